"""The rescore tests' bundles: a folder of ``tests/rescore_bundles`` plus the shared model
module ``common/peekmodel.py`` (``common/relaymodel.py`` for the relay cheats, and
``common/plain_training.py`` as ``training.py`` where the folder has no loop of its own), copied
into a fresh directory."""
import shutil
from pathlib import Path

HERE = Path(__file__).resolve().parent


def bundle(name: str, dest: Path) -> Path:
    """Copy bundle ``name`` with ``peekmodel.py`` (and the plain loop, if it has none) into
    ``dest / name``; returns that folder."""
    out = dest / name
    shutil.copytree(HERE / name, out)
    shutil.copyfile(HERE / "common" / "peekmodel.py", out / "peekmodel.py")
    if "relaymodel" in (out / "architecture.py").read_text():
        shutil.copyfile(HERE / "common" / "relaymodel.py", out / "relaymodel.py")
    if not (out / "training.py").exists():
        shutil.copyfile(HERE / "common" / "plain_training.py", out / "training.py")
    return out
