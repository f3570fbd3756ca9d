"""Challenge profiles: the shipped files, their parsing, overrides and the data pin."""

import dataclasses
import hashlib
import json

import pytest

from prism_challenge.cli import main
from prism_challenge.data.sources import FINEWEB_EDU_REPO, FINEWEB_EDU_REVISION, FINEWEB_EDU_SUBSET
from prism_challenge.pipeline import EvalOptions
from prism_challenge.profiles import (
    DataPin,
    ProfileError,
    data_mismatch,
    load_profile,
    prepare_hint,
    profile_names,
    resolve,
)
from prism_challenge.score.verdict import Policy

from helpers import EXAMPLE, REPO


def test_shipped_profiles():
    assert profile_names() == ["local", "prism-v2"]


def test_local_profile_equals_the_eval_options_defaults():
    # one definition of each default: every setting of `local` is EvalOptions' default, except the
    # quick-start token budget (a library call without a budget streams the whole split)
    local = load_profile("local")
    defaults = EvalOptions(bundle="x")
    for key, value in local.options.items():
        if key == "token_budget":
            assert (value, defaults.token_budget) == (20_000, None)
        else:
            assert getattr(defaults, key) == value, key
    assert local.options["policy"] == Policy()
    assert local.data == DataPin(source="builtin")
    raw = (REPO / "src/prism_challenge/profiles/local.toml").read_bytes()
    assert local.sha256 == hashlib.sha256(raw).hexdigest()


def test_prism_v2_is_the_official_setting():
    v2 = load_profile("prism-v2")
    o = v2.options
    assert (o["seq_len"], o["nproc"], o["device"], o["wall_clock_budget"]) == (512, 1, "cuda", 1200.0)
    assert o["byte_budget"] == 100_000_000 and o["token_budget"] is None
    assert v2.data.source == "fineweb-edu" and v2.data.revision == FINEWEB_EDU_REVISION
    assert (v2.data.dataset, v2.data.subset) == (FINEWEB_EDU_REPO, FINEWEB_EDU_SUBSET)  # what prepare records
    assert v2.data.max_bytes == 256_000_000 and v2.data.subset == "sample-10BT"
    assert prepare_hint(v2.data) == ("prism data prepare --source fineweb-edu --subset sample-10BT "
                                     f"--revision {FINEWEB_EDU_REVISION} --max-bytes 256000000 --out DIR")


def _write(tmp_path, text):
    p = tmp_path / "p.toml"
    p.write_text(text)
    return str(p)


BASE = (REPO / "src/prism_challenge/profiles/local.toml").read_text()


@pytest.mark.parametrize("edit,message", [
    (("seq_len = 256", "seq_len = \"long\""), "[run] seq_len = 'long': must be int"),
    (("nproc = 1", "nproc = 0"), "[run] nproc = 0: must be at least 1"),
    (("device = \"auto\"", "device = \"tpu\""), "[run] device = 'tpu': must be one of ['auto', 'cpu', 'cuda']"),
    (("token_budget = 20_000", "token_budgt = 20_000"), "[budgets] token_budgt: unknown key"),
    (("gap_penalty = 0.5", "gap_penalty = true"), "[policy] gap_penalty = True: must be int or float"),
    (("source = \"builtin\"", "source = \"s3\""), "[data] source = 's3': must be one of"),
    (("seed = 1234", "seed = -4"), "[run] seed = -4: must be a finite number >= 0"),
])
def test_bad_fields_are_named(tmp_path, edit, message):
    path = _write(tmp_path, BASE.replace(*edit))
    with pytest.raises(ProfileError) as exc:
        load_profile(path)
    assert str(exc.value).startswith(f"{path}: ") and message in str(exc.value)


def test_invalid_toml_names_the_line(tmp_path):
    path = _write(tmp_path, BASE.replace("nproc = 1", "nproc = = 1"))
    line = BASE.splitlines().index("nproc = 1") + 1
    with pytest.raises(ProfileError, match=rf"not valid TOML: .*line {line}"):
        load_profile(path)


def test_unknown_profile_lists_the_shipped_ones():
    with pytest.raises(ProfileError, match="no such profile .shipped: local, prism-v2"):
        load_profile("prism-v9")


def test_resolve_records_only_the_fields_that_differ():
    local = load_profile("local")
    settings, overridden = resolve(local, {"seed": 1234, "token_budget": 500, "nproc": None, "data_dir": "/d"})
    assert overridden == ["data", "token_budget"]  # seed 1234 is the profile's own value
    assert settings["token_budget"] == 500 and settings["seed"] == 1234 and settings["nproc"] == 1
    assert settings["data_dir"] == "/d"


def test_data_mismatch_names_each_field():
    pin = DataPin(source="fineweb-edu", subset="sample-10BT", revision="abc", max_bytes=10)
    manifest = {"source": {"kind": "fineweb-edu", "max_bytes": 5}, "subset": "sample-10BT", "revision": "abd"}
    assert data_mismatch(pin, manifest, "f" * 64) == ["revision: profile 'abc', data 'abd'",
                                                      "max_bytes: profile 10, data 5"]
    assert data_mismatch(dataclasses.replace(pin, revision="abd", max_bytes=5), manifest, "f" * 64) == []


def test_eval_with_prism_v2_needs_its_data(capsys):
    code = main(["eval", str(EXAMPLE), "--profile", "prism-v2", "--device", "cpu", "--json"])
    assert code == 2
    out = json.loads(capsys.readouterr().out)
    assert out["failure"]["stage"] == "config"
    assert "profile prism-v2 scores fineweb-edu data: pass --data DIR" in out["failure"]["message"]
    assert "prism data prepare --source fineweb-edu" in out["failure"]["message"]


def test_eval_with_a_broken_profile_is_a_usage_error(tmp_path, capsys):
    path = _write(tmp_path, BASE.replace("threads = 2", "threads = 0"))
    assert main(["eval", str(EXAMPLE), "--profile", path]) == 2
    assert f"{path}: [run] threads = 0: must be at least 1" in capsys.readouterr().err


def test_help_is_complete(capsys):
    # every option of every command has help text, and no literal %% reaches the reader
    import argparse

    from prism_challenge.cli import build_parser

    parser = build_parser()
    todo = [("prism", parser)]
    while todo:
        name, p = todo.pop()
        text = p.format_help()
        assert "%%" not in text, name
        for action in p._actions:
            if isinstance(action, argparse._SubParsersAction):
                todo += [(f"{name} {k}", v) for k, v in action.choices.items()]
            elif action.help is not argparse.SUPPRESS:
                assert action.help, f"{name} {action.option_strings or action.dest}: no help text"
