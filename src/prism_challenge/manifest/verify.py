"""``prism verify RUN_DIR [--data DIR] [--key KEY]... [--service URL] [--reexecute] [--json]``:
recompute what a scored run directory holds, believing nothing it can recompute.

In order, stopping at the first mismatch (exit 1, the mismatch named; exit 0 and ``verified``
with the figures when all agree; exit 2 for a run directory, key or service it cannot read, a
CUDA run on a machine without CUDA, or a re-execution it cannot make on this machine), a line
per stage on stderr as it goes:

1. **certificate**: the manifest's ed25519 signature over its RFC 8785 canonical form
   (:mod:`prism_challenge.manifest.certificate`) verifies under a trusted key: the ``--key`` keys, the key
   ``--service URL`` publishes at ``GET /version``, or else the user's own (``prism eval``'s
   default). An unsigned manifest, another key, or a signature that does not match is a mismatch;
2. **bundle**: the sha256 of the bundle copy the run kept (``RUN_DIR/bundle``) is the manifest's;
3. **data**: the sha256 of the data directory's MANIFEST (``--data``, default the manifest's
   ``data.dir``) is the manifest's ``data.manifest_sha256``;
4. **score**: the counts, ``total_nats``, ``total_bits`` and ``prequential_bpb`` re-derived
   from the curve (:func:`~prism_challenge.manifest.verify_recompute.check_score`);
5. **verdict**: the verdict, its flags and ``final_score`` rebuilt under the profile's policy
   (:func:`~prism_challenge.manifest.verify_recompute.check_verdict`);
6. **draws**: the audited steps drawn again from the revealed ``run_secret`` are exactly the
   listed ones (:func:`~prism_challenge.manifest.verify_recompute.check_draws`);
7. **audit**: each audited batch's snapshot file and inputs hash to the manifest's values; its
   recorded nats (summed over ranks) are the curve's batch; its slices are the stream's rows
   again, cut from the data directory's train split as the feeder cut them; its blind probes are
   the ones the secret draws; and fresh jailed processes re-score them from the snapshot and
   re-run their blind probes (:mod:`prism_challenge.manifest.verify_audit`, :mod:`prism_challenge.audit.rescore`): the re-scored nats must
   reproduce the records within the audit's tolerance
   (:func:`~prism_challenge.evaluator.auditplan.within`). They run on the run's device kind
   under its recorded scoring autocast; a CUDA run on a machine without CUDA is refused before
   any stage (exit 2, the run's device named: on CPU it would differ by more than the
   tolerance, :func:`~prism_challenge.manifest.verify_audit.rescoring_device`). A snapshot that ``prism
   runs prune`` removed (named in the run's prune record with the sha256 the manifest binds,
   :mod:`prism_challenge.manifest.runs_prune`) cannot be re-scored: every other check of its batch is
   made, and the run ends with exit 3 and ``verified except ...``, naming the batches not
   re-scored, never ``verified``;
8. **re-execution** (``--reexecute``): the kept bundle runs again under the recorded settings,
   seed and secret (:mod:`prism_challenge.manifest.verify_reexecute`); the curve must be equal bit for
   bit, and the trained state's sha256.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from prism_challenge.manifest.verify_recompute import CURVE_RTOL, Mismatch, curve_bpb  # noqa: F401 - re-exported

EXIT_VERIFIED, EXIT_MISMATCH, EXIT_UNREADABLE, EXIT_PRUNED = 0, 1, 2, 3


def _check_bundle(run_dir: Path, manifest: dict[str, Any]) -> Path:
    from prism_challenge.audit.auditstage import BUNDLE_COPY
    from prism_challenge.intake.bundle import BundleError, load_bundle

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
        raise Mismatch(f"data: {exc}; on another machine, --data DIR names the run's data directory there") from None
    if data.sha256 != manifest["data"]["manifest_sha256"]:
        raise Mismatch(f"data: the MANIFEST of {data_dir} hashes to {data.sha256}, the run's was "
                       f"{manifest['data']['manifest_sha256']}")
    return data


def validate_manifest(raw: dict[str, Any]) -> None:
    """Check ``raw`` against :class:`~prism_challenge.manifest.results.RunManifest` (raises ``ValueError``)."""
    from prism_challenge.manifest.results import RunManifest

    RunManifest.model_validate(raw)


def schema_errors(exc: Any, limit: int = 3) -> str:
    """A pydantic ``ValidationError`` as ``field.path: rule`` items (the first ``limit``, then a
    count), e.g. ``seed: Input should be a valid integer; score.extra: Extra inputs are not permitted``."""
    errors = exc.errors()
    items = [f"{'.'.join(str(x) for x in e['loc']) or '(top level)'}: {e['msg']}" for e in errors[:limit]]
    more = f" (and {len(errors) - limit} more)" if len(errors) > limit else ""
    return "; ".join(items) + more


def read_manifest(run_dir: Path) -> dict[str, Any]:
    """The run directory's manifest as the file holds it (the signature covers these values).

    Raises:
        ValueError: the directory does not exist or holds no manifest; the manifest is not JSON
            or breaks the schema (the fields and rules named); or the run was not scored with an
            audit.
    """
    import pydantic

    from prism_challenge.manifest.run_manifest import MANIFEST_NAME

    if not run_dir.is_dir():
        raise ValueError(f"{run_dir}: " + ("not a directory: give the run directory that holds " + MANIFEST_NAME
                                           if run_dir.exists() else "no such run directory"))
    path = run_dir / MANIFEST_NAME
    if not path.is_file():
        raise ValueError(f"{run_dir}: holds no {MANIFEST_NAME} (not a run directory of prism eval or the service)")
    try:
        raw = json.loads(path.read_text())
        if not isinstance(raw, dict):
            raise ValueError("not a JSON object")
        validate_manifest(raw)
    except pydantic.ValidationError as exc:
        raise ValueError(f"{path}: not a valid run manifest: {schema_errors(exc)}") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not valid JSON ({exc})") from None
    except RecursionError:
        raise ValueError(f"{path}: not valid JSON (nested too deep)") from None
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

    from prism_challenge.terminal import shown

    # the text can quote the manifest's own fields: shown, never obeyed (terminal, markup)
    Console(stderr=True, highlight=False, soft_wrap=True).print(f"[bold]{stage:<12}[/bold] {shown(text)}")


Say = Callable[[str, str], None]


class _Stages:
    """Says each stage's line with its seconds as it ends (``say``), and keeps the seconds."""

    def __init__(self, say: Say):
        self.say, self.seconds, self.t = say, {}, time.monotonic()

    def restart(self) -> None:
        self.t = time.monotonic()

    def done(self, stage: str, line: str) -> None:
        self.seconds[stage] = time.monotonic() - self.t
        self.say(stage, f"{line} ({self.seconds[stage]:.1f} s)")
        self.t = time.monotonic()


def _trust(m: dict[str, Any], keys: list[str] | None, reexecute: bool, stages: _Stages) -> str:
    """The keys readable, the re-execution possible here, then the certificate; its key id."""
    from prism_challenge.manifest.certificate import CertificateError, check_certificate, trusted_keys

    try:
        trusted_keys(keys)  # a key that cannot be read is the caller's error (exit 2), not a mismatch
    except CertificateError as exc:
        raise ValueError(str(exc)) from None
    from prism_challenge.manifest.verify_audit import rescoring_device

    rescoring_device(m)  # a CUDA run on a machine without CUDA is refused first (exit 2), naming the device
    if reexecute:  # before anything long: a re-execution this machine cannot make is refused first
        from prism_challenge.manifest.verify_reexecute import device_of

        device_of(m)
        stages.restart()
    try:
        kid = check_certificate(m, keys)
    except CertificateError as exc:
        raise Mismatch(str(exc)) from None
    stages.done("certificate", f"signed by trusted key {kid}")
    return kid


def _recompute(m: dict[str, Any], profile: str | None, stages: _Stages,
               min_audited: int | None = None) -> tuple[float, list[float], list[int]]:
    """Score, verdict and draws from the manifest alone: (bpb, nats per batch, drawn steps)."""
    from prism_challenge.manifest import verify_recompute as rc

    bpb, batch_nats = rc.check_score(m)
    stages.done("score", f"{len(batch_nats)} batches, {bpb:.6f} bpb from the curve")
    policy, source = rc.policy_of(m, profile)
    rc.check_verdict(m, policy)
    stages.done("verdict", f"final_score {m['verdict']['final_score']:.6f}, flags {m['verdict']['flags']} under {source}")
    drawn = rc.check_draws(m, min_audited)
    a = m["audit"]["schedule"]["audited_batches"]
    stages.done("draws", f"{len(drawn)} audited batches drawn by the run_secret, as listed (harmonic, A = {a}: a "
                         f"cheat on a fraction f of the batches escapes with at most (1 - f)^{a})")
    return bpb, batch_nats, drawn


def _rescore(run_dir: Path, m: dict[str, Any], copy: Path, data: Any, batch_nats: list[float], isolation: str,
             timeout_s: float, stages: _Stages) -> tuple[int, int, int, list[int]]:
    """The audited batches' files, probes and re-scoring: (audited batches re-scored, blind
    probes passed, probe batches drawn again from the secret, the steps whose snapshot was
    pruned: every check but the re-scoring and blind probes, :mod:`~prism_challenge.manifest.runs_prune`)."""
    from prism_challenge.manifest import verify_recompute as rc
    from prism_challenge.audit.rescore import AuditError
    from prism_challenge.manifest.runs_prune import pruned_steps
    from prism_challenge.manifest.verify_audit import children, filler, load_audit

    pruned, when = pruned_steps(run_dir, m)
    audits, inputs = load_audit(run_dir, m, batch_nats, data, pruned)
    made = rc.check_probes(m, inputs, filler(m, data))
    for e in m["audit"]["batches"]:  # the manifest's own verdict on its records
        if not e["match"]:
            raise Mismatch(f"audited batch {e['step']}: the run itself found recorded {e['recorded_nats']} and "
                           f"re-scored {e['rescored_nats']} nats")
    present = {step: a for step, a in audits.items() if step not in pruned}
    gone = f"; {len(pruned)} not re-scored: their snapshots were pruned ({when}, prism runs prune)" if pruned else ""
    if not present:
        stages.done("re-scoring", f"0 batches re-scored{gone}")
        return 0, 0, made, sorted(pruned)
    stages.say("re-scoring", f"{len(present)} audited batches in fresh sandboxed processes ...")
    try:
        report, probes = children(run_dir, m, copy, present, inputs, data, isolation, timeout_s)
    except AuditError as exc:
        raise Mismatch(f"audit: {exc}") from None
    for e, got in zip([e for e in m["audit"]["batches"] if e["step"] in present], report.batches):
        if got["rescored_nats"] != e["rescored_nats"]:
            sys.stderr.write(f"note: audited batch {e['step']} re-scored {got['rescored_nats']} nats here, "
                             f"{e['rescored_nats']} in the run (within the tolerance)\n")
    stages.done("re-scoring", f"{len(present)} batches equal to their records, {probes} blind probes passed"
                + (f" ({made} probe batches drawn again from the secret)" if made else "") + gone)
    return len(present), probes, made, sorted(pruned)


def verify(run_dir: Path, data_dir: Path | None = None, *, isolation: str = "strict", timeout_s: float = 1800.0,
           keys: list[str] | None = None, profile: str | None = None, reexecute: bool = False,
           say: Say | None = None, min_audited: int | None = None) -> dict[str, Any]:
    """Verify a run directory (the stages in the module docstring); the figures
    (``key_id``, ``bundle_sha256``, ``prequential_bpb``, ``final_score``, ``audited_batches``
    (re-scored), ``draws_checked``, ``blind_probes``, ``probes_redrawn``, ``reexecuted``,
    ``snapshots_pruned`` (the audited steps not re-scored: their snapshots were pruned),
    ``seconds`` per stage).

    Args:
        keys: the trusted public keys (base64 or PEM files); ``None``: the user's own key.
        profile: the run's profile (name or file) when this installation's differs.
        min_audited: the smallest ``A`` accepted (``None``: the harness's
            :data:`~prism_challenge.evaluator.auditplan.AUDITED_BATCHES`).
        say: called with (stage, line) as each stage ends (default: a line on stderr).

    Raises:
        Mismatch: the first thing that differs, named.
        ValueError: the run directory holds no readable scored manifest with an audit, a key
            cannot be read, the run was made on CUDA and this machine has none, or the
            re-execution cannot be made here (another device kind).
    """
    stages = _Stages(say or _say)
    m = read_manifest(run_dir)
    kid = _trust(m, keys, reexecute, stages)
    copy = _check_bundle(run_dir, m)
    data = _check_data(Path(data_dir or m["data"]["dir"]), m)
    stages.done("hashes", f"bundle {m['bundle']['sha256'][:12]}, data MANIFEST {m['data']['manifest_sha256'][:12]}")
    bpb, batch_nats, _ = _recompute(m, profile, stages, min_audited)
    audited, probes, redrawn, pruned = _rescore(run_dir, m, copy, data, batch_nats, isolation, timeout_s, stages)
    again = None
    if reexecute:
        from prism_challenge.manifest.verify_reexecute import reexecute as rerun

        stages.say("re-execution", "the kept bundle runs again under the recorded settings ...")
        again = rerun(run_dir, m, copy, data, isolation, say=lambda line: stages.say("re-execution", line))
        stages.done("re-execution", again["line"])
    return {"key_id": kid, "bundle_sha256": m["bundle"]["sha256"], "data_manifest_sha256": m["data"]["manifest_sha256"],
            "prequential_bpb": bpb, "final_score": m["verdict"]["final_score"], "audited_batches": audited,
            "draws_checked": True, "blind_probes": probes, "probes_redrawn": redrawn, "reexecuted": again,
            "snapshots_pruned": pruned, "seconds": stages.seconds}  # draws_checked: always, a manifest without run_secret is a mismatch


VERIFY_DESCRIPTION = (
    "Recompute a scored run directory, believing nothing it can recompute: the certificate "
    "(the manifest's ed25519 signature, under a trusted key), the bundle's and the data's "
    "hashes, the score from the curve, the verdict and final_score under the profile's policy, "
    "the audit's draws from the revealed run_secret, then each audited batch re-scored in fresh "
    "sandboxed processes. A line per stage goes to stderr as it ends.")
VERIFY_EPILOG = ("exit status: 0 verified; 1 mismatch (the first field that differs is named); 2 a "
                 "directory without a scored, audited manifest, an unreadable key or service, a CUDA "
                 "run on a machine without CUDA, or a re-execution this machine cannot make; 3 everything "
                 "verified but the re-scoring of the audited batches whose snapshots were pruned "
                 "(prism runs prune).")


def add_verify_parser(sub: Any) -> None:
    """Register ``prism verify``."""
    p = sub.add_parser("verify", help="recompute a scored run directory (signature, hashes, score, verdict, draws, "
                                      "audited batches; --reexecute: the whole run)",
                       description=VERIFY_DESCRIPTION, epilog=VERIFY_EPILOG)
    p.add_argument("run_dir", metavar="RUN_DIR", help="a run directory written by prism eval or the service")
    p.add_argument("--data", default=None, metavar="DIR", help="the data directory (default: the manifest's data.dir)")
    p.add_argument("--key", action="append", default=None, metavar="BASE64|PEMFILE",
                   help="a trusted signing public key, from its owner (not from the manifest checked): "
                        "the base64 of the raw 32-byte key, as /version's signing_public_key, or a PEM "
                        "file; repeatable; default: your own key (prism eval's)")
    p.add_argument("--service", default=None, metavar="URL",
                   help="trust the signing key the service at URL publishes at /version")
    p.add_argument("--profile", default=None, metavar="NAME|FILE",
                   help="the run's profile, when it is not this installation's copy of the manifest's profile")
    p.add_argument("--min-audited", type=int, default=None, metavar="A",
                   help="accept a run audited with this A or more (default: the harness's own A; a smaller A "
                        "is a weaker audit, refused)")
    p.add_argument("--reexecute", action="store_true",
                   help="also run the kept bundle again and compare the curve bit for bit (same device kind)")
    p.add_argument("--isolation", choices=("strict", "none"), default="strict",
                   help="sandbox the re-scoring processes (default strict)")
    p.add_argument("--timeout", type=float, default=1800.0, metavar="SECONDS",
                   help="limit for the re-scoring processes (default %(default)s)")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object on stdout: the figures, the mismatch, or the error (exit 2)")
    p.set_defaults(func=cmd_verify)


def _check_arguments(args: argparse.Namespace) -> None:
    """The caller's own arguments, before anything is verified: a ``--profile`` that cannot be
    loaded and a ``--data`` that is not a prepared data directory are the caller's error (exit 2),
    not a mismatch of the run.

    Raises:
        ValueError: naming the option, the value and the rule.
    """
    from prism_challenge.data.manifest import MANIFEST_NAME
    from prism_challenge.profiles import ProfileError, load_profile

    if args.profile is not None:
        try:
            load_profile(args.profile)
        except ProfileError as exc:
            raise ValueError(str(exc)) from None
    if args.data is not None and not (Path(args.data) / MANIFEST_NAME).is_file():
        what = "no such directory" if not Path(args.data).exists() else f"holds no {MANIFEST_NAME}"
        raise ValueError(f"--data {args.data}: {what} (give the run's prepared data directory, as prism data "
                         "prepare --out wrote it)")


def _steps(steps: list[int], shown: int = 8) -> str:
    """``0, 1, 4`` (the first ``shown``, then a count)."""
    more = f" and {len(steps) - shown} more" if len(steps) > shown else ""
    return ", ".join(str(s) for s in steps[:shown]) + more


def cmd_verify(args: argparse.Namespace) -> int:
    """``prism verify``: exit 0 verified, 1 a mismatch, 2 an unreadable run directory, key or service
    (with ``--json``, ``{"verified": false, "error": ...}`` on stdout too), 3 verified but for the
    audited batches whose snapshots were pruned (``--json``: ``"verified": false`` and their
    steps in ``snapshots_pruned``)."""
    try:
        _check_arguments(args)
        keys = list(args.key) if args.key else None
        if args.service:
            keys = [*(keys or []), service_key(args.service)]
        figures = verify(Path(args.run_dir), Path(args.data) if args.data else None, isolation=args.isolation,
                         timeout_s=args.timeout, keys=keys, profile=args.profile, reexecute=args.reexecute,
                         min_audited=args.min_audited)
    except Mismatch as exc:
        print(json.dumps({"verified": False, "mismatch": str(exc)}) if args.json else f"mismatch: {exc}")
        return EXIT_MISMATCH
    except ValueError as exc:
        print(f"prism verify: {exc}", file=sys.stderr)
        if args.json:
            print(json.dumps({"verified": False, "error": str(exc)}))
        return EXIT_UNREADABLE
    pruned = figures["snapshots_pruned"]
    if args.json:
        print(json.dumps({"verified": not pruned, **figures}))
        return EXIT_PRUNED if pruned else EXIT_VERIFIED
    if pruned:
        print(f"verified except the re-scoring: the snapshots of {len(pruned)} audited batches (steps "
              f"{_steps(pruned)}) were pruned (prism runs prune); prequential_bpb {figures['prequential_bpb']:.6f}, "
              f"bundle {figures['bundle_sha256'][:12]}, data MANIFEST {figures['data_manifest_sha256'][:12]}, the "
              f"audited inputs and probes checked, {figures['audited_batches']} audited batches re-scored, signed by "
              f"{figures['key_id']}")
        return EXIT_PRUNED
    print(f"verified: prequential_bpb {figures['prequential_bpb']:.6f}, bundle {figures['bundle_sha256'][:12]}, "
          f"data MANIFEST {figures['data_manifest_sha256'][:12]}, {figures['audited_batches']} audited batches "
          f"re-scored equal to their records, {figures['blind_probes']} blind probes passed, signed by "
          f"{figures['key_id']}" + (", re-executed bit for bit" if figures["reexecuted"] else ""))
    return EXIT_VERIFIED
