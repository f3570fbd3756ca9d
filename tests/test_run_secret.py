"""Issue 25, items 1 and 2: every draw keyed on a per-run secret that no one can compute in
advance, revealed in the manifest after the run; and the harmonic audit schedule, whose escape
bound ``(1 - f)^A`` holds at whatever batch the loop stops."""
import hashlib
import hmac
import json
import math
import secrets
import sys
from pathlib import Path

import numpy as np
import pytest

from prism_challenge import pipeline
from prism_challenge.intake.bundle import load_bundle
from prism_challenge.cli import main as prism
from prism_challenge.evaluator.auditplan import (
    AUDITED_BATCHES,
    audit_draw,
    drawn_steps,
    escape_bound,
    is_audited,
    rate_at,
)
from prism_challenge.pipeline import EvalOptions, evaluate, run_secret
from prism_challenge.manifest.results import RunManifest

from helpers import EXAMPLE

sys.path.insert(0, str(Path(__file__).parent / "rescore_bundles"))
from assemble import bundle  # noqa: E402

S1, S2 = bytes(range(32)), bytes(range(32, 64))


# -- the secret ---------------------------------------------------------------------------------
def test_the_secret_is_the_given_one_or_fresh_from_secrets_and_nothing_else(tmp_path, monkeypatch):
    data = tmp_path / "d"
    data.mkdir()
    (tmp_path / "d.salt").write_text("ab" * 32 + "\n")  # DIR.salt, which the old key read
    opts = EvalOptions(bundle=str(EXAMPLE), data_dir=str(data))
    assert run_secret(EvalOptions(bundle=str(EXAMPLE), run_secret=S1)) == S1
    a, b = run_secret(opts), run_secret(opts)
    assert len(a) == len(b) == 32 and a != b  # two runs, two secrets
    drawn = []
    monkeypatch.setattr(pipeline.start.secrets, "token_bytes", lambda n: drawn.append(n) or b"\x07" * n)
    # exactly the draw: no data directory, salt, path, bundle hash or seed mixed in
    assert run_secret(opts) == b"\x07" * 32 == run_secret(EvalOptions(bundle=str(EXAMPLE), seed=9))
    assert drawn == [32, 32]
    assert not hasattr(pipeline, "_probe_key") and not hasattr(pipeline.start, "_probe_key")


def test_the_service_never_sets_a_run_secret(tmp_path):
    from prism_challenge.profiles import load_profile
    from prism_challenge.service.worker import options_for

    for name in ("local", "prism-v2"):
        assert options_for(load_profile(name), EXAMPLE, tmp_path / name).run_secret is None


def test_no_module_keys_a_draw_on_a_path_or_a_salt():
    src = Path(pipeline.__file__).parents[1]
    for name in (*(f"pipeline/{p.name}" for p in (src / "pipeline").glob("*.py")), "evaluator/feeder.py",
                 "audit/rescore.py", "audit/auditstage.py", "audit/heldout.py", "audit/heldout_parent.py",
                 "audit/heldout_child.py",
                 "score/gapnoise.py", "audit/blindprobe.py"):
        text = (src / name).read_text()
        assert "salt_path.read" not in text and "str(data_root).encode()" not in text, name
        assert "SystemRandom" not in text, name  # no second, unrevealed source of draws


def test_the_heldout_blind_probes_are_drawn_from_the_secret_not_the_seed():
    from prism_challenge.audit.blindprobe import blind_probes

    rng = np.random.default_rng(3)
    batches = [rng.integers(0, 97, (8, 64)).astype(np.int64) for _ in range(12)]
    picks = lambda key: [(b, row, k) for b, row, k, _ in blind_probes(batches, key, 97)]  # noqa: E731
    assert picks(S1) == picks(S1) and picks(S1) != picks(S2)
    assert [b for b, _, _ in picks(S1)] == [b for b, _, _ in picks(S2)]  # the batches: spread over the prefix


def test_the_cli_takes_a_run_secret_of_64_hex_digits(capsys):
    from prism_challenge.cli_eval import _run_secret

    assert _run_secret(S1.hex()) == S1 and _run_secret(S1.hex().upper()) == S1
    for bad in ("xyz", S1.hex()[:-2], S1.hex() + "00", "g" * 64):
        with pytest.raises(SystemExit) as exc:
            prism(["eval", str(EXAMPLE), "--run-secret", bad])
        assert exc.value.code == 2
        assert "a run secret is 64 hex digits" in capsys.readouterr().err
    assert prism(["eval", str(EXAMPLE), "--run-secret", S1.hex(), "--repeats", "2"]) == 2
    assert "--run-secret repeats one run: not with --seeds or --repeats" in capsys.readouterr().err


def test_manifests_without_a_secret_or_a_schedule_still_validate():
    old = json.loads((Path(__file__).parent / "data" / "scored_manifest.v2.json").read_text())
    assert "run_secret" not in old
    RunManifest.model_validate(old)
    new = {**old, "run_secret": S1.hex()}
    if new.get("audit"):
        new["audit"] = {**new["audit"], "schedule": {"rule": "harmonic", "audited_batches": 4}}
    assert RunManifest.model_validate(new).run_secret == S1.hex()
    with pytest.raises(ValueError):
        RunManifest.model_validate({**old, "run_secret": "ab" * 31})


# -- the harmonic schedule's bound, measured -------------------------------------------------------
def _escape_rate(first: int, stop: int, trials: int, audited: int, seed: int) -> tuple[float, float]:
    """The measured escape rate of a cheat on batches ``first .. stop - 1`` over ``trials`` random
    secrets, and the exact one, ``prod (1 - r_k)``."""
    rng = np.random.default_rng(seed)
    escapes = 0
    for _ in range(trials):
        key = rng.bytes(32)
        escapes += not any(is_audited(key, k, audited) for k in range(first, stop))
    return escapes / trials, math.prod(1 - rate_at(k, audited) for k in range(first, stop))


def _old_schedule(key: bytes, step: int, expected: int, audited: int = 20) -> bool:
    """The schedule before issue 25: batch 0, then a rate ``(A - 1) / (N - 1)`` fixed from the
    budget's batch count ``N`` (kept here only to measure the early stop against it)."""
    return step == 0 or audit_draw(key, step) < (audited - 1) / (expected - 1)


def test_a_cheat_that_stops_early_escapes_no_more_than_the_bound():
    # the early stop: 40 of 646 batches taken, cheating on all but batch 0
    rng = np.random.default_rng(1)
    keys = [rng.bytes(32) for _ in range(3000)]
    old = sum(not any(_old_schedule(k, s, 646) for s in range(1, 40)) for k in keys) / len(keys)
    assert old == pytest.approx((1 - 19 / 645) ** 39, abs=0.03)  # about a third escaped
    new = sum(not any(is_audited(k, s) for s in range(1, 40)) for k in keys) / len(keys)
    assert new == 0.0  # batches 1 .. A are audited with rate 1
    # the cheat limited to the first 40 batches, on its last half (f = 1/2 of the 40 taken)
    measured, exact = _escape_rate(20, 40, 3000, AUDITED_BATCHES, seed=2)
    sigma = math.sqrt(exact * (1 - exact) / 3000)
    assert measured <= escape_bound(0.5) + 3 * sigma and abs(measured - exact) <= 4 * sigma + 1e-9
    print(f"early stop at 40 of 646: old schedule escape {old:.3f}, harmonic {new:.3f}; "
          f"f = 1/2 of 40: measured {measured:.4f}, exact {exact:.4f}, bound {escape_bound(0.5):.4f}")


@pytest.mark.parametrize("n", [10, 40, 197, 1000, 50_000])
@pytest.mark.parametrize("f", [0.5, 0.25, 0.1])
def test_a_cheat_on_the_last_f_n_batches_escapes_no_more_than_the_bound(n, f):
    m = max(1, round(f * n))
    trials = 400 if n * f > 2000 else 2000
    measured, exact = _escape_rate(n - m, n, trials, AUDITED_BATCHES, seed=n)
    bound = escape_bound(m / n)
    sigma = math.sqrt(max(bound * (1 - bound), 1e-12) / trials)
    assert exact <= bound + 1e-12
    assert measured <= bound + 3 * sigma, (n, f, measured, bound)
    print(f"n {n}, f {f}: escape measured {measured:.4f} over {trials} secrets, exact {exact:.4f}, bound {bound:.4f}")


# -- real runs ------------------------------------------------------------------------------------
def _run(tmp_path, root, name, **kw):
    opts = dict(token_budget=6_000, heldout_bytes=10_000, device="cpu", threads=1)
    opts.update(kw)
    return evaluate(EvalOptions(bundle=str(root), out_dir=str(tmp_path / name), **opts))


def _audited_steps(manifest):
    return [b["step"] for b in manifest["audit"]["batches"]]


@pytest.mark.slow
def test_two_secrets_give_the_same_score_and_different_draws(tmp_path):
    a = _run(tmp_path, EXAMPLE, "a", run_secret=S1)
    b = _run(tmp_path, EXAMPLE, "b", run_secret=S2)
    assert a.failure is None and b.failure is None
    ma, mb = a.manifest, b.manifest
    assert ma["score"]["prequential_bpb"] == mb["score"]["prequential_bpb"]  # to the last bit
    assert ma["curve"] == mb["curve"] and ma["stream"]["batches"] == mb["stream"]["batches"]
    n = ma["stream"]["batches"]
    assert ma["run_secret"] == S1.hex() and mb["run_secret"] == S2.hex()
    for m, key in ((ma, S1), (mb, S2)):  # the revealed secret re-derives exactly the audited steps
        assert _audited_steps(m) == drawn_steps(key, n, m["audit"]["schedule"]["audited_batches"])
        assert m["audit"]["schedule"] == {"rule": "harmonic", "audited_batches": AUDITED_BATCHES}
        assert m["audit"]["passed"] and "loop_stopped" not in m["verdict"]["flags"]
        RunManifest.model_validate(m)
    assert _audited_steps(ma) != _audited_steps(mb)


SEARCH_LOOP = '''
import gc, json, os, stat, sys
import torch
import torch.nn.functional as F

MASK, MASKED = {mask!r}, {masked!r}  # the secret XOR a mask: the bundle's files do not hold it


def _hits(data, where, found, raw, hexa):
    if isinstance(data, str):
        data = data.encode("utf-8", "replace")
    if hexa in data.lower() or raw in data:
        found.append(where)


def search(ctx):
    raw = bytes(a ^ b for a, b in zip(bytes.fromhex(MASK), bytes.fromhex(MASKED)))
    hexa = raw.hex().encode()
    found, scanned = [], []
    _hits = lambda data, where, found, h=globals()["_hits"]: h(data, where, found, raw, hexa)  # noqa: E731
    _hits(json.dumps(dict(os.environ)), "environ", found)
    _hits(" ".join(sys.argv), "argv", found)
    _hits(repr(vars(ctx)) if hasattr(ctx, "__dict__") else repr(ctx), "ctx", found)
    for obj in gc.get_objects():  # every container in this process's memory, and what it holds
        try:
            items = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, (list, tuple)) else ()
            for v in items:
                if isinstance(v, (str, bytes, bytearray)):
                    _hits(bytes(v) if not isinstance(v, str) else v, "memory", found)
        except Exception:
            pass
    roots = ["/proc", "/tmp", "/var/tmp", "/dev/shm", "/run", os.path.expanduser("~"), os.getcwd(),
             ctx.artifacts_dir, os.path.dirname(os.path.abspath(__file__)), "/etc"]
    for root in roots:
        if root in ("/", "~", ""):
            continue
        for dirpath, dirnames, files in os.walk(root):
            dirnames[:] = [d for d in dirnames if d not in ("fd", "fdinfo", "task", "map_files", "net")]
            if dirpath.startswith("/proc/") and dirpath.count("/") > 3:
                dirnames[:] = []
            for name in files:
                path = os.path.join(dirpath, name)
                if name in ("kmsg", "kcore", "mem", "pagemap", "clear_refs"):
                    continue
                try:
                    if not stat.S_ISREG(os.stat(path).st_mode):
                        continue  # a FIFO or a device could block the read
                    with open(path, "rb") as fh:
                        data = fh.read(1 << 20)
                except OSError:
                    continue
                scanned.append(path)
                _hits(data, path, found)
    return found, scanned


def train(ctx):
    found, scanned = search(ctx)
    canary = any("CANARY" in p for p in scanned)
    with open(os.path.join(ctx.artifacts_dir, "found.json"), "w") as fh:
        json.dump({{"found": found, "scanned": len(scanned), "canary": canary}}, fh)
    print("secret search:", found, len(scanned), canary, flush=True)
    model = ctx.build_model().to(ctx.device)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for batch in ctx.iter_train_batches(model, batch_size=4, seq_len=64):
        logits = model(batch.tokens)
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), batch.tokens[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
'''


@pytest.mark.slow
def test_the_secret_is_nowhere_the_sandbox_can_look(tmp_path, monkeypatch):
    secret = secrets.token_bytes(32)
    root = bundle("honest", tmp_path)
    mask = secrets.token_bytes(32)
    masked = bytes(x ^ y for x, y in zip(secret, mask))
    (root / "training.py").write_text(SEARCH_LOOP.format(mask=mask.hex(), masked=masked.hex()))
    (root / "CANARY.txt").write_text("a file the search must read: it proves the search ran")
    sent = []  # what the trusted side hands to the sandbox: configurations and environments
    from prism_challenge.evaluator import feeder, launcher
    from prism_challenge.pipeline import finish

    real_feeder, real_child, real_launch = feeder.Feeder, finish.child_config, launcher.launch
    monkeypatch.setattr(feeder, "Feeder", lambda *a, **kw: sent.append(a[2]) or real_feeder(*a, **kw))
    monkeypatch.setattr(finish, "child_config", lambda *a, **kw: sent.append(real_child(*a, **kw)) or sent[-1])
    monkeypatch.setattr(launcher, "launch", lambda n, env, *a, **kw: sent.append(env) or real_launch(n, env, *a, **kw))
    out = _run(tmp_path, root, "run", run_secret=secret, run_gates=False, audit_hooks=False, token_budget=3_000)
    assert out.failure is None, out.failure
    assert out.manifest["run_secret"] == secret.hex()  # revealed once the run ended ...
    report = json.loads((out.run_dir / "artifacts" / "found.json").read_text())
    assert report["canary"] and report["scanned"] > 100 and report["found"] == []  # ... never seen inside
    assert len(sent) == 3 and secret.hex() not in json.dumps(sent, default=str)
    for path in out.run_dir.rglob("*"):  # the artifacts, the log, the audit's inputs: all but the manifest
        if path.is_file() and path.name != "prism_run_manifest.v2.json":
            data = path.read_bytes()
            assert secret.hex().encode() not in data and secret not in data, path


PLAN_LOOP = '''
"""Peek at the next token only on the batches of PLAN, and stop after STOP batches."""
import torch
import torch.nn.functional as F

PLAN = {plan!r}
STOP = {stop!r}
NONCE = {nonce!r}


def train(ctx):
    model = ctx.build_model().to(ctx.device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    model.peek = 0 in PLAN
    for i, batch in enumerate(ctx.iter_train_batches(model, batch_size=4, seq_len=64)):
        logits = model(batch.tokens)
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), batch.tokens[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        model.peek = (i + 1) in PLAN
        if STOP is not None and i + 1 >= STOP:
            break
'''


def _old_key(data_root: Path, sha: str, seed: int) -> bytes:
    """The key before issue 25 (``pipeline._probe_key``) where the data directory has no salt:
    the data directory's path, known to anyone."""
    return hmac.new(str(data_root).encode(), f"probe:{sha}:{seed}".encode(), hashlib.sha256).digest()


@pytest.mark.slow
def test_a_loop_tuned_offline_to_the_old_schedule_is_caught(tmp_path):
    from prism_challenge.data.builtin import ensure_builtin

    data_root, seed, budget = ensure_builtin(), EvalOptions(bundle=str(EXAMPLE)).seed, 12_000
    batches = math.ceil((budget - 1) / (4 * 63))  # the budget's batch count, as the old rate took it
    plan = [1, 2, 3, 5, 8, 13, 21, 30]
    root = bundle("loop_switch", tmp_path)  # its model answers the in-process probe from a cache
    for nonce in range(100_000):  # grind a nonce until the old schedule audits none of the plan
        (root / "training.py").write_text(PLAN_LOOP.format(plan=plan, stop=None, nonce=nonce))
        key = _old_key(data_root, load_bundle(root).sha256, seed)
        if not any(_old_schedule(key, s, batches) for s in plan):
            break
    else:
        pytest.fail("no nonce found")
    out = _run(tmp_path, root, "run", token_budget=budget, heldout_bytes=20_000)
    assert out.failure is None, out.failure
    m = out.manifest
    assert not m["audit"]["passed"] and m["verdict"]["final_score"] == 0.0 and "audit" in m["verdict"]["flags"]
    assert m["audit"]["mismatch"].startswith("audited batch ")
    print(f"tuned to the old schedule (nonce {nonce}): {m['score']['prequential_bpb']:.4f} bpb, "
          f"caught: {m['audit']['mismatch']}")


@pytest.mark.slow
def test_a_peeking_loop_that_stops_after_a_few_batches_is_caught_and_flagged(tmp_path):
    root = bundle("loop_switch", tmp_path)
    (root / "training.py").write_text(PLAN_LOOP.format(plan=list(range(1, 8)), stop=8, nonce=0))
    out = _run(tmp_path, root, "run", token_budget=12_000, heldout_bytes=20_000)
    assert out.failure is None, out.failure
    m = out.manifest
    assert m["stream"]["stop_reason"] == "loop_stopped" and m["stream"]["batches"] == 8
    assert "loop_stopped" in m["verdict"]["flags"]
    assert m["stream"]["tokens"] < 0.99 * 12_000 and "short" in m["verdict"]["flags"]  # ranked in the lower tier
    assert not m["audit"]["passed"] and m["verdict"]["final_score"] == 0.0
    assert _audited_steps(m) == drawn_steps(bytes.fromhex(m["run_secret"]), 8, AUDITED_BATCHES)
