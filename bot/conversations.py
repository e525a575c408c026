"""Slack threads as agent sessions: a message in, a turn, a streamed reply out (SPEC §10).

The listeners in ``bot.app`` acknowledge and hand work here as background tasks (``spawn``);
everything that touches a session is a core call (``SessionStore``, ``Agent``,
``SurfaceState``). Busy and stale refusals come from the core before any model call; the waiting
message lives in the database as a draft, so whichever replica gets the button click finds it.

Keys: a thread is ``{team}/{channel}/{thread_ts}`` (the session's ``project_session_id``), a
Slack message ``{team}/{channel}/{ts}``; a user message's id is ``slack_message_id(team,
channel, ts)``, so a retried delivery can never be stored twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any

from slack_sdk.errors import SlackApiError
from slack_sdk.web.async_client import AsyncWebClient

from bot import messages as text
from bot.reply import ReplyStream
from core.agent import Agent, AgentEvent, Notice, TextChunk, ToolStarted
from core.errors import (
    AgentSessionBusy,
    AgentSessionLockLost,
    AgentSessionNotFound,
    AgentSessionStale,
    DuplicateMessage,
)
from core.messages import message_text, slack_message_id, user_message
from core.records import Actor, SessionInfo
from core.settings import Settings
from core.store import SessionStore
from core.surface_state import Draft, SurfaceState

log = logging.getLogger(__name__)

SURFACE = "slack"
# How long a follow-up waits for its thread's first message to be stored (it normally is within
# milliseconds; a replica that died in between must not hold the follow-up up for long).
ROOT_WAIT_SECONDS = 10.0
ROOT_POLL_SECONDS = 0.05
PROJECT = "slack"


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


async def _let_others_run() -> None:
    """Yield to the event loop. SQLite statements run in place (``core.db``), so a chain of
    them never suspends; without these, HTTP acknowledgements would wait behind whole chains."""
    await asyncio.sleep(0)


class Conversations:
    """What the listeners call. One per process; holds the background tasks it started."""

    def __init__(
        self,
        settings: Settings,
        store: SessionStore,
        agent: Agent,
        state: SurfaceState,
        *,
        update_interval: float = 1.0,
        max_turns: int = 8,
    ) -> None:
        self.settings = settings
        self.store = store
        self.agent = agent
        self.state = state
        self.update_interval = update_interval
        self.admins = frozenset(settings.admin_user_ids)
        self._tasks: set[asyncio.Task[None]] = set()
        # New messages worked on at once by this process: more would only lengthen the event
        # loop's ready queue (acknowledgements wait behind it) without finishing sooner; the
        # rest wait here, already acknowledged.
        self._turn_slots = asyncio.Semaphore(max_turns)
        self.closing = False

    # -- background work ------------------------------------------------------------------------

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
        except Exception:
            log.exception("background Slack work failed")

    async def shutdown(self, grace: float = 5.0) -> None:
        """Stop: let running turns finish for ``grace`` seconds, then interrupt them (the core
        persists partial output and releases locks on cancellation)."""
        self.closing = True
        pending = set(self._tasks)
        if pending:
            log.info("waiting up to %gs for %d running task(s)", grace, len(pending))
            _, pending = await asyncio.wait(pending, timeout=grace)
        for task in pending:
            task.cancel()
        for task in pending:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    async def actor(self, team: str, user: str) -> Actor:
        user_id = await self.store.get_or_create_user(external_user(team, user))
        return Actor(user_id=user_id, admin=user in self.admins)

    # -- a message in a thread ------------------------------------------------------------------

    async def known_thread(self, team: str, channel: str, thread_ts: str) -> bool:
        """A session thread, or one whose first message was taken for the agent a moment ago
        (its session may not be bound yet when a quick follow-up arrives)."""
        key = thread_key(team, channel, thread_ts)
        if await self.state.get_thread(key) is not None:
            return True
        return await self.state.event_claimed(f"msg:{key}")

    async def take_message(self, post: Post, body_text: str, client: AsyncWebClient) -> None:
        """A human message for the agent: exactly one replica and one delivery proceeds."""
        if self.closing:
            return  # not claimed: a retry may still reach another replica
        await _let_others_run()
        if not await self.state.claim_event(f"msg:{post.ref}"):
            log.debug("message %s already taken", post.ref)
            return
        self.spawn(self._converse(post, body_text, client))

    async def _converse(self, post: Post, body: str, client: AsyncWebClient) -> None:
        try:
            if post.ts != post.thread_ts:  # before taking a slot its root may need
                await self._after_the_thread_root(post)
            await self._turn_slots.acquire()
        except asyncio.CancelledError:
            log.warning("shutting down: message %s was acknowledged but not answered", post.ref)
            raise
        try:
            await self._converse_now(post, body, client)
        finally:
            self._turn_slots.release()

    async def _converse_now(self, post: Post, body: str, client: AsyncWebClient) -> None:
        user_id = await self.store.get_or_create_user(external_user(post.team, post.user))
        await _let_others_run()
        temporary = post.surface in self.settings.temporary_session_surfaces
        session, _ = await self.store.get_or_create_session(
            PROJECT, post.thread, user_id=user_id, title=body, temporary=temporary
        )
        await _let_others_run()
        await self.state.bind_thread(post.thread, session.id)
        message_id = slack_message_id(post.team, post.channel, post.ts)
        await self.state.add_ref(post.ref, session.id, message_id, "user")
        await _let_others_run()
        await self.send(session, post, body, message_id, client)

    async def _after_the_thread_root(self, post: Post) -> None:
        """Keep Slack's order: a follow-up that overtook its thread's first message (taken a
        moment ago, here or on another replica) waits until that message is in the transcript."""
        if not await self.state.event_claimed(f"msg:{post.thread}"):
            return
        root_id = slack_message_id(post.team, post.channel, post.thread_ts)
        for _ in range(int(ROOT_WAIT_SECONDS / ROOT_POLL_SECONDS)):
            if await self.store.find_message(root_id) is not None:
                return
            await asyncio.sleep(ROOT_POLL_SECONDS)

    async def send(
        self,
        session: SessionInfo,
        post: Post,
        body: str,
        message_id: str,
        client: AsyncWebClient,
        draft: Draft | None = None,
        *,
        retry: bool = True,
    ) -> None:
        """One turn for ``body``; busy and stale refusals become drafts and notices."""
        thread = await self.state.get_thread(post.thread)
        shown = thread.last_shown_message_id if thread else None
        stream = ReplyStream(
            client,
            channel=post.channel,
            thread_ts=post.thread_ts,
            team=post.team,
            user=post.user,
            interval=self.update_interval,
        )
        await self._status(client, post, text.WORKING_STATUS)

        async def on_event(event: AgentEvent) -> None:
            if isinstance(event, TextChunk):
                await stream.append(event.text)
            elif isinstance(event, ToolStarted):
                await stream.append(text.tool_started(event.command))
            elif isinstance(event, Notice):
                await stream.append(text.notice(event.text) + "\n")

        try:
            result = await self.agent.run_turn(
                session.id,
                user_message=user_message(body, message_id=message_id, slack_user=post.user),
                last_message_id=shown,
                on_event=on_event,
            )
        except AgentSessionBusy:
            await self._status(client, post, "")
            await self._busy(session, post, body, message_id, client, draft)
            return
        except AgentSessionStale as exc:
            if retry and await self._only_this_thread_moved(session.id, shown):
                # The thread's own previous turn finished a moment ago; nothing came from
                # elsewhere, so this is not stale for the person typing here.
                await self.state.set_shown(session.id, exc.actual_last_message_id)
                await self.send(session, post, body, message_id, client, draft, retry=False)
                return
            await self._status(client, post, "")
            await self._stale(session, post, body, message_id, client, exc, draft)
            return
        except DuplicateMessage:
            await self._status(client, post, "")
            log.info("message %s is already in the transcript", message_id)
            if draft is not None:
                await self.state.take_draft(draft.id, ("sending",), "sent")
            return
        except AgentSessionLockLost:
            await stream.finish(stream.text + "\n" + text.lock_lost())
            return
        except asyncio.CancelledError:
            with contextlib.suppress(Exception):
                await asyncio.shield(stream.finish())
            raise
        except Exception:
            log.exception("turn for message %s failed", message_id)
            await self._status(client, post, "")
            with contextlib.suppress(Exception):
                await stream.finish()
                await self._ephemeral(client, post, text.internal_error())
            return
        if draft is not None:
            await self.state.take_draft(draft.id, ("sending",), "sent")
        if result.answer is not None:
            await self.state.set_shown(session.id, result.answer.message_id)
        final = stream.text or result.text
        if result.error is not None:
            final += "\n" + text.turn_failed(result.error.code)
        ts = await stream.finish(final)
        await self._status(client, post, "")
        if result.answer is not None and ts is not None:
            await self.state.add_ref(
                thread_key(post.team, post.channel, ts),
                session.id,
                result.answer.message_id,
                "reply",
            )

    async def _only_this_thread_moved(self, session_id: int, shown: str | None) -> bool:
        """Everything after ``shown`` is Slack's own: user messages posted in Slack (they have
        refs) and the answers to them; no checkpoint, no rewind, no other surface."""
        history = await self.store.messages(session_id)
        ids = [m.message_id for m in history]
        if shown is not None and shown not in ids:
            return False
        unseen = history[ids.index(shown) + 1 :] if shown is not None else history
        if not unseen or any(m.is_compaction_message for m in unseen):
            return False
        users = [m.message_id for m in unseen if m.role == "user"]
        if not users or unseen[0].role != "user":
            return False
        known = {r.message_id for r in await self.state.refs_for(users)}
        return set(users) <= known

    async def _status(self, client: AsyncWebClient, post: Post, status: str) -> None:
        """The thread's "working" status; only assistant threads have one, so errors are fine."""
        with contextlib.suppress(SlackApiError):
            await client.assistant_threads_setStatus(
                channel_id=post.channel, thread_ts=post.thread_ts, status=status
            )

    # -- busy ------------------------------------------------------------------------------------

    async def _busy(
        self,
        session: SessionInfo,
        post: Post,
        body: str,
        message_id: str,
        client: AsyncWebClient,
        draft: Draft | None,
    ) -> None:
        queue = self.settings.busy_mode == "queue"
        draft = await self._keep_draft(draft, session, post, body, message_id, "busy", "waiting")
        await client.chat_postEphemeral(
            channel=post.channel,
            user=post.user,
            thread_ts=post.thread_ts,
            text=text.busy_queued_notice() if queue else text.busy_notice(),
        )
        self.spawn(self.wait_until_free(draft, client))

    async def wait_until_free(self, draft: Draft, client: AsyncWebClient) -> None:
        """Poll the database every BUSY_POLL_SECONDS; offer (ask) or send (queue) when free."""
        post = Post.from_context(draft.context)
        deadline = time.monotonic() + self.settings.busy_poll_timeout_seconds
        queue = self.settings.busy_mode == "queue"
        while True:
            await asyncio.sleep(self.settings.busy_poll_seconds)
            current = await self.state.get_draft(draft.id)
            if current is None or current.state != "waiting":
                return
            try:
                busy = await self.store.is_turn_active(draft.session_id)
            except AgentSessionNotFound:
                return
            if not busy:
                if not queue:
                    offered = await self.state.take_draft(draft.id, ("waiting",), "offered")
                    if offered is not None:
                        await client.chat_postEphemeral(
                            channel=post.channel,
                            user=post.user,
                            thread_ts=post.thread_ts,
                            text=text.free_offer(draft.text),
                            blocks=text.offer_blocks(text.free_offer(draft.text), draft.id),
                        )
                    return
                first = await self.state.first_waiting(draft.session_id, ("waiting",))
                if first == draft.id:
                    taken = await self.state.take_draft(draft.id, ("waiting",), "sending")
                    if taken is not None:
                        await self.send_draft(taken, client)
                        return
            if time.monotonic() >= deadline:
                if await self.state.take_draft(draft.id, ("waiting",), "expired"):
                    await client.chat_postEphemeral(
                        channel=post.channel,
                        user=post.user,
                        thread_ts=post.thread_ts,
                        text=text.busy_timeout(draft.text),
                    )
                return

    async def send_draft(self, draft: Draft, client: AsyncWebClient) -> None:
        """Send a draft already moved to ``sending`` (by a click or the queue)."""
        post = Post.from_context(draft.context)
        try:
            session = await self.store.get_session(draft.session_id)
        except AgentSessionNotFound:
            await self.state.take_draft(draft.id, ("sending",), "discarded")
            return
        await self.send(session, post, draft.text, draft.message_id, client, draft)

    async def click_draft(
        self, draft_id: str, user: str, send: bool, client: AsyncWebClient
    ) -> None:
        draft = await self.state.get_draft(draft_id)
        if draft is None or draft.author != user:
            return
        post = Post.from_context(draft.context)
        if send:
            taken = await self.state.take_draft(draft_id, ("offered", "stale"), "sending")
            if taken is None:
                await self._ephemeral(client, post, text.draft_gone())
                return
            await self.send_draft(taken, client)
        else:
            taken = await self.state.take_draft(
                draft_id, ("offered", "stale", "waiting"), "discarded"
            )
            await self._ephemeral(
                client, post, text.draft_discarded() if taken else text.draft_gone()
            )

    async def _keep_draft(
        self,
        draft: Draft | None,
        session: SessionInfo,
        post: Post,
        body: str,
        message_id: str,
        reason: str,
        state: str,
    ) -> Draft:
        """Store a message that was not sent (or move a draft being sent back to ``state``), so
        a button click on any replica finds it."""
        if draft is None:
            return await self.state.add_draft(
                session_id=session.id,
                author=post.user,
                message_id=message_id,
                text=body,
                reason=reason,
                state=state,
                context=post.context(),
            )
        return await self.state.take_draft(draft.id, ("sending",), state) or draft

    async def _ephemeral(self, client: AsyncWebClient, post: Post, body: str) -> None:
        await client.chat_postEphemeral(
            channel=post.channel, user=post.user, thread_ts=post.thread_ts, text=body
        )

    # -- stale -----------------------------------------------------------------------------------

    async def _stale(
        self,
        session: SessionInfo,
        post: Post,
        body: str,
        message_id: str,
        client: AsyncWebClient,
        exc: AgentSessionStale,
        draft: Draft | None,
    ) -> None:
        thread = await self.state.get_thread(post.thread)
        shown = thread.last_shown_message_id if thread else None
        history = await self.store.messages(session.id)
        ids = [m.message_id for m in history]
        rewound = shown is not None and shown not in ids
        start = ids.index(shown) + 1 if shown in ids else 0
        unseen = [
            (m.role, message_text(m.message))
            for m in (history[start:] if not rewound else history[-3:])
            if message_text(m.message)
        ]
        # One refresh per change: the thread now shows the current tail.
        await self.state.set_shown(session.id, exc.actual_last_message_id)
        await client.chat_postMessage(
            channel=post.channel, thread_ts=post.thread_ts, text=text.stale_refresh(unseen, rewound)
        )
        draft = await self._keep_draft(draft, session, post, body, message_id, "stale", "stale")
        offer = text.stale_offer(body)
        await client.chat_postEphemeral(
            channel=post.channel,
            user=post.user,
            thread_ts=post.thread_ts,
            text=offer,
            blocks=text.offer_blocks(offer, draft.id, send_label="Send anyway"),
        )
