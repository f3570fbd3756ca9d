"""The example (``examples/tiny-1m``) with one change: the GPU session's probe bundles
(``bench/gpu_session.sh``: a bf16 model, the loop under autocast, ``torch.compile``, a
``build_model`` that asks ``torch.cuda.device_count()``) and the mixed-precision tests
(``tests/test_mixed_precision.py``). Each variant is written from the example when it is needed,
so it cannot drift from the example it claims to change.

``python bench/variants.py NAME DEST`` writes one; :func:`write_variant` is the same from Python.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "tiny-1m"

_LOOP = """    for batch in ctx.iter_train_batches(
        model, batch_size=LOCAL_BATCH, seq_len=ctx.max_seq_len, tokenizer=tokenizer
    ):
        tokens = batch.tokens
        optimizer.zero_grad(set_to_none=True)
        loss = _next_token_loss(wrapped(tokens), tokens)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(wrapped.parameters(), GRAD_CLIP_NORM)
        optimizer.step()
"""
_AUTOCAST = ("    # the variant's one change: the whole loop under bf16 autocast, the standard idiom\n"
             "    with torch.autocast(device_type=\"cuda\" if ctx.device.startswith(\"cuda\") else \"cpu\", "
             "dtype=torch.bfloat16):\n" + "".join("    " + line + "\n" for line in _LOOP.splitlines()))
_DOC = '    """The model for this challenge context: sized from ``ctx.vocab_size`` and ``ctx.max_seq_len``."""\n'

VARIANTS: dict[str, tuple[str, str, str, str]] = {
    "bf16-cast": ("training.py", "    model = build_model(ctx).to(ctx.device)\n",
                  "    model = build_model(ctx).to(ctx.device).to(torch.bfloat16)  # the variant's one change\n",
                  "the model cast to bf16 in the loop"),
    "autocast-loop": ("training.py", _LOOP, _AUTOCAST, "the whole loop inside torch.autocast(bf16)"),
    "compile": ("training.py", "    wrapped: nn.Module = model\n",
                "    wrapped: nn.Module = torch.compile(model)  # the variant's one change\n",
                "the loop trains through torch.compile"),
    "cuda-count": ("architecture.py", _DOC,
                   _DOC + "    if torch.cuda.device_count() < 0:  # the variant's one change: the question is the probe\n"
                          "        raise RuntimeError(\"a negative device count\")\n",
                   "build_model asks torch.cuda.device_count() first (before CUDA starts in a child)"),
}
"""name -> (file, the example's text, its replacement, what the change is)."""


def write_variant(name: str, dest: Path, *, tokenizer: str = "gpt2") -> Path:
    """Write variant ``name`` (a key of :data:`VARIANTS`) as a bundle folder ``dest`` (created;
    it must not exist): the example's files with the one change and a ``prism.yaml`` naming
    ``tokenizer``.

    Raises:
        KeyError: an unknown ``name``.
        ValueError: the example's text to change is not in it exactly once (the example moved on).
    """
    file, old, new, what = VARIANTS[name]
    shutil.copytree(EXAMPLE, dest, ignore=shutil.ignore_patterns("README.md", "__pycache__"))
    path = dest / file
    text = path.read_text()
    if text.count(old) != 1:
        raise ValueError(f"{EXAMPLE / file}: variant {name!r} wants its text once, found {text.count(old)}")
    path.write_text(text.replace(old, new))
    (dest / "prism.yaml").write_text(f"# examples/tiny-1m with one change: {what} (bench/variants.py)\n"
                                     f"tokenizer: {tokenizer}\n")
    return dest


def main(argv: list[str] | None = None) -> int:
    """The command line: ``NAME DEST``; exit 0, or 2 with the reason."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("name", choices=sorted(VARIANTS))
    p.add_argument("dest", type=Path)
    a = p.parse_args(argv)
    try:
        print(write_variant(a.name, a.dest))
    except (ValueError, FileExistsError) as exc:
        print(f"variants: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
