"""The pipeline as a library, without launching a run: lazy re-exports, options validated in one
place, the failure kinds table, the manifest models and their checked-in schema, the cancel
hook and the progress events of :class:`~prism_challenge.control.RunControl`."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from pydantic import ValidationError

from prism_challenge.cli import main
from prism_challenge.control import POLL_S, RunControl
from prism_challenge.events import BatchScored, StageFinished, StageStarted
from prism_challenge.failures import (
    FAILURE_KINDS,
    INFRASTRUCTURE,
    KILLED,
    REPORTED,
    SUBMISSION,
    TOKENIZER,
    EvalFailure,
    UnknownStage,
    kind_of,
    markdown_table,
)
from prism_challenge.options import EvalOptions, OptionsError
from prism_challenge.manifest.results import REGENERATE, SCHEMA_PATH, RunManifest, early_manifest, schema_text

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "prism_challenge"
EXAMPLE = ROOT / "examples" / "tiny-1m"


# -- lazy re-exports ---------------------------------------------------------------------------
def _fresh(code: str) -> str:
    return subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout.strip()


def test_import_prism_challenge_imports_neither_torch_nor_pydantic():
    out = _fresh("import sys, prism_challenge; print(sorted(m for m in ('torch', 'pydantic', 'numpy', "
                 "'prism_challenge.pipeline') if m in sys.modules))")
    assert out == "[]"


def test_evaluate_and_evaloptions_are_the_library_objects_whatever_was_imported_first():
    out = _fresh("import sys, prism_challenge.pipeline, prism_challenge.api, prism_challenge.options\n"
                 "from prism_challenge import evaluate, EvalOptions\n"
                 "print(evaluate is prism_challenge.api.evaluate, EvalOptions is prism_challenge.options.EvalOptions,"
                 " 'torch' in sys.modules)")
    assert out == "True True False"  # the names stay the library's (and the pipeline imports torch only at a launch)
    out = _fresh("import sys\nfrom prism_challenge import evaluate, EvalOptions\n"
                 "print(evaluate.__module__, EvalOptions.__module__, 'torch' in sys.modules)")
    assert out == "prism_challenge.api prism_challenge.options False"


def test_an_unknown_name_is_an_attribute_error():
    import prism_challenge

    with pytest.raises(AttributeError, match="has no attribute 'nope'"):
        prism_challenge.nope  # noqa: B018


# -- options -------------------------------------------------------------------------------------
@pytest.mark.parametrize("field,value,rule", [
    ("seq_len", 1, "must be between 2 and 16777216"),
    ("nproc", 9, "must be between 1 and 8 processes on one node"),
    ("nproc", 0, "must be between 1 and 8 processes on one node"),
    ("nnodes", 2, "must be between 1 and 1 (PRISM runs on a single node)"),
    ("seed", -1, "must be between 0 and 9223372036854775807"),
    ("seed", 2**63, "must be between 0 and 9223372036854775807"),
    ("threads", 257, "must be between 1 and 256"),
    ("token_budget", 0, "must be at least 1"),
    ("wall_clock_budget", float("inf"), "must be a positive finite number"),
    ("wall_clock_budget", 0.0, "must be a positive finite number"),
    ("idle_timeout", float("nan"), "must be a positive finite number"),
    ("heldout_bytes", -1, "must be between 0 and 1099511627776"),
    ("max_parameters", True, "must be an integer"),
    ("seq_len", 256.0, "must be an integer"),
    ("rank_timeout", "3", "must be a number"),
    ("device", "tpu", "must be one of auto, cpu, cuda"),
    ("isolation", "loose", "must be one of strict, none"),
    ("warm_ranks", 1, "must be True or False"),
    ("bundle", "", "must be a non-empty path"),
    ("out_dir", 3, "must be a non-empty path or None"),
])
def test_a_bad_option_raises_one_error_naming_the_field_and_the_rule(field, value, rule):
    kwargs = {"bundle": "b", field: value}
    with pytest.raises(OptionsError) as exc:
        EvalOptions(**kwargs)
    assert (exc.value.field, exc.value.rule) == (field, rule)
    assert str(exc.value) == f"{field} = {value!r}: {rule}"
    assert isinstance(exc.value, ValueError)


def test_options_normalize_and_a_changed_field_is_checked_again():
    opts = EvalOptions(bundle=Path("b"), wall_clock_budget=60, rank_timeout=3, token_budget=None)
    assert opts.bundle == "b" and type(opts.wall_clock_budget) is float and opts.wall_clock_budget == 60.0
    assert type(opts.rank_timeout) is float
    opts.nproc = 12
    with pytest.raises(OptionsError, match=r"^nproc = 12: must be between 1 and 8 processes on one node$"):
        opts.validate()


def test_the_library_refuses_a_changed_option_before_anything_runs(tmp_path):
    from prism_challenge import evaluate

    opts = EvalOptions(bundle=str(tmp_path / "missing"), out_dir=str(tmp_path / "out"))
    opts.threads = 0
    with pytest.raises(OptionsError, match="threads = 0: must be between 1 and 256"):
        evaluate(opts)
    assert not (tmp_path / "out").exists()
    with pytest.raises(TypeError, match="cancel: 3 must have is_set"):
        evaluate(EvalOptions(bundle="b"), cancel=3)


def test_the_cli_turns_an_option_error_from_a_profile_into_a_usage_error(tmp_path, capsys):
    # the profile loader accepts seq_len = 1 (>= 1); the options' rule (>= 2) refuses it: exit 2, one line
    profile = (SRC / "profiles" / "local.toml").read_text()
    assert re.search(r"(?m)^seq_len = 256 ", profile)
    path = tmp_path / "p.toml"
    path.write_text(re.sub(r"(?m)^seq_len = 256 ", "seq_len = 1 ", profile))
    code = main(["eval", str(EXAMPLE), "--profile", str(path), "--no-progress", "--out", str(tmp_path / "o")])
    assert code == 2
    assert capsys.readouterr().err == "prism eval failed at stage config: --seq-len 1: must be between 2 and 16777216\n"
    assert not (tmp_path / "o").exists()


def test_the_cli_and_the_options_share_the_rule(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["eval", str(EXAMPLE), "--idle-timeout", "-3"])
    assert exc.value.code == 2
    assert capsys.readouterr().err.rstrip().splitlines()[-1] == (
        "prism eval: error: argument --idle-timeout: -3.0 must be a positive finite number")


# -- failure kinds -------------------------------------------------------------------------------
@pytest.mark.parametrize("stage,cause,kind", [
    ("gates", "", SUBMISSION), ("intake", "", SUBMISSION), ("contract", "", SUBMISSION),
    ("resources", "", SUBMISSION), ("budget", "", SUBMISSION), ("consistency", "", SUBMISSION),
    ("runner", "", SUBMISSION), ("runner", KILLED, INFRASTRUCTURE), ("data", "", INFRASTRUCTURE),
    ("isolation", "", INFRASTRUCTURE), ("storage", "", INFRASTRUCTURE), ("config", "", INFRASTRUCTURE),
    ("config", TOKENIZER, SUBMISSION), ("cancelled", "", "cancelled"),
    # a stage the runner names from inside a rank is the submission's, even a harness stage's name
    ("data", REPORTED, SUBMISSION), ("isolation", REPORTED, SUBMISSION), ("train", REPORTED, SUBMISSION),
])
def test_kind_of(stage, cause, kind):
    assert kind_of(stage, cause) == kind
    assert EvalFailure(stage, "m", cause=cause).to_dict() == {"stage": stage, "message": "m", "detail": "",
                                                              "kind": kind, "cause": cause}


def test_an_unlisted_stage_is_a_harness_bug():
    with pytest.raises(UnknownStage):
        kind_of("train")  # only the runner names "train", and then the cause is "reported"


def test_every_stage_the_harness_fails_at_is_in_the_table():
    # every literal stage given to EvalFailure(...) or Feeder.fail(...) in the harness's trusted code
    stages = set()
    for path in SRC.rglob("*.py"):  # every stage's package
        text = path.read_text()
        stages |= set(re.findall(r'EvalFailure\(\s*"([a-z_]+)"', text))
        stages |= set(re.findall(r'(?:self|feeder)\.fail\(\s*"([a-z_]+)"', text))
    assert {"gates", "intake", "contract", "data", "runner", "consistency", "cancelled", "storage"} <= stages
    table = {row.stage for row in FAILURE_KINDS}
    assert stages - table == set()
    for stage in stages:
        kind_of(stage)


def test_the_docs_have_the_table_of_stages_and_kinds():
    page = (ROOT / "docs" / "library.md").read_text()
    m = re.search(r"<!-- failure-kinds:start -->\n(.*?)\n<!-- failure-kinds:end -->", page, re.S)
    assert m, "docs/library.md: the failure kinds table's markers are missing"
    assert m.group(1) == markdown_table(), (
        "docs/library.md's table of stages and kinds differs from prism_challenge.failures.FAILURE_KINDS; paste "
        "the output of `python -c 'from prism_challenge.failures import markdown_table; print(markdown_table())'`")


# -- manifest models and schema ------------------------------------------------------------------
def test_the_checked_in_schema_is_the_models_schema():
    assert SCHEMA_PATH.read_text() == schema_text(), f"the manifest schema is stale: run `{REGENERATE}`"


def test_the_schema_forbids_extra_keys_but_in_the_data_source():
    schema = json.loads(SCHEMA_PATH.read_text())
    defs = schema["$defs"]
    open_ = sorted(name for name, d in defs.items() if d.get("additionalProperties") is not False)
    assert open_ == ["DataSource"]
    assert schema["additionalProperties"] is False


def _early(**failure) -> RunManifest:
    f = {"stage": "gates", "message": "1 blocking finding(s)", "detail": "", "kind": "submission", "cause": ""}
    return early_manifest({**f, **failure}, bundle_path="/b", seed=3, findings=[
        {"rule": "prism:import", "file": "training.py", "line": 1, "col": 0, "message": "os", "blocking": True}],
        profile=None, version="0.1.0")


def test_an_early_manifest_validates_and_round_trips():
    m = _early()
    d = m.to_json_dict()
    assert d["schema"] == "prism.run.v2" and d["status"] == "failed" and d["score"] is None
    assert d["gates"]["findings"][0]["rule"] == "prism:import"
    assert RunManifest.model_validate(json.loads(json.dumps(d))) == m
    assert _early(stage="cancelled", kind="cancelled").status == "cancelled"


@pytest.mark.parametrize("change,needle", [
    (lambda d: d.update(status="scored"), "scored exactly when no failure"),
    (lambda d: d["failure"].update(kind="cancelled"), "status 'failed' with failure kind 'cancelled'"),
    (lambda d: d.update(surprise=1), "Extra inputs are not permitted"),
    (lambda d: d["bundle"].update(sha256="ABC"), "String should match pattern"),
    (lambda d: d["failure"].update(kind="bundle"), "Input should be 'submission', 'infrastructure' or 'cancelled'"),
    (lambda d: d.update(schema="prism.run.v1"), "Input should be 'prism.run.v2'"),
])
def test_the_manifest_model_refuses(change, needle):
    d = _early().to_json_dict()
    change(d)
    with pytest.raises(ValidationError, match=re.escape(needle)):
        RunManifest.model_validate(d)


def test_a_scored_manifest_needs_every_section():
    d = _early().to_json_dict()
    d.update(status="scored", failure=None, bundle={"path": "/b", "sha256": "0" * 64})
    with pytest.raises(ValidationError, match="a scored manifest lacks data, tokenizer, config"):
        RunManifest.model_validate(d)


# -- cancel hook and events ----------------------------------------------------------------------
def test_a_cancel_event_runs_every_kill_once_within_the_poll_period():
    cancel, killed = threading.Event(), []
    control = RunControl(cancel).start()
    control.on_cancel(lambda: killed.append(("a", time.monotonic())))
    control.on_cancel(lambda: 1 / 0)  # a kill that fails does not stop the others
    control.on_cancel(lambda: killed.append(("b", time.monotonic())))
    time.sleep(3 * POLL_S)
    assert killed == [] and not control.cancelled
    t0 = time.monotonic()
    cancel.set()
    deadline = t0 + 5
    while len(killed) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert [k for k, _ in killed] == ["a", "b"]
    assert killed[-1][1] - t0 < 2 * POLL_S + 0.5
    control.on_cancel(lambda: killed.append(("late", 0)))  # registered after the cancel: runs at once
    control.stop()
    assert [k for k, _ in killed] == ["a", "b", "late"]
    with pytest.raises(EvalFailure) as exc:
        control.check()
    assert (exc.value.stage, exc.value.kind) == ("cancelled", "cancelled")


def test_a_cancel_callable_is_read_too():
    flag = {"stop": False}
    control = RunControl(lambda: flag["stop"])
    assert not control.cancelled
    flag["stop"] = True
    assert control.cancelled and control.cancelled_at is not None


def test_stages_emit_started_and_finished_and_a_broken_callback_never_fails_the_run():
    events = []
    control = RunControl(on_progress=events.append)
    with control.stage("data"):
        pass
    with pytest.raises(ZeroDivisionError):
        with control.stage("gates"):
            1 / 0
    with control.stage("stream", total=10, unit="tokens") as mark:
        mark.failed = True
    assert [(type(e).__name__, e.stage) for e in events] == [
        ("StageStarted", "data"), ("StageFinished", "data"), ("StageStarted", "gates"), ("StageFinished", "gates"),
        ("StageStarted", "stream"), ("StageFinished", "stream")]
    assert [e.ok for e in events if isinstance(e, StageFinished)] == [True, False, False]
    assert events[4] == StageStarted(stage="stream", total=10, unit="tokens")

    def broken(event):
        raise RuntimeError("display gone")

    noisy = RunControl(on_progress=broken)
    with pytest.warns(RuntimeWarning, match="on_progress raised RuntimeError: display gone"):
        noisy.emit(BatchScored(batch=0, targets=1, bytes=1, nats=1.0, targets_so_far=1, bytes_so_far=1,
                               nats_so_far=1.0, bpb_so_far=1.0))
    noisy.emit(StageStarted(stage="data"))  # warned once only: no second warning, no exception


def test_events_are_typed():
    with pytest.raises(ValidationError):
        StageStarted(stage="lunch")
    with pytest.raises(ValidationError):
        BatchScored(batch=-1, targets=1, bytes=1, nats=1.0, targets_so_far=1, bytes_so_far=1, nats_so_far=1.0,
                    bpb_so_far=None)
    assert StageFinished(stage="gates", seconds=1.5, ok=True).model_dump() == {
        "event": "stage_finished", "stage": "gates", "seconds": 1.5, "ok": True}


# -- the library's result for failures before a run directory --------------------------------------
def test_missing_data_is_an_infrastructure_failure_with_its_events(tmp_path):
    from prism_challenge import evaluate
    from prism_challenge.events import RunFinished

    events = []
    result = evaluate(EvalOptions(bundle=str(EXAMPLE), data_dir=str(tmp_path / "nope"), out_dir=str(tmp_path / "o"),
                                  device="cpu"), on_progress=events.append)
    assert (result.status, result.kind, result.failure.stage) == ("failed", "infrastructure", "data")
    assert result.run_dir is None and not (tmp_path / "o").exists()
    assert result.manifest.bundle.path == str(EXAMPLE) and result.manifest.score is None
    assert [(type(e).__name__, getattr(e, "stage", None), getattr(e, "ok", None)) for e in events] == [
        ("StageStarted", "intake", None), ("StageFinished", "intake", True),
        ("StageStarted", "data", None), ("StageFinished", "data", False), ("RunFinished", "data", None)]
    assert isinstance(events[-1], RunFinished) and events[-1].kind == "infrastructure"


def test_a_full_disk_is_an_infrastructure_failure(monkeypatch):
    import errno

    from prism_challenge import api, pipeline

    def full(opts, control):
        raise OSError(errno.ENOSPC, "No space left on device", "/runs/x/model/trained_state.pt")

    monkeypatch.setattr(pipeline, "evaluate", full)
    result = api.evaluate(EvalOptions(bundle="b"))
    assert (result.status, result.kind, result.failure.stage) == ("failed", "infrastructure", "storage")
    assert result.failure.message == "OSError: No space left on device (/runs/x/model/trained_state.pt)"


def test_an_error_the_kill_caused_after_a_cancel_is_a_cancel(monkeypatch):
    from prism_challenge import api, pipeline
    from prism_challenge.evaluator.isolation import IsolationError

    def killed(opts, control):
        raise IsolationError("the run was cancelled: the jail starts no new process")

    monkeypatch.setattr(pipeline, "evaluate", killed)
    result = api.evaluate(EvalOptions(bundle="b"), cancel=lambda: True)
    assert (result.status, result.kind, result.failure.stage) == ("cancelled", "cancelled", "cancelled")
    with pytest.raises(IsolationError):  # without a cancel it is a harness error, not hidden
        api.evaluate(EvalOptions(bundle="b"))
