"""``PrismContext``: everything a submitted bundle may see of the challenge.

The context is frozen. Its only data channel is :meth:`PrismContext.iter_train_batches`, the
single-pass predict-then-train instrument: each batch is scored by the harness (the model's loss
is recorded) before it is yielded to the loop. Raw data paths are never handed to submitted code.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn

from prism_challenge.evaluator.protocol import CONTEXT_FIELDS
from prism_challenge.tokenizers import ReferenceTokenizer, reference_tokenizer


@dataclass(frozen=True)
class Batch:
    """One batch of the train stream.

    Attributes:
        tokens: ``[B, T]`` int64 on ``ctx.device``. Consecutive rows overlap by one token: the
            last token of a row is the first of the next. A short final batch has fewer rows (and
            the stream's very last row may be shorter than ``T``); nothing is padded.
        step: 0-based index of the batch in this rank's stream.
    """

    tokens: torch.Tensor
    step: int

    @property
    def batch_size(self) -> int:
        """Rows in this batch (``B``)."""
        return int(self.tokens.shape[0])

    @property
    def seq_len(self) -> int:
        """Tokens per row (``T``)."""
        return int(self.tokens.shape[1])


class _Runtime(Protocol):
    def build_model(self, ctx: PrismContext) -> nn.Module: ...

    def iter_train_batches(
        self, ctx: PrismContext, model: nn.Module, batch_size: int, seq_len: int, tokenizer: Any
    ) -> Iterator[Batch]: ...


class NoRuntimeError(RuntimeError):
    """The context was built outside a PRISM run (no feeder behind it)."""


@dataclass(frozen=True)
class PrismContext:
    """The challenge's side of the contract, as handed to ``build_model(ctx)`` and ``train(ctx)``.

    Attributes:
        seed: the forced seed (the harness re-applies it right before ``build_model`` runs).
        vocab_size: ``V`` of the bundle's tokenizer (real token ids are ``0..V-1``).
        sequence_length: the largest ``seq_len`` a batch may have (tokens per row).
        max_parameters: parameter cap (unique storage elements of parameters and buffers).
        device: ``"cpu"`` or ``"cuda:<local_rank>"``.
        rank, local_rank, world_size: the torchrun process layout (one node).
        artifacts_dir: the only writable directory for submitted code.
        token_budget: most stream tokens this rank may consume (``None``: unbounded).
        step_budget: most batches this rank may receive (``None``: unbounded).
        tokenizer_name: the bundle's tokenizer (``prism.yaml``'s ``tokenizer``, default gpt2).
    """

    seed: int
    vocab_size: int
    sequence_length: int
    max_parameters: int
    device: str = "cpu"
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    artifacts_dir: str = ""
    token_budget: int | None = None
    step_budget: int | None = None
    tokenizer_name: str = "gpt2"
    _runtime: _Runtime | None = field(default=None, repr=False, compare=False)

    @property
    def max_seq_len(self) -> int:
        """Alias of ``sequence_length``."""
        return self.sequence_length

    @property
    def max_params(self) -> int:
        """Alias of ``max_parameters``."""
        return self.max_parameters

    def build_model(self) -> nn.Module:
        """Build the bundle's model with ``build_model(ctx)`` under the forced seed.

        Raises:
            NoRuntimeError: outside a PRISM run.
        """
        if self._runtime is None:
            raise NoRuntimeError("ctx.build_model() is only available inside a PRISM run")
        return self._runtime.build_model(self)

    def reference_tokenizer(self, name: str) -> ReferenceTokenizer:
        """A reference tokenizer (``"gpt2"`` or ``"bytes"``).

        Raises:
            prism_challenge.tokenizers.TokenizerError: unknown name.
        """
        return reference_tokenizer(name)

    def iter_train_batches(
        self,
        model: nn.Module,
        *,
        batch_size: int,
        seq_len: int | None = None,
        tokenizer: ReferenceTokenizer | str | None = None,
    ) -> Iterator[Batch]:
        """The train stream, one :class:`Batch` at a time, each scored before it is yielded.

        Single pass: the stream is never repeated and may be iterated once per run. Rows of
        ``seq_len`` tokens overlap by one token, so every stream token after the first is a
        scored target exactly once, whatever ``batch_size`` and ``seq_len`` are.

        Args:
            model: the module to score (pass the unwrapped module, not a DDP wrapper). It must
                return logits ``[B, T, V' >= V]``.
            batch_size: rows per batch, ``>= 1``.
            seq_len: tokens per row, ``2 <= seq_len <= ctx.sequence_length`` (default: the max).
            tokenizer: if given, the bundle's tokenizer (``prism.yaml``'s ``tokenizer``): its name
                (``"gpt2"``, ``"bytes"``) or ``ctx.reference_tokenizer(name)``; nothing else.

        Raises:
            NoRuntimeError: outside a PRISM run.
            prism_challenge.evaluator.instrument.ContractError: bad arguments, a second call,
                or logits of the wrong shape (the run fails either way).
        """
        if self._runtime is None:
            raise NoRuntimeError("ctx.iter_train_batches() is only available inside a PRISM run")
        return self._runtime.iter_train_batches(
            self, model, batch_size, self.sequence_length if seq_len is None else seq_len, tokenizer
        )


def run_context(values: dict[str, Any], *, rank: int, device: str, runtime: _Runtime) -> PrismContext:
    """The run's :class:`PrismContext` for ``rank`` (one node: ``local_rank == rank``), from the
    :data:`CONTEXT_FIELDS` of ``values``.

    Raises:
        KeyError: a field is missing.
    """
    kw = {name: values[name] for name in CONTEXT_FIELDS}
    for name in ("seed", "vocab_size", "sequence_length", "max_parameters", "world_size"):
        kw[name] = int(kw[name])
    kw["artifacts_dir"] = str(kw["artifacts_dir"])
    kw["tokenizer_name"] = str(kw["tokenizer_name"])
    return PrismContext(**kw, rank=rank, local_rank=rank, device=device, _runtime=runtime)
