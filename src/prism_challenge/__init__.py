"""PRISM: an ability-to-learn challenge harness.

A submission is a two-script bundle (``architecture.py`` with ``build_model(ctx)`` and
``training.py`` with ``train(ctx)``). PRISM re-executes the training loop from a forced random
init on locked text, records the model's loss on every batch before the loop trains on it, and
scores the run by prequential bits-per-byte.

The pipeline, one subpackage per stage, in the order a run takes them:
``intake`` -> ``gates`` (static checks) -> ``data`` (the locked stream) -> ``evaluator`` (the
isolated run: launcher, runner, instrument, feeder) -> ``audit`` (re-scoring, blind probes,
held-out) -> ``score`` (prequential bpb, verdict) -> ``manifest`` (the signed record, verify);
``research`` and ``service`` sit around them, and ``pipeline`` runs the stages in order.

As a library::

    from prism_challenge import evaluate, EvalOptions
    result = evaluate(EvalOptions(bundle="examples/tiny-1m", token_budget=20_000))
    result.status, result.kind, result.manifest.score

The names below are imported lazily (module ``__getattr__``, PEP 562): ``import prism_challenge``
stays cheap (the ranks import it), and torch is imported only when a run starts.
"""

from __future__ import annotations

__version__ = "0.1.0"

_EXPORTS = {
    "evaluate": "prism_challenge.api",
    "EvalOptions": "prism_challenge.options",
    "OptionsError": "prism_challenge.options",
    "EvalResult": "prism_challenge.manifest.results",
    "RunManifest": "prism_challenge.manifest.results",
    "EvalFailure": "prism_challenge.failures",
    "FAILURE_KINDS": "prism_challenge.failures",
    "StageStarted": "prism_challenge.events",
    "StageFinished": "prism_challenge.events",
    "StageCount": "prism_challenge.events",
    "BatchScored": "prism_challenge.events",
    "RunFinished": "prism_challenge.events",
}
__all__ = ["__version__", *_EXPORTS]


def __getattr__(name: str) -> object:  # no typing import: this module must stay cheap
    """The lazy re-exports of :data:`_EXPORTS` (PEP 562).

    Raises:
        AttributeError: ``name`` is not exported.
    """
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'prism_challenge' has no attribute {name!r}")
    import importlib  # already loaded by the import system; bound here, when a name is first used

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
