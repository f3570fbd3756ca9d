"""Hostile bundles for test_no_way_out.py: one attack each, placed in the child it targets.

Each bundle is gate-hostile on purpose (it imports os, ctypes, socket, ...): the tests run them
with the static gate switched off (``EvalOptions(static_gates=False)``, or the parameter gate
alone) to show that the audit hooks and the sandbox stop them anyway.

``WHERE`` picks the child: ``param`` runs the attack in ``build_model`` (the parameter child
builds the model first), ``rank`` in ``train`` (only the ranks call it), ``heldout`` in
``build_model`` when ``ctx.artifacts_dir`` is empty (the held-out children), ``blind`` in the
first forward of a process with an empty ``artifacts_dir`` that built one model whose weights
no longer are the ones it was built with (only the blind probe's process builds a single model
and loads the trained state into it: its batches have the held-out batches' shape).
"""

ATTACKS = {
    "dlopen": "import ctypes\n    ctypes.CDLL('libm.so.6')",
    "torch_load_library": "import torch\n    torch.ops.load_library('/usr/lib/x86_64-linux-gnu/libm.so.6')",
    "salt": "open(SALT, 'rb').read()",
    "socket": "import socket\n    socket.create_connection(('127.0.0.1', PORT), timeout=2)",
    "write_outside": "open('/var/tmp/prism-planted-' + str(PORT), 'w').write('x')",
    "process": "import subprocess\n    subprocess.run(['/bin/true'])",
    "rewrite": "import os\n    open(os.path.join(os.path.dirname(__file__), 'architecture.py'), 'a').write('#')",
}

ARCH = '''
import torch
from torch import nn

SALT = {salt!r}
PORT = {port}
FIRST = []
BUILDS = []


def attack():
    {attack}


class Bigram(nn.Module):
    def __init__(self, v, ctx):
        super().__init__()
        self.table = nn.Embedding(v, v)
        self.ctx = ctx

    def forward(self, tokens):
        # the blind probe's process builds one model and loads the trained state into it
        if {blind} and not FIRST and self.ctx.artifacts_dir == "" and len(BUILDS) == 1:
            if float(self.table.weight.detach().sum()) != BUILDS[0]:
                attack()
        FIRST.append(1)
        return self.table(tokens)


def build_model(ctx):
    if {param} or ({heldout} and ctx.artifacts_dir == ""):
        attack()
    model = Bigram(ctx.vocab_size, ctx)
    BUILDS.append(float(model.table.weight.detach().sum()))
    return model
'''

TRAIN = '''
import torch
import torch.nn.functional as F
from architecture import attack


def train(ctx):
    if {rank}:
        attack()
    model = ctx.build_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for batch in ctx.iter_train_batches(model, batch_size=2, seq_len=32):
        logits = model(batch.tokens)
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), batch.tokens[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
'''


def write(root, attack, where, *, salt="", port=0):
    """Write the bundle for ``attack`` (a key of :data:`ATTACKS`) in child ``where``."""
    root.mkdir(parents=True, exist_ok=True)
    flags = {w: str(w == where) for w in ("param", "rank", "heldout", "blind")}
    (root / "architecture.py").write_text(ARCH.format(salt=salt, port=port, attack=ATTACKS[attack], **flags))
    (root / "training.py").write_text(TRAIN.format(**flags))
    (root / "prism.yaml").write_text("tokenizer: bytes\n")
    return root
