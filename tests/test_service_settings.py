"""The service's settings: defaults, ``PRISM_*`` environment, a TOML file, their precedence,
and the refusals naming the field."""

from __future__ import annotations

import pydantic
import pytest

from prism_challenge.service.settings import ServiceSettings


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    import os

    for key in list(os.environ):
        if key.startswith("PRISM_") and key != "PRISM_CACHE_DIR":
            monkeypatch.delenv(key)


def test_the_defaults():
    s = ServiceSettings()
    assert (s.profile, s.slots, s.dispatch, s.signature_window_s, s.weights_rule, s.family_share) == (
        "prism-v2", 1, True, 300, "family-split", 0.6)
    assert (s.database_url, s.internal_token, s.ray_address, s.max_body_bytes) == (None, None, None, 1 << 20)


def test_the_environment_then_a_toml_file_and_keywords_first(tmp_path, monkeypatch):
    config = tmp_path / "prism-service.toml"
    config.write_text('profile = "local"\nslots = 3\nrate_limit = 7\ninternal_token = "from-file-0123456789"\n'
                      'weights_rule = "winner-takes-all"\n')
    monkeypatch.setenv("PRISM_SLOTS", "5")
    s = ServiceSettings.load(config, rate_limit=9, port=None)  # None: an option not given
    assert (s.profile, s.slots, s.rate_limit, s.weights_rule) == ("local", 5, 9, "winner-takes-all")
    assert s.internal_token.get_secret_value() == "from-file-0123456789" and "from-file" not in repr(s)
    monkeypatch.setenv("PRISM_CONFIG", str(config))
    assert ServiceSettings().slots == 5 and ServiceSettings().profile == "local"


@pytest.mark.parametrize("field, value, words", [
    ("slots", "0", "slots"),
    ("weights_rule", "proportional", "weights_rule"),
    ("profile", "no-such-profile", "no such profile"),
    ("family_share", "1.5", "family_share"),
])
def test_bad_values_name_the_field(monkeypatch, field, value, words):
    monkeypatch.setenv(f"PRISM_{field.upper()}", value)
    with pytest.raises(pydantic.ValidationError, match=words):
        ServiceSettings()


def test_an_unknown_key_in_the_file_and_a_missing_file(tmp_path):
    config = tmp_path / "c.toml"
    config.write_text("slotz = 2\n")
    with pytest.raises(pydantic.ValidationError, match="slotz"):
        ServiceSettings.load(config)
    with pytest.raises(FileNotFoundError, match="no such settings file"):
        ServiceSettings.load(tmp_path / "absent.toml")


def test_dispatch_on_without_the_dispatcher_module_refuses_to_start(tmp_path, monkeypatch):
    import importlib.util

    from fastapi.testclient import TestClient

    from prism_challenge.service import app as appmod

    monkeypatch.setattr(appmod, "DISPATCH_MODULE", "prism_challenge.service.no_such_dispatcher")
    assert importlib.util.find_spec(appmod.DISPATCH_MODULE) is None
    app = appmod.create_app(ServiceSettings(database_url=f"sqlite:///{tmp_path / 'db.sqlite3'}", profile="local",
                                            blob_root=tmp_path / "blobs", dispatch=True))
    with pytest.raises(RuntimeError, match=r"no_such_dispatcher\) is not installed"):
        with TestClient(app):
            pass


def test_prism_serve_without_the_dispatcher_says_so_in_one_line(tmp_path, monkeypatch, capsys):
    """Before uvicorn starts (whose failed startup is a traceback): exit 2 and the way out."""
    from prism_challenge.cli import main
    from prism_challenge.service import app as appmod

    monkeypatch.setattr(appmod, "DISPATCH_MODULE", "prism_challenge.service.no_such_dispatcher")
    code = main(["serve", "--profile", "local", "--database-url", f"sqlite:///{tmp_path / 'db.sqlite3'}",
                 "--blob-root", str(tmp_path / "blobs"), "--port", "0"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert err.startswith("prism serve: the Ray dispatcher") and "--no-dispatch" in err
    assert not (tmp_path / "db.sqlite3").exists()  # refused before the database is made


def test_the_dispatcher_hook_starts_and_stops_it_in_the_lifespan(tmp_path, monkeypatch):
    import sys
    import types

    from fastapi.testclient import TestClient

    from prism_challenge.service import app as appmod

    calls = []

    class Dispatcher:
        def __init__(self, state):
            self.state = state
            calls.append(("start", state.profile.name, state.settings.slots))

        def stop(self):
            calls.append(("stop",))

    fake = types.ModuleType("prism_test_fake_dispatch")
    fake.start = Dispatcher
    fake.__spec__ = importlib_spec("prism_test_fake_dispatch")
    monkeypatch.setitem(sys.modules, "prism_test_fake_dispatch", fake)
    monkeypatch.setattr(appmod, "DISPATCH_MODULE", "prism_test_fake_dispatch")
    app = appmod.create_app(ServiceSettings(database_url=f"sqlite:///{tmp_path / 'db.sqlite3'}", profile="local",
                                            blob_root=tmp_path / "blobs", dispatch=True, slots=3))
    with TestClient(app) as client:
        assert calls == [("start", "local", 3)]
        assert client.get("/health").json()["dispatcher"] == "running"
    assert calls == [("start", "local", 3), ("stop",)] and app.state.dispatcher is None


def importlib_spec(name: str):
    import importlib.machinery

    return importlib.machinery.ModuleSpec(name, loader=None)


def test_health_reports_the_oldest_submission_without_an_owner(tmp_path):
    """No dispatcher is live (dispatch off), so a pending submission has no owner: /health names
    the oldest one; with none waiting it says null."""
    from fastapi.testclient import TestClient

    from prism_challenge.service import app as appmod

    app = appmod.create_app(ServiceSettings(database_url=f"sqlite:///{tmp_path / 'db.sqlite3'}", profile="local",
                                            blob_root=tmp_path / "blobs", dispatch=False))
    with TestClient(app) as client:
        assert client.get("/health").json()["oldest_unowned"] is None
        first = app.state.store.submit("5GrwvaEF5zXb26Fz9rcQpDWS57CtERHpNehXCPcNoHGKutQY", "ab" * 32)
        app.state.store.submit("5GrwvaEF5zXb26Fz9rcQpDWS57CtERHpNehXCPcNoHGKutQY", "cd" * 32)
        body = client.get("/health").json()
    assert body["status"] == "ok" and body["dispatcher"] == "off"
    assert body["oldest_unowned"]["submission"] == first and body["oldest_unowned"]["status"] == "pending"
    assert 0 <= body["oldest_unowned"]["age_s"] < 60


def test_a_short_internal_token_is_refused():
    """The internal routes do not limit failed tries: a short token could be guessed online."""
    import pydantic

    with pytest.raises(pydantic.ValidationError, match="internal_token[\\s\\S]*at least 16 characters"):
        ServiceSettings(profile="local", internal_token="fifteen-chars-x")
    assert ServiceSettings(profile="local", internal_token="sixteen-chars-xy").internal_token.get_secret_value() == \
        "sixteen-chars-xy"


def test_public_architectures_must_exist(tmp_path):
    import pydantic

    with pytest.raises(pydantic.ValidationError, match="public_architectures[\\s\\S]*no such file: .*nope.py"):
        ServiceSettings(profile="local", public_architectures=[tmp_path / "nope.py"])
