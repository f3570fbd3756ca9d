"""Shared fixtures of the dispatcher's tests on Ray (tests/test_service_dispatch.py,
tests/test_service_multinode.py): the fixture data directory, the test profile (it confirms a
top submission on 2 runs in all: issue 29), the tiny bundle (folder and zip) and its direct
``evaluate()`` result on any seed (each service run draws its own secret seed); a fresh
database, blob store and dispatchers per test; waiting and counting helpers."""

from __future__ import annotations

import io
import time
import zipfile
from pathlib import Path

import pytest
from fixtures_data import make_rows, write_jsonl, write_salt
from sqlalchemy import func, select

from prism_challenge import EvalOptions, evaluate
from prism_challenge.manifest.certificate import create_key_file
from prism_challenge.data.prepare import prepare
from prism_challenge.profiles import load_profile
from prism_challenge.service.blobs import BlobStore
from prism_challenge.service.dispatch import Dispatcher
from prism_challenge.service.models import Attempt, Run
from prism_challenge.service.settings import default_signing_key_file
from prism_challenge.service.store import Store
from prism_challenge.service.worker import ACTOR_PREFIX, NAMESPACE, actor_name

from helpers import REPO, write_bundle

ray = pytest.importorskip("ray")

HOTKEY = "5GrwvaEF5zXb26Fz9rcQpDWS57CtERHpNehXCPcNoHGKutQY"
PROFILE = "fleet-test"
FINAL = ("completed", "failed", "rejected")
PROFILE_TOML = """schema = "prism.profile.v1"
name = "fleet-test"
version = 1
description = "a tiny CPU run on fixture data for the dispatcher's tests"

[data]
source = "files"

[tokenizers]
allowed = ["bytes"]

[run]
seq_len = 128
nproc = 1
device = "cpu"
seed = 1234
threads = 1
max_parameters = 1_000_000

[budgets]
token_budget = 4096

[heldout]
bytes = 4000

[policy]
confirm_runs = 2              # a top submission gets one confirmation run (the default 3: twice the tests' time)
"""


TRIVIAL = REPO / "bench" / "bundles" / "trivial" / "architecture.py"


def operator_key() -> None:
    """The operator's signing key in the test session's state directory, as ``prism serve`` makes
    it at start (a dispatcher started alone finds none: every run would fail at stage config)."""
    from prism_challenge.manifest.certificate import create_key_file
    from prism_challenge.service.settings import default_signing_key_file

    if not default_signing_key_file().exists():
        create_key_file(default_signing_key_file())


def fixture_data(root: Path) -> Path:
    """The prepared fixture data directory under ``root`` (400 generated documents)."""
    src = write_jsonl(root / "docs.jsonl", make_rows(400, seed=11))
    data = root / "data"
    prepare([src], data, salt_file=write_salt(root / "salt"))
    return data


def trivial_bundle(folder: Path, lr: float = 0.05) -> tuple[Path, bytes]:
    """The tiny bundle (bench/bundles/trivial's model, batches of 4 x 128 tokens, SGD at
    ``lr``) written in ``folder``, and its zip."""
    bundle = write_bundle(folder, TRIVIAL.read_text(), batch=4, seq_len=128, lr=lr)
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        for f in sorted(bundle.iterdir()):
            z.write(f, f.name)
    return bundle, buf.getvalue()


def direct_evaluate(bundle: Path, data: Path, profile, out_dir: Path, seed: int | None = None):
    """``evaluate()`` of ``bundle`` under ``profile`` as the service runs it (strict isolation),
    in this process, on ``seed`` (``None``: the profile's); asserts it scored."""
    t0 = time.monotonic()
    options = {**profile.options, "seed": profile.options["seed"] if seed is None else seed}
    overridden = [] if seed is None or seed == profile.options["seed"] else ["seed"]
    direct = evaluate(EvalOptions(bundle=str(bundle), data_dir=str(data), out_dir=str(out_dir), isolation="strict",
                                  profile=profile, profile_overridden=overridden, **options))
    assert direct.status == "scored", direct.failure
    print(f"direct evaluate(): {time.monotonic() - t0:.1f} s")
    return direct


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """The fixture data directory, the profile, the tiny bundle (folder and zip) and its direct
    ``evaluate()`` result on a seed (``world["direct"](seed)``, each seed run once)."""
    operator_key()
    root = tmp_path_factory.mktemp("fleet")
    key = default_signing_key_file()  # the operator's key, which prism serve creates at start (publish_key)
    if not key.exists():
        create_key_file(key)
    data = fixture_data(root)
    (root / "fleet-test.toml").write_text(PROFILE_TOML)
    profile = load_profile(str(root / "fleet-test.toml"))
    bundle, zipped = trivial_bundle(root / "bundle")
    done: dict[int, object] = {}

    def direct(seed: int):
        if seed not in done:
            done[seed] = direct_evaluate(bundle, data, profile, root / f"direct-{seed}", seed)
        return done[seed]

    return {"root": root, "data": str(data), "profile": profile, "zip": zipped, "direct": direct, "bundle": bundle}


@pytest.fixture
def service(world, tmp_path, db_url):
    """A fresh database (a SQLite file, and a PostgreSQL database: tests/databases.py) and blob
    store; ``make()`` builds dispatchers on them (stopped at the end)."""
    store = Store(db_url)
    blobs = BlobStore(tmp_path / "blobs")
    made: list[Dispatcher] = []

    def make(**kw) -> Dispatcher:
        kw.setdefault("slots", 2)
        kw.setdefault("backoff_base_s", 0.5)
        d = Dispatcher(store, blobs, data_dir=world["data"], profiles={PROFILE: world["profile"]}, **kw)
        made.append(d)
        return d

    yield store, blobs, make
    for d in made:
        if d._thread is not None:
            d.stop()
    store.close()


def submit(store: Store, blobs: BlobStore, data: bytes) -> int:
    return store.submit(HOTKEY, blobs.put(data), profile=PROFILE)


def wait(pred, what: str, timeout: float = 240.0, every: float = 0.2):
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        value = pred()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def final(store: Store, *sids: int, timeout: float = 240.0) -> None:
    wait(lambda: all(store.submission(s).status in FINAL for s in sids), f"submissions {sids} to end", timeout)


def counts(store: Store, sid: int) -> tuple[int, int]:
    """(attempts, runs) of submission ``sid``, counted in the database."""
    with store.sessions() as s:
        attempts = s.scalar(select(func.count()).select_from(Attempt).where(Attempt.submission_id == sid))
        runs = s.scalar(select(func.count()).select_from(Run).join(Attempt, Attempt.id == Run.attempt_id)
                        .where(Attempt.submission_id == sid))
    return attempts, runs


def assert_same_as_direct(store: Store, sid: int, direct, runs: int = 2, exact: tuple[int, ...] = (0, 1)) -> None:
    """Submission ``sid`` has ``runs`` scored runs, each on its own secret seed (never the
    profile's, its scoring attempt's); the runs of index in ``exact`` bit-exact with
    ``direct(seed)``: ``evaluate()`` run in this process on the seed its manifest reveals (one
    evaluation each: the fault tests name the run their fault struck)."""
    rows = store.runs_of(sid)
    assert [r.run_index for r in rows] == list(range(runs)) and store.submission(sid).runs_wanted == runs
    attempts = {a.id: a for a in store.attempts(sid)}
    seeds = [r.seed for r in rows]
    assert len(set(seeds)) == runs and 1234 not in seeds
    for run in rows:
        assert run.seed == run.manifest["seed"] == attempts[run.attempt_id].seed and run.status == "scored"
    assert len({r.prequential_bpb for r in rows}) == runs  # the seed is the init's: each run its own score
    for run in (r for r in rows if r.run_index in exact):
        d, m = direct(run.seed).manifest, run.manifest
        assert run.prequential_bpb == d.score.prequential_bpb  # bit-exact
        assert m["score"] == d.score.model_dump(mode="json")
        assert m["curve"]["nats_per_target"] == d.curve.nats_per_target and len(d.curve.nats_per_target) >= 8
        assert m["bundle"]["sha256"] == d.bundle.sha256 and m["isolation"]["isolated"] is True
        assert m["profile"]["name"] == PROFILE and m["profile"]["overridden"] == ["seed"]


def stage(actor) -> str | None:
    try:
        return ray.get(actor.progress.remote(), timeout=10)["stage"]
    except Exception:  # noqa: BLE001 - not created yet
        return None


def named_actors() -> list[str]:
    return [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
            if a["namespace"] == NAMESPACE and a["name"].startswith(ACTOR_PREFIX)]


def lookup(token: str):
    """The actor of the attempt with fencing token ``token``, or ``None``."""
    try:
        return ray.get_actor(actor_name(token), namespace=NAMESPACE)
    except ValueError:
        return None
