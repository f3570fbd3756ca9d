"""Hostile bundles for test_no_way_out.py: one attack each, placed in the child it targets.

Each bundle is gate-hostile on purpose (it imports os, ctypes, socket, ...): the tests run them
with the static gate switched off (``EvalOptions(static_gates=False)``, or the parameter gate
alone) to show that the audit hooks and the sandbox stop them anyway.

``WHERE`` picks the child: ``param`` runs the attack in ``build_model`` (the parameter child
builds the model first), ``rank`` in ``train`` (only the ranks call it); ``heldout``, ``blind``
and ``audit`` in the forward of a model whose weights are no longer the ones it was built with
in a process that never trained it: a fresh child that loaded a state (every process sees the
same context, so that is how a bundle can tell one). With the audit off, those are the held-out
children (the scoring child loads the trained state first, then the blind probe's); with it
on, the audit's re-scoring child is the first (it loads batch 1's snapshot).
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
TRAINED = []  # this process took an optimizer step (a rank)


def attack():
    {attack}


class Bigram(nn.Module):
    def __init__(self, v, ctx):
        super().__init__()
        self.table = nn.Embedding(v, v)
        self.built = float(self.table.weight.detach().sum())

    def forward(self, tokens):
        if ({heldout} or {blind} or {audit}) and not TRAINED and float(self.table.weight.detach().sum()) != self.built:
            attack()
        return self.table(tokens)


def build_model(ctx):
    if {param}:
        attack()
    return Bigram(ctx.vocab_size, ctx)
'''

TRAIN = '''
import torch
import torch.nn.functional as F
from architecture import TRAINED, attack


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
        TRAINED.append(1)
'''


def write(root, attack, where, *, salt="", port=0):
    """Write the bundle for ``attack`` (a key of :data:`ATTACKS`) in child ``where``."""
    root.mkdir(parents=True, exist_ok=True)
    flags = {w: str(w == where) for w in ("param", "rank", "heldout", "blind", "audit")}
    (root / "architecture.py").write_text(ARCH.format(salt=salt, port=port, attack=ATTACKS[attack], **flags))
    (root / "training.py").write_text(TRAIN.format(**flags))
    (root / "prism.yaml").write_text("tokenizer: bytes\n")
    return root
