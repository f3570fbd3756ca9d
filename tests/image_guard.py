"""The GPU image's packages, simulated. Copied as ``sitecustomize.py`` into a folder on
``PYTHONPATH``, with ``bench/gpu_wheels.txt`` beside it, it lets a process import, of the
installed distributions, only those the development workplace's GPU image holds or the wheels
carry (the list's ``# image:`` lines and its pins). Any other distribution's top-level module
raises ``ModuleNotFoundError``, as on the device. ``tests/test_gpu_session.py`` runs a whole
``prism eval`` so: its ranks and sandboxed children inherit ``PYTHONPATH`` (the sandbox binds
its entries), and so this guard."""

import importlib.abc
import importlib.metadata
import re
import sys
from pathlib import Path

_norm = lambda n: re.sub(r"[-_.]+", "-", n).lower()  # noqa: E731 - PEP 503 names
_ALLOWED = {"prism-challenge", "pip", "setuptools"}
for _line in Path(__file__).with_name("gpu_wheels.txt").read_text().splitlines():
    if _line.startswith("# image:"):
        _ALLOWED |= {_norm(n) for n in _line.split(":", 1)[1].split()}
    elif _line and not _line.startswith("#"):
        _ALLOWED.add(_norm(_line.split("==")[0]))
_DISTS = {m: {_norm(d) for d in ds} for m, ds in importlib.metadata.packages_distributions().items()}
REFUSED: list[str] = []
# Modules that libraries import inside a ``try`` and do without when missing, so the image runs
# without them: refused here as there, and not reported. ``colorama``: torch's
# ``_inductor/runtime/runtime_utils.py`` (``except ModuleNotFoundError``: plain messages); it is in
# the venv once the ``[docs]`` extra is installed (Material needs it), as ``.ci/run`` does.
_OPTIONAL = {"colorama"}


class ImageGuard(importlib.abc.MetaPathFinder):
    """Refuses a top-level module whose every distribution is outside the image and the wheels."""

    def find_spec(self, name, path=None, target=None):
        dists = _DISTS.get(name)
        if path is None and dists and not dists & _ALLOWED:
            if name in _OPTIONAL:
                raise ModuleNotFoundError(f"No module named {name!r} (not on the GPU image)", name=name)
            REFUSED.append(name)
            sys.stderr.write(f"image guard: {name} ({', '.join(sorted(dists))}) is not on the GPU image\n")
            raise ModuleNotFoundError(f"No module named {name!r} (not on the GPU image)", name=name)
        return None


sys.meta_path.insert(0, ImageGuard())
