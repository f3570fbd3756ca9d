"""The service's web pages on a real server: the leaderboard, a submission with its plot, "how
to submit"; their values and escaping, the plot's PNG, and a headless Chromium screenshot of
each (the pixels checked: the page's header and the plot's line are where they belong)."""

from __future__ import annotations

import copy
import math
import os
import shutil
import struct
import subprocess
from pathlib import Path

import httpx
import pytest
from service_live import live_server
from test_service_read import KEYS, _add, refused, scored

from prism_challenge.failures import EvalFailure
from prism_challenge.manifest.results import EvalResult, RunManifest, early_manifest

HEADER_RGB = (0x1D, 0x35, 0x57)  # base.html's header
LINE_RGB = (0x1F, 0x77, 0xB4)  # matplotlib's C0: the plotted curve


REFERENCE = {"bytes": 3999, "text_sha256": "ab" * 32, "zstd-19": 2.5, "xz-9e": 2.25, "gzip-9": 3.0}


def learning(bpb: float, delta: float, n: int = 600, reference: dict | None = None) -> EvalResult:
    """A scored result whose curve falls like a learning run's: nats per target 1.5 + 4 exp(-j/150)."""
    r = scored(bpb, delta)
    m = copy.deepcopy(r.manifest.to_json_dict())
    m["curve"] = {"nats_per_target": [1.5 + 4 * math.exp(-j / 150) for j in range(n)],
                  "cumulative_targets": [64 * (j + 1) for j in range(n)],
                  "cumulative_bytes": [250 * (j + 1) for j in range(n)]}
    m["reference_codes"] = reference
    return r.model_copy(update={"manifest": RunManifest.model_validate(m)})


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    with live_server(tmp_path_factory.mktemp("site")) as (base, app):
        store = app.state.store
        first = _add(store, "alice", "a", learning(1.90, 0.10))
        best = _add(store, "bob", "a", learning(1.42, 0.30, reference=REFERENCE), variant_of=first)
        f = EvalFailure("contract", "<script>alert(1)</script> no batch was scored").to_dict()
        m = early_manifest(f, bundle_path="/b", seed=1, findings=[], profile=None, version="0.1.0")
        bad = _add(store, "carol", "c", EvalResult(status=m.status, kind="submission", failure=m.failure,
                                                  run_dir=None, manifest_path=None, manifest=m))
        gated = _add(store, "dave", "d", refused())
        yield base, {"first": first, "best": best, "bad": bad, "gated": gated}


def test_the_leaderboard_page_lists_each_hotkeys_best_in_order(site):
    base, ids = site
    r = httpx.get(base + "/")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    page = r.text
    bob, alice = page.index(KEYS["bob"][:8]), page.index(KEYS["alice"][:8])
    assert bob < alice  # 1.42 before 1.90
    assert "1.4200" in page and f"{1 / 2.42:.6f}" in page and f'href="/submissions/{ids["best"]}"' in page
    assert f'variant of <a href="/submissions/{ids["first"]}">' in page
    assert "profile <b>local</b>" in page


def test_the_submission_page_shows_scores_plot_and_escapes_messages(site):
    base, ids = site
    page = httpx.get(f"{base}/submissions/{ids['best']}").text
    assert "completed" in page and "1.420000" in page and f'src="/submissions/{ids["best"]}/curve.png"' in page
    # the reference compressors on the same bytes, and the model's bpb minus the best (1.42 - 2.25)
    assert "same 3,999 scored bytes" in page and "prequential bpb − xz-9e" in page and "-0.8300" in page
    assert all(f"<th>{n} bpb</th><td class=\"num\">{v}</td>" in page
               for n, v in (("zstd-19", "2.5000"), ("xz-9e", "2.2500"), ("gzip-9", "3.0000")))
    assert httpx.get(f"{base}/v1/submissions/{ids['best']}").json()["scores"]["reference_codes"] == {
        "bytes": 3999, "codes": {"zstd-19": 2.5, "xz-9e": 2.25, "gzip-9": 3.0}, "best": "xz-9e",
        "bpb_minus_best": pytest.approx(1.42 - 2.25)}
    first = httpx.get(f"{base}/submissions/{ids['first']}").text  # a manifest without them
    assert "1.900000" in first and "Reference compressors" not in first
    bad = httpx.get(f"{base}/submissions/{ids['bad']}").text
    assert "<script>alert(1)</script>" not in bad and "&lt;script&gt;alert(1)&lt;/script&gt;" in bad
    assert "stage <b>contract</b>, kind <b>submission</b>" in bad and "curve.png" not in bad
    gated = httpx.get(f"{base}/submissions/{ids['gated']}").text
    assert "rule <code>prism:no-network</code>" in gated
    r = httpx.get(f"{base}/submissions/424242")  # a page for a browser, the JSON route keeps its body
    assert r.status_code == 404 and r.headers["content-type"].startswith("text/html")
    assert "<h1>404" in r.text and "submission 424242: no such submission" in r.text and 'href="/"' in r.text
    assert httpx.get(f"{base}/v1/submissions/424242").json()["error"]["code"] == "not-found"


def test_the_curve_png(site):
    base, ids = site
    r = httpx.get(f"{base}/submissions/{ids['best']}/curve.png")
    assert r.status_code == 200 and r.headers["content-type"] == "image/png"
    assert r.content[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", r.content[16:24])
    assert width == 900 and height > 500  # plots.learning_curve_figure: 9 in at 100 dpi
    assert httpx.get(f"{base}/submissions/{ids['bad']}/curve.png").status_code == 404


def test_the_how_to_submit_page(site):
    base, _ = site
    page = httpx.get(base + "/how-to-submit").text
    assert f"prism submit mybundle --url {base} --keyfile hotkey.json" in page
    assert "prism:{hotkey}:{nonce}:{timestamp}:{sha256(body) hex}" in page and "within 300 s" in page


def _screenshot(url: str, out, size: str) -> "object":
    import matplotlib.image

    chromium = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    if chromium is None:
        pytest.skip("no Chromium on this machine")
    subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                    f"--window-size={size}", f"--screenshot={out}", url], capture_output=True, timeout=120, check=True)
    return (matplotlib.image.imread(out)[..., :3] * 255).round().astype(int)


def _has(pixels, rgb, tolerance: int = 6) -> int:
    import numpy as np

    return int((np.abs(pixels - np.array(rgb)).max(axis=-1) <= tolerance).sum())


@pytest.mark.slow  # Chromium: a few seconds per page
def test_chromium_screenshots_of_the_leaderboard_and_a_submission(site, tmp_path):
    base, ids = site
    board = _screenshot(base + "/", tmp_path / "leaderboard.png", "1200,600")
    assert board.shape == (600, 1200, 3)
    assert _has(board[:40], HEADER_RGB) > 1200 * 20  # the header bar across the top
    page = _screenshot(f"{base}/submissions/{ids['best']}", tmp_path / "submission.png", "1200,1500")
    assert page.shape == (1500, 1200, 3)
    assert _has(page[600:], LINE_RGB) > 500  # the plotted curve, below the tables
    keep = os.environ.get("PRISM_SCREENSHOTS")  # a folder to keep them in, to look at them
    if keep:
        for name in ("leaderboard.png", "submission.png"):
            shutil.copy(tmp_path / name, Path(keep) / name)
