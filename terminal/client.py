"""The conversation loop of ``slack-agent chat``: read a line, send it or run a command, print.

States. *Idle*: at the prompt, a watcher checks the session every ``SESSION_POLL_SECONDS``
and prints what other surfaces added, above the line being typed. *Waiting*: a message was
refused (busy, stale, or a failure before it was added); it is kept as the waiting draft, an
empty Enter sends it and ``/discard`` drops it. After a busy refusal the watcher checks every
``BUSY_POLL_SECONDS`` and says when the session is free (giving up after
``BUSY_POLL_TIMEOUT_SECONDS``). *Replying*: the answer streams; Ctrl-C cancels the turn's
task, and the core keeps the partial answer (marked interrupted, with its sandbox state) and
releases the lock before the task ends.

A typed line is never lost: a refused or failed send keeps it as the draft, and a line that
cannot be taken now (an unknown command, a second message while one waits) goes back into the
editor.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from rich.console import Console

from core.conversation import (
    DECISION_REASON_MOST,
    Answered,
    ApprovalRecord,
    Began,
    BudgetRanOut,
    Busy,
    DecisionRefused,
    Failed,
    Interrupted,
    LockLost,
    OverBudget,
    QuietRenderer,
    Said,
    Stale,
    Told,
    ToolBegan,
    ToolEnded,
    TurnEnd,
    TurnEvent,
    Unseen,
    message_text,
    refused_budget,
    resets_text,
)
from core.errors import (
    AgentSessionAlreadyCompact,
    AgentSessionBusy,
    DatabaseValueRefused,
    MessageNotFound,
    SlackAgentError,
)
from terminal import texts as say
from terminal.chat import ChatSession
from terminal.lines import LineSource, on_sigint
from terminal.render import LiveReply, author, message_view

log = logging.getLogger(__name__)

INTERRUPT = "interrupted_from_terminal"  # the cancellation message of a Ctrl-C
T = TypeVar("T")


class CommandRefused(Exception):
    """A command could not be done; the message says why, for the person."""


def _decision_reason(rest: str) -> str | None:
    """What follows ``/approve`` or ``/deny``: None when nothing; refused (nothing decided)
    when longer than a decision's reason may be (``DECISION_REASON_MOST``)."""
    if len(rest) > DECISION_REASON_MOST:
        raise CommandRefused(say.reason_too_long(len(rest), DECISION_REASON_MOST))
    return rest or None


class Terminal:
    def __init__(self, chat: ChatSession, lines: LineSource, console: Console) -> None:
        self.chat = chat
        self.lines = lines
        self.console = console
        settings = chat.settings
        self.session_poll = settings.session_poll_seconds
        self.busy_poll = settings.busy_poll_seconds
        self.busy_timeout = settings.busy_poll_timeout_seconds
        self.draft: str | None = None  # the waiting message
        self.busy_since: float | None = None  # when a busy refusal started the waiting
        self.prefill = ""  # a line given back to the editor
        self.asking: str | None = None  # the waiting call this terminal printed (its id)

    # -- printing -------------------------------------------------------------------------------

    def say(self, body: str, style: str = "italic yellow") -> None:
        self.console.print(body, style=style, markup=False, highlight=False)

    def show(self, messages: list[Any]) -> None:
        for message in messages:
            self.console.print(message_view(message, self.chat.operator))

    def show_unseen(self, unseen: Unseen) -> None:
        if not unseen.messages:
            return
        header = say.rewound_elsewhere() if unseen.rewound else say.elsewhere(len(unseen.messages))
        self.say(header, style="dim")
        self.show(unseen.messages)

    # -- the loop -------------------------------------------------------------------------------

    async def run(self) -> int:
        await self._opening()
        while True:
            watcher = asyncio.create_task(self._watch())
            try:
                line = await self.lines.read(
                    say.WAITING_PROMPT if self.draft else say.PROMPT, self.prefill
                )
            except (EOFError, KeyboardInterrupt):
                break
            finally:
                watcher.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await watcher
            self.prefill = ""
            if not await self._handle(line):
                break
        if self.draft:
            self.say(say.unsent_at_exit(self.draft))
        return 0

    async def _opening(self) -> None:
        chat = self.chat
        if chat.session is None:
            self.say(say.new_session(chat.operator), style="bold")
        else:
            self.say(say.opened(chat.session.id, chat.session.title, chat.operator), style="bold")
            owner = await chat.owner()
            if owner is not None:
                self.say(say.someone_elses(owner, chat.operator))
            link = await chat.permalink()
            if link:
                self.say(say.permalink(link), style="dim")
            history = await chat.projected()
            if history and history[0].position > 0:
                self.say(say.EARLIER_HIDDEN, style="dim")
            self.show(history)
            if not history:
                self.say(say.EMPTY, style="dim")
            await self._show_approval()
            left = await chat.left_behind()
            if left is not None:
                self.say(say.left_behind(left.tool_name, left.decided_by, left.approved))
                await self._send("", left=left)
        self.say(say.HELP, style="dim")

    async def _show_approval(self) -> None:
        """A call waiting for a decision is printed once; when it is decided anywhere (here,
        in Slack), the terminal says so and stops asking."""
        waiting = await self.chat.pending_approval()
        if waiting is not None and waiting.id != self.asking:
            self.say(say.approval_waiting(waiting.tool_name, waiting.server, waiting.arguments))
        elif waiting is None and self.asking is not None:
            self.say(say.APPROVAL_SETTLED, style="dim")
        self.asking = None if waiting is None else waiting.id

    async def _watch(self) -> None:
        """While the prompt waits: others' additions, whether a busy session freed, and the
        call waiting for a decision."""
        while True:
            waiting = self.busy_since is not None
            await asyncio.sleep(self.busy_poll if waiting else self.session_poll)
            try:
                busy = await self.chat.is_busy() if waiting else True
                self.show_unseen(await self.chat.unseen())
                await self._show_approval()
            except SlackAgentError as exc:  # a database blip: the next tick tries again
                log.debug("could not check the session: %s", exc)
                continue
            if self.busy_since is None:
                continue
            if not busy:
                self.busy_since = None
                self.say(say.FREE, style="bold green")
            elif time.monotonic() - self.busy_since > self.busy_timeout:
                self.busy_since = None
                self.say(say.busy_gave_up(self.busy_timeout))

    async def _handle(self, line: str) -> bool:
        """Act on one line; False ends the client."""
        stripped = line.strip()
        if stripped.startswith("/"):
            return await self._command(line)
        if not stripped:
            if self.draft:
                await self._send(self.draft)
            return True
        if self.draft and stripped != self.draft.strip():  # retyping the waiting one sends it
            self.say(say.already_waiting(self.draft))
            self.prefill = line
            return True
        await self._send(stripped)
        return True

    # -- sending --------------------------------------------------------------------------------

    async def _interruptible(self, work: Awaitable[T]) -> asyncio.Task[T]:
        """Run ``work`` as a task that Ctrl-C cancels; the task is done when this returns."""
        task = asyncio.ensure_future(work)

        def interrupt() -> None:
            if not task.cancelling():  # a second Ctrl-C must not cut the first one's cleanup
                task.cancel(INTERRUPT)

        with on_sigint(interrupt):
            await asyncio.wait({task})
        return task

    async def _send(
        self,
        body: str,
        *,
        decide: bool | None = None,
        reason: str | None = None,
        left: ApprovalRecord | None = None,
    ) -> None:
        """Send ``body`` as a turn; or, with ``decide``, approve (True) or deny the waiting
        call (saying ``reason``) and carry the decision out as a turn; or carry out a decision
        ``left`` behind. Each is one call of the conversation door, shown through ``_Lines``."""
        lines = _Lines(LiveReply(self.console))
        self.busy_since = None
        work: Awaitable[TurnEnd | DecisionRefused]
        if left is not None:
            work = self.chat.carry_out(left, lines)
        elif decide is None:
            self.draft = body  # until the core has it, the message is the person's only copy
            work = self.chat.send(body, lines)
        else:
            work = self.chat.decide(self.asking, decide, lines, reason=reason)
        task = await self._interruptible(work)
        lines.reply.stop()
        if task.cancelled():
            if lines.started:
                self.draft = None
                await self.chat.after_interruption()
                self.say(say.INTERRUPTED)
            else:
                self.say(say.NOT_STARTED)
            return
        exc = task.exception()
        if exc is not None:
            if lines.started:
                # The message is in the transcript; only its answer was cut short.
                self.draft = None
                await self.chat.after_interruption()
                self.say(say.turn_failed(_reason(exc)))
            elif isinstance(exc, DatabaseValueRefused):
                # Sent again as it is, it would be refused again: back to the prompt instead.
                if self.draft is not None and decide is None and left is None:
                    self.draft = None
                    self.prefill = body
                self.say(say.value_refused(_reason(exc), sent=decide is None))
            else:
                self.say(say.send_failed(_reason(exc)))
            return
        await self._ended(task.result(), decide is None and left is None)

    async def _ended(self, end: TurnEnd | DecisionRefused, sent: bool) -> None:
        """Say how a turn (or a decision) ended: one branch per way it can end."""
        if isinstance(end, DecisionRefused):
            self.say(say.approval_refused(end.reason))
        elif isinstance(end, Busy):
            self.busy_since = time.monotonic()
            self.say(say.busy())
        elif isinstance(end, Stale):
            self.show(end.unseen.messages)
            self.say(say.stale(len(end.unseen.messages), end.unseen.rewound))
        elif isinstance(end, OverBudget):
            refusal = end.refusal
            limit, resets = refused_budget(refusal).describe(), resets_text(refusal)
            if sent:
                self.say(say.over_budget(limit, resets))
            else:  # a decision: it ended, and never runs by itself later
                self.asking = None
                self.say(say.decision_over_budget(limit, resets))
        elif isinstance(end, LockLost | Interrupted):
            # The message is in the transcript; only its answer was cut short.
            self.draft = None
            await self.chat.after_interruption()
            self.say(say.LOCK_LOST if isinstance(end, LockLost) else say.INTERRUPTED)
        elif isinstance(end, Answered | Failed | BudgetRanOut):
            if sent:
                self.draft = None
            else:  # a decision made (or carried out) here: not news from elsewhere
                self.asking = None
            if isinstance(end, BudgetRanOut):
                limit = refused_budget(end.refusal).describe()
                self.say(say.budget_ran_out(limit, resets_text(end.refusal)))
            elif isinstance(end, Failed):
                self.say(say.turn_failed(end.code))
            if end.result.trace_url is not None:
                self.say(say.trace_link(end.result.trace_url))
            await self._show_approval()

    # -- commands -------------------------------------------------------------------------------

    async def _command(self, line: str) -> bool:
        name, _, rest = line.strip().partition(" ")
        rest = rest.strip()
        handlers: dict[str, Callable[[str], Awaitable[None]]] = {
            "/history": self._history,
            "/rewind": self._rewind,
            "/fork": self._fork,
            "/compact": self._compact,
            "/discard": self._discard,
            "/approve": self._approve,
            "/deny": self._deny,
        }
        if name == "/quit":
            return False
        handler = handlers.get(name)
        if handler is None:
            self.say(say.unknown_command(name))
            self.prefill = line
            return True
        try:
            await handler(rest)
        except CommandRefused as refusal:
            self.say(say.refused(str(refusal)))
        except AgentSessionBusy:
            self.say(say.refused(say.BUSY_REFUSAL))
        except MessageNotFound as exc:
            self.say(say.refused(str(exc)))
        except SlackAgentError as exc:
            self.say(say.refused(_reason(exc)))
        return True

    async def _approve(self, rest: str) -> None:
        """``/approve [reason]``: the rest of the line is what the person says with it."""
        await self._send("", decide=True, reason=_decision_reason(rest))

    async def _deny(self, rest: str) -> None:
        """``/deny [reason]``: the model is told the reason with the refusal, and the Slack
        card and the web page show it, as for a decision made there."""
        await self._send("", decide=False, reason=_decision_reason(rest))

    async def _discard(self, _rest: str) -> None:
        if self.draft is None:
            self.say(say.NOTHING_WAITING)
            return
        self.draft = None
        self.busy_since = None
        self.say(say.DISCARDED)

    async def _history(self, _rest: str) -> None:
        messages, with_snapshot = await self.chat.listing()
        if not messages:
            self.say(say.EMPTY, style="dim")
            return
        self.say(say.HISTORY_LEGEND, style="dim")
        for m in messages:
            words = message_text(m.message) or _tools_summary(m.message)
            if m.is_compaction_message:
                words = "(the conversation before this point, summarised)"
            if (m.message.get("metadata") or {}).get("interrupted"):
                words += f" {say.INTERRUPTED_MARK}"
            line = say.history_line(
                m.position,
                author(m, self.chat.operator),
                m.message_id in with_snapshot,
                say.shorten(words, 70),
            )
            self.console.print(line, markup=False, highlight=False)
        self.show_unseen(await self.chat.unseen())

    async def _rewind(self, rest: str) -> None:
        position = _position("/rewind", rest)
        self.show_unseen(await self.chat.unseen())
        result, outside = await self.chat.rewind(position)
        self.say(say.rewound(result.deleted))
        if outside:
            self.say(say.not_undone(outside))
        if result.draft:
            self.say(say.draft_back(result.draft))
            if self.draft is None:
                self.prefill = result.draft
            else:
                self.console.print(result.draft, markup=False)

    async def _fork(self, rest: str) -> None:
        position = _position("/fork", rest)
        result = await self.chat.fork(position)
        link = await self.chat.permalink(result.conversation.id)
        self.say(say.forked(result.conversation.id, result.copied, link), style="bold")
        if result.draft:
            self.say(say.fork_draft(result.draft))

    async def _compact(self, rest: str) -> None:
        if self.chat.session is None:
            raise CommandRefused(say.NO_SESSION_YET)
        task = await self._interruptible(self.chat.compact(rest or None))
        if task.cancelled():
            self.say(say.refused("interrupted"))
            return
        exc = task.exception()
        if isinstance(exc, AgentSessionAlreadyCompact):
            raise CommandRefused(say.ALREADY_COMPACT)
        if exc is not None:
            raise exc
        unseen = await self.chat.unseen()
        earlier = [m for m in unseen.messages if not m.is_compaction_message]
        self.show(earlier)
        self.say(say.compacted(), style="bold")
        self.show([m for m in unseen.messages if m.is_compaction_message])


class _Lines(QuietRenderer):
    """The terminal's renderer: the answer streams as lines, tools as their commands."""

    def __init__(self, reply: LiveReply) -> None:
        self.reply = reply
        self.started = False

    async def event(self, event: TurnEvent) -> None:
        if isinstance(event, Began):
            self.started = True
            self.reply.start()
        elif isinstance(event, Said):
            self.reply.text(event.text)
        elif isinstance(event, ToolBegan):
            self.reply.tool_started(event.label, shell=event.kind == "shell")
        elif isinstance(event, ToolEnded):
            self.reply.tool_finished(
                {"stdout": event.output, "stderr": event.error, "exit_code": event.exit_code}
                if event.kind == "shell"
                else {"stdout": event.output, "stderr": "", "exit_code": event.exit_code}
            )
        elif isinstance(event, Told):
            self.reply.notice(event.text)


def _position(command: str, rest: str) -> int:
    if not rest.isdigit():
        raise CommandRefused(say.needs_position(command))
    return int(rest)


def _reason(exc: BaseException) -> str:
    code = getattr(exc, "code", None) or exc.__class__.__name__
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{code}: {first}" if first else str(code)


def _tools_summary(message: dict[str, Any]) -> str:
    commands = [
        str((p.get("input") or {}).get("command", ""))
        for p in message.get("parts") or []
        if isinstance(p, dict) and str(p.get("type", "")).startswith("tool-")
    ]
    return "; ".join(f"$ {c}" for c in commands if c)
