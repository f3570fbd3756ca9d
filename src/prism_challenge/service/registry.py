"""The hotkey registry hook (issue 27, item 2): an operator may require that every submitting hotkey
be listed in a file it keeps, re-read when it changes.

Formats, by the file's suffix:

- ``.json``: a metagraph snapshot the operator refreshes (e.g. ``json.dump(metagraph.hotkeys, f)``
  from a cron job): a list of SS58 hotkeys, or an object whose ``hotkeys`` key is that list;
- anything else: one SS58 hotkey per line; blank lines and ``#`` comments are skipped.

Every entry must be an SS58 address of the service's network (``ss58_prefix``); a bad entry
refuses the whole file (its line or index named), so a typo never silently admits or drops keys.
The file's modification time and size are checked at most every ``refresh_s`` seconds and the
file read again when they changed. A file that breaks later (removed, or a bad entry) keeps the
last good list and logs why; a file that cannot be read at start refuses the start.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path

from prism_challenge.service.signing import SignatureError, ss58_decode

log = logging.getLogger("prism.service")


class RegistryError(ValueError):
    """The registry file cannot be read or has a bad entry (the message names the file and where)."""


def read_registry(path: Path, prefix: int) -> frozenset[str]:
    """The hotkeys listed in ``path`` (format: module docstring).

    Raises:
        RegistryError: unreadable, not JSON (a ``.json`` file), not a list of strings, or an entry
            that is not an SS58 address of network ``prefix``.
    """
    try:
        raw = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise RegistryError(f"{path}: cannot be read ({exc})") from None
    if Path(path).suffix.lower() == ".json":
        entries = _json_entries(path, raw)
    else:
        entries = [(f"line {n}", line.split("#", 1)[0].strip()) for n, line in enumerate(raw.splitlines(), 1)]
        entries = [(where, key) for where, key in entries if key]
    keys = set()
    for where, key in entries:
        try:
            _, got = ss58_decode(key)
        except SignatureError as exc:
            raise RegistryError(f"{path}: {where}: {key[:60]!r} is not an SS58 hotkey ({exc})") from None
        if got != prefix:
            raise RegistryError(f"{path}: {where}: {key} is an address of network {got}, not {prefix}")
        keys.add(key)
    return frozenset(keys)


def _json_entries(path: Path, raw: str) -> list[tuple[str, str]]:
    try:
        doc = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise RegistryError(f"{path}: line {exc.lineno}: not JSON ({exc.msg})") from None
    if isinstance(doc, dict):
        doc = doc.get("hotkeys")
    if not isinstance(doc, list) or not all(isinstance(k, str) for k in doc):
        raise RegistryError(f"{path}: must be a list of hotkeys, or an object whose 'hotkeys' is one")
    return [(f"entry {i}", k.strip()) for i, k in enumerate(doc)]


class HotkeyRegistry:
    """The listed hotkeys of one file, re-read when its mtime or size changes.

    Args:
        path: the registry file.
        prefix: the SS58 network of the hotkeys.
        refresh_s: the least seconds between two checks of the file.
        clock: monotonic seconds (tests pass their own).

    Raises:
        RegistryError: the file cannot be read at start.
    """

    def __init__(self, path: Path, prefix: int, refresh_s: float, clock: Callable[[], float] = time.monotonic):
        self.path, self.prefix, self.refresh_s, self.clock = Path(path), prefix, refresh_s, clock
        self._lock = threading.Lock()
        self._stamp = self._stat()
        self._keys = read_registry(self.path, prefix)
        self._checked = clock()

    def _stat(self) -> tuple[int, int] | None:
        try:
            st = self.path.stat()
        except OSError:
            return None
        return st.st_mtime_ns, st.st_size

    def __contains__(self, hotkey: str) -> bool:
        """Whether ``hotkey`` is listed (the file checked first when ``refresh_s`` passed)."""
        with self._lock:
            if self.clock() - self._checked >= self.refresh_s:
                self._refresh()
            return hotkey in self._keys

    def __len__(self) -> int:
        return len(self._keys)

    def _refresh(self) -> None:
        self._checked = self.clock()
        stamp = self._stat()
        if stamp == self._stamp:
            return
        try:
            self._keys = read_registry(self.path, self.prefix)
        except RegistryError as exc:
            log.error("hotkey registry: %s; keeping the %d hotkeys read before", exc, len(self._keys))
        else:
            log.info("hotkey registry %s: %d hotkeys", self.path, len(self._keys))
        self._stamp = stamp


__all__ = ["HotkeyRegistry", "RegistryError", "read_registry"]
