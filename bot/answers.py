"""A received Slack message answered in its thread: the Slack side of the delivery worker.

The worker (``core.conversation.worker``) decides *when* a record is tried; ``ThreadAnswers``
makes the try the Slack way: one call of the conversation door (``Conversations.answer``) with a
renderer for the thread (``_ThreadReply``) that gathers what the agent is told beside the message
(the thread before the mention, shared files, what the person is looking at) and shows the
turn: the reply streaming
as the agent writes it, Slack's agent-session status, a refresh when the session moved on
elsewhere, the notices and offers the poster gets. A record taken over from a replica that died
finishes what that replica left in Slack (a stream left open, an answer never shown).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any

from slack_sdk.errors import SlackApiError
from slack_sdk.web.async_client import AsyncWebClient

from bot import context, render
from bot import texts as text
from bot.context import Gathered, thread_messages
from bot.files import SharedFile, shared_files
from bot.post import Post, external_user, thread_key
from bot.reply import SLACK_FAILURES, ReplyStream, StreamPacer
from core.conversation import (
    REFRESH_LAST,
    AlreadyAnswered,
    Answered,
    Arrival,
    Attachments,
    BeforeTurn,
    Began,
    BudgetRanOut,
    Busy,
    Conversations,
    DeliveryRecord,
    Failed,
    Interrupted,
    LockLost,
    OverBudget,
    Payer,
    PickingUp,
    QuietRenderer,
    Refreshed,
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
from core.conversation.surface import Outcome, Progress, WaitingNotice
from core.conversation.worker import RECORD_LOST
from core.errors import InvalidRequest
from core.runtime import Settings

if TYPE_CHECKING:
    from bot.approvals import ApprovalCards

log = logging.getLogger(__name__)

UNKNOWN_STREAMS = 20  # the agent's newest messages after a taken-over one, stopped if open

# A workspace's client: its team id, and its Enterprise Grid org's id when it has one.
ClientFor = Callable[[str, str | None], Awaitable[AsyncWebClient | None]]


class ThreadAnswers:
    """What the delivery worker asks of the Slack surface. One per process."""

    def __init__(
        self,
        settings: Settings,
        conversations: Conversations,
        client_for_team: ClientFor,
        *,
        update_interval: float = 1.0,
    ) -> None:
        self.settings = settings
        self.conversations = conversations
        self._client_for_team = client_for_team
        self.pacer = StreamPacer(update_interval)  # every reply of this process shares it
        self.cards: ApprovalCards | None = None  # set by the service: cards of waiting calls

    # -- DeliverySurface ------------------------------------------------------------------------

    async def words(
        self, strays: list[DeliveryRecord], client: AsyncWebClient
    ) -> dict[str, tuple[str, dict[str, Any]]] | None:
        """The strays' text and files, read back from their thread (a stray record keeps only
        where and by whom): one bounded read of the few messages between the first stray and
        the last. A message deleted since, or left with no text and no file, is left out."""
        posts = {stray.event_key: Post.from_context(stray.context) for stray in strays}
        first = next(iter(posts.values()))
        stamps = sorted(post.ts for post in posts.values())
        found = await context.thread_span(
            client, first.channel, first.thread_ts, stamps[0], stamps[-1]
        )
        if found is None:
            return None
        words: dict[str, tuple[str, dict[str, Any]]] = {}
        for stray in strays:
            message = found.get(posts[stray.event_key].ts)
            if message is None or message.get("user") != stray.author:
                continue
            raw = message.get("text")
            said = raw.replace("\x00", "").strip() if isinstance(raw, str) else ""
            try:
                files = shared_files(message)
            except InvalidRequest:
                files = []
            if said or files:
                words[stray.event_key] = (
                    said,
                    {**stray.context, "files": [f.as_dict() for f in files]},
                )
        return words

    async def client_for(self, record: DeliveryRecord) -> AsyncWebClient | None:
        enterprise = record.context.get("enterprise")
        return await self._client_for_team(
            str(record.context.get("team", "")), enterprise if isinstance(enterprise, str) else None
        )

    async def tell(
        self, record: DeliveryRecord, client: AsyncWebClient, notice: WaitingNotice
    ) -> None:
        words: dict[WaitingNotice, Callable[[], str]] = {
            WaitingNotice.FOLLOW_UP: text.follow_up_notice,
            WaitingNotice.QUEUED: text.busy_queued_notice,
            WaitingNotice.BUSY: text.busy_notice,
            WaitingNotice.TIMED_OUT: lambda: text.busy_timeout(record.text),
            WaitingNotice.GAVE_UP: lambda: text.gave_up(record.text),
        }
        await tell(client, Post.from_context(record.context), words[notice]())

    async def offer(self, record: DeliveryRecord, client: AsyncWebClient, *, stale: bool) -> bool:
        """The poster decides: **Send** (or **Send anyway**) / **Discard**."""
        post = Post.from_context(record.context)
        body = text.stale_offer(record.text) if stale else text.free_offer(record.text)
        try:
            await client.chat_postEphemeral(
                channel=post.channel,
                user=post.user,
                thread_ts=post.thread_ts,
                text=body,
                blocks=text.offer_blocks(
                    body, str(record.id), send_label="Send anyway" if stale else "Send"
                ),
            )
        except SLACK_FAILURES as exc:
            log.info("offer for %s not posted: %s", record.event_key, exc)
            return False
        return True

    async def answer(
        self,
        record: DeliveryRecord,
        client: AsyncWebClient,
        *,
        resumed: bool,
        progress: Progress,
    ) -> Outcome:
        """Answer ``record`` now if the session lets us: one call of the conversation door,
        shown in the thread by a ``_ThreadReply``.

        ``resumed``: the record was taken over from a replica that died or stopped, so its
        user message may already be in the transcript; the transcript says what is left to do.
        A record of a person's decision on a waiting tool call (``context.approval``) carries
        the decision out instead.
        """
        post = Post.from_context(record.context)
        approval = record.context.get("approval")
        person = external_user(post.team, post.user)
        if isinstance(approval, str):
            if self.cards is not None:
                await self.cards.refresh(approval, client)  # "Approved by …; running"
            decider = record.context.get("decided_by")  # who pays: whoever decided, wherever
            arrival = Arrival(
                person,
                record.text,
                key=post.thread,
                approval=approval,
                payer=Payer(decider if isinstance(decider, str) else person, post.team),
            )
        else:
            if resumed and record.reply_ref is None and record.state == "started":
                await self._stop_unknown_streams(client, post)
            arrival = Arrival(
                person,
                record.text,
                key=post.thread,
                title=record.text,
                temporary=post.surface in self.settings.temporary_session_surfaces,
                message_id=record.message_id,
                ref=post.ref,
                metadata={"slack_user": post.user},
                payer=Payer(person, post.team),
                resume=resumed,
                sent_anyway=record.wait_reason in ("ask", "queue"),
                viewer=f"{post.team}:{post.user}" if post.surface in ("dm", "assistant") else None,
            )
        reply = _ThreadReply(self, post, record, client, progress)
        try:
            end = await self.conversations.answer(arrival, reply)
        finally:
            if isinstance(approval, str) and self.cards is not None:
                with contextlib.suppress(Exception):
                    await self.cards.refresh(approval, client)
        if isinstance(end, Busy):
            return Outcome.BUSY
        if isinstance(end, Stale):
            return Outcome.STALE
        return Outcome.ANSWERED

    # -- one try --------------------------------------------------------------------------------

    async def gather(
        self,
        before: BeforeTurn,
        post: Post,
        record: DeliveryRecord,
        client: AsyncWebClient,
    ) -> Gathered:
        """The message's context (``bot.context``) and files, fetched once per try."""
        gathered = Gathered()
        shared: list[SharedFile] = []
        if post.ts != post.thread_ts and before.fresh:
            earlier = await context.thread_before(client, post.channel, post.thread_ts, post.ts)
            if earlier.text:
                gathered.notes.append(earlier.text)
            shared += earlier.files  # shared before the mention: the agent gets them too
        looking = context.viewing(before.viewing)
        if looking:
            gathered.notes.append(looking)
        shared += [SharedFile.from_dict(f) for f in record.context.get("files") or []]
        if shared:
            token = client.token if isinstance(client.token, str) else None
            await context.fetch_files(
                shared,
                token,
                self.settings.max_file_bytes,
                self.settings.slack_api_url,
                gathered,
            )
            for refused in gathered.refused:
                await tell(
                    client,
                    post,
                    text.file_refused(
                        refused.file.name, refused.refused or "", self.settings.max_file_bytes
                    ),
                )
        return gathered

    @staticmethod
    def _refs(post: Post, parts: list[str]) -> list[str]:
        """Every message of a reply (a long one has several) stands for its answer."""
        return [thread_key(post.team, post.channel, ts) for ts in parts]

    async def _post_refresh(self, client: AsyncWebClient, post: Post, unseen: Unseen) -> None:
        """One refresh per change: what the thread had not shown (its last few messages)."""
        quoted = [
            (m.role, message_text(m.message))
            for m in unseen.messages[-REFRESH_LAST:]
            if message_text(m.message)
        ]
        await client.chat_postMessage(
            channel=post.channel,
            thread_ts=post.thread_ts,
            text=text.stale_refresh(quoted, unseen.rewound),
        )

    async def _stop_unknown_streams(self, client: AsyncWebClient, post: Post) -> None:
        """A replica killed between Slack starting its reply's stream and the database
        recording where (``reply_ref``) left a stream open that no record names. The agent's
        newest messages in the thread after the person's are stopped, saying they were cut
        short: only the dead turn's can still be streaming, and it is the agent's newest (this
        try holds the delivery, so nothing of the agent's came after it); Slack refuses the
        others harmlessly. The newest, not the first after the person's: in a busy thread a
        message queued behind others has their replies, and people's words, before its own."""
        ours: list[str] = []
        try:
            async for message in thread_messages(
                client, post.channel, post.thread_ts, oldest=post.ts
            ):
                ts = message.get("ts")
                if isinstance(ts, str) and ts > post.ts and message.get("bot_id"):
                    ours.append(ts)
        except SLACK_FAILURES as exc:
            log.warning("could not look for streams left open in %s: %s", post.thread, exc)
            return
        for ts in ours[-UNKNOWN_STREAMS:]:
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
        self,
        client: AsyncWebClient,
        post: Post,
        message_id: str,
        body: str,
    ) -> list[str]:
        """An answer the thread never showed, whole, with its feedback buttons (the refs the
        door notes for it)."""
        stream = ReplyStream(
            client, channel=post.channel, thread_ts=post.thread_ts, team=post.team, user=post.user
        )
        await stream.finish(body, blocks=text.feedback_blocks(message_id))
        return self._refs(post, stream.parts)

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


class _ThreadReply(QuietRenderer):
    """One try's reply in its Slack thread: the conversation door's renderer for Slack."""

    def __init__(
        self,
        answers: ThreadAnswers,
        post: Post,
        record: DeliveryRecord,
        client: AsyncWebClient,
        progress: Progress,
    ) -> None:
        self.answers = answers
        self.post = post
        self.record = record
        self.client = client
        self.progress = progress
        self.stream = ReplyStream(
            client,
            channel=post.channel,
            thread_ts=post.thread_ts,
            team=post.team,
            user=post.user,
            pacer=answers.pacer,
            on_start=progress.replying,
        )

    async def prepare(self, before: BeforeTurn) -> Attachments:
        gathered = await self.answers.gather(before, self.post, self.record, self.client)
        return Attachments(gathered.context, gathered.files)

    async def event(self, event: TurnEvent) -> None:
        answers, post, client, stream = self.answers, self.post, self.client, self.stream
        await self.progress.observe(event)
        if isinstance(event, PickingUp):
            if self.record.reply_ref is not None:  # the dead turn's reply, left half-written
                await answers._close_reply(client, post, self.record.reply_ref, text.cut_short())
        elif isinstance(event, Refreshed):
            await answers._post_refresh(client, post, event.unseen)
        elif isinstance(event, Began):
            await self.progress.started(event.conversation.id)
            await answers._session_status(
                client, post, "processing", title=event.conversation.session.title
            )
            if event.picked_up:
                await stream.append(text.notice(text.resumed()) + "\n")
        elif isinstance(event, Said):
            await stream.append(event.text)
        elif isinstance(event, ToolBegan):
            await stream.task_started(event.label)
        elif isinstance(event, ToolEnded):
            await stream.task_finished(
                event.label,
                event.exit_code,
                event.output,
                event.error if event.kind == "shell" else "",
            )
        elif isinstance(event, Told):
            await stream.append(text.notice(event.text) + "\n")

    async def abandoned(self, error: BaseException) -> None:
        answers, post, client, stream = self.answers, self.post, self.client, self.stream
        if isinstance(error, asyncio.CancelledError):
            # A shutdown past its grace: the core kept the partial answer; say so in the thread.
            # A record this replica may no longer hold: the replica that takes it over goes on.
            ending = text.will_retry() if RECORD_LOST in error.args else text.shut_down()
            await answers._close(client, post, stream, stream.text + "\n" + ending)
        elif stream.ts is not None:
            # A database or Slack failure mid-turn: the record stays ours (retried by this
            # replica, or taken over), and carries on from what the transcript holds.
            await answers._close(client, post, stream, stream.text + "\n" + text.will_retry())

    async def finish(self, end: TurnEnd) -> Sequence[str]:
        answers, post, client, stream = self.answers, self.post, self.client, self.stream
        if isinstance(end, LockLost):
            await answers._close(client, post, stream, stream.text + "\n" + text.lock_lost())
        elif isinstance(end, Interrupted):
            await answers._close(client, post, stream, stream.text + "\n" + text.stopped())
        elif isinstance(end, Stale):
            await answers._post_refresh(client, post, end.unseen)
        elif isinstance(end, OverBudget):
            refusal = end.refusal
            await tell(
                client,
                post,
                text.over_budget(refused_budget(refusal).describe(), resets_text(refusal)),
            )
        elif isinstance(end, AlreadyAnswered):
            return await self._already_answered(end)
        elif isinstance(end, Answered | Failed | BudgetRanOut):
            return await self._answered(end)
        return ()

    async def _answered(self, end: Answered | Failed | BudgetRanOut) -> Sequence[str]:
        answers, post, client, stream = self.answers, self.post, self.client, self.stream
        result = end.result
        final = stream.text or result.text
        if isinstance(end, BudgetRanOut):
            limit = refused_budget(end.refusal).describe()
            final += "\n" + text.budget_ran_out(limit, resets_text(end.refusal))
        elif isinstance(end, Failed):
            final += "\n" + text.turn_failed(end.code)
        if result.trace_url is not None:
            final += "\n" + text.trace_link(result.trace_url)
        answer = result.answer
        buttons = text.feedback_blocks(answer.message_id) if answer is not None else None
        # The reply is closed before the door's bookkeeping: the answer is stored, so a
        # database failure from here on must leave neither a stream open nor the answer
        # unshown; the retry finds the answer and this reply (a resumed ``AlreadyAnswered``).
        await answers._close(client, post, stream, final, blocks=buttons)
        if result.approval is not None and answers.cards is not None:
            await answers.cards.post(client, post, result.approval)
        return answers._refs(post, stream.parts)

    async def _already_answered(self, end: AlreadyAnswered) -> Sequence[str]:
        """Answered before the replica died; its reply may not have been finished (one it
        showed whole and recorded is left as it is), and the card its turn stopped at may
        never have been posted."""
        answers, post, client = self.answers, self.post, self.client
        refs: Sequence[str] = ()
        answer = end.answer
        if answer is not None and not end.shown:
            reply = message_text(answer.message)
            if self.record.reply_ref is not None:
                await answers._close_reply(client, post, self.record.reply_ref, reply, replace=True)
            else:
                refs = await answers._post_reply(client, post, answer.message_id, reply)
        if end.waiting is not None and answers.cards is not None:
            await answers.cards.post_missing(client, post, end.waiting)
        return refs


async def tell(client: AsyncWebClient, post: Post, body: str) -> bool:
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
