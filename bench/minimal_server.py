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


async def run_http(port: int) -> None:
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
        host="127.0.0.1",
        port=port,
        lifespan="on",
        log_level="warning",
        timeout_graceful_shutdown=2,
    )
    await uvicorn.Server(config).serve()


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--http":
        anyio.run(run_http, int(sys.argv[2]))
    else:
        anyio.run(run_stdio)
