"""Temporary folders go with their process, however it ends (issue 27, "nothing left behind"):
real child processes hold owner folders (tests/scratch_child.py) and are SIGKILLed; the sweep
(:func:`prism_challenge.scratch.sweep`, run by the next process's first temporary folder and by
the dispatcher's reconcile) removes exactly the folders of dead owners, never a live one's; a
real service attempt (``run_job``: a strict-isolation evaluation) SIGKILLed mid-run leaves
nothing in its work dir once the reconcile's sweep ran."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from prism_challenge import scratch
from prism_challenge.service.recovery import sweep_folders

CHILD = Path(__file__).parent / "scratch_child.py"


def hold(*args: str) -> tuple[subprocess.Popen, Path]:
    """Start tests/scratch_child.py with ``args``; the child and the folder it made (its first line)."""
    proc = subprocess.Popen([sys.executable, str(CHILD), *args], stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline().strip()
    assert line, f"the child made no folder (exit status {proc.poll()})"
    return proc, Path(line)


def kill(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    proc.stdout.close()
    assert proc.returncode == -signal.SIGKILL


def test_a_sigkilled_processs_folder_is_swept_by_the_next_process_and_a_live_ones_is_kept():
    first, folder = hold("own")
    owner = folder.parent
    assert owner.parent == Path(tempfile.gettempdir()) and owner.name.startswith(f"{scratch.RUN_PREFIX}{first.pid}-")
    assert (owner / scratch.LOCK_NAME).read_text() == f"{first.pid}\n" and folder.is_dir()
    second, other = hold("own")
    try:
        assert scratch.sweep(tempfile.gettempdir(), scratch.RUN_PREFIX) == []  # both owners live: nothing removed
        assert folder.is_dir() and other.is_dir()
        kill(first)
        assert folder.is_dir()  # SIGKILL ran no clean-up: the folder outlived its process
        third, _ = hold("own")  # the next process's first temporary folder sweeps the dead one's
        try:
            assert not owner.exists()
            assert other.is_dir()  # the live one's is untouched
        finally:
            kill(third)
    finally:
        kill(second)
    assert sorted(scratch.sweep(tempfile.gettempdir(), scratch.RUN_PREFIX)) == sorted([other.parent, _.parent])
    assert not other.parent.exists()


def test_a_killed_attempts_folder_is_removed_by_the_reconciles_sweep_and_a_live_attempts_is_not(tmp_path):
    work = tmp_path / "work"
    live, live_folder = hold("attempt", str(work), "a" * 32)
    dead, dead_folder = hold("attempt", str(work), "b" * 32)
    try:
        assert live_folder.parent == work / ("a" * 32) and dead_folder.parent == work / ("b" * 32)
        assert sweep_folders(str(work)) == []
        kill(dead)
        assert sweep_folders(str(work)) == [str(work / ("b" * 32))]
        assert sorted(os.listdir(work)) == ["a" * 32] and live_folder.is_dir()
        with pytest.raises(scratch.ScratchError, match="a live owner holds it"):  # the same attempt twice
            with scratch.attempt(work, "a" * 32):
                pass
        assert live_folder.is_dir()
    finally:
        kill(live)
    assert sweep_folders(str(work)) == [str(work / ("a" * 32))] and os.listdir(work) == []


def test_an_attempt_ending_normally_removes_its_folder_and_read_only_copies_in_it(tmp_path):
    before = scratch.own()  # made before the attempt: it stays
    with scratch.attempt(tmp_path, "c" * 32) as owned:
        inner = scratch.mkdtemp("prism-bundle-")  # the attempt is current: folders go in it
        assert inner.parent == tmp_path / ("c" * 32) and scratch.root() == owned.path
        (inner / "f.py").write_text("x = 1\n")
        (inner / "f.py").chmod(0o444)
        inner.chmod(0o555)  # as a frozen bundle copy is
    assert os.listdir(tmp_path) == []
    assert scratch.root() == before.path and before.path.is_dir()  # the process's own folder is current again


def test_an_attempt_that_made_its_process_own_folder_removes_it_too(tmp_path):
    """A Ray actor's attempt whose feeder socket went to the process's own folder: an actor is
    killed once its result is read, so its own folder goes with the attempt."""
    done = subprocess.run([sys.executable, str(CHILD), "attempt-own", str(tmp_path / "work"), "f" * 32],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    own, after = done.stdout.split()
    assert Path(own).parent.name.startswith(scratch.RUN_PREFIX) and after == "gone"
    assert not Path(own).parent.exists() and os.listdir(tmp_path / "work") == []


def test_concurrent_sweeps_never_remove_a_live_folder(tmp_path):
    """Makers and sweepers race on one base: every maker finds its folder (and its own file in
    it) until it closes it; every folder a sweep removed was already closed."""
    stop, errors, live = threading.Event(), [], set()

    def make(i: int) -> None:
        n = 0
        while not stop.is_set():
            owned = scratch.create(tmp_path, f"m{i}-{n}")
            live.add(owned.path)
            (owned.path / "x").write_text("1")
            time.sleep(0.001)
            if not (owned.path / "x").is_file():
                errors.append(f"{owned.path} was removed while live")
            live.discard(owned.path)
            owned.close()
            n += 1

    def sweep() -> None:
        while not stop.is_set():
            for path in scratch.sweep(tmp_path):
                if path in live:
                    errors.append(f"the sweep removed live {path}")

    threads = [threading.Thread(target=make, args=(i,)) for i in range(3)] + \
              [threading.Thread(target=sweep) for _ in range(2)]
    for t in threads:
        t.start()
    time.sleep(2.0)
    stop.set()
    for t in threads:
        t.join()
    assert errors == []
    assert os.listdir(tmp_path) == []


def test_a_killed_builders_staging_folder_goes_at_the_next_build_and_a_finished_one_leaves_only_its_result(tmp_path):
    cache = tmp_path / "cache"
    cache.mkdir()
    live, live_build = hold("stage", str(cache), "train-bytes")
    dead, dead_build = hold("stage", str(cache), "train-bytes")
    try:
        assert live_build.parent.parent == cache and live_build.parent.name.startswith(".train-bytes.tmp-")
        kill(dead)
        with scratch.staging(cache, "train-bytes") as build:  # the next build: the dead one's folder goes
            assert sorted(p.name for p in cache.iterdir()) == sorted([live_build.parent.name, build.parent.name])
            (build / "ids.npy").write_bytes(b"a whole cache")
            os.rename(build, cache / "train-bytes")  # published as prepare and the token cache do
        assert sorted(p.name for p in cache.iterdir()) == sorted([live_build.parent.name, "train-bytes"])
        assert (cache / "train-bytes" / "ids.npy").read_bytes() == b"a whole cache" and live_build.is_dir()
        assert not dead_build.exists()
    finally:
        kill(live)


def test_an_owner_folder_is_made_only_in_a_base_of_this_user(tmp_path):
    (tmp_path / "link").symlink_to(tmp_path)
    with pytest.raises(scratch.ScratchError, match="not a directory of this user"):
        scratch.create(tmp_path / "link", "x")
    stale = tmp_path / f"{scratch.NEW_PREFIX}abc"  # a maker that died before its lock file existed
    stale.mkdir()
    os.utime(stale, (time.time() - 2 * scratch.NEW_STALE_S,) * 2)
    young = tmp_path / f"{scratch.NEW_PREFIX}def"  # one that may be making it now
    young.mkdir()
    other = tmp_path / "not-an-owner"
    other.mkdir()
    assert scratch.sweep(tmp_path) == [stale]
    assert sorted(os.listdir(tmp_path)) == sorted([young.name, other.name, "link"])


@pytest.mark.slow
def test_a_service_attempt_sigkilled_mid_run_leaves_nothing_after_the_reconciles_sweep(tmp_path):
    """A real attempt (run_job: extraction, frozen copy, strict-isolation training) in a child
    process, SIGKILLed once its run directory holds the feeder's files; then the sweep that the
    dispatcher's reconcile runs. A second attempt on the same work dir, run to its end, leaves
    nothing either."""
    from fleet_fixtures import PROFILE_TOML, fixture_data, trivial_bundle

    from prism_challenge.manifest.certificate import create_key_file
    from prism_challenge.service.settings import SIGNING_KEY_ENV

    data = fixture_data(tmp_path / "fixture")
    (tmp_path / "fleet-test.toml").write_text(PROFILE_TOML)
    _, zipped = trivial_bundle(tmp_path / "bundle")
    (tmp_path / "bundle.zip").write_bytes(zipped)
    create_key_file(tmp_path / "key" / "signing-key.pem")  # the operator's key, as the service names it
    env = {**os.environ, SIGNING_KEY_ENV: str(tmp_path / "key" / "signing-key.pem")}
    work = tmp_path / "work"
    args = [str(work), str(tmp_path / "fleet-test.toml"), str(data), str(tmp_path / "bundle.zip")]
    proc = subprocess.Popen([sys.executable, str(CHILD), "job", *args, "d" * 32], stdout=subprocess.PIPE, text=True,
                            env=env)
    try:
        deadline = time.monotonic() + 240
        while not list(work.glob(f"{'d' * 32}/prism-eval-*/run/*")) or not list(work.glob(f"{'d' * 32}/prism-bundle-*")):
            assert proc.poll() is None and time.monotonic() < deadline, "the run never started"
            time.sleep(0.1)
        held = {p.name.split("-")[1] for p in (work / ("d" * 32)).iterdir() if not p.name.startswith(".")}
        assert {"bundle", "eval"} <= held  # the frozen copy and the run's folder, both in the attempt's
    finally:
        kill(proc)
    assert (work / ("d" * 32)).is_dir()
    swept = sweep_folders(str(work))  # the attempt's, and the child's own (a feeder socket too long for tmp_path)
    assert str(work / ("d" * 32)) in swept
    assert all(Path(p).name.startswith(f"{scratch.RUN_PREFIX}{proc.pid}-") for p in swept if Path(p).parent != work)
    assert os.listdir(work) == []
    done = subprocess.run([sys.executable, str(CHILD), "job", *args, "e" * 32], capture_output=True, text=True,
                          timeout=600, env=env)
    assert done.stdout.strip() == "scored", done.stderr[-2000:]
    assert os.listdir(work) == []
