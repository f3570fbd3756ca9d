"""The agent of a one-rank run (evaluator/single.py): torchrun's worker environment, the rank's
end as torchrun's exit status, signals forwarded, and the rank's death with the agent. The rank
is a stand-in (``--`` argv); the environment is compared with what the real torchrun gives its
worker at ``--nproc-per-node=1``."""

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from prism_challenge.evaluator import launcher, single

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="PR_SET_PDEATHSIG is Linux")

# a stand-in rank: writes its environment and pid to OUT, then does what ACTION says
# (SIGQUIT at its default action, which a shell's background job inherits as ignored, and no core file)
FAKE_RANK = ("import json, os, resource, signal, sys, time\n"
             "signal.signal(signal.SIGQUIT, signal.SIG_DFL)\n"
             "resource.setrlimit(resource.RLIMIT_CORE, (0, 0))\n"
             "json.dump({'env': dict(os.environ), 'pid': os.getpid()}, open(os.environ['OUT'] + '.tmp', 'w'))\n"
             "os.rename(os.environ['OUT'] + '.tmp', os.environ['OUT'])\n"
             "kind, _, value = os.environ['ACTION'].partition(':')\n"
             "if kind == 'exit': os._exit(int(value))\n"
             "if kind == 'signal': os.kill(os.getpid(), int(value))\n"
             "if kind == 'ignore': signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
             "else: signal.signal(signal.SIGTERM, lambda *a: os._exit(115))\n"
             "time.sleep(120)\n")
# the agent with a stop grace of GRACE seconds (30 in the module)
AGENT = "import sys; import prism_challenge.evaluator.single as s; s.STOP_GRACE_S = float(sys.argv[1]); s.main(sys.argv[2:])"


def _agent(tmp_path, action: str, grace: float = 30.0) -> tuple[subprocess.Popen, str]:
    out = str(tmp_path / "rank.json")
    proc = subprocess.Popen([sys.executable, "-c", AGENT, str(grace), "--", sys.executable, "-c", FAKE_RANK],
                            env={**os.environ, "OUT": out, "ACTION": action}, stderr=subprocess.PIPE, text=True)
    return proc, out


def _rank(out: str, timeout: float = 60.0) -> dict:
    t0 = time.monotonic()
    while not os.path.exists(out):
        assert time.monotonic() - t0 < timeout, "the rank never started"
        time.sleep(0.02)
    return json.load(open(out))


@pytest.mark.parametrize("action,code,line", [
    ("exit:0", 0, None),
    ("exit:3", 1, f"{single.FAILED} (exitcode: 3)"),
    ("signal:9", 1, f"{single.FAILED} (signal: 9)"),  # a rank that dies on SIGKILL: torchrun's 1, not a kill
])
def test_the_agent_exits_as_torchrun_does(tmp_path, action, code, line):
    proc, out = _agent(tmp_path, action)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == code
    assert (err.strip() or None) == line
    assert _rank(out)["env"]["ACTION"] == action


def test_a_stop_is_forwarded_to_the_rank(tmp_path):
    proc, out = _agent(tmp_path, "wait")
    _rank(out)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert (proc.returncode, err.strip()) == (1, f"{single.FAILED} (exitcode: 115)")  # the rank's own handler ran


def test_an_outside_sigquit_ends_the_agent_with_1_as_torchrun(tmp_path):
    # torchrun's agent handles SIGQUIT (TORCHELASTIC_SIGNALS_TO_HANDLE) and exits 1: not a kill from outside
    proc, out = _agent(tmp_path, "wait")
    _rank(out)
    proc.send_signal(signal.SIGQUIT)
    _, err = proc.communicate(timeout=60)
    assert (proc.returncode, err.strip()) == (1, f"{single.FAILED} (signal: {int(signal.SIGQUIT)})")


def test_a_rank_that_ignores_the_stop_is_killed_after_the_grace(tmp_path):
    proc, out = _agent(tmp_path, "ignore", grace=1.0)
    _rank(out)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert (proc.returncode, err.strip()) == (1, f"{single.FAILED} (signal: 9)")
    assert 1.0 <= time.monotonic() - t0 < 30.0  # the test's grace, not the module's


def test_the_rank_can_host_its_store_on_the_port_the_agent_holds():
    held = single.reserve_port()
    port = held.getsockname()[1]
    try:
        with socket.socket() as other, pytest.raises(OSError):  # one that binds without SO_REUSEADDR is refused
            other.bind((single.RENDEZVOUS_ADDR, port))
        store = torch_store(port)  # c10d's TCPStore (SO_REUSEADDR) binds and listens there
        store.set("k", "v")
        assert store.get("k") == b"v"
    finally:
        held.close()


def torch_store(port: int):
    import datetime

    import torch.distributed as dist

    return dist.TCPStore(single.RENDEZVOUS_ADDR, port, 1, True, timeout=datetime.timedelta(seconds=30))


def test_the_rank_dies_with_the_agent(tmp_path):
    proc, out = _agent(tmp_path, "wait")
    pid = _rank(out)["pid"]
    proc.kill()
    proc.wait()
    t0 = time.monotonic()
    while time.monotonic() - t0 < 30:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        with open(f"/proc/{pid}/stat") as f:  # a zombie waits for its reaper: it is dead
            if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                return
        time.sleep(0.05)
    raise AssertionError("the rank outlived its agent")


TORCHRUN_WORKER = "import json, os, sys; json.dump(dict(os.environ), open(sys.argv[1], 'w'))"


def test_the_rank_gets_torchruns_worker_environment(tmp_path):
    # the real torchrun (the launcher's own argv, --nproc-per-node=1) runs a worker that dumps its environment
    script = tmp_path / "worker.py"
    script.write_text(TORCHRUN_WORKER)
    argv = launcher.torchrun_command(1)
    argv = [*argv[:argv.index("-m", 3)], str(script), str(tmp_path / "torchrun.json")]
    base = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC", "MASTER_", "RANK", "WORLD"))}
    base["TMPDIR"] = str(tmp_path)  # torchrun's log folder (torchelastic_*), which it leaves: the sandbox's /tmp in a run
    subprocess.run(argv, env=base, check=True, timeout=120, capture_output=True)
    theirs = json.load(open(tmp_path / "torchrun.json"))
    ours = single.worker_env(base, master_port=12345)
    added = lambda env: {k: v for k, v in env.items() if k not in base}  # noqa: E731
    # torchrun adds its worker's error file, its own store's port and name, and pidfd/log plumbing of its own
    torchrun_only = {"TORCHELASTIC_ERROR_FILE", "TORCH_ELASTIC_WORKER_IDENTIFIER", "TORCHELASTIC_ENABLE_FILE_TIMER",
                     "TORCHELASTIC_TIMER_FILE"}
    assert set(added(theirs)) - torchrun_only == set(added(ours))
    differ = {k for k in added(ours) if added(ours)[k] != theirs[k]}
    assert differ == {"MASTER_PORT", "TORCHELASTIC_USE_AGENT_STORE"}  # the agent's store: torchrun's, none here
    assert theirs["TORCHELASTIC_USE_AGENT_STORE"] == "True" and ours["TORCHELASTIC_USE_AGENT_STORE"] == "False"
