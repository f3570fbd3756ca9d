"""The challenge service's intake: latency on an idle service and throughput under concurrent
clients (issue 17's intake, issue 18's benchmark), on SQLite and on PostgreSQL.

A real uvicorn server on 127.0.0.1 (``prism serve``'s app, the dispatcher off), for each backend:
a SQLite file, and a fresh PostgreSQL database when ``--postgres URL`` (or
``PRISM_TEST_POSTGRES_URL``) names a server whose role may create databases (else a printed
note). Every submission is a new variant of ``examples/tiny-1m`` (its learning rate changed, so
no duplicate, the same gate work), signed with sr25519, through every check of the route
(signature, nonce, rate limit, unpack, static gates, normalized-source duplicate check, family,
the bytes and the row stored).

* **latency**: ``--repeats`` submissions one after another, POST -> 202, against ``prism
  check``'s static gates (``run_gates(..., check_params=False)``) of the same bundle in-process,
  the work the intake cannot avoid; medians and the ratio intake / gates.
* **throughput**: ``--submissions`` signed submissions from ``--clients`` concurrent clients
  (threads, one hotkey each): accepted per second, first POST -> last 202.
* **where the time goes** (once, in-process, per submission, medians): the signature
  verification, the intake (unpack, gates, hashes: :func:`run_intake`), the nonce and the
  row's writes; the intake's share of the serial work is the bottleneck figure.

One warm-up request first (imports, first gate run). Usage: ``python bench/service_intake.py
[--repeats 10] [--clients 4] [--submissions 40] [--postgres URL]``
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import hashlib
import io
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
import zipfile
from pathlib import Path

import httpx
import uvicorn

from prism_challenge.gates.core import run_gates
from prism_challenge.service.app import create_app
from prism_challenge.service.intake import run_intake
from prism_challenge.service.routes.submit import _register, _use_nonce
from prism_challenge.service.settings import ServiceSettings
from prism_challenge.service.signing import message, sign_request, verify

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "tiny-1m"
SEED = bytes(range(32))
sys.path.insert(0, str(ROOT / "tests"))
from databases import POSTGRES_ENV, fresh_postgres  # noqa: E402 - the tests' fresh-database helper


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


@contextlib.contextmanager
def serving(tmp: Path, url: str):
    """A uvicorn server of the service (dispatcher off) on ``url``; yields ``(base, app)``."""
    settings = ServiceSettings(database_url=url, blob_root=tmp / "blobs", profile="local", dispatch=False,
                               rate_limit=100_000)
    app = create_app(settings)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}", app
    finally:
        server.should_exit = True
        thread.join()


def _post(client: httpx.Client, base: str, seed: bytes, nonce: str, body: bytes) -> None:
    r = client.post(f"{base}/v1/submissions", content=body, headers=sign_request(seed, nonce, int(time.time()), body))
    if r.status_code != 202:
        raise SystemExit(f"refused: {r.status_code} {r.text}")


def latency(base: str, bodies: list[tuple[Path, bytes]]) -> tuple[float, float]:
    """Medians (s) of POST -> 202 and of the static gates alone, one submission at a time."""
    intake, gates = [], []
    with httpx.Client(timeout=120) as client:
        for i, (root, body) in enumerate(bodies):
            t0 = time.perf_counter()
            _post(client, base, SEED, f"lat-{i}", body)
            t1 = time.perf_counter()
            run_gates(root, check_params=False).cleanup()
            intake.append(t1 - t0)
            gates.append(time.perf_counter() - t1)
    return statistics.median(intake[1:]), statistics.median(gates[1:])


def throughput(base: str, bodies: list[bytes], clients: int) -> float:
    """Signed submissions accepted per second, ``clients`` threads posting ``bodies`` at once."""
    def client_run(c: int) -> None:
        seed = bytes([c + 1]) * 32
        with httpx.Client(timeout=600) as client:
            for j in range(c, len(bodies), clients):
                _post(client, base, seed, f"tp-{j}", bodies[j])

    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(clients) as pool:
        list(pool.map(client_run, range(clients)))
    return len(bodies) / (time.perf_counter() - t0)


def breakdown(app, bodies: list[bytes]) -> dict[str, float]:
    """Per submission, in-process, the route's own steps, medians in ms: the signature, the intake
    (unpack, gates, hashes), the nonce's write, the registration (duplicate and family queries,
    the bytes, the row)."""
    state = app.state
    got: dict[str, list[float]] = {"signature (sr25519)": [], "intake (unpack, gates, hashes)": [],
                                   "nonce (a row)": [], "register (queries, bytes, row)": []}
    for i, body in enumerate(bodies):
        headers = sign_request(SEED, f"bd-{i}", int(time.time()), body)
        signed = message(headers["X-Hotkey"], headers["X-Nonce"], headers["X-Timestamp"],
                         hashlib.sha256(body).hexdigest())
        t0 = time.perf_counter()
        verify(headers["X-Hotkey"], headers["X-Signature"], signed)
        t1 = time.perf_counter()
        intake = run_intake(body, state.settings, state.profile)
        t2 = time.perf_counter()
        _use_nonce(state.store, headers["X-Hotkey"], headers["X-Nonce"], int(headers["X-Timestamp"]),
                   state.settings.signature_window_s)
        t3 = time.perf_counter()
        _register(state, headers["X-Hotkey"], body, intake)
        t4 = time.perf_counter()
        for key, value in zip(got, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
            got[key].append(value)
    return {k: 1e3 * statistics.median(v) for k, v in got.items()}


def bench_backend(name: str, url: str, tmp: Path, args) -> None:
    n = args.repeats + 1 + args.submissions + args.breakdown
    roots = [variant(tmp / name, i) for i in range(n)]
    bodies = [zipped(r) for r in roots]
    lat_n = args.repeats + 1
    with serving(tmp / name, url) as (base, app):
        mi, mg = latency(base, list(zip(roots[:lat_n], bodies[:lat_n])))
        rate = throughput(base, bodies[lat_n:lat_n + args.submissions], args.clients)
        parts = breakdown(app, bodies[lat_n + args.submissions:])
    serial = sum(parts.values())
    print(f"-- {name}")
    print(f"   intake (POST -> 202), median of {args.repeats}: {mi * 1000:7.1f} ms")
    print(f"   static gates alone (run_gates), median:  {mg * 1000:7.1f} ms   ratio intake / gates {mi / mg:.2f}")
    print(f"   throughput, {args.clients} clients x {args.submissions} submissions: {rate:6.2f} accepted/s"
          f"   ({1 / rate * 1000:.0f} ms each; 1 / latency = {1 / mi:.2f}/s)")
    print("   one submission's serial work, in-process, medians:")
    for key, value in parts.items():
        print(f"     {key:<34} {value:8.2f} ms  {value / serial:6.1%}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--submissions", type=int, default=40)
    parser.add_argument("--breakdown", type=int, default=10, help="submissions timed in-process, part by part")
    parser.add_argument("--postgres", default=os.environ.get(POSTGRES_ENV),
                        help=f"a PostgreSQL admin URL (default ${POSTGRES_ENV})")
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="prism-bench-intake-"))
    try:
        bench_backend("sqlite", f"sqlite:///{tmp / 'db.sqlite3'}", tmp, args)
        if args.postgres:
            with fresh_postgres(args.postgres) as url:
                bench_backend("postgresql", url, tmp, args)
        else:
            print(f"-- postgresql: skipped (no --postgres URL, no ${POSTGRES_ENV})")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
