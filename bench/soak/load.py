"""The soak's load: what Slack sends a busy workspace's replicas, signed, on 127.0.0.1.

``Plan`` decides, from a seed, every message of every thread and when it is sent: each thread
starts with a mention and goes on with follow-ups (some in quick bursts, so they arrive while
the thread's turn runs); some mentions arrive twice, as ``app_mention`` and as ``message``; a
share of deliveries is repeated as Slack's retries (``X-Slack-Retry-Num``). ``Sender`` delivers
them through a "load balancer" (a replica chosen per request) and behaves as Slack does when
a request fails or is refused: it sends the same event again, to whichever replica, until one
answers 200. Every answer is recorded: status, latency, and when.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import aiohttp

from standins.slack import BOT_USER, TEAM, signed_headers

CHANNEL = "C0SOAK"


@dataclass(frozen=True)
class Send:
    at: float  # seconds from the start
    ts: str
    thread_ts: str
    text: str
    kind: str  # "app_mention" or "message"
    user: str
    retry: int = 0  # X-Slack-Retry-Num (0: first delivery)


@dataclass
class Plan:
    sends: list[Send]
    messages: dict[str, str]  # ts -> thread_ts, every distinct message

    @classmethod
    def make(
        cls,
        *,
        threads: int,
        messages: int,
        seconds: float,
        retry_share: float,
        pair_share: float,
        seed: int,
    ) -> Plan:
        rng = random.Random(seed)
        base = int(time.time()) - 10
        counter = itertools.count(1)

        def new_ts() -> str:
            return f"{base}.{next(counter):06d}"

        sends: list[Send] = []
        distinct: dict[str, str] = {}
        per_thread = [
            messages // threads + (1 if i < messages % threads else 0) for i in range(threads)
        ]
        for t, count in enumerate(per_thread):
            tag = f"[t{t:03d}]"
            user = f"U{t % 7:07d}"
            root_at = rng.uniform(0, seconds * 0.25)
            root = new_ts()
            distinct[root] = root
            text = f"<@{BOT_USER}> {tag} hello, question 0"
            sends.append(Send(root_at, root, root, text, "app_mention", user))
            if rng.random() < pair_share:  # the same mention also as a message event
                sends.append(Send(root_at, root, root, text, "message", user))
            times = sorted(rng.uniform(root_at + 0.05, seconds) for _ in range(count - 1))
            if count > 3 and rng.random() < 0.3:  # a burst: follow-ups while the turn runs
                start = times[0]
                times[:3] = [start, start + 0.05, start + 0.1]
                times.sort()
            for k, at in enumerate(times, start=1):
                ts = new_ts()
                distinct[ts] = root
                who = user if rng.random() < 0.7 else f"U{(t + k) % 7:07d}"
                sends.append(Send(at, ts, root, f"{tag} follow-up {k}", "message", who))
        retries = [
            Send(s.at + rng.uniform(0.0, 3.0), s.ts, s.thread_ts, s.text, s.kind, s.user, 1)
            for s in sends
            if rng.random() < retry_share
        ]
        return cls(sorted([*sends, *retries], key=lambda s: s.at), distinct)


@dataclass
class Answer:
    at: float  # seconds from the start, when the answer arrived
    status: int  # 0: the connection failed
    ms: float
    replica: int = -1  # which of ``Sender.urls`` answered


@dataclass
class Sender:
    """Delivers a plan's sends like Slack: signed, each to some replica, again on failure."""

    urls: list[str]
    secret: str
    started: float = field(default_factory=time.monotonic)
    answers: list[Answer] = field(default_factory=list)
    acknowledged: set[str] = field(default_factory=set)  # ts of messages some replica took
    abandoned: set[str] = field(default_factory=set)  # ts Slack would have given up on
    # Called with each message before its event is first sent: Slack stores a message before
    # it tells the app (a stray's words are read back from the thread when it is adopted).
    posted: Callable[[Send], object] | None = None
    _rng: random.Random = field(default_factory=lambda: random.Random(7))
    _ids: itertools.count[int] = field(default_factory=lambda: itertools.count(1))

    async def run(self, plan: Plan, http: aiohttp.ClientSession) -> None:
        tasks = []
        for send in plan.sends:
            delay = send.at - (time.monotonic() - self.started)
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(self._deliver(send, http)))
        await asyncio.gather(*tasks)

    async def _deliver(self, send: Send, http: aiohttp.ClientSession) -> None:
        if self.posted is not None:
            self.posted(send)  # again for a retry or a double: the same message, kept once
        event = {
            "type": send.kind,
            "user": send.user,
            "text": send.text,
            "ts": send.ts,
            "channel": CHANNEL,
            "event_ts": send.ts,
            "channel_type": "channel",
            "team": TEAM,
        }
        if send.thread_ts != send.ts:
            event["thread_ts"] = send.thread_ts
        payload = {
            "team_id": TEAM,
            "api_app_id": "A0SOAK",
            "type": "event_callback",
            "event_id": f"Ev{next(self._ids):09d}",
            "event_time": int(time.time()),
            "event": event,
        }
        retry = send.retry
        # Slack retries a failed delivery three times (after about 1 s, 1 min and 5 min); the
        # soak keeps the count and condenses the schedule so a run stays within minutes.
        for wait in (0.0, 1.0, 4.0, 10.0, 20.0):
            await asyncio.sleep(wait)
            body = json.dumps(payload)
            headers = signed_headers(body, secret=self.secret)
            if retry:
                headers.update(
                    {"X-Slack-Retry-Num": str(retry), "X-Slack-Retry-Reason": "http_error"}
                )
            replica = self._rng.choice(self.urls)
            url = replica + "/slack/events"
            begun = time.monotonic()
            try:
                async with http.post(url, data=body.encode(), headers=headers) as response:
                    await response.read()
                    status = response.status
            except (aiohttp.ClientError, OSError):
                status = 0
            now = time.monotonic()
            self.answers.append(
                Answer(now - self.started, status, (now - begun) * 1000, self.urls.index(replica))
            )
            if status == 200:
                self.acknowledged.add(send.ts)
                return
            retry += 1
        self.abandoned.add(send.ts)
