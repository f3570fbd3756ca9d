"""The agent of a one-rank run: ``python -m prism_challenge.evaluator.single``.

At ``--nproc 1`` torchrun's agent does three things for the run: it gives the rank torchrun's
environment (``RANK``, ``MASTER_PORT``, ``TORCHELASTIC_*``), it waits for the rank, and it turns
the rank's end into its own exit status (0, or 1 with a failure report). For that it starts an
interpreter that imports torch and runs a c10d rendezvous: about 1.2 s of CPU per run on the
shared 2-core VM (process accounting of one service evaluation), a tenth of a one-batch run's,
and with the pool of warm ranks and the worker's stub, three processes beside the rank.

This module does the same three things with the standard library alone, in place of the pool
and torchrun:

1. it starts the rank (``python -m prism_challenge.evaluator.rank``, torchrun's entry point) at
   once, with the environment torchrun's local agent gives its one worker (:func:`worker_env`:
   the names and values of ``torch.distributed.elastic.agent.server.local_elastic_agent``),
   except ``TORCHELASTIC_USE_AGENT_STORE=False``: there is no agent's store, so a loop that calls
   ``init_process_group`` at world size 1 hosts its own at ``MASTER_PORT``, a loopback port
   that the agent holds while the rank runs (:func:`reserve_port`). The rank imports torch and
   warms up while the gates run, as a warm rank of the pool does
   (:func:`prism_challenge.evaluator.runner.run`);
2. it forwards ``SIGUSR1``, ``SIGUSR2`` and a stop (``SIGTERM``, ``SIGINT``, ``SIGHUP``,
   ``SIGQUIT``) to the rank, and SIGKILLs it 30 s after the first stop, as torchrun's agent
   closes its workers;
3. it exits 0 when the rank exited 0, else 1 after one line on stderr naming the rank's exit
   code or signal (:data:`FAILED`), as torchrun exits 1 after its ``failed (exitcode: N)``
   report. So the launcher's status means what torchrun's does: a rank that dies, on any
   signal, cannot make the run look killed from outside (``pipeline.stream._signal_of``).

The rank is the same process with the same environment names, running the same runner and
submission; only the processes around it differ, and the scores are bit for bit torchrun's
(``tests/test_eval_e2e.py`` compares them). Like the pool, the agent dies with its parent
(``PR_SET_PDEATHSIG``; in a strict sandbox its parent is the sandbox's init) and the rank with
the agent (:mod:`~prism_challenge.evaluator.rank`).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading

from prism_challenge.evaluator.childexit import exit_child
from prism_challenge.evaluator.envpolicy import RENDEZVOUS_ADDR
from prism_challenge.evaluator.warm import FORWARDED_SIGNALS, RANK_MODULE, die_with_parent

RUN_ID = "prism"
"""``TORCHELASTIC_RUN_ID``: torchrun's ``--rdzv-id`` as the launcher gives it."""
SIGNALS_TO_HANDLE = "SIGTERM,SIGINT,SIGHUP,SIGQUIT"
"""``TORCHELASTIC_SIGNALS_TO_HANDLE``: torchrun's ``--signals-to-handle`` default, which its agent
puts in its own environment and so in its worker's."""
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)
"""The stops: every signal torchrun's agent handles (:data:`SIGNALS_TO_HANDLE`) and closes its
workers on. Forwarded to the rank with the rest of the pool's set (``SIGUSR1``, ``SIGUSR2``),
so an outside stop ends the agent with 1, as torchrun's."""
STOP_GRACE_S = 30.0
"""After the first forwarded stop the rank is SIGKILLed this long later (torchrun's agent
closes its workers the same way: the signal, then SIGKILL after 30 s)."""
FAILED = "prism single-rank agent: rank 0 failed"
"""The start of the agent's one failure line (followed by ``(exitcode: N)`` or ``(signal: N)``)."""


def reserve_port(host: str = RENDEZVOUS_ADDR) -> socket.socket:
    """A TCP socket bound to a free port on ``host`` with ``SO_REUSEADDR``, never listening.

    The agent holds it while the rank runs, as torchrun's agent holds its store's port: a
    process that binds without ``SO_REUSEADDR`` is refused the port, while the rank's own c10d
    store (which sets it) binds and listens there. In a strict sandbox the port is in the run's
    own network namespace anyway; this matters for ``--isolation none`` on a shared host.
    """
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, 0))
    return sock


def worker_env(environ: dict[str, str], master_port: int) -> dict[str, str]:
    """``environ`` plus what torchrun's local agent sets for its only worker at world size 1
    (``LocalElasticAgent._start_workers``, torch 2.13, and the agent's own
    ``TORCHELASTIC_SIGNALS_TO_HANDLE``), with no agent's store."""
    return {
        **environ,
        "RANK": "0", "LOCAL_RANK": "0", "GROUP_RANK": "0", "ROLE_RANK": "0", "ROLE_NAME": "default",
        "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1", "GROUP_WORLD_SIZE": "1", "ROLE_WORLD_SIZE": "1",
        "MASTER_ADDR": RENDEZVOUS_ADDR, "MASTER_PORT": str(master_port),
        "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0", "TORCHELASTIC_RUN_ID": RUN_ID,
        "TORCHELASTIC_USE_AGENT_STORE": "False",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
        "TORCHELASTIC_SIGNALS_TO_HANDLE": SIGNALS_TO_HANDLE,  # torchrun's agent sets its own default, inherited
    }


def main(argv: list[str] | None = None) -> None:
    """``python -m prism_challenge.evaluator.single [-- RANK_ARGV...]``: run the one rank (see the
    module docstring; ``RANK_ARGV``, for tests, replaces the rank's command) and exit 0 or 1."""
    args = sys.argv[1:] if argv is None else argv
    if args and (args[0] != "--" or len(args) < 2):
        sys.stderr.write("usage: python -m prism_challenge.evaluator.single [-- RANK_ARGV...]\n")
        sys.exit(2)
    die_with_parent(orphan_check=False)  # in a strict sandbox the parent is its init, pid 1
    command = args[1:] or [sys.executable, "-m", RANK_MODULE]
    port = reserve_port()
    rank = subprocess.Popen(command, env=worker_env(dict(os.environ), port.getsockname()[1]),
                            preexec_fn=die_with_parent)
    deadline: list[threading.Timer] = []

    def forward(signum: int, _frame: object) -> None:
        if signum in STOP_SIGNALS and not deadline:  # the first stop: SIGKILL after the grace
            deadline.append(threading.Timer(STOP_GRACE_S, rank.kill))
            deadline[0].daemon = True
            deadline[0].start()
        try:
            rank.send_signal(signum)
        except OSError:
            pass

    for sig in {*FORWARDED_SIGNALS, *STOP_SIGNALS}:
        signal.signal(sig, forward)
    code = rank.wait()
    port.close()
    if code != 0:
        sys.stderr.write(f"{FAILED} ({f'signal: {-code}' if code < 0 else f'exitcode: {code}'})\n")
    exit_child(0 if code == 0 else 1)


if __name__ == "__main__":
    main()
