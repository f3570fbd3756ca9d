"""Sabotage mode: every run-time confinement layer switched off, to show that each deny test
depends on one.

With ``PRISM_SABOTAGE=1`` in the environment of the TRUSTED parent (the process that runs
``prism`` or the tests), a strict jail starts its children with no sandbox (no namespaces, no
allow-listed view, no uid drop, no rlimits), no kernel-call filter
(:mod:`~prism_challenge.evaluator.seccompfilter`) and no audit hooks. The static gates stay on:
they are not confinement. A bundle cannot set it: the sandbox's environment is an allow-list
(:func:`~prism_challenge.evaluator.envpolicy.sandbox_env`) that never includes it, and the
children's setting is read here, in the parent. A host where it is set by mistake is refused by
the self-test (:mod:`~prism_challenge.evaluator.selftest`) before ``prism serve`` takes work
and before ``prism eval`` runs.

For the tests only: ``PRISM_SABOTAGE=1 pytest tests/no_way_out ...``: every deny test must fail.
"""

from __future__ import annotations

import os

ENV = "PRISM_SABOTAGE"


def active() -> bool:
    """Whether this (parent) process runs with confinement switched off (``$PRISM_SABOTAGE`` is
    ``1``)."""
    return os.environ.get(ENV) == "1"
