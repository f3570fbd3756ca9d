"""torchrun's agent as the launcher starts it: ``python -m prism_challenge.evaluator.agent ARGS``
runs ``torch.distributed.run``'s own ``main`` on ``ARGS`` (the same code as ``python -m
torch.distributed.run ARGS``), then ends without interpreter teardown
(:func:`~prism_challenge.evaluator.childexit.exit_child`): the agent imported torch, and the
stream's end waits for its exit.

Exit status: torchrun's (0; 1 when a rank failed, with torchrun's own traceback and error record
on stderr).
"""

from __future__ import annotations

import sys
import traceback
from typing import NoReturn

from prism_challenge.evaluator.childexit import exit_child


def main(argv: list[str] | None = None) -> NoReturn:
    """Run torchrun's ``main`` on ``argv`` (default ``sys.argv[1:]``) and exit with its status."""
    from torch.distributed.run import main as torchrun

    code: int = 0
    try:
        torchrun(sys.argv[1:] if argv is None else argv)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:  # noqa: BLE001 - a rank failed (ChildFailedError), a signal: reported as torchrun does
        traceback.print_exc()
        code = 1
    exit_child(code)


if __name__ == "__main__":
    main()
