"""FSDP, fully_shard, DTensor and device meshes are refused as prism:sharded-model, however spelled."""

from __future__ import annotations

import ast
import textwrap

import pytest

from prism_challenge.gates import run_gates
from prism_challenge.gates.astindex import BundleIndex
from prism_challenge.gates.rules import RULES
from prism_challenge.gates.sandbox import check_modules
from prism_challenge.gates.scopebuild import build_module

SPELLINGS = {
    "fsdp1 class": "from torch.distributed.fsdp import FullyShardedDataParallel\nm = FullyShardedDataParallel(model)",
    "fsdp1 path": "import torch\nm = torch.distributed.fsdp.FullyShardedDataParallel(model)",
    "fsdp module alias": "import torch.distributed.fsdp as f\nm = f.FullyShardedDataParallel(model)",
    "fsdp2": "from torch.distributed.fsdp import fully_shard\nfully_shard(model)",
    "fsdp2 path": "import torch\ntorch.distributed.fsdp.fully_shard(model)",
    "dtensor": "from torch.distributed.tensor import DTensor\nx = DTensor",
    "distribute_tensor": "from torch.distributed.tensor import distribute_tensor\nx = distribute_tensor(model, None)",
    "distribute_module": "import torch.distributed.tensor as dt\ndt.distribute_module(model)",
    "device mesh": "from torch.distributed.device_mesh import init_device_mesh\nmesh = init_device_mesh('cpu', (2,))",
    "device mesh top": "import torch.distributed as dist\nmesh = dist.init_device_mesh('cpu', (2,))",
    "DeviceMesh": "import torch\nmesh = torch.distributed.DeviceMesh('cpu', [0, 1])",
    "DeviceMesh from": "from torch.distributed import DeviceMesh\nmesh = DeviceMesh('cpu', [0, 1])",
}


def _findings(body: str):
    src = "import torch\nfrom torch import nn\nmodel = nn.Linear(2, 2)\n" + textwrap.dedent(body) + "\n"
    index = BundleIndex([build_module("training.py", src, ast.parse(src), ())])
    return check_modules(index)


@pytest.mark.parametrize("name", sorted(SPELLINGS))
def test_every_spelling_of_a_sharded_model_is_refused_with_its_rule(name):
    found = _findings(SPELLINGS[name])
    rules = {f.rule for f in found}
    assert "prism:sharded-model" in rules, (name, [(f.rule, f.message) for f in found])
    hit = next(f for f in found if f.rule == "prism:sharded-model")
    assert "wrap the model in DistributedDataParallel" in hit.message and hit.line >= 4


def test_ddp_is_not_refused():
    found = _findings("from torch.nn.parallel import DistributedDataParallel\nm = DistributedDataParallel(model)")
    assert not [f for f in found if f.blocking], [(f.rule, f.message) for f in found]
    assert "prism:sharded-model" in RULES


FSDP_TRAINING = '''
import torch
import torch.distributed as dist
from torch.distributed.fsdp import FullyShardedDataParallel


def train(ctx):
    dist.init_process_group("gloo")
    model = FullyShardedDataParallel(ctx.build_model())
    for batch in ctx.iter_train_batches(model, batch_size=2, seq_len=16):
        pass
    dist.destroy_process_group()
'''


def test_a_fsdp_bundle_is_refused_at_nproc_2(tmp_path):
    (tmp_path / "architecture.py").write_text(
        "from torch import nn\n\n\ndef build_model(ctx):\n    return nn.Embedding(ctx.vocab_size, ctx.vocab_size)\n")
    (tmp_path / "training.py").write_text(FSDP_TRAINING)
    report = run_gates(tmp_path, nproc=2, check_params=False)
    blocking = [f for f in report.findings if f.blocking]
    assert [f.rule for f in blocking] == ["prism:sharded-model"] * len(blocking) and blocking
    assert blocking[0].file == "training.py" and blocking[0].line == 4
