#!/usr/bin/env python3
# /// script
# requires-python = ">=3.11"
# dependencies = [
#     "mcp==2.3.0",
#     "httpx2==2.16.2",
# ]
# ///
"""The floor for bench_smol_mcp.py: the smallest server the same SDK can run.

One low-level ``Server`` with one trivial tool (``echo``), served over stdio
(default) or, with ``--http PORT``, over Streamable HTTP in JSON mode on
uvicorn, the way smol_mcp.py serves it (minus the token gate and its tools).
Whatever smol-mcp costs beyond this is smol-mcp's own.

With SMOL_LOCAL_URL set (``unix:///path`` or ``http://host:port``), a
second tool, ``get-machine``, makes the one engine request that
smol_mcp.py's get-machine makes (GET /api/v1/machines/{name}, on a
kept-alive connection) and returns the record, as plainly as asyncio
allows: the floor of a call that waits on the engine, which ``echo`` is
not.

``--http PORT --processes N`` serves from N processes that accept on one
listening socket (forked after it is bound): what more than one core gives
the bare SDK, for the 2026-07-28 era, whose requests need no session. A
handshake-era session lives in the process that opened it, and a client's
keep-alive connection stays with the process that accepted it.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import urllib.parse

import anyio
import mcp_types as types
from mcp.server import Server

ECHO = types.Tool(
    name="echo",
    description="Return the text it is given",
    input_schema={
        "type": "object",
        "properties": {"text": {"type": "string"}},
    },
    output_schema={
        "type": "object",
        "properties": {"text": {"type": "string"}},
        "required": ["text"],
    },
)


GET_MACHINE = types.Tool(
    name="get-machine",
    description="Return a machine's record, as the engine has it",
    input_schema={
        "type": "object",
        "properties": {"name": {"type": "string"}},
        "required": ["name"],
    },
)


class Engine:
    """The serve at SMOL_LOCAL_URL: GETs on kept-alive connections, one a
    call in flight, at most MAX_IDLE kept between calls (as smol_mcp.py's
    QuickReader keeps them)."""

    MAX_IDLE = 8

    def __init__(self, url: str):
        self.url = urllib.parse.urlsplit(url)
        self.idle: list = []

    async def connected(self):
        """A kept connection the engine has not closed, else a new one."""
        while self.idle:
            reader, writer = self.idle.pop()
            if not reader.at_eof() and not writer.is_closing():
                return reader, writer
            writer.close()
        if self.url.scheme == "unix":
            return await asyncio.open_unix_connection(self.url.path)
        return await asyncio.open_connection(self.url.hostname, self.url.port)

    async def get(self, path: str) -> dict:
        """The JSON body of a GET of ``path``; RuntimeError for any answer
        but a 200 of a length (a floor that passed a failure off as a call
        would flatter nothing)."""
        reader, writer = await self.connected()
        try:
            request = f"GET {path} HTTP/1.1\r\nHost: localhost\r\n\r\n"
            writer.write(request.encode())
            head = await reader.readuntil(b"\r\n\r\n")
            status_line, *lines = head.decode("latin-1").split("\r\n")
            fields = {}
            for line in lines:
                name, _, value = line.partition(":")
                fields[name.strip().lower()] = value.strip()
            length = fields.get("content-length", "")
            if status_line.split()[1] != "200" or not length.isdigit():
                raise RuntimeError(f"the engine answered {head[:200]!r}")
            body = await reader.readexactly(int(length))
        except BaseException:
            writer.close()
            raise
        closing = fields.get("connection") == "close"
        if not closing and len(self.idle) < self.MAX_IDLE:
            self.idle.append((reader, writer))
        else:
            writer.close()
        return json.loads(body)


ENGINE = None
if os.environ.get("SMOL_LOCAL_URL"):
    ENGINE = Engine(os.environ["SMOL_LOCAL_URL"])


async def list_tools(ctx, params):
    if ENGINE is None:
        return types.ListToolsResult(tools=[ECHO])
    return types.ListToolsResult(tools=[ECHO, GET_MACHINE])


async def call_tool(ctx, params):
    arguments = params.arguments or {}
    if params.name == "get-machine" and ENGINE is not None:
        name = urllib.parse.quote(str(arguments.get("name", "")), safe="")
        machine = await ENGINE.get(f"/api/v1/machines/{name}")
        return types.CallToolResult(
            content=[types.TextContent(type="text", text=json.dumps(machine))],
            structured_content={"machine": machine},
        )
    text = str(arguments.get("text", ""))
    return types.CallToolResult(
        content=[types.TextContent(type="text", text=text)],
        structured_content={"text": text},
    )


def no_header_schema(name: str) -> None:
    """No tool here declares x-mcp-header, as none of smol_mcp.py's does,
    and it tells the SDK the same way: without it the SDK would list every
    tool at each 2026-era call to look for Mcp-Param-* headers to check,
    a cost of the floor's configuration, not of the SDK."""
    return None


server = Server(
    "minimal",
    version="1.0",
    on_list_tools=list_tools,
    on_call_tool=call_tool,
    get_tool_input_schema=no_header_schema,
)


async def run_stdio() -> None:
    from mcp.server.stdio import stdio_server

    async with stdio_server() as (read, write):
        await server.run(read, write, server.create_initialization_options())


def listen(port: int):
    """Return the listening socket of --http (TCP_NODELAY, as uvicorn's)."""
    import socket

    listening = socket.socket(
        socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP
    )
    listening.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listening.bind(("127.0.0.1", port))
    listening.listen(2048)
    return listening


def serve_processes(port: int, processes: int) -> None:
    """Serve --http from ``processes`` processes on one socket.

    The first is this one; the others are forked children, stopped with
    it (SIGTERM to each).
    """
    import os
    import signal

    # uvicorn raises the signal that stopped it again once it has: with
    # the default action this process would die there, before it stops
    # its children, and they would outlive it. As an exception it unwinds
    # to the finally below, as does one that comes before uvicorn serves.
    def stop(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    stopping = (signal.SIGTERM, signal.SIGINT)
    for sig in stopping:
        signal.signal(sig, stop)
    listening = listen(port)
    children = []
    # Held until the forks are done: a signal that came during os.fork()
    # ran its handler in an at-fork callback, which ignores the
    # exception, and the stop was lost (4 stops of 160 under load).
    signal.pthread_sigmask(signal.SIG_BLOCK, stopping)
    try:
        for _ in range(processes - 1):
            pid = os.fork()
            if pid == 0:
                try:
                    signal.pthread_sigmask(signal.SIG_UNBLOCK, stopping)
                    anyio.run(run_http, listening)
                finally:
                    os._exit(0)
            children.append(pid)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, stopping)
        anyio.run(run_http, listening)
    finally:
        for pid in children:
            os.kill(pid, signal.SIGTERM)
            os.waitpid(pid, 0)


async def run_http(listening) -> None:
    from contextlib import asynccontextmanager

    import uvicorn
    from mcp.server.streamable_http_manager import (
        StreamableHTTPASGIApp,
        StreamableHTTPSessionManager,
    )
    from starlette.applications import Starlette
    from starlette.routing import Route

    manager = StreamableHTTPSessionManager(server, json_response=True)

    @asynccontextmanager
    async def lifespan(_):
        async with manager.run():
            yield

    app = Starlette(
        routes=[Route("/mcp", endpoint=StreamableHTTPASGIApp(manager))],
        lifespan=lifespan,
    )
    config = uvicorn.Config(
        app,
        lifespan="on",
        log_level="warning",
        timeout_graceful_shutdown=2,
    )
    await uvicorn.Server(config).serve(sockets=[listening])


if __name__ == "__main__":
    if len(sys.argv) in (3, 5) and sys.argv[1] == "--http":
        processes = 1
        if len(sys.argv) == 5 and sys.argv[3] == "--processes":
            processes = int(sys.argv[4])
        serve_processes(int(sys.argv[2]), processes)
    else:
        anyio.run(run_stdio)
