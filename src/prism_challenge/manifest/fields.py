"""The manifest models' shared base and constrained field types.

:class:`_Model` refuses extra keys (``extra="forbid"``), so a key the harness adds without
declaring it fails the tests; the aliases below are the constrained types the sections use
(:mod:`~prism_challenge.manifest.run_sections`, :mod:`~prism_challenge.manifest.score_sections`).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

Sha256 = Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]
Count = Annotated[int, Field(ge=0)]
Seconds = Annotated[float, Field(ge=0)]
ShapeKey = Annotated[str, Field(pattern=r"^[1-9][0-9]*x[1-9][0-9]*$")]  # a rank slice's "BxT" (prism_challenge.score.flops)
Status = Literal["scored", "failed", "cancelled"]
StopReason = Literal["", "token_budget", "byte_budget", "step_budget", "wall_clock_budget", "stream_exhausted",
                     "loop_stopped", "stalled", "failed"]


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")
