"""The switches of forced determinism and float precision a bundle may not touch (``prism:determinism``).

The runner forces deterministic algorithms, cuDNN's deterministic non-benchmark kernels, no TF32
and the ``"highest"`` float32 matmul precision before the bundle is imported
(:func:`~prism_challenge.evaluator.seeding.force_determinism`), so that a run's score is the
same on every run of the same bundle on the same device. A loop that switched any of them back
would make its score vary, and change the precision of the harness's own scoring forward. So
any use of these paths (a call, a read, an assignment through them, an import of the module) is
refused with this rule, before the allow-list is consulted; the runner also checks the settings
on every batch (:func:`~prism_challenge.evaluator.seeding.determinism_flags`).
"""

from __future__ import annotations

DETERMINISM = "prism:determinism"

DETERMINISM_PATHS: dict[str, str] = {
    "torch.use_deterministic_algorithms": "switches the forced deterministic algorithms",
    "torch.set_deterministic_debug_mode": "switches the forced deterministic algorithms",
    "torch.set_float32_matmul_precision": "changes the forced float32 matmul precision (TF32, bf16)",
    "torch.set_flush_denormal": "changes how float arithmetic treats denormal numbers",
    "torch.backends.cudnn": "holds cuDNN's deterministic, benchmark and TF32 switches",
    "torch.backends.cuda.matmul": "holds cuBLAS's TF32 and reduced-precision reduction switches",
    "torch.backends.cuda.preferred_blas_library": "picks another matmul library (other kernels, other roundings)",
    "torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp": "switches reduced-precision reductions in attention",
    "torch.backends.mkldnn": "holds oneDNN's TF32 and bf16 precision switches on CPU",
    "torch.backends.fp32_precision": "is the global float32 precision switch",
}
"""Path (and everything below it) -> what it switches."""


def determinism_rule(qualname: str) -> tuple[str, str] | None:
    """``(DETERMINISM, reason)`` when ``qualname`` is, or lies below, one of
    :data:`DETERMINISM_PATHS`; else ``None``."""
    for path, what in DETERMINISM_PATHS.items():
        if qualname == path or qualname.startswith(path + "."):
            return DETERMINISM, (f"'{path}' {what}: PRISM forces deterministic kernels and full float32 "
                                 f"precision for every run, and a bundle may not change them")
    return None
