"""``prism verify --reexecute``: the run made again, the check a third party can make without the
operator's key.

The bundle copy the run kept runs again through :func:`prism_challenge.pipeline.evaluate` under
the settings the manifest records (:func:`options_of`: seed, sequence length, budgets, threads,
world size, parameter cap, data directory, the revealed ``run_secret``, the audit's ``A``, the
held-out bytes) into a temporary directory, signed there by a throwaway key. A training loop is
deterministic under the harness's forced seed and flags on one device kind, so the curve must be
equal bit for bit (every ``nats_per_target`` float, every cumulative count), and so must the
stream's figures, the score and the trained state's sha256 (:func:`compare`). A run that the
wall clock or a stall stopped is compared on the batches both runs reached (the stop depends on
the machine's speed).

Refused (``ValueError``) where the comparison would mean nothing: another device kind than the
run's (a CUDA run on a machine without CUDA, a CPU run is re-executed on the CPU), another GPU
model, or a data directory whose MANIFEST hashes otherwise (checked before, by ``prism verify``).
"""

from __future__ import annotations

import math
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from prism_challenge import scratch

PREFIX_STOPS = ("wall_clock_budget", "stalled")
"""Stop reasons that depend on the machine's speed: the curves are compared on their common prefix."""


def device_of(m: dict[str, Any]) -> str:
    """The device kind to re-execute on: the run's own.

    Raises:
        ValueError: the run used CUDA and this machine has none, or another GPU model.
    """
    import torch

    kind = m["compute"]["device"]
    if kind != "cuda":
        return "cpu"
    if not torch.cuda.is_available():
        raise ValueError("--reexecute: the run used CUDA and this machine has no CUDA device: re-execute on the "
                         "device kind the run used (the curve is compared bit for bit)")
    here, there = torch.cuda.get_device_name(0), m["compute"].get("device_name")
    if there and here != there:
        raise ValueError(f"--reexecute: the run used a {there}, this machine has a {here}: the curve is compared bit "
                         "for bit on the same device")
    return "cuda"


def options_of(m: dict[str, Any], copy: Path, data_dir: Path, out_dir: Path, isolation: str, key_file: Path) -> Any:
    """The :class:`~prism_challenge.options.EvalOptions` that repeat the run (see the module
    docstring); the profile's pins are not re-checked (the settings are the run's own)."""
    from prism_challenge.options import EvalOptions

    cfg, budgets, compute, audit = m["config"], m["budgets"], m["compute"], m["audit"]
    heldout = (m.get("verdict") or {}).get("heldout")
    secret = m.get("run_secret")
    schedule = audit.get("schedule") or {}
    return EvalOptions(
        bundle=str(copy), data_dir=str(data_dir), out_dir=str(out_dir), seed=m["seed"],
        seq_len=cfg["sequence_length"], max_parameters=cfg["max_parameters"], threads=cfg["threads"],
        token_budget=budgets["token_budget"], byte_budget=budgets["byte_budget"], step_budget=budgets["step_budget"],
        wall_clock_budget=budgets["wall_clock_budget_s"], nproc=compute["world_size"], device=device_of(m),
        warm_ranks=bool(compute.get("warm_ranks", True)), isolation=isolation,
        heldout_bytes=int(heldout["max_bytes"]) if heldout else 0,
        scoring_autocast=cfg.get("scoring_autocast") or "fp32",
        audited_batches=int(schedule.get("audited_batches", audit["audited_batches_target"])),
        run_secret=bytes.fromhex(secret) if secret else None, signing_key_file=str(key_file))


def compare(m: dict[str, Any], again: dict[str, Any]) -> str:
    """The re-executed manifest ``again`` against the run's ``m``; returns a line of figures.

    Raises:
        Mismatch: the first batch of the curve, or the stream, score or state figure, that differs.
    """
    from prism_challenge.manifest.verify_recompute import Mismatch

    a, b = m["curve"], again["curve"]
    n = len(a["nats_per_target"])
    prefix = m["stream"]["stop_reason"] in PREFIX_STOPS or again["stream"]["stop_reason"] in PREFIX_STOPS
    if prefix:
        n = min(n, len(b["nats_per_target"]))
    elif len(b["nats_per_target"]) != n:
        raise Mismatch(f"re-execution: {len(b['nats_per_target'])} batches, the run had {n}")
    for i in range(n):
        for k in ("nats_per_target", "cumulative_targets", "cumulative_bytes"):
            if a[k][i] != b[k][i]:
                raise Mismatch(f"re-execution: batch {i}: curve.{k} is {b[k][i]!r}, the run's {a[k][i]!r}")
    if prefix:
        return f"the first {n} batches' curve equal bit for bit (a {m['stream']['stop_reason'] or 'speed'}-stopped run)"
    for sec in ("stream", "score"):
        for k, v in m[sec].items():
            if again[sec][k] != v:
                raise Mismatch(f"re-execution: {sec}.{k} is {again[sec][k]!r}, the run's {v!r}")
    if again["model"]["state_sha256"] != m["model"]["state_sha256"]:
        raise Mismatch(f"re-execution: the trained state hashes to {again['model']['state_sha256']}, the run's to "
                       f"{m['model']['state_sha256']}")
    ha, hb = (m.get("verdict") or {}).get("heldout"), (again.get("verdict") or {}).get("heldout")
    if ha and hb and ha.get("val_bpb_trained") != hb.get("val_bpb_trained"):
        raise Mismatch(f"re-execution: verdict.heldout.val_bpb_trained is {hb.get('val_bpb_trained')!r}, the run's "
                       f"{ha.get('val_bpb_trained')!r}")
    return (f"{n} batches equal bit for bit, {again['score']['prequential_bpb']:.6f} bpb, state "
            f"{(m['model']['state_sha256'] or '')[:12]}")


def progress(m: dict[str, Any], say: Callable[[str], Any]) -> Callable[[Any], None]:
    """An ``on_progress`` callback for the re-executed run: ``say`` a line when each of its
    stages starts, at every tenth of the run's batches with the bpb so far beside the run's own
    at that batch (from the manifest's curve), and as each part of the audit + held-out stage
    ends with its count beside the run's (``stage_count``), so a long re-execution is never silent."""
    from prism_challenge.events import BatchScored, StageCount, StageStarted

    total = int(m["stream"]["batches"])
    marks = {max(0, round(total * i / 10) - 1) for i in range(1, 11)}
    cum_t, per = m["curve"]["cumulative_targets"], m["curve"]["nats_per_target"]
    audit, heldout = m.get("audit") or {}, (m.get("verdict") or {}).get("heldout") or {}
    runs_own = {"re-scored": len(audit.get("batches") or []), "blind probes": audit.get("blind_probes"),
                "held-out batches": heldout.get("batches")}

    def on_event(ev: Any) -> None:
        if isinstance(ev, StageStarted):
            say(f"stage {ev.stage}")
        elif isinstance(ev, StageCount) and ev.done is not None:
            own = runs_own.get(ev.part)
            say(f"stage {ev.stage}: {ev.done:,} {ev.part}" + ("" if own is None else f", the run's {own:,}"))
        elif isinstance(ev, BatchScored) and ev.batch in marks and ev.batch < total:
            nats = sum(n * (t - p) for n, t, p in zip(per[: ev.batch + 1], cum_t, [0, *cum_t]))
            run_bpb = nats / math.log(2) / m["curve"]["cumulative_bytes"][ev.batch]
            say(f"batch {ev.batch + 1}/{total}: {ev.bpb_so_far:.6f} bpb so far, the run's {run_bpb:.6f}")

    return on_event


def reexecute(run_dir: Path, m: dict[str, Any], copy: Path, data: Any, isolation: str,
              say: Callable[[str], Any] | None = None) -> dict[str, Any]:
    """Run the kept bundle ``copy`` again (see the module docstring); returns ``{"line",
    "prequential_bpb", "state_sha256", "batches"}``. ``say``: called with a line of progress
    (:func:`progress`).

    Raises:
        ValueError: another device kind or GPU model than the run's.
        Mismatch: the re-executed run failed, or its curve or figures differ.
    """
    from prism_challenge.manifest.certificate import create_key_file
    from prism_challenge.control import RunControl
    from prism_challenge.failures import EvalFailure
    from prism_challenge.pipeline import evaluate
    from prism_challenge.manifest.verify_recompute import Mismatch

    with tempfile.TemporaryDirectory(prefix="prism-reexecute-", dir=scratch.root()) as tmp:
        key = Path(tmp) / "key" / "signing-key.pem"
        create_key_file(key)
        opts = options_of(m, copy, Path(data.root), Path(tmp) / "run", isolation, key)
        try:
            outcome = evaluate(opts, RunControl(on_progress=progress(m, say) if say else None))
        except EvalFailure as exc:
            raise Mismatch(f"re-execution: the run did not start: {exc.stage}: {exc.message}") from None
        if outcome.failure is not None:
            raise Mismatch(f"re-execution: the run failed: {outcome.failure.stage}: {outcome.failure.message}")
        line = compare(m, outcome.manifest)
        return {"line": line, "prequential_bpb": outcome.manifest["score"]["prequential_bpb"],
                "state_sha256": outcome.manifest["model"]["state_sha256"],
                "batches": outcome.manifest["stream"]["batches"]}
