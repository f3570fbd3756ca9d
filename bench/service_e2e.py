"""The service's evaluation time against ``prism eval`` (issue 17, Speed): what a submitter waits
for on an idle service, submit -> completed, against the whole ``prism eval`` command of the same
bundle under the same profile.

The service is ``prism serve``'s app (:func:`create_app`) in a real uvicorn server on 127.0.0.1,
a SQLite file, the dispatcher on an embedded local Ray of ``--slots`` CPUs. ``prism eval BUNDLE
--profile P`` runs first, as a separate process (interpreter start, imports, gates, run, held-out
children, manifest). Then the service evaluates a first submission (``cold``: Ray just started)
and a second one (``warm``: the headline, the service has been up), each a new variant of the
bundle (its learning rate changed by 1e-6, so not a duplicate; the same work).

Printed for each service run, from the submitter's clock (status read every ``--poll`` s, 0.05
by default, so the service's own latency shows, not a client's poll) and the database's and the
manifest's timestamps:

* **headline** ``ratio``: submit -> completed (the POST sent -> the status read as final)
  over the ``prism eval`` command's wall time; goal at most 1.05;
* submit -> ``running`` (the attempt claimed: the dispatcher's wake-up or poll; 202 -> running can
  read a few ms below zero: the intake wakes the dispatcher before its 202 reaches the client);
* the partial figures: POST -> 202 (the intake's gates), 202 -> running (the dispatcher),
  running -> ``evaluate()`` started on the Ray worker (the actor's process, its imports, the
  zip extracted), ``evaluate()``'s own wall time (``timing.wall_s``), its end -> the result
  in the database (the way back through Ray and the fenced write), the database -> the
  submitter reading it;
* running -> completed against ``prism eval``'s own ``evaluate()`` wall time.

``prism submit`` follows a submission every ``--poll`` seconds (default 2 s in the client): a
submitter reads the end on average half of that later than printed here.

Usage: ``python bench/service_e2e.py [--profile local] [--slots 1]
[--poll 0.05]`` (the example at the local profile's 20 000 tokens: about a minute a run on 2 cores).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from datetime import datetime
from pathlib import Path

import httpx
import uvicorn
from service_intake import EXAMPLE, SEED, variant, zipped

from prism_challenge.manifest.run_manifest import MANIFEST_NAME
from prism_challenge.service.app import create_app
from prism_challenge.service.settings import ServiceSettings
from prism_challenge.service.signing import sign_request

def prism_eval(bundle: Path, profile: str, out: Path) -> tuple[float, dict]:
    """The whole ``prism eval BUNDLE --profile PROFILE`` command: (wall s, its manifest)."""
    prism = Path(sys.executable).with_name("prism")
    t0 = time.perf_counter()
    proc = subprocess.run([str(prism), "eval", str(bundle), "--profile", profile, "--out", str(out), "--quiet"],
                          capture_output=True, text=True)
    wall = time.perf_counter() - t0
    manifests = sorted(out.rglob(MANIFEST_NAME))
    if not manifests:
        raise SystemExit(f"prism eval wrote no manifest (rc {proc.returncode}):\n{proc.stderr[-2000:]}")
    return wall, json.loads(manifests[-1].read_text())


def _unix(value: datetime | None) -> float | None:
    return None if value is None else value.timestamp()


def service_run(client: httpx.Client, base: str, store, body: bytes, nonce: str, poll_s: float) -> dict:
    """Submit ``body`` signed, follow it to the end; the timestamps of its way (Unix s)."""
    t_submit = time.time()
    r = client.post(f"{base}/v1/submissions", content=body, headers=sign_request(SEED, nonce, int(t_submit), body))
    t_202 = time.time()
    if r.status_code != 202:
        raise SystemExit(f"the service refused the bundle: {r.status_code} {r.text}")
    sid = r.json()["id"]
    t_running = None
    while True:
        view = client.get(f"{base}/v1/submissions/{sid}").json()
        now = time.time()
        if view["status"] != "pending" and t_running is None:
            t_running = now
        if view["status"] in ("completed", "failed", "rejected"):
            t_seen = now
            break
        time.sleep(poll_s)
    manifest = client.get(f"{base}/v1/submissions/{sid}/manifest").json()
    sub, attempt = store.submission(sid), store.attempts(sid)[-1]
    timing = manifest["timing"]
    eval_start = timing["last_record_unix"] - timing["start_to_last_record_s"]
    return {"status": view["status"], "submit": t_submit, "accepted": t_202, "running_seen": t_running,
            "claimed": _unix(attempt.started_at), "eval_start": eval_start, "eval_wall": timing["wall_s"],
            "eval_end": eval_start + timing["wall_s"], "written": _unix(sub.finished_at), "seen": t_seen,
            "attempts": len(store.attempts(sid))}


def report(name: str, s: dict, eval_cmd_s: float, eval_wall_s: float) -> None:
    total = s["seen"] - s["submit"]
    running_to_done = s["written"] - s["claimed"]
    print(f"-- service, {name} ({s['status']}, {s['attempts']} attempt)")
    print(f"   submit -> completed (seen):     {total:7.2f} s   ratio to prism eval {total / eval_cmd_s:.3f}"
          "   (goal <= 1.05)")
    print(f"   submit -> running (claimed):    {s['claimed'] - s['submit']:7.2f} s   (seen by the client "
          f"{s['running_seen'] - s['submit']:.2f} s)")
    parts = [("POST -> 202 (intake, gates)", s["accepted"] - s["submit"]),
             ("202 -> running (dispatcher)", s["claimed"] - s["accepted"]),
             ("running -> evaluate() start (actor)", s["eval_start"] - s["claimed"]),
             ("evaluate() wall", s["eval_wall"]),
             ("evaluate() end -> result stored", s["written"] - s["eval_end"]),
             ("stored -> seen by the client", s["seen"] - s["written"])]
    for label, value in parts:
        print(f"     {label:<38} {value:7.2f} s")
    print(f"   running -> completed:           {running_to_done:7.2f} s   ratio to prism eval's evaluate() "
          f"{running_to_done / eval_wall_s:.3f}; its evaluate() alone {s['eval_wall'] / eval_wall_s:.3f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--profile", default="local")
    p.add_argument("--slots", type=int, default=1)
    p.add_argument("--poll", type=float, default=0.05, help="the bench's status poll, seconds")
    args = p.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="prism-bench-e2e-"))
    try:
        eval_cmd_s, m = prism_eval(EXAMPLE, args.profile, tmp / "eval")
        eval_wall_s = m["timing"]["wall_s"]
        print(f"prism eval {EXAMPLE.name} --profile {args.profile}: whole command {eval_cmd_s:.2f} s, "
              f"its evaluate() {eval_wall_s:.2f} s ({m['status']}, prequential bpb {(m.get('score') or {}).get('prequential_bpb')})")
        settings = ServiceSettings(database_url=f"sqlite:///{tmp / 'db.sqlite3'}", blob_root=tmp / "blobs",
                                   profile=args.profile, dispatch=True, slots=args.slots, rate_limit=10_000)
        app = create_app(settings)
        server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        while not server.started:
            time.sleep(0.02)
        base = f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
        try:
            with httpx.Client(timeout=120) as client:
                for i, name in enumerate(("cold (first after start)", "warm (headline)")):
                    body = zipped(variant(tmp, i + 1))
                    s = service_run(client, base, app.state.store, body, f"e2e-{i}", args.poll)
                    report(name, s, eval_cmd_s, eval_wall_s)
        finally:
            server.should_exit = True
            thread.join()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
