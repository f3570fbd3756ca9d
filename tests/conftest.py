import os
import tempfile

import pytest

LEFTOVER_PREFIX = "prism"
"""What PRISM names its temporary folders (prism-bundle-, prism-params-, prism-eval-...)."""
_made: list[str] = []  # every prism-* folder made by tempfile.mkdtemp in this test process
_session_tmp: list[str] = []  # the session's private temp directory (TMPDIR of every child)
CACHES = ("torchinductor_",)
"""Not leftovers: torch's per-user compile cache under the temp directory, which ``import
torch._dynamo`` makes in every process that imports it and every run on the host shares by design."""


def pytest_configure(config):
    """Give the session a private temp directory, ``/tmp/prism-tests-*``, as ``$TMPDIR`` (and
    ``tempfile.tempdir``): every child a test starts inherits it, so what a child leaves there is
    seen at the end (:func:`pytest_sessionfinish`), and other sessions sharing ``/tmp`` are never
    blamed. pytest's own ``tmp_path`` folders and Ray's session folders stay in the host's temp
    directory (``PYTEST_DEBUG_TEMPROOT``, ``RAY_TMPDIR``); a sandboxed child gets its own private
    ``/tmp`` and ``TMPDIR=/tmp`` from the sandbox, whatever this says.

    Also record every temporary folder this process makes under a PRISM name
    (``tempfile.mkdtemp``, which ``TemporaryDirectory`` uses too): exact paths."""
    host_tmp = tempfile.gettempdir()
    os.environ.setdefault("PYTEST_DEBUG_TEMPROOT", host_tmp)
    os.environ.setdefault("RAY_TMPDIR", host_tmp)
    real = tempfile.mkdtemp
    _session_tmp.append(real(prefix="prism-tests-", dir=host_tmp))
    os.environ["TMPDIR"] = _session_tmp[0]
    tempfile.tempdir = None  # gettempdir() reads $TMPDIR again

    def recording(suffix=None, prefix=None, dir=None):
        path = real(suffix, prefix, dir)
        if os.path.basename(os.fsdecode(path)).startswith(LEFTOVER_PREFIX):
            _made.append(os.fsdecode(path))
        return path

    tempfile.mkdtemp = recording


def _leftovers() -> list[str]:
    """What the session left: the PRISM folders this process made that are still there, what is
    in this process's own owner folder but its lock and blank file (:mod:`prism_challenge.scratch`,
    then removed), and anything else in the session's temp directory (a child's) but :data:`CACHES`."""
    import gc

    from prism_challenge import scratch

    gc.collect()  # a gate report no test holds any more takes its frozen copy with it (GateReport.own)
    left = [p for p in _made if os.path.lexists(p)]
    own = scratch.made()
    if own is not None:
        left += [str(own.path / n) for n in sorted(os.listdir(own.path)) if not n.startswith(".")
                 and str(own.path / n) not in left]
        own.close()
    if _session_tmp:
        left += [os.path.join(_session_tmp[0], n) for n in sorted(os.listdir(_session_tmp[0]))
                 if not n.startswith(CACHES)]
    return left


def pytest_sessionfinish(session, exitstatus):
    """Fail the session if PRISM left a temporary folder behind (issue 27: the tests leave
    nothing behind), naming each (:func:`_leftovers`); then remove them and the session's temp
    directory."""
    from prism_challenge.scratch import remove_tree

    left = _leftovers()
    for path in left:
        if os.path.isdir(path) and not os.path.islink(path):
            remove_tree(path)
        elif os.path.lexists(path):
            os.unlink(path)
    if _session_tmp:
        remove_tree(_session_tmp.pop())
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
    """Keep the user's signing key (``prism_challenge.manifest.certificate.user_key``, under
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
