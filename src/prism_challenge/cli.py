"""The ``prism`` command line: ``eval``, ``check``, ``data``, ``compare``, ``init``, ``verify``,
``runs``, ``serve``, ``submit``, ``status``, ``keygen``, ``fleet``, ``findings``."""

from __future__ import annotations

import argparse
import os
import sys

from prism_challenge import __version__
from prism_challenge.cli_eval import EXIT_FAILED, EXIT_SCORED, EXIT_USAGE, MAX_THREADS  # noqa: F401 - re-exported


def build_parser() -> argparse.ArgumentParser:
    """The ``prism`` argument parser with every subcommand registered."""
    parser = argparse.ArgumentParser(prog="prism", description="PRISM: score how fast a training loop learns.")
    parser.add_argument("--version", action="version", version=f"prism-challenge {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    from prism_challenge.cli_eval import add_eval_parser

    add_eval_parser(sub)
    from prism_challenge.gates.cli import add_check_parser

    add_check_parser(sub)
    from prism_challenge.data.cli import add_data_parser

    add_data_parser(sub)
    from prism_challenge.research.compare_report import add_compare_parser

    add_compare_parser(sub)
    from prism_challenge.research.scaffold import add_init_parser

    add_init_parser(sub)
    from prism_challenge.manifest.verify import add_verify_parser

    add_verify_parser(sub)
    from prism_challenge.runs_cli import add_runs_parser

    add_runs_parser(sub)
    from prism_challenge.cli_service import add_service_parsers

    add_service_parsers(sub)
    from prism_challenge.service.fleet_cli import add_fleet_parser

    add_fleet_parser(sub)
    from prism_challenge.service.findings_cli import add_findings_parser

    add_findings_parser(sub)
    return parser


SERVICE_EXTRA_MODULES = frozenset({"sqlalchemy", "alembic", "psycopg", "fastapi", "fastapi_offline", "starlette",
                                   "uvicorn", "pydantic_settings", "prometheus_client", "jinja2", "ray"})
"""The top-level modules of the ``[service]`` extra's packages (pyproject.toml): a command that
needs one of them on a plain install says which install to run."""


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``prism`` console script; returns the exit code (2 when the command
    needs the ``[service]`` extra and it is not installed: a top-level module of
    :data:`SERVICE_EXTRA_MODULES` is missing; a missing submodule of one, ``ray.util.x``, is a
    broken install or a bug, and is raised as it is)."""
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except ModuleNotFoundError as exc:
        if exc.name not in SERVICE_EXTRA_MODULES:  # a submodule missing from an installed package: a real bug
            raise
        sys.stderr.write(f"prism {args.command}: needs the service extra ({exc.name} is not installed): "
                         "pip install 'prism-challenge[service]' (from a checkout: pip install -e '.[service]')\n")
        return 2
    except KeyboardInterrupt:
        sys.stderr.write("prism: interrupted\n")
        return 130
    except BrokenPipeError:  # e.g. `prism check --json | head`: the reader left, that is all
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141


if __name__ == "__main__":
    sys.exit(main())
