"""``prism verify``'s audit stage: each audited batch's files checked against the manifest and
the train stream, then re-scored and blind-probed again in fresh jailed processes
(:mod:`prism_challenge.audit.rescore`), as the run's audit did (:mod:`prism_challenge.audit.auditstage`)."""

from __future__ import annotations

import math
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from prism_challenge import scratch
from prism_challenge.manifest.verify_recompute import CURVE_RTOL, Mismatch


def stream_slices(data: Any, manifest: dict[str, Any], steps: list[int]) -> dict[int, list[np.ndarray]]:
    """The audited steps' rank slices, cut again from the train split as the feeder cut them."""
    from prism_challenge.data.stream import train_stream
    from prism_challenge.evaluator.feeder import RowAssembler
    from prism_challenge.tokenizers import reference_tokenizer

    audit, n = manifest["audit"], int(manifest["compute"]["world_size"])
    b, t = audit["shape"]
    asm = RowAssembler(train_stream(data, reference_tokenizer(manifest["tokenizer"]["name"])),
                       manifest["budgets"]["token_budget"])
    out, wanted = {}, set(steps)
    for step in range(max(steps) + 1):
        cut = asm.cut(n * b, t, allow_short_row=(n == 1))
        if cut is None:
            break
        if step in wanted:
            rows = cut.tokens.shape[0]
            bounds = [rows * r // n for r in range(n + 1)]
            out[step] = [cut.tokens[bounds[r] : bounds[r + 1]] for r in range(n)]
    return out


def load_audit(run_dir: Path, manifest: dict[str, Any], batch_nats: list[float], data: Any,
               pruned: set[int] = frozenset()) -> tuple[dict[int, Any], dict[int, dict[str, np.ndarray]]]:
    """The audited steps as the feeder held them and their stored inputs by step, after checking
    every hash and the curve. A step of ``pruned`` (its snapshot removed by ``prism runs prune``,
    :func:`~prism_challenge.manifest.runs_prune.pruned_steps`) has every check but its snapshot's, and
    ``snapshot`` ``None``."""
    from prism_challenge.audit.auditstage import AUDIT_DIR
    from prism_challenge.evaluator.snapshots import AuditedStep, file_sha256, snapshot_name
    from prism_challenge.audit.rescore import inputs_digest

    n = int(manifest["compute"]["world_size"])
    batches = manifest["audit"]["batches"]
    stream = stream_slices(data, manifest, [e["step"] for e in batches]) if batches else {}
    out, inputs = {}, {}
    for e in batches:
        step = e["step"]
        snap = run_dir / AUDIT_DIR / snapshot_name(step)
        if step in pruned:
            snap = None
        elif not snap.is_file() or file_sha256(snap) != e["snapshot_sha256"]:
            raise Mismatch(f"audited batch {step}: the snapshot {snap} is missing or does not hash to the manifest's")
        with np.load(run_dir / AUDIT_DIR / f"step-{step:06d}.npz", allow_pickle=False) as z:
            arrays = {k: z[k] for k in z.files}
        pieces = {r: arrays[f"tokens_{r}"] for r in range(n)}
        if inputs_digest([pieces[r] for r in range(n)]) != e["inputs_sha256"]:
            raise Mismatch(f"audited batch {step}: its stored inputs do not hash to the manifest's")
        again = stream.get(step)
        if again is None or any(not np.array_equal(again[r], pieces[r]) for r in range(n)):
            raise Mismatch(f"audited batch {step}: its rows are not the train stream's batch {step}")
        recorded = e["recorded_nats"]
        total = math.fsum(x if x is not None else math.inf for x in recorded)
        if math.isfinite(total) and not abs(total - batch_nats[step]) <= CURVE_RTOL * abs(total):
            raise Mismatch(f"audited batch {step}: recorded {total!r} nats, the curve's batch has {batch_nats[step]!r}")
        out[step] = AuditedStep(step, pieces, dict(enumerate(recorded)), snap, e["snapshot_sha256"])
        inputs[step] = arrays
    return out, inputs


def children(run_dir: Path, manifest: dict[str, Any], copy: Path, audits: dict[int, Any],
              inputs: dict[int, dict[str, np.ndarray]], data: Any, isolation: str, timeout_s: float) -> tuple[Any, int]:
    """Re-score and probe every audited batch in fresh jailed processes; the first mismatch raised."""
    from prism_challenge.audit.auditstage import empty_artifacts
    from prism_challenge.data.builtin import default_cache_root
    from prism_challenge.data.partition import default_salt_path
    from prism_challenge.evaluator.isolation import IsolationError
    from prism_challenge.evaluator.jail import (DEFAULT_MAX_FILE_BYTES, DEFAULT_MAX_OPEN_FILES, Jail,
                                                default_memory_limit, jail_limits)
    from prism_challenge.evaluator.instrument import autocast_dtype
    from prism_challenge.audit.rescore import AuditReport, Job, compare_blind, compare_rescore, run_both

    cfg, audit = manifest["config"], manifest["audit"]
    device = rescoring_device(manifest)
    module = manifest["bundle"]["architecture"].rpartition(":")[0].removesuffix(".py").replace("/", ".")
    from prism_challenge.manifest.certificate import user_key_path

    hidden = [str(data.root), str(default_salt_path(data.root)), str(default_cache_root()), str(run_dir / "model"),
              str(user_key_path().parent), str(user_key_path())]
    config = {"seed": manifest["seed"], "threads": cfg["threads"], "vocab_size": manifest["tokenizer"]["vocab_size"],
              "tokenizer": manifest["tokenizer"]["name"], "sequence_length": cfg["sequence_length"],
              "max_parameters": cfg["max_parameters"], "device": device, "bundle_root": str(copy),
              "architecture": [module, manifest["bundle"]["architecture"].rpartition(":")[2]],
              "scoring_autocast": cfg.get("scoring_autocast"), "context": audit["context"], "hidden": hidden}
    limits = jail_limits(device, default_memory_limit(), max_file_bytes=DEFAULT_MAX_FILE_BYTES,
                         max_open_files=DEFAULT_MAX_OPEN_FILES)  # no RLIMIT_AS on CUDA: the cgroup alone
    try:
        jail = Jail.open(isolation, bundle_dir=copy, hidden=hidden, limits=limits, threads=int(cfg["threads"]))
    except IsolationError as exc:
        raise Mismatch(f"isolation: {exc} (use --isolation none on a machine without a sandbox)") from None
    n = int(manifest["compute"]["world_size"])
    jobs, blind_jobs, paths = [], [], []
    for step in sorted(audits):
        a, arrays = audits[step], inputs[step]
        paths.append(a.snapshot)
        for r in range(n):
            passes = sorted(int(k.rsplit("_", 1)[1]) for k in arrays if k.startswith(f"probe_{r}_"))
            mine = [Job(step, r, len(paths) - 1, a.pieces[r],
                        [(int(row), int(k)) for row, k in arrays[f"picks_{r}_{p}"]], arrays[f"probe_{r}_{p}"])
                    for p in passes]
            blind_jobs += mine
            jobs.append(Job(step, r, len(paths) - 1, a.pieces[r], [pick for j in mine for pick in j.picks]))
    artifacts = Path(str(audit["context"]["artifacts_dir"]))
    report = AuditReport()
    deadline = time.monotonic() + timeout_s
    spare = None if artifacts.is_dir() else tempfile.TemporaryDirectory(prefix="prism-audit-", dir=scratch.root())
    with (empty_artifacts(artifacts) if spare is None else spare) as empty:
        writable = [str(empty)]
        if not artifacts.is_dir():
            config["context"] = {**config["context"], "artifacts_dir": str(empty)}
        rescored, blind = run_both(jail, config, jobs, blind_jobs, paths, deadline=deadline, writable=writable)
    compare_rescore(jobs, audits, rescored, device, n, report)
    if report.mismatch:
        raise Mismatch(report.mismatch)
    if blind is not None:
        autocast = autocast_dtype(config.get("scoring_autocast"))
        _, failed = compare_blind(jobs, rescored, blind_jobs, blind, int(config["vocab_size"]), autocast)
        if failed:
            raise Mismatch(failed)
    return report, sum(len(j.picks) for j in blind_jobs)


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def rescoring_device(manifest: dict[str, Any]) -> str:
    """The device kind the audited batches are re-scored on: the run's own (``compute.device``).

    Raises:
        ValueError: the run was made on CUDA and this machine has no CUDA device; the message
            names the run's device. Re-scored on CPU, a CUDA run's batches differ from their
            records by more than the audit's tolerance (other kernels; bf16 autocast), so the
            verdict would be a mismatch that says nothing about the run.
    """
    compute = manifest["compute"]
    if compute["device"] != "cuda":
        return "cpu"
    if not _cuda():
        gpu = compute.get("gpu") or {}
        name = compute.get("device_name") or gpu.get("gpu_model") or "a CUDA GPU"
        cap = f", compute capability {gpu['compute_capability']}" if gpu.get("compute_capability") else ""
        raise ValueError(
            f"the run was made on CUDA ({name}{cap}, torch {compute['torch_version']}) and this machine has no "
            f"CUDA device: its audited batches are re-scored on the run's device (config.scoring_autocast "
            f"{manifest['config'].get('scoring_autocast') or 'fp32'}), and on a CPU they differ from their records "
            f"by more than the audit's tolerance; verify it on a machine with CUDA, the same GPU model for the "
            f"closest match")
    return "cuda"


def filler(m: dict[str, Any], data: Any) -> np.ndarray | None:
    """The val prefix the run's blind probes continued their rows with (as the audit read it)."""
    from prism_challenge.audit.auditstage import val_filler
    from prism_challenge.tokenizers import reference_tokenizer

    filler, _ = val_filler(data, reference_tokenizer(m["tokenizer"]["name"]))
    return filler
