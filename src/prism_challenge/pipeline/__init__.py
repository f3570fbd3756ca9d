"""``prism eval``: the whole scored run, in pipeline order.

intake -> locked data (verified) -> feeder socket -> torchrun started (ranks wait) while the
static gates and the parameter cap run -> release (the ranks import the bundle) -> loss records
-> prequential score -> held-out -> run manifest.

The parent process is the trusted side: it alone reads data, counts bytes and writes the
manifest. The runner (untrusted) only ever sees one batch at a time.

:func:`evaluate` calls the stages in order over one typed run context
(:class:`~prism_challenge.pipeline.context.Run`): :mod:`~prism_challenge.pipeline.start` (data,
launch, gates), :mod:`~prism_challenge.pipeline.stream` (release, stream, score) and
:mod:`~prism_challenge.pipeline.finish` (saved state, audit and held-out, reference code
lengths, manifest).
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from prism_challenge.control import RunControl
from prism_challenge.data.refcodes import Background as RefCodes
from prism_challenge.evaluator.launcher import LaunchError, check_layout
from prism_challenge.failures import USAGE_STAGE, EvalFailure
from prism_challenge.gates.stage import static_gates
from prism_challenge.intake.bundle import Bundle, BundleError, load_bundle
from prism_challenge.intake.frozen import FrozenBundle, freeze
from prism_challenge.manifest.certificate import CertificateError, load_private_key, user_key
from prism_challenge.options import (  # re-exported: the pipeline's settings and defaults
    DEFAULT_HELDOUT_BYTES,
    DEFAULT_IDLE_TIMEOUT_S,
    DEFAULT_MAX_PARAMETERS,
    DEFAULT_RANK_TIMEOUT_S,
    DEFAULT_SEED,
    DEFAULT_SEQ_LEN,
    DEFAULT_THREADS,
    EvalOptions,
)
from prism_challenge.pipeline import start
from prism_challenge.pipeline.context import EvalOutcome, Run
from prism_challenge.pipeline.start import check_out_dir, run_secret
from prism_challenge.profiles import prepare_hint

__all__ = ["DEFAULT_HELDOUT_BYTES", "DEFAULT_IDLE_TIMEOUT_S", "DEFAULT_MAX_PARAMETERS", "DEFAULT_RANK_TIMEOUT_S",
           "DEFAULT_SEED", "DEFAULT_SEQ_LEN", "DEFAULT_THREADS", "EvalFailure", "EvalOptions", "EvalOutcome", "evaluate",
           "run_secret"]

# A GPU that torch can use shows one of these device nodes: NVIDIA's control device, WSL's
# GPU paravirtualisation, AMD's compute (ROCm) device. Without any, ``--device auto`` is cpu.
GPU_DEVICE_NODES = ("/dev/nvidiactl", "/dev/dxg", "/dev/kfd")


def _resolve_device(device: str) -> str:
    """``auto``, ``cpu`` or ``cuda`` as the device the run uses (``auto``: ``cuda`` when
    :func:`torch.cuda.is_available`).

    Raises:
        EvalFailure: stage :data:`USAGE_STAGE`: an unknown device, or ``cuda`` with none available.
    """
    if device not in ("auto", "cpu", "cuda"):
        raise EvalFailure(USAGE_STAGE, f"--device {device!r}: must be auto, cpu or cuda")
    if device == "cpu" or (device == "auto" and not any(os.path.exists(p) for p in GPU_DEVICE_NODES)):
        return "cpu"  # no GPU's device node: torch would find none, and it is not imported before the launch
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if not torch.cuda.is_available():
        raise EvalFailure(USAGE_STAGE, "--device cuda: no CUDA device is available")
    return device


def evaluate(opts: EvalOptions, control: RunControl | None = None) -> EvalOutcome:
    """Run the whole pipeline for one bundle and write the run manifest (the library's entry
    point, :func:`prism_challenge.api.evaluate`, wraps it: one result type, failure kinds).

    Args:
        opts: the run settings.
        control: the caller's cancel source and progress callback (:mod:`~prism_challenge.control`);
            a cancelled run ends with stage ``cancelled`` and ``"status": "cancelled"``.

    Returns:
        The outcome; ``outcome.failure`` is set (and the manifest says ``"status": "failed"``)
        when the run could not be scored. Failures before a run directory exists raise.

    Raises:
        EvalFailure: the bundle, gates, data or configuration stop the run before it starts
            (a refused bundle's early-launched tree is killed and its run directory removed);
            stage :data:`USAGE_STAGE` for an option that cannot be honoured (``--nproc 9``, an
            ``--out`` that is not an empty directory), checked before the data is touched.
    """
    t_start = time.monotonic()
    control = control or RunControl()
    try:
        check_layout(opts.nproc, opts.nnodes)
    except LaunchError as exc:
        raise EvalFailure(USAGE_STAGE, str(exc)) from None
    if opts.seq_len < 2:
        raise EvalFailure(USAGE_STAGE, f"--seq-len {opts.seq_len}: must be at least 2")
    if opts.isolation not in ("strict", "none"):
        raise EvalFailure(USAGE_STAGE, f"--isolation {opts.isolation!r}: must be strict or none")
    device = _resolve_device(opts.device)
    if device == "cuda":
        from prism_challenge.evaluator.gpu import gpu_count_error

        too_many = gpu_count_error(opts.nproc, device)
        if too_many:
            raise EvalFailure(USAGE_STAGE, too_many)
    if opts.out_dir:  # before the data is built or verified: a bad --out is a usage error
        check_out_dir(Path(opts.out_dir))
    pin = opts.profile.data if opts.profile is not None else None
    if pin is not None and not opts.data_dir and pin.source != "builtin":
        raise EvalFailure(USAGE_STAGE, f"profile {opts.profile.name} scores {pin.source} data: pass --data DIR, "
                                       f"a directory built with `{prepare_hint(pin)}`")

    # 1. intake: the bundle is frozen into one read-only copy; the gates, the parameter child,
    # every rank and the held-out children use it, and it is checked again after the run
    frozen: FrozenBundle | None = None
    try:
        with control.stage("intake"):
            try:
                frozen = freeze(opts.bundle)
            except BundleError as exc:
                raise EvalFailure("intake", f"{exc.rule}: {exc}") from None
            try:
                bundle = load_bundle(frozen.root)
            except BundleError as exc:
                if opts.run_gates:  # the gates name the broken rule with its file; nothing is launched
                    static_gates(opts, frozen.root)
                raise EvalFailure("intake", f"{exc.rule}: {exc}") from None
        return _run_bundle(opts, bundle, frozen, device, t_start, control)
    finally:
        if frozen is not None:
            frozen.remove()


def _signer(opts: EvalOptions) -> Ed25519PrivateKey:
    """The key that signs the run's manifest (``opts.signing_key_file``, else the user's own,
    created on first use), loaded before anything is launched.

    Raises:
        EvalFailure: stage :data:`USAGE_STAGE`: the key file is missing, readable by its group or
            others, or not an ed25519 key.
    """
    try:
        return load_private_key(opts.signing_key_file) if opts.signing_key_file else user_key()[0]
    except CertificateError as exc:
        raise EvalFailure(USAGE_STAGE, f"signing key: {exc}") from None


def _run_bundle(opts: EvalOptions, bundle: Bundle, frozen: FrozenBundle, device: str, t_start: float,
                control: RunControl) -> EvalOutcome:
    """Data, launch (torchrun started before the gates), gates, stream, score, audit and
    held-out, manifest: the stages in order, over one :class:`~prism_challenge.pipeline.context.Run`.

    torchrun is launched before the static gates and its ranks connect and wait: the runner
    learns which bundle to import only from the configuration the feeder sends once every gate
    passed, so nothing submitted runs in them before then, while the interpreter start and
    ``import torch`` of torchrun's agent and of every rank overlap the gates (the AST gates in
    this process, then the parameter cap in a child). A bundle the gates refuse kills the tree
    and leaves no run directory behind: what the launch made is undone by one
    :class:`~contextlib.ExitStack`, which the release empties (from then on the run directory
    stays, and the stream stage ends the tree itself).

    This module and :mod:`~prism_challenge.pipeline.start` import nothing that imports torch:
    on a CPU run the launch comes first, and the parent's own ``import torch`` overlaps the
    ranks' start instead of delaying it (a GPU run imports torch before the launch, to check
    the device). The feeder and the stages after the release are imported on a thread while the
    gates run; the feeder is made once the gates passed, and the ranks' connections wait in its
    socket's backlog until then.
    """
    run = Run(opts, control, bundle, frozen, device, t_start, _signer(opts))  # a bad key: before any launch
    start.load_data(run)
    with contextlib.ExitStack() as undo:
        start.launch(run, undo)
        start.gates(run)
        stream, finish = start.serve(run)  # the stages after the release, imported while the gates ran
        total, unit = stream.stream_total(run)
        undo.pop_all()  # released next: the run directory stays, and the stream stage ends the tree
    stream.release(run)
    with control.stage("stream", total=total, unit=unit, check=False) as mark:  # the tree runs: no raise here
        stream.stream(run)
        stream.score(run)
        mark.failed = run.failure is not None
    finish.save_state(run)
    if run.failure is None:
        refcodes = RefCodes(run.data, run.score.bytes)  # the compressors' code lengths, on a thread meanwhile
        finish.audit_and_heldout(run)
        finish.reference_codes(run, refcodes)
    return finish.write_manifest(run)


