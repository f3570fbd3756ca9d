"""The runtime audit hook (evaluator/audit.py) refuses each class of escape from a bundle frame,
with the event named, and admits an honest (and a compiled) training step."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from prism_challenge.evaluator.audit import AUDIT_EXIT_CODE, describe_refusal, find_refusal

HERE = Path(__file__).parent
ELF = b"\x7fELF\x02\x01\x01\x00" + b"\x00" * 56


@pytest.fixture()
def bundle(tmp_path: Path) -> Path:
    root = tmp_path / "bundle"
    shutil.copytree(HERE / "audit_bundles", root)
    (root / "lib.txt").write_bytes(ELF)
    return root


def _run(bundle: Path, artifacts: Path, module: str, function: str, *args: str, env=None) -> subprocess.CompletedProcess:
    artifacts.mkdir(exist_ok=True)
    return subprocess.run(
        [sys.executable, str(HERE / "audit_driver.py"), str(bundle), str(artifacts), module, function, *args],
        capture_output=True, text=True, timeout=300, cwd=artifacts, env={**os.environ, "TORCHINDUCTOR_COMPILE_THREADS": "1", **(env or {})},
    )


def _refused(res: subprocess.CompletedProcess) -> dict:
    assert res.returncode == AUDIT_EXIT_CODE, (res.returncode, res.stdout, res.stderr[-2000:])
    found = find_refusal(res.stderr)
    assert found is not None, res.stderr[-2000:]
    assert "survived" not in res.stdout
    return found


@pytest.mark.parametrize(
    ("attack", "event", "rule"),
    [
        ("dlopen_bundle_file", "ctypes.dlopen", "prism:audit-no-ffi"),
        ("dlopen_libc", "ctypes.dlopen", "prism:audit-no-ffi"),
        ("torch_load_library", "ctypes.dlopen", "prism:audit-no-ffi"),
        ("spawn_process", "subprocess.Popen", "prism:audit-no-process"),
        ("os_system", "os.system", "prism:audit-no-process"),
        ("fork", "os.fork", "prism:audit-no-process"),
        ("import_not_allowed", "import", "prism:audit-import-not-allowed"),
        ("frames", "sys._getframe", "prism:audit-no-introspection"),
        ("swallowed", "os.system", "prism:audit-no-process"),
        ("reopen_fd", "open", "prism:audit-no-fd-open"),
        ("relative_to_dir_fd", "open", "prism:audit-no-relative-path"),
        ("rewrite_gated_file", "open", "prism:audit-no-write-outside-artifacts"),
    ],
)
def test_each_escape_is_refused_with_its_event(bundle: Path, tmp_path: Path, attack: str, event: str, rule: str) -> None:
    found = _refused(_run(bundle, tmp_path / "art", "attacks", attack, str(bundle), str(tmp_path / "art")))
    assert (found["event"], found["rule"]) == (event, rule)
    assert found["origin"].startswith(str(bundle / "attacks.py") + ":")
    assert describe_refusal(found).startswith(f"the runtime audit hook refused {event}(")


def test_a_file_outside_is_neither_read_nor_written(bundle: Path, tmp_path: Path) -> None:
    outside = Path(tempfile.mkdtemp(dir="/var/tmp"))  # not under /tmp, which is writable
    salt = outside / "data.salt"
    salt.write_bytes(b"secret")
    found = _refused(_run(bundle, tmp_path / "art", "attacks", "read_salt", str(bundle), str(salt)))
    assert (found["event"], found["arg"], found["rule"]) == ("open", repr(str(salt)), "prism:audit-no-read-outside-install")
    try:
        found = _refused(_run(bundle, tmp_path / "art", "attacks", "write_outside", str(bundle), str(outside / "planted")))
        assert found["rule"] == "prism:audit-no-write-outside-artifacts"
        assert not (outside / "planted").exists()
    finally:
        shutil.rmtree(outside)


def test_an_extension_module_from_a_writable_dir_is_not_loaded(bundle: Path, tmp_path: Path) -> None:
    target = tmp_path / "art" / "evil.cpython-311-x86_64-linux-gnu.so"
    target.parent.mkdir()
    target.write_bytes(ELF)
    found = _refused(_run(bundle, tmp_path / "art", "attacks", "extension_from_tmp", str(bundle), str(target)))
    assert (found["event"], found["rule"]) == ("import", "prism:audit-no-native-load")


def test_a_loopback_connection_is_refused_before_it_is_made(bundle: Path, tmp_path: Path) -> None:
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    listener.settimeout(0.5)
    try:
        found = _refused(_run(bundle, tmp_path / "art", "attacks", "connect_loopback", str(bundle), str(listener.getsockname()[1])))
        with pytest.raises(TimeoutError):
            listener.accept()
    finally:
        listener.close()
    assert (found["event"], found["rule"]) == ("socket.__new__", "prism:audit-no-network")


@pytest.mark.parametrize("compiled", ["", pytest.param("1", marks=pytest.mark.slow)])
def test_an_honest_step_runs_and_a_compiled_one_is_admitted(bundle: Path, tmp_path: Path, compiled: str) -> None:
    env = {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "art" / "inductor")} if compiled else None
    res = _run(bundle, tmp_path / "art", "honest", "train", str(tmp_path / "art"), compiled, env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    assert find_refusal(res.stderr) is None
    loss = json.loads(res.stdout.strip().splitlines()[-1])["result"]
    assert 0.0 < loss < 10.0
    assert (tmp_path / "art" / "state.pt").stat().st_size > 0


def test_a_stdlib_import_on_the_bundles_behalf_is_the_stdlibs(bundle: Path, tmp_path: Path) -> None:
    res = _run(bundle, tmp_path / "art", "attacks", "stdlib_lazy_import", str(bundle), "-")
    assert res.returncode == 0, res.stderr[-2000:]
    assert json.loads(res.stdout.strip().splitlines()[-1])["result"] == "xn--bcher-kva.example"


def test_nothing_written_is_imported_as_code(bundle: Path, tmp_path: Path) -> None:
    art = tmp_path / "art"
    found = _refused(_run(bundle, art, "attacks", "plant_module", str(bundle), str(art)))
    assert (found["event"], found["rule"]) == ("open", "prism:audit-no-code-outside-install")
    assert found["arg"].startswith(repr(str(art))[:-1])  # its bytecode cache or its source: never read


def test_the_working_directory_leaves_the_import_path(bundle: Path, tmp_path: Path) -> None:
    art = tmp_path / "art"
    art.mkdir()
    argv = [str(HERE / "audit_driver.py"), str(bundle), str(art), "attacks", "import_path_after_arm", str(bundle), str(art)]
    code = f"import runpy, sys; sys.path.insert(0, ''); sys.argv = {argv!r}; runpy.run_path(sys.argv[0], run_name='__main__')"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=art)
    assert res.returncode == 0, res.stderr[-2000:]
    assert json.loads(res.stdout.strip().splitlines()[-1])["result"] == []


def test_no_method_of_an_event_argument_runs_inside_the_hook(bundle: Path, tmp_path: Path) -> None:
    """A str subclass's ``__getitem__`` ran inside the hook's realpath, with the reentrancy guard
    up, so everything it did went unaudited (red team); the hook copies arguments to plain str."""
    res = _run(bundle, tmp_path / "art", "attacks", "str_subclass_path", str(bundle), str(tmp_path / "art"))
    assert res.returncode == 0, res.stderr[-2000:]
    assert json.loads(res.stdout.strip().splitlines()[-1])["result"] == []
