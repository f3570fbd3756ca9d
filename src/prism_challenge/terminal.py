"""Text a submission chose, made safe to show on a terminal.

A bundle chooses the text of its exceptions, its output and the names in its source, and the
harness shows some of it to an operator (a finding's message, a failure's reason and detail, a
held-out or audit error) on a terminal, in a manifest and in the service's pages. A terminal
obeys control sequences: ``ESC [2J`` clears it, an OSC sequence retitles it or writes a link,
and a bidirectional override makes the text read in another order than it runs (red team rt19:
``raise ValueError("\\x1b[2J\\x1b[32mPASSED")`` cleared ``prism check``'s screen and printed a
green PASSED). :func:`printable` shows every such character as a visible escape instead.
"""

from __future__ import annotations

import re

_UNSAFE = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u200b-\u200f\u2028\u2029\u202a-\u202e"
                     "\u2060-\u2069\ufeff\ud800-\udfff]")
"""C0 controls but tab and newline, DEL, C1 controls; the zero-width characters, the line and
paragraph separators, and the bidirectional marks, embeddings, overrides and isolates (Unicode's
UAX #9, and the "Trojan Source" report, CVE-2021-42574); lone surrogates (not UTF-8: a terminal
write of one raises ``UnicodeEncodeError``)."""


def printable(text: str) -> str:
    """``text`` with each unsafe character (:data:`_UNSAFE`) written as its Python escape
    (``\\x1b``, ``\\u202e``); tab and newline stay."""
    return _UNSAFE.sub(lambda m: ascii(m.group())[1:-1], text)


def shown(text: str) -> str:
    """:func:`printable`, then escaped for Rich's console markup (``[bold]`` in ``text`` stays
    literal text)."""
    from rich.markup import escape

    return escape(printable(text))
