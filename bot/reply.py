"""A reply that streams into a thread as the agent writes it, and always arrives whole.

Slack's streaming methods (``chat.startStream`` / ``appendStream`` / ``stopStream``) where the
workspace has them; otherwise one ``chat.postMessage`` updated with ``chat.update``. Either way
at most about one Web API call a second while text arrives (Slack rate-limits both), and the
first text goes out at once. 429s, 5xx answers and dropped connections are retried by
slack_sdk's retry handlers (``bot.web``).

A call that still fails does not fail the turn: the stream is marked broken, the text keeps
accumulating, and ``finish`` delivers whatever Slack has not confirmed in a new message in the
thread. A chunk Slack took but could not confirm may then show twice; nothing is ever lost.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import ClientError
from slack_sdk.errors import SlackApiError
from slack_sdk.web.async_client import AsyncWebClient

log = logging.getLogger(__name__)

# What a Web API call raises once slack_sdk's retries are spent.
SLACK_FAILURES = (SlackApiError, ClientError, asyncio.TimeoutError)


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
        on_start: Callable[[str], Awaitable[None]] | None = None,
    ) -> None:
        self.client = client
        self.channel = channel
        self.thread_ts = thread_ts
        self.team = team
        self.user = user
        self.interval = interval
        self.on_start = on_start  # told the reply's ts once it exists
        self.ts: str | None = None
        self.streaming = False
        self.broken = False  # a call failed after retries: the rest goes out at ``finish``
        self.session_status: str | None = None
        self.status_sent = False
        self.text = ""  # everything shown so far (and pending)
        self._sent = 0  # characters of ``text`` Slack confirmed
        self._last = 0.0
        self._pending: asyncio.Task[None] | None = None
        self._lock = asyncio.Lock()

    async def append(self, text: str) -> None:
        if not text:
            return
        self.text += text
        if self.broken:
            return
        if self.ts is None or time.monotonic() - self._last >= self.interval:
            await self._flush()
        elif self._pending is None:
            self._pending = asyncio.create_task(self._flush_later())

    async def _flush_later(self) -> None:
        await asyncio.sleep(max(0.0, self.interval - (time.monotonic() - self._last)))
        self._pending = None
        await self._flush()

    async def _flush(self) -> None:
        async with self._lock:
            if self.broken:
                return
            chunk = self.text[self._sent :]
            if not chunk and self.ts is not None:
                return
            self._last = time.monotonic()
            try:
                if self.ts is None:
                    await self._start(chunk)
                elif self.streaming:
                    try:
                        await self.client.chat_appendStream(
                            channel=self.channel, ts=self.ts, markdown_text=chunk
                        )
                    except SlackApiError as exc:
                        if not _stream_gone(exc):
                            raise
                        # Slack ended the stream (a stop button, its own time limit): the
                        # reply goes on as an ordinary message, edited in place.
                        self.streaming = False
                        await self.client.chat_update(
                            channel=self.channel, ts=self.ts, text=self.text
                        )
                else:
                    await self.client.chat_update(channel=self.channel, ts=self.ts, text=self.text)
            except SLACK_FAILURES as exc:
                log.warning(
                    "reply in %s: Slack call failed (%s); finishing later", self.channel, exc
                )
                self.broken = True
                return
            self._sent = len(self.text)

    async def _start(self, chunk: str) -> None:
        try:
            kwargs: dict[str, Any] = {"channel": self.channel, "thread_ts": self.thread_ts}
            if self.team and self.user:
                kwargs.update(recipient_team_id=self.team, recipient_user_id=self.user)
            response = await self.client.chat_startStream(markdown_text=chunk, **kwargs)
            ts = response.get("ts")
            if response.get("ok") and isinstance(ts, str):
                self.ts, self.streaming = ts, True
                await self._started()
                return
        except SlackApiError as exc:
            log.debug("streaming unavailable (%s); falling back to chat.update", exc)
        response = await self.client.chat_postMessage(
            channel=self.channel, thread_ts=self.thread_ts, text=chunk or "…"
        )
        self.ts = str(response["ts"])
        await self._started()

    async def _started(self) -> None:
        if self.on_start is not None and self.ts is not None:
            await self.on_start(self.ts)

    async def finish(
        self, final_text: str | None = None, *, session_status: str | None = None
    ) -> str | None:
        """Send what is pending and close the reply; returns its ts (None if nothing was shown).

        ``final_text`` replaces the whole text (fallback mode) or is appended after what streamed.
        ``session_status`` goes with the stream's stop (Slack's agent session leaves
        "processing" in the same call); ``status_sent`` says whether it went.
        """
        self.session_status = session_status
        if self._pending is not None:
            self._pending.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._pending
            self._pending = None
        if final_text is not None and final_text != self.text:
            if final_text.startswith(self.text):
                self.text = final_text
            elif self.ts is None or not self.streaming:
                self.text = final_text
                self._sent = 0 if self.ts is None else self._sent
            else:
                self.text += "\n" + final_text
        if self.ts is None and not self.text:
            return None
        async with self._lock:
            if not self.broken:
                try:
                    await self._close()
                    return self.ts
                except SLACK_FAILURES as exc:
                    log.warning(
                        "reply in %s: closing failed (%s); posting the rest", self.channel, exc
                    )
                    self.broken = True
            return await self._rescue()

    async def _close(self) -> None:
        if self.ts is None:
            await self._start(self.text)
            self._sent = len(self.text)
            if not self.streaming:
                return
        if self.streaming:
            assert self.ts is not None
            rest = self.text[self._sent :]
            kwargs: dict[str, Any] = {"markdown_text": rest} if rest else {}
            if self.session_status:
                kwargs["session_status"] = self.session_status
            try:
                await self.client.chat_stopStream(channel=self.channel, ts=self.ts, **kwargs)
                self.status_sent = bool(self.session_status)
            except SlackApiError as exc:
                if not _stream_gone(exc):
                    raise
                self.streaming = False
                await self.client.chat_update(channel=self.channel, ts=self.ts, text=self.text)
        else:
            assert self.ts is not None
            await self.client.chat_update(channel=self.channel, ts=self.ts, text=self.text)
        self._sent = len(self.text)

    async def _rescue(self) -> str | None:
        """After a failed call: close the stream if Slack lets us, and post what it did not
        confirm as a message of its own, so the reply is complete in the thread."""
        if self.streaming and self.ts is not None:
            with contextlib.suppress(*SLACK_FAILURES):
                await self.client.chat_stopStream(channel=self.channel, ts=self.ts)
        rest = self.text[self._sent :]
        if rest.strip():
            response = await self.client.chat_postMessage(
                channel=self.channel, thread_ts=self.thread_ts, text=rest
            )
            self.ts = self.ts or str(response["ts"])
        self._sent = len(self.text)
        return self.ts
