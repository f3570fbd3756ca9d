"""``prism serve``, ``prism submit``, ``prism status`` and ``prism keygen`` (issue 17, items 2 and 7).

Exit status: 0 done (a submission completed, a status read, a key written); 1 refused or not
scored (local gates, the service's refusal, a failed or rejected submission); 2 a bad command
line, settings or key file.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


def add_service_parsers(sub: Any) -> None:
    """Register ``serve``, ``submit``, ``status`` and ``keygen`` on argparse ``subparsers``."""
    p = sub.add_parser("serve", help="run the challenge service (FastAPI + uvicorn)",
                       description="Settings: these options, then PRISM_* variables, then --config FILE (TOML).")
    p.add_argument("--config", type=Path, help="a TOML settings file (keys named like the PRISM_* settings)")
    p.add_argument("--host", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="port to listen on (default 8000)")
    p.add_argument("--profile", help="the challenge profile evaluated under (default prism-v2)")
    p.add_argument("--data", dest="data_dir", type=Path, help="the profile's locked data directory")
    p.add_argument("--database-url", help="SQLAlchemy URL (default: SQLite under the user data directory)")
    p.add_argument("--blob-root", type=Path, help="where bundle bytes are kept")
    p.add_argument("--slots", type=int, help="evaluations at once on the embedded Ray instance")
    p.add_argument("--ray-address", help="join this Ray cluster instead of starting one")
    p.add_argument("--no-dispatch", dest="dispatch", action="store_const", const=False,
                   help="intake and reading only: evaluate nothing")
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("submit", help="gate locally, sign and upload a bundle, then follow it to its end")
    p.add_argument("bundle", type=Path, help="bundle directory or .zip")
    p.add_argument("--url", required=True, help="the service, e.g. http://127.0.0.1:8000")
    p.add_argument("--keyfile", required=True, type=Path, help="sr25519 key file (prism keygen, or a hotkey file)")
    p.add_argument("--no-wait", action="store_true", help="print the id and return once accepted")
    p.add_argument("--poll", type=float, default=None,
                   help="seconds between status reads (default: service.client.FOLLOW_POLL_S, 0.5)")
    p.add_argument("--timeout", type=float, default=None, help="stop following after this many seconds")
    p.add_argument("--json", action="store_true", help="print the final view as JSON")
    p.set_defaults(func=cmd_submit)

    p = sub.add_parser("status", help="a submission's status, failure and scores")
    p.add_argument("id", type=int, help="the submission's id")
    p.add_argument("--url", required=True, help="the service, e.g. http://127.0.0.1:8000")
    p.add_argument("--json", action="store_true", help="print the submission's view as JSON")
    p.set_defaults(func=cmd_status)

    p = sub.add_parser("keygen", help="write a development sr25519 key (mode 0600)")
    p.add_argument("--out", required=True, type=Path, help="the key file to write (must not exist)")
    p.set_defaults(func=cmd_keygen)


def cmd_serve(args: argparse.Namespace) -> int:
    """Apply the migrations, name the profile and serve until interrupted."""
    import pydantic

    from prism_challenge.service.app import check_dispatcher, create_app
    from prism_challenge.service.settings import ServiceSettings

    given = {k: getattr(args, k) for k in ("host", "port", "profile", "data_dir", "database_url", "blob_root",
                                           "slots", "ray_address", "dispatch")}
    try:
        settings = ServiceSettings.load(args.config, **given)
    except (pydantic.ValidationError, FileNotFoundError) as exc:
        print(f"prism serve: bad settings: {exc}", file=sys.stderr)
        return EXIT_USAGE
    try:
        check_dispatcher(settings)
    except RuntimeError as exc:
        print(f"prism serve: {exc}", file=sys.stderr)
        return EXIT_USAGE
    from prism_challenge.manifest.certificate import CertificateError
    from prism_challenge.service.settings import default_signing_key_file

    from prism_challenge.service.registry import RegistryError

    try:
        app = create_app(settings)
    except RegistryError as exc:
        print(f"prism serve: the hotkey registry (hotkey_registry): {exc}", file=sys.stderr)
        return EXIT_USAGE
    except CertificateError as exc:
        named = settings.signing_key_file
        hint = ("; make one with: openssl genpkey -algorithm ed25519 -out FILE && chmod 600 FILE"
                if named is not None and not Path(named).exists() else "")
        source = "PRISM_SIGNING_KEY_FILE (setting signing_key_file)" if named is not None else "the default key file"
        print(f"prism serve: the signing key, {source}: {exc}{hint}", file=sys.stderr)
        return EXIT_USAGE
    p = app.state.profile
    key_file = settings.signing_key_file or default_signing_key_file()
    print(f"prism serve: profile {p.name} (sha256 {p.sha256[:12]}), database {app.state.store.url}, "
          f"signing key {app.state.signing['signing_key_id']} ({key_file}), "
          f"http://{settings.host}:{settings.port}", file=sys.stderr, flush=True)
    return _serve(app, settings)


def _serve(app: Any, settings: Any) -> int:
    """Start the dispatcher (before the server: what it cannot run refuses the start in one
    line, and Ray's signal handlers are in place before uvicorn's take over), then serve until
    SIGTERM or SIGINT, a clean stop (exit 0)."""
    import signal

    from prism_challenge.service.app import Server, server_config, start_dispatcher, stop_dispatcher
    from prism_challenge.service.capacity import CannotEvaluate

    if settings.dispatch:
        from prism_challenge.evaluator import selftest

        if refused := selftest.refusal("prism serve", cached=False):  # before any work is taken
            print(refused, file=sys.stderr)
            return EXIT_USAGE
        try:
            start_dispatcher(app)
        except CannotEvaluate as exc:
            print(f"prism serve: {exc}", file=sys.stderr)
            return EXIT_USAGE
    server = Server(server_config(app, settings))
    try:
        server.run()
    finally:
        stop_dispatcher(app)  # the lifespan stopped it already, unless the server never started
    for sig in getattr(server, "stopped_by", [])[:1]:
        print(f"prism serve: stopped ({signal.Signals(sig).name})", file=sys.stderr, flush=True)
    return EXIT_OK


def _show(view: dict) -> str:
    """One line for a submission's view: its status and attempt, and once scored its bpb. A
    submission confirmed by several runs (``runs_wanted`` > 1) names the run under way and the
    bpb of each run scored so far; once completed, their mean with the sample standard deviation
    (the leaderboard's ``prequential_bpb`` and ``bpb_std``). A submission rejected or failed in a
    later run shows its scored runs' bpb, never a mean: it is on no leaderboard."""
    import statistics

    from prism_challenge.service.client import FINAL, scored_bpbs

    wanted, runs, final = int(view.get("runs_wanted") or 1), view.get("runs") or [], view["status"] in FINAL
    if wanted == 1:
        line = f"submission {view['id']}: {view['status']} (attempt {view['attempts']}/{view['max_attempts']})"
        if view.get("scores"):
            s = view["scores"]
            line += f"  prequential_bpb {s['prequential_bpb']:.4f}  final_score {s['final_score']:.6f}"
    else:
        where = f"{len(runs)} of {wanted} runs" if final else f"run {min(len(runs) + 1, wanted)} of {wanted}"
        line = f"submission {view['id']}: {view['status']} ({where}, {view['attempts']} attempt(s) in all)"
        bpbs = scored_bpbs(view)
        each = ", ".join(f"{b:.4f}" for b in bpbs)
        if view["status"] == "completed" and len(bpbs) > 1:
            line += (f"  prequential_bpb {statistics.fmean(bpbs):.4f} ± {statistics.stdev(bpbs):.4f} "
                     f"(mean ± std of the runs: {each})")
        elif bpbs:  # a rejected or failed submission has no mean: it is on no leaderboard
            line += f"  prequential_bpb of the runs {'scored (on no leaderboard)' if final else 'so far'}: {each}"
    if view.get("failure"):
        f = view["failure"]
        rule = f" {f['rule']}" if f.get("rule") else ""
        line += f"  [{f['stage']}, {f['kind']}{rule}] {f['message']}"
    return line


def _refused(exc, command: str) -> int:
    """Print a :class:`~prism_challenge.service.client.ClientError`: ``refused:`` for the
    service's answer, ``prism COMMAND:`` when there was none (or the wait ended)."""
    print(f"refused: {exc}" if exc.status else f"prism {command}: {exc}", file=sys.stderr)
    for f in exc.error.get("findings") or []:
        if f.get("blocking"):
            print(f"  {f['file']}:{f['line']}: {f['rule']}: {f['message']}", file=sys.stderr)
    if exc.error.get("duplicate_of") is not None:
        print(f"  the earlier submission: {exc.error['duplicate_of']}", file=sys.stderr)
    return EXIT_FAILED


def cmd_submit(args: argparse.Namespace) -> int:
    """``prism submit``: local gates, zip, sign, upload, follow."""
    from prism_challenge.intake.bundle import BundleError
    from prism_challenge.gates.core import run_gates
    from prism_challenge.service.client import FOLLOW_POLL_S, ClientError, follow, health, upload, zip_bundle
    from prism_challenge.service.keys import KeyfileError, read_keyfile

    try:
        seed, hotkey = read_keyfile(args.keyfile)
        body = zip_bundle(args.bundle)
        report = run_gates(args.bundle, check_params=False)
    except (KeyfileError, ValueError) as exc:
        print(f"prism submit: {exc}", file=sys.stderr)
        return EXIT_USAGE if not isinstance(exc, BundleError) else EXIT_FAILED
    try:
        blocking = [f for f in report.findings if f.blocking]
    finally:
        report.cleanup()
    if blocking:
        print(f"prism submit: the local gates refuse {args.bundle} (nothing was sent):", file=sys.stderr)
        for f in blocking:
            print(f"  {f.location}: {f.rule}: {f.message}", file=sys.stderr)
        return EXIT_FAILED
    human = sys.stderr if args.json else sys.stdout  # with --json, stdout holds the one JSON object alone
    try:
        got = upload(args.url, body, seed)
        print(f"accepted: submission {got['id']} by {hotkey} under profile {got['profile']}"
              + (f", a training variant of {got['variant_of']}" if got.get("variant_of") else ""), file=human,
              flush=True)
        if args.no_wait:
            if args.json:
                print(json.dumps(got, indent=2))
            return EXIT_OK
        if health(args.url).get("dispatcher") == "off":
            print(f"note: this service's dispatcher is off (prism serve --no-dispatch): submission {got['id']} "
                  "stays pending until one evaluates it; following anyway (Ctrl-C, or --timeout, stops; "
                  f"`prism status {got['id']} --url {args.url}` reads it later)", file=sys.stderr, flush=True)
        poll_s = FOLLOW_POLL_S if args.poll is None else args.poll
        view = follow(args.url, got["id"], poll_s=poll_s, timeout_s=args.timeout,
                      on_change=lambda v: print(_show(v), file=human, flush=True))
    except ClientError as exc:
        return _refused(exc, "submit")
    if args.json:
        print(json.dumps(view, indent=2))
    return EXIT_OK if view["status"] == "completed" else EXIT_FAILED


def cmd_status(args: argparse.Namespace) -> int:
    """``prism status ID``."""
    from prism_challenge.service.client import ClientError, status

    try:
        view = status(args.url, args.id)
    except ClientError as exc:
        return _refused(exc, "status")
    print(json.dumps(view, indent=2) if args.json else _show(view))
    return EXIT_OK


def cmd_keygen(args: argparse.Namespace) -> int:
    """``prism keygen --out FILE``: a new key, never over an existing file."""
    from prism_challenge.service.keys import write_keyfile

    try:
        address = write_keyfile(args.out)
    except FileExistsError:
        print(f"prism keygen: {args.out} exists; not overwritten", file=sys.stderr)
        return EXIT_USAGE
    print(f"wrote {args.out} (mode 0600): hotkey {address}")
    return EXIT_OK
