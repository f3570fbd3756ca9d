import os

import pytest


@pytest.fixture(scope="session", autouse=True)
def _isolated_cache(tmp_path_factory):
    """Keep the embedded corpus and token caches of the test session out of the user's cache."""
    if "PRISM_CACHE_DIR" not in os.environ:
        os.environ["PRISM_CACHE_DIR"] = str(tmp_path_factory.mktemp("prism-cache"))
    yield
