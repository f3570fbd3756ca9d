"""The sandbox's command line: the argv prefix of a backend, ``bwrap`` or ``unshare(1)``.

:func:`_prefix` renders a mount plan (:mod:`~prism_challenge.evaluator.mountplan`) for
bubblewrap (:func:`_render_bwrap`: its flags) or for the unshare backend's init
(:mod:`~prism_challenge.evaluator.sandbox_init`, run by path with ``python -I -S``: the plan in
its JSON spec), with the namespaces, the rlimits, the seccomp filter and the uid drop.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from prism_challenge.evaluator import seccompfilter
from prism_challenge.evaluator.mountplan import _Plan
from prism_challenge.evaluator.sandboxerror import IsolationError

if TYPE_CHECKING:
    from prism_challenge.evaluator.isolation import Limits

BACKENDS = ("bwrap", "unshare")
ENV_CWD = "PRISM_SANDBOX_CWD"  # the caller's working directory, from outside bwrap to its init
DEV_NODES = ("null", "zero", "full", "random", "urandom", "tty")  # the unshare backend's /dev
ROOT_TMPFS_BYTES = 1 << 20  # the unshare backend's empty root (directories and mount points only)

# The unshare backend's init: an ordinary module file of this package, run by path.
_HELPER = Path(__file__).with_name("sandbox_init.py")


def _helper_argv(spec: dict[str, Any]) -> list[str]:
    return [sys.executable, "-I", "-S", str(_HELPER), json.dumps(spec, separators=(",", ":")), "--"]


def _render_bwrap(plan: _Plan) -> list[str]:
    out: list[str] = []
    for op in plan.ops:
        kind = op[0]
        if kind == "tmpfs":
            out += ["--size", str(op[2]), "--perms", f"{op[3]:04o}", "--tmpfs", op[1]]
        elif kind == "dir":
            out += ["--perms", f"{op[2]:04o}", "--dir", op[1]]
        elif kind == "bind":
            out += ["--ro-bind" if op[3] else "--bind", op[1], op[2]]
        elif kind == "symlink":
            out += ["--symlink", op[1], op[2]]
        elif kind == "dev":
            out += ["--dev", op[1]]
        elif kind == "devbind":
            out += ["--dev-bind", op[1], op[2]]
        elif kind == "proc":
            out += ["--proc", op[1]]
        elif kind == "remount_ro":
            out += ["--remount-ro", op[1]]
        else:
            raise IsolationError(f"unknown mount op {kind!r}")
    return out


def _prefix(
    backend: str,
    plan: _Plan,
    *,
    uid: int | None,
    gid: int | None,
    limits: Limits | None,
) -> list[str]:
    root = os.geteuid() == 0
    spec: dict[str, Any] = {"setsid": True, "rlimits": limits.rlimits() if limits else []}
    try:  # loaded last, right before exec, by the inner init
        spec["seccomp"] = seccompfilter.spec_entry()
    except seccompfilter.SeccompUnavailable as exc:
        raise IsolationError(str(exc)) from None
    env = {"TMPDIR": "/tmp"}
    if uid is not None:
        spec["uid"], spec["gid"] = uid, (uid if gid is None else gid)
        env.update({"HOME": "/tmp", "USER": "prism", "LOGNAME": "prism"})
    spec["env"] = env
    if backend == "bwrap":
        bwrap = shutil.which("bwrap")
        if bwrap is None:
            raise IsolationError("bwrap is not installed")
        argv = [bwrap, "--die-with-parent", "--new-session", "--unshare-net", "--unshare-pid",
                "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try"]
        if root:
            argv += ["--cap-drop", "ALL"]
            if uid is not None:
                argv += ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID", "--cap-add", "CAP_SETPCAP"]
                spec["capbset"] = True
        argv += _render_bwrap(plan)  # bwrap starts from an empty root (a tmpfs) of its own
        argv.append("--")
        spec["cwd_env"] = ENV_CWD
        return _helper_argv({"pass_cwd": ENV_CWD}) + argv + _helper_argv(spec)
    if backend == "unshare":
        unshare = shutil.which("unshare")
        if unshare is None:
            raise IsolationError("unshare is not installed")
        outer = _helper_argv({"pdeathsig": os.getpid()})
        argv = [unshare]
        if not root:
            argv += ["--user", "--map-root-user"]
        argv += ["--net", "--mount", "--pid", "--ipc", "--uts", "--fork", "--kill-child",
                 "--propagation", "private", "--"]
        inner = dict(spec)
        inner["mounts"] = plan.ops  # built on an empty tmpfs, then pivot_root into it
        inner["root_bytes"] = ROOT_TMPFS_BYTES
        inner["dev_nodes"] = list(DEV_NODES)
        inner["lo"] = True
        inner["init"] = True
        inner["capbset"] = True
        inner["dropcaps"] = True
        return outer + argv + _helper_argv(inner)
    raise IsolationError(f"unknown isolation backend {backend!r}; expected one of {', '.join(BACKENDS)}")
