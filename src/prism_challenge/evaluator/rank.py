"""One rank's entry point under torchrun: ``python -m prism_challenge.evaluator.rank``.

It asks Linux to kill this process when torchrun's agent dies, BEFORE anything heavy is
imported. torchrun starts each rank in a session of its own, so killing the launcher's process
group does not reach the ranks; ``prism eval`` launches torchrun while the static gates still
run, and a refused bundle kills the agent while its ranks may still be importing torch. With the
request made first, they die with it at once instead of finishing that import.

Then it hands its rank to a warm process of the pool when there is one
(:func:`prism_challenge.evaluator.warm.claim`, which ends this process as the warm one ends),
and otherwise runs :func:`prism_challenge.evaluator.runner.main` itself.

``python -m prism_challenge.evaluator.rank --warm FD`` is a warm process, started by the pool:
it dies with the pool, imports torch and waits on ``FD`` for a claim
(:func:`prism_challenge.evaluator.runner.warm_main`).

This module imports only the standard library until it runs a rank.
"""

from __future__ import annotations

import sys

from prism_challenge.evaluator import childgc
from prism_challenge.evaluator.warm import claim, die_with_parent


def main() -> None:
    """Die with the parent, then run this rank: warm (``--warm FD``), claimed, or cold, its
    start without the cyclic collector (:mod:`~prism_challenge.evaluator.childgc`)."""
    childgc.pause()
    if len(sys.argv) == 3 and sys.argv[1] == "--warm":
        die_with_parent()  # the pool
        from prism_challenge.evaluator.runner import warm_main

        warm_main(int(sys.argv[2]))
        return
    die_with_parent()  # torchrun's agent
    claim()  # returns only when no warm process takes this rank
    from prism_challenge.evaluator.runner import main as run_rank

    run_rank()


if __name__ == "__main__":
    main()
