"""``prism init DIR [--tokenizer gpt2|bytes]``: write a small bundle that passes the gates.

The files come from the package's ``templates/bundle/*.tmpl`` (``{{tokenizer}}`` and
``{{name}}`` filled in): ``architecture.py`` (a small causal decoder), ``training.py`` (an AdamW
loop ready for several processes: process group, DDP, the unwrapped module scored),
``prism.yaml`` and a ``README.md``.
"""

from __future__ import annotations

import argparse
from importlib import resources
from pathlib import Path
from typing import Any

TOKENIZERS = ("gpt2", "bytes")
FILES = ("architecture.py", "training.py", "prism.yaml", "README.md")


class ScaffoldError(ValueError):
    """The target cannot take a new bundle (a file, or a directory that is not empty)."""


def write_bundle(target: str | Path, tokenizer: str = "gpt2") -> list[Path]:
    """Write the template bundle into ``target`` (created; must be absent or empty).

    Returns:
        the files written.

    Raises:
        ScaffoldError: ``target`` is a file or a non-empty directory, or ``tokenizer`` is unknown.
    """
    root = Path(target)
    if tokenizer not in TOKENIZERS:
        raise ScaffoldError(f"--tokenizer {tokenizer!r}: must be one of {', '.join(TOKENIZERS)}")
    if root.exists() and not root.is_dir():
        raise ScaffoldError(f"{root}: exists and is not a directory")
    if root.is_dir() and any(root.iterdir()):
        raise ScaffoldError(f"{root}: directory exists and is not empty (name a new or empty directory)")
    root.mkdir(parents=True, exist_ok=True)
    templates = resources.files("prism_challenge") / "templates" / "bundle"
    written = []
    for name in FILES:
        text = (templates / f"{name}.tmpl").read_text()
        path = root / name
        path.write_text(text.replace("{{tokenizer}}", tokenizer).replace("{{name}}", str(target)))
        written.append(path)
    return written


def add_init_parser(sub: Any) -> None:
    """Register ``prism init`` on an argparse subparsers object."""
    p = sub.add_parser("init", help="write a small bundle that passes the gates, ready for several processes",
                       description="Write architecture.py, training.py, prism.yaml and README.md into DIR: a "
                       "small causal decoder and an AdamW loop with comments on the contract. "
                       "prism check DIR passes it; prism eval DIR scores it (any --nproc up to 8).")
    p.add_argument("dir", metavar="DIR", help="the bundle directory to create (absent or empty)")
    p.add_argument("--tokenizer", choices=TOKENIZERS, default="gpt2",
                   help="reference tokenizer: gpt2 (V = 50257, default) or bytes (V = 257)")
    p.set_defaults(func=cmd_init)


def cmd_init(args: argparse.Namespace) -> int:
    """Run ``prism init``; returns 0, or 2 when DIR cannot take a bundle."""
    from rich.console import Console

    try:
        files = write_bundle(args.dir, args.tokenizer)
    except (ScaffoldError, OSError) as exc:
        Console(stderr=True).print(f"[bold red]prism init[/]: {exc}", markup=True, highlight=False, soft_wrap=True)
        return 2
    console = Console(highlight=False)
    console.print(f"wrote {', '.join(p.name for p in files)} in {args.dir} (tokenizer {args.tokenizer})")
    console.print(f"next: prism check {args.dir}  then  prism eval {args.dir}", markup=False)
    return 0
