"""What the audit hook admits of CUDA's start-up and of Triton's compiler, exactly.

Two admissions of :class:`~prism_challenge.evaluator.audit._Policy`, each tied to files of the
interpreter's install (read-only, never the bundle's nor a writable directory's) and to fixed
arguments, never to a name the submission controls:

* **torch's NVML load** (:func:`torch_nvml`). torch releases before February 2026 count devices
  through NVML: ``torch/cuda/__init__.py``'s ``_raw_device_count_nvml`` and
  ``_raw_device_uuid_nvml`` run ``CDLL("libnvidia-ml.so.1")``, look up four NVML functions
  (``ctypes.dlsym``) and the UUID one allocates a buffer (``ctypes.create_string_buffer``).
  Those events are admitted when the innermost frame outside the standard library is one of
  those two functions of torch's installed ``torch/cuda/__init__.py``, the library is exactly
  ``libnvidia-ml.so.1`` (found by the dynamic linker on the read-only library paths) and the
  symbol one of :data:`NVML_SYMBOLS`. The children start CUDA before the hook is armed
  (:func:`~prism_challenge.evaluator.cudainit.start_cuda`), so this is the fallback.
* **Triton's programs** (:func:`triton_process`), inside a compilation the hook already admits
  (a compile entry, every frame torch's or the install's): ``/sbin/ldconfig -p`` (where
  ``libcuda.so.1`` lies: ``triton/backends/nvidia/driver.py``'s ``libcuda_dirs``) and the CUDA
  tools bundled in Triton's wheel (``triton/backends/nvidia/bin/ptxas``: ``--version`` and the
  PTX-to-cubin step; ``ptxas-blackwell``, ``cuobjdump``, ``nvdisasm``) or torch's own
  ``torch/bin/ptxas``, each only when started from a frame of the installed ``triton`` package.
  Triton's C launcher is built with the C compiler inductor already may run in a temporary folder
  and read back from there (:func:`triton_build_output`), and its cache is the
  harness's ``TRITON_CACHE_DIR`` (:data:`TRITON_CACHE_DIR`, one of
  :func:`~prism_challenge.evaluator.audit.compiler_cache_roots`), where only the compiler may
  write and from where only the compiler may load code.
"""

from __future__ import annotations

import ctypes
from typing import Any

NVML_LIBRARY = "libnvidia-ml.so.1"
"""The one library name torch's NVML functions open (and the only one admitted)."""
TORCH_CUDA_FILE = "torch/cuda/__init__.py"
"""Where those functions live, relative to the site directory that holds torch."""
NVML_FUNCTIONS = frozenset({"_raw_device_count_nvml", "_raw_device_uuid_nvml"})
"""The functions of ``torch/cuda/__init__.py`` that load NVML (torch 2.x)."""
NVML_SYMBOLS = frozenset({"nvmlInit", "nvmlDeviceGetCount_v2", "nvmlDeviceGetHandleByIndex_v2", "nvmlDeviceGetUUID"})
"""The NVML functions those two look up."""

TRITON_CACHE_DIR = "/tmp/prism-triton-cache"
"""Triton's cache in every jailed process (set by the harness: :func:`~prism_challenge.evaluator.
launcher.compute_env`): in the sandbox's private ``/tmp``, never ``~/.triton`` nor a host folder."""
LDCONFIG_ARGV = ("/sbin/ldconfig", "-p")
"""Triton's ``libcuda_dirs``: the dynamic linker's cache, read to find ``libcuda.so.1``."""
TRITON_TOOLS = frozenset({"triton/backends/nvidia/bin/ptxas", "triton/backends/nvidia/bin/ptxas-blackwell",
                          "triton/backends/nvidia/bin/cuobjdump", "triton/backends/nvidia/bin/nvdisasm",
                          "torch/bin/ptxas"})
"""The programs Triton runs, relative to a site directory (Triton's knobs default to its bundled
tools; inductor points ``TRITON_PTXAS_PATH`` at ``torch/bin/ptxas`` where that exists)."""
TRITON_PACKAGE = "triton/"
TRITON_BUILDERS = frozenset({"triton/runtime/build.py", "triton/backends/nvidia/driver.py"})
"""Triton's ``compile_module_from_src`` (``runtime/build.py``; ``backends/nvidia/driver.py``
before Triton 3.3): it builds a launcher in a ``tempfile.TemporaryDirectory`` and reads the
library's bytes back to put them in its cache."""


def torch_nvml(event: str, args: tuple, code_file: str | None, code_name: str) -> bool:
    """Whether a ``ctypes.*`` event is torch's own NVML load.

    Args:
        event: the audit event (``ctypes.dlopen``, ``ctypes.dlsym``, ``ctypes.create_string_buffer``).
        args: its arguments (``(name,)``, ``(library, symbol)``, ``(init, size)``).
        code_file: the file of the innermost frame outside the standard library, relative to the
            site directory that holds it (``None``: not in a site directory).
        code_name: that frame's function name.
    """
    if code_file != TORCH_CUDA_FILE or code_name not in NVML_FUNCTIONS:
        return False
    if event == "ctypes.dlopen":
        return len(args) == 1 and type(args[0]) is str and args[0] == NVML_LIBRARY
    if event == "ctypes.dlsym":
        if len(args) != 2 or type(args[0]) is not ctypes.CDLL or type(args[1]) is not str:
            return False
        return args[1] in NVML_SYMBOLS and vars(args[0]).get("_name") == NVML_LIBRARY
    if event == "ctypes.create_string_buffer":
        return len(args) == 2 and args[0] is None and type(args[1]) is int and 0 < args[1] <= 4096
    return False


def triton_process(program: str, argv: Any, code_file: str | None, program_file: str | None) -> bool:
    """Whether a ``subprocess.Popen`` of ``program`` with ``argv`` is one of Triton's programs.

    Args:
        program: the program started (the event's executable).
        argv: its argument list.
        code_file: the file of the innermost frame outside the standard library, relative to the
            site directory that holds it (it must be the ``triton`` package's); ``None``: elsewhere.
        program_file: ``program`` (resolved) relative to a site directory, ``None``: elsewhere.
    """
    if code_file is None or not code_file.startswith(TRITON_PACKAGE):
        return False
    if type(argv) is not list or not argv or argv[0] != program or not all(type(a) is str for a in argv):
        return False
    return tuple(argv) == LDCONFIG_ARGV or program_file in TRITON_TOOLS


def triton_build_output(path: str, code_file: str | None, temp_root: str) -> bool:
    """Whether reading ``path`` is Triton reading back the launcher library it just built.

    Args:
        path: the resolved path opened for reading (the caller has checked it is neither hidden
            nor in a compiler cache).
        code_file: the innermost frame's file outside the standard library, relative to its site
            directory (it must be one of :data:`TRITON_BUILDERS`).
        temp_root: the temporary directory, resolved, with a trailing separator.
    """
    return code_file in TRITON_BUILDERS and path.startswith(temp_root) and path.endswith(".so") \
        and path.count("/", len(temp_root)) == 1  # a file of a folder made directly under it
