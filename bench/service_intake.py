"""Intake latency of the challenge service: signed ``POST /v1/submissions`` -> 202 on an idle
service (a real uvicorn server on 127.0.0.1, a SQLite file), against ``prism check``'s static
gates (``run_gates(..., check_params=False)``) of the same bundle in-process, the work the
intake cannot avoid. Each repeat submits a new variant of ``examples/tiny-1m`` (its learning
rate changed, so no duplicate), after one warm-up request of each (imports, first gate run).

Prints the medians and the ratio intake / gates.

Usage: ``python bench/service_intake.py [--repeats 10]``
"""

from __future__ import annotations

import argparse
import io
import shutil
import statistics
import tempfile
import threading
import time
import zipfile
from pathlib import Path

import httpx
import uvicorn

from prism_challenge.gates.core import run_gates
from prism_challenge.service.app import create_app
from prism_challenge.service.settings import ServiceSettings
from prism_challenge.service.signing import sign_request

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "tiny-1m"
SEED = bytes(range(32))


def variant(tmp: Path, i: int) -> Path:
    """examples/tiny-1m with ``EFFECTIVE_LEARNING_RATE = 0.005 + i * 1e-6``."""
    root = tmp / f"v{i}"
    shutil.copytree(EXAMPLE, root)
    text = (root / "training.py").read_text()
    (root / "training.py").write_text(text.replace("EFFECTIVE_LEARNING_RATE = 0.005",
                                                   f"EFFECTIVE_LEARNING_RATE = {0.005 + i * 1e-6:.6f}"))
    return root


def zipped(root: Path) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as zf:
        for p in sorted(root.rglob("*.py")):
            zf.write(p, p.relative_to(root).as_posix())
    return buf.getvalue()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="prism-bench-intake-"))
    settings = ServiceSettings(database_url=f"sqlite:///{tmp / 'db.sqlite3'}", blob_root=tmp / "blobs",
                               profile="local", dispatch=False, rate_limit=10_000)
    server = uvicorn.Server(uvicorn.Config(create_app(settings), host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.02)
    url = f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}/v1/submissions"
    intake, gates = [], []
    with httpx.Client(timeout=120) as client:
        for i in range(args.repeats + 1):
            root = variant(tmp, i)
            body = zipped(root)
            headers = sign_request(SEED, f"bench-{i}", int(time.time()), body)
            t0 = time.perf_counter()
            r = client.post(url, content=body, headers=headers)
            t1 = time.perf_counter()
            assert r.status_code == 202, r.text
            report = run_gates(root, check_params=False)
            t2 = time.perf_counter()
            report.cleanup()
            if i:  # the first of each is the warm-up
                intake.append(t1 - t0)
                gates.append(t2 - t1)
    server.should_exit = True
    thread.join()
    shutil.rmtree(tmp, ignore_errors=True)
    mi, mg = statistics.median(intake), statistics.median(gates)
    print(f"intake (POST -> 202), median of {args.repeats}: {mi * 1000:.1f} ms")
    print(f"static gates alone (run_gates), median:      {mg * 1000:.1f} ms")
    print(f"ratio intake / gates: {mi / mg:.2f}")


if __name__ == "__main__":
    main()
