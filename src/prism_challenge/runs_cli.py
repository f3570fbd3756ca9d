"""``prism runs``: the local run directories. ``prism runs prune`` removes the snapshots of the
runs that are already verified (:mod:`prism_challenge.manifest.runs_prune`)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from prism_challenge.manifest.runs_prune import DEFAULT_RUNS_DIR, RunPrune, plan_prune, prune

EXIT_DONE, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


def add_runs_parser(sub: Any) -> None:
    """Register ``prism runs prune``."""
    runs = sub.add_parser("runs", help="manage local run directories (prune: remove verified runs' snapshots)")
    verbs = runs.add_subparsers(dest="runs_command", required=True, metavar="ACTION")
    p = verbs.add_parser(
        "prune", help="remove the audit snapshots of runs already verified",
        description="Remove the audit's weight snapshots (model/audit/step-<k>.snap) of the run directories "
                    "whose audit passed and whose manifest is signed by a trusted key; every other run keeps "
                    "them (the reason is printed) unless --all. prism verify still checks a pruned run, all "
                    "but the re-scoring, and says that its snapshots were pruned.",
        epilog="exit status: 0 done (or nothing to do); 1 a file could not be removed; 2 a folder that is not a "
               "directory or a key that cannot be read.")
    p.add_argument("dirs", nargs="*", type=Path, metavar="DIR",
                   help=f"run directories, or folders of them (default ./{DEFAULT_RUNS_DIR})")
    p.add_argument("--dry-run", action="store_true", help="list what would go and the bytes freed; remove nothing")
    p.add_argument("--all", action="store_true", dest="everything",
                   help="also the runs not verified (failed, audit unfinished or not passed, unsigned, no manifest)")
    p.add_argument("--key", action="append", default=None, metavar="BASE64|PEMFILE",
                   help="a trusted signing public key (as prism verify's --key); default: your own (prism eval's)")
    p.set_defaults(func=cmd_prune)


def _mib(n: int) -> str:
    return f"{n} bytes ({n / 2**20:.1f} MiB)"


def _line(plan: RunPrune, dry_run: bool) -> str:
    count = f"{len(plan.files)} snapshot{'s' * (len(plan.files) != 1)}"
    if plan.kept:
        return f"kept        {plan.run_dir}: {count}, {plan.kept}"
    return f"{'would prune' if dry_run else 'pruned':<11} {plan.run_dir}: {count}, {_mib(plan.bytes)}"


def cmd_prune(args: argparse.Namespace) -> int:
    """``prism runs prune``: a line per run directory with snapshots (pruned, or kept and why), then
    the total freed; exit 0, 1 when a file could not be removed, 2 for a folder or key it cannot read."""
    from prism_challenge.manifest.certificate import CertificateError, trusted_keys

    keys = list(args.key) if args.key else None
    try:
        trusted_keys(keys)
        plans = plan_prune(list(args.dirs) or [DEFAULT_RUNS_DIR], keys, args.everything)
    except (ValueError, CertificateError) as exc:
        print(f"prism runs prune: {exc}", file=sys.stderr)
        return EXIT_USAGE
    freed, status = 0, EXIT_DONE
    for plan in plans:
        if not plan.kept and not args.dry_run:
            try:
                freed += prune(plan)
            except (OSError, ValueError) as exc:
                print(f"failed      {plan.run_dir}: {exc}")
                status = EXIT_FAILED
                continue
        elif not plan.kept:
            freed += plan.bytes
        print(_line(plan, args.dry_run))
    pruned = sum(1 for p in plans if not p.kept)
    verb = "would free" if args.dry_run else "freed"
    print(f"{pruned} run{'s' * (pruned != 1)} {'to prune' if args.dry_run else 'pruned'}, "
          f"{len(plans) - pruned} kept: {verb} {_mib(freed)}")
    return status
