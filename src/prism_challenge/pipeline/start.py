"""The stages before the release, in order: ``data`` (:func:`load_data`), the launch
(:func:`launch`: the run directory, the feeder's socket, the sandbox and the ranks), ``gates``
(:func:`gates`) and the feeder (:func:`serve`).

Nothing here imports torch before the ranks are launched (on a CPU run): the parent's own
``import torch`` (about a second of CPU) then overlaps the ranks' interpreter start and imports
instead of delaying them. The static gates need torch (they resolve names against the live
modules), so :func:`launch` ends with it; the feeder and the later stages load on a thread
while the gates run. On a host with a core to spare for it, the parameter cap's child starts
with the ranks too (a spare, :func:`~prism_challenge.gates.param_parent.warm_child`): it imports
torch, then waits for its arguments, which the gate sends once the static gates passed.
``tests/test_pipeline_imports.py`` keeps it so.
"""

from __future__ import annotations

import contextlib
import importlib
import math
import os
import secrets
import shutil
import socket
import threading
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

from prism_challenge import scratch
from prism_challenge.data.builtin import default_cache_root, ensure_builtin
from prism_challenge.data.manifest import DataError, load_manifest
from prism_challenge.data.partition import default_salt_path
from prism_challenge.data.stream import train_stream
from prism_challenge.evaluator import childgc, launcher, protocol
from prism_challenge.evaluator.isolation import Guard, IsolationError
from prism_challenge.evaluator.jail import Jail, jail_limits
from prism_challenge.evaluator.protocol import ENV_SOCKET, ENV_TOKEN, context_values
from prism_challenge.evaluator.sizing import run_sizes
from prism_challenge.failures import TOKENIZER, USAGE_STAGE, EvalFailure
from prism_challenge.gates.param_parent import spare_cores, warm_child
from prism_challenge.gates.stage import parameter_cap, static_gates
from prism_challenge.intake.bundle import Bundle
from prism_challenge.manifest.certificate import user_key_path
from prism_challenge.options import EvalOptions
from prism_challenge.pipeline.context import Run, Sandbox
from prism_challenge.profiles import data_mismatch, manifest_record
from prism_challenge.score.scoringprecision import scoring_autocast
from prism_challenge.tokenizers import TokenizerError, reference_tokenizer
from prism_challenge.events import BatchScored

if TYPE_CHECKING:  # these import torch
    from prism_challenge.evaluator.feeder import Feeder, StepRecord
    from prism_challenge.evaluator.gpu import CudaCheck

def check_out_dir(run_dir: Path) -> None:
    """Refuse an ``--out`` that is not a directory or not empty (stage ``config``)."""
    if run_dir.exists() or run_dir.is_symlink():
        if not run_dir.is_dir():
            raise EvalFailure(USAGE_STAGE, f"--out {run_dir}: exists and is not a directory")
        if any(run_dir.iterdir()):
            raise EvalFailure(USAGE_STAGE, f"--out {run_dir}: directory exists and is not empty "
                                           "(name a new or empty directory)")


SOCKET_PATH_MAX = 100  # a unix socket path, bytes: under sun_path's 108 with room to spare
AFTER_LAUNCH = ("prism_challenge.evaluator.feeder", "prism_challenge.pipeline.stream", "prism_challenge.pipeline.finish")
"""What the parent imports on a thread while the gates run (after its own ``import torch``)."""
GUARD_INTERVAL_S = 1.0  # the guard's /proc scans: rare, off the ranks' cores (see stream.WATCH_INTERVAL_S)


def _new_run_dir(opts: EvalOptions, bundle: Bundle) -> tuple[Path, bool]:
    """Create the run directory; returns it and whether it was created here (not just emptied)."""
    fresh = True
    if opts.out_dir:
        run_dir = Path(opts.out_dir)
        check_out_dir(run_dir)
        fresh = not run_dir.exists()
    else:
        stamp = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
        run_dir = Path("prism-runs") / f"{stamp}-{bundle.root.name}-{bundle.sha256[:8]}"
        n = 1
        while run_dir.exists():
            n += 1
            run_dir = run_dir.with_name(f"{stamp}-{bundle.root.name}-{bundle.sha256[:8]}-{n}")
    run_dir.mkdir(parents=True, exist_ok=True)
    return run_dir.resolve(), fresh


def _remove_run_dir(run_dir: Path, fresh: bool) -> None:
    """Undo :func:`_new_run_dir` for a run that never started (its bundle was refused)."""
    if fresh:
        shutil.rmtree(run_dir, ignore_errors=True)
        if run_dir.parent.name == "prism-runs":  # the default parent, when this run made it
            try:
                run_dir.parent.rmdir()
            except OSError:  # other runs live there
                pass
        return
    for child in run_dir.iterdir():
        if child.is_dir() and not child.is_symlink():
            shutil.rmtree(child, ignore_errors=True)
        else:
            child.unlink(missing_ok=True)


def _socket_path(run_dir: Path) -> tuple[str, Path | None]:
    """The feeder socket: in the run directory when the path fits, else in a fresh folder of the
    current owner folder (:func:`prism_challenge.scratch.mkdtemp`), else of the process's own
    (under the temp directory: the shortest path)."""
    path = run_dir / "feeder.sock"
    if len(os.fsencode(path)) < SOCKET_PATH_MAX:
        return str(path), None
    tmp = scratch.mkdtemp("prism-")
    if len(os.fsencode(tmp / "feeder.sock")) >= SOCKET_PATH_MAX:
        shutil.rmtree(tmp)
        tmp = scratch.own().mkdtemp("prism-")
    return str(tmp / "feeder.sock"), tmp


def _sandbox(opts: EvalOptions, run_dir: Path, artifacts: Path, data_root: Path, bundle: Bundle,
             device: str) -> Sandbox:
    """Open the jail (raises :class:`EvalFailure` at stage ``isolation`` when strict is impossible)."""
    sizes = run_sizes(opts.nproc, device)
    tasks = sizes.max_processes if opts.max_processes is None else opts.max_processes
    limits = jail_limits(
        device, opts.memory_limit_bytes,
        # RLIMIT_NPROC counts every task of the uid: only meaningful for the dedicated sandbox uid
        max_processes=tasks if opts.isolation == "strict" and os.geteuid() == 0 else None,
        max_file_bytes=opts.max_file_bytes,
        max_open_files=opts.max_open_files,
    )
    hidden = [str(p) for p in _hidden(data_root, run_dir, _key_paths(opts))]
    try:
        jail = Jail.open(opts.isolation, bundle_dir=bundle.root, hidden=hidden, limits=limits, threads=opts.threads,
                         audit=opts.audit_hooks, tmp_bytes=sizes.tmp_bytes, shm_bytes=sizes.shm_bytes)
    except IsolationError as exc:
        raise EvalFailure("isolation", str(exc)) from None
    guard = Guard([artifacts], quota_bytes=opts.artifacts_quota_bytes, uid=jail.uid, max_processes=limits.max_processes,
                  interval_s=GUARD_INTERVAL_S)
    return Sandbox(jail, guard)


def _hidden(data_root: Path, run_dir: Path, keys: list[Path] | tuple[Path, ...] = ()) -> list[Path]:
    """What no jailed process may see: the data directory, its salt, PRISM's caches, the
    trusted side's copy of the scored state and the signing key (``keys``, :func:`_key_paths`)
    (the sandbox covers them; the audit hook refuses them)."""
    return [data_root, default_salt_path(data_root), default_cache_root(), run_dir / "model", *keys]


def _key_paths(opts: EvalOptions) -> list[Path]:
    """The signing key's file (the user's key: its folder too), to hide from every jailed process."""
    if opts.signing_key_file:
        return [Path(os.path.realpath(opts.signing_key_file))]
    path = user_key_path()
    return [path.parent, path]


def load_data(run: Run) -> None:
    """Stage ``data``: the bundle's reference tokenizer and the locked data, verified before
    anything is launched; the profile's record.

    Raises:
        EvalFailure: stage ``intake`` (an unknown tokenizer), ``data`` (a bad data directory) or
            :data:`USAGE_STAGE` (a tokenizer the profile does not allow).
    """
    opts = run.opts
    with run.control.stage("data"):
        try:
            run.tokenizer = reference_tokenizer(run.bundle.tokenizer)
        except TokenizerError as exc:
            raise EvalFailure("intake", f"prism.yaml: {exc}") from None
        try:
            data_dir = Path(opts.data_dir) if opts.data_dir else ensure_builtin()
            run.data = load_manifest(data_dir)
            run.data.verify("train")
            run.chunks = train_stream(run.data, run.tokenizer)
        except DataError as exc:
            raise EvalFailure("data", str(exc)) from None
        run.profile_record = _check_profile(opts, run.tokenizer.name, run.data)
    run.control.check()


def launch(run: Run, undo: contextlib.ExitStack) -> None:
    """The run directory, the feeder's socket, the sandbox, torchrun and (on CUDA) the CUDA
    check, each with its undoing pushed on ``undo`` (run only if a stage before the release
    fails).

    Raises:
        EvalFailure: stage ``isolation`` (no sandbox), or :data:`USAGE_STAGE` (``--out``).
    """
    opts, bundle = run.opts, run.bundle
    run.run_dir, run.fresh_dir = _new_run_dir(opts, bundle)
    undo.callback(_remove_run_dir, run.run_dir, run.fresh_dir)
    run.artifacts = run.run_dir / "artifacts"
    run.artifacts.mkdir()
    run.sock_path, run.sock_tmp = _socket_path(run.run_dir)
    if run.sock_tmp is not None:
        undo.callback(shutil.rmtree, run.sock_tmp, ignore_errors=True)
    run.config = {
        **model_config(opts, bundle, run.tokenizer, run.device),
        "artifacts_dir": str(run.artifacts),
        "hidden": [str(p) for p in _hidden(run.data.root, run.run_dir, _key_paths(opts))],
        "token_budget": opts.token_budget,
        "step_budget": opts.step_budget,
        "training": [bundle.training.module, bundle.training.symbol],
        "audit": opts.audited_batches > 0,  # rank 0 keeps each batch's weights until the feeder's answer
        "profile_phases": opts.profile_phases,  # benchmarks: evaluator/phases.py
    }
    run.key = run_secret(opts)  # after intake; never sent to the sandbox
    # the feeder's socket listens before the ranks start: their HELLO waits in its backlog until
    # the feeder, made once the gates passed (:func:`serve`), accepts it
    run.server, run.token = protocol.listen(run.sock_path, opts.nproc), secrets.token_hex(16)
    undo.callback(_close_feeder, run)
    run.sandbox = sandbox = _sandbox(opts, run.run_dir, run.artifacts, run.data.root, bundle, run.device)
    undo.callback(sandbox.jail.close)  # the cgroups of what it started, once the kills below ran
    undo.callback(sandbox.jail.kill_all)  # every child it started: torchrun's tree, the CUDA check
    undo.callback(sandbox.guard.kill)
    run.control.on_cancel(sandbox.jail.kill_all)  # torchrun's tree and every bounded child, at once
    run.control.on_cancel(sandbox.guard.kill)  # and whatever runs as the sandbox uid
    run.log_path = run.run_dir / "logs" / "runner.log"
    run.t_launch = time.monotonic()
    run.proc = launcher.launch(opts.nproc, {ENV_SOCKET: run.sock_path, ENV_TOKEN: run.token}, run.log_path,
                               jail=sandbox.jail, cwd=run.artifacts, socket_dir=Path(run.sock_path).parent,
                               warm=opts.warm_ranks)
    undo.callback(run.proc.kill)
    if opts.run_gates and spare_cores(opts.nproc):  # the parameter cap's child imports torch now too
        with contextlib.suppress(OSError, IsolationError):  # no spare: the gate starts its child when it runs
            warm_child(sandbox.jail, run.artifacts)
    if run.device == "cuda":
        from prism_challenge.evaluator.gpu import start_cuda_check
        run.cuda_check = start_cuda_check(sandbox.jail, opts.nproc)  # meanwhile
    with childgc.paused():  # about 0.1 s less of the parent's CPU (childgc)
        importlib.import_module("torch")  # the parent's own, now that the ranks import theirs (the gates need it)

    run.imports = _import_meanwhile(AFTER_LAUNCH)


def _import_meanwhile(modules: tuple[str, ...]) -> threading.Thread:
    """Import ``modules`` on a thread: the feeder and the stages after the release load while
    the gates run (they wait on the parameter cap's child most of the time). A module that
    fails to import here raises again, with its error, when :func:`serve` imports it."""
    def load() -> None:
        for name in modules:
            try:
                importlib.import_module(name)
            except Exception:  # noqa: BLE001 - raised again where the module is used
                return

    thread = threading.Thread(target=load, name="prism-imports", daemon=True)
    thread.start()
    return thread


def serve(run: Run) -> tuple[ModuleType, ModuleType]:
    """The feeder, once the gates passed: it accepts the ranks waiting in the socket's backlog
    and holds their configuration until :func:`~prism_challenge.pipeline.stream.release`.
    Returns the modules of the stages after the release (``stream``, ``finish``), imported here,
    before the release, so that an import that fails is undone like any stage before it."""
    if run.imports is not None:
        run.imports.join()  # a module the thread could not import raises below, with its error
    from prism_challenge.pipeline import finish, stream

    run.feeder = _feeder(run, run.server, run.token)
    run.feeder.start(release=False)
    return stream, finish


def _feeder(run: Run, server: socket.socket, token: str) -> Feeder:
    """The run's feeder, serving on the listening ``server`` socket; its first import of
    :mod:`~prism_challenge.evaluator.feeder` imports torch."""
    from prism_challenge.audit.auditstage import AUDIT_DIR
    from prism_challenge.evaluator.feeder import Feeder

    opts = run.opts
    return Feeder(
        run.sock_path,
        run.chunks,
        run.config,
        world_size=opts.nproc,
        vocab_size=run.tokenizer.vocab_size,
        token_budget=opts.token_budget,
        byte_budget=opts.byte_budget,
        step_budget=opts.step_budget,
        wall_clock_budget=opts.wall_clock_budget,
        on_record=_on_record(run),
        # the scored model's state: 16 bytes per capped element (float64, a tied tensor twice)
        max_state_bytes=16 * opts.max_parameters + (1 << 20),
        probe_key=run.key,
        audit_dir=run.run_dir / AUDIT_DIR,
        audited_batches=opts.audited_batches,
        server=server,
        token=token,
    )


def _close_feeder(run: Run) -> None:
    """Undo of the launch: close the feeder (its connections and socket), or, before it was
    made, the listening socket alone."""
    if run.feeder is not None:
        run.feeder.close()
        return
    run.server.close()
    try:
        os.unlink(run.sock_path)
    except OSError:
        pass


def _on_record(run: Run) -> Callable[[StepRecord], None]:
    """The feeder's ``on_record``: each scored batch as a :class:`~prism_challenge.events.BatchScored`
    event, with the stream's running totals (called on the feeder's thread)."""
    running: dict[str, float] = {"nats": 0.0, "bytes": 0, "targets": 0, "batches": 0}

    def recorded(rec: StepRecord) -> None:
        running["nats"] += rec.nats
        running["bytes"] += rec.bytes
        running["targets"] += rec.targets
        running["batches"] += 1
        run.control.emit(BatchScored(
            batch=int(running["batches"]) - 1, targets=rec.targets, bytes=rec.bytes, nats=rec.nats,
            targets_so_far=int(running["targets"]), bytes_so_far=int(running["bytes"]), nats_so_far=running["nats"],
            bpb_so_far=running["nats"] / math.log(2) / running["bytes"] if running["bytes"] else None,
            tokens_so_far=run.feeder.result.tokens_consumed))  # set by the feeder just before this call

    return recorded


def gates(run: Run) -> None:
    """Stage ``gates`` (while torchrun starts): the static gates, then the parameter cap in a
    jailed child; then the CUDA check's answer.

    Raises:
        EvalFailure: stage ``gates`` (blocking findings), ``intake`` (the bundle changed while
            the gates ran) or ``isolation`` (CUDA does not start in the sandbox).
    """
    opts, jail = run.opts, run.sandbox.jail
    if opts.run_gates:
        with run.control.stage("gates"):
            if opts.static_gates:
                run.gated = static_gates(opts, run.bundle.root)
                if run.gated.bundle_sha256 != run.bundle.sha256:
                    raise EvalFailure("intake", f"{opts.bundle}: the bundle's files changed while the gates ran")
            run.gated = parameter_cap(opts, run.bundle, run.tokenizer.vocab_size, run.gated, jail,
                                        context_values(run.config, opts.nproc))
        run.control.check()
    run.stack = _cuda_stack(run.cuda_check, jail)


def _cuda_stack(check: CudaCheck | None, jail: Jail) -> dict[str, Any]:
    """The GPU stack the CUDA check child saw inside the sandbox (:mod:`~prism_challenge.evaluator.gpu`),
    or the CPU record when there is no check.

    Raises:
        EvalFailure: stage ``isolation``: CUDA does not initialise there, with its error.
    """
    if check is None:
        from prism_challenge.evaluator.gpu import cpu_stack  # gpu imports torch

        return cpu_stack()
    from prism_challenge.evaluator.gpu import CudaCheckError

    try:
        return check.result()
    except CudaCheckError as exc:
        who = f" as the sandbox uid {jail.uid}" if jail.uid is not None else ""
        raise EvalFailure("isolation", f"CUDA does not initialise inside the sandbox{who}: {exc}") from None


def _check_profile(opts: EvalOptions, tokenizer: str, data) -> dict[str, Any] | None:
    """The manifest's ``profile`` entry; a data directory that differs from the profile's pin
    adds ``data`` to the overridden fields (``data_mismatch`` says how).

    Raises:
        EvalFailure: stage ``config``: the bundle's tokenizer is not one the profile allows.
    """
    profile = opts.profile
    if profile is None:
        return None
    if tokenizer not in profile.tokenizers:
        raise EvalFailure(USAGE_STAGE, f"profile {profile.name}: tokenizer {tokenizer!r} (prism.yaml) is not "
                                       f"allowed; allowed: {', '.join(profile.tokenizers)}", cause=TOKENIZER)
    overridden = list(opts.profile_overridden)
    mismatch = data_mismatch(profile.data, data.data, data.sha256)
    if mismatch and "data" not in overridden:
        overridden = sorted([*overridden, "data"])
    record = manifest_record(profile, overridden)
    if mismatch:
        record["data_mismatch"] = mismatch
    return record


def run_secret(opts: EvalOptions) -> bytes:
    """The run's secret (32 bytes): ``opts.run_secret`` when given (to repeat a run whose
    manifest revealed it), else fresh from :func:`secrets.token_bytes`. Nothing else: no data
    directory, salt, path or bundle hash enters it, so no one can compute it before the run.
    It keys the causality probes, the audit schedule and the blind probes; it stays in this
    process (never in a configuration, environment or file the sandbox can read) until the
    manifest reveals it once the run has ended."""
    return opts.run_secret if opts.run_secret is not None else secrets.token_bytes(32)


def model_config(opts: EvalOptions, bundle: Bundle, tokenizer, device: str) -> dict[str, Any]:
    """What both the runner and the held-out child need to build the model the same way."""
    return {
        "seed": opts.seed,
        "threads": opts.threads,
        "vocab_size": tokenizer.vocab_size,
        "tokenizer": tokenizer.name,
        "sequence_length": opts.seq_len,
        "max_parameters": opts.max_parameters,
        "device": device,
        "bundle_root": str(bundle.root),
        "architecture": [bundle.architecture.module, bundle.architecture.symbol],
        "scoring_autocast": scoring_autocast(opts, bundle)[0],
    }
