"""Text on its way to Slack, so that it arrives as it was written.

Two kinds of field, two treatments:

- **mrkdwn** (``text`` of a message or an ephemeral, section blocks): ``escape`` turns ``&``,
  ``<`` and ``>`` into the entities Slack documents, so nothing a person or the model wrote
  becomes a mention, ``<!channel>`` or a link. Applied to the words quoted into our own
  messages (``bot.texts``), never to our own markup.
- **Markdown** (``markdown_text``, ``markdown`` blocks): Slack does not promise to leave its
  control sequences alone there, so ``neutralise`` puts a zero-width joiner after every ``<``
  that could open one (``<!``, ``<@``, ``<#``, ``<scheme:``), after the ``@`` of ``@here``,
  ``@channel`` and ``@everyone``, and after the ``&`` of an entity. The text reads the same;
  copied out of a code block it carries that invisible joiner.

``split_markdown`` cuts Markdown into pieces Slack takes in one call (12,000 characters for
``markdown_text``), at paragraph ends or after a closed code fence; a line end only when a
block is longer than a piece, and inside a code fence only when the fence itself is.
"""

from __future__ import annotations

import bisect
import re

ZWJ = "\u200d"
APPEND_LIMIT = 12_000  # Slack's limit on one ``markdown_text``
# How far past a ``<``, ``@`` or ``&`` ``neutralise`` looks to decide; a stream holds back
# that much from the end of what arrived until more text (or the end) settles it.
LOOKAHEAD = 40

_CONTROL = re.compile(
    r"<(?=[!@#]|[A-Za-z][A-Za-z0-9+.\-]{0,31}:)"  # <!channel> <@U1> <#C1> <https://x|y>
    r"|@(?=(?:here|channel|everyone)\b)"  # @here and friends
    r"|&(?=(?:lt|gt|amp|quot|#\d{1,7}|#x[0-9A-Fa-f]{1,6});)"  # an entity Slack might decode
)
_RISKY = re.compile(r"[<@&]")
_FENCE_OPEN = re.compile(r"^ {0,3}(`{3,}|~{3,})(.*)$")


def escape(text: str) -> str:
    """For mrkdwn: ``&``, ``<``, ``>`` as Slack's entities (shown as written)."""
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def neutralise(text: str) -> str:
    """For Markdown: a zero-width joiner after what could start a Slack control sequence."""
    return _CONTROL.sub(lambda m: m.group(0) + ZWJ, text)


def settled(text: str, start: int) -> int:
    """How much of ``text`` (from ``start``) ``neutralise`` can treat now, while more may
    follow: all but a tail from the first ``<``, ``@`` or ``&`` within ``LOOKAHEAD`` of the end."""
    tail_from = max(start, len(text) - LOOKAHEAD)
    found = _RISKY.search(text, tail_from)
    return len(text) if found is None else found.start()


def _fence_closes(line: str, opener: str) -> bool:
    stripped = line.rstrip("\r\n")
    body = stripped.lstrip(" ")
    if len(stripped) - len(body) > 3 or not body.startswith(opener):
        return False
    return set(body.rstrip()) == {opener[0]}


def _fence_of(opener: str | None) -> str | None:
    if opener is None:
        return None
    opened = _FENCE_OPEN.match(opener)
    return opened.group(1) if opened else None


def _lines(text: str, inside: str | None = None) -> list[tuple[int, str, str | None]]:
    """Each line's end offset, the line, and the fence open *after* it (None: outside).
    ``inside``: the opening line of a fence ``text`` starts in (it continues earlier text)."""
    found: list[tuple[int, str, str | None]] = []
    fence: str | None = _fence_of(inside)
    offset = 0
    for line in text.splitlines(keepends=True):
        offset += len(line)
        if fence is None:
            opened = _FENCE_OPEN.match(line.rstrip("\r\n"))
            if opened and not (opened.group(1)[0] == "`" and "`" in opened.group(2)):
                fence = opened.group(1)
        elif _fence_closes(line, fence):
            fence = None
        found.append((offset, line, fence))
    return found


def open_fence(text: str) -> str | None:
    """The opening line of the code fence ``text`` ends inside, if any (without its newline)."""
    opener: str | None = None
    fence: str | None = None
    for _, line, after in _lines(text):
        if fence is None and after is not None:
            opener = line.rstrip("\r\n")
        fence = after
    return opener if fence is not None else None


def closing_fence(opener: str) -> str:
    """The line that closes the fence ``opener`` opened."""
    body = opener.lstrip(" ")
    char = body[0]
    return char * (len(body) - len(body.lstrip(char)))


def _boundaries(text: str, inside: str | None = None) -> tuple[list[int], list[int], list[int]]:
    """Offsets where a piece may end: block ends outside a fence (after a blank line or a
    closing fence), line ends outside a fence, and every line end."""
    blocks: list[int] = []
    outside: list[int] = []
    anywhere: list[int] = []
    previous: str | None = _fence_of(inside)
    for end, line, fence in _lines(text, inside):
        anywhere.append(end)
        if fence is None:
            outside.append(end)
            if not line.strip() or previous is not None:
                blocks.append(end)
        previous = fence
    return blocks, outside, anywhere


def block_end(text: str, inside: str | None = None) -> int:
    """Where the last whole block of ``text`` ends (0: none has ended yet); ``inside`` as for
    ``split_markdown``."""
    blocks, _, _ = _boundaries(text, inside)
    return blocks[-1] if blocks else 0


def split_markdown(text: str, limit: int = APPEND_LIMIT, inside: str | None = None) -> list[str]:
    """``text`` in pieces of at most ``limit`` characters whose concatenation is ``text``.

    A piece ends, by preference: after a blank line or a closing fence (a block's end) outside
    any code fence; else at a line end outside a fence; else at any line end; else at
    ``limit`` (a single line longer than a piece). ``inside``: the opening line of the code
    fence ``text`` starts in, when it continues text that opened one.
    """
    if limit < 1:
        raise ValueError("limit must be positive")
    if len(text) <= limit:
        return [text] if text else []
    preferences = _boundaries(text, inside)
    pieces: list[str] = []
    start = 0
    while len(text) - start > limit:
        cut = start + limit
        for candidates in preferences:
            best = _last_within(candidates, start, cut)
            if best is not None:
                cut = best
                break
        pieces.append(text[start:cut])
        start = cut
    if start < len(text):
        pieces.append(text[start:])
    return pieces


def _last_within(offsets: list[int], start: int, end: int) -> int | None:
    """The largest offset in (start, end], from a sorted list."""
    i = bisect.bisect_right(offsets, end)
    if i and offsets[i - 1] > start:
        return offsets[i - 1]
    return None
