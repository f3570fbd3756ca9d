"""The submitter's side of the service (``prism submit``, ``prism status``): zip a bundle, run
the local gates, sign, upload with httpx and follow the submission to its end."""

from __future__ import annotations

import io
import os
import time
import uuid
import zipfile
from collections.abc import Callable
from pathlib import Path

import httpx

from prism_challenge.intake.tree import SKIPPED_DIRS
from prism_challenge.service.signing import sign_request

FINAL = ("completed", "failed", "rejected")
"""The statuses a submission ends in."""


class ClientError(RuntimeError):
    """The service refused a request or could not be reached.

    Attributes:
        status: the HTTP status (0: no answer).
        error: the answer's ``error`` object (``code``, ``message``, ``stage``, ``rule``, ...), or ``{}``.
    """

    def __init__(self, message: str, status: int = 0, error: dict | None = None):
        super().__init__(message)
        self.status, self.error = status, error or {}


def zip_bundle(path: Path) -> bytes:
    """The bundle's bytes as a zip: a ``.zip`` as it is, a directory zipped (sorted members,
    ``__pycache__`` left out, symlinks refused).

    Raises:
        ValueError: not a directory or a ``.zip``, or a symlink inside.
    """
    path = Path(path)
    if path.is_file() and path.suffix == ".zip":
        return path.read_bytes()
    if not path.is_dir():
        raise ValueError(f"{path}: a bundle is a directory or a .zip")
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as zf:
        for dirpath, dirnames, filenames in os.walk(path):
            dirnames[:] = sorted(d for d in dirnames if d not in SKIPPED_DIRS)
            for name in sorted(filenames):
                p = Path(dirpath) / name
                if p.is_symlink():
                    raise ValueError(f"{p}: a symlink; a bundle holds regular files only")
                zf.write(p, p.relative_to(path).as_posix())
    return buf.getvalue()


def _answer(r: httpx.Response) -> dict:
    try:
        body = r.json()
    except ValueError:
        body = {}
    if r.status_code >= 400:
        err = body.get("error") if isinstance(body, dict) else None
        err = err if isinstance(err, dict) else {"code": f"http-{r.status_code}", "message": r.text[:200]}
        raise ClientError(f"{r.status_code} {err.get('code')}: {err.get('message')}", r.status_code, err)
    return body


def _send(method: str, url: str, **kwargs) -> httpx.Response:
    """One request; no answer is a :class:`ClientError` (status 0) that says what to check."""
    try:
        return httpx.request(method, url, **kwargs)
    except httpx.UnsupportedProtocol:
        raise ClientError(f"{url}: not an http:// or https:// URL (the service's address is like "
                          "http://127.0.0.1:8000)") from None
    except httpx.ConnectError as exc:
        raise ClientError(f"cannot connect to {url} ({exc}): is `prism serve` running at that address?") from None
    except httpx.HTTPError as exc:
        raise ClientError(f"{url}: {type(exc).__name__}: {exc}") from None


def health(url: str, *, timeout_s: float = 30.0) -> dict:
    """``GET url/health`` (``status``, ``database``, ``profile``, ``dispatcher``: running or off).

    Raises:
        ClientError: no answer, or an answer without a JSON body.
    """
    r = _send("GET", url.rstrip("/") + "/health", timeout=timeout_s)
    try:
        return r.json()
    except ValueError:
        raise ClientError(f"{url}/health: {r.status_code}, not a PRISM service's answer", r.status_code) from None


def upload(url: str, body: bytes, seed: bytes, *, timeout_s: float = 120.0) -> dict:
    """POST ``body`` to ``url/v1/submissions`` signed by the key of ``seed``; the answer (202).

    Raises:
        ClientError: a refusal (its ``error``) or no answer.
    """
    headers = sign_request(seed, uuid.uuid4().hex, int(time.time()), body)
    r = _send("POST", url.rstrip("/") + "/v1/submissions", content=body, timeout=timeout_s,
              headers={"Content-Type": "application/zip", **headers})
    return _answer(r)


def status(url: str, sid: int, *, timeout_s: float = 30.0) -> dict:
    """``GET url/v1/submissions/{sid}``.

    Raises:
        ClientError: a refusal (404 for an unknown id) or no answer.
    """
    return _answer(_send("GET", f"{url.rstrip('/')}/v1/submissions/{sid}", timeout=timeout_s))



def scored_bpbs(view: dict) -> list[float]:
    """The prequential bpb of each scored run of a submission's view (``GET
    /v1/submissions/{id}``, its ``runs``), first run first; runs failed, rejected or without a
    bpb are left out."""
    return [r["prequential_bpb"] for r in view.get("runs") or []
            if r.get("status") == "scored" and r.get("prequential_bpb") is not None]

FOLLOW_POLL_S = 0.5
"""Seconds between a follower's status reads (``prism submit``, ``follow``): the end of a run is
read on average half of this late; one read is a small indexed query (``bench/service_e2e.py``)."""


def follow(url: str, sid: int, *, poll_s: float = FOLLOW_POLL_S, timeout_s: float | None = None,
           on_change: Callable[[dict], None] = lambda view: None) -> dict:
    """Poll the submission until it is final (:data:`FINAL`); ``on_change`` sees each new status.

    Raises:
        ClientError: a refusal, no answer, or ``timeout_s`` passed first.
    """
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    last = None
    while True:
        view = status(url, sid)
        if (view["status"], view["attempts"]) != last:
            last = (view["status"], view["attempts"])
            on_change(view)
        if view["status"] in FINAL:
            return view
        if deadline is not None and time.monotonic() > deadline:
            raise ClientError(f"stopped following: submission {sid} is still {view['status']} after {timeout_s:g} s "
                              f"(`prism status {sid} --url {url}` reads it later)")
        time.sleep(poll_s)


__all__ = ["ClientError", "FINAL", "FOLLOW_POLL_S", "follow", "health", "scored_bpbs", "status", "upload",
           "zip_bundle"]
