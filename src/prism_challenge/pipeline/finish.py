"""The stages after the score, in order: :func:`save_state` (the scored model's weights, for
the held-out stage), :func:`audit_and_heldout` (re-scoring, blind probes, the held-out
evaluation and the verdict), :func:`reference_codes` (the compressors' code lengths) and
:func:`write_manifest` (the signed run manifest, with its ``timing``).
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

import torch

from prism_challenge.audit.auditstage import apply as apply_audit
from prism_challenge.audit.auditstage import audit_run, child_config, empty_artifacts, keep_bundle, twin_dtypes
from prism_challenge.audit.heldout import HeldoutError, run_heldout
from prism_challenge.control import CANCELLED_MESSAGE
from prism_challenge.data.manifest import DataError
from prism_challenge.data.refcodes import Background as RefCodes
from prism_challenge.evaluator.feeder import FeederResult
from prism_challenge.evaluator.gpu import manifest_record as gpu_record
from prism_challenge.evaluator.protocol import context_values
from prism_challenge.evaluator.isolation import IsolationError
from prism_challenge.evaluator.jail import Jail
from prism_challenge.events import StageCount
from prism_challenge.failures import EvalFailure
from prism_challenge.intake.bundle import Bundle
from prism_challenge.manifest.record import build_manifest, run_budgets, signed_manifest, stream_counts
from prism_challenge.manifest.run_manifest import discard_planted, write_run_manifest
from prism_challenge.options import EvalOptions
from prism_challenge.pipeline.context import EvalOutcome, Run
from prism_challenge.pipeline.start import model_config
from prism_challenge.score.flops import run_spent
from prism_challenge.score.verdict import budget_share, build_verdict
from prism_challenge.terminal import printable

STATE_NAME = "trained_state.pt"
HELDOUT_BATCH = 8


def save_state(run: Run) -> None:
    """The scored model's state, for the held-out stage (``model/``, which no jailed process sees)."""
    if run.result.state and run.failure is None:
        run.state_path = run.run_dir / "model" / STATE_NAME
        run.state_path.parent.mkdir(exist_ok=True)
        torch.save(run.result.state, run.state_path)


def reference_codes(run: Run, refcodes: RefCodes) -> None:
    """The reference compressors' code lengths of the scored bytes, once their thread is done;
    a run cancelled during the held-out stage or while they ran fails ``cancelled``."""
    control = run.control
    if control.cancelled:  # cancelled during the held-out stage
        run.failure = EvalFailure("cancelled", CANCELLED_MESSAGE)
        return
    run.reference_codes = refcodes.result(lambda: control.cancelled)
    if control.cancelled:  # cancelled while the compressors ran
        run.failure = EvalFailure("cancelled", CANCELLED_MESSAGE)


def audit_and_heldout(run: Run) -> None:
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
                    model_config(opts, run.bundle, run.tokenizer, run.device), run.config, opts.nproc,
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


def write_manifest(run: Run) -> EvalOutcome:
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


def _timing(run: Run, t_done: float) -> dict[str, Any]:
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
        **model_config(opts, bundle, tokenizer, device),
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
    lines = printable(error).strip().splitlines() or ["unknown error"]  # the child's words (terminal)
    line = lines[0] if len(lines[0]) <= HELDOUT_LINE_CHARS else lines[0][:HELDOUT_LINE_CHARS] + "..."
    hint = next((h for prefix, h in HELDOUT_HINTS.items() if line.startswith(prefix)), None)
    try:
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_text(error.rstrip() + "\n")
        where = f" (full error: {log})" if len(lines) > 1 or line != lines[0] else ""
    except OSError:
        where = ""
    return line + (f"; hint: {hint}" if hint else "") + where
