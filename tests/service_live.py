"""A real uvicorn server on 127.0.0.1 (a free port, in a thread) for the service's tests, and
helpers to zip bundles and sign submissions with real sr25519 keys."""

from __future__ import annotations

import io
import threading
import time
import zipfile
from contextlib import contextmanager
from pathlib import Path

import httpx
import uvicorn

from prism_challenge.service.app import create_app, server_config
from prism_challenge.service.settings import ServiceSettings
from prism_challenge.service.signing import sign_request

ALICE_SEED = bytes.fromhex("e5be9a5092b81bca64be81d212e7f2f9eba183bb7a90954f7b76361f6edb5c0a")  # `subkey inspect //Alice`
ALICE = "5GrwvaEF5zXb26Fz9rcQpDWS57CtERHpNehXCPcNoHGKutQY"
BOB_SEED = bytes(range(32))
TOKEN = "gateway-secret-token"


@contextmanager
def live_server(tmp_path: Path, start_timeout_s: float = 30.0, **overrides):
    """Yield ``(base_url, app)`` of a real server over a SQLite file (or ``database_url``) and
    blobs under ``tmp_path``; ``overrides`` are more settings. ``start_timeout_s``: how long its
    start (the lifespan: the dispatcher's Ray too, with ``dispatch=True``) may take."""
    given = {"database_url": f"sqlite:///{tmp_path / 'db' / 'prism.sqlite3'}", "blob_root": tmp_path / "blobs",
             "dispatch": False, "internal_token": TOKEN, "profile": "local", **overrides}
    settings = ServiceSettings(**given)
    app = create_app(settings)
    config = server_config(app, settings, host="127.0.0.1", port=0, log_level="warning", lifespan="on")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + start_timeout_s
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the test server did not start")
        time.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}", app
    finally:
        server.should_exit = True
        thread.join(timeout=max(30.0, start_timeout_s))


def zip_dir(root: Path, folder: str | None = None) -> bytes:
    """The files under ``root`` as a zip (inside ``folder/`` when given)."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as zf:
        for p in sorted(root.rglob("*")):
            if p.is_file() and "__pycache__" not in p.parts:
                rel = p.relative_to(root).as_posix()
                zf.write(p, f"{folder}/{rel}" if folder else rel)
    return buf.getvalue()


def zip_files(files: dict[str, str]) -> bytes:
    """A zip of ``{name: text}``."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as zf:
        for name, text in files.items():
            zf.writestr(name, text)
    return buf.getvalue()


_counter = iter(range(1, 1 << 30))


def signed(body: bytes, seed: bytes = ALICE_SEED, *, nonce: str | None = None, timestamp: int | None = None) -> dict:
    """Headers of a signed submission of ``body`` (a fresh nonce, the current time by default)."""
    return sign_request(seed, nonce or f"n-{time.time_ns()}-{next(_counter)}",
                        int(time.time()) if timestamp is None else timestamp, body)


def post(base: str, body: bytes, headers: dict, path: str = "/v1/submissions") -> httpx.Response:
    """POST ``body`` as a zip."""
    return httpx.post(base + path, content=body, headers={"Content-Type": "application/zip", **headers}, timeout=120)
