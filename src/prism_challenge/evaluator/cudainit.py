"""CUDA start-up in every jailed child that uses CUDA, before the audit hook is armed.

On torch releases before upstream's change of February 2026, ``torch.cuda.device_count()``
reads NVML through ``ctypes.CDLL("libnvidia-ml.so.1")`` (``torch/cuda/__init__.py``:
``_device_count_nvml`` -> ``_raw_device_count_nvml``) whenever its cache is empty: during CUDA's
lazy initialisation (``_check_capability`` runs it) and on the first call after it. The audit
hook refuses ``ctypes`` (``no-ffi``, exit 86), so a child that armed the hook first died as CUDA
started, and a bundle that called ``torch.cuda.device_count()`` died in any child.

:func:`start_cuda` is the one prologue every child that runs the model on CUDA calls before
:func:`~prism_challenge.evaluator.audit.arm`: the rank (:mod:`~prism_challenge.evaluator.runner`),
the audit's re-scoring child (:mod:`~prism_challenge.audit.rescore_child`), the held-out child and the
blind probe (:mod:`~prism_challenge.audit.heldout`). It initialises CUDA, selects the device and fills
torch's device-count cache, so NVML is never loaded once the hook is armed. The hook also admits
exactly torch's own NVML load from torch's own frames (:mod:`~prism_challenge.evaluator.gpuadmit`)
for what the prologue cannot foresee (a device-count cache torch empties again).
"""

from __future__ import annotations

from typing import Any


def start_cuda(device: str, cuda: Any = None) -> str:
    """Start CUDA on ``device`` now, while the process runs nothing but the harness.

    Args:
        device: the child's device: ``"cpu"`` (nothing happens), ``"cuda"`` (device 0) or
            ``"cuda:N"``.
        cuda: ``torch.cuda`` (a stand-in in tests).

    Returns:
        The device the child should use: ``"cpu"`` or ``"cuda:N"``.

    Raises:
        ValueError: ``device`` is neither ``cpu`` nor ``cuda[:N]``.
        RuntimeError: CUDA's own error when it does not start (torch raises it).
    """
    kind, _, index = device.partition(":")
    if kind == "cpu" and not index:
        return "cpu"
    if kind != "cuda" or (index and not index.isdigit()):
        raise ValueError(f"device {device!r}: expected cpu, cuda or cuda:N")
    if cuda is None:
        import torch

        cuda = torch.cuda
    n = int(index or 0)
    cuda.init()  # _lazy_init: cuInit, the context, the queued calls (_check_capability)
    cuda.set_device(n)
    cuda.device_count()  # the first call after init fills torch's cache (torch < 2026-02 reads NVML here)
    return f"cuda:{n}"
