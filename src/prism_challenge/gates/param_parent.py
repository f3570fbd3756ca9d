"""The parent's side of the parameter cap: :func:`measure_parameters` runs the bounded child
(:mod:`~prism_challenge.gates.param_count`) in a jail, feeds it its arguments on stdin and
reads its one JSON line; :func:`warm_child` starts that child early in ``prism eval``.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from prism_challenge import scratch

if TYPE_CHECKING:
    from prism_challenge.evaluator.jail import Jail

CHILD_ARGV_TAIL = ("-s", "-m", "prism_challenge.gates.param_count", "--stdin")
"""The child's command line after the interpreter: its arguments come on stdin
(:func:`prism_challenge.gates.param_count.main`), so one started early (:func:`warm_child`)
serves whatever the gates then ask."""


@dataclass(frozen=True)
class ParamResult:
    """What the child reported.

    Attributes:
        count: unique storage elements of parameters and buffers, or ``None`` on failure.
        kind: failure kind (``timeout``, ``memory``, ``build``, ``forward``, ``import``,
            ``symbol``, ``lazy``, ``crash``, ``harness``) or ``None`` on success.
        error: one-line failure message (``""`` on success).
        seconds: wall-clock seconds from the child's start, or from its feed for a spare
            (:func:`warm_child`), to its result.
        detail: the child's full JSON object (parameters/buffers split on success).
    """

    count: int | None
    kind: str | None
    error: str
    seconds: float
    detail: dict[str, Any]


PARAM_LIMITS_MEMORY = 8 << 30
"""Address-space limit of the child when it runs without a run's jail (``prism check`` default)."""


def measure_parameters(
    root: Path,
    module: str,
    symbol: str,
    *,
    vocab_size: int,
    seq_len: int,
    max_parameters: int,
    tokenizer: str = "gpt2",
    timeout_s: float = 60.0,
    jail: Jail | None = None,
    context: dict[str, Any] | None = None,
) -> ParamResult:
    """Build the bundle's model in a jailed child and count its parameters.

    Args:
        root: bundle root (the frozen copy; put first on the child's ``sys.path``).
        module, symbol: the architecture entrypoint (``architecture``, ``build_model``).
        vocab_size, seq_len, max_parameters, tokenizer: the context handed to ``build_model``.
        timeout_s: wall-clock limit in seconds from the feed of its arguments to its end: for a
            child started here its interpreter start and ``import torch`` (1 to 3 s) count in
            it, for a spare (:func:`warm_child`) they came before.
        jail: the :class:`~prism_challenge.evaluator.jail.Jail` every process that runs
            submitted code starts in (sandbox, environment, limits); default: a strict jail
            of its own (:func:`check_jail`).
        context: the run's context values (:data:`~prism_challenge.evaluator.protocol.CONTEXT_FIELDS`,
            ``prism eval``): the child's ``PrismContext`` then has them, and its artifacts
            folder is the run's (still empty); default: a context of its own in a temporary folder.

    Returns:
        the child's report; never raises for bundle failures (they are ``kind``/``error``:
        an audit refusal is kind ``audit`` with the event named).

    Raises:
        RuntimeError: the child could not be started at all.
        prism_challenge.evaluator.isolation.IsolationError: no jail was given and strict
            isolation is not available.
    """
    jail = jail or check_jail(Path(root))
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="prism-params-", dir=scratch.root()) as work:
        artifacts = Path(work) / "artifacts" if context is None else Path(str(context["artifacts_dir"]))
        artifacts.mkdir(exist_ok=context is not None)
        args = [
            "--root", str(root),
            "--module", module,
            "--symbol", symbol,
            "--vocab-size", str(vocab_size),
            "--seq-len", str(seq_len),
            "--max-parameters", str(max_parameters),
            "--artifacts-dir", str(artifacts),
            "--tokenizer", tokenizer,
            "--hidden", json.dumps(list(jail.hidden)),
        ] + ([] if context is None else ["--context", json.dumps(context)])  # fmt: skip
        try:  # a spare started by :func:`warm_child` for the same folder is fed instead of a new child
            done = jail.run(child_argv(), input=(json.dumps(args) + "\n").encode(), timeout_s=timeout_s,
                            **_placement(artifacts))
        except OSError as exc:
            raise RuntimeError(f"cannot start the parameter-count child: {exc}") from exc
    seconds = time.perf_counter() - started
    if done.timed_out:
        return ParamResult(None, "timeout", f"no result within {timeout_s:g} s", seconds, {})
    if done.refusal is not None:
        return ParamResult(None, "audit", done.failure.partition(": ")[2], seconds, {})
    lines = [ln for ln in done.stdout.decode("utf-8", "replace").splitlines() if ln.strip()]
    detail: dict[str, Any] = {}
    if lines:
        try:
            detail = json.loads(lines[-1])
        except (ValueError, RecursionError):  # not JSON, a number too long, nested too deep
            detail = {}
    if not isinstance(detail, dict) or "ok" not in detail:
        tail = " ".join(done.stderr.decode("utf-8", "replace").split()[-30:])
        if done.stderr_note:  # a bounded tail (outputcap): say how much came before it
            tail = f"{done.stderr_note} {tail}"
        kind = (done.failure or "crash").partition(":")[0]
        return ParamResult(None, kind if kind in ("memory", "tasks") else "crash",
                           f"{done.failure or 'the child ended'} without a result: {tail}", seconds, {})
    if detail.get("ok"):
        return ParamResult(int(detail["count"]), None, "", seconds, detail)
    return ParamResult(None, str(detail.get("kind", "build")), str(detail.get("error", "")), seconds, detail)


def child_argv() -> list[str]:
    """The parameter child's command line (:data:`CHILD_ARGV_TAIL`), the same for every bundle."""
    return [sys.executable, *CHILD_ARGV_TAIL]


def spare_cores(nproc: int) -> bool:
    """Whether this process may use at least ``nproc + 2`` cores: one for each rank's start, one
    for the parent's ``import torch`` and one for a spare parameter child (:func:`warm_child`),
    each a single-threaded import of about a second.

    With fewer the spare only takes CPU from the ranks' start, which the release also waits
    for: on this project's 2-core VM (one rank) the trivial bundle's whole command took 4.69 s
    with the spare against 4.24 s without (medians of 4, alternating), though its gates took
    0.27 s instead of 1.24 s.
    """
    return len(os.sched_getaffinity(0)) >= nproc + 2


def warm_child(jail: Jail, artifacts: Path) -> None:
    """Start the parameter child of ``prism eval`` now, in ``jail`` (:meth:`~prism_challenge.evaluator.jail.Jail.warm`):
    its interpreter and ``import torch`` overlap the ranks' start and the static gates, and
    :func:`measure_parameters` with the run's context (whose ``artifacts_dir`` is ``artifacts``)
    feeds it. It reads its arguments before it touches the bundle, so it has run nothing
    submitted when it is fed, or ended unfed (:meth:`~prism_challenge.evaluator.jail.Jail.close`)
    when a gate refuses.

    Raises:
        prism_challenge.evaluator.isolation.IsolationError: the sandbox cannot be set up.
        OSError: the child cannot be started.
    """
    jail.warm(child_argv(), **_placement(artifacts))


def _placement(artifacts: Path) -> dict[str, Any]:
    """The child's writable folder and working directory, ``artifacts``: one definition for
    :func:`warm_child` and :func:`measure_parameters`, since a spare is fed only when they match
    (:meth:`~prism_challenge.evaluator.jail.Jail.run`)."""
    return {"writable": [str(artifacts)], "cwd": str(artifacts)}


def check_jail(root: Path, isolation: str = "strict", threads: int = 2, *,
               memory_bytes: int = PARAM_LIMITS_MEMORY) -> Jail:
    """The jail of a parameter child outside ``prism eval`` (``prism check``): the same sandbox,
    environment policy and limits as a run's, with PRISM's caches (salts, token caches) hidden.

    Raises:
        prism_challenge.evaluator.isolation.IsolationError: strict isolation is not available.
    """
    from prism_challenge.data.builtin import default_cache_root
    from prism_challenge.evaluator.isolation import Limits
    from prism_challenge.evaluator.jail import (
        DEFAULT_MAX_FILE_BYTES,
        DEFAULT_MAX_OPEN_FILES,
        DEFAULT_MAX_PROCESSES,
        Jail,
        default_memory_limit,
    )

    # the run's limits (RLIMIT_NPROC only for the sandbox uid of a root run, as in prism eval)
    tasks = DEFAULT_MAX_PROCESSES if os.geteuid() == 0 and isolation == "strict" else None
    limits = Limits(address_space_bytes=min(memory_bytes, default_memory_limit()), max_open_files=DEFAULT_MAX_OPEN_FILES,
                    max_file_bytes=DEFAULT_MAX_FILE_BYTES, max_processes=tasks)
    return Jail.open(isolation, bundle_dir=root, hidden=[str(default_cache_root())], limits=limits, threads=threads)
