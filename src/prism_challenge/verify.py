"""``prism verify RUN_DIR [--data DIR]``: recompute what a scored run directory holds.

In order, stopping at the first mismatch (exit 1, the mismatch named; exit 0 and
``verified`` with the figures when all agree; exit 2 for a run directory it cannot read):

1. **bundle**: the sha256 of the bundle copy the run kept (``RUN_DIR/bundle``) is the manifest's;
2. **data**: the sha256 of the data directory's MANIFEST (``--data``, default the manifest's
   ``data.dir``) is the manifest's ``data.manifest_sha256``;
3. **score**: ``prequential_bpb`` is re-derived from the curve:
   ``sum_i nats_per_target_i * targets_i / ln 2 / bytes`` (``targets_i`` the differences of the
   cumulative targets) equals the manifest's within :data:`CURVE_RTOL` (the curve holds
   per-target floats: one rounding per batch);
4. **audit**: each audited batch's snapshot file and inputs hash to the manifest's values; its
   recorded nats (summed over ranks) are the curve's batch; its slices are the stream's rows
   again, cut from the data directory's train split as the feeder cut them; and fresh jailed
   processes re-score them from the snapshot and re-run their blind probes
   (:mod:`prism_challenge.rescore`): the re-scored nats must reproduce the records within the
   audit's tolerance (:func:`~prism_challenge.evaluator.auditplan.within`). They run on the
   run's device kind when this machine has it (a CUDA run verified on CPU differs by more than
   the tolerance: verify on the device the run used).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

CURVE_RTOL = 1e-9
"""Relative tolerance of the bpb re-derived from the curve (per-target floats, one rounding each)."""
EXIT_VERIFIED, EXIT_MISMATCH, EXIT_UNREADABLE = 0, 1, 2


class Mismatch(Exception):
    """What differs, named (the first one found)."""


def _check_bundle(run_dir: Path, manifest: dict[str, Any]) -> Path:
    from prism_challenge.auditstage import BUNDLE_COPY
    from prism_challenge.bundle import BundleError, load_bundle

    copy = run_dir / BUNDLE_COPY
    try:
        sha = load_bundle(copy).sha256
    except BundleError as exc:
        raise Mismatch(f"bundle: the run's bundle copy {copy} cannot be read: {exc}") from None
    if sha != manifest["bundle"]["sha256"]:
        raise Mismatch(f"bundle: the copy {copy} hashes to {sha}, the manifest says {manifest['bundle']['sha256']}")
    return copy


def _check_data(data_dir: Path, manifest: dict[str, Any]) -> Any:
    from prism_challenge.data.manifest import DataError, load_manifest

    try:
        data = load_manifest(data_dir)
    except DataError as exc:
        raise Mismatch(f"data: {exc}") from None
    if data.sha256 != manifest["data"]["manifest_sha256"]:
        raise Mismatch(f"data: the MANIFEST of {data_dir} hashes to {data.sha256}, the run's was "
                       f"{manifest['data']['manifest_sha256']}")
    return data


def curve_bpb(curve: dict[str, list]) -> tuple[float, list[float]]:
    """(bpb re-derived from a manifest curve, each batch's total nats)."""
    per, cum_t, cum_b = curve["nats_per_target"], curve["cumulative_targets"], curve["cumulative_bytes"]
    targets = [t - p for t, p in zip(cum_t, [0, *cum_t[:-1]])]
    nats = [n * t for n, t in zip(per, targets)]
    return math.fsum(nats) / math.log(2) / cum_b[-1], nats


def _check_score(manifest: dict[str, Any]) -> tuple[float, list[float]]:
    bpb, nats = curve_bpb(manifest["curve"])
    recorded = manifest["score"]["prequential_bpb"]
    if not abs(bpb - recorded) <= CURVE_RTOL * abs(recorded):
        raise Mismatch(f"score: the curve gives {bpb!r} bpb, the manifest says {recorded!r}")
    return bpb, nats


def _stream_slices(data: Any, manifest: dict[str, Any], steps: list[int]) -> dict[int, list[np.ndarray]]:
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


def _load_audit(run_dir: Path, manifest: dict[str, Any], batch_nats: list[float], data: Any
                ) -> tuple[dict[int, Any], dict[int, dict[str, np.ndarray]]]:
    """The audited steps as the feeder held them and their stored inputs by step, after checking
    every hash and the curve."""
    from prism_challenge.auditstage import AUDIT_DIR
    from prism_challenge.evaluator.snapshots import AuditedStep, file_sha256, snapshot_name
    from prism_challenge.rescore import inputs_digest

    n = int(manifest["compute"]["world_size"])
    batches = manifest["audit"]["batches"]
    stream = _stream_slices(data, manifest, [e["step"] for e in batches]) if batches else {}
    out, inputs = {}, {}
    for e in batches:
        step = e["step"]
        snap = run_dir / AUDIT_DIR / snapshot_name(step)
        if not snap.is_file() or file_sha256(snap) != e["snapshot_sha256"]:
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


def _children(run_dir: Path, manifest: dict[str, Any], copy: Path, audits: dict[int, Any],
              inputs: dict[int, dict[str, np.ndarray]], data: Any, isolation: str, timeout_s: float) -> tuple[Any, int]:
    """Re-score and probe every audited batch in fresh jailed processes; the first mismatch raised."""
    from prism_challenge.auditstage import empty_artifacts
    from prism_challenge.data.builtin import default_cache_root
    from prism_challenge.data.partition import default_salt_path
    from prism_challenge.evaluator.isolation import IsolationError, Limits
    from prism_challenge.evaluator.jail import DEFAULT_MAX_FILE_BYTES, DEFAULT_MAX_OPEN_FILES, Jail, default_memory_limit
    from prism_challenge.evaluator.instrument import autocast_dtype
    from prism_challenge.rescore import AuditReport, Job, compare_blind, compare_rescore, run_both

    cfg, audit = manifest["config"], manifest["audit"]
    device = "cuda" if manifest["compute"]["device"] == "cuda" and _cuda() else "cpu"
    module = manifest["bundle"]["architecture"].rpartition(":")[0].removesuffix(".py").replace("/", ".")
    hidden = [str(data.root), str(default_salt_path(data.root)), str(default_cache_root()), str(run_dir / "model")]
    config = {"seed": manifest["seed"], "threads": cfg["threads"], "vocab_size": manifest["tokenizer"]["vocab_size"],
              "tokenizer": manifest["tokenizer"]["name"], "sequence_length": cfg["sequence_length"],
              "max_parameters": cfg["max_parameters"], "device": device, "bundle_root": str(copy),
              "architecture": [module, manifest["bundle"]["architecture"].rpartition(":")[2]],
              "scoring_autocast": cfg.get("scoring_autocast"), "context": audit["context"], "hidden": hidden}
    limits = Limits(default_memory_limit(), None, DEFAULT_MAX_FILE_BYTES, DEFAULT_MAX_OPEN_FILES)
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
    with (empty_artifacts(artifacts) if artifacts.is_dir() else tempfile.TemporaryDirectory()) as empty:
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


def verify(run_dir: Path, data_dir: Path | None = None, *, isolation: str = "strict",
           timeout_s: float = 1800.0) -> dict[str, Any]:
    """Verify a run directory; the figures (``bundle_sha256``, ``prequential_bpb``,
    ``audited_batches``, ``blind_probes``).

    Raises:
        Mismatch: the first thing that differs, named.
        ValueError: the run directory holds no readable scored manifest with an audit.
    """
    from prism_challenge.rescore import AuditError
    from prism_challenge.results import RunManifest
    from prism_challenge.run_manifest import MANIFEST_NAME

    path = run_dir / MANIFEST_NAME
    try:
        manifest = RunManifest.model_validate(json.loads(path.read_text())).to_json_dict()
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: not a readable run manifest ({str(exc).splitlines()[0]})") from None
    if manifest["status"] != "scored" or manifest.get("audit") is None:
        raise ValueError(f"{path}: the run was not scored with an audit (status {manifest['status']})")
    copy = _check_bundle(run_dir, manifest)
    data = _check_data(Path(data_dir or manifest["data"]["dir"]), manifest)
    bpb, batch_nats = _check_score(manifest)
    audits, inputs = _load_audit(run_dir, manifest, batch_nats, data)
    for e in manifest["audit"]["batches"]:  # the manifest's own verdict on its records
        if not e["match"]:
            raise Mismatch(f"audited batch {e['step']}: the run itself found recorded {e['recorded_nats']} and "
                           f"re-scored {e['rescored_nats']} nats")
    try:
        report, probes = _children(run_dir, manifest, copy, audits, inputs, data, isolation, timeout_s)
    except AuditError as exc:
        raise Mismatch(f"audit: {exc}") from None
    for e, got in zip(manifest["audit"]["batches"], report.batches):
        if got["rescored_nats"] != e["rescored_nats"]:
            sys.stderr.write(f"note: audited batch {e['step']} re-scored {got['rescored_nats']} nats here, "
                             f"{e['rescored_nats']} in the run (within the tolerance)\n")
    return {"bundle_sha256": manifest["bundle"]["sha256"], "data_manifest_sha256": manifest["data"]["manifest_sha256"],
            "prequential_bpb": bpb, "audited_batches": len(audits), "blind_probes": probes}


def add_verify_parser(sub: Any) -> None:
    """Register ``prism verify``."""
    p = sub.add_parser("verify", help="recompute a scored run directory (hashes, score, audited batches)",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("run_dir", help="a run directory written by prism eval")
    p.add_argument("--data", default=None, help="the data directory (default: the manifest's data.dir)")
    p.add_argument("--isolation", choices=("strict", "none"), default="strict",
                   help="sandbox the re-scoring processes (default strict)")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds for the re-scoring processes")
    p.set_defaults(func=cmd_verify)


def cmd_verify(args: argparse.Namespace) -> int:
    """``prism verify``: exit 0 verified, 1 a mismatch, 2 an unreadable run directory."""
    try:
        figures = verify(Path(args.run_dir), Path(args.data) if args.data else None, isolation=args.isolation,
                         timeout_s=args.timeout)
    except Mismatch as exc:
        print(f"mismatch: {exc}")
        return EXIT_MISMATCH
    except ValueError as exc:
        print(f"prism verify: {exc}", file=sys.stderr)
        return EXIT_UNREADABLE
    print(f"verified: prequential_bpb {figures['prequential_bpb']:.6f}, bundle {figures['bundle_sha256'][:12]}, "
          f"data MANIFEST {figures['data_manifest_sha256'][:12]}, {figures['audited_batches']} audited batches "
          f"re-scored equal to their records, {figures['blind_probes']} blind probes passed")
    return EXIT_VERIFIED
