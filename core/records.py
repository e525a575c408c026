"""Plain values the store returns and takes: no ORM objects leave ``core``'s store."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Final, NamedTuple

from core.messages import Message

BUILTIN_PROVIDERS = frozenset({"openai", "anthropic", "offline"})


@dataclass(frozen=True)
class Actor:
    """Who asks. ``admin`` may act on anyone's session (ADMIN_USER_IDS, the terminal operator)."""

    user_id: int | None
    admin: bool = False

    def may_manage(self, owner_id: int | None) -> bool:
        return self.admin or (self.user_id is not None and self.user_id == owner_id)


@dataclass(frozen=True)
class ModelChoice:
    """What ``stamp_session_model`` records on a session at turn start."""

    provider: str
    name: str | None = None
    custom_provider_id: int | None = None
    builtin_provider: str | None = None


@dataclass(frozen=True)
class SessionInfo:
    id: int
    project_name: str
    project_session_id: str
    user_id: int | None
    title: str | None
    expires_at: datetime | None
    heartbeat_at: datetime | None
    model_provider: str | None
    model_name: str | None
    custom_provider_id: int | None
    builtin_provider: str | None
    created_at: datetime
    updated_at: datetime
    is_turn_active: bool

    @property
    def custom_provider_deleted(self) -> bool:
        """The session named a custom provider whose row is gone (FK set null on delete)."""
        return (
            self.model_provider is not None
            and self.model_provider not in BUILTIN_PROVIDERS
            and self.custom_provider_id is None
        )


class StoredMessage(NamedTuple):
    """A persisted message. A named tuple, not a frozen dataclass: a history load makes one per
    message, and a frozen dataclass's ``__init__`` (one ``object.__setattr__`` per field) cost
    about as much as decoding the message's JSON (docs/benchmarks.md, *History load of 10,000
    messages*)."""

    message_id: str
    position: int
    message: Message
    is_compaction_message: bool

    @property
    def role(self) -> str:
        return str(self.message.get("role"))

    @property
    def returns_as_draft(self) -> bool:
        """Whether rewinding or forking *at* this message withdraws it and hands its text back.

        Only what a person wrote: a user message. A checkpoint is user-role but written by
        compaction, so rewinding or forking at it behaves like an assistant message: it is kept
        (the conversation goes back to just after that compaction) and nothing comes back as a
        draft. To undo a compaction, rewind to the message before the checkpoint.
        """
        return self.role == "user" and not self.is_compaction_message


@dataclass
class TurnLease:
    """Proof of holding a session's turn lock; every write of the turn presents its token.

    ``next_position`` is where the turn's next message goes: while the lock is held no one else
    appends, so the turn need not ask the database (the unique ``(session_id, position)``
    constraint would refuse a mistake).
    """

    session_id: int
    token: str
    tail: StoredMessage | None
    next_position: int


@dataclass(frozen=True)
class TruncateResult:
    deleted: int
    draft: str | None
    tail_message_id: str | None
    deleted_message_ids: tuple[str, ...]


@dataclass(frozen=True)
class BranchResult:
    session: SessionInfo
    draft: str | None
    copied: int


class AnyTail:
    """Marker for "do not check the tail" (compaction claims the lock without a stale guard)."""


ANY_TAIL: Final = AnyTail()  # a turn that claims the lock without a stale guard
