"""CUDA in the jailed children, on CPU (issue 26, items 3, 4 and 7):

* CUDA starts before the audit hook is armed (evaluator/cudainit.py), and the hook admits exactly
  torch's own NVML load from torch's own frames (evaluator/gpuadmit.py): synthetic audit events
  on fake stacks, and the real events of torch's NVML functions against a stand-in
  ``libnvidia-ml.so.1`` built here;
* Triton's programs and cache, inside a compilation, and the near misses that stay refused;
* a cgroup byte limit on CUDA, independent of ``RLIMIT_AS`` (evaluator/jail.py).
"""

from __future__ import annotations

import ctypes
import os
import tempfile
import resource
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import torch

from prism_challenge.evaluator import gpuadmit, memcgroup
from prism_challenge.evaluator.audit import AUDIT_EXIT_CODE, build_policy, find_refusal
from prism_challenge.evaluator.cudainit import start_cuda
from prism_challenge.evaluator.envpolicy import sandbox_env
from prism_challenge.evaluator.isolation import Limits
from prism_challenge.evaluator.jail import MEMORY_UNBOUNDED_WARNING, Jail, child_env, jail_limits
from prism_challenge.evaluator.launcher import compute_env
from prism_challenge.evaluator.memcgroup import MemoryCgroup

HERE = Path(__file__).parent
SITE = os.path.realpath(sysconfig.get_paths()["purelib"])
TORCH_CUDA = os.path.realpath(torch.cuda.__file__)
CTYPES = os.path.realpath(ctypes.__file__)
SUBPROCESS = os.path.realpath(subprocess.__file__)
TRITON = os.path.join(SITE, "triton")
PTXAS = os.path.join(TRITON, "backends", "nvidia", "bin", "ptxas")
ENTRY = os.path.join(SITE, "torch", "_dynamo", "convert_frame.py")
HEURISTICS = os.path.join(SITE, "torch", "_inductor", "runtime", "triton_heuristics.py")


class _Code:
    def __init__(self, filename: str, name: str):
        self.co_filename, self.co_name = filename, name


class _Frame:
    """A stand-in for a frame: the file and function the hook reads, and the caller."""

    def __init__(self, filename: str, name: str = "f", back: _Frame | None = None):
        self.f_code, self.f_back, self.f_lineno = _Code(filename, name), back, 1


def stack(*frames: tuple[str, str]) -> _Frame:
    """Frames innermost first: ``stack((file, function), ...)``."""
    frame = None
    for filename, name in reversed(frames):
        frame = _Frame(filename, name, frame)
    return frame


@pytest.fixture()
def policy(tmp_path: Path, monkeypatch):
    monkeypatch.setenv("TRITON_CACHE_DIR", gpuadmit.TRITON_CACHE_DIR)
    monkeypatch.setattr(tempfile, "tempdir", "/tmp")  # as in a rank: the sandbox's TMPDIR is its private /tmp
    bundle = tmp_path / "bundle"
    (bundle / "torch" / "cuda").mkdir(parents=True)
    (bundle / "architecture.py").write_text("x = 1\n")
    (tmp_path / "art").mkdir()
    pol = build_policy(str(bundle), [str(tmp_path / "art")])
    pol.test_bundle, pol.test_art = str(bundle), str(tmp_path / "art")
    return pol


def nvml_stack(policy, function: str = "_raw_device_count_nvml", torch_file: str = TORCH_CUDA) -> _Frame:
    """ctypes's own frame, torch's NVML function, torch's device_count, the bundle's call."""
    return stack((CTYPES, "__init__"), (torch_file, function), (TORCH_CUDA, "device_count"),
                 (os.path.join(policy.test_bundle, "architecture.py"), "build_model"))


def nvml_library() -> ctypes.CDLL:
    """A loaded library that stands for NVML (libm, renamed as ``CDLL("libnvidia-ml.so.1")`` names it)."""
    lib = ctypes.CDLL("libm.so.6")
    vars(lib)["_name"] = gpuadmit.NVML_LIBRARY
    return lib


# -- item 3: CUDA start-up and torch's NVML load ----------------------------------------------
def test_start_cuda_initialises_selects_and_fills_the_count_cache_in_that_order():
    calls = []

    class FakeCuda:
        def init(self):
            calls.append("init")

        def set_device(self, n):
            calls.append(f"set_device({n})")

        def device_count(self):
            calls.append("device_count")
            return 2

    assert start_cuda("cuda:1", FakeCuda()) == "cuda:1"
    assert start_cuda("cuda", FakeCuda()) == "cuda:0"
    assert calls == ["init", "set_device(1)", "device_count", "init", "set_device(0)", "device_count"]
    assert start_cuda("cpu", FakeCuda()) == "cpu" and len(calls) == 6  # nothing on CPU
    for bad in ("mps", "cuda:x", "cpu:0"):
        with pytest.raises(ValueError, match="expected cpu, cuda or cuda:N"):
            start_cuda(bad, FakeCuda())


def test_torchs_nvml_load_from_torchs_own_function_is_admitted(policy):
    lib = nvml_library()
    for function in sorted(gpuadmit.NVML_FUNCTIONS):
        frame = nvml_stack(policy, function)
        assert policy.rule("ctypes.dlopen", ("libnvidia-ml.so.1",), frame) is None
        for symbol in sorted(gpuadmit.NVML_SYMBOLS):
            assert policy.rule("ctypes.dlsym", (lib, symbol), frame) is None
        assert policy.rule("ctypes.create_string_buffer", (None, 96), frame) is None


@pytest.mark.parametrize("case", ["other_library", "library_path", "bundle_frame", "other_torch_function",
                                  "bundle_copy_of_torch", "writable_copy_of_torch", "other_symbol",
                                  "symbol_of_other_library", "huge_buffer", "other_ctypes_event"])
def test_near_misses_of_the_nvml_load_are_refused(policy, case):
    lib, frame = nvml_library(), nvml_stack(policy)
    event, args = "ctypes.dlopen", ("libnvidia-ml.so.1",)
    if case == "other_library":
        args = ("libc.so.6",)
    elif case == "library_path":
        args = (os.path.join(policy.test_art, "libnvidia-ml.so.1"),)
    elif case == "bundle_frame":  # the bundle opens it itself
        frame = stack((CTYPES, "__init__"),
                      (os.path.join(policy.test_bundle, "architecture.py"), "_raw_device_count_nvml"))
    elif case == "other_torch_function":
        frame = nvml_stack(policy, "device_count")
    elif case == "bundle_copy_of_torch":  # a file that looks like torch's, in the bundle
        frame = nvml_stack(policy, torch_file=os.path.join(policy.test_bundle, "torch", "cuda", "__init__.py"))
    elif case == "writable_copy_of_torch":
        frame = nvml_stack(policy, torch_file=os.path.join(policy.test_art, "torch", "cuda", "__init__.py"))
    elif case == "other_symbol":
        event, args = "ctypes.dlsym", (lib, "nvmlDeviceSetPersistenceMode")
    elif case == "symbol_of_other_library":
        event, args = "ctypes.dlsym", (ctypes.CDLL("libm.so.6"), "nvmlInit")
    elif case == "huge_buffer":
        event, args = "ctypes.create_string_buffer", (None, 1 << 20)
    elif case == "other_ctypes_event":
        event, args = "ctypes.string_at", (0, 8)
    assert policy.rule(event, args, frame) == "no-ffi"


FAKE_NVML = r"""
#include <string.h>
int nvmlInit(void) { return 0; }
int nvmlDeviceGetCount_v2(int *n) { *n = 3; return 0; }
int nvmlDeviceGetHandleByIndex_v2(unsigned i, void **h) { *h = (void *)(unsigned long)(i + 1); return 0; }
int nvmlDeviceGetUUID(void *h, char *buf, unsigned len) {
  const char *ids[] = {"GPU-aaaa", "GPU-bbbb", "GPU-cccc"};
  strncpy(buf, ids[(unsigned long)h - 1], len); return 0; }
"""

PROBE = """import torch


def count():
    return torch.cuda._device_count_nvml()


def dlopen_nvml_itself():
    return torch.ops.load_library("libnvidia-ml.so.1")
"""


@pytest.fixture()
def fake_nvml(tmp_path: Path) -> Path:
    if shutil.which("gcc") is None:
        pytest.skip("no C compiler to build the stand-in NVML")
    libdir = tmp_path / "nvml"
    libdir.mkdir()
    (libdir / "nvml.c").write_text(FAKE_NVML)
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(libdir / "libnvidia-ml.so.1"), str(libdir / "nvml.c")],
                   check=True, capture_output=True)
    return libdir


@pytest.mark.parametrize(("visible", "count"), [("0,1", 2), ("GPU-bbbb,GPU-cccc", 2), ("0,1,2,3", 3), ("0", None)])
def test_torchs_real_nvml_functions_run_under_the_armed_hook(tmp_path, fake_nvml, visible, count):
    # torch's own _device_count_nvml (the path device_count takes before CUDA started, on torch
    # before 2026-02): its real ctypes events, raised under the armed hook from a bundle's call
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    (bundle / "probe.py").write_text(PROBE)
    (tmp_path / "art").mkdir()
    env = {**os.environ, "LD_LIBRARY_PATH": str(fake_nvml), "CUDA_VISIBLE_DEVICES": visible,
           "TORCHINDUCTOR_COMPILE_THREADS": "1"}
    function = "count" if count else "dlopen_nvml_itself"
    res = subprocess.run([sys.executable, str(HERE / "audit_driver.py"), str(bundle), str(tmp_path / "art"), "probe",
                          function], capture_output=True, text=True, timeout=300, env=env)
    if count:
        assert res.returncode == 0, res.stderr[-2000:]
        assert res.stdout.strip().splitlines()[-1] == f'{{"result": {count}}}'
        return
    # the same library through torch's other loader (torch/_ops.py, not an NVML function): refused
    assert res.returncode == AUDIT_EXIT_CODE, res.stderr[-2000:]
    found = find_refusal(res.stderr)
    assert (found["event"], found["rule"]) == ("ctypes.dlopen", "prism:audit-no-ffi")
    assert found["arg"].endswith("libnvidia-ml.so.1'")


# -- item 4: Triton's programs and cache --------------------------------------------------------
def triton_stack(policy, triton_file: str = "backends/nvidia/compiler.py", entry: bool = True) -> _Frame:
    """subprocess's frame, Triton's, inductor's, dynamo's compile entry, the bundle's forward."""
    frames = [(SUBPROCESS, "_execute_child"), (os.path.join(TRITON, triton_file), "make_cubin"),
              (HEURISTICS, "precompile")]
    if entry:
        frames.append((ENTRY, "_compile"))
    frames.append((os.path.join(policy.test_bundle, "architecture.py"), "forward"))
    return stack(*frames)


def popen(argv: list[str]) -> tuple:
    return (argv[0], argv, None, None)


PTXAS_CUBIN = [PTXAS, "-lineinfo", "-v", "--gpu-name=sm_90a", "/tmp/tmpab12.ptx", "-o", "/tmp/tmpab12.ptx.o"]


@pytest.mark.parametrize(("triton_file", "argv"), [
    ("backends/nvidia/driver.py", ["/sbin/ldconfig", "-p"]),
    ("knobs.py", [PTXAS, "--version"]),
    ("backends/nvidia/compiler.py", PTXAS_CUBIN),
    ("backends/nvidia/compiler.py", [os.path.join(SITE, "torch", "bin", "ptxas"), "--version"]),
    ("runtime/build.py", ["/usr/bin/gcc", "/tmp/tmpx/main.c", "-O3", "-shared", "-fPIC", "-o", "/tmp/tmpx/m.so"]),
])
def test_tritons_programs_inside_a_compilation_are_admitted(policy, triton_file, argv):
    assert policy.rule("subprocess.Popen", popen(argv), triton_stack(policy, triton_file)) is None


@pytest.mark.parametrize("case", ["ldconfig_other_args", "ldconfig_from_the_bundle", "ldconfig_outside_a_compilation",
                                  "ptxas_from_tmp", "ptxas_from_the_artifacts", "ptxas_from_torch_not_triton",
                                  "ptxas_other_argv0", "shell_from_triton"])
def test_near_misses_of_tritons_programs_are_refused(policy, case):
    frame, argv = triton_stack(policy), [PTXAS, "--version"]
    if case == "ldconfig_other_args":
        argv = ["/sbin/ldconfig", "-p", "-C", "/tmp/cache"]
    elif case == "ldconfig_from_the_bundle":
        argv = ["/sbin/ldconfig", "-p"]
        frame = stack((SUBPROCESS, "_execute_child"), (os.path.join(policy.test_bundle, "architecture.py"), "f"),
                      (ENTRY, "_compile"))
    elif case == "ldconfig_outside_a_compilation":
        argv, frame = ["/sbin/ldconfig", "-p"], triton_stack(policy, "backends/nvidia/driver.py", entry=False)
    elif case == "ptxas_from_tmp":
        argv = ["/tmp/triton/backends/nvidia/bin/ptxas", "--version"]
    elif case == "ptxas_from_the_artifacts":
        argv = [os.path.join(policy.test_art, "triton", "backends", "nvidia", "bin", "ptxas"), "--version"]
    elif case == "ptxas_from_torch_not_triton":  # inductor's frame, not Triton's
        frame = stack((SUBPROCESS, "_execute_child"), (HEURISTICS, "precompile"), (ENTRY, "_compile"))
    elif case == "ptxas_other_argv0":
        argv = [PTXAS, "--version"]
        assert policy.rule("subprocess.Popen", ("/bin/sh", argv, None, None), frame) == "no-process"
        return
    elif case == "shell_from_triton":
        argv = ["/bin/sh", "-c", "id"]
    assert policy.rule("subprocess.Popen", popen(argv), frame) == "no-process"


def test_tritons_cache_is_the_harness_folder_and_only_the_compiler_writes_and_loads_it(policy):
    launcher = os.path.join(gpuadmit.TRITON_CACHE_DIR, "3f2a", "__triton_launcher.so")
    compiling = triton_stack(policy, "runtime/cache.py")
    bundle = stack((os.path.join(policy.test_bundle, "architecture.py"), "forward"))
    assert policy.rule("open", (launcher, "wb", 0o1101), compiling) is None  # Triton writes its launcher
    assert policy.rule("open", (launcher, "rb", 0), compiling) is None
    assert policy.rule("import", ("__triton_launcher", launcher, None, None, None), compiling) is None
    assert policy.rule("open", (launcher, "wb", 0o1101), bundle) == "no-write-to-compiler-cache"
    assert policy.rule("import", ("__triton_launcher", launcher, None, None, None), bundle) == "no-native-load"
    for elsewhere in ("/tmp/.triton/cache/3f2a/__triton_launcher.so",  # Triton's default, not the harness's
                      os.path.join(policy.test_art, "3f2a", "__triton_launcher.so")):
        assert policy.rule("open", (elsewhere, "rb", 0), compiling) == "no-code-outside-install"
        assert policy.rule("import", ("__triton_launcher", elsewhere, None, None, None), compiling) == "no-native-load"


def test_triton_reads_back_the_launcher_it_built_in_a_temporary_folder_and_nothing_else(policy):
    built = "/tmp/tmpk2x9/__triton_launcher.cpython-311-x86_64-linux-gnu.so"
    opened = (built, "rb", 0)
    assert policy.rule("open", opened, triton_stack(policy, "runtime/build.py")) is None
    assert policy.rule("open", opened, triton_stack(policy, "backends/nvidia/driver.py")) is None  # Triton < 3.3
    refused = [
        policy.rule("open", opened, triton_stack(policy, "knobs.py")),  # another Triton file
        policy.rule("open", opened, triton_stack(policy, "runtime/build.py", entry=False)),  # no compilation
        policy.rule("open", opened, stack((os.path.join(policy.test_bundle, "architecture.py"), "f"), (ENTRY, "c"))),
        policy.rule("open", ("/tmp/a/b/evil.so", "rb", 0), triton_stack(policy, "runtime/build.py")),
        policy.rule("open", ("/tmp/tmpk2x9/evil.py", "rb", 0), triton_stack(policy, "runtime/build.py")),
        policy.rule("open", (os.path.join(policy.test_art, "x", "evil.so"), "rb", 0),
                    triton_stack(policy, "runtime/build.py")),
    ]
    assert refused == ["no-code-outside-install"] * 6


def test_the_harness_sets_tritons_cache_and_keeps_only_the_hosts_libcuda_path(monkeypatch):
    host = {"TRITON_LIBCUDA_PATH": "/usr/local/nvidia/lib64", "TRITON_CACHE_DIR": "/home/me/.triton",
            "TRITON_PTXAS_PATH": "/tmp/ptxas", "TRITON_HOME": "/tmp"}
    env = sandbox_env(host)
    assert env["TRITON_LIBCUDA_PATH"] == "/usr/local/nvidia/lib64"
    assert not {"TRITON_CACHE_DIR", "TRITON_PTXAS_PATH", "TRITON_HOME"} & set(env)
    assert compute_env(2)["TRITON_CACHE_DIR"] == gpuadmit.TRITON_CACHE_DIR == "/tmp/prism-triton-cache"
    for key, value in host.items():
        monkeypatch.setenv(key, value)
    env = child_env(2)
    assert env["TRITON_CACHE_DIR"] == gpuadmit.TRITON_CACHE_DIR and "TRITON_PTXAS_PATH" not in env


# -- item 7: a cgroup byte limit on CUDA ------------------------------------------------------
class _Group:
    def __init__(self, limit: int):
        self.limit, self.removed = limit, False

    def remove(self):
        self.removed = True


def test_cuda_limits_have_a_cgroup_byte_limit_and_no_address_space_cap():
    cuda, cpu = jail_limits("cuda", 20 << 30, max_open_files=64), jail_limits("cpu", 20 << 30)
    assert (cuda.address_space_bytes, cuda.memory_bytes, cuda.cgroup_bytes(), cuda.max_open_files) == (
        None, 20 << 30, 20 << 30, 64)
    assert (cpu.address_space_bytes, cpu.cgroup_bytes()) == (20 << 30, 20 << 30)
    assert Limits(address_space_bytes=5).cgroup_bytes() == 5 and Limits().cgroup_bytes() is None
    assert resource.RLIMIT_AS not in dict(cuda.rlimits()) and dict(cpu.rlimits())[resource.RLIMIT_AS] == 20 << 30


@pytest.mark.parametrize(("device", "cgroup", "held", "rlimit_as", "warned"), [
    ("cuda", True, "cgroup", None, False),
    ("cuda", False, "none", None, True),
    ("cpu", True, "cgroup", None, False),
    ("cpu", False, "rlimit", 8 << 30, False),
])
def test_what_holds_a_childs_memory(monkeypatch, tmp_path, device, cgroup, held, rlimit_as, warned):
    made = []

    def create(limit, *a, **k):
        made.append(limit)
        return _Group(limit) if cgroup else None

    monkeypatch.setattr(MemoryCgroup, "create", staticmethod(create))
    jail = Jail("none", str(tmp_path), (), jail_limits(device, 8 << 30), 1)
    limits, group = jail._memory()
    assert made == [8 << 30] and (group is not None) == cgroup
    assert limits.address_space_bytes == rlimit_as
    summary = jail.summary()
    assert summary["memory_limit_by"] == held and jail.memory_unbounded == warned
    assert summary.get("memory_warning") == (MEMORY_UNBOUNDED_WARNING if warned else None)


def test_the_weakest_childs_bound_is_what_the_manifest_records(monkeypatch, tmp_path):
    answers = iter([_Group(1), None, _Group(1)])
    monkeypatch.setattr(MemoryCgroup, "create", staticmethod(lambda limit, *a, **k: next(answers)))
    jail = Jail("none", str(tmp_path), (), jail_limits("cuda", 1 << 30), 1)
    assert [jail._memory()[1] is not None for _ in range(3)] == [True, False, True]
    assert jail.summary()["memory_limit_by"] == "none" and "memory_warning" in jail.summary()


def test_a_cgroup_is_made_with_the_byte_limit_on_a_cgroup2_tree(tmp_path):
    root = tmp_path / "cgroup"
    own = root / "system.slice" / "prism.service"
    own.mkdir(parents=True)
    (root / "cgroup.controllers").write_text("cpu memory pids\n")
    (own / "cgroup.subtree_control").write_text("memory pids\n")
    proc = tmp_path / "proc-self-cgroup"
    proc.write_text("0::/system.slice/prism.service\n")
    group = MemoryCgroup.create(6 << 30, root=root, proc_cgroup=str(proc))
    assert group is not None and group.path.parent == own
    assert (group.path / "memory.max").read_text() == str(6 << 30)
    (own / "cgroup.subtree_control").write_text("pids\n")  # memory not delegated: no group
    assert MemoryCgroup.create(6 << 30, root=root, proc_cgroup=str(proc)) is None
    assert MemoryCgroup.create(6 << 30, root=tmp_path / "v1-only", proc_cgroup=str(proc)) is None


def test_this_hosts_cuda_memory_bound_is_stated(tmp_path):
    # whatever this host offers, a CUDA jail says what holds the memory, and warns when nothing does
    jail = Jail("none", str(tmp_path), (), jail_limits("cuda", 1 << 30), 1)
    limits, group = jail._memory()
    try:
        v2 = (memcgroup.CGROUP_ROOT / "cgroup.controllers").is_file()
        assert jail.summary()["memory_limit_by"] == ("cgroup" if group is not None else "none")
        assert group is not None or not v2 or jail.memory_unbounded
        if not v2:
            assert jail.summary()["memory_warning"] == MEMORY_UNBOUNDED_WARNING
    finally:
        jail._release(group)
