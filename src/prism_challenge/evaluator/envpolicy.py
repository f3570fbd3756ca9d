"""What the environment of every jailed process keeps of the host's, and what it is given.

An allow-list, defined once here and applied by :func:`sandbox_env` (through
:func:`~prism_challenge.evaluator.jail.child_env`, so torchrun, its ranks, the parameter child,
the held-out child, the blind probe and the CUDA check all get the same): each kept variable
has a one-line reason in :data:`ENV_KEEP` or :data:`ENV_KEEP_PREFIXES`. Everything else of the
host (API tokens, cloud keys, agent sockets, ``TORCH_*``/``TORCHINDUCTOR_*`` settings, every
``TRITON_*`` one but ``TRITON_LIBCUDA_PATH``, and every ``NCCL_*`` variable not listed: network
plugins, InfiniBand, topology files, socket interfaces) is dropped; ``TRITON_CACHE_DIR`` is the
harness's own (:func:`~prism_challenge.evaluator.launcher.compute_env`). :data:`RANK_NETWORK_ENV`
is then set: the sandbox has only loopback, so the collectives and the rendezvous are pinned to it
whatever the host's name and NCCL settings.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

ENV_KEEP: dict[str, str] = {
    "PATH": "programs the loop's libraries run by name (inductor's C++ compiler)",
    "LANG": "the locale (text encoding of the interpreter's I/O)",
    "LANGUAGE": "the locale's message language",
    "TZ": "the time zone of log time stamps",
    "PYTHONPATH": "where the interpreter finds the packages the sandbox binds (led by PRISM's src)",
    "LD_LIBRARY_PATH": "where hosts put libcuda and the NGC/Kubernetes compat libraries (its directories are "
                       "bound read-only)",
    "CUDA_VISIBLE_DEVICES": "which GPUs the run is given (the operator's choice)",
    "CUDA_DEVICE_ORDER": "how those GPUs are numbered (PCI bus order or fastest first)",
    "NVIDIA_VISIBLE_DEVICES": "the container runtime's GPU selection, for tools that read it",
    "NVIDIA_DRIVER_CAPABILITIES": "the container runtime's driver features, for tools that read it",
    "PYTORCH_CUDA_ALLOC_CONF": "the CUDA caching allocator's settings (expandable segments against "
                               "fragmentation on the host's GPU; values are unchanged)",
    "PYTORCH_ALLOC_CONF": "the same, under its newer name",
    "NCCL_DEBUG": "NCCL's diagnostics level (log output only)",
    "NCCL_DEBUG_SUBSYS": "which NCCL subsystems log (log output only)",
    "NCCL_P2P_DISABLE": "hosts whose GPU peer-to-peer path is broken (VMs, some PCIe switches) fall back to "
                        "shared memory",
    "NCCL_P2P_LEVEL": "the same, for a distance (NVLink, PCIe switch, CPU)",
    "NCCL_SHM_DISABLE": "hosts whose /dev/shm transport fails fall back to peer-to-peer",
    "NCCL_CUMEM_ENABLE": "containers where cuMem-based buffers fail (older drivers)",
    "TRITON_LIBCUDA_PATH": "the folder of the host's libcuda.so.1 where ldconfig's cache does not list it (Triton "
                           "links its launcher against it; the folder is bound read-only)",
}
"""Host variables every jailed process keeps, each with why."""

ENV_KEEP_PREFIXES: dict[str, str] = {
    "LC_": "the locale's categories (LC_ALL, LC_CTYPE, ...)",
}
"""Prefixes of host variables every jailed process keeps, each with why."""

RANK_NETWORK_ENV: dict[str, str] = {
    "NCCL_SOCKET_IFNAME": "lo",  # NCCL's bootstrap and socket transport: the sandbox has only loopback
    "GLOO_SOCKET_IFNAME": "lo",  # gloo's device (CPU runs and CPU tensors): the same
    "NCCL_IB_DISABLE": "1",  # no InfiniBand probing: nothing but loopback exists in the namespace
    # no network plugin: NCCL would load libnccl-net.so from the host's library paths; with a name it
    # looks only for libnccl-net-none.so (and newer NCCL reads "none" as "load none"), then uses its own
    "NCCL_NET_PLUGIN": "none",
}
"""Set in every jailed process after the allow-list (one node: the ranks meet on 127.0.0.1)."""

SAFE_PATH_ENV: dict[str, str] = {
    # no interpreter puts its working directory (``-m``, ``-c``) or its script's folder first on
    # sys.path: a jailed process works in the artifacts folder, which the submission writes (the
    # parameter cap's child runs build_model there while the ranks start), so a planted
    # ``sympy.py`` would otherwise run in a rank's warm-up, before its audit hook is armed
    "PYTHONSAFEPATH": "1",
}
"""Set in every jailed process after the allow-list (Python 3.11+: ``-P``)."""

RENDEZVOUS_ADDR = "127.0.0.1"
"""The address torchrun's rendezvous and ``MASTER_ADDR`` use (its ``--standalone`` publishes
``socket.getfqdn()``, which in a sandbox whose host name does not resolve reaches nothing)."""


def kept(name: str) -> bool:
    """Whether the host variable ``name`` passes the allow-list."""
    return name in ENV_KEEP or name.startswith(tuple(ENV_KEEP_PREFIXES))


def sandbox_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The part of ``environ`` a jailed process may see (:data:`ENV_KEEP`,
    :data:`ENV_KEEP_PREFIXES`), plus :data:`RANK_NETWORK_ENV` and :data:`SAFE_PATH_ENV`; ``HOME`` is the sandbox's private
    ``/tmp``. ``LD_LIBRARY_PATH`` keeps its absolute entries only (:func:`ld_library_dirs`)."""
    env = {k: v for k, v in environ.items() if kept(k)}
    if "LD_LIBRARY_PATH" in env:  # an empty or relative entry names the working directory: the artifacts
        env["LD_LIBRARY_PATH"] = ":".join(ld_library_dirs(env))  # directory, which the submission writes
        if not env["LD_LIBRARY_PATH"]:
            del env["LD_LIBRARY_PATH"]
    env.update(RANK_NETWORK_ENV)
    env.update(SAFE_PATH_ENV)
    env["HOME"] = "/tmp"
    return env


def libcuda_dirs(environ: Mapping[str, str] | None = None) -> list[str]:
    """``$TRITON_LIBCUDA_PATH`` when it is an absolute folder (the sandbox binds it read-only
    beside :func:`ld_library_dirs`), else nothing."""
    value = (os.environ if environ is None else environ).get("TRITON_LIBCUDA_PATH", "")
    return [value] if value and os.path.isabs(value) else []


def ld_library_dirs(environ: Mapping[str, str] | None = None) -> list[str]:
    """The absolute directories of ``$LD_LIBRARY_PATH`` (relative entries are dropped: they would
    name a directory of the sandbox's working directory), in order."""
    value = (os.environ if environ is None else environ).get("LD_LIBRARY_PATH", "")
    return [p for p in value.split(":") if p and os.path.isabs(p)]
