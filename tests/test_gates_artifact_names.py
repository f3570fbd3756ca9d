"""prism:torch-io: integers in a checkpoint name under ctx.artifacts_dir (issue 26), and only them."""

from __future__ import annotations

import pytest

from test_gates_sandbox import scan

HEAD = "import torch\n\n\ndef train(ctx):\n    state = {}\n"


def torch_io(pre: str, path: str) -> list[str]:
    src = HEAD + pre + f"    torch.save(state, {path})\n"
    _, found = scan({"training.py": src}, {"training.py": ("train",)})
    return [f.rule for f in found if f.rule == "prism:torch-io"]


@pytest.mark.parametrize("pre, path", [
    ("    step = 3\n", 'f"{ctx.artifacts_dir}/ckpt_{step:06d}.pt"'),
    ("    k = ctx.seed\n", 'f"{ctx.artifacts_dir}/ckpt_{k:d}.pt"'),
    ("    k = ctx.seed\n", 'f"{ctx.artifacts_dir}/ckpt.{k:>8d}.pt"'),
    ("    for step in range(3):\n        pass\n", 'ctx.artifacts_dir + "/ckpt_" + str(step) + ".pt"'),
    ("    x = 'a'\n", 'ctx.artifacts_dir + "/ckpt." + str(int(x)) + ".pt"'),
    ("    x = 'a'\n", 'f"{ctx.artifacts_dir}/ckpt_{int(x)}.pt"'),
    ("    for i, b in enumerate([1]):\n        pass\n", 'f"{ctx.artifacts_dir}/ckpt_{i}.pt"'),
    ("    for i, b in enumerate([1], start=1):\n        pass\n", 'f"{ctx.artifacts_dir}/ckpt_{i}.pt"'),
    ("    step = 0\n    step += 1\n", 'f"{ctx.artifacts_dir}/ckpt_{step}.pt"'),
    ("    step = 3\n", 'f"{ctx.artifacts_dir}/.{step:d}./x.pt"'),  # '.' + digits + '.' is no '..'
])
def test_integers_formatted_into_a_name_under_artifacts_dir_pass(pre, path):
    assert torch_io(pre, path) == []


@pytest.mark.parametrize("pre, path", [
    ("    name = '../x'\n", 'f"{ctx.artifacts_dir}/ckpt_{name}.pt"'),  # a str: its own text
    ("    name = 3\n    name = '..'\n", 'ctx.artifacts_dir + "/ckpt_" + str(name) + ".pt"'),
    ("    step = ctx.seed\n", 'ctx.artifacts_dir + "/ckpt_" + str(step) + ".pt"'),  # str() runs __str__
    ("    step = 3\n", 'f"{ctx.artifacts_dir}/ckpt_{step!s:>6}.pt"'),
    ("    step = 3\n", 'f"{ctx.artifacts_dir}/ckpt_{step:s}.pt"'),
    ("    step = 3\n", 'f"{ctx.artifacts_dir}{step:d}/x.pt"'),  # artifacts7/: a sibling folder
    ("    step = 3\n", 'f"{ctx.artifacts_dir}/..{step:d}/x.pt"'),
    ("    step = 0\n    step += ctx.seed\n", 'f"{ctx.artifacts_dir}/ckpt_{step}.pt"'),  # __radd__ of anything
    ("    for i, b in enumerate([1], start=ctx.seed):\n        pass\n", 'f"{ctx.artifacts_dir}/c_{i}.pt"'),
    ("    for i in ['..']:\n        pass\n", 'f"{ctx.artifacts_dir}/c_{i}.pt"'),
    ("    step = 1\n    w = 3\n", 'f"{ctx.artifacts_dir}/c_{step:0{w}d}.pt"'),  # a nested spec
    ("    step = 1\n    def g():\n        nonlocal step\n        step = '..'\n", 'f"{ctx.artifacts_dir}/c_{step}.pt"'),
    ("    step = 1\n    def g(step):\n        return step\n", 'f"{ctx.artifacts_dir}/c_{step}.pt"'),
    ("    pass\n", 'f"{ctx.artifacts_dir}/c_{str}.pt"'),
    ("    step = 1\n", 'f"{ctx.artifacts_dir}/c_{str(step)}.pt"'),
    ("    step = 1\n", 'ctx.artifacts_dir + "/" + f"{step:d}" + "/../x"'),
    ("    range = lambda n: ['..']\n    for step in range(3):\n        pass\n", 'f"{ctx.artifacts_dir}/c_{step}.pt"'),
    ("    int = lambda x: '..'\n", 'f"{ctx.artifacts_dir}/c_{int(ctx)}.pt"'),
    ("    str = lambda x: '..'\n    step = 1\n", 'ctx.artifacts_dir + "/c_" + str(step)'),
])
def test_anything_else_in_a_name_is_refused(pre, path):
    assert torch_io(pre, path) == ["prism:torch-io"]
