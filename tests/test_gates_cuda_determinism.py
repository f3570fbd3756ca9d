"""prism:cuda-determinism: ops that raise under forced determinism on CUDA only are named, as
advisories, under a CUDA device (issue 26, item 9). No GPU is needed: the check is static."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch

from prism_challenge.gates import run_gates
from prism_challenge.gates.cli import main
from prism_challenge.gates.cudadeterminism import METHODS, OPS

HONEST = Path(__file__).resolve().parent / "honest_bundles"

EXTRAS = '''

def extras(x, idx):
    a = x.cumsum(1)
    b = torch.cumsum(x, dim=0)
    c = F.interpolate(x, scale_factor=2)
    d = F.interpolate(x, scale_factor=2, mode="bilinear")
    e = idx.bincount()
    f = idx.bincount(x)
    g = torch.histc(x)
    h = x.scatter_reduce(0, idx, x, reduce="sum")
    i = x.scatter_reduce(0, idx, x, "prod")
    j = F.pad(x, (1, 1), mode="reflect")
    k = nn.AdaptiveAvgPool2d(1)
    m = x.median()
    n = x.median(0)
    return a, b, c, d, e, f, g, h, i, j, k, m, n
'''
NAMED = {50: ".cumsum()", 51: "torch.cumsum", 53: "torch.nn.functional.interpolate", 55: ".bincount()",
         56: "torch.histc", 58: ".scatter_reduce()", 59: "torch.nn.functional.pad",
         60: "torch.nn.AdaptiveAvgPool2d", 62: ".median()"}
"""Line of EXTRAS in the MoE bundle's architecture.py -> the op named there (interpolate in
nearest mode, bincount without weights, scatter_reduce 'sum' and median without dim are fine)."""


@pytest.fixture
def bundle(tmp_path):
    """The honest MoE bundle (index_add_, deterministic on CUDA) plus the ops above."""
    for src in (HONEST / "base", HONEST / "moe_index_add"):
        for f in src.iterdir():
            shutil.copyfile(f, tmp_path / f.name)
    arch = tmp_path / "architecture.py"
    arch.write_text(arch.read_text() + EXTRAS)
    assert arch.read_text().splitlines()[49].strip() == "a = x.cumsum(1)"
    return tmp_path


def cuda_findings(report):
    return {f.line: f for f in report.findings if f.rule == "prism:cuda-determinism"}


def test_under_cuda_each_op_is_an_advisory_at_its_line(bundle):
    found = cuda_findings(run_gates(bundle, check_params=False, device="cuda"))
    assert {line: f.message.split(" raises")[0] for line, f in found.items()} == NAMED
    assert not any(f.blocking for f in found.values())
    assert all(f.file == "architecture.py" and "fail at stage train on the GPU" in f.message for f in found.values())
    assert "index_add" not in " ".join(f.message for f in found.values())  # deterministic on CUDA


@pytest.mark.parametrize("device", ["cpu", None])
def test_off_cuda_nothing_is_said(bundle, device):
    assert cuda_findings(run_gates(bundle, check_params=False, device=device)) == {}


@pytest.mark.parametrize("flags", [["--device", "cuda"], ["--profile", "prism-v2"]])
def test_prism_check_warns_under_a_cuda_device_or_profile_and_passes(bundle, capsys, flags):
    assert main([str(bundle), "--no-params", "--json", *flags]) == 0
    report = json.loads(capsys.readouterr().out)
    lines = sorted(f["line"] for f in report["findings"] if f["rule"] == "prism:cuda-determinism")
    assert lines == sorted(NAMED) and report["blocking"] is False


def test_prism_check_on_cpu_and_with_a_bad_profile(bundle, capsys):
    assert main([str(bundle), "--no-params", "--json"]) == 0
    assert "cuda-determinism" not in capsys.readouterr().out
    assert main([str(bundle), "--no-params", "--profile", "no-such-profile"]) == 2
    assert "no-such-profile" in capsys.readouterr().out


def test_every_op_torch_documents_as_raising_is_covered():
    doc = torch.use_deterministic_algorithms.__doc__
    raising = doc[doc.index("operations will throw a"):doc.index("In addition")]
    names = set(re.findall(r":(?:class|func):`([\w.]+)`", raising)) - {"RuntimeError"}
    covered = set(OPS) | {"torch.Tensor." + m for m in METHODS}
    missing = {n for n in names if n not in covered and n.replace("torch.Tensor.", "torch.") not in covered}
    assert missing == {"torch.Tensor.resize_"}  # on quantized tensors only, which a bundle cannot make
