"""The one exception tree of slack-agent.

Every surface (Slack, the terminal client, the command line) maps these the same way, by
``code``, which is stable: operators grep logs for it and clients branch on it. Driver errors
never leave ``core``; the store translates them at its boundary with ``raise ... from exc``. Tools
above the product add their own leaves (the soak's ``bench.soak.SoakFailed``).

    SlackAgentError
    ├── ConfigError                      config_invalid
    ├── UsageError                       usage_error
    ├── InvalidRequest                   invalid_request
    ├── DatabaseError                    database_error
    │   ├── DatabaseNotReady             database_not_ready
    │   ├── DatabaseUnreachable          database_unreachable
    │   └── DatabaseValueRefused         database_value_refused
    ├── AgentSessionError
    │   ├── AgentSessionNotFound         agent_session_not_found
    │   ├── AgentSessionForbidden        agent_session_forbidden
    │   ├── AgentSessionBusy             agent_session_busy
    │   ├── AgentSessionStale            agent_session_stale
    │   ├── AgentSessionAlreadyCompact   agent_session_already_compact
    │   ├── AgentSessionLockLost         agent_session_lock_lost
    │   ├── TurnInterrupted              agent_session_turn_interrupted
    │   ├── AgentSessionBudgetExceeded   agent_session_budget_exceeded
    │   ├── MessageNotFound              agent_session_message_not_found
    │   ├── DuplicateMessage             agent_session_message_duplicate
    │   └── InvalidMessage               agent_session_message_invalid
    └── ModelProviderError               model_provider_error
        ├── ModelProviderUnavailable     model_provider_unavailable
        ├── ModelProviderRateLimited     model_provider_rate_limited
        ├── ModelProviderTimeout         model_provider_timeout
        ├── ModelProviderBadResponse     model_provider_bad_response
        └── ModelProviderRejected        model_provider_rejected
"""

from __future__ import annotations

from datetime import datetime
from decimal import Decimal


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


class UsageError(SlackAgentError):
    """A command was called with arguments that do not make sense together."""

    code = "usage_error"


class InvalidRequest(SlackAgentError):
    """A surface got a request whose shape is wrong (a value of the wrong type); nothing of it
    was acted on."""

    code = "invalid_request"


class DatabaseError(SlackAgentError):
    """The database failed in a way the protocol does not expect (unreachable, corrupt, ...)."""

    code = "database_error"


class DatabaseNotReady(DatabaseError):
    """The database has no schema yet, or one older than this build's: an operator's command
    would fail on a table or column that is not there."""

    code = "database_not_ready"


class DatabaseUnreachable(DatabaseError):
    """A turn stopped itself: the database did not confirm its lock within the safe share of
    the staleness window (§6.12). Retried like any database failure mid-turn."""

    code = "database_unreachable"


class DatabaseValueRefused(DatabaseError):
    """The database refused a value itself (PostgreSQL's SQLSTATE class 22, "data exception":
    a NUL in a text, a number out of range), so nothing of the statement was written. Unlike
    the database failing, sending the same request again is refused again: every surface
    answers it as the request's fault (a 4xx; the terminal says so once), never "try again".
    Made only by ``core.storage.engine.database_error``, where driver errors are read."""

    code = "database_value_refused"


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


class TurnInterrupted(AgentSessionError):
    """The turn was stopped on purpose (``Turn.interrupt``: a stop button, a shutdown); its
    partial output and sandbox state are kept, marked interrupted, and the lock released."""

    code = "agent_session_turn_interrupted"

    def __init__(self, message: str, *, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


class AgentSessionBudgetExceeded(AgentSessionError):
    """A spending limit (``BUDGETS``) is used up for the actor: refused before any model
    request, or (``during_turn``) a running turn stopped after its request in flight.

    The limit and its reset time are on the exception as values, so every surface words the
    refusal itself: ``limit`` is the entry as written (``user:day:200000tokens``), ``scope``
    ``user``/``workspace``/``all``, ``period`` ``day``/``month``, ``unit`` ``tokens``/``usd``,
    ``amount`` the limit in that unit, ``spent`` what the window has used (reservations of
    running turns included), ``resets_at`` when the window ends (UTC).
    """

    code = "agent_session_budget_exceeded"

    def __init__(
        self,
        message: str,
        *,
        limit: str,
        scope: str,
        period: str,
        unit: str,
        amount: Decimal,
        spent: Decimal,
        resets_at: datetime,
        during_turn: bool = False,
    ) -> None:
        super().__init__(message)
        self.limit = limit
        self.scope = scope
        self.period = period
        self.unit = unit
        self.amount = amount
        self.spent = spent
        self.resets_at = resets_at
        self.during_turn = during_turn


class MessageNotFound(AgentSessionError):
    code = "agent_session_message_not_found"


class DuplicateMessage(AgentSessionError):
    """A message with this id is already stored (a retried delivery of the same message)."""

    code = "agent_session_message_duplicate"


class InvalidMessage(AgentSessionError):
    """A message that breaks the transcript's invariants (id not a UUID, ids disagreeing)."""

    code = "agent_session_message_invalid"


class ModelProviderError(SlackAgentError):
    """A model call failed; the turn ends with a message to the user instead of an answer.

    ``partial_text`` is the text the provider had already streamed to the caller when it failed,
    so the turn can persist it as interrupted output rather than lose what the user
    may already have seen. ``retry_after`` is the wait the server asked for, when it said one.
    """

    code = "model_provider_error"

    def __init__(
        self,
        message: str,
        *,
        provider: str,
        status_code: int | None = None,
        retry_after: float | None = None,
        partial_text: str = "",
    ) -> None:
        super().__init__(message)
        self.provider = provider
        self.status_code = status_code
        self.retry_after = retry_after
        self.partial_text = partial_text


class ModelProviderUnavailable(ModelProviderError):
    """The endpoint could not be reached or kept failing (5xx, overloaded) after retries."""

    code = "model_provider_unavailable"


class ModelProviderRateLimited(ModelProviderError):
    """429 after retries, or a ``Retry-After`` longer than a turn may sensibly wait."""

    code = "model_provider_rate_limited"


class ModelProviderTimeout(ModelProviderError):
    """Connecting took too long, or the stream went silent for longer than the read timeout."""

    code = "model_provider_timeout"


class ModelProviderBadResponse(ModelProviderError):
    """The reply broke the wire format: malformed JSON, or a stream cut before its terminator."""

    code = "model_provider_bad_response"


class ModelProviderRejected(ModelProviderError):
    """The provider refused the request itself (bad key, unknown model, invalid request).

    Retrying cannot help; the operator has to change configuration.
    """

    code = "model_provider_rejected"
