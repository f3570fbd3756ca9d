"""Issue 13's acceptance: each class of escape is refused at the gate, and, with the static gate
switched off, stopped at run time by the audit hooks and the sandbox in every kind of child (the
parameter child of ``prism check`` and ``prism eval``, the ranks, the held-out child, the blind
probe), with the event named; no process that imports the bundle shares the host's network."""

from __future__ import annotations

import os
import shutil
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

import bundles  # noqa: E402
from prism_challenge.pipeline import EvalOptions, evaluate  # noqa: E402
from prism_challenge.evaluator import isolation  # noqa: E402
from prism_challenge.intake.frozen import freeze  # noqa: E402
from prism_challenge.gates import parameter_gate, run_gates  # noqa: E402
from prism_challenge.intake.bundle import load_bundle  # noqa: E402

needs_sandbox = pytest.mark.skipif(isolation.available_backend() is None, reason="no working sandbox backend")

EVENTS = {
    "dlopen": "ctypes.dlopen",
    "torch_load_library": "ctypes.dlopen",
    "salt": "open",
    "socket": "socket.",  # socket.getaddrinfo or socket.__new__, whichever comes first
    "write_outside": "open",
    "process": "subprocess.Popen",
    "rewrite": "open",
}
GATE_RULES = {
    "dlopen": "prism:no-ffi",
    "torch_load_library": "prism:no-ffi",
    "salt": "prism:no-filesystem",
    "socket": "prism:no-network",
    "write_outside": "prism:no-filesystem",
    "process": "prism:no-process",
    "rewrite": "prism:no-process",
}


@pytest.fixture(scope="module")
def salt():
    """A data salt as ``prism data prepare`` leaves one: mode 0600, outside /tmp (which jailed
    processes may write, so the hook lets them read it)."""
    base = Path(tempfile.mkdtemp(prefix="prism-salt-", dir="/var/tmp"))
    path = base / "data.salt"
    path.write_text("00" * 32 + "\n")
    path.chmod(0o600)
    yield path
    shutil.rmtree(base, ignore_errors=True)


@pytest.fixture()
def listener():
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.bind(("127.0.0.1", 0))
    s.listen(4)
    s.settimeout(0.2)
    yield s
    s.close()


def _no_connection(listener: socket.socket) -> None:
    with pytest.raises(TimeoutError):
        listener.accept()


@pytest.mark.parametrize("attack", sorted(bundles.ATTACKS))
def test_the_gate_refuses_each_attack(tmp_path, salt, attack):
    root = bundles.write(tmp_path / "b", attack, "param", salt=str(salt), port=9)
    report = run_gates(root, check_params=False)
    try:
        assert report.blocking
        assert GATE_RULES[attack] in {f.rule for f in report.findings if f.blocking}
    finally:
        report.cleanup()


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["none", pytest.param("strict", marks=needs_sandbox)])
@pytest.mark.parametrize("attack", sorted(bundles.ATTACKS))
def test_the_parameter_child_stops_each_attack_without_the_gate(tmp_path, salt, listener, attack, mode):
    """``prism check``'s parameter gate on a bundle the static gate never saw: the hook names
    the event, with or without the sandbox around it."""
    root = bundles.write(tmp_path / "b", attack, "param", salt=str(salt), port=listener.getsockname()[1])
    frozen = freeze(root)
    try:
        findings, count = parameter_gate(load_bundle(frozen.root), vocab_size=257, isolation=mode)
        assert frozen.changes() == []
    finally:
        frozen.remove()
    assert count is None
    assert [f.rule for f in findings] == ["prism:audit"], findings
    assert f"the runtime audit hook refused {EVENTS[attack]}" in findings[0].message
    _no_connection(listener)
    assert not Path(f"/var/tmp/prism-planted-{listener.getsockname()[1]}").exists()


ENV_AND_NATIVE = '''
import os
import torch
from torch import nn


def build_model(ctx):
    got = 0
    if os.environ.get("PRISM_TEST_PARENT_SECRET"):
        got += 1
    try:
        got += 2 * int(torch.from_file({salt!r}, size=1, dtype=torch.uint8).numel())  # native read: no audit event
    except RuntimeError:
        pass
    return Count(ctx.vocab_size, 1 + got)  # 1 + got parameters: what the child obtained


class Count(nn.Module):
    def __init__(self, v, n):
        super().__init__()
        self.v = v
        self.p = nn.Parameter(torch.zeros(n))

    def forward(self, tokens):
        return torch.zeros(tokens.shape[0], tokens.shape[1], self.v) * self.p.sum()
'''


@pytest.mark.slow
@needs_sandbox
def test_the_sandboxed_parameter_child_gets_no_parent_env_and_no_salt(tmp_path, salt, monkeypatch):
    monkeypatch.setenv("PRISM_TEST_PARENT_SECRET", "s3cret")
    root = bundles.write(tmp_path / "b", "salt", "none", salt=str(salt))
    (root / "architecture.py").write_text(ENV_AND_NATIVE.format(salt=str(salt)))
    frozen = freeze(root)
    try:
        bundle = load_bundle(frozen.root)
        strict, n_strict = parameter_gate(bundle, vocab_size=257, isolation="strict")
        none, n_none = parameter_gate(bundle, vocab_size=257, isolation="none")
    finally:
        frozen.remove()
    assert (strict, none) == ([], [])
    assert n_strict == 1  # neither the variable nor the salt reached the sandboxed child
    assert n_none == 1 + 2  # no sandbox: the native read got through (the environment is still clean)


def _eval(tmp_path, root, **kw):
    kw.setdefault("token_budget", 2000)
    kw.setdefault("seq_len", 32)
    kw.setdefault("threads", 1)
    kw.setdefault("heldout_bytes", 20_000)
    kw.setdefault("static_gates", False)
    return evaluate(EvalOptions(bundle=str(root), out_dir=str(tmp_path / "run"), **kw))


@pytest.mark.slow
@needs_sandbox
@pytest.mark.parametrize("attack", ["salt", "socket", "process", "torch_load_library"])
def test_the_ranks_stop_attacks_without_the_gate(tmp_path, salt, listener, attack):
    root = bundles.write(tmp_path / "b", attack, "rank", salt=str(salt), port=listener.getsockname()[1])
    out = _eval(tmp_path, root)
    assert out.failure is not None and out.failure.stage == "contract", out.failure
    assert f"the runtime audit hook refused {EVENTS[attack]}" in out.failure.message
    assert out.manifest["status"] == "failed"
    _no_connection(listener)


@pytest.mark.slow
@needs_sandbox
@pytest.mark.parametrize(("attack", "where"), [("write_outside", "heldout"), ("dlopen", "heldout"),
                                               ("rewrite", "blind")])
def test_the_heldout_and_blind_children_stop_attacks_without_the_gate(tmp_path, salt, attack, where):
    root = bundles.write(tmp_path / "b", attack, where, salt=str(salt), port=os.getpid())
    out = _eval(tmp_path, root, audited_batches=0)  # the held-out children are the fresh ones
    assert out.failure is None, out.failure
    verdict = out.manifest["verdict"]
    assert verdict["final_score"] == 0.0 and "heldout_contract" in verdict["flags"]
    assert f"the runtime audit hook refused {EVENTS[attack]}" in verdict["heldout_error"]
    assert not Path(f"/var/tmp/prism-planted-{os.getpid()}").exists()


@pytest.mark.slow
@needs_sandbox
def test_the_audit_children_stop_attacks_without_the_gate(tmp_path, salt):
    root = bundles.write(tmp_path / "b", "write_outside", "audit", salt=str(salt), port=os.getpid())
    out = _eval(tmp_path, root)
    assert out.failure is None, out.failure
    verdict, audit = out.manifest["verdict"], out.manifest["audit"]
    assert verdict["final_score"] == 0.0 and "audit" in verdict["flags"]
    assert not audit["passed"] and "the runtime audit hook refused open" in (audit["error"] or ""), audit
    assert not Path(f"/var/tmp/prism-planted-{os.getpid()}").exists()


SLOW_BUILD = '''
import torch
from torch import nn


def build_model(ctx):
    x = torch.ones(384, 384)
    for _ in range(100):  # about a second of work: the sampler sees every child that builds it
        x = (x @ x).clamp(max=1.0)
    return nn.Embedding(ctx.vocab_size, ctx.vocab_size)
'''


def _python_module(cmd: list[str]) -> str | None:
    """The module a ``python [-opts] -m MODULE ...`` command line runs, else ``None``."""
    if not cmd or not os.path.basename(cmd[0]).startswith("python") or "-m" not in cmd:
        return None
    i = cmd.index("-m")
    return cmd[i + 1] if "--" not in cmd[:i] and i + 1 < len(cmd) else None


def _descends_from(pid: str, ancestor: str) -> bool:
    """Whether process ``pid`` is a descendant of ``ancestor`` (this test's own children only)."""
    for _ in range(64):
        try:
            pid = open(f"/proc/{pid}/stat").read().rpartition(")")[2].split()[1]
        except (OSError, IndexError):
            return False
        if pid == ancestor:
            return True
        if pid in ("0", "1"):
            return False
    return False


def _sample(stop: threading.Event, seen: dict[str, set[str]]) -> None:
    host, me = os.readlink("/proc/self/ns/net"), str(os.getpid())
    kinds = {"prism_challenge.gates.param_count": "param", "prism_challenge.evaluator.rank": "rank",
             "prism_challenge.audit.heldout": "heldout"}
    while not stop.is_set():
        for pid in os.listdir("/proc"):
            if not pid.isdigit():
                continue
            try:
                cmd = open(f"/proc/{pid}/cmdline", "rb").read().decode(errors="replace").split("\0")
                net = os.readlink(f"/proc/{pid}/ns/net")
            except OSError:
                continue
            module = _python_module(cmd)
            if module in kinds and _descends_from(pid, me):  # the interpreter running it (not bwrap or the sandbox's init naming it)
                seen.setdefault(kinds[module], set()).add("host" if net == host else "own")
        time.sleep(0.02)


@pytest.mark.slow
@needs_sandbox
def test_no_process_that_imports_the_bundle_shares_the_host_network(tmp_path):
    """Samples /proc through a whole ``prism eval``: the parameter child, the ranks and the
    held-out children are each seen, and never in the host's network namespace."""
    from helpers import LOOP, write_bundle

    root = write_bundle(tmp_path / "b", SLOW_BUILD, LOOP.format(lr=0.1, batch=2, seq_len=32))
    seen: dict[str, set[str]] = {}
    stop = threading.Event()
    sampler = threading.Thread(target=_sample, args=(stop, seen), daemon=True)
    sampler.start()
    try:
        out = evaluate(EvalOptions(bundle=str(root), out_dir=str(tmp_path / "run"), token_budget=2000, seq_len=32,
                                   threads=1, heldout_bytes=20_000))
    finally:
        stop.set()
        sampler.join()
    assert out.failure is None, out.failure
    assert seen == {"param": {"own"}, "rank": {"own"}, "heldout": {"own"}}


def test_a_changed_frozen_copy_is_named(tmp_path):
    root = bundles.write(tmp_path / "b", "salt", "none")
    frozen = freeze(root)
    try:
        assert frozen.changes() == []
        arch = frozen.root / "architecture.py"
        assert arch.stat().st_mode & 0o777 == 0o444 and frozen.root.stat().st_mode & 0o777 == 0o555
        os.chmod(frozen.root, 0o755)  # only the owner (the trusted side) can do this
        os.chmod(arch, 0o644)
        arch.write_text("# rewritten\n")
        (frozen.root / "__pycache__").mkdir()
        assert frozen.changes() == ["__pycache__", "architecture.py"]
    finally:
        frozen.remove()
    assert not frozen.holder.exists()


LIMIT_LOOPS = {
    "memory": "    torch.empty(1 << 46, dtype=torch.uint8).fill_(1)  # 64 TiB: over any host's memory\n",
    "tasks": "    torch.set_num_threads(4000)  # over the sandbox uid's task limit\n"
             "    torch.ones(2048, 2048) @ torch.ones(2048, 2048)\n",
}


@pytest.mark.slow
@needs_sandbox
@pytest.mark.skipif(os.geteuid() != 0, reason="the task limit holds for the sandbox uid of a root run")
@pytest.mark.parametrize("limit", sorted(LIMIT_LOOPS))
def test_a_limit_reached_is_reported_as_such(tmp_path, limit):
    from helpers import UNIFORM_ARCH, write_bundle

    loop = "import torch\n\n\ndef train(ctx):\n" + LIMIT_LOOPS[limit]
    out = _eval(tmp_path, write_bundle(tmp_path / "b", UNIFORM_ARCH, loop))
    assert out.failure is not None and out.failure.stage == "resources", out.failure
    # memory: the runner's report, named; tasks: the guard's count or the rank's own report
    expected = ("memory: the process ran out of its memory limit",) if limit == "memory" else (
        "tasks: the process could not start a thread or process", "process limit: the sandbox reached")
    assert out.failure.message.startswith(expected), out.failure.message


ASSERT_INJECTION = '''
import torch
import torch.nn.functional as F


def warm(x):
    y = x * 2
    assert (y > -1e30).all(), "P\\'\\'\\' + str(__import__('os').system('touch pwned_by_inductor'))[:0] + r\\'\\'\\'Q"
    return y + 1


def train(ctx):
    torch.compile(warm)(torch.ones(8))
    model = ctx.build_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for batch in ctx.iter_train_batches(model, batch_size=2, seq_len=32):
        logits = model(batch.tokens)
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), batch.tokens[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
'''


@pytest.mark.slow
@needs_sandbox
def test_an_assert_message_never_becomes_compiled_code(tmp_path):
    """Red team: dynamo turned ``assert cond, msg`` into ``torch._assert_async`` and inductor
    pasted ``msg`` unescaped into the module it generated and loaded, under the compile admission:
    a gate-clean bundle ran ``os.system``. The rewrite is off in every child: the assert stays
    the bundle's own Python, and the run is scored honestly."""
    from helpers import UNIFORM_ARCH, write_bundle

    root = write_bundle(tmp_path / "b", UNIFORM_ARCH, ASSERT_INJECTION)
    report = run_gates(root, check_params=False)
    try:
        assert not report.blocking, report.findings  # the gate cannot see it: a string constant
    finally:
        report.cleanup()
    out = _eval(tmp_path, root, static_gates=True)
    assert out.failure is None, out.failure
    assert not (out.run_dir / "artifacts" / "pwned_by_inductor").exists()
    assert out.manifest["score"]["prequential_bpb"] > 7.9  # the uniform model: log2(257) per byte
