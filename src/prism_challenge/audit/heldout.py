"""Held-out evaluation: the trained model and its random-init twin on a fixed val prefix.

After the scored run the trusted parent holds the scored model's ``state_dict`` (saved by the
harness, not the submission). This module then scores, in a separate bounded process:

* the **twin**: ``build_model(ctx)`` under the forced seed, untrained;
* the **trained** model: built the same way, then loaded from ``torch.load(state,
  weights_only=True)`` (tensors only: a planted pickle cannot run code), each tensor in its own
  dtype (:func:`~prism_challenge.evaluator.statedict.load_scored_state`: a model the loop cast to
  bf16 is scored in bf16); the twin takes the dtypes of the model that scored batch 0, the
  audit's snapshot of step 0 (:func:`~prism_challenge.evaluator.statedict.in_dtypes_of`; without
  an audit, ``build_model``'s own);

on the same rows of a deterministic byte-budget prefix of the ``val`` split
(:func:`prism_challenge.data.stream.heldout_stream`: whole documents while their UTF-8 bytes
total at most ``max_bytes``, in the train stream's layout ``EOT doc EOT doc ...``), cut into
overlapping rows by :class:`prism_challenge.evaluator.feeder.RowAssembler` exactly as the feeder
cuts the train stream, and scored by :func:`prism_challenge.evaluator.instrument.score_batch`
(eval mode, no_grad, logits sliced to ``V``, float64 sums; a non-finite batch is charged
``2 ln V`` nats per target, :func:`~prism_challenge.evaluator.instrument.charge`). So

    val_bpb = sum(nats) / ln 2 / sum(target bytes)         (the training score's definition)
    heldout_delta = val_bpb(twin) - val_bpb(trained)       (> 0: the training helped)

The figures keep each batch's nats per model and each batch's bytes (the trusted side's counts):
the spread of the trained model's per-batch bpb is the val side of the memorization gap's
standard error (:mod:`prism_challenge.score.gapnoise`).

**Probes.** Every held-out batch of the trained model is also probed in process
(:func:`~prism_challenge.evaluator.instrument.check_causal`; the twin is not: a non-causal twin
only lowers the delta). The in-process probe can be answered from a cache by a model that
remembers the rows it has just scored, so the blind probe (:mod:`prism_challenge.audit.blindprobe`)
recomputes the prediction of a token in a second, fresh process that never saw its future;
a mismatch is ``HeldoutError("contract: ...")``, which zeroes the run. Every forward runs under
the bundle's ``scoring_autocast``, as in the stream.

**Process boundary.** The process that scores imports the submission's architecture, so it is
untrusted from the moment of that import. :func:`run_heldout` therefore keeps everything that
decides the figures on the trusted side: it cuts the rows itself, sends the child only token
ids (never text, never a data path) and the state bytes over stdin, and computes targets, bytes
and bpb from its own counts, taking only nats per model and batch from the child. The child applies its
rlimits (address space, file size, open files; soft = hard) before the submission is imported,
redirects file descriptor 1 to stderr so submitted prints cannot forge the result line, and
dies with its parent. Run it inside :func:`prism_challenge.evaluator.isolation.sandbox_prefix`
(``writable=[]``, the data directory, caches and salts ``hidden``): it then needs no file but
the interpreter and the bundle. What it cannot prevent, like the training runner: code running
in the child's address space (the submitted ``forward``) can tamper with the in-process
computation; the static gates (no monkeypatching, no introspection) are the defence there.

``python -m prism_challenge.audit.heldout CONFIG.json`` runs it standalone (trusted use: it reads the
val split from ``data_dir`` and ``state_path`` itself) and prints one JSON line.
"""

from __future__ import annotations

import dataclasses
import io
import json
import math
import os
import secrets
import struct
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from prism_challenge.audit.blindprobe import BLIND_PROBES, BlindProbeError, blind_probes, compare, logprobs_at
from prism_challenge.evaluator.isolation import Limits
from prism_challenge.evaluator.freshdir import empty_folders
from prism_challenge.evaluator.jail import Jail

LN2 = math.log(2.0)
DEFAULT_MAX_BYTES = 200_000
TRAINED_STATE_NAME = "prism_trained_state.pt"
STDERR_TAIL_LINES = 15
HELDOUT_LIMITS = Limits(max_file_bytes=64 << 20, max_open_files=1024)
"""The held-out child's limits when it runs without the run's jail (tests, standalone use)."""

__all__ = [
    "BLIND_PROBES",
    "DEFAULT_MAX_BYTES",
    "TRAINED_STATE_NAME",
    "HeldoutError",
    "blind_probes",
    "heldout_cuts",
    "run_heldout",
    "score_rows",
    "evaluate_config",
]


class HeldoutError(RuntimeError):
    """The held-out evaluation could not produce figures; the message says why (stage: reason)."""


def heldout_cuts(
    data_dir: str | os.PathLike[str],
    tokenizer: str,
    *,
    split: str = "val",
    max_bytes: int = DEFAULT_MAX_BYTES,
    batch_size: int,
    seq_len: int,
) -> list[Any]:
    """The held-out rows, batch by batch: a list of ``feeder.Cut`` (tokens ``[R, T]``, target bytes ``[R]``).

    Rows of ``seq_len`` tokens overlap by one token (every token after the first is a target
    once); ``batch_size`` rows per batch, fewer in the last; the stream's last row may be
    shorter. Deterministic: the same data directory, tokenizer, split and budget give the same
    rows.

    Raises:
        HeldoutError: the data directory, split or a shard is bad, or the arguments are.
    """
    from prism_challenge.data.manifest import DataError, load_manifest
    from prism_challenge.data.stream import heldout_stream
    from prism_challenge.evaluator.feeder import RowAssembler
    from prism_challenge.tokenizers import TokenizerError, reference_tokenizer

    if batch_size < 1 or seq_len < 2:
        raise HeldoutError(f"config: batch_size {batch_size} must be >= 1 and seq_len {seq_len} >= 2")
    try:
        tok = reference_tokenizer(tokenizer)
        manifest = load_manifest(data_dir)
        asm = RowAssembler(heldout_stream(manifest, tok, split=split, max_bytes=max_bytes))
        cuts = []
        while (cut := asm.cut(batch_size, seq_len)) is not None:
            cuts.append(cut)
    except (DataError, TokenizerError) as exc:
        raise HeldoutError(f"data: {exc}") from None
    return cuts


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
    import importlib

    import torch
    from torch import nn

    from prism_challenge.evaluator.audit import arm
    from prism_challenge.evaluator.cudainit import start_cuda
    from prism_challenge.evaluator.instrument import autocast_dtype
    from prism_challenge.evaluator.interface import PrismContext, run_context
    from prism_challenge.gates.param_count import count_unique_elements
    from prism_challenge.evaluator.seeding import force_determinism, force_source_imports
    from prism_challenge.evaluator.statedict import DTYPES, in_dtypes_of, load_scored_state

    device = start_cuda(str(config.get("device", "cpu")))  # CUDA starts before the hook is armed (cudainit)
    seed = int(config["seed"])
    force_determinism(seed, int(config.get("threads", 1)))
    vocab = int(config["vocab_size"])
    stage = "import"
    try:
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
        cap = int(config["max_parameters"])
        stage = "load"
        if hasattr(state, "seek"):
            state.seek(0)
        sd = torch.load(state, map_location="cpu", weights_only=True)
        if not isinstance(sd, dict):
            raise HeldoutError(f"load: the trained state is a {type(sd).__name__}, not a state_dict")
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
        trained = models["trained"][0]
        autocast = autocast_dtype(config.get("scoring_autocast"))
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
    except HeldoutError:
        raise
    except Exception as exc:  # noqa: BLE001 - submitted code fails in any way; named, not hidden
        raise submission_failure(exc, stage, HeldoutError) from None


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


def _bpb(nats: float, nbytes: int) -> float:
    return nats / LN2 / nbytes


def _figures(result: dict[str, Any], batch_bytes: Sequence[int]) -> dict[str, Any]:
    """The held-out figures from the models' nats and the trusted side's bytes per batch."""
    nbytes = int(sum(batch_bytes))
    twin = _bpb(result["twin"]["nats"], nbytes)
    trained = _bpb(result["trained"]["nats"], nbytes)
    return {
        "val_bpb_twin": twin,
        "val_bpb_trained": trained,
        "heldout_delta": twin - trained,
        "targets": result["targets"],
        "bytes": nbytes,
        "nats_twin": result["twin"]["nats"],
        "nats_trained": result["trained"]["nats"],
        "nonfinite_batches_twin": result["twin"]["nonfinite_batches"],
        "nonfinite_batches_trained": result["trained"]["nonfinite_batches"],
        "batches": result["batches"],
        "batch_bytes": [int(b) for b in batch_bytes],
        "batch_nats_twin": list(result["twin"]["batch_nats"]),
        "batch_nats_trained": list(result["trained"]["batch_nats"]),
    }


# -------------------------------------------------------------------------------------------
# The child process
# -------------------------------------------------------------------------------------------
def _read_exact(f: Any, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = f.read(n - len(buf))
        if not chunk:
            raise HeldoutError("protocol: stdin ended early")
        buf += chunk
    return bytes(buf)


def _read_frame(f: Any) -> bytes:
    (n,) = struct.unpack(">Q", _read_exact(f, 8))
    return _read_exact(f, n)


def _frame(data: bytes) -> bytes:
    return struct.pack(">Q", len(data)) + data


def _pack_batches(batches: Sequence[np.ndarray]) -> bytes:
    buf = io.BytesIO()
    np.savez(buf, **{f"b{i:06d}": np.ascontiguousarray(b, dtype=np.int64) for i, b in enumerate(batches)})
    return buf.getvalue()


def _unpack_batches(data: bytes) -> list[np.ndarray]:
    with np.load(io.BytesIO(data), allow_pickle=False) as z:
        return [z[k] for k in sorted(z.files)]


WARM_MODULES = ("torch", "prism_challenge.evaluator.audit", "prism_challenge.evaluator.instrument",
                "prism_challenge.evaluator.interface", "prism_challenge.gates.param_count")


def _warm_up() -> None:
    """Import torch and the harness modules :func:`evaluate_config` uses, before stdin is read."""
    import importlib

    for name in WARM_MODULES:
        importlib.import_module(name)


def main(argv: list[str] | None = None) -> int:
    """``python -m prism_challenge.audit.heldout CONFIG.json`` or ``... --stdin`` (used by :func:`run_heldout`).

    Prints one JSON line on stdout: ``{"ok": true, ...figures}`` or ``{"ok": false, "error": ...}``;
    exit status 0 or 1. With ``--stdin`` the config, the token batches and the state bytes come
    as three length-prefixed frames on stdin and the line carries nats and targets only (the
    parent computes bytes and bpb).
    """
    argv = sys.argv[1:] if argv is None else argv
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # whatever else writes to stdout lands in stderr

    def emit(obj: dict[str, Any]) -> None:
        out.write(json.dumps(obj) + "\n")
        out.flush()

    try:
        if argv == ["--stdin"]:
            _warm_up()  # a spare imports before it is fed (Jail.warm)
            stdin = sys.stdin.buffer
            config = json.loads(_read_frame(stdin))
            batches = _unpack_batches(_read_frame(stdin))
            state: Any = io.BytesIO(_read_frame(stdin))
            batch_bytes = None
        elif len(argv) == 1:
            config = json.loads(Path(argv[0]).read_text())
            cuts = heldout_cuts(config["data_dir"], config["tokenizer"], split=config.get("split", "val"),
                                max_bytes=int(config.get("max_bytes", DEFAULT_MAX_BYTES)),
                                batch_size=int(config["batch_size"]), seq_len=int(config["seq_len"]))
            batches = [c.tokens for c in cuts]
            batch_bytes: list[int] | None = [int(c.target_bytes.sum()) for c in cuts]
            # read now, before the audit hook is armed: the state file may lie anywhere the user keeps it
            state = io.BytesIO(Path(config["state_path"]).read_bytes())
        else:
            sys.stderr.write("usage: python -m prism_challenge.audit.heldout CONFIG.json | --stdin\n")
            return 2
        result = evaluate_config(config, batches, state)
        if batch_bytes is None:
            emit({"ok": True, **result})
        else:
            if sum(batch_bytes) <= 0:
                raise HeldoutError("data: the held-out prefix covers no bytes")
            emit({"ok": True, **_figures(result, batch_bytes), "split": config.get("split", "val")})
        return 0
    except HeldoutError as exc:
        emit({"ok": False, "error": str(exc)})
    except MemoryError:
        emit({"ok": False, "error": "memory: out of memory (MemoryError)"})
    except Exception as exc:  # noqa: BLE001
        emit({"ok": False, "error": f"heldout: {type(exc).__name__}: {exc}"})
    return 1


# -------------------------------------------------------------------------------------------
# The parent side
# -------------------------------------------------------------------------------------------
def run_heldout(
    config: dict[str, Any],
    *,
    timeout_s: float,
    jail: Jail | None = None,
    memory_bytes: int | None = None,
    key: bytes | None = None,
) -> dict[str, Any]:
    """Run the held-out evaluation in a jailed child process and return its figures.

    The trusted side cuts the rows (:func:`heldout_cuts` from ``config["data_dir"]``, ``split``
    (default ``val``), ``max_bytes`` (default 200 000), ``batch_size``, ``seq_len``), reads
    ``config["state_path"]``, and sends token ids, config and state bytes over stdin to
    ``python -m prism_challenge.audit.heldout --stdin`` started in ``jail``; the child needs no data
    path. The blind probe is a second child in the same jail.

    Args:
        config: see :func:`evaluate_config`, plus ``data_dir``, ``split``, ``max_bytes``,
            ``batch_size``, ``seq_len``, ``state_path``; optionally ``context``, the run's
            context values (:func:`~prism_challenge.evaluator.interface.run_context`, whose
            ``artifacts_dir`` must be an empty folder the children may write).
        timeout_s: wall-clock limit of both children together; past it the child's process
            group is killed.
        jail: the run's :class:`~prism_challenge.evaluator.jail.Jail` (sandbox, environment,
            limits); default: no sandbox, :data:`HELDOUT_LIMITS` with ``memory_bytes``
            (``None``: unlimited address space, needed on CUDA).
        key: the run's secret, which draws the blind probe's rows and positions
            (:func:`~prism_challenge.audit.blindprobe.blind_probes`; never sent to a child); ``None``:
            a fresh one from :func:`secrets.token_bytes`.

    Returns:
        ``{"val_bpb_twin", "val_bpb_trained", "heldout_delta", "targets", "bytes", "nats_twin",
        "nats_trained", "nonfinite_batches_twin", "nonfinite_batches_trained", "batches",
        "batch_bytes", "batch_nats_twin", "batch_nats_trained", "split", "max_bytes",
        "parameter_count", "blind_probes", "wall_s"}``; bpb in bits per byte, nats in nats
        (``batch_*``: ``[batches]`` lists, the bytes counted here, the nats the child's),
        ``blind_probes`` the number of rows the blind probe checked.

    Raises:
        HeldoutError: ``"<stage>: <reason>"``: data, state file, timeout, memory, tasks, an
            ``audit`` refusal (the event named), a crash (with the tail of the child's stderr),
            a malformed reply, or ``contract`` when the blind probe found a prediction that
            depends on a later token.
    """
    from prism_challenge.evaluator.instrument import autocast_dtype

    t0 = time.monotonic()
    split = str(config.get("split", "val"))
    max_bytes = int(config.get("max_bytes", DEFAULT_MAX_BYTES))
    cuts = heldout_cuts(config["data_dir"], str(config["tokenizer"]), split=split, max_bytes=max_bytes,
                        batch_size=int(config["batch_size"]), seq_len=int(config["seq_len"]))
    batch_bytes = [int(c.target_bytes.sum()) for c in cuts]
    nbytes = sum(batch_bytes)
    targets = int(sum(c.tokens.shape[0] * (c.tokens.shape[1] - 1) for c in cuts))
    if nbytes <= 0:
        raise HeldoutError(f"data: the {split} prefix of {max_bytes} bytes covers no bytes")
    try:
        state = Path(config["state_path"]).read_bytes()
    except OSError as exc:
        raise HeldoutError(f"state: cannot read the trained state {config['state_path']}: {exc.strerror}") from None
    child_config = {k: config[k] for k in ("bundle_root", "architecture", "seed", "vocab_size", "tokenizer",
                                           "sequence_length", "max_parameters")}
    child_config.update({"threads": int(config.get("threads", 1)), "device": str(config.get("device", "cpu")),
                         "scoring_autocast": config.get("scoring_autocast"), "context": config.get("context"),
                         "twin_dtypes": config.get("twin_dtypes")})
    if jail is None:
        jail = Jail("none", str(config["bundle_root"]), (str(config["data_dir"]),),
                    dataclasses.replace(HELDOUT_LIMITS, address_space_bytes=memory_bytes), child_config["threads"])
    child_config["hidden"] = list(jail.hidden)
    batches = [c.tokens for c in cuts]
    probes = blind_probes(batches, key if key is not None else secrets.token_bytes(32), int(config["vocab_size"]))
    child_config["checks"] = [[b, row, k] for b, row, k, _ in probes]
    deadline = t0 + timeout_s
    try:
        reply = _run_child(jail, child_config, batches, state, deadline, timeout_s, warm_next=bool(probes))
    finally:
        if not probes:
            jail.drop_spare(list(CHILD_ARGV), writable=_writable(child_config))
    try:
        result = {"twin": _model_reply(reply["twin"], len(cuts)), "trained": _model_reply(reply["trained"], len(cuts)),
                  "targets": int(reply["targets"]), "batches": int(reply["batches"])}
    except (KeyError, TypeError, ValueError) as exc:
        raise HeldoutError(f"protocol: malformed reply from the held-out process ({exc})") from None
    if result["targets"] != targets or result["batches"] != len(cuts):
        raise HeldoutError(f"protocol: the held-out process scored {result['targets']} targets in "
                           f"{result['batches']} batches; {targets} in {len(cuts)} were sent")
    if probes:
        check_nats = reply.get("check_nats")
        if not isinstance(check_nats, list) or len(check_nats) != len(probes):
            raise HeldoutError("protocol: malformed reply from the held-out process (check_nats)")
        try:
            blind = _run_child(jail, {**child_config, "blind": [[row, k] for _, row, k, _ in probes], "checks": []},
                               [p[3] for p in probes], state, deadline, timeout_s)
        finally:
            jail.drop_spare(list(CHILD_ARGV), writable=_writable(child_config))
        try:
            compare(probes, batches, check_nats, blind.get("blind_logprobs"), blind.get("blind_precisions"),
                    int(config["vocab_size"]), autocast_dtype(child_config["scoring_autocast"]))
        except BlindProbeError as exc:
            raise HeldoutError(str(exc)) from None
    figures = _figures(result, batch_bytes)
    figures.update({"split": split, "max_bytes": max_bytes, "parameter_count": reply.get("parameter_count"),
                    "blind_probes": len(probes), "wall_s": time.monotonic() - t0})
    return figures


CHILD_ARGV = (sys.executable, "-m", "prism_challenge.audit.heldout", "--stdin")


def _writable(child_config: dict[str, Any]) -> list[str]:
    """The children's one writable folder: the run's ``ctx.artifacts_dir`` (none without a context)."""
    values = child_config.get("context")
    return [str(values["artifacts_dir"])] if values else []


def _run_child(jail: Jail, child_config: dict[str, Any], batches: Sequence[np.ndarray], state: bytes,
               deadline: float, timeout_s: float, *, warm_next: bool = False) -> dict[str, Any]:
    """Run one held-out child in ``jail`` (config, batches and state on stdin); its ``{"ok": true,
    ...}`` reply. A spare the jail holds for it is fed instead of a new child
    (:meth:`~prism_challenge.evaluator.jail.Jail.warm`); ``warm_next`` starts the next one's.

    Raises:
        HeldoutError: timeout (``deadline``, a ``time.monotonic()`` value), an audit refusal, the
            memory or task limit, a crash with the tail of its stderr, a malformed reply, or the
            child's own error.
    """
    payload = _frame(json.dumps(child_config).encode()) + _frame(_pack_batches(batches)) + _frame(state)
    writable = _writable(child_config)
    empty_folders(writable)  # nothing the other child left (freshdir)
    done = jail.run(list(CHILD_ARGV), input=payload, timeout_s=deadline - time.monotonic(), writable=writable,
                    warm_next=warm_next)
    if done.timed_out:
        raise HeldoutError(f"timeout: the held-out evaluation ran past its limit of {timeout_s:g} s")
    if done.refusal is not None:  # the hook's line, whatever the child printed after it
        raise HeldoutError(f"contract: {done.failure.partition(': ')[2]}")
    tail = done.stderr_tail(STDERR_TAIL_LINES)  # after a note of the bytes dropped, if any (outputcap)
    lines = done.stdout.decode(errors="replace").strip().splitlines()
    reply: dict[str, Any] | None = None
    if lines:
        try:
            reply = json.loads(lines[-1])
        except json.JSONDecodeError:
            reply = None
    if not isinstance(reply, dict):
        raise HeldoutError(f"{done.failure or 'crash: no result'} and no result\n{tail}".rstrip())
    if not reply.get("ok"):
        raise HeldoutError(str(reply.get("error") or "heldout: failed without a reason"))
    return reply


def _model_reply(d: Any, batches: int) -> dict[str, Any]:
    """One model's reply, checked: ``batches`` per-batch nats, each finite and >= 0; the total is
    their ``math.fsum`` computed here (the child's own total is not read).

    Raises:
        ValueError: a missing, mis-sized or non-numeric entry (a malformed reply).
    """
    per = d["batch_nats"]
    if not isinstance(per, list) or len(per) != batches:
        raise ValueError(f"batch_nats must be a list of {batches} numbers")
    for nats in per:
        if not isinstance(nats, (int, float)) or isinstance(nats, bool) or not math.isfinite(nats) or nats < 0:
            raise ValueError(f"nats {nats!r} must be a finite non-negative number")
    per = [float(x) for x in per]
    return {"nats": math.fsum(per), "batch_nats": per, "targets": int(d["targets"]),
            "nonfinite_batches": int(d["nonfinite_batches"])}


if __name__ == "__main__":
    from prism_challenge.evaluator.childexit import exit_child

    exit_child(main())  # no interpreter teardown (childexit)
