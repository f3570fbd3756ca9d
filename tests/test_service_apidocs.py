"""The API docs (``/docs``: Swagger UI, ``/redoc``: ReDoc) render on a host with no internet:
their scripts and styles come from the service itself (the ``fastapi-offline`` package's copies),
checked in the HTML, and in headless Chromium with every request off the loopback refused (a dead
proxy and no name resolution): the rendered DOM lists the routes, and the screenshot shows
Swagger UI's coloured operation bars. The same browser, on FastAPI's default page that loads
them from a CDN, shows nothing: the control that proves the check can fail."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import httpx
import pytest
from service_live import live_server

GET_RGB = (0x61, 0xAF, 0xFE)  # Swagger UI's GET operation bar (swagger-ui.css .opblock-get)
POST_RGB = (0x49, 0xCC, 0x90)  # and POST's (.opblock-post)
OFFLINE = ["--proxy-server=http://127.0.0.1:9", "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1"]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    with live_server(tmp_path_factory.mktemp("apidocs")) as (url, _app):
        yield url


def test_the_docs_pages_load_nothing_from_outside(base):
    for page in ("/docs", "/redoc"):
        html = httpx.get(base + page).text
        assets = re.findall(r'(?:src|href)="([^"]+)"', html)
        assert assets and all(a.startswith("/static-offline-docs/") for a in assets), (page, assets)
        assert "cdn" not in html.lower() and "https://" not in html
        for a in assets:
            r = httpx.get(base + a)
            assert r.status_code == 200 and len(r.content) > 1000, a  # the bundle is served, not a stub
    assert "'/openapi.json'" in httpx.get(base + "/docs").text
    assert "/v1/submissions" in httpx.get(base + "/openapi.json").json()["paths"]


def _chromium(*args: str) -> subprocess.CompletedProcess:
    chromium = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    if chromium is None:
        pytest.skip("no Chromium on this machine (.ci/run installs Debian's)")
    return subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                           "--virtual-time-budget=15000", *OFFLINE, *args], capture_output=True, text=True,
                          timeout=180, check=True)


def _count(png: Path, rgb: tuple[int, int, int], tolerance: int = 8) -> int:
    import matplotlib.image
    import numpy as np

    pixels = (matplotlib.image.imread(png)[..., :3] * 255).round().astype(int)
    return int((np.abs(pixels - np.array(rgb)).max(axis=-1) <= tolerance).sum())


@pytest.mark.slow  # Chromium: a few seconds per page
def test_chromium_renders_swagger_ui_and_redoc_with_no_internet(base, tmp_path):
    dom = _chromium("--dump-dom", base + "/docs").stdout
    assert "PRISM challenge service" in dom and "/v1/submissions" in dom and "opblock-post" in dom
    shot = tmp_path / "docs.png"
    _chromium("--window-size=1200,1400", f"--screenshot={shot}", base + "/docs")
    assert _count(shot, GET_RGB) > 2000 and _count(shot, POST_RGB) > 2000  # the operations' bars
    redoc = _chromium("--dump-dom", base + "/redoc").stdout
    assert "/v1/submissions" in redoc and "PRISM challenge service" in redoc
    # the control: FastAPI's own page loads Swagger UI from a CDN, which this browser cannot reach
    from fastapi.openapi.docs import get_swagger_ui_html

    cdn = tmp_path / "cdn.html"
    cdn.write_bytes(get_swagger_ui_html(openapi_url=base + "/openapi.json", title="cdn").body)
    _chromium("--window-size=1200,1400", f"--screenshot={tmp_path / 'cdn.png'}", cdn.as_uri())
    assert _count(tmp_path / "cdn.png", GET_RGB) == 0 and "/v1/submissions" not in _chromium("--dump-dom", cdn.as_uri()).stdout
