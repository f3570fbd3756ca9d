"""``prism eval``: the command line of a scored run (profiles, ``--json``, ``--quiet``, seeds).

Every setting that changes a score starts from a challenge profile (``--profile``, default
``local``; :mod:`prism_challenge.profiles`); an option given on the command line overrides it and
the manifest records the field. ``--seeds A,B,C`` or ``--repeats N`` runs once per seed and
reports the mean and the sample standard deviation (ddof=1) of the kept runs.
"""

from __future__ import annotations

import argparse
import json
from datetime import datetime, timezone
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from prism_challenge.options import (
    DEFAULT_IDLE_TIMEOUT_S,
    DEFAULT_RANK_TIMEOUT_S,
    MAX_THREADS,
    RULES,
    OptionsError,
    check_field,
)
from prism_challenge.evaluator import selftest
from prism_challenge.failures import USAGE_STAGE
from prism_challenge.intake.spec import SCORING_AUTOCAST
from prism_challenge.profiles import DEFAULT_PROFILE, ProfileError, load_profile, profile_names, resolve

EXIT_SCORED, EXIT_FAILED, EXIT_USAGE = 0, 1, 2
FLAG_NAMES = {"data_dir": "--data", "out_dir": "--out"}  # EvalOptions fields whose flag is not --field-name
# EvalOptions fields a profile sets; the command line's value (when given) overrides it
PROFILE_FIELDS = ("seq_len", "nproc", "device", "seed", "threads", "max_parameters", "token_budget",
                  "byte_budget", "step_budget", "wall_clock_budget", "heldout_bytes", "scoring_autocast")


def _field(name: str):
    """An argparse type for the :class:`~prism_challenge.options.EvalOptions` field ``name``: the
    text parsed as the field's kind and checked by the field's rule (:data:`~prism_challenge.options.RULES`,
    the same check the options make)."""
    kind = RULES[name].kind

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {'an integer' if kind is int else 'a number'}") from None
        try:
            return check_field(name, value)
        except OptionsError as exc:
            raise argparse.ArgumentTypeError(f"{value} {exc.rule}") from None

    return parse


def _range(low: int, high: int):
    """An argparse type: an integer in ``low..high`` (for options that are not EvalOptions fields)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{value} must be between {low} and {high}")
        return value

    return parse


def flag_of(field_name: str) -> str:
    """The ``prism eval`` flag of an EvalOptions field (``seq_len`` -> ``--seq-len``)."""
    return FLAG_NAMES.get(field_name, "--" + field_name.replace("_", "-"))


def _seed_list(text: str) -> list[int]:
    parse = _field("seed")
    seeds = [parse(x.strip()) for x in text.split(",") if x.strip()]
    if not seeds or len(set(seeds)) != len(seeds):
        raise argparse.ArgumentTypeError(f"{text!r}: a comma-separated list of distinct seeds, e.g. 1234,1,2")
    return seeds


def _run_secret(text: str) -> bytes:
    """``--run-secret``: 64 hex digits (a manifest's ``run_secret``) as the run's 32 bytes."""
    s = text.strip().lower()
    bad = [c for c in s if c not in "0123456789abcdef"]
    if len(s) != 64 or bad:
        why = f"{bad[0]!r} is not a hex digit" if bad else f"{len(s)} hex digits"
        raise argparse.ArgumentTypeError(f"{text!r}: {why}; a run secret is 64 hex digits (0-9, a-f), as a "
                                         "manifest's run_secret")
    return bytes.fromhex(s)


def add_eval_parser(sub: Any) -> None:
    """Register ``prism eval`` on an argparse subparsers object."""
    local = load_profile(DEFAULT_PROFILE).options
    d = lambda key: f"(profile {DEFAULT_PROFILE}: {local[key]})"  # noqa: E731 - the help's default
    p = sub.add_parser(
        "eval",
        help="re-execute a bundle from a forced random init and score it by prequential bits-per-byte",
        description="Run the static gates, then re-execute the bundle's training loop under torchrun "
        "(one rank: under the single-rank agent) on the locked train stream and write prism_run_manifest.v2.json in the run directory. "
        "Settings start from a challenge profile; an option given here overrides it (recorded in the "
        "manifest). The score is final_score (higher is better); runs rank by prequential_bpb (lower "
        "is better) as prism compare shows. The manifest reveals the run's secret (run_secret) and is "
        "signed with your key (made on first use in your config folder, prism/signing-key.pem); "
        "prism verify RUN_DIR checks it.",
    )
    p.add_argument("bundle", help="bundle directory (architecture.py + training.py) or .zip")
    p.add_argument("--profile", default=DEFAULT_PROFILE, metavar="NAME|FILE",
                   help=f"challenge profile: {', '.join(profile_names())} or a .toml file (default {DEFAULT_PROFILE})")
    p.add_argument("--data", dest="data_dir", metavar="DIR",
                   help="prepared data directory (default: the profile's; local: the embedded corpus)")
    p.add_argument("--out", dest="out_dir", metavar="DIR",
                   help="run directory (default ./prism-runs/<time>-<bundle>-<sha>; with seeds, DIR/seed-<S>)")
    p.add_argument("--seed", type=_field("seed"), help=f"forced seed, 0..2^63-1 {d('seed')}")
    seeds = p.add_mutually_exclusive_group()
    seeds.add_argument("--seeds", type=_seed_list, metavar="S1,S2,...",
                       help="run once per seed; print mean and sample std (ddof=1) of bpb and final_score")
    seeds.add_argument("--repeats", type=_range(2, 100), metavar="N",
                       help="run N times, with seeds SEED, SEED+1, ... (SEED: --seed or the profile's); as --seeds")
    p.add_argument("--seq-len", type=_field("seq_len"), metavar="T",
                   help=f"ctx.max_seq_len, 2..{RULES['seq_len'].high} {d('seq_len')}")
    p.add_argument("--token-budget", type=_field("token_budget"), metavar="N",
                   help=f"stop after this many stream tokens; replaces the profile's byte budget {d('token_budget')}")
    p.add_argument("--byte-budget", type=_field("byte_budget"), metavar="N",
                   help="stop at the first batch boundary at or past N UTF-8 bytes of text (the same text "
                        "for every tokenizer); replaces the profile's token budget")
    p.add_argument("--step-budget", type=_field("step_budget"), metavar="N", help="stop after this many batches")
    p.add_argument("--wall-clock-budget", type=_field("wall_clock_budget"), metavar="SECONDS",
                   help="stop the stream this many seconds after the gates' release (graceful)")
    p.add_argument("--no-budget", action="store_true",
                   help="drop the profile's budgets (those not given here): stream the whole train split")
    p.add_argument("--nproc", type=int, metavar="N", help=f"processes on this node, 1..8 {d('nproc')}")
    p.add_argument("--nnodes", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--device", choices=["auto", "cpu", "cuda"],
                   help=f"where the ranks compute; auto: cuda when available {d('device')}")
    p.add_argument("--threads", type=_field("threads"), metavar="N",
                   help=f"CPU threads per rank, 1..{MAX_THREADS}, fixed for reproducibility {d('threads')}")
    p.add_argument("--max-parameters", type=_field("max_parameters"), metavar="N",
                   help=f"parameter cap: unique parameter and buffer elements {d('max_parameters')}")
    p.add_argument("--heldout-bytes", type=_field("heldout_bytes"), metavar="BYTES",
                   help=f"UTF-8 bytes of the val split for the held-out delta; 0 disables {d('heldout_bytes')}")
    p.add_argument("--scoring-autocast", choices=list(SCORING_AUTOCAST),
                   help="autocast dtype of the harness's scoring forwards for a bundle whose prism.yaml declares "
                        f"no scoring_autocast (fp32: none) {d('scoring_autocast')}")
    _add_run_options(p)


def _add_run_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rank-timeout", type=_field("rank_timeout"), default=DEFAULT_RANK_TIMEOUT_S, metavar="SECONDS",
                   help="fail when a rank is silent this long while another is ahead (default %(default)s)")
    p.add_argument("--idle-timeout", type=_field("idle_timeout"), default=DEFAULT_IDLE_TIMEOUT_S, metavar="SECONDS",
                   help="one rank: stop and score what was scored when the loop takes no batch for this long; "
                        "any number of ranks: fail when no batch was scored this long after the start "
                        "(default %(default)s)")
    p.add_argument("--isolation", choices=["strict", "none"], default="strict",
                   help="strict (default): sandboxed, no network, data hidden; none: local work only, not tamper-resistant")
    p.add_argument("--run-secret", type=_run_secret, metavar="HEX",
                   help="repeat a run exactly, with its other options: the 64 hex digits of its manifest's "
                   "run_secret (the key of its audit and probe draws; default: a fresh secret per run, "
                   "revealed in the manifest); not with --seeds or --repeats")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object on stdout (summary and manifest path); human output goes to stderr")
    p.add_argument("--quiet", action="store_true",
                   help="no progress bar and no table: one result line (or only the JSON with --json)")
    p.add_argument("--no-progress", action="store_true", help="no live progress bar")
    p.add_argument("--profile-phases", action="store_true",
                   help="benchmarks: time each rank's stream by phase (scoring, state copy, report, the loop's own "
                        "step...) and write it with the parent's CPU time to the run's logs/phases.json")
    p.set_defaults(func=cmd_eval)


def _options(args: argparse.Namespace, profile, seed: int | None, out_dir: str | None):
    """The run's EvalOptions: the profile's settings with the command line's on top.

    Raises:
        OptionsError: a value breaks its rule (the profile's or the command line's).
    """
    from prism_challenge.options import EvalOptions

    given = {k: getattr(args, k) for k in PROFILE_FIELDS}
    given["seed"] = seed
    given["data_dir"] = args.data_dir
    settings, overridden = resolve(profile, given)
    sizes = ("token_budget", "byte_budget")  # one size budget on the command line replaces the profile's other
    for mine, other in (sizes, sizes[::-1]):
        if given[mine] is not None and given[other] is None and settings[other] is not None:
            settings[other] = None
            overridden.append(other)
    if args.no_budget:
        for k in ("token_budget", "byte_budget", "step_budget", "wall_clock_budget"):
            if settings[k] is not None and given[k] is None:
                settings[k] = None
                overridden.append(k)
        overridden.sort()
    return EvalOptions(bundle=args.bundle, out_dir=out_dir, nnodes=args.nnodes, rank_timeout=args.rank_timeout,
                       idle_timeout=args.idle_timeout, isolation=args.isolation, profile=profile,
                       profile_overridden=overridden, run_secret=getattr(args, "run_secret", None),
                       profile_phases=bool(getattr(args, "profile_phases", False)), **settings)


def _seeds(args: argparse.Namespace, profile) -> list[int] | None:
    if args.seeds:
        return args.seeds
    if args.repeats:
        base = args.seed if args.seed is not None else profile.options["seed"]
        return [base + i for i in range(args.repeats)]
    return None


def _seed_out(args: argparse.Namespace, seed: int) -> str:
    if args.out_dir:
        return str(Path(args.out_dir) / f"seed-{seed}")
    stamp = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
    name = Path(args.bundle.rstrip("/")).name.removesuffix(".zip")
    args.out_dir = str(Path("prism-runs") / f"{stamp}-{name}-seeds")
    return str(Path(args.out_dir) / f"seed-{seed}")


def cmd_eval(args: argparse.Namespace) -> int:
    """Run ``prism eval`` for parsed ``args``; returns the exit code (0 scored, 1 failed, 2 usage)."""
    from rich.console import Console

    from prism_challenge.research.report import print_seed_stats, seed_stats

    human = Console(stderr=True) if args.json else Console()
    if args.seeds and args.seed is not None:
        return _usage(args, human, "--seed and --seeds: give the seeds in --seeds only")
    if getattr(args, "run_secret", None) is not None and (args.seeds or args.repeats):
        return _usage(args, human, "--run-secret repeats one run: not with --seeds or --repeats")
    try:
        profile = load_profile(args.profile)
    except ProfileError as exc:
        return _usage(args, human, str(exc))
    seeds = _seeds(args, profile)
    try:  # every run's options are checked before the first run starts
        runs = [_options(args, profile, args.seed, args.out_dir)] if seeds is None else [
            _options(args, profile, seed, _seed_out(args, seed)) for seed in seeds]
    except OptionsError as exc:
        return _usage(args, human, f"{flag_of(exc.field)} {exc.value}: {exc.rule}")
    if any(o.isolation == "strict" for o in runs) and (refused := selftest.refusal("prism eval", cached=True)):
        _err().print(refused, highlight=False, markup=False)
        return EXIT_FAILED
    if seeds is None:
        code, summary = _run_one(args, runs[0], human)
        if args.json:
            print(json.dumps(summary, indent=2))
        return code
    results = []
    for i, (seed, opts) in enumerate(zip(seeds, runs), 1):
        _err().print(f"prism eval: run {i} of {len(seeds)}, seed {seed}", highlight=False)
        code, summary = _run_one(args, opts, human)
        results.append(summary)
        if code == EXIT_USAGE:
            break
    stats = seed_stats(results)
    if args.json:
        print(json.dumps({"runs": results, "aggregate": stats}, indent=2))
    else:
        print_seed_stats(human, stats)
    return max(r["exit_code"] for r in results)


def _usage(args: argparse.Namespace, console, message: str) -> int:
    from prism_challenge.failures import EvalFailure
    from prism_challenge.research.report import print_failure

    failure = EvalFailure(USAGE_STAGE, message)
    print_failure(_err(), failure)
    if args.json:
        print(json.dumps({"status": "failed", "exit_code": EXIT_USAGE, "run_dir": None, "manifest": None,
                          "failure": {"stage": USAGE_STAGE, "message": message, "kind": failure.kind}}, indent=2))
    return EXIT_USAGE


def _err():
    """The human console: stderr."""
    from rich.console import Console

    return Console(stderr=True)


def _run_one(args: argparse.Namespace, opts, human) -> tuple[int, dict[str, Any]]:
    """One scored run with the progress bar; returns the exit code and the JSON summary."""
    from prism_challenge.api import evaluate
    from prism_challenge.pipeline.context import NO_ISOLATION_WARNING
    from prism_challenge.research.report import print_failure, print_summary, summary_dict

    err = _err()
    if opts.isolation == "none":
        err.print(f"[bold red on yellow] WARNING [/] [bold]{NO_ISOLATION_WARNING}[/]")
    bar = ProgressBar(err, disable=args.no_progress or args.quiet)
    try:
        result = evaluate(opts, on_progress=bar)
    finally:
        bar.stop()
    failure = result.failure
    if result.run_dir is None:  # stopped before a run directory existed: a bad command line exits 2
        print_failure(err, failure)
        code = EXIT_USAGE if failure.stage == USAGE_STAGE else EXIT_FAILED
        gates = result.manifest.gates if result.manifest is not None else None
        return code, {"status": result.status, "exit_code": code, "seed": opts.seed, "run_dir": None,
                      "manifest": None, "failure": {"stage": failure.stage, "message": failure.message,
                                                    "kind": failure.kind},
                      # a refused bundle: each finding (file, line, col, rule, message), as prism check lists them
                      "findings": [f.model_dump(mode="json") for f in gates.findings] if gates else []}
    outcome = SimpleNamespace(manifest=result.manifest.to_json_dict(), run_dir=Path(result.run_dir))
    memory_warning = (outcome.manifest.get("isolation") or {}).get("memory_warning")
    if memory_warning:  # CUDA on a host without a cgroup v2 memory controller (evaluator/jail.py)
        err.print(f"[bold red on yellow] WARNING [/] [bold]{memory_warning}[/]")
    summary = summary_dict(outcome)
    summary["exit_code"] = code = EXIT_FAILED if failure is not None else EXIT_SCORED
    if failure is not None:
        print_failure(err, failure, outcome.run_dir)
    elif args.quiet:
        if not args.json:
            print(f"seed {opts.seed}  final_score {summary['final_score']:.6f}  prequential_bpb "
                  f"{summary['prequential_bpb']:.6f}  manifest {summary['manifest']}")
    else:
        print_summary(human, outcome)
    return code, summary


class ProgressBar:
    """``prism eval``'s live progress, driven by the run's progress events
    (:mod:`~prism_challenge.events`): a bar appears when the ``stream`` stage starts (sized by its
    ``total`` and ``unit``) and advances on each ``batch_scored`` (the stream's tokens consumed
    under a token budget, so it reaches the budget; else bytes), showing ``bpb_so_far``; the
    stages after it (the audit and held-out evaluation, the manifest) each get a line with their
    elapsed time, marked done when they end; the audit + held-out line names the part under way
    (``stage_count``) and counts each part once it ended ("3 re-scored · 8 blind probes · 5
    held-out batches")."""

    AFTER = {"heldout": "audit + held-out", "manifest": "manifest"}

    def __init__(self, console, disable: bool):
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

        self.progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            TextColumn("{task.fields[counts]}"),
            TextColumn("{task.fields[note]}"),
            TimeElapsedColumn(),
            console=console,
            disable=disable,
            transient=False,
            refresh_per_second=2,  # the parent shares the cores with the ranks
        )
        self.task: Any = None
        self.unit = "bytes"
        self.stages: dict[str, Any] = {}
        self.parts: dict[str, dict[str, int]] = {}  # stage -> part -> its count, once the part ended

    def _counts(self) -> str:
        t = self.progress.tasks[self.task]
        return f"{t.completed:,.0f}/{t.total:,.0f} {self.unit}" if t.total else f"{t.completed:,.0f} {self.unit}"

    def __call__(self, event: Any) -> None:
        from prism_challenge.events import BatchScored, StageCount, StageFinished, StageStarted

        if isinstance(event, StageStarted) and event.stage == "stream":
            self.unit = event.unit or "bytes"
            self.task = self.progress.add_task("prequential", total=event.total, counts="", note="bpb -")
            self.progress.update(self.task, counts=self._counts())
            self.progress.start()
        elif isinstance(event, BatchScored) and self.task is not None:
            if self.unit == "tokens" and event.tokens_so_far is not None:
                self.progress.update(self.task, completed=event.tokens_so_far)
            else:
                self.progress.update(self.task, advance=event.targets if self.unit == "tokens" else event.bytes)
            bpb = f"{event.bpb_so_far:.4f}" if event.bpb_so_far is not None else "-"
            self.progress.update(self.task, counts=self._counts(), note=f"bpb [cyan]{bpb}")
        elif isinstance(event, StageStarted) and event.stage in self.AFTER and self.task is not None:
            self.stages[event.stage] = self.progress.add_task(self.AFTER[event.stage], total=None, counts="",
                                                              note="running")
        elif isinstance(event, StageCount) and event.stage in self.stages:
            parts = self.parts.setdefault(event.stage, {})
            if event.done is not None:
                parts[event.part] = event.done
            counts = " · ".join(f"{n:,} {part}" for part, n in parts.items())
            self.progress.update(self.stages[event.stage], counts=counts,
                                 note="running" if event.done is not None else f"{event.part}…")
        elif isinstance(event, StageFinished) and event.stage in self.stages:
            self.progress.update(self.stages[event.stage], total=1, completed=1,
                                 note="done" if event.ok else "[red]failed")

    def stop(self) -> None:
        """Stop the live display (idempotent)."""
        self.progress.stop()
