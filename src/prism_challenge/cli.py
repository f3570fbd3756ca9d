"""The ``prism`` command line: ``eval``, ``check``, ``data prepare``, ``data info``."""

from __future__ import annotations

import argparse
import math
import os
import sys
from typing import Any

from prism_challenge import __version__
from prism_challenge.evaluator.protocol import MAX_BATCH_TOKENS

EXIT_SCORED = 0
EXIT_FAILED = 1  # the run failed: one line names the stage and reason
EXIT_USAGE = 2  # a bad command line (argparse's own errors exit 2 too)
MAX_THREADS = 256  # CPU threads per rank (the sandbox allows 1024 tasks in all)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be at least 1")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not (value > 0 and math.isfinite(value)):  # inf would reach the manifest as non-JSON "Infinity"
        raise argparse.ArgumentTypeError(f"{value} must be a positive finite number")
    return value


def _bounded_int(low: int, high: int):
    """An argparse type: an integer in ``low..high`` (the message names the range)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{value} must be between {low} and {high}")
        return value

    return parse


def _add_eval_parser(sub: Any) -> None:
    from prism_challenge import evaluate as ev

    p = sub.add_parser(
        "eval",
        help="re-execute a bundle from a forced random init and score it by prequential bits-per-byte",
        description="Run the static gates, then re-execute the bundle's training loop under torchrun "
        "on the locked train stream and write prism_run_manifest.v2.json in the run directory.",
    )
    p.add_argument("bundle", help="bundle directory (architecture.py + training.py) or .zip")
    p.add_argument("--data", dest="data_dir", help="prepared data directory (default: the embedded corpus)")
    p.add_argument("--out", dest="out_dir", help="run directory (default: ./prism-runs/<time>-<bundle>-<sha>)")
    p.add_argument("--seed", type=_bounded_int(0, 2**63 - 1), default=ev.DEFAULT_SEED,
                   help="forced seed, 0..2^63-1 (default %(default)s)")
    p.add_argument("--seq-len", type=_bounded_int(2, MAX_BATCH_TOKENS), default=ev.DEFAULT_SEQ_LEN,
                   help=f"ctx.max_seq_len, 2..{MAX_BATCH_TOKENS} (default %(default)s)")
    p.add_argument("--token-budget", type=_positive_int, help="stop after this many stream tokens")
    p.add_argument("--step-budget", type=_positive_int, help="stop after this many batches")
    p.add_argument("--wall-clock-budget", type=_positive_float, metavar="SECONDS",
                   help="stop the stream this many seconds after the run starts (once the gates passed; graceful)")
    p.add_argument("--nproc", type=int, default=1, help="processes on this node, 1..8 (default 1)")
    p.add_argument("--nnodes", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--threads", type=_bounded_int(1, MAX_THREADS), default=ev.DEFAULT_THREADS,
                   help=f"CPU threads per rank, 1..{MAX_THREADS}, fixed for reproducibility (default %(default)s)")
    p.add_argument("--max-parameters", type=_positive_int, default=ev.DEFAULT_MAX_PARAMETERS)
    p.add_argument("--rank-timeout", type=_positive_float, default=ev.DEFAULT_RANK_TIMEOUT_S, metavar="SECONDS",
                   help="fail when a rank is silent this long while another is ahead (default %(default)s)")
    p.add_argument("--idle-timeout", type=_positive_float, default=ev.DEFAULT_IDLE_TIMEOUT_S, metavar="SECONDS",
                   help="one rank: stop and score what was scored when the loop takes no batch for this long; "
                        "any number of ranks: fail when no batch was scored this long after the start "
                        "(default %(default)s)")
    p.add_argument("--isolation", choices=["strict", "none"], default="strict",
                   help="strict (default): sandboxed, no network, data hidden; none: local work only, not tamper-resistant")
    p.add_argument("--heldout-bytes", type=_bounded_int(0, 1 << 40), default=ev.DEFAULT_HELDOUT_BYTES, metavar="BYTES",
                   help="UTF-8 bytes of the val split for the held-out delta; 0 disables (default %(default)s)")
    p.add_argument("--no-progress", action="store_true", help="no live progress bar")
    p.set_defaults(func=_cmd_eval)


def _cmd_eval(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from prism_challenge import evaluate as ev
    from prism_challenge.evaluate import USAGE_STAGE, EvalFailure, EvalOptions, evaluate
    from prism_challenge.report import print_failure, print_summary

    console = Console(stderr=True)
    opts = EvalOptions(
        bundle=args.bundle, data_dir=args.data_dir, out_dir=args.out_dir, seed=args.seed, seq_len=args.seq_len,
        token_budget=args.token_budget, step_budget=args.step_budget, wall_clock_budget=args.wall_clock_budget,
        nproc=args.nproc, nnodes=args.nnodes, device=args.device, threads=args.threads,
        max_parameters=args.max_parameters, rank_timeout=args.rank_timeout, idle_timeout=args.idle_timeout,
        isolation=args.isolation,
        heldout_bytes=args.heldout_bytes,
    )
    if args.isolation == "none":
        console.print(f"[bold red on yellow] WARNING [/] [bold]{ev.NO_ISOLATION_WARNING}[/]")
    progress = Progress(
        TextColumn("[bold]prequential"),
        BarColumn(),
        TextColumn("{task.completed:,.0f}/{task.total:,.0f} {task.fields[unit]}"),
        TextColumn("bpb [cyan]{task.fields[bpb]}"),
        TimeElapsedColumn(),
        console=console,
        disable=args.no_progress,
        transient=False,
        refresh_per_second=2,  # the parent shares the cores with the ranks
    )
    state: dict[str, Any] = {}

    def on_start(info: dict[str, Any]) -> None:
        state["unit"] = info["unit"]
        state["task"] = progress.add_task("run", total=info["total"], unit=info["unit"], bpb="-")
        progress.start()

    def on_record(rec: Any, running: dict[str, float]) -> None:
        done = rec.targets if state["unit"] == "tokens" else rec.bytes
        bpb = running["nats"] / math.log(2) / running["bytes"] if running["bytes"] else float("nan")
        progress.update(state["task"], advance=done, bpb=f"{bpb:.4f}")

    try:
        outcome = evaluate(opts, on_start=on_start, on_record=on_record)
    except EvalFailure as exc:  # before a run directory exists: a bad command line exits 2
        progress.stop()
        print_failure(console, exc)
        return EXIT_USAGE if exc.stage == USAGE_STAGE else EXIT_FAILED
    finally:
        progress.stop()
    if outcome.failure is not None:
        print_failure(console, outcome.failure, outcome.run_dir)
        return EXIT_FAILED
    print_summary(Console(), outcome)
    return EXIT_SCORED


def build_parser() -> argparse.ArgumentParser:
    """The ``prism`` argument parser with every subcommand registered."""
    parser = argparse.ArgumentParser(prog="prism", description="PRISM: score how fast a training loop learns.")
    parser.add_argument("--version", action="version", version=f"prism-challenge {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_eval_parser(sub)
    from prism_challenge.gates.cli import add_check_parser

    add_check_parser(sub)
    from prism_challenge.data.cli import add_data_parser

    add_data_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``prism`` console script; returns the exit code."""
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        sys.stderr.write("prism: interrupted\n")
        return 130
    except BrokenPipeError:  # e.g. `prism check --json | head`: the reader left, that is all
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141


if __name__ == "__main__":
    sys.exit(main())
