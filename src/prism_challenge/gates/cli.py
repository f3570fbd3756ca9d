"""``prism check BUNDLE [--json]``: run the static gates and print the findings.

Exit status: 0 when nothing blocks, 1 when a finding blocks, 2 when the bundle cannot be read
(a :class:`~prism_challenge.intake.bundle.BundleError`, e.g. a zip-hardening rule) or the request is
invalid (``--nproc 0``).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from prism_challenge.intake.bundle import BundleError
from prism_challenge.evaluator.isolation import IsolationError
from prism_challenge.gates.core import DEFAULT_MAX_PARAMETERS, run_gates
from prism_challenge.gates.findings import GateReport

EXIT_CLEAN = 0
EXIT_BLOCKED = 1
EXIT_UNREADABLE = 2


def add_check_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register the ``check`` subcommand on an argparse ``subparsers`` object.

    The parser's ``func`` default is :func:`cmd_check` (``args -> exit code``).

    Returns:
        the new subparser.
    """
    p = subparsers.add_parser(
        "check",
        help="run the static gates on a bundle (no training)",
        description=(
            "Intake, AST sandbox, multi-GPU contract and parameter cap. Exit 0 when clean, "
            "1 when a finding blocks, 2 when the bundle cannot be read."
        ),
    )
    p.add_argument("bundle", help="bundle directory or .zip")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument(
        "--max-parameters",
        type=int,
        default=DEFAULT_MAX_PARAMETERS,
        help="parameter cap, unique storage elements (default %(default)s)",
    )
    p.add_argument("--nproc", type=int, default=1, help="GPUs the run will use (1..8)")
    p.add_argument("--nnodes", type=int, default=1, help="nodes the run will use (1)")
    p.add_argument("--vocab-size", type=int, default=None, help="default: the bundle tokenizer's")
    p.add_argument("--seq-len", type=int, default=256, help="ctx.sequence_length for build_model")
    p.add_argument(
        "--param-timeout", type=float, default=60.0, help="seconds for the parameter count"
    )
    p.add_argument("--no-params", action="store_true", help="skip the parameter count")
    p.add_argument(
        "--device",
        choices=("cpu", "cuda", "auto"),
        default=None,
        help="the device the run will use (default: the profile's, else cpu); on cuda, the ops that raise "
        "under forced determinism on CUDA only are advisories (prism:cuda-determinism)",
    )
    p.add_argument("--profile", default=None, help="a challenge profile (name or file): its device, unless --device")
    p.add_argument(
        "--isolation",
        choices=("strict", "none"),
        default="strict",
        help="strict (default): the parameter count's child, which runs build_model, is sandboxed "
        "like every process that runs submitted code; none: unsandboxed, for your own bundles only",
    )
    p.set_defaults(func=cmd_check)
    return p


def _device(args: argparse.Namespace) -> str:
    """``--device``, else the ``--profile``'s device, else ``"cpu"``.

    Raises:
        ValueError: the profile cannot be loaded (the message names the file and field)."""
    if args.device is not None:
        return args.device
    if args.profile is not None:
        from prism_challenge.profiles import load_profile

        return str(load_profile(args.profile).options["device"])
    return "cpu"


def cmd_check(args: argparse.Namespace) -> int:
    """Run ``prism check`` for parsed ``args``; print the report; return the exit status."""
    try:
        device = _device(args)
    except ValueError as exc:  # ProfileError is a ValueError
        _print_unreadable(args, "prism:usage", str(exc))
        return EXIT_UNREADABLE
    try:
        report = run_gates(
            args.bundle,
            max_parameters=args.max_parameters,
            nproc=args.nproc,
            nnodes=args.nnodes,
            param_timeout_s=args.param_timeout,
            vocab_size=args.vocab_size,
            seq_len=args.seq_len,
            check_params=not args.no_params,
            isolation=args.isolation,
            device=device,
        )
    except BundleError as exc:
        _print_unreadable(args, exc.rule, str(exc))
        return EXIT_UNREADABLE
    except IsolationError as exc:
        _print_unreadable(args, "prism:isolation", f"{exc} (or pass --isolation none)")
        return EXIT_UNREADABLE
    except ValueError as exc:
        _print_unreadable(args, "prism:usage", str(exc))
        return EXIT_UNREADABLE
    try:
        if args.json:
            print(json.dumps(report.to_dict(), indent=2))
        else:
            _print_table(report)
    finally:
        report.cleanup()
    return EXIT_BLOCKED if report.blocking else EXIT_CLEAN


def _print_unreadable(args: argparse.Namespace, rule: str, message: str) -> None:
    if args.json:
        payload = {
            "bundle": None,
            "error": {"rule": rule, "message": message},
            "findings": [],
            "param_count": None,
            "max_parameters": args.max_parameters,
            "blocking": True,
        }
        print(json.dumps(payload, indent=2))
        return
    from rich.console import Console

    Console(stderr=False, highlight=False).print(  # soft_wrap: one line at any terminal width
        f"[bold red]cannot read bundle[/] [cyan]{rule}[/]: {_escape(message)}", soft_wrap=True
    )


def _escape(text: str) -> str:
    from prism_challenge.terminal import shown

    return shown(text)


def _packed(parts: list[str], width: int, sep: str = "  ") -> list[str]:
    """``parts`` joined by ``sep`` into lines of at most ``width`` characters where they fit,
    never breaking inside a part (a part longer than ``width`` has a line of its own)."""
    lines: list[str] = []
    for part in parts:
        if lines and len(lines[-1]) + len(sep) + len(part) <= width:
            lines[-1] += sep + part
        else:
            lines.append(part)
    return lines


def _print_table(report: GateReport) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(highlight=False)
    if report.bundle is not None:
        b = report.bundle
        for line in _packed([f"bundle {_escape(report.shown_source)}",  # a .zip by its own name, never its extraction
                             f"architecture {_escape(f'{b.architecture.file}:{b.architecture.symbol}')}",
                             f"training {_escape(f'{b.training.file}:{b.training.symbol}')}",
                             f"tokenizer {_escape(b.tokenizer)}"],  # prism.yaml's words (terminal.shown)
                            console.width):
            console.print(line, soft_wrap=True)
    if report.findings:
        table = Table(show_lines=False)
        table.add_column("rule", style="cyan", no_wrap=True)
        table.add_column("where", no_wrap=True)
        table.add_column("message")
        table.add_column("blocks", no_wrap=True)
        for f in report.findings:
            table.add_row(f.rule, _escape(f.location), _escape(f.message), "yes" if f.blocking else "advisory")
        console.print(table)
    if report.param_count is not None:
        console.print(f"parameters: {report.param_count:,} (cap {report.max_parameters:,})")
    else:
        console.print("parameters: not counted")
    blocking = sum(f.blocking for f in report.findings)
    if blocking:
        console.print(f"[bold red]BLOCKED[/]: {blocking} blocking finding(s)")
    else:
        console.print("[bold green]PASS[/]")


def main(argv: list[str] | None = None) -> int:
    """Standalone entry (``python -m prism_challenge.gates.cli BUNDLE``); returns the exit code."""
    parser = argparse.ArgumentParser(prog="prism")
    sub = parser.add_subparsers(dest="command", required=True)
    add_check_parser(sub)
    args = parser.parse_args(["check", *(sys.argv[1:] if argv is None else argv)])
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
