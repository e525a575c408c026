"""The ``slack-agent`` command (also ``python -m bot``): parse, call the core, print.

Every failure a user can cause ends as one line on stderr and exit status 2; nothing is
half-done, because each core call is one transaction.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import tempfile
from collections.abc import Callable, Coroutine, Sequence
from datetime import date
from decimal import Decimal
from pathlib import Path
from typing import Any

from bench.parts import PARTS
from core.errors import SlackAgentError, UsageError
from core.logs import configure_logging
from core.messages import message_text
from core.operator import Operator
from core.records import SessionInfo
from core.settings import Settings, load_settings
from core.usage.totals import MessageUsage


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="slack-agent", description="A durable, lock-safe AI agent for Slack threads."
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    commands.add_parser("serve", help="run the bot (migrates first)")
    commands.add_parser("migrate", help="bring the database to the newest schema")
    sweep = commands.add_parser("sweep", help="apply the retention rules")
    sweep.add_argument("--once", action="store_true", help="one pass, printing what it deleted")

    sessions = commands.add_parser("sessions", help="list, show or delete sessions")
    session_cmds = sessions.add_subparsers(dest="action", required=True, metavar="ACTION")
    listing = session_cmds.add_parser("list", help="most recently updated first")
    listing.add_argument("--limit", type=int, default=50)
    for action in ("show", "delete"):
        sub = session_cmds.add_parser(action, help=f"{action} one session")
        sub.add_argument("session_id", type=int, metavar="ID")

    retention = commands.add_parser("retention", help="show or set retention at run time")
    retention_cmds = retention.add_subparsers(dest="action", required=True, metavar="ACTION")
    retention_cmds.add_parser("show")
    setter = retention_cmds.add_parser("set", help="0 turns a rule off")
    setter.add_argument(
        "--max-idle-days", type=float, help="delete a session idle this long (0: never)"
    )
    setter.add_argument(
        "--max-per-user", type=int, help="keep at most this many sessions per person (0: no limit)"
    )

    usage = commands.add_parser("usage", help="what the model requests used and cost")
    usage.add_argument("--by", choices=("user", "workspace", "model", "day"), default="user")
    usage.add_argument("--since", metavar="DATE", help="YYYY-MM-DD (UTC); default: all time")
    usage.add_argument("--json", action="store_true", help="one JSON object")

    budget = commands.add_parser("budget", help="show or change spending limits at run time")
    budget_cmds = budget.add_subparsers(dest="action", required=True, metavar="ACTION")
    budget_cmds.add_parser("show")
    budget_set = budget_cmds.add_parser(
        "set", help="add or replace limits, e.g. user:day:200000tokens,all:month:500usd"
    )
    budget_set.add_argument(
        "value",
        metavar="ENTRIES",
        help="SCOPE:PERIOD:AMOUNT, comma-separated: SCOPE user, workspace or all; PERIOD day "
        "or month (UTC); AMOUNT tokens or usd (200000tokens, 500usd)",
    )
    budget_clear = budget_cmds.add_parser(
        "clear", help="remove SCOPE:PERIOD[:UNIT]; with none, back to the environment's BUDGETS"
    )
    budget_clear.add_argument(
        "value", metavar="SCOPE:PERIOD[:UNIT]", nargs="?", help="e.g. user:day or all:month:usd"
    )

    token = commands.add_parser("token", help="keys for programs using the HTTP API")
    token_cmds = token.add_subparsers(dest="action", required=True, metavar="ACTION")
    token_create = token_cmds.add_parser("create", help="print a new token once (kept hashed)")
    token_create.add_argument("--user", required=True, metavar="TEAM:USER", help="who it acts as")
    token_create.add_argument("--name", help="what it is for (shown by token list)")
    token_create.add_argument("--expires", type=float, metavar="DAYS", help="default: never")
    token_cmds.add_parser("list", help="every token, without its secret")
    token_revoke = token_cmds.add_parser("revoke", help="refuse a token from now on")
    token_revoke.add_argument("token_id", type=int, metavar="ID")

    user = commands.add_parser("user", help="one person's data: export it, or erase it")
    user_cmds = user.add_subparsers(dest="action", required=True, metavar="ACTION")
    user_export = user_cmds.add_parser(
        "export", help="their sessions, messages, usage, approvals, … as JSON lines on stdout"
    )
    user_export.add_argument("person", metavar="TEAM:USER")
    user_erase = user_cmds.add_parser(
        "erase", help="remove their data (usage kept, anonymised); refused while they have a turn"
    )
    user_erase.add_argument("person", metavar="TEAM:USER")

    bench = commands.add_parser(
        "bench", help="measure the core (no model); a PART alone with its arguments"
    )
    bench.add_argument("part", nargs="?", choices=sorted(PARTS), help="one part (default: all)")
    bench.add_argument("part_args", nargs=argparse.REMAINDER, help="the part's arguments")
    bench.add_argument("--json", action="store_true", help="print one JSON object")
    bench.add_argument("--database-url", help="default: a fresh temporary SQLite file")
    bench.add_argument(
        "--quick", action="store_true", help="smaller sizes, up to 100 concurrent turns"
    )
    bench.add_argument(
        "--compare",
        action="store_true",
        help="against the peers (optional extra `compare`); PostgreSQL ones given --database-url",
    )

    soak = commands.add_parser(
        "soak", help="replicas under load and faults, then every promise checked (127.0.0.1 only)"
    )
    soak.add_argument("--database-url", help="default: a fresh temporary SQLite file")
    soak.add_argument("--quick", action="store_true", help="300 messages in 40 s")
    soak.add_argument("--messages", type=int)
    soak.add_argument("--threads", type=int)
    soak.add_argument("--seconds", type=float)
    soak.add_argument("--replicas", type=int, default=3)
    soak.add_argument(
        "--restart-command",
        help="restart PostgreSQL with this command once (default: cut its connections for 4 s)",
    )
    soak.add_argument("--seed", type=int, default=1)
    soak.add_argument(
        "--faults",
        default="all",
        help="faults to inject: all (default), none, a comma list of slack-429, slack-500, "
        "model-timeout, model-cut, kill, outage, blackhole, or all but some (all,-outage,-kill)",
    )
    soak.add_argument(
        "--proxy",
        action="store_true",
        help="PostgreSQL through the soak's TCP proxy even without the outage (its cost)",
    )
    soak.add_argument(
        "--budgets",
        metavar="ENTRIES",
        help="the replicas' BUDGETS (default: limits no turn reaches, so every claim checks "
        "them; '' for none)",
    )
    soak.add_argument(
        "--profile",
        metavar="DIR",
        help="record the replicas' loops, py-spy stacks and CPU by process into DIR",
    )
    soak.add_argument("--json", action="store_true", help="print one JSON object")

    chat = commands.add_parser("chat", help="continue a session from the terminal")
    chat.add_argument(
        "session",
        nargs="?",
        metavar="SESSION",
        help="a session id or the Slack permalink of a message in its thread (none: a new one)",
    )
    demo = commands.add_parser("demo", help="the first-run experience")
    demo.add_argument(
        "--web",
        action="store_true",
        help="then keep the stand-in Slack, the offline model and the web page up on "
        "http://127.0.0.1:8000 until Ctrl-C",
    )
    commands.add_parser("tools", help="list the MCP servers, their state and tools")
    return parser


def _session_line(s: SessionInfo) -> str:
    busy = "busy" if s.is_turn_active else "idle"
    title = s.title or "(untitled)"
    return (
        f"{s.id:>6}  {s.updated_at:%Y-%m-%d %H:%M}  {busy:<4}  "
        f"{s.project_name}:{s.project_session_id}  {title}"
    )


async def _run_operator(args: argparse.Namespace, settings: Settings) -> None:
    op = Operator.open(settings)
    try:
        if args.command != "migrate":
            await op.storage.require_ready()
        await _dispatch(op, args)
    finally:
        await op.close()


async def _dispatch(op: Operator, args: argparse.Namespace) -> None:
    if args.command == "migrate":
        before, after = await op.migrate()
        print(f"database at revision {after}" + ("" if before == after else f" (was {before})"))
    elif args.command == "sweep":
        if not args.once:
            raise UsageError("sweep: pass --once (the periodic sweeper runs inside serve)")
        report = await op.sweep_once()
        print(
            f"deleted {report.expired} expired, {report.idle} idle and {report.over_cap} "
            f"over-cap sessions; collected {report.snapshot_contents} snapshot contents"
            f" and {report.extra.get('processed_events', 0)} old delivery records"
        )
    elif args.command == "retention":
        if args.action == "set":
            if args.max_idle_days is None and args.max_per_user is None:
                raise UsageError("retention set: give --max-idle-days and/or --max-per-user")
            try:
                policy = await op.set_retention(
                    max_idle_days=args.max_idle_days, max_per_user=args.max_per_user
                )
            except ValueError as exc:
                raise UsageError(f"retention set: {exc}") from None
        else:
            policy = await op.retention()
        print(f"max idle days: {policy.max_idle_days:g} (0 = off)")
        print(f"max per user:  {policy.max_per_user} (0 = off)")
    elif args.command == "sessions":
        await _sessions(op, args)
    elif args.command == "usage":
        await _usage(op, args)
    elif args.command == "budget":
        await _budget(op, args)
    elif args.command == "token":
        await _token(op, args)
    elif args.command == "user":
        await _user(op, args)


async def _user(op: Operator, args: argparse.Namespace) -> None:
    if args.action == "export":
        async for record in op.export_person(args.person):
            print(json.dumps(record, ensure_ascii=False, default=str))
        return
    erased = await op.erase_person(args.person)
    if not erased.anything:
        print(f"nothing kept about {args.person}")
        return
    print(
        f"erased {args.person}: {erased.sessions} sessions ({erased.messages} messages), "
        f"{erased.deliveries} delivery records, {erased.feedback} votes, {erased.tokens} API "
        f"tokens, {erased.sign_ins} web sign-ins, {erased.person} person record; "
        f"kept anonymised: {erased.usage_anonymised} model requests (usage and budgets), "
        f"{erased.decisions_anonymised} tool-call decisions, "
        f"{erased.requests_anonymised} tool-call requests"
    )


async def _token(op: Operator, args: argparse.Namespace) -> None:
    if args.action == "create":
        token_id, secret = await op.create_token(
            args.user, name=args.name, expires_days=args.expires
        )
        print(secret)
        print(f"token {token_id}: shown this once, only its hash is kept", file=sys.stderr)
    elif args.action == "revoke":
        await op.revoke_token(args.token_id)
        print(f"token {args.token_id} revoked")
    else:
        tokens = await op.tokens()
        if not tokens:
            print("no tokens")
        for t in tokens:
            state = (
                "revoked"
                if t.revoked_at
                else (f"expires {t.expires_at:%Y-%m-%d %H:%M}" if t.expires_at else "no expiry")
            )
            print(
                f"{t.id:>4}  {t.person:<24}  {t.created_at:%Y-%m-%d}  {state:<22}  {t.name or ''}"
            )


def _since(value: str | None) -> date | None:
    if value is None:
        return None
    try:
        return date.fromisoformat(value)
    except ValueError:
        raise UsageError(f"usage --since: {value!r} is not a date (YYYY-MM-DD)") from None


async def _usage(op: Operator, args: argparse.Namespace) -> None:
    lines = await op.usage(args.by, since=_since(args.since))
    if args.json:
        print(
            json.dumps({"by": args.by, "since": args.since, "lines": [x.to_json() for x in lines]})
        )
        return
    if not lines:
        print("no model requests recorded" + (f" since {args.since}" if args.since else ""))
        return
    print(f"{args.by:<32} {'requests':>8} {'input':>12} {'output':>10} {'cached':>10} {'cost':>12}")
    for line in lines:
        notes = []
        if line.estimated:
            notes.append(f"{line.estimated} estimated")
        if line.unreported:
            notes.append(f"{line.unreported} with counts not reported (budgets count estimates)")
        if line.unpriced:
            notes.append(f"{line.unpriced} unpriced (not in the cost)")
        print(
            f"{line.key[:32]:<32} {line.requests:>8} {line.input_tokens:>12,} "
            f"{line.output_tokens:>10,} {line.cached_tokens:>10,} {_usd(line.cost_usd):>12}"
            + (f"  ({'; '.join(notes)})" if notes else "")
        )


def _usd(amount: Decimal) -> str:
    return f"${amount:,.4f}" if amount < 1 else f"${amount:,.2f}"


async def _budget(op: Operator, args: argparse.Namespace) -> None:
    if args.action == "set":
        await op.set_budgets(args.value)
    elif args.action == "clear":
        await op.clear_budgets(args.value)
    shown = await op.budgets()
    if not shown:
        print("no budgets: nothing limits spending")
    for budget, source, account in shown:
        used = ""
        if account is not None:
            spent = (
                _usd(account.spent) if budget.unit == "usd" else f"{int(account.spent):,} tokens"
            )
            used = f"; used {spent} this {budget.period}"
        print(f"{budget!s:<32} {budget.describe()} (set in the {source}){used}")


async def _sessions(op: Operator, args: argparse.Namespace) -> None:
    if args.action == "list":
        found = await op.list_sessions(limit=args.limit)
        for session in found:
            print(_session_line(session))
        if not found:
            print("no sessions")
    elif args.action == "show":
        session, messages, feedback = await op.show_session(args.session_id)
        print(_session_line(session))
        model = session.model_provider or "-"
        print(f"owner user id {session.user_id}; model {model}/{session.model_name or '-'}")
        for m in messages:
            marker = "checkpoint" if m.is_compaction_message else m.role
            text = " ".join(message_text(m.message).split())
            voted = feedback.get(m.message_id, {})
            tally = f"  [+{voted.get('good', 0)} -{voted.get('bad', 0)}]" if voted else ""
            print(f"  {m.position:>5} {marker:<10} {text[:100]}{tally}")
            used = MessageUsage.from_json((m.message.get("metadata") or {}).get("usage"))
            if used is not None:
                print(f"  {'':>5} {'':<10} {_message_usage(used)}")
    elif args.action == "delete":
        session = await op.delete_session(args.session_id)
        print(
            f"deleted session {session.id} ({session.project_name}:{session.project_session_id})"
            " as the local operator"
        )


def _count(value: int | None) -> str:
    return "unknown" if value is None else f"{value:,}"


def _message_usage(used: MessageUsage) -> str:
    """``usage: openai/gpt-4.1-mini, 2 requests, 1,200 in (1,024 cached), 30 out, $0.0003``."""
    cost = "cost unknown" if used.cost_usd is None else _usd(used.cost_usd)
    cached = f" ({_count(used.cached_tokens)} cached)" if used.cached_tokens else ""
    requests = f"{used.requests} request" + ("" if used.requests == 1 else "s")
    text = (
        f"usage: {used.provider or '?'}/{used.model or '?'}, {requests}, "
        f"{_count(used.input_tokens)} in{cached}, {_count(used.output_tokens)} out, {cost}"
    )
    return text + (" (estimated)" if used.estimated else "")


async def _serve(args: argparse.Namespace, settings: Settings) -> None:
    from bot.serve import serve

    await serve(settings)


async def _demo(args: argparse.Namespace, settings: Settings) -> None:
    from slack_agent.demo import run_demo

    if settings.log_level.upper() == "INFO":  # the demo prints the threads; logs would drown them
        logging.getLogger().setLevel(logging.WARNING)
    await run_demo(web_page=args.web)


async def _chat(args: argparse.Namespace, settings: Settings) -> None:
    from terminal import run_chat

    await run_chat(settings, args.session)


async def _bench(args: argparse.Namespace, settings: Settings) -> None:
    """The core's measurements, then the Slack surface's (ack latency, idle memory of serve);
    or, with ``--compare``, our storage against the peers'."""
    if args.part is not None:
        from bench.parts import run

        await asyncio.to_thread(run, args.part, args.part_args)
        return
    if args.compare:
        from bench.peers.compare import format_compare, run_compare

        compared = await run_compare(args.database_url, quick=args.quick)
        if isinstance(compared.get("skipped"), str):
            print(compared["skipped"], file=sys.stderr)
            return
        print(json.dumps(compared) if args.json else format_compare(compared))
        return
    from bench.costs.observability import bench_observability, format_observability
    from bench.costs.storage import format_table, run_bench
    from bench.costs.tools import bench_tools
    from bench.load.ack import bench_slack
    from bench.load.turns import (
        bench_ack_during_fork_and_sweep,
        bench_concurrent_turns,
        format_lines,
    )

    result = await run_bench(args.database_url, quick=args.quick)
    result.update(await bench_slack(args.database_url))
    result.update(await bench_tools(args.database_url, quick=args.quick))
    result["concurrent_turns"] = await bench_concurrent_turns(
        args.database_url,
        sizes=(10, 100) if args.quick else (10, 100, 500),
        stream_seconds=5.0 if args.quick else 20.0,
    )
    result["ack_during_fork_and_sweep"] = await bench_ack_during_fork_and_sweep(
        args.database_url, fork_messages=2000 if args.quick else 10_000
    )
    result["observability"] = await bench_observability(args.database_url, quick=args.quick)
    if args.json:
        print(json.dumps(result))
    else:
        print(
            "\n".join([format_table(result), *format_lines(result), *format_observability(result)])
        )


async def _tools(args: argparse.Namespace, settings: Settings) -> None:
    from core.tools.listing import tools_report

    if settings.log_level.upper() == "INFO":  # the report says what the INFO lines would
        logging.getLogger().setLevel(logging.WARNING)
    print(await tools_report(settings))


async def _soak(args: argparse.Namespace, settings: Settings) -> None:
    from bench.soak.profile import summary
    from bench.soak.run import SoakFailed, format_report, parse_faults, run_soak, soak_config

    try:
        args.faults = parse_faults(args.faults)
    except ValueError as exc:
        raise UsageError(f"--faults: {exc}") from None
    with tempfile.TemporaryDirectory(prefix="soak-db-") as tmp:
        url = args.database_url or f"sqlite+aiosqlite:///{tmp}/soak.db"
        report = await run_soak(soak_config(url, args))
    print(json.dumps(report.as_dict()) if args.json else format_report(report))
    if args.profile and not args.json:
        print(summary(Path(args.profile)))
    if not report.ok:
        raise SoakFailed(f"{len(report.violations)} promise(s) broken; see the report above")


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        settings = load_settings()
        configure_logging(settings.log_level, settings.log_format, settings.secret_values())
        runners: dict[str, Callable[[argparse.Namespace, Settings], Coroutine[Any, Any, None]]]
        runners = {
            "bench": _bench,
            "serve": _serve,
            "demo": _demo,
            "soak": _soak,
            "chat": _chat,
            "tools": _tools,
        }
        runner = runners.get(args.command, _run_operator)
        asyncio.run(runner(args, settings))
    except SlackAgentError as exc:
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else exc.code
        print(f"slack-agent: {exc.code}: {first_line}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # a bug of ours: one line for the user, the traceback in the log
        logging.getLogger("slack-agent").debug("unexpected error", exc_info=True)
        print(
            f"slack-agent: internal_error: {exc.__class__.__name__}: {exc} "
            "(LOG_LEVEL=DEBUG shows the traceback)",
            file=sys.stderr,
        )
        return 1
    return 0
