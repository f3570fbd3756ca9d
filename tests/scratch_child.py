"""A process for tests/test_scratch.py that holds PRISM temporary folders until it is killed.

Usage:
    python scratch_child.py own                       # a folder in this process's own owner folder
    python scratch_child.py attempt BASE NAME         # the owner folder of an attempt
    python scratch_child.py stage PARENT NAME         # a folder building PARENT/NAME (a data cache)
    python scratch_child.py attempt-own BASE NAME     # an attempt that makes the process's own folder
    python scratch_child.py job WORK_DIR PROFILE DATA ZIP TOKEN   # a service attempt's run (run_job)

``own``, ``attempt`` and ``stage`` print the folder made, one line, then sleep until killed; ``job`` runs
:func:`prism_challenge.service.worker.run_job` (a real evaluation) and prints its status.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path


def main(argv: list[str]) -> int:
    from prism_challenge import scratch

    if argv[0] == "own":
        print(scratch.mkdtemp("prism-held-"), flush=True)
    elif argv[0] == "attempt":
        with scratch.attempt(argv[1], argv[2]) as owned:
            print(owned.mkdtemp("prism-eval-"), flush=True)
            time.sleep(3600)
    elif argv[0] == "attempt-own":  # prints the own folder made during the attempt, then whether it is gone
        with scratch.attempt(argv[1], argv[2]):
            held = scratch.own().mkdtemp("prism-")
        print(held, "gone" if not held.parent.exists() else "kept", flush=True)
        return 0
    elif argv[0] == "stage":
        with scratch.staging(argv[1], argv[2]) as build:
            (build / "ids.npy").write_bytes(b"half a cache")
            print(build, flush=True)
            time.sleep(3600)
    else:
        from prism_challenge.profiles import load_profile
        from prism_challenge.service.worker import Job, run_job

        work_dir, profile, data, zipped, token = argv[1:]
        job = Job(token=token, submission_id=1, bundle=Path(zipped).read_bytes(), profile=load_profile(profile),
                  data_dir=data, work_dir=work_dir)
        print(run_job(job)["status"], flush=True)
        return 0
    time.sleep(3600)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
