"""An MCP tool as the agent offers it: its name for the model, its schema, its approval rule.

The rule comes from the server's ``approval`` and the tool's annotations: ``always`` asks for
every call, ``never`` for none, and ``unless_read_only`` (the default) lets a tool run without
asking only when the server marks it ``readOnlyHint: true``. Annotations are the server's word,
not a guarantee, which is why an operator who does not trust a server says ``always``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from core.providers.base import JsonObject, ToolSpec
from core.tools.calls import ArgumentCheck, call_digest
from core.tools.config import Approval, ServerConfig
from core.tools.names import offered_name


def approval_needed(rule: Approval, read_only: bool) -> bool:
    return rule == "always" or (rule == "unless_read_only" and not read_only)


@dataclass(frozen=True)
class McpTool:
    """``name`` is what the model calls (``mcp__<server>__<tool>``); ``tool`` the server's name
    for it; ``approvers`` who may decide its calls besides the session's owner and admins."""

    name: str
    server: str
    tool: str
    description: str
    input_schema: JsonObject
    read_only: bool
    needs_approval: bool
    check: ArgumentCheck = field(repr=False, compare=False)
    approvers: tuple[str, ...] = ()
    origin: str = ""  # the server as configured (transport and target), for ``digest``

    def digest(self, arguments: dict[str, Any]) -> str:
        """What a person's approval of this call binds to (``call_digest``)."""
        identity = {"server": self.server, "origin": self.origin, "tool": self.tool}
        return call_digest(self.name, arguments, tool=identity)

    def spec(self) -> ToolSpec:
        return ToolSpec(self.name, self.description, self.input_schema)

    @property
    def rule(self) -> str:
        """The rule as ``slack-agent tools`` prints it."""
        return "asks for approval" if self.needs_approval else "runs without asking"


def from_listing(config: ServerConfig, listed: Any) -> McpTool | None:
    """The tool a server listed (an SDK ``Tool``), or None if its name cannot be offered."""
    name = offered_name(config.name, listed.name)
    if name is None:
        return None
    annotations = listed.annotations
    read_only = bool(annotations is not None and annotations.read_only_hint is True)
    schema = dict(listed.input_schema or {})
    schema.setdefault("type", "object")
    title = listed.title or (annotations.title if annotations is not None else None)
    description = listed.description or title or f"{listed.name} (MCP server {config.name})"
    return McpTool(
        name=name,
        server=config.name,
        tool=listed.name,
        description=description,
        input_schema=schema,
        read_only=read_only,
        needs_approval=approval_needed(config.approval, read_only),
        approvers=config.approvers,
        check=ArgumentCheck(schema),
        origin=f"{config.transport}:{config.target}",
    )
