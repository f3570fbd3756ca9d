import os

import pytest


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
