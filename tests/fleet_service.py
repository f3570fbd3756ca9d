"""A service process for tests/test_service_dispatch.py: a Dispatcher that joins a running Ray
cluster and dispatches until it is killed (the test SIGKILLs it mid-run).

Usage: python fleet_service.py DB_URL BLOB_ROOT RAY_ADDRESS PROFILE_NAME PROFILE_FILE DATA_DIR
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from prism_challenge.profiles import load_profile
from prism_challenge.service.blobs import BlobStore
from prism_challenge.service.dispatch import Dispatcher
from prism_challenge.service.store import Store


def main(argv: list[str]) -> int:
    url, blobs, address, name, profile_file, data_dir = argv
    dispatcher = Dispatcher(Store(url), BlobStore(Path(blobs)), ray_address=address, slots=2, backoff_base_s=0.5,
                            data_dir=data_dir, profiles={name: load_profile(profile_file)})
    dispatcher.start()
    print("dispatching", flush=True)
    while True:
        time.sleep(1)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
