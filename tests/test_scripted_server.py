"""The scripted stand-in counts a conversation's model calls at once exactly: the soak's "never
two model calls at once" rests on it."""

from __future__ import annotations

import asyncio

import aiohttp

from standins.scripted import ScriptedServer, SseReply, sse_frame

FRAMES = [sse_frame({"n": 1}), sse_frame({"n": 2})]


def _slow() -> SseReply:
    return SseReply(FRAMES, split=False, linger=5.0)  # silent after its frames, until hung up


async def test_a_call_whose_client_left_is_not_counted_with_the_next() -> None:
    """A client that gives up on a call (a model timeout) and makes the next one at once: the
    first ended before the second began, though the server's answer would still pause."""
    async with ScriptedServer(key=lambda body: str(body["tag"])) as server:
        server.push(_slow(), _slow())
        async with aiohttp.ClientSession() as http:
            response = await http.post(f"{server.url}/v1", json={"tag": "t1"})
            await response.content.readany()
            response.close()  # the client's timeout: the connection is dropped
            second = await http.post(f"{server.url}/v1", json={"tag": "t1"})
            await second.content.readany()
            second.close()
        await asyncio.sleep(0.1)
    assert server.overlapping() == {}
    assert server.overlaps("t1") == []
    assert [span.end is not None for span in server.spans_by["t1"]] == [True, True]


async def test_two_calls_of_one_conversation_at_once_are_counted() -> None:
    async with ScriptedServer(key=lambda body: str(body["tag"])) as server:
        server.push(_slow(), _slow(), _slow())
        async with aiohttp.ClientSession() as http:
            first = await http.post(f"{server.url}/v1", json={"tag": "t1"})
            await first.content.readany()
            other = await http.post(f"{server.url}/v1", json={"tag": "t2"})
            await other.content.readany()
            second = await http.post(f"{server.url}/v1", json={"tag": "t1"})
            await second.content.readany()
            for response in (first, other, second):
                response.close()
        await asyncio.sleep(0.1)
    assert server.overlapping() == {"t1": 2}
    ((a, b),) = server.overlaps("t1")
    assert (a.number, b.number) == (1, 3)
