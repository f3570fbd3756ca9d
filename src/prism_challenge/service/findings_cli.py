"""``prism findings list`` and ``prism findings lift``: the operator's view of the findings (runs
the audit caught, :mod:`prism_challenge.service.findings`) and the lifting of a suspension.

Both work on the service's database, found as ``prism serve`` finds it: ``--database-url``, then
``PRISM_DATABASE_URL``, then ``--config FILE`` (TOML), then the default SQLite file; the
suspension's period is the same settings' ``suspension_s``. Exit status: 0 done; 1 nothing to
lift; 2 bad settings, or no database there.
"""

from __future__ import annotations

import argparse
import getpass
import json
import socket
import sys
from pathlib import Path
from typing import Any

EXIT_OK, EXIT_NOTHING, EXIT_USAGE = 0, 1, 2


def add_findings_parser(sub: Any) -> None:
    """Register ``prism findings list`` and ``prism findings lift`` on argparse ``subparsers``."""
    p = sub.add_parser("findings", help="the service's findings (runs the audit caught) and suspensions",
                       description="Read or lift the findings in the service's database (the settings of "
                                   "prism serve: --database-url, PRISM_DATABASE_URL, --config).")
    cmds = p.add_subparsers(dest="findings_command", required=True, metavar="COMMAND")
    ls = cmds.add_parser("list", help="every finding, newest first, and whether it suspends its hotkey now")
    ls.add_argument("--hotkey", help="only this hotkey's findings")
    ls.add_argument("--json", action="store_true", help="print the findings as JSON")
    ls.set_defaults(func=cmd_list)
    lift = cmds.add_parser("lift", help="lift a hotkey's suspension (its findings are kept, marked lifted)")
    lift.add_argument("hotkey", help="the SS58 hotkey")
    lift.add_argument("--reason", help="why (recorded with the lift)")
    lift.add_argument("--by", default=None, help="who lifts it (default: user@host)")
    lift.set_defaults(func=cmd_lift)
    for q in (ls, lift):
        q.add_argument("--config", type=Path, help="the service's TOML settings file (as prism serve --config)")
        q.add_argument("--database-url", help="SQLAlchemy URL (default: the settings', else the SQLite file under "
                                              "the user data directory)")


def _open(args: argparse.Namespace, command: str):
    """``(store, settings)``, or ``None`` after saying why (bad settings, no database)."""
    import pydantic

    from prism_challenge.service.settings import ServiceSettings
    from prism_challenge.service.store import Store, default_url

    try:
        settings = ServiceSettings.load(args.config, database_url=args.database_url)
    except (pydantic.ValidationError, FileNotFoundError) as exc:
        print(f"prism findings {command}: bad settings: {exc}", file=sys.stderr)
        return None
    url = settings.database_url or default_url()
    if url.startswith("sqlite:///") and not Path(url.removeprefix("sqlite:///")).is_file():
        print(f"prism findings {command}: no database at {url.removeprefix('sqlite:///')} (--database-url URL)",
              file=sys.stderr)
        return None
    return Store(url), settings


def cmd_list(args: argparse.Namespace) -> int:
    """``prism findings list [--hotkey H] [--json]``."""
    from prism_challenge.service import findings as fnd
    from prism_challenge.service.models import utcnow

    opened = _open(args, "list")
    if opened is None:
        return EXIT_USAGE
    store, settings = opened
    try:
        now, period = utcnow(), settings.suspension_s
        views = [fnd.finding_view(f, now, period) for f in fnd.findings(store, args.hotkey)]
    finally:
        store.close()
    if args.json:
        print(json.dumps(views, indent=2))
        return EXIT_OK
    if not views:
        print("no finding" + (f" against {args.hotkey}" if args.hotkey else ""))
    for v in views:
        state = (f"lifted {v['lifted_at'][:19]} by {v['lifted_by']}" + (f" ({v['lift_reason']})" if v["lift_reason"]
                 else "")) if v["lifted_at"] else ("suspends" if v["active"] else "expired")
        figures = "" if v["recorded_nats"] is None and v["rescored_nats"] is None else (
            f" recorded {v['recorded_nats']!r} re-scored {v['rescored_nats']!r} nats")
        print(f"#{v['id']} {v['created_at'][:19]} {v['hotkey']} {v['kind']} submission {v['submission_id']} "
              f"run {v['run_id']} batch {'-' if v['step'] is None else v['step']}{figures} [{state}]")
    return EXIT_OK


def cmd_lift(args: argparse.Namespace) -> int:
    """``prism findings lift HOTKEY [--reason TEXT] [--by WHO]``: 0 lifted, 1 nothing to lift."""
    from prism_challenge.service import findings as fnd
    from prism_challenge.service.models import utcnow

    opened = _open(args, "lift")
    if opened is None:
        return EXIT_USAGE
    store, _ = opened
    by = args.by or f"{getpass.getuser()}@{socket.gethostname()}"
    try:
        n = fnd.lift(store, args.hotkey, by=by, reason=args.reason, now=utcnow())
    finally:
        store.close()
    if n == 0:
        print(f"prism findings lift: {args.hotkey} has no finding to lift", file=sys.stderr)
        return EXIT_NOTHING
    print(f"lifted {n} finding{'s' if n != 1 else ''} against {args.hotkey} (by {by})")
    return EXIT_OK


__all__ = ["add_findings_parser", "cmd_lift", "cmd_list"]
