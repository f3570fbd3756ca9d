"""The one launcher (evaluator/jail.py): its environment policy, memory ceiling, failure
diagnosis and deadline, and the same jail for a bounded child as for torchrun."""

from __future__ import annotations

import os
import sys
import time

import pytest

from prism_challenge.evaluator import isolation
from prism_challenge.evaluator.audit import AUDIT_EXIT_CODE, ENV_OFF, REFUSAL_TAG
from prism_challenge.evaluator.isolation import Limits
from prism_challenge.evaluator.jail import (
    MAX_ADDRESS_SPACE,
    Jail,
    child_env,
    default_memory_limit,
    diagnose,
)
from prism_challenge.evaluator.memcgroup import MemoryCgroup, host_memory_bytes


def test_the_memory_limit_is_never_above_the_hosts_memory():
    with open("/proc/meminfo") as f:
        total = int(next(line for line in f if line.startswith("MemTotal:")).split()[1]) * 1024
    assert host_memory_bytes() == total
    assert default_memory_limit() == min(MAX_ADDRESS_SPACE, total)


def test_the_environment_is_an_allow_list_plus_the_compute_settings(monkeypatch):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "k")
    monkeypatch.setenv("PRISM_AUDIT_HOOKS", "off")  # only the jail itself may set this
    monkeypatch.setenv("LANG", "C.UTF-8")
    env = child_env(3)
    assert "AWS_SECRET_ACCESS_KEY" not in env and ENV_OFF not in env
    assert env["LANG"] == "C.UTF-8" and env["HOME"] == "/tmp"
    assert (env["OMP_NUM_THREADS"], env["TORCHINDUCTOR_COMPILE_THREADS"], env["PYTHONDONTWRITEBYTECODE"]) == ("3", "1", "1")
    assert env["PYTHONPATH"].split(os.pathsep)[0].endswith("src")


@pytest.mark.parametrize(
    ("code", "output", "kind"),
    [
        (AUDIT_EXIT_CODE, f'x\n{REFUSAL_TAG} {{"event": "os.system", "arg": "\'true\'", "rule": "prism:audit-no-process", '
                          '"origin": "a.py:3"}\n', "audit: the runtime audit hook refused os.system('true') "
                                                   "[prism:audit-no-process] at a.py:3"),
        (1, "RuntimeError: DefaultCPUAllocator: can't allocate memory: you tried to allocate 1 bytes",
         "memory: the process ran out of its memory limit of 4,096 bytes (exit status 1)"),
        (-6, "libgomp: Thread creation failed: Resource temporarily unavailable",
         "tasks: the process could not start a thread or process: the task limit of 64 was reached (signal SIGABRT)"),
        (-11, "Segmentation fault", "crash: the process ended (signal SIGSEGV)"),
    ],
)
def test_diagnose_names_the_cause(code, output, kind):
    got, refusal = diagnose(code, output, Limits(address_space_bytes=4096, max_processes=64))
    assert got == kind
    assert (refusal is not None) == kind.startswith("audit:")


def test_no_cgroup_v2_means_the_rlimit_holds_memory():
    v2 = os.path.isfile("/sys/fs/cgroup/cgroup.controllers")
    group = MemoryCgroup.create(1 << 30)
    if not v2:
        assert group is None
    elif group is not None:  # a cgroup v2 host that delegates memory to PRISM
        try:
            assert (group.path / "memory.max").read_text().strip() == str(1 << 30)
        finally:
            group.remove()


def test_a_bounded_child_is_killed_at_its_deadline_with_its_group(tmp_path):
    jail = Jail("none", str(tmp_path), (), Limits(), 1)
    marker = tmp_path / "grandchild.pid"
    code = (f"import os, subprocess, sys, time\np = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
            f"open({str(marker)!r}, 'w').write(str(p.pid))\ntime.sleep(60)")
    t0 = time.monotonic()
    done = jail.run([sys.executable, "-c", code], timeout_s=3)
    assert done.timed_out and done.failure == "timeout: no result within 3 s"
    assert time.monotonic() - t0 < 30
    pid = int(marker.read_text())
    for _ in range(100):  # the grandchild was in the killed group
        if not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split()[2] == "Z":
            break
        time.sleep(0.05)
    else:
        pytest.fail("the grandchild outlived the group kill")


def test_a_started_child_waits_for_its_input_and_an_abandoned_one_is_killed_and_reaped(tmp_path):
    # start() then finish(): the child ran only up to its stdin read until it was fed; its
    # deadline counts from finish(); abandon() kills a child never fed
    jail = Jail("none", str(tmp_path), (), Limits(), 1)
    marker = tmp_path / "before-input"
    code = (f"import sys\nopen({str(marker)!r}, 'w').write('up')\ndata = sys.stdin.buffer.read()\n"
            f"sys.stdout.write(str(len(data)) + ' ' + data[:5].decode())")
    child = jail.start([sys.executable, "-c", code])
    for _ in range(200):
        if marker.exists():
            break
        time.sleep(0.05)
    assert marker.read_text() == "up" and child.proc.poll() is None  # up, and waiting on stdin
    time.sleep(0.5)
    done = jail.finish(child, input=b"hello world", timeout_s=30)
    assert (done.returncode, done.stdout, done.timed_out, done.failure) == (0, b"11 hello", False, None)
    waiting = jail.start([sys.executable, "-c", "import sys; sys.stdin.read()"])
    jail.abandon(waiting)
    assert waiting.proc.returncode == -9 and jail.cgroups == []
    slow = jail.start([sys.executable, "-c", "import sys, time; sys.stdin.read(); time.sleep(60)"])
    t0 = time.monotonic()
    assert jail.finish(slow, input=b"", timeout_s=1).timed_out and time.monotonic() - t0 < 20


def test_a_spare_is_fed_by_the_next_matching_run_and_close_ends_an_unused_one(tmp_path):
    jail = Jail("none", str(tmp_path), (), Limits(), 1)
    code = "import os, sys; sys.stdin.buffer.read(); sys.stdout.write(str(os.getpid()))"
    jail.warm([sys.executable, "-c", code], writable=[str(tmp_path)])
    (spare,) = jail._spares.values()
    other = jail.run([sys.executable, "-c", code], input=b"", timeout_s=30)  # another key: a new child
    assert int(other.stdout) != spare.proc.pid and jail._spares
    fed = jail.run([sys.executable, "-c", code], input=b"", timeout_s=30, writable=[str(tmp_path)], warm_next=True)
    assert int(fed.stdout) == spare.proc.pid  # the spare ran, and the next one is warming
    (unused,) = jail._spares.values()
    assert unused.proc.pid != spare.proc.pid and unused.proc.poll() is None
    jail.close()
    assert unused.proc.returncode == -9 and not jail._spares
    folder = tmp_path / "art"
    folder.mkdir()
    jail.warm([sys.executable, "-c", code], writable=[str(folder)])
    (stale,) = jail._spares.values()
    folder.rename(tmp_path / "art.aside")  # as auditstage.empty_artifacts does: another folder, same path
    folder.mkdir()
    fresh = jail.run([sys.executable, "-c", code], input=b"", timeout_s=30, writable=[str(folder)])
    assert int(fresh.stdout) != stale.proc.pid and stale.proc.returncode == -9  # the stale spare: killed, not fed


@pytest.mark.skipif(isolation.available_backend() is None, reason="no working sandbox backend")
def test_a_strict_child_sees_no_network_and_not_the_parents_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("PRISM_TEST_PARENT_SECRET", "s3cret")
    jail = Jail.open("strict", bundle_dir=tmp_path, hidden=[], limits=Limits(), threads=1)
    code = "import os, socket; print(os.environ.get('PRISM_TEST_PARENT_SECRET'), sorted(socket.if_nameindex()))"
    done = jail.run([sys.executable, "-S", "-c", code], timeout_s=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.decode().strip() == "None [(1, 'lo')]"


@pytest.mark.skipif(isolation.available_backend() is None, reason="no working sandbox backend")
def test_a_folder_a_strict_child_grew_reaches_the_next_child_new_and_a_spare_on_it_is_not_fed(tmp_path):
    """The directory-size channel (freshdir): a child makes and deletes 600 entries in its folder,
    which leaves the folder's size grown on ext4; after ``empty_folders`` the next child reads a
    new folder's size, and a spare started on the grown folder is killed, not fed."""
    from prism_challenge.evaluator.freshdir import empty_folders

    folder = tmp_path / "art"
    folder.mkdir()
    probe = tmp_path / "probe"
    probe.mkdir()
    fresh = probe.stat().st_size
    probe.rmdir()
    (tmp_path / "bundle").mkdir()  # bound read-only: not above the folder
    jail = Jail.open("strict", bundle_dir=tmp_path / "bundle", hidden=[], limits=Limits(), threads=1)
    grow = ("import os, sys; d = sys.argv[1]\n"
            "for i in range(600): open(os.path.join(d, f'{i:04d}' + 'n' * 80), 'w').close()\n"
            "for n in os.listdir(d): os.unlink(os.path.join(d, n))\n"
            "print(os.stat(d).st_size)")
    grown = jail.run([sys.executable, "-S", "-c", grow, str(folder)], timeout_s=60, writable=[str(folder)])
    assert grown.returncode == 0, grown.stderr
    if int(grown.stdout) == fresh:
        pytest.skip("this filesystem shrinks an emptied directory")
    mark = tmp_path / "mark"
    mark.mkdir()
    read = ("import os, sys; open(os.path.join(sys.argv[2], 'up'), 'w').close(); sys.stdin.buffer.read(); "
            "print(os.getpid(), os.stat(sys.argv[1]).st_size)")
    argv, writable = [sys.executable, "-S", "-c", read, str(folder), str(mark)], [str(folder), str(mark)]
    jail.warm(argv, writable=writable)
    (stale,) = jail._spares.values()
    for _ in range(600):  # the spare is up: the sandbox bound the grown folder
        if (mark / "up").exists():
            break
        time.sleep(0.05)
    assert (mark / "up").exists() and stale.proc.poll() is None
    empty_folders([folder])
    done = jail.run(argv, input=b"", timeout_s=60, writable=writable)
    jail.close()
    assert done.returncode == 0, done.stderr
    assert int(done.stdout.split()[1]) == fresh and stale.proc.returncode == -9
