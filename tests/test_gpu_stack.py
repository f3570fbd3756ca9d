"""The GPU stack (evaluator/gpu.py): the CUDA check inside the sandbox, the nproc-per-GPU rule,
and what the manifest records, on CPU with stand-ins for torch.cuda where a GPU is needed."""

from types import SimpleNamespace

import pytest
import torch

from prism_challenge.cli import main as cli_main
from prism_challenge.pipeline import USAGE_STAGE, EvalFailure, EvalOptions, evaluate
from prism_challenge.evaluator import gpu, isolation
from prism_challenge.evaluator.gpu import (
    STACK_FIELDS,
    CudaCheckError,
    cpu_stack,
    driver_version,
    gpu_count_error,
    gpu_stack,
    manifest_record,
    parse_check,
    peak_memory,
)
from prism_challenge.evaluator.jail import Jail
from prism_challenge.evaluator.jailchild import Finished
from prism_challenge.evaluator.isolation import Limits

from helpers import EXAMPLE

PROPRIETARY = "NVRM version: NVIDIA UNIX x86_64 Kernel Module  580.159.03  Thu Oct  9 12:00:00 UTC 2025\nGCC version: gcc 12\n"
OPEN = "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  575.57.08  Release Build  (dvs-builder@U16)\n"


class FakeCuda:
    """torch.cuda as a two-H200 host shows it."""

    def __init__(self, available=True, count=2, initialized=True):
        self.available, self.count, self.initialized = available, count, initialized
        self.nccl = SimpleNamespace(version=lambda: (2, 27, 3))

    def is_available(self):
        return self.available

    def is_initialized(self):
        return self.initialized

    def device_count(self):
        return self.count

    def get_device_name(self, i):
        return ["NVIDIA H200", "NVIDIA H100 80GB HBM3"][i]

    def get_device_properties(self, i):
        return SimpleNamespace(major=9, minor=0, total_memory=150_754_820_096)

    def max_memory_allocated(self):
        return 3_221_225_472

    def max_memory_reserved(self):
        return 4_294_967_296


@pytest.mark.parametrize("text, version", [(PROPRIETARY, "580.159.03"), (OPEN, "575.57.08")])
def test_the_driver_version_is_read_from_the_kernel_module_line(text, version):
    assert driver_version(text) == version


def test_the_stack_is_gathered_from_torch_cuda(monkeypatch, tmp_path):
    (tmp_path / "version").write_text(PROPRIETARY)
    monkeypatch.setattr(gpu, "DRIVER_FILE", str(tmp_path / "version"))
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(torch.backends.cudnn, "version", lambda: 91002)
    ran = []
    stack = gpu_stack(FakeCuda(), nproc=2, kernel=lambda i: ran.append(i) or 8.0)
    assert ran == [0, 1]  # one kernel on each device a rank uses
    assert stack == {
        "device": "cuda", "gpu_model": "NVIDIA H200", "gpu_models": ["NVIDIA H200", "NVIDIA H100 80GB HBM3"],
        "gpu_count": 2, "compute_capability": "9.0", "memory_bytes": 150_754_820_096, "driver": "580.159.03",
        "cuda_runtime": "13.0", "cudnn": 91002, "nccl": "2.27.3",
    }
    assert set(stack) == {"device", *STACK_FIELDS}


@pytest.mark.parametrize("cuda, nproc, kernel, needle", [
    (FakeCuda(available=False), 1, lambda i: 8.0, "is_available() is False"),
    (FakeCuda(count=1), 2, lambda i: 8.0, "1 GPU(s) visible, 2 rank(s) need one each"),
    (FakeCuda(), 1, lambda i: 0.0, "cuda:0: a kernel computed 0.0, not 8.0"),
])
def test_a_cuda_that_does_not_work_is_an_error(cuda, nproc, kernel, needle):
    with pytest.raises(CudaCheckError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        gpu_stack(cuda, nproc=nproc, kernel=kernel)


def test_cpu_runs_record_the_same_fields_as_null():
    assert cpu_stack() == {"device": "cpu", **{k: None for k in STACK_FIELDS}}
    done = {1: peak_memory(FakeCuda(available=False)), 0: peak_memory(FakeCuda(available=False))}
    record = manifest_record(cpu_stack(), done)
    assert record["peak_allocated_bytes"] == {"0": None, "1": None}
    assert record["peak_reserved_bytes"] == {"0": None, "1": None}
    assert record["device"] == "cpu" and record["driver"] is None


def test_a_cuda_rank_reports_its_allocated_and_reserved_peaks():
    peaks = peak_memory(FakeCuda())
    assert (peaks["peak_device_bytes"], peaks["peak_reserved_bytes"]) == (3_221_225_472, 4_294_967_296)
    assert peaks["peak_rss_bytes"] > 0
    assert peak_memory(FakeCuda(initialized=False))["peak_device_bytes"] is None  # CUDA never used
    record = manifest_record({"device": "cuda"}, {0: peaks})
    assert record["peak_allocated_bytes"] == {"0": 3_221_225_472}
    assert record["peak_reserved_bytes"] == {"0": 4_294_967_296}


@pytest.mark.parametrize("out, err, code, result", [
    (b'{"ok": true, "stack": {"device": "cuda", "gpu_count": 1}}\n', b"", 0, {"device": "cuda", "gpu_count": 1}),
    (b'{"ok": false, "error": "RuntimeError: No CUDA GPUs are available"}\n', b"", 1,
     "RuntimeError: No CUDA GPUs are available"),
    (b"", b"Traceback\nImportError: libcuda.so.1: cannot open shared object file\n", 1,
     "crash: the process ended (exit status 1): ImportError: libcuda.so.1: cannot open shared object file"),
])
def test_the_check_childs_reply_is_read(out, err, code, result):
    done = Finished(code, out, err, False, None if code == 0 else "crash: the process ended (exit status 1)", None)
    if isinstance(result, dict):
        assert parse_check(done) == result
    else:
        with pytest.raises(CudaCheckError) as exc:
            parse_check(done)
        assert str(exc.value) == result


def test_more_ranks_than_gpus_is_a_usage_error(monkeypatch, capsys):
    assert gpu_count_error(2, "cpu", 0) is None and gpu_count_error(2, "cuda", 2) is None
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    assert gpu_count_error(2, "cuda", 1) == ("--nproc 2: 1 CUDA device(s) are visible (CUDA_VISIBLE_DEVICES=3); "
                                             "each rank needs one of its own")
    # this machine has no GPU: torch.cuda.device_count() is 0, so one rank on cuda is already too many
    assert torch.cuda.device_count() == 0
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # past --device cuda's own check
    with pytest.raises(EvalFailure) as exc:
        evaluate(EvalOptions(bundle=str(EXAMPLE), device="cuda", nproc=1))
    assert exc.value.stage == USAGE_STAGE and exc.value.message.startswith("--nproc 1: 0 CUDA device(s) are visible")
    assert cli_main(["eval", str(EXAMPLE), "--device", "cuda", "--nproc", "2"]) == 2
    assert "--nproc 2: 0 CUDA device(s) are visible" in capsys.readouterr().err


strict = pytest.mark.skipif(isolation.available_backend() is None, reason="no working sandbox backend")


@pytest.mark.slow
@strict
def test_the_check_child_reports_cudas_error_from_inside_the_sandbox(tmp_path):
    jail = Jail.open("strict", bundle_dir=tmp_path, hidden=[], limits=Limits(), threads=1)
    with pytest.raises(CudaCheckError, match=r"is_available\(\) is False"):
        gpu.start_cuda_check(jail, 1).result()


@pytest.mark.slow
@strict
def test_a_cuda_run_whose_sandbox_cannot_reach_cuda_fails_at_isolation(tmp_path, monkeypatch):
    # the parent believes in one GPU; inside the sandbox (this CPU machine) CUDA does not initialise
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    out = tmp_path / "run"
    with pytest.raises(EvalFailure) as exc:
        evaluate(EvalOptions(bundle=str(EXAMPLE), out_dir=str(out), device="cuda", heldout_bytes=0, step_budget=1))
    assert exc.value.stage == "isolation"
    assert "CUDA does not initialise inside the sandbox" in exc.value.message
    assert "is_available() is False" in exc.value.message
    assert not out.exists() or not any(out.iterdir())  # nothing was released, no run directory kept
