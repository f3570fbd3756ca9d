"""One launcher for every process that runs submitted code (codejail's ``jail_code`` is the model).

The ranks (torchrun and its pool), the parameter-cap child (in ``prism eval`` and in ``prism
check``), the held-out child and the blind probe all start through one :class:`Jail`, so they
all get the same:

* **sandbox** (:func:`~prism_challenge.evaluator.isolation.sandbox_prefix`): no network, the data,
  its salt and PRISM's caches hidden, the frozen bundle read-only, only the child's own writable
  directory and a private ``/tmp`` writable;
* **environment** (:func:`child_env`): the allow-listed part of the parent's environment
  (:func:`~prism_challenge.evaluator.envpolicy.sandbox_env`: an allow-list, loopback-only NCCL and gloo), the compute settings
  (:func:`~prism_challenge.evaluator.launcher.compute_env`), no bytecode writing;
* **identity and limits**: the sandbox uid when PRISM runs as root, the same
  :class:`~prism_challenge.evaluator.isolation.Limits`; memory is held by a cgroup v2
  ``memory.max`` where the host lets PRISM make one (:class:`MemoryCgroup`), otherwise by
  ``RLIMIT_AS``, never above the host's memory (:func:`default_memory_limit`);
* **death with the parent** (bubblewrap's ``--die-with-parent``, the unshare init's
  ``PR_SET_PDEATHSIG``, or the same request in ``preexec_fn`` without a sandbox), a session of
  its own, and **one deadline with a group kill** (:meth:`Jail.run`);
* **bounded output** (:mod:`~prism_challenge.evaluator.outputcap`): the parent keeps a fixed tail
  of what a bounded child prints, and counts the bytes it drops.

A child that ended badly is classified by :func:`diagnose`: the audit hook's refusal (the event
named), the memory limit, the task limit, or a plain crash.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prism_challenge.evaluator.audit import AUDIT_EXIT_CODE, ENV_OFF, describe_refusal, find_refusal
from prism_challenge.evaluator.isolation import (
    DEFAULT_SHM_BYTES,
    DEFAULT_TMP_BYTES,
    IsolationError,
    Limits,
    available_backend,
    limits_preexec,
    sandbox_prefix,
)
from prism_challenge.evaluator import sabotage
from prism_challenge.evaluator.envpolicy import sandbox_env
from prism_challenge.evaluator.jailchild import Finished, Started, _folder_ids, _spare_key, kill_group, stream_input
from prism_challenge.evaluator.launcher import compute_env
from prism_challenge.evaluator.memcgroup import MemoryCgroup, host_memory_bytes
from prism_challenge.evaluator.outputcap import collect, drains, feed, refusal_watch
from prism_challenge.evaluator.sandboxwatch import pick_sandbox_uid

MAX_ADDRESS_SPACE = 32 << 30
"""Ceiling of the per-process address-space limit, bytes (torch reserves much address space)."""
DEFAULT_MAX_PROCESSES = 1024
"""Tasks (processes and threads) of the sandbox uid."""
DEFAULT_MAX_FILE_BYTES = 4 << 30
"""Largest file a jailed process may write, bytes (inductor's precompiled headers are large)."""
DEFAULT_MAX_OPEN_FILES = 4096
"""Open files per jailed process."""

MEMORY_SIGNS = ("memoryerror", "can't allocate memory", "cannot allocate memory", "std::bad_alloc",
                "out of memory")
TASK_SIGNS = ("can't start new thread", "resource temporarily unavailable", "thread creation failed",
              "pthread_create failed", "fork: retry")


MEMORY_UNBOUNDED_WARNING = (
    "the jailed processes' host memory is unbounded: this host offers no cgroup v2 memory controller PRISM may "
    "use, and CUDA processes take no address-space cap; only the host's OOM killer stops a loop that "
    "allocates without end (the run's figures are unaffected)")
"""The manifest's ``isolation.memory_warning`` (and the console's) when :attr:`Jail.memory_unbounded`."""
MEMORY_HELD_BY = ("none", "rlimit", "cgroup")
"""What holds a jailed child's memory, weakest first (the manifest's ``isolation.memory_limit_by``)."""


def default_memory_limit() -> int:
    """The memory limit of every jailed process: :data:`MAX_ADDRESS_SPACE`, but never more than
    the host's memory (a limit above the RAM holds nothing), bytes."""
    host = host_memory_bytes()
    return MAX_ADDRESS_SPACE if host is None else min(MAX_ADDRESS_SPACE, host)


def jail_limits(device: str, memory_bytes: int | None, *, max_processes: int | None = None,
                max_file_bytes: int | None = None, max_open_files: int | None = None) -> Limits:
    """The limits of a run's jailed processes on ``device`` (``"cpu"`` or ``"cuda"``).

    ``memory_bytes`` (``None``: unlimited) is the cgroup v2 ``memory.max`` of each jailed tree on
    both devices (:class:`MemoryCgroup`, where the host has one); on CPU it is also each
    process's ``RLIMIT_AS``, which holds the memory where no cgroup can be made. CUDA maps far
    more address space than it uses, so a CUDA process takes no ``RLIMIT_AS``: the cgroup alone
    bounds it, and without one nothing does (:data:`MEMORY_UNBOUNDED_WARNING`).
    """
    return Limits(address_space_bytes=None if device == "cuda" else memory_bytes, max_processes=max_processes,
                  max_file_bytes=max_file_bytes, max_open_files=max_open_files, memory_bytes=memory_bytes)


def child_env(threads: int, extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of every jailed process: :func:`sandbox_env` of this process's
    environment, :func:`compute_env` for ``threads``, ``PYTHONDONTWRITEBYTECODE=1`` and
    ``PYTHONPATH`` led by this package's source directory, then ``extra``."""
    env = sandbox_env(os.environ)
    src = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH", "")) if p)
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    env.update(compute_env(threads))
    env.update(extra or {})
    return env


def diagnose(returncode: int | None, output: str, limits: Limits, *, oom: bool = False) -> tuple[str, dict | None]:
    """Why a jailed child ended with ``returncode`` (``None``: a report the child made itself,
    not an exit): ``(kind: reason, refusal or None)``.

    Kinds: ``audit`` (the audit hook refused an event: it is named), ``memory`` (the memory
    limit was reached), ``tasks`` (the task limit was reached), ``crash`` (anything else, with
    the exit status or signal).
    """
    refusal = find_refusal(output)
    if refusal is not None:
        return f"audit: {describe_refusal(refusal)}", refusal
    low = output.lower()
    how = "" if returncode is None else f" (signal {signal.Signals(-returncode).name})" \
        if returncode < 0 and -returncode in signal.valid_signals() else f" (exit status {returncode})"
    if oom or any(s in low for s in MEMORY_SIGNS):
        cap = limits.address_space_bytes
        return f"memory: the process ran out of its memory limit{f' of {cap:,} bytes' if cap else ''}{how}", None
    if any(s in low for s in TASK_SIGNS):
        cap = limits.max_processes
        return f"tasks: the process could not start a thread or process: the task limit{f' of {cap}' if cap else ''} " \
               f"was reached{how}", None
    return f"crash: the process ended{how or ''}", None


@dataclass
class Jail:
    """How every process that runs submitted code is started. Build one per evaluation with
    :meth:`open`; start children with :meth:`popen` (long-lived: torchrun) or :meth:`run`
    (bounded: the parameter, held-out and probe children).

    Attributes:
        mode: ``"strict"`` (the sandbox) or ``"none"`` (no sandbox: local work only).
        bundle_dir: the frozen bundle copy, bound read-only.
        hidden: host paths the sandbox covers (data directory, salt, caches).
        limits: rlimits of every process (address space, tasks, file size, open files).
        threads: intra-op threads (:func:`compute_env`).
        backend, uid: the sandbox backend and uid (``None`` without a sandbox / not root).
        audit: arm the audit hooks in the children (``False`` only in tests of the sandbox
            by itself).
        tmp_bytes, shm_bytes: sizes of the sandbox's private ``/tmp`` and ``/dev/shm``
            (:func:`~prism_challenge.evaluator.sizing.run_sizes`).
    """

    mode: str
    bundle_dir: str
    hidden: tuple[str, ...]
    limits: Limits
    threads: int
    backend: str | None = None
    uid: int | None = None
    audit: bool = True
    cgroups: list[MemoryCgroup] = field(default_factory=list)
    memory_by: str = ""  # what held the children's memory, the weakest of them (_memory); "" before the first
    children: list[subprocess.Popen] = field(default_factory=list)
    killed: bool = False  # kill_all() ran: no new child starts
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)
    _spares: dict[tuple, Started] = field(default_factory=dict, repr=False, compare=False)
    tmp_bytes: int = DEFAULT_TMP_BYTES
    shm_bytes: int = DEFAULT_SHM_BYTES

    @classmethod
    def open(cls, mode: str, *, bundle_dir: str | os.PathLike[str], hidden: Sequence[str | os.PathLike[str]],
             limits: Limits, threads: int, audit: bool = True, tmp_bytes: int = DEFAULT_TMP_BYTES,
             shm_bytes: int = DEFAULT_SHM_BYTES) -> Jail:
        """Probe the sandbox once and pick the uid.

        Raises:
            IsolationError: an unknown mode, or ``strict`` with no working sandbox.
        """
        if mode not in ("strict", "none"):
            raise IsolationError(f"isolation mode {mode!r}: expected strict or none")
        sizes = {"tmp_bytes": tmp_bytes, "shm_bytes": shm_bytes}
        if mode == "none":
            return cls(mode, str(bundle_dir), tuple(map(str, hidden)), limits, threads, audit=audit, **sizes)
        backend = available_backend()
        if backend is None:
            sandbox_prefix("strict", writable=[], hidden=[], tmp_dir=None, socket_dir=None, bundle_dir=None)
        uid = pick_sandbox_uid() if os.geteuid() == 0 else None
        return cls(mode, str(bundle_dir), tuple(map(str, hidden)), limits, threads, backend, uid, audit, **sizes)

    @property
    def isolated(self) -> bool:
        """Whether children run in the sandbox."""
        return self.mode == "strict"

    def command(self, argv: Sequence[str], *, writable: Sequence[str | os.PathLike[str]] = (),
                socket_dir: str | os.PathLike[str] | None = None, limits: Limits | None = None) -> list[str]:
        """``argv`` behind the sandbox prefix (``writable`` read-write, ``socket_dir`` read-only,
        ``limits`` default :attr:`limits`).

        Raises:
            IsolationError: the sandbox cannot bind a path.
        """
        if not self.isolated:
            return list(argv)
        prefix = sandbox_prefix("strict", writable=list(writable), hidden=list(self.hidden), tmp_dir=None,
                                socket_dir=socket_dir, bundle_dir=self.bundle_dir, limits=limits or self.limits,
                                uid=self.uid, backend=self.backend, tmp_bytes=self.tmp_bytes,
                                shm_bytes=self.shm_bytes)
        return prefix + list(argv)

    def _memory(self) -> tuple[Limits, MemoryCgroup | None]:
        """The rlimits to apply and the cgroup that holds the memory instead of ``RLIMIT_AS``
        (:meth:`Limits.cgroup_bytes`); records in :attr:`memory_by` what holds it: ``cgroup``,
        ``rlimit``, or ``none`` (no cgroup here and no address-space cap: CUDA on a host
        without a usable cgroup v2 memory controller, :data:`MEMORY_UNBOUNDED_WARNING`)."""
        cap = self.limits.cgroup_bytes()
        group = MemoryCgroup.create(cap) if cap else None
        held = "cgroup" if group is not None else "rlimit" if self.limits.address_space_bytes else "none"
        if not self.memory_by or MEMORY_HELD_BY.index(held) < MEMORY_HELD_BY.index(self.memory_by):
            self.memory_by = held  # the weakest of the children's
        if group is None:
            return self.limits, None
        self.cgroups.append(group)
        return dataclasses.replace(self.limits, address_space_bytes=None), group

    def popen(self, argv: Sequence[str], *, writable: Sequence[str | os.PathLike[str]] = (),
              socket_dir: str | os.PathLike[str] | None = None, env: dict[str, str] | None = None,
              cwd: str | os.PathLike[str] | None = None, stdin: Any = subprocess.DEVNULL, stdout: Any = None,
              stderr: Any = None) -> subprocess.Popen:
        """Start ``argv`` in the jail, in a session of its own, and return it.

        ``env``: extra variables over :func:`child_env`. In the sandbox the rlimits are applied
        after the uid drop; without it in ``preexec_fn`` (with ``PR_SET_PDEATHSIG``).
        """
        return self._start(argv, writable=writable, socket_dir=socket_dir, env=env, cwd=cwd, stdin=stdin,
                           stdout=stdout, stderr=stderr)[0]

    def _start(self, argv: Sequence[str], *, writable, socket_dir, env, cwd, stdin, stdout, stderr
               ) -> tuple[subprocess.Popen, MemoryCgroup | None]:
        """Start ``argv`` (see :meth:`popen`); the process and its memory cgroup, if any."""
        limits, group = self._memory()
        apply = None if self.isolated else limits_preexec(
            address_space_bytes=limits.address_space_bytes, max_processes=limits.max_processes,
            max_file_bytes=limits.max_file_bytes, max_open_files=limits.max_open_files)

        def preexec() -> None:
            if group is not None:
                group.enter()
            if apply is not None:
                apply()

        extra = {**(env or {}), **({} if self.audit and not sabotage.active() else {ENV_OFF: "off"})}
        command = self.command(argv, writable=writable, socket_dir=socket_dir, limits=limits)
        with self._lock:  # kill_all() either sees this child or keeps it from starting
            if self.killed:
                if group is not None:
                    group.remove()
                    self.cgroups.remove(group)
                raise IsolationError("the run was cancelled: the jail starts no new process")
            proc = subprocess.Popen(command, env=child_env(self.threads, extra), cwd=cwd, stdin=stdin, stdout=stdout,
                                    stderr=stderr, start_new_session=True, preexec_fn=preexec)
            self.children = [p for p in self.children if p.returncode is None] + [proc]
        return proc, group

    def run(self, argv: Sequence[str], *, input: bytes | Iterable[bytes] = b"", timeout_s: float,
            writable: Sequence[str | os.PathLike[str]] = (), env: dict[str, str] | None = None,
            cwd: str | os.PathLike[str] | None = None, warm_next: bool = False) -> Finished:
        """Run ``argv`` in the jail to its end or to ``timeout_s`` seconds (then its whole group
        is killed), feeding ``input`` on stdin; never raises for the child's own failure. A spare
        :meth:`warm` started for the same ``argv``, ``writable``, ``env`` and ``cwd`` is fed
        instead of a new child; ``warm_next`` starts the next spare once this child is taken.

        Raises:
            IsolationError: the sandbox cannot be set up.
            OSError: the child cannot be started.
        """
        spare = self._spares.pop(_spare_key(argv, writable, env, cwd), None)
        if spare is not None and (spare.proc.poll() is not None or spare.folders != _folder_ids(writable)):
            self.abandon(spare)  # it died waiting, or a folder it bound was replaced since: start another
            spare = None
        started = spare or self.start(argv, writable=writable, env=env, cwd=cwd)
        if warm_next:
            try:
                self.warm(argv, writable=writable, env=env, cwd=cwd)
            except BaseException:
                self.abandon(started)
                raise
        return self.finish(started, input=input, timeout_s=timeout_s)

    def warm(self, argv: Sequence[str], *, writable: Sequence[str | os.PathLike[str]] = (),
             env: dict[str, str] | None = None, cwd: str | os.PathLike[str] | None = None) -> None:
        """Start a spare ``argv`` child now (:meth:`start`) for the next :meth:`run` with the same
        ``argv``, ``writable``, ``env`` and ``cwd``, which feeds it instead of starting one: its
        interpreter start and imports overlap whatever runs meanwhile. Only for children that
        read their stdin before running any submitted code (the audit's and the held-out's): a
        spare has run nothing but the harness when it is fed, as fresh as one started then. A
        spare whose ``writable`` folder was replaced since (another folder at the same path) is
        not fed: it would see the old folder.
        One spare per key; :meth:`close` and :meth:`kill_all` end the unused ones.

        Raises:
            IsolationError: as :meth:`start`.
            OSError: the child cannot be started.
        """
        key = _spare_key(argv, writable, env, cwd)
        if key not in self._spares:
            self._spares[key] = self.start(argv, writable=writable, env=env, cwd=cwd)

    def start(self, argv: Sequence[str], *, writable: Sequence[str | os.PathLike[str]] = (),
              env: dict[str, str] | None = None, cwd: str | os.PathLike[str] | None = None) -> Started:
        """Start ``argv`` in the jail with pipes, to be fed later by :meth:`finish` (or ended by
        :meth:`abandon`). A child that reads its stdin before it runs any submitted code (the
        audit's, the held-out's) can import torch while an earlier child works: it is as fresh
        as one started later, since it has run nothing but the harness when it is fed.

        Raises:
            IsolationError: the sandbox cannot be set up, or the run was cancelled.
            OSError: the child cannot be started.
        """
        folders = _folder_ids(writable)
        proc, group = self._start(argv, writable=writable, socket_dir=None, env=env, cwd=cwd, stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        return Started(proc, group, folders)

    def finish(self, started: Started, *, input: bytes | Iterable[bytes] = b"", timeout_s: float) -> Finished:
        """Feed a :meth:`start`-ed child ``input`` and wait for its end, at most ``timeout_s``
        seconds from now (then its whole group is killed); never raises for its own failure.
        ``input``: bytes, or an iterable of byte blocks written one by one as the child reads
        (:func:`stream_input`: a large input is never held whole).

        Raises:
            OSError: the iterable failed (e.g. a file it reads), after the child ended.
        """
        proc, group = started.proc, started.group
        timed_out = False
        watch = refusal_watch()  # the hook's refusal line, whatever is printed after it
        pipes = drains(proc, watch)  # bounded: the parent keeps a fixed tail of each (outputcap)
        feeder = None
        if isinstance(input, (bytes, bytearray, memoryview)):
            feed(proc, bytes(input))
        else:
            feeder = stream_input(proc, input)
        try:
            proc.wait(timeout=max(0.0, timeout_s))
        except subprocess.TimeoutExpired:
            timed_out = True
            kill_group(proc)
            proc.wait()
        except BaseException:
            kill_group(proc)
            proc.wait()
            collect(pipes)
            raise
        finally:
            oom = group is not None and group.oom_killed()
            self._release(group)
            if feeder is not None:
                feeder.join()
        out, err = collect(pipes)
        kept = {"stdout_dropped": out.dropped, "stderr_dropped": err.dropped}
        if feeder is not None and feeder.error is not None:
            raise feeder.error
        if timed_out:
            return Finished(proc.returncode, out.tail, err.tail, True, f"timeout: no result within {timeout_s:g} s",
                            None, **kept)
        if proc.returncode == 0:
            return Finished(0, out.tail, err.tail, False, None, None, **kept)
        seen = (watch.line + b"\n" if watch.line is not None else b"") + err.tail
        failure, refusal = diagnose(proc.returncode, seen.decode(errors="replace"), self.limits, oom=oom)
        return Finished(proc.returncode, out.tail, err.tail, False, failure, refusal, **kept)

    def abandon(self, started: Started) -> None:
        """Kill a :meth:`start`-ed child that will not be fed (an earlier child failed) and reap it."""
        kill_group(started.proc)
        started.proc.wait()
        if started.proc.stdin is not None:
            started.proc.stdin.close()
        collect(drains(started.proc))
        self._release(started.group)

    def _release(self, group: MemoryCgroup | None) -> None:
        if group is not None:
            group.remove()
            if group in self.cgroups:
                self.cgroups.remove(group)

    def kill_all(self) -> int:
        """SIGKILL the group of every child this jail started that was not reaped yet (torchrun's
        tree, the parameter, held-out and probe children), and start no new one (:meth:`popen`
        and :meth:`run` raise :class:`IsolationError` after it); safe from another thread (a
        cancelled run). Returns how many groups were signalled."""
        with self._lock:
            self.killed = True
            alive = [p for p in self.children if p.returncode is None]
            for proc in alive:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
        return len(alive)

    def drop_spare(self, argv: Sequence[str], *, writable: Sequence[str | os.PathLike[str]] = (),
                   env: dict[str, str] | None = None, cwd: str | os.PathLike[str] | None = None) -> None:
        """End the unused spare of this key (:meth:`warm`), if there is one."""
        spare = self._spares.pop(_spare_key(argv, writable, env, cwd), None)
        if spare is not None:
            self.abandon(spare)

    def close(self) -> None:
        """End the unused spares (:meth:`warm`) and remove the cgroups of children started with
        :meth:`popen` (after they ended)."""
        while self._spares:
            self.abandon(self._spares.popitem()[1])
        for group in self.cgroups:
            group.remove()
        self.cgroups.clear()

    def summary(self) -> dict[str, Any]:
        """What the manifest records of the jail."""
        return {"mode": self.mode, "isolated": self.isolated, "backend": self.backend, "uid": self.uid,
                "hidden": list(self.hidden), "limits": vars(self.limits).copy(),
                "tmp_bytes": self.tmp_bytes, "shm_bytes": self.shm_bytes,
                "memory_limit_by": self.memory_by or ("rlimit" if self.limits.address_space_bytes else "none"),
                "audit_hooks": self.audit,
                "audit_exit_code": AUDIT_EXIT_CODE,
                **({"memory_warning": MEMORY_UNBOUNDED_WARNING} if self.memory_unbounded else {})}

    @property
    def memory_unbounded(self) -> bool:
        """Whether a memory limit was asked for (:meth:`Limits.cgroup_bytes`) and nothing holds it:
        no usable cgroup v2 memory controller, and no ``RLIMIT_AS`` (CUDA)."""
        return self.memory_by == "none" and self.limits.cgroup_bytes() is not None
