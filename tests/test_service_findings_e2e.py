"""A caught cheat end to end on Ray (issue 25, item 5): the architecture that switches its peek
on after batch 0 (tests/rescore_bundles/arch_switch), submitted to a real dispatcher on a local
Ray of one CPU, evaluated under strict isolation on fixture data, its audit mismatch stored with
the run and recorded as one finding with the manifest's own figures; its hotkey is then
suspended. On a SQLite file and on PostgreSQL (tests/databases.py)."""

from __future__ import annotations

import io
import sys
import time
import zipfile
from pathlib import Path

import pytest
from fleet_fixtures import HOTKEY, PROFILE, PROFILE_TOML, final, fixture_data, operator_key

from prism_challenge.profiles import load_profile
from prism_challenge.service import findings as fnd
from prism_challenge.service.blobs import BlobStore
from prism_challenge.service.dispatch import Dispatcher
from prism_challenge.service.models import utcnow
from prism_challenge.service.store import Store

sys.path.insert(0, str(Path(__file__).parent / "rescore_bundles"))
from assemble import bundle  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.fleet]


def _zip(root: Path) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        for f in sorted(root.iterdir()):
            z.write(f, f.name)
    return buf.getvalue()


def test_a_cheat_caught_on_ray_records_one_finding_and_suspends_its_hotkey(tmp_path, db_url):
    operator_key()
    data = fixture_data(tmp_path)
    (tmp_path / "fleet-test.toml").write_text(PROFILE_TOML)
    profile = load_profile(str(tmp_path / "fleet-test.toml"))
    store, blobs = Store(db_url), BlobStore(tmp_path / "blobs")
    try:
        sid = store.submit(HOTKEY, blobs.put(_zip(bundle("arch_switch", tmp_path))), profile=PROFILE)
        t0 = time.monotonic()
        d = Dispatcher(store, blobs, slots=1, backoff_base_s=0.5, data_dir=str(data),
                       profiles={PROFILE: profile}).start()
        try:
            final(store, sid, timeout=300)
        finally:
            d.stop()
        print(f"submitted to caught on Ray: {time.monotonic() - t0:.1f} s")
        run = store.result_of(sid)
        audit, verdict = run.manifest["audit"], run.manifest["verdict"]
        assert store.submission(sid).status == "completed" and verdict["final_score"] == 0.0
        assert "audit" in verdict["flags"] and audit["error"] is None
        bad = next(b for b in audit["batches"] if not b["match"])
        (f,) = fnd.findings(store)
        assert (f.hotkey, f.submission_id, f.run_id, f.kind, f.step, f.rank) == (
            HOTKEY, sid, run.id, "rescore", bad["step"], 0)
        assert (f.recorded_nats, f.rescored_nats) == (bad["recorded_nats"][0], bad["rescored_nats"][0])
        assert f.rescored_nats > f.recorded_nats and f.message == audit["mismatch"]
        print(fnd.describe(f))
        assert fnd.suspension(store, HOTKEY, utcnow(), None).suspended
    finally:
        store.close()
