import os
import shutil
import tempfile
from pathlib import Path

import pytest

LEFTOVER_PREFIX = "prism"
"""What PRISM names its temporary folders and files (prism-bundle-, prism-params-, prism-eval-...)."""


def pytest_configure(config):
    """One temporary folder for this session (``TMPDIR`` and ``tempfile.tempdir``), so that what
    this session's tests and the processes they start leave behind can be told apart from other
    sessions' on a shared ``/tmp`` (:func:`pytest_sessionfinish` checks it). pytest's own
    ``tmp_path`` folders stay where they were (``PYTEST_DEBUG_TEMPROOT``)."""
    if hasattr(config, "workerinput"):  # a pytest-xdist worker: the controller's folder is inherited
        return
    root = tempfile.gettempdir()
    os.environ.setdefault("PYTEST_DEBUG_TEMPROOT", root)
    config._prism_tmp = tempfile.mkdtemp(prefix="pytest-prism-tmp-", dir=root)
    os.environ["TMPDIR"] = tempfile.tempdir = config._prism_tmp


def pytest_sessionfinish(session, exitstatus):
    """Fail the session if anything of PRISM's was left in its temporary folder (issue 27: the
    tests leave nothing behind), naming each; then remove the folder."""
    tmp = getattr(session.config, "_prism_tmp", None)
    if tmp is None:
        return
    from prism_challenge.frozen import remove_tree

    left = sorted(p.name for p in Path(tmp).iterdir() if p.name.startswith(LEFTOVER_PREFIX))
    remove_tree(tmp)
    shutil.rmtree(tmp, ignore_errors=True)
    if left:
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        line = f"PRISM left {len(left)} temporary path(s) behind: {', '.join(left[:20])}"
        if reporter is not None:
            reporter.write_sep("=", line, red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.fixture(scope="session", autouse=True)
def _isolated_cache(tmp_path_factory):
    """Keep the embedded corpus and token caches of the test session out of the user's cache."""
    if "PRISM_CACHE_DIR" not in os.environ:
        os.environ["PRISM_CACHE_DIR"] = str(tmp_path_factory.mktemp("prism-cache"))
    yield


@pytest.fixture(scope="session", autouse=True)
def _isolated_config(tmp_path_factory):
    """Keep the user's signing key (``prism_challenge.certificate.user_key``, under
    ``platformdirs.user_config_dir``) and the service's (``user_data_dir``) of the test session
    out of the user's home."""
    os.environ["XDG_CONFIG_HOME"] = str(tmp_path_factory.mktemp("prism-config"))
    os.environ["XDG_DATA_HOME"] = str(tmp_path_factory.mktemp("prism-data"))  # the service's default key
    yield


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request, tmp_path):
    """A database URL for the service's store, once on a SQLite file and once on a fresh
    PostgreSQL database (``tests/databases.py``; skipped without ``PRISM_TEST_POSTGRES_URL``)."""
    from databases import fresh_postgres, postgres_admin_url, sqlite_url

    if request.param == "sqlite":
        yield sqlite_url(tmp_path)
        return
    admin = postgres_admin_url()
    if admin is None:
        pytest.skip("PostgreSQL: PRISM_TEST_POSTGRES_URL is not set (.ci/run starts a server and sets it)")
    with fresh_postgres(admin) as url:
        yield url
