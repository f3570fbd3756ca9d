"""What a GPU host's setup must not break, shown on CPU: an unresolvable host name, the
libraries found through LD_LIBRARY_PATH (evaluator/envpolicy.py, launcher.py)."""

import json
import os
import shutil
import subprocess
import sys

import pytest

from prism_challenge.pipeline import EvalOptions, evaluate
from prism_challenge.evaluator import isolation
from prism_challenge.evaluator.gpu import STACK_FIELDS

from helpers import EXAMPLE, UNIFORM_ARCH, write_bundle

pytestmark = pytest.mark.slow
strict = pytest.mark.skipif(isolation.available_backend() is None, reason="no working sandbox backend")


def _can_set_hostname() -> bool:
    if shutil.which("unshare") is None:
        return False
    res = subprocess.run(["unshare", "--uts", "sh", "-c", "hostname prism-probe-x"], capture_output=True)
    return res.returncode == 0


@strict
@pytest.mark.skipif(not _can_set_hostname(), reason="unshare --uts needs root (CAP_SYS_ADMIN)")
def test_two_ranks_score_when_the_host_name_does_not_resolve(tmp_path):
    # containers, Kubernetes pods and cloud VMs: torchrun --standalone published socket.getfqdn(),
    # which the sandbox's loopback-only namespace cannot resolve; the ranks waited until the idle
    # timeout (reproduced: "no batch was asked for 40 s after the start"); now they meet on 127.0.0.1
    out = tmp_path / "run"
    script = (f"hostname prism-unresolvable-host-x && exec {sys.executable} -m prism_challenge.cli eval {EXAMPLE} "
              f"--nproc 2 --device cpu --threads 1 --step-budget 2 --seq-len 32 --heldout-bytes 0 "
              f"--idle-timeout 60 --rank-timeout 60 --quiet --out {out}")
    res = subprocess.run(["unshare", "--uts", "sh", "-c", script], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    manifest = json.loads((out / "prism_run_manifest.v2.json").read_text())
    assert manifest["status"] == "scored" and manifest["compute"]["world_size"] == 2
    assert manifest["stream"]["batches"] == 2 and manifest["isolation"]["isolated"] is True
    log = (out / "logs" / "runner.log").read_text()
    assert "prism-unresolvable-host-x" not in log  # nothing tried to reach the host's name


LD_LOOP = """
import os


def train(ctx):
    model = ctx.build_model()
    dirs = os.environ.get("LD_LIBRARY_PATH", "").split(":")
    seen = [[d, os.access(d + "/libprobe.so", os.R_OK), os.access(d, os.W_OK)] for d in dirs]
    print("LDPROBE", seen, os.environ.get("NCCL_SOCKET_IFNAME"), os.environ.get("NCCL_TOPO_FILE"), flush=True)
    for batch in ctx.iter_train_batches(model, batch_size=1, seq_len=8):
        pass
"""


@strict
def test_the_library_path_reaches_the_ranks_bound_read_only(tmp_path, monkeypatch):
    libs = tmp_path / "nvidia-compat"
    libs.mkdir()
    (libs / "libprobe.so").write_text("not a library\n")
    os.chmod(tmp_path, 0o755)
    monkeypatch.setenv("LD_LIBRARY_PATH", f"{libs}::relative/dir")
    monkeypatch.setenv("NCCL_TOPO_FILE", str(libs / "topo.xml"))
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "eth0")
    o = evaluate(EvalOptions(bundle=str(write_bundle(tmp_path / "b", UNIFORM_ARCH, LD_LOOP)), out_dir=str(tmp_path / "r"),
                             device="cpu", run_gates=False, heldout_bytes=0, token_budget=50))
    assert o.failure is None, o.failure
    line = next(x for x in (o.run_dir / "logs" / "runner.log").read_text().splitlines() if x.startswith("LDPROBE"))
    # readable inside the sandbox, not writable; the relative entry is gone; NCCL is pinned to loopback
    assert line == f"LDPROBE [['{libs}', True, False]] lo None"
    # a CPU run records the GPU stack's fields as null (evaluator/gpu.py)
    g = o.manifest["compute"]["gpu"]
    assert g == {"device": "cpu", **dict.fromkeys(STACK_FIELDS), "peak_allocated_bytes": {"0": None},
                 "peak_reserved_bytes": {"0": None}}
