"""The trusted side of the held-out evaluation: rows cut, children run in the jail, figures
computed from its own counts (:mod:`prism_challenge.audit.heldout` describes the evaluation).

:func:`run_heldout` cuts the val prefix into rows itself (:func:`heldout_cuts`), sends the child
only token ids, config and state bytes (:mod:`~prism_challenge.audit.heldout_wire`), takes only
nats per model and batch from it (:func:`_model_reply`) and computes targets, bytes and bpb
(:func:`_figures`) from its own counts; the blind probe is a second child in the same jail.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import secrets
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from prism_challenge.audit.blindprobe import BlindProbeError, blind_probes, compare
from prism_challenge.audit.heldout_wire import HeldoutError, _frame, _pack_batches
from prism_challenge.evaluator.isolation import Limits
from prism_challenge.evaluator.freshdir import empty_folders
from prism_challenge.evaluator.pagecache import cache_note, empty_page_cache
from prism_challenge.evaluator.jail import Jail

LN2 = math.log(2.0)
DEFAULT_MAX_BYTES = 200_000
STDERR_TAIL_LINES = 15
HELDOUT_LIMITS = Limits(max_file_bytes=64 << 20, max_open_files=1024)
"""The held-out child's limits when it runs without the run's jail (tests, standalone use)."""


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
    t0 = time.monotonic()
    split = str(config.get("split", "val"))
    max_bytes = int(config.get("max_bytes", DEFAULT_MAX_BYTES))
    cuts, batch_bytes, targets = _cut_rows(config, split, max_bytes)
    state = _read_state(config)
    child_config, jail = _child_setup(config, jail, memory_bytes)
    batches = [c.tokens for c in cuts]
    probes = blind_probes(batches, key if key is not None else secrets.token_bytes(32), int(config["vocab_size"]))
    child_config["checks"] = [[b, row, k] for b, row, k, _ in probes]
    deadline = t0 + timeout_s
    reply, result = _score_in_children(jail, child_config, batches, state, deadline, timeout_s, probes, targets,
                                       int(config["vocab_size"]))
    figures = _figures(result, batch_bytes)
    figures.update({"split": split, "max_bytes": max_bytes, "parameter_count": reply.get("parameter_count"),
                    "blind_probes": len(probes), "page_cache": result.get("page_cache"),
                    "wall_s": time.monotonic() - t0})
    return figures


def _cut_rows(config: dict[str, Any], split: str, max_bytes: int) -> tuple[list[Any], list[int], int]:
    """:func:`run_heldout`'s rows, cut on the trusted side: ``(cuts, bytes per batch, targets)``.

    Raises:
        HeldoutError: ``data: ...`` (see :func:`heldout_cuts`), or a prefix that covers no bytes.
    """
    cuts = heldout_cuts(config["data_dir"], str(config["tokenizer"]), split=split, max_bytes=max_bytes,
                        batch_size=int(config["batch_size"]), seq_len=int(config["seq_len"]))
    batch_bytes = [int(c.target_bytes.sum()) for c in cuts]
    nbytes = sum(batch_bytes)
    targets = int(sum(c.tokens.shape[0] * (c.tokens.shape[1] - 1) for c in cuts))
    if nbytes <= 0:
        raise HeldoutError(f"data: the {split} prefix of {max_bytes} bytes covers no bytes")
    return cuts, batch_bytes, targets


def _read_state(config: dict[str, Any]) -> bytes:
    """The trained state's bytes, read by the trusted side from ``config["state_path"]``.

    Raises:
        HeldoutError: ``state: ...`` when the file cannot be read.
    """
    try:
        return Path(config["state_path"]).read_bytes()
    except OSError as exc:
        raise HeldoutError(f"state: cannot read the trained state {config['state_path']}: {exc.strerror}") from None


def _child_setup(config: dict[str, Any], jail: Jail | None, memory_bytes: int | None) -> tuple[dict[str, Any], Jail]:
    """The children's config (what they need of ``config``, no data path) and the jail they run in
    (default: no sandbox, :data:`HELDOUT_LIMITS` with ``memory_bytes``)."""
    child_config = {k: config[k] for k in ("bundle_root", "architecture", "seed", "vocab_size", "tokenizer",
                                           "sequence_length", "max_parameters")}
    child_config.update({"threads": int(config.get("threads", 1)), "device": str(config.get("device", "cpu")),
                         "scoring_autocast": config.get("scoring_autocast"), "context": config.get("context"),
                         "twin_dtypes": config.get("twin_dtypes")})
    if jail is None:
        jail = Jail("none", str(config["bundle_root"]), (str(config["data_dir"]),),
                    dataclasses.replace(HELDOUT_LIMITS, address_space_bytes=memory_bytes), child_config["threads"])
    child_config["hidden"] = list(jail.hidden)
    return child_config, jail


def _score_in_children(jail: Jail, child_config: dict[str, Any], batches: list[Any], state: bytes,
                       deadline: float, timeout_s: float, probes: list[Any], targets: int,
                       vocab: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """Run the scoring child, check its reply against what was sent, then (when there are probes)
    the blind probe's child; ``(reply, {"twin", "trained", "targets", "batches"})``.

    Raises:
        HeldoutError: see :func:`run_heldout`.
    """
    from prism_challenge.evaluator.instrument import autocast_dtype

    try:
        reply = _run_child(jail, child_config, batches, state, deadline, timeout_s, warm_next=bool(probes))
    finally:
        if not probes:
            jail.drop_spare(list(CHILD_ARGV), writable=_writable(child_config))
    try:
        result = {"twin": _model_reply(reply["twin"], len(batches)),
                  "trained": _model_reply(reply["trained"], len(batches)),
                  "targets": int(reply["targets"]), "batches": int(reply["batches"])}
    except (KeyError, TypeError, ValueError) as exc:
        raise HeldoutError(f"protocol: malformed reply from the held-out process ({exc})") from None
    if result["targets"] != targets or result["batches"] != len(batches):
        raise HeldoutError(f"protocol: the held-out process scored {result['targets']} targets in "
                           f"{result['batches']} batches; {targets} in {len(batches)} were sent")
    if probes:
        check_nats = reply.get("check_nats")
        if not isinstance(check_nats, list) or len(check_nats) != len(probes):
            raise HeldoutError("protocol: malformed reply from the held-out process (check_nats)")
        result["page_cache"] = cache_note([empty_page_cache()])  # after the scoring child ended (pagecache)
        try:
            blind = _run_child(jail, {**child_config, "blind": [[row, k] for _, row, k, _ in probes], "checks": []},
                               [p[3] for p in probes], state, deadline, timeout_s)
        finally:
            jail.drop_spare(list(CHILD_ARGV), writable=_writable(child_config))
        try:
            compare(probes, batches, check_nats, blind.get("blind_logprobs"), blind.get("blind_precisions"),
                    vocab, autocast_dtype(child_config["scoring_autocast"]))
        except BlindProbeError as exc:
            raise HeldoutError(str(exc)) from None
    return reply, result


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
        except (ValueError, RecursionError):  # not JSON, a number too long, nested too deep
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
