"""The false-positive suite (issue 26): honest idioms of real training code must score cleanly.

``tests/honest_bundles/base`` is a tiny causal GPT over bytes with an AdamW loop; every other
folder there replaces its ``architecture.py``, ``training.py`` and/or ``prism.yaml`` with one idiom (dropout,
BatchNorm, RoPE caches, minGPT's ``configure_optimizers``, checkpoints under formatted names,
``AveragedModel``, ...; each file's docstring says which). The gates must admit every one
(one fast test), and every one must score end to end with no flag, the audit passed and a
positive final score (one slow test per idiom, 2048 stream tokens and 10 kB held out).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from prism_challenge.gates import run_gates
from prism_challenge.pipeline import EvalOptions, evaluate

HONEST = Path(__file__).resolve().parent / "honest_bundles"
IDIOMS = sorted(p.name for p in HONEST.iterdir() if p.is_dir() and p.name != "base")


def assemble(idiom: str, dest: Path) -> Path:
    """The bundle of ``idiom``: the base's files, overlaid with the idiom folder's."""
    dest.mkdir(parents=True)
    for src in (HONEST / "base", HONEST / idiom):
        for f in sorted(src.iterdir()):
            if f.suffix in (".py", ".yaml"):
                shutil.copyfile(f, dest / f.name)
    return dest


def test_the_suite_holds_at_least_thirty_idioms():
    assert len(IDIOMS) >= 30, IDIOMS
    for idiom in IDIOMS:
        files = {f.name for f in (HONEST / idiom).iterdir()}
        assert files and files <= {"architecture.py", "training.py", "prism.yaml"}, (idiom, files)


def test_the_gates_admit_every_honest_idiom(tmp_path):
    refused = {}
    for idiom in ["base", *IDIOMS]:
        report = run_gates(assemble(idiom, tmp_path / idiom), check_params=False)
        blocking = [f"{f.rule} {f.location}: {f.message}" for f in report.findings if f.blocking]
        if blocking:
            refused[idiom] = blocking
    assert refused == {}


@pytest.mark.slow
@pytest.mark.parametrize("idiom", IDIOMS)
def test_an_honest_idiom_scores_cleanly_end_to_end(tmp_path, idiom):
    bundle = assemble(idiom, tmp_path / "bundle")
    o = evaluate(EvalOptions(bundle=str(bundle), out_dir=str(tmp_path / "run"), device="cpu", threads=1,
                             seq_len=64, token_budget=2048, heldout_bytes=10_000))
    assert o.failure is None, o.failure
    m = o.manifest
    v = m["verdict"]
    assert (v["flags"], v["heldout_error"]) == ([], None)
    assert m["audit"]["passed"] is True and m["audit"]["error"] is None and m["audit"]["mismatch"] is None
    assert all(b["match"] for b in m["audit"]["batches"]) and len(m["audit"]["batches"]) >= 2
    assert m["stream"]["batches"] >= 2048 // (4 * 64) and m["stream"]["tokens"] >= 2048
    assert v["final_score"] > 0
