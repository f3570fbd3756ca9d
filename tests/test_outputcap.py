"""Bounded output (evaluator/outputcap.py): a child that prints hundreds of MB costs the parent a
fixed tail, the bytes dropped are counted exactly, the harness's reply on stdout stays intact,
and the ranks' log is capped."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from prism_challenge.evaluator.isolation import Limits
from prism_challenge.evaluator.jail import Jail
from prism_challenge.evaluator.jailchild import Finished
from prism_challenge.evaluator.audit import AUDIT_EXIT_CODE, REFUSAL_TAG, find_refusal
from prism_challenge.evaluator.outputcap import (
    LOG_BYTES,
    RESULT_BYTES,
    TAIL_BYTES,
    Drain,
    dropped_note,
    gap_note,
    refusal_watch,
)

MB = 1 << 20
FLOOD_MB = 300


def flood_code(stream: str, mb: int, reply: str = "") -> str:
    """A child writing ``mb`` MiB of 'x' (the last byte of each MiB a newline) on ``stream``, then
    'END' on stderr, then ``reply`` on stdout."""
    return textwrap.dedent(f"""
        import os, sys
        line = b"x" * ({MB} - 1) + b"\\n"
        fd = 1 if {stream!r} == "stdout" else 2
        for _ in range({mb}):
            os.write(fd, line)
        os.write(2, b"END\\n")
        os.write(1, {reply.encode()!r})
    """)


def test_a_drain_keeps_the_last_cap_bytes_and_counts_the_rest_exactly(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", flood_code("stderr", 40)], stderr=subprocess.PIPE)
    drain = Drain(proc.stderr, TAIL_BYTES)
    proc.wait()
    got = drain.result()
    total = 40 * MB + 4  # 40 lines of 1 MiB, then "END\n"
    assert got.total == total and len(got.tail) == TAIL_BYTES and got.dropped == total - TAIL_BYTES
    assert got.tail == (b"x" * (MB - 1) + b"\n")[4:] + b"END\n"  # exactly the last MiB
    text = got.text(2)
    assert text.splitlines()[0] == dropped_note(total - TAIL_BYTES, total)
    assert text.endswith("\nEND") and f"the first {total - TAIL_BYTES:,} were dropped" in text


def test_the_ranks_log_keeps_its_head_a_note_of_the_gap_and_the_tail(tmp_path):
    log = tmp_path / "runner.log"
    mb = LOG_BYTES // MB + 8
    proc = subprocess.Popen([sys.executable, "-c", flood_code("stdout", mb)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)
    drain = Drain(proc.stdout, TAIL_BYTES, log=open(log, "wb"))
    proc.wait()
    got = drain.result()
    total = mb * MB + 4
    note = f"\n{gap_note(total - TAIL_BYTES - LOG_BYTES, total)}\n".encode()
    assert got.total == total and log.stat().st_size == LOG_BYTES + len(note) + TAIL_BYTES
    with open(log, "rb") as f:
        f.seek(LOG_BYTES)
        assert f.read(len(note)) == note
        assert f.read().endswith(b"x\nEND\n")


REFUSAL = {"event": "os.system", "arg": "'true'", "rule": "prism:audit-no-process", "origin": "a.py:3"}


def refusal_then_flood(mb: int) -> str:
    """A child that prints a malformed refusal line, the hook's line, then ``mb`` MiB on stderr
    (as a thread of the bundle could while the hook ends the process), then exits as the hook does."""
    line = f"\n{REFUSAL_TAG} {json.dumps(REFUSAL)}\n"
    return (f"import os\nos.write(2, b'{REFUSAL_TAG} not json\\n')\nos.write(2, {line!r}.encode())\n"
            + flood_code("stderr", mb) + f"\nos._exit({AUDIT_EXIT_CODE})\n")


def test_the_hooks_refusal_is_named_whatever_is_printed_after_it(tmp_path):
    jail = Jail("none", str(tmp_path), (), Limits(), 1)
    done = jail.run([sys.executable, "-c", refusal_then_flood(FLOOD_MB)], timeout_s=300)
    assert done.stderr_dropped > FLOOD_MB * MB - TAIL_BYTES and REFUSAL_TAG.encode() not in done.stderr
    assert done.refusal == REFUSAL
    assert done.failure == "audit: the runtime audit hook refused os.system('true') [prism:audit-no-process] at a.py:3"


def test_the_ranks_log_keeps_the_hooks_refusal_that_fell_in_its_gap(tmp_path):
    log = tmp_path / "runner.log"
    mb = LOG_BYTES // MB + 8
    code = flood_code("stdout", LOG_BYTES // MB + 1) + refusal_then_flood(mb).replace("os.write(2", "os.write(1")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    drain = Drain(proc.stdout, TAIL_BYTES, log=open(log, "wb"), watch=refusal_watch())
    proc.wait()
    assert drain.result().dropped > mb * MB
    text = log.read_text()
    assert find_refusal(text) == REFUSAL and text.count(REFUSAL_TAG) == 1  # the malformed one fell in the gap


def test_a_small_output_is_kept_whole_in_the_log(tmp_path):
    log = tmp_path / "runner.log"
    proc = subprocess.Popen([sys.executable, "-c", "print('hello'); import sys; print('err', file=sys.stderr)"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    drain = Drain(proc.stdout, TAIL_BYTES, log=open(log, "wb"))
    proc.wait()
    assert drain.result().dropped == 0 and sorted(log.read_text().split()) == ["err", "hello"]


def test_a_jailed_child_that_floods_both_streams_keeps_its_reply_and_a_clear_tail(tmp_path):
    jail = Jail("none", str(tmp_path), (), Limits(), 1)
    reply = json.dumps({"ok": True, "count": 7}) + "\n"
    done = jail.run([sys.executable, "-c", flood_code("stderr", FLOOD_MB, reply)], input=b"", timeout_s=300)
    assert (done.returncode, done.failure) == (0, None)
    assert json.loads(done.stdout.decode().splitlines()[-1]) == {"ok": True, "count": 7}
    total = FLOOD_MB * MB + 4
    assert (len(done.stderr), done.stderr_dropped, done.stdout_dropped) == (TAIL_BYTES, total - TAIL_BYTES, 0)
    assert done.stderr_tail(1) == f"{dropped_note(total - TAIL_BYTES, total)}\nEND"
    # the reply's own descriptor flooded (a submission that found it): bounded by RESULT_BYTES, last line intact
    flood = jail.run([sys.executable, "-c", flood_code("stdout", RESULT_BYTES // MB + 4, reply)], timeout_s=300)
    assert flood.stdout_dropped == (RESULT_BYTES // MB + 4) * MB + len(reply) - RESULT_BYTES
    assert len(flood.stdout) == RESULT_BYTES and flood.stdout.endswith(reply.encode())


def test_a_failing_childs_message_says_how_much_was_dropped():
    done = Finished(1, b"", b"Traceback\nValueError: boom\n", False, "crash: the process ended (exit status 1)",
                    None, 0, 5_000_000)
    assert done.stderr_tail(1) == f"{dropped_note(5_000_000, 5_000_000 + 27)}\nValueError: boom"


def test_the_parents_peak_memory_stays_flat_while_a_child_prints_300_mb(tmp_path):
    # in a fresh interpreter: its peak RSS after the child printed 300 MB (on stderr) and 70 MB
    # (on stdout) is within twice the caps of its peak before; communicate() kept all of it (370 MB)
    script = textwrap.dedent(f"""
        import resource, sys
        sys.path[:0] = {sys.path!r}
        from prism_challenge.evaluator.isolation import Limits
        from prism_challenge.evaluator.jail import Jail
        code = sys.argv[1]
        jail = Jail("none", {str(tmp_path)!r}, (), Limits(), 1)
        jail.run([sys.executable, "-c", "print(1)"], timeout_s=60)
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        done = jail.run([sys.executable, "-c", code], timeout_s=300)
        after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        print(before, after, done.stderr_dropped + len(done.stderr), done.stdout_dropped + len(done.stdout))
    """)
    code = flood_code("stderr", FLOOD_MB) + "\nfor _ in range(70): os.write(1, b'y' * (%d - 1) + b'\\n')\n" % MB
    out = subprocess.run([sys.executable, "-c", script, code], capture_output=True, text=True, timeout=600, check=True)
    before, after, err_total, out_total = map(int, out.stdout.split())
    assert (err_total, out_total) == (FLOOD_MB * MB + 4, 70 * MB)
    bound = 2 * (TAIL_BYTES + RESULT_BYTES) + 32 * MB  # each stream: its cap and a chunk, then a copy of the tail
    assert (after - before) * 1024 < bound < err_total + out_total


# -- each child's failure message names the bytes dropped -------------------------------------
DROPPED = 5_000_000
CRASHED = Finished(-9, b"", b"Traceback\nValueError: boom\n", False, "crash: the process ended (signal SIGKILL)",
                   None, 0, DROPPED)
NOTE = dropped_note(DROPPED, DROPPED + len(CRASHED.stderr))


class _Jail:
    """A jail whose every child ended as :data:`CRASHED`."""

    hidden: tuple = ()

    def run(self, *args, **kw):
        return CRASHED


def test_the_parameter_childs_failure_names_the_bytes_dropped(tmp_path):
    from prism_challenge.gates.param_parent import measure_parameters

    got = measure_parameters(tmp_path, "architecture", "build_model", vocab_size=257, seq_len=8,
                             max_parameters=10, tokenizer="bytes", jail=_Jail())
    assert got.count is None and got.kind == "crash"
    assert got.error == f"crash: the process ended (signal SIGKILL) without a result: {NOTE} Traceback ValueError: boom"


def test_the_held_out_childs_failure_names_the_bytes_dropped():
    from prism_challenge.audit.heldout import HeldoutError
    from prism_challenge.audit.heldout_parent import _run_child

    with pytest.raises(HeldoutError) as caught:
        _run_child(_Jail(), {}, [np.zeros((1, 2), dtype=np.int64)], b"", time.monotonic() + 60, 60)
    assert str(caught.value) == ("crash: the process ended (signal SIGKILL) and no result\n"
                                 f"{NOTE}\nTraceback\nValueError: boom")


def test_the_audit_childrens_failure_names_the_bytes_dropped():
    from prism_challenge.audit.rescore import AuditError, _reply

    for mode in ("rescore", "blind"):
        with pytest.raises(AuditError) as caught:
            _reply(CRASHED, mode)
        assert str(caught.value) == (f"crash: the process ended (signal SIGKILL) in the {mode} process\n{NOTE}\n"
                                     "Traceback\nValueError: boom")


def test_the_cuda_checks_failure_names_the_bytes_dropped():
    from prism_challenge.evaluator.gpu import CudaCheckError, parse_check

    with pytest.raises(CudaCheckError) as caught:
        parse_check(CRASHED)
    assert str(caught.value) == f"crash: the process ended (signal SIGKILL): {NOTE} ValueError: boom"


def test_a_pipe_past_fd_setsize_is_still_drained(tmp_path):
    # a service holds many descriptors: select() refuses one past 1024, poll() does not
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1200:
        pytest.skip(f"RLIMIT_NOFILE hard limit {hard} < 1200")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1200), hard))
    held = []
    try:
        while not held or held[-1] < 1100:
            held.append(os.open(os.devnull, os.O_RDONLY))
        done = Jail("none", str(tmp_path), (), Limits(), 1).run(
            [sys.executable, "-c", flood_code("stderr", 3, '{"ok": true}\n')], timeout_s=60)
        assert (done.returncode, done.stdout, done.stderr_dropped) == (0, b'{"ok": true}\n', 3 * MB + 4 - TAIL_BYTES)
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_a_log_that_cannot_be_written_does_not_stop_the_drain():
    # a full disk (/dev/full: every write fails with ENOSPC): the child is still drained to its end
    proc = subprocess.Popen([sys.executable, "-c", flood_code("stdout", 40)], stdout=subprocess.PIPE)
    drain = Drain(proc.stdout, TAIL_BYTES, log=open("/dev/full", "wb"))
    assert proc.wait(timeout=120) == 0
    got = drain.result()
    assert drain.log_failed and got.total == 40 * MB and got.dropped == 40 * MB - TAIL_BYTES
