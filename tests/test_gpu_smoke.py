"""bench/gpu_smoke.py and its bf16 bundle work on CPU (--device cpu --quick), not only on a GPU."""

import json
import subprocess
import sys

import pytest

from prism_challenge.gates import run_gates

from helpers import REPO

BF16 = REPO / "bench" / "bundles" / "bf16"


def test_the_bf16_bundle_passes_the_gates_and_autocasts_its_step():
    report = run_gates(BF16, check_params=False)
    assert not [f for f in report.findings if f.blocking]
    assert "torch.autocast(device_type, dtype=torch.bfloat16)" in (BF16 / "training.py").read_text()
    assert "torch.autocast(self.head.weight.device.type, dtype=torch.bfloat16)" in (BF16 / "architecture.py").read_text()


@pytest.mark.slow
def test_the_smoke_bench_runs_the_example_on_cpu(tmp_path):
    res = subprocess.run([sys.executable, str(REPO / "bench" / "gpu_smoke.py"), "--device", "cpu", "--quick",
                          "--only", "example"], capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    lines = res.stdout.splitlines()
    assert any(x.startswith("[example] scored: prequential_bpb ") and "isolation strict" in x for x in lines)
    stack = json.loads(next(x for x in lines if x.startswith("[example] gpu stack: ")).split(": ", 1)[1])
    assert stack["device"] == "cpu" and stack["gpu_count"] is None
    assert lines[-1].startswith("== gpu smoke on cpu (quick): example ok in ")
