"""What one MCP tool call came to, as the agent loop records it and the model reads it.

Every call ends in a ``ToolOutcome``, never an exception (cancellation aside): a server that is
down, dies, hangs or refuses is an outcome whose ``text`` says so, naming the server, so the
model can tell the person or try something else.

Results are text for the model: text blocks as they are, an embedded text resource with its URI,
and binary content (images, audio, blobs) as a label with its type and size, never the bytes.
The text is cut at ``RESULT_CAP`` characters with a note saying how much there was; structured
content larger than the cap is left out (the text carries the result, as MCP servers are asked to
duplicate it there).
"""

from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass
from typing import Any, Literal

from core.providers.base import JsonObject, ToolResult
from core.tools.calls import canonical_json

# Large enough for a page of a document or a few hundred lines of a listing; small enough that a
# runaway result costs a few thousand tokens, not a context window.
RESULT_CAP = 20_000

OutcomeKind = Literal[
    "ok",  # the tool answered
    "tool_error",  # the tool answered with isError (its text says why)
    "invalid_arguments",  # the arguments do not match the input schema; nothing was sent
    "unknown_tool",  # no configured server offers this name
    "unavailable",  # the server is down, starting, disabled or shut down; nothing was sent
    "approval_required",  # the call needs a person's approval and carries none for it
    "timeout",  # no answer within the server's timeout; the server is restarted
    "server_failed",  # the server died or broke the protocol mid-call; it is restarted
    "protocol_error",  # the server answered with an MCP error or a malformed result
    "cancelled",  # the turn stopped while the call ran (the exception is re-raised)
]


@dataclass(frozen=True)
class ToolOutcome:
    """``name`` is what the model called; ``server`` the configured server it went to (None when
    the name is unknown). ``text`` is what the model reads, already cut and redacted."""

    name: str
    server: str | None
    kind: OutcomeKind
    text: str
    structured: Any = None
    truncated: bool = False

    @property
    def ok(self) -> bool:
        return self.kind == "ok"

    def to_tool_result(self, tool_call_id: str) -> ToolResult:
        return ToolResult(tool_call_id, self.name, self.text, is_error=not self.ok)

    def to_output(self) -> JsonObject:
        """The JSON a transcript's tool part keeps as this call's output (or error)."""
        output: JsonObject = {"text": self.text, "outcome": self.kind}
        if self.structured is not None:
            output["structured"] = self.structured
        if self.truncated:
            output["truncated"] = True
        return output


def cut(text: str, cap: int = RESULT_CAP) -> tuple[str, bool]:
    if len(text) <= cap:
        return text, False
    return (
        f"{text[:cap]}\n\n[cut: the result was {len(text):,} characters; "
        f"the first {cap:,} are shown]",
        True,
    )


def render_content(
    blocks: list[Any], structured: Any, cap: int = RESULT_CAP
) -> tuple[str, Any, bool]:
    """(text, structured content or None, truncated) of a CallToolResult's parts."""
    parts = [_block_text(block) for block in blocks]
    text = "\n".join(part for part in parts if part)
    truncated = False
    if structured is not None:
        encoded = canonical_json(structured)
        if not text:
            text = encoded
        if len(encoded) > cap:
            structured, truncated = None, True
    text, cut_text = cut(text, cap)
    return text, structured, truncated or cut_text


def _block_text(block: Any) -> str:
    kind = getattr(block, "type", None)
    if kind == "text":
        return str(block.text)
    if kind in ("image", "audio"):
        return _label(kind, getattr(block, "mime_type", None), getattr(block, "data", ""))
    if kind == "resource":
        resource = block.resource
        uri = str(getattr(resource, "uri", ""))
        if getattr(resource, "text", None) is not None:
            return f"[resource {uri}]\n{resource.text}"
        return _label("resource", getattr(resource, "mime_type", None), resource.blob, uri)
    if kind == "resource_link":
        return f"[resource link: {getattr(block, 'name', '')} {getattr(block, 'uri', '')}]"
    return f"[{kind or 'unknown'} content: not shown]"


def _label(kind: str, mime: str | None, data: str, uri: str = "") -> str:
    try:
        size = f"{len(base64.b64decode(data, validate=True)):,} bytes"
    except (binascii.Error, ValueError):
        size = "undecodable data"
    where = f" {uri}" if uri else ""
    return f"[binary {kind}{where} ({mime or 'unknown type'}, {size}): not shown to the model]"
