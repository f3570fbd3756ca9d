"""Intake, the first stage of a run: a submitted bundle read, checked and frozen before anything
of it runs.

* :mod:`~prism_challenge.intake.bundle`: the bundle directory, ``prism.yaml``, the file hashes;
* :mod:`~prism_challenge.intake.bundlefiles`: what a bundle may hold (text kinds, module names);
* :mod:`~prism_challenge.intake.frozen`: one read-only copy, checked again after the run.
"""
