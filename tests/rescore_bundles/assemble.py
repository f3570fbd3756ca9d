"""The rescore tests' bundles: a folder of ``tests/rescore_bundles`` plus the shared model
module ``common/peekmodel.py``, copied into a fresh directory."""
import shutil
from pathlib import Path

HERE = Path(__file__).resolve().parent


def bundle(name: str, dest: Path) -> Path:
    """Copy bundle ``name`` with ``peekmodel.py`` into ``dest / name``; returns that folder."""
    out = dest / name
    shutil.copytree(HERE / name, out)
    shutil.copyfile(HERE / "common" / "peekmodel.py", out / "peekmodel.py")
    return out
