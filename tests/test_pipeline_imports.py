"""The launch comes before the parent's ``import torch`` (issue 28: a researcher's small-run wait).

``prism eval`` used to import torch (about a second of CPU, more on a busy machine) before it
launched the ranks, which then imported their own: the two imports ran one after the other. Now
the parent launches first, from modules that import no torch, and imports torch while the ranks
start. A rank that connects before the feeder exists waits in the listening socket's backlog.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading

import numpy as np
import pytest

from prism_challenge.evaluator import protocol
from prism_challenge.evaluator.feeder import Feeder
from prism_challenge.evaluator.protocol import Kind

from helpers import EXAMPLE, chunks_of

LIGHT = ("prism_challenge.pipeline", "prism_challenge.pipeline.start", "prism_challenge.pipeline.context",
         "prism_challenge.api", "prism_challenge.cli")

AT_LAUNCH = """
import json, sys, tempfile
from pathlib import Path
from prism_challenge.evaluator import launcher
from prism_challenge.evaluator.protocol import ENV_SOCKET, ENV_TOKEN
from prism_challenge.pipeline import EvalOptions, evaluate

seen = {}
def launch(nproc, env, *args, **kwargs):
    seen["torch"] = "torch" in sys.modules
    seen["feeder"] = "prism_challenge.evaluator.feeder" in sys.modules
    import socket
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(env[ENV_SOCKET])  # the socket already listens: a rank that starts now can connect
    s.close()
    seen["token"] = len(env[ENV_TOKEN])
    raise RuntimeError("stopped at the launch")

launcher.launch = launch
out = Path(sys.argv[1]) / "run"
try:
    evaluate(EvalOptions(bundle=sys.argv[2], isolation="none", out_dir=str(out), token_budget=2000, device="cpu"))
except RuntimeError as exc:
    seen["error"] = str(exc)
seen["run_dir_left"] = out.exists()
print(json.dumps(seen))
"""


def _python(code: str, *args: str) -> str:
    done = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip().splitlines()[-1]


def test_the_modules_before_the_launch_import_no_torch():
    code = "import sys, json\n" + "".join(f"import {m}\n" for m in LIGHT) + \
        "print(json.dumps(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.'))))"
    assert json.loads(_python(code)) == []


def test_the_ranks_are_launched_before_the_parent_imports_torch(tmp_path):
    seen = json.loads(_python(AT_LAUNCH, str(tmp_path), str(EXAMPLE)))
    assert seen == {"torch": False, "feeder": False, "token": 32, "error": "stopped at the launch",
                    "run_dir_left": False}  # a failed launch is undone: no run directory stays


AUTO_WITHOUT_GPU = """
import json, sys
import prism_challenge.pipeline as pipeline
pipeline.GPU_DEVICE_NODES = ("/nonexistent/nvidiactl",)  # a host with no GPU device node
print(json.dumps([pipeline._resolve_device("auto"), "torch" in sys.modules]))
"""


def test_auto_on_a_host_without_a_gpu_device_node_is_cpu_without_torch():
    assert json.loads(_python(AUTO_WITHOUT_GPU)) == ["cpu", False]


BROKEN_STREAM = """
import json, os, subprocess, sys, time
from pathlib import Path
sys.modules["prism_challenge.pipeline.stream"] = None  # its import fails (a broken install)
from prism_challenge.pipeline import EvalOptions, evaluate
out = Path(sys.argv[1]) / "run"
seen = {}
try:
    evaluate(EvalOptions(bundle=sys.argv[2], isolation="none", out_dir=str(out), token_budget=2000,
                         device="cpu", heldout_bytes=0))
except ImportError as exc:
    seen["error"] = type(exc).__name__
time.sleep(2)
seen["run_dir_left"] = out.exists()
ps = subprocess.run(["ps", "-o", "pid=,args=", "--ppid", str(os.getpid())], capture_output=True, text=True).stdout
seen["children"] = [line.split(None, 1)[1] for line in ps.splitlines() if "ps -o" not in line]
print(json.dumps(seen))
"""


def test_a_stage_after_the_release_that_cannot_be_imported_is_undone_like_the_gates(tmp_path):
    """The stages after the release are imported before the launch's undo is given up: a broken
    install leaves no run directory and no process behind (red team: it left both)."""
    seen = json.loads(_python(BROKEN_STREAM, str(tmp_path), str(EXAMPLE)))
    assert seen == {"error": "ModuleNotFoundError", "run_dir_left": False, "children": []}


def test_a_rank_that_connects_before_the_feeder_exists_is_served(tmp_path):
    path = str(tmp_path / "f.sock")
    server, token = protocol.listen(path, 1), "t" * 32
    rank = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    rank.connect(path)  # before any Feeder: the connection waits in the backlog
    protocol.send(rank, Kind.HELLO, {"rank": 0, "local_rank": 0, "world_size": 1, "pid": 1, "token": token})
    ids = np.arange(100) % 50
    feeder = Feeder(path, iter(chunks_of(ids.tolist(), [1] * 100, 10)), {"seed": 7}, vocab_size=50,
                    server=server, token=token)
    try:
        got = {}
        reader = threading.Thread(target=lambda: got.update(zip(("kind", "config"), protocol.recv(rank, 0)[:2])))
        reader.start()
        feeder.start(release=False)
        reader.join(0.5)
        assert reader.is_alive() and not got  # accepted, but no configuration before the release
        feeder.release()
        reader.join(10)
        assert got == {"kind": Kind.CONFIG, "config": {"seed": 7}}
        assert feeder.result.ready_at is not None
    finally:
        rank.close()
        feeder.close()


def test_a_forged_token_is_refused_from_the_backlog_too(tmp_path):
    path = str(tmp_path / "f.sock")
    server = protocol.listen(path, 1)
    rank = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    rank.connect(path)
    protocol.send(rank, Kind.HELLO, {"rank": 0, "local_rank": 0, "world_size": 1, "pid": 1, "token": "guess"})
    feeder = Feeder(path, iter(chunks_of(list(range(20)), [1] * 20, 10)), {"seed": 7}, vocab_size=50,
                    server=server, token="t" * 32)
    try:
        feeder.start()  # released at once: a rank with the right token would get its CONFIG now
        with pytest.raises(protocol.ProtocolError):  # the feeder closes the connection unanswered
            protocol.recv(rank, 0)
        assert feeder.result.ready_at is None
    finally:
        rank.close()
        feeder.close()
