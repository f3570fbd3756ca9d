"""Warm ranks: rank processes that import torch while the gates run, claimed by torchrun's workers.

Without them a rank's start-up is a chain: torchrun's agent imports torch (about 0.8 s on this
2-core VM), only then spawns the rank, which imports torch again and the modules every training
loop pulls in (``torch._dynamo`` through ``torch.optim``, about 0.8 s more). The gates end long
before that chain does, and the run waits for it.

Here ``prism eval`` starts this module's **pool** (inside the sandbox, standard library only) in
place of torchrun. The pool

1. starts one warm process per rank: ``python -m prism_challenge.evaluator.rank --warm FD``,
   which imports torch and the runner, warms up, then blocks on its end of a socket pair
   (``FD``). It knows nothing of the bundle, the rank layout or the feeder yet;
2. starts the real ``torchrun`` (its argv follows ``--``) with ``PRISM_WARM_SOCKET`` naming the
   pool's listening socket (an abstract Unix socket: in a strict sandbox it lives in the run's
   own network namespace);
3. serves **claims**: each worker torchrun spawns (``python -m prism_challenge.evaluator.rank``,
   the stub) connects, and the pool accepts it only when the peer's parent is torchrun's agent
   (``SO_PEERCRED``). The stub sends its environment (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
   ``MASTER_ADDR``/``MASTER_PORT``, ``TORCHELASTIC_*``: all that torchrun gave it); the pool hands
   it to the next warm process, which takes it as its own ``os.environ`` and runs the rank
   (:func:`prism_challenge.evaluator.runner.main`) exactly as a cold rank would;
4. relays the end: when a warm process exits, its status (exit code, or the signal that killed
   it) goes to its stub, which ends the same way, so torchrun sees the rank's real outcome. A
   signal torchrun sends the stub (``SIGTERM`` when another rank failed) is forwarded to the
   warm process; a stub that dies (SIGKILL) takes its warm process with it;
5. exits with torchrun's exit code once torchrun ended, killing any warm process left.

So each rank is still one process running the runner and the submission, with the environment
torchrun made for it; only its interpreter start and ``import torch`` moved before the release.
Any stub that finds no pool (``PRISM_WARM_SOCKET`` unset, the pool gone, no warm process left)
runs the rank itself, cold. Every process here dies with its parent (``PR_SET_PDEATHSIG``):
warm processes and torchrun with the pool, stubs with torchrun's agent.

This module imports only the standard library (the pool and the stubs must start in ~20 ms).
"""

from __future__ import annotations

import io
import json
import os
import secrets
import selectors
import signal
import socket
import struct
import subprocess
import sys
from typing import Any

from prism_challenge.evaluator.childexit import exit_child

ENV_WARM_SOCKET = "PRISM_WARM_SOCKET"
RANK_MODULE = "prism_challenge.evaluator.rank"
CLAIM_TIMEOUT_S = 10.0  # a stub sends its environment at once after connecting
MAX_MESSAGE_BYTES = 1 << 20  # one JSON line: an environment, a pid or a status
FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)


class WarmError(RuntimeError):
    """A malformed message between the pool, a stub and a warm process."""


def die_with_parent(orphan_check: bool = True) -> None:
    """Ask Linux to SIGKILL this process when its parent dies (Linux only; no-op elsewhere).

    With ``orphan_check``, exits at once with status 137 when the parent is already gone (the
    process was re-parented to pid 1). The pool passes ``False``: in a sandbox's pid namespace
    its parent IS pid 1, the sandbox's init.
    """
    if sys.platform != "linux":
        return
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
    if orphan_check and os.getppid() == 1:  # the parent died before the request took effect
        os._exit(137)


# -- one JSON object per line --------------------------------------------------------------------
def send_message(sock: socket.socket, obj: dict[str, Any]) -> None:
    """Send ``obj`` as one JSON line."""
    sock.sendall(json.dumps(obj).encode() + b"\n")


def recv_message(stream: io.BufferedIOBase) -> dict[str, Any] | None:
    """Read one JSON line from ``stream`` (``sock.makefile("rb")``: a pid and a status may arrive
    in one segment, so lines are cut from a buffered reader, never from single ``recv`` calls).

    Returns ``None`` on end of stream before any byte.

    Raises:
        WarmError: a line over ``MAX_MESSAGE_BYTES``, cut short, or not a JSON object.
    """
    line = stream.readline(MAX_MESSAGE_BYTES + 1)
    if not line:
        return None
    if not line.endswith(b"\n"):
        raise WarmError(f"message over {MAX_MESSAGE_BYTES} bytes" if len(line) > MAX_MESSAGE_BYTES
                        else "message cut short")
    try:
        obj = json.loads(line)
    except ValueError as exc:
        raise WarmError(f"not JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise WarmError("not a JSON object")
    return obj


def _address(name: str) -> str:
    return "\0" + name  # Linux abstract namespace: no file, scoped to the network namespace


def exit_status(returncode: int) -> dict[str, int]:
    """A ``subprocess`` return code as ``{"exit": code}`` or ``{"signal": number}``."""
    return {"signal": -returncode} if returncode < 0 else {"exit": returncode}


# -- the stub: torchrun's worker -----------------------------------------------------------------
def claim(environ: dict[str, str] | None = None) -> None:
    """Hand this worker's rank to a warm process and end as it ends; return to run it cold.

    Called first thing by torchrun's worker (:mod:`prism_challenge.evaluator.rank`). When the
    pool named by ``PRISM_WARM_SOCKET`` takes the claim, this function does not return: it
    forwards signals to the warm process and exits with its status (the same exit code, or the
    same signal). It returns, and the caller runs the rank itself, when there is no pool, the
    pool cannot be reached or has no warm process left.
    """
    env = dict(os.environ if environ is None else environ)
    name = env.pop(ENV_WARM_SOCKET, "")
    if not name:
        return
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stream = sock.makefile("rb")
    try:
        sock.connect(_address(name))
        send_message(sock, {"env": env})
        reply = recv_message(stream)
    except (OSError, WarmError):
        sock.close()
        return
    if not reply or not isinstance(reply.get("pid"), int):
        sock.close()
        return
    pid = reply["pid"]

    def forward(signum: int, _frame: Any) -> None:
        try:
            os.kill(pid, signum)
        except OSError:
            pass

    for sig in FORWARDED_SIGNALS:
        signal.signal(sig, forward)
    try:
        status = recv_message(stream)
    except (OSError, WarmError):
        status = None
    _end_like(status)


def _end_like(status: dict[str, Any] | None) -> None:
    """Exit with the warm process's status: the same code, or killed by the same signal."""
    sys.stdout.flush()
    sys.stderr.flush()
    if status and isinstance(status.get("signal"), int):
        sig = status["signal"]
        try:
            if sig not in (signal.SIGKILL, signal.SIGSTOP):  # the others may have a handler here
                signal.signal(sig, signal.SIG_DFL)
            os.kill(os.getpid(), sig)
        except (OSError, ValueError):
            pass
        os._exit(128 + sig)
    code = status.get("exit") if status else None
    exit_child(1 if code is None else code)  # no status: the warm process's end is unknown


# -- the warm process ----------------------------------------------------------------------------
def wait_for_claim(fd: int) -> dict[str, str]:
    """Block on the pool's socket pair end ``fd`` until a stub's environment arrives; return it.

    Raises:
        WarmError: the pool closed the pair (the run ended before this rank was claimed) or sent
            something other than ``{"env": {str: str}}``.
    """
    with socket.socket(fileno=fd) as sock, sock.makefile("rb") as stream:
        msg = recv_message(stream)
    if msg is None:
        raise WarmError("the pool closed before this warm process was claimed")
    env = msg.get("env")
    if not isinstance(env, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
        raise WarmError("a claim carries {'env': {name: value}}")
    return env


# -- the pool ------------------------------------------------------------------------------------
class _Warm:
    """One warm process and, once claimed, the stub it runs for."""

    def __init__(self, proc: subprocess.Popen, pair: socket.socket):
        self.proc, self.pair = proc, pair
        self.stub: socket.socket | None = None
        self.taken = False  # claimed once: never handed to a second stub
        self.ended = False


def _peer_parent(conn: socket.socket) -> int | None:
    """The parent pid of the process at the other end of ``conn`` (``SO_PEERCRED``)."""
    try:
        pid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))[0]
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        return int(stat[stat.rindex(b")") + 2:].split()[1])
    except (OSError, ValueError, IndexError):
        return None


class Pool:
    """The pool (see the module docstring): ``nproc`` warm processes, then torchrun, then claims."""

    def __init__(self, nproc: int, torchrun_argv: list[str], warm_argv: list[str] | None = None):
        """Start ``nproc`` warm processes, then torchrun (``torchrun_argv``).

        ``warm_argv``: the warm process's command, to which the socket pair's fd is appended
        (default: ``python -m prism_challenge.evaluator.rank --warm``; tests give their own).

        Raises:
            OSError: a process or the listening socket could not be made.
        """
        self.warm_argv = warm_argv or [sys.executable, "-m", RANK_MODULE, "--warm"]
        self.name = f"prism-warm-{os.getpid()}-{secrets.token_hex(8)}"
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(_address(self.name))
        self.listener.listen(max(8, nproc))
        self.warm = [self._start_warm() for _ in range(nproc)]
        self.torchrun = subprocess.Popen(torchrun_argv, env={**os.environ, ENV_WARM_SOCKET: self.name},
                                         preexec_fn=die_with_parent)
        self.pidfds: dict[int, int] = {}

    def _start_warm(self) -> _Warm:
        ours, theirs = socket.socketpair()
        proc = subprocess.Popen([*self.warm_argv, str(theirs.fileno())],
                                pass_fds=(theirs.fileno(),), preexec_fn=die_with_parent)
        theirs.close()
        return _Warm(proc, ours)

    def serve(self) -> int:
        """Serve claims until torchrun exits; return its exit code (128 + signal when killed)."""
        sel = selectors.DefaultSelector()
        sel.register(self.listener, selectors.EVENT_READ, "accept")
        watched = [self._watch(sel, p) for p in [w.proc for w in self.warm] + [self.torchrun]]
        timeout = None if all(watched) else 0.5  # no pidfds (Linux < 5.3): poll the children
        try:
            while True:
                for key, _ in sel.select(timeout):
                    if key.data == "accept":
                        self._accept(sel)
                    elif isinstance(key.data, _Warm):  # a stub's connection: it died
                        self._stub_died(sel, key.fileobj, key.data)
                for w in self.warm:
                    if not w.ended and w.proc.poll() is not None:
                        self._ended(sel, w)
                rc = self.torchrun.poll()
                if rc is not None:
                    return 128 - rc if rc < 0 else rc
        finally:
            for w in self.warm:
                if w.proc.poll() is None:
                    w.proc.kill()
                    w.proc.wait()

    def _watch(self, sel: selectors.BaseSelector, proc: subprocess.Popen) -> bool:
        """Wake the loop when ``proc`` exits (a pidfd); ``False`` where Linux has none."""
        try:
            fd = os.pidfd_open(proc.pid)
        except (AttributeError, OSError):
            return False
        sel.register(fd, selectors.EVENT_READ, "exit")
        self.pidfds[proc.pid] = fd
        return True

    def _accept(self, sel: selectors.BaseSelector) -> None:
        conn, _ = self.listener.accept()
        if _peer_parent(conn) != self.torchrun.pid:  # only torchrun's workers claim a rank
            conn.close()
            return
        try:
            conn.settimeout(CLAIM_TIMEOUT_S)
            with conn.makefile("rb") as stream:
                msg = recv_message(stream)
            env = (msg or {}).get("env")
            if not isinstance(env, dict):
                raise WarmError("a claim carries {'env': {...}}")
            w = next((w for w in self.warm if not w.taken and not w.ended), None)
            if w is None:
                send_message(conn, {"cold": "no warm process left"})
                conn.close()
                return
            w.taken = True
            send_message(w.pair, {"env": env})
            send_message(conn, {"pid": w.proc.pid})
        except (OSError, WarmError):
            conn.close()
            return
        w.stub = conn
        conn.settimeout(None)
        sel.register(conn, selectors.EVENT_READ, w)
        if all(w.taken or w.ended for w in self.warm):  # nothing left to claim: nobody else may
            sel.unregister(self.listener)
            self.listener.close()

    def _stub_died(self, sel: selectors.BaseSelector, conn: socket.socket, w: _Warm) -> None:
        """A stub says nothing after its claim: readable means it died; its warm process follows."""
        sel.unregister(conn)
        conn.close()
        w.stub = None
        if w.proc.poll() is None:
            w.proc.kill()

    def _ended(self, sel: selectors.BaseSelector, w: _Warm) -> None:
        w.ended = True
        fd = self.pidfds.pop(w.proc.pid, None)
        if fd is not None:  # an exited process's pidfd stays readable
            sel.unregister(fd)
            os.close(fd)
        w.pair.close()
        if w.stub is not None:
            try:
                send_message(w.stub, exit_status(w.proc.wait()))
            except OSError:
                pass
            sel.unregister(w.stub)
            w.stub.close()
            w.stub = None


def main(argv: list[str] | None = None) -> None:
    """``python -m prism_challenge.evaluator.warm NPROC -- TORCHRUN_ARGV...``: run the pool."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) < 3 or args[1] != "--" or not args[0].isdigit():
        sys.stderr.write("usage: python -m prism_challenge.evaluator.warm NPROC -- TORCHRUN_ARGV...\n")
        sys.exit(2)
    die_with_parent(orphan_check=False)
    try:
        pool = Pool(int(args[0]), args[2:])
    except OSError as exc:  # no pool (e.g. no process left under the limit): torchrun alone, cold ranks
        sys.stderr.write(f"prism warm pool: {exc}; ranks start cold\n")
        os.execv(args[2], args[2:])
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):  # pass a stop on to torchrun
        signal.signal(sig, lambda n, _f: pool.torchrun.send_signal(n))
    sys.exit(pool.serve())


if __name__ == "__main__":
    main()
