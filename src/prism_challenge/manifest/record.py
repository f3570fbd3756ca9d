"""The run manifest as the pipeline builds it: its body from the stages' results, its budgets
and stream counts, the signed form written to the run directory, and ``--profile-phases``' record.

The manifest's schema is :mod:`~prism_challenge.manifest.results`; the file,
:mod:`~prism_challenge.manifest.run_manifest`; the signature, :mod:`~prism_challenge.manifest.certificate`.
"""

from __future__ import annotations

import dataclasses
import json
import platform
import resource
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from prism_challenge import __version__
from prism_challenge.evaluator.feeder import FeederResult
from prism_challenge.evaluator.launcher import agent_of
from prism_challenge.manifest.certificate import CertificateError, sign_manifest
from prism_challenge.manifest.run_manifest import SCHEMA
from prism_challenge.options import EvalOptions
from prism_challenge.score.scoring import curve
from prism_challenge.score.scoringprecision import scoring_record


def write_phases(path: Path, result: FeederResult, cpu_release: Any, wall_s: float) -> None:
    """``--profile-phases``: each rank's phase seconds (its DONE header's ``phases``) and the
    trusted parent's CPU seconds (all its threads: feeder, guard, progress) from the release to
    the end of the stream, as JSON."""
    use = resource.getrusage(resource.RUSAGE_SELF)
    path.write_text(json.dumps({
        "ranks": {str(r): d.get("phases") for r, d in sorted(result.done.items())},
        "parent": {"wall_s": round(wall_s, 6), "cpu_user_s": round(use.ru_utime - cpu_release.ru_utime, 6),
                   "cpu_system_s": round(use.ru_stime - cpu_release.ru_stime, 6)},
    }, indent=1))


def signed_manifest(manifest: dict[str, Any], key: Ed25519PrivateKey) -> dict[str, Any]:
    """The manifest in the typed model's JSON form (what the service stores and the API returns:
    it round-trips, so the signature holds there too) with its certificate
    (:func:`~prism_challenge.manifest.certificate.sign_manifest`); unsigned when it has no canonical form
    (a non-finite figure: ``prism verify`` then refuses it)."""
    from prism_challenge.manifest.results import RunManifest

    try:
        manifest = RunManifest.model_validate(manifest).to_json_dict()
    except ValueError:  # a manifest the model refuses is written as it is (the tests catch that bug)
        pass
    try:
        return sign_manifest(manifest, key)
    except CertificateError:
        return manifest


def run_budgets(opts: EvalOptions) -> dict[str, Any]:
    """The run manifest's ``budgets`` (also :func:`~prism_challenge.score.crown.budget_share`'s)."""
    return {"token_budget": opts.token_budget, "byte_budget": opts.byte_budget, "step_budget": opts.step_budget,
            "wall_clock_budget_s": opts.wall_clock_budget}


def stream_counts(result: FeederResult) -> dict[str, int]:
    """The run manifest's ``stream`` counts: batches, tokens, targets and bytes the stream covered."""
    return {"batches": len(result.steps), "tokens": result.tokens_consumed,
            "targets": sum(s.targets for s in result.steps), "bytes": sum(s.bytes for s in result.steps)}


def build_manifest(opts: Any, bundle: Any, data: Any, tokenizer: Any, device: str, result: FeederResult,
                   score: Any, failure: Any, findings: list[Any], param_count_gate: int | None, planted: list[str],
                   state_path: Path | None, timing: dict[str, Any]) -> dict[str, Any]:
    """The run manifest's body (:data:`~prism_challenge.manifest.run_manifest.SCHEMA`) from the
    pipeline's stages: ``opts`` (:class:`~prism_challenge.options.EvalOptions`), the bundle, the
    data and tokenizer, the feeder's ``result``, the score (``None`` when unscored) and the
    ``failure``, the gates' ``findings`` and parameter count, the files ``planted`` in the
    artifacts folder, the saved state's path and ``timing`` (seconds). The pipeline adds the
    profile, isolation, GPU, verdict, audit and reference code lengths, then signs it
    (:func:`signed_manifest`)."""
    done = result.done
    counts = {d.get("parameter_count") for d in done.values() if d.get("parameter_count") is not None}
    return {
        "schema": SCHEMA,
        "created_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "tool": {"name": "prism-challenge", "version": __version__},
        "status": "scored" if failure is None else "cancelled" if failure.kind == "cancelled" else "failed",
        "failure": None if failure is None else failure.to_dict(),
        "bundle": {
            "path": str(Path(opts.bundle).resolve()),  # as given: not a temporary extraction or copy
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
        "config": {"sequence_length": opts.seq_len, "max_parameters": opts.max_parameters, "threads": opts.threads,
                   **scoring_record(opts, bundle),
                   "policy": dataclasses.asdict(opts.policy)},
        "budgets": run_budgets(opts),
        "compute": {
            "torch_version": torch.__version__,
            "python": platform.python_version(),
            "platform": platform.platform(),
            "device": device,
            "world_size": opts.nproc,
            "nproc_per_node": opts.nproc,
            "nnodes": 1,
            "warm_ranks": opts.warm_ranks,  # rank processes started while the gates ran (evaluator/warm.py)
            "launcher": agent_of(opts.nproc, opts.warm_ranks),  # torchrun, or the single-rank agent
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
        "stream": {"stop_reason": result.stop_reason, **stream_counts(result)},
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
