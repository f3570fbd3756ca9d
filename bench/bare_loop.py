"""The bare baseline for ``bench/overhead.py``: the same batches and the same loop, no harness.

Run as its own process (``python bench/bare_loop.py BUNDLE BATCHES.npy ...``) so it pays the
same interpreter start and ``import torch`` as a rank does. It forces the same determinism,
imports the bundle, and calls its ``train(ctx)`` with a minimal in-process context whose
``iter_train_batches`` yields the pre-cut batches after one no-grad scoring forward each (the
unavoidable work of prequential scoring), under the bundle's ``scoring_autocast`` as the
harness's. No torchrun, no socket, no feeder, no tokenization.
Prints one JSON line: ``{"t_last_batch": <time.time() of the last batch>, "batches": n}``.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import tempfile
import time

import numpy as np
import torch

from prism_challenge.evaluator.audit import arm
from prism_challenge.intake.bundle import load_bundle
from prism_challenge.evaluator.instrument import autocast_dtype, score_batch
from prism_challenge.evaluator.interface import Batch, PrismContext
from prism_challenge.evaluator.seeding import force_determinism, force_seeds


class BareRuntime:
    """In-process stand-in for the runner: pre-cut batches, a scoring forward, nothing else."""

    def __init__(self, batches: list[np.ndarray], vocab_size: int, build, seed: int,
                 autocast: torch.dtype | None = None):
        self.batches, self.vocab_size, self.build, self.seed = batches, vocab_size, build, seed
        self.autocast = autocast  # prism.yaml's scoring_autocast, as the harness's scoring forward
        self.t_first = None
        self.t_last = None

    def build_model(self, ctx):
        force_seeds(self.seed)
        return self.build(ctx)

    def iter_train_batches(self, ctx, model, batch_size, seq_len, tokenizer):
        for step, rows in enumerate(self.batches):
            if self.t_first is None:  # as the harness: from the loop's first request for a batch
                self.t_first = time.time()
            tokens = torch.from_numpy(rows).to(ctx.device)
            score_batch(model, tokens, self.vocab_size, autocast=self.autocast)
            self.t_last = time.time()
            yield Batch(tokens, step)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("bundle")
    p.add_argument("batches", help=".npz with arrays b0, b1, ... (the harness's exact batches)")
    p.add_argument("--vocab-size", type=int, required=True)
    p.add_argument("--seq-len", type=int, required=True)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--device", default="cpu")
    p.add_argument("--audit", action="store_true", help="arm the runtime audit hook before the bundle is imported")
    a = p.parse_args()
    autocast = autocast_dtype(load_bundle(a.bundle).scoring_autocast)
    force_determinism(a.seed, a.threads)
    if a.audit:  # as a rank does: after the harness's imports, before the bundle's
        arm(a.bundle, [tempfile.gettempdir()])
    data = np.load(a.batches)
    batches = [data[f"b{i}"] for i in range(len(data.files))]
    sys.dont_write_bytecode = True  # no __pycache__ in the bundle: intake refuses one (prism:bytecode)
    sys.path.insert(0, a.bundle)
    arch = importlib.import_module("architecture")
    runtime = BareRuntime(batches, a.vocab_size, arch.build_model, a.seed, autocast)
    arch.build_model = runtime.build_model
    training = importlib.import_module("training")
    ctx = PrismContext(seed=a.seed, vocab_size=a.vocab_size, sequence_length=a.seq_len, max_parameters=10**9,
                       device=a.device, artifacts_dir="", _runtime=runtime)
    training.train(ctx)
    print(json.dumps({"t_first_batch": runtime.t_first, "t_last_batch": runtime.t_last, "batches": len(batches)}))


if __name__ == "__main__":
    main()
