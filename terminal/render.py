"""How messages look in a terminal: rich renderables for stored messages and a live reply.

Text parts are Markdown (rendered by rich); a shell tool call is its command and its output,
shortened; a checkpoint is its sections as a list, never the XML the model reads.

What is printed comes from other people (Slack users), the model and sandbox output, so it may
hold control sequences: an ESC sequence that clears the screen, an OSC 52 that writes the
operator's clipboard, a carriage return that overwrites what was printed. ``PlainConsole``
removes C0 and C1 control characters (but newline and tab) from every piece of text it writes,
whichever renderable it came from, while rich's own styling and cursor movement (which it adds
around the text) still reach the terminal.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, ClassVar

from rich.console import Console, ConsoleOptions, Group, RenderableType, RenderResult
from rich.live import Live
from rich.markdown import CodeBlock, MarkdownElement
from rich.markdown import Markdown as RichMarkdown
from rich.segment import Segment
from rich.syntax import Syntax
from rich.text import Text

from core.conversation import SECTIONS, Message, StoredMessage, parse_checkpoint
from terminal import texts as say

TOOL_OUTPUT_LINES = 12
# C0 controls but tab and newline, DEL, and C1 controls (ESC's 8-bit forms, CSI 0x9b, OSC 0x9d).
_CONTROLS = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def plain(text: str) -> str:
    """``text`` without the control characters a terminal would act on."""
    return _CONTROLS.sub("", text)


class PlainConsole(Console):
    """A rich console that never writes a control character it was given as text.

    rich keeps ESC and most other controls in text (it strips only bell, backspace, vertical
    tab, form feed and carriage return). The text segments are cleaned where rich turns
    segments into output (``_render_buffer``, the one place every print and live refresh goes
    through); control segments, rich's own cursor movements, pass unchanged.
    """

    def _render_buffer(self, buffer: Iterable[Segment]) -> str:
        return super()._render_buffer(
            segment if segment.control else Segment(plain(segment.text), segment.style)
            for segment in buffer
        )


class _CodeBlock(CodeBlock):
    """A fenced block as its lines: rich pads one by a blank line above and below and a space
    on each side, which reads as stray blank lines once the output is not a terminal (a pipe,
    the demo's transcript)."""

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        yield Syntax(str(self.text).rstrip(), self.lexer_name, theme=self.theme, word_wrap=True)


class Markdown(RichMarkdown):
    """rich's Markdown with code blocks unpadded (``_CodeBlock``)."""

    elements: ClassVar[dict[str, type[MarkdownElement]]] = {
        **RichMarkdown.elements,
        "fence": _CodeBlock,
        "code_block": _CodeBlock,
    }


def author(message: StoredMessage, operator: str) -> str:
    if message.is_compaction_message:
        return say.CHECKPOINT_LABEL
    if message.role == "assistant":
        return "agent"
    meta: dict[str, Any] = message.message.get("metadata") or {}
    if meta.get("author") == operator:
        return "you"
    if isinstance(meta.get("author"), str):
        return str(meta["author"])
    if isinstance(meta.get("slack_user"), str):
        return f"slack:{meta['slack_user']}"
    return "user"


def tool_block(
    command: str, output: dict[str, Any] | None, error: str | None = None, *, shell: bool = True
) -> Text:
    """A tool call and what it gave: ``$ command`` for the sandbox's shell, ``call name`` for
    an MCP tool (a ``$`` would say it was typed at a shell)."""
    block = Text(f"$ {command}\n" if shell else f"call {command}\n", style="bold cyan")
    lines: list[str] = []
    if output is not None:
        body = str(output.get("stdout") or "") + str(output.get("stderr") or "")
        if not {"stdout", "stderr"} & output.keys():  # a stored MCP tool's output: its text
            body = str(output.get("text") or "")
        lines = body.rstrip("\n").splitlines()
        code = output.get("exit_code")
        if isinstance(code, int) and code != 0:
            lines.append(f"(exit status {code})")
    if error:
        lines.append(error)
    if len(lines) > TOOL_OUTPUT_LINES:
        lines = [*lines[:TOOL_OUTPUT_LINES], say.tool_output_cut()]
    if lines:
        block.append("\n".join(lines), style="dim")
    block.rstrip()  # the next block starts on the next line; a trailing newline would be a gap
    return block


def _parts(message: Message) -> list[RenderableType]:
    out: list[RenderableType] = []
    for part in message.get("parts") or []:
        if not isinstance(part, dict):
            continue
        kind = part.get("type")
        if kind == "text" and str(part.get("text", "")).strip():
            out.append(Markdown(str(part["text"])))
        elif isinstance(kind, str) and kind.startswith("tool-"):
            arguments = part.get("input") or {}
            command = arguments.get("command") if isinstance(arguments, dict) else None
            output = part.get("output")
            out.append(
                tool_block(
                    str(command or kind.removeprefix("tool-")),
                    output if isinstance(output, dict) else None,
                    part.get("errorText") if isinstance(part.get("errorText"), str) else None,
                    shell=command is not None,
                )
            )
    return out


def checkpoint_markdown(message: StoredMessage) -> str | None:
    checkpoint = parse_checkpoint(message)
    if checkpoint is None:
        return None
    lines: list[str] = []
    for section in SECTIONS:
        items = checkpoint.items(section)
        if items:
            lines.append(f"**{section.replace('_', ' ').capitalize()}**")
            lines.extend(f"- {item}" for item in items)
            lines.append("")
    return "\n".join(lines) or "(empty checkpoint)"


def message_view(message: StoredMessage, operator: str) -> RenderableType:
    who = author(message, operator)
    header = Text(f"[{message.position}] ", style="dim")
    header.append(who, style="bold magenta" if message.is_compaction_message else "bold")
    meta = message.message.get("metadata") or {}
    if meta.get("interrupted"):
        header.append(f" {say.INTERRUPTED_MARK}", style="yellow")
    body: list[RenderableType] = []
    if message.is_compaction_message:
        rendered = checkpoint_markdown(message)
        body = [Markdown(rendered)] if rendered else _parts(message.message)
    else:
        body = _parts(message.message)
    return Group(header, *body)


@dataclass
class _Tool:
    command: str
    output: dict[str, Any] | None = None
    shell: bool = True


@dataclass
class LiveReply:
    """The answer as it streams: Markdown re-rendered as text arrives, tools as they run."""

    console: Console
    blocks: list[str | _Tool | Text] = field(default_factory=list)
    live: Live | None = None

    def start(self) -> None:
        self.live = Live(
            self._view(),
            console=self.console,
            auto_refresh=False,
            vertical_overflow="visible",
        )
        self.live.start()

    def _view(self) -> RenderableType:
        views: list[RenderableType] = [Text("agent", style="bold")]
        for block in self.blocks:
            if isinstance(block, str):
                views.append(Markdown(block))
            elif isinstance(block, _Tool):
                views.append(tool_block(block.command, block.output, shell=block.shell))
            else:
                views.append(block)
        return Group(*views)

    def _refresh(self) -> None:
        if self.live is not None:
            self.live.update(self._view(), refresh=True)

    def text(self, chunk: str) -> None:
        if self.blocks and isinstance(self.blocks[-1], str):
            self.blocks[-1] += chunk
        else:
            self.blocks.append(chunk)
        self._refresh()

    def tool_started(self, command: str, *, shell: bool = True) -> None:
        self.blocks.append(_Tool(command, shell=shell))
        self._refresh()

    def tool_finished(self, output: dict[str, Any]) -> None:
        for block in reversed(self.blocks):
            if isinstance(block, _Tool):
                block.output = output
                break
        self._refresh()

    def notice(self, body: str, style: str = "italic yellow") -> None:
        self.blocks.append(Text(body, style=style))
        self._refresh()

    def stop(self) -> None:
        if self.live is not None:
            self._refresh()
            self.live.stop()
            self.live = None
            if not self.console.is_terminal:  # rich ends the line itself only on a terminal
                self.console.line()
