"""Slack threads as agent sessions: one try at answering a received message.

``bot.worker`` decides *when* a received message is tried (its thread's line, a busy session,
a take-over after a replica died); this module makes one try: find or create the thread's
session, run the turn through the core, stream the reply, and say what came of it
(``Outcome``). Busy and stale refusals come from the core before any model call. Everything
that touches a session is a core call (``SessionStore``, ``Agent``, ``SurfaceState``).

Keys: a thread is ``{team}/{channel}/{thread_ts}`` (the session's ``project_session_id``), a
Slack message ``{team}/{channel}/{ts}``; a user message's id is ``slack_message_id(team,
channel, ts)``, so a retried delivery can never be stored twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any, Protocol

from slack_sdk.errors import SlackApiError
from slack_sdk.web.async_client import AsyncWebClient

from bot import context, render
from bot import texts as text
from bot.context import Prepared
from bot.files import SharedFile
from bot.reply import SLACK_FAILURES, ReplyStream, StreamPacer
from core.agent.loop import (
    Agent,
    AgentEvent,
    ModelCalled,
    ModelDone,
    Notice,
    TextChunk,
    ToolFinished,
    ToolStarted,
    TurnStarted,
)
from core.errors import (
    AgentSessionBusy,
    AgentSessionLockLost,
    AgentSessionStale,
    DuplicateMessage,
    InvalidRequest,
    TurnInterrupted,
)
from core.messages import message_text, user_message
from core.records import Actor, SessionInfo, StoredMessage
from core.settings import Settings
from core.storage.deliveries import DeliveryRecord
from core.storage.feedback import record_vote
from core.storage.sessions import SessionStore
from core.storage.surface_state import SurfaceState

log = logging.getLogger(__name__)

SURFACE = "slack"
PROJECT = "slack"
SHUTDOWN = "shutdown"  # the cancellation message of a turn stopped by a shutdown
REFRESH_LAST = 10  # a stale refresh quotes at most this many of the messages the thread missed
UNKNOWN_STREAMS = 20  # the thread messages after a taken-over one searched for a stream left open


class Progress(Protocol):
    """What the delivery record learns during a try (``bot.worker`` keeps it)."""

    async def started(self, session_id: int) -> None:
        """The claim held: the user message is in the transcript."""

    async def replying(self, reply_ts: str) -> None:
        """The reply's first message exists in Slack (a take-over finishes it)."""

    def waiting_on_model(self) -> None:
        """The turn's work before its model call is done; it now mostly waits."""

    async def done_with_model(self) -> None:
        """The model's answer is complete; the turn's own work resumes (storing it)."""


def thread_key(team: str, channel: str, thread_ts: str) -> str:
    return f"{team}/{channel}/{thread_ts}"


def external_user(team: str, user: str) -> str:
    return f"slack:{team}:{user}"


@dataclass(frozen=True)
class Post:
    """Where a message was posted and by whom: what every reply needs."""

    team: str
    channel: str
    thread_ts: str
    ts: str
    user: str
    surface: str  # "dm", "channel" or "assistant" (TEMPORARY_SESSION_SURFACES)

    @property
    def thread(self) -> str:
        return thread_key(self.team, self.channel, self.thread_ts)

    @property
    def ref(self) -> str:
        return thread_key(self.team, self.channel, self.ts)

    def context(self) -> dict[str, Any]:
        return {
            "team": self.team,
            "channel": self.channel,
            "thread_ts": self.thread_ts,
            "ts": self.ts,
            "user": self.user,
            "surface": self.surface,
        }

    @classmethod
    def from_context(cls, data: dict[str, Any]) -> Post:
        return cls(
            **{k: str(data[k]) for k in ("team", "channel", "thread_ts", "ts", "user", "surface")}
        )


class Outcome(enum.Enum):
    ANSWERED = "answered"  # answered now, or found answered (or interrupted) already
    BUSY = "busy"  # the session's lock is held elsewhere; nothing was written
    STALE = "stale"  # the session moved on elsewhere; the thread got its refresh


async def _let_others_run() -> None:
    """Yield to the event loop. SQLite statements run in place (``core.storage.engine``), so a chain
    of them never suspends; without these, HTTP acknowledgements would wait behind whole chains."""
    await asyncio.sleep(0)


class Conversations:
    """What the listeners and the delivery worker call. One per process."""

    def __init__(
        self,
        settings: Settings,
        store: SessionStore,
        agent: Agent,
        state: SurfaceState,
        *,
        update_interval: float = 1.0,
    ) -> None:
        self.settings = settings
        self.store = store
        self.agent = agent
        self.state = state
        self.pacer = StreamPacer(update_interval)  # every reply of this process shares it
        self._tasks: set[asyncio.Task[None]] = set()
        self.closing = False

    # -- background work that is not a delivery (shortcuts, commands) ---------------------------

    def spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        if self.closing:
            coro.close()
            return
        task = asyncio.create_task(self._guard(coro))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    @staticmethod
    async def _guard(coro: Coroutine[Any, Any, None]) -> None:
        try:
            await coro
        except asyncio.CancelledError:
            raise
        except InvalidRequest as exc:
            log.warning("malformed payload: %s", exc)
        except Exception:
            log.exception("background Slack work failed")

    async def shutdown(self, grace: float) -> None:
        """Let running shortcut work finish for ``grace`` seconds, then cancel it."""
        self.closing = True
        pending = set(self._tasks)
        if pending:
            _, pending = await asyncio.wait(pending, timeout=grace)
        for task in pending:
            task.cancel(SHUTDOWN)
        for task in pending:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    # -- Slack's agent sessions ------------------------------------------------------------------

    async def stop(self, thread: str) -> bool:
        """The stop button: the thread's running turn stops, on whichever replica runs it."""
        found = await self.state.get_thread(thread)
        return found is not None and await self.store.request_stop(found.session_id)

    async def stop_workspace(self, team: str) -> int:
        """The app left a workspace: every turn running there stops (nothing else changes)."""
        return await self.store.request_stops(PROJECT, f"{team}/")

    async def renamed(self, thread: str, title: str) -> None:
        """A person renamed the session in Slack: that is its title here too."""
        found = await self.state.get_thread(thread)
        if found is not None and title.strip():
            await self.store.set_title(found.session_id, title, Actor(None, admin=True))

    async def vote(
        self,
        value: str,
        team: str,
        user: str,
        channel: str,
        thread_ts: str | None,
        client: AsyncWebClient,
    ) -> None:
        """A feedback button: the vote is stored against the answer it is on (the button's
        value names it) and acknowledged to the voter."""
        verdict, _, message_id = value.partition(":")
        stored = await record_vote(self.store.db, message_id, external_user(team, user), verdict)
        if thread_ts is not None and channel:
            post = Post(team, channel, thread_ts, thread_ts, user, "channel")
            await self.tell(client, post, text.vote_noted(verdict) if stored else text.vote_gone())

    async def actor(self, team: str, user: str) -> Actor:
        user_id = await self.store.get_or_create_user(external_user(team, user))
        return Actor(user_id=user_id, admin=self.settings.is_admin(team, user))

    # -- one try at a received message ----------------------------------------------------------

    async def session_of(self, record: DeliveryRecord) -> SessionInfo | None:
        """The session of the record's thread, if it exists yet."""
        if record.session_id is not None:
            return await self.store.get_session(record.session_id)
        thread = await self.state.get_thread(record.thread_key)
        return None if thread is None else await self.store.get_session(thread.session_id)

    async def attempt(
        self,
        record: DeliveryRecord,
        client: AsyncWebClient,
        *,
        resumed: bool,
        progress: Progress,
    ) -> Outcome:
        """Answer ``record`` now if the session lets us.

        ``resumed``: the record was taken over from a replica that died or stopped, so its
        user message may already be in the transcript; the transcript says what is left to do.
        """
        post = Post.from_context(record.context)
        user_id = await self.store.get_or_create_user(external_user(post.team, post.user))
        await _let_others_run()
        session, _ = await self.store.get_or_create_session(
            PROJECT,
            post.thread,
            user_id=user_id,
            title=record.text,
            temporary=post.surface in self.settings.temporary_session_surfaces,
        )
        await _let_others_run()
        await self.state.bind_thread(post.thread, session.id)
        await self.state.add_ref(post.ref, session.id, record.message_id, "user")
        await _let_others_run()
        prepared = await self._prepare(session, post, record, client)
        if not resumed:
            try:
                return await self._turn(
                    session, post, record, client, progress, prepared, resume=False
                )
            except DuplicateMessage:
                log.info("message %s is already in the transcript", record.message_id)
        return await self._resume(session, post, record, client, progress, prepared)

    async def _prepare(
        self, session: SessionInfo, post: Post, record: DeliveryRecord, client: AsyncWebClient
    ) -> Prepared:
        """The message's context (``bot.context``) and files, fetched once per try."""
        prepared = Prepared()
        if post.ts != post.thread_ts and await self.store.tail(session.id) is None:
            earlier = await context.thread_before(client, post.channel, post.thread_ts, post.ts)
            if earlier:
                prepared.notes.append(earlier)
        if post.surface in ("dm", "assistant"):
            looking = context.viewing(await self.state.viewing(f"{post.team}:{post.user}"))
            if looking:
                prepared.notes.append(looking)
        shared = [SharedFile.from_dict(f) for f in record.context.get("files") or []]
        if shared:
            token = client.token if isinstance(client.token, str) else None
            await context.fetch_files(shared, token, self.settings.max_file_bytes, prepared)
            for refused in prepared.refused:
                await self.tell(
                    client,
                    post,
                    text.file_refused(
                        refused.file.name, refused.refused or "", self.settings.max_file_bytes
                    ),
                )
        return prepared

    async def viewing(self, team: str, user: str, seen: dict[str, Any]) -> None:
        """``app_context_changed``: remembered for the person's next message (any replica)."""
        await self.state.set_viewing(f"{team}:{user}", seen)

    async def _resume(
        self,
        session: SessionInfo,
        post: Post,
        record: DeliveryRecord,
        client: AsyncWebClient,
        progress: Progress,
        prepared: Prepared,
    ) -> Outcome:
        """Carry on from what the transcript holds: a user message that is the tail
        is answered from there (never stored again); one with anything after it was answered."""
        if record.reply_ref is None and record.state == "started":
            await self._stop_unknown_streams(client, post)
        tail = await self.store.tail(session.id)
        if tail is not None and tail.message_id == record.message_id:
            if record.reply_ref is not None:  # the dead turn's reply, left half-written
                await self._close_reply(client, post, record.reply_ref, text.cut_short())
            return await self._turn(session, post, record, client, progress, prepared, resume=True)
        found = await self.store.find_message(record.message_id)
        if found is None:
            return await self._turn(session, post, record, client, progress, prepared, resume=False)
        after = await self.store.messages(session.id, after_position=found[1].position)
        answer = after[0] if after and after[0].role == "assistant" else None
        if answer is not None:
            # Answered before the replica died; its reply may not have been finished.
            reply = message_text(answer.message)
            if record.reply_ref is not None:
                await self._close_reply(client, post, record.reply_ref, reply, replace=True)
            else:
                await self._post_reply(client, post, session.id, answer.message_id, reply)
        return Outcome.ANSWERED

    async def _stop_unknown_streams(self, client: AsyncWebClient, post: Post) -> None:
        """A replica killed between Slack starting its reply's stream and the database
        recording where (``reply_ref``) left a stream open that no record names. The agent's
        messages in the thread after the person's are stopped, saying they were cut short:
        only the dead turn's can still be streaming (this try holds the delivery), and Slack
        refuses the others harmlessly."""
        try:
            response = await client.conversations_replies(
                channel=post.channel, ts=post.thread_ts, oldest=post.ts, limit=UNKNOWN_STREAMS
            )
        except SLACK_FAILURES as exc:
            log.warning("could not look for streams left open in %s: %s", post.thread, exc)
            return
        for message in response.get("messages") or []:
            ts = message.get("ts") if isinstance(message, dict) else None
            if isinstance(ts, str) and ts > post.ts and message.get("bot_id"):
                with contextlib.suppress(*SLACK_FAILURES):
                    await client.chat_stopStream(
                        channel=post.channel, ts=ts, markdown_text="\n" + text.cut_short()
                    )

    async def _close_reply(
        self, client: AsyncWebClient, post: Post, ts: str, body: str, *, replace: bool = False
    ) -> None:
        """Stop a stream a dead replica left open, ending with ``body`` (or showing only
        ``body`` with ``replace``); a reply that cannot be edited any more gets a new message,
        and so does a ``body`` longer than one edit carries."""
        md = render.neutralise(body)
        try:
            if not replace:
                await client.chat_stopStream(channel=post.channel, ts=ts, markdown_text=md)
                return
            with contextlib.suppress(*SLACK_FAILURES):
                await client.chat_stopStream(channel=post.channel, ts=ts)
            if len(md) <= render.APPEND_LIMIT:
                await client.chat_update(channel=post.channel, ts=ts, markdown_text=md)
                return
        except SLACK_FAILURES:
            pass
        stream = ReplyStream(
            client, channel=post.channel, thread_ts=post.thread_ts, team=post.team, user=post.user
        )
        await stream.finish(body)

    async def _post_reply(
        self, client: AsyncWebClient, post: Post, session_id: int, message_id: str, body: str
    ) -> None:
        """An answer the thread never showed, whole, with its feedback buttons."""
        stream = ReplyStream(
            client, channel=post.channel, thread_ts=post.thread_ts, team=post.team, user=post.user
        )
        await stream.finish(body, blocks=text.feedback_blocks(message_id))
        await self._add_reply_refs(post, session_id, message_id, stream.parts)

    async def _turn(
        self,
        session: SessionInfo,
        post: Post,
        record: DeliveryRecord,
        client: AsyncWebClient,
        progress: Progress,
        prepared: Prepared,
        *,
        resume: bool,
        retry: bool = True,
    ) -> Outcome:
        thread = await self.state.get_thread(post.thread)
        shown = thread.last_shown_message_id if thread else None
        stream = ReplyStream(
            client,
            channel=post.channel,
            thread_ts=post.thread_ts,
            team=post.team,
            user=post.user,
            pacer=self.pacer,
            on_start=progress.replying,
        )

        async def on_event(event: AgentEvent) -> None:
            if isinstance(event, TurnStarted):
                await progress.started(session.id)
                await self._session_status(client, post, "processing", title=session.title)
                if resume:
                    await stream.append(text.notice(text.resumed()) + "\n")
            elif isinstance(event, ModelCalled):
                progress.waiting_on_model()
            elif isinstance(event, ModelDone):
                await progress.done_with_model()
            elif isinstance(event, TextChunk):
                await stream.append(event.text)
            elif isinstance(event, ToolStarted):
                await stream.task_started(event.command)
            elif isinstance(event, ToolFinished):
                result = event.result
                await stream.task_finished(
                    event.command, result.exit_code, result.stdout, result.stderr
                )
            elif isinstance(event, Notice):
                await stream.append(text.notice(event.text) + "\n")

        try:
            result = await self.agent.run_turn(
                session.id,
                user_message=None
                if resume
                else user_message(
                    record.text,
                    message_id=record.message_id,
                    slack_user=post.user,
                    **({"context": prepared.context} if prepared.context else {}),
                ),
                last_message_id=record.message_id if resume else shown,
                on_event=on_event,
                files=prepared.files,
            )
        except AgentSessionBusy:
            return Outcome.BUSY
        except AgentSessionStale as exc:
            if resume:  # something was added after the message meanwhile: it was answered
                return Outcome.ANSWERED
            if not retry:
                await self._refresh_stale(session, post, client, exc)
                return Outcome.STALE
            if await self._only_this_thread_moved(session.id, shown):
                # The thread's own previous turn finished a moment ago; nothing came from
                # elsewhere, so this is not stale for the person typing here.
                await self.state.set_shown(session.id, exc.actual_last_message_id)
            elif record.wait_reason in ("ask", "queue"):
                # The poster was told the session was in use elsewhere and chose to send (or
                # queued): the thread is shown what changed, then the message goes.
                await self._refresh_stale(session, post, client, exc)
            else:
                await self._refresh_stale(session, post, client, exc)
                return Outcome.STALE
            return await self._turn(
                session, post, record, client, progress, prepared, resume=False, retry=False
            )
        except AgentSessionLockLost:
            await self._close(client, post, stream, stream.text + "\n" + text.lock_lost())
            return Outcome.ANSWERED
        except TurnInterrupted:
            await self._close(client, post, stream, stream.text + "\n" + text.stopped())
            return Outcome.ANSWERED
        except asyncio.CancelledError:
            # A shutdown past its grace: the core kept the partial answer; say so in the thread.
            with contextlib.suppress(Exception):
                await asyncio.shield(
                    self._close(client, post, stream, stream.text + "\n" + text.shut_down())
                )
            raise
        except DuplicateMessage:
            raise
        except Exception:
            # A database or Slack failure mid-turn: the record stays ours (retried by this
            # replica, or taken over), and carries on from what the transcript holds.
            with contextlib.suppress(Exception):
                if stream.ts is not None:
                    await self._close(client, post, stream, stream.text + "\n" + text.will_retry())
            raise
        final = stream.text or result.text
        if result.error is not None:
            final += "\n" + text.turn_failed(result.error.code)
        answer = result.answer
        buttons = text.feedback_blocks(answer.message_id) if answer is not None else None
        # The reply is closed before the bookkeeping below: the answer is stored, so a
        # database failure from here on must leave neither a stream open nor the answer
        # unshown; the retry finds the answer and this reply (``_resume``).
        await self._close(client, post, stream, final, blocks=buttons)
        if answer is not None:
            await self.state.set_shown(session.id, answer.message_id)
            await self._add_reply_refs(post, session.id, answer.message_id, stream.parts)
        return Outcome.ANSWERED

    async def _add_reply_refs(
        self, post: Post, session_id: int, message_id: str, parts: list[str]
    ) -> None:
        """Every message of a reply (a long one has several) stands for its answer."""
        for ts in parts:
            await self.state.add_ref(
                thread_key(post.team, post.channel, ts), session_id, message_id, "reply"
            )

    async def _unseen(self, session_id: int, shown: str | None) -> tuple[list[StoredMessage], bool]:
        """The messages after the one the thread last showed, read from there on (not the
        whole transcript); when that one is gone (rewound elsewhere), the last few. And
        whether it was gone."""
        if shown is None:
            return await self.store.messages(session_id), False
        found = await self.store.find_message(shown)
        if found is None or found[0] != session_id:
            tail = await self.store.tail(session_id)
            start = tail.position - REFRESH_LAST if tail else -1
            return await self.store.messages(session_id, after_position=start), True
        return await self.store.messages(session_id, after_position=found[1].position), False

    async def _only_this_thread_moved(self, session_id: int, shown: str | None) -> bool:
        """Everything after ``shown`` is Slack's own: user messages posted in Slack (they have
        refs) and the answers to them; no checkpoint, no rewind, no other surface."""
        unseen, rewound = await self._unseen(session_id, shown)
        if rewound or not unseen or any(m.is_compaction_message for m in unseen):
            return False
        users = [m.message_id for m in unseen if m.role == "user"]
        if not users or unseen[0].role != "user":
            return False
        known = {r.message_id for r in await self.state.refs_for(users)}
        return set(users) <= known

    async def _refresh_stale(
        self, session: SessionInfo, post: Post, client: AsyncWebClient, exc: AgentSessionStale
    ) -> None:
        """One refresh per change: what the thread had not shown (its last ``REFRESH_LAST``
        messages at most), and the thread now shows the current tail."""
        thread = await self.state.get_thread(post.thread)
        shown = thread.last_shown_message_id if thread else None
        unseen, rewound = await self._unseen(session.id, shown)
        quoted = [
            (m.role, message_text(m.message))
            for m in unseen[-REFRESH_LAST:]
            if message_text(m.message)
        ]
        await self.state.set_shown(session.id, exc.actual_last_message_id)
        await client.chat_postMessage(
            channel=post.channel, thread_ts=post.thread_ts, text=text.stale_refresh(quoted, rewound)
        )

    async def _close(
        self,
        client: AsyncWebClient,
        post: Post,
        stream: ReplyStream,
        final: str,
        *,
        blocks: list[dict[str, Any]] | None = None,
    ) -> str | None:
        """Finish the reply (with the feedback buttons, ``blocks``, when it is an answer), and
        take Slack's agent session out of "processing" with it."""
        ts = await stream.finish(final, session_status="active", blocks=blocks)
        if not stream.status_sent:
            await self._session_status(client, post, "active")
        return ts

    async def _session_status(
        self, client: AsyncWebClient, post: Post, status: str, *, title: str | None = None
    ) -> None:
        """Slack's agent session for the thread (status, and its title when Slack creates it).
        A workspace where the app is not an agent refuses; that changes nothing here."""
        try:
            await client.agents_sessions_setStatus(
                channel_id=post.channel, thread_ts=post.thread_ts, status=status, title=title
            )
        except SlackApiError as exc:
            log.debug("agent session status not set in %s: %s", post.thread, exc)

    # -- what the poster is told ----------------------------------------------------------------

    async def tell(self, client: AsyncWebClient, post: Post, body: str) -> bool:
        """An ephemeral to the poster; False (logged) if Slack would not take it, so a notice
        that failed never stops the message it is about from being answered."""
        try:
            await client.chat_postEphemeral(
                channel=post.channel, user=post.user, thread_ts=post.thread_ts, text=body
            )
        except SlackApiError as exc:
            log.warning("could not tell %s in %s: %s", post.user, post.thread, exc)
            return False
        return True

    async def offer(self, client: AsyncWebClient, record: DeliveryRecord, *, stale: bool) -> None:
        """The poster decides: **Send** (or **Send anyway**) / **Discard**."""
        post = Post.from_context(record.context)
        body = text.stale_offer(record.text) if stale else text.free_offer(record.text)
        await client.chat_postEphemeral(
            channel=post.channel,
            user=post.user,
            thread_ts=post.thread_ts,
            text=body,
            blocks=text.offer_blocks(
                body, str(record.id), send_label="Send anyway" if stale else "Send"
            ),
        )
