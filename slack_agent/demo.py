"""``slack-agent demo``: the first run, with no Slack workspace and no model key.

The real Bolt app (two replicas of it, each with its own engine) serves signed HTTP requests the
way Slack sends them, replies go to a local stand-in of the Slack Web API, the model is the
``offline`` stand-in (deterministic, labelled as such, able to run shell commands), and the
database is a fresh SQLite file. The script plays a short conversation and prints each thread as
a Slack user would see it: a threaded reply, a second replica meeting a busy session, a fork, a
rewind, a compaction, a tool of an MCP server (the small notes server shipped in
``standins.mcp_notes``) run only once a person approved it, and a restart that loses nothing.

``demo --web`` then keeps the stand-in Slack, the offline model, the database and a replica up,
serving the web page and its API on ``http://127.0.0.1:8000`` until Ctrl-C: the page's "Sign in
with Slack" goes to the stand-in's authorize page, which signs Alice in at once (no Slack needed),
and she finds the demo's sessions there to continue, approve, rewind and chart.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from aiohttp import web

from bot.service import Bot
from core.conversation.places import SLACK_PROJECT, SlackThread
from core.errors import ConfigError
from core.messages import assistant_message, user_message
from core.providers import UserMessage
from core.providers.offline import respond
from core.records import TurnLease
from core.settings import load_settings
from standins.mcp_notes import stdio_entry
from standins.server import serve_app
from standins.slack import TEAM, Message, SlackClient, SlackStandIn

SECRET = "demo-signing-secret"
WEB_HOST, WEB_PORT = "127.0.0.1", 8000
CHANNEL = "C0GENERAL"
NAMES = {"U0ALICE": "alice", "U0BOB": "bob"}
_MENTION = re.compile(r"<@([A-Z0-9]+)>")
_LINK = re.compile(r"<(https?://[^|>]+)\|([^>]+)>")


class DemoReplica:
    """One ``serve`` replica, in this process: the real app on its own port and engine."""

    def __init__(self, name: str, bot: Bot, runner: web.AppRunner, slack: SlackClient) -> None:
        self.name, self.bot, self.runner, self.slack = name, bot, runner, slack

    @classmethod
    async def start(
        cls,
        name: str,
        database_url: str,
        standin: SlackStandIn,
        mcp_config: str,
        *,
        port: int | None = None,
        **extra: Any,
    ) -> DemoReplica:
        """``port``: listen on ``WEB_HOST:port`` (the page's) rather than a free port."""
        settings = load_settings(
            database_url=database_url,
            mcp_config=mcp_config,
            slack_bot_token="xoxb-demo",
            slack_signing_secret=SECRET,
            slack_api_url=standin.api_url,
            model_provider="offline",
            busy_poll_seconds=0.2,
            sweeper_interval_seconds=0,
            _env_file=None,
            **extra,
        )
        bot = await Bot.open(settings)
        bot.answers.pacer.base = 0.2
        bot.start()
        # As serve does: no acknowledgement waits on auth.test or opens a connection.
        await bot.prepare_to_listen()
        if port is None:
            runner, url = await serve_app(bot.web_app())
        else:
            runner, url = await _listen(bot, port)
        slack = await SlackClient(url, team=TEAM, secret=SECRET).__aenter__()
        return cls(name, bot, runner, slack)

    async def stop(self) -> None:
        await self.slack.__aexit__()
        await self.runner.cleanup()
        await self.bot.close()


class Slack:
    """What Slack does for the people in the demo: keep their post, send the signed request
    to the replica it reaches."""

    def __init__(self, standin: SlackStandIn) -> None:
        self.standin = standin

    @staticmethod
    def _ok(replica: DemoReplica, status: int) -> None:
        if status != 200:
            raise RuntimeError(f"{replica.name} answered {status}")

    async def say(
        self, replica: DemoReplica, user: str, text: str, thread_ts: str | None = None
    ) -> str:
        mention = thread_ts is None
        shown = (f"@agent {text}" if mention else text).strip()
        ts = self.standin.user_post(CHANNEL, user, shown, thread_ts)
        kind = "app_mention" if mention else "message"
        return await replica.slack.message(
            text, user=user, channel=CHANNEL, ts=ts, thread_ts=thread_ts, mention=mention, kind=kind
        )

    async def shortcut(
        self, replica: DemoReplica, user: str, callback_id: str, message: Message
    ) -> None:
        status = await replica.slack.shortcut(
            callback_id,
            message_ts=message.ts,
            thread_ts=message.thread_ts,
            user=user,
            channel=CHANNEL,
        )
        self._ok(replica, status)

    async def submit(self, replica: DemoReplica, user: str, view: dict[str, Any]) -> None:
        """A person pressing a modal's submit button."""
        self._ok(replica, await replica.slack.submit_view(view, user=user))

    async def click(self, replica: DemoReplica, user: str, ephemeral: Message, label: str) -> None:
        action_id, value = ephemeral.values[ephemeral.buttons.index(label)].split("\x00", 1)
        self._ok(replica, await replica.slack.button(action_id, value, user=user, channel=CHANNEL))

    async def until(self, condition: Callable[[], Any], within: float = 30.0) -> Any:
        try:
            return await self.standin.wait_for(condition, within)
        except AssertionError:
            raise RuntimeError("the demo timed out waiting for the app") from None


def _replies(standin: SlackStandIn, root: str) -> list[Message]:
    return [p for p in standin.thread(CHANNEL, root) if p.author == "agent" and p.ts != root]


def _settled(standin: SlackStandIn, root: str, count: int) -> Callable[[], bool]:
    """``count`` agent replies in the thread, and the last one finished streaming."""

    def check() -> bool:
        replies = [p for p in _replies(standin, root) if "Thinking" not in p.text]
        stopped = standin.named("chat.stopStream", "chat.update")
        return len(replies) >= count and bool(stopped)

    return check


def print_thread(standin: SlackStandIn, root: str, viewer: str, title: str) -> None:
    print(f"\n── {title} (as {NAMES.get(viewer, viewer)} sees it) " + "─" * 20)
    for p in standin.thread(CHANNEL, root, viewer):
        who = NAMES.get(p.author, p.author)
        tag = " (only visible to you)" if p.visible_to else ""
        lines = _as_shown(p.text).strip().splitlines()
        shown = lines[:12] + (["…"] if len(lines) > 12 else [])
        for task in p.tasks.values():
            output = f": {task['output']}" if task.get("output") else ""
            shown.append(f"⚙ {task['title']} ({task['status']}){output}")
        # A message that is only a task card (a reply that began with a command) shows the
        # card on the author's line, as Slack shows it under the app's name: no empty line.
        first, *rest = shown or [""]
        print(f"  {who}{tag}: {first}")
        for line in rest:
            print(f"  {' ' * len(who)}  {line}")
        if p.buttons:
            print(f"  {' ' * len(who)}  [{'] ['.join(p.buttons)}]")


def _as_shown(text: str) -> str:
    """Mentions and links as Slack shows them (``<@U0ALICE>`` as ``@alice``, a link with a
    label as the label, its address after it in brackets: a terminal has no link to click)."""
    text = _LINK.sub(lambda m: f"{m.group(2)} ({m.group(1)})", text)
    return _MENTION.sub(lambda m: "@" + NAMES.get(m.group(1), m.group(1)), text)


async def _listen(bot: Bot, port: int) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(bot.web_app(), access_log=None, shutdown_timeout=1.0)
    await runner.setup()
    try:
        await web.TCPSite(runner, WEB_HOST, port).start()
    except OSError as exc:
        await runner.cleanup()
        await bot.close()
        raise ConfigError(
            f"demo --web: cannot listen on {WEB_HOST}:{port} ({exc.strerror}); is it in use?"
        ) from exc
    return runner, f"http://{WEB_HOST}:{port}"


async def run_demo(*, web_page: bool = False, port: int = WEB_PORT) -> None:
    """The story; with ``web_page``, then the page on ``port`` until cancelled (Ctrl-C)."""
    with tempfile.TemporaryDirectory() as tmp:
        async with SlackStandIn(TEAM, history=True) as standin:
            url = f"sqlite+aiosqlite:///{Path(tmp) / 'demo.db'}"
            await _play(standin, Slack(standin), url, Path(tmp))
            if web_page:
                await keep_the_page_up(standin, url, Path(tmp), port)


async def keep_the_page_up(standin: SlackStandIn, url: str, tmp: Path, port: int) -> None:
    """A replica serving the page and its API on ``port``, Alice signed in by the stand-in's
    authorize page (and an admin, so every page of it shows), until cancelled."""
    alice = "U0ALICE"
    standin.sign_in_as = alice
    replica = await DemoReplica.start(
        "the page",
        url,
        standin,
        _mcp_config(tmp),
        port=port,
        slack_signin_client_id="demo.client",
        slack_signin_client_secret="demo-client-secret",
        slack_openid_authorize_url=standin.authorize_url,
        admin_user_ids=f"{TEAM}:{alice}",
    )
    page = f"http://{WEB_HOST}:{port}"
    print(f"\nThe web page: {page} (Sign in with Slack signs you in as alice; no Slack needed).")
    print("The stand-in Slack, the offline model and the page stay up until Ctrl-C.", flush=True)
    try:
        await asyncio.Event().wait()
    finally:
        await replica.stop()


def _mcp_config(tmp: Path) -> str:
    """An ``MCP_CONFIG`` naming the notes server shipped in the repository (stdio), its notes
    kept in a file of the demo's temporary directory."""
    notes = {"MCP_NOTES_FILE": str(tmp / "notes.json")}
    path = tmp / "mcp.json"
    path.write_text(json.dumps({"mcpServers": {"notes": stdio_entry(notes)}}))
    return str(path)


async def _play(standin: SlackStandIn, slack: Slack, url: str, tmp: Path) -> None:
    alice, bob = "U0ALICE", "U0BOB"
    print("slack-agent demo: the real app against a local Slack stand-in, the offline model")
    print("(a deterministic stand-in, not a language model), a fresh SQLite database and a")
    print("small notes MCP server.")
    mcp = _mcp_config(tmp)
    a = await DemoReplica.start("replica A", url, standin, mcp)
    b = await DemoReplica.start("replica B", url, standin, mcp)

    # 1. A mention starts a session in the thread; the reply streams into it.
    root = await slack.say(a, alice, "hello! what can you do?")
    await slack.until(_settled(standin, root, 1))
    # 2. A slow turn (a shell command in the sandbox) on replica A; Bob writes in the thread
    #    meanwhile and his message lands on replica B: it waits for the thread's own turn and
    #    is answered right after, by whichever replica, in order.
    await slack.say(
        a, alice, "$ sleep 2; echo 'step one done' > notes.txt; cat notes.txt", thread_ts=root
    )
    await slack.until(lambda: len(_replies(standin, root)) >= 2)
    await slack.say(b, bob, "is the build done?", thread_ts=root)
    await slack.until(
        lambda: any("right after" in p.text for p in standin.thread(CHANNEL, root, bob))
    )
    print_thread(standin, root, bob, "#general, while replica A works")
    await slack.until(lambda: len(_replies(standin, root)) >= 3 and _done(standin, 3))
    print_thread(standin, root, bob, "#general, once the first reply was done")

    # 2b. Someone continues the same session from the terminal; Bob's next message meets a
    #     session busy elsewhere, waits, and is offered to him once the terminal is done.
    question = "summarise the thread"
    terminal = await _terminal_turn(a.bot, root, question)
    await slack.say(b, bob, "and the tests?", thread_ts=root)

    def offer() -> Message | None:
        return next((p for p in standin.thread(CHANNEL, root, bob) if p.buttons), None)

    await slack.until(
        lambda: any("used elsewhere" in p.text for p in standin.thread(CHANNEL, root, bob))
    )
    answer = respond([UserMessage(question)], []).text  # what the offline model answers
    await a.bot.runtime.storage.sessions.finish(terminal, [assistant_message(answer)])
    print("\n── the terminal: a turn in the same conversation while Bob writes " + "─" * 10)
    print(f"  > {question}\n  agent\n  {answer}")
    waiting = await slack.until(offer)
    print_thread(standin, root, bob, "#general, while the terminal client held the session")
    await slack.click(b, bob, waiting, "Send")
    await slack.until(lambda: len(_replies(standin, root)) >= 5 and _done(standin, 4))

    # 2c. The real terminal client (`slack-agent chat` given the thread's permalink) continues
    #     the thread. Alice's next message in Slack meets a session that moved on elsewhere: the
    #     thread first shows what the terminal added, and she sends hers anyway.
    link = SlackThread(TEAM, CHANNEL, root).permalink
    await _terminal_client(
        url, link, ["$ echo 'step two done (terminal)' >> notes.txt; cat notes.txt"]
    )
    await slack.say(a, alice, "what did the terminal do?", thread_ts=root)

    def send_anyway() -> Message | None:
        return next(
            (p for p in standin.thread(CHANNEL, root, alice) if "Send anyway" in p.buttons), None
        )

    stale = await slack.until(send_anyway)
    print_thread(standin, root, alice, "#general, after the terminal client continued it")
    await slack.click(a, alice, stale, "Send anyway")
    await slack.until(lambda: _done(standin, 5))

    # 3. Bob forks from the reply that made notes.txt: the files come along.
    replies = _replies(standin, root)
    notes_reply = replies[1]
    await slack.shortcut(b, bob, "fork_session", notes_reply)
    await slack.until(
        lambda: any("Forked." in p.text for p in standin.messages.values() if p.visible_to == bob)
    )
    fork_head = next(p for p in standin.messages.values() if "Forked from" in p.text)
    await slack.say(b, bob, "$ cat notes.txt", thread_ts=fork_head.ts)
    await slack.until(lambda: len(_replies(standin, fork_head.ts)) >= 2 and _done(standin, 6))
    print_thread(standin, fork_head.ts, bob, "#general, Bob's fork")

    # 4. Alice rewinds her thread to the first reply (after confirming how many messages will
    #    leave); the later replies are marked.
    opened = len(standin.views)
    await slack.shortcut(a, alice, "rewind_session", replies[0])
    await slack.until(lambda: len(standin.views) > opened)
    confirm = standin.views[-1]
    print(f"\n── the confirmation Alice sees ── {confirm['blocks'][0]['text']['text']}")
    await slack.submit(a, alice, confirm)
    await slack.until(
        lambda: sum(p.text.startswith("~(rewound") for p in _replies(standin, root)) >= 2
    )
    # 5. ... and compacts it into a checkpoint.
    await slack.shortcut(a, alice, "compact_session", replies[0])
    await slack.until(lambda: any("compacted" in p.text for p in _replies(standin, root)))
    print_thread(standin, root, alice, "#general, after rewind and compaction")

    # 5b. A tool of an MCP server that can change something asks first: the turn stops at the
    #     call and the thread gets a card; Alice (the conversation's owner) approves it on the
    #     other replica, and the call runs once and the answer continues.
    await _approval(standin, slack, a, b, alice, tmp)

    # 6. Restart: both replicas stop; a new one picks the thread up from the database.
    before = await _transcript(a.bot, root)
    await a.stop()
    await b.stop()
    c = await DemoReplica.start("replica C", url, standin, mcp)
    after = await _transcript(c.bot, root)
    await slack.say(c, alice, "still there after the restart?", thread_ts=root)
    await slack.until(lambda: any("still there" in p.text for p in _replies(standin, root)))
    print_thread(standin, root, alice, "#general, after a restart")
    await c.stop()
    print(
        f"\nRestart: {len(before)} messages stored before, {len(after)} after, "
        f"{'nothing lost' if before == after else 'MISMATCH'}."
    )
    print("Next: create the app from manifest.yml and run `slack-agent serve` (see README).")


async def _approval(
    standin: SlackStandIn, slack: Slack, a: DemoReplica, b: DemoReplica, alice: str, tmp: Path
) -> None:
    for replica in (a, b):  # the notes server starts in the background with each replica
        tools = replica.bot.runtime.tools
        if tools is None:
            raise RuntimeError("the demo's MCP server is not configured")
        async with asyncio.timeout(60):
            await tools.wait_for("notes", "connected")
    call = 'mcp__notes__add_note {"title": "release", "text": "ship on friday"}'
    root = await slack.say(a, alice, call)

    def card() -> Message | None:
        return next(
            (p for p in standin.thread(CHANNEL, root, alice) if "Approve" in p.buttons), None
        )

    waiting = await slack.until(card)
    print_thread(standin, root, alice, "#general, the agent asks before it writes a note")
    await slack.click(b, alice, waiting, "Approve")

    def continued() -> bool:
        thread = _replies(standin, root)
        ran = any("the call ran" in p.text for p in thread)  # the card shows the outcome
        # the answer continued: its task card shows the result, its text says how it ended
        return ran and any(
            not p.streaming and "answered" in p.text and "saved note" in str(p.tasks)
            for p in thread
        )

    await slack.until(continued)
    print_thread(standin, root, alice, "#general, after Alice approved on replica B")
    notes = json.loads((tmp / "notes.json").read_text())
    print(f"\nThe notes server now holds: {json.dumps(notes)}")


async def _terminal_turn(bot: Bot, root: str, question: str) -> TurnLease:
    """A turn started outside Slack, as ``slack-agent chat`` starts one (the core, directly)."""
    session = await bot.runtime.storage.sessions.find_session(
        SLACK_PROJECT, SlackThread(TEAM, CHANNEL, root).key
    )
    assert session is not None
    tail = await bot.runtime.storage.sessions.tail(session.id)
    return await bot.runtime.storage.sessions.start_turn(
        session.id,
        user_message=user_message(question),
        last_message_id=tail.message_id if tail else None,
    )


async def _terminal_client(url: str, link: str, lines: list[str]) -> None:
    """Run ``slack-agent chat LINK`` as its own process on the demo's database, typing
    ``lines`` into it, and print what it printed from the first line typed on."""
    env = {**os.environ, "DATABASE_URL": url, "MODEL_PROVIDER": "offline", "LOG_LEVEL": "WARNING"}
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "bot",
        "chat",
        link,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        env=env,
    )
    out, _ = await proc.communicate("".join(f"{line}\n" for line in lines).encode())
    printed = out.decode(errors="replace").splitlines()
    typed = next((i for i, line in enumerate(printed) if line.startswith("> ")), 0)
    print(f"\n── the terminal: slack-agent chat {link} " + "─" * 10)
    print(f"  {printed[0] if printed else ''}")
    print("  … (the thread's history) …")
    for line in printed[typed:]:
        print(f"  {line.rstrip()}")
    if proc.returncode != 0:
        raise RuntimeError(f"slack-agent chat ended with status {proc.returncode}")


def _done(standin: SlackStandIn, streams: int) -> bool:
    return len(standin.named("chat.stopStream")) >= streams


async def _transcript(bot: Bot, root: str) -> list[str]:
    session = await bot.runtime.storage.sessions.find_session(
        SLACK_PROJECT, SlackThread(TEAM, CHANNEL, root).key
    )
    if session is None:
        return []
    return [m.message_id for m in await bot.runtime.storage.sessions.messages(session.id)]
