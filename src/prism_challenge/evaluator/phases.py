"""Where a rank's stream spends its wall time, per phase (benchmarks only: ``--profile-phases``).

:class:`PhaseClock` takes laps with ``time.perf_counter`` at the runner's phase boundaries; the
sums and the batch count go to the trusted side in the rank's DONE header and from there to the
run's ``logs/phases.json`` (never to the manifest: the profile is not part of a scored result).
Off, every lap is one attribute test. The phases of one batch ``k``, in order:

* ``report_wait``: the previous batch's report still on its way (:mod:`~prism_challenge.evaluator.reporter`);
* ``batch_wait``: reading batch ``k`` from the feeder's socket;
* ``staging``: tokens to the device, the determinism flags checked;
* ``state_copy``: rank 0 of an audited run: the copy of the weights before the scoring forward;
* ``scoring``: the scoring forward, the causality probe on probed batches;
* ``census``: the parameter census of probed batches;
* ``report_start``: the loss's read-back enqueued, the report's thread started;
* ``loop``: the loop's own work between getting batch ``k`` and asking for ``k + 1``.
"""

from __future__ import annotations

import resource
import time

PHASES = ("report_wait", "batch_wait", "staging", "state_copy", "scoring", "census", "report_start", "loop")


class PhaseClock:
    """Sums of wall seconds per phase (:data:`PHASES`) when ``on``; nothing otherwise."""

    def __init__(self, on: bool):
        self.on = bool(on)
        self.totals = dict.fromkeys(PHASES, 0.0)
        self.batches = 0
        self._t = time.perf_counter() if self.on else 0.0
        self._cpu = (0.0, 0.0)

    def start(self) -> None:
        """The stream begins: laps count from now, and so does the process's CPU time."""
        if self.on:
            self._t = time.perf_counter()
            use = resource.getrusage(resource.RUSAGE_SELF)
            self._cpu = (use.ru_utime, use.ru_stime)

    def lap(self, phase: str) -> None:
        """Charge the seconds since the last lap to ``phase`` (one of :data:`PHASES`)."""
        if self.on:
            now = time.perf_counter()
            self.totals[phase] += now - self._t
            self._t = now

    def report(self) -> dict[str, float | int]:
        """``{phase: seconds, ..., "batches": n, "cpu_user_s": u, "cpu_system_s": s}`` for the
        DONE header: the CPU seconds of the rank's process (all its threads) since :meth:`start`."""
        use = resource.getrusage(resource.RUSAGE_SELF)
        return {**{k: round(v, 6) for k, v in self.totals.items()}, "batches": self.batches,
                "cpu_user_s": round(use.ru_utime - self._cpu[0], 6), "cpu_system_s": round(use.ru_stime - self._cpu[1], 6)}
