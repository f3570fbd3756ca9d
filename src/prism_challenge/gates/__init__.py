"""Static gates, run before any training: intake, AST sandbox, multi-GPU contract, parameter cap.

Public API::

    from prism_challenge.gates import run_gates, Finding, GateReport, RULES

    report = run_gates("examples/tiny-1m")        # or a .zip
    if report.blocking: ...                       # findings that stop the run
    report.param_count                            # unique parameter+buffer elements

An unreadable bundle (missing, not a zip, an intake rule such as ``prism:zip-symlink``) raises
:class:`prism_challenge.intake.bundle.BundleError` instead of returning a report (``prism check``
exits 2); every other broken rule is a :class:`Finding` (exit 1 when one blocks). The CLI
subcommand lives in :mod:`prism_challenge.gates.cli`.
"""

from prism_challenge.gates.core import DEFAULT_MAX_PARAMETERS, parameter_gate, run_gates, tokenizer_vocab_size
from prism_challenge.gates.findings import Finding, GateReport
from prism_challenge.gates.rules import CONTRACT_RULES, FINDING_RULES, INTAKE_RULES, RULES

__all__ = [
    "CONTRACT_RULES",
    "DEFAULT_MAX_PARAMETERS",
    "FINDING_RULES",
    "INTAKE_RULES",
    "RULES",
    "Finding",
    "GateReport",
    "parameter_gate",
    "run_gates",
    "tokenizer_vocab_size",
]
