"""Batches onto the scoring device: the feeder's bytes as a ``[B, T]`` int64 tensor.

On CPU the batch is a view of the received bytes (no copy). On CUDA it goes through one pinned
(page-locked) host buffer, reused from batch to batch, with a non-blocking host-to-device copy:
the copy then runs as a DMA transfer queued before the scoring forward instead of a pageable,
synchronising one. The buffer is written again only after the previous batch's copy has left it
(a CUDA event recorded behind the copy). The batch's one synchronisation is the instrument's
``.item()`` on its loss, which the record needs anyway.
"""

from __future__ import annotations

import torch


class Staging:
    """The runner's staging of token batches for one device.

    Args:
        device: ``"cpu"`` or ``"cuda:N"``; the pinned path is taken only on a ``cuda`` device
            with CUDA available.
    """

    def __init__(self, device: str):
        self.device = device
        self.pinned = device.startswith("cuda") and torch.cuda.is_available()
        self._buffer: torch.Tensor | None = None
        self._copied: torch.cuda.Event | None = None

    def tokens(self, payload: bytes | bytearray | memoryview, rows: int, cols: int) -> torch.Tensor:
        """The batch ``[rows, cols]`` int64 on the device, from ``rows * cols * 8`` bytes.

        Raises:
            ValueError: the payload does not hold ``rows * cols`` int64 values.
        """
        host = torch.frombuffer(payload, dtype=torch.int64).view(rows, cols)
        if not self.pinned:
            return host if self.device == "cpu" else host.to(self.device)
        if self._copied is not None:
            self._copied.synchronize()  # the previous batch's copy has left the buffer
        n = rows * cols
        if self._buffer is None or self._buffer.numel() < n:
            self._buffer = torch.empty(n, dtype=torch.int64, pin_memory=True)
        staged = self._buffer[:n].view(rows, cols)
        staged.copy_(host)
        out = staged.to(self.device, non_blocking=True)
        self._copied = torch.cuda.Event()
        self._copied.record()
        return out
