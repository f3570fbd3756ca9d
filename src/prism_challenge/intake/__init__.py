"""Intake, the first stage of a run: a submitted bundle read, checked and frozen before anything
of it runs.

* :mod:`~prism_challenge.intake.bundle`: the bundle directory or ``.zip`` opened, its file hashes;
* :mod:`~prism_challenge.intake.refusal`: ``BundleError`` (the broken rule's id) and the intake limits;
* :mod:`~prism_challenge.intake.spec`: ``prism.yaml`` (entrypoints, tokenizer, scoring autocast);
* :mod:`~prism_challenge.intake.tree`: the intake rules on a bundle directory, its file hashes;
* :mod:`~prism_challenge.intake.ziparchive`: a ``.zip`` bundle checked member by member, then extracted;
* :mod:`~prism_challenge.intake.readable`: a private bundle copied once, world-readable;
* :mod:`~prism_challenge.intake.bundlefiles`: what a bundle may hold (text kinds, module names);
* :mod:`~prism_challenge.intake.frozen`: one read-only copy, checked again after the run.
"""
