"""``prism verify RUN_DIR [--data DIR] [--key KEY]... [--service URL] [--reexecute] [--json]``:
recompute what a scored run directory holds, believing nothing it can recompute.

In order, stopping at the first mismatch (exit 1, the mismatch named; exit 0 and ``verified``
with the figures when all agree; exit 2 for a run directory, key or service it cannot read, or a
re-execution it cannot make on this machine), a line per stage on stderr as it goes:

1. **certificate**: the manifest's ed25519 signature over its RFC 8785 canonical form
   (:mod:`prism_challenge.certificate`) verifies under a trusted key: the ``--key`` keys, the key
   ``--service URL`` publishes at ``GET /version``, or else the user's own (``prism eval``'s
   default). An unsigned manifest, another key, or a signature that does not match is a mismatch;
2. **bundle**: the sha256 of the bundle copy the run kept (``RUN_DIR/bundle``) is the manifest's;
3. **data**: the sha256 of the data directory's MANIFEST (``--data``, default the manifest's
   ``data.dir``) is the manifest's ``data.manifest_sha256``;
4. **score**: the counts, ``total_nats``, ``total_bits`` and ``prequential_bpb`` re-derived
   from the curve (:func:`~prism_challenge.verify_recompute.check_score`);
5. **verdict**: the verdict, its flags and ``final_score`` rebuilt under the profile's policy
   (:func:`~prism_challenge.verify_recompute.check_verdict`);
6. **draws**: the audited steps drawn again from the revealed ``run_secret`` are exactly the
   listed ones (:func:`~prism_challenge.verify_recompute.check_draws`);
7. **audit**: each audited batch's snapshot file and inputs hash to the manifest's values; its
   recorded nats (summed over ranks) are the curve's batch; its slices are the stream's rows
   again, cut from the data directory's train split as the feeder cut them; its blind probes are
   the ones the secret draws; and fresh jailed processes re-score them from the snapshot and
   re-run their blind probes (:mod:`prism_challenge.rescore`): the re-scored nats must
   reproduce the records within the audit's tolerance
   (:func:`~prism_challenge.evaluator.auditplan.within`). They run on the run's device kind when
   this machine has it (a CUDA run verified on CPU differs by more than the tolerance: verify on
   the device the run used);
8. **re-execution** (``--reexecute``): the kept bundle runs again under the recorded settings,
   seed and secret (:mod:`prism_challenge.verify_reexecute`); the curve must be equal bit for
   bit, and the trained state's sha256.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from prism_challenge.verify_recompute import CURVE_RTOL, Mismatch, curve_bpb  # noqa: F401 - re-exported

EXIT_VERIFIED, EXIT_MISMATCH, EXIT_UNREADABLE = 0, 1, 2


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
    from prism_challenge.certificate import user_key_path

    hidden = [str(data.root), str(default_salt_path(data.root)), str(default_cache_root()), str(run_dir / "model"),
              str(user_key_path().parent), str(user_key_path())]
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


def validate_manifest(raw: dict[str, Any]) -> None:
    """Check ``raw`` against :class:`~prism_challenge.results.RunManifest` (raises ``ValueError``)."""
    from prism_challenge.results import RunManifest

    RunManifest.model_validate(raw)


def read_manifest(run_dir: Path) -> dict[str, Any]:
    """The run directory's manifest as the file holds it (the signature covers these values).

    Raises:
        ValueError: no readable run manifest, or not a scored one with an audit.
    """
    from prism_challenge.run_manifest import MANIFEST_NAME

    path = run_dir / MANIFEST_NAME
    try:
        raw = json.loads(path.read_text())
        if not isinstance(raw, dict):
            raise ValueError("not a JSON object")
        validate_manifest(raw)
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: not a readable run manifest ({str(exc).splitlines()[0]})") from None
    if raw["status"] != "scored" or raw.get("audit") is None:
        raise ValueError(f"{path}: the run was not scored with an audit (status {raw['status']})")
    return raw


def service_key(url: str, timeout_s: float = 10.0) -> str:
    """The signing public key a service publishes (``GET URL/version``'s ``signing_public_key``).

    Raises:
        ValueError: the service does not answer, or publishes no key.
    """
    import httpx

    try:
        r = httpx.get(url.rstrip("/") + "/version", timeout=timeout_s)
        r.raise_for_status()
        key = r.json().get("signing_public_key")
    except (httpx.HTTPError, ValueError, AttributeError) as exc:
        raise ValueError(f"--service {url}: cannot read its /version ({exc})") from None
    if not isinstance(key, str) or not key:
        raise ValueError(f"--service {url}: its /version publishes no signing_public_key")
    return key


def _say(stage: str, text: str) -> None:
    from rich.console import Console

    Console(stderr=True, highlight=False, soft_wrap=True).print(f"[bold]{stage:<12}[/bold] {text}")


Say = Callable[[str, str], None]


def verify(run_dir: Path, data_dir: Path | None = None, *, isolation: str = "strict", timeout_s: float = 1800.0,
           keys: list[str] | None = None, profile: str | None = None, reexecute: bool = False,
           say: Say | None = None) -> dict[str, Any]:
    """Verify a run directory (the stages in the module docstring); the figures
    (``key_id``, ``bundle_sha256``, ``prequential_bpb``, ``final_score``, ``audited_batches``,
    ``draws_checked``, ``blind_probes``, ``reexecuted``, ``seconds`` per stage).

    Args:
        keys: the trusted public keys (base64 or PEM files); ``None``: the user's own key.
        profile: the run's profile (name or file) when this installation's differs.
        say: called with (stage, line) as each stage ends (default: a line on stderr).

    Raises:
        Mismatch: the first thing that differs, named.
        ValueError: the run directory holds no readable scored manifest with an audit, a key
            cannot be read, or the re-execution cannot be made here (another device kind).
    """
    from prism_challenge import verify_recompute as rc
    from prism_challenge.certificate import CertificateError, check_certificate, trusted_keys
    from prism_challenge.rescore import AuditError

    say = say or _say
    seconds: dict[str, float] = {}
    t = time.monotonic()

    def done(stage: str, line: str) -> None:
        nonlocal t
        seconds[stage] = time.monotonic() - t
        say(stage, f"{line} ({seconds[stage]:.1f} s)")
        t = time.monotonic()

    m = read_manifest(run_dir)
    try:
        trusted_keys(keys)  # a key that cannot be read is the caller's error (exit 2), not a mismatch
    except CertificateError as exc:
        raise ValueError(str(exc)) from None
    if reexecute:  # before anything long: a re-execution this machine cannot make is refused first
        from prism_challenge.verify_reexecute import device_of

        device_of(m)
        t = time.monotonic()
    try:
        kid = check_certificate(m, keys)
    except CertificateError as exc:
        raise Mismatch(str(exc)) from None
    done("certificate", f"signed by trusted key {kid}")
    copy = _check_bundle(run_dir, m)
    data = _check_data(Path(data_dir or m["data"]["dir"]), m)
    done("hashes", f"bundle {m['bundle']['sha256'][:12]}, data MANIFEST {m['data']['manifest_sha256'][:12]}")
    bpb, batch_nats = rc.check_score(m)
    done("score", f"{len(batch_nats)} batches, {bpb:.6f} bpb from the curve")
    policy, source = rc.policy_of(m, profile)
    rc.check_verdict(m, policy)
    done("verdict", f"final_score {m['verdict']['final_score']:.6f}, flags {m['verdict']['flags']} under {source}")
    drawn = rc.check_draws(m)
    done("draws", f"{len(drawn)} audited batches drawn by the run_secret, as listed" if drawn is not None
         else "not checked: the manifest reveals no run_secret (a harness from before it did)")
    audits, inputs = _load_audit(run_dir, m, batch_nats, data)
    probes_made = rc.check_probes(m, inputs, _filler(m, data) if rc.secret_of(m) is not None else None)
    for e in m["audit"]["batches"]:  # the manifest's own verdict on its records
        if not e["match"]:
            raise Mismatch(f"audited batch {e['step']}: the run itself found recorded {e['recorded_nats']} and "
                           f"re-scored {e['rescored_nats']} nats")
    say("re-scoring", f"{len(audits)} audited batches in fresh sandboxed processes ...")
    try:
        report, probes = _children(run_dir, m, copy, audits, inputs, data, isolation, timeout_s)
    except AuditError as exc:
        raise Mismatch(f"audit: {exc}") from None
    for e, got in zip(m["audit"]["batches"], report.batches):
        if got["rescored_nats"] != e["rescored_nats"]:
            sys.stderr.write(f"note: audited batch {e['step']} re-scored {got['rescored_nats']} nats here, "
                             f"{e['rescored_nats']} in the run (within the tolerance)\n")
    done("re-scoring", f"{len(audits)} batches equal to their records, {probes} blind probes passed"
         + (f" ({probes_made} probe batches drawn again from the secret)" if probes_made else ""))
    again = None
    if reexecute:
        from prism_challenge.verify_reexecute import reexecute as rerun

        say("re-execution", "the kept bundle runs again under the recorded settings ...")
        again = rerun(run_dir, m, copy, data, isolation)
        done("re-execution", again["line"])
    return {"key_id": kid, "bundle_sha256": m["bundle"]["sha256"], "data_manifest_sha256": m["data"]["manifest_sha256"],
            "prequential_bpb": bpb, "final_score": m["verdict"]["final_score"], "audited_batches": len(audits),
            "draws_checked": drawn is not None, "blind_probes": probes, "reexecuted": again, "seconds": seconds}


def _filler(m: dict[str, Any], data: Any) -> np.ndarray | None:
    """The val prefix the run's blind probes continued their rows with (as the audit read it)."""
    from prism_challenge.auditstage import val_filler
    from prism_challenge.tokenizers import reference_tokenizer

    filler, _ = val_filler(data, reference_tokenizer(m["tokenizer"]["name"]))
    return filler


def add_verify_parser(sub: Any) -> None:
    """Register ``prism verify``."""
    p = sub.add_parser("verify", help="recompute a scored run directory (signature, hashes, score, verdict, draws, "
                                      "audited batches; --reexecute: the whole run)",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("run_dir", help="a run directory written by prism eval or the service")
    p.add_argument("--data", default=None, help="the data directory (default: the manifest's data.dir)")
    p.add_argument("--key", action="append", default=None, metavar="BASE64|PEMFILE",
                   help="a trusted signing public key (repeatable); default: your own key (prism eval's)")
    p.add_argument("--service", default=None, metavar="URL",
                   help="trust the signing key the service at URL publishes at /version")
    p.add_argument("--profile", default=None, help="the run's profile (name or file), when it is not this "
                                                   "installation's copy of the manifest's profile")
    p.add_argument("--reexecute", action="store_true",
                   help="also run the kept bundle again and compare the curve bit for bit (same device kind)")
    p.add_argument("--isolation", choices=("strict", "none"), default="strict",
                   help="sandbox the re-scoring processes (default strict)")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds for the re-scoring processes")
    p.add_argument("--json", action="store_true", help="print one JSON object (the figures, or the mismatch)")
    p.set_defaults(func=cmd_verify)


def cmd_verify(args: argparse.Namespace) -> int:
    """``prism verify``: exit 0 verified, 1 a mismatch, 2 an unreadable run directory, key or service."""
    try:
        keys = list(args.key) if args.key else None
        if args.service:
            keys = [*(keys or []), service_key(args.service)]
        figures = verify(Path(args.run_dir), Path(args.data) if args.data else None, isolation=args.isolation,
                         timeout_s=args.timeout, keys=keys, profile=args.profile, reexecute=args.reexecute)
    except Mismatch as exc:
        print(json.dumps({"verified": False, "mismatch": str(exc)}) if args.json else f"mismatch: {exc}")
        return EXIT_MISMATCH
    except ValueError as exc:
        print(f"prism verify: {exc}", file=sys.stderr)
        return EXIT_UNREADABLE
    if args.json:
        print(json.dumps({"verified": True, **figures}))
        return EXIT_VERIFIED
    print(f"verified: prequential_bpb {figures['prequential_bpb']:.6f}, bundle {figures['bundle_sha256'][:12]}, "
          f"data MANIFEST {figures['data_manifest_sha256'][:12]}, {figures['audited_batches']} audited batches "
          f"re-scored equal to their records, {figures['blind_probes']} blind probes passed, signed by "
          f"{figures['key_id']}" + (", re-executed bit for bit" if figures["reexecuted"] else ""))
    return EXIT_VERIFIED
