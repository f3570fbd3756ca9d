"""Runtime-hostile bundles through the whole pipeline: ``evaluate(EvalOptions(isolation="strict"))``.

Each test states the expected outcome of one hostile bundle (issue 5, acceptance). Gates are off
unless the test is about them: these bundles must be stopped by the runtime sandbox itself.

The integration used (evaluate.py): ``EvalOptions.isolation`` ("strict" default, "none"),
``memory_limit_bytes`` (RLIMIT_AS per process), ``max_processes`` (RLIMIT_NPROC of the sandbox
uid); the manifest's ``isolation`` ({"mode", "backend", "guard": {"uid", ...}, ...}) and
``verdict`` (``prism_challenge.score.verdict.Verdict.to_dict()``, the held-out figures in
``verdict["heldout"]``). Tests skip, saying so, where those are missing.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import socket
import tempfile
import time
import uuid
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

import hostile_bundles as hb
from prism_challenge.data.builtin import default_cache_root, ensure_builtin
from prism_challenge.data.manifest import load_manifest
from prism_challenge.pipeline import EvalFailure, EvalOptions, evaluate
from prism_challenge.evaluator import isolation
from prism_challenge.evaluator.sandboxwatch import tasks_of_uid
from prism_challenge.manifest.run_manifest import MANIFEST_NAME, SCHEMA

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
needs_sandbox = pytest.mark.skipif(
    isolation.available_backend() is None,
    reason="no working sandbox backend (install bubblewrap or allow unshare): strict cannot run",
)
V = 257


def write(root: Path, architecture: str, training: str) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "architecture.py").write_text(architecture)
    (root / "training.py").write_text(training)
    (root / "prism.yaml").write_text("tokenizer: bytes\n")
    return root


def run(tmp_path, bundle, name="run", **kw):
    kw.setdefault("run_gates", False)
    kw.setdefault("audit_hooks", False)  # the sandbox by itself (tests/no_way_out: with the hooks)
    kw.setdefault("token_budget", 3000)
    kw.setdefault("seq_len", 64)
    kw.setdefault("threads", 1)
    kw.setdefault("isolation", "strict")
    return evaluate(EvalOptions(bundle=str(bundle), out_dir=str(tmp_path / name), device="cpu", **kw))


def probe(outcome):
    return json.loads((outcome.run_dir / "artifacts" / "probe.json").read_text())


def uniform_bpb(score):
    return math.log2(V) * score["targets"] / score["bytes"]


@pytest.fixture(scope="module")
def public_data_dir():
    """A copy of the default corpus outside /tmp and world-readable (0755/0644): only the
    sandbox's hiding keeps it closed (the real corpus lives under the private cache dir)."""
    src = ensure_builtin()
    base = Path(tempfile.mkdtemp(prefix="prism-e2e-data-", dir="/var/tmp" if os.path.isdir("/var/tmp") else None))
    dst = base / "data"
    shutil.copytree(src, dst)
    for p in [base, *dst.rglob("*")]:
        p.chmod(0o755 if p.is_dir() else 0o644)
    base.chmod(0o755)
    yield dst
    shutil.rmtree(base, ignore_errors=True)


# -- network ----------------------------------------------------------------------------------
@needs_sandbox
def test_opening_a_socket_fails(tmp_path):
    host = socket.socket()
    host.bind(("127.0.0.1", 0))
    host.listen(4)
    try:
        o = run(tmp_path, write(tmp_path / "b", hb.UNIFORM, hb.socket_bundle(host.getsockname()[1])))
        host.setblocking(False)
        with pytest.raises(BlockingIOError):
            host.accept()  # nothing reached the host
    finally:
        host.close()
    assert o.failure is None, o.failure
    p = probe(o)
    assert p["host_loopback"] == "ConnectionRefusedError"  # the sandbox's loopback is its own
    assert p["internet"] != "ok" and p["dns"] != "ok"
    assert o.manifest["isolation"]["mode"] == "strict"


# -- reading data -----------------------------------------------------------------------------
@needs_sandbox
def test_reading_data_heldout_and_cache_files_fails(tmp_path, public_data_dir):
    m = load_manifest(public_data_dir)
    cache = default_cache_root()
    paths = {"manifest": str(public_data_dir / "MANIFEST.json"), "dir:data": str(public_data_dir),
             "dir:cache": str(cache)}
    for split in m.split_names:
        paths[f"shard:{split}"] = str(m.shard_paths(split)[0])
    tokens = cache / "tokens"
    if tokens.is_dir():
        paths["dir:tokens"] = str(tokens)
        for f in sorted(tokens.rglob("*"))[:3]:
            if f.is_file():
                paths[f"token_cache:{f.name}"] = str(f)
    for name, p in paths.items():  # control: all of it is readable outside the sandbox
        assert os.listdir(p) if name.startswith("dir:") else open(p, "rb").read(1), name
    o = run(tmp_path, write(tmp_path / "b", hb.UNIFORM, hb.read_bundle(paths)), data_dir=str(public_data_dir))
    assert o.failure is None, o.failure
    p = probe(o)
    assert set(p) == set(paths)
    for name, got in p.items():
        if name.startswith("dir:"):
            assert got in ("PermissionError", "FileNotFoundError", []), (name, got)
        else:
            assert got in ("PermissionError", "FileNotFoundError"), (name, got)


@needs_sandbox
def test_the_host_outside_the_allow_list_is_absent(tmp_path, public_data_dir):
    """Strict is an allow-list view: the raw text the data was prepared from (world-readable, as
    /work/shared/data/*.jsonl is), another run's directory, the harness checkout but its src dir,
    and the host's home and config are not there at all (not merely unreadable)."""
    var_tmp = "/var/tmp" if os.path.isdir("/var/tmp") else None
    raw_dir = Path(tempfile.mkdtemp(prefix="prism-e2e-raw-", dir=var_tmp))
    try:
        raw_dir.chmod(0o755)
        raw = raw_dir / "train.jsonl"
        raw.write_text('{"text": "the exact train text"}\n')
        raw.chmod(0o644)
        other_run = tmp_path / "other-run"
        (other_run / "artifacts").mkdir(parents=True)
        (other_run / MANIFEST_NAME).write_text("{}")
        paths = {"raw": str(raw), "dir:raw_dir": str(raw_dir), "other_run": str(other_run / MANIFEST_NAME),
                 "dir:other_run": str(other_run), "repo_pyproject": str(REPO / "pyproject.toml"),
                 "dir:repo_tests": str(REPO / "tests"), "dir:data": str(public_data_dir),
                 "dir:shared_data": str(REPO.parent / "shared" / "data"), "etc_shadow": "/etc/shadow",
                 "dir:home": "/home", "dir:srv": "/srv", "dir:var_lib": "/var/lib", "dir:opt": "/opt"}
        o = run(tmp_path, write(tmp_path / "b", hb.UNIFORM, hb.read_bundle(paths)), data_dir=str(public_data_dir))
    finally:
        shutil.rmtree(raw_dir, ignore_errors=True)
    assert o.failure is None, o.failure
    p = probe(o)
    assert set(p) == set(paths)
    for name, got in p.items():
        assert got == "FileNotFoundError", (name, got)


# -- writing outside the artifacts directory --------------------------------------------------
@needs_sandbox
def test_writing_outside_the_artifacts_directory_fails(tmp_path, public_data_dir):
    run_dir = tmp_path / "run"
    bundle = tmp_path / "b"
    var_tmp = Path("/var/tmp") / f"prism-e2e-evil-{uuid.uuid4().hex}.txt"
    targets = {
        "run_dir": str(run_dir / "planted.txt"),
        "run_manifest": str(run_dir / MANIFEST_NAME),
        "bundle": str(bundle / "evil.py"),
        "data": str(public_data_dir / "evil.txt"),
        "cache": str(default_cache_root() / "evil.txt"),
        "repo": str(REPO / "evil.txt"),
        "host_tmp": str(tmp_path / "outside.txt"),
        "var_tmp": str(var_tmp),
        "etc": "/etc/prism-evil.txt",
    }
    o = run(tmp_path, write(bundle, hb.UNIFORM, hb.write_bundle_src(targets)), data_dir=str(public_data_dir))
    assert o.failure is None, o.failure
    p = probe(o)
    assert p["inside"] == "ok" and (o.run_dir / "artifacts" / "inside.txt").read_text() == "ok"
    for name, path in targets.items():
        assert p[name] in ("PermissionError", "OSError", "FileNotFoundError"), (name, p[name])
        assert name == "run_manifest" or not Path(path).exists(), name
    assert json.loads((run_dir / MANIFEST_NAME).read_text())["schema"] == SCHEMA  # the harness's own


# -- resource bombs ---------------------------------------------------------------------------
@needs_sandbox
def test_fork_bomb_is_contained_and_reported(tmp_path):
    o = run(tmp_path, write(tmp_path / "b", hb.UNIFORM, hb.FORK_BOMB), max_processes=128)
    assert o.failure is not None
    assert "process limit" in o.failure.message, o.failure
    uid = (o.manifest["isolation"].get("guard") or {}).get("uid")
    if uid is not None:  # nothing of the sandbox survives the run (zombies are reaped by the host)
        deadline = time.monotonic() + 30
        while tasks_of_uid(uid) != (0, 0) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert tasks_of_uid(uid) == (0, 0)


@needs_sandbox
def test_memory_bomb_is_contained_and_reported(tmp_path):
    o = run(tmp_path, write(tmp_path / "b", hb.UNIFORM, hb.MEMORY_BOMB), memory_limit_bytes=3 << 30)
    assert o.failure is not None and o.failure.stage == "resources", o.failure  # named as the limit it is
    assert o.failure.message.startswith("memory: the process ran out of its memory limit of 3,221,225,472 bytes: ")
    assert any(s in o.failure.message for s in ("allocate memory", "MemoryError", "out of memory")), o.failure


# -- time -------------------------------------------------------------------------------------
def test_infinite_loop_in_train_is_stopped_by_the_watchdog_and_scored(tmp_path):
    o = run(tmp_path, write(tmp_path / "b", hb.UNIFORM, hb.INFINITE_LOOP), wall_clock_budget=20, token_budget=None)
    assert o.failure is None, o.failure
    st, s = o.manifest["stream"], o.manifest["score"]
    assert st["stop_reason"] == "wall_clock_budget" and st["batches"] == 3
    assert s["targets"] == 3 * 2 * 15
    assert s["prequential_bpb"] == pytest.approx(uniform_bpb(s), rel=1e-6)  # what was scored is scored


def test_a_loop_that_never_calls_the_iterator_fails_clearly(tmp_path):
    o = run(tmp_path, write(tmp_path / "b", hb.UNIFORM, hb.NEVER_ITERATES))
    assert o.failure is not None and o.failure.stage == "contract"
    assert "never iterated" in o.failure.message


# -- planted files ----------------------------------------------------------------------------
@needs_sandbox
def test_planted_pickle_and_manifest_are_ignored(tmp_path):
    marker = tmp_path / "pwned"
    run_dir = tmp_path / "run"
    outside = {"run_state": str(run_dir / "model" / "trained_state.pt"), "run_dir_state": str(run_dir / "trained_state.pt")}
    o = run(tmp_path, write(tmp_path / "b", hb.UNIFORM, hb.planted_bundle(str(marker), outside)))
    assert o.failure is None, o.failure
    p = probe(o)
    assert p["trained_state.pt"] == "ok" and p["artifacts_manifest"] == "ok"  # planted inside artifacts
    assert p["run_state"] != "ok" and p["run_dir_state"] != "ok"
    assert not marker.exists()  # no pickle of the submission was ever loaded
    m = json.loads((run_dir / MANIFEST_NAME).read_text())
    assert m["schema"] == SCHEMA and m["status"] == "scored"
    assert m["score"]["prequential_bpb"] == pytest.approx(uniform_bpb(m["score"]), rel=1e-6)
    assert "prism_run_manifest.v2.json" in m["discarded_files"]
    assert not (o.run_dir / "artifacts" / MANIFEST_NAME).exists()
    ho = m["verdict"]["heldout"]
    assert ho is not None, m["verdict"]
    # the held-out model is the harness's copy of the scored weights (uniform), not the planted pickle
    assert ho["val_bpb_trained"] == pytest.approx(math.log2(V) * ho["targets"] / ho["bytes"], rel=1e-6)
    assert ho["heldout_delta"] == pytest.approx(0.0, abs=1e-9)


# -- monkeypatching ---------------------------------------------------------------------------
@pytest.mark.parametrize("patch", sorted(hb.PATCHES))
def test_monkeypatching_is_rejected_by_the_gates_or_changes_nothing(tmp_path, patch):
    loop = hb.PATCH_LOOP.replace("{patch}", hb.PATCHES[patch])
    bundle = write(tmp_path / "b", hb.UNIFORM, loop)
    try:
        o = run(tmp_path, bundle, run_gates=True)
        failure = o.failure
    except EvalFailure as exc:  # the gates refuse before a run directory exists
        failure = exc
    if failure is not None:
        assert failure.stage == "gates", failure
        rules = ("prism:no-monkeypatch", "prism:no-introspection", "prism:ctx-private", "prism:import-not-allowed")
        patch_lines = {i + 1 for i, line in enumerate(loop.splitlines())
                       if line.strip() and line.strip() in hb.PATCHES[patch]}
        hits = [ln for ln in failure.detail.splitlines() if ln.startswith("training.py:")
                and int(ln.split(":")[1]) in patch_lines and any(r in ln for r in rules)]
        assert hits, failure.detail
    else:  # not refused: then the recorded loss must be the honest one
        s = o.manifest["score"]
        assert s["prequential_bpb"] == pytest.approx(uniform_bpb(s), rel=1e-6)


# -- smuggled knowledge -----------------------------------------------------------------------
def train_stream_ids(n_bytes: int) -> tuple[np.ndarray, bytes]:
    """The first stream tokens (EOT doc EOT doc ...) and the docs' bytes, from the shards directly."""
    m = load_manifest(ensure_builtin())
    ids, raw = [256], b""
    for path in m.shard_paths("train"):
        for text in pq.read_table(path, columns=["text"]).column("text").to_pylist():
            b = text.encode("utf-8")
            ids += list(b) + [256]
            raw += b + b"\x00"  # a separator that never occurs in text: contexts never span documents
            if len(raw) >= n_bytes:
                return np.array(ids), raw[:n_bytes]
    return np.array(ids), raw


def test_baked_in_knowledge_is_zeroed(tmp_path):
    ids, raw = train_stream_ids(32_000)
    arch = hb.baked_architecture(raw)
    scope: dict = {}
    exec(compile(arch, "baked_architecture", "exec"), scope)  # the bundle's own model, in this process
    model = scope["Baked"](V)
    b, t = 8, 128
    first = torch.from_numpy(ids[: b * (t - 1) + 1])
    rows = first.unfold(0, t, t - 1)  # overlapping rows, as the feeder cuts them
    with torch.no_grad():
        logp = torch.log_softmax(model(rows)[:, :-1].float(), dim=-1)
        expected = float(-logp.gather(-1, rows[:, 1:].unsqueeze(-1)).double().sum()) / (b * (t - 1))
    assert expected < 0.5 * math.log(V)  # knowledge at step 0: the anomaly must fire
    loop = hb.training(f"stream(ctx, batch_size={b}, seq_len={t})")
    o = run(tmp_path, write(tmp_path / "b", arch, loop), seq_len=t, token_budget=3 * b * (t - 1) + 1)
    assert o.failure is None, o.failure
    v = o.manifest["verdict"]
    assert v["first_batch_nats_per_target"] == pytest.approx(expected, rel=1e-6)
    assert v["anomaly_flagged"] and v["anti_cheat_multiplier"] == 0.0 and "anomaly" in v["flags"]
    assert v["final_score"] == 0.0


def test_honest_run_has_a_full_verdict(tmp_path):
    o = run(tmp_path, write(tmp_path / "b", hb.UNIFORM, hb.training("stream(ctx)")))
    assert o.failure is None, o.failure
    v, s = o.manifest["verdict"], o.manifest["score"]
    assert not v["anomaly_flagged"] and v["anti_cheat_multiplier"] == 1.0
    assert v["first_batch_nats_per_target"] == pytest.approx(math.log(V), rel=1e-6)
    assert v["final_score"] == pytest.approx(v["memorization_penalty"] / (1 + s["prequential_bpb"]), rel=1e-12)
    ho = v["heldout"]
    assert ho["val_bpb_twin"] == pytest.approx(math.log2(V) * ho["targets"] / ho["bytes"], rel=1e-6)


# -- modes ------------------------------------------------------------------------------------
def test_isolation_none_is_flagged_in_the_manifest(tmp_path):
    o = run(tmp_path, write(tmp_path / "b", hb.UNIFORM, hb.training("stream(ctx)")), isolation="none")
    assert o.failure is None, o.failure
    assert o.manifest["isolation"]["mode"] == "none"


def test_strict_without_a_backend_fails_closed(tmp_path, monkeypatch):
    # every backend's probe fails (as on a host without bubblewrap and without user namespaces)
    monkeypatch.setattr(isolation, "_probe_cached", lambda backend: (False, "disabled by the test"))
    assert isolation.available_backend() is None
    bundle = write(tmp_path / "b", hb.UNIFORM, hb.training("stream(ctx)"))
    try:
        o = run(tmp_path, bundle)
        failure = o.failure
    except Exception as exc:  # noqa: BLE001 - EvalFailure before the run directory exists is fine too
        failure = exc
    assert failure is not None and "bubblewrap" in str(failure) and "--isolation none" in str(failure)


# -- planted bytecode -------------------------------------------------------------------------
PLAIN_LOOP = """
def train(ctx):
    model = ctx.build_model()
    for batch in ctx.iter_train_batches(model, batch_size=2, seq_len=16):
        pass
"""


def plant_bytecode(bundle: Path, module: str, source: str) -> None:
    """Put ``source``, compiled as an unchecked-hash .pyc, where Python looks for ``module``'s
    bytecode: it would be loaded whatever ``module.py`` says."""
    import importlib.util
    import py_compile

    hidden = bundle.parent / f"hidden_{module}.py"
    hidden.write_text(source)
    py_compile.compile(str(hidden), cfile=importlib.util.cache_from_source(str(bundle / f"{module}.py")),
                       dfile=f"{module}.py", invalidation_mode=py_compile.PycInvalidationMode.UNCHECKED_HASH,
                       doraise=True)


@needs_sandbox
def test_bytecode_planted_beside_the_checked_source_never_runs(tmp_path, monkeypatch):
    import subprocess
    import sys

    import prism_challenge.pipeline as ev

    bundle = write(tmp_path / "b", hb.UNIFORM, PLAIN_LOOP)
    plant = [("training", "def train(ctx):\n    raise RuntimeError('planted training bytecode ran')\n"),
             ("architecture", "def build_model(ctx):\n    raise RuntimeError('planted architecture ran')\n")]
    for module, source in plant:
        plant_bytecode(bundle, module, source)
    # the planted files are real: a plain import of the bundle runs them
    seen = subprocess.run([sys.executable, "-c", "import sys; sys.path.insert(0, '.'); import training; training.train(0)"],
                          cwd=bundle, capture_output=True, text=True)
    assert "planted training bytecode ran" in seen.stderr
    with pytest.raises(ev.EvalFailure) as refused:  # intake refuses a bundle that ships bytecode
        run(tmp_path, bundle, name="refused", run_gates=True)
    assert refused.value.stage == "intake" and refused.value.message.startswith("prism:bytecode: __pycache__/")
    # planted into the frozen copy once intake passed (only the trusted side could): the gates'
    # parameter child, every rank and the held-out child still read the source
    shutil.rmtree(bundle / "__pycache__")
    from prism_challenge.intake import frozen as frozen_mod

    real_freeze, real_gates = ev.freeze, ev.start.static_gates  # the gates stage calls start.static_gates
    seen_by_check = {"update": True}
    frozen_copies = []

    def freeze_and_keep(*a, **k):
        frozen_copies.append(real_freeze(*a, **k))
        return frozen_copies[-1]

    def gates_then_plant(opts, root):  # after the gates read the copy: the ranks import it next
        gated = real_gates(opts, root)
        fb = frozen_copies[-1]
        os.chmod(fb.root, 0o755)
        for module, source in plant:
            plant_bytecode(fb.root, module, source)
        if seen_by_check["update"]:  # hide the plant from the after-run check: the loader alone
            fb.at_intake = frozen_mod.snapshot(fb.root)
        return gated

    monkeypatch.setattr(ev, "freeze", freeze_and_keep)
    monkeypatch.setattr(ev.start, "static_gates", gates_then_plant)
    o = run(tmp_path, bundle, run_gates=True, heldout_bytes=30000)
    assert o.failure is None, o.failure
    s = o.manifest["score"]
    assert s["prequential_bpb"] == pytest.approx(uniform_bpb(s), rel=1e-6)
    assert o.manifest["verdict"]["heldout"] is not None, o.manifest["verdict"]["heldout_error"]
    # and the after-run check names a copy that changed since intake
    seen_by_check["update"] = False
    o = run(tmp_path, bundle, name="changed", run_gates=True, heldout_bytes=0)
    assert o.failure is not None and o.failure.stage == "contract"
    assert o.failure.message.startswith("the frozen bundle changed during the run: __pycache__")

