"""The ambient state of every scoring forward, set by the harness, never inherited from the loop.

The stream's scoring forward runs inside the loop's ``next()`` on ``ctx.iter_train_batches``: a
loop that trains inside ``torch.autocast(...)`` or ``torch.nn.attention.sdpa_kernel(...)`` (both
allow-listed, both common) would otherwise have its batches scored under its own autocast and
attention kernel, while the audit's fresh children, the blind probes and the held-out stage score
without them: the same weights, other numbers, and an honest run zeroed by its audit (issue 26:
"recorded 11013.774518966675 nats, re-scored 11013.76040649414"). So every process that scores
(the stream and its causality probe, the re-scoring children, the blind probes, held-out,
``prism verify``) runs its forward under :func:`scoring_state`:

* **autocast**: exactly the run's scoring autocast on the scored device (``torch.autocast(
  device_type, dtype, cache_enabled=False)``, or ``enabled=False`` for ``fp32``), and autocast
  off on every other device type where the caller had it on. The cache is off: autocast keys its
  cached casts by the weight alone, so inside a loop's long ``torch.autocast`` region the scoring
  forward would otherwise reuse casts the loop's own forward made (in the loop's dtype, or of
  weights its optimizer has changed since). Autocast that the model's own ``forward`` enters is
  the model's code and runs the same in every process.
* **attention kernel**: every backend of :data:`SDPA_BACKENDS` enabled, in that priority order
  (``sdpa_kernel(..., set_priority=True)``; the caller's flags and whole order are restored on
  exit). Flash, then memory-efficient, then math, then cuDNN and ``OVERRIDEABLE``: torch's own
  default (2.13's ``torch._C._get_sdp_priority_order()``), so a loop that never calls
  ``sdpa_kernel`` trains and is scored under the same flags (no recompile of a compiled model
  between the two), while math, which takes any input, comes before cuDNN attention, whose
  kernels vary with the cuDNN version: cuDNN never runs. Which kernel runs is torch's choice for
  the inputs' device, dtype and shape, the same in every process on the same device (on CPU
  torch tries flash, then math, whatever the order); each one's forward is deterministic (no
  atomics), on CPU as on CUDA.
* **grad mode**: the caller holds ``torch.no_grad()`` (``instrument.measure``); inference mode
  changes no value.

The float32 precision switches (TF32, oneDNN bf16, ``float32_matmul_precision``, the
reduced-precision reductions) are forced at start-up in every process
(:func:`~prism_challenge.evaluator.seeding.force_determinism`), refused by the gate
(``prism:determinism``) and read by the runner before every scoring forward
(:func:`~prism_challenge.evaluator.seeding.determinism_change`): a changed one fails the run.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

SDPA_BACKENDS: tuple[SDPBackend, ...] = (
    SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH, SDPBackend.CUDNN_ATTENTION,
    SDPBackend.OVERRIDEABLE)
"""The attention kernels a scoring forward may use, in priority order (see the module docstring)."""

AUTOCAST_DEVICE_TYPES = ("cpu", "cuda")
"""The device types whose ambient autocast the harness switches off when it scores on another."""


@contextlib.contextmanager
def scoring_state(device_type: str, autocast: torch.dtype | None) -> Iterator[None]:
    """The harness's autocast and attention kernels for one scoring forward on ``device_type``
    (``"cpu"``, ``"cuda"``); ``autocast`` is the run's scoring autocast dtype (``None``: none,
    :data:`~prism_challenge.evaluator.instrument.AUTOCAST_DTYPES`). The caller's state is restored
    on exit."""
    with contextlib.ExitStack() as stack:
        for other in AUTOCAST_DEVICE_TYPES:
            if other != device_type and torch.is_autocast_enabled(other):
                stack.enter_context(torch.autocast(device_type=other, enabled=False))
        if autocast is None:
            stack.enter_context(torch.autocast(device_type=device_type, enabled=False))
        else:
            stack.enter_context(torch.autocast(device_type=device_type, dtype=autocast, cache_enabled=False))
        stack.enter_context(_sdpa_pinned())
        yield


@contextlib.contextmanager
def _sdpa_pinned() -> Iterator[None]:
    """:data:`SDPA_BACKENDS` in their order, the caller's whole priority order restored after
    (``sdpa_kernel`` alone restores the order of the backends that were on)."""
    order = torch._C._get_sdp_priority_order()
    try:
        with sdpa_kernel(list(SDPA_BACKENDS), set_priority=True):
            yield
    finally:
        torch._C._set_sdp_priority_order(order)
