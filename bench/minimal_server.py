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

``--http PORT --processes N`` serves from N processes that accept on one
listening socket (forked after it is bound): what more than one core gives
the bare SDK, for the 2026-07-28 era, whose requests need no session. A
handshake-era session lives in the process that opened it, and a client's
keep-alive connection stays with the process that accepted it.
"""

from __future__ import annotations

import sys

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


async def list_tools(ctx, params):
    return types.ListToolsResult(tools=[ECHO])


async def call_tool(ctx, params):
    text = str((params.arguments or {}).get("text", ""))
    return types.CallToolResult(
        content=[types.TextContent(type="text", text=text)],
        structured_content={"text": text},
    )


server = Server(
    "minimal", version="1.0", on_list_tools=list_tools, on_call_tool=call_tool
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
