"""Every text a Slack user reads, and the blocks that carry buttons, in one place.

Tone: short, plain, says what happened and what the reader can do next. Nothing else in ``bot``
writes user-facing words; listeners call these functions.

These texts are mrkdwn: whatever a person or the model wrote is quoted through ``_quote`` or
``escape`` (``bot.render``), so it shows as written and never becomes a mention or a link.
The exceptions go into a Markdown reply, which ``bot.reply`` neutralises: ``notice`` and the
turn's own notes (``resumed``, ``stopped``, ``turn_failed``…).
"""

from __future__ import annotations

from typing import Any

from bot.render import escape
from core.conversation import argument_lines, folded, pages

# Action ids of the buttons (the listeners match on them).
SEND_DRAFT = "draft_send"
DISCARD_DRAFT = "draft_discard"
COMPACT_PICK = "compact_pick"

THINKING = "_Thinking…_"


def busy_notice() -> str:
    return (
        ":hourglass_flowing_sand: This session is being used elsewhere (another reply is being "
        "written). Your message has not been added yet; I'll let you know when it's free."
    )


def busy_queued_notice() -> str:
    return (
        ":hourglass_flowing_sand: This session is being used elsewhere. Your message has not "
        "been added yet; it will be sent automatically, in order, when the session is free."
    )


def follow_up_notice() -> str:
    return (
        ":speech_balloon: Got it. I'm still answering the message before this one; "
        "I'll answer yours right after."
    )


def free_offer(text: str) -> str:
    return f"The session is free now. Send your waiting message?\n>{_quote(text)}"


def busy_timeout(text: str) -> str:
    return (
        "I stopped waiting: the session stayed busy too long, so your message was not sent. "
        f"Here it is, to post again:\n>{_quote(text)}"
    )


def draft_sending() -> str:
    return "Sending your message…"


def draft_discarded() -> str:
    return "Discarded; nothing was added to the conversation."


def draft_gone() -> str:
    return "That message was already sent or discarded."


def stale_refresh(unseen: list[tuple[str, str]], rewound: bool) -> str:
    head = (
        ":arrows_counterclockwise: This conversation was rewound elsewhere since this thread "
        "last showed it."
        if rewound
        else ":arrows_counterclockwise: This conversation continued elsewhere (for example in "
        "the terminal client) since this thread last showed it."
    )
    if not unseen:
        return head
    lines = [head, "Here is what this thread had not shown:"]
    for role, text in unseen:
        who = "*agent*" if role == "assistant" else "*user*"
        lines.append(f"{who}: {_quote(text, 500)}")
    return "\n".join(lines)


def stale_offer(text: str) -> str:
    return (
        "Your message was not sent because the conversation changed elsewhere; the thread now "
        f"shows what changed. Send it anyway?\n>{_quote(text)}"
    )


def turn_failed(code: str) -> str:
    return f":warning: The model could not finish this reply ({code}). What it wrote is kept."


def over_budget(limit: str, resets: str) -> str:
    """A message refused because its sender is over a spending limit (``BUDGETS``)."""
    return (
        f":no_entry: Not sent to the agent: {_quote(limit)} is used up. It resets {resets}; "
        "your message was not added to the conversation."
    )


def budget_ran_out(limit: str, resets: str) -> str:
    return (
        f":no_entry: This reply stopped: {_quote(limit)} ran out while it was written "
        f"(it resets {resets}). What it wrote is kept."
    )


def trace_link(url: str) -> str:
    """The finished reply's link to its trace (``TRACE_URL_TEMPLATE``), in the reply's
    Markdown (the reply is sent as ``markdown_text``)."""
    return f"[View trace]({url})"


def lock_lost() -> str:
    return ":warning: This reply was interrupted: the session was taken over elsewhere."


def stopped() -> str:
    return ":black_square_for_stop: Stopped. What I wrote so far is kept."


def shut_down() -> str:
    return (
        ":warning: This reply was interrupted because the app was restarting. What it wrote "
        "so far is kept; send your message again to continue."
    )


def resumed() -> str:
    return "Picking this back up: the reply to this message was interrupted by a restart."


def cut_short() -> str:
    return "_(cut short by a restart; picked back up below)_"


def will_retry() -> str:
    return ":warning: Something went wrong while answering; I'll pick this back up shortly."


def gave_up(text: str) -> str:
    return (
        ":warning: I couldn't answer this message after several tries, so I stopped. "
        f"Here it is, to post again:\n>{_quote(text)}"
    )


def internal_error() -> str:
    return ":warning: Something went wrong on my side and I could not answer that. Try again?"


def no_session() -> str:
    return (
        "That message isn't part of an agent conversation. Use this on a message in a thread "
        "I'm taking part in."
    )


def not_in_transcript() -> str:
    return (
        "That message isn't part of the conversation itself (it's a notice). Pick one of the "
        "questions or replies in the thread."
    )


def forbidden(action: str) -> str:
    return (
        f"Only the person who started this conversation (or an admin) can {action} it. "
        "Nothing was changed. You can fork it instead."
    )


def busy_action(action: str) -> str:
    return (
        f"This session is being used elsewhere right now, so I can't {action} it. "
        "Try again when the reply is done."
    )


def rewound(deleted: int, by_user: str, to: str) -> str:
    """Posted at the thread's end, so it links to the message rewound to: "to here" read as
    the notice itself, below the messages that had just left."""
    return (
        f":rewind: <@{by_user}> rewound the conversation to <{to}|this message>; {deleted} "
        f"later message{'s' if deleted != 1 else ''} left the conversation, which goes on "
        "from here."
    )


REWOUND_SHOWN = 3_000  # characters of a rewound reply still shown under its marker


def rewound_reply(original: str) -> str:
    shown = original if len(original) <= REWOUND_SHOWN else original[:REWOUND_SHOWN] + "…"
    return f"~(rewound: no longer part of the conversation)~\n{escape(shown)}"


def returned_draft(text: str) -> str:
    return (
        "Your message was taken out of the conversation. Here it is, to edit and post again:"
        f"\n>{_quote(text)}"
    )


def forked_from(permalink: str, by_user: str) -> str:
    return (
        f":fork_and_knife: Forked from {permalink} by <@{by_user}>. "
        "Continue the new conversation in this thread."
    )


def fork_copied(copied: int) -> str:
    plural = "s" if copied != 1 else ""
    return f"This thread starts with the {copied} message{plural} of the original, up to the fork."


def fork_done(permalink: str) -> str:
    return f"Forked. The new conversation is here: {permalink}"


def compacted(sections: list[tuple[str, list[str]]]) -> str:
    """A checkpoint as a person reads it: a heading per section that has something, its items
    as bullets (never the XML the model reads)."""
    lines = [":compression: The conversation was compacted into a checkpoint:"]
    for name, items in sections:
        if items:
            lines.append(f"*{name.replace('_', ' ').capitalize()}*")
            lines.extend(f"• {_quote(item, 1000)}" for item in items)
    if len(lines) == 1:
        lines.append("_(nothing to keep)_")
    return "\n".join(lines)


def compacted_text(body: str) -> str:
    """A checkpoint that could not be read as sections: its text, as written."""
    return f":compression: The conversation was compacted into a checkpoint:\n{escape(body)}"


def already_compact() -> str:
    return "This conversation already ends in a checkpoint; there is nothing new to compact."


def compact_picker_empty() -> str:
    return (
        "You have no conversations in this channel to compact. Give a thread link: "
        "`/compact <thread link> [focus]`."
    )


def compact_picker() -> str:
    return "Which conversation should I compact?"


def compact_started(by_user: str) -> str:
    return f":hourglass_flowing_sand: <@{by_user}> started compacting this conversation…"


def compact_nothing_of_yours() -> str:
    return (
        "I found no conversation of yours to compact at that link. Use a link to a thread "
        "you started with me (or the picker: /compact without a link)."
    )


def compact_failed(code: str) -> str:
    return (
        f":warning: I couldn't compact this conversation ({code}); nothing was changed. "
        "Try again in a moment."
    )


def compact_bad_link() -> str:
    return (
        "I couldn't read that thread link. Copy it with *Copy link* on the thread's first message."
    )


def notice(text: str) -> str:
    return f"_{text}_"


def tool_started(command: str) -> str:
    return f"\n`$ {_quote(command, 200)}`\n"


def permalink(team_domain: str | None, channel: str, ts: str) -> str:
    host = f"{team_domain}.slack.com" if team_domain else "slack.com"
    return f"https://{host}/archives/{channel}/p{ts.replace('.', '')}"


def offer_blocks(text: str, draft_id: str, send_label: str = "Send") -> list[dict[str, Any]]:
    return [
        {"type": "section", "text": {"type": "mrkdwn", "text": text}},
        {
            "type": "actions",
            "elements": [
                _button(send_label, SEND_DRAFT, draft_id, style="primary"),
                _button("Discard", DISCARD_DRAFT, draft_id),
            ],
        },
    ]


FEEDBACK = "answer_feedback"
PICKER_CHOICES = 5


def feedback_blocks(message_id: str) -> list[dict[str, Any]]:
    """Slack's feedback buttons under a finished answer; the value names the answer voted on."""
    return [
        {
            "type": "context_actions",
            "elements": [
                {
                    "type": "feedback_buttons",
                    "action_id": FEEDBACK,
                    "positive_button": {
                        "text": {"type": "plain_text", "text": "👍"},
                        "value": f"good:{message_id}",
                        "accessibility_label": "This answer was helpful",
                    },
                    "negative_button": {
                        "text": {"type": "plain_text", "text": "👎"},
                        "value": f"bad:{message_id}",
                        "accessibility_label": "This answer was not helpful",
                    },
                }
            ],
        }
    ]


def vote_noted(verdict: str) -> str:
    return (
        "Thanks, noted: this answer helped."
        if verdict == "good"
        else "Thanks, noted: this answer missed. Say what was wrong and I'll try again."
    )


def vote_gone() -> str:
    return (
        "That answer is no longer part of the conversation (it was rewound), "
        "so the vote was not kept."
    )


REWIND_CONFIRM = "rewind_confirm"


def picker_blocks(choices: list[tuple[int, str]], key: str) -> list[dict[str, Any]]:
    """The ``/compact`` picker; its choices and focus are stashed under ``key`` (the buttons
    carry only that key and a session id: Slack caps a button's value)."""
    buttons = [
        _button(title[:70] or f"session {sid}", f"{COMPACT_PICK}:{i}", f"{key}:{sid}")
        for i, (sid, title) in enumerate(choices)
    ]
    return [
        {"type": "section", "text": {"type": "mrkdwn", "text": compact_picker()}},
        {"type": "actions", "elements": buttons},
    ]


def compact_picked(title: str) -> str:
    return f"Compacting *{_quote(title or 'the conversation', 80)}*…"


def rewind_modal(
    leaving: int, key: str, *, to_a_question: bool, outside: tuple[str, ...] = ()
) -> dict[str, Any]:
    """The confirmation *Rewind to here* asks for before anything changes."""
    plural = "message" if leaving == 1 else "messages"
    body = (
        f"{leaving} {plural} will leave the conversation (the agent forgets them, and its "
        "sandbox goes back to how it was)."
        if leaving
        else "Nothing comes after this message: the conversation stays as it is."
    )
    if to_a_question:
        body += " The message you picked comes back to its author as a draft, to post again."
    if outside:
        body += "\n" + not_undone(outside)
    return {
        "type": "modal",
        "callback_id": REWIND_CONFIRM,
        "private_metadata": key,
        "title": {"type": "plain_text", "text": "Rewind to here?"},
        "submit": {"type": "plain_text", "text": "Rewind"},
        "close": {"type": "plain_text", "text": "Cancel"},
        "blocks": [{"type": "section", "text": {"type": "mrkdwn", "text": body}}],
    }


def _button(label: str, action_id: str, value: str, style: str | None = None) -> dict[str, Any]:
    button: dict[str, Any] = {
        "type": "button",
        "text": {"type": "plain_text", "text": label},
        "action_id": action_id,
        "value": value,
    }
    if style:
        button["style"] = style
    return button


def _quote(text: str, limit: int = 300) -> str:
    """Someone else's words on one line, shortened to ``limit``, escaped for mrkdwn."""
    folded = " ".join(text.split())
    return escape(folded if len(folded) <= limit else folded[: limit - 1] + "…")


def file_refused(name: str, reason: str, limit: int) -> str:
    why = {
        "too_big": f"it is larger than the {limit / 1_000_000:g} MB this app copies",
        "no_access": "Slack would not hand it over (the app needs the files:read permission)",
        "not_slack": "it is not stored on Slack's file servers",
    }.get(reason, "Slack could not deliver it just now")
    return f"I couldn't copy *{_quote(name, 100)}* into my sandbox: {why}."


def not_undone(calls: tuple[str, ...]) -> str:
    """Calls of a rewind's leaving messages that reached the team's systems."""
    plural = "action" if len(calls) == 1 else "actions"
    shown = "; ".join(_quote(c, 150) for c in calls[:5])
    more = f" (and {len(calls) - 5} more)" if len(calls) > 5 else ""
    return f"{len(calls)} {plural} outside the sandbox are not undone: {shown}{more}."


# -- tool calls waiting for a person's approval -------------------------------------------------

APPROVE = "approval_approve"
DENY = "approval_deny"
SHOW_CALL = "approval_show"  # *Show all*: the whole call in a modal
CALL_PAGE = "approval_page"  # the modal's Previous / Next (value ``<id>:<page>``)
# Slack's limits (Block Kit): a section's text holds 3,000 characters, a message 50 blocks, a
# modal 100. A card shows each argument folded to ``CARD_LINE`` characters and as many as fit
# in one section; the modal shows every character, ``MODAL_SECTIONS`` sections a page.
SECTION_LIMIT = 3000
CARD_LINE = 300
MODAL_SECTIONS = 40
_FENCE = "```"


def _slack_length(text: str) -> int:
    """How many characters ``text`` takes in mrkdwn (``&``, ``<``, ``>`` become entities)."""
    return len(escape(text))


def _code(text: str) -> str:
    return f"{_FENCE}{escape(text)}{_FENCE}"


def _call_lines(arguments: dict[str, Any]) -> list[str]:
    """Every argument, escaped so nothing hides (``core.conversation.visible``); a backtick too,
    so nothing closes the code block."""
    return argument_lines(arguments, also="`") or ["(no arguments)"]


def card_arguments(arguments: dict[str, Any]) -> tuple[str, bool]:
    """The arguments as a card shows them (one code block) and whether anything is not on the
    card (a value folded, or arguments past what one block holds): then *Show all* shows them."""
    room = SECTION_LIMIT - 2 * len(_FENCE) - 200  # the last line's fold and "more" note
    shown: list[str] = []
    used = 0
    lines = _call_lines(arguments)
    complete = True
    for index, line in enumerate(lines):
        fold = folded(line, CARD_LINE)
        complete = complete and fold == line
        cost = _slack_length(fold) + 1
        if used + cost > room:
            left = len(lines) - index
            shown.append(f"… and {left} more argument{'s' if left > 1 else ''} (Show all)")
            return _code("\n".join(shown)), True
        shown.append(fold)
        used += cost
    return _code("\n".join(shown)), not complete


def approval_request(tool: str, server: str) -> str:
    return (
        f"The agent wants to use *{_quote(tool, 100)}* (MCP server *{_quote(server, 64)}*), "
        "which may change something outside this conversation. Its arguments:"
    )


APPROVAL_WHO = (
    "It runs only if the conversation's owner, an admin or one of the server's approvers "
    "approves. Characters that print as nothing are shown as \\u escapes."
)
APPROVAL_FOLDED = "Some arguments are folded here: *Show all* shows every character of the call."


def approval_text(tool: str, server: str) -> str:
    """The card's notification text (its blocks show the arguments)."""
    return f"The agent asks to use {_quote(tool, 100)} (MCP server {_quote(server, 64)})."


def _call_blocks(
    approval_id: str, tool: str, server: str, arguments: dict[str, Any]
) -> tuple[list[dict[str, Any]], bool]:
    body, folded_ = card_arguments(arguments)
    notes = f"{APPROVAL_WHO}\n{APPROVAL_FOLDED}" if folded_ else APPROVAL_WHO
    blocks: list[dict[str, Any]] = [
        {"type": "section", "text": {"type": "mrkdwn", "text": approval_request(tool, server)}},
        {"type": "section", "text": {"type": "mrkdwn", "text": body}},
        {"type": "context", "elements": [{"type": "mrkdwn", "text": notes}]},
    ]
    return blocks, folded_


def approval_blocks(
    approval_id: str, tool: str, server: str, arguments: dict[str, Any]
) -> list[dict[str, Any]]:
    """The card: what would run, and Approve / Deny (the buttons carry only the request's id),
    and *Show all* when the card folds anything."""
    blocks, folded_ = _call_blocks(approval_id, tool, server, arguments)
    buttons = [
        _button("Approve", APPROVE, approval_id, style="primary"),
        _button("Deny", DENY, approval_id, style="danger"),
    ]
    if folded_:
        buttons.append(_button("Show all", SHOW_CALL, approval_id))
    return [*blocks, {"type": "actions", "elements": buttons}]


def call_pages(arguments: dict[str, Any]) -> list[list[str]]:
    """The whole call for the modal: pages of at most ``MODAL_SECTIONS`` code blocks, each
    within a section's limit; every character of every argument is on one of them."""
    size = SECTION_LIMIT - 2 * len(_FENCE)
    blocks = pages(_call_lines(arguments), size, measure=_slack_length)
    return [blocks[i : i + MODAL_SECTIONS] for i in range(0, len(blocks), MODAL_SECTIONS)]


def call_modal(
    approval_id: str, tool: str, server: str, arguments: dict[str, Any], page: int = 0
) -> dict[str, Any]:
    """*Show all*: every argument of the call (one page of it, with Previous / Next)."""
    found = call_pages(arguments)
    page = max(0, min(page, len(found) - 1))
    where = f" (page {page + 1} of {len(found)})" if len(found) > 1 else ""
    head = (
        f"*{_quote(tool, 100)}* on MCP server *{_quote(server, 64)}*: every argument{where}, "
        "exactly the call that runs if approved. Characters that print as nothing are shown "
        "as \\u escapes."
    )
    blocks: list[dict[str, Any]] = [{"type": "section", "text": {"type": "mrkdwn", "text": head}}]
    blocks += [
        {"type": "section", "text": {"type": "mrkdwn", "text": _code(piece)}}
        for piece in found[page]
    ]
    turns = []
    if page > 0:
        turns.append(_button("Previous page", CALL_PAGE, f"{approval_id}:{page - 1}"))
    if page + 1 < len(found):
        turns.append(_button("Next page", CALL_PAGE, f"{approval_id}:{page + 1}"))
    if turns:
        blocks.append({"type": "actions", "elements": turns})
    return {
        "type": "modal",
        "title": {"type": "plain_text", "text": "The whole call"},
        "close": {"type": "plain_text", "text": "Close"},
        "blocks": blocks,
    }


def _who(external_id: str | None) -> str:
    """A decider as the card names them: a Slack user as a mention, anyone else by name."""
    if external_id and external_id.startswith("slack:"):
        return f"<@{external_id.rsplit(':', 1)[-1]}>"
    return (
        _quote(external_id.removeprefix("cli:") if external_id else "someone", 60) + " (terminal)"
    )


def approval_outcome(
    state: str, decided_by: str | None, reason: str | None = None, said: str | None = None
) -> str:
    """What the card says once the request left ``pending`` (in place of its buttons): every
    end state with its reason (``core.storage.approvals``), and what the decider said with the
    decision (``said``, given on the web) quoted after it, so the thread sees why too."""
    shown = _outcome(state, decided_by, reason)
    if said and decided_by is not None:
        return f"{shown} Their reason: “{_quote(said, 500)}”"
    return shown


def _outcome(state: str, decided_by: str | None, reason: str | None) -> str:
    who = _who(decided_by)
    ended = {
        ("ran", "may_have_run"): (
            f"⚠️ Approved by {who}; the call was sent, but its result was never recorded: it "
            "may have run."
        ),
        ("refused", "over_budget"): (
            f"💸 Approved by {who}, but not run: a usage budget was used up when it was to run. "
            "Ask again when the budget allows."
        ),
        ("expired", "decision_expired"): (
            f"⌛ Approved by {who}, but not carried out in time, so the call did not run."
        ),
        ("superseded", "moved_on"): (
            "↪️ The conversation moved on before this request was carried out, so the call did "
            "not run."
        ),
        ("superseded", "compacted"): (
            "↪️ The conversation was compacted before this request was carried out, so the "
            "call did not run."
        ),
    }.get((state, reason or ""))
    if ended is not None:
        return ended
    if state == "superseded" and decided_by is not None:
        return f"↪️ Approved by {who}, but a newer message came first, so the call did not run."
    return {
        "approved": f"✅ Approved by {who}; running the call…",
        "running": f"✅ Approved by {who}; running the call…",
        "ran": f"✅ Approved by {who}; the call ran.",
        "denied": f"🚫 Denied by {who}; the call did not run.",
        "declined": f"🚫 Denied by {who}; the call did not run.",
        "expired": "⌛ Expired: nobody decided in time, so the call did not run.",
        "superseded": "↪️ Superseded: a newer message came first, so the call did not run.",
        "rewound": "⏪ The conversation was rewound past this request; the call did not run.",
        "refused": f"Approved by {who}, but the call could not be run.",
    }.get(state, "This request is no longer waiting.")


def approval_outcome_blocks(
    approval_id: str,
    state: str,
    decided_by: str | None,
    tool: str,
    server: str,
    arguments: dict[str, Any],
    reason: str | None = None,
    said: str | None = None,
) -> list[dict[str, Any]]:
    """The card once its request left ``pending``: the call as before (*Show all* kept when
    anything is folded) and what became of it (``said``: the decider's reason)."""
    blocks, folded_ = _call_blocks(approval_id, tool, server, arguments)
    outcome = approval_outcome(state, decided_by, reason, said)
    blocks.append({"type": "context", "elements": [{"type": "mrkdwn", "text": outcome}]})
    if folded_:
        show = _button("Show all", SHOW_CALL, approval_id)
        blocks.append({"type": "actions", "elements": [show]})
    return blocks


def approval_not_recorded() -> str:
    return "I couldn't record that decision just now, so nothing was run yet. Please click again."


def approval_refused(reason: str, decided_by: str | None = None) -> str:
    """One line to a person whose click changed nothing."""
    return {
        "unknown": "That request is not one I know, so nothing was run.",
        "not_allowed": (
            "Only the person who started this conversation, an admin or one of this tool's "
            "approvers can decide this request."
        ),
        "expired": "That request has expired: nobody decided in time, so nothing was run.",
        "superseded": "That request was superseded by a newer message, so nothing was run.",
        "moved_on": (
            "The conversation has moved on since that request (a newer message or a "
            "compaction), so it can no longer be decided and nothing was run."
        ),
        "rewound": "The conversation was rewound past that request, so nothing was run.",
        "decided": f"That request was already decided by {_who(decided_by)}.",
    }.get(reason, "That request can no longer be decided.")
