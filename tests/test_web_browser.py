"""The web page in a real browser: Playwright driving Debian's Chromium (``/usr/bin/chromium``;
``.ci/run`` installs it) against the real listener serving the HTTP API and the page, with the
stand-in Slack (which also answers Sign in with Slack) and the offline or gated model.

Every test signs in through the page's own "Sign in with Slack" link, as a person would. The page
is not a database rule (the API's tests run on both databases), so these run on SQLite only.
"""

from __future__ import annotations

import asyncio
import json
import shutil
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
from playwright.async_api import Browser, BrowserContext, Page, async_playwright, expect

from standins.openai import GatedModel
from standins.otlp import OtlpReceiver
from standins.slack import SlackClient, SlackStandIn
from tests.mcp_support import notes
from tests.slack_harness import RunningBot, running_bot
from tests.test_slack_approvals import cards, click, connected, mcp

pytestmark = [pytest.mark.slow, pytest.mark.parametrize("backend", ["sqlite"])]

CHROMIUM = "/usr/bin/chromium"
ADD = 'mcp__notes__add_note {"title": "plan", "text": "ship friday"}'
# Generous: the machine is shared; these bound waits, they assert no speed.
SECONDS = 30_000


@asynccontextmanager
async def chromium() -> AsyncIterator[Browser]:
    if shutil.which(CHROMIUM) is None:
        pytest.fail(f"the browser tests need Chromium at {CHROMIUM} (apt-get install chromium)")
    async with async_playwright() as playwright:
        browser = await playwright.chromium.launch(executable_path=CHROMIUM)
        try:
            yield browser
        finally:
            await browser.close()


@asynccontextmanager
async def web(
    database_url: str, slack: SlackStandIn, **settings: Any
) -> AsyncIterator[tuple[RunningBot, Browser]]:
    signin = {
        "slack_signin_client_id": "A1.client",
        "slack_signin_client_secret": "secret",
        "slack_openid_authorize_url": slack.authorize_url,
    }
    async with running_bot(database_url, slack, **signin, **settings) as bot, chromium() as browser:
        yield bot, browser


async def signed_in(
    browser: Browser, bot: RunningBot, slack: SlackStandIn, user: str = "U1", **options: Any
) -> tuple[BrowserContext, Page]:
    """A new browser (its own cookies) signed in as ``user`` through the page's link: the
    stand-in Slack's authorize page signs in the person it is told to."""
    slack.sign_in_as = user
    context = await browser.new_context(base_url=bot.url, **options)
    page = await context.new_page()
    await page.goto("/")
    await page.get_by_role("link", name="Sign in with Slack").click()
    await expect(page.get_by_role("heading", name="Sessions")).to_be_visible(timeout=SECONDS)
    return context, page


async def web_session(page: Page) -> int:
    """A new web session made with the page's button; its id."""
    await page.get_by_role("button", name="New session").click()
    await page.wait_for_url("**/sessions/*", timeout=SECONDS)
    return int(page.url.rsplit("/", 1)[-1])


async def send(page: Page, text: str) -> None:
    composer = page.get_by_label("Message")
    await composer.fill(text)
    await composer.press("Enter")


def transcript(page: Page) -> Any:
    return page.get_by_role("list", name="Transcript")


async def api(page: Page, method: str, path: str, body: Any = None, csrf: str | None = "me") -> Any:
    """A request from inside the page (its cookie); ``csrf="me"`` sends the person's token."""
    return await page.evaluate(
        """async ([method, path, body, csrf]) => {
            const headers = {"Content-Type": "application/json"};
            if (csrf === "me") {
                headers["X-CSRF-Token"] = (await (await fetch("/v1/me")).json()).csrfToken;
            } else if (csrf !== null) {
                headers["X-CSRF-Token"] = csrf;
            }
            const r = await fetch(path, {method, headers,
                body: body === null ? undefined : JSON.stringify(body)});
            return {status: r.status, body: await r.text()};
        }""",
        [method, path, body, csrf],
    )


def slack_session_id(page_url: str) -> int:
    return int(page_url.rsplit("/", 1)[-1])


async def open_slack_thread(page: Page, thread_title: str) -> int:
    """From the list, the session of a Slack thread (found by its title)."""
    await page.goto("/")
    await page.get_by_role("link", name=thread_title).first.click()
    await page.wait_for_url("**/sessions/*", timeout=SECONDS)
    return slack_session_id(page.url)


# -- sign-in, list, chat -----------------------------------------------------------------------


async def test_web__sign_in_lists_sessions_with_their_place_and_signs_out(
    database_url: str, slack: SlackStandIn
) -> None:
    async with web(database_url, slack) as (bot, browser), SlackClient(bot.url) as client:
        root = await client.message("hello from slack", mention=True)
        await slack.wait_for(lambda: slack.named("chat.stopStream"))
        context, page = await signed_in(browser, bot, slack)
        rows = page.get_by_role("list", name="Sessions")
        await expect(rows).to_contain_text("hello from slack", timeout=SECONDS)
        place = rows.get_by_role("link", name="Slack thread ↗")
        await expect(place).to_be_visible()
        link = await place.get_attribute("href") or ""
        assert "C1" in link
        assert root.replace(".", "") in link
        session = await web_session(page)
        await page.goto("/")
        row = page.locator(f'[data-session-id="{session}"]')
        await expect(row.get_by_text("Web", exact=True)).to_be_visible(timeout=SECONDS)
        await page.get_by_label("Search sessions").fill("hello from")
        await expect(page.locator(f'[data-session-id="{session}"]')).to_have_count(
            0, timeout=SECONDS
        )
        await expect(rows).to_contain_text("hello from slack")
        await page.get_by_role("button", name="Sign out").click()
        await expect(page.get_by_role("link", name="Sign in with Slack")).to_be_visible(
            timeout=SECONDS
        )
        await context.close()


async def test_web__send_and_see_the_streamed_answer_with_its_usage(
    database_url: str, slack: SlackStandIn
) -> None:
    async with web(database_url, slack) as (bot, browser):
        _, page = await signed_in(browser, bot, slack)
        await web_session(page)
        await send(page, "hello from the page")
        await expect(transcript(page)).to_contain_text("hello from the page", timeout=SECONDS)
        answer = transcript(page).locator('[data-role="assistant"]')
        await expect(answer).to_contain_text("[offline stand-in]", timeout=SECONDS)
        await expect(answer.get_by_label("Usage of this answer")).to_be_visible(timeout=SECONDS)
        await expect(page.get_by_label("Message")).to_be_enabled()
        await expect(page.get_by_label("Message")).to_have_value("")
        # Reloaded, the same transcript comes from the server.
        await page.reload()
        await expect(transcript(page)).to_contain_text("hello from the page", timeout=SECONDS)
        await expect(transcript(page).locator('[data-role="assistant"]')).to_have_count(1)


TRACES = "http://phoenix:6006/projects/p/traces/{trace_id}"


async def test_web__view_trace_links_the_answer_to_the_trace_that_was_exported(
    database_url: str, slack: SlackStandIn
) -> None:
    """With tracing on and ``TRACE_URL_TEMPLATE`` set, a streamed answer carries *View trace*,
    and the link is the template filled with the id of the trace the collector received for
    that turn; reloaded, the stored answer links to the same trace."""
    async with OtlpReceiver() as collector:
        async with web(
            database_url,
            slack,
            otel_exporter_otlp_traces_endpoint=collector.endpoint,
            trace_url_template=TRACES,
        ) as (bot, browser):
            _, page = await signed_in(browser, bot, slack)
            await web_session(page)
            await send(page, "hello, traced")
            answer = transcript(page).locator('[data-role="assistant"]')
            link = answer.get_by_role("link", name="View trace")
            await expect(link).to_be_visible(timeout=SECONDS)
            streamed = await link.get_attribute("href")
            assert await link.get_attribute("target") == "_blank"
            await page.reload()
            link = (
                transcript(page)
                .locator('[data-role="assistant"]')
                .get_by_role("link", name="View trace")
            )
            await expect(link).to_be_visible(timeout=SECONDS)
            stored = await link.get_attribute("href")
        # The bot flushed its spans when it closed: the turn's trace is the one linked.
        (trace_id,) = collector.traces()
    assert streamed == stored == TRACES.format(trace_id=trace_id)


# -- busy elsewhere, stale, idle ---------------------------------------------------------------


def gated(model: GatedModel) -> dict[str, Any]:
    return {
        "model_provider": "openai",
        "openai_api_key": "sk-test",
        "openai_base_url": model.base_url,
    }


async def test_web__busy_while_a_slack_turn_runs_then_the_slack_answer_is_swapped_in(
    database_url: str, slack: SlackStandIn, model: GatedModel
) -> None:
    async with (
        web(database_url, slack, **gated(model)) as (bot, browser),
        SlackClient(bot.url) as client,
    ):
        model.release()
        thread = await client.message("first", mention=True)
        await slack.wait_for(lambda: slack.named("chat.stopStream"))
        model.gate.clear()
        _, page = await signed_in(browser, bot, slack)
        await open_slack_thread(page, "first")
        await expect(transcript(page)).to_contain_text("answer 1", timeout=SECONDS)
        await page.evaluate("window.notReloaded = true")
        model.arrived.clear()
        await client.message("second, from slack", thread_ts=thread, mention=True)
        await asyncio.wait_for(model.arrived.wait(), SECONDS / 1000)
        await send(page, "from the page meanwhile")
        composer = page.get_by_label("Message")
        await expect(page.get_by_text("Session is being used elsewhere")).to_be_visible(
            timeout=SECONDS
        )
        await expect(composer).to_be_disabled()
        await expect(composer).to_have_value("from the page meanwhile")
        await expect(transcript(page)).not_to_contain_text("from the page meanwhile")
        model.release()
        await expect(transcript(page)).to_contain_text("answer 2", timeout=SECONDS)
        await expect(transcript(page)).to_contain_text("second, from slack")
        await expect(composer).to_be_enabled(timeout=SECONDS)
        await expect(page.get_by_text("Session is being used elsewhere")).to_have_count(0)
        await expect(composer).to_have_value("from the page meanwhile")
        assert await page.evaluate("window.notReloaded === true")
        await composer.press("Enter")
        await expect(transcript(page)).to_contain_text("answer 3", timeout=SECONDS)


async def test_web__stale_refetches_keeps_the_draft_and_says_so_once(
    database_url: str, slack: SlackStandIn
) -> None:
    # The page would pick the Slack message up by itself within SESSION_POLL_SECONDS: an hour
    # here, so its send meets the stale refusal first.
    async with (
        web(database_url, slack, session_poll_seconds=3600) as (bot, browser),
        SlackClient(bot.url) as client,
    ):
        thread = await client.message("started in slack", mention=True)
        await slack.wait_for(lambda: slack.named("chat.stopStream"))
        _, page = await signed_in(browser, bot, slack)
        await open_slack_thread(page, "started in slack")
        await expect(transcript(page).locator('[data-role="assistant"]')).to_have_count(
            1, timeout=SECONDS
        )
        await client.message("added in slack", thread_ts=thread, mention=True)
        await slack.wait_for(lambda: len(slack.named("chat.stopStream")) == 2)
        await expect(transcript(page)).not_to_contain_text("added in slack")
        await send(page, "my draft")
        notice = page.get_by_text("New messages arrived while you were writing")
        await expect(notice).to_be_visible(timeout=SECONDS)
        await expect(transcript(page)).to_contain_text("added in slack")
        await expect(page.get_by_label("Message")).to_have_value("my draft")
        await expect(page.get_by_label("Message")).to_be_enabled()
        await page.get_by_label("Message").press("Enter")
        await expect(transcript(page).locator('[data-role="assistant"]')).to_have_count(
            3, timeout=SECONDS
        )
        await expect(notice).to_have_count(0)


async def test_web__an_idle_page_picks_up_messages_added_in_slack(
    database_url: str, slack: SlackStandIn
) -> None:
    async with (
        web(database_url, slack, session_poll_seconds=0.5) as (bot, browser),
        SlackClient(bot.url) as client,
    ):
        thread = await client.message("one", mention=True)
        await slack.wait_for(lambda: slack.named("chat.stopStream"))
        _, page = await signed_in(browser, bot, slack)
        await open_slack_thread(page, "one")
        await page.evaluate("window.notReloaded = true")
        await client.message("two, from slack", thread_ts=thread, mention=True)
        await expect(transcript(page)).to_contain_text("two, from slack", timeout=SECONDS)
        await expect(transcript(page).locator('[data-role="assistant"]')).to_have_count(
            2, timeout=SECONDS
        )
        assert await page.evaluate("window.notReloaded === true")


# -- approvals ---------------------------------------------------------------------------------


def card_updates(slack: SlackStandIn, ts: str) -> list[str]:
    return [c.text for c in slack.named("chat.update") if c.args.get("ts") == ts]


async def test_web__approve_in_the_page_what_slack_posted_and_the_slack_card_updates(
    database_url: str, slack: SlackStandIn, tmp_path: Path
) -> None:
    async with (
        web(database_url, slack, **mcp(tmp_path)) as (bot, browser),
        SlackClient(bot.url) as client,
    ):
        await connected(bot)
        await client.message(ADD, mention=True)
        (card,) = await slack.wait_for(lambda: cards(slack))
        _, page = await signed_in(browser, bot, slack)
        await open_slack_thread(page, "mcp__notes__add_note")
        approval = page.get_by_role("region", name="Approval needed")
        await expect(approval).to_contain_text("add_note", timeout=SECONDS)
        await approval.get_by_role("button", name="Approve").click()
        await expect(approval).to_have_count(0, timeout=SECONDS)
        await slack.wait_for(lambda: card_updates(slack, card.result["ts"]))
        assert notes(tmp_path) == {"plan": "ship friday"}
        await expect(transcript(page)).to_contain_text("ship friday", timeout=SECONDS)


async def test_web__deny_with_a_reason_the_slack_card_and_the_transcript_say_why(
    database_url: str, slack: SlackStandIn, tmp_path: Path
) -> None:
    """The card's optional reason goes with the decision: nothing runs, Slack's card shows
    the reason, and the declined call in the transcript says who declined it and why."""
    async with (
        web(database_url, slack, **mcp(tmp_path)) as (bot, browser),
        SlackClient(bot.url) as client,
    ):
        await connected(bot)
        await client.message(ADD, mention=True)
        (card,) = await slack.wait_for(lambda: cards(slack))
        _, page = await signed_in(browser, bot, slack)
        await open_slack_thread(page, "mcp__notes__add_note")
        approval = page.get_by_role("region", name="Approval needed")
        await approval.get_by_label("Reason (optional)").fill("  not before the review  ")
        await approval.get_by_role("button", name="Deny").click()
        await expect(approval).to_have_count(0, timeout=SECONDS)
        (updated, *_) = await slack.wait_for(lambda: card_updates(slack, card.result["ts"]))
        assert "not before the review" in updated
        declined = transcript(page).locator("details.tool.denied")
        await expect(declined).to_have_count(1, timeout=SECONDS)
        await declined.locator("summary").click()
        await expect(declined.locator(".decision")).to_have_text(
            "slack:T1:U1 declined it: not before the review"
        )
        assert notes(tmp_path) == {}


async def test_web__approved_in_slack_the_page_card_clears_and_two_tabs_agree(
    database_url: str, slack: SlackStandIn, tmp_path: Path
) -> None:
    async with (
        web(database_url, slack, **mcp(tmp_path)) as (bot, browser),
        SlackClient(bot.url, response_url=slack.response_url) as client,
    ):
        await connected(bot)
        await client.message(ADD, mention=True)
        (card,) = await slack.wait_for(lambda: cards(slack))
        context, page = await signed_in(browser, bot, slack)
        session = await open_slack_thread(page, "mcp__notes__add_note")
        other = await context.new_page()
        await other.goto(f"/sessions/{session}")
        for tab in (page, other):
            await expect(tab.get_by_role("region", name="Approval needed")).to_be_visible(
                timeout=SECONDS
            )
        assert await click(client, slack, card) == 200  # decided in Slack
        for tab in (page, other):
            await expect(tab.get_by_role("region", name="Approval needed")).to_have_count(
                0, timeout=SECONDS
            )
        await slack.wait_for(lambda: notes(tmp_path))


async def test_web__two_tabs_on_one_approval_the_second_click_is_told_it_was_decided(
    database_url: str, slack: SlackStandIn, tmp_path: Path
) -> None:
    # Polls ten minutes apart: the second tab still shows its card when its person clicks.
    slow = {"busy_poll_seconds": 600, "session_poll_seconds": 600}
    async with web(database_url, slack, **slow, **mcp(tmp_path)) as (bot, browser):
        await connected(bot)
        context, page = await signed_in(browser, bot, slack)
        session = await web_session(page)
        await send(page, ADD)
        other = await context.new_page()
        await other.goto(f"/sessions/{session}")
        cards_ = [tab.get_by_role("region", name="Approval needed") for tab in (page, other)]
        for card in cards_:
            await expect(card).to_be_visible(timeout=SECONDS)
        # The first tab approves from the keyboard.
        await cards_[0].get_by_role("button", name="Approve").focus()
        await page.keyboard.press("Enter")
        await expect(cards_[0]).to_have_count(0, timeout=SECONDS)
        await expect(transcript(page)).to_contain_text("ship friday", timeout=SECONDS)
        # The second is told the call was decided, and shows what came of it.
        await expect(cards_[1]).to_be_visible()
        await cards_[1].get_by_role("button", name="Approve").click()
        await expect(other.get_by_text("That call was already approved")).to_be_visible(
            timeout=SECONDS
        )
        await expect(cards_[1]).to_have_count(0, timeout=SECONDS)
        await expect(transcript(other)).to_contain_text("ship friday", timeout=SECONDS)
        assert notes(tmp_path) == {"plan": "ship friday"}


# -- rewind, usage, narrow ---------------------------------------------------------------------


async def test_web__rewind_here_asks_first_then_removes_what_the_plan_said_then_compact(
    database_url: str, slack: SlackStandIn
) -> None:
    async with web(database_url, slack) as (bot, browser):
        _, page = await signed_in(browser, bot, slack)
        await web_session(page)
        for text in ("first words", "second words"):
            await send(page, text)
            await expect(transcript(page)).to_contain_text(text, timeout=SECONDS)
            await expect(page.get_by_role("button", name="Send")).to_be_disabled(timeout=SECONDS)
            await expect(
                transcript(page).get_by_role("button", name="Rewind here")
            ).not_to_have_count(0, timeout=SECONDS)
        await expect(transcript(page).locator('[data-role="assistant"]')).to_have_count(
            2, timeout=SECONDS
        )
        second = transcript(page).locator('[data-role="user"]', has_text="second words")
        await second.get_by_role("button", name="Rewind here").click()
        dialog = page.get_by_role("dialog", name="Rewind here?")
        await expect(dialog).to_contain_text("removes 2 messages", timeout=SECONDS)
        await page.keyboard.press("Escape")  # the dialog is keyboard-usable: Escape cancels
        await expect(dialog).to_have_count(0)
        await expect(transcript(page)).to_contain_text("second words")
        await second.get_by_role("button", name="Rewind here").click()
        await (
            page.get_by_role("dialog", name="Rewind here?")
            .get_by_role("button", name="Rewind")
            .click()
        )
        await expect(transcript(page)).not_to_contain_text("second words", timeout=SECONDS)
        await expect(transcript(page)).to_contain_text("first words")
        # The rewound message of the person's is back in the composer, to edit and resend.
        await expect(page.get_by_label("Message")).to_have_value("second words")
        # Compact: the checkpoint shows as such.
        await page.get_by_role("button", name="Compact").click()
        await expect(transcript(page).get_by_role("separator", name="Checkpoint")).to_be_visible(
            timeout=SECONDS
        )
        await page.reload()
        await expect(transcript(page)).to_contain_text("first words", timeout=SECONDS)
        await expect(transcript(page)).not_to_contain_text("second words")


async def test_web__branch_from_here_and_stop(
    database_url: str, slack: SlackStandIn, model: GatedModel
) -> None:
    async with web(database_url, slack, **gated(model)) as (bot, browser):
        model.release()
        _, page = await signed_in(browser, bot, slack)
        first = await web_session(page)
        for text in ("keep this", "and this"):
            await send(page, text)
            await expect(page.get_by_role("button", name="Send")).to_be_disabled(timeout=SECONDS)
            await expect(transcript(page).locator('[data-role="assistant"]')).to_contain_text(
                [f"answer {n}" for n in range(1, 2 if text == "keep this" else 3)],
                timeout=SECONDS,
            )
        # Branch from the second question: a new session with what came before it, the
        # question back in its composer; the first session keeps everything.
        asked = transcript(page).locator('[data-role="user"]', has_text="and this")
        await asked.get_by_role("button", name="Branch from here").click()
        await (
            page.get_by_role("dialog", name="Branch from here?")
            .get_by_role("button", name="Branch")
            .click()
        )
        await page.wait_for_url(lambda url: not url.endswith(f"/sessions/{first}"))
        await expect(transcript(page)).to_contain_text("answer 1", timeout=SECONDS)
        await expect(transcript(page)).not_to_contain_text("answer 2")
        await expect(page.get_by_label("Message")).to_have_value("and this")
        # Stop: a turn held at the model is stopped from the page, its partial answer kept.
        model.gate.clear()
        await send(page, "stop me")
        await expect(page.get_by_role("button", name="Stop")).to_be_enabled(timeout=SECONDS)
        await asyncio.wait_for(model.arrived.wait(), SECONDS / 1000)
        await page.get_by_role("button", name="Stop").click()
        await expect(page.get_by_role("button", name="Stop")).to_be_disabled(timeout=SECONDS)
        await expect(transcript(page)).to_contain_text("stopped before it finished")
        await expect(page.get_by_label("Message")).to_be_enabled()
        await page.goto(f"/sessions/{first}")
        await expect(transcript(page)).to_contain_text("answer 2", timeout=SECONDS)


async def test_web__admin_sets_retention_and_budgets_and_sees_the_mcp_servers(
    database_url: str, slack: SlackStandIn, tmp_path: Path
) -> None:
    async with web(database_url, slack, admin_user_ids="T1:U1", **mcp(tmp_path)) as (
        bot,
        browser,
    ):
        await connected(bot)
        _, theirs = await signed_in(browser, bot, slack, user="U2")
        their_session = await web_session(theirs)
        _, page = await signed_in(browser, bot, slack)
        row = page.locator(f'[data-session-id="{their_session}"]')
        await expect(row).to_have_count(0)  # Mine
        await page.get_by_role("radio", name="All").check()
        await expect(row).to_be_visible(timeout=SECONDS)
        await page.get_by_role("link", name="Admin").click()
        servers = page.get_by_role("region", name="MCP servers")
        await expect(servers).to_contain_text("notes", timeout=SECONDS)
        await expect(servers).to_contain_text("add_note")
        retention = page.get_by_role("form", name="Retention")
        await retention.get_by_label("Delete sessions idle for more than (days)").fill("30")
        await retention.get_by_role("button", name="Save retention").click()
        await expect(retention.get_by_role("status")).to_have_text("Saved.", timeout=SECONDS)
        budgets = page.get_by_role("form", name="Budgets")
        await budgets.get_by_label("Entries to add or replace").fill("user:day:5000tokens")
        await budgets.get_by_role("button", name="Save budgets").click()
        await expect(budgets.get_by_role("status")).to_have_text("Saved.", timeout=SECONDS)
        await expect(budgets).to_contain_text("user:day:5000tokens")
        await page.reload()
        await expect(page.get_by_label("Delete sessions idle for more than (days)")).to_have_value(
            "30", timeout=SECONDS
        )
        await page.get_by_role("link", name="Usage").click()
        await expect(page.locator(".budget")).to_contain_text("5000tokens", timeout=SECONDS)
        # A person's data: their export downloads, and erasing them asks first.
        await page.get_by_role("link", name="Admin").click()
        data = page.get_by_role("form", name="A person's data")
        await data.get_by_label("Slack member").fill("T1:U2")
        async with page.expect_download() as downloading:
            await data.get_by_role("link", name="Export (JSON lines)").click()
        saved = await (await downloading.value).path()
        records = [
            json.loads(line) for line in (await asyncio.to_thread(saved.read_text)).splitlines()
        ]
        assert "session" in {r["record"] for r in records}
        await data.get_by_role("button", name="Erase…").click()
        await page.get_by_role("dialog").get_by_role("button", name="Erase").click()
        await expect(data.get_by_role("status")).to_contain_text("Erased T1:U2", timeout=SECONDS)
        await page.goto(f"/sessions/{their_session}")
        await expect(page.get_by_text("not found", exact=False)).to_be_visible(timeout=SECONDS)


async def test_web__usage_charts_the_spend_beside_the_budgets(
    database_url: str, slack: SlackStandIn
) -> None:
    async with web(database_url, slack, budgets="user:day:200000tokens") as (bot, browser):
        _, page = await signed_in(browser, bot, slack)
        await web_session(page)
        await send(page, "count this")
        await expect(transcript(page).get_by_label("Usage of this answer")).to_be_visible(
            timeout=SECONDS
        )
        await page.get_by_role("link", name="Usage").click()
        chart = page.get_by_role("img", name="Spend by day")
        await expect(chart).to_be_visible(timeout=SECONDS)
        assert await chart.locator("rect.bar").count() >= 1
        await expect(page.locator(".budget")).to_contain_text("200000tokens")
        await expect(page.locator(".budget meter")).to_be_visible()


async def test_web__a_narrow_window_has_no_sideways_scroll_and_still_sends(
    database_url: str, slack: SlackStandIn
) -> None:
    async with web(database_url, slack) as (bot, browser):
        _, page = await signed_in(browser, bot, slack, viewport={"width": 360, "height": 700})
        await web_session(page)
        await send(page, "x" * 300)  # one long word must wrap, not widen the page
        await expect(transcript(page).locator('[data-role="assistant"]')).to_have_count(
            1, timeout=SECONDS
        )
        wide = await page.evaluate(
            "document.documentElement.scrollWidth - document.documentElement.clientWidth"
        )
        assert wide <= 0
        await expect(page.get_by_role("button", name="Send")).to_be_in_viewport()


# -- security ----------------------------------------------------------------------------------


async def test_web__csrf_forged_or_missing_is_refused_and_writes_nothing(
    database_url: str, slack: SlackStandIn
) -> None:
    async with web(database_url, slack) as (bot, browser):
        _, page = await signed_in(browser, bot, slack)
        for csrf in ("forged", None):
            answer = await api(page, "POST", "/v1/agent_sessions", {}, csrf=csrf)
            assert answer["status"] == 403
            assert json.loads(answer["body"])["code"] == "csrf_failed"
        listed = await api(page, "GET", "/v1/agent_sessions", None, csrf=None)
        assert json.loads(listed["body"])["data"] == []
        made = await api(page, "POST", "/v1/agent_sessions", {})
        assert made["status"] == 201


async def test_web__another_persons_cookie_and_session_url_show_not_found(
    database_url: str, slack: SlackStandIn
) -> None:
    async with web(database_url, slack) as (bot, browser):
        _, mine = await signed_in(browser, bot, slack, user="U1")
        session = await web_session(mine)
        my_token = json.loads((await api(mine, "GET", "/v1/me", None, csrf=None))["body"])[
            "csrfToken"
        ]
        _, theirs = await signed_in(browser, bot, slack, user="U2")
        await theirs.goto(f"/sessions/{session}")
        await expect(theirs.get_by_role("heading", name="Not found")).to_be_visible(timeout=SECONDS)
        seen = await api(theirs, "GET", f"/v1/agent_sessions/{session}", None, csrf=None)
        assert seen["status"] == 404
        # U1's token with U2's cookie: the token belongs to a sign-in, not to anyone's cookie.
        forged = await api(theirs, "POST", "/v1/agent_sessions", {}, csrf=my_token)
        assert forged["status"] == 403
        listed = await api(theirs, "GET", "/v1/agent_sessions", None, csrf=None)
        assert json.loads(listed["body"])["data"] == []


async def test_web__the_csrf_header_is_matched_whatever_its_case(
    database_url: str, slack: SlackStandIn
) -> None:
    async with web(database_url, slack) as (bot, browser):
        _, page = await signed_in(browser, bot, slack)
        status = await page.evaluate(
            """async () => {
                const token = (await (await fetch("/v1/me")).json()).csrfToken;
                const headers = new Headers({"Content-Type": "application/json"});
                headers.set("X-CSRF-Token", token);  // sent as x-csrf-token
                const r = await fetch("/v1/agent_sessions", {method: "POST", headers, body: "{}"});
                return r.status;
            }"""
        )
        assert status == 201
