"""One rank's entry point under torchrun: ``python -m prism_challenge.evaluator.rank``.

It asks Linux to kill this process when torchrun's agent dies, BEFORE anything heavy is
imported, then hands over to :func:`prism_challenge.evaluator.runner.main`. torchrun starts each
rank in a session of its own, so killing the launcher's process group does not reach the ranks;
``prism eval`` launches torchrun while the static gates still run, and a refused bundle kills the
agent while its ranks may still be importing torch. With the request made first, they die with
it at once instead of finishing that import.

This module imports only the standard library.
"""

from __future__ import annotations

import os
import sys


def die_with_parent() -> None:
    """Ask Linux to SIGKILL this process when its parent (torchrun's agent) dies (Linux only)."""
    if sys.platform != "linux":
        return
    import ctypes
    import signal

    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
    if os.getppid() == 1:  # the parent died before the request took effect
        os._exit(137)


def main() -> None:
    """Die with the agent, then run this rank (see :func:`prism_challenge.evaluator.runner.main`)."""
    die_with_parent()
    from prism_challenge.evaluator.runner import main as run_rank

    run_rank()


if __name__ == "__main__":
    main()
