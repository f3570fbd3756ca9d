"""The sandbox's self-test (``evaluator/selftest.py``): it passes on a host whose sandbox holds,
and refuses, naming the probes, where confinement is broken (simulated from the trusted side:
sabotage mode switches every layer off; the filter alone switched off is named alone)."""

import sys

import pytest

from prism_challenge.cli import main
from prism_challenge.evaluator import isolation, sabotage, seccompfilter, selftest

from helpers import EXAMPLE

pytest.importorskip("pyseccomp")
needs_sandbox = pytest.mark.skipif(sys.platform != "linux" or isolation.available_backend() is None,
                                   reason="no working sandbox backend")
pytestmark = needs_sandbox


@pytest.fixture(autouse=True)
def _own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PRISM_CACHE_DIR", str(tmp_path / "cache"))


def test_every_probe_is_held_here():
    assert selftest.run_probes() == []


def test_a_pass_is_cached_per_host_version_kernel_and_filter(tmp_path):
    selftest.require(cached=True)
    passed = list((tmp_path / "cache" / "selftest").iterdir())
    assert [p.name for p in passed] == [f"{selftest.cache_key()}.json"]


def test_confinement_switched_off_is_refused_naming_every_probe(monkeypatch):
    monkeypatch.setenv(sabotage.ENV, "1")
    with pytest.raises(selftest.SelfTestFailed) as info:
        selftest.require(cached=True)
    assert info.value.probes == list(selftest.PROBES)
    for name in selftest.PROBES:
        assert repr(name) in str(info.value)


def test_a_cached_pass_does_not_cover_a_broken_sandbox(tmp_path, monkeypatch):
    selftest.require(cached=True)  # a pass, cached
    monkeypatch.setenv(sabotage.ENV, "1")  # then confinement breaks: the key changes, the probes run again
    with pytest.raises(selftest.SelfTestFailed):
        selftest.require(cached=True)


def test_the_filter_alone_off_is_named_alone(monkeypatch):
    monkeypatch.setattr(seccompfilter, "spec_entry", lambda: None)
    with pytest.raises(selftest.SelfTestFailed) as info:
        selftest.require(cached=False)
    assert info.value.probes == ["denied system call"]
    assert "'denied system call'" in str(info.value) and "'network'" not in str(info.value)


def test_prism_eval_refuses_a_broken_host_before_running(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(sabotage.ENV, "1")
    code = main(["eval", str(EXAMPLE), "--token-budget", "1000", "--out", str(tmp_path / "out"), "--no-progress"])
    err = capsys.readouterr().err
    assert code == 1
    assert "prism eval: the sandbox self-test failed" in err and "'host file'" in err
    assert not (tmp_path / "out").exists()


def test_prism_serve_refuses_a_broken_host_before_the_dispatcher_starts(monkeypatch, capsys):
    from types import SimpleNamespace

    from prism_challenge import cli_service
    from prism_challenge.service import app as service_app

    started = []
    monkeypatch.setattr(service_app, "start_dispatcher", lambda app: started.append(app))
    monkeypatch.setenv(sabotage.ENV, "1")
    assert cli_service._serve(object(), SimpleNamespace(dispatch=True)) == 2
    assert started == [] and "prism serve: the sandbox self-test failed" in capsys.readouterr().err
