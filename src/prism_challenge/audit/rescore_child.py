"""The audit's child process (:mod:`prism_challenge.audit.rescore`): ``python -m
prism_challenge.audit.rescore_child --stdin [--device cuda]``, started in the run's jail. It reads the
config and the batches on stdin, then one frame per weight snapshot, each only when its first job
comes (:class:`~prism_challenge.evaluator.snapfile.SnapshotStream`: one snapshot held at a time,
however many the child re-scores), and prints one JSON line on stdout; for each
job it builds the model in the run's context, loads the job's snapshot and scores the batch:
``rescore`` mode as the instrument does (nats, and the nats of the probed targets), ``blind`` mode
the log-probabilities at the probed positions. A child whose config names ``flop_shapes`` (the
first re-scoring child of the audit) then counts the scoring forward's FLOPs per shape on its last
job's model (:mod:`~prism_challenge.score.flops`), in that job's reply under ``flops``.
"""

from __future__ import annotations

from prism_challenge.evaluator import childgc

if __name__ == "__main__":
    childgc.pause()  # before the imports below import torch; until arm() (childgc)

import base64
import json
import math
import os
import sys
from typing import Any

import numpy as np

from prism_challenge.audit.heldout_child import submission_failure
from prism_challenge.audit.heldout_wire import _read_frame, _unpack_batches
from prism_challenge.audit.rescore import AuditError


def _score_job(model: Any, tokens: Any, job: dict[str, Any], mode: str, vocab: int, autocast: Any) -> dict[str, Any]:
    import torch

    from prism_challenge.evaluator.instrument import (
        check_logits,
        measure,
        positions_logprobs,
        probe_precision,
        scoring_forward,
    )

    picks = [(int(r), int(k)) for r, k in job["picks"]]
    if mode == "rescore":
        scored = measure(model, tokens, vocab, autocast=autocast)
        nats = scored.nats if math.isfinite(scored.nats) else None
        return {"nats": nats, "picked": [0.0 - float(scored.logprobs[r, k - 1]) for r, k in picks]}
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        with torch.no_grad():
            logits = check_logits(scoring_forward(model, tokens, autocast), tokens.shape[0], tokens.shape[1], vocab)
            vectors = [base64.b64encode(lp.cpu().numpy().astype(np.float32).tobytes()).decode()
                       for lp in positions_logprobs(logits, [(r, k - 1) for r, k in picks], vocab)]
            precision = str(probe_precision(logits.dtype, autocast)).removeprefix("torch.")
    finally:
        for m, was in modes:
            m.training = was
    return {"logprobs": vectors, "precision": precision}


def child_run(config: dict[str, Any], batches: list[np.ndarray], states: Any) -> list[dict[str, Any]]:
    """The child's work: per job, build the model in the run's context, load its snapshot
    (``states.load(i)``, :class:`~prism_challenge.evaluator.snapfile.SnapshotStream`), score.

    Raises:
        AuditError: ``"<stage>: <reason>"`` for import, build, load and score failures.
    """
    import importlib

    import torch
    from torch import nn

    from prism_challenge.evaluator.audit import arm
    from prism_challenge.evaluator.cudainit import start_cuda
    from prism_challenge.evaluator.instrument import autocast_dtype
    from prism_challenge.evaluator.interface import run_context
    from prism_challenge.evaluator.seeding import force_determinism, force_source_imports
    from prism_challenge.evaluator.statedict import load_scored_state
    from prism_challenge.score.flops import child_count, shape_of
    from prism_challenge.gates.param_count import count_unique_elements
    from prism_challenge.audit.heldout_child import _BuildOnly

    device = str(config.get("device", "cpu"))
    seed, vocab, mode = int(config["seed"]), int(config["vocab_size"]), str(config["mode"])
    force_determinism(seed, int(config.get("threads", 1)))
    stage = "setup"  # the harness's own steps: a failure here is never the submission's (rescore.SUBMITTED_STAGES)
    try:
        root = str(config["bundle_root"])
        force_source_imports(root)
        sys.path.insert(0, root)
        device = start_cuda(device)  # CUDA starts before the hook is armed (cudainit)
        arm(root, [str(config["context"]["artifacts_dir"])], hidden=config.get("hidden", ()))
        module, symbol = config["architecture"]
        stage = "import"
        fn = getattr(importlib.import_module(module), symbol, None)
        if not callable(fn):
            raise AuditError(f"import: {module.replace('.', '/')}.py does not define a callable {symbol}(ctx)")
        runtime = _BuildOnly(fn, seed)
        autocast = autocast_dtype(config.get("scoring_autocast"))
        shapes = [shape_of(k) for k in config.get("flop_shapes") or ()]  # this child counts FLOPs (flops)
        out = []
        for job, batch in zip(config["jobs"], batches):
            stage = "build"
            ctx = run_context(config["context"], rank=int(job["rank"]), device=device, runtime=runtime)
            model = runtime.build_model(ctx)
            if not isinstance(model, nn.Module):
                raise AuditError(f"build: build_model(ctx) returned {type(model).__name__}, not a torch.nn.Module")
            if count_unique_elements(model)[0] > int(config["max_parameters"]):
                raise AuditError("build: the model is over the parameter cap")
            stage = "load"
            sd = states.load(int(job["state"]))
            load_scored_state(model, sd)  # each tensor in its own dtype: the model that scored
            del sd  # the snapshot's buffer goes before the next one is read
            model = model.to(device)
            stage = "score"
            tokens = torch.tensor(batch, dtype=torch.int64).to(device)  # a copy: the model may write to it
            out.append(_score_job(model, tokens, job, mode, vocab, autocast))
            if shapes and len(out) == len(config["jobs"]):  # after the last job: nothing scored here follows it
                out[-1]["flops"] = child_count(model, tokens, shapes, autocast)
            del model
        return out
    except AuditError:
        raise
    except BaseException as exc:  # noqa: BLE001 - submitted code fails in any way; named, not hidden. A
        # BaseException subclass (allow-listed) would otherwise end the child with no reply
        raise submission_failure(exc, stage, AuditError) from None


WARM_MODULES = ("torch", "prism_challenge.evaluator.audit", "prism_challenge.evaluator.instrument",
                "prism_challenge.evaluator.snapfile",
                "prism_challenge.evaluator.interface", "prism_challenge.evaluator.seeding",
                "prism_challenge.gates.param_count", "prism_challenge.score.flops", "torch.utils.flop_counter",
                # the FLOP count's first forward imports it, and its import makes inductor's cache
                # folder: done here, before the audit hook is armed, and not under the bundle's frames
                "torch._dynamo")


def _warm_up(device: str = "cpu") -> None:
    """Import torch and the harness modules :func:`child_run` uses before stdin is read, and
    start ``device`` (:func:`start_device`): the audit starts a child while the stream or the
    child before it works (a spare, :meth:`~prism_challenge.evaluator.jail.Jail.warm`), and this
    is all such a child runs until it is fed."""
    import importlib

    for name in WARM_MODULES:
        importlib.import_module(name)
    start_device(device)


def start_device(device: str) -> None:
    """The one place a re-scoring or blind child starts its device: in its prologue, before it
    reads stdin and before the audit hook is armed (:func:`child_run` arms it), so a spare pays
    CUDA's start-up while it waits. CPU: nothing. A failure is left to the child's own first
    use of the device (it names it there)."""
    if not device.startswith("cuda"):
        return
    try:
        import torch

        from prism_challenge.evaluator.cudainit import start_cuda

        torch.empty(1, device=start_cuda(device))  # cudainit's start-up, and the context made now
    except Exception as exc:  # noqa: BLE001 - reported by the first real use
        sys.stderr.write(f"prism rescore child: CUDA did not start in the prologue: {exc}\n")


def _device_arg(argv: list[str]) -> str | None:
    """The device of ``--stdin [--device D]`` (``cpu`` without it), ``None`` for other argv."""
    if argv == ["--stdin"]:
        return "cpu"
    if len(argv) == 3 and argv[:2] == ["--stdin", "--device"] and argv[2] in ("cpu", "cuda"):
        return argv[2]
    return None


def main(argv: list[str] | None = None) -> int:
    """``python -m prism_challenge.audit.rescore_child --stdin``: one JSON line ``{"ok": true, "jobs": [...]}``
    or ``{"ok": false, "error": ...}`` on stdout; exit status 0 or 1."""
    argv = sys.argv[1:] if argv is None else argv
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # whatever else writes to stdout lands in stderr
    device = _device_arg(argv)
    if device is None:
        sys.stderr.write("usage: python -m prism_challenge.audit.rescore_child --stdin [--device cpu|cuda]\n")
        return 2
    _warm_up(device)
    try:
        from prism_challenge.evaluator.snapfile import SnapshotStream

        stdin = sys.stdin.buffer
        config = json.loads(_read_frame(stdin))
        batches = _unpack_batches(_read_frame(stdin))
        uses = [0] * (1 + max(int(j["state"]) for j in config["jobs"]))
        for j in config["jobs"]:
            uses[int(j["state"])] += 1
        states = SnapshotStream(stdin, uses)
        reply: dict[str, Any] = {"ok": True, "jobs": child_run(config, batches, states), "held": states.held_max}
    except AuditError as exc:
        reply = {"ok": False, "error": str(exc)}
    except MemoryError:
        reply = {"ok": False, "error": "memory: out of memory (MemoryError)"}
    except Exception as exc:  # noqa: BLE001
        reply = {"ok": False, "error": f"audit: {type(exc).__name__}: {exc}"}
    out.write(json.dumps(reply) + "\n")
    out.flush()
    return 0 if reply["ok"] else 1


if __name__ == "__main__":
    from prism_challenge.evaluator.childexit import exit_child

    exit_child(main())  # no interpreter teardown (childexit)
