"""A call waiting for approval as a person reads it: every argument, nothing hidden or reordered.

The digest a person approves binds every argument (``core.tools.call_digest``), so every surface
must be able to show every one of them: a model could otherwise push the argument that matters
(``to``, ``path``, ``query``) past a cut, or hide it behind characters a screen does not draw.
So a surface shows ``argument_lines`` (each argument on its own line, sorted, its value as JSON)
and never cuts them silently: a long value is folded (``folded``: its start and how many
characters are not on this screen) only where the same surface offers the whole call one step
away (Slack's *Show all*), cut into ``pages`` no longer than its blocks hold.

Characters that change what a person reads without being seen are shown as JSON escapes
(``\\u202e``): controls, bidirectional overrides and isolates, zero-width and other format
characters, line and paragraph separators, spaces other than the plain one, private-use and
unassigned code points. The escape keeps the JSON exact (it means the same string), so what is
shown is still the call that runs.
"""

from __future__ import annotations

import json
import re
import unicodedata
from collections.abc import Callable, Mapping
from typing import Any

# Unicode categories drawn as nothing, or as something else: Cc controls, Cf format (bidi
# controls, zero-width characters, tags), Zl/Zp separators, Co private use, Cs lone surrogates,
# Cn unassigned. Zs spaces other than U+0020 are escaped too (a no-break space looks like one).
_HIDDEN = frozenset({"Cc", "Cf", "Zl", "Zp", "Co", "Cs", "Cn"})


def _escaped(char: str) -> str:
    code = ord(char)
    if code > 0xFFFF:  # as JSON writes it: a surrogate pair
        code -= 0x10000
        return f"\\u{0xD800 + (code >> 10):04x}\\u{0xDC00 + (code & 0x3FF):04x}"
    return f"\\u{code:04x}"


def visible(text: str, also: str = "") -> str:
    """``text`` (JSON) with every character a screen would hide or reorder written as its JSON
    escape; ``also``: more characters to escape (a surface's own markup, e.g. a backtick)."""
    plain = "".join(re.escape(c) for c in also)
    # Printable ASCII and the line breaks of indentation pass at C speed; the rest is looked at.
    pattern = re.compile(f"[^\\x20-\\x7e\\n]|[{plain}]" if plain else "[^\\x20-\\x7e\\n]")
    return pattern.sub(lambda m: _shown(m.group(0), also), text)


def _shown(char: str, also: str) -> str:
    category = unicodedata.category(char)
    hidden = category in _HIDDEN or category == "Zs" or char in also
    return _escaped(char) if hidden else char


def argument_lines(arguments: Mapping[str, Any], also: str = "") -> list[str]:
    """Every argument as ``"name": value`` (sorted by name; the value as JSON, nested values
    indented), escaped with ``visible``: the whole call, nothing cut."""
    lines: list[str] = []
    for name in sorted(arguments):
        value = json.dumps(arguments[name], ensure_ascii=False, sort_keys=True, indent=2)
        key = json.dumps(name, ensure_ascii=False)
        lines.append(visible(f"{key}: {value}", also))
    return lines


def folded(line: str, limit: int) -> str:
    """``line`` when it fits in ``limit`` characters; else its start and how much is not shown
    (said, never silent)."""
    if len(line) <= limit:
        return line
    hidden = len(line) - limit
    return f"{line[:limit]} … (+{hidden:,} characters not shown here)"


def pages(lines: list[str], size: int, *, measure: Callable[[str], int] = len) -> list[str]:
    """``lines`` joined into pieces measuring at most ``size`` (``measure``: what a text costs
    where it is shown, additive over its characters, e.g. entities in mrkdwn), a line broken only
    when it alone is heavier; nothing left out (the pieces, in order, hold every line)."""
    found: list[str] = []
    current: list[str] = []
    used = 0
    for line in lines:
        cost = measure(line)
        if current and used + 1 + cost <= size:
            current.append(line)
            used += 1 + cost
            continue
        if current:
            found.append("\n".join(current))
            current, used = [], 0
        start = 0
        while cost > size:  # alone too heavy: the longest start that fits, and go on
            fits = _longest_start(line[start : start + size], size, measure)
            piece = line[start : start + fits]
            found.append(piece)
            start += fits
            cost -= measure(piece)
        current, used = [line[start:]], cost
    if current:
        found.append("\n".join(current))
    return found


def _longest_start(text: str, size: int, measure: Callable[[str], int]) -> int:
    """How many characters of ``text`` measure at most ``size`` (at least one)."""
    low, high = 1, min(len(text), size)
    while low < high:
        middle = (low + high + 1) // 2
        if measure(text[:middle]) <= size:
            low = middle
        else:
            high = middle - 1
    return low
