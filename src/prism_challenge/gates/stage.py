"""The gates as a stage of ``prism eval`` (:mod:`~prism_challenge.pipeline`): every static gate
over the frozen bundle, then the parameter cap in a jailed child, each refusal an
:class:`~prism_challenge.failures.EvalFailure` at stage ``gates`` that lists its blocking findings.
The gates themselves are :func:`~prism_challenge.gates.core.run_gates` and
:func:`~prism_challenge.gates.core.parameter_gate`.
"""

from __future__ import annotations

import shlex
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prism_challenge.evaluator.jail import Jail
from prism_challenge.failures import EvalFailure
from prism_challenge.intake.bundle import Bundle, BundleError
from prism_challenge.options import DEFAULT_MAX_PARAMETERS, DEFAULT_SEQ_LEN, EvalOptions


@dataclass
class Gated:
    """What the static gates said about a bundle that passed them."""

    findings: list[Any]
    parameter_count: int | None
    seconds: float
    bundle_sha256: str | None = None


def check_command(opts: EvalOptions) -> str:
    """The ``prism check`` command line that reproduces this run's gate findings (the settings
    the gates depend on: ``--nproc``, ``--seq-len``, ``--max-parameters``)."""
    parts = ["prism", "check", shlex.quote(str(opts.bundle))]
    if opts.nproc != 1:
        parts += ["--nproc", str(opts.nproc)]
    if opts.seq_len != DEFAULT_SEQ_LEN:
        parts += ["--seq-len", str(opts.seq_len)]
    if opts.max_parameters != DEFAULT_MAX_PARAMETERS:
        parts += ["--max-parameters", str(opts.max_parameters)]
    return " ".join(parts)


def refuse(findings: list[Any], opts: EvalOptions) -> EvalFailure:
    """The gates' failure: every blocking finding (``file:line:col: rule: message``) in ``detail``."""
    return EvalFailure(
        "gates",
        f"{sum(f.blocking for f in findings)} blocking finding(s); `{check_command(opts)}` lists them",
        "\n".join(f"{f.file}:{f.line}:{f.col}: {f.rule}: {f.message}" for f in findings if f.blocking),
        findings=findings,
    )


def static_gates(opts: EvalOptions, root: Path) -> Gated:
    """Every static gate over the bundle directory ``root`` except the parameter cap (which
    runs ``build_model`` in a child, see :func:`parameter_cap`).

    Raises:
        EvalFailure: at stage ``gates`` (blocking findings) or ``intake`` (unreadable bundle).
    """
    from prism_challenge.gates import run_gates

    t0 = time.monotonic()
    try:
        report = run_gates(root, max_parameters=opts.max_parameters, nproc=opts.nproc, nnodes=opts.nnodes,
                           seq_len=opts.seq_len, check_params=False, device=opts.device)
    except BundleError as exc:
        raise EvalFailure("intake", f"{exc.rule}: {exc}") from None
    report.cleanup()  # a directory bundle: nothing was extracted
    if report.blocking:
        raise refuse(list(report.findings), opts)
    return Gated(list(report.findings), None, time.monotonic() - t0,
                  report.bundle.sha256 if report.bundle is not None else None)


def parameter_cap(opts: EvalOptions, bundle: Bundle, vocab_size: int, gated: Gated, jail: Jail,
                    context: dict[str, Any] | None = None) -> Gated:
    """The parameter cap (the last gate) added to ``gated``.

    Raises:
        EvalFailure: at stage ``gates`` when the cap is exceeded or the model cannot be built.
    """
    from prism_challenge.gates import parameter_gate

    t0 = time.monotonic()
    found, count = parameter_gate(bundle, vocab_size=vocab_size, seq_len=opts.seq_len,
                                  max_parameters=opts.max_parameters, jail=jail, context=context)
    findings = sorted([*gated.findings, *found], key=lambda f: (f.file, f.line, f.col, f.rule, f.message))
    if any(f.blocking for f in found):
        raise refuse(findings, opts)
    return Gated(findings, count, gated.seconds + time.monotonic() - t0, gated.bundle_sha256)
