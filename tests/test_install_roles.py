"""Installs by role: a plain ``pip install prism-challenge`` is the researcher's (eval, check,
compare, verify, init, data, submit); the ``[service]`` extra adds the service and its fleet.

The plain install is simulated here by shadowing each of the extra's modules with one that
cannot be imported (``PYTHONPATH``), so ``prism eval`` must score the example without touching any
of them, and ``prism serve`` must say in one line which install to run. The closing note of
issue 30 gives the check in a real fresh venv (no Ray, no FastAPI)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from prism_challenge.cli import SERVICE_EXTRA_MODULES

ROOT = Path(__file__).resolve().parents[1]


def _module(requirement: str) -> str:
    """``"psycopg[binary]>=3.1"`` -> ``"psycopg"``; ``"pydantic-settings>=2.3"`` -> ``"pydantic_settings"``."""
    return re.split(r"[\[<>=!~ ;]", requirement, maxsplit=1)[0].replace("-", "_").lower()


def test_the_service_extra_and_the_cli_name_the_same_modules():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extra = {_module(r) for r in project["optional-dependencies"]["service"]}
    base = {_module(r) for r in project["dependencies"]}
    assert extra == SERVICE_EXTRA_MODULES - {"starlette"}  # starlette comes with fastapi
    assert {"ray", "fastapi", "sqlalchemy", "uvicorn"} <= extra and not base & SERVICE_EXTRA_MODULES
    assert "prism-challenge[service]" in project["optional-dependencies"]["test"]


@pytest.fixture(scope="module")
def plain_env(tmp_path_factory):
    shadow = tmp_path_factory.mktemp("shadow")
    for name in SERVICE_EXTRA_MODULES - {"jinja2"}:  # torch itself requires jinja2: every install has it
        (shadow / name).mkdir()
        (shadow / name / "__init__.py").write_text(
            f"raise ModuleNotFoundError(\"No module named '{name}' (shadowed: a plain install)\", name={name!r})\n")
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(shadow), os.environ.get("PYTHONPATH", "")])}


def _prism(env, *argv, cwd=None):
    return subprocess.run([sys.executable, "-m", "prism_challenge.cli", *argv], env=env, cwd=cwd,
                          capture_output=True, text=True, timeout=900)


def test_the_shadow_really_hides_the_extra(plain_env):
    r = subprocess.run([sys.executable, "-c", "import ray"], env=plain_env, capture_output=True, text=True)
    assert r.returncode == 1 and "No module named 'ray' (shadowed" in r.stderr


@pytest.mark.slow  # one short run of the example
def test_prism_eval_scores_without_the_service_extra(plain_env, tmp_path):
    r = _prism(plain_env, "eval", str(ROOT / "examples" / "tiny-1m"), "--token-budget", "2000", "--heldout-bytes",
               "0", "--out", str(tmp_path / "run"), "--json")
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout)
    # the embedded default text's first 2,000 tokens are 6,629 bytes; the example's bpb there
    # (this VM, with every extra installed: 4.669927683498454), to float noise across CPUs
    assert out["status"] == "scored" and out["tokens"] == 2000 and out["bytes"] == 6629
    assert out["prequential_bpb"] == pytest.approx(4.669927683498454, abs=1e-3)


@pytest.mark.parametrize("argv", [["serve", "--no-dispatch"], ["fleet", "status"]])
def test_a_service_command_without_the_extra_names_the_install_in_one_line(plain_env, tmp_path, argv):
    r = _prism(plain_env, *argv, cwd=tmp_path)
    assert r.returncode == 2 and r.stdout == ""
    line = r.stderr.strip()
    assert "\n" not in line and "Traceback" not in line
    assert line.startswith(f"prism {argv[0]}: needs the service extra (") and "pip install 'prism-challenge[service]'" in line


def test_a_submodule_missing_from_an_installed_service_package_is_raised_not_called_a_plain_install(tmp_path):
    # sqlalchemy is installed, but broken: its __init__ imports a submodule that is not there (a
    # half-upgraded install). "pip install the service extra" would not fix it; the real error must show
    shadow = tmp_path / "broken"
    (shadow / "sqlalchemy").mkdir(parents=True)
    (shadow / "sqlalchemy" / "__init__.py").write_text("import sqlalchemy.missing_part\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(shadow), os.environ.get("PYTHONPATH", "")])}
    r = _prism(env, "fleet", "status", "--db", f"sqlite:///{tmp_path / 'db.sqlite3'}", cwd=tmp_path)
    assert r.returncode == 1 and "needs the service extra" not in r.stderr
    last = r.stderr.rstrip().splitlines()[-1]
    assert last == "ModuleNotFoundError: No module named 'sqlalchemy.missing_part'"
