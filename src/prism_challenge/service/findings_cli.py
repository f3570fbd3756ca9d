"""``prism findings list`` and ``prism findings lift``: the operator's view of the findings (runs
the audit caught, :mod:`prism_challenge.service.findings`) and the lifting of a suspension.

Both work on the service's database, found as ``prism serve`` finds it: ``--database-url``, then
``PRISM_DATABASE_URL``, then ``--config FILE`` (TOML), then the default SQLite file; the
suspension's period is the same settings' ``suspension_s``. They never create or migrate a
database: one that does not exist, cannot be reached or is not at this version's migration head
is refused with its reason. Exit status: 0 done; 1 nothing to lift; 2 bad settings, or no usable
database there.
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


DB_HELP = ("the service's database, a SQLAlchemy URL: sqlite:///REL/PATH or sqlite:////ABS/PATH, "
           "postgresql+psycopg://USER@HOST/DB (default: PRISM_DATABASE_URL, then --config's database_url, "
           "then the SQLite file of prism serve's default, under the user data directory)")
EPILOG = ("The database must be one prism serve has set up (it applies the migrations at its start); "
          "this command never creates or migrates one. Exit status: 0 done; 1 nothing to lift; 2 bad "
          "settings, or no usable database there.")


def add_findings_parser(sub: Any) -> None:
    """Register ``prism findings list`` and ``prism findings lift`` on argparse ``subparsers``."""
    p = sub.add_parser("findings", help="the service's findings (runs the audit caught) and suspensions",
                       description="Read or lift the findings (runs the audit caught) in the service's database: "
                                   "the one prism serve uses, found from the same settings (--database-url, "
                                   "PRISM_DATABASE_URL, --config).", epilog=EPILOG)
    cmds = p.add_subparsers(dest="findings_command", required=True, metavar="COMMAND")
    ls = cmds.add_parser("list", help="every finding, newest first, and whether it suspends its hotkey now",
                         description="Every finding, newest first: its hotkey, kind, submission, run, batch and "
                                     "figures, and its state: [suspends] (its hotkey is suspended now), "
                                     "[expired] (a timed suspension that ended) or [lifted ...].", epilog=EPILOG)
    ls.add_argument("--hotkey", metavar="SS58", help="only this hotkey's findings")
    ls.add_argument("--json", action="store_true", help="print the findings as a JSON list")
    ls.set_defaults(func=cmd_list)
    lift = cmds.add_parser("lift", help="lift a hotkey's suspension (its findings are kept, marked lifted)",
                           description="Lift every finding of HOTKEY not lifted yet: the hotkey is no longer "
                                       "suspended and its runs count again; the findings are kept, marked with "
                                       "who, when and why.", epilog=EPILOG)
    lift.add_argument("hotkey", metavar="HOTKEY", help="the SS58 hotkey (as prism findings list shows it)")
    lift.add_argument("--reason", metavar="TEXT", help="why (recorded with the lift)")
    lift.add_argument("--by", default=None, metavar="WHO", help="who lifts it (default: user@host)")
    lift.set_defaults(func=cmd_lift)
    for q in (ls, lift):
        q.add_argument("--config", type=Path, metavar="FILE",
                       help="the service's TOML settings file (as prism serve --config)")
        q.add_argument("--database-url", metavar="URL", help=DB_HELP)


def _schema_problem(url: str) -> str | None:
    """Why the database at ``url`` is not one this version of ``prism serve`` has set up (no
    Alembic revision, or another than the migrations' head), or ``None``. Reads only.

    Raises:
        sqlalchemy.exc.SQLAlchemyError: the database cannot be reached or read.
    """
    from alembic.config import Config
    from alembic.runtime.migration import MigrationContext
    from alembic.script import ScriptDirectory
    from sqlalchemy import create_engine

    from prism_challenge.service.store import MIGRATIONS

    engine = create_engine(url)
    try:
        with engine.connect() as connection:
            current = MigrationContext.configure(connection).get_current_revision()
    finally:
        engine.dispose()
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))
    scripts = ScriptDirectory.from_config(config)
    head = scripts.get_current_head()
    if current == head:
        return None
    if current is None:
        return "holds no PRISM service tables (not migrated): prism serve --database-url URL sets it up"
    known = {r.revision for r in scripts.walk_revisions()}
    if current not in known:
        return f"is at migration {current}, which this prism does not know (a newer prism set it up)"
    return (f"is at migration {current}, this prism needs {head}: start this version's prism serve once, "
            "which applies the migrations")


def _open(args: argparse.Namespace, command: str):
    """``(store, settings)``, or ``None`` after saying why (bad settings; no database, one that
    cannot be reached, or one not migrated to this version)."""
    import pydantic
    import sqlalchemy.exc
    from sqlalchemy.engine import make_url

    from prism_challenge.service.settings import ServiceSettings
    from prism_challenge.service.store import Store, default_url

    say = f"prism findings {command}:"
    try:
        settings = ServiceSettings.load(args.config, database_url=args.database_url)
    except (pydantic.ValidationError, FileNotFoundError) as exc:
        print(f"{say} bad settings: {exc}", file=sys.stderr)
        return None
    url = settings.database_url or default_url()
    try:
        shown = make_url(url).render_as_string(hide_password=True)
    except sqlalchemy.exc.ArgumentError:
        print(f"{say} the database URL {url!r} is not a SQLAlchemy URL (e.g. sqlite:////srv/prism/prism.sqlite3, "
              "postgresql+psycopg://prism@db/prism)", file=sys.stderr)
        return None
    if url.startswith("sqlite:///") and not Path(url.removeprefix("sqlite:///")).is_file():
        path = Path(url.removeprefix("sqlite:///"))
        print(f"{say} no database at {path}" + ("" if path.is_absolute() else f" ({path.resolve()})")
              + ": give prism serve's --database-url URL (sqlite:////ABS/PATH for an absolute path)", file=sys.stderr)
        return None
    try:
        problem = _schema_problem(url)
        if problem is None:
            return Store(url), settings
    except ImportError as exc:
        print(f"{say} cannot open the database {shown}: its driver is not installed ({exc})", file=sys.stderr)
        return None
    except sqlalchemy.exc.SQLAlchemyError as exc:
        reason = str(getattr(exc, "orig", None) or exc).strip().splitlines()[0]
        print(f"{say} cannot open the database {shown}: {reason}", file=sys.stderr)
        return None
    print(f"{say} the database {shown} {problem}", file=sys.stderr)
    return None


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
        recorded = 0 if n else len(fnd.findings(store, args.hotkey))
    finally:
        store.close()
    if n == 0:
        why = (f"its {recorded} finding{'s are' if recorded != 1 else ' is'} lifted already" if recorded
               else "none is recorded against it")
        print(f"prism findings lift: {args.hotkey} has no finding to lift: {why}", file=sys.stderr)
        return EXIT_NOTHING
    print(f"lifted {n} finding{'s' if n != 1 else ''} against {args.hotkey} (by {by})")
    return EXIT_OK


__all__ = ["add_findings_parser", "cmd_lift", "cmd_list"]
