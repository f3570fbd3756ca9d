"""Forced determinism: seeds, deterministic algorithms, a fixed thread count.

Applied by the runner before any submitted module is imported, and re-applied (seeds only)
right before every ``build_model`` call, so a loop cannot choose its initial weights by
re-seeding.
"""

from __future__ import annotations

import os
import random

import numpy as np
import torch


def force_seeds(seed: int) -> None:
    """Seed ``random``, ``numpy`` and ``torch`` (CPU and every CUDA device) with ``seed``."""
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)


def force_determinism(seed: int, threads: int) -> None:
    """Seeds plus deterministic kernels and ``threads`` intra-op CPU threads.

    ``CUBLAS_WORKSPACE_CONFIG`` must already be in the environment before CUDA initializes (the
    launcher sets it); it is set here too for direct callers.
    """
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.set_num_threads(threads)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:  # already set, or parallel work already ran in this process
        pass
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    force_seeds(seed)
