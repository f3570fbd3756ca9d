"""The run's scoring precision: which autocast the harness's scoring forwards run under, and why.

A bundle may declare ``scoring_autocast`` in ``prism.yaml`` (``fp32``, ``bf16``, ``fp16``); when
it declares none, the run's profile chooses (``[scoring] autocast``, ``EvalOptions.scoring_autocast``:
``fp32`` for ``local``, ``bf16`` for ``prism-v2``). A declared value wins: a bundle that wants
its batches scored in full float32 on a GPU says so, and pays the forward's time out of its own
wall clock. The value applies to every scoring forward of the run (the stream and its probes, the
audit's children, the blind probes, held-out, ``prism verify``), under the harness's own
attention kernels (:mod:`prism_challenge.evaluator.scoringstate`), whatever the loop's
autocast. The manifest records it: ``config.scoring_autocast`` (the value used),
``config.scoring_autocast_source`` (``bundle`` or ``profile``) and ``config.scoring_sdpa`` (the
attention kernels, in priority order).
"""

from __future__ import annotations

from typing import Any


def scoring_autocast(opts: Any, bundle: Any) -> tuple[str, str]:
    """``(value, source)``: the bundle's declared ``scoring_autocast`` and ``"bundle"``, else
    ``opts.scoring_autocast`` (the profile's) and ``"profile"``."""
    if bundle.scoring_autocast is not None:
        return str(bundle.scoring_autocast), "bundle"
    return str(opts.scoring_autocast), "profile"


def scoring_record(opts: Any, bundle: Any) -> dict[str, Any]:
    """The manifest's ``config`` entries of the scoring precision (see the module docstring)."""
    from prism_challenge.evaluator.scoringstate import SDPA_BACKENDS

    value, source = scoring_autocast(opts, bundle)
    return {"scoring_autocast": value, "scoring_autocast_source": source,
            "scoring_sdpa": [b.name.lower() for b in SDPA_BACKENDS]}
