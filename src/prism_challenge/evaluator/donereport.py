"""A rank's DONE header, kept to the fields and types the trusted side reads.

The header is the untrusted side's word (a submission in the rank's process can send any JSON
object). Its fields reach the run manifest (:class:`~prism_challenge.manifest.results.RunManifest`:
``compute.device_name``, ``compute.peak_rss_bytes``, ``model.state_sha256`` ...), whose model
refuses a wrong type; a refusal there raised out of :func:`prism_challenge.api.evaluate`, which
the service reads as the harness's own fault (stage ``dispatch``, kind ``infrastructure``) and
retries on a fresh secret seed. :func:`clean_done` keeps each known field of the right type and
sets any other value to ``None``; unknown fields are dropped.
"""

from __future__ import annotations

import re
from typing import Any

COUNTS = ("peak_rss_bytes", "peak_device_bytes", "peak_reserved_bytes", "parameter_count")
"""Fields that are a count (an integer >= 0; a JSON ``true`` is none)."""
MAPPINGS = ("phases", "state_tensors", "state_moments")
"""Fields that are a JSON object (checked where they are read: ``feedchecks._drift``, the phases file)."""
DEVICE_NAME_MAX = 200
_SHA256 = re.compile(r"[0-9a-f]{64}")


def _count(v: Any) -> int | None:
    return v if type(v) is int and v >= 0 else None


def clean_done(header: dict[str, Any]) -> dict[str, Any]:
    """``header`` with each known field kept when of its type, else ``None``: :data:`COUNTS`,
    ``device_name`` (a string of at most :data:`DEVICE_NAME_MAX` characters), ``state_sha256``
    (64 lowercase hex digits), :data:`MAPPINGS` (a dict); fields not in the header stay absent,
    fields it has that are not known are dropped."""
    out: dict[str, Any] = {}
    for key, value in header.items():
        if key in COUNTS:
            out[key] = _count(value)
        elif key == "device_name":
            out[key] = value if isinstance(value, str) and len(value) <= DEVICE_NAME_MAX else None
        elif key == "state_sha256":
            out[key] = value if isinstance(value, str) and _SHA256.fullmatch(value) else None
        elif key in MAPPINGS:
            out[key] = value if isinstance(value, dict) else None
    return out
