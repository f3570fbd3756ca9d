"""The held-out child: twin and trained model built, loaded and scored in the process that
imports the bundle (:mod:`prism_challenge.audit.heldout` describes the evaluation).

Everything here runs on the untrusted side of the boundary: :func:`evaluate_config` is what
``python -m prism_challenge.audit.heldout --stdin`` computes; its harness imports happen before
the audit hook is armed. :func:`submission_failure` and :class:`_BuildOnly` are shared with the
audit's re-scoring child (:mod:`~prism_challenge.audit.rescore_child`).
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np

from prism_challenge.audit.blindprobe import logprobs_at
from prism_challenge.audit.heldout_wire import HeldoutError


def score_rows(model: Any, batches: Sequence[np.ndarray], vocab_size: int, device: str, *, probe: bool = True,
               autocast: Any = None, picks: Sequence[Sequence[int]] = ()) -> dict[str, Any]:
    """Score ``model`` on token batches: ``{"nats", "batch_nats", "targets", "nonfinite_batches", "picked"}``.

    ``batch_nats`` is ``[len(batches)]``: each batch's
    :func:`~prism_challenge.evaluator.instrument.measure` nats (float64), a non-finite batch
    replaced by ``2 ln V`` nats per target; ``nats`` their ``math.fsum``. ``picked`` holds, for each ``(batch, row, k)`` of ``picks``, the
    nats of target ``k`` of that row as that batch was scored (the blind probe's reference).

    Args:
        probe: also probe every batch for causality (row ``i mod B``, ``k = T // 2``).
        autocast: the scoring autocast dtype (``None``: none).

    Raises:
        prism_challenge.evaluator.instrument.ContractError: logits of the wrong shape, or a
            prediction that depends on a later token
            (:func:`~prism_challenge.evaluator.instrument.check_causal`).
    """
    import torch

    from prism_challenge.evaluator.instrument import charge, measure

    parts, targets, nonfinite, picked = [], 0, 0, []
    wanted: dict[int, list[tuple[int, int]]] = {}
    for b, row, k in picks:
        wanted.setdefault(int(b), []).append((int(row), int(k)))
    for i, arr in enumerate(batches):
        tokens = torch.tensor(arr, dtype=torch.int64)  # a copy: the model may write to its input
        if device != "cpu":
            tokens = tokens.to(device)
        n_targets = int(arr.shape[0] * (arr.shape[1] - 1))
        rows, t = arr.shape
        spec = (max(1, t // 2), 1 + i % (vocab_size - 1), i % rows) if probe else None
        scored = measure(model, tokens, vocab_size, spec, autocast=autocast)
        nats, finite = charge(scored.nats, n_targets, vocab_size)
        picked += [0.0 - float(scored.logprobs[row, k - 1]) for row, k in wanted.get(i, ())]
        parts.append(nats)
        targets += n_targets
        nonfinite += not finite
    return {"nats": math.fsum(parts), "batch_nats": [float(x) for x in parts], "targets": targets,
            "nonfinite_batches": nonfinite, "picked": picked}


class _BuildOnly:
    """The held-out process's runtime behind ``PrismContext``: build_model only."""

    def __init__(self, fn: Any, seed: int):
        self.fn, self.seed = fn, seed

    def build_model(self, ctx: Any) -> Any:
        from prism_challenge.evaluator.seeding import force_seeds

        force_seeds(self.seed)
        return self.fn(ctx)

    def iter_train_batches(self, *args: Any, **kwargs: Any) -> Any:
        from prism_challenge.evaluator.instrument import ContractError

        raise ContractError("there is no train stream in the held-out evaluation")


def evaluate_config(config: dict[str, Any], batches: Sequence[np.ndarray], state: Any) -> dict[str, Any]:
    """Build, load and score twin and trained model in this process (imports the bundle).

    Args:
        config: ``bundle_root``, ``architecture`` ``[module, symbol]``, ``seed``, ``threads``,
            ``vocab_size``, ``tokenizer``, ``sequence_length``, ``max_parameters``, ``device``,
            optionally ``scoring_autocast`` (``prism.yaml``'s; absent: none), ``checks``
            (``[batch, row, k]``: the blind probe's references, returned as ``check_nats``) or
            ``blind`` (``[row, k]`` per batch: this is the blind probe's fresh process).
        batches: token batches ``[R, T]`` int64.
        state: a path or a binary file object holding the trained ``state_dict``.

    Returns:
        ``{"twin": {...}, "trained": {...}, "targets", "batches", "parameter_count"}`` where each
        model entry is :func:`score_rows`'s result.

    Raises:
        HeldoutError: ``"<stage>: <reason>"`` for import, build, load and score failures.
    """
    import torch
    from torch import nn

    from prism_challenge.evaluator.cudainit import start_cuda
    from prism_challenge.evaluator.instrument import autocast_dtype
    from prism_challenge.gates.param_count import count_unique_elements
    from prism_challenge.evaluator.seeding import force_determinism
    from prism_challenge.evaluator.statedict import DTYPES, in_dtypes_of, load_scored_state

    device = start_cuda(str(config.get("device", "cpu")))  # CUDA starts before the hook is armed (cudainit)
    seed = int(config["seed"])
    force_determinism(seed, int(config.get("threads", 1)))
    vocab = int(config["vocab_size"])
    stage = "import"
    try:
        runtime, ctx = _import_architecture(config, seed, vocab, device)
        cap = int(config["max_parameters"])
        stage = "load"
        sd = _read_state_dict(state)
        models = {}
        names = ("trained",) if config.get("blind") else ("twin", "trained")
        for name in names:
            stage = "build"
            model = runtime.build_model(ctx)
            if not isinstance(model, nn.Module):
                raise HeldoutError(f"build: build_model(ctx) returned {type(model).__name__}, not a torch.nn.Module")
            count = count_unique_elements(model)[0]  # the runner's count (parameters + buffers)
            if count > cap:
                raise HeldoutError(f"build: the model has {count} parameters, over the cap of {cap}")
            stage = "load"
            if name == "trained":  # each tensor in its own dtype: the trained model as it is
                load_scored_state(model, sd)
            elif config.get("twin_dtypes"):  # the twin in the dtypes that scored batch 0 (auditstage.twin_dtypes)
                in_dtypes_of(model, {k: torch.empty(0, dtype=DTYPES[v]) for k, v in config["twin_dtypes"].items()
                                     if v in DTYPES})
            models[name] = (model.to(device), count)
        out: dict[str, Any] = {"batches": len(batches), "parameter_count": models["trained"][1]}
        stage = "score"
        autocast = autocast_dtype(config.get("scoring_autocast"))
        return _score_models(config, models, out, batches, vocab, device, autocast)
    except HeldoutError:
        raise
    except Exception as exc:  # noqa: BLE001 - submitted code fails in any way; named, not hidden
        raise submission_failure(exc, stage, HeldoutError) from None


def _import_architecture(config: dict[str, Any], seed: int, vocab: int, device: Any) -> tuple[_BuildOnly, Any]:
    """:func:`evaluate_config`'s import stage: the bundle's source forced, the audit hook armed,
    then the architecture imported; ``(runtime, ctx)`` for ``build_model``.

    Raises:
        HeldoutError: ``import: ...`` when the architecture does not define a callable symbol;
            whatever importing the bundle raises (:func:`evaluate_config` names the stage).
    """
    import importlib

    from prism_challenge.evaluator.audit import arm
    from prism_challenge.evaluator.interface import PrismContext, run_context
    from prism_challenge.evaluator.seeding import force_source_imports

    force_source_imports(config["bundle_root"])  # the source the gates checked, no planted bytecode
    sys.path.insert(0, str(config["bundle_root"]))
    values = config.get("context")  # the run's context values (prism eval), else a context of its own
    writable = [str(values["artifacts_dir"])] if values else []
    arm(str(config["bundle_root"]), writable, hidden=config.get("hidden", ()))  # every process that imports it, for good
    module, symbol = config["architecture"]
    arch = importlib.import_module(module)
    fn = getattr(arch, symbol, None)
    if not callable(fn):
        raise HeldoutError(f"import: {module.replace('.', '/')}.py does not define a callable {symbol}(ctx)")
    runtime = _BuildOnly(fn, seed)
    ctx = run_context(values, rank=0, device=device, runtime=runtime) if values else PrismContext(
        seed=seed,
        vocab_size=vocab,
        sequence_length=int(config["sequence_length"]),
        max_parameters=int(config["max_parameters"]),
        device=device,
        tokenizer_name=str(config["tokenizer"]),
        _runtime=runtime,
    )
    return runtime, ctx


def _read_state_dict(state: Any) -> dict:
    """The trained ``state_dict`` read from ``state`` (a path or a binary file object), tensors only.

    Raises:
        HeldoutError: ``load: ...`` when it holds something other than a dict.
    """
    import torch

    if hasattr(state, "seek"):
        state.seek(0)
    sd = torch.load(state, map_location="cpu", weights_only=True)
    if not isinstance(sd, dict):
        raise HeldoutError(f"load: the trained state is a {type(sd).__name__}, not a state_dict")
    return sd


def _score_models(config: dict[str, Any], models: dict[str, Any], out: dict[str, Any],
                  batches: Sequence[np.ndarray], vocab: int, device: Any, autocast: Any) -> dict[str, Any]:
    """:func:`evaluate_config`'s score stage: ``out`` completed with each model's :func:`score_rows`
    (twin and trained) and the blind probe's references, or, in the blind probe's process, the
    log-probabilities of its positions (``blind_logprobs``, ``blind_precisions``)."""
    trained = models["trained"][0]
    if config.get("blind"):  # each batch is a probe batch [B, T]: (row, k) of blindprobe.blind_probes
        blind = [logprobs_at(trained, b, int(row), int(k) - 1, vocab, device, autocast)
                 for b, (row, k) in zip(batches, config["blind"])]
        out["blind_logprobs"] = [lp.hex() for lp, _ in blind]
        out["blind_precisions"] = [name for _, name in blind]
        return out
    for name, (model, _) in models.items():
        out[name] = score_rows(model, batches, vocab, device, probe=name == "trained", autocast=autocast,
                               picks=config.get("checks", []) if name == "trained" else ())
    out["targets"] = out["trained"]["targets"]
    out["check_nats"] = out["trained"].pop("picked")
    out["twin"].pop("picked")
    return out


def submission_failure(exc: Exception, stage: str, error: type[Exception]) -> Exception:
    """What a child that runs submitted code reports for ``exc`` raised at ``stage`` (import,
    build, load, score), as ``error`` (:class:`HeldoutError`, the audit's ``AuditError``):
    ``"contract: ..."`` for the instrument's :class:`ContractError`, ``"<stage>: out of memory
    (MemoryError)"``, else ``"<stage>: <type>: <message>"``."""
    from prism_challenge.evaluator.instrument import ContractError

    if isinstance(exc, ContractError):
        return error(f"contract: {exc}")
    if isinstance(exc, MemoryError):
        return error(f"{stage}: out of memory (MemoryError)")
    return error(f"{stage}: {type(exc).__name__}: {exc}")
