"""The GPU stack of a run: the check that CUDA works inside the sandbox, what the manifest records.

On a CUDA run ``prism eval`` starts one small jailed child while the gates run
(:func:`start_cuda_check`, through the run's :class:`~prism_challenge.evaluator.jail.Jail`, so
with the ranks' sandbox, uid, environment and limits): ``python -m
prism_challenge.evaluator.gpu N`` initialises CUDA, runs one kernel on each of the ``N`` devices
the ranks will use, and prints the stack it saw (:func:`gpu_stack`) as one JSON line. It runs no
submitted code. The release waits for it; when CUDA does not initialise there (no device nodes,
no driver library on ``LD_LIBRARY_PATH``, a device the sandbox uid may not open) the run fails at
stage ``isolation`` with the child's error, instead of every rank failing in ``set_device``.

The manifest's ``compute.gpu`` (:func:`manifest_record`) holds that stack and each rank's peak
device memory (:func:`peak_memory`, reported by the rank); on CPU the same fields are there,
``null``, with ``"device": "cpu"``.
"""

from __future__ import annotations

import json
import os
import re
import resource
import sys
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from prism_challenge.evaluator.jail import Jail
    from prism_challenge.evaluator.jailchild import Finished

CHECK_TIMEOUT_S = 180.0
"""The CUDA check's deadline: interpreter, ``import torch`` and a context on up to 8 GPUs."""
STACK_FIELDS = ("gpu_model", "gpu_models", "gpu_count", "compute_capability", "memory_bytes", "driver",
                "cuda_runtime", "cudnn", "nccl")
"""The keys of :func:`gpu_stack` besides ``device`` (all ``None`` on CPU)."""
DRIVER_FILE = "/proc/driver/nvidia/version"
_DRIVER_RE = re.compile(r"Kernel Module(?: for \S+)?\s+(\d+(?:\.\d+)+)")
ERROR_LINE_CHARS = 400


class CudaCheckError(RuntimeError):
    """CUDA does not initialise inside the sandbox (the child's error is the message)."""


def gpu_count_error(nproc: int, device: str, visible: int | None = None) -> str | None:
    """Why ``nproc`` ranks cannot run on ``device``, or ``None``: on CUDA each rank needs a GPU
    of its own, and ``visible`` (default ``torch.cuda.device_count()``, which honours
    ``CUDA_VISIBLE_DEVICES``) must be at least ``nproc``."""
    if device != "cuda":
        return None
    if visible is None:
        visible = torch.cuda.device_count()
    if nproc <= visible:
        return None
    mask = os.environ.get("CUDA_VISIBLE_DEVICES")
    where = f" (CUDA_VISIBLE_DEVICES={mask})" if mask is not None else ""
    return f"--nproc {nproc}: {visible} CUDA device(s) are visible{where}; each rank needs one of its own"


def cpu_stack() -> dict[str, Any]:
    """The stack record of a CPU run: ``{"device": "cpu"}`` and every :data:`STACK_FIELDS` ``None``."""
    return {"device": "cpu", **dict.fromkeys(STACK_FIELDS)}


def driver_version(text: str | None = None) -> str | None:
    """The NVIDIA kernel driver's version (``"580.159.03"``) from ``text``, the contents of
    :data:`DRIVER_FILE` (read when ``None``), else from NVML (``nvidia-ml-py``) where installed;
    ``None`` when neither says."""
    if text is None:
        try:
            with open(DRIVER_FILE) as f:
                text = f.read()
        except OSError:
            text = ""
    match = _DRIVER_RE.search(text)
    if match:
        return match.group(1)
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            version = pynvml.nvmlSystemGetDriverVersion()
        finally:
            pynvml.nvmlShutdown()
        return version.decode() if isinstance(version, bytes) else str(version)
    except Exception:  # noqa: BLE001 - no NVML here: the version stays unknown
        return None


def _one_kernel(index: int) -> float:
    """Create a context on ``cuda:index`` and run one kernel there: ``sum(ones(4) + 1)`` (8.0)."""
    return torch.ones(4, device=f"cuda:{index}").add_(1).sum().item()


def gpu_stack(cuda: Any = None, nproc: int = 1, kernel: Any = _one_kernel) -> dict[str, Any]:
    """Initialise CUDA, run one kernel on devices ``0..nproc-1``, and describe the stack.

    Args:
        cuda: ``torch.cuda`` (a stand-in in tests).
        nproc: how many devices the ranks use (one each).
        kernel: runs the kernel on a device index and returns its result (8.0).

    Returns:
        ``{"device": "cuda", "gpu_model": name of device 0, "gpu_models": names of every
        visible device, "gpu_count": visible devices, "compute_capability": "9.0",
        "memory_bytes": device 0's total memory, "driver": :func:`driver_version`,
        "cuda_runtime": the CUDA runtime torch was built with (``torch.version.cuda``),
        "cudnn": cuDNN's version number (``torch.backends.cudnn.version()``), "nccl":
        ``"2.27.3"``}``.

    Raises:
        CudaCheckError: no device is visible, fewer than ``nproc``, or CUDA fails on one.
    """
    cuda = torch.cuda if cuda is None else cuda
    if not cuda.is_available():
        raise CudaCheckError("torch.cuda.is_available() is False (no device node, driver or libcuda visible)")
    count = int(cuda.device_count())
    if count < nproc:
        raise CudaCheckError(f"{count} GPU(s) visible, {nproc} rank(s) need one each")
    for index in range(nproc):
        got = kernel(index)
        if got != 8.0:
            raise CudaCheckError(f"cuda:{index}: a kernel computed {got}, not 8.0")
    props = cuda.get_device_properties(0)
    try:
        nccl = ".".join(str(p) for p in cuda.nccl.version())
    except Exception:  # noqa: BLE001 - a build without NCCL
        nccl = None
    return {
        "device": "cuda",
        "gpu_model": cuda.get_device_name(0),
        "gpu_models": [cuda.get_device_name(i) for i in range(count)],
        "gpu_count": count,
        "compute_capability": f"{props.major}.{props.minor}",
        "memory_bytes": int(props.total_memory),
        "driver": driver_version(),
        "cuda_runtime": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version(),
        "nccl": nccl,
    }


def peak_memory(cuda: Any = None) -> dict[str, int | None]:
    """This rank's peaks: ``peak_rss_bytes`` (``ru_maxrss``), and where CUDA was used
    ``peak_device_bytes`` (``max_memory_allocated``, tensors) and ``peak_reserved_bytes``
    (``max_memory_reserved``, what the caching allocator held), both ``None`` otherwise."""
    cuda = torch.cuda if cuda is None else cuda
    out: dict[str, int | None] = {"peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                                  "peak_device_bytes": None, "peak_reserved_bytes": None}
    if cuda.is_available() and cuda.is_initialized():
        out["peak_device_bytes"] = int(cuda.max_memory_allocated())
        out["peak_reserved_bytes"] = int(cuda.max_memory_reserved())
    return out


def manifest_record(stack: dict[str, Any], done: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """The manifest's ``compute.gpu``: ``stack`` (:func:`gpu_stack` or :func:`cpu_stack`) plus
    ``peak_allocated_bytes`` and ``peak_reserved_bytes`` by rank (``"0"``, ``"1"``...) from the
    ranks' DONE reports (``done``)."""
    return {
        **stack,
        "peak_allocated_bytes": {str(r): d.get("peak_device_bytes") for r, d in sorted(done.items())},
        "peak_reserved_bytes": {str(r): d.get("peak_reserved_bytes") for r, d in sorted(done.items())},
    }


def parse_check(done: Finished) -> dict[str, Any]:
    """The stack from the check child's result.

    Raises:
        CudaCheckError: the child timed out, crashed, or reported CUDA's error.
    """
    lines = done.stdout.decode(errors="replace").strip().splitlines()
    reply: Any = None
    if lines:
        try:
            reply = json.loads(lines[-1])
        except ValueError:
            reply = None
    if isinstance(reply, dict) and reply.get("ok") and isinstance(reply.get("stack"), dict):
        return reply["stack"]
    if isinstance(reply, dict) and isinstance(reply.get("error"), str):
        raise CudaCheckError(reply["error"][:ERROR_LINE_CHARS])
    tail = done.stderr.decode(errors="replace").strip().splitlines()[-1:] or [""]
    note = f" {done.stderr_note}" if done.stderr_note else ""  # bytes dropped before the tail (outputcap)
    raise CudaCheckError(f"{done.failure or 'no result'}:{note} {tail[0][:ERROR_LINE_CHARS]}".rstrip(": "))


@dataclass
class CudaCheck:
    """The CUDA check child running in the background (:func:`start_cuda_check`)."""

    thread: threading.Thread
    outcome: dict[str, Any] = field(default_factory=dict)

    def result(self) -> dict[str, Any]:
        """Wait for the child; its stack.

        Raises:
            CudaCheckError: CUDA does not initialise inside the sandbox (as the sandbox uid).
        """
        self.thread.join()
        if "error" in self.outcome:
            raise self.outcome["error"]
        return self.outcome["stack"]


def start_cuda_check(jail: Jail, nproc: int, timeout_s: float = CHECK_TIMEOUT_S) -> CudaCheck:
    """Start ``python -m prism_challenge.evaluator.gpu nproc`` in ``jail`` on a thread."""
    check = CudaCheck(threading.Thread(target=lambda: None))

    def work() -> None:
        try:
            done = jail.run([sys.executable, "-m", "prism_challenge.evaluator.gpu", str(nproc)], timeout_s=timeout_s)
            check.outcome["stack"] = parse_check(done)
        except CudaCheckError as exc:
            check.outcome["error"] = exc
        except Exception as exc:  # noqa: BLE001 - the sandbox could not start the child
            check.outcome["error"] = CudaCheckError(f"{type(exc).__name__}: {exc}")

    check.thread = threading.Thread(target=work, name="prism-cuda-check", daemon=True)
    check.thread.start()
    return check


def main(argv: list[str] | None = None) -> int:
    """``python -m prism_challenge.evaluator.gpu [NPROC]``: one JSON line, ``{"ok": true, "stack":
    ...}`` or ``{"ok": false, "error": "..."}``; exit status 0 or 1."""
    args = sys.argv[1:] if argv is None else argv
    nproc = int(args[0]) if args and args[0].isdigit() else 1
    try:
        stack = gpu_stack(nproc=nproc)
    except Exception as exc:  # noqa: BLE001 - CUDA's own error, whatever its type, is the report
        print(json.dumps({"ok": False, "error": f"{type(exc).__name__}: {exc}".splitlines()[0]}), flush=True)
        return 1
    print(json.dumps({"ok": True, "stack": stack}), flush=True)
    return 0


if __name__ == "__main__":
    from prism_challenge.evaluator.childexit import exit_child

    exit_child(main())  # no interpreter teardown (childexit)
