"""The one exception tree of slack-agent.

Every surface (Slack, the terminal client, the command line) maps these the same way, by
``code``, which is stable: operators grep logs for it and clients branch on it. Driver errors
never leave ``core``; the store translates them at its boundary with ``raise ... from exc``.

    SlackAgentError
    ├── ConfigError                      config_invalid
    ├── DatabaseError                    database_error
    └── AgentSessionError
        ├── AgentSessionNotFound         agent_session_not_found
        ├── AgentSessionForbidden        agent_session_forbidden
        ├── AgentSessionBusy             agent_session_busy
        ├── AgentSessionStale            agent_session_stale
        ├── AgentSessionAlreadyCompact   agent_session_already_compact
        ├── AgentSessionLockLost         agent_session_lock_lost
        ├── MessageNotFound              agent_session_message_not_found
        ├── DuplicateMessage             agent_session_message_duplicate
        └── InvalidMessage               agent_session_message_invalid
"""

from __future__ import annotations


class SlackAgentError(Exception):
    """Base of every error slack-agent raises on purpose."""

    code = "slack_agent_error"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def __str__(self) -> str:
        return self.message


class ConfigError(SlackAgentError):
    """A setting a mode needs is missing or malformed; the message names the variable."""

    code = "config_invalid"


class DatabaseError(SlackAgentError):
    """The database failed in a way the protocol does not expect (unreachable, corrupt, ...)."""

    code = "database_error"


class AgentSessionError(SlackAgentError):
    """Refusals of the session store, each naming the session it concerns."""

    code = "agent_session_error"


class AgentSessionNotFound(AgentSessionError):
    code = "agent_session_not_found"


class AgentSessionForbidden(AgentSessionError):
    """The actor neither owns the session nor is an admin, for an owner-only operation."""

    code = "agent_session_forbidden"


class AgentSessionBusy(AgentSessionError):
    """Another turn holds a live lock on the session; nothing was written."""

    code = "agent_session_busy"


class AgentSessionStale(AgentSessionError):
    """The client's ``last_message_id`` is not the persisted tail; nothing was written."""

    code = "agent_session_stale"

    def __init__(self, message: str, *, actual_last_message_id: str | None) -> None:
        super().__init__(message)
        self.actual_last_message_id = actual_last_message_id


class AgentSessionAlreadyCompact(AgentSessionError):
    code = "agent_session_already_compact"


class AgentSessionLockLost(AgentSessionError):
    """This turn's lock went stale and another turn took it over (fencing token mismatch)."""

    code = "agent_session_lock_lost"


class MessageNotFound(AgentSessionError):
    code = "agent_session_message_not_found"


class DuplicateMessage(AgentSessionError):
    """A message with this id is already stored (a retried delivery of the same message)."""

    code = "agent_session_message_duplicate"


class InvalidMessage(AgentSessionError):
    """A message that breaks the transcript's invariants (id not a UUID, ids disagreeing)."""

    code = "agent_session_message_invalid"
