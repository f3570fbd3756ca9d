"""What a child process's end costs: interpreter teardown after ``import torch`` against
``os._exit`` (:mod:`prism_challenge.evaluator.childexit`, how every child of the harness ends).

Each case starts ``python -c`` that imports torch (and optionally runs one forward of
``[4, 256, 50257]`` logits, the example's batch), prints ``time.perf_counter()`` (a system-wide
monotonic clock on Linux) as its last act, then ends normally or through
:func:`~prism_challenge.evaluator.childexit.exit_child`; the parent notes the time its wait
returned. Printed: the median latency from that last act to the parent's wake-up, per case and
its ratio. The harness's own children each pay this once per run: the audit's two, the held-out
stage's two or three, torchrun's agent, each rank, the CUDA check.

Usage: ``python bench/child_exit.py [--repeats 5]``.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

WORK = {
    "import torch": "import torch",
    "import torch + one forward": "import torch; x = torch.randn(4, 256, 50257).log_softmax(-1)",
}
LAST = "import sys, time; sys.stdout.write(repr(time.perf_counter()) + '\\n'); sys.stdout.flush()"
FAST = "from prism_challenge.evaluator.childexit import exit_child; exit_child(0)"


def latency(code: str, repeats: int) -> float:
    """Median seconds from the child's last printed time to the parent's wake-up."""
    out = []
    for _ in range(repeats):
        p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
        woke = time.perf_counter()
        out.append(woke - float(p.stdout.strip().splitlines()[-1]))
    return statistics.median(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    for name, work in WORK.items():
        normal = latency(f"{work}; {LAST}", args.repeats)
        fast = latency(f"{work}; {LAST}; {FAST}", args.repeats)
        print(f"{name}: exit {normal:.3f} s with interpreter teardown, {fast:.3f} s with exit_child "
              f"({normal / fast:.1f}x; {normal - fast:.2f} s saved per child)")


if __name__ == "__main__":
    main()
