"""Admission (issue 27, item 2): limits a fresh hotkey cannot bypass, counted from the database (a
restart keeps them; a refused request never counts), the hotkey registry, trusted proxies and
the header deadline. On SQLite and PostgreSQL where the database is what is tested."""

from __future__ import annotations

import hashlib
import json
import shutil
import socket
from datetime import timedelta

import pytest
from sqlalchemy import select

from helpers import EXAMPLE
from prism_challenge.service.admission import Limits, admit, client_key
from prism_challenge.service.errors import ApiError
from prism_challenge.service.models import Submission, utcnow
from prism_challenge.service.registry import HotkeyRegistry, RegistryError, read_registry
from prism_challenge.service.signing import ss58_encode
from prism_challenge.service.store import Store
from service_live import ALICE, BOB_SEED, live_server, post, signed, zip_dir, zip_files


def _seed(k: int) -> bytes:
    """A fresh key's seed, one per ``k`` (32 bytes)."""
    return hashlib.sha256(f"fresh key {k}".encode()).digest()


def _hotkey(seed: bytes) -> str:
    return signed(b"x", seed)["X-Hotkey"]


def _bundles(tmp_path, n: int) -> list[bytes]:
    """``n`` zips of examples/tiny-1m, each with its own normalized source (no duplicates)."""
    out = []
    for k in range(n):
        root = tmp_path / f"b{k}"
        shutil.copytree(EXAMPLE, root)
        (root / "training.py").write_text((root / "training.py").read_text() + f"\nBUNDLE_TAG = {k}\n")
        out.append(zip_dir(root, "mybundle"))
    return out


def test_thirty_fresh_keys_from_one_address_queue_the_address_limit_and_a_restart_keeps_it(db_url, tmp_path):
    bodies = _bundles(tmp_path, 30)
    given = {"database_url": db_url, "address_rate_limit": 10, "rate_window_s": 3600}
    with live_server(tmp_path / "svc", **given) as (base, app):
        answers = [post(base, b, signed(b, _seed(k))) for k, b in enumerate(bodies)]
        with app.state.store.sessions() as s:
            rows = list(s.scalars(select(Submission)))
    assert [r.status_code for r in answers] == [202] * 10 + [429] * 20
    late = answers[10].json()["error"]
    assert (late["code"], late["stage"], late["rule"]) == ("address-rate-limited", "auth", "prism:address-rate-limit")
    assert "client 127.0.0.1: 10 submissions accepted in 3600 s" in late["message"]
    assert 3590 <= int(answers[29].headers["Retry-After"]) <= 3600
    assert len(rows) == 10 and {r.client_address for r in rows} == {"127.0.0.1"}
    assert {r.status for r in rows} == {"pending"}
    with live_server(tmp_path / "svc", **given) as (base, app):  # a restart: the same database, a new process state
        r = post(base, bodies[11], signed(bodies[11], _seed(99)))
        assert r.status_code == 429 and r.json()["error"]["code"] == "address-rate-limited", r.text
        gateway = post(base, bodies[12], {"Authorization": "Bearer gateway-secret-token",
                                          "X-Verified-Hotkey": _hotkey(_seed(98))}, "/internal/v1/submissions")
        assert gateway.status_code == 202, gateway.text  # the gateway answers for its clients' addresses


@pytest.fixture
def store(db_url):
    s = Store(db_url)
    s.migrate()
    yield s
    s.close()


def _limits(**kw) -> Limits:
    given = {"window_s": 600.0, "per_hotkey": 3, "per_address": 4, "in_flight": 2, "queued": 5, **kw}
    return Limits(**given)


def _refusal(store, hotkey, address, limits, now=None) -> ApiError | None:
    with store.sessions() as s:
        try:
            admit(s, hotkey, address, limits, now or utcnow())
        except ApiError as exc:
            return exc
    return None


def _add(store, hotkey, address, status="pending", age_s=0.0) -> int:
    sid = store.submit(hotkey, "ab" * 32, client_address=address)
    with store.sessions.begin() as s:
        row = s.get(Submission, sid)
        row.status, row.created_at = status, utcnow() - timedelta(seconds=age_s)
    return sid


def test_in_flight_window_and_queue_limits_count_rows(store):
    a, b, c = (_hotkey(_seed(k)) for k in (1, 2, 3))
    limits = _limits()
    _add(store, a, "198.51.100.1")
    _add(store, a, "198.51.100.1", status="running")
    exc = _refusal(store, a, "198.51.100.2", limits)
    assert (exc.status, exc.code, exc.headers["Retry-After"]) == (429, "too-many-in-flight", "60")
    _add(store, b, "198.51.100.3", status="completed", age_s=500)
    _add(store, b, "198.51.100.3", status="rejected", age_s=100)
    _add(store, b, "198.51.100.3", status="failed", age_s=700)  # outside the window: not counted
    assert _refusal(store, b, "198.51.100.4", limits) is None  # 2 in the window, limit 3
    _add(store, b, "198.51.100.3", status="completed", age_s=50)
    exc = _refusal(store, b, "198.51.100.4", limits)
    # the 3 newest in the window are 50, 100, 500 s old: one more fits when the 500 s one leaves, in 100 s
    assert (exc.status, exc.code) == (429, "rate-limited") and int(exc.headers["Retry-After"]) in (99, 100)
    exc = _refusal(store, c, "198.51.100.3", limits)  # a fresh key from an address with 3 in the window: 4th ok
    assert exc is None
    _add(store, c, "198.51.100.3", status="completed", age_s=10)
    exc = _refusal(store, _hotkey(_seed(4)), "198.51.100.3", limits)
    assert (exc.status, exc.code, exc.rule) == (429, "address-rate-limited", "prism:address-rate-limit")
    assert _refusal(store, c, None, limits) is None  # the gateway's route: no address counted
    for k in range(3):
        _add(store, _hotkey(_seed(10 + k)), f"192.0.2.{k}")
    assert _refusal(store, _hotkey(_seed(20)), "192.0.2.99", limits) is None  # 4 pending: a's first, 3 new
    _add(store, _hotkey(_seed(13)), "192.0.2.3")
    exc = _refusal(store, _hotkey(_seed(20)), "192.0.2.99", limits)  # 5 pending (running, completed: not queued)
    assert (exc.status, exc.code, exc.rule) == (503, "queue-full", "prism:queue-full")


def test_a_refused_admission_writes_nothing(store):
    a = _hotkey(_seed(1))
    _add(store, a, "198.51.100.1")
    _add(store, a, "198.51.100.1")
    limits = _limits()
    with pytest.raises(ApiError) as got:
        store.submit(a, "cd" * 32, client_address="198.51.100.1",
                     admit=lambda s: admit(s, a, "198.51.100.1", limits, utcnow(), lock=True))
    assert got.value.code == "too-many-in-flight"
    with store.sessions() as s:
        assert len(list(s.scalars(select(Submission)))) == 2


def test_client_key_counts_an_ipv6_host_by_its_network():
    assert client_key("203.0.113.7") == "203.0.113.7"
    assert client_key("::ffff:203.0.113.7") == "203.0.113.7"
    assert client_key("2001:db8:1:2:aaaa::1") == client_key("2001:db8:1:2:bbbb::9") == "2001:db8:1:2::/64"
    assert client_key("2001:db8:1:3::1") == "2001:db8:1:3::/64"
    assert client_key("2001:db8:1:2::1", 128) == "2001:db8:1:2::1/128"
    assert client_key(None) is None and client_key("testclient") == "testclient"


def test_a_trusted_proxy_names_the_client_and_an_untrusted_one_does_not(tmp_path):
    bodies = _bundles(tmp_path, 3)
    via = {"X-Forwarded-For": "203.0.113.5"}
    with live_server(tmp_path / "direct", address_rate_limit=1) as (base, app):
        assert post(base, bodies[0], {**signed(bodies[0], _seed(1)), **via}).status_code == 202
        r = post(base, bodies[1], {**signed(bodies[1], _seed(2)), "X-Forwarded-For": "203.0.113.6"})
        assert r.json()["error"]["code"] == "address-rate-limited"  # the header is the client's word: ignored
        assert app.state.store.submission(1).client_address == "127.0.0.1"
    with live_server(tmp_path / "proxied", address_rate_limit=1, trusted_proxies=["127.0.0.1"]) as (base, app):
        assert post(base, bodies[0], {**signed(bodies[0], _seed(1)), **via}).status_code == 202
        r = post(base, bodies[1], {**signed(bodies[1], _seed(2)), "X-Forwarded-For": "203.0.113.6"})
        assert r.status_code == 202, r.text  # another client behind the same proxy
        r = post(base, bodies[2], {**signed(bodies[2], _seed(3)), **via})
        assert r.json()["error"]["code"] == "address-rate-limited"
        assert [app.state.store.submission(i).client_address for i in (1, 2)] == ["203.0.113.5", "203.0.113.6"]


def test_read_registry_formats_and_errors(tmp_path):
    a, b = _hotkey(_seed(1)), _hotkey(_seed(2))
    text = tmp_path / "hotkeys.txt"
    text.write_text(f"# the operator's list\n{a}\n\n  {b}   # bob\n")
    assert read_registry(text, 42) == {a, b}
    (tmp_path / "meta.json").write_text(json.dumps({"netuid": 1, "hotkeys": [a]}))
    assert read_registry(tmp_path / "meta.json", 42) == {a}
    (tmp_path / "list.json").write_text(json.dumps([a, b]))
    assert read_registry(tmp_path / "list.json", 42) == {a, b}
    text.write_text(f"{a}\nnot-a-key\n")
    with pytest.raises(RegistryError, match=r"hotkeys.txt: line 2: 'not-a-key' is not an SS58 hotkey"):
        read_registry(text, 42)
    text.write_text(ss58_encode(_seed(5), 0) + "\n")
    with pytest.raises(RegistryError, match="line 1: .* network 0, not 42"):
        read_registry(text, 42)
    (tmp_path / "bad.json").write_text('{"hotkeys": 3}')
    with pytest.raises(RegistryError, match="a list of hotkeys"):
        read_registry(tmp_path / "bad.json", 42)


def test_the_registry_is_read_again_when_it_changes_and_keeps_its_list_when_it_breaks(tmp_path):
    a, b = _hotkey(_seed(1)), _hotkey(_seed(2))
    path = tmp_path / "hotkeys.txt"
    path.write_text(a + "\n")
    now = [0.0]
    reg = HotkeyRegistry(path, 42, refresh_s=60, clock=lambda: now[0])
    assert a in reg and b not in reg
    path.write_text(f"{a}\n{b}\n")
    assert b not in reg  # not checked before refresh_s
    now[0] = 60.0
    assert b in reg and len(reg) == 2
    path.write_text("garbage\n")
    now[0] = 120.0
    assert a in reg and b in reg  # the last good list
    path.write_text(b + "\n")
    now[0] = 180.0
    assert a not in reg and b in reg


def test_an_unlisted_hotkey_gets_403_and_a_listed_one_goes_on(tmp_path):
    listed = tmp_path / "hotkeys.txt"
    listed.write_text(_hotkey(BOB_SEED) + "\n")
    body = zip_files({"x.py": "x = 1\n"})  # refused at intake: the registry is checked before it
    with live_server(tmp_path / "svc", hotkey_registry=listed) as (base, _):
        r = post(base, body, signed(body))
        assert r.status_code == 403, r.text
        err = r.json()["error"]
        assert (err["code"], err["stage"], err["rule"]) == ("not-registered", "auth", "prism:registry")
        assert err["message"].startswith(f"{ALICE} is not in this service's hotkey registry")
        assert post(base, body, signed(body, BOB_SEED)).status_code == 422


def test_a_request_head_that_never_ends_is_closed_at_the_header_timeout(tmp_path):
    with live_server(tmp_path, header_timeout_s=0.5) as (base, _):
        port = int(base.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")  # and never the blank line
            assert sock.recv(1024) == b""  # closed by the server, nothing answered (the socket's own 30 s raises)
        with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:  # a whole head is served
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            assert sock.recv(1024).startswith(b"HTTP/1.1 200")


def test_migration_0005_keeps_the_rows_of_0004_which_count_per_hotkey_but_no_address(tmp_path):
    from alembic import command
    from alembic.config import Config
    from sqlalchemy import create_engine, text

    from prism_challenge.service.store import MIGRATIONS

    db = tmp_path / "old.sqlite3"
    engine = create_engine(f"sqlite:///{db}")
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))
    hotkey = _hotkey(_seed(1))
    with engine.begin() as connection:
        config.attributes["connection"] = connection
        command.upgrade(config, "0004")
        t = (utcnow() - timedelta(seconds=30)).strftime("'%Y-%m-%d %H:%M:%S'")
        connection.execute(text(f"INSERT INTO submitters VALUES (1, '{hotkey}', {t})"))
        connection.execute(text("INSERT INTO submissions (id, submitter_id, bundle_sha256, status, attempts, "
                                f"max_attempts, created_at, updated_at) VALUES (1, 1, 'x', 'pending', 0, 3, {t}, {t})"))
    engine.dispose()
    store = Store(f"sqlite:///{db}")
    try:
        assert store.submission(1).client_address is None
        exc = _refusal(store, hotkey, "198.51.100.1", _limits(in_flight=1))
        assert exc.code == "too-many-in-flight"
        assert _refusal(store, _hotkey(_seed(2)), "198.51.100.1", _limits(per_address=1)) is None
        with store.engine.connect() as c:
            assert c.execute(text("SELECT version_num FROM alembic_version")).all() == [("0006",)]
    finally:
        store.close()
