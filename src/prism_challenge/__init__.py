"""PRISM: an ability-to-learn challenge harness.

A submission is a two-script bundle (``architecture.py`` with ``build_model(ctx)`` and
``training.py`` with ``train(ctx)``). PRISM re-executes the training loop from a forced random
init on locked text, records the model's loss on every batch before the loop trains on it, and
scores the run by prequential bits-per-byte.

The pipeline, one module per stage:
``bundle`` (intake) -> ``gates`` (static checks) -> ``evaluator`` (launcher, runner, instrument,
feeder) -> ``scoring`` -> ``run_manifest`` (storage).
"""

__version__ = "0.1.0"
