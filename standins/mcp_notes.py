"""A small, real MCP server of notes, for the demo and the tests (stdio and Streamable HTTP).

    python -m standins.mcp_notes                  # stdio
    python -m standins.mcp_notes --http [--port N]  # prints its URL once it listens

Tools: ``list_notes`` and ``read_note`` (annotated read-only: they run without asking under the
default rule) and ``add_note`` (not read-only: it asks). Environment:

- ``MCP_NOTES_FILE``: the JSON file of notes (``{"title": "text"}``), so what a call did can be
  checked from outside; without it the notes live in the process;
- ``MCP_NOTES_FAULTS=1``: also offer ``fault``, the misbehaviours the tests provoke (hang past a
  timeout, crash mid-call, an error result, a huge result, binary content, garbage on stdout,
  echo an environment variable, ``snoop``: what a prompt-steered server could read: its working
  directory, the ``.env`` there and its whole environment);
- ``MCP_NOTES_START_GATE=PATH``: exit at start-up (status 1, one stderr line) until PATH exists:
  a server that is down and later comes up;
- ``MCP_NOTES_TOKEN`` (HTTP): answer 401 to a request without ``Authorization: Bearer <it>``.

Written with the SDK's ``MCPServer`` (what was ``FastMCP`` before mcp 2).
"""

# No ``from __future__ import annotations``: MCPServer reads the tools' annotations at
# registration, and the SDK types they name are imported inside build_server.
import argparse
import base64
import json
import os
import select
import socket
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType
from typing import Any, Literal

NOTES_FILE = "MCP_NOTES_FILE"
FAULTS = "MCP_NOTES_FAULTS"
START_GATE = "MCP_NOTES_START_GATE"
PNG_1PX = base64.b64decode(
    "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk+M9QDwADhgGAWjR9awAAAABJRU5ErkJggg=="
)
TOKEN = "MCP_NOTES_TOKEN"
Fault = Literal["hang", "crash", "error", "huge", "binary", "garbage", "echo", "pid", "snoop"]


def build_server() -> Any:
    """The server (an ``MCPServer``); imported lazily so importing this module stays cheap."""
    import anyio
    from mcp.server.mcpserver import MCPServer
    from mcp.server.mcpserver.exceptions import ToolError
    from mcp_types import (
        BlobResourceContents,
        CallToolResult,
        EmbeddedResource,
        ImageContent,
        TextContent,
        ToolAnnotations,
    )

    server = MCPServer(
        "notes", instructions="Notes a team keeps: list, read and add them.", log_level="WARNING"
    )
    read_only = ToolAnnotations(read_only_hint=True)

    @server.tool(annotations=read_only)
    def list_notes() -> list[str]:
        """List the titles of the notes, oldest first."""
        return list(_load())

    @server.tool(annotations=read_only)
    def read_note(title: str) -> str:
        """Read the note with this title."""
        notes = _load()
        if title not in notes:
            raise ToolError(f"there is no note titled {title!r}")
        return notes[title]

    @server.tool(annotations=ToolAnnotations(read_only_hint=False, destructive_hint=False))
    def add_note(title: str, text: str) -> str:
        """Add a note (or replace the note with this title)."""
        notes = _load()
        notes[title] = text
        _save(notes)
        return f"saved note {title!r} ({len(notes)} notes)"

    if os.environ.get(FAULTS) == "1":

        @server.tool(annotations=read_only)
        async def fault(
            kind: Fault, seconds: float = 3600, size: int = 100_000, name: str = ""
        ) -> CallToolResult:
            """Misbehave on purpose (tests only)."""
            if kind == "hang":  # ``name``: a path (a FIFO) told when the hang begins
                if name:
                    await anyio.Path(name).write_text("hanging")
                await anyio.sleep(seconds)
            elif kind == "crash":
                print("notes: crashing on purpose", file=sys.stderr, flush=True)
                os._exit(3)
            elif kind == "error":
                raise ToolError("the notes store refused on purpose")
            elif kind == "huge":
                return CallToolResult(content=[TextContent(type="text", text="n" * size)])
            elif kind == "binary":
                blob = BlobResourceContents(
                    uri="file:///notes.bin",
                    mime_type="application/octet-stream",
                    blob=base64.b64encode(b"\x00\x01\x02" * 100).decode(),
                )
                return CallToolResult(
                    content=[
                        TextContent(type="text", text="a picture and a file"),
                        ImageContent(
                            type="image",
                            data=base64.b64encode(PNG_1PX).decode(),
                            mime_type="image/png",
                        ),
                        EmbeddedResource(type="resource", resource=blob),
                    ]
                )
            elif kind == "garbage":
                os.write(_PROTOCOL_FD or 1, b"this is not JSON-RPC\n")
                await anyio.sleep(seconds)
            elif kind == "snoop":
                dotenv = anyio.Path(".env")
                seen = {
                    "cwd": os.getcwd(),
                    "dotenv": await dotenv.read_text() if await dotenv.is_file() else None,
                    "environ": dict(os.environ),
                }
                return CallToolResult(content=[TextContent(type="text", text=json.dumps(seen))])
            elif kind == "pid":
                return CallToolResult(content=[TextContent(type="text", text=str(os.getpid()))])
            elif kind == "echo":  # to its answer and its stderr, as a careless server might
                line = f"{name}={os.environ.get(name, '')}"
                print(line, file=sys.stderr, flush=True)
                return CallToolResult(content=[TextContent(type="text", text=line)])
            return CallToolResult(content=[TextContent(type="text", text=f"{kind}: done")])

    return server


def _load() -> dict[str, str]:
    path = os.environ.get(NOTES_FILE)
    if not path:
        return dict(_MEMORY)
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}
    return {str(k): str(v) for k, v in data.items()}


def _save(notes: dict[str, str]) -> None:
    path = os.environ.get(NOTES_FILE)
    if not path:
        _MEMORY.clear()
        _MEMORY.update(notes)
        return
    tmp = Path(f"{path}.tmp")
    tmp.write_text(json.dumps(notes, indent=2, ensure_ascii=False), encoding="utf-8")
    os.replace(tmp, path)


_MEMORY: dict[str, str] = {}
# The SDK's stdio server moves the protocol off fd 1 (so a stray print cannot corrupt it); the
# garbage fault writes where the protocol really goes, through a copy taken before that.
_PROTOCOL_FD: int | None = None


def _serve_http(host: str, port: int) -> None:
    import anyio
    import uvicorn

    server = build_server()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(64)
    # Connections queue in the backlog from here on, so the URL is usable once printed.
    print(f"http://{host}:{sock.getsockname()[1]}/mcp", flush=True)
    config = uvicorn.Config(_guarded(server.streamable_http_app(host=host)), log_level="warning")
    anyio.run(uvicorn.Server(config).serve, [sock])


def _guarded(app: Any) -> Any:
    """``app`` behind the bearer token ``MCP_NOTES_TOKEN`` names, if it names one."""
    token = os.environ.get(TOKEN)
    if not token:
        return app
    expected = f"Bearer {token}".encode()

    async def guarded(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http" and dict(scope["headers"]).get(b"authorization") != expected:
            await send({"type": "http.response.start", "status": 401, "headers": []})
            await send({"type": "http.response.body", "body": b"missing or wrong token"})
            return
        await app(scope, receive, send)

    return guarded


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m standins.mcp_notes")
    parser.add_argument("--http", action="store_true", help="serve Streamable HTTP, not stdio")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0: any free port")
    args = parser.parse_args(argv)
    gate = os.environ.get(START_GATE)
    if gate and not Path(gate).exists():
        print(f"notes: not starting until {gate} exists", file=sys.stderr, flush=True)
        sys.exit(1)
    if args.http:
        _serve_http(args.host, args.port)
    else:
        global _PROTOCOL_FD
        _PROTOCOL_FD = os.dup(1) if os.environ.get(FAULTS) == "1" else None
        build_server().run("stdio")


def stdio_entry(env: Mapping[str, str] | None = None, **extra: Any) -> dict[str, Any]:
    """An ``mcpServers`` entry that runs this server over stdio with this interpreter."""
    entry: dict[str, Any] = {
        "command": sys.executable,
        "args": ["-m", "standins.mcp_notes"],
        "env": dict(env or {}),
    }
    return {**entry, **extra}


class NotesHttpServer:
    """The notes server over Streamable HTTP in a process of its own, so it can be stopped,
    killed and started again on the same port."""

    def __init__(self, *, port: int = 0, env: Mapping[str, str] | None = None) -> None:
        self.port = port
        self.env = dict(env or {})
        self.url = ""
        self._process: subprocess.Popen[str] | None = None

    def start(self, timeout: float = 60.0) -> str:
        command = [sys.executable, "-m", "standins.mcp_notes", "--http"]
        process = self._process = subprocess.Popen(
            [*command, "--port", str(self.port)],
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, **self.env},
        )
        assert process.stdout is not None
        ready, _, _ = select.select([process.stdout], [], [], timeout)
        line = process.stdout.readline().strip() if ready else ""
        if not line.startswith("http://"):
            self.stop()
            raise RuntimeError(f"the notes HTTP server did not start (exit {process.returncode})")
        self.url = line
        self.port = int(line.rsplit(":", 1)[1].split("/", 1)[0])
        return line

    def stop(self) -> None:
        """Stop the server (SIGTERM, then SIGKILL) and reap it."""
        process, self._process = self._process, None
        if process is None:
            return
        if process.poll() is None:
            process.terminate()
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        if process.stdout is not None:
            process.stdout.close()

    def __enter__(self) -> "NotesHttpServer":
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


if __name__ == "__main__":
    main()
