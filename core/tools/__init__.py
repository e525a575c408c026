"""Tools from the MCP servers an operator names in ``MCP_CONFIG`` (see ``toolbox`` for the API).

``config`` reads the servers' file, ``server`` keeps each server connected, ``toolbox`` is what
the agent loop calls, ``outcome`` is what a call comes to, ``calls`` holds the digest an approval
binds to, ``listing`` is ``slack-agent tools``. The MCP SDK is imported only once a server starts,
so a command that never connects pays nothing for it.
"""

from core.tools.calls import call_digest, canonical_json
from core.tools.config import (
    McpConfig,
    ServerConfig,
    load_mcp_config,
    mcp_environment,
    with_known_secrets,
)
from core.tools.names import is_mcp_tool_name
from core.tools.outcome import RESULT_CAP, OutcomeKind, ToolOutcome
from core.tools.server import Backoff, ServerState, ServerStatus
from core.tools.tool import McpTool
from core.tools.toolbox import McpTools

__all__ = [
    "RESULT_CAP",
    "Backoff",
    "McpConfig",
    "McpTool",
    "McpTools",
    "OutcomeKind",
    "ServerConfig",
    "ServerState",
    "ServerStatus",
    "ToolOutcome",
    "call_digest",
    "canonical_json",
    "is_mcp_tool_name",
    "load_mcp_config",
    "mcp_environment",
    "with_known_secrets",
]
