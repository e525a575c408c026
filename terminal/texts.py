"""Every sentence the terminal client prints, in one place so wording is reviewed together."""

from __future__ import annotations

from core.conversation import argument_lines

PROMPT = "> "
WAITING_PROMPT = "(waiting) > "

HELP = (
    "Type a message and Enter to send it. Commands: /history, /rewind N, /fork N, "
    "/compact [focus], /discard, /approve [reason], /deny [reason], /quit. Ctrl-C stops a "
    "reply; Ctrl-C or Ctrl-D here quits."
)


def opened(session_id: int, title: str | None, operator: str) -> str:
    name = f" ({title})" if title else ""
    return f"Session {session_id}{name}, as the local operator {operator}."


def new_session(operator: str) -> str:
    return (
        f"A new terminal session, as the local operator {operator}: "
        "it is created with your first message."
    )


def created(session_id: int) -> str:
    return f"This is session {session_id}; `slack-agent chat {session_id}` continues it."


def someone_elses(owner: str, operator: str) -> str:
    return (
        f"This session belongs to {owner}. You act on it as the local operator {operator}, "
        "who may act on any session."
    )


def permalink(link: str) -> str:
    return f"Its Slack thread: {link}"


EMPTY = "(no messages yet)"
CHECKPOINT_LABEL = "checkpoint"
EARLIER_HIDDEN = "(earlier messages are summarised in the checkpoint; /history lists them all)"
INTERRUPTED_MARK = "(interrupted)"


def busy() -> str:
    return (
        "This session is being used elsewhere: your message has not been added. "
        "I'll say when it is free; then Enter sends it, /discard drops it."
    )


FREE = "The session is free now: Enter sends your waiting message, /discard drops it."


def busy_gave_up(seconds: float) -> str:
    waited = f"{seconds / 60:.0f} minutes" if seconds >= 120 else f"{seconds:.0f} seconds"
    return (
        f"The session has been busy for over {waited}; I stopped checking. "
        "Enter tries to send your waiting message, /discard drops it."
    )


def stale(count: int, rewound: bool) -> str:
    what = "was rewound elsewhere" if rewound else "moved on elsewhere"
    shown = f"; above are the {count} message(s) you had not seen" if count else ""
    return (
        f"The session {what} since you last saw it{shown}. Your message was not sent: "
        "Enter sends it now, /discard drops it."
    )


def elsewhere(count: int) -> str:
    return f"── {count} new message(s) from elsewhere ──"


def rewound_elsewhere() -> str:
    return "── the session was rewound elsewhere; its latest messages: ──"


def already_waiting(draft: str) -> str:
    return (
        f"A message is already waiting ({shorten(draft)}): Enter sends it, /discard drops it. "
        "Your new line is back at the prompt."
    )


DISCARDED = "The waiting message was dropped."
NOTHING_WAITING = "No message is waiting."


def send_failed(reason: str) -> str:
    return f"Your message could not be sent ({reason}). Enter sends it again."


def value_refused(reason: str, *, sent: bool) -> str:
    """The database refused a value of what was typed (a NUL PostgreSQL cannot store): as
    typed, it would be refused again, so no "Enter sends it again"."""
    if sent:
        return (
            f"Not sent: the database refused something in it ({reason}). Nothing was "
            "changed; your line is back at the prompt to edit."
        )
    return (
        f"Not decided: the database refused something in the reason ({reason}). Nothing "
        "was changed; the call still waits: decide again without it."
    )


def turn_failed(reason: str) -> str:
    return f"The reply stopped early ({reason}); what it wrote is kept, marked interrupted."


def over_budget(limit: str, resets: str) -> str:
    return f"Not sent: {limit} is used up; it resets {resets}. Your message was not added."


def decision_over_budget(limit: str, resets: str) -> str:
    return (
        f"Not run: {limit} is used up (it resets {resets}). The approved call will not run by "
        "itself later; ask again when the budget allows."
    )


def budget_ran_out(limit: str, resets: str) -> str:
    return f"The reply stopped: {limit} ran out while it was written (it resets {resets})."


def trace_link(url: str) -> str:
    return f"Trace: {url}"


INTERRUPTED = (
    "Interrupted: the partial answer is kept, marked interrupted, and the session is free."
)
NOT_STARTED = "Interrupted before the message was added; it is back at the prompt."
LOCK_LOST = "This turn's lock was taken over after it went stale; the reply stopped."


def unknown_command(name: str) -> str:
    return f"Unknown command {name}. {HELP}"


def needs_position(command: str) -> str:
    return f"{command} needs a message position, as /history prints it (e.g. {command} 3)."


def no_position(position: int) -> str:
    return f"No message at position {position}; /history lists them."


def history_line(position: int, label: str, snapshot: bool, text: str) -> str:
    mark = "  [sandbox]" if snapshot else ""
    return f"{position:>4}  {label:<10} {text}{mark}"


HISTORY_LEGEND = "position, author, text; [sandbox] = the message carries a sandbox snapshot"


def rewound(deleted: int) -> str:
    return f"Rewound: {deleted} message(s) left the conversation."


def draft_back(draft: str) -> str:
    return f"The rewound message is back at the prompt: {shorten(draft)}"


def forked(session_id: int, copied: int, link: str | None) -> str:
    where = f" Its Slack thread: {link}" if link else " It has no Slack thread."
    return (
        f"Forked into session {session_id} ({copied} message(s) copied, with their sandbox state)."
        f"{where} Continue it with `slack-agent chat {session_id}`."
    )


def fork_draft(draft: str) -> str:
    return f"The message you forked at was not copied; its text: {shorten(draft, 200)}"


def compacted() -> str:
    return "Compacted into a checkpoint:"


def refused(reason: str) -> str:
    return f"Not done: {reason}"


BUSY_REFUSAL = "the session is being used elsewhere; try again when it is free"
ALREADY_COMPACT = "the conversation already ends with a checkpoint"
NO_SESSION_YET = "the session has no messages yet"


def unsent_at_exit(draft: str) -> str:
    return f"Your waiting message was not sent: {draft}"


def tool_output_cut() -> str:
    return "… (output shortened)"


def shorten(text: str, limit: int = 60) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else flat[: limit - 1] + "…"


# -- tool calls waiting for a decision -----------------------------------------------------------

APPROVAL_SETTLED = (
    "The waiting tool call was decided or moved on elsewhere; nothing to approve now."
)


def approval_waiting(tool: str, server: str, arguments: dict[str, object]) -> str:
    """The call waiting for a decision, whole: every argument on its own line, nothing cut,
    characters a terminal would hide or reorder shown as \\u escapes
    (``core.conversation.argument_lines``)."""
    lines = argument_lines(arguments) or ["(no arguments)"]
    shown = "\n".join("  " + line.replace("\n", "\n  ") for line in lines)
    return (
        f"The agent wants to use {tool} (MCP server {server}) with these arguments:\n{shown}\n"
        "It runs only once approved: /approve or /deny, either followed by a reason if you "
        "want the agent to know why."
    )


def reason_too_long(length: int, most: int) -> str:
    return (
        f"a decision's reason is at most {most} characters (this one has {length}); "
        "nothing was decided"
    )


def left_behind(tool: str, decided_by: str | None, approved: bool) -> str:
    who = (decided_by or "someone").removeprefix("cli:")
    verb = "approved" if approved else "denied"
    return (
        f"A decision on {tool} ({verb} by {who}) was never carried out: the process that made "
        "it stopped first. Carrying it out now."
    )


def approval_refused(reason: str) -> str:
    return {
        "unknown": "Nothing waits for a decision in this session.",
        "expired": "That request has expired: nobody decided in time, so nothing was run.",
        "superseded": "That request was superseded by a newer message, so nothing was run.",
        "moved_on": (
            "The conversation has moved on since that request (a newer message or a "
            "compaction), so it can no longer be decided and nothing was run."
        ),
        "rewound": "The conversation was rewound past that request, so nothing was run.",
        "decided": "That request was already decided elsewhere.",
        "not_allowed": "You may not decide that request.",
    }.get(reason, "That request can no longer be decided.")


def not_undone(calls: tuple[str, ...]) -> str:
    plural = "action" if len(calls) == 1 else "actions"
    return f"{len(calls)} {plural} outside the sandbox are not undone: " + "; ".join(calls) + "."
