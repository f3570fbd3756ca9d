import os
import tempfile

import pytest

LEFTOVER_PREFIX = "prism"
"""What PRISM names its temporary folders (prism-bundle-, prism-params-, prism-eval-...)."""
_made: list[str] = []  # every prism-* folder made by tempfile.mkdtemp in this test process


def pytest_configure(config):
    """Record every temporary folder this session's process makes under a PRISM name
    (``tempfile.mkdtemp``, which ``TemporaryDirectory`` uses too), for :func:`pytest_sessionfinish`:
    exact paths, so that other sessions sharing ``/tmp`` are never blamed. ``TMPDIR`` is left
    alone: the audit hook's policy reads ``tempfile.gettempdir()``."""
    real = tempfile.mkdtemp

    def recording(suffix=None, prefix=None, dir=None):
        path = real(suffix, prefix, dir)
        if os.path.basename(os.fsdecode(path)).startswith(LEFTOVER_PREFIX):
            _made.append(os.fsdecode(path))
        return path

    tempfile.mkdtemp = recording


def pytest_sessionfinish(session, exitstatus):
    """Fail the session if a PRISM temporary folder this process made is still there (issue 27:
    the tests leave nothing behind), naming each; then remove them."""
    import gc

    from prism_challenge.frozen import remove_tree

    gc.collect()  # a gate report no test holds any more takes its frozen copy with it (GateReport.own)
    left = [p for p in _made if os.path.lexists(p)]
    for path in left:
        remove_tree(path)
    if left:
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        line = f"PRISM left {len(left)} temporary folder(s) behind: {', '.join(left[:10])}"
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
