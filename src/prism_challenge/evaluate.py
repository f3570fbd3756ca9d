"""``prism eval``: the whole scored run, in pipeline order.

intake + static gates -> locked data (verified) -> feeder socket -> torchrun (runner per rank)
-> loss records -> prequential score -> run manifest.

The parent process is the trusted side: it alone reads data, counts bytes and writes the
manifest. The runner (untrusted) only ever sees one batch at a time.
"""

from __future__ import annotations

import os
import platform
import resource
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from prism_challenge import __version__
from prism_challenge.bundle import Bundle, BundleError, load_bundle
from prism_challenge.data.builtin import ensure_builtin
from prism_challenge.data.manifest import DataError, load_manifest
from prism_challenge.data.stream import train_stream
from prism_challenge.evaluator.feeder import Feeder, FeederResult, StepRecord
from prism_challenge.evaluator.launcher import LaunchError, check_layout, launch
from prism_challenge.evaluator.runner import ENV_SOCKET, ENV_TOKEN
from prism_challenge.run_manifest import SCHEMA, discard_planted, write_run_manifest
from prism_challenge.scoring import Score, ScoringError, curve, prequential_score
from prism_challenge.tokenizers import TokenizerError, reference_tokenizer

DEFAULT_SEED = 1234
DEFAULT_SEQ_LEN = 256
DEFAULT_MAX_PARAMETERS = 150_000_000
DEFAULT_THREADS = 2
DONE_GRACE_S = 20.0  # after every rank reported DONE, torchrun gets this long to exit
WATCHDOG_GRACE_S = 30.0  # past the wall-clock budget, the tree is killed after this long
LOG_TAIL_LINES = 12
DEFAULT_RANK_TIMEOUT_S = 120.0  # a rank silent this long while another rank is ahead fails the run
STATE_NAME = "trained_state.pt"


@dataclass
class EvalOptions:
    """Settings of one scored run (the challenge's side: data, seed, order, budgets).

    Budgets: ``token_budget`` (stream tokens), ``step_budget`` (global batches),
    ``wall_clock_budget`` (seconds from launch; graceful: the stream stops and what was scored
    is scored).
    """

    bundle: str
    data_dir: str | None = None
    out_dir: str | None = None
    seed: int = DEFAULT_SEED
    seq_len: int = DEFAULT_SEQ_LEN
    token_budget: int | None = None
    step_budget: int | None = None
    wall_clock_budget: float | None = None
    nproc: int = 1
    nnodes: int = 1
    device: str = "auto"
    threads: int = DEFAULT_THREADS
    max_parameters: int = DEFAULT_MAX_PARAMETERS
    run_gates: bool = True
    rank_timeout: float = DEFAULT_RANK_TIMEOUT_S


class EvalFailure(RuntimeError):
    """A run that could not be scored; ``stage`` names where it stopped."""

    def __init__(self, stage: str, message: str, detail: str = ""):
        super().__init__(f"{stage}: {message}")
        self.stage, self.message, self.detail = stage, message, detail


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
        raise EvalFailure("config", f"--device {device!r}: must be auto, cpu or cuda")
    if device == "cuda" and not torch.cuda.is_available():
        raise EvalFailure("config", "--device cuda: no CUDA device is available")
    return device


def _new_run_dir(opts: EvalOptions, bundle: Bundle) -> Path:
    if opts.out_dir:
        run_dir = Path(opts.out_dir)
        if run_dir.exists() and any(run_dir.iterdir()):
            raise EvalFailure("config", f"--out {run_dir}: directory exists and is not empty")
    else:
        stamp = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
        run_dir = Path("prism-runs") / f"{stamp}-{bundle.root.name}-{bundle.sha256[:8]}"
        n = 1
        while run_dir.exists():
            n += 1
            run_dir = run_dir.with_name(f"{stamp}-{bundle.root.name}-{bundle.sha256[:8]}-{n}")
    run_dir.mkdir(parents=True, exist_ok=True)
    return run_dir.resolve()


def _socket_path(run_dir: Path) -> tuple[str, Path | None]:
    """The feeder socket: in the run directory when the path fits, else in a short temp dir."""
    path = run_dir / "feeder.sock"
    if len(os.fsencode(path)) < 100:
        return str(path), None
    tmp = Path(tempfile.mkdtemp(prefix="prism-"))
    return str(tmp / "feeder.sock"), tmp


def _log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.rstrip().splitlines()[-lines:])


def evaluate(opts: EvalOptions, on_start: Callable[[dict[str, Any]], None] | None = None,
             on_record: Callable[[StepRecord, Score | None], None] | None = None) -> EvalOutcome:
    """Run the whole pipeline for one bundle and write the run manifest.

    Args:
        opts: the run settings.
        on_start: called once the stream is about to start, with ``{"total": int | None,
            "unit": "tokens" | "bytes"}`` for a progress display.
        on_record: called with each scored step and the running score.

    Returns:
        The outcome; ``outcome.failure`` is set (and the manifest says ``"status": "failed"``)
        when the run could not be scored. Failures before a run directory exists raise.

    Raises:
        EvalFailure: the bundle, gates, data or configuration stop the run before launch.
    """
    t_start = time.monotonic()
    try:
        check_layout(opts.nproc, opts.nnodes)
    except LaunchError as exc:
        raise EvalFailure("config", str(exc)) from None
    if opts.seq_len < 2:
        raise EvalFailure("config", f"--seq-len {opts.seq_len}: must be at least 2")
    device = _resolve_device(opts.device)

    # 1. intake and static gates
    findings: list[Any] = []
    param_count_gate = None
    cleanup: Callable[[], None] = lambda: None
    t_gates = time.monotonic()
    try:
        if opts.run_gates:
            from prism_challenge.gates import run_gates

            report = run_gates(
                opts.bundle,
                max_parameters=opts.max_parameters,
                nproc=opts.nproc,
                nnodes=opts.nnodes,
                seq_len=opts.seq_len,
            )
            findings = list(report.findings)
            param_count_gate = report.param_count
            if report.blocking:
                report.cleanup()
                raise EvalFailure(
                    "gates",
                    f"{sum(f.blocking for f in findings)} blocking finding(s); run `prism check` for the list",
                    "\n".join(f"{f.file}:{f.line}:{f.col}: {f.rule}: {f.message}" for f in findings if f.blocking),
                )
            bundle = report.bundle
            cleanup = report.cleanup
        else:
            bundle = load_bundle(opts.bundle)
    except BundleError as exc:
        raise EvalFailure("intake", str(exc)) from None
    gates_s = time.monotonic() - t_gates
    try:
        return _run_bundle(opts, bundle, device, findings, param_count_gate, gates_s, t_start, on_start, on_record)
    finally:
        cleanup()


def _run_bundle(opts: EvalOptions, bundle: Bundle, device: str, findings: list[Any], param_count_gate: int | None,
                gates_s: float, t_start: float, on_start, on_record) -> EvalOutcome:
    """Stages after the gates: data, feeder, torchrun, scoring, manifest."""

    # 2. tokenizer and locked data
    try:
        tokenizer = reference_tokenizer(bundle.tokenizer)
    except TokenizerError as exc:
        raise EvalFailure("intake", f"prism.yaml: {exc}") from None
    try:
        data_dir = Path(opts.data_dir) if opts.data_dir else ensure_builtin()
        data = load_manifest(data_dir)
        data.verify("train")
    except DataError as exc:
        raise EvalFailure("data", str(exc)) from None

    # 3. run directory, feeder, torchrun
    run_dir = _new_run_dir(opts, bundle)
    artifacts = run_dir / "artifacts"
    artifacts.mkdir()
    sock_path, sock_tmp = _socket_path(run_dir)
    config = {
        "seed": opts.seed,
        "threads": opts.threads,
        "vocab_size": tokenizer.vocab_size,
        "tokenizer": tokenizer.name,
        "sequence_length": opts.seq_len,
        "max_parameters": opts.max_parameters,
        "device": device,
        "artifacts_dir": str(artifacts),
        "token_budget": opts.token_budget,
        "step_budget": opts.step_budget,
        "bundle_root": str(bundle.root),
        "architecture": [bundle.architecture.module, bundle.architecture.symbol],
        "training": [bundle.training.module, bundle.training.symbol],
    }
    running: dict[str, float] = {"nats": 0.0, "bytes": 0}

    def _recorded(rec: StepRecord) -> None:
        running["nats"] += rec.nats
        running["bytes"] += rec.bytes
        if on_record is not None:
            on_record(rec, running)

    feeder = Feeder(
        sock_path,
        train_stream(data, tokenizer),
        config,
        world_size=opts.nproc,
        vocab_size=tokenizer.vocab_size,
        token_budget=opts.token_budget,
        step_budget=opts.step_budget,
        wall_clock_budget=opts.wall_clock_budget,
        on_record=_recorded,
    )
    if on_start is not None:
        if opts.token_budget:
            on_start({"total": opts.token_budget, "unit": "tokens"})
        else:
            on_start({"total": int(data.split("train").get("utf8_bytes") or 0) or None, "unit": "bytes"})
    log_path = run_dir / "logs" / "runner.log"
    feeder.start()
    t_launch = time.monotonic()
    proc = launch(
        opts.nproc,
        {ENV_SOCKET: sock_path, ENV_TOKEN: feeder.token},
        log_path,
        threads=opts.threads,
        cwd=artifacts,
    )
    killed_by = None
    try:
        while proc.poll() is None:
            time.sleep(0.02)
            now = time.monotonic()
            if feeder.failed.is_set():
                time.sleep(0.5)  # let the runner finish writing its report, then stop the tree
                killed_by = "failure"
                break
            if opts.wall_clock_budget is not None and now - t_launch > opts.wall_clock_budget + WATCHDOG_GRACE_S:
                killed_by = "watchdog"
                break
            stalled = feeder.check_stall(opts.rank_timeout)
            if stalled is not None:
                stage, message, rank = stalled
                feeder.fail(stage, f"{message} [--rank-timeout {opts.rank_timeout:g} s]", rank=rank)
                killed_by = "failure"
                break
            if feeder.all_done():
                deadline = now + DONE_GRACE_S
                while proc.poll() is None and time.monotonic() < deadline:
                    time.sleep(0.02)
                break
    finally:
        if proc.poll() is None:
            proc.kill()
        result = feeder.finish()
        if sock_tmp is not None:
            shutil.rmtree(sock_tmp, ignore_errors=True)
    t_end = time.monotonic()

    # 4. score
    failure: EvalFailure | None = None
    score: Score | None = None
    if result.error is not None:
        err = result.error
        failure = EvalFailure(err["stage"], err["message"], err.get("traceback") or _log_tail(log_path))
    elif killed_by == "watchdog":
        result.stop_reason = "wall_clock_budget"
    elif len(result.done) < opts.nproc:
        failure = EvalFailure(
            "runner",
            f"the run ended without a report from rank(s) "
            f"{sorted(set(range(opts.nproc)) - set(result.done))} (torchrun exit code {proc.proc.returncode})",
            _log_tail(log_path),
        )
    if failure is None and not result.steps:
        failure = EvalFailure(
            "contract", "no batch was scored: the loop never iterated ctx.iter_train_batches(...)"
        )
    if failure is None:
        try:
            score = prequential_score(result.steps)
        except ScoringError as exc:
            failure = EvalFailure("scoring", str(exc))

    state_path = None
    if result.state and failure is None:
        state_path = run_dir / "model" / STATE_NAME
        state_path.parent.mkdir()
        torch.save(result.state, state_path)
    planted = discard_planted(artifacts)
    manifest = _manifest(
        opts, bundle, data, tokenizer, device, result, score, failure, findings, param_count_gate, planted, state_path,
        timing={
            "gates_s": gates_s,
            "launch_to_first_batch_s": (result.first_batch_at - t_launch) if result.first_batch_at else None,
            "launch_to_last_record_s": (result.last_record_at - t_launch) if result.last_record_at else None,
            "after_stream_s": (t_end - result.last_record_at) if result.last_record_at else None,
            "wall_s": t_end - t_start,
        },
    )
    write_run_manifest(run_dir, manifest)
    return EvalOutcome(run_dir, manifest, score, failure, findings)


def _manifest(opts, bundle, data, tokenizer, device, result: FeederResult, score, failure, findings,
              param_count_gate, planted, state_path, timing) -> dict[str, Any]:
    done = result.done
    counts = {d.get("parameter_count") for d in done.values() if d.get("parameter_count") is not None}
    return {
        "schema": SCHEMA,
        "created_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "tool": {"name": "prism-challenge", "version": __version__},
        "status": "failed" if failure else "scored",
        "failure": None if failure is None else {"stage": failure.stage, "message": failure.message, "detail": failure.detail},
        "bundle": {
            "path": str(bundle.root),
            "sha256": bundle.sha256,
            "files": bundle.file_hashes,
            "architecture": f"{bundle.architecture.file}:{bundle.architecture.symbol}",
            "training": f"{bundle.training.file}:{bundle.training.symbol}",
        },
        "gates": {"findings": [f.to_dict() for f in findings], "parameter_count": param_count_gate},
        "data": {
            "dir": str(data.root),
            "manifest_sha256": data.sha256,
            "source": data.data.get("source"),
            "split": "train",
        },
        "tokenizer": {
            "name": tokenizer.name,
            "sha256": tokenizer.sha256,
            "vocab_size": tokenizer.vocab_size,
            "eot_token": tokenizer.eot_token,
        },
        "seed": opts.seed,
        "config": {"sequence_length": opts.seq_len, "max_parameters": opts.max_parameters, "threads": opts.threads},
        "budgets": {
            "token_budget": opts.token_budget,
            "step_budget": opts.step_budget,
            "wall_clock_budget_s": opts.wall_clock_budget,
        },
        "compute": {
            "torch_version": torch.__version__,
            "python": platform.python_version(),
            "platform": platform.platform(),
            "device": device,
            "world_size": opts.nproc,
            "nproc_per_node": opts.nproc,
            "nnodes": 1,
            "device_name": done.get(0, {}).get("device_name"),
            "peak_rss_bytes": {str(r): d.get("peak_rss_bytes") for r, d in sorted(done.items())},
            "peak_device_bytes": {str(r): d.get("peak_device_bytes") for r, d in sorted(done.items()) if "peak_device_bytes" in d},
            "parent_peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        },
        "model": {
            "parameter_count": counts.pop() if len(counts) == 1 else None,
            "state_sha256": done.get(0, {}).get("state_sha256"),
            "state_sha256_per_rank": {str(r): d.get("state_sha256") for r, d in sorted(done.items())},
            "state_path": str(state_path) if state_path else None,
        },
        "stream": {
            "stop_reason": result.stop_reason,
            "batches": len(result.steps),
            "tokens": result.tokens_consumed,
            "targets": sum(s.targets for s in result.steps),
            "bytes": sum(s.bytes for s in result.steps),
        },
        "score": None if score is None else {
            "total_nats": score.total_nats,
            "total_bits": score.total_bits,
            "targets": score.targets,
            "bytes": score.bytes,
            "prequential_bpb": score.prequential_bpb,
            "nonfinite_batches": score.nonfinite_batches,
        },
        "curve": curve(result.steps),
        "timing": timing,
        "discarded_files": planted,
    }
