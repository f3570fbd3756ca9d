"""A child's start with and without the cyclic collector paused (:mod:`prism_challenge.evaluator.childgc`).

Each harness child imports torch and the harness's modules and warms up before it reads its
input or runs a line of the bundle. This runs that start, exactly as each child does it, in a
fresh interpreter (no sandbox), with the collector on (as before) and paused (as now), in
alternating order, and prints the medians and their ratio per child:

* ``rank``: ``prism_challenge.evaluator.runner`` and its warm-up (``torch._dynamo``, ``torch.optim``);
* ``param``: the parameter child's preloaded modules (``param_count.PRELOADED``);
* ``rescore``: the audit's re-scoring child's module and warm-up;
* ``heldout``: the held-out (and blind-probe) child's warm-up.

Usage: ``python bench/child_gc.py [--repeats 5]``. The seconds are the start alone, timed in the
child from its first line to the end of its warm-up (the interpreter's own start excluded).
A ``python -m`` child pauses once ``runpy`` has imported its package (the parameter child's
``prism_challenge.gates``: about 0.09 s with the collector on), so its real saving is a little
smaller than the row here.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys

STARTS = {
    "rank": "import prism_challenge.evaluator.runner as m; m._warm_up()",
    "param": "import importlib, prism_challenge.gates.param_count as m; [importlib.import_module(n) for n in m.PRELOADED]",
    "rescore": "import prism_challenge.audit.rescore_child as m; m._warm_up('cpu')",
    "heldout": "import prism_challenge.audit.heldout as m; m._warm_up()",
}


def timed_start(code: str, paused: bool) -> float:
    """Seconds of one child's start (``code``) in a fresh interpreter, collector paused or not."""
    prog = ("import time, gc\nt = time.perf_counter()\n" + ("gc.disable()\n" if paused else "")
            + code + "\nprint(time.perf_counter() - t)\n")
    out = subprocess.run([sys.executable, "-c", prog], capture_output=True, text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=5)
    a = p.parse_args()
    print(f"{'child':8} {'collector on':>13} {'paused':>8} {'ratio':>6}   every run (on | paused)")
    for name, code in STARTS.items():
        on: list[float] = []
        off: list[float] = []
        for i in range(a.repeats):
            for paused in ((False, True) if i % 2 == 0 else (True, False)):
                (off if paused else on).append(timed_start(code, paused))
        m_on, m_off = statistics.median(on), statistics.median(off)
        print(f"{name:8} {m_on:12.3f}s {m_off:7.3f}s {m_off / m_on:6.3f}   "
              f"{' '.join(f'{x:.2f}' for x in on)} | {' '.join(f'{x:.2f}' for x in off)}")


if __name__ == "__main__":
    main()
