"""``prism eval``: the whole scored run, in pipeline order.

intake -> locked data (verified) -> feeder socket -> torchrun started (ranks wait) while the
static gates and the parameter cap run -> release (the ranks import the bundle) -> loss records
-> prequential score -> held-out -> run manifest.

The parent process is the trusted side: it alone reads data, counts bytes and writes the
manifest. The runner (untrusted) only ever sees one batch at a time.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import resource
import secrets
import shutil
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from prism_challenge import scratch
from prism_challenge.audit.auditstage import (
    AUDIT_DIR,
    audit_run,
    child_config,
    drop_snapshots,
    empty_artifacts,
    keep_bundle,
    twin_dtypes,
)
from prism_challenge.audit.auditstage import apply as apply_audit
from prism_challenge.intake.bundle import Bundle, BundleError, load_bundle
from prism_challenge.manifest.certificate import CertificateError, load_private_key, user_key, user_key_path
from prism_challenge.data.builtin import default_cache_root, ensure_builtin
from prism_challenge.data.partition import default_salt_path
from prism_challenge.data.manifest import DataError, load_manifest
from prism_challenge.data.refcodes import Background as RefCodes
from prism_challenge.data.stream import train_stream
from prism_challenge.evaluator.feeder import Feeder, FeederResult, StepRecord
from prism_challenge.evaluator.interface import context_values
from prism_challenge.evaluator.audit import describe_refusal, find_refusal
from prism_challenge.evaluator.isolation import Guard, IsolationError
from prism_challenge.evaluator.jail import Jail, diagnose, jail_limits
from prism_challenge.evaluator.launcher import LaunchError, agent_of, check_layout, launch
from prism_challenge.control import CANCELLED_MESSAGE, RunControl
from prism_challenge.events import BatchScored, StageCount
from prism_challenge.failures import KILLED, REPORTED, TOKENIZER, USAGE_STAGE, EvalFailure  # noqa: F401
from prism_challenge.evaluator.gpu import CudaCheck, CudaCheckError, cpu_stack, gpu_count_error, start_cuda_check
from prism_challenge.evaluator.gpu import manifest_record as gpu_record
from prism_challenge.evaluator.sizing import run_sizes
from prism_challenge.score.flops import run_spent
from prism_challenge.intake.frozen import FrozenBundle, freeze
from prism_challenge.audit.heldout import HeldoutError, run_heldout
from prism_challenge.profiles import data_mismatch, manifest_record, prepare_hint
from prism_challenge.evaluator.runner import ENV_SOCKET, ENV_TOKEN
from prism_challenge.research.report import C10D_HOSTNAME_WARNING, strip_launcher_dump
from prism_challenge.options import (  # noqa: F401 - re-exported: the pipeline's settings and defaults
    DEFAULT_HELDOUT_BYTES,
    DEFAULT_IDLE_TIMEOUT_S,
    DEFAULT_MAX_PARAMETERS,
    DEFAULT_RANK_TIMEOUT_S,
    DEFAULT_SEED,
    DEFAULT_SEQ_LEN,
    DEFAULT_THREADS,
    EvalOptions,
)
from prism_challenge.gates.stage import Gated, parameter_cap, static_gates
from prism_challenge.manifest.record import build_manifest, run_budgets, signed_manifest, stream_counts, write_phases
from prism_challenge.manifest.run_manifest import discard_planted, write_run_manifest
from prism_challenge.score.scoring import Score, ScoringError, prequential_score
from prism_challenge.score.scoringprecision import scoring_autocast
from prism_challenge.tokenizers import TokenizerError, reference_tokenizer
from prism_challenge.score.verdict import budget_share, build_verdict

DONE_GRACE_S = 20.0  # after every rank reported DONE, torchrun gets this long to exit
DRAIN_S = 5.0  # after torchrun exited, the feeder gets this long to read the ranks' last frames
WATCHDOG_GRACE_S = 30.0  # past the wall-clock budget, the tree is killed after this long
LOG_TAIL_LINES = 12
SOCKET_PATH_MAX = 100  # a unix socket path, bytes: under sun_path's 108 with room to spare
# The parent shares the cores with the ranks: it wakes rarely (an OMP thread of a rank that
# loses its core stalls every other thread of that rank at the next barrier).
WATCH_INTERVAL_S = 0.25  # the watch loop's period: few wake-ups on cores the ranks compute on
GUARD_INTERVAL_S = 1.0
STATE_NAME = "trained_state.pt"
HELDOUT_BATCH = 8
NO_ISOLATION_WARNING = (
    "--isolation none: the submission ran unsandboxed, with this user's network, files and privileges; "
    "this run is not tamper-resistant and must not be ranked"
)


@dataclass
class EvalOutcome:
    """What ``prism eval`` produced: the manifest (written to ``run_dir``) and the score."""

    run_dir: Path
    manifest: dict[str, Any]
    score: Score | None
    failure: EvalFailure | None = None
    gate_findings: list[Any] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.failure is None


Hooks = dict[str, Callable[..., Any]]


def _resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device not in ("cpu", "cuda"):
        raise EvalFailure(USAGE_STAGE, f"--device {device!r}: must be auto, cpu or cuda")
    if device == "cuda" and not torch.cuda.is_available():
        raise EvalFailure(USAGE_STAGE, "--device cuda: no CUDA device is available")
    return device


def _check_out_dir(run_dir: Path) -> None:
    """Refuse an ``--out`` that is not a directory or not empty (stage ``config``)."""
    if run_dir.exists() or run_dir.is_symlink():
        if not run_dir.is_dir():
            raise EvalFailure(USAGE_STAGE, f"--out {run_dir}: exists and is not a directory")
        if any(run_dir.iterdir()):
            raise EvalFailure(USAGE_STAGE, f"--out {run_dir}: directory exists and is not empty "
                                           "(name a new or empty directory)")


def _new_run_dir(opts: EvalOptions, bundle: Bundle) -> tuple[Path, bool]:
    """Create the run directory; returns it and whether it was created here (not just emptied)."""
    fresh = True
    if opts.out_dir:
        run_dir = Path(opts.out_dir)
        _check_out_dir(run_dir)
        fresh = not run_dir.exists()
    else:
        stamp = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
        run_dir = Path("prism-runs") / f"{stamp}-{bundle.root.name}-{bundle.sha256[:8]}"
        n = 1
        while run_dir.exists():
            n += 1
            run_dir = run_dir.with_name(f"{stamp}-{bundle.root.name}-{bundle.sha256[:8]}-{n}")
    run_dir.mkdir(parents=True, exist_ok=True)
    return run_dir.resolve(), fresh


def _remove_run_dir(run_dir: Path, fresh: bool) -> None:
    """Undo :func:`_new_run_dir` for a run that never started (its bundle was refused)."""
    if fresh:
        shutil.rmtree(run_dir, ignore_errors=True)
        if run_dir.parent.name == "prism-runs":  # the default parent, when this run made it
            try:
                run_dir.parent.rmdir()
            except OSError:  # other runs live there
                pass
        return
    for child in run_dir.iterdir():
        if child.is_dir() and not child.is_symlink():
            shutil.rmtree(child, ignore_errors=True)
        else:
            child.unlink(missing_ok=True)


def _socket_path(run_dir: Path) -> tuple[str, Path | None]:
    """The feeder socket: in the run directory when the path fits, else in a fresh folder of the
    current owner folder (:func:`prism_challenge.scratch.mkdtemp`), else of the process's own
    (under the temp directory: the shortest path)."""
    path = run_dir / "feeder.sock"
    if len(os.fsencode(path)) < SOCKET_PATH_MAX:
        return str(path), None
    tmp = scratch.mkdtemp("prism-")
    if len(os.fsencode(tmp / "feeder.sock")) >= SOCKET_PATH_MAX:
        shutil.rmtree(tmp)
        tmp = scratch.own().mkdtemp("prism-")
    return str(tmp / "feeder.sock"), tmp


def _drop_c10d_warnings(log: Path) -> None:
    """Remove c10d's hostname warning from the runner log: the sandbox's empty network namespace
    resolves no hostname, so every rank's TCPStore client printed it first, on every run."""
    try:
        text = log.read_text(errors="replace")
        if C10D_HOSTNAME_WARNING in text:
            log.write_text("".join(line for line in text.splitlines(keepends=True) if C10D_HOSTNAME_WARNING not in line))
    except OSError:
        pass


def _log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    try:
        text = strip_launcher_dump(path.read_text(errors="replace"))  # torchrun's own dump stays in the log
    except OSError:
        return ""
    return "\n".join(text.rstrip().splitlines()[-lines:])


def evaluate(opts: EvalOptions, control: RunControl | None = None) -> EvalOutcome:
    """Run the whole pipeline for one bundle and write the run manifest (the library's entry
    point, :func:`prism_challenge.api.evaluate`, wraps it: one result type, failure kinds).

    Args:
        opts: the run settings.
        control: the caller's cancel source and progress callback (:mod:`~prism_challenge.control`);
            a cancelled run ends with stage ``cancelled`` and ``"status": "cancelled"``.

    Returns:
        The outcome; ``outcome.failure`` is set (and the manifest says ``"status": "failed"``)
        when the run could not be scored. Failures before a run directory exists raise.

    Raises:
        EvalFailure: the bundle, gates, data or configuration stop the run before it starts
            (a refused bundle's early-launched tree is killed and its run directory removed);
            stage :data:`USAGE_STAGE` for an option that cannot be honoured (``--nproc 9``, an
            ``--out`` that is not an empty directory), checked before the data is touched.
    """
    t_start = time.monotonic()
    control = control or RunControl()
    try:
        check_layout(opts.nproc, opts.nnodes)
    except LaunchError as exc:
        raise EvalFailure(USAGE_STAGE, str(exc)) from None
    if opts.seq_len < 2:
        raise EvalFailure(USAGE_STAGE, f"--seq-len {opts.seq_len}: must be at least 2")
    if opts.isolation not in ("strict", "none"):
        raise EvalFailure(USAGE_STAGE, f"--isolation {opts.isolation!r}: must be strict or none")
    device = _resolve_device(opts.device)
    too_many = gpu_count_error(opts.nproc, device)
    if too_many:
        raise EvalFailure(USAGE_STAGE, too_many)
    if opts.out_dir:  # before the data is built or verified: a bad --out is a usage error
        _check_out_dir(Path(opts.out_dir))
    pin = opts.profile.data if opts.profile is not None else None
    if pin is not None and not opts.data_dir and pin.source != "builtin":
        raise EvalFailure(USAGE_STAGE, f"profile {opts.profile.name} scores {pin.source} data: pass --data DIR, "
                                       f"a directory built with `{prepare_hint(pin)}`")

    # 1. intake: the bundle is frozen into one read-only copy; the gates, the parameter child,
    # every rank and the held-out children use it, and it is checked again after the run
    frozen: FrozenBundle | None = None
    try:
        with control.stage("intake"):
            try:
                frozen = freeze(opts.bundle)
            except BundleError as exc:
                raise EvalFailure("intake", f"{exc.rule}: {exc}") from None
            try:
                bundle = load_bundle(frozen.root)
            except BundleError as exc:
                if opts.run_gates:  # the gates name the broken rule with its file; nothing is launched
                    static_gates(opts, frozen.root)
                raise EvalFailure("intake", f"{exc.rule}: {exc}") from None
        return _run_bundle(opts, bundle, frozen, device, t_start, control)
    finally:
        if frozen is not None:
            frozen.remove()


@dataclass
class _Sandbox:
    """The isolation of one run: the jail every child starts in, and the parent's guard."""

    jail: Jail
    guard: Guard

    @property
    def mode(self) -> str:
        return self.jail.mode

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {**self.jail.summary(), "guard": self.guard.summary()}
        if self.mode == "none":
            out["warning"] = NO_ISOLATION_WARNING
        return out


def _sandbox(opts: EvalOptions, run_dir: Path, artifacts: Path, data_root: Path, bundle: Bundle,
             device: str) -> _Sandbox:
    """Open the jail (raises :class:`EvalFailure` at stage ``isolation`` when strict is impossible)."""
    sizes = run_sizes(opts.nproc, device)
    tasks = sizes.max_processes if opts.max_processes is None else opts.max_processes
    limits = jail_limits(
        device, opts.memory_limit_bytes,
        # RLIMIT_NPROC counts every task of the uid: only meaningful for the dedicated sandbox uid
        max_processes=tasks if opts.isolation == "strict" and os.geteuid() == 0 else None,
        max_file_bytes=opts.max_file_bytes,
        max_open_files=opts.max_open_files,
    )
    hidden = [str(p) for p in _hidden(data_root, run_dir, _key_paths(opts))]
    try:
        jail = Jail.open(opts.isolation, bundle_dir=bundle.root, hidden=hidden, limits=limits, threads=opts.threads,
                         audit=opts.audit_hooks, tmp_bytes=sizes.tmp_bytes, shm_bytes=sizes.shm_bytes)
    except IsolationError as exc:
        raise EvalFailure("isolation", str(exc)) from None
    guard = Guard([artifacts], quota_bytes=opts.artifacts_quota_bytes, uid=jail.uid, max_processes=limits.max_processes,
                  interval_s=GUARD_INTERVAL_S)
    return _Sandbox(jail, guard)


def _hidden(data_root: Path, run_dir: Path, keys: list[Path] | tuple[Path, ...] = ()) -> list[Path]:
    """What no jailed process may see: the data directory, its salt, PRISM's caches, the
    trusted side's copy of the scored state and the signing key (``keys``, :func:`_key_paths`)
    (the sandbox covers them; the audit hook refuses them)."""
    return [data_root, default_salt_path(data_root), default_cache_root(), run_dir / "model", *keys]


def _key_paths(opts: EvalOptions) -> list[Path]:
    """The signing key's file (the user's key: its folder too), to hide from every jailed process."""
    if opts.signing_key_file:
        return [Path(os.path.realpath(opts.signing_key_file))]
    path = user_key_path()
    return [path.parent, path]


def _signer(opts: EvalOptions) -> Ed25519PrivateKey:
    """The key that signs the run's manifest (``opts.signing_key_file``, else the user's own,
    created on first use), loaded before anything is launched.

    Raises:
        EvalFailure: stage :data:`USAGE_STAGE`: the key file is missing, readable by its group or
            others, or not an ed25519 key.
    """
    try:
        return load_private_key(opts.signing_key_file) if opts.signing_key_file else user_key()[0]
    except CertificateError as exc:
        raise EvalFailure(USAGE_STAGE, f"signing key: {exc}") from None


@dataclass
class _Run:
    """One run's shared state, filled in stage by stage (:func:`_run_bundle`): what intake gave,
    what each stage made, and the times the manifest's ``timing`` reads."""

    opts: EvalOptions
    control: RunControl
    bundle: Bundle
    frozen: FrozenBundle
    device: str
    t_start: float
    signing_key: Ed25519PrivateKey
    # the data stage
    tokenizer: Any = None
    data: Any = None
    chunks: Any = None
    profile_record: dict[str, Any] | None = None
    # the launch
    run_dir: Path = Path()
    fresh_dir: bool = False
    artifacts: Path = Path()
    sock_path: str = ""
    sock_tmp: Path | None = None
    config: dict[str, Any] = field(default_factory=dict)
    key: bytes = b""
    feeder: Feeder | None = None
    sandbox: _Sandbox | None = None
    proc: Any = None
    log_path: Path = Path()
    t_launch: float = 0.0
    cuda_check: CudaCheck | None = None
    # the gates and the stream
    gated: Gated = field(default_factory=lambda: Gated([], None, 0.0))
    stack: Any = None
    t_release: float = 0.0
    cpu_release: Any = None
    t_end: float = 0.0
    result: FeederResult | None = None
    killed_by: str | None = None
    harness_killed: bool = False
    # the score and after
    failure: EvalFailure | None = None
    score: Score | None = None
    state_path: Path | None = None
    audit: Any = None
    verdict: Any = None
    reference_codes: Any = None


def _run_bundle(opts: EvalOptions, bundle: Bundle, frozen: FrozenBundle, device: str, t_start: float,
                control: RunControl) -> EvalOutcome:
    """Data, launch (torchrun started before the gates), gates, stream, score, audit and
    held-out, manifest: the stages in order, over one :class:`_Run`.

    torchrun is launched before the static gates and its ranks connect and wait: the runner
    learns which bundle to import only from the configuration the feeder sends once every gate
    passed, so nothing submitted runs in them before then, while the interpreter start and
    ``import torch`` of torchrun's agent and of every rank overlap the gates (the AST gates in
    this process, then the parameter cap in a child). A bundle the gates refuse kills the tree
    and leaves no run directory behind: what the launch made is undone by one
    :class:`~contextlib.ExitStack`, which the release empties (from then on the run directory
    stays, and the stream stage ends the tree itself).
    """
    run = _Run(opts, control, bundle, frozen, device, t_start, _signer(opts))  # a bad key: before any launch
    _load_data(run)
    with contextlib.ExitStack() as undo:
        _launch(run, undo)
        _gates(run)
        undo.pop_all()  # released: the run directory stays, and the stream stage ends the tree
    _release(run)
    total, unit = _stream_total(run)
    with control.stage("stream", total=total, unit=unit, check=False) as mark:  # the tree runs: no raise here
        _stream(run)
        _score(run)
        mark.failed = run.failure is not None
    _save_state(run)
    if run.failure is None:
        refcodes = RefCodes(run.data, run.score.bytes)  # the compressors' code lengths, on a thread meanwhile
        _audit_and_heldout(run)
        _reference_codes(run, refcodes)
    return _write_manifest(run)


def _load_data(run: _Run) -> None:
    """Stage ``data``: the bundle's reference tokenizer and the locked data, verified before
    anything is launched; the profile's record.

    Raises:
        EvalFailure: stage ``intake`` (an unknown tokenizer), ``data`` (a bad data directory) or
            :data:`USAGE_STAGE` (a tokenizer the profile does not allow).
    """
    opts = run.opts
    with run.control.stage("data"):
        try:
            run.tokenizer = reference_tokenizer(run.bundle.tokenizer)
        except TokenizerError as exc:
            raise EvalFailure("intake", f"prism.yaml: {exc}") from None
        try:
            data_dir = Path(opts.data_dir) if opts.data_dir else ensure_builtin()
            run.data = load_manifest(data_dir)
            run.data.verify("train")
            run.chunks = train_stream(run.data, run.tokenizer)
        except DataError as exc:
            raise EvalFailure("data", str(exc)) from None
        run.profile_record = _check_profile(opts, run.tokenizer.name, run.data)
    run.control.check()


def _launch(run: _Run, undo: contextlib.ExitStack) -> None:
    """The run directory, the feeder's socket, the sandbox, torchrun and (on CUDA) the CUDA
    check, each with its undoing pushed on ``undo`` (run only if a stage before the release
    fails).

    Raises:
        EvalFailure: stage ``isolation`` (no sandbox), or :data:`USAGE_STAGE` (``--out``).
    """
    opts, bundle = run.opts, run.bundle
    run.run_dir, run.fresh_dir = _new_run_dir(opts, bundle)
    undo.callback(_remove_run_dir, run.run_dir, run.fresh_dir)
    run.artifacts = run.run_dir / "artifacts"
    run.artifacts.mkdir()
    run.sock_path, run.sock_tmp = _socket_path(run.run_dir)
    if run.sock_tmp is not None:
        undo.callback(shutil.rmtree, run.sock_tmp, ignore_errors=True)
    run.config = {
        **_model_config(opts, bundle, run.tokenizer, run.device),
        "artifacts_dir": str(run.artifacts),
        "hidden": [str(p) for p in _hidden(run.data.root, run.run_dir, _key_paths(opts))],
        "token_budget": opts.token_budget,
        "step_budget": opts.step_budget,
        "training": [bundle.training.module, bundle.training.symbol],
        "audit": opts.audited_batches > 0,  # rank 0 keeps each batch's weights until the feeder's answer
        "profile_phases": opts.profile_phases,  # benchmarks: evaluator/phases.py
    }
    run.key = run_secret(opts)  # after intake; never sent to the sandbox
    run.feeder = feeder = Feeder(
        run.sock_path,
        run.chunks,
        run.config,
        world_size=opts.nproc,
        vocab_size=run.tokenizer.vocab_size,
        token_budget=opts.token_budget,
        byte_budget=opts.byte_budget,
        step_budget=opts.step_budget,
        wall_clock_budget=opts.wall_clock_budget,
        on_record=_on_record(run),
        # the scored model's state: 16 bytes per capped element (float64, a tied tensor twice)
        max_state_bytes=16 * opts.max_parameters + (1 << 20),
        probe_key=run.key,
        audit_dir=run.run_dir / AUDIT_DIR,
        audited_batches=opts.audited_batches,
    )
    undo.callback(feeder.close)
    run.sandbox = sandbox = _sandbox(opts, run.run_dir, run.artifacts, run.data.root, bundle, run.device)
    undo.callback(sandbox.jail.close)  # the cgroups of what it started, once the kills below ran
    undo.callback(sandbox.jail.kill_all)  # every child it started: torchrun's tree, the CUDA check
    undo.callback(sandbox.guard.kill)
    run.control.on_cancel(sandbox.jail.kill_all)  # torchrun's tree and every bounded child, at once
    run.control.on_cancel(sandbox.guard.kill)  # and whatever runs as the sandbox uid
    run.log_path = run.run_dir / "logs" / "runner.log"
    feeder.start(release=False)
    run.t_launch = time.monotonic()
    run.proc = launch(opts.nproc, {ENV_SOCKET: run.sock_path, ENV_TOKEN: feeder.token}, run.log_path,
                      jail=sandbox.jail, cwd=run.artifacts, socket_dir=Path(run.sock_path).parent, warm=opts.warm_ranks)
    undo.callback(run.proc.kill)
    run.cuda_check = start_cuda_check(sandbox.jail, opts.nproc) if run.device == "cuda" else None  # meanwhile


def _on_record(run: _Run) -> Callable[[StepRecord], None]:
    """The feeder's ``on_record``: each scored batch as a :class:`~prism_challenge.events.BatchScored`
    event, with the stream's running totals (called on the feeder's thread)."""
    running: dict[str, float] = {"nats": 0.0, "bytes": 0, "targets": 0, "batches": 0}

    def recorded(rec: StepRecord) -> None:
        running["nats"] += rec.nats
        running["bytes"] += rec.bytes
        running["targets"] += rec.targets
        running["batches"] += 1
        run.control.emit(BatchScored(
            batch=int(running["batches"]) - 1, targets=rec.targets, bytes=rec.bytes, nats=rec.nats,
            targets_so_far=int(running["targets"]), bytes_so_far=int(running["bytes"]), nats_so_far=running["nats"],
            bpb_so_far=running["nats"] / math.log(2) / running["bytes"] if running["bytes"] else None,
            tokens_so_far=run.feeder.result.tokens_consumed))  # set by the feeder just before this call

    return recorded


def _gates(run: _Run) -> None:
    """Stage ``gates`` (while torchrun starts): the static gates, then the parameter cap in a
    jailed child; then the CUDA check's answer.

    Raises:
        EvalFailure: stage ``gates`` (blocking findings), ``intake`` (the bundle changed while
            the gates ran) or ``isolation`` (CUDA does not start in the sandbox).
    """
    opts, jail = run.opts, run.sandbox.jail
    if opts.run_gates:
        with run.control.stage("gates"):
            if opts.static_gates:
                run.gated = static_gates(opts, run.bundle.root)
                if run.gated.bundle_sha256 != run.bundle.sha256:
                    raise EvalFailure("intake", f"{opts.bundle}: the bundle's files changed while the gates ran")
            run.gated = parameter_cap(opts, run.bundle, run.tokenizer.vocab_size, run.gated, jail,
                                        context_values(run.config, opts.nproc))
        run.control.check()
    run.stack = _cuda_stack(run.cuda_check, jail)


def _stream_total(run: _Run) -> tuple[int | None, str]:
    """The progress bar's total and unit: the token budget, else the bytes the stream can score."""
    opts = run.opts
    if opts.token_budget:
        return opts.token_budget, "tokens"
    total = int(run.data.split("train").get("utf8_bytes") or 0) or None
    if opts.byte_budget:
        total = min(total, opts.byte_budget) if total else opts.byte_budget
    return total, "bytes"


def _release(run: _Run) -> None:
    """Every gate passed: the feeder sends the ranks their configuration, and the run starts
    (the wall-clock budget and ``timing`` count from here)."""
    run.feeder.release()
    run.t_release = run.feeder.released_at or time.monotonic()
    run.cpu_release = resource.getrusage(resource.RUSAGE_SELF)


def _stream(run: _Run) -> None:
    """The stream: watch the ranks to the end (budgets, stalls, cancel), then end the tree and
    read the feeder's result. Sets ``run.result``, ``killed_by`` and ``harness_killed``; never
    raises for the run's own failure (:func:`_score` judges it)."""
    opts, feeder, proc, sandbox = run.opts, run.feeder, run.proc, run.sandbox
    try:
        run.killed_by = _watch(opts, proc, feeder, sandbox.guard, run.t_release, run.control)
    finally:
        if proc.poll() is not None:  # torchrun ended by itself: read what its ranks wrote last
            feeder.drain(DRAIN_S)
        feeder.stopping.set()  # connections the kill closes are not the runner's failure
        run.harness_killed = proc.poll() is None
        if run.harness_killed:
            proc.kill()
        proc.close_log()  # the ranks' last output, the log capped (outputcap)
        sandbox.guard.kill()
        sandbox.jail.close()
        run.result = feeder.finish()
        if run.sock_tmp is not None:
            shutil.rmtree(run.sock_tmp, ignore_errors=True)
    run.t_end = time.monotonic()
    _drop_c10d_warnings(run.log_path)
    if opts.profile_phases:
        write_phases(run.run_dir / "logs" / "phases.json", run.result, run.cpu_release, run.t_end - run.t_release)


def _score(run: _Run) -> None:
    """Score what was scored: why the run cannot be scored (:func:`_judge`, the frozen bundle's
    check) in ``run.failure``, else its prequential score in ``run.score``. An unscored run
    keeps no weights: the audit's snapshots go."""
    opts, result, proc = run.opts, run.result, run.proc
    if run.control.cancelled:  # the watcher killed the tree: whatever the feeder saw after, it was the kill
        run.killed_by = "cancelled"
    outside = None if run.harness_killed or run.killed_by == "cancelled" else _signal_of(proc.poll())
    failure = _judge(opts, result, run.killed_by, proc, run.log_path, run.sandbox.jail, outside)
    changed = run.frozen.changes()
    if changed:  # the ranks imported something other than what the gates read and the manifest names
        failure = EvalFailure("contract", f"the frozen bundle changed during the run: {', '.join(changed[:5])}")
    if failure is None:
        try:
            run.score = prequential_score(result.steps)
        except ScoringError as exc:
            failure = EvalFailure("scoring", str(exc))
    run.failure = failure
    if failure is not None:
        drop_snapshots(run.run_dir)


def _save_state(run: _Run) -> None:
    """The scored model's state, for the held-out stage (``model/``, which no jailed process sees)."""
    if run.result.state and run.failure is None:
        run.state_path = run.run_dir / "model" / STATE_NAME
        run.state_path.parent.mkdir(exist_ok=True)
        torch.save(run.result.state, run.state_path)


def _reference_codes(run: _Run, refcodes: RefCodes) -> None:
    """The reference compressors' code lengths of the scored bytes, once their thread is done;
    a run cancelled during the held-out stage or while they ran fails ``cancelled``."""
    control = run.control
    if control.cancelled:  # cancelled during the held-out stage
        run.failure = EvalFailure("cancelled", CANCELLED_MESSAGE)
        return
    run.reference_codes = refcodes.result(lambda: control.cancelled)
    if control.cancelled:  # cancelled while the compressors ran
        run.failure = EvalFailure("cancelled", CANCELLED_MESSAGE)


def _audit_and_heldout(run: _Run) -> None:
    """Stage ``heldout`` of a scored run: the audit (re-scoring, blind probes), then the
    held-out evaluation, then the verdict, in ``run.audit`` and ``run.verdict`` (the verdict
    stays ``None`` if the run is cancelled first).

    Each stage gets the artifacts folder empty and new
    (:func:`~prism_challenge.audit.auditstage.empty_artifacts`, in :func:`audit_run` and
    :func:`_heldout`; every child empties it again before it is fed), so not even the folder's
    own metadata passes from an audit child to a held-out child. The jail is closed at the end:
    no spare child outlives the run."""
    opts, control, jail, result, score = run.opts, run.control, run.sandbox.jail, run.result, run.score
    try:
        with control.stage("heldout", check=False) as mark:
            keep_bundle(run.frozen.root, run.run_dir)  # a cancel here still writes the manifest (check=False)
            if opts.audited_batches > 0:
                control.emit(StageCount(stage="heldout", part="re-scored"))
                run.audit = audit = audit_run(jail=jail, config=child_config(
                    _model_config(opts, run.bundle, run.tokenizer, run.device), run.config, opts.nproc,
                    list(jail.hidden)), result=result, world_size=opts.nproc, data=run.data, tokenizer=run.tokenizer,
                    key=run.key, artifacts=run.artifacts, run_dir=run.run_dir, timeout_s=opts.heldout_timeout,
                    audited_batches=opts.audited_batches)
                control.emit(StageCount(stage="heldout", part="re-scored", done=len(audit.batches)))
                control.emit(StageCount(stage="heldout", part="blind probes", done=audit.blind_probes))
            if opts.heldout_bytes > 0:
                control.emit(StageCount(stage="heldout", part="held-out batches"))
            heldout, heldout_error = _heldout(opts, jail, run.bundle, run.data, run.tokenizer, run.device, result,
                                              run.state_path, context_values(run.config, opts.nproc), key=run.key)
            if heldout is not None:
                control.emit(StageCount(stage="heldout", part="held-out batches", done=int(heldout["batches"])))
            verdict = build_verdict(score.prequential_bpb, result.steps, run.tokenizer.vocab_size, heldout,
                                    heldout_error=heldout_error, policy=opts.policy, stop_reason=result.stop_reason,
                                    covered=budget_share(stream_counts(result), run_budgets(opts)))
            if heldout_error is not None and heldout_error.startswith("contract:"):
                # the trained model broke the contract on held-out text (e.g. it is not causal): zeroed
                verdict = dataclasses.replace(verdict, anti_cheat_multiplier=0.0, final_score=0.0,
                                              flags=[*verdict.flags, "heldout_contract"])
            run.verdict = apply_audit(verdict, run.audit) if run.audit is not None else verdict
            mark.failed = control.cancelled
    finally:
        jail.close()  # no spare child (Jail.warm) outlives the run


def _write_manifest(run: _Run) -> EvalOutcome:
    """Stage ``manifest``: the run's record (:func:`_manifest`, with its ``timing``, isolation,
    compute, verdict, audit and reference code lengths), signed and written to the run
    directory; the outcome."""
    opts, result, gated = run.opts, run.result, run.gated
    t_done = time.monotonic()
    planted = discard_planted(run.artifacts)
    manifest = build_manifest(opts, run.bundle, run.data, run.tokenizer, run.device, result, run.score, run.failure,
                         gated.findings, gated.parameter_count, planted, run.state_path, timing=_timing(run, t_done))
    manifest["profile"] = run.profile_record
    manifest["isolation"] = run.sandbox.summary()
    manifest["compute"]["gpu"] = gpu_record(run.stack, result.done)
    manifest["compute"].update(run_spent(  # FLOPs, wall time, device-seconds (flops)
        run.audit, result.steps, run_wall_s=t_done - run.t_start, world_size=opts.nproc,
        stream_wall_s=(result.last_record_at - run.t_release) if result.last_record_at else None))
    manifest["verdict"] = run.verdict.to_dict() if run.verdict is not None else None
    manifest["audit"] = run.audit.to_dict() if run.audit is not None else None
    manifest["reference_codes"] = run.reference_codes
    manifest["run_secret"] = run.key.hex()  # revealed now that the run has ended: anyone can re-derive the draws
    with run.control.stage("manifest", check=False):
        manifest = signed_manifest(manifest, run.signing_key)
        write_run_manifest(run.run_dir, manifest)
    return EvalOutcome(run.run_dir, manifest, run.score, run.failure, gated.findings)


def _timing(run: _Run, t_done: float) -> dict[str, Any]:
    """The manifest's ``timing``: seconds between the run's marks (``time.monotonic``; ``t_done``:
    the end of the held-out stage), and the last record's Unix time."""
    result, t_launch, t_release, t_start = run.result, run.t_launch, run.t_release, run.t_start
    last, first, ready = result.last_record_at, result.first_batch_at, result.ready_at
    return {
        "gates_s": run.gated.seconds,
        "launch_to_release_s": t_release - t_launch,
        "launch_to_ready_s": (ready - t_launch) if ready else None,
        "launch_to_first_batch_s": (first - t_launch) if first else None,
        "launch_to_last_record_s": (last - t_launch) if last else None,
        "release_to_first_batch_s": (first - t_release) if first else None,
        "release_to_last_record_s": (last - t_release) if last else None,
        "start_to_last_record_s": (last - t_start) if last else None,
        "last_record_unix": (time.time() - (time.monotonic() - last)) if last else None,
        "after_stream_s": (run.t_end - last) if last else None,
        "heldout_s": t_done - run.t_end,
        "wall_s": t_done - t_start,
    }


def _cuda_stack(check: CudaCheck | None, jail: Jail) -> dict[str, Any]:
    """The GPU stack the CUDA check child saw inside the sandbox (:mod:`~prism_challenge.evaluator.gpu`),
    or the CPU record when there is no check.

    Raises:
        EvalFailure: stage ``isolation``: CUDA does not initialise there, with its error.
    """
    if check is None:
        return cpu_stack()
    try:
        return check.result()
    except CudaCheckError as exc:
        who = f" as the sandbox uid {jail.uid}" if jail.uid is not None else ""
        raise EvalFailure("isolation", f"CUDA does not initialise inside the sandbox{who}: {exc}") from None


def _check_profile(opts: EvalOptions, tokenizer: str, data) -> dict[str, Any] | None:
    """The manifest's ``profile`` entry; a data directory that differs from the profile's pin
    adds ``data`` to the overridden fields (``data_mismatch`` says how).

    Raises:
        EvalFailure: stage ``config``: the bundle's tokenizer is not one the profile allows.
    """
    profile = opts.profile
    if profile is None:
        return None
    if tokenizer not in profile.tokenizers:
        raise EvalFailure(USAGE_STAGE, f"profile {profile.name}: tokenizer {tokenizer!r} (prism.yaml) is not "
                                       f"allowed; allowed: {', '.join(profile.tokenizers)}", cause=TOKENIZER)
    overridden = list(opts.profile_overridden)
    mismatch = data_mismatch(profile.data, data.data, data.sha256)
    if mismatch and "data" not in overridden:
        overridden = sorted([*overridden, "data"])
    record = manifest_record(profile, overridden)
    if mismatch:
        record["data_mismatch"] = mismatch
    return record


def _watch(opts: EvalOptions, proc, feeder: Feeder, guard: Guard | None, t_release: float,
           control: RunControl) -> str | None:
    """Wait for the run to end; returns why the parent stopped it early (or ``None``).

    ``t_release``: when the run started (the gates' release); the wall-clock budget counts from it.
    """
    while proc.poll() is None:
        feeder.wake.wait(WATCH_INTERVAL_S)  # a failure or the last DONE wakes it at once
        feeder.wake.clear()
        now = time.monotonic()
        if control.cancelled:
            return "cancelled"
        if feeder.failed.is_set():
            time.sleep(0.5)  # let the runner finish writing its report, then stop the tree
            return "failure"
        if opts.wall_clock_budget is not None and now - t_release > opts.wall_clock_budget + WATCHDOG_GRACE_S:
            return "watchdog"
        never = feeder.check_first_batch(opts.idle_timeout)
        if never is not None:  # nothing scored and nothing coming: fail now, not when the budget ends
            feeder.fail("contract", f"{never} [--idle-timeout {opts.idle_timeout:g} s]")
            return "failure"
        stalled = feeder.check_stall(opts.rank_timeout if opts.nproc > 1 else opts.idle_timeout,
                                     first_timeout=opts.idle_timeout)  # a first compile is no stall
        if stalled is not None:
            stage, message, rank = stalled
            if stage == "stalled":  # one rank stuck after its last batch: stop, score what was scored
                return "stalled"
            feeder.fail(stage, f"{message} [--rank-timeout {opts.rank_timeout:g} s]", rank=rank)
            return "failure"
        reason = guard.check(now) if guard is not None else None
        if reason is not None:
            feeder.fail("resources", reason)
            return "failure"
        if feeder.all_done():
            deadline = now + DONE_GRACE_S
            while proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.02)
            return None
    return None


def _judge(opts: EvalOptions, result: FeederResult, killed_by: str | None, proc, log_path: Path,
           jail: Jail, outside_signal: int | None = None) -> EvalFailure | None:
    """Why the run cannot be scored, or ``None`` (a watchdog or stall stop is scored on what was scored).

    The audit hook's refusal (in the ranks' log) comes first: a rank it stopped also closed its
    socket, which the feeder reports as a lost connection. A cancelled run is ``cancelled``; a
    torchrun the harness did not stop that ended on a signal (``outside_signal``) was killed from
    outside (cause ``killed``); a failure the runner reported from inside a rank has cause
    ``reported``."""
    if killed_by == "cancelled":
        return EvalFailure("cancelled", CANCELLED_MESSAGE)
    if outside_signal is not None:
        return EvalFailure("runner", f"{_agent_name(opts)} ended on signal {outside_signal} that the harness did not send: "
                                     "the run was killed from outside", _log_tail(log_path), cause=KILLED)
    refusal = find_refusal(_log_tail(log_path, 10_000)) if proc.poll() not in (0, None) or result.error else None
    if refusal is not None:
        return EvalFailure("contract", describe_refusal(refusal), _log_tail(log_path))
    if result.error is not None:  # a limit reached is named as such, not as the loop's error or a lost rank
        message = str(result.error.get("message", ""))
        lost = "closed" in message or "connection" in message.lower()
        kind = diagnose(proc.poll() if lost else None, _log_tail(log_path, 200) if lost else message, jail.limits)[0]
        if kind.startswith(("memory:", "tasks:")):
            return EvalFailure("resources", kind if lost else f"{kind}: {message}", _log_tail(log_path))
    if result.error is not None:
        err = result.error
        return EvalFailure(err["stage"], err["message"], err.get("traceback") or _log_tail(log_path),
                           cause=REPORTED if err.get("origin") == "runner" else str(err.get("cause") or ""))
    if killed_by == "watchdog":
        result.stop_reason = "wall_clock_budget"
    elif killed_by == "stalled":
        result.stop_reason = "stalled"
    elif len(result.done) < opts.nproc:
        return EvalFailure(
            "runner",
            f"the run ended without a report from rank(s) "
            f"{sorted(set(range(opts.nproc)) - set(result.done))} ({_agent_name(opts)} exit code {proc.proc.returncode})",
            _log_tail(log_path),
        )
    counts = [d.get("parameter_count") for d in result.done.values()]
    over = [c for c in counts if isinstance(c, int) and c > opts.max_parameters]
    if over:  # the runner refuses this itself; the trusted side checks its report too
        return EvalFailure("contract", f"the scored model holds {max(over):,} unique parameter and buffer elements, "
                                       f"over the cap of {opts.max_parameters:,}")
    if not result.steps and result.stop_reason == "wall_clock_budget":
        return EvalFailure("budget", f"no batch was scored before the wall-clock budget of "
                                     f"{opts.wall_clock_budget:g} s ran out (counted from the gates' release)")
    if not result.steps:
        return EvalFailure("contract", "no batch was scored: the loop never iterated ctx.iter_train_batches(...)")
    return None


def _agent_name(opts: EvalOptions) -> str:
    """The launcher's agent in messages: ``torchrun`` or ``the single-rank agent``."""
    return "torchrun" if agent_of(opts.nproc, opts.warm_ranks) == "torchrun" else "the single-rank agent"


EXTERNAL_SIGNALS = (signal.SIGKILL, signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)


def _signal_of(returncode: int | None) -> int | None:
    """The signal that ended the launcher's process (``-N`` from Python, ``128 + N`` from a
    sandbox's init or a shell that reports its child's signal), or ``None``. The ranks cannot
    signal it (the audit hook refuses ``os.kill``), and a rank that dies makes torchrun, or the
    single-rank agent, exit 1."""
    if returncode is None:
        return None
    sig = -returncode if returncode < 0 else returncode - 128 if returncode > 128 else 0
    return sig if sig in EXTERNAL_SIGNALS else None


def run_secret(opts: EvalOptions) -> bytes:
    """The run's secret (32 bytes): ``opts.run_secret`` when given (to repeat a run whose
    manifest revealed it), else fresh from :func:`secrets.token_bytes`. Nothing else: no data
    directory, salt, path or bundle hash enters it, so no one can compute it before the run.
    It keys the causality probes, the audit schedule and the blind probes; it stays in this
    process (never in a configuration, environment or file the sandbox can read) until the
    manifest reveals it once the run has ended."""
    return opts.run_secret if opts.run_secret is not None else secrets.token_bytes(32)


def _model_config(opts: EvalOptions, bundle: Bundle, tokenizer, device: str) -> dict[str, Any]:
    """What both the runner and the held-out child need to build the model the same way."""
    return {
        "seed": opts.seed,
        "threads": opts.threads,
        "vocab_size": tokenizer.vocab_size,
        "tokenizer": tokenizer.name,
        "sequence_length": opts.seq_len,
        "max_parameters": opts.max_parameters,
        "device": device,
        "bundle_root": str(bundle.root),
        "architecture": [bundle.architecture.module, bundle.architecture.symbol],
        "scoring_autocast": scoring_autocast(opts, bundle)[0],
    }


def _heldout(opts: EvalOptions, jail: Jail, bundle: Bundle, data, tokenizer, device: str,
             result: FeederResult, state_path: Path | None,
             context: dict[str, Any] | None = None,
             key: bytes | None = None) -> tuple[dict[str, Any] | None, str | None]:
    """The held-out figures, or why there are none. ``context``: the run's context values
    (the children see them, and the artifacts folder empty); ``key``: the run's secret (the
    blind probe's draws; it stays in this process)."""
    if opts.heldout_bytes <= 0:
        return None, "disabled (--heldout-bytes 0)"
    if "val" not in (data.data.get("splits") or {}):
        return None, f"the data directory {data.root} has no val split"
    if state_path is None:
        return None, "the run produced no scored model state"
    seq_len = result.shape[1] if result.shape else opts.seq_len
    config = {
        **_model_config(opts, bundle, tokenizer, device),
        "data_dir": str(data.root),
        "split": "val",
        "max_bytes": opts.heldout_bytes,
        "batch_size": HELDOUT_BATCH,
        "seq_len": seq_len,
        "state_path": str(state_path),
        "twin_dtypes": twin_dtypes(state_path.parent.parent),
    }
    if context is not None:
        config["context"] = context
    try:
        if context is None:
            return run_heldout(config, timeout_s=opts.heldout_timeout, jail=jail, key=key), None
        with empty_artifacts(Path(str(context["artifacts_dir"]))):
            return run_heldout(config, timeout_s=opts.heldout_timeout, jail=jail, key=key), None
    except (HeldoutError, IsolationError, DataError) as exc:
        return None, _one_line(str(exc), state_path.parent.parent / "logs" / "heldout.log")


HELDOUT_HINTS = {
    "load:": "the trained state does not load into build_model(ctx)'s module: pass that module (or its "
             "torch.compile wrapper) to ctx.iter_train_batches, and keep the parameter names build_model makes",
    "build:": "build_model(ctx) fails or differs in the held-out process: it must build the same module every call",
    "timeout:": "the held-out forward passes are too slow for --heldout-bytes; lower it",
}
HELDOUT_LINE_CHARS = 240


def _one_line(error: str, log: Path) -> str:
    """A held-out error as one line plus a hint; the whole text goes to ``log`` (the summary
    and the manifest's ``heldout_error`` keep the line, the log keeps, e.g., every missing key)."""
    lines = error.strip().splitlines() or ["unknown error"]
    line = lines[0] if len(lines[0]) <= HELDOUT_LINE_CHARS else lines[0][:HELDOUT_LINE_CHARS] + "..."
    hint = next((h for prefix, h in HELDOUT_HINTS.items() if line.startswith(prefix)), None)
    try:
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_text(error.rstrip() + "\n")
        where = f" (full error: {log})" if len(lines) > 1 or line != lines[0] else ""
    except OSError:
        where = ""
    return line + (f"; hint: {hint}" if hint else "") + where


