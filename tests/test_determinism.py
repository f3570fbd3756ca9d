"""Determinism a submission cannot switch off: the gate's prism:determinism rule, and the
runner's check of the forced settings on every batch (gates/determinism.py, seeding.py)."""

import sys
from pathlib import Path

import pytest
import torch

from prism_challenge.pipeline import EvalOptions, evaluate
from prism_challenge.evaluator.seeding import DETERMINISM_FLAGS, determinism_change, determinism_flags
from prism_challenge.gates import RULES, run_gates
from prism_challenge.gates.determinism import DETERMINISM, DETERMINISM_PATHS

sys.path.insert(0, str(Path(__file__).resolve().parent / "adversarial"))
from gatekit import arch, line_of, write_bundle  # noqa: E402

from helpers import UNIFORM_ARCH  # noqa: E402
from helpers import write_bundle as write_run_bundle  # noqa: E402


@pytest.mark.parametrize(
    "top, body, needle, path",
    [
        ("", "torch.use_deterministic_algorithms(False)", "use_deterministic", "torch.use_deterministic_algorithms"),
        ("", "torch.set_deterministic_debug_mode(0)", "set_deterministic", "torch.set_deterministic_debug_mode"),
        ("", 'torch.set_float32_matmul_precision("medium")', "set_float32", "torch.set_float32_matmul_precision"),
        ("", "torch.backends.cudnn.benchmark = True", "cudnn", "torch.backends.cudnn"),
        ("", "torch.backends.cuda.matmul.allow_tf32 = True", "matmul", "torch.backends.cuda.matmul"),
        ("", "torch.backends.mkldnn.allow_tf32 = True", "mkldnn", "torch.backends.mkldnn"),
        ("", "f = torch.use_deterministic_algorithms\nf(False)", "f = torch", "torch.use_deterministic_algorithms"),
        ("", 'getattr(torch, "use_deterministic_algorithms")(False)', "getattr", "torch.use_deterministic_algorithms"),
        ("from torch.backends import cudnn", "", "backends import cudnn", "torch.backends.cudnn"),
        ("from torch import use_deterministic_algorithms as u", "", "algorithms as u", "torch.use_deterministic_algorithms"),
    ],
)
def test_the_gate_refuses_the_determinism_and_precision_switches(tmp_path, top, body, needle, path):
    src = arch(top=top, body=body)
    report = run_gates(write_bundle(tmp_path, {"architecture.py": src}), check_params=False)
    hits = [f for f in report.findings if f.rule == DETERMINISM]
    assert [(f.file, f.line) for f in hits] == [("architecture.py", line_of(src, needle))]
    assert f"'{path}' " in hits[0].message and "a bundle may not change them" in hits[0].message
    assert hits[0].blocking


def test_the_rule_is_registered_and_the_switches_are_off_the_allow_list():
    from prism_challenge.gates.allowlist import load_allowlist

    assert DETERMINISM in RULES
    al = load_allowlist()
    for path in DETERMINISM_PATHS:
        assert path not in al.paths and path not in al.modules
    assert not {"allow_tf32", "allow_bf16_reduced_precision_reduction"} & set(al.attrs)


def test_reading_the_precision_getter_stays_allowed(tmp_path):
    src = arch(body="p = torch.get_float32_matmul_precision()")
    report = run_gates(write_bundle(tmp_path, {"architecture.py": src}), check_params=False)
    assert not [f for f in report.findings if f.blocking]


@pytest.mark.parametrize("name, flip", [
    ("torch.backends.cudnn.benchmark", lambda: setattr(torch.backends.cudnn, "benchmark", True)),
    ("torch.get_float32_matmul_precision()", lambda: torch.set_float32_matmul_precision("medium")),
    ("torch.are_deterministic_algorithms_enabled()", lambda: torch.use_deterministic_algorithms(False)),
])
def test_a_flipped_flag_is_named_with_both_values(name, flip):
    saved = determinism_flags()
    torch.backends.cudnn.benchmark = False
    torch.set_float32_matmul_precision("highest")
    torch.use_deterministic_algorithms(True)
    try:
        expected = determinism_flags()
        assert determinism_change(expected) is None
        flip()
        before = expected[name]
        after = {"torch.backends.cudnn.benchmark": True, "torch.get_float32_matmul_precision()": "medium",
                 "torch.are_deterministic_algorithms_enabled()": False}[name]
        assert determinism_change(expected) == f"{name} is {after!r}, the run forces {before!r}"
    finally:
        torch.backends.cudnn.benchmark = saved["torch.backends.cudnn.benchmark"]
        torch.set_float32_matmul_precision(saved["torch.get_float32_matmul_precision()"])
        torch.use_deterministic_algorithms(saved["torch.are_deterministic_algorithms_enabled()"])
    assert len(DETERMINISM_FLAGS) == len(determinism_flags()) == 21


SWITCH_OFF_LOOP = """
import torch


def train(ctx):
    model = ctx.build_model()
    for batch in ctx.iter_train_batches(model, batch_size=1, seq_len=8):
        if batch.step == 1:
            torch.use_deterministic_algorithms(False)
"""


@pytest.mark.slow
def test_the_runner_stops_a_loop_that_switches_determinism_off(tmp_path):
    # the static gate would refuse this bundle (prism:determinism); with it off, the runner's
    # per-batch check stops the run before batch 2 is scored
    bundle = write_run_bundle(tmp_path / "b", UNIFORM_ARCH, SWITCH_OFF_LOOP)
    o = evaluate(EvalOptions(bundle=str(bundle), out_dir=str(tmp_path / "run"), device="cpu", static_gates=False,
                             heldout_bytes=0, token_budget=200))
    assert o.failure is not None and o.failure.stage == "contract", o.failure
    assert o.failure.message.startswith("batch 2: torch.are_deterministic_algorithms_enabled() is False, "
                                        "the run forces True")
    assert o.manifest["stream"]["batches"] == 2 and o.manifest["score"] is None  # batches 0, 1; no score
