"""``prism fleet status``: the queue, the running attempts and the last hour, read from the database."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table


def _s(value: float | None) -> str:
    """Seconds as ``12 s``, ``3.4 min`` or ``2.1 h``; ``-`` for none."""
    if value is None:
        return "-"
    if value < 120:
        return f"{value:.0f} s"
    return f"{value / 60:.1f} min" if value < 7200 else f"{value / 3600:.1f} h"


def render(status: Any, console: Console) -> None:
    """Print a :class:`~prism_challenge.service.watch.FleetStatus` as rich tables."""
    head = Table(title="queue", show_header=False)
    head.add_row("pending", str(status.pending))
    head.add_row("ready (backoff over)", str(status.ready))
    head.add_row("running", str(len(status.running)))
    for state in ("completed", "rejected", "failed"):
        head.add_row(f"{state}, last hour", str(status.last_hour.get(state, 0)))
    head.add_row("oldest without an owner", _s(status.oldest_unowned_s))
    console.print(head)
    running = Table(title="running attempts")
    for col in ("submission", "attempt", "node", "age", "heartbeat"):
        running.add_column(col)
    for r in status.running:
        running.add_row(str(r.submission_id), str(r.number), r.node or "(not known yet)", _s(r.age_s),
                        _s(r.heartbeat_age_s) + " ago")
    console.print(running)
    recent = Table(title="results, last hour")
    for col in ("submission", "status", "attempts", "prequential bpb", "finished (UTC)"):
        recent.add_column(col)
    for sid, state, attempts, bpb, finished in status.recent:
        recent.add_row(str(sid), state, str(attempts), "-" if bpb is None else f"{bpb:.6f}",
                       finished.strftime("%Y-%m-%d %H:%M:%S"))
    console.print(recent)
    disp = Table(title="dispatchers")
    for col in ("name", "heartbeat", "state"):
        disp.add_column(col)
    for name, beat, stopped in status.dispatchers:
        disp.add_row(name, _s(beat) + " ago", "stopped" if stopped else "live")
    console.print(disp)


def cmd_fleet_status(args: argparse.Namespace) -> int:
    """``prism fleet status``: exit 0, or 2 when the database does not exist."""
    from prism_challenge.service.store import Store, default_url
    from prism_challenge.service.watch import fleet_status

    url = args.db or default_url()
    if url.startswith("sqlite:///") and not Path(url.removeprefix("sqlite:///")).is_file():
        sys.stderr.write(f"prism fleet status: no database at {url.removeprefix('sqlite:///')} (--db URL)\n")
        return 2
    store = Store(url)
    try:
        render(fleet_status(store), Console())
    finally:
        store.close()
    return 0


def add_fleet_parser(sub: Any) -> None:
    """Register ``prism fleet status`` on an argparse subparsers object."""
    p = sub.add_parser("fleet", help="the evaluation fleet: queue, running attempts, recent results",
                       description="Read the service's database and show the evaluation fleet.")
    fleet = p.add_subparsers(dest="fleet_command", required=True, metavar="COMMAND")
    st = fleet.add_parser("status", help="queue depth, running attempts with node and age, the last hour's results")
    st.add_argument("--db", metavar="URL", default=None,
                    help="SQLAlchemy URL of the service's database (default: the SQLite file under the user data "
                         "directory)")
    st.set_defaults(func=cmd_fleet_status)
