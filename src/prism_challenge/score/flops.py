"""What a run spent, beside its score: the manifest's ``compute`` figures of FLOPs and time.

* ``forward_flops_per_batch``: the FLOPs of one scoring forward (``model(tokens)`` under the
  run's scoring autocast and attention kernels, :func:`~prism_challenge.evaluator.instrument.scoring_forward`)
  per distinct rank slice shape ``[B, T]`` the stream scored, keyed ``"BxT"`` (:func:`shape_key`).
  Measured once per shape with :class:`torch.utils.flop_counter.FlopCounterMode` by the audit's
  re-scoring child (:mod:`~prism_challenge.audit.rescore_child`): a fresh sandboxed process the harness
  starts, which rebuilds the scored model from the bundle and loads the weights of an audited
  batch. The figure is never taken from the ranks nor from anything the loop says, so nothing the
  loop does in its own process changes it.
* ``training_flops_estimate``: :data:`TRAINING_FLOPS_FACTOR` times the forward FLOPs summed
  over every rank slice the stream scored (``batches_per_shape``): one training step per scored
  batch, at its shape, on the model ``build_model`` builds. The harness's own scoring forwards
  (1x, under ``no_grad``) and probe forwards are not in it, nor any work of the loop's beyond
  that step (several passes per batch, a side model): that shows in the wall time and the
  device-seconds, which the harness measures from outside the ranks.
* ``stream_wall_s``: seconds from the gates' release (the loop's start, from which the
  wall-clock budget counts) to the last record; ``run_wall_s``: the whole run's seconds, from
  the call's start to the verdict; ``device_seconds``: ``stream_wall_s`` times the ranks (one
  device each: a GPU, or a CPU rank's threads).

Limits, stated in the manifest's ``flops_method``: ``FlopCounterMode`` counts matmul-like ATen
operators only (``mm``, ``addmm``, ``bmm``, ``baddbmm``, convolutions, the fused attention
kernels: 2 FLOPs per multiply-add); elementwise operators, normalisations, softmax and embedding
look-ups count zero, and fused attention is counted as full (not causal) attention. The CPU's
fused attention kernel (``_scaled_dot_product_flash_attention_for_cpu``), absent from torch's
table, is counted with torch's own formula for the flash kernel (:func:`_cpu_sdpa_mapping`).
The count runs in a process that also runs submitted code: a model could in principle behave
differently under the counter (it sees a dispatch mode). The count is information beside the
score, never part of it. (The ranks' import allow-list refuses ``torch.utils.flop_counter``.)
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

TRAINING_FLOPS_FACTOR = 3
"""Training FLOPs per forward FLOP: forward (1x) plus backward (about 2x: the gradients with
respect to activations and to weights, one matmul each per forward matmul), the rule behind the
``6 N T`` training compute of Kaplan et al. (2020), "Scaling Laws for Neural Language Models",
arXiv:2001.08361, section 2.1 (``2 N T`` for the forward)."""

METHOD = ("forward: torch.utils.flop_counter.FlopCounterMode on one scoring forward per rank slice shape, at "
          "the scoring precision, in the audit's re-scoring child (the harness's fresh process, the model rebuilt "
          "from the bundle and an audited snapshot); matmul-like operators only (2 FLOPs per multiply-add; "
          "fused attention counted as full attention). training: 3 x the forward FLOPs summed over every rank "
          "slice scored (forward + backward, Kaplan et al. 2020's 6NT rule)")


def shape_key(shape: Sequence[int]) -> str:
    """``"BxT"`` of a rank slice's shape ``(B, T)`` (rows, tokens per row)."""
    b, t = shape
    return f"{int(b)}x{int(t)}"


def shape_of(key: str) -> tuple[int, int]:
    """The ``(B, T)`` of a :func:`shape_key`.

    Raises:
        ValueError: not ``"BxT"`` with two positive integers.
    """
    b, sep, t = key.partition("x")
    if not (sep and b.isdigit() and t.isdigit() and int(b) > 0 and int(t) > 0):
        raise ValueError(f"batch shape {key!r}: expected 'BxT' with positive integers")
    return int(b), int(t)


def shape_counts(shapes: Iterable[Sequence[Sequence[int]]]) -> dict[str, int]:
    """How many rank slices of each shape the stream scored: ``shapes`` holds, per scored step,
    the ``(B, T)`` of each rank's slice (:attr:`~prism_challenge.evaluator.feeder.StepRecord.shapes`)."""
    counts: Counter[str] = Counter()
    for step in shapes:
        counts.update(shape_key(s) for s in step)
    return dict(sorted(counts.items()))


def _cpu_sdpa_mapping() -> dict[Any, Any]:
    """``custom_mapping`` for ``FlopCounterMode``: the CPU fused attention kernel, counted with
    torch's own formula of the flash kernel (same arguments ``query, key, value, ...``); empty
    where torch already counts it."""
    import torch
    from torch.utils.flop_counter import flop_registry

    aten = torch.ops.aten
    op = getattr(aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    formula = flop_registry.get(aten._scaled_dot_product_flash_attention)
    if op is None or formula is None or op in flop_registry:
        return {}

    def cpu_flash(*args: Any, out_val: Any = None, **kwargs: Any) -> int:
        return formula(*args, out_val=out_val, **kwargs)  # torch's registered formula takes tensors

    cpu_flash._get_raw = True  # type: ignore[attr-defined] - FlopCounterMode then does not wrap it again
    return {op: cpu_flash}


def _tiled(tokens: Any, shape: tuple[int, int]) -> Any:
    """``tokens`` ``[B0, T0]`` (int64) read row-major and repeated cyclically into ``[B, T]``:
    real token ids of the scored text in a batch of any shape (matmul FLOPs depend on shapes only)."""
    flat = tokens.reshape(-1)
    n = shape[0] * shape[1]
    reps = -(-n // flat.numel())
    return flat.repeat(reps)[:n].reshape(shape).clone()


def count_forward_flops(model: Any, tokens: Any, shapes: Sequence[Sequence[int]], autocast: Any) -> dict[str, int]:
    """FLOPs of one scoring forward of ``model`` per shape, keyed by :func:`shape_key`.

    Args:
        model: the scored ``nn.Module`` (put in eval mode, under ``torch.no_grad``; each module's
            mode is restored after).
        tokens: ``[B0, T0]`` int64 token ids on the model's device; each shape's batch is cut
            from them (:func:`_tiled`).
        shapes: the ``(B, T)`` to count.
        autocast: the run's scoring autocast dtype (``None``: off).

    Returns:
        ``{"BxT": flops}``, FLOPs as :meth:`FlopCounterMode.get_total_flops` counts them (see the
        module docstring: matmul-like operators only).

    Raises:
        Exception: whatever the model's forward raises (the caller records it).
    """
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from prism_challenge.evaluator.instrument import scoring_forward

    mapping = _cpu_sdpa_mapping()
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    out: dict[str, int] = {}
    try:
        with torch.no_grad():
            for shape in shapes:
                b, t = int(shape[0]), int(shape[1])
                batch = _tiled(tokens, (b, t))
                counter = FlopCounterMode(display=False, custom_mapping=mapping)
                with counter:
                    scoring_forward(model, batch, autocast)
                out[shape_key((b, t))] = int(counter.get_total_flops())
    finally:
        for m, was in modes:
            m.training = was
    return out


def child_count(model: Any, tokens: Any, shapes: Sequence[Sequence[int]], autocast: Any) -> dict[str, Any]:
    """The re-scoring child's reply entry: ``{"flops": {...}, "seconds": s}``, or
    ``{"error": "...", "seconds": s}`` when the forward failed under the counter (the count is
    information: its failure never fails the audit)."""
    t0 = time.monotonic()
    try:
        flops: dict[str, Any] = {"flops": count_forward_flops(model, tokens, shapes, autocast)}
    except Exception as exc:  # noqa: BLE001 - submitted code fails in any way; named in the manifest
        flops = {"error": f"{type(exc).__name__}: {exc}"[:500]}
    flops["seconds"] = time.monotonic() - t0
    return flops


def checked(reply: Any, shapes: Sequence[str]) -> tuple[dict[str, int] | None, float | None, str | None]:
    """``(forward FLOPs by shape, seconds, error)`` from a child's :func:`child_count` entry:
    the FLOPs only when every shape of ``shapes`` has a non-negative integer and nothing else does."""
    if not isinstance(reply, dict):
        return None, None, "the re-scoring child sent no FLOP count"
    secs = reply.get("seconds")
    secs = float(secs) if isinstance(secs, (int, float)) and not isinstance(secs, bool) and secs >= 0 else None
    if reply.get("error") is not None:
        return None, secs, f"the forward failed under the FLOP counter: {str(reply['error'])[:500]}"
    flops = reply.get("flops")
    if not (isinstance(flops, dict) and set(flops) == set(shapes)
            and all(type(v) is int and v >= 0 for v in flops.values())):
        return None, secs, "the re-scoring child's FLOP count is malformed"
    return dict(sorted(flops.items())), secs, None


def spent(forward: Mapping[str, int] | None, counts: Mapping[str, int], *, stream_wall_s: float | None,
          run_wall_s: float, world_size: int, count_s: float | None = None, error: str | None = None
          ) -> dict[str, Any]:
    """The manifest's ``compute`` figures of what the run spent (see the module docstring).

    Args:
        forward: forward FLOPs per shape key (``None``: not counted; ``error`` says why).
        counts: rank slices scored per shape key (:func:`shape_counts`).
        stream_wall_s: seconds from the gates' release to the last record (``None``: no record).
        run_wall_s: the whole run's seconds.
        world_size: ranks (one device each).
        count_s: the seconds the count took in the child.

    Returns:
        ``forward_flops_per_batch``, ``batches_per_shape``, ``training_flops_estimate``
        (``TRAINING_FLOPS_FACTOR * sum(forward[s] * counts[s])``, ``None`` when a scored shape
        has no count), ``stream_wall_s``, ``run_wall_s``, ``device_seconds``, ``flops_count_s``,
        ``flops_method``, ``flops_error``.
    """
    training = None
    if forward is not None and all(s in forward for s in counts):
        training = TRAINING_FLOPS_FACTOR * sum(forward[s] * n for s, n in counts.items())
    elif forward is not None and error is None:
        error = "a scored batch shape has no FLOP count"
    return {
        "forward_flops_per_batch": dict(forward) if forward is not None else None,
        "batches_per_shape": dict(counts),
        "training_flops_estimate": training,
        "stream_wall_s": stream_wall_s,
        "run_wall_s": run_wall_s,
        "device_seconds": stream_wall_s * world_size if stream_wall_s is not None else None,
        "flops_count_s": count_s,
        "flops_method": METHOD,
        "flops_error": error,
    }


def run_spent(audit: Any, steps: Sequence[Any], *, stream_wall_s: float | None, run_wall_s: float,
              world_size: int) -> dict[str, Any]:
    """:func:`spent` of a run: the FLOPs from its audit's re-scoring child (``audit.flops``,
    :class:`~prism_challenge.audit.rescore.AuditReport`; ``None``: no audit ran), the shapes from its
    scored steps (:class:`~prism_challenge.evaluator.feeder.StepRecord`)."""
    counts = shape_counts(s.shapes for s in steps)
    forward, secs, error = None, None, None
    if audit is None:
        error = "no audit ran (its re-scoring child counts the FLOPs)"
    elif audit.flops is None:
        error = f"the audit's re-scoring did not complete: {audit.error or audit.mismatch or 'no reply'}"[:500]
    else:
        forward, secs, error = checked(audit.flops, list(counts))
    return spent(forward, counts, stream_wall_s=stream_wall_s, run_wall_s=run_wall_s, world_size=world_size,
                 count_s=secs, error=error)


def flops_text(flops: float | None) -> str:
    """A FLOP count in three significant digits, ``1.25e11`` (``"-"``: none)."""
    if flops is None:
        return "-"
    return f"{flops:.3g}".replace("e+", "e")
