"""The conversation API every surface calls (``conversations``), and what a surface has shown
of a session (``views``). A surface is a translation: its input to one of these calls, the
result to its output; see docs/design.md for the calls a surface makes."""

from core.conversation.approvals import ApprovalDesk, Decided, Decision, Refused
from core.conversation.conversations import Conversation, Conversations, Forked
from core.conversation.outcomes import (
    AlreadyAnswered,
    Answered,
    Busy,
    ConversationEvent,
    OnConversationEvent,
    OverBudget,
    PickingUp,
    Refreshed,
    RewindPlan,
    Rewound,
    Stale,
    TurnOutcome,
    TurnRequest,
)
from core.conversation.views import REFRESH_LAST, MemoryView, ThreadView, Unseen, View

__all__ = [
    "REFRESH_LAST",
    "AlreadyAnswered",
    "Answered",
    "ApprovalDesk",
    "Busy",
    "Conversation",
    "ConversationEvent",
    "Conversations",
    "Decided",
    "Decision",
    "Forked",
    "MemoryView",
    "OnConversationEvent",
    "OverBudget",
    "PickingUp",
    "Refreshed",
    "Refused",
    "RewindPlan",
    "Rewound",
    "Stale",
    "ThreadView",
    "TurnOutcome",
    "TurnRequest",
    "Unseen",
    "View",
]
