"""The runner: the untrusted side of a scored run, one process per rank under torchrun.

Each rank (``python -m prism_challenge.evaluator.rank`` under torchrun, or the warm process its
worker claimed: :func:`warm_main`) connects to the trusted
feeder over the Unix socket named by ``PRISM_FEEDER_SOCKET``, receives the run configuration,
forces determinism BEFORE any submitted module is imported, imports the bundle's architecture and
training modules, and calls ``train(ctx)``. The bundle's ``build_model`` is replaced by a wrapper
that re-applies the forced seeds right before it runs, however the loop reaches it
(``ctx.build_model()`` or ``from architecture import build_model``).

Batches come one at a time: the runner reads the next batch from the feeder's socket, scores it
with the instrument, sends the loss record at once (with the request for the following batch,
which the feeder releases only because that record arrived), and only then yields the batch to
the loop. The following batch waits in the socket while the loop trains; it does not exist in
this process before the loop asks for it, after the current batch's record has left.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import os
import platform
import socket
import sys
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from prism_challenge.evaluator import protocol
from prism_challenge.evaluator.audit import arm
from prism_challenge.evaluator.cudainit import start_cuda
from prism_challenge.evaluator.census import TensorCensus
from prism_challenge.evaluator.childexit import exit_child
from prism_challenge.evaluator.gpu import peak_memory
from prism_challenge.evaluator.instrument import ContractError, autocast_dtype, measure
from prism_challenge.evaluator.interface import Batch, PrismContext, run_context
from prism_challenge.evaluator.protocol import context_values
from prism_challenge.evaluator.protocol import Kind
from prism_challenge.evaluator.seeding import (
    determinism_change,
    determinism_flags,
    force_determinism,
    force_seeds,
    force_source_imports,
)
from prism_challenge.evaluator.phases import PhaseClock
from prism_challenge.evaluator.reporter import Reporter, defer
from prism_challenge.evaluator.snapfile import exact_view
from prism_challenge.evaluator.staging import Staging
from prism_challenge.evaluator.statedict import (cpu_state, frames, state_digests, state_moments,
                                                 tensors_header_bytes, uncompiled)
from prism_challenge.evaluator.warm import WarmError, wait_for_claim
from prism_challenge.gates.param_count import ObjectGraphTooLarge, count_unique_elements, module_tensors, unique_elements
from prism_challenge.tokenizers import ReferenceTokenizer

ENV_SOCKET, ENV_TOKEN = protocol.ENV_SOCKET, protocol.ENV_TOKEN
MAX_BATCH_TOKENS = protocol.MAX_BATCH_TOKENS
TRACEBACK_LINES = 15
DRAIN_TIMEOUT_S = 60.0  # the feeder's answer to the last record is sent at once; this bounds a lost one
TENSOR_DIGESTS_MAX_BYTES = 512 << 10  # a DONE header's per-tensor digests and moments (ranks > 1), under MAX_HEADER
PLAIN_TENSORS = (torch.Tensor, nn.Parameter, *((nn.Buffer,) if hasattr(nn, "Buffer") else ()))
"""The types a scored model's ``state_dict`` entries may have for the audit's snapshot."""


class Runtime:
    """The runner's side of ``PrismContext``: model building and the instrumented stream."""

    def __init__(self, reader: protocol.FrameReader, config: dict[str, Any], rank: int = 0):
        self.sock = reader.sock
        self.rank = rank
        self.reader = reader
        self.config = config
        self.vocab_size = int(config["vocab_size"])
        self.seed = int(config["seed"])
        self.tokenizer_name = str(config["tokenizer"])
        self.device = str(config["device"])
        self.autocast = autocast_dtype(config.get("scoring_autocast"))  # prism.yaml's scoring_autocast
        self.stage = "setup"
        self._iterated = False
        self._build_fn: Callable[..., nn.Module] | None = None
        self.models: list[nn.Module] = []
        self.scored_model: nn.Module | None = None
        self.determinism = determinism_flags()  # as force_determinism left them (built after it)
        # an audited run: (step, the weights before the batch's scoring forward), until settle()
        self.held: tuple[int, dict[str, torch.Tensor]] | None = None
        self.sender: Reporter | None = None  # the last batch's report (record, answer, snapshot), on its way
        self.clock = PhaseClock(bool(config.get("profile_phases")))  # benchmarks only (evaluator/phases.py)

    def settle(self) -> None:
        """Wait until the last batch's report (:class:`~prism_challenge.evaluator.reporter.Reporter`:
        its record, the feeder's answer, an audited batch's snapshot, the next request) has left:
        the runner sends and reads nothing while it runs (it owns the socket).

        Raises:
            protocol.ProtocolError: it could not be sent.
        """
        sender, self.sender = self.sender, None
        if sender is not None:
            sender.settle()
        self.held = None  # the batch's copy of the weights, freed here on every rank (the loop's thread)

    # -- reporting ---------------------------------------------------------------------------
    def report_error(self, stage: str, message: str, tb: str = "") -> None:
        """Send an ERROR frame (best effort: the feeder may already be gone), once the snapshot on
        its way has left."""
        try:
            self.settle()
        except protocol.ProtocolError:
            pass
        try:
            protocol.send(self.sock, Kind.ERROR, {"stage": stage, "message": message, "traceback": tb})
        except OSError:
            pass

    def contract_error(self, message: str) -> ContractError:
        """Report a contract violation to the feeder now (the loop may swallow the exception)."""
        self.report_error("contract", message)
        return ContractError(message)

    # -- build_model -------------------------------------------------------------------------
    def wrap_build_model(self, fn: Callable[..., nn.Module]) -> Callable[..., nn.Module]:
        """Wrap the bundle's ``build_model`` so the forced seeds are applied right before it."""
        self._build_fn = fn

        @functools.wraps(fn)
        def forced_build_model(*args: Any, **kwargs: Any) -> nn.Module:
            force_seeds(self.seed)
            model = fn(*args, **kwargs)
            if isinstance(model, nn.Module):
                self.models.append(model)
            return model

        return forced_build_model

    def build_model(self, ctx: PrismContext) -> nn.Module:
        """``ctx.build_model()``: the bundle's ``build_model(ctx)`` under the forced seed."""
        if self._build_fn is None:
            raise RuntimeError("build_model is not available before the bundle is imported")
        force_seeds(self.seed)
        model = self._build_fn(ctx)
        if isinstance(model, nn.Module):
            self.models.append(model)
        return model

    # -- the instrumented stream -------------------------------------------------------------
    def iter_train_batches(
        self, ctx: PrismContext, model: nn.Module, batch_size: int, seq_len: int, tokenizer: Any
    ) -> Iterator[Batch]:
        """Validate the request, then return the single-pass instrumented stream."""
        if self._iterated:
            raise self.contract_error("ctx.iter_train_batches() may be called once per run: the stream is single-pass")
        if not isinstance(model, nn.Module):
            raise self.contract_error(
                f"iter_train_batches(model=...) needs a torch.nn.Module, got {type(model).__name__}"
            )
        for name, value in (("batch_size", batch_size), ("seq_len", seq_len)):
            if type(value) is not int:  # noqa: E721 - an int subclass could run code in harness comparisons
                raise self.contract_error(f"iter_train_batches({name}=...) must be an int, got {value!r}")
        if batch_size < 1:
            raise self.contract_error(f"iter_train_batches(batch_size={batch_size}) must be >= 1")
        if not 2 <= seq_len <= ctx.sequence_length:
            raise self.contract_error(
                f"iter_train_batches(seq_len={seq_len}) must be in 2..{ctx.sequence_length} (ctx.max_seq_len)"
            )
        if batch_size * seq_len > MAX_BATCH_TOKENS:
            raise self.contract_error(
                f"iter_train_batches: batch_size*seq_len = {batch_size * seq_len} exceeds {MAX_BATCH_TOKENS} tokens"
            )
        count = unique_elements(self._reachable(model))
        if count > ctx.max_parameters:
            raise self.contract_error(
                f"iter_train_batches(model=...): the model holds {count:,} unique parameter and buffer elements "
                f"(tensors reachable from it included), over the cap of {ctx.max_parameters:,} (the scored model "
                f"is held to the cap, not only build_model's)"
            )
        if tokenizer is not None:
            if isinstance(tokenizer, ReferenceTokenizer) or type(tokenizer) is str:
                name = tokenizer.name if isinstance(tokenizer, ReferenceTokenizer) else tokenizer
                if name != self.tokenizer_name:
                    raise self.contract_error(
                        f"iter_train_batches(tokenizer={name!r}) differs from the bundle's tokenizer "
                        f"{self.tokenizer_name!r} (prism.yaml's 'tokenizer:' field names the one the stream uses)"
                    )
            else:
                raise self.contract_error(
                    f"iter_train_batches(tokenizer=...) takes a tokenizer's name (a str) or "
                    f"ctx.reference_tokenizer(name), got {type(tokenizer).__name__}"
                )
        self._iterated = True
        self.scored_model = model
        return self._stream(model, batch_size, seq_len)

    def _stream(self, model: nn.Module, batch_size: int, seq_len: int) -> Iterator[Batch]:
        step = 0
        staging = Staging(self.device)
        request = {"batch_size": batch_size, "seq_len": seq_len}
        protocol.send(self.sock, Kind.NEXT, request)
        clock = self.clock
        clock.start()
        while True:
            clock.lap("loop")
            self.settle()  # an audited batch's snapshot (and the request after it) left while the loop trained
            clock.lap("report_wait")
            # batch `step` was asked for with the previous record: it waits in the socket (not in
            # this process) until the loop asks for it here
            kind, header, payload = self.reader.recv(max_payload=8 * MAX_BATCH_TOKENS)
            if kind == Kind.END:  # the loop asked past the last batch: tell the feeder it is leaving
                protocol.send(self.sock, Kind.EVENT, {"event": "end", "batches": step})
                return
            if kind != Kind.BATCH:
                raise protocol.ProtocolError(f"expected BATCH or END from the feeder, got {kind.name}")
            clock.lap("batch_wait")
            rows, cols = int(header["rows"]), int(header["seq_len"])
            tokens = staging.tokens(payload, rows, cols)
            self._check_determinism(step)
            clock.lap("staging")
            # the weights before the model sees the batch. Every rank takes the copy and frees it in
            # settle(): the ranks' allocations and frees follow one sequence, whatever the load
            # (issue 27); only rank 0's is sent
            self.held = self._state_before(model, step)
            clock.lap("state_copy")
            probe = header.get("probe")
            census = TensorCensus() if probe else None  # the probed batches also take a census
            try:
                scored = measure(model, tokens, self.vocab_size, tuple(probe) if probe else None, census,
                                 self.autocast)
            except ContractError as exc:
                raise self.contract_error(str(exc)) from None
            clock.lap("scoring")
            nats = defer(scored.total)  # enqueued before the loop gets the batch (reporter: no lookahead)
            del scored
            if census is not None:
                self._check_census(model, census, tokens, step)
            clock.lap("census")
            # record, answer, snapshot and the next request leave while the loop trains on this batch
            self.sender = Reporter(self.sock, self.reader, step, nats, bool(self.config.get("audit")),
                                   self.held if self.rank == 0 else None, then=((Kind.NEXT, request),))
            clock.batches += 1
            clock.lap("report_start")
            try:
                yield Batch(tokens, step)
            except GeneratorExit:
                # the loop dropped the stream before its end: tell the feeder now, so ranks that go
                # on without this one fail fast instead of hanging in a collective
                self.settle()
                protocol.send(self.sock, Kind.EVENT, {"event": "left", "batches": step + 1})
                raise
            step += 1

    def _state_before(self, model: nn.Module, step: int) -> tuple[int, dict[str, torch.Tensor]] | None:
        """An audited run (every rank; rank 0 sends it): ``(step, a copy of the scored module's state_dict)`` taken
        before the scoring forward, so no submitted code has run on the batch yet: a forward that
        wrote what it read into its own buffers leaves no trace in it. Held until the batch's report
        has left (:meth:`settle`); on the model's device (a copy of the parameters' size).

        Raises:
            ContractError: an entry that is not a plain tensor (a subclass could defer its copy).
        """
        if not self.config.get("audit"):
            return None
        out: dict[str, torch.Tensor] = {}
        copies: dict[tuple, torch.Tensor] = {}  # a tied tensor (two names, one storage) is copied once
        for name, value in uncompiled(model).state_dict().items():
            if not isinstance(value, torch.Tensor):
                continue
            if type(value) not in PLAIN_TENSORS:
                raise self.contract_error(f"state_dict entry {name!r} is a {type(value).__name__}: the scored "
                                          f"model's state must hold plain tensors")
            view = exact_view(value)
            if view not in copies:
                copies[view] = value.detach().clone()
            out[name] = copies[view]
        return step, out

    def _check_determinism(self, step: int) -> None:
        """Fail the run (stage contract) when the loop switched forced determinism or precision
        off before batch ``step`` (the gate refuses the switches; this backs it at run time).

        Raises:
            ContractError: naming the batch and the flag.
        """
        changed = determinism_change(self.determinism)
        if changed is not None:
            raise self.contract_error(f"batch {step}: {changed}: a submission may not switch forced determinism "
                                      f"or float precision (prism:determinism)")

    def _check_census(self, model: nn.Module, census: TensorCensus, tokens: torch.Tensor, step: int) -> None:
        """Hold what the scored forward read (registered or not) to the parameter cap.

        Raises:
            ContractError: the model's registered tensors together with every other tensor its
                forward read (see :mod:`~prism_challenge.evaluator.census`) exceed the cap.
        """
        reachable = self._reachable(model)
        count = unique_elements(reachable + census.tensors(exclude=tokens))
        cap = int(self.config["max_parameters"])
        if count > cap:
            raise self.contract_error(
                f"batch {step}: the scored forward read {count:,} unique tensor elements (parameters, buffers "
                f"and tensors held anywhere else), over the cap of {cap:,}; {unique_elements(reachable):,} of them "
                f"are reachable from the model"
            )

    def _reachable(self, model: nn.Module) -> list:
        """Every tensor reachable from ``model`` (:func:`module_tensors`).

        Raises:
            ContractError: the model reaches too many objects to account for.
        """
        try:
            return [t for group in module_tensors(model) for t in group]
        except ObjectGraphTooLarge as exc:
            raise self.contract_error(str(exc)) from None


def _tail(exc: BaseException) -> str:
    lines = "".join(traceback.format_exception(exc)).rstrip().splitlines()
    return "\n".join(lines[-TRACEBACK_LINES:])


def _import_bundle(runtime: Runtime, config: dict[str, Any]) -> Callable[[PrismContext], Any]:
    root = config["bundle_root"]
    force_source_imports(root)  # the gates checked the source; no planted bytecode runs instead
    sys.path.insert(0, root)
    arch_mod, arch_sym = config["architecture"]
    train_mod, train_sym = config["training"]
    runtime.stage = "import"
    arch = importlib.import_module(arch_mod)
    fn = getattr(arch, arch_sym, None)
    if not callable(fn):
        raise ContractError(f"{arch_mod.replace('.', '/')}.py does not define a callable {arch_sym}(ctx)")
    setattr(arch, arch_sym, runtime.wrap_build_model(fn))
    training = importlib.import_module(train_mod)
    train = getattr(training, train_sym, None)
    if not callable(train):
        raise ContractError(f"{train_mod.replace('.', '/')}.py does not define a callable {train_sym}(ctx)")
    return train


def _warm_up() -> None:
    """Import what nearly every training loop pulls in on its first steps, before the run starts:
    a loop's first ``torch.optim`` optimizer imports ``torch._dynamo`` (about 1 s on CPU). The
    rank does this while it waits for the gates, so it is off the path to the first batch."""
    for name in ("torch._dynamo", "torch.optim"):
        importlib.import_module(name)


def run(sock: socket.socket, rank: int, local_rank: int, world_size: int) -> int:
    """Run one rank: receive CONFIG, import the bundle, call ``train(ctx)``, report DONE.

    Returns the process exit code (0 when ``train`` returned).
    """
    _warm_up()  # while the gates run: nothing of the bundle is known or imported yet
    reader = protocol.FrameReader(sock)
    kind, config, _ = reader.recv(max_payload=0)
    if kind != Kind.CONFIG:
        raise protocol.ProtocolError(f"expected CONFIG from the feeder, got {kind.name}")
    device = config["device"]
    if device == "cuda":
        device = start_cuda(f"cuda:{local_rank}")  # before the hook is armed (cudainit)
    config["device"] = device
    force_determinism(int(config["seed"]), int(config["threads"]))
    arm(str(config["bundle_root"]), [str(config["artifacts_dir"])], hidden=config.get("hidden", ()))  # for good
    runtime = Runtime(reader, config, rank)
    try:
        train = _import_bundle(runtime, config)
        ctx = run_context(context_values(config, world_size), rank=rank, device=device, runtime=runtime)
        if local_rank != rank:
            ctx = dataclasses.replace(ctx, local_rank=local_rank)
        runtime.stage = "train"
        train(ctx)
    except BaseException as exc:  # noqa: BLE001 - everything the submission raises is reported
        if isinstance(exc, ContractError):
            runtime.report_error("contract", str(exc))
        else:
            runtime.report_error(runtime.stage, f"{type(exc).__name__}: {exc}", _tail(exc))
        return 1
    try:
        runtime.settle()  # the last batch's report: its record, the audit's answer, its snapshot
    except (OSError, protocol.ProtocolError) as exc:
        runtime.report_error("state", f"the last batch's report: {exc}")
        return 1
    done: dict[str, Any] = {**peak_memory(), "device_name": _device_name(device)}
    if runtime.clock.on:
        done["phases"] = runtime.clock.report()
    model = runtime.scored_model
    if model is not None:
        runtime.stage = "state"
        try:
            done["parameter_count"] = count = count_unique_elements(model)[0]
            cap = int(config["max_parameters"])
            if count > cap:  # e.g. buffers registered during training: held to the cap, and not sent
                runtime.report_error("contract", f"the scored model ended with {count:,} unique parameter and "
                                                 f"buffer elements, over the cap of {cap:,}")
                return 1
            state = cpu_state(model)
            done["state_sha256"], each = state_digests(state)
            if world_size > 1 and tensors_header_bytes(each) <= TENSOR_DIGESTS_MAX_BYTES:
                done["state_tensors"] = each  # names the tensors ranks disagree on (feedchecks._check_states)
                done["state_moments"] = state_moments(state)  # tells drift in the last bits from a real split
            if rank == 0:  # the trusted side keeps rank 0's scored model for the held-out evaluation
                for header, payload in frames(state):
                    protocol.send(sock, Kind.STATE, header, payload)
        except Exception as exc:  # noqa: BLE001 - e.g. a state tensor of an unstorable dtype
            runtime.report_error("state", f"{type(exc).__name__}: {exc}", _tail(exc))
            return 1
    protocol.send(sock, Kind.DONE, done)
    return 0


def _device_name(device: str) -> str:
    if device.startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    return f"cpu ({platform.machine()})"


def warm_main(fd: int) -> None:
    """A warm process of the pool (:mod:`~prism_challenge.evaluator.warm`): warm up, wait for a
    claim on the socket pair end ``fd``, take the claiming worker's environment as this
    process's own (``RANK``, ``MASTER_PORT``, ``TORCHELASTIC_*``, the feeder's socket and
    token: all that torchrun gave it), then run the rank as :func:`main`. Exits 0 without running
    anything when the pool ends before a claim.
    """
    _warm_up()
    try:
        env = wait_for_claim(fd)
    except (OSError, WarmError):
        os._exit(0)
    os.environ.clear()  # the claim carries the worker's environment less the pool's socket name
    os.environ.update(env)
    main()


def main() -> None:
    """One rank: read the rank layout and the socket from the environment, connect, run.

    Started by :mod:`prism_challenge.evaluator.rank` (torchrun's entry point), which first ties
    this process's life to torchrun's agent.
    """
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    path = os.environ.get(ENV_SOCKET)
    if not path:
        sys.stderr.write(f"prism runner: {ENV_SOCKET} is not set; the runner is started by `prism eval`\n")
        sys.exit(2)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(path)
    protocol.send(
        sock,
        Kind.HELLO,
        {
            "rank": rank,
            "local_rank": local_rank,
            "world_size": world_size,
            "pid": os.getpid(),
            "token": os.environ.get(ENV_TOKEN, ""),
        },
    )
    code = run(sock, rank, local_rank, world_size)
    sock.close()
    exit_child(code)  # skip interpreter teardown: submitted atexit hooks and threads do not run on

