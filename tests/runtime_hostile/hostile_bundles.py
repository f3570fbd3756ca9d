"""Runtime-hostile bundles: each does one thing the sandbox must stop, and says what it saw.

Every bundle is a working submission (the ``UNIFORM`` model and a plain loop over the stream)
with one hostile piece. Bundles that probe the sandbox write what each attempt gave into
``artifacts/probe.json`` (the only place they can write) and then train normally, so the test
can read both the probe and the scored run. Parameters (paths, ports) are baked into the source
by the test, as an attacker who knows the layout would.
"""

from __future__ import annotations

import base64
import textwrap

from helpers import UNIFORM_ARCH as UNIFORM  # noqa: F401 - re-exported; tests/ is on sys.path (conftest)


PROBE = """
import json, os


def attempt(out, name, fn):
    try:
        r = fn()
        out[name] = "ok" if r is None else r
    except Exception as exc:  # what the sandbox answered
        out[name] = type(exc).__name__


def save(ctx, out):
    with open(os.path.join(ctx.artifacts_dir, "probe.json"), "w") as f:
        json.dump(out, f)


def stream(ctx, batch_size=2, seq_len=16, stop_after=None):
    import torch
    model = ctx.build_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    for batch in ctx.iter_train_batches(model, batch_size=batch_size, seq_len=seq_len):
        logits = model(batch.tokens)
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                                                 batch.tokens[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        if stop_after is not None and batch.step + 1 >= stop_after:
            return
"""


def training(body: str) -> str:
    """``training.py``: the probe helpers, then ``train(ctx)`` with ``body`` (4-space indented)."""
    return PROBE + "\n\ndef train(ctx):\n" + textwrap.indent(textwrap.dedent(body).strip("\n"), "    ") + "\n"


def socket_bundle(port: int) -> str:
    """Connect out: to the internet, to a listener on the host's loopback, and resolve a name."""
    return training(f"""
        import socket
        out = {{}}
        attempt(out, "internet", lambda: socket.create_connection(("1.1.1.1", 53), timeout=3).close())
        attempt(out, "host_loopback", lambda: socket.create_connection(("127.0.0.1", {port}), timeout=3).close())
        attempt(out, "dns", lambda: socket.getaddrinfo("example.com", 443) and None)
        save(ctx, out)
        stream(ctx)
    """)


def read_bundle(paths: dict[str, str]) -> str:
    """Read each file (data MANIFEST, train/val/test shards, token cache, salt) or list each dir."""
    return training(f"""
        out = {{}}
        for name, path in {paths!r}.items():
            if name.startswith("dir:"):
                attempt(out, name, lambda p=path: os.listdir(p))
            else:
                attempt(out, name, lambda p=path: len(open(p, "rb").read(64)))
        save(ctx, out)
        stream(ctx)
    """)


def write_bundle_src(paths: dict[str, str]) -> str:
    """Write a file at each path outside the artifacts directory, and one inside."""
    return training(f"""
        out = {{}}
        for name, path in {paths!r}.items():
            attempt(out, name, lambda p=path: open(p, "w").write("planted") and None)
        attempt(out, "inside", lambda: open(os.path.join(ctx.artifacts_dir, "inside.txt"), "w").write("ok") and None)
        save(ctx, out)
        stream(ctx)
    """)


FORK_BOMB = training("""
    import time
    model = ctx.build_model()
    it = ctx.iter_train_batches(model, batch_size=2, seq_len=16)
    next(it)
    while True:
        try:
            os.fork()
        except OSError:
            time.sleep(0.001)
""")

MEMORY_BOMB = training("""
    import torch
    model = ctx.build_model()
    it = ctx.iter_train_batches(model, batch_size=2, seq_len=16)
    next(it)
    hog = []
    while True:
        hog.append(torch.ones(1 << 26))  # 256 MiB, touched
""")

INFINITE_LOOP = training("""
    stream(ctx, stop_after=3)
    while True:
        pass
""")

NEVER_ITERATES = training("""
    import torch
    model = ctx.build_model()
    model(torch.zeros(1, 4, dtype=torch.long))
""")


def planted_bundle(marker: str, outside_paths: dict[str, str]) -> str:
    """Plant a code-running pickle at every trained-state path, and a forged run manifest."""
    return training(f"""
        import pickle

        class Evil:
            def __reduce__(self):
                return (os.system, ("touch {marker}",))

        out = {{}}
        bomb = pickle.dumps({{"bias": Evil()}})
        a = ctx.artifacts_dir
        os.makedirs(os.path.join(a, "model"), exist_ok=True)
        for rel in ("trained_state.pt", "model/trained_state.pt", "prism_trained_state.pt"):
            attempt(out, rel, lambda r=rel: open(os.path.join(a, r), "wb").write(bomb) and None)
        forged = json.dumps({{"schema": "prism.run.v2", "status": "scored", "score": {{"prequential_bpb": 0.0}}}})
        attempt(out, "artifacts_manifest", lambda: open(os.path.join(a, "prism_run_manifest.v2.json"), "w").write(forged) and None)
        for name, path in {outside_paths!r}.items():
            attempt(out, name, lambda p=path: open(p, "wb").write(bomb) and None)
        save(ctx, out)
        stream(ctx)
    """)


# monkeypatches of the scoring path; each must be refused by the gates or leave the loss alone
PATCHES = {
    "torch.log_softmax": "torch.log_softmax = lambda x, dim=-1: torch.zeros_like(x)",
    "F.log_softmax": "F.log_softmax = lambda x, dim=-1: torch.zeros_like(x)",
    "Tensor.gather": "torch.Tensor.gather = lambda self, dim, index: torch.zeros(index.shape)",
    "Tensor.double": "torch.Tensor.double = lambda self: self * 0",
    "runner.measure": "import prism_challenge.evaluator.runner as runner\n    runner.measure = lambda *a, **k: None",
    "vars(torch)": "vars(torch)['log_softmax'] = lambda x, dim=-1: torch.zeros_like(x)",
    "ctx._runtime": "ctx._runtime.vocab_size = 2",
    "forward_hook": "torch.nn.modules.module.register_module_forward_hook(lambda m, i, o: o * 0)",
}

PATCH_LOOP = """
import torch
import torch.nn.functional as F


def train(ctx):
    {patch}
    model = ctx.build_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    for batch in ctx.iter_train_batches(model, batch_size=2, seq_len=16):
        logits = model(batch.tokens)
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), batch.tokens[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
"""

BAKED_K = 8


def baked_architecture(stream_bytes: bytes) -> str:
    """A model that knows the text: the first bytes of the train stream baked in as a literal.

    For each position it looks up the last ``BAKED_K`` tokens in the baked text and puts a
    logit of 20 on the byte that followed them there; elsewhere it is uniform. Its first-batch
    loss is far below half of ``ln 257`` before any training: the smuggled-knowledge signal.
    """
    b64 = base64.b64encode(stream_bytes).decode()
    return f'''
import base64
import torch
from torch import nn

TEXT = base64.b64decode("{b64}")
K = {BAKED_K}
TABLE = {{TEXT[i - K:i]: TEXT[i] for i in range(K, len(TEXT))}}


class Baked(nn.Module):
    def __init__(self, v):
        super().__init__()
        self.v = v
        self.scale = nn.Parameter(torch.ones(()))

    def forward(self, tokens):
        b, t = tokens.shape
        logits = torch.zeros(b, t, self.v)
        rows = tokens.tolist()
        for r in range(b):
            for j in range(K - 1, t):
                context = rows[r][j - K + 1:j + 1]
                if max(context) < 256:
                    nxt = TABLE.get(bytes(context))
                    if nxt is not None:
                        logits[r, j, nxt] = 20.0
        return logits * self.scale


def build_model(ctx):
    return Baked(ctx.vocab_size)
'''
