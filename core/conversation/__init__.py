"""The conversation API every surface calls (``conversations``, through its door ``door``), and
what a surface has shown of a session (``views``). A surface is a renderer: what arrived goes in
through one call, the turn comes back as events and one closed outcome; see docs/design.md,
*Adding a surface*.

This package is, with ``core.errors`` and ``core.runtime``, all a surface imports of the core
(the layer test holds them to it), so the values a surface handles are named here too: who pays
(``Payer``), a stored message and its text, a waiting tool call, a delivery record, the
checkpoint's sections, a budget refusal's wording."""

from core.agent.accounting import Payer
from core.agent.loop import ApprovalRequest
from core.checkpoint import SECTIONS, parse_checkpoint
from core.conversation.approvals import ApprovalDesk, Decided, Decision
from core.conversation.conversations import Conversation, Conversations, Forked, Summary
from core.conversation.door import (
    Arrival,
    Attachments,
    BeforeTurn,
    Began,
    BudgetRanOut,
    Choice,
    DecisionRecorded,
    DecisionRefused,
    Failed,
    Interrupted,
    LockLost,
    QuietRenderer,
    Renderer,
    Said,
    Told,
    ToolBegan,
    ToolEnded,
    TurnEnd,
    TurnEvent,
)
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
from core.conversation.places import SLACK_PROJECT, TERMINAL_PROJECT, WEB_PROJECT, Place
from core.conversation.shown import argument_lines, folded, pages, visible
from core.conversation.views import REFRESH_LAST, MemoryView, ThreadView, Unseen, View
from core.conversation.visibility import Viewer, may_see, place
from core.messages import Message, message_text, slack_message_id
from core.records import Actor, SessionInfo, StoredMessage
from core.storage.approvals import DECISION_REASON_MOST, ApprovalRecord
from core.storage.deliveries import DeliveryRecord
from core.trace_links import stored_trace_url
from core.usage.budgets import refused_budget, resets_text

__all__ = [
    "DECISION_REASON_MOST",
    "REFRESH_LAST",
    "SECTIONS",
    "SLACK_PROJECT",
    "TERMINAL_PROJECT",
    "WEB_PROJECT",
    "Actor",
    "AlreadyAnswered",
    "Answered",
    "ApprovalDesk",
    "ApprovalRecord",
    "ApprovalRequest",
    "Arrival",
    "Attachments",
    "BeforeTurn",
    "Began",
    "BudgetRanOut",
    "Busy",
    "Choice",
    "Conversation",
    "ConversationEvent",
    "Conversations",
    "Decided",
    "Decision",
    "DecisionRecorded",
    "DecisionRefused",
    "DeliveryRecord",
    "Failed",
    "Forked",
    "Interrupted",
    "LockLost",
    "MemoryView",
    "Message",
    "OnConversationEvent",
    "OverBudget",
    "Payer",
    "PickingUp",
    "Place",
    "QuietRenderer",
    "Refreshed",
    "Renderer",
    "RewindPlan",
    "Rewound",
    "Said",
    "SessionInfo",
    "Stale",
    "StoredMessage",
    "Summary",
    "ThreadView",
    "Told",
    "ToolBegan",
    "ToolEnded",
    "TurnEnd",
    "TurnEvent",
    "TurnOutcome",
    "TurnRequest",
    "Unseen",
    "View",
    "Viewer",
    "argument_lines",
    "folded",
    "may_see",
    "message_text",
    "pages",
    "parse_checkpoint",
    "place",
    "refused_budget",
    "resets_text",
    "slack_message_id",
    "stored_trace_url",
    "visible",
]
