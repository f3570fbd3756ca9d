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


sys.path.insert(0, str(REPO / "bench"))
from gpu_smoke import honest_problems  # noqa: E402


def _manifest(flags=(), final=0.18, passed=True, heldout_bytes=20_000, heldout_error=None, status="scored"):
    return {"status": status, "failure": None if status == "scored" else {"stage": "train", "message": "boom"},
            "verdict": {"flags": list(flags), "final_score": final, "heldout_error": heldout_error},
            "audit": {"passed": passed, "error": None if passed else "audited batch 2: recorded 10727.824262619019 "
                      "nats, re-scored 10727.837071418762 nats", "mismatch": None},
            "_heldout_bytes": heldout_bytes}


def test_a_run_zeroed_by_its_audit_is_a_failure_not_a_pass():
    # issue 26's bf16-cast example: scored, but the audit zeroed it
    problems = honest_problems(_manifest(flags=["audit"], final=0.0, passed=False))
    assert problems[0] == "flag audit"
    assert problems[1].startswith("audit not passed: error 'audited batch 2: recorded 10727.824262619019 nats")
    assert problems[2] == "final_score 0.0"
    assert len(problems) == 3


def test_a_clean_run_has_no_problem_and_a_disabled_heldout_is_admitted_only_when_off():
    assert honest_problems(_manifest()) == []
    assert honest_problems(_manifest(flags=["heldout_unavailable"], heldout_bytes=0)) == []
    assert honest_problems(_manifest(flags=["heldout_unavailable"], heldout_error="data: too small")) == [
        "flag heldout_unavailable", "heldout_error data: too small"]
    assert honest_problems(_manifest(flags=["memorization"])) == ["flag memorization"]
    assert honest_problems({**_manifest(), "audit": None}) == ["audit not passed: error None, mismatch None"]
    assert honest_problems(_manifest(status="failed")) == ["not scored: stage train: boom"]
