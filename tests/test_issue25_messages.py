"""Issue 25's commands as a new user meets them: every mistake is one line naming the file or
field and the rule (never a traceback), and the help reads at 80 columns. No run is launched."""

from __future__ import annotations

import copy
import io
import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
from rich.console import Console

from prism_challenge.manifest.certificate import CertificateError, parse_public_key
from prism_challenge.cli import build_parser, main

FIXTURE = json.loads((Path(__file__).parent / "data" / "scored_manifest.v2.json").read_text())
SECRET = "8534440dc16e4f5ef832c180ba27b497d2e94cb506341499f08de8f518801183"


# -- prism verify: a run directory it cannot read -------------------------------------------------
def _verify(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(["verify", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_verify_names_a_missing_directory_a_file_and_a_folder_without_a_manifest(tmp_path, capsys):
    missing = tmp_path / "nope"
    assert _verify(capsys, str(missing)) == (2, "", f"prism verify: {missing}: no such run directory\n")
    a_file = tmp_path / "notes.txt"
    a_file.write_text("x")
    code, _, err = _verify(capsys, str(a_file))
    assert code == 2 and err == (f"prism verify: {a_file}: not a directory: give the run directory that holds "
                                 "prism_run_manifest.v2.json\n")
    code, _, err = _verify(capsys, str(tmp_path))
    assert code == 2 and err == (f"prism verify: {tmp_path}: holds no prism_run_manifest.v2.json (not a run "
                                 "directory of prism eval or the service)\n")


def test_verify_json_prints_the_error_of_exit_2_on_stdout(tmp_path, capsys):
    code, out, err = _verify(capsys, str(tmp_path / "nope"), "--json")
    assert code == 2
    assert json.loads(out) == {"verified": False, "error": f"{tmp_path / 'nope'}: no such run directory"}
    assert err == f"prism verify: {tmp_path / 'nope'}: no such run directory\n"


def test_a_hand_edited_manifest_names_its_broken_fields(tmp_path, capsys):
    path = tmp_path / "prism_run_manifest.v2.json"
    m = copy.deepcopy(FIXTURE)
    m["seed"], m["score"]["extra"], m["run_secret"] = "x", 1, SECRET[:-1]
    path.write_text(json.dumps(m))
    code, _, err = _verify(capsys, str(tmp_path))
    assert code == 2 and "Traceback" not in err
    assert err.startswith(f"prism verify: {path}: not a valid run manifest: ")
    # the three fields the edit broke, each with its rule (pydantic's order: the model's fields)
    assert "seed: Input should be a valid integer" in err
    assert "score.extra: Extra inputs are not permitted" in err
    assert "run_secret: String should match pattern '^[0-9a-f]{64}$'" in err
    path.write_text(json.dumps(m)[:-5])  # cut short: not JSON
    code, _, err = _verify(capsys, str(tmp_path))
    assert code == 2 and err.startswith(f"prism verify: {path}: not valid JSON (") and "line 1 column" in err


# -- --key -----------------------------------------------------------------------------------------
@pytest.mark.parametrize(("text", "why"), [
    ("nokey.pem", "no such file"),
    ("/no/such/dir/key.pem", "no such file"),
    ("AAAA", "its base64 decodes to 3 bytes, not 32"),
    ("xv0A0YVJyrtlTyxyOfjLVZtO07LKm8XuKm9MetQsu20", "not valid base64: a 32-byte key is 44 characters, the last '='"),
])
def test_a_bad_key_says_what_is_wrong_with_it(text, why):
    with pytest.raises(CertificateError) as exc:
        parse_public_key(text)
    assert str(exc.value) == (f"--key {text}: neither a key file nor the base64 of a raw 32-byte ed25519 public key, "
                              f"as GET /version's signing_public_key ({why})")


def test_a_directory_given_as_key_is_not_a_regular_file(tmp_path):
    with pytest.raises(CertificateError, match=r"\(not a regular file\)$"):
        parse_public_key(str(tmp_path))


# -- --run-secret ----------------------------------------------------------------------------------
@pytest.mark.parametrize(("bad", "why"), [(SECRET[:-1], "63 hex digits"), (SECRET + "0", "65 hex digits"),
                                          (SECRET[:-1] + "g", "'g' is not a hex digit")])
def test_a_bad_run_secret_says_how_it_is_bad(bad, why, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["eval", "examples/tiny-1m", "--run-secret", bad])
    assert exc.value.code == 2
    err = capsys.readouterr().err.splitlines()[-1]
    assert err == (f"prism eval: error: argument --run-secret: {bad!r}: {why}; a run secret is 64 hex digits "
                   "(0-9, a-f), as a manifest's run_secret")


# -- the summary of prism eval ---------------------------------------------------------------------
def test_the_summary_shows_the_run_secret_and_the_certificates_key(tmp_path):
    from prism_challenge.research.report import print_summary

    m = copy.deepcopy(FIXTURE)
    m["run_secret"] = SECRET
    m["certificate"] = {"alg": "ed25519", "canonicalization": "RFC 8785", "public_key": "x",
                        "key_id": "ee3d73cc5462a469", "signature": "y"}
    buf = io.StringIO()
    print_summary(Console(file=buf, width=120), SimpleNamespace(manifest=m, run_dir=tmp_path))
    text = buf.getvalue()
    assert "run secret   " in text
    assert "8534440dc16e... (run_secret in the manifest; --run-secret repeats this run)" in text
    assert "ed25519, key ee3d73cc5462a469 (prism verify RUN_DIR checks it)" in text
    del m["certificate"], m["run_secret"]
    buf = io.StringIO()
    print_summary(Console(file=buf, width=120), SimpleNamespace(manifest=m, run_dir=tmp_path))
    assert "- (unsigned)" in buf.getvalue()


# -- prism findings against a database prism serve has not set up ----------------------------------
def test_findings_refuses_a_missing_database_naming_the_path(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["findings", "list", "--database-url", "sqlite:///svc/prism.sqlite3"]) == 2
    assert capsys.readouterr().err == (f"prism findings list: no database at svc/prism.sqlite3 "
                                       f"({tmp_path / 'svc' / 'prism.sqlite3'}): give prism serve's --database-url "
                                       "URL (sqlite:////ABS/PATH for an absolute path)\n")
    assert not (tmp_path / "svc").exists()  # nothing made


def test_findings_refuses_an_unmigrated_database_and_leaves_it_as_it_was(tmp_path, capsys):
    empty = tmp_path / "empty.sqlite3"
    empty.touch()
    url = f"sqlite:///{empty}"
    assert main(["findings", "list", "--database-url", url]) == 2
    assert capsys.readouterr().err == (f"prism findings list: the database {url} holds no PRISM service tables (not "
                                       "migrated): prism serve --database-url URL sets it up\n")
    assert empty.stat().st_size == 0  # not migrated behind the operator's back


def test_findings_refuses_a_database_at_an_older_migration(tmp_path, capsys):
    from alembic import command
    from alembic.config import Config
    from sqlalchemy import create_engine

    from prism_challenge.service.store import MIGRATIONS

    db = tmp_path / "old.sqlite3"
    engine = create_engine(f"sqlite:///{db}")
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))
    with engine.begin() as connection:
        config.attributes["connection"] = connection
        command.upgrade(config, "0003")
    engine.dispose()
    from alembic.script import ScriptDirectory

    head = ScriptDirectory.from_config(config).get_current_head()  # the newest migration file
    assert head == sorted(p.name[:4] for p in MIGRATIONS.joinpath("versions").glob("0*.py"))[-1]
    assert main(["findings", "lift", "5Grw", "--database-url", f"sqlite:///{db}"]) == 2
    assert capsys.readouterr().err == (f"prism findings lift: the database sqlite:///{db} is at migration 0003, this "
                                       f"prism needs {head}: start this version's prism serve once, which applies the "
                                       "migrations\n")


def test_findings_names_a_bad_url_and_an_unreachable_server_without_a_traceback(capsys):
    assert main(["findings", "list", "--database-url", "notaurl"]) == 2
    assert capsys.readouterr().err == ("prism findings list: the database URL 'notaurl' is not a SQLAlchemy URL (e.g. "
                                       "sqlite:////srv/prism/prism.sqlite3, postgresql+psycopg://prism@db/prism)\n")
    pytest.importorskip("psycopg")
    assert main(["findings", "list", "--database-url", "postgresql+psycopg://prism:pw@127.0.0.1:1/prism"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("prism findings list: cannot open the database postgresql+psycopg://prism:***@127.0.0.1:1/"
                          "prism: ") and "Traceback" not in err and ":pw@" not in err and err.count("\n") == 1


def test_lifting_a_hotkey_without_findings_says_so(tmp_path, capsys):
    from prism_challenge.service.store import Store

    url = f"sqlite:///{tmp_path / 'prism.sqlite3'}"
    Store(url).close()  # as prism serve sets it up
    assert main(["findings", "lift", "5Grw", "--database-url", url]) == 1
    assert capsys.readouterr().err == "prism findings lift: 5Grw has no finding to lift: none is recorded against it\n"


# -- prism serve's signing key ---------------------------------------------------------------------
def test_serve_names_a_bad_signing_key_and_how_to_make_one(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    monkeypatch.setenv("PRISM_SIGNING_KEY_FILE", str(tmp_path / "missing.pem"))
    argv = ["serve", "--profile", "local", "--database-url", f"sqlite:///{tmp_path / 'db.sqlite3'}", "--blob-root",
            str(tmp_path / "blobs"), "--no-dispatch"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err == (f"prism serve: the signing key, PRISM_SIGNING_KEY_FILE (setting signing_key_file): "
                   f"{tmp_path / 'missing.pem'}: the signing key file cannot be read (No such file or directory); "
                   "make one with: openssl genpkey -algorithm ed25519 -out FILE && chmod 600 FILE\n")
    key = tmp_path / "open.pem"
    key.write_text("x")
    os.chmod(key, 0o644)
    monkeypatch.setenv("PRISM_SIGNING_KEY_FILE", str(key))
    assert main(argv) == 2
    assert capsys.readouterr().err == (f"prism serve: the signing key, PRISM_SIGNING_KEY_FILE (setting "
                                       f"signing_key_file): {key}: the signing key file has mode 0644; its group and "
                                       f"others must have no access (chmod 600 {key})\n")


# -- help at 80 columns ----------------------------------------------------------------------------
@pytest.mark.parametrize("argv", [["verify"], ["findings"], ["findings", "list"], ["findings", "lift"], ["eval"]])
def test_the_help_fits_80_columns_without_markup(argv, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    parser = build_parser()
    for name in argv:  # walk down to the subcommand's parser
        parser = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction").choices[name]
    text = parser.format_help()
    assert max(len(line) for line in text.splitlines()) <= 80
    assert "``" not in text and "DATABASE_URL\n" not in text and "CONFIG\n" not in text
    if argv[0] != "eval":
        assert "exit status: 0" in text.lower()


# -- the caller's own --profile and --data are the caller's error (exit 2), not the run's ----------
def _run_dir(tmp_path: Path) -> Path:
    run = tmp_path / "run"
    run.mkdir()
    (run / "prism_run_manifest.v2.json").write_text(json.dumps(FIXTURE))  # the arguments are checked first
    return run


def test_verify_refuses_a_profile_or_data_directory_it_cannot_read_before_anything_else(tmp_path, capsys):
    run = _run_dir(tmp_path)
    code, out, err = _verify(capsys, str(run), "--profile", "nope", "--json")
    assert code == 2 and json.loads(out)["error"].startswith("--profile nope: no such profile")
    empty = tmp_path / "empty"
    empty.mkdir()
    code, _, err = _verify(capsys, str(run), "--data", str(empty))
    assert code == 2 and err == (f"prism verify: --data {empty}: holds no MANIFEST.json (give the run's prepared "
                                 "data directory, as prism data prepare --out wrote it)\n")
    code, _, err = _verify(capsys, str(run), "--data", str(tmp_path / "nodata"))
    assert code == 2 and f"--data {tmp_path / 'nodata'}: no such directory (" in err


def test_the_json_summary_carries_the_run_secret_and_the_signing_key_id(tmp_path):
    from prism_challenge.research.report import summary_dict

    m = copy.deepcopy(FIXTURE)
    assert summary_dict(SimpleNamespace(manifest=m, run_dir=tmp_path))["run_secret"] is None  # an older manifest
    m["run_secret"], m["certificate"] = SECRET, {"key_id": "ee3d73cc5462a469"}
    got = summary_dict(SimpleNamespace(manifest=m, run_dir=tmp_path))
    assert (got["run_secret"], got["signing_key_id"]) == (SECRET, "ee3d73cc5462a469")
