"""The stages from the release to the score, in order: :func:`release` (the ranks get their
configuration), :func:`stream` (the parent watches the ranks to the stream's end: budgets,
stalls, failures, cancel) and :func:`score` (why the run cannot be scored, else its prequential
score).
"""

from __future__ import annotations

import resource
import shutil
import signal
import time
from pathlib import Path

from prism_challenge.control import CANCELLED_MESSAGE, RunControl
from prism_challenge.evaluator.audit import describe_refusal, find_refusal
from prism_challenge.evaluator.feeder import Feeder, FeederResult
from prism_challenge.evaluator.isolation import Guard
from prism_challenge.evaluator.jail import Jail, diagnose
from prism_challenge.evaluator.launcher import agent_of
from prism_challenge.failures import KILLED, REPORTED, EvalFailure
from prism_challenge.audit.auditstage import drop_snapshots
from prism_challenge.manifest.record import write_phases
from prism_challenge.options import EvalOptions
from prism_challenge.pipeline.context import Run
from prism_challenge.research.report import C10D_HOSTNAME_WARNING, strip_launcher_dump
from prism_challenge.score.scoring import ScoringError, prequential_score

DONE_GRACE_S = 20.0  # after every rank reported DONE, torchrun gets this long to exit
DRAIN_S = 5.0  # after torchrun exited, the feeder gets this long to read the ranks' last frames
WATCHDOG_GRACE_S = 30.0  # past the wall-clock budget, the tree is killed after this long
LOG_TAIL_LINES = 12
# The parent shares the cores with the ranks: it wakes rarely (an OMP thread of a rank that
# loses its core stalls every other thread of that rank at the next barrier).
WATCH_INTERVAL_S = 0.25  # the watch loop's period: few wake-ups on cores the ranks compute on


def _drop_c10d_warnings(log: Path) -> None:
    """Remove c10d's hostname warning from the runner log: the sandbox's empty network namespace
    resolves no hostname, so every rank's TCPStore client printed it first, on every run."""
    try:
        text = log.read_text(errors="replace")
        if C10D_HOSTNAME_WARNING in text:
            log.write_text("".join(line for line in text.splitlines(keepends=True) if C10D_HOSTNAME_WARNING not in line))
    except OSError:
        pass


def _log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    try:
        text = strip_launcher_dump(path.read_text(errors="replace"))  # torchrun's own dump stays in the log
    except OSError:
        return ""
    return "\n".join(text.rstrip().splitlines()[-lines:])


def stream_total(run: Run) -> tuple[int | None, str]:
    """The progress bar's total and unit: the token budget, else the bytes the stream can score."""
    opts = run.opts
    if opts.token_budget:
        return opts.token_budget, "tokens"
    total = int(run.data.split("train").get("utf8_bytes") or 0) or None
    if opts.byte_budget:
        total = min(total, opts.byte_budget) if total else opts.byte_budget
    return total, "bytes"


def release(run: Run) -> None:
    """Every gate passed: the feeder sends the ranks their configuration, and the run starts
    (the wall-clock budget and ``timing`` count from here)."""
    run.feeder.release()
    run.t_release = run.feeder.released_at or time.monotonic()
    run.cpu_release = resource.getrusage(resource.RUSAGE_SELF)


def stream(run: Run) -> None:
    """The stream: watch the ranks to the end (budgets, stalls, cancel), then end the tree and
    read the feeder's result. Sets ``run.result``, ``killed_by`` and ``harness_killed``; never
    raises for the run's own failure (:func:`score` judges it)."""
    opts, feeder, proc, sandbox = run.opts, run.feeder, run.proc, run.sandbox
    try:
        run.killed_by = _watch(opts, proc, feeder, sandbox.guard, run.t_release, run.control)
    finally:
        if proc.poll() is not None:  # torchrun ended by itself: read what its ranks wrote last
            feeder.drain(DRAIN_S)
        feeder.stopping.set()  # connections the kill closes are not the runner's failure
        run.harness_killed = proc.poll() is None
        if run.harness_killed:
            proc.kill()
        proc.close_log()  # the ranks' last output, the log capped (outputcap)
        sandbox.guard.kill()
        sandbox.jail.close()
        run.result = feeder.finish()
        if run.sock_tmp is not None:
            shutil.rmtree(run.sock_tmp, ignore_errors=True)
    run.t_end = time.monotonic()
    _drop_c10d_warnings(run.log_path)
    if opts.profile_phases:
        write_phases(run.run_dir / "logs" / "phases.json", run.result, run.cpu_release, run.t_end - run.t_release)


def score(run: Run) -> None:
    """Score what was scored: why the run cannot be scored (:func:`_judge`, the frozen bundle's
    check) in ``run.failure``, else its prequential score in ``run.score``. An unscored run
    keeps no weights: the audit's snapshots go."""
    opts, result, proc = run.opts, run.result, run.proc
    if run.control.cancelled:  # the watcher killed the tree: whatever the feeder saw after, it was the kill
        run.killed_by = "cancelled"
    outside = None if run.harness_killed or run.killed_by == "cancelled" else _signal_of(proc.poll())
    failure = _judge(opts, result, run.killed_by, proc, run.log_path, run.sandbox.jail, outside)
    changed = run.frozen.changes()
    if changed:  # the ranks imported something other than what the gates read and the manifest names
        failure = EvalFailure("contract", f"the frozen bundle changed during the run: {', '.join(changed[:5])}")
    if failure is None:
        try:
            run.score = prequential_score(result.steps)
        except ScoringError as exc:
            failure = EvalFailure("scoring", str(exc))
    run.failure = failure
    if failure is not None:
        drop_snapshots(run.run_dir)


def _watch(opts: EvalOptions, proc, feeder: Feeder, guard: Guard | None, t_release: float,
           control: RunControl) -> str | None:
    """Wait for the run to end; returns why the parent stopped it early (or ``None``).

    ``t_release``: when the run started (the gates' release); the wall-clock budget counts from it.
    """
    while proc.poll() is None:
        feeder.wake.wait(WATCH_INTERVAL_S)  # a failure or the last DONE wakes it at once
        feeder.wake.clear()
        now = time.monotonic()
        if control.cancelled:
            return "cancelled"
        if feeder.failed.is_set():
            time.sleep(0.5)  # let the runner finish writing its report, then stop the tree
            return "failure"
        if opts.wall_clock_budget is not None and now - t_release > opts.wall_clock_budget + WATCHDOG_GRACE_S:
            return "watchdog"
        never = feeder.check_first_batch(opts.idle_timeout)
        if never is not None:  # nothing scored and nothing coming: fail now, not when the budget ends
            feeder.fail("contract", f"{never} [--idle-timeout {opts.idle_timeout:g} s]")
            return "failure"
        stalled = feeder.check_stall(opts.rank_timeout if opts.nproc > 1 else opts.idle_timeout,
                                     first_timeout=opts.idle_timeout)  # a first compile is no stall
        if stalled is not None:
            stage, message, rank = stalled
            if stage == "stalled":  # one rank stuck after its last batch: stop, score what was scored
                return "stalled"
            feeder.fail(stage, f"{message} [--rank-timeout {opts.rank_timeout:g} s]", rank=rank)
            return "failure"
        reason = guard.check(now) if guard is not None else None
        if reason is not None:
            feeder.fail("resources", reason)
            return "failure"
        if feeder.all_done():
            deadline = now + DONE_GRACE_S
            while proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.02)
            return None
    return None


def _judge(opts: EvalOptions, result: FeederResult, killed_by: str | None, proc, log_path: Path,
           jail: Jail, outside_signal: int | None = None) -> EvalFailure | None:
    """Why the run cannot be scored, or ``None`` (a watchdog or stall stop is scored on what was scored).

    The audit hook's refusal (in the ranks' log) comes first: a rank it stopped also closed its
    socket, which the feeder reports as a lost connection. A cancelled run is ``cancelled``; a
    torchrun the harness did not stop that ended on a signal (``outside_signal``) was killed from
    outside (cause ``killed``); a failure the runner reported from inside a rank has cause
    ``reported``."""
    if killed_by == "cancelled":
        return EvalFailure("cancelled", CANCELLED_MESSAGE)
    if outside_signal is not None:
        return EvalFailure("runner", f"{_agent_name(opts)} ended on signal {outside_signal} that the harness did not send: "
                                     "the run was killed from outside", _log_tail(log_path), cause=KILLED)
    refusal = find_refusal(_log_tail(log_path, 10_000)) if proc.poll() not in (0, None) or result.error else None
    if refusal is not None:
        return EvalFailure("contract", describe_refusal(refusal), _log_tail(log_path))
    if result.error is not None:  # a limit reached is named as such, not as the loop's error or a lost rank
        message = str(result.error.get("message", ""))
        lost = "closed" in message or "connection" in message.lower()
        kind = diagnose(proc.poll() if lost else None, _log_tail(log_path, 200) if lost else message, jail.limits)[0]
        if kind.startswith(("memory:", "tasks:")):
            return EvalFailure("resources", kind if lost else f"{kind}: {message}", _log_tail(log_path))
    if result.error is not None:
        err = result.error
        return EvalFailure(err["stage"], err["message"], err.get("traceback") or _log_tail(log_path),
                           cause=REPORTED if err.get("origin") == "runner" else str(err.get("cause") or ""))
    if killed_by == "watchdog":
        result.stop_reason = "wall_clock_budget"
    elif killed_by == "stalled":
        result.stop_reason = "stalled"
    elif len(result.done) < opts.nproc:
        return EvalFailure(
            "runner",
            f"the run ended without a report from rank(s) "
            f"{sorted(set(range(opts.nproc)) - set(result.done))} ({_agent_name(opts)} exit code {proc.proc.returncode})",
            _log_tail(log_path),
        )
    counts = [d.get("parameter_count") for d in result.done.values()]
    over = [c for c in counts if isinstance(c, int) and c > opts.max_parameters]
    if over:  # the runner refuses this itself; the trusted side checks its report too
        return EvalFailure("contract", f"the scored model holds {max(over):,} unique parameter and buffer elements, "
                                       f"over the cap of {opts.max_parameters:,}")
    if not result.steps and result.stop_reason == "wall_clock_budget":
        return EvalFailure("budget", f"no batch was scored before the wall-clock budget of "
                                     f"{opts.wall_clock_budget:g} s ran out (counted from the gates' release)")
    if not result.steps:
        return EvalFailure("contract", "no batch was scored: the loop never iterated ctx.iter_train_batches(...)")
    return None


def _agent_name(opts: EvalOptions) -> str:
    """The launcher's agent in messages: ``torchrun`` or ``the single-rank agent``."""
    return "torchrun" if agent_of(opts.nproc, opts.warm_ranks) == "torchrun" else "the single-rank agent"


EXTERNAL_SIGNALS = (signal.SIGKILL, signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)


def _signal_of(returncode: int | None) -> int | None:
    """The signal that ended the launcher's process (``-N`` from Python, ``128 + N`` from a
    sandbox's init or a shell that reports its child's signal), or ``None``. The ranks cannot
    signal it (the audit hook refuses ``os.kill``), and a rank that dies makes torchrun, or the
    single-rank agent, exit 1."""
    if returncode is None:
        return None
    sig = -returncode if returncode < 0 else returncode - 128 if returncode > 128 else 0
    return sig if sig in EXTERNAL_SIGNALS else None
