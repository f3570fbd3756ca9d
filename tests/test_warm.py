"""The pool of warm ranks (evaluator/warm.py) with stand-ins for torchrun and the rank.

A fake torchrun spawns one stub per rank (``claim()``, then exit 42 when it runs cold); a fake
warm process records the environment it was handed and ends as the test plan says. No torch.
"""

import json
import signal
import sys
import textwrap
import time

import pytest

from prism_challenge.evaluator import warm
from prism_challenge.evaluator.warm import ENV_WARM_SOCKET, Pool, claim, exit_status

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="abstract Unix sockets and PR_SET_PDEATHSIG are Linux")

COLD = 42  # a stub that ran its rank itself exits with this

FAKE_WARM = textwrap.dedent("""
    import json, os, signal, sys
    from prism_challenge.evaluator.warm import wait_for_claim
    env = wait_for_claim(int(sys.argv[-1]))
    out = os.environ["OUT_DIR"]
    with open(os.path.join(out, "warm-%s.json" % env["RANK"]), "w") as f:
        json.dump({"env": env, "pid": os.getpid()}, f)
    kind, _, value = env.get("ACTION", "exit:0").partition(":")
    if kind == "exit":
        os._exit(int(value))
    if kind == "signal":
        os.kill(os.getpid(), int(value))
    signal.pause()  # "wait": until a signal ends it
""")

STUB = ("import sys; from prism_challenge.evaluator.warm import claim; claim(); "
        f"print('cold', flush=True); sys.exit({COLD})")

FAKE_TORCHRUN = textwrap.dedent(f"""
    import json, os, signal, subprocess, sys, time
    out, plan, code = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
    stub = [sys.executable, "-c", {STUB!r}]
    procs, result = [], {{}}
    for rank, action in enumerate(plan):
        env = {{**os.environ, "RANK": str(rank), "ACTION": action}}
        if action == "grandchild":  # not torchrun's own child: the pool must refuse its claim
            procs.append(subprocess.Popen([sys.executable, "-c",
                "import subprocess, sys; sys.exit(subprocess.call(sys.argv[1:]))", *stub], env=env))
        else:
            procs.append(subprocess.Popen(stub, env=env))
    def warm_pid(rank):
        path = os.path.join(out, "warm-%d.json" % rank)
        for _ in range(500):
            if os.path.exists(path):
                try:
                    return json.load(open(path))["pid"]
                except ValueError:
                    pass
            time.sleep(0.01)
    def gone(pid):
        for _ in range(500):
            try:
                with open("/proc/%d/stat" % pid) as f:
                    if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                        return True
            except OSError:
                return True
            time.sleep(0.01)
        return False
    for rank, (action, p) in enumerate(zip(plan, procs)):
        if action in ("term", "kill"):
            pid = warm_pid(rank)
            os.kill(p.pid, signal.SIGTERM if action == "term" else signal.SIGKILL)
            if action == "kill":
                p.wait()
                result["warm_gone_%d" % rank] = gone(pid)
    result["returncodes"] = [p.wait() for p in procs]
    with open(os.path.join(out, "torchrun.json"), "w") as f:
        json.dump(result, f)
    sys.exit(code)
""")


def run_pool(tmp_path, plan, nwarm=None, code=0, monkeypatch=None):
    """Run a pool of ``nwarm`` fake warm processes under the fake torchrun; (pool rc, result, warm records)."""
    (tmp_path / "warm.py").write_text(FAKE_WARM)
    (tmp_path / "torchrun.py").write_text(FAKE_TORCHRUN)
    monkeypatch.setenv("OUT_DIR", str(tmp_path))
    pool = Pool(len(plan) if nwarm is None else nwarm,
                [sys.executable, str(tmp_path / "torchrun.py"), str(tmp_path), json.dumps(plan), str(code)],
                warm_argv=[sys.executable, str(tmp_path / "warm.py")])
    rc = pool.serve()
    result = json.loads((tmp_path / "torchrun.json").read_text())
    records = {int(p.stem.split("-")[1]): json.loads(p.read_text()) for p in tmp_path.glob("warm-*.json")}
    return rc, result, records, pool


def test_each_rank_runs_in_a_warm_process_with_the_workers_environment(tmp_path, monkeypatch):
    rc, result, records, pool = run_pool(tmp_path, ["exit:0", "exit:3"], code=5, monkeypatch=monkeypatch)
    assert rc == 5  # the pool ends as torchrun ended
    assert result["returncodes"] == [0, 3]  # each stub ends with its warm process's exit code
    assert sorted(records) == [0, 1]
    for rank, rec in records.items():
        env = rec["env"]
        assert env["RANK"] == str(rank) and env["ACTION"] == ["exit:0", "exit:3"][rank]
        assert ENV_WARM_SOCKET not in env  # the claim hands over the worker's env, less the pool's name
        assert env["OUT_DIR"] == str(tmp_path)
    assert {rec["pid"] for rec in records.values()} == {w.proc.pid for w in pool.warm}
    assert all(w.proc.returncode is not None for w in pool.warm)


def test_a_warm_process_killed_by_a_signal_kills_its_stub_with_the_same_signal(tmp_path, monkeypatch):
    _, result, _, _ = run_pool(tmp_path, [f"signal:{int(signal.SIGKILL)}", f"signal:{int(signal.SIGSEGV)}"],
                               monkeypatch=monkeypatch)
    assert result["returncodes"] == [-signal.SIGKILL, -signal.SIGSEGV]


def test_sigterm_to_the_stub_reaches_the_warm_process(tmp_path, monkeypatch):
    # torchrun stops its workers with SIGTERM when another rank failed
    _, result, records, _ = run_pool(tmp_path, ["term"], monkeypatch=monkeypatch)
    assert records[0]["env"]["ACTION"] == "term"
    assert result["returncodes"] == [-signal.SIGTERM]


def test_a_stub_that_dies_takes_its_warm_process_with_it(tmp_path, monkeypatch):
    _, result, records, _ = run_pool(tmp_path, ["kill"], monkeypatch=monkeypatch)
    assert 0 in records  # it was claimed and waiting
    assert result["returncodes"] == [-signal.SIGKILL]
    assert result["warm_gone_0"] is True  # killed while torchrun still ran, not only at the pool's end


def test_a_claim_from_a_process_that_is_not_torchruns_worker_is_refused(tmp_path, monkeypatch):
    # rank 1 is a grandchild of torchrun (what a submission's own process would be): it runs cold,
    # and the warm process it could have taken goes to rank 2
    rc, result, records, _ = run_pool(tmp_path, ["exit:0", "grandchild", "exit:7"], nwarm=2, monkeypatch=monkeypatch)
    assert rc == 0
    assert sorted(records) == [0, 2]
    assert result["returncodes"] == [0, COLD, 7]


def test_claims_past_the_warm_processes_run_cold(tmp_path, monkeypatch):
    _, result, records, _ = run_pool(tmp_path, ["exit:5", "exit:5"], nwarm=1, monkeypatch=monkeypatch)
    assert len(records) == 1
    assert sorted(result["returncodes"]) == [5, COLD]


def test_claim_returns_at_once_without_a_pool(monkeypatch):
    monkeypatch.delenv(ENV_WARM_SOCKET, raising=False)
    t0 = time.monotonic()
    assert claim() is None
    assert claim({ENV_WARM_SOCKET: "prism-warm-no-such-pool"}) is None  # nobody listens: cold
    assert time.monotonic() - t0 < 5


def test_exit_status_names_codes_and_signals():
    assert exit_status(0) == {"exit": 0}
    assert exit_status(3) == {"exit": 3}
    assert exit_status(-9) == {"signal": 9}


def test_a_warm_process_ends_quietly_when_the_pool_closes_before_a_claim():
    a, b = warm.socket.socketpair()
    a.close()
    with pytest.raises(warm.WarmError, match="closed before"):
        warm.wait_for_claim(b.detach())


def test_the_pool_command_line_is_checked(capsys):
    with pytest.raises(SystemExit) as e:
        warm.main(["x", "--", "torchrun"])
    assert e.value.code == 2
    assert "usage" in capsys.readouterr().err
