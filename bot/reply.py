"""A reply that streams into a thread as the agent writes it, and always arrives whole.

The model writes Markdown, and it goes to Slack as Markdown (``markdown_text``), neutralised
(``bot.render``) so nothing in it becomes a mention or a link it was not.

- **Streaming** where the workspace has it (``chat.startStream`` / ``appendStream`` /
  ``stopStream``); otherwise messages posted with ``chat.postMessage`` and edited with
  ``chat.update``. At most about one Web API call a second while text arrives, fewer when
  more than ``STREAM_CALLS_PER_SECOND`` replies stream at once (``StreamPacer``; Slack
  rate-limits them); the first text goes out at once. A piece shorter than ``SMALL_PIECE``
  characters waits up to ``SMALL_PIECE_WAITS`` intervals more for the words after it: a model
  that trickles a word a second would otherwise cost an update (a Web API call: roughly a
  third of a millisecond of our CPU, by the profile in docs/benchmarks.md) per word; one that
  writes 256 characters a second or more is paced as before.
  (slack_sdk's own ``chat_stream`` helper waits for 256 characters, however long.) 429s, 5xx
  answers and dropped
  connections are retried by slack_sdk's retry handlers (``bot.slack_api``).
- **Limits.** One ``markdown_text`` carries at most 12,000 characters: more goes in several
  appends, cut at paragraph or code-fence ends (``render.split_markdown``). A message holds at
  most ``MESSAGE_LIMIT`` characters (``APPEND_LIMIT`` without streaming: one edit carries the
  whole message); a longer reply continues in further messages, cut at a block's end, a code
  fence cut there closed and reopened. Near a message's end only whole blocks are sent, so the
  cut can fall between them.
- **A stream Slack ended** (``message_not_in_streaming_state``: its stop button, its own time
  limit) keeps what it shows; the rest continues in a new message.
- **Sandbox commands** are task cards (``task_update`` chunks: in progress, then complete or
  error with a short output); without streaming, a line of text. A reply whose first words
  are blank (a line break before a tool call) starts with its card, not an empty message.
- **The end**: ``finish`` sends what is left and stops the stream with the agent session's
  status and the feedback buttons (``blocks``), in one call.

A call that still fails does not fail the turn: the stream is marked broken, the text keeps
accumulating, and ``finish`` delivers whatever Slack has not confirmed in new messages in the
thread. A chunk Slack took but could not confirm may then show twice; nothing is ever lost.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import re
import time
import weakref
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from aiohttp import ClientError
from slack_sdk.errors import SlackApiError
from slack_sdk.models.messages.chunk import TaskUpdateChunk
from slack_sdk.web.async_client import AsyncWebClient

from bot import render
from bot import texts as words
from bot.render import APPEND_LIMIT

log = logging.getLogger(__name__)

# Blank lines at the start of a text (``ReplyStream._open``).
_BLANK_LINES = re.compile(r"\A(?:[ \t]*\n)+")
# What a Web API call raises once slack_sdk's retries are spent.
SLACK_FAILURES = (SlackApiError, ClientError, asyncio.TimeoutError)
# Characters of Markdown one streamed message holds (Slack shows up to 40,000 in a message).
MESSAGE_LIMIT = 36_000
# A message with less room than this left is ended rather than cut into a sliver.
MIN_ROOM = 1_000
# A task card's output: its last characters.
TASK_OUTPUT = 300
# Text updates a second that one replica's replies share (``StreamPacer``).
STREAM_CALLS_PER_SECOND = 100.0
# Characters of new text that are worth an update as soon as the interval allows; less waits
# up to this many base intervals more for the next words (the module docstring).
SMALL_PIECE = 256
SMALL_PIECE_WAITS = 2


class StreamPacer:
    """The pace of one replica's streaming replies: together they make at most about
    ``budget`` Web API calls a second, so each one's interval grows with how many stream at
    once (never below ``interval``). Under a few hundred turns at once, a call a second for
    each was most of the replica's CPU (and more than Slack's rate limits allow): replies then
    arrive in fewer, larger pieces, and nothing else slows down."""

    def __init__(self, interval: float = 1.0, budget: float = STREAM_CALLS_PER_SECOND) -> None:
        self.base = interval
        self.budget = budget
        # Replies streaming now (any object that stands for one: ``bench.turn_floor`` paces
        # its own the same way).
        self._streaming: weakref.WeakSet[object] = weakref.WeakSet()

    @property
    def interval(self) -> float:
        return max(self.base, len(self._streaming) / self.budget)

    def wait(self, waiting: int) -> float:
        """Seconds from a reply's last update until ``waiting`` characters are due: a piece of
        ``SMALL_PIECE`` or more after ``interval``, a smaller one ``SMALL_PIECE_WAITS`` base
        intervals later."""
        if waiting < SMALL_PIECE:
            return self.interval + SMALL_PIECE_WAITS * self.base
        return self.interval

    def started(self, reply: object) -> None:
        self._streaming.add(reply)

    def finished(self, reply: object) -> None:
        self._streaming.discard(reply)


def _stream_gone(exc: SlackApiError) -> bool:
    """Slack ended the stream itself: it can only be edited from now on."""
    return bool(exc.response.get("error") == "message_not_in_streaming_state")


class ReplyStream:
    def __init__(
        self,
        client: AsyncWebClient,
        *,
        channel: str,
        thread_ts: str,
        team: str | None,
        user: str | None,
        interval: float = 1.0,
        pacer: StreamPacer | None = None,
        on_start: Callable[[str], Awaitable[None]] | None = None,
    ) -> None:
        self.client = client
        self.channel = channel
        self.thread_ts = thread_ts
        self.team = team
        self.user = user
        self.pacer = pacer or StreamPacer(interval, budget=math.inf)
        self.on_start = on_start  # told the reply's first ts once it exists
        self.ts: str | None = None  # the reply's first message
        self.parts: list[str] = []  # every message of the reply, in order
        self.streaming = False  # the current message is a stream
        self.can_stream = True  # until Slack says the workspace has no streaming
        self.broken = False  # a call failed after retries: the rest goes out at ``finish``
        self.status_sent = False
        self.text = ""  # the Markdown written so far (shown, or pending)
        self._sent = 0  # characters of ``text`` Slack confirmed
        self._current: str | None = None  # the message being written
        self._shown = ""  # what the current message holds (neutralised)
        self._tasks: list[tuple[str, str]] = []  # task cards in progress: (id, command)
        self._task_count = 0
        self._last = 0.0
        self._pending: asyncio.Task[None] | None = None
        self._lock = asyncio.Lock()

    @property
    def interval(self) -> float:
        """Seconds between two text updates while text arrives (the first goes at once)."""
        return self.pacer.interval

    def _wait_left(self) -> float:
        """Seconds until the text not sent yet is due (``StreamPacer.wait``)."""
        return self.pacer.wait(len(self.text) - self._sent) - (time.monotonic() - self._last)

    # -- what the turn calls --------------------------------------------------------------------

    async def append(self, text: str) -> None:
        if not text:
            return
        self.text += text
        if self.broken:
            return
        if self.ts is None:  # the reply's first text: it streams from now on
            self.pacer.started(self)
        if self.ts is None or self._wait_left() <= 0:
            await self._flush()
        elif self._pending is None:
            self._pending = asyncio.create_task(self._flush_later())

    async def task_started(self, command: str) -> None:
        """A sandbox command starts: a task card in progress."""
        self._task_count += 1
        task = (f"task_{self._task_count}", command)
        self._tasks.append(task)
        await self._task(task, "in_progress", None)

    async def task_finished(self, command: str, exit_code: int, stdout: str, stderr: str) -> None:
        """The command ended: its card says done or error, with the end of its output."""
        task = next((t for t in self._tasks if t[1] == command), None)
        if task is None:
            return
        self._tasks.remove(task)
        output = (stdout.strip() or stderr.strip())[-TASK_OUTPUT:]
        if exit_code:
            output = f"exit {exit_code}" + (f": {output}" if output else "")
        await self._task(task, "complete" if exit_code == 0 else "error", output or None)

    async def finish(
        self,
        final_text: str | None = None,
        *,
        session_status: str | None = None,
        blocks: Sequence[dict[str, Any]] | None = None,
    ) -> str | None:
        """Send what is pending and close the reply; returns its first ts (None if nothing
        was shown).

        ``final_text`` replaces the whole text (when it extends what streamed, or nothing was
        shown yet) or is appended after what streamed. ``session_status`` goes with the
        stream's stop (Slack's agent session leaves "processing" in the same call);
        ``status_sent`` says whether it went. ``blocks`` (the feedback buttons) go under the
        reply's last message.
        """
        self.pacer.finished(self)
        if self._pending is not None:
            self._pending.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._pending
            self._pending = None
        if final_text is not None and final_text != self.text:
            if final_text.startswith(self.text):
                self.text = final_text
            elif self.ts is None:
                self.text, self._sent = final_text, 0
            else:
                self.text += "\n" + final_text
        if self.ts is None and not self.text.strip():
            return None
        async with self._lock:
            if not self.broken:
                try:
                    await self._close(session_status, list(blocks or []))
                    return self.ts
                except SLACK_FAILURES as exc:
                    log.warning(
                        "reply in %s: closing failed (%s); posting the rest", self.channel, exc
                    )
                    self.broken = True
            return await self._rescue()

    # -- text -----------------------------------------------------------------------------------

    async def _flush_later(self) -> None:
        await asyncio.sleep(max(0.0, self._wait_left()))
        self._pending = None
        if self._wait_left() > 0 and self._sent < len(self.text):
            # ``append`` sent a piece meanwhile (it grew past a small one): wait again.
            self._pending = asyncio.create_task(self._flush_later())
            return
        await self._flush()

    async def _flush(self, *, whole: bool = False) -> None:
        async with self._lock:
            await self._flush_locked(whole=whole)

    async def _flush_locked(self, *, whole: bool = False) -> None:
        if self.broken:
            return
        end = len(self.text) if whole else render.settled(self.text, self._sent)
        raw = self.text[self._sent : end]
        if not whole and len(self._shown) + len(raw) > self._limit() - APPEND_LIMIT:
            # Near the message's end: whole blocks only, so a cut can fall between them.
            raw = raw[: render.block_end(raw, render.open_fence(self._shown))]
        if not raw:
            return
        self._last = time.monotonic()
        try:
            await self._send(render.neutralise(raw))
        except SLACK_FAILURES as exc:
            log.warning("reply in %s: Slack call failed (%s); finishing later", self.channel, exc)
            self.broken = True
            return
        self._sent += len(raw)

    def _limit(self) -> int:
        return MESSAGE_LIMIT if self.streaming or self._current is None else APPEND_LIMIT

    async def _send(self, md: str) -> None:
        """Put ``md`` at the end of the reply: into the current message while it has room,
        then into new ones."""
        while md:
            if self._current is None:
                md = await self._open(md)
                continue
            room = self._limit() - len(self._shown)
            if len(md) <= room:
                md = await self._put(md)
                continue
            head, md = self._cut(md, room)
            if head:
                md = await self._put(head) + md
            if self._current is not None:
                await self._end_message()

    def _cut(self, md: str, room: int) -> tuple[str, str]:
        """The most of ``md`` that ends a block and fits in ``room``, and the rest. A code
        block the cut would fall in goes whole to the next message; one already open here (or
        longer than a message) is closed at the cut and reopened in the rest."""
        if room < MIN_ROOM:
            return "", md
        inside = render.open_fence(self._shown)
        head = render.split_markdown(md, room - 16, inside)[0]
        rest = md[len(head) :]
        opener = render.open_fence(self._shown + head)
        if opener is not None and inside is None and self._shown:
            return "", md  # a code block that starts here starts the next message instead
        if opener is not None:
            head += ("" if head.endswith("\n") else "\n") + render.closing_fence(opener) + "\n"
            rest = opener + "\n" + rest
        return head, rest

    async def _open(self, md: str) -> str:
        """Start a message with the beginning of ``md``; returns what it does not hold yet.

        A message starts at its first line with something on it: blank lines would show as an
        empty message, or an empty line atop one (a model may write a line break or two before
        its first tool call; the command's card, or its line, then starts the reply). Within
        an open message they still separate what comes before and after them."""
        md = _BLANK_LINES.sub("", md)
        if not md.strip():
            return ""
        if self.can_stream:
            first = render.split_markdown(md, APPEND_LIMIT)[0]
            if await self._start_stream(markdown_text=first):
                self._shown = first
                return md[len(first) :]
        head, rest = (md, "") if len(md) <= APPEND_LIMIT else self._cut(md, APPEND_LIMIT)
        response = await self.client.chat_postMessage(
            channel=self.channel, thread_ts=self.thread_ts, markdown_text=head
        )
        await self._opened(str(response["ts"]), streaming=False)
        self._shown = head
        if rest:
            await self._end_message()
        return rest

    async def _start_stream(self, **content: Any) -> bool:
        kwargs: dict[str, Any] = {"channel": self.channel, "thread_ts": self.thread_ts}
        if self.team and self.user:
            kwargs.update(recipient_team_id=self.team, recipient_user_id=self.user)
        try:
            response = await self.client.chat_startStream(**kwargs, **content)
        except SlackApiError as exc:
            log.debug("streaming unavailable (%s); posting and editing instead", exc)
            self.can_stream = False
            return False
        ts = response.get("ts")
        if not (response.get("ok") and isinstance(ts, str)):
            self.can_stream = False
            return False
        await self._opened(ts, streaming=True)
        return True

    async def _opened(self, ts: str, *, streaming: bool) -> None:
        self._current, self.streaming, self._shown = ts, streaming, ""
        self.parts.append(ts)
        if self.ts is None:
            self.ts = ts
            if self.on_start is not None:
                await self.on_start(ts)

    async def _put(self, md: str) -> str:
        """Add ``md`` to the current message (it fits); returns what a stream Slack ended
        meanwhile did not take."""
        assert self._current is not None
        if not self.streaming:
            shown = self._shown + md
            await self.client.chat_update(
                channel=self.channel, ts=self._current, markdown_text=shown
            )
            self._shown = shown
            return ""
        pieces = render.split_markdown(md, APPEND_LIMIT, render.open_fence(self._shown))
        for i, piece in enumerate(pieces):
            try:
                await self.client.chat_appendStream(
                    channel=self.channel, ts=self._current, markdown_text=piece
                )
            except SlackApiError as exc:
                if not _stream_gone(exc):
                    raise
                # Slack keeps what it shows; the rest goes on below (in its code block).
                opener = render.open_fence(self._shown)
                self._current, self._shown = None, ""
                return ("" if opener is None else opener + "\n") + "".join(pieces[i:])
            self._shown += piece
        return ""

    async def _end_message(self) -> None:
        """The current message is full: stop its stream (the reply goes on in a new one)."""
        current, self._current, self._shown = self._current, None, ""
        if self.streaming and current is not None:
            try:
                await self.client.chat_stopStream(channel=self.channel, ts=current)
            except SlackApiError as exc:
                if not _stream_gone(exc):
                    raise

    # -- task cards -----------------------------------------------------------------------------

    async def _task(self, task: tuple[str, str], status: str, output: str | None) -> None:
        async with self._lock:
            await self._flush_locked(whole=True)  # what was said before the command comes first
            if self.broken:
                return
            task_id, command = task
            title = render.neutralise(" ".join(command.split())[:200])
            chunk = TaskUpdateChunk(
                id=task_id,
                title=title,
                status=status,
                output=None if output is None else render.neutralise(output),
            )
            try:
                if (
                    self._current is None
                    and self.can_stream
                    and await self._start_stream(chunks=[chunk])
                ):
                    return
                if not self.can_stream:
                    if status == "in_progress":  # a workspace without streaming: a line
                        line = words.tool_started(command)
                        self.text += line
                        await self._flush_locked(whole=True)
                    return
                assert self._current is not None
                try:
                    await self.client.chat_appendStream(
                        channel=self.channel, ts=self._current, chunks=[chunk]
                    )
                except SlackApiError as exc:
                    if not _stream_gone(exc):
                        raise
                    self._current, self._shown = None, ""
                    await self._start_stream(chunks=[chunk])
            except SLACK_FAILURES as exc:
                log.warning("reply in %s: task card not shown (%s)", self.channel, exc)
                self.broken = True

    # -- the end --------------------------------------------------------------------------------

    async def _close(self, session_status: str | None, blocks: list[dict[str, Any]]) -> None:
        md = render.neutralise(self.text[self._sent :])
        # Cards still in progress (the turn was stopped, or failed) end as errors.
        unfinished = [
            TaskUpdateChunk(
                id=task_id, title=render.neutralise(command[:200]), status="error", output="stopped"
            )
            for task_id, command in self._tasks
        ]
        self._tasks.clear()
        last = ""
        room = self._limit() - len(self._shown)
        if self._current is not None and self.streaming and len(md) <= min(room, APPEND_LIMIT):
            last, md = md, ""  # the last words go with the stop itself
        if md:
            await self._send(md)
            self._sent = len(self.text)
        if self._current is None:
            return  # nothing of the reply is open any more: the status is set apart
        if not self.streaming:
            if blocks:
                await self._buttons(blocks)
            return
        try:
            await self._stop(last, unfinished, blocks, session_status)
        except SlackApiError as exc:
            if not _stream_gone(exc):
                raise
            # Slack ended the stream meanwhile: the last words and the buttons go below it.
            self._current, self._shown = None, ""
            if not last:
                return
            await self._send(last)
            if self._current is not None and self.streaming:
                await self._stop("", [], blocks, session_status)
            elif self._current is not None and blocks:
                await self._buttons(blocks)
        self._sent = len(self.text)

    async def _stop(
        self,
        last: str,
        chunks: list[TaskUpdateChunk],
        blocks: list[dict[str, Any]],
        session_status: str | None,
    ) -> None:
        assert self._current is not None
        kwargs: dict[str, Any] = {}
        if last:
            kwargs["markdown_text"] = last
        if chunks:
            kwargs["chunks"] = chunks
        if blocks:
            kwargs["blocks"] = blocks
        if session_status:
            kwargs["session_status"] = session_status
        await self.client.chat_stopStream(channel=self.channel, ts=self._current, **kwargs)
        self._shown += last
        self.status_sent = bool(session_status)

    async def _buttons(self, blocks: list[dict[str, Any]]) -> None:
        """Without a stream: the last message becomes a Markdown block with the buttons under
        it (``markdown_text`` does not go with blocks)."""
        assert self._current is not None
        await self.client.chat_update(
            channel=self.channel,
            ts=self._current,
            text=render.escape(self._shown[:300]),
            blocks=[{"type": "markdown", "text": self._shown}, *blocks],
        )

    async def _rescue(self) -> str | None:
        """After a failed call: close the stream if Slack lets us, and post what it did not
        confirm as messages of their own, so the reply is complete in the thread."""
        if self.streaming and self._current is not None:
            with contextlib.suppress(*SLACK_FAILURES):
                await self.client.chat_stopStream(channel=self.channel, ts=self._current)
        self._current = None
        rest = render.neutralise(self.text[self._sent :])
        if rest.strip():
            for piece in render.split_markdown(rest, APPEND_LIMIT):
                response = await self.client.chat_postMessage(
                    channel=self.channel, thread_ts=self.thread_ts, markdown_text=piece
                )
                self.parts.append(str(response["ts"]))
                self.ts = self.ts or str(response["ts"])
        self._sent = len(self.text)
        return self.ts
