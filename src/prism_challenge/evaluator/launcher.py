"""The launcher: starts the runner's ranks on one node, under the real ``torchrun`` or, for one
rank, under the single-rank agent.

``torchrun --rdzv-backend=c10d --rdzv-endpoint=127.0.0.1:0 --local-addr=127.0.0.1 --nnodes=1
--nproc-per-node=N -m prism_challenge.evaluator.rank``
runs as a child process in its own process group (so the whole tree can be stopped), with
stdout and stderr going to the run's log file. By default it runs under the pool of warm ranks
(:mod:`~prism_challenge.evaluator.warm`), which starts the N rank processes alongside it. One
rank with warm ranks on (every ``--nproc 1`` run by default) runs under
:mod:`~prism_challenge.evaluator.single` instead: the rank started at once with torchrun's
worker environment, torchrun's exit status, no interpreter that imports torch beside it
(:func:`agent_of`). The environment (:func:`compute_env`) fixes the thread count, cuBLAS's
deterministic workspace and huge-page allocation before anything in the child starts.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from prism_challenge.evaluator.envpolicy import RENDEZVOUS_ADDR, sandbox_env  # noqa: F401 - re-exported
from prism_challenge.evaluator.gpuadmit import TRITON_CACHE_DIR
from prism_challenge.evaluator.outputcap import GRACE_S, Drain, log_drain, refusal_watch

if TYPE_CHECKING:
    from prism_challenge.evaluator.jail import Jail

MAX_NPROC = 8
MONITOR_INTERVAL_S = 0.5  # torchrun's agent polls its ranks this often (its default 0.1 s wakes it 10x/s on
# the cores the ranks compute on; a rank's exit is noticed at most this late, after its DONE was read)
MALLOC_MMAP_THRESHOLD = 32 << 20  # glibc's largest: blocks up to this size come from the heap
MALLOC_TRIM_THRESHOLD = 1 << 40  # never give freed heap memory back (see compute_env)
RUNNER_MODULE = "prism_challenge.evaluator.rank"  # ties the rank to the agent, then runs the runner
AGENT_MODULE = "prism_challenge.evaluator.agent"  # torch.distributed.run's main, ended without teardown
WARM_POOL_MODULE = "prism_challenge.evaluator.warm"  # warm ranks claimed by torchrun's workers
SINGLE_MODULE = "prism_challenge.evaluator.single"  # one rank, torchrun's part played by the standard library


class LaunchError(ValueError):
    """A launch request the challenge refuses (too many processes, several nodes, ...)."""


def check_layout(nproc: int, nnodes: int = 1) -> None:
    """Refuse anything but 1..8 processes on one node.

    Raises:
        LaunchError: naming the value and the rule.
    """
    if nnodes != 1:
        raise LaunchError(f"--nnodes {nnodes}: PRISM runs on a single node (nnodes must be 1)")
    if not 1 <= nproc <= MAX_NPROC:
        raise LaunchError(f"--nproc {nproc}: must be between 1 and {MAX_NPROC} processes on one node")


def torchrun_command(nproc: int) -> list[str]:
    """The argv that starts ``nproc`` runner ranks under torchrun (same interpreter).

    The rendezvous is what torchrun's ``--standalone`` makes (a c10d store of the agent's own on
    a free port) with every address pinned to
    :data:`~prism_challenge.evaluator.envpolicy.RENDEZVOUS_ADDR`: ``--standalone`` itself
    listens on ``localhost`` and publishes ``socket.getfqdn()`` as ``MASTER_ADDR``, and where
    the host's name does not resolve to loopback (containers, Kubernetes, cloud VMs) the ranks
    wait for a store they cannot reach until the idle timeout. The run id is fixed: the store
    is private to this launch (its own port, in the sandbox's own network namespace).
    """
    check_layout(nproc)
    return [
        sys.executable,
        "-m",
        AGENT_MODULE,
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={RENDEZVOUS_ADDR}:0",
        "--rdzv-id=prism",
        f"--local-addr={RENDEZVOUS_ADDR}",
        "--nnodes=1",
        f"--nproc-per-node={nproc}",
        "--max-restarts=0",
        f"--monitor-interval={MONITOR_INTERVAL_S}",
        "-m",
        RUNNER_MODULE,
    ]


def warm_pool_command(nproc: int) -> list[str]:
    """The argv prefix that runs torchrun under the pool of warm ranks
    (:mod:`~prism_challenge.evaluator.warm`): ``nproc`` rank processes import torch while
    torchrun's agent starts, and its workers hand their ranks to them."""
    check_layout(nproc)
    return [sys.executable, "-m", WARM_POOL_MODULE, str(nproc), "--"]


def agent_of(nproc: int, warm: bool) -> str:
    """Which agent starts the ranks: ``"single"`` (:mod:`~prism_challenge.evaluator.single`) for
    one rank with warm ranks on, ``"torchrun"`` otherwise (several ranks, or ``warm=False``: the
    reference launch, every rank cold after torchrun's agent)."""
    check_layout(nproc)
    return "single" if nproc == 1 and warm else "torchrun"


def launch_command(nproc: int, warm: bool = True) -> list[str]:
    """The argv :func:`launch` starts in the jail for ``nproc`` ranks (:func:`agent_of`)."""
    if agent_of(nproc, warm) == "single":
        return [sys.executable, "-m", SINGLE_MODULE]
    return (warm_pool_command(nproc) if warm else []) + torchrun_command(nproc)


def compute_env(threads: int) -> dict[str, str]:
    """The variables every process that runs the submission's model gets (ranks, held-out child).

    * ``OMP_NUM_THREADS``/``MKL_NUM_THREADS``: the fixed intra-op thread count.
    * ``CUBLAS_WORKSPACE_CONFIG=:4096:8``: cuBLAS's deterministic mode (read when CUDA starts).
    * ``PYTHONHASHSEED=0``: the same ``str`` hashes in every run.
    * ``TORCHINDUCTOR_COMPILE_THREADS=1``: ``torch.compile`` builds its kernels in the thread
      that asked for them, under the compile entry the audit hook admits
      (:mod:`~prism_challenge.evaluator.audit`), with no pool of compile workers (tasks). On CUDA
      too: inductor's pool is a process of its own that unpickles jobs from a pipe, outside the
      audit hook, and torch offers no way to arm the hook in it.
    * ``TRITON_CACHE_DIR``: Triton's cache (:data:`~prism_challenge.evaluator.gpuadmit.TRITON_CACHE_DIR`),
      in the sandbox's private ``/tmp``; the host's ``TRITON_*`` settings are dropped
      (:mod:`~prism_challenge.evaluator.envpolicy`), so no process reads a cache the submission
      or another run wrote, and the audit hook knows where Triton's launchers come from.
    * ``THP_MEM_ALLOC_ENABLE=1``: PyTorch's CPU allocator aligns tensors of 2 MiB or more to
      2 MiB and asks for transparent huge pages (``madvise(MADV_HUGEPAGE)``; effective where
      ``/sys/kernel/mm/transparent_hugepage/enabled`` is ``always`` or ``madvise``). A scoring
      forward of the example allocates ~1.5 GB of logits per batch; with 4 KiB pages the kernel
      zero-fills them one fault at a time (about 460,000 faults per batch, more system than user
      time), and the run takes twice as long (``bench/overhead.py``). Values are unchanged: the
      same kernels run on the same numbers, only the page size differs.
    * ``MALLOC_MMAP_THRESHOLD_=32 MiB``, ``MALLOC_TRIM_THRESHOLD_=1 TiB`` (glibc, ``mallopt(3)``):
      blocks up to 32 MiB come from the heap and freed heap memory is kept for the next batch,
      never handed back to the kernel. By default glibc adapts both thresholds as blocks come and
      go; a training loop frees and re-allocates the same activations every batch, and some runs
      settled into giving them back and faulting them in again: the trivial bundle of
      ``bench/overhead.py`` (8.4 MB of logits per batch) ran its stream in 1.1 s or in 1.5-1.7 s
      (74,000 or 170,000-270,000 page faults), at random. Now every run takes the fast path.
      Peak RSS does not grow (the peak is reached every batch anyway): example +2 %. Blocks over
      32 MiB (the example's logits) keep their own ``mmap``; glibc refuses a higher threshold.
      Other C libraries ignore the variables.
    """
    n = str(int(threads))
    return {"OMP_NUM_THREADS": n, "MKL_NUM_THREADS": n, "CUBLAS_WORKSPACE_CONFIG": ":4096:8",
            "PYTHONHASHSEED": "0", "THP_MEM_ALLOC_ENABLE": "1", "TORCHINDUCTOR_COMPILE_THREADS": "1",
            "TRITON_CACHE_DIR": TRITON_CACHE_DIR,
            "MALLOC_MMAP_THRESHOLD_": str(MALLOC_MMAP_THRESHOLD), "MALLOC_TRIM_THRESHOLD_": str(MALLOC_TRIM_THRESHOLD)}


@dataclass
class Launched:
    """A started torchrun process tree."""

    proc: subprocess.Popen
    log_path: Path
    drain: Drain | None = None

    def close_log(self, grace_s: float = GRACE_S) -> None:
        """Wait (at most ``grace_s`` seconds after the tree ended) for the ranks' last output and
        close the log: its first ``LOG_BYTES``, a note of the bytes dropped, its last ``TAIL_BYTES``
        (:mod:`~prism_challenge.evaluator.outputcap`). Call once the launcher ended."""
        if self.drain is not None:
            self.drain.result(grace_s)

    def poll(self) -> int | None:
        """Exit code of the launcher (torchrun, or the single-rank agent), or ``None`` while it runs."""
        return self.proc.poll()

    def kill(self) -> None:
        """Kill the launched process group (the sandbox when there is one, the pool of warm ranks,
        torchrun's agent, or the single-rank agent and its rank).

        torchrun puts each of its workers in a session of its own; they die with the agent, and
        the warm ranks and torchrun with the pool, because each asks for ``PR_SET_PDEATHSIG``
        first thing; in a strict sandbox the whole pid namespace dies with its init.
        """
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.proc.wait()
        self.close_log()


def launch(
    nproc: int,
    env_extra: dict[str, str],
    log_path: Path,
    *,
    jail: Jail,
    cwd: Path,
    socket_dir: Path | None = None,
    warm: bool = True,
) -> Launched:
    """Start the ranks (:func:`launch_command`: torchrun, or the single-rank agent) in ``jail``
    (:mod:`~prism_challenge.evaluator.jail`).

    Args:
        nproc: ranks on this node (1..8).
        env_extra: variables for the runner (feeder socket and token).
        log_path: file that receives the children's stdout and stderr, capped
            (:func:`~prism_challenge.evaluator.outputcap.log_drain`).
        jail: the run's jail: its sandbox, environment policy and limits.
        cwd: working directory of the children (the run's artifacts directory, the one
            writable directory).
        socket_dir: the feeder socket's directory (bound read-only).
        warm: start each rank at once, while the gates run: one rank under the single-rank
            agent, several under the pool of warm ranks (:func:`warm_pool_command`); with
            ``False`` every rank starts cold, after torchrun's agent.

    Raises:
        LaunchError: the layout is refused.
    """
    cmd = launch_command(nproc, warm)
    env = {**env_extra, "PYTHONUNBUFFERED": "1", "TORCHELASTIC_ERROR_FILE": str(log_path.with_suffix(".error.json"))}
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log = open(log_path, "wb")
    try:  # through a pipe: the log and the parent's memory stay bounded whatever the ranks print
        proc = jail.popen(cmd, writable=[cwd], socket_dir=socket_dir, env=env, cwd=cwd, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT)
    except BaseException:
        log.close()
        raise
    return Launched(proc, log_path, log_drain(proc, log, refusal_watch()))
