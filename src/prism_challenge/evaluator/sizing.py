"""The sandbox's shared limits for a run layout: tasks, ``/tmp`` and ``/dev/shm`` (one place).

The task limit (``RLIMIT_NPROC`` of the sandbox uid) and the two tmpfs sizes are shared by every
rank of a run, so on CUDA they grow with the world size; on CPU they stay at the defaults the
CPU runs were measured with (:data:`~prism_challenge.evaluator.jail.DEFAULT_MAX_PROCESSES`,
:data:`~prism_challenge.evaluator.isolation.DEFAULT_TMP_BYTES`,
:data:`~prism_challenge.evaluator.isolation.DEFAULT_SHM_BYTES`). Inductor's compile workers are
bounded per rank elsewhere, at one: ``TORCHINDUCTOR_COMPILE_THREADS=1``
(:func:`~prism_challenge.evaluator.launcher.compute_env`), so a rank compiles in the thread that
asked, under the compile entry the audit hook admits, and no pool of workers counts against the
task limit.
"""

from __future__ import annotations

from dataclasses import dataclass

BASE_TASKS = 256
"""Tasks of everything but the ranks: the sandbox init, the pool of warm ranks, torchrun's agent
and its threads, the bounded children (parameter, held-out)."""
TASKS_PER_CUDA_RANK = 256
"""Tasks of one CUDA rank: its intra-op threads, the CUDA driver's threads, NCCL's proxy,
watchdog and heartbeat threads per communicator, Triton's and inductor's helpers. An estimate
with a wide margin, not yet measured on a GPU host (``bench/gpu_smoke.py`` runs there; the
manifest's ``isolation.guard.peak_tasks`` shows what a run used). A fork bomb is still stopped
at the sum."""
TMP_PER_CUDA_RANK = 512 << 20
"""``/tmp`` bytes per CUDA rank: inductor's and Triton's caches (``/tmp/torchinductor_*``,
``$HOME/.triton`` with ``HOME=/tmp``), the kernels each rank compiles and the CUDA JIT cache."""
SHM_PER_CUDA_RANK = 512 << 20
"""``/dev/shm`` bytes per CUDA rank: NCCL's shared-memory transport and proxy buffers (one set
per pair of ranks that cannot use peer-to-peer), torch's shared CPU tensors."""


@dataclass(frozen=True)
class RunSizes:
    """The shared limits of one run's sandbox.

    Attributes:
        max_processes: tasks (processes and threads) of the sandbox uid.
        tmp_bytes: size of the private ``/tmp`` tmpfs, bytes.
        shm_bytes: size of the private ``/dev/shm`` tmpfs, bytes.
    """

    max_processes: int
    tmp_bytes: int
    shm_bytes: int


def run_sizes(nproc: int, device: str) -> RunSizes:
    """The shared limits for ``nproc`` ranks on ``device`` (``"cpu"`` or ``"cuda"``).

    CPU: the defaults, whatever ``nproc``. CUDA: ``max(default, base + per_rank * nproc)`` for
    each of tasks (:data:`BASE_TASKS`, :data:`TASKS_PER_CUDA_RANK`), ``/tmp`` (the CPU default
    as base, :data:`TMP_PER_CUDA_RANK`) and ``/dev/shm`` (:data:`SHM_PER_CUDA_RANK`). At 8
    ranks: 2304 tasks, 4.5 GiB of ``/tmp``, 5 GiB of ``/dev/shm`` (tmpfs: pages are used, and
    charged to the run's memory, only when written).

    Raises:
        ValueError: ``nproc`` below 1 or an unknown device.
    """
    from prism_challenge.evaluator.isolation import DEFAULT_SHM_BYTES, DEFAULT_TMP_BYTES
    from prism_challenge.evaluator.jail import DEFAULT_MAX_PROCESSES

    if nproc < 1:
        raise ValueError(f"nproc {nproc}: must be at least 1")
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device {device!r}: expected cpu or cuda")
    if device == "cpu":
        return RunSizes(DEFAULT_MAX_PROCESSES, DEFAULT_TMP_BYTES, DEFAULT_SHM_BYTES)
    return RunSizes(
        max_processes=max(DEFAULT_MAX_PROCESSES, BASE_TASKS + TASKS_PER_CUDA_RANK * nproc),
        tmp_bytes=max(DEFAULT_TMP_BYTES, DEFAULT_TMP_BYTES + TMP_PER_CUDA_RANK * nproc),
        shm_bytes=max(DEFAULT_SHM_BYTES, DEFAULT_SHM_BYTES + SHM_PER_CUDA_RANK * nproc),
    )
