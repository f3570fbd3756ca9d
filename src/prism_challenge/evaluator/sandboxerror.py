"""The one error of the sandbox: strict isolation was asked for and cannot be provided.

Raised by every part of the sandbox (:mod:`~prism_challenge.evaluator.mountplan`,
:mod:`~prism_challenge.evaluator.sandboxargv`, :mod:`~prism_challenge.evaluator.sandboxwatch`,
:mod:`~prism_challenge.evaluator.isolation`, :mod:`~prism_challenge.evaluator.jail`); callers
import it from :mod:`~prism_challenge.evaluator.isolation`.
"""

from __future__ import annotations


class IsolationError(RuntimeError):
    """Strict isolation was requested but cannot be provided (no working backend, bad paths)."""
