#!/usr/bin/env python3
# /// script
# requires-python = ">=3.11"
# # anyio, starlette, pydantic, jsonschema and mcp_types come with mcp 2.3.0
# # (its own requirements). httpx2 is the HTTP client mcp 2.x depends on, so
# # the cloud fleet uses it rather than a second stack. uvicorn and h11 are
# # pinned exactly: the HTTP front subclasses uvicorn's H11Protocol and reads
# # its internals, so only the tested versions are allowed.
# dependencies = [
#     "mcp==2.3.0",
#     "httpx2==2.16.2",
#     "uvicorn==0.54.0",
#     "h11==0.16.0",
# ]
# ///
"""smol-mcp: an MCP server that gives an AI agent microVMs to work in.

The agent creates a machine from an OCI image, runs commands in it, reads and
writes its files, branches it, follows its log and deletes it, through MCP
tools (long commands show their output as they run, or run as jobs). Every
command a tool runs executes inside a guest; the only host
process this server ever spawns is ``smolvm serve``, and only when a local tool
is first called.

Run it with ``uv run smol_mcp.py`` (stdio) or ``--http`` (Streamable HTTP).
Importing this module has no side effects; ``__all__`` is the surface for
embedding: ``load_config()``, ``build_server(config)``, the ``Fleet`` contract
with its ``FLEETS`` registry, and ``main()``.

A tool call's path, by section number:

    stdio (13) | HTTP and the plain API (14),
                 with OAuth and the operator's pages (14b)
      -> the MCP server (12), with the caller's session (10)
      -> agent access (11): token, scope, owner, approval, activity log
      -> argument validation (7) -> the tool's handler (8)
      -> the Fleet contract (3): LocalFleet (3) or CloudFleet (4) -> the engine
      <- one record shape (5), output within the reply budget (6)

The file is in dependency order, lowest first: configuration and errors; the
fleets behind one contract; what shapes a reply; validation and the tools;
resources, sessions and agent access; the MCP server; the transports that
carry it (stdio, HTTP, sign-in and OAuth); the command line, which wires it
all together, last.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextvars
import dataclasses
import datetime
import errno
import fcntl
import functools
import gc
import getpass
import hashlib
import hmac
import html
import http.client
import importlib.metadata
import ipaddress
import itertools
import json
import logging
import math
import os
import re
import secrets as secrets_module
import select
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import weakref
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, Required, TypedDict, Unpack

# Nine third-party packages, all but anyio imported where they are used.
# anyio, starlette, pydantic, jsonschema and mcp_types come with mcp 2.3.0
# (its own requirements); httpx2 is the HTTP client mcp 2.x depends on, so
# the cloud fleet uses it rather than a second stack; uvicorn and h11 are
# pinned exactly because the HTTP front subclasses uvicorn's H11Protocol and
# reads its internals, so only the tested versions will do.
import anyio

__version__ = "0.1.0"
__all__ = [
    "Config",
    "load_config",
    "Fleet",
    "FLEETS",
    "LocalFleet",
    "CloudFleet",
]
__all__ += ["SmolMcp", "build_server", "main", "main_http"]

log = logging.getLogger("smol_mcp")


# ---------------------------------------------------------------------------
# 1. Configuration
#
# Environment over config file over default. The file is JSON with
# camelCase keys; anything unknown, mistyped or out of range stops startup
# with a message naming the key, because a setting that is silently
# ignored is worse than one that refuses to start.
# ---------------------------------------------------------------------------

DEFAULT_CLOUD_URL = "https://api.smolmachines.com"
# A mount root that allows writing ends in this.
MOUNT_ROOT_WRITABLE = ":rw"


# Kinds read from the config file only: a structure has no spelling as
# one environment variable.
FILE_ONLY_KINDS = ("pools",)


def setting_field(
    default: Any,
    env: str = "",
    kind: str = "",
    *,
    example: Any = None,
    **limits: Any,
) -> Any:
    """One Config field: its default, its environment variable (SMOL_MCP_
    and the name in capitals unless given; none for a FILE_ONLY_KINDS
    kind), its kind ("str", "int", "choice", "version", "list",
    "secret", "fleets", "pools"; inferred unless given; ints take
    ``minimum`` and ``maximum``), a valid ``example`` other than the
    default (as the config file would hold it) and its file key (the
    camelCase name). SETTINGS derives from these."""
    if not kind and "choices" in limits:
        kind = "choice"
    elif not kind:
        kind = {int: "int", tuple: "list"}.get(type(default), "str")
    rule = {"env": env, "kind": kind, "example": example, **limits}
    return field(
        default=default, repr=kind != "secret", metadata={"setting": rule}
    )


@dataclass(frozen=True)
class WarmPool:
    """One pool of warmPools: the machine its workers are branched from,
    and how many the engine keeps booted (None: the setting's default)."""

    name: str
    image: str
    ready: int
    cpus: int | None = None
    memory_mb: int | None = None
    network: str | None = None
    allow_hosts: tuple[str, ...] = ()
    allow_cidrs: tuple[str, ...] = ()


@dataclass(frozen=True)
class Config:
    """Every setting, already validated. Build one with ``load_config()``."""

    smolvm: str = setting_field(
        "smolvm", "SMOLVM", example="/opt/smolmachines/smolvm"
    )
    min_smolvm: str = setting_field("1.14.0", kind="version", example="1.2.3")
    local_url: str = setting_field(
        "", "SMOL_LOCAL_URL", example="unix:///run/smolvm/serve.sock"
    )
    runtime_dir: str = setting_field("", example="/run/user/1000/smol-mcp")
    machine_prefix: str = setting_field("mcp-", example="tmp-")
    memory_mb: int = setting_field(
        2048, minimum=128, maximum=1048576, example=4096
    )
    cpus: int = setting_field(2, minimum=1, maximum=255, example=4)
    network_default: str = setting_field(
        "blocked", choices=("blocked", "open"), example="open"
    )
    run_once_network: str = setting_field(
        "blocked", choices=("blocked", "open"), example="open"
    )
    ephemeral_ttl_secs: int = setting_field(3600, minimum=60, example=7200)
    ephemeral_auto_stop_secs: int = setting_field(900, minimum=60, example=600)
    exec_timeout_secs: int = setting_field(120, minimum=1, example=60)
    max_exec_timeout_secs: int = setting_field(
        900, minimum=1, maximum=86400, example=1200
    )
    max_output_bytes: int = setting_field(
        65536, minimum=1024, maximum=64 * 1024 * 1024, example=4096
    )
    ready_timeout_secs: int = setting_field(120, minimum=1, example=30)
    serve_start_timeout_secs: int = setting_field(60, minimum=1, example=30)
    logs_tail: int = setting_field(100, minimum=1, maximum=100000, example=10)
    logs_poll_secs: int = setting_field(2, minimum=1, example=5)
    cloud_url: str = setting_field(
        DEFAULT_CLOUD_URL, "SMOL_CLOUD_URL", example="https://api.example.com"
    )
    cloud_token: str = setting_field(
        "", "SMOL_CLOUD_TOKEN", "secret", example="smk_example"
    )
    # Which fleets (section 3) it serves: "auto", "both" or their names
    # joined by commas; read against the registry once it is filled.
    targets: str = setting_field("auto", kind="fleets", example="local,cloud")
    http_host: str = setting_field("127.0.0.1", example="0.0.0.0")
    http_port: int = setting_field(
        8080, minimum=1, maximum=65535, example=9000
    )
    http_path: str = setting_field("/mcp", example="/smol/mcp")
    auth_token: str = setting_field("", kind="secret", example="a-secret")
    http_session_idle_secs: int = setting_field(1800, minimum=1, example=60)
    # A 2026-era client over HTTP cannot say it left: this bounds how long
    # its token's state outlives its last request.
    http_stateless_idle_secs: int = setting_field(300, minimum=1, example=60)
    http_allowed_hosts: tuple[str, ...] = setting_field(
        (), example=["mcp.example.com"]
    )
    http_allowed_origins: tuple[str, ...] = setting_field(
        (), example=["https://app.example.com"]
    )
    # --http behind a reverse proxy: the proxy's addresses, whose
    # X-Forwarded-For then names the caller. Empty: the peer is the caller.
    trusted_proxies: tuple[str, ...] = setting_field((), example=["10.0.0.1"])
    state_dir: str = setting_field("", example="/var/lib/smol-mcp")
    # --http behind a proxy or TLS
    public_url: str = setting_field("", example="https://mcp.example.com")
    # Empty: every scope (section 11).
    scopes: tuple[str, ...] = setting_field(
        (), example=["machines.read", "sandbox.exec"]
    )
    mount_roots: tuple[str, ...] = setting_field(
        (), example=["/srv", "/work:rw"]
    )
    # stdio: "changes" holds every changing call for a person
    approval: str = setting_field(
        "none", choices=("none", "changes"), example="changes"
    )
    approval_timeout_secs: int = setting_field(
        900, minimum=1, maximum=7 * 86400, example=60
    )
    approval_webhook: str = setting_field(
        "", example="https://hooks.example/smol"
    )
    approval_via: str = setting_field(
        "terminal", choices=("terminal", "client"), example="client"
    )
    egress_private_cidrs: tuple[str, ...] = setting_field(
        (), example=["10.0.0.0/8", "fd00::/64"]
    )
    reply_tokens: int = setting_field(
        20000, minimum=4000, maximum=1_000_000, example=50000
    )
    # The host address published ports bind (one IPv4 address; empty: the
    # engine's loopback), and the host ports an agent may name.
    expose_hosts: tuple[str, ...] = setting_field((), example=["192.0.2.10"])
    expose_ports: tuple[str, ...] = setting_field(
        (), example=["8000-8099", "9000"]
    )
    # Booted machines the operator keeps ready (WarmPool, above).
    warm_pools: tuple[WarmPool, ...] = setting_field(
        (), kind="pools", example={"py": {"image": "alpine", "ready": 2}}
    )

    def secret_values(self) -> list[str]:
        """The configured secrets, so they can be kept out of children and
        messages."""
        secrets = [s.attr for s in SETTINGS if s.kind == "secret"]
        values = (getattr(self, attr) for attr in secrets)
        return [value for value in values if value]


@dataclass(frozen=True)
class Setting:
    """One setting as the loader reads it, derived from its Config field."""

    key: str
    env: str
    attr: str
    kind: str
    choices: tuple[str, ...] = ()
    minimum: int | None = None
    maximum: int | None = None
    # A valid value other than the default, as the config file holds it.
    example: Any = None


def _camel(attr: str) -> str:
    return re.sub(r"_([a-z])", lambda match: match.group(1).upper(), attr)


def _setting(f: dataclasses.Field) -> Setting:
    rule = f.metadata["setting"]
    env = rule["env"] or f"SMOL_MCP_{f.name.upper()}"
    if rule["kind"] in FILE_ONLY_KINDS:
        env = ""
    return Setting(_camel(f.name), attr=f.name, **{**rule, "env": env})


SETTINGS: tuple[Setting, ...] = tuple(
    _setting(f) for f in dataclasses.fields(Config)
)


def config_file_path(environ: dict[str, str]) -> Path:
    """Where the config file is looked for: $SMOL_MCP_CONFIG, else the XDG
    path."""
    if environ.get("SMOL_MCP_CONFIG"):
        return Path(environ["SMOL_MCP_CONFIG"]).expanduser()
    home = Path(environ.get("HOME") or Path.home())
    config_home = Path(environ.get("XDG_CONFIG_HOME") or home / ".config")
    return config_home / "smol-mcp" / "config.json"


def _parse_setting(setting: Setting, value: Any, source: str) -> Any:
    """One raw value (an environment string, or JSON from the file) as its
    setting's type; raise ConfigError naming the setting when it is not
    one."""
    if source == "env":
        where = setting.env
    else:
        where = f'"{setting.key}" in the config file'
    if setting.kind in ("str", "secret", "version"):
        return _parse_text(setting, value, where)
    if setting.kind == "choice":
        if not isinstance(value, str) or value.strip() not in setting.choices:
            raise ConfigError(
                f"{where} must be one of {', '.join(setting.choices)}; "
                f"got {value!r}"
            )
        return value.strip()
    if setting.kind == "int":
        return _parse_int(setting, value, source, where)
    if setting.kind == "pools":
        return parse_warm_pools(value, where)
    if setting.kind == "fleets":
        return _parse_fleets(value, where)
    # The one kind left: "list".
    if source == "env":
        value = value.split(",")
    elif not isinstance(value, list) or not all(
        isinstance(v, str) for v in value
    ):
        raise ConfigError(f"{where} must be a list of strings")
    return tuple(v.strip() for v in value if v.strip())


def _parse_text(setting: Setting, value: Any, where: str) -> str:
    """A "str", "secret" or "version" value, stripped; raise ConfigError
    when it is not a string, or not a version where one is due."""
    if not isinstance(value, str):
        raise ConfigError(f"{where} must be a string, got {_json_type(value)}")
    value = value.strip()
    if (
        setting.kind == "version"
        and value
        and not re.fullmatch(r"\d+(\.\d+){0,2}", value)
    ):
        why = "a version such as 1.14.0 (or empty to skip the check)"
        raise ConfigError(f"{where} must be {why}, got {value!r}")
    return value


def _parse_int(setting: Setting, value: Any, source: str, where: str) -> int:
    """An "int" value; raise ConfigError when it is not a whole number, or
    is outside the setting's bounds."""
    if source == "env":
        if not re.fullmatch(r"\s*-?\d+\s*", value):
            raise ConfigError(f"{where} must be a whole number, got {value!r}")
        value = int(value)
    elif isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(
            f"{where} must be a whole number, got {_json_type(value)}"
        )
    if setting.minimum is not None and value < setting.minimum:
        raise ConfigError(
            f"{where} must be at least {setting.minimum}, got {value}"
        )
    if setting.maximum is not None and value > setting.maximum:
        raise ConfigError(
            f"{where} must be at most {setting.maximum}, got {value}"
        )
    return value


# warmPools: each pool holds up to 16 booted machines, and a host holds
# few such pools. A pool's name leaves room for the machines named after
# it (smol-pool-NAME, and the engine's pool-NAME-xxxxxxxx).
WARM_POOLS_MAX = 8
WARM_POOL_READY_MAX = 16
WARM_POOL_NAME_MAX = 64
# Each key of a pool: (its WarmPool attribute, its rule).
WARM_POOL_KEYS = {
    "image": ("image", "a string"),
    "ready": ("ready", (1, WARM_POOL_READY_MAX)),
    "cpus": ("cpus", (1, 255)),
    "memoryMb": ("memory_mb", (128, 1048576)),
    "network": ("network", ("open", "blocked")),
    "allowHosts": ("allow_hosts", "a list"),
    "allowCidrs": ("allow_cidrs", "a list"),
}


def parse_warm_pools(value: Any, where: str) -> tuple[WarmPool, ...]:
    """warmPools as WarmPools, in the file's order; raise ConfigError
    naming the pool and key at the first flaw (egress entries are
    checked with the other settings, in _check_warm_pools)."""
    example = '{"py": {"image": "python:3.12-alpine", "ready": 2}}'
    if not isinstance(value, dict):
        raise ConfigError(
            f"{where} must be an object of pools by name, such as {example}"
            f"; got {_json_type(value)}"
        )
    if len(value) > WARM_POOLS_MAX:
        raise ConfigError(
            f"{where} names {len(value)} pools; at most {WARM_POOLS_MAX}, "
            "as each keeps booted machines on this host"
        )
    return tuple(_warm_pool(name, spec, where) for name, spec in value.items())


def _warm_pool(name: str, spec: Any, where: str) -> WarmPool:
    """One pool of warmPools; raise ConfigError naming its flaw."""
    at = f'{where}, pool "{name}",'
    named = NAME_RE.fullmatch(name) and len(name) <= WARM_POOL_NAME_MAX
    if not named:
        raise ConfigError(
            f"{where} names the pool {name!r}: a pool name starts with a "
            "letter or digit and holds only letters, digits, '-' and '_', "
            f"at most {WARM_POOL_NAME_MAX} of them"
        )
    if not isinstance(spec, dict):
        raise ConfigError(
            f"{at} must be an object such as "
            f'{{"image": "alpine", "ready": 2}}; got {_json_type(spec)}'
        )
    for key in spec:
        if key not in WARM_POOL_KEYS:
            maybe = did_you_mean(key, WARM_POOL_KEYS)
            raise ConfigError(
                f'{at} has no key "{key}"{maybe}; the keys are: '
                f"{', '.join(WARM_POOL_KEYS)}"
            )
    for key in ("image", "ready"):
        if key not in spec:
            raise ConfigError(f'{at} needs "{key}"')
    fields = {
        WARM_POOL_KEYS[key][0]: _warm_pool_value(key, raw, at)
        for key, raw in spec.items()
    }
    return WarmPool(name, **fields)


def _warm_pool_value(key: str, raw: Any, at: str) -> Any:
    """One key's value of a pool, as WarmPool holds it; raise ConfigError
    when it breaks the key's rule."""
    rule = WARM_POOL_KEYS[key][1]
    if rule == "a string":
        text = raw.strip() if isinstance(raw, str) else ""
        if not text or re.search(r"[\x00-\x20\x7f]", text):
            raise ConfigError(
                f'{at} "{key}" must be an image reference such as alpine, '
                f"without spaces; got {json.dumps(raw)[:60]}"
            )
        return text
    if rule == "a list":
        if not isinstance(raw, list) or not all(
            isinstance(item, str) for item in raw
        ):
            raise ConfigError(f'{at} "{key}" must be a list of strings')
        return tuple(raw)
    if isinstance(rule[0], str):
        if raw not in rule:
            raise ConfigError(
                f'{at} "{key}" must be one of {", ".join(rule)}; '
                f"got {json.dumps(raw)[:60]}"
            )
        return raw
    whole = isinstance(raw, int) and not isinstance(raw, bool)
    if not whole or not rule[0] <= raw <= rule[1]:
        raise ConfigError(
            f'{at} "{key}" must be a whole number from {rule[0]} to '
            f"{rule[1]}; got {json.dumps(raw)[:60]}"
        )
    return raw


def _parse_fleets(value: Any, where: str) -> str:
    """A "fleets" value: "auto", "both", or fleet names joined by commas
    (section 3), in the registry's order; raise ConfigError when it is
    none of these, naming the fleets."""
    if isinstance(value, str) and value.strip() in ("auto", "both"):
        return value.strip()
    try:
        if not isinstance(value, str):
            raise ValueError(f"got {_json_type(value)}")
        return ",".join(named_fleets(value))
    except ValueError as err:
        accepted = fleets_accepted("auto")
        raise ConfigError(f"{where} must be {accepted}; {err}") from None


def _json_type(value: Any) -> str:
    names = {
        bool: "a boolean",
        int: "a number",
        float: "a number",
        str: "a string",
        list: "a list",
        dict: "an object",
        type(None): "null",
    }
    return names.get(type(value), type(value).__name__)


def load_config(environ: dict[str, str] | None = None) -> Config:
    """The config file and the environment as a validated Config. A missing
    file is fine; anything else wrong raises ConfigError with a sentence
    naming the key (never a secret)."""
    environ = dict(os.environ if environ is None else environ)
    path = config_file_path(environ)
    values = _file_values(_read_config_file(path), path)
    for setting in SETTINGS:
        if setting.env and setting.env in environ:
            raw = environ[setting.env]
            values[setting.attr] = _parse_setting(setting, raw, "env")
    config = Config(**values)
    _check_config(config)
    _check_public_url(config)
    runtime_dir = config.runtime_dir or default_runtime_dir(environ)
    state_dir = config.state_dir or default_state_dir(environ)
    return dataclasses.replace(
        config, runtime_dir=runtime_dir, state_dir=state_dir
    )


def _read_config_file(path: Path) -> dict:
    """The config file's JSON object; {} when there is no file. Raise
    ConfigError when it cannot be read, or is not a JSON object."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}
    except OSError as exc:
        raise ConfigError(
            f"cannot read the config file {path}: {exc.strerror}"
        ) from None
    except json.JSONDecodeError as exc:
        where = f"{exc.msg} at line {exc.lineno} column {exc.colno}"
        raise ConfigError(
            f"the config file {path} is not valid JSON: {where}"
        ) from None
    if not isinstance(data, dict):
        raise ConfigError(
            f"the config file {path} must hold a JSON object of settings"
        )
    return data


def _file_values(data: dict, path: Path) -> dict[str, Any]:
    """The config file's settings by Config attribute, each parsed; raise
    ConfigError for a key that is not a setting, naming the accepted
    ones."""
    by_key = {s.key: s for s in SETTINGS}
    values = {}
    for key, raw in data.items():
        if key not in by_key:
            maybe = did_you_mean(key, by_key)
            raise ConfigError(
                f'unknown key "{key}" in the config file {path}{maybe}; '
                f"the accepted keys are: {', '.join(by_key)}"
            )
        values[by_key[key].attr] = _parse_setting(by_key[key], raw, "file")
    return values


def _check_config(config: Config) -> None:
    """Raise ConfigError for the first setting that is wrong in a way its
    kind cannot say: against another setting, or in its form."""
    if config.exec_timeout_secs > config.max_exec_timeout_secs:
        raise ConfigError(
            f"execTimeoutSecs ({config.exec_timeout_secs}) must not be "
            "above maxExecTimeoutSecs "
            f"({config.max_exec_timeout_secs})"
        )
    if not NAME_RE.fullmatch(config.machine_prefix + "x"):
        raise ConfigError(
            "machinePrefix must start with a letter or digit and hold only "
            "letters, digits, '-' and '_', "
            f"got {config.machine_prefix!r}"
        )
    if not config.machine_prefix:
        why = "it is what marks a machine as ephemeral"
        raise ConfigError(f"machinePrefix must not be empty: {why}")
    if not config.http_path.startswith("/"):
        raise ConfigError(
            f"httpPath must start with '/', got {config.http_path!r}"
        )
    if config.local_url:
        # Raises ConfigError when not a loopback or unix URL.
        parse_local_url(config.local_url)
    unknown = [scope for scope in config.scopes if scope not in SCOPES]
    if unknown:
        named = ", ".join(repr(scope) for scope in unknown)
        why = f"which is not a scope; the scopes are: {', '.join(SCOPES)}"
        raise ConfigError(f"SMOL_MCP_SCOPES (scopes) names {named}, {why}")
    # Raises ConfigError naming a root that is not absolute.
    parse_mount_roots(config.mount_roots)
    for cidr in config.egress_private_cidrs:
        try:
            ipaddress.ip_network(cidr)
        except ValueError as err:
            why = f"{cidr!r}, not an address range: {err}"
            raise ConfigError(f"egressPrivateCidrs holds {why}") from None
    for proxy in config.trusted_proxies:
        try:
            ipaddress.ip_network(proxy, strict=False)
        except ValueError as err:
            why = f"{proxy!r}, not an address or a range of addresses: {err}"
            where = "trustedProxies (SMOL_MCP_TRUSTED_PROXIES)"
            raise ConfigError(f"{where} holds {why}") from None
    # Each raises ConfigError naming the entry that is wrong.
    parse_expose_hosts(config.expose_hosts)
    parse_expose_ports(config.expose_ports)
    webhook = config.approval_webhook
    scheme = urllib.parse.urlsplit(webhook).scheme
    if webhook and scheme not in ("http", "https"):
        why = f"must be an http:// or https:// URL, got {webhook!r}"
        raise ConfigError(f"approvalWebhook (SMOL_MCP_APPROVAL_WEBHOOK) {why}")
    _check_warm_pools(config)


def _check_warm_pools(config: Config) -> None:
    """Raise ConfigError for a pool whose egress create-machine would
    refuse: an allow list and a network together, or an entry no allow
    list may hold."""
    for pool in config.warm_pools:
        at = f'warmPools, pool "{pool.name}",'
        lists = pool.allow_hosts or pool.allow_cidrs
        if lists and pool.network is not None:
            raise ConfigError(
                f'{at} gives "network" and an allow list: an allow list '
                "already means egress to those destinations only; keep one"
            )
        try:
            for index, host in enumerate(pool.allow_hosts):
                egress_host(host, f"allowHosts[{index}]", True, config)
            for index, cidr in enumerate(pool.allow_cidrs):
                egress_cidr(cidr, f"allowCidrs[{index}]", config)
        except ArgumentError as err:
            raise ConfigError(f"{at} {err}") from None


def _check_public_url(config: Config) -> None:
    """Raise ConfigError unless publicUrl is empty, or an https:// address
    (http:// on loopback) without a path."""
    if not config.public_url:
        return
    public = urllib.parse.urlsplit(config.public_url)
    plain_http = (
        public.scheme == "http" and public.hostname not in LOOPBACK_HOSTS
    )
    more = public.path.strip("/") or public.query or public.fragment
    if public.scheme not in ("http", "https") or plain_http or more:
        raise ConfigError(
            "publicUrl (SMOL_MCP_PUBLIC_URL) is the https:// address "
            "clients reach --http at, without a path, such as "
            f"https://mcp.example.com; got {config.public_url!r}"
        )


def default_runtime_dir(environ: dict[str, str]) -> str:
    """$XDG_RUNTIME_DIR/smol-mcp, else a per-user folder in the temp
    directory."""
    if environ.get("XDG_RUNTIME_DIR"):
        return str(Path(environ["XDG_RUNTIME_DIR"]) / "smol-mcp")
    return str(Path(tempfile.gettempdir()) / f"smol-mcp-{os.getuid()}")


def default_state_dir(environ: dict[str, str]) -> str:
    """$XDG_STATE_HOME/smol-mcp, else ~/.local/state/smol-mcp (tokens
    outlive a reboot)."""
    if environ.get("XDG_STATE_HOME"):
        return str(Path(environ["XDG_STATE_HOME"]) / "smol-mcp")
    home = Path(environ.get("HOME") or Path.home())
    return str(home / ".local" / "state" / "smol-mcp")


def ensure_runtime_dir(path: str) -> Path:
    """ensure_private_dir for the runtime directory: it holds an
    unauthenticated API's socket."""
    return ensure_private_dir(
        path, "runtime directory", "SMOL_MCP_RUNTIME_DIR"
    )


def ensure_private_dir(path: str | Path, what: str, env: str) -> Path:
    """Create a directory with mode 0700; refuse one another user owns or
    can open (``what`` names it, the variable ``env`` moves it)."""
    directory = Path(path)
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    info = directory.stat()
    if info.st_uid != os.getuid():
        why = f"belongs to another user; set {env} to a directory of your own"
        raise SmolError(f"the {what} {directory} {why}")
    if info.st_mode & 0o077:
        # Not tightened in place: it may be a shared directory such as /tmp
        # that others rely on.
        mode = oct(info.st_mode & 0o777)
        raise SmolError(
            f"the {what} {directory} can be opened by other users "
            f"(mode {mode}); set {env} to a directory only you can open, "
            "for example one made with mkdir -m 700"
        )
    return directory


def parse_mount_roots(roots: tuple[str, ...]) -> list[tuple[str, bool]]:
    """The mount roots as (resolved directory, writable): absolute host
    directories, read-only unless ending in ":rw", resolved so a source is
    compared with the real place; raise ConfigError for any other."""
    parsed = []
    for root in roots:
        writable = root.endswith(MOUNT_ROOT_WRITABLE)
        if writable:
            directory = root.removesuffix(MOUNT_ROOT_WRITABLE)
        else:
            directory = root.removesuffix(":ro")
        if not directory.startswith("/") or any(
            c in directory for c in "\0\n\r"
        ):
            raise ConfigError(
                "mountRoots entries must be absolute host directories, "
                'optionally ending in ":rw" to allow writing (for example '
                f"/srv/work:rw); got {root!r}"
            )
        parsed.append((os.path.realpath(directory), writable))
    return parsed


def parse_expose_hosts(hosts: tuple[str, ...]) -> str | None:
    """The one host address exposeHosts names, or None for the engine's
    loopback; raise ConfigError unless it is one IPv4 address other than
    0.0.0.0 (the engine reads one IPv4 address, SMOLVM_PUBLISH_ADDR, and
    ignores any other value)."""
    if len(hosts) > 1:
        raise ConfigError(
            f"exposeHosts names {len(hosts)} addresses, but smolvm binds "
            "published ports to one IPv4 address: name the one people "
            "reach, such as 192.0.2.10"
        )
    if not hosts:
        return None
    try:
        address = ipaddress.IPv4Address(hosts[0])
    except ValueError:
        raise ConfigError(
            f"exposeHosts holds {hosts[0]!r}, not an IPv4 address; smolvm "
            "binds published ports to an IPv4 address only (it ignores "
            "anything else), such as 192.0.2.10"
        ) from None
    if address.is_unspecified:
        raise ConfigError(
            "exposeHosts holds 0.0.0.0, which binds every interface and "
            "names none a person could open: name the one address people "
            "reach, such as 192.0.2.10"
        )
    return str(address)


def parse_expose_ports(ports: tuple[str, ...]) -> list[range]:
    """The host ports exposePorts lets an agent name, as ranges; raise
    ConfigError for an entry that is not a port (1-65535) or a range of
    them written LOW-HIGH."""
    ranges = []
    for entry in ports:
        match = re.fullmatch(r"(\d{1,5})(?:-(\d{1,5}))?", entry)
        low = high = 0
        if match:
            low = int(match[1])
            high = int(match[2] or match[1])
        if not match or not 1 <= low <= high <= 65535:
            raise ConfigError(
                f"exposePorts holds {entry!r}; each entry is a host port "
                "(1-65535) or a range of them, such as 8000 or 8000-8099"
            )
        ranges.append(range(low, high + 1))
    return ranges


def parse_local_url(url: str) -> tuple[str, str | int]:
    """SMOL_LOCAL_URL as ("unix", path) or ("tcp", port). Only a Unix
    socket or a loopback port: the local API has no authentication, so
    reaching it across a network hands the host out. Raise ConfigError for
    any other URL."""
    parsed = urllib.parse.urlsplit(url)
    if parsed.scheme == "unix":
        path = parsed.path or parsed.netloc
        if not path.startswith("/"):
            raise ConfigError(
                "SMOL_LOCAL_URL must name an absolute socket path, as "
                f"unix:///path/to/serve.sock; got {url!r}"
            )
        return "unix", path
    loopback = parsed.hostname in LOOPBACK_HOSTS
    if parsed.scheme == "http" and loopback and parsed.port:
        return "tcp", parsed.port
    forms = "unix:///absolute/path.sock or http://127.0.0.1:PORT"
    why = "loopback only, because the local API has no authentication"
    raise ConfigError(f"SMOL_LOCAL_URL must be {forms} ({why}); got {url!r}")


# ---------------------------------------------------------------------------
# 2. Errors
#
# Every failure a caller can act on is a SmolError whose text says what
# happened and what to do next. Tool handlers let these travel up; the
# dispatcher makes them tool errors (isError: true).
# ---------------------------------------------------------------------------


class SmolError(Exception):
    """A failure to report to the caller; ``str(err)`` is the whole message."""


class ConfigError(SmolError):
    """A setting is unknown, mistyped or out of range."""


class ArgumentError(SmolError):
    """A tool argument is unknown, mistyped or out of range."""


class NotRunning(SmolError):
    """The machine is not running, so a command was not sent (the tools
    start it and retry)."""


class Paused(NotRunning):
    """The machine is paused: its saved execution must be resumed, not
    booted afresh (the tools that use a machine resume it and retry; the
    text says what to do for the others)."""


class PoolEmpty(SmolError):
    """No warm machine could be leased from a pool; the text says why (the
    machine is then made cold from the pool's spec)."""


class ApiError(SmolError):
    """The machine API refused a request; keeps its status, code and
    message to branch on."""

    def __init__(
        self,
        fleet: str,
        action: str,
        status: int,
        code: str,
        message: str,
        engine_log: tuple[str, ...] = (),
    ):
        self.fleet = fleet
        self.action = action
        self.status = status
        self.code = code
        self.api_message = message
        # Lines of the engine's own log its message quoted ahead of the
        # cause (split_engine_log): said last, after every hint.
        self.engine_log = engine_log
        label = f"HTTP {status} {code}".strip()
        super().__init__(
            f"The {fleet} machine API refused to {action}: {message} ({label})"
        )

    def __str__(self) -> str:
        if not self.engine_log:
            return super().__str__()
        lines = "\n".join(f"  {line}" for line in self.engine_log)
        return (
            f"{self.args[0]}\nThe engine's own log before it failed:\n{lines}"
        )

    def with_hint(self, hint: str) -> ApiError:
        """The same error with one more sentence telling the caller what to
        do."""
        err = ApiError(
            self.fleet,
            self.action,
            self.status,
            self.code,
            self.api_message,
            self.engine_log,
        )
        err.args = (f"{self.args[0]}. {hint}",)
        return err


def redact(text: str, secret_values: list[str]) -> str:
    """``text`` with every configured secret replaced: the last defence for
    others' data."""
    for value in secret_values:
        if value:
            text = text.replace(value, "[redacted]")
    return text


# ---------------------------------------------------------------------------
# 3. Fleets: the contract both keep, then the local fleet (smolvm serve)
#
# The local fleet: http.client over AF_UNIX to `smolvm serve start --listen
# <runtimeDir>/serve.sock`, spawned on the first local call and never at
# connect. Every method here blocks; the tool layer runs them in worker
# threads so one long command never stalls another session. The exception,
# read_now, makes the quick reads' one GET on the event loop (QuickReader),
# where a thread hop cost more than the read.
# ---------------------------------------------------------------------------

# -- the fleet contract: a fleet is one class with these members, and one
# row in FLEETS


class JobOptions(TypedDict, total=False):
    """How a command runs: the keywords of Fleet.exec, exec_stream and
    start_job."""

    timeout_secs: Required[int]
    workdir: str | None
    env: dict[str, str] | None


class ExecOptions(JobOptions, total=False):
    # exec and exec_stream only: a job reads no input
    stdin: str | None


# exec_stream's sink: (stream, text) as the guest prints it.
OnOutput = Callable[[str, str], None]


class Fleet(Protocol):
    """What the tools, resources, sessions and doctor ask of a fleet;
    LocalFleet and CloudFleet both satisfy it (a test compares every
    signature)."""

    name: str
    config: Config
    # Has egress_policy, egress_events and update_egress (allow-egress).
    amends_egress: bool
    # create-machine's mounts name host directories (held to mountRoots).
    mounts_host_paths: bool
    # The engine makes a branch source when it starts the machine.
    branch_needs_start: bool
    # Why create-machine's pool is refused here; None where it leases.
    pool_refusal: str | None
    # How the server's instructions name the fleet.
    served_as: str
    # The fleet's own line in the server's instructions.
    instruction: str

    def __init__(
        self, config: Config, environ: dict[str, str] | None = None
    ) -> None: ...
    def acquire(self) -> None: ...
    def release(self) -> None: ...
    def list_machines(self) -> list[dict]: ...
    def get_machine(self, name: str) -> dict: ...
    def machine_state(self, name: str) -> str | None: ...
    def create_machine(self, spec: MachineSpec) -> dict: ...
    # A running machine is left as it is. ``mounts``: the ones the caller
    # just created it with (the local fleet checks each source again at
    # every start, reading the machine for them when they are not given).
    def start_machine(
        self,
        name: str,
        branchable: bool = False,
        mounts: list[dict] | None = None,
    ) -> dict: ...
    def stop_machine(self, name: str) -> dict: ...
    def delete_machine(self, name: str) -> dict: ...
    def branch_machine(self, name: str, child: str) -> dict: ...
    def pull_image(self, name: str, image: str) -> dict: ...
    # (the record, whether this call paused or resumed it): a machine that
    # is so already answers its record.
    def pause_machine(self, name: str) -> tuple[dict, bool]: ...
    def resume_machine(self, name: str) -> tuple[dict, bool]: ...
    # A saved state: save_state answers {"ref" (the engine's handle),
    # "status", "sizeBytes"}, and on the cloud the source's "network": the
    # record restore_state and delete_state take (not a machine's name, so
    # OwnedFleet lets them through: States says whose a state is).
    def save_state(self, name: str, state: str) -> dict: ...
    def restore_state(self, saved: dict, child: str) -> dict: ...
    def delete_state(self, saved: dict) -> None: ...
    def probe_ready(self, name: str) -> str | None: ...
    def exec(
        self, name: str, argv: list[str], **options: Unpack[ExecOptions]
    ) -> ExecResult: ...
    def exec_stream(
        self,
        name: str,
        argv: list[str],
        *,
        on_output: OnOutput,
        **options: Unpack[ExecOptions],
    ) -> ExecResult: ...
    def start_job(
        self,
        name: str,
        job_id: str,
        argv: list[str],
        **options: Unpack[JobOptions],
    ) -> dict: ...
    def read_job(
        self, name: str, job_id: str, offsets: tuple[int, int], limit: int
    ) -> JobPage: ...
    def cancel_job(self, name: str, job_id: str) -> None: ...
    def list_jobs(
        self, name: str, machine_id: str | None = None
    ) -> list[dict]: ...
    def read_file(
        self, name: str, path: str, offset: int, length: int
    ) -> FilePage: ...
    def write_file(self, name: str, path: str, data: bytes) -> int: ...
    def console_lines(self, name: str) -> list[str]: ...
    # expose-port: publish guest port ``guest`` (on host port ``host``, or
    # one the fleet picks), or take it away; the answer is the tool's
    # result, {url, port, hostPort, changed}.
    def publish_port(
        self, name: str, guest: int, host: int | None
    ) -> dict: ...
    def unpublish_port(self, name: str, guest: int) -> dict: ...
    # What smol://targets says about this fleet (it may not be served).
    @classmethod
    def target_facts(cls, app: SmolMcp) -> dict: ...
    # What the configuration lacks for this fleet to be served, as the
    # words after "needs", or None.
    @classmethod
    def lacking(cls, config: Config) -> str | None: ...
    # For `doctor`: check what a person should know (facts may change), and
    # return the detail lines under the fleet's heading and the advice
    # printed after its reason.
    @classmethod
    def doctor_report(
        cls, app: SmolMcp, facts: dict
    ) -> tuple[list[str], list[str]]: ...


# Instructions and smol://targets list the fleets in the order they register.
# Everything that names the fleets reads this table when it runs, so a test
# may add a fleet and take it out again (FLEETS.pop).
FLEETS: dict[str, type[Fleet]] = {}


def registered(cls: type) -> type:
    """A fleet class decorator: its one row in FLEETS, under its ``name``;
    raise ValueError when a fleet of that name is registered already."""
    if cls.name in FLEETS:
        raise ValueError(f"a fleet named {cls.name!r} is registered already")
    FLEETS[cls.name] = cls
    return cls


def named_fleets(text: str) -> tuple[str, ...]:
    """Return the fleets ``text`` names, in the registry's order: "both"
    is every fleet, else fleet names joined by commas; raise ValueError
    ("got ...") when it names none, or anything that is not a fleet."""
    if text.strip() == "both":
        return tuple(FLEETS)
    words = {word.strip() for word in text.split(",")} - {""}
    if not words or not words <= set(FLEETS):
        raise ValueError(f"got {text!r}")
    return tuple(name for name in FLEETS if name in words)


def fleets_accepted(*first: str) -> str:
    """Return what a setting or flag naming fleets accepts, as words
    after "must be" ("one of auto, local, cloud, both, or ..."), with
    the words ``first`` before the fleets' names."""
    words = ", ".join([*first, *FLEETS, "both"])
    if len(FLEETS) < 2:
        return f"one of {words}"
    pair = ",".join(list(FLEETS)[:2])
    return f"one of {words}, or fleets joined by commas such as {pair}"


def spoken(words: Iterable[str], last: str = "and") -> str:
    """Return ``words`` as a sentence lists them: "a", "a and b", "a, b
    and c" (``last`` is the word before the last one)."""
    words = list(words)
    if len(words) < 2:
        return "".join(words)
    return f"{', '.join(words[:-1])} {last} {words[-1]}"


# -- the local fleet --------------------------------------------------------

NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,127}")
# Machine names this server keeps for itself, on every fleet: hidden from
# list-machines and refused as a name in every tool.
SERVER_MACHINE_PREFIX = "smol-"
# A local saved state is a paused (later frozen) branch of its source,
# named for the state.
STATE_MACHINE_PREFIX = f"{SERVER_MACHINE_PREFIX}state-"
# The engine's text for a paused machine (observed on 1.32.2).
SAVED_EXECUTION = "machine has saved execution"
ANSI_ESCAPE_RE = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
# A line of the engine's own log (tracing's format: time, level), which a
# failed boot's message quotes.
ENGINE_LOG_LINE_RE = re.compile(
    r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?Z\s+"
    r"(TRACE|DEBUG|INFO|WARN|ERROR)\s"
)
# The serve child's environment is an allow-list: PATH to find its helpers,
# HOME and XDG_* for its data, cache and socket directories, the locale and
# TZ for its messages, TMPDIR for scratch files, RUST_LOG for its log level,
# and SMOLVM_* (minimal_child_env), the engine's own settings.
CHILD_ENV_NAMES = tuple(
    "PATH HOME USER LOGNAME LANG LC_ALL LC_CTYPE TMPDIR TZ XDG_RUNTIME_DIR "
    "XDG_DATA_HOME XDG_CONFIG_HOME XDG_CACHE_HOME XDG_STATE_HOME "
    "RUST_LOG".split()
)
GUEST_MARKERS = ("/usr/local/bin/smolvm-agent", "/etc/smolvm")
# Where the serve binds published ports unless SMOLVM_PUBLISH_ADDR says
# (observed: 127.0.0.1 and [::1], never every interface).
PUBLISH_DEFAULT_ADDRESS = "127.0.0.1"
# The TCP ports one machine publishes (create-machine, expose-port): each
# holds a port of the host.
PORTS_PER_MACHINE = 16
# "Ready" means a command has actually run in the guest.
READY_PROBE = ["true"]
# $1 path, $2 offset, $3 length: the size, a newline, the page (-L: a link's
# target); anything but a file (or a link to one) fails, for the files
# route to say what it is.
RANGE_READ_SCRIPT = (
    '[ -f "$1" ] && stat -L -c %s "$1" && '
    'tail -c +$(($2 + 1)) "$1" | head -c "$3"'
)


def wheel_engine() -> str | None:
    """The smol/smol-vmm (the full smolvm CLI) of this interpreter's
    smolmachines, if installed."""
    try:
        distribution = importlib.metadata.distribution("smolmachines")
    except importlib.metadata.PackageNotFoundError:
        return None
    path = Path(str(distribution.locate_file("smol/smol-vmm")))
    if not os.access(path, os.X_OK):
        return None
    return str(path.resolve())


def inside_smol_guest() -> bool:
    """True inside a smol machine, where there is no hypervisor for a nested
    fleet."""
    return any(os.path.exists(marker) for marker in GUEST_MARKERS)


def version_tuple(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", version)[:3])


def minimal_child_env(
    environ: dict[str, str], secret_values: list[str]
) -> dict[str, str]:
    """The serve child's environment: a few basics and SMOLVM_* engine
    settings, never a token. A secret can hide inside a value
    (SMOLVM_EXTRA=prefix-<token>): such a variable is dropped."""
    env = {name: environ[name] for name in CHILD_ENV_NAMES if name in environ}
    for name, value in environ.items():
        if name.startswith("SMOLVM_"):
            env[name] = value
    hides = [secret for secret in secret_values if secret]
    return {
        name: value
        for name, value in env.items()
        if not any(s in value or s in name for s in hides)
    }


class UnixHTTPConnection(http.client.HTTPConnection):
    """http.client over an AF_UNIX stream socket."""

    def __init__(self, socket_path: str, timeout: float):
        super().__init__("localhost", timeout=timeout)
        self.socket_path = socket_path

    def connect(self) -> None:
        """Connect, retrying while the listen backlog is full; raise
        BlockingIOError when it stays full."""
        for attempt in range(20):
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(self.timeout)
            try:
                sock.connect(self.socket_path)
                self.sock = sock
                return
            except BlockingIOError:
                # The listen backlog is full: nothing was sent, so retry.
                sock.close()
                time.sleep(0.01 * min(attempt + 1, 10))
            except OSError:
                sock.close()
                raise
        # Busy (or stopped), not gone: the caller waits for it rather than
        # start another serve.
        full = f"the serve at {self.socket_path} kept its listen backlog full"
        raise BlockingIOError(errno.EAGAIN, full)


class QuickReader:
    """GETs to the serve made on the event loop, over connections kept
    alive between reads: the quick reads' way, where a worker thread's hop
    costs more than the read. It reads only a plain answer of a length;
    anything else it leaves to http.client in a worker thread, the
    blocking way."""

    # Connections kept between reads; one more answered is closed.
    MAX_IDLE = 8
    # A longer answer goes the blocking way, which need not hold it whole.
    MAX_ANSWER = 1 << 20

    def __init__(self, kind: str, address: str | int):
        """A reader for the serve at ``address``: a socket path when
        ``kind`` is "unix", else a loopback port."""
        self.idle: list[QuickConnection] = []
        self.kind = kind
        if kind == "unix":
            self.address = address
            # As http.client names it: no port on the default one.
            self.host = "localhost"
        else:
            self.address = ("127.0.0.1", int(address))
            self.host = f"127.0.0.1:{address}"

    def close_idle(self) -> None:
        """Close the kept connections. The list is swapped for an empty
        one first: a read on the loop may be taking one now."""
        idle = self.idle
        self.idle = []
        for connection in idle:
            connection.close()

    async def get(self, path: str) -> tuple[int, str, bytes] | None:
        """GET ``path``: (status, Content-Type, body); None when the answer
        is not one to be sure of (a failed connection, a bad status line,
        no length or a negative one, an encoded answer, one that ends early
        or is over MAX_ANSWER), as a GET is safe to send again. Cancelled,
        the connection is closed; the caller bounds the time."""
        request = (
            f"GET {path} HTTP/1.1\r\n"
            f"Host: {self.host}\r\n"
            "Accept-Encoding: identity\r\n"
            "\r\n"
        )
        connection = None
        try:
            connection = await self._connected()
            answer = await connection.exchange(request.encode(), path)
        except BaseException as exc:
            if connection is not None:
                connection.close()
            # A timeout (an OSError too) is the caller's to report.
            if isinstance(exc, TimeoutError):
                raise
            # LookupError: a status line without a status.
            if isinstance(exc, OSError | ValueError | LookupError):
                return None
            raise
        status, fields, body, whole = answer
        if whole and fields.get("connection") != "close":
            self._keep(connection)
        else:
            connection.close()
        return status, fields.get("content-type", ""), body

    async def _connected(self) -> QuickConnection:
        """A kept connection the serve has not closed (nor sent anything
        on), else a new one."""
        while self.idle:
            connection = self.idle.pop()
            if connection.reusable():
                return connection
            connection.close()
        loop = asyncio.get_running_loop()

        def made() -> QuickConnection:
            return QuickConnection(self.MAX_ANSWER)

        if self.kind == "unix":
            _, connection = await loop.create_unix_connection(
                made, self.address
            )
        else:
            _, connection = await loop.create_connection(made, *self.address)
        return connection

    def _keep(self, connection: QuickConnection) -> None:
        """Keep ``connection`` for the next read, or close it when enough
        are."""
        if len(self.idle) < self.MAX_IDLE:
            self.idle.append(connection)
        else:
            connection.close()


class QuickConnection(asyncio.Protocol):
    """One connection of QuickReader's: a GET sent, its answer read as it
    comes. The loop watches the socket all along, so a read adds and
    removes no watch and asks the kernel nothing but to send and receive.
    Bytes that come while no GET waits (or the serve closing it) make it
    one not to use again."""

    def __init__(self, max_answer: int):
        self.max_answer = max_answer
        self.transport: Any = None
        self.buffer = bytearray()
        # (status, fields, body start, length) once the head is in.
        self.head: tuple | None = None
        self.waiter: asyncio.Future | None = None
        self.stale = False
        # The GET's path, for the errors.
        self.path = ""

    def reusable(self) -> bool:
        """Open, and nothing came on it since its last answer."""
        return not self.stale and not self.transport.is_closing()

    def close(self) -> None:
        """Close it, from any thread (stop_serve runs in a worker thread,
        and a transport is its loop's alone); once the loop is closed,
        there is nothing left to close."""
        self.stale = True
        try:
            on_loop = asyncio.get_running_loop() is self.loop
        except RuntimeError:
            on_loop = False
        if on_loop:
            self.transport.close()
            return
        try:
            self.loop.call_soon_threadsafe(self.transport.close)
        except RuntimeError:
            pass

    async def exchange(self, request: bytes, path: str) -> tuple:
        """Send ``request`` and wait for its answer: status, header fields
        (by lower-case name), body, and whether the connection holds
        nothing after it. Raise ValueError for an answer not plain JSON of
        a length, LookupError for a status line without a status,
        ConnectionResetError for one that ends early or is too long."""
        self.path = path
        self.buffer.clear()
        self.head = None
        self.waiter = asyncio.get_running_loop().create_future()
        self.transport.write(request)
        try:
            return await self.waiter
        finally:
            self.waiter = None

    def connection_made(self, transport: Any) -> None:
        self.transport = transport
        self.loop = asyncio.get_running_loop()

    def data_received(self, data: bytes) -> None:
        self.buffer.extend(data)
        if self.waiter is None or self.waiter.done():
            self.stale = True
            return
        try:
            answer = self.answer()
        except (ValueError, LookupError, ConnectionResetError) as err:
            self.waiter.set_exception(err)
            return
        if answer is not None:
            self.waiter.set_result(answer)

    def eof_received(self) -> bool:
        self.lost()
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost()

    def lost(self) -> None:
        """The serve closed the connection: an answer still awaited ended
        early."""
        self.stale = True
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(self.ended_early())

    def ended_early(self) -> ConnectionResetError:
        return ConnectionResetError(
            f"the answer to {self.path} ended early or is too long"
        )

    def answer(self) -> tuple | None:
        """The answer in the buffer, or None while more is to come; raise
        as exchange says."""
        if self.head is None:
            end = self.buffer.find(b"\r\n\r\n")
            if end < 0:
                return self.more()
            self.head = self.read_head(end)
        status, fields, start, length = self.head
        if len(self.buffer) < start + length:
            return self.more()
        body = bytes(self.buffer[start : start + length])
        return status, fields, body, len(self.buffer) == start + length

    def more(self) -> None:
        """None (more is to come); raise ConnectionResetError when the
        answer is over max_answer already."""
        if len(self.buffer) > self.max_answer:
            raise self.ended_early()

    def read_head(self, end: int) -> tuple:
        """The status, header fields, where the body starts and its length;
        raise ValueError unless it is plain JSON of a length."""
        status_line, *lines = self.buffer[:end].decode("latin-1").split("\r\n")
        status = int(status_line.split()[1])
        fields = {}
        for line in lines:
            key, _, value = line.partition(":")
            fields[key.strip().lower()] = value.strip()
        length = int(fields.get("content-length", "-"))
        if length < 0 or "content-encoding" in fields:
            raise ValueError(
                f"the answer to {self.path} is not plain JSON of a length"
            )
        return status, fields, end + 4, length


@dataclass
class MachineSpec:
    """A create request in the normalised vocabulary both fleets
    understand."""

    name: str
    image: str
    cpus: int
    memory_mb: int
    # "open" or "blocked"
    network: str
    allow_hosts: list[str] = field(default_factory=list)
    allow_cidrs: list[str] = field(default_factory=list)
    # Deny rules checked ahead of the allow list (the local engine's
    # egressRules; the cloud has none).
    egress_rules: list[dict[str, str]] = field(default_factory=list)
    # [{"guest", "host"?}]
    ports: list[dict[str, int]] = field(default_factory=list)
    # [{"source", "target", ...}]
    mounts: list[dict[str, Any]] = field(default_factory=list)
    storage_gb: int | None = None
    overlay_gb: int | None = None
    cmd: list[str] | None = None
    env: dict[str, str] = field(default_factory=dict)
    branchable: bool = False
    # The cloud turns this into a TTL and an idle stop.
    ephemeral: bool = False


@dataclass
class ExecResult:
    """What a command did, as raw bytes: the budget is applied later."""

    exit_code: int
    stdout: bytes
    stderr: bytes
    seconds: float
    # The streams the API itself cut short (the cloud's text cap).
    cut_by_service: tuple[str, ...] = ()


@dataclass
class FilePage:
    """One page of a guest file."""

    data: bytes
    size: int


# Local jobs (no job API): a process started through exec, detached (its own
# session, HUP ignored), with its pid, stdout, stderr, exit (the code,
# written at the end), timedout and cancelled files under JOB_DIR/<jobId>.
# It outlives the call, client and server, ends with its machine, and reads
# "lost" when its process is gone without an exit file (the machine stopped
# under it).
JOB_DIR = "/var/tmp/smol-mcp/jobs"
JOB_ID_PATTERN = "^[A-Za-z0-9][A-Za-z0-9_-]{0,127}$"
# $1 job directory, $2 timeout in seconds, then the argv. Runs detached;
# writes pid, then exit.
JOB_WAITER_SCRIPT = r"""d=$1; t=$2; shift 2
trap '' HUP
if command -v setsid >/dev/null 2>&1; then
  setsid "$@" >"$d/stdout" 2>"$d/stderr" </dev/null &
else
  "$@" >"$d/stdout" 2>"$d/stderr" </dev/null &
fi
c=$!
echo "$c" >"$d/pid.part" && mv -f "$d/pid.part" "$d/pid"
( n=0
  while [ "$n" -lt "$t" ]; do
    sleep 1; [ -e "$d/exit" ] && exit 0; n=$((n + 1))
  done
  : >"$d/timedout"; kill -TERM -"$c" 2>/dev/null || kill -TERM "$c"
  sleep 5; kill -KILL -"$c" 2>/dev/null || kill -KILL "$c"
) </dev/null >/dev/null 2>&1 &
wait "$c"; echo "$?" >"$d/exit.part"; mv -f "$d/exit.part" "$d/exit"
"""
# $1 the waiter script, $2 job directory, $3 timeout, then the argv; prints
# the pid.
JOB_START_SCRIPT = r"""w=$1; d=$2; shift 2
[ -e "$d" ] && {
  echo "a job with this id already exists in the machine" >&2; exit 98
}
mkdir -p "$d" || exit 97
date +%s >"$d/started"
if command -v setsid >/dev/null 2>&1; then s=setsid; else s=; fi
$s sh -c "$w" sh "$d" "$@" </dev/null >/dev/null 2>&1 &
n=0
while [ ! -s "$d/pid" ] && [ "$n" -lt 100 ]; do sleep 0.1; n=$((n + 1)); done
[ -s "$d/pid" ] || { echo "the job's process did not start" >&2; exit 96; }
cat "$d/pid"
"""
# The state of the job in directory $1: "running -", "exited CODE" or
# "lost -".
JOB_STATE_FUNCTION = r"""st() {
  [ -s "$1/exit" ] && { echo "exited $(cat "$1/exit")"; return; }
  [ -s "$1/pid" ] && kill -0 "$(cat "$1/pid")" 2>/dev/null &&
    { echo "running -"; return; }
  sleep 1; [ -s "$1/exit" ] && { echo "exited $(cat "$1/exit")"; return; }
  echo "lost -"
}
"""
# $1 job directory, $2 stdout offset, $3 stderr offset, $4 byte budget.
# Prints "state code stdoutSize stderrSize n m", a newline, then n bytes of
# stdout and m of stderr from the offsets; the budget is shared, neither
# side starves. Runs after JOB_STATE_FUNCTION, as JOB_LIST_SCRIPT does.
JOB_READ_SCRIPT = r"""[ -s "$1/pid" ] || { echo "no such job" >&2; exit 3; }
s=$(st "$1")
so=0; [ -f "$1/stdout" ] && so=$(wc -c <"$1/stdout")
se=0; [ -f "$1/stderr" ] && se=$(wc -c <"$1/stderr")
ao=$((so - $2)); [ "$ao" -lt 0 ] && ao=0
ae=$((se - $3)); [ "$ae" -lt 0 ] && ae=0
h=$(($4 / 2)); r=$(($4 - ae)); [ "$r" -lt "$h" ] && r=$h
n=$ao; [ "$n" -gt "$r" ] && n=$r
m=$ae; [ "$m" -gt $(($4 - n)) ] && m=$(($4 - n))
echo "$s $so $se $n $m"
[ "$n" -gt 0 ] && tail -c +$(($2 + 1)) "$1/stdout" | head -c "$n"
[ "$m" -gt 0 ] && tail -c +$(($3 + 1)) "$1/stderr" | head -c "$m"
exit 0
"""
# $1 job directory. Ends the job's process group (TERM, then KILL after
# 5 s); idempotent.
JOB_CANCEL_SCRIPT = r"""[ -s "$1/pid" ] || { echo "no such job" >&2; exit 3; }
[ -e "$1/exit" ] && exit 0
p=$(cat "$1/pid")
kill -0 "$p" 2>/dev/null || exit 0
: >"$1/cancelled"
kill -TERM -"$p" 2>/dev/null || kill -TERM "$p" 2>/dev/null
n=0
while [ ! -e "$1/exit" ] && [ "$n" -lt 50 ]; do sleep 0.1; n=$((n + 1)); done
[ -e "$1/exit" ] || kill -KILL -"$p" 2>/dev/null || kill -KILL "$p" 2>/dev/null
n=0
while [ ! -e "$1/exit" ] && [ "$n" -lt 30 ]; do sleep 0.1; n=$((n + 1)); done
exit 0
"""
# $1 the jobs directory: one "jobId state code" line per job, oldest first.
JOB_LIST_SCRIPT = r"""[ -d "$1" ] || exit 0
for d in $(ls -tr "$1"); do [ -s "$1/$d/pid" ] && echo "$d $(st "$1/$d")"; done
exit 0
"""


@dataclass
class JobPage:
    """One read of a job: its state and a page of each output stream."""

    # running, exited or lost
    state: str
    exit_code: int | None
    stdout: bytes
    stderr: bytes
    # Bytes of stdout and stderr written so far.
    sizes: tuple[int, int]


def local_exec_body(
    argv: list[str], timeout_secs: int, workdir=None, env=None, stdin=None
) -> dict:
    """The local exec body (autoStart false: the tool starts a stopped
    machine, and says so)."""
    env_list = [{"name": k, "value": v} for k, v in (env or {}).items()]
    options = {
        "workdir": workdir or None,
        "env": env_list or None,
        "stdin": stdin,
    }
    body = {"command": argv, "timeoutSecs": timeout_secs, "autoStart": False}
    return body | {
        key: value for key, value in options.items() if value is not None
    }


def helper_output(name: str, action: str, result: ExecResult) -> bytes:
    """The stdout of one of this server's guest scripts; raise SmolError
    with the reason it failed."""
    if result.exit_code == 0:
        return bytes(result.stdout)
    stderr = bytes(result.stderr).decode("utf-8", "replace").strip()
    why = stderr or f"exit code {result.exit_code}"
    if "no such job" in why:
        raise SmolError(
            f"machine '{name}' has no such job (while trying to {action}); "
            "get-machine lists its jobs"
        )
    raise SmolError(
        f"could not {action} in machine '{name}': {why}. The job tools need "
        "a POSIX shell (sh) with kill, tail, head and wc in the image."
    )


def paused_refusal(name: str, tool: str) -> Paused:
    """Paused, for ``tool`` (start-machine or stop-machine) on a paused
    machine: what to do instead."""
    if tool == "start-machine":
        cannot = "start-machine cannot boot it afresh"
    else:
        cannot = "there is nothing for stop-machine to stop"
    return Paused(
        f"machine '{name}' is paused (its memory and processes are saved, "
        f"and it uses no CPU or memory), so {cannot}: resume-machine "
        "resumes it where it stopped (so does a run-command, read-file, "
        "write-file or start-job on it), and delete-machine discards it "
        "with what it saved"
    )


def not_pausable(name: str, state: Any) -> SmolError:
    """Why a machine in ``state`` (not running, not paused) cannot be
    paused."""
    return SmolError(
        f"machine '{name}' is {state}, not running: a pause saves a running "
        "machine's memory and processes, so there is nothing to pause; "
        "start-machine starts it"
    )


def not_resumable(name: str, state: Any) -> SmolError:
    """Why a machine in ``state`` (not paused, not running) cannot be
    resumed."""
    return SmolError(
        f"machine '{name}' is {state}, not paused: nothing is saved to "
        "resume; start-machine boots it afresh"
    )


def not_saveable(name: str, state: Any, branchable: bool) -> SmolError:
    """Why machine ``name`` cannot be saved as a state: it does not run,
    or (locally) it is no branch source."""
    if state == "paused":
        return SmolError(
            f"machine '{name}' is paused; resume-machine resumes it, then "
            "save-machine can save it"
        )
    if state not in ("running", "started"):
        return SmolError(
            f"machine '{name}' is {state}: only a running machine can be "
            "saved (its memory is part of the state); start-machine starts "
            "it"
        )
    return SmolError(
        f"machine '{name}' is not a branch source: the local engine saves "
        "a state by branching the machine, which needs a machine created "
        "with branchable: true (create-machine). Create one that way, set "
        "it up, and save that"
    )


def state_copy_exists(ref: str) -> SmolError:
    """The error for a save whose copy's name the engine already holds."""
    return SmolError(
        f"the local engine already holds a machine named '{ref}', a saved "
        "state's copy this server has no record of (from a save that did "
        "not finish, say). Pick another state name, or have the operator "
        f"delete it on the host (smolvm machine delete {ref})"
    )


def local_state_machine(state: str) -> str:
    """The local engine's machine that holds saved state ``state``."""
    return f"{STATE_MACHINE_PREFIX}{state}"


def not_running(name: str, err: ApiError) -> SmolError:
    """NotRunning for the engine's refusal to run a command in a stopped
    machine, else ``err``."""
    if err.status == 409 and "not running" in err.api_message:
        return NotRunning(f"machine '{name}' is not running")
    return err


class LocalServe:
    """The ``smolvm serve`` on this host and the HTTP calls to it: started
    on first use, shared by every session (``acquire``/``release`` count
    them; the last release stops a serve we started), restarted if it
    dies, never started when SMOL_LOCAL_URL names one. LocalFleet is the
    fleet made of it; its ``name`` labels the API's errors."""

    name: str

    def __init__(self, config: Config, environ: dict[str, str] | None = None):
        self.config = config
        self.environ = dict(os.environ if environ is None else environ)
        self._lock = threading.RLock()
        self._process: subprocess.Popen | None = None
        # The sessions of this process using the serve.
        self._users = 0
        # Whether the serve is known to answer, at a version we accept.
        self._ready = False
        # One kept-alive connection per worker thread.
        self._pool = threading.local()
        runtime = Path(config.runtime_dir)
        self._serve_log = runtime / "serve.log"
        self._pid_file = runtime / "serve.pid"
        self._users_dir = runtime / "serve-users"
        self.version: str | None = None
        if config.local_url:
            self._kind, self._address = parse_local_url(config.local_url)
        else:
            self._kind = "unix"
            self._address = str(runtime / "serve.sock")
        self._quick_reader = QuickReader(self._kind, self._address)

    # -- lifecycle ---------------------------------------------------------

    @property
    def endpoint(self) -> str:
        """A stable name for the serve we talk to, used to match cleanup
        records."""
        return self.config.local_url or f"unix://{self._address}"

    def acquire(self) -> None:
        with self._lock:
            self._users += 1

    def release(self) -> None:
        """One session let go. When the last session of the last smol-mcp
        process using our serve lets go, the serve is stopped; a serve named
        by SMOL_LOCAL_URL is never ours to stop."""
        with self._lock:
            self._users = max(0, self._users - 1)
            if self._users or self.config.local_url:
                return
            with bookkeeping(self.config.runtime_dir):
                (self._users_dir / str(os.getpid())).unlink(missing_ok=True)
            if self._other_processes_use_serve():
                # Theirs to stop now.
                self._process = None
                self._ready = False
                return
            self.stop_serve()

    def _other_processes_use_serve(self) -> bool:
        """Whether another live smol-mcp process (same runtime directory)
        marked our serve used."""
        for marker in self._users_dir.glob("*"):
            pid = int(marker.name) if marker.name.isdigit() else 0
            if pid == os.getpid():
                continue
            try:
                started = int(marker.read_text() or 0) or None
            except (OSError, ValueError):
                started = None
            if process_alive(pid, started):
                return True
            # A process that died without letting go.
            with bookkeeping(self.config.runtime_dir):
                marker.unlink(missing_ok=True)
        return False

    def stop_serve(self) -> None:
        """Stop the serve on our socket: our child, or one another process
        left us (serve.pid)."""
        with self._lock:
            process = self._process
            self._process = None
            self._ready = False
            self._quick_reader.close_idle()
        if process is not None and process.poll() is None:
            process.terminate()
            try:
                process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=5)
        elif process is None and not self.config.local_url:
            pid = self._live_serve_pid()
            if pid:
                os.kill(pid, signal.SIGTERM)
        with bookkeeping(self.config.runtime_dir):
            self._pid_file.unlink(missing_ok=True)

    def smolvm_path(self) -> str | None:
        """The smolvm binary to start: SMOLVM as a path, or found on PATH
        (not set: the wheel's engine next); None when there is none."""
        configured = self.config.smolvm
        if os.sep in configured:
            if os.access(configured, os.X_OK):
                return configured
            return None
        found = shutil.which(configured, path=self.environ.get("PATH"))
        if found is None and configured == Config.smolvm:
            found = wheel_engine()
        return found

    def ensure_serve(self) -> None:
        """Make sure a serve answers, starting ours if needed, and check its
        version once; raise SmolError saying why none does."""
        with self._lock:
            if self._ready and (
                self._process is None or self._process.poll() is None
            ):
                return
            self._ready = False
            if inside_smol_guest():
                raise SmolError(
                    "The local target is unavailable inside a smol machine: "
                    "there is no hypervisor here to start a nested machine "
                    "with. Use the cloud target, or run smol-mcp on the host."
                )
            if not self.config.local_url and not self._answers():
                self._start_serve_once()
            self.version = self._answering_version()
            if not self.config.local_url:
                self._mark_used()
            self._check_version()
            self._ready = True

    def _answering_version(self) -> str:
        """The serve's version, from /health; raise SmolError when it does
        not answer."""
        try:
            return str(self._health().get("version", ""))
        except OSError as exc:
            why = f"({exc.strerror or exc})"
            if self.config.local_url:
                raise self._nothing_answers(f" {why}") from None
            raise SmolError(
                f"the smolvm serve stopped answering on {self._address} "
                f"{why}; its log is {self._serve_log}"
            ) from None

    def _mark_used(self) -> None:
        """Mark our serve used by this process (a file named by its pid,
        holding its start time), so another process's release leaves it."""
        with bookkeeping(self.config.runtime_dir):
            self._users_dir.mkdir(mode=0o700, exist_ok=True)
            started = process_start_time(os.getpid())
            marker = self._users_dir / str(os.getpid())
            marker.write_text(str(started or ""))

    def _check_version(self) -> None:
        """Raise SmolError when the serve is older than minSmolvm."""
        minimum = self.config.min_smolvm
        if minimum and version_tuple(self.version) < version_tuple(minimum):
            raise SmolError(
                f"smolvm {self.version} is older than the minimum {minimum} "
                "this server needs (older serves reject fields it sends). "
                "Upgrade smolvm, or set SMOL_MCP_MIN_SMOLVM to an empty value "
                "to skip the check."
            )

    def _nothing_answers(self, why: str = "") -> SmolError:
        """The error for a SMOL_LOCAL_URL where nothing answers (``why``
        follows the URL)."""
        return SmolError(
            f"nothing answers at SMOL_LOCAL_URL={self.config.local_url}{why}; "
            "start the serve there, or unset SMOL_LOCAL_URL to let smol-mcp "
            "start its own"
        )

    def _answers(self) -> bool:
        """True when something (maybe another smol-mcp process's serve)
        answers on our socket."""
        try:
            self._health()
            return True
        except (OSError, SmolError):
            return False

    def _health(self) -> dict:
        status, _, body = self._raw_request("GET", "/health", timeout=5)
        if status != 200:
            raise SmolError(
                f"the local serve answered /health with HTTP {status}"
            )
        return json.loads(body)

    def _start_serve_once(self) -> None:
        """Start the serve unless another smol-mcp process sharing the
        runtime directory is starting it right now: a file lock makes them
        take turns."""
        lock_path = ensure_runtime_dir(self.config.runtime_dir) / "serve.lock"
        with open(lock_path, "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if self._answers():
                return
            # A serve that runs but does not answer is busy or stopped, not
            # dead (replacing it orphans it and fights it for its port):
            # wait within serveStartTimeoutSecs.
            pid = self._live_serve_pid()
            deadline = time.monotonic() + self.config.serve_start_timeout_secs
            while pid is not None and process_alive(pid):
                if self._answers():
                    return
                if time.monotonic() >= deadline:
                    raise self._busy_error(pid)
                time.sleep(0.2)
            self._start_serve()

    def _live_serve_pid(self) -> int | None:
        """The live serve on our socket, answering or not: ours, or
        another's (serve.pid)."""
        if self._process is not None and self._process.poll() is None:
            return self._process.pid
        try:
            pid = int(self._pid_file.read_text().strip() or 0)
            # A pid on file may have been reused: is it a serve on our
            # socket? (No /proc: leave it.)
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except (OSError, ValueError):
            return None
        ours = b"serve" in cmdline and self._address.encode() in cmdline
        if process_alive(pid) and ours:
            return pid
        return None

    def _busy_error(self, pid: int | None) -> SmolError:
        which = f"the smolvm serve (pid {pid})" if pid else "the smolvm serve"
        return SmolError(
            f"{which} is running but did not answer on {self._address} "
            f"within {self.config.serve_start_timeout_secs} s: it is busy or "
            "stopped. It was left running, not replaced. Try again shortly; "
            f"if it stays this way, see {self._serve_log}, or end that "
            "process so a new one starts."
        )

    def _start_serve(self) -> None:
        """Start our serve and wait until it answers; raise SmolError saying
        why it does not (not found, exited at once, too slow)."""
        binary = self.smolvm_path()
        if binary is None:
            raise SmolError(
                f"smolvm was not found (looked for {self.config.smolvm!r} on "
                "PATH). Install smolvm, set SMOLVM to the path of the binary, "
                "or set SMOL_LOCAL_URL to a running serve."
            )
        runtime_dir = ensure_runtime_dir(self.config.runtime_dir)
        socket_path = self._address
        log_path = runtime_dir / "serve.log"
        if len(socket_path.encode()) > 100:
            raise SmolError(
                f"the socket path {socket_path} is too long for a Unix "
                "socket; set SMOL_MCP_RUNTIME_DIR to a shorter directory"
            )
        Path(socket_path).unlink(missing_ok=True)
        log_start = self._spawn_serve(binary, socket_path, log_path)
        self._wait_until_answering(log_path, log_start)

    def _spawn_serve(
        self, binary: str, socket_path: str, log_path: Path
    ) -> int:
        """Start ``smolvm serve`` on ``socket_path`` in its own session,
        its output appended to ``log_path``, and note its pid; return where
        this start's lines begin in the log."""
        env = minimal_child_env(self.environ, self.config.secret_values())
        named = parse_expose_hosts(self.config.expose_hosts)
        if named:
            # The engine binds published ports to this IPv4 address (and
            # [::1]) instead of 127.0.0.1 (observed).
            env["SMOLVM_PUBLISH_ADDR"] = named
        argv = [binary, "serve", "start", "--listen", socket_path]
        with open(log_path, "ab") as log_file:
            log_start = log_file.tell()
            self._process = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log_file,
                stderr=log_file,
                env=env,
                start_new_session=True,
            )
        pid = self._process.pid
        log.info("started smolvm serve (pid %s) on %s", pid, socket_path)
        with bookkeeping(self.config.runtime_dir):
            self._pid_file.write_text(str(pid))
        return log_start

    def _wait_until_answering(self, log_path: Path, log_start: int) -> None:
        """Wait within serveStartTimeoutSecs for our new serve to answer;
        raise SmolError when it exits first, or is too slow (it is then
        stopped)."""
        timeout = self.config.serve_start_timeout_secs
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                self._process = None
                raise self._exited_error(log_path, log_start)
            if self._answers():
                return
            time.sleep(0.05)
        self.stop_serve()
        raise SmolError(
            f"smolvm serve did not answer within {timeout} s "
            f"(serveStartTimeoutSecs); its log is {log_path}"
        )

    def _exited_error(self, log_path: Path, log_start: int) -> SmolError:
        """Why our serve exited at once: the last line of this start's part
        of the log, and where another serve runs if the address was taken."""
        with open(log_path, "rb") as log_read:
            log_read.seek(log_start)
            output = log_read.read().decode("utf-8", "replace")
        lines = [
            line.strip()
            for line in output.splitlines()
            if line.strip() and not line.startswith("note:")
        ]
        last = lines[-1] if lines else ""
        if "Address already in use" in output:
            hint = other_serve_hint(self._address)
            return SmolError(f"smolvm serve could not start: {last}. {hint}")
        why = f"{last or 'no output'} (its log is {log_path})"
        return SmolError(f"smolvm serve exited at once: {why}")

    # -- HTTP --------------------------------------------------------------

    def _connection(self, timeout: float) -> http.client.HTTPConnection:
        """A new connection to the serve; it connects when first used."""
        if self._kind == "unix":
            return UnixHTTPConnection(str(self._address), timeout)
        return http.client.HTTPConnection(
            "127.0.0.1", int(self._address), timeout=timeout
        )

    def _pooled(self, timeout: float) -> http.client.HTTPConnection:
        """This worker thread's kept-alive connection (opening one costs
        about as much as a call); one the serve closed while it sat idle is
        replaced before it is used."""
        conn = getattr(self._pool, "conn", None)
        # Closed by the serve: an idle kept-alive socket then reads as ready.
        if (
            conn is not None
            and conn.sock is not None
            and select.select([conn.sock], [], [], 0)[0]
        ):
            conn.close()
            conn = None
        if conn is None:
            conn = self._connection(timeout)
            self._pool.conn = conn
        conn.timeout = timeout
        if conn.sock is not None:
            conn.sock.settimeout(timeout)
        return conn

    def _raw_request(
        self,
        method: str,
        path: str,
        body=None,
        *,
        content_type=None,
        timeout=30.0,
        read=None,
    ) -> tuple[int, str, Any]:
        """Send one request (bytes ``body``) on the pooled connection:
        (status, Content-Type, body). ``read(response)`` consumes a 200
        answer itself (for answers too large to hold whole)."""
        headers = {}
        if content_type:
            headers["Content-Type"] = content_type
        conn = self._pooled(timeout)
        try:
            conn.request(method, path, body=body, headers=headers)
            response = conn.getresponse()
            answer_type = response.getheader("Content-Type", "")
            if read is not None and response.status == 200:
                data = read(response)
            else:
                data = response.read()
        except BaseException:
            # Half-used: never hand it to the next call.
            conn.close()
            self._pool.conn = None
            raise
        return response.status, answer_type, data

    def _send_when_accepted(self, send: Callable) -> tuple[int, str, Any]:
        """Send; while the serve's listen backlog is full (EAGAIN on
        connect: busy or stopped, not gone; the request was not received)
        wait and resend, within a bound."""
        deadline = time.monotonic() + self.config.serve_start_timeout_secs
        while True:
            try:
                return send()
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise self._busy_error(self._live_serve_pid()) from None
                time.sleep(0.2)

    def request(
        self,
        action,
        method,
        path,
        payload=None,
        *,
        timeout=None,
        setting=None,
        read=None,
    ):
        """One API call sending ``payload`` (bytes as they are, else JSON):
        the JSON answer (bytes for a raw one, what ``read`` made of a 200);
        raise ApiError when the API refuses. A serve that stopped answering
        is started again once; a timeout names ``setting`` (both default to
        readyTimeoutSecs)."""
        self.ensure_serve()
        if timeout is None:
            timeout = self.config.ready_timeout_secs
        setting = setting or "readyTimeoutSecs"
        body, content_type = self._encoded(payload)
        send = functools.partial(
            self._raw_request,
            method,
            path,
            body,
            content_type=content_type,
            timeout=timeout,
            read=read,
        )
        status, answer_type, data = self._answer(
            action, send, timeout, setting
        )
        if status >= 400:
            raise api_error(self.name, action, status, answer_type, data)
        if read is not None and status == 200:
            return data
        if "application/json" in answer_type:
            return self._json_answer(action, method, path, data)
        return data

    def _json_answer(
        self, action: str, method: str, path: str, data: bytes
    ) -> Any:
        """The JSON of an answer the serve labelled JSON (None when empty);
        raise SmolError naming the serve and the route when it is not JSON
        (a short Content-Length cuts it)."""
        if not data:
            return None
        try:
            return json.loads(data)
        except ValueError:
            head = data[:80].decode("utf-8", "replace")
            raise SmolError(
                f"the {self.name} machine API (smolvm serve) answered "
                f"{method} {path}, to {action}, with a body that is not "
                f"JSON ({len(data)} bytes, starting "
                f"{head!r}): the engine's answer was cut short or malformed, "
                "not this call's fault. Try the call again; if it keeps "
                "happening, restart the serve"
            ) from None

    @staticmethod
    def _encoded(payload: Any) -> tuple[Any, str | None]:
        """A request's body and Content-Type: none for no payload, bytes as
        they are, anything else as JSON."""
        if payload is None:
            return None, None
        if isinstance(payload, bytes | bytearray):
            return payload, "application/octet-stream"
        return json.dumps(payload).encode(), "application/json"

    def _answer(
        self, action: str, send: Callable, timeout: float, setting: str
    ) -> tuple[int, str, Any]:
        """What ``send()`` got, the serve started again once if it stopped
        answering; raise SmolError on a timeout (naming ``setting``), or
        when the serve dropped the connection."""
        try:
            return self._send_when_accepted(send)
        except (ConnectionRefusedError, FileNotFoundError):
            # The connection never opened, so the request was not received:
            # safe to resend.
            self._ready = False
            if self.config.local_url:
                raise self._nothing_answers() from None
            self.ensure_serve()
            return send()
        except TimeoutError:
            raise self._too_slow(action, timeout, setting) from None
        except (OSError, http.client.HTTPException) as exc:
            self._ready = False
            raise serve_dropped(action, exc) from None

    @staticmethod
    def _too_slow(action: str, timeout: float, setting: str) -> SmolError:
        return SmolError(
            f"the local machine API did not answer within {timeout:.0f} s "
            f"while trying to {action}. A busy host or a large image can "
            f"take that long: raise {setting} to wait longer, and check the "
            f"engine with `{invocation()} doctor`"
        )

    def _refusal(
        self, action: str, response: http.client.HTTPResponse
    ) -> ApiError:
        ctype = response.getheader("Content-Type", "")
        return api_error(
            self.name, action, response.status, ctype, response.read()
        )


@registered
class LocalFleet(LocalServe):
    """The Fleet contract on the local serve: machines, commands, jobs,
    files and egress, each an API call or a guest script of ours."""

    name = "local"
    served_as = (
        "local (smolvm on the host this server runs on, started on the "
        "first local call; nothing billed)"
    )
    instruction = (
        "- Local: the engine fetches a registry image on the host, so a "
        "pull needs no egress in the machine: do not open the network for "
        "it. mounts, overlayGb and cmd are local only; branch-machine "
        "needs a Linux or macOS host."
    )
    # The local engine records refusals, and amends the allow list in place.
    amends_egress = True
    mounts_host_paths = True
    branch_needs_start = True
    # The engine keeps fork pools (warmPools): create-machine's pool works.
    pool_refusal = None

    def __init__(self, config: Config, environ: dict[str, str] | None = None):
        super().__init__(config, environ)
        # The pool leases this process holds, by machine name.
        self.leases = Leases(self)

    @classmethod
    def target_facts(cls, app: SmolMcp) -> dict:
        return local_target_facts(app.local)

    @classmethod
    def lacking(cls, config: Config) -> str | None:
        # The engine is found or fetched on the first call (doctor says how).
        return None

    @classmethod
    def doctor_report(
        cls, app: SmolMcp, facts: dict
    ) -> tuple[list[str], list[str]]:
        smolvm = facts["smolvm"]
        details = [
            f"smolvm: {cls._engine_found(smolvm)}",
            f"hypervisor: {facts['hypervisor']['detail']}",
            f"serve: {facts['serve']}",
            describe_mount_roots(app.config),
            *app.pools.doctor_lines(),
        ]
        if smolvm["path"] or app.config.local_url or smolvm["version"]:
            return details, []
        get = engine_get_command(Path(__file__).resolve(), sys.prefix)
        return details, [ENGINE_ON_RAMP.format(get=get)]

    @staticmethod
    def _engine_found(smolvm: dict) -> str:
        """doctor's line on the engine: where it is, its version, and what
        found it."""
        if smolvm["path"]:
            parts = [smolvm["path"]]
        elif smolvm["version"]:
            parts = ["not found here"]
        else:
            parts = ["(not found)"]
        if smolvm["version"]:
            parts.append(f", version {smolvm['version']}")
        if smolvm.get("from"):
            parts.append(f" (found through {smolvm['from']})")
        return "".join(parts)

    # -- quick reads, on the event loop ------------------------------------

    async def read_now(self, read: Callable, *args: str) -> Any:
        """Call.read's way for list_machines, get_machine and
        egress_policy: their one GET made on the event loop by the
        QuickReader. None when it goes the blocking way (a GET is safe to
        send again): anything else asked, the serve not yet known to
        answer, an answer the reader cannot be sure of, or a body that is
        not JSON (a short Content-Length cuts it). Raise SmolError naming
        readyTimeoutSecs when the serve is too slow."""
        quick = (self.list_machines, self.get_machine, self.egress_policy)
        if not self._ready or read not in quick:
            return None
        if args:
            action = f"get machine '{args[0]}'"
            path = f"/api/v1/machines/{_q(args[0])}"
        else:
            action = "list machines"
            path = "/api/v1/machines"
        timeout = self.config.ready_timeout_secs
        try:
            # asyncio's own: the reader is asyncio's too, and anyio's
            # scope costs more than the read it bounds.
            async with asyncio.timeout(timeout):
                answer = await self._quick_reader.get(path)
        except TimeoutError:
            raise self._too_slow(action, timeout, "readyTimeoutSecs") from None
        if answer is None:
            return None
        status, content_type, body = answer
        if status >= 400:
            raise api_error(self.name, action, status, content_type, body)
        try:
            info = json.loads(body)
        except ValueError:
            return None
        if read == self.list_machines:
            return [local_record(m) for m in info["machines"]]
        record = local_record(info)
        if read == self.get_machine:
            return record
        return record, egress_lists(info)

    # -- machines (normalised) ---------------------------------------------

    def _machine(
        self,
        action: str,
        method: str,
        route: str,
        *payload: Any,
        **options: Any,
    ) -> Any:
        """``request`` on a route under /api/v1/machines/ (quoted by the
        caller)."""
        return self.request(
            action, method, f"/api/v1/machines/{route}", *payload, **options
        )

    def list_machines(self) -> list[dict]:
        answer = self.request("list machines", "GET", "/api/v1/machines")
        return [local_record(m) for m in answer["machines"]]

    def get_machine(self, name: str) -> dict:
        action = f"get machine '{name}'"
        return local_record(self._machine(action, "GET", _q(name)))

    def machine_state(self, name: str) -> str:
        return self.get_machine(name)["state"]

    def create_machine(self, spec: MachineSpec) -> dict:
        address = PUBLISH_DEFAULT_ADDRESS
        if spec.ports:
            # Published on expose-port's terms: where the operator allows,
            # on a host port an agent may name.
            address = self.publish_address()
        for index, port in enumerate(spec.ports):
            if port.get("host"):
                where = f"ports[{index}].host"
                check_host_port(self.config, port["host"], where)
        named = [p["host"] for p in spec.ports if p.get("host")]
        unnamed = len(spec.ports) - len(named)
        picks = iter(free_ports(address, unnamed, named))
        ports = [
            {"host": p.get("host") or next(picks), "guest": p["guest"]}
            for p in spec.ports
        ]
        mounts = [
            {
                "source": m["source"],
                "target": m["target"],
                "readonly": m.get("readonly") is not False,
            }
            for m in spec.mounts
        ]
        env = [{"name": k, "value": v} for k, v in spec.env.items()]
        fields = {
            "name": spec.name,
            "image": spec.image,
            "cpus": spec.cpus,
            "memoryMb": spec.memory_mb,
            "network": spec.network == "open",
            "allowedHosts": spec.allow_hosts or None,
            "allowedCidrs": spec.allow_cidrs or None,
            "egressRules": spec.egress_rules or None,
            "ports": ports or None,
            "mounts": mounts or None,
            "storageGb": spec.storage_gb,
            "overlayGb": spec.overlay_gb,
            "cmd": spec.cmd,
            "env": env or None,
        }
        body = {
            key: value for key, value in fields.items() if value is not None
        }
        action = f"create machine '{spec.name}'"
        return local_record(
            self.request(action, "POST", "/api/v1/machines", body)
        )

    def recheck_mounts(self, name: str, action: str) -> dict:
        """The machine's MachineInfo; refuse ``action`` unless each mount
        source still resolves under its root (check_mount_sources)."""
        machine = self._machine(action, "GET", _q(name))
        self.check_mount_sources(machine.get("mounts") or [], action)
        return machine

    def check_mount_sources(self, mounts: list[dict], action: str) -> None:
        """Refuse ``action`` unless each of ``mounts`` (as MachineInfo has
        them) has a source that still resolves under its root: a guest
        with a writable share may have swapped in a symlink."""
        for mount in mounts:
            want_write = mount.get("readonly") is False
            try:
                contained_host_path(
                    self.config, mount["source"], "source", want_write
                )
            except ArgumentError as err:
                raise ArgumentError(
                    f"could not {action}: the source of its mount at "
                    f"{mount.get('target')} is checked again at every start, "
                    f"and now {err}. Restore the directory, or delete the "
                    "machine"
                ) from None

    def start_machine(
        self,
        name: str,
        branchable: bool = False,
        mounts: list[dict] | None = None,
    ) -> dict:
        """Start ``name`` once each mount source is checked again; one
        running already is left as it is. ``mounts``: the ones the caller
        just created it with; else the machine is read for them. Raise
        Paused for a paused one (the engine boots only a machine without
        saved execution)."""
        action = f"start machine '{name}'"
        if mounts is None:
            machine = self._machine(action, "GET", _q(name))
            if machine.get("state") in RUNNING_STATES:
                return local_record(machine)
            if machine.get("state") == "paused":
                raise paused_refusal(name, "start-machine")
            mounts = machine.get("mounts") or []
        self.check_mount_sources(mounts, action)
        # Branchability is a start option locally (a create field on cloud).
        query = "?branchable=true" if branchable else ""
        route = f"{_q(name)}/start{query}"
        timeout = self.config.ready_timeout_secs + 60
        try:
            answer = self._machine(action, "POST", route, timeout=timeout)
        except ApiError as err:
            # Paused since it was read, or given mounts and not read.
            if err.status == 409 and SAVED_EXECUTION in err.api_message:
                raise paused_refusal(name, "start-machine") from None
            raise
        return local_record(answer)

    def stop_machine(self, name: str) -> dict:
        """Stop ``name``; raise Paused for a paused one, which the engine
        keeps as it is."""
        action = f"stop machine '{name}'"
        # The timeout covers a guest's shutdown grace, then the kill.
        timeout = self.config.ready_timeout_secs * 3
        try:
            answer = self._machine(
                action, "POST", f"{_q(name)}/stop", timeout=timeout
            )
        except ApiError as err:
            if err.status == 409 and SAVED_EXECUTION in err.api_message:
                raise paused_refusal(name, "stop-machine") from None
            raise
        return local_record(answer)

    def delete_machine(self, name: str) -> dict:
        """Delete a machine; a pooled one is the pool's, so its lease is
        completed instead (the engine replaces the worker)."""
        lease = self.leases.get(name)
        if lease is not None:
            self.leases.complete(lease)
            return {"deleted": name}
        self._machine(f"delete machine '{name}'", "DELETE", _q(name))
        return {"deleted": name}

    def branch_machine(self, name: str, child: str) -> dict:
        action = f"branch machine '{name}' into '{child}'"
        self.recheck_mounts(name, action)
        route = f"{_q(name)}/branches"
        timeout = self.config.ready_timeout_secs + 60
        return local_record(
            self._machine(
                action, "POST", route, {"name": child}, timeout=timeout
            )
        )

    # -- pause, resume and saved states ------------------------------------

    def pause_machine(self, name: str) -> tuple[dict, bool]:
        """Pause ``name`` (memory, disks and execution saved, no CPU or
        memory held); one paused already answers its record, which is read
        only after the engine's 409. Raise SmolError for a machine that is
        not running."""
        action = f"pause machine '{name}'"
        # Saving memory takes time: as long as a stop may.
        timeout = self.config.ready_timeout_secs * 3
        try:
            answer = self._machine(
                action, "POST", f"{_q(name)}/pause", timeout=timeout
            )
        except ApiError as err:
            if err.status == 404:
                # Worded unlike the other routes' 404s.
                hint = "Check the name with list-machines"
                raise err.with_hint(hint) from None
            if err.status != 409:
                raise
            record = self.get_machine(name)
            if record["state"] != "paused":
                raise not_pausable(name, record["state"]) from None
            return record, False
        return local_record(answer), True

    def resume_machine(self, name: str) -> tuple[dict, bool]:
        """Resume ``name``'s saved execution under its name; one running
        already answers its record, read only after the engine's 409.
        Raise SmolError for a machine with nothing saved."""
        action = f"resume machine '{name}'"
        timeout = self.config.ready_timeout_secs + 60
        try:
            answer = self._machine(
                action, "POST", f"{_q(name)}/resume", timeout=timeout
            )
        except ApiError as err:
            if err.status != 409:
                raise
            record = self.get_machine(name)
            if record["state"] not in RUNNING_STATES:
                raise not_resumable(name, record["state"]) from None
            return record, False
        return local_record(answer), True

    def save_state(self, name: str, state: str) -> dict:
        """Save running branch source ``name`` as ``state``: a branch of it
        (memory and disks), itself a branch source, paused, which keeps it
        durably; the source runs on. Raise SmolError when the source is no
        running branch source; a copy that could not be paused is
        deleted."""
        ref = local_state_machine(state)
        action = f"save machine '{name}' as state '{state}'"
        source = self.recheck_mounts(name, action)
        branchable = source.get("branchable") or source.get("forkable")
        if source.get("state") != "running" or not branchable:
            raise not_saveable(name, source.get("state"), bool(branchable))
        body = {"name": ref, "branchable": True}
        route = f"{_q(name)}/branches"
        timeout = self.config.ready_timeout_secs + 60
        try:
            self._machine(action, "POST", route, body, timeout=timeout)
        except ApiError as err:
            if err.status == 409 and "already exists" in err.api_message:
                raise state_copy_exists(ref) from None
            raise
        try:
            self._machine(
                action,
                "POST",
                f"{_q(ref)}/pause",
                timeout=self.config.ready_timeout_secs * 3,
            )
        except BaseException:
            # A copy that was not saved is no state.
            self._delete_leftover(ref)
            raise
        return {"ref": ref, "status": "ready", "sizeBytes": None}

    def restore_state(self, saved: dict, child: str) -> dict:
        """A new running machine ``child`` from a saved state: its paused
        copy resumed (at its first use) and branched with freezeSource,
        which keeps the copy frozen as a reusable base."""
        ref = saved["ref"]
        action = f"create machine '{child}' from a saved state"
        timeout = self.config.ready_timeout_secs + 60
        base = self.recheck_mounts(ref, action)
        if base.get("state") == "paused":
            route = f"{_q(ref)}/resume"
            self._machine(action, "POST", route, timeout=timeout)
        body = {"name": child, "freezeSource": True}
        route = f"{_q(ref)}/branches"
        return local_record(
            self._machine(action, "POST", route, body, timeout=timeout)
        )

    def delete_state(self, saved: dict) -> None:
        """Delete the state's copy; one gone already counts as deleted.
        The engine refuses while machines made from it exist."""
        try:
            self.delete_machine(saved["ref"])
        except ApiError as err:
            if err.status != 404:
                raise

    def _delete_leftover(self, name: str) -> None:
        """Delete a machine a failed call made; a failure is logged (the
        error that got us here is the one to report)."""
        try:
            self.delete_machine(name)
        except SmolError as err:
            log.warning("could not delete machine %s: %s", name, err)

    def pull_image(self, name: str, image: str) -> dict:
        action = f"pull {image} into machine '{name}'"
        answer = self._machine(
            action,
            "POST",
            f"{_q(name)}/images/pull",
            {"image": image},
            timeout=self.config.max_exec_timeout_secs + 60,
            setting="maxExecTimeoutSecs",
        )
        return answer.get("image", answer)

    # -- commands ----------------------------------------------------------

    def exec(
        self, name: str, argv: list[str], **options: Unpack[ExecOptions]
    ) -> ExecResult:
        """Run a command; raise NotRunning unless the machine runs (the
        engine would boot it silently)."""
        action = f"run a command in machine '{name}'"
        return self._exec_for(action, name, argv, **options)

    def _exec_for(
        self,
        action: str,
        name: str,
        argv: list[str],
        **options: Unpack[ExecOptions],
    ) -> ExecResult:
        """``exec``, its refusals worded as ``action``."""
        body = local_exec_body(argv, **options)
        started = time.monotonic()
        try:
            data = self._machine(
                action,
                "POST",
                f"{_q(name)}/exec",
                body,
                # The HTTP wait outlives the command's own timeout, so the
                # guest, not the socket, decides.
                timeout=options["timeout_secs"] + 30,
                setting="the call's timeoutSecs (up to maxExecTimeoutSecs)",
                read=read_exec_answer,
            )
        except ApiError as err:
            raise not_running(name, err) from None
        except ValueError as err:
            raise SmolError(
                f"the local serve answered a command in machine '{name}' "
                f"with a body this server could not read ({err})"
            ) from None
        seconds = time.monotonic() - started
        return ExecResult(
            int(data["exitCode"]),
            data["stdoutB64"],
            data["stderrB64"],
            seconds,
        )

    def exec_stream(
        self, name, argv, *, on_output, **options: Unpack[ExecOptions]
    ) -> ExecResult:
        """``exec`` through the stream route: ``on_output`` gets output as
        the guest prints it."""
        self.ensure_serve()
        action = f"run a command in machine '{name}'"
        route = f"/api/v1/machines/{_q(name)}/exec/stream"
        body = json.dumps(local_exec_body(argv, **options)).encode()
        headers = {
            "Content-Type": "application/json",
            "Accept": "text/event-stream",
        }
        # A connection of its own: the stream holds it open.
        conn = self._connection(options["timeout_secs"] + 30)
        started = time.monotonic()
        try:
            try:
                conn.request("POST", route, body, headers)
                response = conn.getresponse()
            except (OSError, http.client.HTTPException) as exc:
                raise serve_dropped(action, exc) from None
            if response.status >= 400:
                raise not_running(name, self._refusal(action, response))
            pieces = iter(lambda: response.read1(1 << 16), b"")
            broken = (OSError, http.client.HTTPException)
            return collect_exec_stream(
                sse_events(pieces), name, on_output, started, broken
            )
        finally:
            conn.close()

    def probe_ready(self, name: str) -> str | None:
        """None once a command runs in the guest; while it is still coming
        up, what the guest answered instead. Raise SmolError if the machine
        stopped, ApiError if it is gone."""
        try:
            self.exec(name, READY_PROBE, timeout_secs=10)
            return None
        except NotRunning:
            raise SmolError(
                f"machine '{name}' stopped while waiting for its guest to "
                "answer; its log (machine-logs) may say why"
            ) from None
        except ApiError as err:
            if err.status in (400, 404):
                raise
            return err.api_message

    def exec_helper(
        self, name: str, action: str, script: str, *args: str
    ) -> bytes:
        """The stdout of a guest script of ours (sh -c); a non-zero exit
        raises SmolError with its stderr."""
        argv = ["sh", "-c", script, "sh", *args]
        try:
            result = self.exec(name, argv, timeout_secs=60)
        except NotRunning:
            if self.machine_state(name) == "paused":
                raise Paused(
                    f"machine '{name}' is paused, and its jobs with it "
                    "(they go on when it resumes); resume-machine resumes "
                    "it, then read-job shows what they wrote"
                ) from None
            raise SmolError(
                f"machine '{name}' is not running, and its jobs ended when it "
                "stopped; start-machine, then read-job, shows what they wrote"
            ) from None
        return helper_output(name, action, result)

    # -- jobs: processes this server starts in the guest -------------------

    def start_job(
        self, name, job_id, argv, **options: Unpack[JobOptions]
    ) -> dict:
        starter = [
            "sh",
            "-c",
            JOB_START_SCRIPT,
            "sh",
            JOB_WAITER_SCRIPT,
            f"{JOB_DIR}/{job_id}",
            str(options["timeout_secs"]),
            *argv,
        ]
        # The job's own timeout is the waiter's; starting it takes moments.
        result = self.exec(name, starter, **{**options, "timeout_secs": 60})
        helper_output(name, f"start job {job_id}", result)
        return {"jobId": job_id, "state": "running"}

    def read_job(
        self, name: str, job_id: str, offsets: tuple[int, int], limit: int
    ) -> JobPage:
        args = (f"{JOB_DIR}/{job_id}", *map(str, offsets), str(limit))
        script = JOB_STATE_FUNCTION + JOB_READ_SCRIPT
        data = self.exec_helper(name, f"read job {job_id}", script, *args)
        header, _, rest = data.partition(b"\n")
        try:
            state, code, out_size, err_size, n, m = header.decode().split()
            out_bytes = int(n)
            err_bytes = int(m)
        except ValueError:
            raise SmolError(
                f"the guest of machine '{name}' answered a read of job "
                f"{job_id} in a form this server could not read "
                f"({header[:200]!r})"
            ) from None
        exit_code = int(code) if code.lstrip("-").isdigit() else None
        return JobPage(
            state,
            exit_code,
            rest[:out_bytes],
            rest[out_bytes : out_bytes + err_bytes],
            (int(out_size), int(err_size)),
        )

    def cancel_job(self, name: str, job_id: str) -> None:
        self.exec_helper(
            name,
            f"cancel job {job_id}",
            JOB_CANCEL_SCRIPT,
            f"{JOB_DIR}/{job_id}",
        )

    def list_jobs(
        self, name: str, machine_id: str | None = None
    ) -> list[dict]:
        script = JOB_STATE_FUNCTION + JOB_LIST_SCRIPT
        answer = self.exec_helper(name, "list jobs", script, JOB_DIR)
        jobs = []
        for line in answer.decode("utf-8", "replace").splitlines():
            job_id, state, code = (line.split() + ["", "", ""])[:3]
            if job_id:
                exit_code = int(code) if code.isdigit() else None
                jobs.append(
                    {"jobId": job_id, "state": state, "exitCode": exit_code}
                )
        return jobs

    # -- files and the console log -----------------------------------------

    def read_file(
        self, name: str, path: str, offset: int, length: int
    ) -> FilePage:
        """One page of a file, cut in the guest (stat, tail, head): the API
        has no range, and a command, unlike the files route, never boots a
        stopped machine (unchecked, and unsaid), so one request reads a
        running machine's page and raises NotRunning for any other. An
        image that cannot cut it streams the file, keeping only the page;
        so does anything but a file, for the files route's own refusal."""
        page = self._page_cut_in_guest(name, path, offset, length)
        if page is not None:
            return page
        return self._page_downloaded(name, path, offset, length)

    def _page_cut_in_guest(
        self, name: str, path: str, offset: int, length: int
    ) -> FilePage | None:
        """The page as RANGE_READ_SCRIPT cuts it in the guest; None when the
        image cannot run it, or ``path`` is no file. Raise NotRunning when
        the machine does not run, ApiError when it is gone."""
        args = [path, str(offset), str(length)]
        argv = ["sh", "-c", RANGE_READ_SCRIPT, "sh", *args]
        action = f"read {path} in machine '{name}'"
        try:
            result = self._exec_for(action, name, argv, timeout_secs=120)
        except ApiError as err:
            if err.status == 404:
                raise
            # No shell in this image, say: the download still works.
            return None
        size_line, newline, data = bytes(result.stdout).partition(b"\n")
        if result.exit_code == 0 and newline and size_line.strip().isdigit():
            return FilePage(data=data, size=int(size_line))
        return None

    def _page_downloaded(
        self, name: str, path: str, offset: int, length: int
    ) -> FilePage:
        """The page read from the file's download; raise SmolError for a
        directory, or a serve that stopped answering."""
        self.ensure_serve()
        action = f"read {path} in machine '{name}'"
        route = f"/api/v1/machines/{_q(name)}/files/{guest_route_suffix(path)}"
        conn = self._connection(timeout=self.config.ready_timeout_secs + 60)
        try:
            conn.request("GET", route)
            response = conn.getresponse()
            if response.status >= 400:
                raise self._refusal(action, response)
            if "application/json" in response.getheader("Content-Type", ""):
                raise directory_error(path, response)
            return download_page(response, offset, length)
        except TimeoutError:
            raise SmolError(
                "the local machine API stopped answering while trying to "
                f"{action}"
            ) from None
        except (OSError, http.client.HTTPException) as exc:
            raise serve_dropped(action, exc) from None
        finally:
            conn.close()

    def write_file(self, name: str, path: str, data: bytes) -> int:
        action = f"write {path} in machine '{name}'"
        route = f"{_q(name)}/files/{guest_route_suffix(path)}"
        timeout = self.config.ready_timeout_secs + len(data) / (1 << 20)
        answer = self._machine(action, "PUT", route, data, timeout=timeout)
        if isinstance(answer, dict):
            return int(answer.get("size", len(data)))
        return len(data)

    def console_lines(self, name: str) -> list[str]:
        """Every line of the guest console log (the API streams it as
        SSE)."""
        action = f"read the log of machine '{name}'"
        route = f"{_q(name)}/logs?source=console"
        try:
            data = self._machine(action, "GET", route)
        except ApiError as err:
            if err.status == 404 and "no logs yet" in err.api_message:
                # Never started: nothing logged yet, which is an answer,
                # not a failure.
                return []
            raise
        if not isinstance(data, bytes):
            data = json.dumps(data).encode()
        # One log line per data: line.
        lines = data.decode("utf-8", "replace").splitlines()
        return [
            line[5:].removeprefix(" ")
            for line in lines
            if line.startswith("data:")
        ]

    # -- egress ------------------------------------------------------------

    def egress_policy(self, name: str) -> tuple[dict, dict]:
        """(the machine's record, its egress policy as egress_lists has
        it)."""
        info = self._machine(f"get machine '{name}'", "GET", _q(name))
        return local_record(info), egress_lists(info)

    def egress_events(self, name: str, limit: int) -> list[dict]:
        """The machine's recorded egress denials, oldest first, the newest
        ``limit`` of them."""
        action = f"read the egress denials of machine '{name}'"
        route = f"{_q(name)}/egress-events?limit={limit}"
        answer = self._machine(action, "GET", route)
        events = answer.get("events") if isinstance(answer, dict) else None
        return [e for e in events or [] if isinstance(e, dict)]

    def update_egress(self, name: str, change: dict) -> tuple[dict, dict]:
        """Amend the allow list (an UpdateEgressRequest body); the engine
        answers the record."""
        action = f"amend the egress allow list of machine '{name}'"
        info = self._machine(action, "POST", f"{_q(name)}/egress", change)
        return local_record(info), egress_lists(info)

    # -- published ports (expose-port) -------------------------------------

    def publish_address(self) -> str:
        """The host address published ports bind; raise SmolError when it
        is not loopback and exposeHosts does not name it."""
        named = parse_expose_hosts(self.config.expose_hosts)
        if named or self.config.local_url:
            # Our serve is told to bind it (_spawn_serve); a serve we did
            # not start cannot be asked, so the operator's word, else the
            # engine's default, is all there is.
            return named or PUBLISH_DEFAULT_ADDRESS
        value = self.environ.get("SMOLVM_PUBLISH_ADDR")
        try:
            address = ipaddress.IPv4Address(value or "")
        except ValueError:
            # The engine ignores what is not an IPv4 address (observed).
            return PUBLISH_DEFAULT_ADDRESS
        if address.is_loopback:
            return str(address)
        raise SmolError(
            f"the local serve binds published ports to {address} "
            "(SMOLVM_PUBLISH_ADDR in this server's environment), which is "
            "not loopback and not named in exposeHosts, so nothing was "
            "published. Only the operator can allow it: name the address "
            "in exposeHosts (SMOL_MCP_EXPOSE_HOSTS), or unset "
            "SMOLVM_PUBLISH_ADDR"
        )

    def publish_port(self, name: str, guest: int, host: int | None) -> dict:
        """Publish TCP port ``guest`` on ``host`` (None: a free one): the
        route replaces the whole set, so it is read, added to and put. A
        port already published answers as it is."""
        address = self.publish_address()
        info = self._machine(f"get machine '{name}'", "GET", _q(name))
        ports = port_specs(info)
        for port in ports:
            if port["guest"] == guest and "protocol" not in port:
                if host not in (None, port["host"]):
                    raise ArgumentError(
                        f"guest port {guest} of machine '{name}' is "
                        f"published on host port {port['host']} already; "
                        "close it first (close: true) to move it"
                    )
                return published(address, guest, port["host"], False)
        taken = [port["host"] for port in ports if "protocol" not in port]
        if len(taken) >= PORTS_PER_MACHINE:
            raise ports_full(name)
        if host in taken:
            raise ArgumentError(
                f"host port {host} already carries another port of "
                f"machine '{name}' (get-machine lists them); leave hostPort "
                "out and a free one is picked"
            )
        if host is not None:
            check_host_port(self.config, host, "hostPort")
        chosen = host or free_port(address, taken)
        try:
            self._put_ports(name, ports + [{"host": chosen, "guest": guest}])
        except ApiError as err:
            if err.code != "PORT_IN_USE" or host is not None:
                raise port_in_use(err, host) from None
            # Taken since it was picked: once more, with another.
            chosen = free_port(address, taken)
            self._put_ports(name, ports + [{"host": chosen, "guest": guest}])
        return published(address, guest, chosen, True)

    def unpublish_port(self, name: str, guest: int) -> dict:
        """Take TCP port ``guest`` off the machine's published ports; one
        that is not published answers unchanged."""
        info = self._machine(f"get machine '{name}'", "GET", _q(name))
        ports = port_specs(info)
        kept = [
            port
            for port in ports
            if port["guest"] != guest or "protocol" in port
        ]
        closed = {"url": None, "port": guest, "hostPort": None}
        if len(kept) == len(ports):
            return {**closed, "changed": False}
        removed = [port for port in ports if port not in kept]
        self._put_ports(name, kept)
        return {**closed, "hostPort": removed[0]["host"], "changed": True}

    def _put_ports(self, name: str, ports: list[dict]) -> dict:
        """Replace the machine's published ports with ``ports``."""
        action = f"set the published ports of machine '{name}'"
        body = {"ports": ports}
        return self._machine(action, "PUT", f"{_q(name)}/ports", body)

    # -- warm pools: the engine's fork pools and their leases --------------

    def list_pools(self) -> list[dict]:
        """The engine's fork pools (ForkPoolInfo records)."""
        answer = self.request("list the fork pools", "GET", "/api/v1/pools")
        return [pool for pool in answer["pools"] if isinstance(pool, dict)]

    def pools_now(self) -> list[dict] | None:
        """list_pools from a serve that already answers, starting nothing
        (doctor, smol://pools); None when none answers."""
        try:
            status, _, body = self._raw_request(
                "GET", "/api/v1/pools", timeout=5
            )
            pools = json.loads(body)["pools"] if status == 200 else None
        except (OSError, http.client.HTTPException, ValueError, KeyError):
            return None
        if not isinstance(pools, list):
            return None
        return [pool for pool in pools if isinstance(pool, dict)]

    def create_pool(self, name: str, source: str, ready: int) -> dict:
        """Ask for a fork pool of ``ready`` workers branched from the
        running, branchable ``source``, which the engine then freezes."""
        body = {
            "name": name,
            "source": source,
            "desiredReady": ready,
            "freezeSource": True,
        }
        action = f"create the fork pool '{name}'"
        return self.request(action, "POST", "/api/v1/pools", body)

    def lease(
        self, pool: str, key: str, env: dict[str, str]
    ) -> tuple[dict, float]:
        """Lease a clean worker of ``pool`` at once (waitSecs 0): the lease
        (ForkLeaseInfo) and the seconds the engine took. A connection
        dropped mid-request is retried once under the same idempotency
        key, which answers the same lease rather than a second one."""
        body = {
            "idempotencyKey": key,
            "env": [f"{name}={value}" for name, value in env.items()],
            "waitSecs": 0,
        }
        action = f"lease a machine from the pool '{pool}'"
        route = f"/api/v1/pools/{_q(pool)}/leases"
        started = time.monotonic()
        try:
            answer = self.request(action, "POST", route, body)
        except ApiError:
            raise
        except SmolError as err:
            # Perhaps after the engine leased: the same key answers that.
            log.info("a lease from %s is asked again: %s", pool, err)
            started = time.monotonic()
            answer = self.request(action, "POST", route, body)
        return answer, time.monotonic() - started

    def heartbeat_lease(self, pool: str, lease_id: str) -> dict:
        action = f"keep the lease {lease_id} of the pool '{pool}' alive"
        route = f"/api/v1/pools/{_q(pool)}/leases/{_q(lease_id)}/heartbeat"
        return self.request(action, "POST", route)

    def complete_lease(self, pool: str, lease_id: str) -> dict:
        action = f"complete the lease {lease_id} of the pool '{pool}'"
        route = f"/api/v1/pools/{_q(pool)}/leases/{_q(lease_id)}/complete"
        return self.request(action, "POST", route)


# A held lease's heartbeat comes every third of its TTL, so two may fail
# before it expires; never more often than this.
LEASE_BEAT_MIN_SECS = 5
# The engine's default lease TTL, for a lease that does not say its own.
LEASE_TTL_DEFAULT_SECS = 600
# How long the heartbeat thread waits for a next lease once none is held.
LEASE_BEATER_LINGER_SECS = 30


def lease_beat_secs(ttl_secs: float) -> float:
    """How often a lease of ``ttl_secs`` gets its heartbeat."""
    return max(LEASE_BEAT_MIN_SECS, ttl_secs / 3)


@dataclass
class Lease:
    """A pooled machine this process holds: the pool's lease of it, who
    holds it, and when its heartbeat is due."""

    pool: str
    id: str
    machine: str
    principal: str = ""
    # Its session (beats stop once it has ended); None for a lease a
    # stopped process left, adopted only to be completed.
    session: Any = None
    beat_secs: float = float(LEASE_TTL_DEFAULT_SECS)
    beat_at: float = math.inf


class Leases:
    """The leases of pooled machines this process holds, by machine name:
    a delete completes one, a thread beats their heartbeats while their
    sessions live, and the session records name them for the crash
    sweep."""

    def __init__(self, fleet: LocalFleet):
        self.fleet = fleet
        self._held: dict[str, Lease] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._beating = False

    def get(self, machine: str) -> Lease | None:
        return self._held.get(machine)

    def held_by(self, pool: str, principal: str) -> int:
        """How many of ``pool``'s workers ``principal`` holds."""
        with self._lock:
            return sum(
                1
                for lease in self._held.values()
                if lease.pool == pool and lease.principal == principal
            )

    def add(self, lease: Lease) -> None:
        """Hold ``lease``; its heartbeats start (the thread with them)."""
        lease.beat_at = time.monotonic() + lease.beat_secs
        with self._lock:
            self._held[lease.machine] = lease
            start = not self._beating
            self._beating = True
        if start:
            threading.Thread(
                target=self._beat_while_held,
                name="smol-mcp lease heartbeats",
                daemon=True,
            ).start()
        self._wake.set()

    def drop(self, machine: str) -> None:
        with self._lock:
            self._held.pop(machine, None)
        self._wake.set()

    def records(self, machines: Iterable[str]) -> dict[str, dict]:
        """The leases of ``machines``, as a session record keeps them."""
        held = [self._held.get(name) for name in machines]
        return {
            lease.machine: {"pool": lease.pool, "id": lease.id}
            for lease in held
            if lease is not None
        }

    def adopt(self, records: Any) -> None:
        """Hold the leases a stopped process's session record names (no
        heartbeats), so that deleting their machines completes them; a
        malformed entry is left out."""
        if not isinstance(records, dict):
            return
        for machine, lease in records.items():
            if not isinstance(lease, dict):
                continue
            pool = lease.get("pool")
            lease_id = lease.get("id")
            if isinstance(pool, str) and isinstance(lease_id, str):
                with self._lock:
                    self._held[machine] = Lease(pool, lease_id, machine)

    def complete(self, lease: Lease) -> None:
        """Complete ``lease``, and forget it. A lease the engine already
        ended (expired, or its pool gone) leaves its worker to delete,
        if it is still there."""
        try:
            self.fleet.complete_lease(lease.pool, lease.id)
        except ApiError as err:
            if err.status not in (404, 409):
                raise
            log.info("lease %s had ended: %s", lease.id, err.api_message)
            name = lease.machine
            try:
                self.fleet._machine(
                    f"delete machine '{name}'", "DELETE", _q(name)
                )
            except ApiError as gone:
                if gone.status != 404:
                    raise
        self.drop(lease.machine)

    def _beat_while_held(self) -> None:
        """Beat each held lease's heartbeat when due, until none has been
        held for LEASE_BEATER_LINGER_SECS (a thread costs a lease more
        than its wait)."""
        empty_since = None
        while True:
            with self._lock:
                now = time.monotonic()
                held = list(self._held.values())
                if held:
                    empty_since = None
                elif empty_since is None:
                    empty_since = now
                elif now - empty_since >= LEASE_BEATER_LINGER_SECS:
                    self._beating = False
                    return
            due = [lease for lease in held if lease.beat_at <= now]
            for lease in due:
                self._beat(lease)
            if not due:
                wait = LEASE_BEATER_LINGER_SECS
                if held:
                    wait = min(lease.beat_at for lease in held) - now
                self._wake.wait(min(60.0, wait))
                self._wake.clear()

    def _beat(self, lease: Lease) -> None:
        """One heartbeat of ``lease``; none once its session has ended, or
        the engine has ended the lease. A failure is logged, and the next
        beat tries again."""
        if lease.session is None or lease.session.ended:
            lease.beat_at = math.inf
            return
        lease.beat_at = time.monotonic() + lease.beat_secs
        try:
            self.fleet.heartbeat_lease(lease.pool, lease.id)
        except ApiError as err:
            if err.status in (404, 409):
                lease.beat_at = math.inf
            log.warning(
                "the lease of %s (pool %s) ended: %s",
                lease.machine,
                lease.pool,
                err,
            )
        except SmolError as err:
            log.info("a heartbeat of %s failed: %s", lease.machine, err)


def directory_error(
    path: str, response: http.client.HTTPResponse
) -> SmolError:
    """The error for a read of a directory, naming what it holds (the
    serve answered its listing)."""
    listing = json.loads(response.read() or b"{}")
    entries = listing.get("entries", [])[:50]
    names = ", ".join(entry.get("name", "?") for entry in entries)
    return SmolError(
        f"{path} is a directory, not a file; it holds: "
        f"{names or 'nothing'}. Pass the path of a file inside it."
    )


def download_page(
    response: http.client.HTTPResponse, offset: int, length: int
) -> FilePage:
    """``length`` bytes at ``offset`` of a file's download, and the file's
    size: its Content-Length, else counted by reading to the end."""
    size = int(response.getheader("Content-Length") or -1)
    skipped = 0
    while skipped < offset:
        chunk = response.read(min(1 << 20, offset - skipped))
        if not chunk:
            break
        skipped += len(chunk)
    if skipped < offset:
        # The file ends before the page begins.
        data = b""
    else:
        data = response.read(length)
    if size < 0:
        # No length header (a streamed file): count what is left.
        pieces = iter(functools.partial(response.read, 1 << 20), b"")
        size = skipped + len(data) + sum(map(len, pieces))
    return FilePage(data=data, size=size)


def route_table(text: str) -> dict[tuple[str, str], str | None]:
    """{(method, path): reason} from ``text``, where each entry is "reason:"
    and the "METHOD /path" pairs it gives that reason ("called:" for None),
    continued on indented lines; "~" is /api/v1/machines."""
    routes: dict[tuple[str, str], str | None] = {}
    text = text.strip().replace(" ~", " /api/v1/machines")
    # An entry starts on a line that is not indented.
    for entry in re.split(r"\n(?=\S)", text):
        head, _, pairs = " ".join(entry.split()).partition(":")
        reason = None if head == "called" else head
        words = pairs.split()
        routes.update(dict.fromkeys(zip(words[::2], words[1::2]), reason))
    return routes


# Every route of the local API, in its OpenAPI spelling, under why this
# server does not call it ("called:" for the ones it does; exec/stream gives
# live output, given a progress token). `smol_mcp.py parity` compares this
# with the running serve's spec, so a route a new smolvm adds shows up as a
# decision. "~" stands for /api/v1/machines.
LOCAL_ROUTES = route_table("""
called: GET /health  GET ~  POST ~  GET ~/{name}  DELETE ~/{name}
    POST ~/{name}/start  POST ~/{name}/stop  POST ~/{id}/exec
    POST ~/{id}/exec/stream  GET ~/{id}/files/{path}
    PUT ~/{id}/files/{path}  GET ~/{id}/logs  POST ~/{id}/images/pull
    POST ~/{name}/branches  POST ~/{name}/egress  GET ~/{name}/egress-events
    POST ~/{name}/pause  POST ~/{name}/resume
    PUT ~/{name}/ports
host scheduling numbers; no tool reports capacity: GET /capacity
no tool lists a machine's images: GET ~/{id}/images
running another image on an overlay is not in the tool vocabulary:
    POST ~/{id}/run
the legacy name of branches: POST ~/{name}/fork
branch pools; this server has no pool vocabulary: POST ~/{name}/fork-release
needs a pushToken minted by the control plane, which a local user
    cannot produce: POST ~/{name}/export
no tool grows a machine after it exists: POST ~/{name}/resize
mounts are a create-time argument: POST ~/{name}/sync  GET ~/{name}/mounts
    POST ~/{name}/mounts  DELETE ~/{name}/mounts
mediated egress is not used: GET ~/{name}/mediation-events
credential bindings are not used: PUT ~/{name}/credential-values
publish captures only a cache disk mounted at one guest path, not a
    machine's root file system, so a saved state is a paused branch instead:
    POST ~/{name}/cache-disk/publish  DELETE /api/v1/cache-bases/{base}
called: GET /api/v1/pools  POST /api/v1/pools
    POST /api/v1/pools/{name}/leases
    POST /api/v1/pools/{name}/leases/{lease}/heartbeat
    POST /api/v1/pools/{name}/leases/{lease}/complete
the operator's warm pools are made and leased from, never resized, deleted,
    batch-leased or read one by one: GET /api/v1/pools/{name}
    DELETE /api/v1/pools/{name}  PUT /api/v1/pools/{name}/size
    POST /api/v1/pools/{name}/lease-batches
    GET /api/v1/pools/{name}/leases/{lease}
RL rollout executors are a batch surface, not an agent one:
    GET /api/v1/rollout-executors  POST /api/v1/rollout-executors
    GET /api/v1/rollout-executors/{name}
    DELETE /api/v1/rollout-executors/{name}
    POST /api/v1/rollout-executors/{name}/generate
    POST /api/v1/rollout-executors/{name}/batches
    POST /api/v1/rollout-executors/{name}/policies
    POST /api/v1/rollout-executors/{name}/device-policies
    DELETE /api/v1/rollout-executors/{name}/policies/{policy}/{version}
""")


def parity_report(spec: dict) -> dict[str, list]:
    """The serve's OpenAPI against LOCAL_ROUTES: what we call, skip (and
    why), what is new (unknown) and what we call but it lacks (missing)."""
    verbs = ("get", "post", "put", "delete", "patch")
    offered = {
        (verb.upper(), path)
        for path, ops in spec.get("paths", {}).items()
        for verb in ops
        if verb.lower() in verbs
    }
    called = {
        route for route, reason in LOCAL_ROUTES.items() if reason is None
    }
    skipped = [
        (route, why)
        for route, why in LOCAL_ROUTES.items()
        if why and route in offered
    ]
    lists = {
        "called": called & offered,
        "skipped": skipped,
        "unknown": offered - set(LOCAL_ROUTES),
        "missing": called - offered,
    }
    return {key: sorted(routes) for key, routes in lists.items()}


def serve_dropped(action: str, exc: BaseException) -> SmolError:
    """The serve closed the connection mid-call: it stopped or restarted."""
    return SmolError(
        "the local serve closed the connection while trying to "
        f"{action} ({type(exc).__name__}); it may have stopped or restarted. "
        "Check the machine with get-machine before trying again."
    )


def api_error(
    fleet: str, action: str, status: int, content_type: str, data: bytes
) -> ApiError:
    """An ApiError from the serve's JSON ``{"error", "code"}`` (handlers) or
    plain text (parser)."""
    text = data.decode("utf-8", "replace").strip()
    code = ""
    if "application/json" in content_type:
        try:
            parsed = json.loads(text)
            message = str(parsed.get("error") or text)
            code = str(parsed.get("code") or "")
            text = message
        except (ValueError, AttributeError):
            pass
    # Engine log lines carry terminal colours into messages.
    text = ANSI_ESCAPE_RE.sub("", text)
    if not text and status == 404:
        text = (
            "no such route on this serve (it may be older than this server "
            "expects)"
        )
    text, engine_log = split_engine_log(text)
    return ApiError(
        fleet, action, status, code, text or "no message", engine_log
    )


def split_engine_log(text: str) -> tuple[str, tuple[str, ...]]:
    """Return ``text`` with the cause first, and the engine's log lines
    it quoted ahead of the cause.

    A failed boot reads "monitor agent: <log lines> (<cause>)": the
    cause takes the lines' place. Text with no log line, or whose cause
    is not the parenthesis it ends with, comes back whole.
    """
    found = ENGINE_LOG_LINE_RE.search(text)
    if found is None or not text.endswith(")"):
        return text, ()
    quoted = text[found.start() :]
    depth = 0
    opening = -1
    for index in range(len(quoted) - 1, -1, -1):
        if quoted[index] == ")":
            depth += 1
        elif quoted[index] == "(":
            depth -= 1
        if depth == 0:
            opening = index
            break
    log_text = quoted[:opening].strip()
    if opening <= 0 or not log_text:
        return text, ()
    cause = quoted[opening + 1 : -1]
    starts = [line.start() for line in ENGINE_LOG_LINE_RE.finditer(log_text)]
    pieces = [
        log_text[start:end].strip()
        for start, end in zip(starts, [*starts[1:], len(log_text)])
    ]
    return text[: found.start()] + cause, tuple(pieces)


def sse_events(chunks: Iterable[bytes]) -> Iterator[tuple[str, str]]:
    """(event, data) pairs of a server-sent-event stream read in pieces. A
    line ends at CR, LF or CRLF, and one event's data lines join with LF,
    as server-sent events define."""
    pending = b""
    event = "message"
    data = []
    last_cr = False
    for chunk in chunks:
        if last_cr and chunk.startswith(b"\n"):
            # The LF of a CRLF split across two pieces.
            chunk = chunk[1:]
        last_cr = chunk.endswith(b"\r")
        pending += chunk
        *lines, pending = re.split(rb"\r\n|\r|\n", pending)
        for raw in lines:
            line = raw.decode("utf-8", "replace")
            if not line:
                if data:
                    yield event, "\n".join(data)
                event = "message"
                data = []
            elif not line.startswith(":"):
                key, _, value = line.partition(":")
                value = value.removeprefix(" ")
                if key == "event":
                    event = value
                elif key == "data":
                    data.append(value)
    if data:
        yield event, "\n".join(data)


def collect_exec_stream(
    events: Iterable[tuple[str, str]],
    name: str,
    on_output: Callable,
    started: float,
    broken: tuple,
) -> ExecResult:
    """An exec stream as the result a plain exec gives, each piece of output
    passed to ``on_output`` as it arrives. Raise SmolError when the stream
    ends without its exit event, or fails (``broken``)."""
    out = {"stdout": bytearray(), "stderr": bytearray()}
    try:
        for event, data in events:
            if event in out:
                out[event] += data.encode("utf-8")
                on_output(event, data)
            elif event == "error":
                raise SmolError(
                    f"the command in machine '{name}' failed while its "
                    f"output streamed: {data}"
                )
            elif event == "exit":
                code = stream_exit_code(name, data)
                seconds = time.monotonic() - started
                stdout = bytes(out["stdout"])
                return ExecResult(code, stdout, bytes(out["stderr"]), seconds)
        how = "it ended"
    except broken as exc:
        how = type(exc).__name__
    got = len(out["stdout"]) + len(out["stderr"])
    raise SmolError(
        f"the output stream of the command in machine '{name}' broke after "
        f"{got} bytes ({how}) before its exit code arrived, so the command's "
        "result is unknown (it may still be running). Check the machine with "
        "get-machine, and run the command again, or as a job (start-job) if "
        "it needs longer."
    )


def stream_exit_code(name: str, data: str) -> int:
    """The exit code in an exec stream's exit event; raise SmolError when
    the event cannot be read."""
    try:
        return int(json.loads(data)["exitCode"])
    except (ValueError, KeyError, TypeError):
        raise SmolError(
            f"the output stream of machine '{name}' ended with an exit event "
            f"this server could not read ({data[:200]!r})"
        ) from None


def free_port(address: str = "127.0.0.1", taken: Iterable[int] = ()) -> int:
    """A host port that is free on ``address`` right now and not in
    ``taken``, for a published port given without one."""
    return free_ports(address, 1, taken)[0]


def free_ports(
    address: str, count: int, taken: Iterable[int] = ()
) -> list[int]:
    """``count`` distinct host ports free on ``address`` right now and not
    in ``taken``. Every socket stays bound until all are picked: a port
    just released can be handed out again, and the engine refuses a
    machine that maps one host port twice. A pick in ``taken`` stays
    bound too, so each is made at most once."""
    taken = set(taken)
    held = []
    picked = []
    try:
        while len(picked) < count:
            sock = socket.socket()
            held.append(sock)
            sock.bind((address, 0))
            port = sock.getsockname()[1]
            if port not in taken:
                picked.append(port)
    finally:
        for sock in held:
            sock.close()
    return picked


def port_specs(info: dict) -> list[dict]:
    """A local record's published ports as the ports route takes them back
    (``protocol`` only for udp, as the engine lists them)."""
    specs = []
    for port in info.get("ports") or []:
        spec = {"host": port.get("host"), "guest": port.get("guest")}
        if port.get("protocol") == "udp":
            spec["protocol"] = "udp"
        specs.append(spec)
    return specs


def published(address: str, guest: int, host: int, changed: bool) -> dict:
    """expose-port's answer for a local port published on ``host``."""
    return {
        "url": f"http://{address}:{host}",
        "port": guest,
        "hostPort": host,
        "changed": changed,
    }


def ports_full(name: str) -> ArgumentError:
    """The refusal of one more published port than a machine may have."""
    return ArgumentError(
        f"machine '{name}' publishes {PORTS_PER_MACHINE} TCP ports already, "
        "the most a machine may (each holds a port of the host); close one "
        "first (close: true), get-machine lists them"
    )


def port_in_use(err: ApiError, host: int | None) -> ApiError:
    """``err`` with the next step when the host port asked for is taken."""
    if err.code != "PORT_IN_USE":
        return err
    return err.with_hint(
        f"Host port {host} is in use on this host: leave hostPort out and "
        "a free one is picked"
    )


def _q(value: str, safe: str = "") -> str:
    return urllib.parse.quote(value, safe=safe)


class JsonStream:
    """Just enough of a JSON reader to walk a flat object arriving a chunk
    at a time."""

    # Big enough that a 64 MiB answer is a few hundred reads.
    CHUNK = 1 << 18

    def __init__(self, stream: Any):
        self.stream = stream
        self.buf = bytearray()
        self.pos = 0

    def _fill(self) -> bool:
        """Read the next chunk into the buffer; False at the end."""
        # Drop what was consumed, so the buffer stays a chunk or two.
        if self.pos > self.CHUNK:
            del self.buf[: self.pos]
            self.pos = 0
        chunk = self.stream.read(self.CHUNK)
        self.buf += chunk
        return bool(chunk)

    def next_token(self) -> bytes:
        """The next byte that is not white space; raise ValueError at the
        end."""
        while True:
            while (
                self.pos < len(self.buf) and self.buf[self.pos] in b" \t\r\n"
            ):
                self.pos += 1
            if self.pos < len(self.buf):
                self.pos += 1
                return bytes(self.buf[self.pos - 1 : self.pos])
            if not self._fill():
                raise ValueError("the answer ended early")

    def string(self, sink: Callable[[bytes], None] | None = None) -> None:
        """Pass the string's raw bytes up to its closing quote to ``sink``
        (None skips them), escapes undecoded. Only quotes are looked at
        (per-escape steps would crawl through output with a newline every
        few bytes): one ends it unless an odd backslash run precedes it."""
        # The backslashes that ended the part already consumed.
        carried = 0
        while True:
            quote = self.buf.find(b'"', self.pos)
            if quote < 0:
                # No quote yet: pass the part on, and read more.
                part = bytes(self.buf[self.pos :])
                carried = self._backslashes(part, carried)
                if sink is not None:
                    sink(part)
                self.pos = len(self.buf)
                if not self._fill():
                    raise ValueError("a string did not end")
                continue
            part = bytes(self.buf[self.pos : quote])
            escaped = self._backslashes(part, carried) % 2 == 1
            self.pos = quote + 1
            if not escaped:
                if sink is not None:
                    sink(part)
                return
            # An escaped quote: the string goes on, and holds it.
            if sink is not None:
                sink(part + b'"')
            carried = 0

    @staticmethod
    def _backslashes(part: bytes, carried: int) -> int:
        """The backslashes ending ``part``, with the ``carried`` ones before
        it when the part is nothing but backslashes."""
        run = len(part) - len(part.rstrip(b"\\"))
        if run == len(part):
            run += carried
        return run

    def scalar(self, first: bytes) -> Any:
        """A number, true, false or null that began with ``first``."""
        token = bytearray(first)
        while True:
            while (
                self.pos < len(self.buf)
                and self.buf[self.pos] not in b",}] \t\r\n"
            ):
                token.append(self.buf[self.pos])
                self.pos += 1
            if self.pos < len(self.buf) or not self._fill():
                return json.loads(token)

    def base64(self, output: bytearray) -> None:
        """A base64 string decoded into ``output`` as it arrives, in
        4-character blocks; raise ValueError when it ends mid-block."""
        # A rest shorter than a block waits for the next piece.
        pending = bytearray()

        def decode(raw: bytes) -> None:
            pending.extend(raw)
            usable = len(pending) // 4 * 4
            output.extend(
                base64.b64decode(bytes(pending[:usable]), validate=True)
            )
            del pending[:usable]

        self.string(decode)
        if pending:
            raise ValueError("a base64 field ended mid-block")


def read_exec_answer(stream: Any) -> dict:
    """A local exec answer's exitCode and byte-exact stdoutB64 and
    stderrB64, decoded as they arrive; the lossy text copies are skipped
    (the whole answer costs ~7x the output in memory). Raise ValueError
    when it is not such an answer."""
    reader = JsonStream(stream)
    answer: dict[str, Any] = {
        "exitCode": None,
        "stdoutB64": bytearray(),
        "stderrB64": bytearray(),
    }
    if reader.next_token() != b"{":
        raise ValueError("not a JSON object")
    token = reader.next_token()
    while token != b"}":
        if token == b",":
            token = reader.next_token()
        if token != b'"':
            raise ValueError(f"unexpected {token!r}")
        key_bytes = bytearray()
        reader.string(key_bytes.extend)
        key = json.loads(b'"' + key_bytes + b'"')
        if reader.next_token() != b":":
            raise ValueError("a key without a value")
        first = reader.next_token()
        if first == b'"' and key in ("stdoutB64", "stderrB64"):
            reader.base64(answer[key])
        elif first == b'"':
            # The lossy text copy, or a field this server does not read.
            reader.string()
        else:
            value = reader.scalar(first)
            if key == "exitCode":
                answer["exitCode"] = value
        token = reader.next_token()
    if answer["exitCode"] is None:
        raise ValueError("no exitCode")
    return answer


def other_serve_hint(own: str) -> str:
    """Where another smolvm serve on this host listens (from /proc), as the
    SMOL_LOCAL_URL that would use it; the generic hint when none is
    found."""
    for entry in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            argv = entry.read_bytes().decode("utf-8", "replace").split("\0")
        except OSError:
            continue
        if "serve" not in argv or "--listen" not in argv[:-1]:
            continue
        listen = argv[argv.index("--listen") + 1]
        if listen == own:
            continue
        if "://" in listen:
            url = listen
        else:
            url = f"unix://{os.path.abspath(listen)}"
        return (
            "Another smolvm serve runs on this host "
            f"(pid {entry.parent.name}, listening on {listen}): use it with "
            f"SMOL_LOCAL_URL={url} (it is then left running), or stop it."
        )
    return (
        "Only one smolvm serve can run per host with the default settings "
        "(it binds 127.0.0.1:10081), and one is already running. Point "
        "smol-mcp at it with SMOL_LOCAL_URL=unix:///path/to/its.sock "
        "(smolvm's own default is unix://$XDG_RUNTIME_DIR/smolvm.sock; it is "
        "then left running), or stop it."
    )


# ---------------------------------------------------------------------------
# 4. Cloud fleet: the smol cloud REST API
#
# httpx2 to $SMOL_CLOUD_URL with a bearer token; a machine is a mach-... id,
# found by name with one list call. Routes and bodies follow the official
# Python client (smolmachines 1.32.2), even where the live service was seen
# to differ; its observed behaviour is kept as a fallback.
# ---------------------------------------------------------------------------

CLOUD_TIMEOUT_SECS = 30
# The official client's wait for a job start (and other long calls).
CLOUD_LONG_TIMEOUT_SECS = 1800
LOG_WINDOW_LINES = 10000  # the most log lines one cloud read asks for
CLOUD_RETRY_STATUSES = (408, 429, 502, 503, 504)
# A longer Retry-After is not waited out: the call says so and ends.
CLOUD_MAX_RETRY_WAIT_SECS = 30
CLOUD_BLOCKED = {"mode": "blocked"}
# A deny-all where "blocked" is refused: RFC 5737 TEST-NET-1, routed
# nowhere (an empty list is refused with a 400).
CLOUD_BLOCKED_FALLBACK = {
    "mode": "allowCidrs",
    "cidrs": ["192.0.2.0/24"],
    "hosts": [],
}
CLOUD_EXEC_SCRIPT_READ = (
    'wc -c < "$1" && tail -c +$(($2 + 1)) "$1" | head -c "$3" | base64'
)
CLOUD_EXEC_SCRIPT_WRITE = (
    'mkdir -p "$(dirname "$1")" && base64 -d > "$1" && wc -c < "$1"'
)


class CloudApi:
    """The smol cloud REST API through one httpx2 client: a bearer token,
    retries where they are safe, and every failure a sentence."""

    def __init__(self, config: Config, fleet: str):
        import httpx2

        self.config = config
        # The fleet its ApiErrors name.
        self.fleet = fleet
        headers = {
            "Authorization": f"Bearer {config.cloud_token}",
            "User-Agent": f"smol-mcp/{__version__}",
        }
        self.client = httpx2.Client(
            base_url=config.cloud_url.rstrip("/"),
            timeout=CLOUD_TIMEOUT_SECS,
            headers=headers,
        )

    def request(
        self,
        action,
        method,
        path,
        data=None,
        *,
        timeout=CLOUD_TIMEOUT_SECS,
        expect=dict,
    ):
        """Return the answer to one call, retried where safe: 429 always
        (it never ran), other retryable statuses only for idempotent
        methods. Bytes ``data`` are sent as they are, else as JSON. A
        success must be JSON of an ``expect`` type; with None any body
        does (JSON parsed, else the bytes). Raise ApiError when the
        service refuses, SmolError when it is out of reach or answers
        what it should not."""
        if not self.config.cloud_token:
            fix = "set SMOL_CLOUD_TOKEN (or cloudToken in the config file)"
            raise SmolError(f"the cloud fleet needs an account key: {fix}")
        response = self._send_retried(action, method, path, data, timeout)
        if response.status_code >= 400:
            raise self.error(action, response)
        return self._answer(action, response, expect)

    def _send_retried(self, action, method, path, data, timeout) -> Any:
        """Return the first response not worth retrying, or the fourth;
        raise SmolError when the service asks to wait too long."""
        if isinstance(data, bytes):
            octets = {"Content-Type": "application/octet-stream"}
            sent = {"content": data, "headers": octets}
        else:
            sent = {"json": data}
        idempotent = method in ("GET", "PUT", "DELETE")
        for attempt in range(1, 4):
            response = self._send(action, method, path, timeout, sent)
            code = response.status_code
            retryable = code in CLOUD_RETRY_STATUSES and idempotent
            # A 429 is retried whatever the method: the call never ran.
            if code != 429 and not retryable:
                return response
            delay = self._retry_delay(action, response, attempt)
            log.info(
                "the cloud API answered HTTP %d to %s: trying again in %.1f s",
                code,
                action,
                delay,
            )
            time.sleep(delay)
        return self._send(action, method, path, timeout, sent)

    def _send(self, action, method, path, timeout, sent) -> Any:
        """Return one response; raise SmolError when none comes in time
        or the service cannot be reached."""
        import httpx2

        try:
            return self.client.request(method, path, timeout=timeout, **sent)
        except httpx2.TimeoutException:
            raise SmolError(
                f"the cloud API did not answer within {timeout:.0f} s while "
                f"trying to {action}; check the service's status and this "
                f"host's connection to {self.config.cloud_url}"
            ) from None
        except httpx2.TransportError as exc:
            secrets = self.config.secret_values()
            detail = redact(str(exc), secrets) or type(exc).__name__
            where = f"the cloud API at {self.config.cloud_url}"
            raise SmolError(
                f"could not reach {where} to {action}: {detail}"
            ) from None

    def _retry_delay(self, action, response, attempt) -> float:
        """Return the seconds to wait before the next attempt: Retry-After
        when it is a number, else a doubling backoff; raise SmolError when
        that is longer than CLOUD_MAX_RETRY_WAIT_SECS."""
        code = response.status_code
        wait = response.headers.get("retry-after", "")
        if wait.replace(".", "", 1).isdigit():
            delay = float(wait)
        else:
            delay = 0.5 * 2**attempt
        if delay > CLOUD_MAX_RETRY_WAIT_SECS:
            raise SmolError(
                f"the cloud API is busy (HTTP {code}) and asks to wait "
                f"{delay:.0f} s before trying to {action} again, longer "
                f"than this server waits ({CLOUD_MAX_RETRY_WAIT_SECS} s); "
                "try the call again later"
            )
        return delay

    def _answer(self, action, response, expect) -> Any:
        """Return a success's body: JSON of an ``expect`` type, or with
        ``expect`` None any body (JSON parsed, else the bytes, None when
        empty); raise SmolError for any other answer."""
        ctype = response.headers.get("content-type", "")
        body = response.content
        if "application/json" not in ctype:
            why = "not JSON"
        elif not body:
            why = "an empty body"
        else:
            try:
                value = json.loads(body)
            except ValueError:
                why = "malformed JSON"
            else:
                if expect is None or isinstance(value, expect):
                    return value
                why = f"JSON of the wrong shape ({_json_type(value)})"
        if expect is None:
            return body or None
        raise self.bad_answer(action, why, body, response.status_code, ctype)

    def error(self, action: str, response: Any) -> ApiError:
        """Return an ApiError from a cloud error body: plain text, JSON
        with code and error, or empty."""
        # A streamed answer's body is not read yet.
        response.read()
        status = response.status_code
        text = response.text.strip()
        code = ""
        if "application/json" in response.headers.get("content-type", ""):
            try:
                parsed = response.json()
                message = parsed.get("error") or parsed.get("message")
                text = str(message or text)
                code = str(parsed.get("code") or "")
            except (ValueError, AttributeError):
                pass
        if status == 401:
            text = (
                f"the account key was refused ({text or 'no detail'}); "
                "check SMOL_CLOUD_TOKEN"
            )
        text = redact(text or "no message", self.config.secret_values())
        err = ApiError(self.fleet, action, status, code, text)
        if request_id := response.headers.get("x-request-id"):
            err.args = (f"{err.args[0]} [request id {request_id}]",)
        return err

    def bad_answer(
        self, action, why, body, status=200, ctype="application/json"
    ) -> SmolError:
        """Return a sentence about an answer the cloud should not have
        given; ``body`` is bytes or JSON."""
        if not isinstance(body, bytes):
            body = json.dumps(body).encode()
        start = body[:120].decode("utf-8", "replace")
        head = redact(start, self.config.secret_values())
        return SmolError(
            f"the cloud API answered the request to {action} with {why}: "
            f"HTTP {status}, content type {ctype or '(none)'}, starting "
            f"{head!r}. That is the service's (or a proxy's) answer, not "
            "this call's: check SMOL_CLOUD_URL points at the API, and try "
            "again later"
        )


@registered
class CloudFleet:
    """A smol cloud account's machines, through a CloudApi. Blocking, like
    LocalFleet: called from worker threads. Long signatures go without
    annotations (Fleet's are the contract's)."""

    name = "cloud"
    served_as = (
        "cloud (the smol cloud account; machines are billed while they exist)"
    )
    instruction = (
        "- Cloud: a command, read or write in a stopped machine starts it "
        "(startedMachine: true) and leaves it running; published ports need "
        "open egress; delete-machine returns the settled usage."
    )
    # The official client has no route to amend or read a cloud machine's
    # egress.
    amends_egress = False
    # No host directories: the cloud's own refusal of mounts says so.
    mounts_host_paths = False
    branch_needs_start = False
    pool_refusal = (
        "create-machine's pool is local only: the smol cloud API has no "
        "pool routes, and keeping paused cloud machines warm would bill "
        "their storage, which the operator did not ask for. Create the "
        "machine from an image instead (image, cpus, memoryMb, network)"
    )

    @classmethod
    def target_facts(cls, app: SmolMcp) -> dict:
        """The fleet's facts, told without calling the service."""
        keyed = bool(app.config.cloud_token)
        reason = None if keyed else "no account key: set SMOL_CLOUD_TOKEN"
        return dict(
            served=True,
            usable=keyed,
            reason=reason,
            url=app.config.cloud_url,
            tokenSet=keyed,
        )

    @classmethod
    def lacking(cls, config: Config) -> str | None:
        if config.cloud_token:
            return None
        return (
            "the cloud account key: set SMOL_CLOUD_TOKEN "
            "(or cloudToken in the config file)"
        )

    @classmethod
    def doctor_report(
        cls, app: SmolMcp, facts: dict
    ) -> tuple[list[str], list[str]]:
        # The key is tried with one list call.
        if facts["usable"]:
            try:
                count = len(app.fleets[cls.name].list_machines())
                facts["reason"] = (
                    f"the account key works ({count} machine(s) on the fleet)"
                )
            except SmolError as err:
                facts.update(
                    usable=False,
                    reason=redact(str(err), app.config.secret_values()),
                )
        key_set = "yes" if facts["tokenSet"] else "no"
        return [f"url: {facts['url']}, key set: {key_set}"], []

    def __init__(self, config: Config, environ: dict[str, str] | None = None):
        self.config = config
        self.api = CloudApi(config, self.name)
        # Becomes the fallback if the service refuses this spelling.
        self._blocked = CLOUD_BLOCKED

    def acquire(self) -> None:
        """Nothing to hold: sessions share one HTTP client, and the cloud
        keeps no connection state of ours."""

    def release(self) -> None:
        """Nothing to let go of (see acquire)."""

    def _find(self, name: str) -> dict:
        """The raw record named ``name``; an unnamed one goes by its id,
        and a name wins over an id."""
        found = [
            record
            for record in self._list_raw()
            if (record.get("name") or record.get("id")) == name
        ]
        if found:
            return min(found, key=lambda record: not record.get("name"))
        missing = f"machine '{name}' not found"
        raise ApiError(
            self.name, f"find machine '{name}'", 404, "NOT_FOUND", missing
        )

    def _list_raw(self) -> list[dict]:
        answer = self.api.request(
            "list machines", "GET", "/v1/machines", expect=(dict, list)
        )
        # The official client accepts either shape; the service has sent a
        # bare array.
        if isinstance(answer, dict):
            machines = answer.get("machines", [])
        else:
            machines = answer
        ok = isinstance(machines, list) and all(
            isinstance(m, dict) and "id" in m for m in machines
        )
        if not ok:
            raise self.api.bad_answer(
                "list machines", "not a list of machine records", answer
            )
        return machines

    def list_machines(self) -> list[dict]:
        return [cloud_record(r) for r in self._list_raw()]

    def get_machine(self, name: str) -> dict:
        return cloud_record(self._find(name))

    def machine_state(self, name: str) -> str:
        return self.get_machine(name)["state"]

    def create_machine(self, spec: MachineSpec) -> dict:
        self._check_spec(spec)
        body = self._create_body(spec)
        action = f"create machine '{spec.name}'"
        try:
            created = self.api.request(action, "POST", "/v1/machines", body)
            return cloud_record(created)
        except ApiError as err:
            refused = err.status in (400, 422) and "blocked" in err.api_message
            if body["network"] is not CLOUD_BLOCKED or not refused:
                raise
        deny = "denying egress with an allow-list of 192.0.2.0/24"
        log.info('the cloud API refused network mode "blocked"; %s', deny)
        self._blocked = CLOUD_BLOCKED_FALLBACK
        body["network"] = CLOUD_BLOCKED_FALLBACK
        created = self.api.request(action, "POST", "/v1/machines", body)
        return cloud_record(created)

    @staticmethod
    def _check_spec(spec: MachineSpec) -> None:
        """Raise ArgumentError when ``spec`` asks for what only the local
        fleet has, or publishes ports from a machine without egress."""
        local_only = {
            "mounts": spec.mounts,
            "overlayGb": spec.overlay_gb,
            "cmd": spec.cmd,
        }
        given = [argument for argument, value in local_only.items() if value]
        if given:
            raise ArgumentError(
                f'"{given[0]}" is local only: the cloud fleet has no host '
                "directories, overlay disk or workload command to set; "
                "leave it out for a cloud machine"
            )
        if any(port.get("host") for port in spec.ports):
            why = (
                "the cloud control plane picks the host port; "
                "pass only the guest port"
            )
            raise ArgumentError(f'"ports[].host" is local only: {why}')
        egress = spec.network == "open" or spec.allow_hosts or spec.allow_cidrs
        if spec.ports and not egress:
            why = (
                "a cloud machine that publishes ports cannot also block egress"
            )
            fix = (
                'pass network: "open" (or an allow-list) with ports, '
                "or leave the ports out"
            )
            raise ArgumentError(f"{why}; {fix}")

    def _create_body(self, spec: MachineSpec) -> dict[str, Any]:
        """The create call's body for ``spec``, as the official client
        forms it."""
        # Ephemeral is expressed as a TTL and an idle stop; the service has
        # no "ephemeral" create field, and a machine it deletes on stop
        # could never be started.
        ttl = None
        auto_stop = None
        if spec.ephemeral:
            ttl = self.config.ephemeral_ttl_secs
            auto_stop = self.config.ephemeral_auto_stop_secs
        return {
            "name": spec.name,
            "source": {"type": "image", "reference": spec.image},
            "resources": {
                "diskGb": spec.storage_gb,
                "cpus": spec.cpus,
                "memoryMb": spec.memory_mb,
            },
            "ttlSeconds": ttl,
            "autoStopSeconds": auto_stop,
            # Branchability is a create field on the cloud.
            "forkable": spec.branchable,
            # Always sent: on the cloud an omitted policy means open egress.
            "network": self._egress_policy(spec),
            "ports": [{"port": p["guest"]} for p in spec.ports],
            "env": spec.env,
        }

    def _egress_policy(self, spec: MachineSpec) -> dict:
        """The network policy to create with: the allow-list if one is
        given, else open, else this service's spelling of blocked."""
        if spec.allow_hosts or spec.allow_cidrs:
            return {
                "mode": "allowCidrs",
                "cidrs": spec.allow_cidrs,
                "hosts": spec.allow_hosts,
            }
        if spec.network == "open":
            return {"mode": "open"}
        return self._blocked

    def _act(
        self, name: str, verb: str, timeout: float, query: str = ""
    ) -> dict:
        """Ask the machine to ``verb`` (start, stop); return its record
        after. Raise Paused for a paused machine, which the service keeps
        as it is."""
        found = self._find(name)
        if found.get("state") == "paused":
            raise paused_refusal(name, f"{verb}-machine")
        return self._ask(found, name, verb, timeout, query)

    def _ask(
        self, found: dict, name: str, verb: str, timeout: float, query=""
    ) -> dict:
        """Ask the machine of raw record ``found`` to ``verb``; return its
        record after."""
        route = f"/v1/machines/{found['id']}"
        action = f"{verb} machine '{name}'"
        self.api.request(
            action,
            "POST",
            f"{route}/{verb}{query}",
            timeout=timeout,
            expect=None,
        )
        record = self.api.request(f"get machine '{name}'", "GET", route)
        return cloud_record(record)

    def start_machine(
        self,
        name: str,
        branchable: bool = False,
        mounts: list[dict] | None = None,
    ) -> dict:
        """Start ``name``; one running already is left as it is. Raise
        Paused for a paused one. (No mounts: the cloud has no host
        directories.)"""
        found = self._find(name)
        if found.get("state") in RUNNING_STATES:
            return cloud_record(found)
        if found.get("state") == "paused":
            raise paused_refusal(name, "start-machine")
        # The official client repeats branchability on the first start of
        # a branch source.
        query = "?forkable=true" if branchable else ""
        timeout = self.config.ready_timeout_secs + 60
        return self._ask(found, name, "start", timeout, query)

    def stop_machine(self, name: str) -> dict:
        return self._act(name, "stop", 360)

    def delete_machine(self, name: str) -> dict:
        """Delete and return the settled bill, which the service computes
        at teardown."""
        route = f"/v1/machines/{self._find(name)['id']}?includeUsage=true"
        usage = self.api.request(
            f"delete machine '{name}'",
            "DELETE",
            route,
            timeout=120,
            expect=None,
        )
        deleted = {"deleted": name}
        if isinstance(usage, dict):
            deleted["usage"] = usage
        return deleted

    def _exec(
        self, machine_id: str, name: str, body: dict
    ) -> tuple[dict, float]:
        """One exec call (``body`` from cloud_exec_body): the answer and
        the seconds it took."""
        action = f"run a command in machine '{name}'"
        started = time.monotonic()
        timeout = max(CLOUD_TIMEOUT_SECS, body["timeoutSeconds"] + 30)
        route = f"/v1/machines/{machine_id}/exec"
        answer = self.api.request(action, "POST", route, body, timeout=timeout)
        exit_code = answer.get("exitCode")
        if isinstance(exit_code, bool) or not isinstance(exit_code, int):
            raise self.api.bad_answer(
                action, "no whole-number exitCode", answer
            )
        return answer, time.monotonic() - started

    def _running(self, name: str) -> dict:
        """The raw record of machine ``name``; raise NotRunning unless it
        runs (a cloud exec would start it)."""
        record = self._find(name)
        if record.get("state") == "paused":
            raise Paused(f"machine '{name}' is paused")
        if record.get("state") not in RUNNING_STATES:
            raise NotRunning(f"machine '{name}' is not running")
        return record

    def exec(self, name, argv, **options: Unpack[ExecOptions]) -> ExecResult:
        """Run a command; NotRunning unless the machine runs."""
        record = self._running(name)
        body = cloud_exec_body(argv, **options)
        answer, seconds = self._exec(record["id"], name, body)
        cut = tuple(
            stream
            for stream in ("stdout", "stderr")
            if answer.get(f"{stream}Truncated")
            and not answer.get(f"{stream}B64")
        )
        out = exec_stream(answer, "stdout")
        err = exec_stream(answer, "stderr")
        return ExecResult(int(answer["exitCode"]), out, err, seconds, cut)

    def exec_stream(
        self, name, argv, *, on_output, **options: Unpack[ExecOptions]
    ) -> ExecResult:
        """``exec`` through the SSE route. Never retried: the command may
        have run."""
        import httpx2

        record = self._running(name)
        action = f"run a command in machine '{name}'"
        started = time.monotonic()
        route = f"/v1/machines/{record['id']}/exec/stream"
        sse = {"Accept": "text/event-stream"}
        body = cloud_exec_body(argv, **options)
        secs = max(CLOUD_TIMEOUT_SECS, options["timeout_secs"] + 30)
        try:
            with self.api.client.stream(
                "POST", route, json=body, headers=sse, timeout=secs
            ) as reply:
                if reply.status_code >= 400:
                    raise self.api.error(action, reply)
                events = sse_events(reply.iter_bytes())
                faults = (httpx2.TransportError,)
                return collect_exec_stream(
                    events, name, on_output, started, faults
                )
        # Before the answer began (collect_exec_stream handles the rest).
        except httpx2.TransportError as exc:
            where = f"the cloud API at {self.config.cloud_url}"
            raise SmolError(
                f"could not reach {where} to {action}: {type(exc).__name__}"
            ) from None

    def _jobs_path(self, name: str) -> str:
        return f"/v1/machines/{self._find(name)['id']}/jobs"

    def start_job(
        self, name, job_id, argv, **options: Unpack[JobOptions]
    ) -> dict:
        """The service names the job itself; ``job_id`` is the local
        fleet's. Raise Paused for a paused machine (the service refuses
        it)."""
        body = cloud_exec_body(argv, **options)
        found = self._find(name)
        if found.get("state") == "paused":
            raise Paused(f"machine '{name}' is paused")
        path = f"/v1/machines/{found['id']}/jobs"
        action = f"start a job in machine '{name}'"
        job = self.api.request(
            action, "POST", path, body, timeout=CLOUD_LONG_TIMEOUT_SECS
        )
        return {"jobId": job["id"], "state": job.get("state", "running")}

    def read_job(
        self, name: str, job_id: str, offsets: tuple[int, int], limit: int
    ) -> JobPage:
        path = f"{self._jobs_path(name)}/{_q(job_id)}"
        job = self.api.request(
            f"read job {job_id} of machine '{name}'", "GET", path
        )
        sizes = (
            int(job.get("stdoutBytes") or 0),
            int(job.get("stderrBytes") or 0),
        )
        left = tuple(
            max(0, size - offset) for size, offset in zip(sizes, offsets)
        )
        # At most `limit` bytes together.
        shares = stream_shares(left, limit)
        pages = [b"", b""]
        streams = ("stdout", "stderr")
        for index, (stream, offset, count) in enumerate(
            zip(streams, offsets, shares)
        ):
            if count > 0:
                query = f"output?stream={stream}&offset={offset}&limit={count}"
                page = self.api.request(
                    f"read the {stream} of job {job_id}",
                    "GET",
                    f"{path}/{query}",
                )
                # data, or dataB64 byte-exact.
                pages[index] = exec_stream(page, "data")[:count]
        state = job.get("state", "lost")
        return JobPage(state, job.get("exitCode"), *pages, sizes)

    def cancel_job(self, name: str, job_id: str) -> None:
        path = f"{self._jobs_path(name)}/{_q(job_id)}/cancel"
        action = f"cancel job {job_id} of machine '{name}'"
        self.api.request(action, "POST", path)

    def list_jobs(
        self, name: str, machine_id: str | None = None
    ) -> list[dict]:
        """The machine's jobs; with its ``machine_id`` (mach-...), no list
        call to find it."""
        if machine_id:
            path = f"/v1/machines/{machine_id}/jobs"
        else:
            path = self._jobs_path(name)
        answer = self.api.request(
            f"list the jobs of machine '{name}'", "GET", path
        )
        # The service lists newest first.
        return [
            {
                "jobId": job.get("id"),
                "state": job.get("state"),
                "exitCode": job.get("exitCode"),
            }
            for job in reversed(answer.get("jobs", []))
        ]

    def probe_ready(self, name: str) -> str | None:
        """None once a command runs in the guest (the service's `ready`
        also waits for ports)."""
        record = self._find(name)
        state = record.get("state")
        if state in ("error", "stopped", "deleted"):
            why = "its log (machine-logs) may say why"
            raise SmolError(
                f"machine '{name}' is {state} instead of starting; {why}"
            )
        if state not in RUNNING_STATES:
            return f"state {state}"
        try:
            self._exec(record["id"], name, cloud_exec_body(READY_PROBE, 10))
            return None
        except ApiError as err:
            if err.status in (401, 403, 404):
                raise
            return err.api_message

    def _file_route(self, name: str, path: str) -> tuple[str, str]:
        """The machine's id and ``path``'s files route, as the official
        client forms it; raise NotRunning unless the machine runs, as its
        files are a running guest's."""
        machine_id = self._running(name)["id"]
        suffix = guest_route_suffix(path)
        return machine_id, f"/v1/machines/{machine_id}/files//{suffix}"

    def read_file(
        self, name: str, path: str, offset: int, length: int
    ) -> FilePage:
        machine_id, route = self._file_route(name, path)
        try:
            return self._read_route(route, name, path, offset, length)
        except ApiError as err:
            if err.status != 404:
                raise
        # 404: a missing file, or a service without the suffix route; exec
        # tells which, per request.
        return self._read_by_exec(machine_id, name, path, offset, length)

    def _read_route(self, route, name, path, offset, length) -> FilePage:
        """The page read from the files route, streamed so that no more
        than the page is kept; raise ApiError when the route refuses."""
        timeout = CLOUD_TIMEOUT_SECS + 430
        with self.api.client.stream("GET", route, timeout=timeout) as response:
            if response.status_code >= 400:
                action = f"read {path} in machine '{name}'"
                raise self.api.error(action, response)
            size = int(response.headers.get("content-length", -1))
            page = bytearray()
            seen = 0
            for chunk in response.iter_bytes():
                # What the page lacks, from where it starts.
                page += chunk[max(0, offset - seen) :][: length - len(page)]
                seen += len(chunk)
                if len(page) >= length and size >= 0:
                    break
            if size < 0:
                size = seen
            return FilePage(data=bytes(page), size=size)

    def _read_by_exec(
        self, machine_id, name, path, offset, length
    ) -> FilePage:
        """The page read by a shell in the machine (the file's size, then
        the page in base64); raise SmolError when the read fails or its
        output was cut."""
        argv = [
            "sh",
            "-c",
            CLOUD_EXEC_SCRIPT_READ,
            "sh",
            path,
            str(offset),
            str(length),
        ]
        answer, _ = self._exec(machine_id, name, cloud_exec_body(argv, 120))
        if answer.get("exitCode") != 0:
            exit_code = answer.get("exitCode")
            error = exec_stderr(answer) or f"exit code {exit_code}"
            raise SmolError(
                f"could not read {path} in machine '{name}': {error}"
            )
        size_line, _, encoded = exec_stream(answer, "stdout").partition(b"\n")
        size = int(size_line.strip() or 0)
        try:
            data = base64.b64decode(encoded)
        except ValueError:
            data = b""
        # The service caps exec output; a page cut short would read as the
        # end of the file.
        if len(data) != max(0, min(length, size - offset)):
            raise SmolError(
                f"the cloud API cut the output of the read of {path} short "
                "(its exec output cap), so the page is not returned; "
                "ask for a smaller length"
            )
        return FilePage(data=data, size=size)

    def write_file(self, name: str, path: str, data: bytes) -> int:
        machine_id, route = self._file_route(name, path)
        action = f"write {path} in machine '{name}'"
        timeout = CLOUD_TIMEOUT_SECS + len(data) / (256 * 1024)
        try:
            self.api.request(
                action, "PUT", route, data, timeout=timeout, expect=None
            )
            return len(data)
        except ApiError as err:
            if err.status != 404:
                raise
        # A PUT to a just-found machine 404s only without a files route:
        # exec (per request).
        argv = ["sh", "-c", CLOUD_EXEC_SCRIPT_WRITE, "sh", path]
        stdin = base64.b64encode(data).decode("ascii")
        body = cloud_exec_body(argv, 120, stdin=stdin)
        answer, _ = self._exec(machine_id, name, body)
        if answer.get("exitCode") != 0:
            error = exec_stderr(answer)
            raise SmolError(
                f"could not write {path} in machine '{name}': {error}"
            )
        return int(exec_stream(answer, "stdout").strip() or len(data))

    def console_lines(self, name: str) -> list[str]:
        """The console log's last lines, read as the official client reads
        them (plain text)."""
        machine_id = self._find(name)["id"]
        route = f"/v1/machines/{machine_id}/logs?tail={LOG_WINDOW_LINES}"
        answer = self.api.request(
            f"read the log of machine '{name}'", "GET", route, expect=None
        )
        if isinstance(answer, (dict, list)):
            text = json.dumps(answer)
        elif isinstance(answer, bytes):
            text = answer.decode("utf-8", "replace")
        else:
            text = str(answer or "")
        return text.splitlines()

    def branch_machine(self, name: str, child: str) -> dict:
        route = f"/v1/machines/{self._find(name)['id']}"
        body = {"name": child, "ports": []}
        action = f"branch machine '{name}' into '{child}'"
        try:
            created = self.api.request(
                action, "POST", f"{route}/branches", body, timeout=1800
            )
        except ApiError as err:
            if err.status != 404:
                raise
            # Older control planes only have the fork route (the source
            # exists: it was just found).
            created = self.api.request(
                action, "POST", f"{route}/fork", body, timeout=1800
            )
        return cloud_record(created)

    # -- pause, resume and saved states ------------------------------------

    def pause_machine(self, name: str) -> tuple[dict, bool]:
        """Pause ``name``; the list's record says first whether it is
        paused already (its record answered) or cannot be (SmolError)."""
        found = self._find(name)
        state = found.get("state")
        if state == "paused":
            return cloud_record(found), False
        if state not in RUNNING_STATES:
            raise not_pausable(name, state)
        record = self._ask(found, name, "pause", CLOUD_LONG_TIMEOUT_SECS)
        return record, True

    def resume_machine(self, name: str) -> tuple[dict, bool]:
        """Resume ``name``'s saved execution; the list's record says first
        whether it runs already (its record answered) or has nothing saved
        (SmolError)."""
        found = self._find(name)
        state = found.get("state")
        if state in RUNNING_STATES:
            return cloud_record(found), False
        if state != "paused":
            raise not_resumable(name, state)
        record = self._ask(found, name, "resume", CLOUD_LONG_TIMEOUT_SECS)
        return record, True

    def save_state(self, name: str, state: str) -> dict:
        """Capture a checkpoint of running machine ``name`` (it keeps
        running); its network policy is kept for the restore, which takes
        one."""
        found = self._find(name)
        if found.get("state") not in RUNNING_STATES:
            raise not_saveable(name, found.get("state"), True)
        action = f"save machine '{name}' as state '{state}'"
        route = f"/v1/machines/{found['id']}/checkpoints"
        checkpoint = self.api.request(
            action, "POST", route, timeout=CLOUD_LONG_TIMEOUT_SECS
        )
        ref = checkpoint.get("id")
        if not isinstance(ref, str) or not ref:
            raise self.api.bad_answer(action, "no checkpoint id", checkpoint)
        return {
            "ref": ref,
            "status": checkpoint.get("status"),
            "sizeBytes": checkpoint.get("sizeBytes"),
            "network": _object_field(found, "network") or None,
        }

    def restore_state(self, saved: dict, child: str) -> dict:
        """A new stopped machine ``child`` restored from the state's
        checkpoint, with its source's network policy (the service's own
        default would be blocked)."""
        network = saved.get("network") or self._blocked
        body = {"name": child, "network": network}
        route = f"/v1/checkpoints/{_q(saved['ref'])}/restore"
        action = f"create machine '{child}' from a saved state"
        return cloud_record(self.api.request(action, "POST", route, body))

    def delete_state(self, saved: dict) -> None:
        """Delete the state's checkpoint; one gone already counts as
        deleted. The service refuses while a machine restored from it
        exists."""
        route = f"/v1/checkpoints/{_q(saved['ref'])}"
        try:
            self.api.request(
                "delete a saved state", "DELETE", route, expect=None
            )
        except ApiError as err:
            if err.status != 404:
                raise

    def pull_image(self, name: str, image: str) -> dict:
        why = (
            "the cloud control plane pulls a machine's image itself "
            "when the machine is created"
        )
        raise ArgumentError(f"pull-image is local only: {why}")

    # -- published ports (expose-port) -------------------------------------

    def publish_port(self, name: str, guest: int, host: int | None) -> dict:
        """Publish TCP port ``guest`` (the route takes the whole set) and
        answer a port link to it: the way in a person opens."""
        if host is not None:
            raise ArgumentError(
                '"hostPort" is local only: the cloud control plane picks the '
                "host port; leave it out"
            )
        record = self._find(name)
        if cloud_egress(_object_field(record, "network")) == "blocked":
            raise ArgumentError(
                f"machine '{name}' blocks egress, and a cloud machine that "
                "publishes ports cannot also block egress; create one with "
                'network: "open" (or an allow-list) to publish a port'
            )
        guests = cloud_tcp_ports(record)
        changed = guest not in guests
        if changed and len(guests) >= PORTS_PER_MACHINE:
            raise ports_full(name)
        if changed:
            answer = self._put_ports(record, name, [*guests, guest])
            if isinstance(answer, dict):
                record = answer
        action = f"make a link to port {guest} of machine '{name}'"
        route = f"/v1/machines/{record['id']}/port-links"
        links = self.api.request(action, "POST", route)
        url = _object_field(links, "urls").get(str(guest))
        if not isinstance(url, str):
            raise self.api.bad_answer(action, f"no link for {guest}", links)
        return {
            "url": url,
            "port": guest,
            "hostPort": cloud_host_port(record, guest),
            "changed": changed,
        }

    def unpublish_port(self, name: str, guest: int) -> dict:
        """Take TCP port ``guest`` off the machine's published ports; the
        last one closed also revokes the machine's port links."""
        record = self._find(name)
        guests = cloud_tcp_ports(record)
        closed = {"url": None, "port": guest}
        if guest not in guests:
            return {**closed, "hostPort": None, "changed": False}
        host = cloud_host_port(record, guest)
        kept = [port for port in guests if port != guest]
        self._put_ports(record, name, kept)
        if not kept:
            action = f"revoke the port links of machine '{name}'"
            route = f"/v1/machines/{record['id']}/port-links"
            self.api.request(action, "DELETE", route, expect=None)
        return {**closed, "hostPort": host, "changed": True}

    def _put_ports(self, record: dict, name: str, guests: list[int]) -> Any:
        """Replace the machine's published TCP ports with ``guests``."""
        action = f"set the published ports of machine '{name}'"
        route = f"/v1/machines/{record['id']}/ports"
        body = {"ports": [{"port": port} for port in guests]}
        return self.api.request(action, "PUT", route, body, expect=None)


def cloud_tcp_ports(record: dict) -> list[int]:
    """The guest ports a cloud record publishes over TCP, the set the
    ports route replaces."""
    return [
        port["port"]
        for port in record.get("ports") or []
        if isinstance(port, dict) and port.get("protocol", "tcp") == "tcp"
    ]


def cloud_host_port(record: dict, guest: int) -> int | None:
    """The node's host port for ``guest``, or None while it is not
    placed."""
    for port in record.get("ports") or []:
        if isinstance(port, dict) and port.get("port") == guest:
            return port.get("hostPort") or None
    return None


def cloud_exec_body(
    argv: list[str], timeout_secs: int, workdir=None, env=None, stdin=None
) -> dict:
    """A cloud exec's or job start's body (the ExecOptions as keywords);
    ``stdin`` if any."""
    body = {
        "command": argv,
        "env": env or {},
        "cwd": workdir,
        "timeoutSeconds": timeout_secs,
    }
    if stdin is not None:
        body["stdin"] = stdin
    return body


def exec_stream(answer: dict, stream: str) -> bytes:
    """One stream of a cloud exec: byte-exact base64 when sent, else the
    text (capped at 1 MiB)."""
    if encoded := answer.get(f"{stream}B64"):
        return base64.b64decode(encoded)
    return str(answer.get(stream) or "").encode("utf-8")


def exec_stderr(answer: dict) -> str:
    """A cloud exec's stderr as text, stripped (for a failure's sentence)."""
    return exec_stream(answer, "stderr").decode("utf-8", "replace").strip()


# ---------------------------------------------------------------------------
# 5. Normalised records
#
# A machine has the same keys on every fleet, null where a fleet has no such
# value, so no tool handler (and no agent) needs to know which API answered.
# ---------------------------------------------------------------------------

MACHINE_KEYS = tuple(
    "id name state image cpus memoryMb network ports createdAt pid url "
    "branchable parent".split()
)


def local_record(info: dict) -> dict:
    """A local MachineInfo in the shared vocabulary (``id``: the name, the
    local API's only handle). An allow list wins over `network: true`,
    which an amended machine also reads (1.32.2)."""
    if info.get("allowedHosts") or info.get("allowedCidrs"):
        network = "allowlist"
    elif info.get("network"):
        network = "open"
    else:
        network = "blocked"
    ports = [
        {"guest": p.get("guest"), "host": p.get("host")}
        for p in info.get("ports") or []
    ]
    # name state image cpus memoryMb pid
    named_alike = {key: info.get(key) for key in MACHINE_KEYS}
    return named_alike | {
        "id": info["name"],
        "network": network,
        "ports": ports,
        "createdAt": iso_time(info.get("createdAt")),
        "url": None,  # the local fleet has no public ingress
        "branchable": bool(info.get("branchable") or info.get("forkable")),
        "parent": info.get("parentMachine"),
    }


def egress_lists(info: dict) -> dict:
    """A local machine's egress: open or not, and its allow lists (hosts
    include patterns)."""
    hosts = list(info.get("allowedHosts") or [])
    cidrs = list(info.get("allowedCidrs") or [])
    is_open = bool(info.get("network")) and not hosts and not cidrs
    return {"open": is_open, "hosts": hosts, "cidrs": cidrs}


def cloud_record(info: dict) -> dict:
    """A cloud machine in the shared vocabulary; network null (unknown) if
    the record omits it."""
    network = _object_field(info, "network")
    source = _object_field(info, "source")
    resources = _object_field(info, "resources")
    ports = [
        {"guest": p.get("port"), "host": p.get("hostPort")}
        for p in info.get("ports") or []
    ]
    # id state url
    named_alike = {key: info.get(key) for key in MACHINE_KEYS}
    return named_alike | {
        "name": info.get("name") or info.get("id"),
        "image": source.get("reference") or info.get("image"),
        "cpus": resources.get("cpus"),
        "memoryMb": resources.get("memoryMb"),
        "network": cloud_egress(network),
        "ports": ports,
        "createdAt": iso_time(info.get("createdAt")),
        "pid": None,  # the VM process runs on a node we cannot see
        "branchable": bool(
            info.get("branchable", info.get("forkable", False))
        ),
        "parent": info.get("parent") or info.get("sourceMachineId"),
    }


def _object_field(info: dict, key: str) -> dict:
    """``info[key]`` when it is an object, else an empty one."""
    value = info.get(key)
    if isinstance(value, dict):
        return value
    return {}


def cloud_egress(network: dict) -> str | None:
    """A cloud network policy's word in the shared vocabulary (open,
    blocked, allowlist), or None when its mode is missing or unknown."""
    mode = network.get("mode")
    fallback = network.get("cidrs") == CLOUD_BLOCKED_FALLBACK["cidrs"]
    # Our deny-all for a service refusing "blocked" reads as blocked,
    # unless hosts were allowed too.
    if mode == "allowCidrs" and fallback and not network.get("hosts"):
        mode = "blocked"
    if not isinstance(mode, str):
        return None
    words = {"open": "open", "blocked": "blocked", "allowCidrs": "allowlist"}
    return words.get(mode)


def machine_identity(record: dict) -> str:
    """Which machine a record is: one made again under its name has another
    id or creation time."""
    return f"{record.get('id')}@{record.get('createdAt')}"


def iso_time(value: Any) -> str | None:
    """Unix seconds as RFC 3339 UTC, the form the cloud API uses."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return utc_time(value)
    if isinstance(value, str):
        return value
    return None


# ---------------------------------------------------------------------------
# 6. Output budget
#
# A tool result is read by a model that pays in tokens (Claude Code refuses
# a result over 25,000). A stream longer than maxOutputBytes, or estimated
# above replyTokens, keeps its head and its tail, says how much fell
# between, and the whole stream is written into the machine so nothing is
# lost.
# ---------------------------------------------------------------------------

OVERFLOW_DIR = "/tmp/smol-mcp-output"


def utf8_prefix_end(data: bytes, end: int) -> int:
    """Largest cut <= end that does not split a UTF-8 character."""
    end = min(end, len(data))
    # Back to the first byte of the character at `end`.
    for back in range(1, min(end, 4) + 1):
        lead = data[end - back]
        if lead & 0xC0 == 0x80:
            continue
        # A lead byte: is its character complete before `end`?
        if lead >= 0xC0 and back < utf8_length(lead):
            return end - back
        return end
    return end


def utf8_length(lead: int) -> int:
    """The bytes in the character a UTF-8 lead byte (0xC0 and up) begins."""
    if lead < 0xE0:
        return 2
    if lead < 0xF0:
        return 3
    return 4


# One piece a tokenizer cannot merge across: a run of letters and digits, a
# run of spaces, a character JSON escapes, other ASCII, one non-ASCII
# character.
TOKEN_PIECE_RE = re.compile(
    r'[A-Za-z0-9]+| +|[\x00-\x1f"\\]|[!-~\x7f]|[^\x00-\x7f]'
)
PLAIN_WORD_RE = re.compile(r"(?:[A-Z]?[a-z]{2,}){1,4}|[A-Z]+|[a-z]|[0-9]+")
# Of replyTokens, for the fields around the content and the marker.
REPLY_RESERVE_TOKENS = 2000


def piece_tokens(piece: str) -> int:
    """Tokens a TOKEN_PIECE_RE piece may cost in a reply's JSON, as
    measured on BPE tokenizers: English 3.5 characters a token,
    base64/random 1.4, CJK 2.3 a character, emoji 2.9, \\u00XX 3."""
    first = piece[0]
    size = len(piece)
    if first.isascii() and first.isalnum():
        if size > 12 or not PLAIN_WORD_RE.fullmatch(piece):
            return (size * 3 + 3) // 4  # base64, hex, random: barely merged
        if first.isdigit():
            return (size + 1) // 2
        return (size + 2) // 3
    if first == " ":
        return (size + 3) // 4
    if first < " " or first in '"\\':
        # A two-character JSON escape (\n, \") costs 2, a \u00XX one 4.
        if first in '\n\t\r\b\f"\\':
            return 2
        return 4
    if first.isascii():
        return 1
    # Every byte of a non-ASCII character may be a token of its own.
    return len(first.encode("utf-8", "surrogatepass"))


def est_tokens(text: str) -> int:
    """A conservative estimate of what ``text`` costs a model inside a JSON
    reply."""
    return sum(piece_tokens(m.group()) for m in TOKEN_PIECE_RE.finditer(text))


def within_tokens(text: str, tokens: int) -> int:
    """How many leading characters of ``text`` are estimated at most
    ``tokens``."""
    used = 0
    for match in TOKEN_PIECE_RE.finditer(text):
        cost = piece_tokens(match.group())
        if used + cost > tokens:
            # A long piece is cut: it costs at most one token a character.
            # One character is not cut.
            if match.end() == match.start() + 1:
                return match.start()
            return match.start() + max(0, tokens - used)
        used += cost
    return len(text)


def prefix_within_tokens(data: bytes, tokens: int) -> int:
    """The longest prefix of ``data`` in whole characters estimated at most
    ``tokens``."""
    text = data.decode("utf-8", "surrogateescape")
    prefix = text[: within_tokens(text, tokens)]
    return len(prefix.encode("utf-8", "surrogateescape"))


def suffix_within_tokens(data: bytes, tokens: int) -> bytes:
    """The longest end of ``data`` in whole characters estimated at most
    ``tokens`` (``data`` begins on a character)."""
    backwards = data.decode("utf-8", "surrogateescape")[::-1]
    suffix = backwards[: within_tokens(backwards, tokens)][::-1]
    return suffix.encode("utf-8", "surrogateescape")


def reply_json(result: dict) -> str:
    """A structured tool result's text content: the same JSON, compact (no
    whitespace a model pays for; CPython's C encoder runs only without an
    indent), non-ASCII kept (escaped costs six)."""
    return json.dumps(result, ensure_ascii=False, separators=(",", ":"))


def reply_tokens(config: Config) -> int:
    """The tokens a result's content (its streams or its page) may cost
    together."""
    return config.reply_tokens - REPLY_RESERVE_TOKENS


def stream_shares(costs: tuple[int, int], limit: int) -> tuple[int, int]:
    """Split ``limit`` between stdout and stderr; one needing under half
    leaves the rest."""
    first = min(costs[0], max(limit // 2, limit - costs[1]))
    return first, min(costs[1], limit - first)


def omission_marker(omitted: int, where: str) -> str:
    """The line that stands where a stream's middle was left out."""
    return f"\n[... smol-mcp: {omitted} bytes omitted here; {where} ...]\n"


def fit_stream(
    data: bytes, limit: int, tokens: int, where: str
) -> tuple[str, int]:
    """The text to return for one stream and the bytes left out: its head
    and its tail, each within half of ``limit`` bytes and of ``tokens``;
    ``where`` ends the marker (where the stream is)."""
    # A longer stream is never decoded whole.
    if len(data) <= limit:
        text = data.decode("utf-8", "surrogateescape")
        if est_tokens(text) <= tokens:
            return data.decode("utf-8", "replace"), 0
    tokens -= est_tokens(omission_marker(len(data), where))
    head = data[: utf8_prefix_end(data, limit // 2)]
    head = head[: prefix_within_tokens(head, tokens // 2)]
    # A short stream's tail begins after the head.
    start = max(len(head), len(data) - (limit - limit // 2))
    # Begin on a character.
    while start < len(data) and (data[start] & 0xC0) == 0x80:
        start += 1
    tail = suffix_within_tokens(data[start:], tokens - tokens // 2)
    omitted = len(data) - len(head) - len(tail)
    head_text = head.decode("utf-8", "replace")
    tail_text = tail.decode("utf-8", "replace")
    return head_text + omission_marker(omitted, where) + tail_text, omitted


# ---------------------------------------------------------------------------
# 7. Argument validation
#
# The SDK does not validate tool arguments, so this does, against the JSON
# Schema the client sees. Every refusal names the argument; an unknown one
# gets the nearest accepted name, because `memory` for `memoryMb` is the
# usual mistake and the API's own message would not say which tool.
# ---------------------------------------------------------------------------

NAME_PATTERN = "^[A-Za-z0-9][A-Za-z0-9_-]{0,127}$"
# A state's name is a machine name that leaves room for
# STATE_MACHINE_PREFIX (11 characters) within the engine's 128.
STATE_NAME_PATTERN = "^[A-Za-z0-9][A-Za-z0-9_-]{0,116}$"
ABSOLUTE_PATH_PATTERN = "^/[^\\x00-\\x1f\\x7f]*$"
FILE_PATH_PATTERN = "^/.*[^/]$"
PATTERN_RULES = {
    FILE_PATH_PATTERN: (
        "must be the absolute path of a file "
        "(starting with /, not ending with /)"
    ),
    NAME_PATTERN: (
        "must start with a letter or digit and hold only letters, digits, "
        "'-' and '_' (at most 128)"
    ),
    ABSOLUTE_PATH_PATTERN: (
        "must be an absolute path "
        "(starting with /, without control characters)"
    ),
    STATE_NAME_PATTERN: (
        "must start with a letter or digit and hold only letters, digits, "
        "'-' and '_' (at most 117)"
    ),
    "^[A-Za-z_][A-Za-z0-9_]*$": (
        "must be a variable name: letters, digits and '_', "
        "not starting with a digit"
    ),
}
TYPE_WORDS = {
    "string": "a string",
    "integer": "a whole number",
    "boolean": "true or false",
    "array": "a list",
    "object": "an object",
}
# The built-in ceiling; schemas show maxExecTimeoutSecs (configured_schema).
MAX_TIMEOUT_SECS = 86400
MAX_MEMORY_MB = 1048576  # 1 TiB, the same ceiling as the memoryMb setting
MAX_DISK_GB = 4096  # storageGb and overlayGb
# 1 TiB; also keeps the exec fallback's shell arithmetic exact.
MAX_FILE_OFFSET = 1 << 40
# The largest output budget the settings allow.
MAX_READ_LENGTH = 64 * 1024 * 1024
GUEST_PATH_FORBIDDEN = re.compile(r"[\x00-\x1f\x7f]")
# Image transports that read from this host (file: URLs and
# containers-transports(5)).
HOST_TRANSPORTS = (
    "file:",
    "dir:",
    "oci:",
    "oci-archive:",
    "docker-archive:",
    "docker-daemon:",
)
# Which refusal is told when a value breaks several rules: the first in
# this order.
_KEYWORD_ORDER = tuple(
    "type enum minimum maximum minLength maxLength pattern minItems "
    "maxItems additionalProperties required oneOf".split()
)
# Names other tools use for an argument, too far from ours for difflib to
# find.
ARGUMENT_SLIPS = {
    "machine": "name",
    "vm": "name",
    "cwd": "workdir",
    "dir": "workdir",
}


@functools.cache  # called for every pattern an argument is checked against
def python_pattern(pattern: str) -> str:
    """A schema pattern for Python: a final `$` (Python: also before a
    newline) becomes `\\Z`."""
    # Only a `$` not escaped.
    return re.sub(r"(?<!\\)\$\Z", r"\\Z", pattern)


def guest_path(path: str, where: str = "path") -> str:
    """An absolute guest path in plain POSIX form; one that climbs above
    `/` or holds a control character is refused: on an HTTP route it could
    name another route rather than a file."""
    if not path.startswith("/"):
        raise ArgumentError(
            f'"{where}" must be an absolute path inside the machine '
            f"(starting with /); got {json.dumps(path)[:60]}"
        )
    if GUEST_PATH_FORBIDDEN.search(path):
        raise ArgumentError(
            f'"{where}" holds a control character (such as a newline or '
            "NUL), which no file name should; pass the path without it"
        )
    # Lexical; the host is POSIX too.
    plain = os.path.normpath(path.lstrip("/"))
    if plain == ".." or plain.startswith("../"):
        raise ArgumentError(
            f'"{where}" climbs above / with ".."; pass the plain absolute '
            f"path of the file, got {json.dumps(path)[:60]}"
        )
    if plain == ".":
        return "/"
    return "/" + plain


def reserved_machine(
    name: str,
    pools: Iterable[WarmPool],
    owned: Callable[[str], bool],
    parent: str | None = None,
) -> str | None:
    """Why no tool may take the machine ``name``, or None: a smol- machine
    is this server's own, and a warm pool's worker (named after the pool,
    or, where the record is at hand, a branch of its source: ``parent``)
    is the engine's until it is leased through this server (``owned``: it
    has an owner on record)."""
    if name.startswith(SERVER_MACHINE_PREFIX):
        return (
            f"'{name}' is a name this server keeps for its own machines "
            f"(every name starting with {SERVER_MACHINE_PREFIX}: warm "
            "pools' sources, saved states), so no tool takes it; name a "
            "machine otherwise, or use one list-machines shows"
        )
    for pool in pools:
        worker = name.startswith(f"pool-{pool.name}-")
        worker = worker or parent == pool_source(pool.name)
        if worker and not owned(name):
            return (
                f"'{name}' is a worker the engine keeps ready for the warm "
                f"pool '{pool.name}', leased to nobody, so no tool takes "
                f'it; create-machine with pool: "{pool.name}" leases one'
            )
    return None


def guest_route_suffix(path: str) -> str:
    """``path`` as a files-route suffix: normalised, each segment
    percent-encoded, no leading /."""
    return "/".join(
        urllib.parse.quote(part, safe="")
        for part in guest_path(path).split("/")[1:]
    )


def contained_host_path(
    config: Config, source: str, where: str, want_write: bool
) -> str:
    """The resolved host path (what the engine is given) if under a mount
    root allowing what is asked, else ArgumentError. Resolved first, so a
    link inside a root cannot lead out of it."""
    roots = parse_mount_roots(config.mount_roots)
    if not roots:
        raise ArgumentError(
            f'"{where}" names a host path ({source!r}), and this server '
            "exposes no host directory: the operator can allow some with "
            "the mountRoots setting (SMOL_MCP_MOUNT_ROOTS). Otherwise copy "
            "files in with write-file, or use a registry image"
        )
    plain = plain_host_path(source, where)
    resolved = os.path.realpath(os.path.expanduser(plain))
    for root, writable in roots:
        if not within(resolved, root):
            continue
        refuse_server_directory(config, resolved, where)
        if want_write and not writable:
            raise ArgumentError(
                f'"{where}" asks for write access under {root}, which '
                'mountRoots opens read-only; leave "readonly" out (or '
                'true), or have the operator add ":rw" to that root'
            )
        return resolved
    listed = ", ".join(
        root + (MOUNT_ROOT_WRITABLE if writable else "")
        for root, writable in roots
    )
    raise ArgumentError(
        f'"{where}" resolves to {resolved}, which is outside the host '
        f"directories this server exposes ({listed}; the mountRoots "
        "setting); pick a path under one of them"
    )


def plain_host_path(source: str, where: str) -> str:
    """``source`` without a file: prefix, not yet resolved; raise
    ArgumentError unless it is an absolute (or home) host path."""
    if GUEST_PATH_FORBIDDEN.search(source):
        raise ArgumentError(
            f'"{where}" holds a control character (such as a newline or '
            "NUL), which no host path should; pass the path without it"
        )
    plain = re.sub(r"(?i)^file:(//)?", "", source.strip())
    if plain.lower().startswith(HOST_TRANSPORTS):
        raise ArgumentError(
            f'"{where}" names the host-side transport {plain.split(":")[0]}: '
            f"({source!r}); give the plain host path (under mountRoots) "
            "or a registry image instead"
        )
    if not plain.startswith(("/", "~")):
        raise ArgumentError(
            f'"{where}" must be an absolute host path, got {source!r}'
        )
    return plain


def refuse_server_directory(config: Config, resolved: str, where: str) -> None:
    """Raise ArgumentError when ``resolved`` is, holds or lies in one of
    this server's own directories."""
    for own in server_directories(config):
        if within(resolved, own) or within(own, resolved):
            raise ArgumentError(
                f'"{where}" resolves to {resolved}, which is or holds '
                f"{own}, a directory of this server itself (tokens, "
                "approvals, sockets): never mountable, whatever mountRoots "
                "says; pick another directory"
            )


def check_host_port(config: Config, port: int, where: str) -> None:
    """Raise ArgumentError unless exposePorts lets an agent name host
    port ``port``. A host port is the host's: one a host program expects
    later (a database, a dev server) would carry its traffic, and its
    secrets, into the guest."""
    allowed = parse_expose_ports(config.expose_ports)
    if any(port in ports for ports in allowed):
        return
    if allowed:
        listed = ", ".join(config.expose_ports)
        why = f"the operator allows only {listed} (exposePorts)"
    else:
        why = "the operator allows none (exposePorts is empty)"
    raise ArgumentError(
        f'"{where}" is {port}, a host port an agent may not choose: {why}. '
        "Leave it out and a free port is picked"
    )


def within(path: str, directory: str) -> bool:
    """True when ``path`` is ``directory`` or lies under it (both
    resolved)."""
    return path == directory or path.startswith(directory.rstrip("/") + "/")


def server_directories(config: Config) -> list[str]:
    """The state, runtime and config directories, resolved."""
    places = (
        config.state_dir,
        config.runtime_dir,
        str(config_file_path(dict(os.environ)).parent),
    )
    return [
        os.path.realpath(os.path.expanduser(place))
        for place in places
        if place
    ]


def contain_host_paths(
    config: Config, image: str, mounts: list[dict]
) -> tuple[str, list[dict]]:
    """Hold a host-path image and every mount to mountRoots (closed by
    default): the image, resolved if a host path, and the mounts resolved,
    readonly unless `readonly: false` was asked."""
    # A path (absolute, relative, home) or a host-side transport.
    plain = image.strip().lower()
    host_prefixes = ("/", "./", "../", "~", *HOST_TRANSPORTS)
    if plain.startswith(host_prefixes) or plain in (".", ".."):
        image = contained_host_path(config, image, "image", want_write=False)
    checked = []
    for index, mount in enumerate(mounts):
        want_write = mount.get("readonly") is False
        source = contained_host_path(
            config, mount["source"], f"mounts[{index}].source", want_write
        )
        target = guest_path(mount["target"], f"mounts[{index}].target")
        checked.append(
            {"source": source, "target": target, "readonly": not want_write}
        )
    return image, checked


def did_you_mean(
    word: str, choices: Iterable[str], cutoff: float = 0.6
) -> str:
    """' (did you mean "x"?)' naming the closest choice, or "" when none is
    close. difflib is imported here: only a refusal needs it, and
    every start would pay for it."""
    import difflib

    hint = difflib.get_close_matches(word, list(choices), n=1, cutoff=cutoff)
    return f' (did you mean "{hint[0]}"?)' if hint else ""


# Strict JSON (RFC 8259) at every door that reads a body, and in every
# argument: Python's json reads NaN, Infinity and -Infinity (and 1e999 as
# infinity), which strict readers of the activity log refuse, and a body
# nested past the recursion limit raises RecursionError.
JSON_MAX_DEPTH = 64
# A JSON string: the unrolled form, which never backtracks without bound.
JSON_STRING_RE = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"')
JSON_NOT_BRACKET_RE = re.compile(r"[^\[\]{}]+")
JSON_BRACKET_STEP = {"[": 1, "{": 1, "]": -1, "}": -1}


class JsonRefused(ValueError):
    """JSON that Python reads but RFC 8259 (or JSON_MAX_DEPTH) does not
    allow; ``str(err)`` is the sentence to answer with."""


def strict_json(data: bytes | str) -> Any:
    """Return the JSON value of ``data`` (bytes in any encoding JSON
    allows); raise JsonRefused for NaN, Infinity, a number too large to be
    finite or nesting deeper than JSON_MAX_DEPTH, and ValueError for
    what is not JSON."""
    text = data
    if isinstance(data, (bytes, bytearray)):
        encoding = json.detect_encoding(data)
        text = bytes(data).decode(encoding, "surrogatepass")
    if json_depth(text) > JSON_MAX_DEPTH:
        raise JsonRefused(
            f"the body nests arrays and objects more than {JSON_MAX_DEPTH} "
            "deep, which no request of this server needs; send a flatter "
            "body"
        )
    return strict_decoder().decode(text)


@functools.cache
def strict_decoder() -> json.JSONDecoder:
    """The decoder strict_json reads with, made once (json.loads makes one
    at each call given hooks)."""
    return json.JSONDecoder(
        parse_constant=refuse_json_constant, parse_float=finite_float
    )


def json_depth(text: str) -> int:
    """How deep the arrays and objects of JSON ``text`` nest (brackets
    inside strings do not count)."""
    if text.count("[") + text.count("{") <= JSON_MAX_DEPTH:
        return 0
    brackets = JSON_NOT_BRACKET_RE.sub("", JSON_STRING_RE.sub("", text))
    steps = map(JSON_BRACKET_STEP.__getitem__, brackets)
    return max(itertools.accumulate(steps), default=0)


def refuse_json_constant(name: str) -> Any:
    """json's parse_constant: raise JsonRefused for NaN, Infinity and
    -Infinity."""
    raise JsonRefused(
        f"the body holds {name}, which JSON (RFC 8259) does not allow; "
        "send finite numbers only"
    )


def finite_float(text: str) -> float:
    """json's parse_float: the number, or JsonRefused when it is too large
    to be finite (1e999)."""
    value = float(text)
    if math.isinf(value):
        raise JsonRefused(
            f"the body holds the number {text[:40]}, too large to be "
            "finite; send finite numbers only"
        )
    return value


def refuse_non_finite(arguments: dict) -> None:
    """Raise ArgumentError naming the first NaN or infinite number in
    ``arguments``: the SDK's reader of a message lets them through."""
    pending = [([key], value) for key, value in arguments.items()]
    # Breadth first, in argument order: the loop reaches what it appends.
    for path, value in pending:
        if isinstance(value, dict):
            pending.extend(([*path, k], v) for k, v in value.items())
        elif isinstance(value, list):
            pending.extend(([*path, i], v) for i, v in enumerate(value))
        elif isinstance(value, float) and not math.isfinite(value):
            where = _argument_where(path)
            if math.isnan(value):
                what = "NaN"
            else:
                what = "infinite (Infinity, or a number such as 1e999)"
            raise ArgumentError(
                f'"{where}" is {what}, which JSON (RFC 8259) does not allow '
                "and no tool takes; pass a finite number"
            )


def finite_json(value: Any) -> Any:
    """``value`` with each NaN or infinite number as the string that names
    it ("NaN", "Infinity", "-Infinity"), so json.dumps writes strict
    JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return json.dumps(value)
    if isinstance(value, dict):
        return {key: finite_json(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_json(item) for item in value]
    return value


@functools.cache
def argument_validator() -> Any:
    """Draft 2020-12 as ECMAScript reads it: 1.0 is no integer, and a final
    `$` ends the string."""
    import jsonschema  # installed with mcp

    def whole_number(checker: Any, value: Any) -> bool:
        # JSON true is not 1.
        return isinstance(value, int) and not isinstance(value, bool)

    def ecma_pattern(
        validator: Any, pattern: str, value: Any, schema: dict
    ) -> Iterator[Any]:
        if validator.is_type(value, "string") and not re.search(
            python_pattern(pattern), value
        ):
            yield jsonschema.ValidationError(
                f"{value!r} does not match {pattern!r}"
            )

    base = jsonschema.Draft202012Validator
    checker = base.TYPE_CHECKER.redefine("integer", whole_number)
    return jsonschema.validators.extend(
        base, {"pattern": ecma_pattern}, type_checker=checker
    )


# What quick_check reads of a schema: every other keyword leaves the
# schema to jsonschema alone. The annotations check nothing.
QUICK_ANNOTATIONS = frozenset(
    "description title default examples $comment deprecated".split()
)
QUICK_KEYWORDS = frozenset(
    "type enum minimum maximum minLength maxLength pattern properties "
    "required additionalProperties propertyNames items minItems maxItems "
    "oneOf".split()
)
# A JSON type's Python test, as argument_validator reads them: a bool is
# no number, and 1.0 is no integer.
QUICK_TYPES = {
    "string": lambda value: isinstance(value, str),
    "integer": lambda value: (
        isinstance(value, int) and not isinstance(value, bool)
    ),
    "number": lambda value: (
        isinstance(value, (int, float)) and not isinstance(value, bool)
    ),
    "boolean": lambda value: isinstance(value, bool),
    "object": lambda value: isinstance(value, dict),
    "array": lambda value: isinstance(value, list),
    "null": lambda value: value is None,
}


def quick_check(schema: Any) -> Callable[[Any], bool] | None:
    """A test of a value against ``schema`` that says what
    argument_validator says, in microseconds rather than tens of them;
    None when the schema uses a keyword it does not read (QUICK_KEYWORDS),
    so that only jsonschema decides. A value it refuses still goes to
    jsonschema, which words the refusal."""
    if schema is True or schema == {}:
        return lambda value: True
    if not isinstance(schema, dict):
        return None
    if not set(schema) <= QUICK_KEYWORDS | QUICK_ANNOTATIONS:
        return None
    tests = []
    for keyword in QUICK_KEYWORDS & set(schema):
        test = quick_keyword(keyword, schema[keyword], schema)
        if test is None:
            return None
        tests.append(test)
    return lambda value: all(test(value) for test in tests)


def quick_keyword(keyword: str, rule: Any, schema: dict) -> Any:
    """The test of one keyword of a schema, or None when quick_check
    cannot read its rule. Each applies to the type it names only, as in
    JSON Schema: a minimum says nothing of a string."""
    is_number = QUICK_TYPES["number"]
    if keyword == "type":
        return quick_type(rule)
    if keyword == "enum":
        # Strings only: jsonschema compares them with ==.
        if not all(isinstance(each, str) for each in rule):
            return None
        members = frozenset(rule)
        return lambda value: isinstance(value, str) and value in members
    if keyword in ("minimum", "maximum"):
        if not is_number(rule):
            return None
        if keyword == "minimum":
            return lambda value: not is_number(value) or value >= rule
        return lambda value: not is_number(value) or value <= rule
    if keyword in ("minLength", "maxLength", "minItems", "maxItems"):
        return quick_size(keyword, rule)
    if keyword == "pattern":
        search = re.compile(python_pattern(rule)).search
        return lambda value: not isinstance(value, str) or bool(search(value))
    if keyword in ("properties", "additionalProperties", "propertyNames"):
        return quick_object(keyword, rule, schema)
    if keyword == "required":
        names = tuple(rule)
        return lambda value: (
            not isinstance(value, dict) or all(name in value for name in names)
        )
    if keyword == "items":
        each = quick_check(rule)
        if each is None:
            return None
        return lambda value: (
            not isinstance(value, list) or all(map(each, value))
        )
    return quick_one_of(rule)


def quick_type(rule: Any) -> Any:
    """The test of a type keyword (a name, or a list of them)."""
    names = [rule] if isinstance(rule, str) else rule
    if not all(name in QUICK_TYPES for name in names):
        return None
    tests = [QUICK_TYPES[name] for name in names]
    return lambda value: any(test(value) for test in tests)


def quick_size(keyword: str, rule: Any) -> Any:
    """The test of minLength, maxLength (a string's characters), minItems
    or maxItems (a list's items)."""
    if not QUICK_TYPES["integer"](rule):
        return None
    kind = str
    if keyword.endswith("Items"):
        kind = list
    if keyword.startswith("min"):
        return lambda value: not isinstance(value, kind) or len(value) >= rule
    return lambda value: not isinstance(value, kind) or len(value) <= rule


def quick_object(keyword: str, rule: Any, schema: dict) -> Any:
    """The test of properties, additionalProperties (the keys properties
    does not name) or propertyNames."""
    if keyword == "properties":
        tests = {name: quick_check(sub) for name, sub in rule.items()}
        if None in tests.values():
            return None
        return lambda value: (
            not isinstance(value, dict)
            or all(
                tests[name](item)
                for name, item in value.items()
                if name in tests
            )
        )
    if keyword == "propertyNames":
        test = quick_check(rule)
        if test is None:
            return None
        return lambda value: (
            not isinstance(value, dict) or all(map(test, value))
        )
    known = frozenset(schema.get("properties", {}))
    test = quick_check(rule)
    if rule is False:
        test = lambda item: False  # noqa: E731
    if test is None:
        return None
    return lambda value: (
        not isinstance(value, dict)
        or all(test(item) for name, item in value.items() if name not in known)
    )


def quick_one_of(rule: Any) -> Any:
    """The test of oneOf: exactly one of its schemas holds."""
    tests = [quick_check(sub) for sub in rule]
    if None in tests:
        return None
    return lambda value: sum(test(value) for test in tests) == 1


def validate_arguments(
    tool: str, schema: dict, arguments: dict, checker: Any = None
) -> dict:
    """ArgumentError on the first flaw of ``arguments`` against ``schema``
    (or ``checker``)."""
    if not isinstance(arguments, dict):
        raise ArgumentError(f"{tool} takes an object of named arguments")
    refuse_non_finite(arguments)
    validator = checker or argument_validator()(schema)
    errors = list(validator.iter_errors(arguments))
    if errors:
        raise ArgumentError(
            _refusal(_first_error(errors, arguments), tool, arguments)
        )
    return arguments


def _error_path(error: Any) -> list:
    """Where an error's value lies; a property name's error is reported at
    its object."""
    path = list(error.absolute_path)
    if "propertyNames" in error.absolute_schema_path:
        return [*path, error.instance]
    return path


def _first_error(errors: list, arguments: dict) -> Any:
    """The error told: by argument order, a parent's rule before its
    items', then _KEYWORD_ORDER."""

    def order(error: Any) -> tuple:
        positions = []
        node = arguments
        for step in _error_path(error):
            if isinstance(node, dict):
                positions.append(list(node).index(step))
                node = node.get(step)
            else:
                positions.append(step)
                node = node[step]
        # A name's error before its value's.
        if "propertyNames" in error.absolute_schema_path:
            return tuple(positions), -1
        return tuple(positions), _KEYWORD_ORDER.index(error.validator)

    return min(errors, key=order)


def _refusal(error: Any, tool: str, arguments: dict) -> str:
    """One jsonschema error as the sentence the user is shown."""
    path = _error_path(error)
    where = _argument_where(path)
    rule = error.validator
    if rule == "additionalProperties":
        return _unknown_key_refusal(error, tool, path, where)
    if rule == "required":
        return _missing_key_refusal(error, tool, path, where)
    if rule == "oneOf":
        return _one_of_refusal(error, tool, arguments, where)
    return _value_refusal(error, path, where)


def _argument_where(path: list) -> str:
    """``path`` as a refusal names it: ``mounts[0].source``."""
    steps = []
    for step in path:
        if isinstance(step, int):
            steps.append(f"[{step}]")
        else:
            steps.append(f".{step}")
    return "".join(steps).removeprefix(".")


def _unknown_key_refusal(error: Any, tool: str, path: list, where: str) -> str:
    """The refusal of a key the schema has no property for, with the
    nearest accepted name when one is near."""
    accepted = error.schema.get("properties", {})
    key = next(key for key in error.instance if key not in accepted)
    # Another tool's name for the argument first, if ours is accepted here.
    slip = ARGUMENT_SLIPS.get(key.lower(), "")
    maybe = did_you_mean(slip, accepted, cutoff=1) or did_you_mean(
        key, accepted, cutoff=0.5
    )
    names = ", ".join(accepted)
    if not path:
        return (
            f'{tool} has no argument "{key}"{maybe}; '
            f"it accepts: {names or 'none'}"
        )
    return f'"{where}" has no field "{key}"{maybe}; it accepts: {names}'


def _missing_key_refusal(error: Any, tool: str, path: list, where: str) -> str:
    """The refusal of a missing required key; a tool's argument is told
    with its description."""
    schema = error.schema
    key = next(key for key in schema["required"] if key not in error.instance)
    if path:
        return f'"{where}" needs the field "{key}"'
    description = schema["properties"][key].get("description", "")
    sentence = f'{tool} needs the argument "{key}": {description}'
    return sentence.rstrip(": ")


def _one_of_refusal(error: Any, tool: str, arguments: dict, where: str) -> str:
    """The refusal of a value matching none of its forms: the flaw of the
    form of its kind, else the kinds it may be."""
    value = error.instance
    options = error.schema["oneOf"]
    for index, option in enumerate(options):
        if argument_validator()(option).is_type(value, option["type"]):
            # The right kind of value, wrong in its details: say which.
            inner = [
                e for e in error.context if e.relative_schema_path[0] == index
            ]
            return _refusal(_first_error(inner, arguments), tool, arguments)
    kinds = " or ".join(TYPE_WORDS[option["type"]] for option in options)
    # No oneOf argument is secret, so the value is shown.
    return f'"{where}" must be {kinds}, got {json.dumps(value)[:60]}'


def _value_refusal(error: Any, path: list, where: str) -> str:
    """The refusal of a value by its type, choices, bounds or pattern; a
    secret argument's value is not repeated."""
    value = error.instance
    rule = error.validator
    schema = error.schema
    limit = error.validator_value
    if bool(path) and path[0] in (*REDACTED_ARGUMENTS, *REDACTED_MAPS):
        got = "a value not repeated here"
    else:
        got = json.dumps(value)[:60]
    if rule == "type":
        kind = TYPE_WORDS.get(limit, limit)
        choices = ""
        if "enum" in schema:
            choices = f" ({' or '.join(map(json.dumps, schema['enum']))})"
        return f'"{where}" must be {kind}{choices}, got {got}'
    if rule == "enum":
        listed = ", ".join(json.dumps(v) for v in limit)
        return f'"{where}" must be one of {listed}; got {got}'
    if rule == "maxItems":
        return f'"{where}" may hold at most {limit} items, got {len(value)}'
    if rule == "pattern":
        rule_words = PATTERN_RULES.get(limit, f"must match {limit}")
        return f'"{where}" {rule_words}; got {got}'
    return {
        "minimum": f'"{where}" must be at least {limit}, got {value}',
        "maximum": f'"{where}" must be at most {limit}, got {value}',
        "minLength": f'"{where}" must not be empty',
        "maxLength": f'"{where}" must be at most {limit} characters long',
        "minItems": f'"{where}" must hold at least {limit} item(s)',
    }[rule]


# ---------------------------------------------------------------------------
# 8. Tools
#
# The tools: those of the TypeScript smol-mcp with its names, arguments and
# result shapes, then jobs and allow-egress. Each handler sits under its
# @tool spec and gets a Call (its fleet and session, worker threads for the
# blocking API, progress) and the validated arguments; it returns the
# structured result. A SmolError becomes a tool error; anything else is
# logged, no stack trace.
# ---------------------------------------------------------------------------

# How long a cleanup's delete may take, and the pause before it is retried.
CLEANUP_TIMEOUT_SECS = 20
DELETE_RETRY_PAUSE_SECS = 1
# How often a waiting call says so in a progress notification.
PROGRESS_INTERVAL_SECS = 5
# Blocking calls of one session that run at once; more wait their turn.
SESSION_CALL_SLOTS = 8
# The cloud reports "started" once the VM process launched.
RUNNING_STATES = ("running", "started")
# The console lines a failed boot quotes.
BOOT_LOG_LINES = 20
# The run of last lines a log cursor's digest covers.
CURSOR_LINES = 3
JOB_DEFAULT_TIMEOUT_SECS = 3600
# A job holds its machine: a day at most.
JOB_MAX_TIMEOUT_SECS = 24 * 3600
# The named shells one machine keeps (run-command's `shell`).
SHELLS_PER_MACHINE = 16
# The denials read after a failed command.
EGRESS_EVENTS_LIMIT = 1000
# The denials get-machine reads.
EGRESS_RECENT = 50
HOST_UNREACHABLE_RE = re.compile(
    "dns error|error sending request|Connect|connection refused"
    "|timed out|certificate"
)
BOOT_FAILURE_RE = re.compile(
    "did not become ready|before the agent was ready|KvmOpen"
)
# The local engine's refusal of an image reference it cannot parse, or of
# the registry address in it, at the first start (1.32.2).
BAD_IMAGE_RE = re.compile(
    "bad reference: |builder error: invalid "
    "(port number|IPv6 address|international domain name)"
)
BAD_IMAGE_HINT = (
    "The engine could not read that image reference. One reads "
    "[registry/][namespace/]name[:tag][@sha256:<64 hex digits>], such as "
    "alpine, python:3.12-alpine or ghcr.io/owner/name:1.0: letters, "
    "digits, '.', '_' and '-' in each part, no spaces, and a registry "
    "(with a dot or a port) first when there are three parts or more. "
)
BAD_IMAGE_TRY = (
    "pull-image {name, image} tries another reference on a local machine "
    "you have without making a new one. "
)
PRIVATE_REGISTRY = (
    "An image in a private registry also needs credentials the engine "
    "has: the operator adds them on its host (smolvm config registries "
    "edit)"
)


def _string(description: str, **extra: Any) -> dict:
    return {"type": "string", "description": description, **extra}


def _integer(description: str, minimum: int = 1, **extra: Any) -> dict:
    return {
        "type": "integer",
        "description": description,
        "minimum": minimum,
        **extra,
    }


def _boolean(description: str) -> dict:
    return {"type": "boolean", "description": description}


def _object(properties: dict, required: tuple[str, ...] = ()) -> dict:
    closed = {"required": list(required), "additionalProperties": False}
    return {"type": "object", "properties": properties, **closed}


def _input(required: str, **properties: dict) -> dict:
    """A tool's arguments: ``properties`` in the order given, the
    ``required`` names required."""
    return _object(properties, tuple(required.split()))


def _types(fields: str) -> dict:
    """Schema properties from "name:type" words: type? may also be
    null, type[] is an array."""
    properties: dict[str, dict] = {}
    for field_ in fields.split():
        name, kind = field_.split(":")
        if kind.endswith("[]"):
            properties[name] = {"type": "array", "items": {"type": kind[:-2]}}
        elif kind.endswith("?"):
            properties[name] = {"type": [kind[:-1], "null"]}
        else:
            properties[name] = {"type": kind}
    return properties


def _out(
    properties: dict | str, optional: dict | None = None, description: str = ""
) -> dict:
    """A result schema: ``properties`` (or _types words) always present,
    ``optional`` sometimes."""
    if isinstance(properties, str):
        properties = _types(properties)
    head = {"type": "object"}
    if description:
        head["description"] = description
    return {
        **head,
        "properties": {**properties, **(optional or {})},
        "required": list(properties),
    }


def _list(**parts: Any) -> dict:
    """An array of at most 32 items; ``parts`` (items, description) in
    the order given."""
    return {"type": "array", "maxItems": 32, **parts}


ARG_NAME = _string(
    "The machine's name (list-machines shows them).",
    minLength=1,
    pattern=NAME_PATTERN,
)
ARG_IMAGE = _string(
    "An OCI image reference, such as alpine or python:3.12-alpine.",
    minLength=1,
)
ARG_CPUS = _integer("Virtual CPUs (default from SMOL_MCP_CPUS).", maximum=255)
ARG_MEMORY = _integer(
    "Memory in MiB (default from SMOL_MCP_MEMORY_MB).",
    minimum=128,
    maximum=MAX_MEMORY_MB,
)
ARG_NETWORK = _string(
    'Egress: "blocked" (the default) or "open". A registry image does '
    "not need it: the local engine fetches images on the host. On the "
    "local fleet, open egress (and an allow list) never reaches the host, "
    "its network or cloud metadata.",
    enum=["open", "blocked"],
)
ARG_ALLOW_HOSTS = _list(
    items=_string("A host name.", minLength=1, maxLength=255),
    description=(
        "Allow egress only to these host names (and their subdomains)."
    ),
)
ARG_ALLOW_CIDRS = _list(
    items=_string(
        "A CIDR such as 198.51.100.0/24.", minLength=1, maxLength=64
    ),
    description="Allow egress only to these address ranges.",
)
ARG_ENV = {
    "type": "object",
    "description": "Environment variables, as a map of name to value.",
    "propertyNames": {
        "type": "string",
        "pattern": "^[A-Za-z_][A-Za-z0-9_]*$",
    },
    "additionalProperties": {"type": "string"},
}
ARG_COMMAND = {
    "description": (
        "The command: a list of arguments run as is, or a string run "
        "with sh -c."
    ),
    "oneOf": [
        {"type": "string", "minLength": 1},
        {"type": "array", "minItems": 1, "items": {"type": "string"}},
    ],
}
ARG_TIMEOUT = _integer(
    "Seconds before the command is killed (default "
    "SMOL_MCP_EXEC_TIMEOUT_SECS, at most SMOL_MCP_MAX_EXEC_TIMEOUT_SECS).",
    maximum=MAX_TIMEOUT_SECS,
)
ARG_WORKDIR = _string(
    "Working directory inside the machine (an absolute path).",
    pattern=ABSOLUTE_PATH_PATTERN,
)
ARG_STDIN = _string("Text piped to the command's standard input.")
ARG_PATH = _string(
    "An absolute path of a file inside the machine.", pattern=FILE_PATH_PATTERN
)
ARG_ENCODING = _string(
    "utf8 (the default) for text, base64 for bytes.", enum=["utf8", "base64"]
)
ARG_JOB_ID = _string(
    "The job's id, as start-job returned it (get-machine lists a "
    "machine's jobs).",
    pattern=JOB_ID_PATTERN,
)
ARG_JOB_OFFSET = {
    **_input(
        "",
        stdout=_integer(
            "Bytes of stdout already read.", minimum=0, maximum=MAX_FILE_OFFSET
        ),
        stderr=_integer(
            "Bytes of stderr already read.", minimum=0, maximum=MAX_FILE_OFFSET
        ),
    ),
    "description": (
        "Where to continue: the nextOffset of the previous read-job."
    ),
}
ARG_WAIT = _boolean(
    "Wait until a command has run in the guest before answering "
    "(default true)."
)
ARG_SHELL = _string(
    "A named shell of the machine to run in: the working directory and "
    "exported variables this command ends with are where the next command "
    "in the same shell starts (cd and export persist). Omit it and every "
    f"command starts fresh. At most {SHELLS_PER_MACHINE} shells a machine.",
    minLength=1,
    pattern=NAME_PATTERN,
)
# run-command's and run-once's
ARG_EXEC = dict(
    command=ARG_COMMAND,
    timeoutSecs=ARG_TIMEOUT,
    workdir=ARG_WORKDIR,
    env=ARG_ENV,
    stdin=ARG_STDIN,
)

OUT_MACHINE = _out(
    "id:string name:string state:string? image:string? cpus:integer? "
    "memoryMb:integer? network:string? ports:array createdAt:string? "
    "pid:integer? url:string? branchable:boolean parent:string?",
    description="A machine, with the same keys on every fleet.",
)
# allow-egress's, after the name
EGRESS_ARGS = dict(
    hosts=_list(
        description=(
            "Host names to allow, such as pypi.org; each covers its "
            "subdomains too."
        ),
        items=_string("A host name.", minLength=1, maxLength=253),
    ),
    hostPatterns=_list(
        description=(
            "Patterns to allow: an exact host name, or *.domain for its "
            "subdomains only."
        ),
        items=_string("A host name or *.domain.", minLength=1, maxLength=255),
    ),
    cidrs=_list(
        description=(
            "Address ranges to allow, such as 203.0.113.7/32 (/8 or "
            "narrower; IPv6 /32 or narrower); never loopback, link-local "
            "or private ranges."
        ),
        items=_string("An address range.", minLength=1, maxLength=64),
    ),
    remove={
        **_input(
            "",
            hosts=_list(
                items=_string("A listed entry.", minLength=1, maxLength=255),
                description=(
                    "Host names or patterns to take off, as get-machine "
                    "lists them."
                ),
            ),
            cidrs=_list(
                items=_string("A listed range.", minLength=1, maxLength=64),
                description=(
                    "Address ranges to take off, as get-machine lists them."
                ),
            ),
        ),
        "description": (
            "Entries to take off the allow list; at least one entry must "
            "remain."
        ),
    },
)
EGRESS_POLICY = _types("open:boolean hosts:string[] cidrs:string[]")
OUT_EGRESS = _out(
    EGRESS_POLICY, description="A local machine's egress policy."
)
DENIAL = _types(
    "dest:string operation:string count:integer firstAt:string? lastAt:string?"
)
OUT_DENIALS = {
    "type": "array",
    "description": "Refused connections grouped by destination (local fleet).",
    "items": {"type": "object", "properties": DENIAL},
}
OUT_JOB_STATE = _types("jobId:string state:string exitCode:integer?")
OUT_JOBS = {
    "type": ["array", "null"],
    "items": {"type": "object", "properties": OUT_JOB_STATE},
}
# read-job's, after the state and the streams
OUT_JOB_PAGE = {
    "nextOffset": {
        "type": "object",
        "properties": _types("stdout:integer stderr:integer"),
    },
    **_types("eof:boolean"),
}
OUT_EXEC_PROPERTIES = _types(
    "stdout:string stderr:string exitCode:integer truncated:boolean "
    "timedOut:boolean overflow:string[] startedMachine:boolean"
)
OUT_EXEC_EGRESS = {
    "egressDenied": OUT_DENIALS,
    "egressHint": {"type": "string"},
}
# Whether the call resumed a paused machine before it used it.
OUT_RESUMED = _types("resumedMachine:boolean")


# A tool is one object: compared and hashed by identity.
@dataclass(eq=False)
class ToolSpec:
    """One tool: its handler (tool_list_machines answers list-machines)
    and what the client is shown; ``access``: its scope level, then its
    true annotations ("exec: destructive"). ``fleets`` names the only
    fleets that serve it (empty: every fleet), and ``refusal`` says to
    a call on another fleet why not and what to do instead."""

    handler: Callable
    title: str
    description: str
    input_schema: dict
    output_schema: dict
    access: str
    fleets: tuple[str, ...] = ()
    refusal: str = ""
    name: str = field(init=False)
    level: str = field(init=False)

    def __post_init__(self) -> None:
        handler_name = self.handler.__name__
        self.name = handler_name.removeprefix("tool_").replace("_", "-")
        self._check_fleets()
        self.level, _, hints = self.access.partition(":")
        known = ("read_only", "destructive", "idempotent", "open_world")
        # A misspelt hint would read as false.
        unknown = set(hints.split()) - set(known)
        if unknown:
            raise ValueError(
                f"{self.name}: unknown annotations {sorted(unknown)} in "
                f"{self.access!r}"
            )
        for hint in known:
            setattr(self, hint, hint in hints.split())

    def _check_fleets(self) -> None:
        """Raise ValueError when ``fleets`` names no registered fleet, or
        comes without the ``refusal`` another fleet answers with."""
        unknown = set(self.fleets) - set(FLEETS)
        if unknown:
            raise ValueError(
                f"{self.name}: fleets {sorted(unknown)} are not registered"
            )
        if self.fleets and not self.refusal:
            raise ValueError(f"{self.name}: fleets without a refusal")

    def serves(self, fleet: str) -> bool:
        """Whether the fleet named ``fleet`` serves this tool."""
        return not self.fleets or fleet in self.fleets

    def refuse_on(self, fleet: str) -> None:
        """Raise ArgumentError, before anything is asked of an engine or a
        person, when the fleet named ``fleet`` does not serve this tool."""
        if self.serves(fleet):
            return
        only = spoken(self.fleets)
        raise ArgumentError(
            f"{self.name} is {only} only, so the {fleet} fleet refuses it: "
            f"{self.refusal}"
        )


class Call:
    """One tool call: its fleet and session, worker threads for the
    blocking API, progress."""

    def __init__(
        self,
        app: SmolMcp,
        session: Session,
        fleet: Fleet,
        ctx: Any,
        principal=None,
        params=None,
    ):
        self.app = app
        self.session = session
        self.fleet = fleet
        self.ctx = ctx
        self.principal = principal or app.access.stdio
        self.params = params
        self.config = app.config
        self.started = time.monotonic()
        self._last_progress = -1.0

    async def api(
        self,
        function: Callable,
        *args: Any,
        waiting: str | None = None,
        **kwargs: Any,
    ) -> Any:
        """Run one blocking API call in a worker thread, with progress as
        with_heartbeat says; a cancelled call stops waiting at once (the
        thread finishes on its own)."""
        work = functools.partial(function, *args, **kwargs)
        run = functools.partial(
            anyio.to_thread.run_sync,
            work,
            abandon_on_cancel=True,
            limiter=self.session.call_slots(),
        )
        return await self.with_heartbeat(run, waiting)

    async def read(self, function: Callable, *args: Any) -> Any:
        """A quick read (list-machines, get-machine): made on the event
        loop where the fleet's class can (LocalFleet.read_now), within the
        session's share and with a beat if slow; else as api. A wrapped
        fleet (OwnedFleet) has none of its own: its guards run the
        blocking way."""
        if (now := getattr(type(self.fleet), "read_now", None)) is not None:
            async with self.session.call_slots():
                read = functools.partial(now, self.fleet, function, *args)
                answer = await self.with_heartbeat(read, None)
            if answer is not None:
                return answer
        return await self.api(function, *args)

    async def with_heartbeat(self, run: Callable, waiting: str | None) -> Any:
        """Await ``run()`` while progress says what it waits on: with
        ``waiting``, at once and every few seconds; without, only once it
        takes that long (an API asking us to retry, say); with "", never
        (the caller reports). Until a beat is due, a timer: a quick call,
        no task."""
        if waiting == "":
            return await run()
        first_beat = 0 if waiting else PROGRESS_INTERVAL_SECS
        waiting = waiting or f"waiting for the {self.fleet.name} API"
        loop = asyncio.get_running_loop()
        beats = []

        async def heartbeat() -> None:
            while True:
                await self.so_far(waiting)
                await asyncio.sleep(PROGRESS_INTERVAL_SECS)

        def start_beating() -> None:
            beats.append(loop.create_task(heartbeat()))

        timer = loop.call_later(first_beat, start_beating)
        try:
            return await run()
        finally:
            timer.cancel()
            for beat in beats:
                beat.cancel()

    async def so_far(self, waiting: str) -> None:
        elapsed = int(time.monotonic() - self.started)
        await self.progress(None, f"{waiting}: {elapsed} s so far")

    async def create(
        self, function: Callable, *args: Any, waiting: str
    ) -> Any:
        """Run a call that creates a machine to its end, even if the tool
        call is cancelled: abandoned, it could create a machine after the
        cleanup ran, and nobody would delete it."""
        # Waiting for a slot may be cancelled (nothing exists yet); the
        # create itself may not.
        async with self.session.call_slots():
            # The slot above is the real bound.
            limiter = anyio.CapacityLimiter(1)
            work = functools.partial(function, *args)
            run = functools.partial(
                anyio.to_thread.run_sync, work, limiter=limiter
            )
            with anyio.CancelScope(shield=True):
                return await self.with_heartbeat(run, waiting)

    def progress_token(self) -> Any:
        """The client's progress token, or None when it asked for no
        progress."""
        if self.ctx is None:
            return None
        return (self.ctx.meta or {}).get("progress_token")

    async def progress(self, total: float | None, message: str) -> None:
        """A progress notification (a no-op unless the client asked for
        them). The value is the call's elapsed seconds, so it only ever
        increases."""
        if self.ctx is None:
            return
        done = max(
            round(time.monotonic() - self.started, 3),
            self._last_progress + 0.001,
        )
        self._last_progress = done
        try:
            token = self.progress_token()
            over_http = self.ctx.request is not None and token is not None
            if over_http and not modern(self.ctx):
                # A handshake-era plain-JSON reply carries no
                # notifications: these ride the session's GET stream. (A
                # 2026-era one's ride its own answer's event stream.)
                await self.ctx.session.send_progress_notification(
                    token, done, total, message
                )
            else:
                await self.ctx.session.report_progress(done, total, message)
        except Exception:
            # Progress is a courtesy; a client that went away must not
            # fail the call.
            log.debug("progress notification not sent", exc_info=True)

    def new_ephemeral_name(self) -> str:
        return f"{self.config.machine_prefix}{secrets_module.token_hex(4)}"

    def forget(self, name: str) -> None:
        """A machine this call deleted: out of the session's record and
        the ownership store."""
        self.session.forget(self.fleet.name, name)
        self.app.access.owners.clear(self.fleet.name, [name])
        self.app.failed_last.discard((self.fleet.name, name))

    async def delete_quietly(self, name: str) -> None:
        """Delete a machine this call created, even while the call is
        cancelled, and forget it; a failure is logged, not raised over the
        error that got us here (cleanup tries again)."""
        delete = functools.partial(self.fleet.delete_machine, name)
        with anyio.CancelScope(shield=True):
            try:
                with anyio.fail_after(CLEANUP_TIMEOUT_SECS):
                    await anyio.to_thread.run_sync(
                        delete, abandon_on_cancel=True
                    )
                self.forget(name)
            except Exception as err:
                if isinstance(err, ApiError) and err.status == 404:
                    self.forget(name)
                else:
                    log.warning("could not delete machine %s: %s", name, err)


def egress_entries(
    args: dict, key: str, config: Config, pattern: bool | None = None
) -> list[str]:
    """The entries of ``args[key]`` held to allow-egress's rules: host
    names (with ``pattern``, *.domain too), or without ``pattern``,
    address ranges."""
    entries = enumerate(args.get(key) or [])
    if pattern is None:
        return [
            egress_cidr(value, f"{key}[{i}]", config) for i, value in entries
        ]
    return [
        egress_host(value, f"{key}[{i}]", pattern, config)
        for i, value in entries
    ]


def exec_options(args: dict, timeout: int) -> dict:
    """A command's options, as a fleet's exec, exec_stream and start_job
    take them; ``timeout`` unless the arguments name one (the schema held
    it to the ceiling)."""
    given = {
        key: args[key] for key in ("workdir", "env", "stdin") if key in args
    }
    return {"timeout_secs": args.get("timeoutSecs", timeout), **given}


def command_argv(command: str | list[str]) -> list[str]:
    """The argv of a command: a string runs with sh -c, a list as is."""
    if isinstance(command, str):
        return ["sh", "-c", command]
    return list(command)


def is_boot_failure(err: BaseException) -> bool:
    return (
        isinstance(err, ApiError)
        and BOOT_FAILURE_RE.search(err.api_message) is not None
    )


def explain_start_failure(
    err: Exception, network: str | None, log_lines: list[str] | None = None
) -> Exception:
    """Add the one sentence that says what to do about a failed start;
    ``log_lines``: the last console lines of a machine deleted since (so
    pointing at machine-logs would lead nowhere)."""
    if not isinstance(err, ApiError):
        return err
    text = err.api_message
    if BAD_IMAGE_RE.search(text):
        return err.with_hint(BAD_IMAGE_HINT + BAD_IMAGE_TRY + PRIVATE_REGISTRY)
    if network != "open" and "must be pulled" in text:
        # An older engine (1.14 line) refuses a registry image without
        # guest egress.
        return err.with_hint(
            "This engine pulls a registry image through the machine's own "
            'network, which is blocked; pass network: "open" to '
            "create-machine (or run-once) to allow the pull"
        )
    registry = "manifests" in text or "registry" in text
    if registry and HOST_UNREACHABLE_RE.search(text):
        # 1.32.2 fetches the image on the host: the guest's egress plays
        # no part.
        return err.with_hint(
            "The host this server runs on could not reach the image "
            "registry (the engine fetches images on the host, not in the "
            "machine, so opening the machine's network would not help); "
            "the operator has to fix the host's DNS, proxy or network "
            "access, or give an image that is already on the host"
        )
    if is_boot_failure(err):
        return explain_boot_failure(err, log_lines)
    port_in_use = "port" in text and "in use" in text
    if "PORT_IN_USE" in err.code or port_in_use:
        return err.with_hint(
            "Another machine or process holds that host port; pick another "
            "in ports[].host"
        )
    return err


def explain_boot_failure(
    err: ApiError, log_lines: list[str] | None
) -> ApiError:
    """explain_start_failure's hint for a guest that did not boot: the
    console log's last ``log_lines`` when the machine is deleted, else
    where to look."""
    if log_lines is None:
        return err.with_hint(
            "The microVM could not boot on this host; the smol://targets "
            "resource says whether a usable hypervisor is present, and the "
            "machine's log (machine-logs) may say more"
        )
    if log_lines:
        tail = "\n".join(log_lines)
    else:
        tail = "(the console log was empty)"
    return err.with_hint(
        "The microVM could not boot on this host, and the machine is "
        "deleted. A usable /dev/kvm can still fail to boot a guest (in a VM "
        "without nested virtualization, say). The last lines of its "
        f"console log:\n{tail}"
    )


async def start_failure(
    call: Call, name: str, err: BaseException, network: str
) -> BaseException:
    """explain_start_failure for a machine about to be deleted: a boot
    failure quotes its log."""
    if not isinstance(err, Exception):
        return err
    if not is_boot_failure(err):
        return explain_start_failure(err, network)
    try:
        lines = await call.api(call.fleet.console_lines, name)
    except Exception as log_err:
        # The error being reported matters more than its log.
        log.debug("could not read the log of %s: %s", name, log_err)
        lines = []
    return explain_start_failure(err, network, lines[-BOOT_LOG_LINES:])


async def wait_until_ready(call: Call, name: str) -> None:
    """Return once a command has run in the guest (the probe never
    restarts a stopped machine)."""
    limit = call.config.ready_timeout_secs
    started = time.monotonic()
    delay = 0.1
    while True:
        elapsed = int(time.monotonic() - started)
        await call.progress(
            None,
            f"waiting for the guest of '{name}': {elapsed} s of {limit} s",
        )
        if (not_ready := await call.api(call.fleet.probe_ready, name)) is None:
            return
        if time.monotonic() - started >= limit:
            raise SmolError(
                f"the guest of machine '{name}' did not run a command within "
                f"{limit} s (readyTimeoutSecs); its last answer: {not_ready}"
            )
        await anyio.sleep(delay)
        delay = min(delay * 2, 2.0)


async def start_and_wait(
    call: Call,
    name: str,
    branchable: bool = False,
    mounts: list[dict] | None = None,
) -> dict:
    """Start ``name`` (Fleet.start_machine: ``mounts`` are the ones this
    call just created it with) and wait until a command runs in it; its
    record."""
    waiting = f"starting '{name}'"
    record = await call.api(
        call.fleet.start_machine, name, branchable, mounts, waiting=waiting
    )
    await wait_until_ready(call, name)
    return record


async def resume_and_wait(call: Call, name: str) -> tuple[dict, bool]:
    """Resume a paused machine and wait until a command runs in it: its
    record, and whether this call resumed it (it may run already)."""
    waiting = f"resuming '{name}'"
    record, resumed = await call.api(
        call.fleet.resume_machine, name, waiting=waiting
    )
    await wait_until_ready(call, name)
    return record, resumed


async def ready_or_woken(call: Call, name: str, action: str) -> str:
    """Return once a command has run in machine ``name``, first starting
    a stopped one or resuming a paused one: what this call did,
    "started", "resumed" or "". A running one costs one probe, which
    also tells a machine that does not run (a command never boots it);
    the refusal of a missing one names ``action``, what the probe is
    for."""
    try:
        await call.api(call.fleet.exec, name, READY_PROBE, timeout_secs=10)
    except NotRunning as err:
        return await wake(call, name, err)
    except ApiError as err:
        if err.status == 404:
            raise ApiError(
                err.fleet, action, err.status, err.code, err.api_message
            ) from None
        # Up, but its guest not yet.
        await wait_until_ready(call, name)
    return ""


async def on_running(call: Call, name: str, run: Callable) -> tuple[Any, str]:
    """Await ``run()`` against a running machine, first starting a stopped
    one (and leaving it running, as the cloud API does) or resuming a
    paused one; the second value says what this call did: "started",
    "resumed" or ""."""
    try:
        return await run(), ""
    except NotRunning as err:
        woke = await wake(call, name, err)
    return await run(), woke


async def wake(call: Call, name: str, err: NotRunning) -> str:
    """Make a machine ``run()`` found not running run: resume it when it
    is paused (the local engine says so only when asked to start it), else
    start it; "resumed" or "started"."""
    if not isinstance(err, Paused):
        try:
            await start_and_wait(call, name)
            return "started"
        except Paused:
            pass
    await resume_and_wait(call, name)
    return "resumed"


# Every command runs under a wrapper that writes its pid in the guest
# (RUN_PID_DIR/<runId>) and then becomes the command (exec "$@"), so a
# cancelled call, streamed or not, can end its process group with a second
# exec (RUN_KILL_SCRIPT). With a progress token it runs through the
# engine's exec stream route, under RUN_TEE_WRAPPER: SSE cannot carry a
# bare CR, a NUL or invalid UTF-8, so the stream only feeds progress, and
# the result is the guest's own copy of the output, read back whole
# (RUN_READ_BACK). Each script is one string, a literal a line of it (or
# two where a line is long).
RUN_PID_DIR = "/tmp/smol-mcp-run"
RUN_WRAPPER = (
    '{ mkdir -p "${1%/*}" && echo "$$" >"$1"; } 2>/dev/null; shift; exec "$@"'
)
RUN_TEE_WRAPPER = (
    "f=$1; shift\n"
    '{ mkdir -p "${f%/*}" && echo "$$" >"$f" && mkfifo "$f.o" "$f.e"; } '
    '2>/dev/null || exec "$@"\n'
    'tee "$f.out" <"$f.o" & tee "$f.err" <"$f.e" >&2 &\n'
    '(exec "$@") >"$f.o" 2>"$f.e"; c=$?; wait; exit $c\n'
)
RUN_READ_BACK = (
    '[ -e "$1.out" ] || exit 3; cat "$1.out"; cat "$1.err" >&2; '
    'rm -f "$1" "$1".*'
)
RUN_KILL_SCRIPT = (
    'n=0; while [ ! -s "$1" ] && [ "$n" -lt 20 ]; do sleep 0.1; '
    "n=$((n + 1)); done\n"
    '[ -s "$1" ] || exit 0\n'
    'p=$(cat "$1"); rm -f "$1" "$1".*\n'
    'kill -TERM -"$p" 2>/dev/null; pkill -TERM -P "$p" 2>/dev/null; '
    'kill -TERM "$p" 2>/dev/null\n'
    'n=0; while kill -0 "$p" 2>/dev/null && [ "$n" -lt 20 ]; do sleep 0.1; '
    "n=$((n + 1)); done\n"
    'kill -KILL -"$p" 2>/dev/null; pkill -KILL -P "$p" 2>/dev/null; '
    'kill -KILL "$p" 2>/dev/null\n'
    "exit 0\n"
)
# A named shell (run-command's and start-job's `shell`) is a directory of
# the guest, SHELL_DIR/<name>, holding the working directory (cwd) and
# the exported environment (env, as `export -p` prints it) as they were
# at the end of the last command run in it; SHELL_SCRIPT reads them
# before the command and writes them after it, in the same sh process as
# the command, so its cd and export stay (an exit in it too, by an EXIT
# trap). The command is data ($6), run with eval; stdout, stderr and the
# exit code are the command's own. A command killed (at its timeout, or
# cancelled: TERM or KILL) writes nothing: the shell stays as it was
# before it. A job reads the state and writes none back: a job ending
# while the next command runs would make the shell's state a race.
# Nothing is kept on the host, so a branch, a pause and resume, or a
# server restart keep every shell. A machine keeps at most
# SHELLS_PER_MACHINE; the guest script counts them (no extra request).
SHELL_DIR = "/var/tmp/smol-mcp/shells"
# $1 the shell's directory, $2 the most shells a machine keeps, $3 the
# marker a refusal starts stderr with, $4 save (run-command) or job, $5
# cwd (start in the saved directory) or workdir (the call named one), $6
# the command, then NAME=VALUE for each variable of the call's env (set
# after the saved ones, so the call's win). A refusal (no room for a new
# shell, or no place to keep it) exits 125 with the marker, its kind and
# the shells there on stderr, before the command runs. Our names start
# with _smol_ (the command shares the shell with them); pwd and mv are
# called with `command` so a function the command defines is not.
SHELL_SCRIPT = r"""_smol_d=$1
_smol_r=$3
_smol_k=$4
_smol_c=$6
_smol_n() { if [ -e "$1" ]; then echo $#; else echo 0; fi; }
_smol_no() {
  echo "$_smol_r $1" >&2
  for _smol_e in "${_smol_d%/*}"/*; do
    [ -d "$_smol_e" ] && echo "${_smol_e##*/}" >&2
  done
  exit 125
}
if [ "$_smol_k" = save ] && [ ! -d "$_smol_d" ]; then
  [ "$(_smol_n "${_smol_d%/*}"/*)" -lt "$2" ] || _smol_no limit
  mkdir -p "$_smol_d" 2>/dev/null || _smol_no state
  if [ "$(_smol_n "${_smol_d%/*}"/*)" -gt "$2" ]; then
    rmdir "$_smol_d"; _smol_no limit
  fi
fi
_smol_p=$PWD
if [ -f "$_smol_d/env" ]; then command . "$_smol_d/env" 2>/dev/null; fi
PWD=$_smol_p
if [ "$5" = cwd ] && [ -f "$_smol_d/cwd" ]; then
  IFS= read -r _smol_p <"$_smol_d/cwd" && cd -- "$_smol_p" 2>/dev/null
fi
shift 6
for _smol_e do export "$_smol_e"; done
unset _smol_e _smol_p
set --
_smol_save() {
  command pwd >"$_smol_d/cwd.part" && export -p >"$_smol_d/env.part" &&
    command -p mv -f "$_smol_d/env.part" "$_smol_d/env" &&
    command -p mv -f "$_smol_d/cwd.part" "$_smol_d/cwd"
}
_smol_end() { { trap - EXIT "$1"; kill -"$1" "$$"; } 2>/dev/null; }
if [ "$_smol_k" = save ]; then
  trap '{ _smol_x=$?; set +ex; _smol_save; exit "$_smol_x"; } 2>/dev/null' EXIT
  trap '_smol_end TERM' TERM
  trap '_smol_end INT' INT
  trap '_smol_end HUP' HUP
fi
eval "$_smol_c"
"""
# The longest working directory a result shows.
SHELL_CWD_BYTES = 1024
# $1 the shell's directory: its saved working directory, at most one byte
# more than SHELL_CWD_BYTES (the file is the guest's to fill).
SHELL_CWD_SCRIPT = f'head -c {SHELL_CWD_BYTES + 1} "$1/cwd"'
# At most about three output lines a second reach the client, each cut to
# LIVE_LINE_CHARS.
LIVE_OUTPUT_INTERVAL_SECS = 0.3
LIVE_LINE_CHARS = 200


def guest_script(script: str, pid_file: str, *argv: str) -> list[str]:
    """The argv that runs one of the RUN_ scripts above with its pid
    file."""
    return ["sh", "-c", script, "sh", pid_file, *argv]


def shell_argv(args: dict, options: dict, mode: str) -> tuple[list, str]:
    """The argv that runs ``args["command"]`` in the shell
    ``args["shell"]`` (``mode`` "save" or "job"), and the marker of its
    refusal. The call's env goes in as the script's arguments, so it is
    taken out of ``options``. An argv list is one command line of quoted
    words; raise ArgumentError for a word no command line can carry."""
    command = args["command"]
    if not isinstance(command, str):
        if any("\0" in word for word in command):
            raise ArgumentError(
                '"command" holds a NUL character, which no shell command '
                "line (nor any argv) can carry; take it out"
            )
        # Every word quoted, so a word that is a shell keyword stays a
        # word, as exec would take it.
        command = " ".join(quoted(word) for word in command)
    marker = f"smol-mcp-shell-{secrets_module.token_hex(8)}"
    start = "workdir" if "workdir" in args else "cwd"
    env = options.pop("env", None) or {}
    assignments = [f"{key}={value}" for key, value in env.items()]
    return [
        "sh",
        "-c",
        SHELL_SCRIPT,
        "sh",
        f"{SHELL_DIR}/{args['shell']}",
        str(SHELLS_PER_MACHINE),
        marker,
        mode,
        start,
        command,
        *assignments,
    ], marker


def quoted(word: str) -> str:
    """``word`` in single quotes for sh, whatever it holds."""
    return "'" + word.replace("'", "'\\''") + "'"


def refuse_shell(
    result: ExecResult, marker: str, name: str, shell: str
) -> None:
    """Raise SmolError when SHELL_SCRIPT refused to open ``shell`` (its
    stderr starts with ``marker``); nothing ran then."""
    stderr = bytes(result.stderr).decode("utf-8", "replace")
    if result.exit_code != 125 or not stderr.startswith(f"{marker} "):
        return
    kind, *shells = stderr[len(marker) + 1 :].split()
    if kind == "limit":
        raise SmolError(
            f"machine '{name}' keeps {SHELLS_PER_MACHINE} shells already "
            f"({', '.join(shells)}), the most it may, so shell '{shell}' "
            "was not opened and nothing ran. Use one of those, or remove "
            f'one first: run-command {{name: "{name}", command: "rm -r '
            f'{SHELL_DIR}/<shell>"}}'
        )
    raise SmolError(
        f"machine '{name}' cannot keep shell '{shell}': {SHELL_DIR} cannot "
        "be written in its guest, so nothing ran. Run the command without "
        "shell (chain the steps with &&), or make that directory writable"
    )


async def shell_cwd(call: Call, name: str, shell: str) -> str | None:
    """The working directory shell ``shell`` saved, or None when it has
    none (its first command was killed), it cannot be read or it is over
    SHELL_CWD_BYTES."""
    argv = ["sh", "-c", SHELL_CWD_SCRIPT, "sh", f"{SHELL_DIR}/{shell}"]
    try:
        answer = await call.api(call.fleet.exec, name, argv, timeout_secs=30)
    except SmolError as err:
        log.warning("could not read shell %s of %s: %s", shell, name, err)
        return None
    data = bytes(answer.stdout).removesuffix(b"\n")
    if answer.exit_code != 0 or len(data) > SHELL_CWD_BYTES:
        # A path that long is not shown cut: it would name another place.
        return None
    return data.decode("utf-8", "replace") or None


async def run_in_machine(
    call: Call, name: str, argv: list[str], **options: Any
) -> ExecResult:
    """Run a command; with a progress token, through the stream route, the
    newest output line a progress message a few times a second. Same
    result either way; cancelled, it is ended."""
    pid_file = f"{RUN_PID_DIR}/{secrets_module.token_hex(8)}"
    try:
        if call.progress_token() is None:
            wrapped = guest_script(RUN_WRAPPER, pid_file, *argv)
            waiting = f"running the command in '{name}'"
            return await call.api(
                call.fleet.exec, name, wrapped, waiting=waiting, **options
            )
        return await stream_in_machine(call, name, pid_file, argv, options)
    except anyio.get_cancelled_exc_class():
        kill = guest_script(RUN_KILL_SCRIPT, pid_file)
        end = functools.partial(call.fleet.exec, name, kill, timeout_secs=30)
        with (
            anyio.CancelScope(shield=True),
            anyio.move_on_after(CLEANUP_TIMEOUT_SECS),
        ):
            try:
                await anyio.to_thread.run_sync(end)
            except Exception as err:
                log.warning(
                    "could not end the cancelled command in machine %s: %s",
                    name,
                    err,
                )
        raise


async def stream_in_machine(
    call: Call, name: str, pid_file: str, argv: list[str], options: dict
) -> ExecResult:
    """run_in_machine's stream route: progress from the stream, the result
    from the guest's copy (the stream's own when the guest kept none)."""
    # Each stream's newest line and its number, written by the worker
    # thread. Both keys exist from the start, so the loop reads a dict that
    # never changes size.
    last = {"stdout": (0, ""), "stderr": (0, "")}
    # The lines seen so far, and the numbers of those already sent (0:
    # none yet).
    count = [0]
    shown = {0}

    def on_output(stream: str, data: str) -> None:
        lines = [line for line in data.splitlines() if line.strip()]
        if lines:
            line = lines[-1].strip()
            if len(line) > LIVE_LINE_CHARS:
                line = line[: LIVE_LINE_CHARS - 1] + "…"
            count[0] += 1
            last[stream] = (count[0], f"{stream}: {line}")

    # A line counts as shown once it is sent: the end may cut it off.
    async def show(number: int, message: str) -> None:
        await call.progress(None, message)
        shown.add(number)

    async def reporter() -> None:
        quiet_since = time.monotonic()
        while True:
            await anyio.sleep(LIVE_OUTPUT_INTERVAL_SECS)
            newest = max(tuple(last.values()))
            if newest[0] not in shown:
                quiet_since = time.monotonic()
                await show(*newest)
            elif time.monotonic() - quiet_since >= PROGRESS_INTERVAL_SECS:
                quiet_since = time.monotonic()
                await call.so_far(f"running the command in '{name}'")

    tee = guest_script(RUN_TEE_WRAPPER, pid_file, *argv)
    failure = None
    async with anyio.create_task_group() as group:
        group.start_soon(reporter)
        try:
            stream = functools.partial(
                call.fleet.exec_stream, on_output=on_output, **options
            )
            value = await call.api(stream, name, tee, waiting="")
        except Exception as err:
            # Carried out of the group, which would wrap it in a group.
            failure = err
        group.cancel_scope.cancel()
    if failure is not None:
        raise failure
    # Each stream's last line, even one that came between two ticks or was
    # overtaken by the other pipe's (two tees in the guest, so their order
    # is not the command's).
    for number, message in sorted(tuple(last.values())):
        if number not in shown:
            await show(number, message)
    return await with_guest_copy(call, name, pid_file, value)


async def with_guest_copy(
    call: Call, name: str, pid_file: str, value: ExecResult
) -> ExecResult:
    """``value`` with the output the guest kept of the command in its
    place; ``value`` itself when the guest kept no copy or the copy cannot
    be read back."""
    read_back = guest_script(RUN_READ_BACK, pid_file)
    try:
        copy = await call.api(
            call.fleet.exec, name, read_back, timeout_secs=60
        )
    except SmolError as err:
        log.warning(
            "could not read back the output of a command in %s: %s", name, err
        )
        return value
    if copy.exit_code != 0:
        # The guest could not keep a copy (no mkfifo or tee): the stream is
        # all.
        return value
    return dataclasses.replace(
        value,
        stdout=copy.stdout,
        stderr=copy.stderr,
        cut_by_service=copy.cut_by_service,
    )


async def budget_exec(
    call: Call,
    name: str,
    result: ExecResult,
    timeout: int,
    since: datetime.datetime,
    once: bool,
    network: str | None = None,
) -> dict:
    """The run-command result: each stream within maxOutputBytes, both
    within replyTokens; a stream that did not fit is written whole into
    the machine, its path in ``overflow`` (not by run-once, ``once``,
    whose machine is deleted as it answers); a failure's egress denials
    too, and the hint of blocked egress (``network``: the machine's
    egress word when the caller knows it, else read when needed)."""
    limit = call.config.max_output_bytes
    streams = (("stdout", result.stdout), ("stderr", result.stderr))
    # A stream longer than twice the byte limit is cut whatever it costs:
    # its first 2*limit bytes tell its share, and a 16 MiB stream is not
    # decoded whole.
    costs = [
        est_tokens(out[: 2 * limit].decode("utf-8", "surrogateescape"))
        for _, out in streams
    ]
    shares = stream_shares((costs[0], costs[1]), reply_tokens(call.config))
    # 124 is what the guest reports for a command it killed at its timeout.
    timed_out = result.exit_code == 124 and result.seconds >= timeout - 1
    shaped: dict[str, Any] = dict.fromkeys(("stdout", "stderr"), "")
    shaped.update(
        exitCode=result.exit_code,
        truncated=False,
        timedOut=timed_out,
        overflow=[],
    )
    stamp = f"{time.strftime('%Y%m%dT%H%M%S')}-{secrets_module.token_hex(3)}"
    for (stream, data), share, cost in zip(streams, shares, costs):
        lost = ""
        if stream in result.cut_by_service:
            shaped["truncated"] = True
            lost = (
                f"\n[... smol-mcp: the cloud API cut {stream} here, at "
                f"{len(data)} bytes; what followed was not returned by the "
                "service and is lost ...]\n"
            )
        if len(data) <= limit and cost <= share:
            shaped[stream] = data.decode("utf-8", "replace") + lost
            continue
        shaped["truncated"] = True
        if once:
            where = (
                "run-once deletes its machine, so the whole stream was not "
                "kept; use create-machine and run-command to keep it"
            )
        else:
            path = f"{OVERFLOW_DIR}/{stamp}.{stream}"
            try:
                await call.api(call.fleet.write_file, name, path, data)
            except SmolError as err:
                where = (
                    "the whole stream could not be saved in the machine: "
                    f"{err}"
                )
            else:
                shaped["overflow"].append(path)
                kept = "the first" if lost else "the whole"
                where = (
                    f"{kept} {len(data)} bytes of the stream are in the "
                    f"machine at {path} (read it with read-file)"
                )
        shaped[stream] = fit_stream(data, limit, share, where)[0] + lost
    shaped = await note_egress_denials(call, name, shaped, since, once)
    if "egressHint" in shaped or not failed_on_network(result, shaped):
        return shaped
    return await note_blocked_egress(call, name, shaped, once, network)


EGRESS_HINT = (
    "egressDenied lists the connections this machine's egress policy "
    "refused while the command ran. If the command needs one, allow-egress "
    '{{name: "{name}", hosts: [the host name it used]}} (or cidrs: '
    '["<address>/32"]) adds it to the allow list once a person confirms.'
)
# run-once deletes its machine as it answers: there is nothing left to
# amend.
EGRESS_HINT_RUN_ONCE = (
    "egressDenied lists the connections the machine's egress policy "
    "refused while the command ran. That machine is deleted already; to "
    "let the command reach a host, run it again with allowHosts: "
    '["<the host name it used>"] (or allowCidrs: ["<address>/32"]).'
)
# For a caller that cannot call allow-egress: pointing at it would only
# earn a refusal.
EGRESS_HINT_NO_SCOPE = (
    "egressDenied lists the connections this machine's egress policy "
    "refused while the command ran. Widening the allow list needs the "
    "manage scope, which this caller does not have: ask the operator "
    "(allow-egress, or a machine created with the hosts it needs)."
)


def parse_event_time(value: Any) -> datetime.datetime | None:
    """An RFC 3339 denial time; None for the "" the engine writes for a
    line without one."""
    try:
        return datetime.datetime.fromisoformat(value.replace("Z", "+00:00"))
    except (AttributeError, TypeError, ValueError):
        return None


def group_denials(
    events: list[dict], since: datetime.datetime | None = None
) -> list[dict]:
    """Denials grouped by destination and operation, in the order first
    seen: {dest, operation, count, firstAt, lastAt}. With ``since``, only
    those timed from then on (untimed ones: not)."""
    groups: dict[tuple[str, str], dict] = {}
    for event in events:
        when = parse_event_time(event.get("timestamp"))
        if since is not None and (when is None or when < since):
            continue
        key = (str(event.get("dest", "")), str(event.get("operation", "")))
        stamp = event.get("timestamp") or None
        group = groups.setdefault(
            key, {"dest": key[0], "operation": key[1], "count": 0}
        )
        group.setdefault("firstAt", stamp)
        group["count"] += 1
        group["lastAt"] = stamp or group.get("lastAt")
    return list(groups.values())


async def note_egress_denials(
    call: Call, name: str, shaped: dict, since: datetime.datetime, once: bool
) -> dict:
    """Add egressDenied (and its hint) to a failed or timed-out command's
    result where the engine records denials (unreadable ones change
    nothing); ``once``: run-once's, the hint is to rerun."""
    if not call.fleet.amends_egress:
        return shaped
    # get-machine reads the refusals after a failed command.
    machine = (call.fleet.name, name)
    if shaped["exitCode"] == 0 and not shaped["timedOut"]:
        call.app.failed_last.discard(machine)
        return shaped
    call.app.failed_last.add(machine)
    try:
        events = await call.api(
            call.fleet.egress_events, name, EGRESS_EVENTS_LIMIT
        )
    except SmolError as err:
        log.info("could not read the egress denials of %s: %s", name, err)
        return shaped
    if not (denied := group_denials(events, since)):
        return shaped
    hint = egress_hint(call, name, once)
    return {**shaped, "egressDenied": denied, "egressHint": hint}


def egress_hint(call: Call, name: str, once: bool) -> str:
    """The egressHint of a command's denials: run again (run-once), ask
    for allow-egress, or, for a caller without its scope, ask the
    operator."""
    if once:
        return EGRESS_HINT_RUN_ONCE
    if granting_scope(call.principal, "allow-egress") is None:
        return EGRESS_HINT_NO_SCOPE
    return EGRESS_HINT.format(name=name)


# What a command prints when it could not look a name up or reach an
# address: busybox (wget, nslookup, ping), curl, GNU wget, pip and
# Python's socket and urllib, npm and Node, git and ssh, apt and apk, Go,
# Java. Matched only in the last NETWORK_FAILURE_TAIL bytes of a stream,
# where a failing command says why it stopped, so a word in passing
# earlier in the output does not count.
NETWORK_FAILURE_RE = re.compile(
    "|".join(
        (
            "bad address '",
            "can't resolve",
            "could(n't| not) resolve",
            "unable to resolve",
            "temporary failure (in name resolution|resolving)",
            "name or service not known",
            "no address associated with hostname",
            "nodename nor servname",
            "failed to lookup address",
            "network is unreachable",
            "no route to host",
            r"\b(ENOTFOUND|EAI_AGAIN|ENETUNREACH|EHOSTUNREACH)\b",
            "no servers could be reached",
            "dns lookup error",
            r"temporary error \(try again later\)",
            r"lookup \S+( on \S+)?: no such host",
            "UnknownHostException",
            "getaddrinfo failed",
        )
    ),
    re.IGNORECASE,
)
NETWORK_FAILURE_TAIL = 4096
EGRESS_BLOCKED = (
    "The command's output reads like a failed name lookup or connection, "
    "and this machine's egress is blocked (the default): it reaches no "
    "host at all."
)
EGRESS_BLOCKED_AMEND = (
    f"{EGRESS_BLOCKED} To let it reach the host it needs, stop-machine, "
    'then allow-egress {{name: "{name}", hosts: ["<the host name>"]}} '
    "(once a person confirms), then start-machine; or create a machine "
    'with network: "open" (or allowHosts).'
)
EGRESS_BLOCKED_CREATE = (
    f"{EGRESS_BLOCKED} This fleet cannot change a machine's egress: "
    'create a machine with network: "open" (or allowHosts: ["<the host '
    'name>"]) for the command.'
)
EGRESS_BLOCKED_RUN_ONCE = (
    f"{EGRESS_BLOCKED} That machine is deleted already; run the command "
    'again with network: "open" (or allowHosts: ["<the host name>"]).'
)
EGRESS_BLOCKED_NO_SCOPE = (
    f"{EGRESS_BLOCKED} Opening it needs the manage scope, which this "
    "caller does not have: ask the operator for a machine with the egress "
    'it needs (network: "open" at create, or allow-egress).'
)


def failed_on_network(result: ExecResult, shaped: dict) -> bool:
    """Return whether a command failed (a non-zero exit or its timeout)
    and the end of its stdout or stderr reads like a network failure."""
    if shaped["exitCode"] == 0 and not shaped["timedOut"]:
        return False
    for data in (result.stderr, result.stdout):
        tail = data[-NETWORK_FAILURE_TAIL:].decode("utf-8", "replace")
        if NETWORK_FAILURE_RE.search(tail):
            return True
    return False


async def note_blocked_egress(
    call: Call, name: str, shaped: dict, once: bool, network: str | None
) -> dict:
    """Add the egressHint of blocked egress to a command that failed on
    the network, when its machine's egress is blocked; ``network``: the
    machine's egress word, read from its record when None (an unreadable
    record adds nothing)."""
    if network is None:
        try:
            record = await call.api(call.fleet.get_machine, name)
        except SmolError as err:
            log.info("could not read the egress of %s: %s", name, err)
            return shaped
        network = record["network"]
    if network != "blocked":
        return shaped
    return {**shaped, "egressHint": blocked_egress_hint(call, name, once)}


def blocked_egress_hint(call: Call, name: str, once: bool) -> str:
    """The egressHint of a blocked machine's network failure: run again
    (run-once), amend (allow-egress, local), create anew (cloud), or ask
    the operator."""
    if once:
        return EGRESS_BLOCKED_RUN_ONCE
    if granting_scope(call.principal, "allow-egress") is None:
        return EGRESS_BLOCKED_NO_SCOPE
    if call.fleet.amends_egress:
        return EGRESS_BLOCKED_AMEND.format(name=name)
    return EGRESS_BLOCKED_CREATE


def spec_egress(spec: MachineSpec) -> str:
    """A create request's egress in the shared vocabulary (open, blocked,
    allowlist), as the machine's record will read."""
    if spec.allow_hosts or spec.allow_cidrs:
        return "allowlist"
    return spec.network


ARG_NAME_ONLY = _input("name", name=ARG_NAME)
OUT_CREATED = _out(
    {"machine": OUT_MACHINE, **_types("ephemeral:boolean ready:boolean")}
)
ARG_PORTS = {
    "type": "array",
    "description": (
        "Ports to publish: guest port, and optionally the host port."
    ),
    "maxItems": PORTS_PER_MACHINE,
    "items": _input(
        "guest",
        guest=_integer("Port inside the machine.", maximum=65535),
        host=_integer(
            "Port on the host (default: a free one).", maximum=65535
        ),
    ),
}
ARG_MOUNTS = {
    "type": "array",
    "description": (
        "Host directories to attach (local fleet only), only under the "
        "operator's mountRoots; read-only by default."
    ),
    "items": _input(
        "source target",
        source=_string("Absolute host path."),
        target=_string(
            "Absolute path inside the machine.", pattern=ABSOLUTE_PATH_PATTERN
        ),
        readonly=_boolean(
            "Mount read-only (the default); false asks for write, which "
            "only a root opened with :rw grants."
        ),
    ),
}
EGRESS_WITH_DENIALS = _out(
    EGRESS_POLICY, {"recentDenials": OUT_DENIALS}, OUT_EGRESS["description"]
)
ARG_INCLUDE = {
    "type": "array",
    "description": (
        '"jobs": read the jobs\' states from the machine itself; "egress": '
        "its recent refused connections (local). Each costs a request."
    ),
    "items": {"type": "string", "enum": ["jobs", "egress"]},
    "maxItems": 2,
}
ARG_CREATE_NAME = {
    **ARG_NAME,
    "description": (
        "Name for the machine; omit for an ephemeral one (mcp-xxxxxxxx)."
    ),
}
ARG_POOL_SHORT = "a warm pool of booted machines that smol://pools lists"
ARG_POOL = _string(
    f"Lease a machine at once from {ARG_POOL_SHORT} (the operator's "
    "warmPools), instead of booting one from an image; only env may be "
    "given with it, and the engine names the machine (see the result).",
    minLength=1,
    pattern=NAME_PATTERN,
)
OUT_CREATED_OR_LEASED = _out(
    OUT_CREATED["properties"],
    _types("warm:boolean pool:string readyMs:integer why:string"),
)
SIZE_ARGS = dict(cpus=ARG_CPUS, memoryMb=ARG_MEMORY)
ARG_STATE = _string(
    "The saved state's name (list-states shows them). A name starting with "
    "the ephemeral prefix (mcp- by default) makes a state deleted when this "
    "session ends.",
    minLength=1,
    pattern=STATE_NAME_PATTERN,
)
ARG_FROM = {
    **ARG_STATE,
    "description": (
        "Start from this saved state (save-machine) instead of an image: "
        "the state fixes everything but the name."
    ),
}
# The validator's sentence, said by create-machine itself: with from, no
# image is needed.
IMAGE_NEEDED = (
    'create-machine needs the argument "image": '
    f'{ARG_IMAGE["description"]} Or pass "from": a state save-machine made, '
    f'or "pool": {ARG_POOL_SHORT}.'
)
NETWORK_ARGS = dict(
    network=ARG_NETWORK, allowHosts=ARG_ALLOW_HOSTS, allowCidrs=ARG_ALLOW_CIDRS
)
# Filled by @tool, in the order the handlers below are defined.
TOOLS: list[ToolSpec] = []


def tool(*spec: Any, **keywords: Any) -> Callable:
    """Register the handler below as a tool: ``spec`` and ``keywords``
    are its ToolSpec's fields after the handler."""

    def register(handler: Callable) -> Callable:
        TOOLS.append(ToolSpec(handler, *spec, **keywords))
        return handler

    return register


# -- the tools, each its spec and handler, in the order the client lists them


@tool(
    "List machines",
    "List every machine on the fleet, with its state, image, size, egress "
    "and published ports. Changes nothing.",
    _object({}),
    _out({"machines": {"type": "array", "items": OUT_MACHINE}}),
    "read: read_only idempotent",
)
async def tool_list_machines(call: Call, args: dict) -> dict:
    machines = await call.read(call.fleet.list_machines)
    # The server's own machines and the pools' unleased workers: no tool
    # takes them, so none is listed.
    reserved = call.app.reserved_for(call.fleet)
    return {
        "machines": [
            m
            for m in machines
            if not reserved(m["name"], parent=m.get("parent"))
        ]
    }


@tool(
    "Get a machine",
    "Show one machine: state, image, size, egress, ports, pid and whether "
    "it can be branched, and the jobs (start-job) of a running machine as "
    "last seen. Changes nothing.",
    # (local fleet: also the allow list, and its recent refusals when asked
    # or after a failure)
    _input("name", name=ARG_NAME, include=ARG_INCLUDE),
    _out(
        {"machine": OUT_MACHINE, "jobs": OUT_JOBS},
        {"egress": EGRESS_WITH_DENIALS},
    ),
    "read: read_only idempotent",
)
async def tool_get_machine(call: Call, args: dict) -> dict:
    """One engine request: the record holds the egress policy. Jobs come
    from our record unless `include` asks the guest; refusals only for a
    restricted policy, asked or after a failure."""
    name = args["name"]
    include = args.get("include", [])
    if call.fleet.amends_egress:
        machine, egress = await call.read(call.fleet.egress_policy, name)
    else:
        machine = await call.read(call.fleet.get_machine, name)
        egress = None
    jobs = await machine_jobs(call, name, machine, "jobs" in include)
    shown = {"machine": machine, "jobs": jobs}
    if egress is None:
        return shown
    failed = (call.fleet.name, name) in call.app.failed_last
    if not egress["open"] and ("egress" in include or failed):
        await add_recent_denials(call, name, egress)
    return {**shown, "egress": egress}


async def machine_jobs(
    call: Call, name: str, machine: dict, from_guest: bool
) -> list[dict] | None:
    """get-machine's jobs: the guest's list with ``from_guest``, else our
    record; none for a machine that is not running (it runs no job), our
    record for a paused one (its jobs are paused with it, and no command
    reaches it), and None when they cannot be listed (unknown, which is
    not the same as none)."""
    paused = machine["state"] == "paused"
    if machine["state"] not in RUNNING_STATES and not paused:
        return []
    try:
        if from_guest and not paused:
            return await call.api(call.fleet.list_jobs, name, machine["id"])
        recorded = call.app.access.owners.jobs.read().get(call.fleet.name, {})
        return list(recorded.get(name, []))
    except SmolError as err:
        log.info("could not list the jobs of %s: %s", name, err)
        return None


async def add_recent_denials(call: Call, name: str, egress: dict) -> None:
    """Add a machine's recent refusals to its ``egress`` policy, or why
    they could not be read."""
    try:
        events = await call.api(call.fleet.egress_events, name, EGRESS_RECENT)
        egress["recentDenials"] = group_denials(events)
    except SmolError as err:
        egress.update(recentDenials=[], recentDenialsError=str(err))


async def machine_spec(
    call: Call, args: dict, name: str, network_default: str
) -> MachineSpec:
    """A create's MachineSpec. An allow-list narrows egress, so it
    excludes an explicit network; a machine with egress gets the host
    ranges as deny rules."""
    hosts = egress_entries(args, "allowHosts", call.config, True)
    cidrs = egress_entries(args, "allowCidrs", call.config)
    if (hosts or cidrs) and "network" in args:
        raise ArgumentError(
            f'"network": "{args["network"]}" cannot be combined with '
            "allowHosts/allowCidrs: an allow-list already means egress to "
            "those destinations only. Pass one or the other."
        )
    if hosts or cidrs:
        network = "blocked"
    else:
        network = args.get("network", network_default)
    # The cloud has no host directories: its own refusal of mounts is the
    # clearer sentence there.
    mounts = args.get("mounts", [])
    if call.fleet.mounts_host_paths:
        image, mounts = contain_host_paths(call.config, args["image"], mounts)
    else:
        image, _ = contain_host_paths(call.config, args["image"], [])
    cpus = args.get("cpus", call.config.cpus)
    memory = args.get("memoryMb", call.config.memory_mb)
    # The other arguments are MachineSpec's fields by their camelCase
    # names, with its defaults.
    rest = ("ports", "storage_gb", "overlay_gb", "cmd", "env", "branchable")
    given = {attr: args[_camel(attr)] for attr in rest if _camel(attr) in args}
    given.update(mounts=mounts, ephemeral=call.session.is_ephemeral(name))
    if network == "open" or hosts or cidrs:
        given["egress_rules"] = host_range_rules(call.config)
    named = [(f"allowHosts[{i}]", host) for i, host in enumerate(hosts)]
    await refuse_resolving_to_host_ranges(named, call.config)
    return MachineSpec(
        name, image, cpus, memory, network, hosts, cidrs, **given
    )


@tool(
    "Create a machine",
    "Create a new microVM from an OCI image and (by default) start it, "
    "answering once a command has run in it. Egress is blocked unless "
    'network is "open" or an allow-list is given. A name starting with the '
    "ephemeral prefix (mcp- by default), or no name, makes a machine that "
    "is deleted when this session ends; any other name persists. With "
    "pool, a machine the operator's warm pool keeps booted is leased at "
    "once instead (ephemeral too). Uses host CPU, memory and disk while it "
    "exists. With from instead of an image, the machine starts from a "
    "saved state (save-machine), where its source was when saved.",
    _input(
        "",
        name=ARG_CREATE_NAME,
        image=ARG_IMAGE,
        **{"from": ARG_FROM},
        **SIZE_ARGS,
        **NETWORK_ARGS,
        ports=ARG_PORTS,
        mounts=ARG_MOUNTS,
        storageGb=_integer("Storage disk size in GiB.", maximum=MAX_DISK_GB),
        overlayGb=_integer(
            "Overlay disk size in GiB (local fleet only).", maximum=MAX_DISK_GB
        ),
        cmd={
            "type": "array",
            "items": {"type": "string"},
            "description": "Workload command (local fleet only).",
        },
        env=ARG_ENV,
        branchable=_boolean("Make it a branch source for branch-machine."),
        start=_boolean("Start it and wait for the guest (default true)."),
        pool=ARG_POOL,
    ),
    OUT_CREATED_OR_LEASED,
    "manage: open_world",
)
async def tool_create_machine(call: Call, args: dict) -> dict:
    if "from" in args:
        return await create_from_state(call, args)
    if "pool" in args:
        return await create_from_pool(call, args)
    if "image" not in args:
        raise ArgumentError(IMAGE_NEEDED)
    name = args.get("name") or call.new_ephemeral_name()
    spec = await machine_spec(call, args, name, call.config.network_default)
    start = args.get("start", True)
    if spec.branchable and not start and call.fleet.branch_needs_start:
        raise ArgumentError(
            '"branchable": true needs "start": true on the local fleet: the '
            "engine makes a machine a branch source when it starts it"
        )
    record = await create_recorded(call, name, call.fleet.create_machine, spec)
    if start:
        try:
            record = await start_and_wait(
                call, name, spec.branchable, spec.mounts
            )
        except BaseException as err:
            failure = await start_failure(call, name, err, spec.network)
            await call.delete_quietly(name)
            if isinstance(err, Exception):
                raise failure from None
            raise
    return {
        "machine": record,
        "ephemeral": call.session.is_ephemeral(name),
        "ready": start,
    }


async def create_recorded(
    call: Call,
    name: str,
    create: Callable,
    *args: Any,
    owner: str | None = None,
) -> dict:
    """Create a machine (or a branch child) so the session's record stays
    true: an ephemeral name is recorded before the call (a crash right
    after still cleans up), forgotten only if the API refused it and this
    call recorded it; its owner (the caller, or a branch source's)
    likewise. A record the engine proves stale (it took the name) is
    replaced: it is not the old owner's."""
    added = call.session.is_ephemeral(name) and call.session.remember(
        call.fleet.name, name
    )
    owners = call.app.access.owners
    owner = owner or call.principal.name
    claimed = owners.owner(call.fleet.name, name) is None
    if claimed:
        owners.claim(call.fleet.name, name, owner)
    try:
        record = await call.create(create, *args, waiting=f"creating '{name}'")
    except SmolError:
        if added:
            call.session.forget(call.fleet.name, name)
        if claimed:
            # Only if nobody claimed it since.
            owners.release(call.fleet.name, name, owner)
        raise
    if call.session.ended and call.session.is_ephemeral(name):
        # The session ended (its client went, its token was deleted) while
        # this create ran, so its cleanup came too early to see the
        # machine: do it here.
        await call.delete_quietly(name)
        raise SmolError(
            f"the session ended while '{name}' was being created, so the "
            "machine was deleted at once (its session's cleanup had already "
            "run); open a new session and create it again"
        )
    owners.claim(call.fleet.name, name, owner, machine_identity(record))
    call.session.identities[(call.fleet.name, name)] = machine_identity(record)
    return record


# -- warm pools: machines the operator keeps booted -------------------------
#
# warmPools (section 1) names pools of booted workers on the local engine.
# At the first local tool call, a thread of WarmPools makes each pool: its
# source machine smol-pool-POOL (the operator's, never listed), started as
# a branch source, then the engine's fork pool, which freezes the source
# and keeps `ready` workers branched from it; a pool the engine already
# has is adopted. create-machine {pool} leases a worker (one request, no
# readiness command: the worker booted long ago), holds the lease for the
# caller's session (Leases, section 3), and completes it where another
# machine would be deleted. No clean worker, a pool not made, or a caller
# past its share: the machine is made cold from the pool's spec, and the
# result says why.

# In the runtime directory: each pool's last outcome, which doctor reads.
POOLS_FILE = "pools.json"
POOL_NOT_MADE = (
    "not made yet: the server makes its warm pools at its first local tool "
    "call"
)
POOL_BEING_MADE = (
    "still being made: its source machine boots, then the engine fills the "
    "pool"
)
POOL_LOST = (
    "gone from the engine (deleted, or the serve started afresh); it is "
    "being made again"
)


def pool_source(pool: str) -> str:
    """The name of the source machine of the pool named ``pool``."""
    return f"{SERVER_MACHINE_PREFIX}pool-{pool}"


def pool_share(pool: WarmPool) -> int:
    """How many of ``pool``'s workers one caller may hold at once: half
    its ready count, at least one, so that one agent cannot drain it."""
    return max(1, pool.ready // 2)


class WarmPools:
    """The operator's warm pools in this process: made in a thread of their
    own at the first local tool call, each pool's standing (for
    create-machine, smol://pools and doctor), and each caller's share."""

    def __init__(self, app: SmolMcp):
        self.config = app.config
        self.local = app.local
        self.specs = {pool.name: pool for pool in app.config.warm_pools}
        # name -> (available, why not): what this process knows.
        self._standing = dict.fromkeys(self.specs, (False, POOL_NOT_MADE))
        # (pool, principal) -> leases asked for and not yet answered.
        self._pending: dict[tuple[str, str], int] = {}
        self._making: set[str] = set()
        self._started = False
        self._lock = threading.Lock()

    def spec(self, name: str) -> WarmPool:
        """The pool named ``name``; raise ArgumentError naming the pools
        there are (or saying there are none)."""
        if name in self.specs:
            return self.specs[name]
        if not self.specs:
            raise ArgumentError(
                f'"pool" is {name!r}, but this server keeps no warm pools '
                "(the operator sets them with warmPools in the config "
                'file); create the machine from an "image" instead'
            )
        raise ArgumentError(
            f'"pool" is {name!r}, which is not a warm pool of this server'
            f"{did_you_mean(name, self.specs)}; the pools are: "
            f"{', '.join(self.specs)} (smol://pools says which are ready)"
        )

    def make_once(self, fleet: Fleet) -> None:
        """At this process's first local tool call, start making every
        pool in a thread of its own: no call waits for it."""
        if self._started or fleet is not self.local or not self.specs:
            return
        self._started = True
        self._make_in_thread(list(self.specs))

    def lost(self, name: str) -> None:
        """The engine has no pool ``name`` any more: make it again."""
        self._make_in_thread([name], POOL_LOST)

    def _make_in_thread(self, names: list[str], why=POOL_BEING_MADE) -> None:
        with self._lock:
            names = [name for name in names if name not in self._making]
            self._making.update(names)
            for name in names:
                self._standing[name] = (False, why)
        if names:
            threading.Thread(
                target=self._make_all,
                args=(names,),
                name="smol-mcp warm pools",
                daemon=True,
            ).start()

    def _make_all(self, names: list[str]) -> None:
        """Make (or adopt) each pool named; each outcome is noted, and a
        failure logged once."""
        try:
            pools = self.local.list_pools()
            on_engine = {pool.get("name"): pool for pool in pools}
        except SmolError as err:
            for name in names:
                self._noted(name, err)
            return
        for name in names:
            try:
                adopted = self._make(self.specs[name], on_engine.get(name))
            # A bug here must not reach any tool: it is logged.
            except Exception as err:
                self._noted(name, err)
            else:
                self._noted(name, None, adopted)

    def _noted(
        self, name: str, err: Exception | None, adopted: bool = False
    ) -> None:
        """Note the outcome of making ``name`` here and in POOLS_FILE."""
        if err is None:
            standing = (True, None)
            how = "adopted from the engine" if adopted else "made"
            log.info("warm pool %s: %s", name, how)
        else:
            standing = (False, f"could not be made: {describe(err)}")
            log.warning("warm pool %s %s", name, standing[1])
        with self._lock:
            self._standing[name] = standing
            self._making.discard(name)
        path = Path(self.config.runtime_dir) / POOLS_FILE
        try:
            with bookkeeping(self.config.runtime_dir):
                ensure_runtime_dir(self.config.runtime_dir)
                recorded = read_pools_file(path)
                recorded[name] = {
                    "available": standing[0],
                    "reason": standing[1],
                    "at": utc_now(),
                }
                write_json(path, recorded)
        except SmolError as err:
            # Only doctor reads it: the pool is no worse for it.
            log.warning(
                "could not note warm pool %s for doctor: %s", name, err
            )

    def _make(self, pool: WarmPool, existing: dict | None) -> bool:
        """Make ``pool`` on the engine, or adopt the engine's ``existing``
        one; True when adopted. Raise SmolError when it cannot be made
        (a source made for it is deleted)."""
        source = pool_source(pool.name)
        if existing is not None:
            if existing.get("source") == source:
                return True
            raise SmolError(
                f"the engine already has a fork pool named '{pool.name}', "
                f"made from '{existing.get('source')}' rather than {source}, "
                "so it was not adopted; rename the pool in warmPools, or "
                "delete that pool on the engine"
            )
        made = self._run_source(pool, source)
        try:
            self.local.create_pool(pool.name, source, pool.ready)
        except BaseException:
            if made:
                self._delete_source(source)
            raise
        return False

    def _run_source(self, pool: WarmPool, source: str) -> bool:
        """Have ``source`` run as a branch source, created from the pool's
        spec if it is not there; True when it was created here."""
        try:
            state = self.local.machine_state(source)
        except ApiError as err:
            if err.status != 404:
                raise
            state = None
        made = state is None
        if made:
            self.local.create_machine(self._source_spec(pool, source))
        if state in ("running", "frozen"):
            return False
        try:
            self.local.start_machine(source, branchable=True)
            self._wait_ready(source)
        except BaseException:
            if made:
                self._delete_source(source)
            raise
        return made

    def _source_spec(self, pool: WarmPool, source: str) -> MachineSpec:
        """The source's MachineSpec: the pool's spec, the defaults where it
        says nothing, its image held to mountRoots."""
        config = self.config
        image, _ = contain_host_paths(config, pool.image, [])
        hosts = [
            egress_host(host, f"allowHosts[{index}]", True, config)
            for index, host in enumerate(pool.allow_hosts)
        ]
        network = pool.network or config.network_default
        if hosts or pool.allow_cidrs:
            network = "blocked"
        return MachineSpec(
            source,
            image,
            pool.cpus or config.cpus,
            pool.memory_mb or config.memory_mb,
            network,
            hosts,
            list(pool.allow_cidrs),
            branchable=True,
        )

    def _wait_ready(self, name: str) -> None:
        """Return once a command runs in ``name``; raise SmolError after
        readyTimeoutSecs."""
        limit = self.config.ready_timeout_secs
        deadline = time.monotonic() + limit
        while (answer := self.local.probe_ready(name)) is not None:
            if time.monotonic() > deadline:
                raise SmolError(
                    f"the guest of {name} did not run a command within "
                    f"{limit} s (readyTimeoutSecs); its last answer: {answer}"
                )
            time.sleep(0.2)

    def _delete_source(self, source: str) -> None:
        try:
            self.local.delete_machine(source)
        except SmolError as err:
            log.warning("could not delete %s: %s", source, err)

    def unavailable(self, name: str) -> str | None:
        """Why the pool ``name`` cannot be leased from now, or None."""
        with self._lock:
            available, why = self._standing[name]
        if available:
            return None
        return f"the pool '{name}' is not available: {why}"

    def reserve(self, pool: WarmPool, principal: Principal) -> str | None:
        """Count a lease ``principal`` is about to ask ``pool`` for, or
        say why not: it holds its share already."""
        key = (pool.name, principal.name)
        with self._lock:
            held = self.local.leases.held_by(*key)
            held += self._pending.get(key, 0)
            if held < pool_share(pool):
                self._pending[key] = self._pending.get(key, 0) + 1
                return None
        who = "this stdio server"
        if principal.kind == "token":
            who = f"the token '{principal.name}'"
        return (
            f"{who} holds {held} machine(s) of the pool '{pool.name}' "
            f"already, its share at once (half the pool's {pool.ready}, at "
            "least one, so that no one agent drains it)"
        )

    def unreserve(self, pool: WarmPool, principal: Principal) -> None:
        """The lease counted by reserve was answered (a granted one is
        counted among the held leases from then on)."""
        key = (pool.name, principal.name)
        with self._lock:
            left = self._pending.get(key, 1) - 1
            if left:
                self._pending[key] = left
            else:
                self._pending.pop(key, None)

    def document(self) -> dict:
        """smol://pools: each pool, its spec, and whether it can be leased
        from now (the engine's counts when its serve answers)."""
        engine = self.local.pools_now()
        with self._lock:
            standing = dict(self._standing)
        return {
            "pools": [
                pool_entry(pool, engine, standing[name])
                for name, pool in self.specs.items()
            ]
        }

    def doctor_lines(self) -> list[str]:
        """doctor's lines on the pools: what the engine has, else what the
        serving processes last noted (POOLS_FILE); nothing is made."""
        if not self.specs:
            return []
        engine = self.local.pools_now()
        noted = read_pools_file(Path(self.config.runtime_dir) / POOLS_FILE)
        lines = []
        for name, pool in self.specs.items():
            was = noted.get(name) or {}
            standing = (bool(was.get("available")), was.get("reason"))
            if not was:
                standing = (False, POOL_NOT_MADE)
            entry = pool_entry(pool, engine, standing)
            if entry["available"]:
                counts = entry["engine"]
                how = (
                    f"{counts['ready']} ready, {counts['provisioning']} "
                    f"booting, {counts['active']} leased"
                )
            else:
                how = f"not available: {entry['reason']}"
            lines.append(f"warm pool {name} ({pool.image}): {how}")
        return lines


def read_pools_file(path: Path) -> dict:
    """POOLS_FILE's pools by name; {} when it is missing or unreadable."""
    try:
        recorded = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(recorded, dict):
        return {}
    return {k: v for k, v in recorded.items() if isinstance(v, dict)}


def pool_entry(
    pool: WarmPool, engine: list[dict] | None, standing: tuple
) -> dict:
    """One pool as smol://pools shows it: its spec, whether it can be
    leased from, why not, and the engine's counts (None when its serve
    does not answer, or has no such pool)."""
    available, why = standing
    source = pool_source(pool.name)
    counts = None
    if engine is None:
        if available:
            available = False
            why = "on a serve that does not answer now"
    else:
        found = [p for p in engine if p.get("name") == pool.name]
        if found and found[0].get("source") == source:
            keys = ("ready", "provisioning", "active")
            counts = {key: found[0].get(key) for key in keys}
            available = True
            why = None
        elif available:
            available = False
            why = (
                "not on the engine any more (deleted, or the serve started "
                "afresh)"
            )
    return {
        "name": pool.name,
        "source": source,
        "image": pool.image,
        "cpus": pool.cpus,
        "memoryMb": pool.memory_mb,
        "network": pool.network,
        "allowHosts": list(pool.allow_hosts),
        "allowCidrs": list(pool.allow_cidrs),
        "desiredReady": pool.ready,
        "sharePerCaller": pool_share(pool),
        "available": available,
        "reason": why,
        "engine": counts,
    }


def pool_argument(call: Call, args: dict) -> WarmPool:
    """The pool create-machine's ``pool`` names; raise ArgumentError on a
    fleet without pools, beside an argument the pool fixed, for an env
    value the engine could not keep, or for a pool there is not."""
    if call.fleet.pool_refusal:
        raise ArgumentError(call.fleet.pool_refusal)
    fixed = [key for key in args if key not in ("pool", "env")]
    if fixed:
        named = ", ".join(f'"{key}"' for key in fixed)
        raise ArgumentError(
            f'{named} cannot be given with "pool": the pool '
            f"'{args['pool']}' fixed the machine's image, size and egress "
            "when the operator made it, and the engine names a pooled "
            "machine (its name is in the result). Pass only pool and env, "
            "or leave pool out to create from an image"
        )
    for key, value in args.get("env", {}).items():
        if re.search(r"[\0\n\r]", value):
            raise ArgumentError(
                f'"env.{key}" holds a newline or NUL, which a pooled '
                "machine's environment cannot keep (the engine keeps it a "
                "line a variable); pass the value without one"
            )
    return call.app.pools.spec(args["pool"])


async def create_from_pool(call: Call, args: dict) -> dict:
    """create-machine {pool, env?}: a booted worker leased from the pool,
    or, when none can be had, a machine made cold from the pool's spec,
    with the reason in ``why``."""
    pool = pool_argument(call, args)
    pools = call.app.pools
    env = args.get("env", {})
    why = pools.unavailable(pool.name) or pools.reserve(pool, call.principal)
    if why is None:
        try:
            return await lease_from_pool(call, pool, env)
        except PoolEmpty as empty:
            why = str(empty)
        finally:
            pools.unreserve(pool, call.principal)
    return await create_cold_from_pool(call, pool, env, why)


async def lease_from_pool(call: Call, pool: WarmPool, env: dict) -> dict:
    """Lease a clean worker of ``pool`` for this call's caller and session,
    held as its ephemeral machine; raise PoolEmpty when the engine has
    none to give."""
    local = call.app.local
    # A fresh key a call; only its own retry (LocalFleet.lease) reuses it.
    key = secrets_module.token_hex(16)
    waiting = f"leasing a machine from the pool '{pool.name}'"
    try:
        answer, seconds = await call.create(
            local.lease, pool.name, key, env, waiting=waiting
        )
    except ApiError as err:
        raise pool_empty(call, pool.name, err) or err from None
    lease = held_lease(call, pool, answer)
    name = lease.machine
    try:
        record = await record_pooled(call, name)
        identity = machine_identity(record)
        call.session.identities[(local.name, name)] = identity
        if answer.get("state") != "active":
            # Not handed over booted: wait as for any other machine.
            await wait_until_ready(call, name)
    except BaseException:
        await complete_quietly(call, name)
        raise
    if call.session.ended:
        # As in create_recorded: its cleanup came too early to see it.
        await complete_quietly(call, name)
        raise SmolError(
            f"the session ended while '{name}' was being leased, so its "
            "lease was completed at once; open a new session and ask again"
        )
    return {
        "machine": record,
        "ephemeral": True,
        "ready": True,
        "warm": True,
        "pool": pool.name,
        "readyMs": round(seconds * 1000),
    }


async def complete_quietly(call: Call, name: str) -> None:
    """Complete the lease of a pooled machine this call leased, even while
    the call is cancelled, and forget it; as Call.delete_quietly, but on
    the fleet itself (a sandbox's view may not own it yet)."""
    complete = functools.partial(call.app.local.delete_machine, name)
    with anyio.CancelScope(shield=True):
        try:
            with anyio.fail_after(CLEANUP_TIMEOUT_SECS):
                await anyio.to_thread.run_sync(
                    complete, abandon_on_cancel=True
                )
        except Exception as err:
            log.warning("could not complete the lease of %s: %s", name, err)
            return
    try:
        call.forget(name)
    except SmolError as err:
        log.warning("the lease of %s is completed; %s", name, err)


def pool_empty(call: Call, pool: str, err: ApiError) -> PoolEmpty | None:
    """PoolEmpty for the engine's answer that ``pool`` has no worker to
    give (none clean, at its lease limit, or gone), else None."""
    if err.status == 503:
        why = (
            f"the pool '{pool}' had no clean worker ready (its workers are "
            "leased, or still booting)"
        )
    elif err.status == 409 and "lease limit" in err.api_message:
        why = f"the pool '{pool}' is at its limit of active leases"
    elif err.status == 404 and "fork pool" in err.api_message:
        call.app.pools.lost(pool)
        why = f"the pool '{pool}' is not available: {POOL_LOST}"
    else:
        return None
    return PoolEmpty(why)


def held_lease(call: Call, pool: WarmPool, answer: Any) -> Lease:
    """Hold the lease the engine answered for this call's caller and
    session (its heartbeats start); raise SmolError when the answer is not
    a lease."""
    lease_id = answer.get("id") if isinstance(answer, dict) else None
    name = answer.get("machine") if isinstance(answer, dict) else None
    if not isinstance(lease_id, str) or not NAME_RE.fullmatch(str(name)):
        raise SmolError(
            f"the engine answered a lease from the pool '{pool.name}' in a "
            f"form this server cannot read ({str(answer)[:200]}); it ends "
            "at its TTL"
        )
    ttl = LEASE_TTL_DEFAULT_SECS
    created = answer.get("createdAt")
    expires = answer.get("expiresAt")
    if isinstance(created, int) and isinstance(expires, int):
        ttl = max(1, expires - created)
    lease = Lease(
        pool.name,
        lease_id,
        name,
        call.principal.name,
        call.session,
        lease_beat_secs(ttl),
    )
    call.app.local.leases.add(lease)
    return lease


async def record_pooled(call: Call, name: str) -> dict:
    """The leased machine's record, asked of the engine while its session
    record (naming the lease, for the crash sweep) and then its owner are
    written in a worker thread, off the event loop; raise what either
    raised. In that order: the sweep clears the owners of what it finds
    recorded."""
    local = call.app.local
    failed = []

    def write() -> None:
        try:
            call.session.remember(local.name, name)
            call.app.access.owners.claim(local.name, name, call.principal.name)
        except Exception as err:
            # Carried out of the group, which would wrap it in a group.
            failed.append(err)

    async with anyio.create_task_group() as group:
        group.start_soon(functools.partial(anyio.to_thread.run_sync, write))
        # On the event loop where it can be (a quick read), else a thread.
        record = await local.read_now(local.get_machine, name)
        if record is None:
            record = await call.api(local.get_machine, name)
    if failed:
        raise failed[0]
    return record


async def create_cold_from_pool(
    call: Call, pool: WarmPool, env: dict, why: str
) -> dict:
    """A machine made cold from ``pool``'s spec, as create-machine makes
    any: the result says it is not warm, and ``why``."""
    args = {"image": pool.image}
    if pool.cpus:
        args["cpus"] = pool.cpus
    if pool.memory_mb:
        args["memoryMb"] = pool.memory_mb
    if pool.network:
        args["network"] = pool.network
    if pool.allow_hosts:
        args["allowHosts"] = list(pool.allow_hosts)
    if pool.allow_cidrs:
        args["allowCidrs"] = list(pool.allow_cidrs)
    if env:
        args["env"] = env
    await call.progress(None, f"{why}: creating one cold from its spec")
    started = time.monotonic()
    try:
        created = await tool_create_machine(call, args)
    except SmolError as err:
        raise SmolError(
            f"{why}, and a machine made cold from the pool's spec failed "
            f"too: {err}"
        ) from None
    cold = (
        f"{why}, so this machine was made cold from the pool's spec "
        f"({pool.image}); it is ephemeral like a pooled one"
    )
    return {
        **created,
        "warm": False,
        "pool": pool.name,
        "readyMs": round((time.monotonic() - started) * 1000),
        "why": cold,
    }


@tool(
    "Run a command in a machine",
    "Run a command inside the named machine (never on this host) and "
    "return its stdout, stderr and exit code. A non-zero exit is a result, "
    "not an error. Output beyond the budget keeps its head and tail, and "
    "the whole stream is saved in the machine at the path listed in "
    "overflow. A stopped machine is started first. On the local fleet a "
    "failed command lists the connections the egress policy refused "
    "(egressDenied). A paused machine is resumed first. With shell, it "
    "runs in that named shell of the machine: the directory and exported "
    "variables it ends with are where the next command in the shell starts "
    "(cwd in the result).",
    _input("name command", name=ARG_NAME, **ARG_EXEC, shell=ARG_SHELL),
    _out(
        {**OUT_EXEC_PROPERTIES, **OUT_RESUMED},
        {**OUT_EXEC_EGRESS, **_types("cwd:string?")},
    ),
    "exec: destructive open_world",
)
async def tool_run_command(call: Call, args: dict) -> dict:
    name = args["name"]
    options = exec_options(args, call.config.exec_timeout_secs)
    since = datetime.datetime.now(datetime.UTC)
    argv = command_argv(args["command"])
    shell = args.get("shell")
    if shell:
        argv, marker = shell_argv(args, options, "save")
    run = functools.partial(run_in_machine, call, name, argv, **options)
    result, woke = await on_running(call, name, run)
    if shell:
        refuse_shell(result, marker, name, shell)
    shaped = await budget_exec(
        call, name, result, options["timeout_secs"], since, once=False
    )
    answer = {
        **shaped,
        "startedMachine": woke == "started",
        "resumedMachine": woke == "resumed",
    }
    if shell:
        # What the shell saved (as it was, if the command was killed).
        answer["cwd"] = await shell_cwd(call, name, shell)
    return answer


@tool(
    "Run a command in a throwaway machine",
    "Create a machine from an image, run one command in it, and delete the "
    "machine on every path (success, failure, timeout, cancellation). "
    'Egress is blocked unless network is "open" or an allow-list is given.',
    _input(
        "image command",
        image=ARG_IMAGE,
        **ARG_EXEC,
        **SIZE_ARGS,
        **NETWORK_ARGS,
    ),
    _out(
        {**OUT_EXEC_PROPERTIES, **OUT_RESUMED, "name": {"type": "string"}},
        OUT_EXEC_EGRESS,
    ),
    "exec: open_world",
)
async def tool_run_once(call: Call, args: dict) -> dict:
    options = exec_options(args, call.config.exec_timeout_secs)
    name = call.new_ephemeral_name()
    spec = await machine_spec(call, args, name, call.config.run_once_network)
    try:
        await call.progress(None, f"creating {name} from {spec.image}")
        await create_recorded(call, name, call.fleet.create_machine, spec)
        try:
            await start_and_wait(call, name, mounts=spec.mounts)
        except Exception as err:
            raise await start_failure(call, name, err, spec.network) from None
        since = datetime.datetime.now(datetime.UTC)
        result = await run_in_machine(
            call, name, command_argv(args["command"]), **options
        )
        shaped = await budget_exec(
            call,
            name,
            result,
            options["timeout_secs"],
            since,
            once=True,
            network=spec_egress(spec),
        )
        # Its own new machine: nothing was stopped or paused before.
        woke = {"startedMachine": False, "resumedMachine": False}
        return {**shaped, **woke, "name": name}
    finally:
        # Every path: success, error, timeout, cancellation.
        await call.delete_quietly(name)


@tool(
    "Read a file from a machine",
    "Read a file inside the named machine, a page at a time: offset and "
    "length pick the bytes, size is the whole file, eof says whether this "
    "page reached its end. Never returns more than the output budget. "
    "Starts a stopped machine, resumes a paused one.",
    _input(
        "name path",
        name=ARG_NAME,
        path=ARG_PATH,
        encoding=ARG_ENCODING,
        offset=_integer(
            "First byte to read (default 0).",
            minimum=0,
            maximum=MAX_FILE_OFFSET,
        ),
        length=_integer(
            "Bytes to read (default and maximum: the output budget).",
            maximum=MAX_READ_LENGTH,
        ),
    ),
    _out(
        "path:string content:string encoding:string size:integer "
        "offset:integer bytes:integer eof:boolean startedMachine:boolean "
        "resumedMachine:boolean"
    ),
    # Not read-only: it starts a stopped machine.
    "exec: idempotent",
)
async def tool_read_file(call: Call, args: dict) -> dict:
    name = args["name"]
    path = guest_path(args["path"])
    encoding = args.get("encoding", "utf8")
    offset = args.get("offset", 0)
    limit = call.config.max_output_bytes
    length = min(args.get("length", limit), limit)
    read = functools.partial(
        call.api, call.fleet.read_file, name, path, offset, length
    )
    page, woke = await on_running(call, name, read)
    tokens = reply_tokens(call.config)
    if encoding == "utf8":
        data, content = utf8_page(page, path, offset, length, tokens)
    else:
        data, content = base64_page(page.data, tokens)
    shown = {
        "path": path,
        "content": content,
        "encoding": encoding,
        "size": page.size,
    }
    shown.update(
        offset=offset, bytes=len(data), eof=offset + len(data) >= page.size
    )
    return {
        **shown,
        "startedMachine": woke == "started",
        "resumedMachine": woke == "resumed",
    }


def utf8_page(
    page: FilePage, path: str, offset: int, length: int, tokens: int
) -> tuple[bytes, str]:
    """The bytes of a read-file page that fit ``tokens`` and their text,
    ending on a whole character unless the file ends there; raise
    ArgumentError when they are not UTF-8 text."""
    data = page.data
    if offset + len(data) < page.size:
        # End the page on a character boundary.
        data = data[: utf8_prefix_end(data, len(data))]
        if not data and page.data:
            raise ArgumentError(
                f'"length" {length} is too short for the character at offset '
                f"{offset}; ask for at least 4 bytes"
            )
    data = data[: prefix_within_tokens(data, tokens)]
    try:
        return data, data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ArgumentError(
            f"{path} is not UTF-8 text (byte {offset + err.start} is not); "
            'read it with encoding: "base64", or start at another offset'
        ) from None


def base64_page(data: bytes, tokens: int) -> tuple[bytes, str]:
    """The bytes of a read-file page whose base64 fits ``tokens``, and
    that base64."""
    content = base64.b64encode(data).decode("ascii")
    fits = within_tokens(content, tokens)
    if fits < len(content):
        # A base64 prefix of 4k characters is the encoding of the first
        # 3k bytes.
        data = data[: fits // 4 * 3]
        content = content[: fits // 4 * 4]
    return data, content


@tool(
    "Write a file into a machine",
    "Write a file inside the named machine, replacing any file at that "
    "path and creating parent directories. Waits until the guest runs "
    "commands first, so the file is not hidden by the workload's file "
    "system. Starts a stopped machine, resumes a paused one.",
    _input(
        "name path content",
        name=ARG_NAME,
        path=ARG_PATH,
        content=_string("The file's content."),
        encoding=ARG_ENCODING,
    ),
    _out(
        "path:string bytes:integer startedMachine:boolean "
        "resumedMachine:boolean"
    ),
    "exec: destructive idempotent",
)
async def tool_write_file(call: Call, args: dict) -> dict:
    name = args["name"]
    path = guest_path(args["path"])
    encoding = args.get("encoding", "utf8")
    data = args["content"].encode("utf-8")
    if encoding == "base64":
        try:
            data = base64.b64decode(data, validate=True)
        except ValueError:
            raise ArgumentError(
                '"content" is not valid base64; send the bytes '
                'base64-encoded, or pass encoding: "utf8" for text'
            ) from None
    # Ready first: a file written before the workload's file system is up
    # would be mounted over.
    action = f"write {path} in machine '{name}'"
    woke = await ready_or_woken(call, name, action)
    written = await call.api(call.fleet.write_file, name, path, data)
    return {
        "path": path,
        "bytes": written,
        "startedMachine": woke == "started",
        "resumedMachine": woke == "resumed",
    }


@tool(
    "Start a machine",
    "Start a stopped machine and (by default) wait until a command has run "
    "in it. A running machine is left as it is; a paused one is refused "
    "(resume-machine resumes it).",
    _input("name", name=ARG_NAME, wait=ARG_WAIT),
    _out({"machine": OUT_MACHINE, **_types("ready:boolean")}),
    "manage: idempotent open_world",
)
async def tool_start_machine(call: Call, args: dict) -> dict:
    name = args["name"]
    wait = args.get("wait", True)
    # The fleet reads the machine (a running one is left as it is).
    try:
        record = await call.api(call.fleet.start_machine, name)
    except Exception as err:
        # Unread here: an engine that needs egress to pull says the
        # machine has none.
        raise explain_start_failure(err, None) from None
    if wait:
        await wait_until_ready(call, name)
    return {"machine": record, "ready": wait}


@tool(
    "Branch a machine",
    "Copy a running branch source (created with branchable: true), memory "
    "and disks included, into a new child machine that starts where the "
    "source is. Without childName the child is ephemeral. Branching on the "
    "local fleet needs a Linux or macOS host.",
    _input(
        "name",
        name={
            **ARG_NAME,
            "description": "The running, branchable source machine.",
        },
        childName={
            **ARG_NAME,
            "description": "Name for the child; omit for an ephemeral one.",
        },
        wait=ARG_WAIT,
    ),
    OUT_CREATED,
    "manage",
)
async def tool_branch_machine(call: Call, args: dict) -> dict:
    source = args["name"]
    wait = args.get("wait", True)
    child = args.get("childName") or call.new_ephemeral_name()
    owner = call.app.access.owners.owner(call.fleet.name, source)
    try:
        branch = call.fleet.branch_machine
        record = await create_recorded(
            call, child, branch, source, child, owner=owner
        )
    except ApiError as err:
        words = ("forkable", "control socket", "branchable")
        if err.status == 409 and any(
            word in err.api_message for word in words
        ):
            raise err.with_hint(
                "The source must be running and created as a branch source: "
                "create-machine with branchable: true, then branch it while "
                "it runs"
            ) from None
        raise
    if wait:
        try:
            await wait_until_ready(call, child)
        except BaseException:
            await call.delete_quietly(child)
            raise
    return {
        "machine": record,
        "ephemeral": call.session.is_ephemeral(child),
        "ready": wait,
    }


@tool(
    "Stop a machine",
    "Stop the named machine. Its disks are kept; start-machine starts it "
    "again. Whatever runs in it is ended. A paused machine is refused "
    "(resume-machine, or delete-machine).",
    ARG_NAME_ONLY,
    _out({"machine": OUT_MACHINE}),
    "manage: destructive idempotent",
)
async def tool_stop_machine(call: Call, args: dict) -> dict:
    return {"machine": await call.api(call.fleet.stop_machine, args["name"])}


@tool(
    "Delete a machine",
    "Delete the named machine and its disks for good. Anything not copied "
    "out of it is lost.",
    ARG_NAME_ONLY,
    _out("deleted:string", _types("usage:object")),
    "manage: destructive",
)
async def tool_delete_machine(call: Call, args: dict) -> dict:
    try:
        result = await call.api(call.fleet.delete_machine, args["name"])
    except ApiError as err:
        # A local saved state is a branch of its source, which the engine
        # may keep while the state's copy depends on it.
        if err.status == 409 and STATE_MACHINE_PREFIX in err.api_message:
            raise err.with_hint(STATE_OF_IT) from None
        raise
    call.forget(args["name"])
    return result


STATE_OF_IT = (
    "A saved state made from this machine (named in smol-state-STATE "
    "above) depends on it: delete-state that state first, then delete the "
    "machine"
)


def log_cursor(lines: list[str], end: int) -> str:
    """Where a reader stopped: lines seen and a digest of the last few
    (one line recurs), so the place is found again when the cloud's tail
    window (its log route has no cursor) has moved."""
    if end == 0:
        return "0:"
    last = "\n".join(lines[max(0, end - CURSOR_LINES) : end]).encode()
    return f"{end}:{hashlib.sha256(last).hexdigest()[:12]}"


def lines_after_cursor(lines: list[str], cursor: str) -> int:
    """The index of the first line a reader holding ``cursor`` has not
    seen."""
    count, _, digest = cursor.partition(":")
    if not count.isdigit():
        raise ArgumentError(
            '"cursor" must be a cursor returned by machine-logs, got '
            f"{cursor!r}"
        )
    seen = int(count)
    if seen == 0 or seen <= len(lines) and log_cursor(lines, seen) == cursor:
        # From the start, or the window has not moved.
        return seen
    # The window moved: find the run of lines last seen.
    for end in range(len(lines), 0, -1):
        if log_cursor(lines, end).partition(":")[2] == digest:
            return end
    # The log started again from scratch: all of it is new.
    return 0


@tool(
    "Read a machine's log",
    "Read the latest lines of the machine's guest console. Pass the cursor "
    "from the last call to get only what arrived since. Changes nothing.",
    _input(
        "name",
        name=ARG_NAME,
        tail=_integer(
            "How many of the latest lines (default SMOL_MCP_LOGS_TAIL).",
            maximum=100000,
        ),
        cursor=_string("The cursor from the previous machine-logs call."),
    ),
    _out("lines:string[] cursor:string"),
    "read: read_only",
)
async def tool_machine_logs(call: Call, args: dict) -> dict:
    """The guest console; with the last cursor, only what arrived since."""
    lines = await call.api(call.fleet.console_lines, args["name"])
    if "cursor" in args:
        start = lines_after_cursor(lines, args["cursor"])
    else:
        start = max(0, len(lines) - args.get("tail", call.config.logs_tail))
    picked = []
    used = 0
    budget = reply_tokens(call.config)
    for line in lines[start:]:
        used += len(line.encode()) + 1
        # Its quotes, comma and indent.
        cost = est_tokens(line) + 3
        if picked and (used > call.config.max_output_bytes or cost > budget):
            # The rest comes with the next cursor.
            break
        # A line alone over the budget is cut to it.
        picked.append(line[: within_tokens(line, budget - 3)])
        budget -= cost
    return {"lines": picked, "cursor": log_cursor(lines, start + len(picked))}


# -- machines that keep their state: pause and resume, saved states


@tool(
    "Pause a machine",
    "Pause the named running machine: its memory, disks and running "
    "processes are saved, and it stops using CPU and memory. "
    "resume-machine resumes it where it stopped, and so does a "
    "run-command, read-file, write-file or start-job on it. A paused "
    "machine is left as it is.",
    ARG_NAME_ONLY,
    _out({"machine": OUT_MACHINE, **_types("paused:boolean")}),
    "manage: idempotent",
)
async def tool_pause_machine(call: Call, args: dict) -> dict:
    name = args["name"]
    record, _ = await call.api(
        call.fleet.pause_machine, name, waiting=f"pausing '{name}'"
    )
    return {"machine": record, "paused": True}


@tool(
    "Resume a machine",
    "Resume a paused machine where it stopped, its memory and processes as "
    "they were, and wait until a command has run in it. resumedMs is how "
    "long that took; a running machine is left as it is (resumedMs 0).",
    ARG_NAME_ONLY,
    _out(
        {"machine": OUT_MACHINE, **_types("ready:boolean resumedMs:integer")}
    ),
    "manage: idempotent",
)
async def tool_resume_machine(call: Call, args: dict) -> dict:
    """resumedMs: from the resume request until a command ran; 0 when the
    machine was running (its readiness is still checked)."""
    started = time.monotonic()
    record, resumed = await resume_and_wait(call, args["name"])
    took = 0
    if resumed:
        took = int((time.monotonic() - started) * 1000)
    return {"machine": record, "ready": True, "resumedMs": took}


OUT_STATE = _out(
    "state:string fleet:string source:string? createdAt:string? "
    "ephemeral:boolean status:string? sizeBytes:integer?",
    description=(
        "A saved state: the machine it was saved from, when, whether it "
        "ends with this session, and its status: saving until its save "
        "answered, then ready (on the cloud the checkpoint's own status, "
        "with its size)."
    ),
)


def state_owner(call: Call) -> str | None:
    """The owner whose states alone the caller sees (a sandbox.* token's
    own, its fleet wrapped as an OwnedFleet), or None for all."""
    if isinstance(call.fleet, OwnedFleet):
        return call.principal.name
    return None


def find_state(call: Call, state: str) -> dict:
    """The record of saved state ``state`` as the caller may see it; raise
    ArgumentError as for a missing one when it is another's (to a sandbox
    token) or not there."""
    found = call.app.access.states.find(
        call.fleet.name, state, state_owner(call)
    )
    if found is None:
        raise ArgumentError(
            f"there is no saved state named '{state}' on the "
            f"{call.fleet.name} fleet; list-states shows them"
        )
    return found


def state_view(call: Call, state: str, record: dict) -> dict:
    """A saved state as the tools show it."""
    status = record.get("status")
    if not record.get("ref"):
        # Claimed, and its save has not answered (or never finished).
        status = "saving"
    return {
        "state": state,
        "fleet": call.fleet.name,
        "source": record.get("source"),
        "createdAt": record.get("createdAt"),
        "ephemeral": call.session.is_ephemeral(state),
        "status": status,
        "sizeBytes": record.get("sizeBytes"),
    }


@tool(
    "Save a machine as a state",
    "Save a running machine's memory and disks as a named state, leaving "
    "the machine running; create-machine with from: STATE starts new "
    "machines from it, each where the machine was when saved. A state "
    "named with the ephemeral prefix (mcp- by default) is deleted when this "
    "session ends; any other persists until delete-state. Locally the "
    "machine must be a branch source (created with branchable: true). A "
    "state uses disk on the host (local) or the account's storage (cloud).",
    _input("name state", name=ARG_NAME, state=ARG_STATE),
    _out({"state": OUT_STATE}),
    "manage",
)
async def tool_save_machine(call: Call, args: dict) -> dict:
    """Claim the name first (its bound, its uniqueness), then save; the
    claim goes if the save fails."""
    name = args["name"]
    state = args["state"]
    fleet = call.fleet.name
    states = call.app.access.states
    claim = states.claim(fleet, state, call.principal.name)
    ephemeral = call.session.is_ephemeral(state)
    if ephemeral:
        # Recorded before the engine is asked: a crash still cleans up.
        call.session.remember_state(fleet, state, claim)
    waiting = f"saving '{name}' as '{state}'"
    try:
        saved = await call.create(
            call.fleet.save_state, name, state, waiting=waiting
        )
    except BaseException:
        states.release(fleet, state, claim)
        call.session.forget_state(fleet, state)
        raise
    record = states.settle(fleet, state, claim, source=name, **saved)
    if record is None or (ephemeral and call.session.ended):
        await discard_saved(call, state, saved, record is None)
    return {"state": state_view(call, state, record)}


async def discard_saved(
    call: Call, state: str, saved: dict, deleted: bool
) -> None:
    """Delete a state this call saved that nobody may use: one deleted
    (``deleted``) while it was saved, or an ephemeral one whose session
    ended meanwhile (its cleanup had run). Raise SmolError saying so."""
    delete = functools.partial(call.fleet.delete_state, saved)
    with anyio.CancelScope(shield=True):
        try:
            await anyio.to_thread.run_sync(delete)
        except SmolError as err:
            log.warning("could not delete saved state %s: %s", state, err)
    call.app.access.states.forget(call.fleet.name, state)
    call.session.forget_state(call.fleet.name, state)
    if deleted:
        why = "delete-state deleted it while it was being saved"
    else:
        why = "the session ended while it was being saved"
    raise SmolError(
        f"the state '{state}' was discarded at once: {why}. Save it again "
        "if it is still wanted"
    )


@tool(
    "List saved states",
    "List the saved states (save-machine) on the fleet: each one's name, "
    "the machine it was saved from, when, and whether it ends with this "
    "session. Changes nothing.",
    _object({}),
    _out({"states": {"type": "array", "items": OUT_STATE}}),
    "read: read_only idempotent",
)
async def tool_list_states(call: Call, args: dict) -> dict:
    """From this server's record alone: no engine request (the cloud has
    no route listing every checkpoint)."""
    records = call.app.access.states.records(
        call.fleet.name, state_owner(call)
    )
    return {
        "states": [
            state_view(call, state, record)
            for state, record in sorted(records.items())
        ]
    }


@tool(
    "Delete a saved state",
    "Delete a saved state for good, with its memory image and disks. "
    "Machines made from it are not deleted, and while they exist the "
    "engine keeps the state: delete them first.",
    _input("state", state=ARG_STATE),
    _out("deleted:string"),
    "manage: destructive",
)
async def tool_delete_state(call: Call, args: dict) -> dict:
    state = args["state"]
    saved = find_state(call, state)
    if saved.get("ref"):
        try:
            await call.api(call.fleet.delete_state, saved)
        except ApiError as err:
            if err.status == 409:
                raise err.with_hint(STATE_IN_USE) from None
            raise
    call.app.access.states.forget(call.fleet.name, state)
    call.session.forget_state(call.fleet.name, state)
    return {"deleted": state}


STATE_IN_USE = (
    "Machines made from this state still depend on it: delete them "
    "(delete-machine) first, then call delete-state again"
)
# With from, the one other argument create-machine takes.
FROM_FIXES = (
    "a saved state fixes the image, size, egress, ports, mounts, "
    "environment and command of a machine made from it"
)


async def create_from_state(call: Call, args: dict) -> dict:
    """create-machine {from}: a new machine from a saved state, which
    fixes everything but its name, ready once a command has run in it
    (deleted again when it does not get there)."""
    extra = [key for key in args if key not in ("from", "name")]
    if extra:
        raise ArgumentError(
            f'"{extra[0]}" cannot be combined with "from": {FROM_FIXES}; '
            'pass only "name" with "from" (or no name, for an ephemeral '
            "machine)"
        )
    state = args["from"]
    saved = find_state(call, state)
    if not saved.get("ref"):
        raise ArgumentError(
            f"the state '{state}' is still being saved (or its save did "
            "not finish); list-states shows it, and delete-state forgets "
            "one that never will"
        )
    name = args.get("name") or call.new_ephemeral_name()
    restore = call.fleet.restore_state
    try:
        record = await create_recorded(call, name, restore, saved, name)
    except ApiError as err:
        if err.status == 404:
            raise state_gone(call, state) from None
        raise
    try:
        if record["state"] in RUNNING_STATES:
            await wait_until_ready(call, name)
        else:
            record = await start_and_wait(call, name)
    except BaseException as err:
        failure = await start_failure(call, name, err, record["network"])
        await call.delete_quietly(name)
        if isinstance(err, Exception):
            raise failure from None
        raise
    ephemeral = call.session.is_ephemeral(name)
    return {"machine": record, "ephemeral": ephemeral, "ready": True}


def state_gone(call: Call, state: str) -> SmolError:
    """The error for a state whose engine copy is gone."""
    return SmolError(
        f"the saved state '{state}' has no copy left on the "
        f"{call.fleet.name} fleet (it was deleted outside this server), so "
        "no machine can start from it; delete-state forgets it"
    )


@tool(
    "Pull an image into a machine",
    "Pull an OCI image into the named machine's image store (local fleet "
    "only; the machine is started to do it).",
    _input("name image", name=ARG_NAME, image=ARG_IMAGE),
    _out("image:object"),
    "manage: idempotent open_world",
    fleets=("local",),
    refusal=(
        "create-machine pulls a machine's image itself there, so pass the "
        "image to create-machine instead"
    ),
)
async def tool_pull_image(call: Call, args: dict) -> dict:
    name = args["name"]
    try:
        pulled = await call.api(call.fleet.pull_image, name, args["image"])
    except ApiError as err:
        if BAD_IMAGE_RE.search(err.api_message):
            raise err.with_hint(BAD_IMAGE_HINT + PRIVATE_REGISTRY) from None
        raise
    return {"image": pulled}


@tool(
    "Start a background job in a machine",
    "Start a command inside the named machine (never on this host) and "
    "return at once with its jobId. Use it for work longer than a tool "
    "call should wait (builds, test suites, servers): it keeps running "
    "after this call, the client and this server have gone, until it "
    "exits, its timeout (default 1 hour, at most 24) or cancel-job ends "
    "it, or the machine stops or is deleted. Read its output with "
    "read-job. A stopped machine is started first, a paused one resumed.",
    _input(
        "name command",
        name=ARG_NAME,
        command=ARG_COMMAND,
        timeoutSecs=_integer(
            "Seconds before the job is ended (default 3600, at most 86400)."
        ),
        workdir=ARG_WORKDIR,
        env=ARG_ENV,
        shell={
            **ARG_SHELL,
            "description": (
                "Start from this named shell's directory and exported "
                "variables (as run-command left them); the job changes "
                "neither."
            ),
        },
    ),
    _out(
        "jobId:string state:string timeoutSecs:integer startedMachine:boolean "
        "resumedMachine:boolean"
    ),
    "exec: destructive open_world",
)
async def tool_start_job(call: Call, args: dict) -> dict:
    name = args["name"]
    argv = command_argv(args["command"])
    options = exec_options(args, JOB_DEFAULT_TIMEOUT_SECS)
    if args.get("shell"):
        # A job writes no state back, so nothing can refuse it.
        argv, _ = shell_argv(args, options, "job")
    if options["timeout_secs"] > JOB_MAX_TIMEOUT_SECS:
        raise ArgumentError(
            f'"timeoutSecs" is {options["timeout_secs"]}, above the job '
            f"ceiling of {JOB_MAX_TIMEOUT_SECS} s (24 hours); ask for less, "
            "or have the job check in and start a new one"
        )
    # The local fleet's; the cloud names its own.
    job_id = f"job-{secrets_module.token_hex(6)}"
    start = functools.partial(
        call.api, call.fleet.start_job, name, job_id, argv, **options
    )
    job, woke = await on_running(call, name, start)
    call.app.access.owners.note_job(call.fleet.name, name, job, started=True)
    return {
        **job,
        "timeoutSecs": options["timeout_secs"],
        "startedMachine": woke == "started",
        "resumedMachine": woke == "resumed",
    }


@tool(
    "Read a job's output",
    "Show a job's state (running, exited or lost) and exit code, and a "
    "page of its stdout and stderr from offset, within the output budget. "
    "Pass nextOffset back as offset for the next page; eof says the job "
    "has ended and everything was read. Changes nothing.",
    _input(
        "name jobId", name=ARG_NAME, jobId=ARG_JOB_ID, offset=ARG_JOB_OFFSET
    ),
    _out(
        {
            **OUT_JOB_STATE,
            **_types("stdout:string stderr:string"),
            **OUT_JOB_PAGE,
        }
    ),
    "read: read_only",
)
async def tool_read_job(call: Call, args: dict) -> dict:
    name = args["name"]
    job_id = args["jobId"]
    offset = args.get("offset", {})
    offsets = (offset.get("stdout", 0), offset.get("stderr", 0))
    page = await call.api(
        call.fleet.read_job,
        name,
        job_id,
        offsets,
        call.config.max_output_bytes,
    )
    texts, next_offset = job_streams(page, offsets, reply_tokens(call.config))
    ends = zip(next_offset.values(), page.sizes)
    ended = page.state != "running"
    shaped = {
        "jobId": job_id,
        "state": page.state,
        "exitCode": page.exit_code,
        **texts,
        "nextOffset": next_offset,
        "eof": ended and all(at >= size for at, size in ends),
    }
    call.app.access.owners.note_job(call.fleet.name, name, shaped)
    return shaped


def job_streams(
    page: JobPage, offsets: tuple[int, int], tokens: int
) -> tuple[dict, dict]:
    """A read-job page's stdout and stderr texts, within ``tokens``
    between them, and where each stream continues; a page that more may
    follow ends on a whole character (its rest comes with the next)."""
    pages = []
    streams = (page.stdout, page.stderr)
    for data, start, size in zip(streams, offsets, page.sizes):
        if page.state == "running" or start + len(data) < size:
            data = data[: utf8_prefix_end(data, len(data))]
        pages.append(data)
    # Like run-command, both streams share one budget of tokens.
    costs = tuple(
        est_tokens(data.decode("utf-8", "surrogateescape")) for data in pages
    )
    shares = stream_shares((costs[0], costs[1]), tokens)
    texts = {}
    next_offset = {}
    names = ("stdout", "stderr")
    for stream, data, share, start in zip(names, pages, shares, offsets):
        data = data[: prefix_within_tokens(data, share)]
        texts[stream] = data.decode("utf-8", "replace")
        next_offset[stream] = start + len(data)
    return texts, next_offset


@tool(
    "Cancel a job",
    "End a running job and what it started (TERM, then KILL after a few "
    "seconds). A job that has already ended is left as it is, so repeating "
    "the call is harmless.",
    _input("name jobId", name=ARG_NAME, jobId=ARG_JOB_ID),
    _out(OUT_JOB_STATE),
    "exec: destructive idempotent",
)
async def tool_cancel_job(call: Call, args: dict) -> dict:
    name = args["name"]
    job_id = args["jobId"]
    await call.api(call.fleet.cancel_job, name, job_id)
    page = await call.api(call.fleet.read_job, name, job_id, (0, 0), 0)
    shown = {"jobId": job_id, "state": page.state, "exitCode": page.exit_code}
    call.app.access.owners.note_job(call.fleet.name, name, shown)
    return shown


HOST_LABEL_RE = re.compile(r"[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?")
EGRESS_ALLOW = {
    "type": "boolean",
    "title": "Allow this egress change",
    "description": (
        "true to apply it; false (or decline) leaves the machine as it is"
    ),
}
EGRESS_QUESTION_SCHEMA = dict(
    type="object", required=["allow"], properties={"allow": EGRESS_ALLOW}
)
EGRESS_409_HINT = (
    "The engine applies this change only to a stopped machine (a running "
    "one keeps its current kind of policy). allow-egress never stops a "
    "machine itself: stop it with stop-machine (whatever runs in it ends), "
    "call allow-egress again, then start it with start-machine"
)


# Never reachable through an allow list: the host itself, the cloud's
# metadata service, and spellings of them. Private ranges only as
# egressPrivateCidrs allows.
EGRESS_FORBIDDEN = [
    (ipaddress.ip_network(cidr), why)
    for why, cidrs in (
        ("unspecified", "0.0.0.0/8"),
        ("loopback: the host's own services", "127.0.0.0/8"),
        (
            "link-local, where cloud metadata (169.254.169.254) lives",
            "169.254.0.0/16 fe80::/10",
        ),
        ("multicast, reserved or broadcast", "224.0.0.0/3 ff00::/8"),
        ("unspecified, loopback or IPv4-compatible", "::/96"),
        (
            "IPv4-mapped or NAT64: it reaches IPv4",
            "::ffff:0:0/96 64:ff9b::/96 64:ff9b:1::/48",
        ),
        (
            "private",
            "10.0.0.0/8 172.16.0.0/12 192.168.0.0/16 100.64.0.0/10 fc00::/7",
        ),
    )
    for cidr in cidrs.split()
]
# Bare public suffixes: a name under one is someone else's site, the
# suffix is everyone's.
PUBLIC_SUFFIXES = frozenset(
    "co.uk org.uk ac.uk gov.uk me.uk com.au net.au org.au co.nz co.jp "
    "ne.jp co.kr co.in co.za com.br com.cn com.mx com.tr com.tw com.hk "
    "com.sg github.io gitlab.io pages.dev workers.dev netlify.app "
    "vercel.app web.app firebaseapp.com appspot.com herokuapp.com "
    "blogspot.com cloudfront.net amazonaws.com s3.amazonaws.com "
    "azurewebsites.net fly.dev onrender.com ngrok.io ngrok-free.app "
    "repl.co glitch.me".split()
)


# DNS services whose names answer the address they spell
# (169.254.169.254.nip.io, 10-0-0-1.sslip.io) or the host's own loopback
# (anything.localtest.me): any name under one can name the host.
ADDRESS_NAME_DOMAINS = frozenset(
    "nip.io sslip.io xip.io traefik.me localtest.me lvh.me vcap.me "
    "localho.st".split()
)
# Top-level names private networks give their own hosts, never a public
# site, and what each names.
PRIVATE_NETWORK = "a private network's own hosts"
INTERNAL_NAME_SUFFIXES = {
    "internal": (
        "a private network's own hosts (host.docker.internal is this host, "
        "metadata.google.internal the cloud's metadata service at "
        "169.254.169.254)"
    ),
    "localdomain": "this host (localhost.localdomain is 127.0.0.1)",
    "local": "hosts on the local link or in a cluster (*.cluster.local)",
    "svc": "a cluster's services (kubernetes.default.svc is its API server)",
    "default": "a cluster's services (kubernetes.default is its API server)",
    "arpa": (
        "addresses themselves (in-addr.arpa, ip6.arpa) or a home network "
        "(home.arpa)"
    ),
    "lan": PRIVATE_NETWORK,
    "home": PRIVATE_NETWORK,
    "corp": PRIVATE_NETWORK,
    "intranet": PRIVATE_NETWORK,
    "private": PRIVATE_NETWORK,
}
# An IPv4 address spelled with dashes inside one label (10-0-0-1).
DASHED_IPV4_RE = re.compile(r"(?<![0-9])(\d{1,3}(?:-\d{1,3}){3})(?![0-9])")
# How long adding names to an allow list waits for this host's resolver;
# a name with no answer by then counts as one that does not resolve.
EGRESS_RESOLVE_SECS = 3


def egress_refusal(network: Any, config: Config) -> str | None:
    """Why an allow list may not hold this range (it touches a forbidden
    one), or None."""
    for cidr in config.egress_private_cidrs:
        allowed = ipaddress.ip_network(cidr)
        if allowed.version == network.version and network.subnet_of(allowed):
            return None
    for forbidden, why in EGRESS_FORBIDDEN:
        same_version = forbidden.version == network.version
        if same_version and network.overlaps(forbidden):
            return f"{forbidden} is {why}"
    return None


def egress_host(value: str, where: str, pattern: bool, config: Config) -> str:
    """A host name (with ``pattern``, or `*.domain`) the engine accepts,
    lower-cased; never an address in any spelling, a loopback name, or a
    whole top-level domain or public suffix."""
    host = value.lower()
    wildcard = pattern and host.startswith("*.")
    name = host[2:] if wildcard else host
    address = host_address(name)
    if address is not None:
        why = egress_refusal(ipaddress.ip_network(address), config)
        if why:
            fix = f", which no allow list may reach: {why}"
        else:
            prefix = f"{address}/{address.max_prefixlen}"
            fix = f"; pass it in cidrs as {prefix} instead"
        raise ArgumentError(
            f'"{where}" is the address {address} ({value!r}){fix}'
        )
    validate_host_name(name, value, where, pattern, wildcard)
    refuse_host_range_name(name, value, where, config)
    return host


def host_address(
    name: str,
) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """The IP address ``name`` spells, also as a resolver reads it
    (2130706433, 0x7f.1, 0177.0.0.1); None for a host name."""
    try:
        return ipaddress.ip_address(name)
    except ValueError:
        pass
    if re.fullmatch(r"[0-9a-fx.]+", name) and re.search(r"\d", name):
        try:
            return ipaddress.ip_address(socket.inet_aton(name))
        except OSError:
            pass
    return None


def validate_host_name(
    name: str, value: str, where: str, pattern: bool, wildcard: bool
) -> None:
    """Raise ArgumentError unless ``name`` (``value`` without its *. when
    a ``wildcard``) is a host name the engine accepts and that names one
    site: no top-level domain, public suffix or loopback name."""
    if "*" in name:
        if pattern:
            what = "hostPatterns takes only *.domain"
        else:
            what = "hosts takes no wildcards; use hostPatterns"
        raise ArgumentError(f'"{where}" is {value!r}: {what}')
    labels = name.split(".")
    well_formed = all(HOST_LABEL_RE.fullmatch(label) for label in labels)
    if len(name) > 253 or not well_formed:
        raise ArgumentError(
            f'"{where}" is not a host name: {value!r}. Pass a name such as '
            "pypi.org: letters, digits and hyphens in dot-separated labels"
        )
    if len(labels) < 2 or name in PUBLIC_SUFFIXES:
        if wildcard:
            covers = "every host in that domain"
        else:
            covers = "every host under it"
        raise ArgumentError(
            f'"{where}" is {value!r}, which would cover {covers} (a '
            "top-level domain or public suffix, with sites of many owners); "
            "name a host such as pypi.org"
        )
    if name == "localhost" or name.endswith(".localhost"):
        raise ArgumentError(
            f'"{where}" is {value!r}, a name of the host itself (loopback)'
        )


def refuse_host_range_name(
    name: str, value: str, where: str, config: Config
) -> None:
    """Raise ArgumentError when host name ``name`` (``value`` as given)
    stands for an address no allow list may reach: under a DNS service
    that spells addresses, a private network's own name, or a name that
    spells such an address."""
    for domain in ADDRESS_NAME_DOMAINS:
        if name == domain or name.endswith("." + domain):
            raise ArgumentError(
                f'"{where}" is {value!r}, under {domain}, a DNS service '
                "whose names answer the address they spell (or the host's "
                "own loopback), so it can name the host or its network, "
                "which no allow list may reach. Name the site itself"
            )
    top = name.rsplit(".", 1)[-1]
    if top in INTERNAL_NAME_SUFFIXES:
        raise ArgumentError(
            f'"{where}" is {value!r}: .{top} names '
            f"{INTERNAL_NAME_SUFFIXES[top]}, never a public site, so no "
            "allow list may reach it. For a host on the operator's own "
            "network, the operator lists its range in egressPrivateCidrs "
            "(SMOL_MCP_EGRESS_PRIVATE_CIDRS); then pass its address in cidrs"
        )
    for address in spelled_addresses(name):
        why = egress_refusal(ipaddress.ip_network(address), config)
        if why:
            raise ArgumentError(
                f'"{where}" is {value!r}, a name that spells the address '
                f"{address}, which no allow list may reach: {why}. Name the "
                "site by its own name"
            )


def spelled_addresses(name: str) -> list[Any]:
    """The IP addresses host name ``name`` spells, as the DNS services
    that answer them read it: four labels (10.0.0.1.example), dashes in a
    label (10-0-0-1, or fe80--1 for IPv6)."""
    labels = name.split(".")
    quads = [labels[i : i + 4] for i in range(len(labels) - 3)]
    for label in labels:
        quads += [run.split("-") for run in DASHED_IPV4_RE.findall(label)]
    found: list[Any] = [
        ipaddress.IPv4Address(".".join(str(int(part)) for part in quad))
        for quad in quads
        if all(part.isdigit() and int(part) < 256 for part in quad)
    ]
    for label in labels:
        if label.count("-") < 2:
            continue
        try:
            found.append(ipaddress.IPv6Address(label.replace("-", ":")))
        except ValueError:
            pass
    return found


def egress_cidr(value: str, where: str, config: Config) -> str:
    """An address range narrow enough to be an allow-list entry."""
    try:
        network = ipaddress.ip_network(value)
    except ValueError as err:
        raise ArgumentError(
            f'"{where}" is not an address range: {value!r} ({err}). Pass one '
            "such as 203.0.113.7/32 or 10.0.0.0/8"
        ) from None
    widest = 8 if network.version == 4 else 32
    if network.prefixlen < widest:
        raise ArgumentError(
            f'"{where}" is {value!r}, which covers {network.num_addresses} '
            f"addresses; allow-egress takes ranges of /{widest} or narrower. "
            "For open egress, create a new machine with "
            'network: "open" instead'
        )
    if why := egress_refusal(network, config):
        raise ArgumentError(
            f'"{where}" is {value!r}, which no allow list may reach: {why}. '
            "An operator who needs a private range lists it in "
            "egressPrivateCidrs (SMOL_MCP_EGRESS_PRIVATE_CIDRS)"
        )
    return value


async def resolve_host(name: str) -> list[str]:
    """The addresses ``name`` resolves to on this host (in the event
    loop's resolver threads), none when it does not resolve."""
    try:
        answers = await anyio.getaddrinfo(name, None, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        return []
    # An IPv6 answer may carry its zone (fe80::1%eth0).
    return [str(answer[4][0]).split("%")[0] for answer in answers]


async def refuse_resolving_to_host_ranges(
    entries: list[tuple[str, str]], config: Config
) -> None:
    """Raise ArgumentError when a host name (or *.domain: its domain) of
    ``entries``, (where, name) pairs, resolves here to an address no
    allow list may reach. The names resolve together, within
    EGRESS_RESOLVE_SECS; one without an answer by then is let through, as
    is one that does not resolve here."""
    answers: dict[str, list[str]] = {}

    async def look_up(where: str, name: str) -> None:
        answers[where] = await resolve_host(name.removeprefix("*."))

    with anyio.move_on_after(EGRESS_RESOLVE_SECS):
        async with anyio.create_task_group() as group:
            for where, name in entries:
                group.start_soon(look_up, where, name)
    for where, name in entries:
        for address in answers.get(where, []):
            why = egress_refusal(ipaddress.ip_network(address), config)
            if why:
                raise ArgumentError(
                    f'"{where}" is {name!r}, which this host resolves to '
                    f"{address}, which no allow list may reach: {why}. Name "
                    "a public host; an operator who needs that range lists "
                    "it in egressPrivateCidrs (SMOL_MCP_EGRESS_PRIVATE_CIDRS)"
                )


def host_range_rules(config: Config) -> list[dict]:
    """The deny rules the local engine checks ahead of a machine's allow
    list (egressRules): every range EGRESS_FORBIDDEN names, less the
    operator's egressPrivateCidrs. A name's DNS answers, which the engine
    learns into the allow list, then never reach the host, its network or
    the cloud's metadata; nor does open egress."""
    allowed = [
        ipaddress.ip_network(cidr) for cidr in config.egress_private_cidrs
    ]
    return [
        {"action": "deny", "cidr": str(network)}
        for forbidden, _ in EGRESS_FORBIDDEN
        for network in without_ranges(forbidden, allowed)
    ]


def without_ranges(network: Any, removed: list[Any]) -> list[Any]:
    """``network`` less each range of ``removed`` that lies in it or
    holds it, as the fewest ranges, in address order."""
    left = [network]
    for cut in removed:
        if cut.version != network.version:
            continue
        kept = []
        for piece in left:
            if piece.subnet_of(cut):
                continue
            if cut.subnet_of(piece):
                kept.extend(piece.address_exclude(cut))
            else:
                kept.append(piece)
        left = kept
    return sorted(left)


def egress_change(
    args: dict, before: dict, config: Config
) -> tuple[dict, dict]:
    """(the UpdateEgressRequest body, the allow list it leaves) for
    allow-egress's arguments: listed entries dropped, removals must be
    listed, no entry left (engine: allow all) refused."""
    hosts = egress_entries(args, "hosts", config, False)
    patterns = egress_entries(args, "hostPatterns", config, True)
    cidrs = egress_entries(args, "cidrs", config)
    remove = args.get("remove", {})
    asked = (hosts, patterns, cidrs, remove.get("hosts"), remove.get("cidrs"))
    if not any(asked):
        raise ArgumentError(
            "allow-egress needs something to change: hosts, hostPatterns, "
            "cidrs, or remove {hosts, cidrs}"
        )
    removed_hosts, removed_cidrs = listed_removals(remove, before)
    kept_hosts = [h for h in before["hosts"] if h not in removed_hosts]
    kept_cidrs = [c for c in before["cidrs"] if c not in removed_cidrs]
    # Hosts and patterns arrive lower-cased.
    known = {host.lower() for host in kept_hosts}
    new_hosts = [h for h in dict.fromkeys(hosts) if h not in known]
    new_patterns = [
        p for p in dict.fromkeys(patterns) if p not in known.union(new_hosts)
    ]
    new_cidrs = [c for c in dict.fromkeys(cidrs) if c not in kept_cidrs]
    after = {
        "hosts": kept_hosts + new_hosts + new_patterns,
        "cidrs": kept_cidrs + new_cidrs,
    }
    if not after["hosts"] and not after["cidrs"]:
        raise ArgumentError(
            "this would remove every entry of the allow list, and the engine "
            "reads an empty list as egress to every host; allow-egress never "
            "does that. Keep at least one entry, or create a new machine "
            'with network: "open" if that is really wanted'
        )
    body = dict(
        allowHosts=new_hosts,
        allowHostPatterns=new_patterns,
        allowCidrs=new_cidrs,
        removeAllowHosts=removed_hosts,
        removeAllowCidrs=removed_cidrs,
    )
    return {key: value for key, value in body.items() if value}, after


def added_names(args: dict, body: dict) -> list[tuple[str, str]]:
    """The host names and patterns an allow-egress ``body`` adds, as
    (where in ``args``, entry) pairs."""
    added = []
    for arg, key in (
        ("hosts", "allowHosts"),
        ("hostPatterns", "allowHostPatterns"),
    ):
        adding = body.get(key, [])
        for i, value in enumerate(args.get(arg, [])):
            if value.lower() in adding:
                added.append((f"{arg}[{i}]", value.lower()))
    return added


def listed_removals(remove: dict, before: dict) -> tuple[list[str], list[str]]:
    """The host names and the address ranges ``remove`` takes off the
    ``before`` allow list, written as the engine lists them (host names
    match in any case, address ranges only as listed); raise
    ArgumentError for an entry that is not listed."""
    removed: dict[str, list[str]] = {"hosts": [], "cidrs": []}
    for key, fold, what in (
        ("hosts", str.lower, "hosts"),
        ("cidrs", str, "ranges"),
    ):
        listed = {fold(entry): entry for entry in before[key]}
        for i, entry in enumerate(remove.get(key, [])):
            if fold(entry) not in listed:
                raise ArgumentError(
                    f'"remove.{key}[{i}]" ({entry!r}) is not on the allow '
                    f"list of this machine, which lists {what} "
                    f"{before[key] or 'none'}; get-machine shows it"
                )
            removed[key].append(listed[fold(entry)])
    return removed["hosts"], removed["cidrs"]


def egress_question(
    name: str, fleet: str, before: dict, body: dict, after: dict
) -> str:
    """What the person is asked: exactly what changes, for which machine,
    and the list it leaves."""
    removed = body.get("removeAllowHosts", [])
    removed = removed + body.get("removeAllowCidrs", [])
    wording = (
        ("reach hosts {} (each with its subdomains)", body.get("allowHosts")),
        ("reach {}", body.get("allowHostPatterns")),
        ("reach address ranges {}", body.get("allowCidrs")),
        ("no longer reach {}", removed),
    )
    parts = [
        text.format(", ".join(entries)) for text, entries in wording if entries
    ]
    if before["open"]:
        now = "open to every host (the allow list narrows it)"
    elif not before["hosts"] and not before["cidrs"]:
        now = "blocked (no egress at all)"
    else:
        now = "limited to " + ", ".join(before["hosts"] + before["cidrs"])
    changes = "; and ".join(parts)
    left = ", ".join(after["hosts"] + after["cidrs"])
    return (
        f"The agent asks to change the egress of machine '{name}' on the "
        f"{fleet} fleet so that it may {changes}. Its egress is now {now}; "
        f"afterwards it is limited to {left}. Allow this change?"
    )


@tool(
    "Change a machine's egress allow list",
    "Let a local machine reach more hosts, host patterns or address ranges "
    "(or take entries off its allow list), without opening egress to "
    "everything: an empty list is never sent and allowAll is not offered. "
    "When the client can ask, the person confirms exactly what changes "
    "first; a decline changes nothing. A machine with no allow list yet "
    "(blocked or open) must be stopped first, and this tool never stops "
    "one. The result has the allow list before and after. Local fleet "
    "only.",
    _input("name", name=ARG_NAME, **EGRESS_ARGS),
    _out(
        dict(machine=OUT_MACHINE, before=OUT_EGRESS, after=OUT_EGRESS)
        | _types("changed:boolean")
    ),
    # Removals narrow it; a repeated removal is refused.
    "manage: destructive",
    fleets=("local",),
    refusal=(
        "its engine has no route to amend a machine's egress; create a new "
        'machine with allowHosts/allowCidrs (or network: "open") instead'
    ),
)
async def tool_allow_egress(call: Call, args: dict) -> dict:
    name = args["name"]
    record, before = await call.api(call.fleet.egress_policy, name)
    body, after = egress_change(args, before, call.config)
    await refuse_resolving_to_host_ranges(added_names(args, body), call.config)
    if not body:
        # Everything asked for is already on the list.
        same = {**after, "open": False}
        return {
            "machine": record,
            "before": before,
            "after": same,
            "changed": False,
        }
    has_list = before["hosts"] or before["cidrs"]
    if record["state"] in RUNNING_STATES and not has_list:
        # The engine would answer 409: say so now rather than ask the
        # person for nothing.
        kind = "open" if before["open"] else "blocked"
        raise SmolError(
            f"machine '{name}' is running with {kind} egress and no allow "
            f"list yet, so nothing was changed or asked. {EGRESS_409_HINT}"
        )
    await confirm_egress_change(call, name, before, body, after)
    try:
        record, applied = await call.api(call.fleet.update_egress, name, body)
    except ApiError as err:
        if err.status == 409:
            raise err.with_hint(EGRESS_409_HINT) from None
        raise
    # The lists the engine answered are the truth (and what an activity log
    # records as "after").
    return {
        "machine": record,
        "before": before,
        "after": applied,
        "changed": True,
    }


async def confirm_egress_change(
    call: Call, name: str, before: dict, body: dict, after: dict
) -> None:
    """Ask the person to allow the change ``body`` makes; raise SmolError
    when they decline. A client that cannot ask lets it through."""
    question = egress_question(name, call.fleet.name, before, body, after)
    # What is confirmed: no answer is replayed.
    binding = json.dumps([name, body], sort_keys=True)
    allowed = await call.app.confirm(
        call.ctx,
        call.params,
        call.session,
        question,
        binding,
        EGRESS_QUESTION_SCHEMA,
    )
    # None: the client cannot ask.
    if allowed is False:
        raise SmolError(
            f"The person did not allow the egress change for machine "
            f"'{name}'; nothing changed. Do not ask again unless they say so."
        )


@tool(
    "Publish a port for a person",
    "Publish a TCP port the machine serves so a person can open it: on "
    "the local fleet at a port of this host's 127.0.0.1 (or the one "
    "address the operator named in exposeHosts), on the cloud as a link. "
    "The url in the result is what the person opens. The server in the "
    "machine must listen on 0.0.0.0, not only on 127.0.0.1; a stopped "
    "machine serves the port once it starts. close: true takes the port "
    "away again.",
    _input(
        "name port",
        name=ARG_NAME,
        port=_integer("The TCP port the machine serves on.", maximum=65535),
        hostPort=_integer(
            "Local only: the host port to publish it on, where the "
            "operator lets agents name one (exposePorts); by default a "
            "free one is picked.",
            maximum=65535,
        ),
        close=_boolean(
            "Take the port away instead (a port not published is left as "
            "it is)."
        ),
    ),
    _out("url:string? port:integer hostPort:integer? changed:boolean"),
    # Closing takes a way in away; asking again answers the same port.
    "manage: destructive idempotent",
)
async def tool_expose_port(call: Call, args: dict) -> dict:
    name = args["name"]
    port = args["port"]
    if not args.get("close"):
        host = args.get("hostPort")
        waiting = f"publishing port {port} of '{name}'"
        return await call.api(
            call.fleet.publish_port, name, port, host, waiting=waiting
        )
    if "hostPort" in args:
        raise ArgumentError(
            '"hostPort" does nothing with "close": true (the guest port '
            "names what is closed); leave it out"
        )
    waiting = f"closing port {port} of '{name}'"
    return await call.api(
        call.fleet.unpublish_port, name, port, waiting=waiting
    )


TOOLS_BY_NAME = {tool.name: tool for tool in TOOLS}


# ---------------------------------------------------------------------------
# 9. Resources
#
# smol://targets says what this process serves and whether each fleet
# can work on this host right now, without starting anything. The log
# template gives the latest console lines of a machine.
# ---------------------------------------------------------------------------

TARGETS_URI = "smol://targets"
POOLS_URI = "smol://pools"
LOGS_URI_TEMPLATE = "smol://machine/{target}/{name}/logs"
# How many logs one session may follow at once, and one token in all.
SUBSCRIPTIONS_PER_SESSION = 16
SUBSCRIPTIONS_PER_TOKEN = 64
LOGS_URI_RE = re.compile(
    r"smol://machine/(?P<target>[^/]+)/(?P<name>[^/]+)/logs"
)


def uid_drop_advice(
    euid: int, kvm_mode: int | None, environ: dict[str, str]
) -> str | None:
    """Return why every start would fail late, or None.

    As root with a root-only /dev/kvm, smolvm's own uid for each VM
    cannot open it: every start ends in KvmOpen(Error(13)).
    """
    if (
        euid
        or kvm_mode is None
        or kvm_mode & 0o066
        or environ.get("SMOLVM_VM_UID_DROP") == "off"
    ):
        return None
    return (
        f"running as root with /dev/kvm at mode {oct(kvm_mode & 0o777)[2:]}:"
        " smolvm drops each VM to a uid of its own, which cannot open"
        " /dev/kvm, so every start would fail with KvmOpen(Error(13)); set"
        " SMOLVM_VM_UID_DROP=off in this server's environment (setup"
        " carries it into the client entry), or let the kvm group read and"
        " write /dev/kvm"
    )


def kvm_mode() -> int | None:
    try:
        return os.stat("/dev/kvm").st_mode
    except OSError:
        return None


def hypervisor_status() -> tuple[bool, str]:
    """Whether this host can run microVMs, and if not, why and what to do."""
    if sys.platform == "darwin":
        return True, "Hypervisor.framework (macOS)"
    if not os.path.exists("/dev/kvm"):
        enable = (
            "enable KVM (or nested virtualisation on this VM)"
            " and load the kvm module"
        )
        return False, f"/dev/kvm does not exist: {enable}"
    if not os.access("/dev/kvm", os.R_OK | os.W_OK):
        join = "add the user to the kvm group"
        return (
            False,
            f"/dev/kvm is not readable and writable by this user: {join}",
        )
    return True, "/dev/kvm is usable"


def local_target_facts(fleet: LocalFleet) -> dict:
    """Return what smol://targets says of the local fleet.

    It only reads: a local tool call is what starts the serve.
    """
    config = fleet.config
    guest = inside_smol_guest()
    hypervisor = hypervisor_status()
    binary = None
    if not config.local_url:
        binary = fleet.smolvm_path()
    running = running_smolvm(fleet)
    serve = config.local_url or "started on the first local tool call"
    if running and not config.local_url:
        serve = f"running at {fleet.endpoint} (smolvm {running})"
    facts: dict[str, Any] = {
        "served": True,
        "usable": True,
        "reason": None,
        "insideGuest": guest,
    }
    present, detail = hypervisor
    facts["hypervisor"] = {"present": present, "detail": detail}
    facts["smolvm"] = {
        "path": binary,
        "version": running,
        "from": smolvm_origin(config, binary),
    }
    facts["serve"] = serve
    facts["minSmolvm"] = config.min_smolvm or None
    why, note = local_standing(fleet, guest, binary, running, hypervisor)
    minimum = config.min_smolvm
    if running and minimum and version_tuple(running) < version_tuple(minimum):
        fix = (
            "upgrade it, or set SMOL_MCP_MIN_SMOLVM to an empty value"
            " to skip the check"
        )
        why = f"smolvm {running} is older than {minimum}; {fix}"
    elif not running and not why and minimum:
        when = "when the first local call starts the serve"
        note = f"its version is checked against {minimum} {when}"
    if why:
        facts["usable"] = False
        facts["reason"] = why
    elif note:
        facts["reason"] = note
    return facts


def running_smolvm(fleet: LocalFleet) -> str | None:
    """Return the version of the serve that already runs, or None.

    It asks a serve that runs; it starts none.
    """
    if fleet.version:
        return fleet.version
    try:
        version = fleet._health().get("version")
    except (OSError, SmolError, ValueError):
        return None
    return str(version or "") or None


def smolvm_origin(config: Config, binary: str | None) -> str | None:
    """Return how smolvm was found (SMOLVM, PATH, this Python's wheel)."""
    if not binary:
        return None
    if os.sep in config.smolvm:
        return "SMOLVM"
    if binary == wheel_engine() and not shutil.which(config.smolvm):
        return (
            "the smolmachines package of this Python (smolvm is not on PATH)"
        )
    return "PATH"


def local_standing(
    fleet: LocalFleet,
    guest: bool,
    binary: str | None,
    running: str | None,
    hypervisor: tuple[bool, str],
) -> tuple[str | None, str | None]:
    """Return why the local fleet is unusable, and a note on how it works.

    Either may be None; the first thing that stops it is the one named.
    """
    config = fleet.config
    hypervisor_ok, hypervisor_reason = hypervisor
    if guest:
        return (
            "running inside a smol machine,"
            " which cannot start machines of its own",
            None,
        )
    if config.local_url and running is None:
        fix = (
            "start that serve, or unset SMOL_LOCAL_URL"
            " to let smol-mcp start its own"
        )
        why = f"nothing answers at SMOL_LOCAL_URL={config.local_url}; {fix}"
        return why, None
    if config.local_url:
        return None, "uses the serve at SMOL_LOCAL_URL"
    # Another smol-mcp's serve, in our runtime directory.
    if binary is None and running:
        later = (
            "when it stops, starting a new one needs smolvm:"
            " set SMOLVM to its path"
        )
        note = f"uses the serve already running at {fleet.endpoint}; {later}"
        return None, note
    if binary is None:
        fix = (
            "get it with one of the commands below, or set SMOLVM to its path"
        )
        return f"smolvm was not found ({config.smolvm!r}); {fix}", None
    if not hypervisor_ok:
        return hypervisor_reason, None
    advice = uid_drop_advice(os.geteuid(), kvm_mode(), fleet.environ)
    if advice:
        return advice, None
    if running is None and rollout_port_taken():
        hint = other_serve_hint(fleet.endpoint.removeprefix("unix://"))
        why = f"127.0.0.1:10081, which every serve binds, is taken. {hint}"
        return why, None
    return None, None


def rollout_port_taken() -> bool:
    """Whether 127.0.0.1:10081, which every serve binds, is taken."""
    with socket.socket() as probe:
        probe.settimeout(0.2)
        return probe.connect_ex(("127.0.0.1", 10081)) == 0


async def follow_log(
    app: SmolMcp, fleet: Fleet, name: str, notify: Callable, who: str
) -> None:
    """Call ``notify`` each time a machine's console grows, until it is gone.

    The console is polled: no route pushes its lines.
    """
    last = None
    app.polling[who] = app.polling.get(who, 0) + 1
    try:
        while True:
            try:
                lines = await anyio.to_thread.run_sync(
                    fleet.console_lines,
                    name,
                    abandon_on_cancel=True,
                    limiter=app.thread_limiter(),
                )
                seen = log_cursor(lines, len(lines))
                if last is not None and seen != last:
                    await notify()
                last = seen
            # Stopped: it may start again. Gone: nothing more to follow.
            except SmolError as err:
                if isinstance(err, ApiError) and err.status == 404:
                    return
                log.debug("log poll of %s: %s", name, err)
            await anyio.sleep(app.config.logs_poll_secs)
    finally:
        app.polling[who] -= 1


def targets_document(app: SmolMcp) -> dict:
    """Return the mode and, per fleet, whether it is served and usable now.

    A fleet that is not says why.
    """
    facts = {name: kind.target_facts(app) for name, kind in FLEETS.items()}
    mode = (
        f"this process serves {app.mode} only;"
        f" SMOL_MCP_TARGETS={app.config.targets}"
    )
    for name, fleet_facts in facts.items():
        if name not in app.fleets:
            fleet_facts.update(served=False, usable=False, reason=mode)
    return {"mode": app.mode, "fleets": facts}


# ---------------------------------------------------------------------------
# 10. Sessions and cleanup
#
# A machine whose name starts with machinePrefix is ephemeral: its
# session deletes it when it ends. Local records in the runtime
# directory let the next process delete what a SIGKILLed one left.
# ---------------------------------------------------------------------------

NOT_THE_SESSIONS_MACHINE = (
    "not deleted: a machine of that name is no longer the one it made"
)
NOT_THE_SESSIONS_STATE = (
    "not deleted: a saved state of that name is no longer the one it saved"
)


class Session:
    """One client's state: its fleet, its subscriptions and its ephemeral
    machines (recorded on disk).
    """

    def __init__(self, app: SmolMcp, session_id: str, tasks: Any = None):
        self.app = app
        self.id = session_id
        # Where its pollers run.
        self.tasks = tasks
        self.machines: dict[str, set[str]] = {}
        # fleet -> ephemeral saved state -> the claim id it saved it under.
        self.states: dict[str, dict[str, str]] = {}
        self.record_path = Path(
            app.config.runtime_dir, "sessions", f"{os.getpid()}-{self.id}.json"
        )
        # Both mode: the fleet this session chose, if it chose one, and
        # the call whose question made the choice.
        self.target: str | None = None
        self.asked_fleet = False
        self.chose_during: Any = None
        self.ended = False
        self._slots = None
        self._bus = None
        self.listener = None
        # Made lazily by anyio, in the loop that first takes it.
        self.question_lock = anyio.Lock()
        # uri -> its poller's CancelScope (handshake era).
        self.subscriptions: dict[str, Any] = {}
        # For the HTTP idle timeout: calls being served, and (2026 era)
        # subscriptions/listen streams open.
        self.in_flight = 0
        self.listening = 0
        self.last_seen = time.monotonic()
        # Over HTTP: the token that opened it.
        self.principal: Principal | None = None
        # (fleet, name) -> machine_identity()
        self.identities: dict[tuple[str, str], str] = {}
        # Nonces of 2026-era confirmations already answered.
        self.spent: set[str] = set()
        # Calls awaiting approval: answered first when revoked.
        self.held = 0
        self.revoked_at = None
        # A call made since it opened: an unused HTTP session is ended
        # sooner.
        self.used = False
        # Handshake era over HTTP: Mcp-Session-Id, and the version.
        self.http_id = None
        self.protocol = None

    def call_slots(self):
        """Return this session's share of the worker threads.

        Its long calls queue apart from other sessions'.
        """
        if self._slots is None:
            self._slots = SessionSlots(
                self.app.thread_limiter(), SESSION_CALL_SLOTS
            )
        return self._slots

    def events(self):
        """Return this session's event bus and its listen handler.

        2026-era notifications go out on listen.
        """
        if self._bus is None:
            from mcp.server.subscriptions import (
                InMemorySubscriptionBus,
                ListenHandler,
            )

            self._bus = InMemorySubscriptionBus()
            self.listener = ListenHandler(self._bus)
        return self._bus, self.listener

    def is_ephemeral(self, name: str) -> bool:
        return name.startswith(self.app.config.machine_prefix)

    def remember(self, fleet: str, name: str) -> bool:
        """Record an ephemeral machine; False if it was recorded already."""
        names = self.machines.setdefault(fleet, set())
        if added := name not in names:
            names.add(name)
            self._save()
        return added

    def forget(self, fleet: str, name: str) -> None:
        if name in self.machines.get(fleet, set()):
            self.machines[fleet].discard(name)
            self._save()

    def remember_state(self, fleet: str, state: str, claim_id: str) -> None:
        """Record an ephemeral saved state, by the claim it was saved
        under."""
        self.states.setdefault(fleet, {})[state] = claim_id
        self._save()

    def forget_state(self, fleet: str, state: str) -> None:
        if self.states.get(fleet, {}).pop(state, None) is not None:
            self._save()

    def _save(self) -> None:
        """Write the local record atomically.

        A failure costs a warning, never the operation.
        """
        runtime_dir = self.app.config.runtime_dir
        # Only local machines, with the copies that hold its ephemeral
        # saved states: the crash sweep reads it.
        local = self.app.local.name
        copies = map(local_state_machine, self.states.get(local, {}))
        names = sorted({*self.machines.get(local, set()), *copies})
        with bookkeeping(runtime_dir):
            if not names:
                self.record_path.unlink(missing_ok=True)
                return
            # The parent first: it keeps others out.
            ensure_runtime_dir(runtime_dir)
            self.record_path.parent.mkdir(mode=0o700, exist_ok=True)
            pid = os.getpid()
            record = {
                "pid": pid,
                "started": process_start_time(pid),
                "endpoint": self.app.local.endpoint,
                "machines": names,
                # A pooled machine's lease: completed, not deleted.
                "leases": self.app.local.leases.records(names),
            }
            # The umask decides who may read it. No fsync: a record, like
            # the machines it names, is not needed after a power cut.
            write_json(self.record_path, record, mode=0o666, durable=False)

    async def close(self) -> None:
        """Delete this session's ephemeral machines, fleet by fleet, then
        its ephemeral saved states.

        What stays, stays recorded.
        """
        who = self.app.who(self.principal or self.app.access.stdio)
        await self.close_machines(who)
        if any(self.states.values()):
            # After the machines, which may be made from a state; then the
            # machines a state's copy kept (a branch source keeps its
            # clones' disks, so the engine may refuse it until they go).
            await self.close_states(who)
            if any(self.machines.values()):
                await self.close_machines(who)

    async def close_machines(self, who: dict) -> None:
        """Delete this session's ephemeral machines, fleet by fleet."""
        run = anyio.to_thread.run_sync
        for fleet_name, names in list(self.machines.items()):
            # A name held by another machine by now is never deleted here.
            try:
                fleet = self.app.fleets[fleet_name]
                replaced = await run(self.replaced, fleet, sorted(names))
                kept = sorted(set(names) - set(replaced))
                deleted, refused = await run(
                    delete_in_passes, fleet, kept, abandon_on_cancel=True
                )
            except Exception as err:
                log.warning(
                    "session %s ended: could not clean up its %s machines"
                    " (%s): %s",
                    self.id,
                    fleet_name,
                    ", ".join(sorted(names)),
                    describe(err),
                )
                continue
            for name in [*deleted, *replaced]:
                outcome = NOT_THE_SESSIONS_MACHINE
                if name in deleted:
                    outcome = "deleted"
                log.info("session %s ended: %s: %s", self.id, name, outcome)
                self.forget(fleet_name, name)
                entry = {
                    "event": "session-cleanup",
                    **who,
                    "session": self.id,
                    "target": fleet_name,
                    "machine": name,
                    "outcome": outcome,
                }
                self.app.record(entry)
            self.app.access.owners.clear(fleet_name, deleted)
            for name, err in refused:
                log.warning(
                    "session %s ended: could not delete %s: %s",
                    self.id,
                    name,
                    err,
                )

    async def close_states(self, who: dict) -> None:
        """Delete this session's ephemeral saved states, each only if it
        is still the one this session saved.
        """
        store = self.app.access.states
        for fleet_name, claims in list(self.states.items()):
            fleet = self.app.fleets[fleet_name]
            for state, claim_id in sorted(claims.items()):
                saved = store.find(fleet_name, state)
                ours = saved is not None and saved.get("id") == claim_id
                try:
                    if ours and saved.get("ref"):
                        await anyio.to_thread.run_sync(
                            fleet.delete_state, saved, abandon_on_cancel=True
                        )
                except Exception as err:
                    log.warning(
                        "session %s ended: could not delete saved state"
                        " %s: %s",
                        self.id,
                        state,
                        describe(err),
                    )
                    continue
                outcome = NOT_THE_SESSIONS_STATE
                if ours:
                    store.release(fleet_name, state, claim_id)
                    outcome = "deleted"
                log.info("session %s ended: %s: %s", self.id, state, outcome)
                self.forget_state(fleet_name, state)
                entry = {
                    "event": "session-cleanup",
                    **who,
                    "session": self.id,
                    "target": fleet_name,
                    "state": state,
                    "outcome": outcome,
                }
                self.app.record(entry)

    def replaced(self, fleet: Fleet, names: list[str]) -> list[str]:
        """Return the names now held by another machine than the one this
        session made.
        """
        made = {
            name: self.identities.get((fleet.name, name)) for name in names
        }
        return [
            name for name in names if not same_machine(fleet, name, made[name])
        ]


def same_machine(
    fleet: Any, name: str, identity: str | None, record: dict | None = None
) -> bool:
    """Whether ``name`` is still the machine whose machine_identity() was
    ``identity``.

    An unknown identity says yes, and so does a machine gone or
    unreadable: the call on it says which.
    """
    if identity is None:
        return True
    try:
        return machine_identity(record or fleet.get_machine(name)) == identity
    except SmolError:
        return True


class SessionSlots:
    """A to_thread limiter: a slot of the session's, then a shared thread;
    at most ``slots`` of each.
    """

    def __init__(self, shared: Any, slots: int):
        self.shared = shared
        self.own = anyio.CapacityLimiter(slots)

    async def __aenter__(self) -> None:
        for taken, limiter in enumerate((self.own, self.shared)):
            # A free slot is taken without a pass through the event loop.
            try:
                limiter.acquire_nowait()
            except anyio.WouldBlock:
                try:
                    await limiter.acquire()
                except BaseException:
                    if taken:
                        self.own.release()
                    raise

    async def __aexit__(self, *exc_info: Any) -> None:
        self.shared.release()
        self.own.release()


def delete_in_passes(fleet: Fleet, names: list[str]) -> tuple[list[str], list]:
    """Delete ``names`` in passes; return what is gone and what was refused.

    A branch's source refuses while it has children, so the passes go
    on until one makes no progress, then once more after a pause. A 404
    counts as gone; each refusal comes with its error.
    """
    pending = list(names)
    gone = []
    retried = False
    while pending:
        refused: list[tuple[str, Exception]] = []
        for name in pending:
            # A cleanup goes on past any one machine's failure.
            try:
                fleet.delete_machine(name)
            except Exception as err:
                if not isinstance(err, ApiError) or err.status != 404:
                    refused.append((name, err))
                    continue
            gone.append(name)
        if len(refused) == len(pending):
            if retried:
                return gone, refused
            retried = True
            time.sleep(DELETE_RETRY_PAUSE_SECS)
        pending = [name for name, _ in refused]
    return gone, []


def describe(err: BaseException) -> str:
    """Return an error as a log line shows it."""
    if isinstance(err, SmolError):
        return str(err)
    return f"{type(err).__name__}: {err}"


def write_json(
    path: Path,
    value: Any,
    mode: int = 0o600,
    indent: int | None = None,
    durable: bool = True,
) -> None:
    """Write a JSON file whole or not at all: a crash mid-write leaves the
    old one; ``durable``, a power cut too (fsync).
    """
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    with os.fdopen(os.open(temporary, flags, mode), "w") as out:
        json.dump(value, out, indent=indent)
        out.flush()
        if durable:
            os.fsync(out.fileno())
    os.replace(temporary, path)


_warned_dirs: set[str] = set()


@contextmanager
def bookkeeping(runtime_dir: str):
    """Guard a write of our records in the runtime directory.

    An OSError there costs one warning, once per directory.
    """
    try:
        yield
    except OSError as err:
        if runtime_dir not in _warned_dirs:
            _warned_dirs.add(runtime_dir)
            log.warning(
                "cannot write to the runtime directory %s (%s); machines"
                " work on, but one this process cannot delete will not be"
                " found by the next start. Make it writable (or set"
                " SMOL_MCP_RUNTIME_DIR).",
                runtime_dir,
                err.strerror or err,
            )


def _proc_stat(pid: int) -> list[str] | None:
    """Return /proc/PID/stat from the state field on, or None without it.

    Field 3 of the file is [0] here.
    """
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text[text.rfind(")") + 2 :].split()


def process_start_time(pid: int) -> int | None:
    """Return when a process started, in ticks since boot.

    None without /proc. With the pid, it names one process.
    """
    fields = _proc_stat(pid)
    if not fields or len(fields) <= 19:
        return None
    return int(fields[19])


def process_alive(pid: int, started: int | None = None) -> bool:
    """Whether pid runs (a zombie does not) and, when ``started`` is
    known, is the process noted then.
    """
    if pid <= 0:
        # A record without a real pid belongs to nobody.
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    fields = _proc_stat(pid)
    if fields is None:
        # No /proc at all (macOS): the signal answered.
        return not Path("/proc/self/stat").exists()
    if fields[0] in ("Z", "X"):
        return False
    return started is None or started == process_start_time(pid)


def sweep_orphans(fleet: LocalFleet, runtime_dir: str) -> list[str]:
    """Delete the ephemeral machines this serve holds for processes that
    died; return their names.
    """
    deleted = []
    for path in sorted((Path(runtime_dir) / "sessions").glob("*.json")):
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        alive = process_alive(int(record.get("pid", 0)), record.get("started"))
        if alive or record.get("endpoint") != fleet.endpoint:
            continue
        # Its pooled machines' leases: deleting them completes them.
        fleet.leases.adopt(record.get("leases"))
        gone, refused = delete_in_passes(fleet, record.get("machines", []))
        deleted += gone
        for name, err in refused:
            log.warning(
                "could not delete %s left by process %s: %s",
                name,
                record.get("pid"),
                err,
            )
        with bookkeeping(runtime_dir):
            # Try again at the next start rather than forget them.
            if refused:
                left = [name for name, _ in refused]
                write_json(path, {**record, "machines": left}, mode=0o666)
            else:
                path.unlink(missing_ok=True)
    if deleted:
        log.info(
            "deleted %d machine(s) left by an earlier process: %s",
            len(deleted),
            ", ".join(deleted),
        )
    return deleted


# ---------------------------------------------------------------------------
# 11. Agent access
#
# Who is calling, and what it may do. Over HTTP every request carries a
# token: SMOL_MCP_AUTH_TOKEN ("default", every scope) or one from
# `tokens create` (only its hash is kept). Its scopes decide which tools
# it sees and calls; sandbox.* narrows it to the machines it created
# (Owners remembers them). stdio has no token: SMOL_MCP_SCOPES narrows
# it. Every call passes authorize() first.
# ---------------------------------------------------------------------------

# The wider domain first: when a principal holds both, its grant wins.
SCOPE_DOMAINS = ("machines", "sandbox")
SCOPE_LEVELS = ("read", "manage", "exec")
SCOPES = (
    *(f"{d}.{level}" for d in SCOPE_DOMAINS for level in SCOPE_LEVELS),
    "activity.read",
)
# Every level of one domain, the presets' and grants' building block.
MACHINES_SCOPES = tuple(f"machines.{level}" for level in SCOPE_LEVELS)
SANDBOX_SCOPES = tuple(f"sandbox.{level}" for level in SCOPE_LEVELS)
# Each tool's scope level, from its ToolSpec.access; a tool without one
# is granted to nobody.
TOOL_LEVELS = {
    tool.name: tool.level for tool in TOOLS if tool.level in SCOPE_LEVELS
}
APPROVAL_MODES = ("none", "changes")
# `tokens create --preset`: the usual grants, by what the agent is for.
SCOPE_PRESETS = {
    # Its own machines only.
    "sandbox": ",".join(SANDBOX_SCOPES),
    "read": "machines.read,activity.read",
    "full": ",".join(SCOPES),
}
TOKEN_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
# In any case: ours, and the terminal's.
RESERVED_TOKEN_NAMES = ("default", "stdio", "cli", "smol-mcp")
TOKEN_SECRET_PREFIX = "smolmcp_"
TOKENS_FILE = "tokens.json"
USAGE_FILE = "tokens-used.json"
OWNERS_FILE = "owners.json"
STATES_FILE = "states.json"
# The saved states one token may hold, on both fleets together: each keeps
# a machine's memory image and disks on the host's disk (local) or in the
# account (cloud), and no other rule bounds how many an agent makes.
STATES_PER_TOKEN = 32
# The jobs get-machine shows: the newest 100 a machine.
JOBS_FILE = "jobs.json"
JOBS_KEPT = 100
USAGE_FLUSH_SECS = 60
TOKEN_WATCH_SECS = 0.5
# A deleted token's calls in flight may finish answering.
TOKEN_END_GRACE_SECS = 5


class ScopeMissing(SmolError):
    """A call the principal has no scope (or no fleet) for.

    The text starts with scope_missing:.
    """


@dataclass(frozen=True)
class Principal:
    """Who a request comes from: a token (by name), or the stdio client
    and its OS user.
    """

    name: str
    scopes: frozenset
    # The fleets it may use: every registered one unless narrowed.
    targets: tuple[str, ...] = field(default_factory=lambda: tuple(FLEETS))
    # "changes": every changing call waits for a person.
    approval: str = "none"
    # "token" or "stdio".
    kind: str = "token"
    # stdio: the OS user the server runs as.
    user: str | None = None
    # A token's own id: a new token under an old name is another
    # principal.
    id: str = ""

    def label(self) -> str:
        if self.kind == "stdio":
            return f"this stdio server (SMOL_MCP_SCOPES, user {self.user})"
        return f"the token '{self.name}'"

    def tools(self) -> tuple[str, ...]:
        return tuple(
            tool.name
            for tool in TOOLS
            if granting_scope(self, tool.name) is not None
        )

    def describe(self) -> dict:
        """Return what smol://targets tells the caller about itself."""
        described = {
            "principal": self.name,
            "kind": self.kind,
            "scopes": sorted(self.scopes),
            "targets": list(self.targets),
            "approval": self.approval,
        }
        if self.user:
            described["user"] = self.user
        return described


@dataclass(frozen=True)
class Grant:
    """What authorize() allowed: the granting scope, and whether only
    the principal's own machines (sandbox.*).
    """

    scope: str
    owned_only: bool


def granting_scope(principal: Principal, tool: str) -> str | None:
    """Return the scope of ``principal`` that grants ``tool``, or None.

    None too when TOOL_LEVELS lacks the tool.
    """
    level = TOOL_LEVELS.get(tool)
    if level is None:
        return None
    for domain in SCOPE_DOMAINS:
        scope = f"{domain}.{level}"
        if scope in principal.scopes:
            return scope
    return None


def check_scope(principal: Principal, tool: str) -> str:
    """Return the granting scope; raise ScopeMissing naming the scope and
    the principal when there is none.
    """
    if scope := granting_scope(principal, tool):
        return scope
    level = TOOL_LEVELS.get(tool, "unknown")
    held = ", ".join(sorted(principal.scopes)) or "none"
    raise ScopeMissing(
        f"scope_missing: {tool} needs the machines.{level} scope"
        f" (or sandbox.{level} for machines of its own), which"
        f" {principal.label()} does not have (its scopes: {held})."
        " Ask the operator for a token with that scope."
    )


def authorize(
    principal: Principal, tool: str, target: str | None, machine: str | None
) -> Grant:
    """Return what the principal may do with ``tool`` on ``target``.

    The check before every tool call (and log resource): the tool's
    scope, then the fleet; raise ScopeMissing when either is missing.
    """
    scope = check_scope(principal, tool)
    if target is not None and target not in principal.targets:
        only = (
            f"the {' and '.join(principal.targets)} fleet only, not {target}"
        )
        ask = f"Ask the operator for a token whose targets include {target}."
        raise ScopeMissing(
            f"scope_missing: {principal.label()} may use {only}. {ask}"
        )
    return Grant(scope, scope.startswith("sandbox."))


def ensure_state_dir(path: str | Path) -> Path:
    return ensure_private_dir(path, "state directory", "SMOL_MCP_STATE_DIR")


class StateFile:
    """A JSON file in the state directory (0600).

    It is written whole under a lock any process honours, and read again
    only when it changed; another process's change is looked for each
    ``recheck_secs``.
    """

    def __init__(
        self,
        path: Path,
        empty: Callable,
        valid: Callable | None = None,
        recheck_secs=0,
    ):
        self.path = path
        self.empty = empty
        self.recheck_secs = recheck_secs
        self.valid = valid or (lambda data: isinstance(data, type(empty())))
        self._signature = None
        self._data = empty()
        self._lock = threading.Lock()
        # The monotonic time of the last look.
        self._checked = -recheck_secs

    def read(self) -> Any:
        if time.monotonic() - self._checked < self.recheck_secs:
            return self._data
        try:
            info = os.stat(self.path)
            signature = (info.st_mtime_ns, info.st_size, info.st_ino)
        # Nothing recorded yet.
        except (FileNotFoundError, NotADirectoryError):
            signature = None
        with self._lock:
            if signature != self._signature:
                data = self.empty()
                if signature:
                    data = self._load()
                self._signature = signature
                self._data = data
            # Not after a failed load: that one is seen every time.
            self._checked = time.monotonic()
            return self._data

    def expire(self) -> None:
        """Make the next read look at the file again."""
        self._checked = -self.recheck_secs

    def _load(self) -> Any:
        try:
            data = json.loads(self.path.read_text(encoding="utf-8"))
        except (FileNotFoundError, NotADirectoryError):
            return self.empty()
        except (OSError, ValueError) as exc:
            raise SmolError(
                f"cannot read {self.path} ({exc}); fix or remove that file"
            ) from None
        if not self.valid(data):
            held = f"it holds {_json_type(data)}: {json.dumps(data)[:60]}"
            fix = (
                "fix it, or move it aside to start afresh"
                " (what it recorded is forgotten then)"
            )
            raise SmolError(
                f"{self.path} is not shaped as this server writes it"
                f" ({held}); {fix}"
            )
        return data

    def update(self, change: Callable[[Any], Any]) -> Any:
        try:
            ensure_state_dir(self.path.parent)
            with locked(self.path.with_name(self.path.name + ".lock")):
                data = self._load()
                result = change(data)
                write_json(self.path, data, indent=1)
                self.expire()
            return result
        except OSError as exc:
            fix = "set SMOL_MCP_STATE_DIR to a directory this user can write"
            raise SmolError(
                f"cannot write {self.path} ({exc.strerror}); {fix}"
            ) from None


def locked(path: Path) -> Any:
    """Lock ``path`` (made 0600) exclusively until the returned file
    closes: ``with locked(path):``.

    Not @contextmanager: that sets ``__traceback__`` on an error passing
    through, and a frozen one refuses it.
    """
    held = os.fdopen(os.open(path, os.O_RDWR | os.O_CREAT, 0o600), "rb")
    try:
        fcntl.flock(held, fcntl.LOCK_EX)
    except BaseException:
        held.close()
        raise
    return held


def secret_hash(secret: str) -> str:
    return hashlib.sha256(secret.encode("utf-8", "surrogatepass")).hexdigest()


def new_token_secret() -> str:
    return TOKEN_SECRET_PREFIX + secrets_module.token_urlsafe(32)


def parse_scopes(text: str, setting: str = "") -> tuple[str, ...]:
    """Return the scopes in a comma-separated text, each checked.

    Read from a ``setting``, the text may name none.
    """
    scopes = tuple(
        dict.fromkeys(part.strip() for part in text.split(",") if part.strip())
    )
    unknown = ", ".join(repr(scope) for scope in scopes if scope not in SCOPES)
    if unknown or not (scopes or setting):
        if unknown and setting:
            named = f"{setting} names {unknown}, which is not a scope"
        elif unknown:
            named = f"{unknown} is not a scope"
        else:
            named = "no scope was given"
        raise ConfigError(f"{named}; the scopes are: {', '.join(SCOPES)}")
    return scopes


def parse_targets(text: str | None) -> tuple[str, ...]:
    """Return the fleets a token's ``--targets`` names (every fleet when
    None): "both", or fleet names joined by commas; raise ConfigError
    saying what it takes."""
    if text is None:
        return tuple(FLEETS)
    try:
        return named_fleets(text)
    except ValueError as err:
        raise ConfigError(
            f"--targets takes {fleets_accepted()}; {err}"
        ) from None


def valid_tokens(data: Any) -> bool:
    """Whether the tokens file holds a list of records, each named."""
    if not isinstance(data, dict):
        return False
    tokens = data.get("tokens", [])
    if not isinstance(tokens, list):
        return False
    return all(
        isinstance(record, dict) and isinstance(record.get("name"), str)
        for record in tokens
    )


def known_hashes(records: list[dict]) -> dict[str, list[tuple]]:
    """Each secret hash the tokens file knows (a token's own, with no
    expiry, and its OAuth access tokens'), mapped to where it is, in file
    order: (place, record, the access token's scopes or None, expiry or
    None)."""
    known: dict[str, list[tuple]] = {}
    for index, record in enumerate(records):
        own = str(record.get("sha256", ""))
        known.setdefault(own, []).append(((index, 0), record, None, None))
        for number, access in enumerate(record.get("access", []), 1):
            place = (index, number)
            scopes = access.get("scopes")
            expires = access["expiresAt"]
            entry = (place, record, scopes, expires)
            known.setdefault(access["sha256"], []).append(entry)
    return known


def narrowed(record: dict, scopes: list | None) -> dict:
    """A token's record as an access token of it has it: with only
    ``scopes`` of its own, when the access token was given fewer (a
    refresh that asked for less)."""
    if scopes is None:
        return record
    kept = [scope for scope in record.get("scopes", []) if scope in scopes]
    return {**record, "scopes": kept}


@functools.lru_cache(maxsize=256)
def token_principal(
    name: str, scopes: tuple, targets: tuple, approval: str, token_id: str
) -> Principal:
    """The principal of a named token: one object for the same record, so
    what is cached by principal (authenticated_user) is found at once."""
    return Principal(name, frozenset(scopes), targets, approval, id=token_id)


class TokenStore:
    """The named tokens, each with its secret's SHA-256 (never the
    secret); when each was last used is kept apart.
    """

    def __init__(self, state_dir: str):
        # Read on every HTTP request: looked at again at most twice a
        # second.
        self.file = StateFile(
            Path(state_dir) / TOKENS_FILE,
            lambda: {"tokens": []},
            valid_tokens,
            0.5,
        )
        self.usage = StateFile(Path(state_dir) / USAGE_FILE, dict)
        # name -> when (time.time()), not yet written.
        self._used: dict[str, float] = {}
        # compare's list of (hash, place, record, scopes, expiry), and the
        # file's data it was made from.
        self._known: dict[str, list[tuple]] = {}
        self._listed: Any = None
        self._flushed = time.monotonic()

    def records(self) -> list[dict]:
        return list(self.file.read().get("tokens", []))

    def create(
        self, name: str, scopes: tuple, targets: tuple, approval: str, **extra
    ) -> tuple:
        """Add a token; return its record and its secret.

        Raise ConfigError for a name or approval mode it cannot take, or
        a name already in use.
        """
        check_token_name(name)
        if approval not in APPROVAL_MODES:
            raise ConfigError(
                f"--approval takes {' or '.join(APPROVAL_MODES)};"
                f" got {approval!r}"
            )
        secret = new_token_secret()
        record = {
            "name": name,
            "id": secrets_module.token_hex(8),
            "sha256": secret_hash(secret),
            "scopes": list(scopes),
            "targets": list(targets),
            "approval": approval,
            "createdAt": utc_now(),
            # An OAuth grant's client.
            **extra,
        }

        def add(data: dict) -> None:
            tokens = data.setdefault("tokens", [])
            if any(existing["name"] == name for existing in tokens):
                fix = f"pick another name, or `tokens delete {name}` first"
                raise ConfigError(
                    f"a token named {name!r} already exists; {fix}"
                )
            data["tokens"].append(record)

        self.file.update(add)
        return record, secret

    def delete(self, name: str) -> bool:
        def remove(data: dict) -> bool:
            tokens = data.get("tokens", [])
            data["tokens"] = [
                record for record in tokens if record["name"] != name
            ]
            return len(data["tokens"]) != len(tokens)

        if not self.file.path.exists():
            return False
        removed = self.file.update(remove)
        if removed and self.usage.path.exists():
            self.usage.update(lambda data: data.pop(name, None))
        # Its auto-approval goes with it.
        if removed:
            AutoApprovals(self.file.path.parent).end(name)
        return removed

    def match(self, offered: list[str], again: bool = True) -> dict | None:
        """Return the record whose hash matches an offered secret, or None.

        The hash of a live OAuth access token counts too. A secret is
        looked up by its hash (compare says why); a miss reads the file
        again, so a new token works at once.
        """
        hashes = [secret_hash(candidate) for candidate in offered if candidate]
        return self.match_hashes(hashes, again)

    def match_hashes(self, hashes: list[str], again: bool = True) -> Any:
        """match, for secrets hashed already (secret_hash)."""
        found = self.compare(hashes)
        if found is None and again:
            self.file.expire()
            found = self.compare(hashes)
        return found

    def compare(self, hashes: list[str]) -> dict | None:
        """The record (narrowed) an offered hash matches, the last in the
        file when several do. The known hashes are listed again only when
        the file is read again."""
        data = self.file.read()
        if data is not self._listed:
            self._known = known_hashes(data.get("tokens", []))
            self._listed = data
        now = time.time()
        found = None
        for digest in hashes:
            # Looked up by its hash, not compared with each known one: a
            # lookup's time can tell only of the SHA-256 of what was
            # offered, which gives away no secret, and the check costs
            # the same with one token or ten thousand.
            matches = self._known.get(digest, ())
            for place, record, scopes, expires in matches:
                live = expires is None or expires > now
                if live and (found is None or place > found[0]):
                    found = (place, record, scopes)
        if found is None:
            return None
        return narrowed(found[1], found[2])

    def touch(self, name: str) -> None:
        # The time is worded when written (flush_usage, last_used): a
        # request need not.
        self._used[name] = time.time()

    def flush_usage(self, force: bool = False) -> None:
        """Write the last-used times, at most every USAGE_FLUSH_SECS."""
        if not self._used:
            return
        recent = time.monotonic() - self._flushed < USAGE_FLUSH_SECS
        if recent and not force:
            return
        used = self._used
        self._used = {}
        self._flushed = time.monotonic()
        names = {record["name"] for record in self.records()}
        kept = {
            name: utc_time(when)
            for name, when in used.items()
            if name in names
        }
        try:
            self.usage.update(lambda data: data.update(kept))
        except (OSError, SmolError) as err:
            log.warning("could not record when tokens were last used: %s", err)

    def last_used(self) -> dict:
        """Return name -> when last used: the file's, and this process's
        uses not yet written.
        """
        mine = {name: utc_time(when) for name, when in self._used.items()}
        try:
            return {**self.usage.read(), **mine}
        except SmolError:
            return mine


def check_token_name(name: str) -> None:
    """Raise ConfigError when ``name`` cannot be a token's name."""
    reserved = name.lower() in RESERVED_TOKEN_NAMES
    if TOKEN_NAME_RE.fullmatch(name) and not reserved:
        return
    rule = (
        "use 1 to 64 letters, digits, '.', '_' or '-',"
        " starting with a letter or digit"
    )
    names = " or ".join(RESERVED_TOKEN_NAMES)
    raise ConfigError(
        f"{name!r} cannot be a token name: {rule}, and not {names}"
    )


def utc_now() -> str:
    return utc_time(time.time())


def utc_time(seconds: float) -> str:
    """Return seconds since the epoch as the RFC 3339 UTC time the
    records hold, to the second.
    """
    # A quarter of datetime's cost.
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(seconds))


def parse_time(text: str) -> float:
    """Return the seconds since the epoch of an RFC 3339 UTC time such as
    utc_now() writes.
    """
    moment = datetime.datetime.fromisoformat(str(text).replace("Z", "+00:00"))
    return moment.timestamp()


PERIOD_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def seconds_left(expires_at: Any) -> int | None:
    """Return the whole seconds until the RFC 3339 time ``expires_at``
    (0 once past), or None when it is not a time."""
    try:
        return max(0, int(parse_time(expires_at) - time.time()))
    except (ValueError, TypeError):
        return None


def parse_period(text: str) -> int:
    """Return a period such as 90s, 15m, 1h, 2d or 1w in seconds; raise
    ValueError for anything else.
    """
    match = re.fullmatch(r"(\d{1,6})([smhdw])", text.strip())
    if match is None:
        raise ValueError(
            f"{text!r} is not a period; write it as 90s, 15m, 1h, 2d or 1w"
        )
    return int(match[1]) * PERIOD_UNITS[match[2]]


def valid_owners(data: Any) -> bool:
    """Whether the owners file holds fleet -> name -> its owner (or
    {"owner", "id"}).
    """
    if not isinstance(data, dict):
        return False
    fleets = list(data.values())
    if not all(isinstance(names, dict) for names in fleets):
        return False
    return all(
        isinstance(owner, (str, dict))
        for names in fleets
        for owner in names.values()
    )


class Owners:
    """Who created each machine, per fleet (for a branch: its source's
    owner), and its jobs as last seen.
    """

    def __init__(self, state_dir: str):
        self.file = StateFile(
            Path(state_dir) / OWNERS_FILE, dict, valid_owners
        )
        # Read by every get-machine: looked at again at most twice a
        # second.
        self.jobs = StateFile(
            Path(state_dir) / JOBS_FILE, dict, recheck_secs=0.5
        )

    def owner(self, fleet: str, name: str) -> str | None:
        owner, _ = self.claimed(fleet, name)
        return owner

    def claimed(self, fleet: str, name: str) -> tuple[str | None, str | None]:
        """Return who claimed ``name`` and, once its create answered,
        machine_identity() of the machine.
        """
        held = self.file.read().get(fleet, {}).get(name)
        if isinstance(held, dict):
            return held.get("owner"), held.get("id")
        return held, None

    def claim(
        self, fleet: str, name: str, owner: str, identity: str | None = None
    ) -> None:
        held = owner
        if identity:
            held = {"owner": owner, "id": identity}
        self.file.update(
            lambda data: data.setdefault(fleet, {}).__setitem__(name, held)
        )

    def clear(self, fleet: str, names: list[str]) -> None:
        def drop(data: dict) -> None:
            for name in names:
                data.get(fleet, {}).pop(name, None)

        if set(names) & set(self.jobs.read().get(fleet, {})):
            self.jobs.update(drop)
        if any(self.owner(fleet, name) for name in names):
            self.file.update(drop)

    def note_job(
        self, fleet: str, name: str, job: dict, started: bool = False
    ) -> None:
        """Note a job's last-seen state if this server ``started`` it or
        noted it before; a failure is logged.
        """
        seen = {
            "jobId": job["jobId"],
            "state": job["state"],
            "exitCode": job.get("exitCode"),
        }

        def change(data: dict) -> None:
            jobs = data.setdefault(fleet, {}).setdefault(name, [])
            ids = [job["jobId"] for job in jobs]
            at = len(jobs)
            if seen["jobId"] in ids:
                at = ids.index(seen["jobId"])
            jobs[at : at + 1] = [seen]
            del jobs[:-JOBS_KEPT]

        try:
            known = self.jobs.read().get(fleet, {}).get(name, [])
            if seen in known:
                return
            if started or seen["jobId"] in [job["jobId"] for job in known]:
                self.jobs.update(change)
        except SmolError as err:
            log.warning(
                "could not record job %s of %s: %s", seen["jobId"], name, err
            )

    def release(self, fleet: str, name: str, owner: str) -> None:
        """Forget a claim that came to nothing, unless another owner holds
        the name by now.
        """

        def drop(data: dict) -> None:
            # A bare claim, made before the create.
            if data.get(fleet, {}).get(name) == owner:
                del data[fleet][name]

        if self.owner(fleet, name) == owner:
            self.file.update(drop)


def valid_states(data: Any) -> bool:
    """Whether the states file holds fleet -> state -> a record naming its
    owner.
    """
    if not isinstance(data, dict):
        return False
    fleets = list(data.values())
    if not all(isinstance(states, dict) for states in fleets):
        return False
    return all(
        isinstance(record, dict) and isinstance(record.get("owner"), str)
        for states in fleets
        for record in states.values()
    )


class States:
    """The saved states (save-machine), per fleet: who saved each, the
    engine's handle for it (``ref``), its source and when. A name is
    claimed (``id``) before the engine is asked and settled after, so two
    saves cannot take one name, nor one owner more than STATES_PER_TOKEN.
    """

    def __init__(self, state_dir: str):
        self.file = StateFile(
            Path(state_dir) / STATES_FILE, dict, valid_states
        )

    def records(self, fleet: str, owner: str | None = None) -> dict:
        """Return state -> record on ``fleet``: ``owner``'s only, unless
        None.
        """
        held = self.file.read().get(fleet, {})
        return {
            state: dict(record)
            for state, record in held.items()
            if owner is None or record["owner"] == owner
        }

    def find(
        self, fleet: str, state: str, owner: str | None = None
    ) -> dict | None:
        return self.records(fleet, owner).get(state)

    def claim(self, fleet: str, state: str, owner: str) -> str:
        """Claim ``state`` for ``owner``; return the claim's id. Raise
        SmolError when the name is taken on the fleet, or the owner holds
        STATES_PER_TOKEN states already.
        """
        claim_id = secrets_module.token_hex(8)

        def add(data: dict) -> None:
            held = data.setdefault(fleet, {})
            if state in held:
                raise SmolError(
                    f"a saved state named '{state}' exists already on the "
                    f"{fleet} fleet; pick another name, or delete-state it "
                    "first"
                )
            owned = [
                record
                for states in data.values()
                for record in states.values()
                if record.get("owner") == owner
            ]
            if len(owned) >= STATES_PER_TOKEN:
                raise SmolError(
                    f"this caller holds {len(owned)} saved states, the most "
                    f"one token may ({STATES_PER_TOKEN}); delete-state one "
                    "it no longer needs (list-states shows them), then save "
                    "again"
                )
            held[state] = {
                "owner": owner,
                "id": claim_id,
                "ref": None,
                "createdAt": utc_now(),
            }

        self.file.update(add)
        return claim_id

    def settle(
        self, fleet: str, state: str, claim_id: str, **fields: Any
    ) -> dict | None:
        """Add what the save answered to its claim; return the record, or
        None when the claim is gone (deleted meanwhile).
        """

        def put(data: dict) -> dict | None:
            held = data.get(fleet, {}).get(state)
            if held is None or held.get("id") != claim_id:
                return None
            held.update(fields)
            return dict(held)

        return self.file.update(put)

    def release(self, fleet: str, state: str, claim_id: str) -> None:
        """Drop a claim that came to nothing (only that claim)."""

        def drop(data: dict) -> None:
            held = data.get(fleet, {}).get(state)
            if held is not None and held.get("id") == claim_id:
                del data[fleet][state]

        self.file.update(drop)

    def forget(self, fleet: str, state: str) -> None:
        if self.find(fleet, state) is not None:
            self.file.update(lambda data: data[fleet].pop(state, None))

    def forget_refs(self, fleet: str, refs: list[str]) -> None:
        """Forget the states whose engine copies ``refs`` are gone."""
        gone = [
            state
            for state, record in self.records(fleet).items()
            if record.get("ref") in refs
        ]
        for state in gone:
            self.forget(fleet, state)


class OwnedFleet:
    """A fleet as a sandbox.* principal sees it: another's machine is
    answered as a missing one.
    """

    def __init__(self, fleet: Any, owners: Owners, owner: str):
        self._fleet = fleet
        self._owners = owners
        self._owner = owner

    def mine(self, name: str, record: dict | None = None) -> bool:
        """Whether ``name`` is this owner's, and still the machine it
        created rather than one made again under that name.
        """
        owner, identity = self._owners.claimed(self._fleet.name, name)
        return owner == self._owner and same_machine(
            self._fleet, name, identity, record
        )

    def __getattr__(self, attr: str) -> Any:
        value = getattr(self._fleet, attr)
        unguarded = ("acquire", "release", "create_machine")
        if not callable(value) or attr in unguarded:
            return value
        if attr == "list_machines":
            return lambda: [m for m in value() if self.mine(m["name"], m)]
        return functools.partial(self._guarded, value)

    def _guarded(self, method: Callable, /, *args: Any, **kwargs: Any) -> Any:
        """Call ``method`` on a machine of this owner's; on another's,
        answer as on a missing machine.
        """
        if not args or not isinstance(args[0], str) or self.mine(args[0]):
            return method(*args, **kwargs)
        name = args[0]
        prefix = self._fleet.config.machine_prefix
        absent = f"{prefix}absent-{secrets_module.token_hex(8)}"
        try:
            method(absent, *args[1:], **kwargs)
        except SmolError as err:
            if isinstance(err, ApiError):
                err.action = err.action.replace(absent, name)
                err.api_message = err.api_message.replace(absent, name)
            err.args = tuple(
                a.replace(absent, name) if isinstance(a, str) else a
                for a in err.args
            )
            raise err from None
        raise ApiError(
            self._fleet.name,
            f"find machine '{name}'",
            404,
            "NOT_FOUND",
            f"machine '{name}' not found",
        )


class Access:
    """This process's principals and what they own: tokens, owners, the
    activity log and approvals.
    """

    def __init__(self, config: Config, environ: dict[str, str] | None = None):
        if environ is None:
            environ = os.environ
        state = config.state_dir or default_state_dir(dict(environ))
        self.state_dir = state
        self.tokens = TokenStore(state)
        self.owners = Owners(state)
        self.states = States(state)
        self.auto = AutoApprovals(state)
        self.activity = ActivityLog(state)
        self.desk = ApprovalDesk(state)
        self._default_hash = None
        if config.auth_token:
            self._default_hash = secret_hash(config.auth_token)
        self.default = Principal("default", frozenset(SCOPES), id="default")
        self.stdio = Principal(
            "stdio",
            frozenset(config.scopes or SCOPES),
            approval=config.approval,
            kind="stdio",
            user=os_user(),
            id="stdio",
        )
        self._warned = False

    def token_for(self, offered: list[str]) -> Principal | None:
        """Return the principal whose secret is among ``offered``, or None.

        A secret the tokens file lacks (but not the default token's)
        reads the file again at once.
        """
        hashes = [secret_hash(one) for one in offered if one]
        default = self._default_hash
        # Every comparison runs (a list, not a generator), whichever
        # matches.
        is_default = default is not None and any(
            [hmac.compare_digest(digest, default) for digest in hashes]
        )
        try:
            record = self.tokens.match_hashes(hashes, again=not is_default)
        # A damaged tokens file lets no named token in.
        except SmolError as err:
            if not self._warned:
                log.warning("%s; named tokens are refused until then", err)
                self._warned = True
            record = None
        if record is None and is_default:
            return self.default
        if record is None:
            return None
        self.tokens.touch(record["name"])
        return token_principal(
            record["name"],
            tuple(record.get("scopes", [])),
            tuple(record.get("targets") or FLEETS),
            record.get("approval", "none"),
            record.get("id", ""),
        )

    def live_ids(self) -> dict[str, str]:
        """Return name -> id of every principal that may still make
        requests.
        """
        default = {}
        if self._default_hash is not None:
            default["default"] = "default"
        try:
            tokens = self.tokens.records()
        except SmolError:
            return default
        return {
            token["name"]: token.get("id", "") for token in tokens
        } | default

    def fleet_for(
        self, principal: Principal, grant: Grant, fleet: Fleet
    ) -> Fleet:
        """Return the fleet as ``grant`` lets the principal see it."""
        if grant.owned_only:
            return OwnedFleet(fleet, self.owners, principal.name)
        return fleet


# -- Activity log and approvals -----------------------------------------------
# What an agent changed is written down before it is told the result,
# and any change can be held until a person on the host answers. Both
# are plain files in the state directory, shared by server processes
# and terminal commands without a daemon: the log is appended under a
# file lock; an approval is a request file naming the waiting process
# (pid and start time: no request outlives it) and the answer file
# `approvals approve|deny` writes next to it.

ACTIVITY_URI = "smol://activity"
ACTIVITY_FILE = "activity.jsonl"
ACTIVITY_KEEP_FILES = 5
# Then activity.jsonl.1 ... .5; the oldest is dropped.
ACTIVITY_ROTATE_BYTES = 8 * 1024 * 1024
# A page: what smol://activity and `activity` show at most, in entries
# and in bytes.
ACTIVITY_RESOURCE_ENTRIES = 200
ACTIVITY_PAGE_BYTES = 512 * 1024
# A longer value is cut, keeping its byte count and SHA-256.
ACTIVITY_FIELD_BYTES = 2048
APPROVALS_DIR = "approvals"
AUTO_APPROVE_FILE = "auto-approve.json"
# A terminal's answer is seen within a second.
APPROVAL_POLL_SECS = 0.25
APPROVAL_PROGRESS_SECS = 5
# The calls one token (or stdio server) may hold waiting; more are
# refused.
APPROVAL_MAX_WAITING = 16
# What `approvals list` shows of a value; of the rest, its byte count
# and SHA-256.
APPROVAL_SHOW_BYTES = 4096
# Approval notices post from one bounded pool.
WEBHOOK_THREADS = 2
WEBHOOK_QUEUE = 64
# A 2026-era confirmation (allow-egress) answers within this, once.
CONFIRM_TTL_SECS = 600
AUTO_APPROVE_PERIODS = {
    "1h": 3600,
    "1d": 86400,
    "7d": 604800,
    "30d": 2592000,
    "forever": None,
}
# Arguments that are the agent's data, not a description of the call:
# the log keeps their size and digest, so a reader can match them
# without holding them (a file with a key must not copy it here).
REDACTED_ARGUMENTS = ("content", "stdin")
REDACTED_MAPS = ("env",)


class ApprovalRefused(SmolError):
    """A held call that got no approval; the text starts with its code."""

    def __init__(self, code: str, detail: str):
        self.code = code
        super().__init__(f"{code}: {detail}")


def fingerprint(value: str) -> dict:
    """Return what the log keeps of a value it must not copy: its size
    and SHA-256.
    """
    return {
        "bytes": len(value.encode("utf-8", "surrogatepass")),
        "sha256": secret_hash(value),
    }


def redact_arguments(arguments: dict, schema: dict | None = None) -> dict:
    """Return the arguments as the log shows them.

    content, stdin, each value of env, and any argument the schema does
    not know appear as their size and digest.
    """
    properties = (schema or {}).get("properties")
    known = arguments if properties is None else properties
    shown = {}
    for key, value in arguments.items():
        if key in REDACTED_MAPS and isinstance(value, dict):
            shown[key] = {
                name: fingerprint(str(item)) for name, item in value.items()
            }
        elif key in (*REDACTED_ARGUMENTS, *REDACTED_MAPS) or key not in known:
            if not isinstance(value, str):
                value = json.dumps(value)
            shown[key] = fingerprint(value)
        else:
            shown[key] = value
    return shown


def approval_arguments(call: Any) -> dict:
    """Return what a person judges a held call by: all its arguments,
    each cut at APPROVAL_SHOW_BYTES.
    """
    return bounded(
        dict(getattr(call.params, "arguments", None) or {}),
        APPROVAL_SHOW_BYTES,
    )


def bounded(value: Any, limit: int = ACTIVITY_FIELD_BYTES) -> Any:
    """Return ``value`` with no string over ``limit`` bytes, nor the whole
    over 4 times that as JSON.

    What is longer is cut to its head, with the byte count and SHA-256
    of the whole.
    """
    if isinstance(value, str):
        data = value.encode("utf-8", "surrogatepass")
        if len(data) <= limit:
            return value
        return {
            "cut": data[: limit // 2].decode("utf-8", "ignore"),
            **fingerprint(value),
        }
    if isinstance(value, dict):
        items = list(value.items())[:64]
        inner = {str(k)[:128]: bounded(v, limit) for k, v in items}
    elif isinstance(value, list):
        inner = [bounded(v, limit) for v in value[:64]]
    else:
        return value
    text = json.dumps(value, default=str)
    if len(inner) == len(value) and len(json.dumps(inner)) <= 4 * limit:
        return inner
    return {"cut": text[: limit // 2], **fingerprint(text)}


def activity_json(entry: dict) -> str:
    """One activity line's JSON; raise ValueError for a NaN or an
    infinity, which strict JSON does not allow."""
    return json.dumps(
        entry, ensure_ascii=False, separators=(",", ":"), allow_nan=False
    )


def os_user() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return str(os.getuid())


class ActivityLog:
    """activity.jsonl: a JSON object a line, each written under a lock;
    rotated into .1 to .5.
    """

    def __init__(self, state_dir: str | Path):
        self.path = Path(state_dir) / ACTIVITY_FILE

    def append(self, entry: dict, secret_values: list[str] = ()) -> None:
        """Write one entry; raise OSError or SmolError when the state
        directory cannot take it.
        """
        entry = {
            "time": utc_now(),
            **{key: bounded(value) for key, value in entry.items()},
        }
        try:
            text = activity_json(entry)
        except ValueError:
            # A NaN or an infinity got this far: written as the string
            # that names it, never bare (strict readers refuse the line)
            # nor lost.
            text = activity_json(finite_json(entry))
        line = (redact(text, list(secret_values)) + "\n").encode("utf-8")
        ensure_state_dir(self.path.parent)
        with locked(self.path.with_name(ACTIVITY_FILE + ".lock")):
            self._rotate_before(len(line))
            fd = os.open(
                self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600
            )
            with open(fd, "ab", buffering=0) as out:
                written = out.write(line)
                # A full disk: never leave half a line behind.
                if written != len(line):
                    out.truncate(os.fstat(fd).st_size - written)
                    raise OSError(28, "No space left on device")

    def _rotate_before(self, adding: int) -> None:
        """Rotate the files if ``adding`` bytes would take the log past
        ACTIVITY_ROTATE_BYTES: .4 replaces .5, and the oldest goes.
        """
        if not self.path.exists():
            return
        size = self.path.stat().st_size
        if not size or size + adding <= ACTIVITY_ROTATE_BYTES:
            return
        for index in range(ACTIVITY_KEEP_FILES - 1, 0, -1):
            if self.older(index).exists():
                self.older(index).replace(self.older(index + 1))
        self.path.replace(self.older(1))

    def older(self, index: int) -> Path:
        return self.path.with_name(f"{ACTIVITY_FILE}.{index}")

    def entries(
        self, keep: Callable = bool, limit: int | None = None, max_bytes=0
    ) -> list[dict]:
        """Return the latest ``limit`` entries ``keep`` accepts, oldest
        first, in at most ``max_bytes`` of lines.

        The newest files are read first, no further than needed, and
        split on "\\n" only.
        """
        found = []
        size = 0
        older = [self.older(i) for i in range(1, ACTIVITY_KEEP_FILES + 1)]
        for path in [self.path, *older]:
            try:
                lines = path.read_bytes().split(b"\n")
            except (FileNotFoundError, NotADirectoryError):
                continue
            for line in reversed(lines):
                try:
                    # A line written before the guard may hold a bare
                    # NaN: read as the string "NaN".
                    entry = json.loads(
                        line.decode("utf-8", "replace"), parse_constant=str
                    )
                except ValueError:
                    continue
                if not isinstance(entry, dict) or not keep(entry):
                    continue
                size += len(line) + 1
                full = limit is not None and len(found) >= limit
                if full or (max_bytes and size > max_bytes):
                    return found[::-1]
                found.append(entry)
        return found[::-1]


def activity_filter(
    principal=None, machine=None, since_secs: int | None = None
) -> Callable:
    """Return a test of an entry: by ``principal``, on ``machine``, and
    within the last ``since_secs``, each when given.
    """
    cutoff = None
    if since_secs is not None:
        cutoff = time.time() - since_secs

    def keep(entry: dict) -> bool:
        for key, wanted in (("principal", principal), ("machine", machine)):
            if wanted is not None and entry.get(key) != wanted:
                return False
        if cutoff is None:
            return True
        try:
            return parse_time(entry.get("time", "")) >= cutoff
        except ValueError:
            return False

    return keep


def waiting_process_alive(request: dict) -> bool:
    """Whether the process that filed ``request`` still waits on it."""
    # The start times are both None without /proc.
    pid = request.get("pid")
    alive = isinstance(pid, int) and process_alive(pid)
    return alive and process_start_time(pid) == request.get("pidStart")


class ApprovalDesk:
    """The approvals directory: <id>.request.json of a waiting server,
    and <id>.answer.json answering it.
    """

    def __init__(self, state_dir: str | Path):
        self.directory = Path(state_dir) / APPROVALS_DIR

    def path_of(self, approval_id: str, kind: str) -> Path:
        if not re.fullmatch(r"[a-f0-9]{12}", approval_id):
            raise SmolError(
                f"{approval_id!r} is not an approval id;"
                " `approvals list` shows them"
            )
        return self.directory / f"{approval_id}.{kind}.json"

    def open(self, request: dict) -> str:
        """File ``request`` for this process; return its id."""
        ensure_state_dir(self.directory.parent)
        self.directory.mkdir(mode=0o700, exist_ok=True)
        approval_id = secrets_module.token_hex(6)
        pid = os.getpid()
        request = dict(
            request, id=approval_id, pid=pid, pidStart=process_start_time(pid)
        )
        write_json(self.path_of(approval_id, "request"), request)
        return approval_id

    def answer(self, approval_id: str) -> dict | None:
        path = self.path_of(approval_id, "answer")
        try:
            answer = json.loads(path.read_text())
        except (OSError, ValueError):
            return None
        if not isinstance(answer, dict):
            return None
        return answer

    def close(self, approval_id: str) -> None:
        for kind in ("request", "answer"):
            self.path_of(approval_id, kind).unlink(missing_ok=True)

    def pending(self) -> list[dict]:
        """Return the requests still waited on and unanswered, oldest
        first; those of a stopped process go.
        """
        found = []
        for path in self.directory.glob("*.request.json"):
            try:
                request = json.loads(path.read_text())
                approval_id = str(request["id"])
                answered = self.path_of(approval_id, "answer").exists()
            except (OSError, ValueError, KeyError, TypeError, SmolError):
                continue
            try:
                expired = parse_time(request["expiresAt"]) < time.time()
            except (KeyError, TypeError, ValueError):
                expired = True
            # Nobody can act on it any more.
            if expired or not waiting_process_alive(request):
                self.close(approval_id)
            elif not answered:
                found.append(request)
        return sorted(
            found, key=lambda request: str(request.get("requestedAt", ""))
        )

    def respond(self, approval_id: str, answer: dict) -> dict:
        """Answer a waiting request and return it; raise SmolError for an
        unknown, stale or answered id.
        """
        try:
            request = json.loads(
                self.path_of(approval_id, "request").read_text()
            )
        except (OSError, ValueError):
            listed = "`approvals list` shows the calls that wait"
            raise SmolError(
                f"no call waits for approval {approval_id}; {listed}"
            ) from None
        if not waiting_process_alive(request):
            self.close(approval_id)
            raise SmolError(
                f"the server that held {approval_id} has stopped, so that"
                " call was refused (approval_interrupted); there is"
                " nothing to answer"
            )
        answer_path = self.path_of(approval_id, "answer")
        if answer_path.exists():
            raise SmolError(f"{approval_id} was answered already")
        write_json(answer_path, answer)
        return request


class AutoApprovals:
    """Who may run changing tools unasked: name -> {id, until}; a new
    namesake's id asks again.
    """

    def __init__(self, state_dir: str | Path):
        self.file = StateFile(Path(state_dir) / AUTO_APPROVE_FILE, dict)

    def until(self, principal: Principal) -> str | None:
        """Return until when it may run without asking: "forever", an RFC
        3339 time, or None.
        """
        try:
            granted = self.file.read().get(principal.name)
            if (
                not isinstance(granted, dict)
                or granted.get("id") != principal.id
            ):
                return None
            if granted.get("until") is None:
                return "forever"
            if parse_time(granted["until"]) <= time.time():
                return None
            return granted["until"]
        except (SmolError, ValueError, TypeError):
            return None

    def grant(self, name: str, principal_id: str, period: str) -> str:
        seconds = AUTO_APPROVE_PERIODS[period]
        until = None
        if seconds is not None:
            until = utc_time(time.time() + seconds)
        self.file.update(
            lambda data: data.__setitem__(
                name, {"id": principal_id, "until": until}
            )
        )
        return until or "forever"

    def end(self, name: str) -> bool:
        if not self.file.path.exists():
            return False
        return self.file.update(lambda data: data.pop(name, None) is not None)

    def shown(self, name: str, principal_id: str) -> str:
        """Return what `tokens list` says of a principal's auto-approval."""
        principal = Principal(name, frozenset(), id=principal_id)
        return self.until(principal) or "off"


def post_webhook(url: str, payload: dict) -> str | None:
    """POST an approval notice (never the arguments); return the failure
    as a sentence, or None.
    """
    try:
        import httpx2

        response = httpx2.post(url, json=payload, timeout=10)
        if response.status_code >= 300:
            return f"the approval webhook answered HTTP {response.status_code}"
    # Any failure is reported, never raised into the waiting call.
    except Exception as err:
        return f"the approval webhook failed ({type(err).__name__}: {err})"
    return None


# ---------------------------------------------------------------------------
# 12. The MCP server
#
# One low-level mcp Server serves both protocol eras. Its lifespan is
# entered once per stdio process (and once per in-memory client), which
# is exactly the life of a stdio session, so the session lives there
# and is cleaned up as the lifespan exits, however the connection ended.
# ---------------------------------------------------------------------------

ELICIT_TIMEOUT_SECS = 120
JSON_TYPE = "application/json"


def fleet_question(fleets: dict[str, Fleet]) -> tuple[str, dict]:
    """Return the question that asks a session which of ``fleets`` it is
    for, and its form: each fleet by name, or both (decide per call)."""
    served = spoken(fleet.served_as for fleet in fleets.values())
    message = (
        f"This smol-mcp server reaches these fleets of machines: {served}."
        " Which one is this session for?"
        " Choose both to name the fleet on every call."
    )
    choice = {
        "type": "string",
        "title": "Fleet",
        "enum": [*fleets, "both"],
        "description": ", ".join(fleets) + ", or both (decide per call)",
    }
    schema = {
        "type": "object",
        "required": ["fleet"],
        "properties": {"fleet": choice},
    }
    return message, schema


def target_argument(fleets: dict[str, Fleet]) -> dict:
    """Return the ``target`` argument that names one of ``fleets``."""
    served = spoken((fleet.served_as for fleet in fleets.values()), "or")
    return {
        "type": "string",
        "enum": list(fleets),
        "description": (
            f"Which fleet: {served}. Required: a machine on one fleet is"
            " invisible on another, so there is no default."
        ),
    }


def target_names(fleets: dict[str, Fleet]) -> str:
    """Return the fleets as messages name them: '"local" or "cloud"'."""
    return spoken((f'"{name}"' for name in fleets), "or")


@functools.cache
def sdk_types():
    """Return the SDK's mcp_types, imported at first use: stdio startup
    loads no SDK (once: an import statement costs a microsecond or two a
    call).
    """
    import mcp_types

    return mcp_types


class AskClient(Exception):
    """A 2026-era question for the person (InputRequiredResult): the call
    answers with it.
    """

    def __init__(self, state: str, requests: dict):
        super().__init__("input required")
        question = sdk_types().InputRequiredResult
        self.question = question(request_state=state, input_requests=requests)


def can_elicit(ctx) -> bool:
    """Whether the client can show a form (said at initialize, or per
    2026-era request).
    """
    if ctx is None:
        return False
    asks = getattr(ctx.session.client_capabilities, "elicitation", None)
    if asks is None:
        return False
    return not (asks.form is None and asks.url is not None)


def modern(ctx) -> bool:
    """Whether the request speaks the 2026 era (questions travel in the
    result).
    """
    return ctx.protocol_version in sdk_types().version.MODERN_PROTOCOL_VERSIONS


def form_question(message: str, schema: dict):
    types = sdk_types()
    params = types.ElicitRequestFormParams(
        message=message, requested_schema=schema
    )
    return types.ElicitRequest(params=params)


def elicit_result(answer: Any):
    """Return a 2026-era answer as the client sent it (a dict) read as an
    ElicitResult.
    """
    if isinstance(answer, dict):
        return sdk_types().ElicitResult.model_validate(answer)
    return answer


def resolve_mode(config: Config) -> str:
    """Return the mode, decided at startup: the one fleet served, "both"
    when it is every fleet, else the served fleets joined by commas.

    auto serves every fleet the configuration allows; any other targets
    value serves the fleets it names, refused when one lacks something.
    """
    lacking = {name: fleet.lacking(config) for name, fleet in FLEETS.items()}
    if config.targets == "auto":
        served = [name for name, why in lacking.items() if why is None]
        if not served:
            needs = "; ".join(
                f"{name} needs {lacking[name]}" for name in FLEETS
            )
            raise ConfigError(f"SMOL_MCP_TARGETS=auto finds no fleet: {needs}")
        return mode_of(served)
    try:
        served = named_fleets(config.targets)
    except ValueError as err:
        accepted = fleets_accepted("auto")
        raise ConfigError(
            f"SMOL_MCP_TARGETS must be {accepted}; {err}"
        ) from None
    for name in served:
        if lacking[name]:
            raise ConfigError(
                f"SMOL_MCP_TARGETS={config.targets} needs {lacking[name]}"
            )
    return mode_of(served)


def mode_of(served: Iterable[str]) -> str:
    """Return the mode that serves these fleets: a fleet's name, "both"
    (every fleet), or the fleets joined by commas."""
    served = tuple(served)
    if len(served) > 1 and set(served) == set(FLEETS):
        return "both"
    return ",".join(served)


def configured_schema(tool: ToolSpec, config: Config) -> dict:
    """Return a tool's input schema with the configured timeoutSecs
    ceiling: it offers no value the server refuses.
    """
    schema = tool.input_schema
    if schema["properties"].get("timeoutSecs") is not ARG_TIMEOUT:
        return schema
    ceiling = {**ARG_TIMEOUT, "maximum": config.max_exec_timeout_secs}
    return {
        **schema,
        "properties": {**schema["properties"], "timeoutSecs": ceiling},
    }


def server_instructions(app: SmolMcp) -> str:
    """Return what the server tells the agent at initialize."""
    config = app.config
    served = spoken(fleet.served_as for fleet in app.fleets.values())
    lines = [
        "smol-mcp gives you microVMs (smol machines) to work in instead of"
        " this computer: every command you run with these tools executes"
        f" inside a guest, never on the host. This process serves {served}.",
        "- Typical flow: create-machine (waits until the guest runs"
        " commands), run-command, write-file/read-file, delete-machine."
        " run-once does create, run and delete in one call.",
        '- Egress is blocked unless you pass network: "open" or'
        " allowHosts/allowCidrs.",
        f"- Machines named {config.machine_prefix}… (and unnamed ones) are"
        " ephemeral: deleted when this session ends. Any other name"
        " persists.",
        f"- Output beyond {config.max_output_bytes} bytes per stream or"
        f" {config.reply_tokens} tokens per result keeps its head and tail;"
        " the whole stream is saved in the machine at the path in overflow."
        " read-file pages with offset/length.",
        "- A non-zero exit code is a result, not an error. Commands time out"
        f" after {config.exec_timeout_secs} s by default (timeoutSecs up to"
        f" {config.max_exec_timeout_secs}).",
        "- branch-machine needs a running source created with branchable:"
        " true.",
        "- pause-machine keeps a machine's memory and processes while it"
        " uses no CPU; a command, read or write on it resumes it"
        " (resumedMachine: true). save-machine keeps a running machine as a"
        " named state that create-machine {from: STATE} starts new machines"
        " from.",
        '- run-command with shell: "NAME" keeps cd and export from one'
        " command to the next in that shell. expose-port gives the URL a"
        " person opens for a port the machine serves on 0.0.0.0.",
    ]
    if app.takes_target:
        named = target_names(app.fleets)
        lines.append(
            f"- Every tool needs target: {named}; there is no default."
        )
    lines.extend(fleet.instruction for fleet in app.fleets.values())
    lines.extend(unserved_tools_lines(app.fleets))
    lines.append(
        "- smol://targets says whether each fleet is usable right now,"
        " and why not."
    )
    if app.approvals.apply():
        lines.append(
            "- Approvals: a tool that changes something may wait for a"
            " person on the server's host to approve it (up to"
            f" {config.approval_timeout_secs} s; progress notifications say"
            " so and name the command that approves it). Read-only tools"
            " answer at once. You cannot approve anything yourself. A"
            " refusal starts with a code: approval_rejected (a person said"
            " no; the reason follows), approval_timed_out (nobody answered),"
            " approval_cancelled (the call stopped waiting),"
            " approval_interrupted (the server stopped),"
            " approval_token_deleted, approval_unavailable (approvals cannot"
            " be asked for here). Nothing ran in any of these cases; ask the"
            " person before trying again."
        )
    return "\n".join(lines)


def unserved_tools_lines(fleets: dict[str, Fleet]) -> list[str]:
    """Return the instructions' lines on the tools some of ``fleets`` do
    not serve, each naming the fleets that do (from each ToolSpec)."""
    only: dict[tuple[str, ...], list[str]] = {}
    for tool in TOOLS:
        if not all(tool.serves(name) for name in fleets):
            only.setdefault(tool.fleets, []).append(tool.name)
    lines = []
    for serving, names in only.items():
        verb = "is" if len(names) == 1 else "are"
        lines.append(f"- {spoken(names)} {verb} {spoken(serving)} only.")
    return lines


@functools.cache
def dual_era_server_class() -> type:
    """Return the SDK's Server, advertising tools.listChanged however it
    is asked for its options (Client(server) asks without any).

    Built on first use: importing this module loads no mcp.
    """
    from mcp.server import NotificationOptions, Server

    class DualEraServer(Server):
        def create_initialization_options(
            self, notification_options=None, *args, **kwargs
        ):
            options = notification_options or NotificationOptions(
                tools_changed=True
            )
            return super().create_initialization_options(
                options, *args, **kwargs
            )

    return DualEraServer


@asynccontextmanager
async def no_lifespan(server: Any):
    """The lifespan of a server whose process's lifespan another's runs."""
    yield {}


def no_header_schema(name: str) -> None:
    """The SDK's lookup of a tool's schema for Mcp-Param-* headers: none,
    as no tool declares x-mcp-header (a test holds that), so there is
    nothing to check them against. Without the lookup the SDK would list
    every tool, serialized, at each 2026-era call to find the schema."""
    return None


class SmolMcp:
    """Everything one process serves: the config, the fleets, and the MCP
    server.

    Its methods are the handlers of tools and sessions, and the steps of
    a tool call. What a client reads and follows is Resources; a call
    held for a person's answer is Approvals.
    """

    def __init__(self, config: Config, environ: dict[str, str] | None = None):
        self.config = config
        self.mode = resolve_mode(config)
        self.access = Access(config, environ)
        # Always built (inert), for smol://targets.
        self.local = LocalFleet(config, environ)
        self.fleets: dict[str, Fleet] = self.served_fleets(environ)
        # The operator's warmPools: made at the first local tool call.
        self.pools = WarmPools(self)
        # More than one fleet: every tool takes a target, and a session
        # is asked which fleet it is for.
        self.takes_target = len(self.fleets) > 1
        self.target_argument = target_argument(self.fleets)
        self._limiter = None
        self._swept = False
        self._tool_lists: dict[tuple, list] = {}
        # Tool name -> its argument validator, built once.
        self.checkers: dict[str, Any] = {}
        # Tool name -> its quick_check (None: jsonschema alone).
        self.quick_checks: dict[str, Any] = {}
        # Seals the state of 2026-era questions.
        self.state_key = secrets_module.token_bytes(32)
        # Set when serving Streamable HTTP.
        self.http: HttpSessions | None = None
        # The sign-in pages of --http (section 14b).
        self.pages: Pages | None = None
        # Machines whose last command failed.
        self.failed_last: set[tuple[str, str]] = set()
        # Set on SIGTERM/SIGINT: a waiting approval ends as interrupted.
        self.stopping = False
        # Principal id -> its log pollers (subscriptions).
        self.polling: dict[str, int] = {}
        self.approvals = Approvals(self)
        self.resources = Resources(self)
        self.server = self.mcp_server(self.lifespan)

    def mcp_server(self, lifespan: Callable) -> Any:
        """The SDK's low-level server of this process's handlers, with
        ``lifespan``."""
        return dual_era_server_class()(
            "smol-mcp",
            version=__version__,
            title="smol machines",
            instructions=server_instructions(self),
            lifespan=lifespan,
            get_tool_input_schema=no_header_schema,
            on_list_tools=self.on_list_tools,
            on_call_tool=self.call_tool,
            on_list_resources=self.resources.on_list_resources,
            on_list_resource_templates=(
                self.resources.on_list_resource_templates
            ),
            on_read_resource=self.resources.on_read_resource,
            on_subscribe_resource=self.resources.on_subscribe,
            on_unsubscribe_resource=self.resources.on_unsubscribe,
            on_subscriptions_listen=self.resources.listen,
        )

    def served_fleets(self, environ: dict[str, str] | None) -> dict:
        """Return the fleets this mode serves, by name; the local one is
        self.local.
        """
        fleets = {}
        for name in named_fleets(self.mode):
            if FLEETS[name] is LocalFleet:
                fleets[name] = self.local
            else:
                fleets[name] = FLEETS[name](self.config, environ)
        return fleets

    def thread_limiter(self):
        """Return the threads for blocking API calls: enough that long
        commands never queue short ones.
        """
        if self._limiter is None:
            self._limiter = anyio.CapacityLimiter(128)
        return self._limiter

    @asynccontextmanager
    async def lifespan(self, server: Any):
        # Over HTTP it is entered once for the whole listener, which
        # holds many sessions.
        async with anyio.create_task_group() as tasks:
            if self.http is not None:
                async with self.http.running(tasks):
                    yield {}
                return
            session = self.open_session(secrets_module.token_hex(4), tasks)
            try:
                yield {"session": session}
            finally:
                # Its log pollers end with it.
                tasks.cancel_scope.cancel()
                await self.end_session(session)

    async def on_list_tools(self, ctx, params):
        # Only a process of several fleets has a session choose one.
        with_target = (
            self.takes_target and self.session_for(ctx).target is None
        )
        tools = self.tool_list(with_target, self.principal_for(ctx))
        return sdk_types().ListToolsResult(tools=tools)

    def tool_list(
        self, with_target: bool, principal: Principal | None = None
    ) -> list:
        """Return the tools its scopes grant, as shown; cached per shape
        (2026-era clients list often).
        """
        key = (with_target, (principal or self.access.stdio).tools())
        if key not in self._tool_lists:
            self._tool_lists[key] = [
                self.mcp_tool(TOOLS_BY_NAME[n], with_target) for n in key[1]
            ]
        return self._tool_lists[key]

    def principal_for(self, ctx) -> Principal:
        """Return who sent the request: the token HttpGate found, or the
        stdio principal.
        """
        if ctx.request is None:
            return self.access.stdio
        return ctx.request.scope["state"]["smol_principal"]

    def mcp_tool(self, tool: ToolSpec, with_target: bool):
        """Return the tool as a client is shown it; with_target (several
        fleets) adds a required target.
        """
        types = sdk_types()
        schema = configured_schema(tool, self.config)
        if with_target:
            required = ["target", *schema["required"]]
            target = self.target_argument
            properties = {"target": target, **schema["properties"]}
            schema = {**schema, "properties": properties, "required": required}
        annotations = types.ToolAnnotations(
            title=tool.title,
            read_only_hint=tool.read_only,
            destructive_hint=tool.destructive,
            idempotent_hint=tool.idempotent,
            open_world_hint=tool.open_world,
        )
        return types.Tool(
            name=tool.name,
            title=tool.title,
            description=tool.description,
            input_schema=schema,
            output_schema=tool.output_schema,
            annotations=annotations,
        )

    def session_for(self, ctx) -> Session:
        """Return a request's session: the lifespan's on stdio and in
        memory, else HttpSessions'.
        """
        if ctx.request is None:
            return ctx.lifespan_context["session"]
        return self.http.session_for(ctx)

    def open_session(self, session_id: str, tasks: Any) -> Session:
        """Return a new session; it holds the fleets (the serve) until
        end_session.
        """
        for fleet in self.fleets.values():
            fleet.acquire()
        return Session(self, session_id, tasks)

    def fleet_for(
        self, session: Session, name: str, arguments: dict, params: Any = None
    ) -> Any:
        """Return the fleet a call goes to, taking `target` out of the
        arguments; raise ArgumentError when it names none it may use.
        """
        if not self.takes_target:
            return next(iter(self.fleets.values()))
        # The call whose question made the choice may still name a fleet.
        asked_here = params is not None and params is session.chose_during
        overrides = asked_here and "target" in arguments
        if session.target is not None and not overrides:
            given = arguments.pop("target", session.target)
            if given != session.target:
                raise ArgumentError(
                    f"this session chose the {session.target} fleet at its"
                    f' first call, so target "{given}" is not available in'
                    " it; use a new session (over HTTP with the 2026-07-28"
                    " protocol, the session is the token) for another"
                    " fleet"
                )
            return self.fleets[session.target]
        if "target" not in arguments:
            served = spoken(self.fleets)
            raise ArgumentError(
                f'{name} needs "target": {target_names(self.fleets)}. This'
                f" server serves the {served} fleets and there is no default,"
                " because a machine on one fleet is invisible on another and"
                " fleets bill differently."
            )
        target = arguments.pop("target")
        validate_arguments(
            name, _object({"target": self.target_argument}), {"target": target}
        )
        return self.fleets[target]

    async def ask_fleet(self, ctx, session: Session, params):
        """With several fleets, ask a session once which fleet it is for,
        if the client can answer.

        A choice narrows the session (`target` leaves every tool). In
        the 2026 era the question is raised as AskClient.
        """
        if not self.takes_target or session.asked_fleet:
            return None
        # Calls racing in at the start get one question.
        async with session.question_lock:
            if session.asked_fleet:
                return None
            # A client that cannot answer is not asked: it keeps the
            # argument.
            answer = None
            if can_elicit(ctx):
                question, form = fleet_question(self.fleets)
                answer = await self.ask(
                    ctx, params, "fleet", "smol-mcp:fleet", question, form
                )
            session.asked_fleet = True
            choice = None
            if answer is not None and answer.action == "accept":
                choice = (answer.content or {}).get("fleet")
            if choice not in self.fleets or session.target is not None:
                return
            session.target = choice
            # The call that asked may still name another fleet.
            session.chose_during = params
            log.info("session %s chose the %s fleet", session.id, choice)
            # The session's subscriptions/listen stream hears of it.
            if modern(ctx):
                from mcp.server.subscriptions import ToolsListChanged

                await session.events()[0].publish(ToolsListChanged())
            else:
                await ctx.session.send_tool_list_changed()

    async def ask(
        self, ctx, params, key: str, state: str, message: str, schema: dict
    ):
        """Ask the person one form question; return the answer, or None if
        none came.

        In the 2026 era, raise AskClient with the question under ``key``
        until a retry brings the answer with this ``state``.
        """
        question = form_question(message, schema)
        if not modern(ctx):
            return await self.elicit(ctx, question)
        answer = None
        if params is not None:
            answer = (params.input_responses or {}).get(key)
        if answer is None or params.request_state != state:
            raise AskClient(state, {key: question})
        return elicit_result(answer)

    async def confirm(
        self, ctx, params, session: Session, message: str, binding: str, schema
    ):
        """Ask the person to allow a change; return None when the client
        cannot ask, else whether they accepted with allow: true.

        The 2026-era state is sealed to the session and ``binding`` and
        carries a nonce: it answers once, within CONFIRM_TTL_SECS.
        """
        if not can_elicit(ctx):
            return None

        def sealed(expires: str, nonce: str) -> str:
            text = f"{session.id}\0{binding}\0{expires}\0{nonce}".encode()
            seal = hmac.new(self.state_key, text, "sha256").hexdigest()
            return f"smol-mcp:confirm:{expires}:{nonce}:{seal}"

        state = str(getattr(params, "request_state", None) or "")
        _, _, expires, nonce, *_ = [*state.split(":"), "", "", "", ""]
        fresh = (
            expires.isdigit()
            and int(expires) > time.time()
            and nonce not in session.spent
        )
        if not (fresh and hmac.compare_digest(state, sealed(expires, nonce))):
            expires = str(int(time.time()) + CONFIRM_TTL_SECS)
            state = sealed(expires, secrets_module.token_hex(8))
        answer = await self.ask(ctx, params, "confirm", state, message, schema)
        session.spent.add(state.split(":")[3])
        accepted = answer is not None and answer.action == "accept"
        return accepted and (answer.content or {}).get("allow") is True

    async def elicit(
        self, ctx, question, timeout: float = ELICIT_TIMEOUT_SECS
    ):
        """Send an elicitation; return the answer, or None after
        ``timeout`` or a failure.
        """
        from mcp.shared.message import ServerMessageMetadata

        related = None
        if ctx.session.can_send_request:
            related = ctx.request_id
        metadata = ServerMessageMetadata(related_request_id=related)
        try:
            answer_type = sdk_types().ElicitResult
            return await ctx.session.send_request(
                question, answer_type, timeout, metadata
            )
        # Timed out, or there is no way back to the client.
        except Exception as err:
            log.info("a question to the person got no answer (%s)", err)
            return None

    async def call_tool(self, ctx, params):
        """Validate and dispatch one tool call; return its result.

        A failure is a tool error. A change is written to the activity
        log before the caller is told its result.
        """
        name = params.name
        principal = self.principal_for(ctx)
        tool = TOOLS_BY_NAME.get(name)
        entry: dict = {"event": "tool", "tool": name, **self.who(principal)}
        started = time.monotonic()

        def logged(outcome: str) -> None:
            if tool is not None and not tool.read_only:
                took = int((time.monotonic() - started) * 1000)
                self.record({**entry, "outcome": outcome, "durationMs": took})

        try:
            # Named from the caller's own list: it learns of no other tool.
            if tool is None:
                tools = ", ".join(principal.tools())
                raise ArgumentError(
                    f"there is no tool named {name!r}; the tools are: {tools}"
                )
            # Before any question is asked or argument read.
            check_scope(principal, name)
            session = self.session_for(ctx)
            entry["session"] = session.id
            await self.ask_fleet(ctx, session, params)
            arguments = dict(params.arguments or {})
            fleet = self.fleet_for(session, name, arguments, params)
            machine = arguments.get("name")
            entry["target"] = fleet.name
            entry["machine"] = machine
            # Only a change is logged, or held for approval.
            if not tool.read_only:
                schema = tool.input_schema
                entry["arguments"] = redact_arguments(arguments, schema)
            self.validate(tool, arguments)
            self.refuse_reserved(fleet, arguments)
            grant = authorize(principal, name, fleet.name, machine)
            # Before its approval: nobody is asked for what cannot run.
            tool.refuse_on(fleet.name)
            reach = self.access.fleet_for(principal, grant, fleet)
            call = Call(self, session, reach, ctx, principal, params)
            if not tool.read_only:
                await self.hold_for_approval(call, entry, params)
            await self.sweep_once(fleet)
            self.pools.make_once(fleet)
            result = await tool.handler(call, arguments)
        except anyio.get_cancelled_exc_class():
            logged("cancelled")
            raise
        # The fleet or approval question, as a 2026-era result.
        except AskClient as ask:
            return ask.question
        except SmolError as err:
            if isinstance(ctx, PlainRequest):
                ctx.failure = err
            message = explain(err)
            gone = self.idle_gone(principal, entry, err)
            if gone:
                message = f"{message}. {gone}"
            message = redact(message, self.config.secret_values())
            logged(message.splitlines()[0])
            return tool_error(message)
        except Exception as err:
            log.exception("tool %s failed unexpectedly", name)
            bug = bug_report(name, err)
            message = redact(bug, self.config.secret_values())
            logged(message)
            return tool_error(message)
        if not tool.read_only:
            note_result(entry, result)
            logged("ok")
        return tool_result(result)

    def idle_gone(
        self, principal: Principal, entry: dict, err: SmolError
    ) -> str:
        """Why the machine a call named is not found, when its token's
        idle 2026-era state took it (HttpSessions.idle_ended_note); else
        ""."""
        if self.http is None or not machine_missing(err):
            return ""
        target = entry.get("target")
        machine = entry.get("machine")
        return self.http.idle_ended_note(principal, target, machine)

    def validate(self, tool: ToolSpec, arguments: dict) -> None:
        """Raise ArgumentError when ``arguments`` do not fit the tool's
        schema, with the configured ceilings (its validator is built
        once).
        """
        if tool.name not in self.checkers:
            schema = configured_schema(tool, self.config)
            self.quick_checks[tool.name] = quick_check(schema)
            self.checkers[tool.name] = argument_validator()(schema)
        quick = self.quick_checks[tool.name]
        if quick is not None and quick(arguments):
            # jsonschema would find nothing: only the numbers are left.
            refuse_non_finite(arguments)
        else:
            validate_arguments(
                tool.name,
                tool.input_schema,
                arguments,
                self.checkers[tool.name],
            )

    def reserved_for(self, fleet: Fleet) -> Callable[[str], str | None]:
        """The test of a machine name on ``fleet``: why no tool may take
        it (reserved_machine), or None."""
        pools = ()
        if fleet.name == self.local.name:
            pools = self.config.warm_pools
        owners = self.access.owners

        def owned(name: str) -> bool:
            return owners.owner(fleet.name, name) is not None

        return functools.partial(reserved_machine, pools=pools, owned=owned)

    def refuse_reserved(self, fleet: Fleet, arguments: dict) -> None:
        """Raise ArgumentError when a call names a machine no tool takes."""
        reserved = self.reserved_for(fleet)
        for key in ("name", "childName"):
            value = arguments.get(key)
            why = isinstance(value, str) and reserved(value)
            if why:
                raise ArgumentError(f'"{key}": {why}')

    async def hold_for_approval(self, call: Call, entry: dict, params: Any):
        """Wait for a person's approval if the principal needs one; the
        entry records who gave it.
        """
        approver = await self.approvals.hold(call, entry, params)
        if approver is None:
            return
        entry["approvedBy"] = approver
        # "N s so far" counts the work, not the wait.
        call.started = time.monotonic()

    def who(self, principal: Principal) -> dict:
        """Return the principal as the activity log names it."""
        named = {"principal": principal.name}
        if principal.user:
            named["user"] = principal.user
        return named

    def record(self, entry: dict) -> None:
        """Append to the activity log; a failed write costs a warning,
        never the call's result.
        """
        try:
            self.access.activity.append(entry, self.config.secret_values())
        except (OSError, SmolError) as err:
            reason = getattr(err, "strerror", None) or str(err)
            what = (
                entry.get("event"),
                entry.get("tool") or entry.get("approval") or "",
            )
            lost = (
                "could not write the activity log %s (%s); entry lost: %s %s"
            )
            log.warning(lost, self.access.activity.path, reason, *what)

    async def sweep_once(self, fleet: Fleet) -> None:
        """Before this process's first local call, delete what a crashed
        one left behind.
        """
        if self._swept or fleet is not self.local:
            return
        swept = await anyio.to_thread.run_sync(
            sweep_orphans, fleet, self.config.runtime_dir
        )
        self.access.owners.clear(fleet.name, swept)
        self.access.states.forget_refs(fleet.name, swept)
        cleanup = {
            "event": "orphan-cleanup",
            "principal": "smol-mcp",
            "target": fleet.name,
        }
        outcome = "deleted (left by a stopped process)"
        for name in swept:
            self.record({**cleanup, "machine": name, "outcome": outcome})
        self._swept = True

    async def end_session(self, session: Session) -> None:
        """Delete the session's ephemeral machines and release the fleets:
        bounded in time, and done even when cancelled.
        """
        # A deleted token's sessions end early; the SDK may end them again
        # later.
        if session.ended:
            return
        session.ended = True
        # Its subscriptions/listen streams end too.
        if session.listener is not None:
            session.listener.close()
        # Nothing escapes: over HTTP it would end the listener.
        with anyio.CancelScope(shield=True):
            try:
                for poller in session.subscriptions.values():
                    poller.cancel()
                session.subscriptions.clear()
                with anyio.move_on_after(CLEANUP_TIMEOUT_SECS):
                    await session.close()
            except Exception as err:
                log.warning(
                    "session %s: its cleanup failed (%s)",
                    session.id,
                    describe(err),
                )
            for fleet in self.fleets.values():
                try:
                    await anyio.to_thread.run_sync(fleet.release)
                except Exception as err:
                    log.warning(
                        "session %s: letting go of the %s fleet failed (%s)",
                        session.id,
                        fleet.name,
                        describe(err),
                    )


class Resources:
    """What a client reads and follows: smol://targets, smol://activity
    and each machine's console log, listed, read and subscribed to.
    """

    def __init__(self, app: SmolMcp):
        self.app = app

    async def on_list_resources(self, ctx, params):
        types = sdk_types()
        about = (
            "The mode, each fleet this process serves, "
            "and whether it is usable on this host now."
        )
        shown = [
            (
                TARGETS_URI,
                "targets",
                "Fleets served and whether they are usable",
                about,
            )
        ]
        if "activity.read" in self.app.principal_for(ctx).scopes:
            about = (
                f"The latest {ACTIVITY_RESOURCE_ENTRIES} entries of the"
                " activity log: changing calls, approvals, cleanups (a"
                " sandbox token sees its own)."
            )
            shown.append(
                (ACTIVITY_URI, "activity", "What agents changed", about)
            )
        if self.pools_readable(self.app.principal_for(ctx)) is None:
            about = (
                "The operator's warm pools (create-machine with pool):"
                " each one's machine, whether it can be leased from now"
                " and why not, and the engine's ready, provisioning and"
                " active counts."
            )
            shown.append((POOLS_URI, "pools", "Warm pools", about))
        resources = [
            types.Resource(
                uri=uri,
                name=name,
                title=title,
                mime_type=JSON_TYPE,
                description=text,
            )
            for uri, name, title, text in shown
        ]
        return types.ListResourcesResult(resources=resources)

    async def on_list_resource_templates(self, ctx, params):
        template = sdk_types().ResourceTemplate(
            uri_template=LOGS_URI_TEMPLATE,
            name="machine-logs",
            title="A machine's console log",
            mime_type="text/plain",
            description="The latest lines of a machine's guest console.",
        )
        return sdk_types().ListResourceTemplatesResult(
            resource_templates=[template]
        )

    async def on_read_resource(self, ctx, params):
        uri = str(params.uri)
        principal = self.app.principal_for(ctx)
        if uri == TARGETS_URI:
            # It probes the engines: a thread waits for them.
            document = await anyio.to_thread.run_sync(
                targets_document, self.app
            )
            document["access"] = principal.describe()
            text = json.dumps(document, indent=2)
            mime = JSON_TYPE
        elif uri == ACTIVITY_URI:
            text = json.dumps(self.activity_document(principal), indent=1)
            mime = JSON_TYPE
        elif uri == POOLS_URI:
            if why := self.pools_readable(principal):
                raise_resource_error(why)
            # It asks the serve, if one answers: a thread waits for it.
            document = await anyio.to_thread.run_sync(self.app.pools.document)
            text = json.dumps(document, indent=1)
            mime = JSON_TYPE
        elif LOGS_URI_RE.fullmatch(uri):
            text = await self.read_log(ctx, uri, principal)
            mime = "text/plain"
        else:
            known = f"{TARGETS_URI}, {POOLS_URI} and {LOGS_URI_TEMPLATE}"
            raise_resource_error(
                f"unknown resource {uri}; the resources are {known}"
            )
        content = sdk_types().TextResourceContents(
            uri=uri, mime_type=mime, text=text
        )
        return sdk_types().ReadResourceResult(contents=[content])

    async def read_log(self, ctx, uri: str, principal: Principal) -> str:
        """Return the latest lines of the console a log URI names; raise
        a protocol error when it cannot be read.
        """
        config = self.app.config
        fleet, name = self.log_resource(uri, principal)
        try:
            call = Call(self.app, self.app.session_for(ctx), fleet, ctx)
            lines = await call.api(fleet.console_lines, name)
        except SmolError as err:
            raise_resource_error(redact(str(err), config.secret_values()))
        return "\n".join(lines[-config.logs_tail :])

    def pools_readable(self, principal: Principal) -> str | None:
        """Why ``principal`` may not read smol://pools, or None: it needs
        warm pools to be configured, the local fleet served and among its
        targets, and a scope that reads machines."""
        local = self.app.local.name
        if not self.app.config.warm_pools or local not in self.app.fleets:
            return (
                f"{POOLS_URI}: this server keeps no warm pools on a fleet it"
                " serves (the operator sets them with warmPools in the"
                " config file)"
            )
        try:
            authorize(principal, "list-machines", local, None)
        except ScopeMissing as err:
            return f"{POOLS_URI}: {err}"
        return None

    def activity_document(self, principal: Principal) -> dict:
        """Return smol://activity as ``principal`` may read it.

        It needs activity.read; a sandbox.* principal sees its own
        entries only.
        """
        if "activity.read" not in principal.scopes:
            raise_resource_error(
                f"scope_missing: {ACTIVITY_URI} needs the activity.read"
                f" scope, which {principal.label()} does not have. Ask the"
                " operator for a token with that scope."
            )
        domains = {
            scope.partition(".")[0]
            for scope in principal.scopes
            if "." in scope
        }
        # Without machines.*, a sandbox.* principal sees its own only.
        own_only = "sandbox" in domains and "machines" not in domains
        keep = bool
        if own_only:
            keep = activity_filter(principal.name)
        entries = self.app.access.activity.entries(
            keep, ACTIVITY_RESOURCE_ENTRIES, ACTIVITY_PAGE_BYTES
        )
        return {"entries": entries, "ownOnly": own_only}

    def log_resource(self, uri: str, principal: Principal) -> tuple[Any, str]:
        """Return the fleet and machine name of a log URI, as ``principal``
        may see them; raise a protocol error when it names none.
        """
        fleets = self.app.fleets
        match = LOGS_URI_RE.fullmatch(uri)
        if match is None or match["target"] not in fleets:
            form = f"{LOGS_URI_TEMPLATE} with target {' or '.join(fleets)}"
            raise_resource_error(
                f"{uri} is not a log resource of this server;"
                f" the form is {form}"
            )
        name = urllib.parse.unquote(match["name"])
        # Held to the tool's rule: "..", "a/b" reach no route.
        if not NAME_RE.fullmatch(name):
            why = (
                f"{uri} names the machine {name!r}, which is no machine"
                " name: it "
            )
            raise_resource_error(why + PATTERN_RULES[NAME_PATTERN])
        if name.startswith(SERVER_MACHINE_PREFIX):
            raise_resource_error(
                f"{uri} names {name!r}: names starting with"
                f" {SERVER_MACHINE_PREFIX!r} are this server's own machines,"
                " which no tool or resource reaches"
            )
        try:
            grant = authorize(principal, "machine-logs", match["target"], name)
        except ScopeMissing as err:
            raise_resource_error(str(err))
        fleet = fleets[match["target"]]
        return self.app.access.fleet_for(principal, grant, fleet), name

    async def on_subscribe(self, ctx, params):
        """Handshake era: follow a log until unsubscribe or the end of the
        session.
        """
        uri = str(params.uri)
        principal = self.app.principal_for(ctx)
        fleet, name = self.log_resource(uri, principal)
        session = self.app.session_for(ctx)
        if uri in session.subscriptions:
            return sdk_types().EmptyResult()
        self.check_share(principal, len(session.subscriptions) + 1, 1)
        scope = anyio.CancelScope()
        session.subscriptions[uri] = scope
        # The captured session outlives this call.
        notify = ctx.session.send_resource_updated

        async def poll() -> None:
            with scope:
                await follow_log(
                    self.app, fleet, name, lambda: notify(uri), principal.id
                )

        session.tasks.start_soon(poll)
        return sdk_types().EmptyResult()

    async def on_unsubscribe(self, ctx, params):
        session = self.app.session_for(ctx)
        scope = session.subscriptions.pop(str(params.uri), None)
        if scope is not None:
            scope.cancel()
        return sdk_types().EmptyResult()

    async def listen(self, ctx, params):
        """2026 era: notifications travel on this stream; its log pollers
        live as long.
        """
        from mcp.server.subscriptions import ResourceUpdated

        bus, handler = self.app.session_for(ctx).events()
        principal = self.app.principal_for(ctx)
        asked = params.notifications.resource_subscriptions or []
        uris = list(dict.fromkeys(asked))
        self.check_share(principal, len(uris), len(uris))
        followed = [(uri, *self.log_resource(uri, principal)) for uri in uris]
        async with anyio.create_task_group() as pollers:
            for uri, fleet, name in followed:
                updated = ResourceUpdated(uri=uri)
                notify = functools.partial(bus.publish, updated)
                pollers.start_soon(
                    follow_log, self.app, fleet, name, notify, principal.id
                )
            try:
                return await handler(ctx, params)
            finally:
                pollers.cancel_scope.cancel()

    def check_share(
        self, principal: Principal, in_session: int, adding: int
    ) -> None:
        """Refuse log subscriptions past a session's or a token's share."""
        each = SUBSCRIPTIONS_PER_SESSION
        total = SUBSCRIPTIONS_PER_TOKEN
        followed = self.app.polling.get(principal.id, 0)
        if in_session > each or followed + adding > total:
            raise_resource_error(
                f"{principal.label()} may follow {each} logs per session"
                f" and {total} in all; unsubscribe from one (or end a"
                " listen stream) first"
            )


class Approvals:
    """Changing calls held until a person answers.

    A held call is filed for the terminal, the review page and the
    webhook; with approvalVia client, the person at the client is asked
    too. Each step of one held call's life is a method here, sharing the
    counts of calls waiting and questions out.
    """

    def __init__(self, app: SmolMcp):
        self.app = app
        # Principal id -> its calls waiting for approval.
        self.held_by: dict[str, int] = {}
        # Calls that answered approval_interrupted: their answers may be
        # on their way out still.
        self.interrupted = 0
        # 2026-era client approvals filed, not yet answered.
        self.asked: set[str] = set()
        # stdio: the client went away; its waiting calls end.
        self.stdin_closed = False
        # The webhook's pool: its threads start on first use.
        self._webhooks = ThreadPoolExecutor(
            WEBHOOK_THREADS, "smol-mcp-webhook"
        )
        self._webhook_slots = threading.BoundedSemaphore(WEBHOOK_QUEUE)

    def apply(self) -> bool:
        """Whether any call may be held: stdio approval is on, or such a
        token exists.
        """
        if self.app.config.approval == "changes":
            return True
        try:
            records = self.app.access.tokens.records()
        except SmolError:
            return False
        return any(r.get("approval") == "changes" for r in records)

    def client_gone(self) -> None:
        """stdin closed: waiting calls end as approval_cancelled, and its
        questions are withdrawn.
        """
        self.stdin_closed = True
        for approval_id in list(self.asked):
            self.app.access.desk.close(approval_id)
        self.asked.clear()

    async def interrupt(self) -> int:
        """At a stop signal, let waiting calls answer approval_interrupted
        before anything ends; return how many answered so. A call may
        have seen the stop and answered already, before this was called.
        """
        self.app.stopping = True
        if any(self.held_by.values()):
            with anyio.move_on_after(4 * APPROVAL_POLL_SECS + 1):
                while any(self.held_by.values()):
                    await anyio.sleep(0.05)
        if self.interrupted:
            # Their answers on their way out.
            await anyio.sleep(0.2)
        return self.interrupted

    def refuse(
        self, event: dict, outcome: str, detail: str, **extra: Any
    ) -> ApprovalRefused:
        """Log the outcome; return the refusal, whose code is
        approval_<outcome>.
        """
        self.app.record({**event, "approval": outcome, **extra})
        return ApprovalRefused("approval_" + outcome.replace(" ", "_"), detail)

    def auto_approved(self, principal: Principal, event: dict) -> bool:
        until = self.app.access.auto.until(principal)
        if until:
            self.app.record(
                {**event, "approval": "auto-approved", "until": until}
            )
        return bool(until)

    async def hold(self, call: Call, entry: dict, params: Any = None) -> Any:
        """Before a changing tool runs, wait for a person if its principal
        needs approval.

        Return None when it needs none, "auto" when it is auto-approved,
        else who approved; raise ApprovalRefused (or AskClient, the
        2026-era question) otherwise.
        """
        principal = call.principal
        if principal.approval != "changes":
            return None
        keys = ("principal", "user", "session", "tool", "target", "machine")
        event = {key: entry[key] for key in keys if entry.get(key) is not None}
        event["event"] = "approval"
        if self.auto_approved(principal, event):
            return "auto"
        self.check_room(principal, event)
        # approvalVia client: on stdio, a client that takes forms is asked
        # too; in the 2026 era the question travels in the call's result
        # and the answer with its retry.
        asks = (
            self.app.config.approval_via == "client"
            and principal.kind == "stdio"
            and can_elicit(call.ctx)
        )
        in_result = asks and modern(call.ctx)
        request = None
        if in_result:
            request = self.resumed_request(call, entry, params)
        # What the person at the client said, once they said it.
        answers = {}
        if request is not None:
            # The 2026-era retry that carries the client's answer.
            approval_id = request["id"]
            event["id"] = approval_id
            self.asked.discard(approval_id)
            answer = (params.input_responses or {}).get("approval")
            answers["client"] = elicit_result(answer)
            expires = parse_time(request["expiresAt"])
            timeout = max(1, int(expires - time.time()))
        else:
            timeout = self.app.config.approval_timeout_secs
            approval_id = self.file_request(call, entry, event, timeout)
            # The request stays filed: the terminal may answer meanwhile.
            if in_result:
                self.asked.add(approval_id)
                question = {"approval": self.question(event)}
                raise AskClient(f"smol-mcp:approval:{approval_id}", question)
        ask_now = asks and not in_result
        return await self.wait(
            call, approval_id, event, timeout, answers, ask_now
        )

    def check_room(self, principal: Principal, event: dict) -> None:
        """Raise ApprovalRefused when ``principal`` already has
        APPROVAL_MAX_WAITING calls waiting.
        """
        waiting = self.held_by.get(principal.id, 0)
        # Only stdio asks its client: those questions wait too.
        if principal.kind == "stdio":
            waiting += len(self.asked)
        if waiting < APPROVAL_MAX_WAITING:
            return
        busy = (
            f"{principal.label()} already has {APPROVAL_MAX_WAITING} calls"
            f" waiting for approval, so {event['tool']} was refused at once;"
            " nothing ran. Call it again once the person on the server's"
            " host has answered those."
        )
        raise self.refuse(event, "unavailable", busy)

    async def wait(
        self,
        call: Call,
        approval_id: str,
        event: dict,
        timeout: int,
        answers: dict,
        ask_client: bool,
    ) -> str:
        """Wait for poll()'s outcome, asking the person at the client
        meanwhile when ``ask_client``; return who approved, or raise the
        refusal. The request is closed either way.
        """
        principal = call.principal

        # Handshake era: the question travels during this call.
        async def ask() -> None:
            question = self.question(event)
            answers["client"] = await self.app.elicit(
                call.ctx, question, timeout
            )

        self.held_by[principal.id] = self.held_by.get(principal.id, 0) + 1
        call.session.held += 1
        try:
            async with anyio.create_task_group() as asking:
                if ask_client:
                    asking.start_soon(ask)
                # An error is carried out of the group, which would wrap
                # it.
                try:
                    outcome = await self.poll(
                        call, approval_id, event, timeout, answers
                    )
                except Exception as err:
                    outcome = err
                asking.cancel_scope.cancel()
            if isinstance(outcome, Exception):
                raise outcome
            return outcome
        finally:
            self.held_by[principal.id] -= 1
            call.session.held -= 1
            self.app.access.desk.close(approval_id)

    def file_request(
        self, call: Call, entry: dict, event: dict, timeout: int
    ) -> str:
        """File the request where `approvals list` finds it, log it and
        tell the webhook; return its id, or raise ApprovalRefused when it
        cannot be filed.
        """
        app = self.app
        principal = call.principal
        tool = entry["tool"]
        request = {
            "token": principal.name,
            "principalId": principal.id,
            "tool": tool,
            "target": entry.get("target"),
            "machine": entry.get("machine"),
            # For the person; the log and the webhook redact them.
            "arguments": approval_arguments(call),
            "session": entry.get("session"),
            "requestedAt": utc_now(),
            "expiresAt": utc_time(time.time() + timeout),
        }
        try:
            approval_id = app.access.desk.open(request)
        except (OSError, SmolError) as err:
            reason = getattr(err, "strerror", None) or str(err)
            why = (
                f"{tool} needs a person's approval, but the request could not"
                f" be filed in {app.access.desk.directory} ({reason});"
                " nothing ran. The operator must make the state directory"
                " writable (SMOL_MCP_STATE_DIR)."
            )
            raise self.refuse(
                event, "unavailable", why, error=reason
            ) from None
        event["id"] = approval_id
        requested = {
            **event,
            "approval": "requested",
            "expiresAt": request["expiresAt"],
        }
        app.record(requested)
        if app.config.approval_webhook:
            notice = {
                "id": approval_id,
                "token": principal.name,
                "tool": tool,
                "machine": entry.get("machine"),
                "expiresAt": request["expiresAt"],
            }
            if review := self.review_url(approval_id):
                notice["review"] = review
            self.notify_webhook(notice, event)
        return approval_id

    def resumed_request(
        self, call: Call, entry: dict, params: Any
    ) -> dict | None:
        """Return the open request a 2026-era retry names, if this process
        filed it for the same call; else None.
        """
        state = getattr(params, "request_state", None) or ""
        if not state.startswith("smol-mcp:approval:"):
            return None
        approval_id = state.rsplit(":", 1)[1]
        try:
            path = self.app.access.desk.path_of(approval_id, "request")
            request = json.loads(path.read_text())
        except (OSError, ValueError, SmolError):
            return None
        same_call = {
            "pid": os.getpid(),
            "principalId": call.principal.id,
            "tool": entry["tool"],
            "target": entry.get("target"),
            "arguments": approval_arguments(call),
        }
        for key, value in same_call.items():
            if request.get(key) != value:
                return None
        return request

    @staticmethod
    def question(event: dict):
        """Return the form question that asks the person at the client."""
        message = (
            f"An agent wants to run {event['tool']}{on_machine(event)}"
            f" (approval {event['id']}). Accept to let it run once; decline"
            " to refuse it. `approvals list` on the server's host shows its"
            " arguments."
        )
        note = {
            "type": "string",
            "title": "Note",
            "description": "Optional; kept in the activity log",
        }
        return form_question(
            message, {"type": "object", "properties": {"note": note}}
        )

    async def poll(
        self,
        call: Call,
        approval_id: str,
        event: dict,
        timeout: int,
        answers: dict,
    ):
        """Wait for the terminal's or the client's answer; return the
        approver, or raise ApprovalRefused.

        The wait ends sooner when the token is deleted, an auto-approval
        is granted, the time is up, or the client or the server stops.
        """
        tool = event["tool"]
        deadline = time.monotonic() + timeout
        next_progress = 0.0
        howto = self.howto(approval_id)
        try:
            while (answer := self.answer_to(approval_id, answers)) is None:
                self.check_still_waiting(call, event)
                if self.auto_approved(call.principal, event):
                    return "auto"
                left = deadline - time.monotonic()
                if left <= 0:
                    late = (
                        f"nobody approved {tool} within {timeout} s; nothing"
                        " ran. Ask the person on the server's host to watch"
                        " for it, then call it again."
                    )
                    raise self.refuse(event, "timed out", late)
                if time.monotonic() >= next_progress:
                    next_progress = time.monotonic() + APPROVAL_PROGRESS_SECS
                    waits = (
                        f"{tool}{on_machine(event)} waits for a person to"
                        f" approve it ({int(left)} s left)"
                    )
                    await call.progress(None, f"{waits}: {howto}")
                await anyio.sleep(APPROVAL_POLL_SECS)
        except anyio.get_cancelled_exc_class():
            outcome = "cancelled"
            if self.app.stopping:
                outcome = "interrupted"
            self.app.record({**event, "approval": outcome})
            raise
        return self.decided(event, answer)

    def howto(self, approval_id: str) -> str:
        """Return how a person answers: the command on the server's host,
        and the review page when someone can open it (review_url).
        """
        approve = ["approvals", "approve", approval_id]
        command = " ".join(launch_command() + approve)
        review = ""
        if url := self.review_url(approval_id):
            review = f", or answer at {url}"
        return (
            f"on the server's host run `{command}`"
            f" (or `approvals deny {approval_id}`; `approvals list` shows"
            f" what it asks){review}"
        )

    def review_url(self, approval_id: str) -> str | None:
        """Return the console's page of a waiting call, or None when no
        one could open it: no pages (stdio, or --http off loopback without
        publicUrl), or no operator password or link to sign in with."""
        pages = self.app.pages
        if not pages or not pages.operator.enabled():
            return None
        return f"{pages.issuer}{REVIEW_PAGE}{approval_id}"

    def answer_to(self, approval_id: str, answers: dict) -> dict | None:
        """Return the terminal's (or the review page's) answer, else the
        client's, else None.
        """
        answer = self.app.access.desk.answer(approval_id)
        return answer or self.client_decision(answers)

    def check_still_waiting(self, call: Call, event: dict) -> None:
        """Raise ApprovalRefused when the call can wait no longer: its
        client went away, the server stops, or its token was deleted.
        """
        principal = call.principal
        session = call.session
        waited = f"while {event['tool']} waited for approval; nothing ran."
        gone = session.ended or client_gone(call.ctx)
        if gone or (principal.kind == "stdio" and self.stdin_closed):
            raise self.refuse(
                event, "cancelled", f"the client went away {waited}"
            )
        if self.app.stopping:
            back = " Call it again once the server is back."
            self.interrupted += 1
            raise self.refuse(
                event, "interrupted", f"the server stopped {waited}{back}"
            )
        if principal.kind != "token":
            return
        if principal.id != self.app.access.live_ids().get(principal.name):
            deleted = f"the token '{principal.name}' was deleted {waited}"
            raise self.refuse(event, "token deleted", deleted)

    def decided(self, event: dict, answer: dict) -> str:
        """Log a person's answer; return who approved, or raise
        ApprovalRefused for a rejection.
        """
        by = str(answer.get("by") or "unknown")
        note = {}
        if answer.get("reason"):
            note["reason"] = str(answer["reason"])[:500]
        channel = {}
        if answer.get("via"):
            channel["via"] = str(answer["via"])[:40]
        if answer.get("decision") == "approve":
            extra = {}
            if answer.get("autoFor"):
                extra["autoFor"] = answer["autoFor"]
            approved = {**event, "approval": "approved", "by": by}
            self.app.record({**approved, **extra, **note, **channel})
            return by
        reason = note.get("reason", "no reason given")
        rejected = f"{by} rejected {event['tool']}: {reason}. Nothing ran."
        raise self.refuse(
            event, "rejected", rejected, by=by, reason=reason, **channel
        )

    @staticmethod
    def client_decision(answers: dict) -> dict | None:
        """Return the client's answer as the terminal's: accept approves,
        decline rejects, anything else is None.
        """
        answer = answers.get("client")
        if answer is None or answer.action not in ("accept", "decline"):
            return None
        by = "the person at the client (approvalVia client)"
        if answer.action == "decline":
            return {
                "decision": "deny",
                "by": by,
                "reason": "declined at the client",
            }
        note = str((answer.content or {}).get("note") or "")
        return {"decision": "approve", "by": by, "reason": note}

    def notify_webhook(self, payload: dict, event: dict) -> None:
        """POST ``payload`` from one small, bounded pool: a slow webhook
        holds no call, nor a thread per call.
        """
        failed = {**event, "approval": "webhook failed"}

        # post_webhook raises nothing: the slot is always given back.
        def send() -> None:
            failure = post_webhook(self.app.config.approval_webhook, payload)
            self._webhook_slots.release()
            if failure is not None:
                log.warning("%s; the terminal channel still works", failure)
                self.app.record({**failed, "error": failure})

        if not self._webhook_slots.acquire(blocking=False):
            self.app.record({**failed, "error": "too many notices queued"})
            return
        self._webhooks.submit(send)


def on_machine(event: dict) -> str:
    """Return " on NAME" for an event on a machine, else ""."""
    if event.get("machine"):
        return f" on {event['machine']}"
    return ""


def note_result(entry: dict, result: dict) -> None:
    """Name in a change's log entry the machine it made or used, and the
    exit code of the command it ran.
    """
    made = result.get("machine")
    if not isinstance(made, dict):
        made = {}
    named = made.get("name") or result.get("name")
    entry["machine"] = named or entry.get("machine")
    # A create from a warm pool: leased, or made cold (and why).
    for key in ("warm", "why"):
        if key in result:
            entry[key] = result[key]
    if isinstance(result.get("exitCode"), int):
        entry["exitCode"] = result["exitCode"]


def bug_report(name: str, err: Exception) -> str:
    """Return what a caller is told of an error no tool expected."""
    return (
        f"{name} failed unexpectedly ({type(err).__name__}: {err}). This is"
        " a bug in smol-mcp; the server log has the details."
    )


def machine_missing(err: SmolError) -> bool:
    """Whether ``err`` is the engine saying the machine named is not
    there (our own lookup's words, or the serve's)."""
    if not isinstance(err, ApiError) or err.status != 404:
        return False
    missing = ("machine '", "vm not found")
    return any(words in err.api_message for words in missing)


def explain(err: SmolError) -> str:
    """Return the error text, with what to do for the API refusals every
    tool can meet.
    """
    if not isinstance(err, ApiError):
        return str(err)
    if machine_missing(err):
        return str(err.with_hint("Check the name with list-machines"))
    if err.status == 404 and err.action.startswith(("read ", "write ")):
        hint = "Check the path: run-command with ls shows what is there"
        return str(err.with_hint(hint))
    if err.status == 409 and "already exists" in err.api_message:
        hint = (
            "Pick another name, or use start-machine"
            " to start the existing machine"
        )
        return str(err.with_hint(hint))
    return str(err)


def tool_result(result: dict) -> dict:
    """A tool's result as the SDK sends it (CallToolResult's wire form):
    its JSON as text, and structured. A dict, not the model: the SDK
    validates either, and building the model costs more than the gate
    in front of it."""
    return {
        "content": [{"type": "text", "text": reply_json(result)}],
        "structuredContent": result,
        "isError": False,
        "resultType": "complete",
    }


def tool_error(message: str) -> dict:
    """A tool error as the SDK sends it (see tool_result)."""
    return {
        "content": [{"type": "text", "text": message}],
        "isError": True,
        "resultType": "complete",
    }


def raise_resource_error(message: str):
    from mcp import MCPError

    raise MCPError(code=sdk_types().INVALID_PARAMS, message=message)


def build_server(config: Config | None = None):
    """Return the MCP server for ``config`` (default: ``load_config()``),
    ready on any transport.
    """
    return SmolMcp(config or load_config()).server


# ---------------------------------------------------------------------------
# 13. stdio
#
# The default transport. The session ends at stdin EOF, SIGTERM or SIGINT, and
# in every case the lifespan cleanup runs: the SDK alone would skip it on
# SIGTERM and hang on SIGINT (its stdin reader thread is blocked in read()).
# ---------------------------------------------------------------------------


async def run_stdio(app: SmolMcp) -> None:
    from mcp.server.stdio import stdio_server

    answers = None
    async with anyio.create_task_group() as group:

        async def watch_signals() -> None:
            with anyio.open_signal_receiver(
                signal.SIGTERM, signal.SIGINT
            ) as received:
                async for _ in received:
                    # It sets app.stopping first.
                    await app.approvals.interrupt()
                    # Every call in flight hears why it stopped.
                    if answers is not None:
                        await answers.refuse_pending()
                    # This unwinds run(): the lifespan cleanup runs.
                    group.cancel_scope.cancel()
                    return

        group.start_soon(watch_signals)
        async with stdio_server() as (read, write):
            answers = AnsweredWrites(write)
            reads = AnsweredReads(read, write, answers, app)
            try:
                await app.server.run(
                    reads, answers, app.server.create_initialization_options()
                )
            finally:
                # Stopped by a signal: the stdin reader thread would block
                # a normal exit.
                if app.stopping:
                    logging.shutdown()
                    os._exit(0)
        group.cancel_scope.cancel()


class StreamWrapper:
    """A transport stream with something added; closing it closes the
    inner one (the anyio mixins do the rest).
    """

    def __init__(self, inner: Any):
        self.inner = inner

    async def aclose(self) -> None:
        await self.inner.aclose()


def rpc_error(request_id: Any, code: int, message: str) -> Any:
    """Return a JSON-RPC error answer, as the transport sends it."""
    from mcp.shared.message import SessionMessage

    types = sdk_types()
    error = types.ErrorData(code=code, message=message)
    return SessionMessage(
        types.JSONRPCError(jsonrpc="2.0", id=request_id, error=error)
    )


class AnsweredReads(StreamWrapper, anyio.abc.ObjectReceiveStream):
    """The stdio read stream, kept open at stdin's end until every request
    read has been answered (the SDK would drop them at EOF).

    A line it cannot parse gets a parse error.
    """

    def __init__(
        self, inner: Any, raw_write: Any, writes: AnsweredWrites, app: SmolMcp
    ):
        super().__init__(inner)
        # The write stream unwrapped: a parse error answers no request.
        self.raw_write = raw_write
        self.writes = writes
        self.app = app

    @property
    def last_context(self) -> Any:
        return getattr(self.inner, "last_context", None)

    async def receive(self) -> Any:
        types = sdk_types()
        try:
            item = await self.inner.receive()
        except anyio.EndOfStream:
            # The client is gone: its waiting calls end, and the stream
            # ends once every request read is answered.
            self.app.approvals.client_gone()
            await self.writes.drained()
            raise
        # A SessionMessage's message; an Exception is a line unread.
        message = None
        if not isinstance(item, Exception):
            message = item.message
        params = getattr(message, "params", None)
        method = getattr(message, "method", None)
        cancels = method == "notifications/cancelled"
        if isinstance(message, types.JSONRPCRequest):
            self.writes.pending.add(message.id)
        elif cancels and isinstance(params, dict) and "requestId" in params:
            # The SDK sends a cancelled request no answer.
            self.writes.answered(params["requestId"])
        elif isinstance(item, Exception):
            request_id, error = unparsed(item)
            why = (
                f"this message could not be read ({error}); send one"
                " JSON-RPC message per line, as UTF-8 JSON without lone"
                " surrogates"
            )
            await self.raw_write.send(
                rpc_error(request_id, types.PARSE_ERROR, why)
            )
        return item


class AnsweredWrites(StreamWrapper, anyio.abc.ObjectSendStream):
    """The stdio write stream, counting off the requests it answers."""

    def __init__(self, inner: Any):
        super().__init__(inner)
        self.pending: set = set()
        self._changed = anyio.Event()

    async def drained(self) -> None:
        """Return once every request read has been answered (or
        cancelled).
        """
        while self.pending:
            await self._changed.wait()
            self._changed = anyio.Event()

    def answered(self, request_id: Any) -> None:
        self.pending.discard(request_id)
        self._changed.set()

    async def send(self, item: Any) -> None:
        await self.inner.send(item)
        answer_id = getattr(getattr(item, "message", None), "id", None)
        if answer_id in self.pending and not hasattr(item.message, "method"):
            self.answered(answer_id)

    async def refuse_pending(self) -> None:
        """Answer every request still in flight with the shutdown error."""
        with anyio.move_on_after(2):
            for request_id in list(self.pending):
                await self.send(
                    rpc_error(request_id, -32000, SHUTDOWN_MESSAGE)
                )
            # The transport's writer flushes the last one.
            await anyio.sleep(0.2)


def unparsed(err: Exception) -> tuple[Any, str]:
    """Return what the SDK could not parse: the request's id read
    leniently (else None), and why.
    """
    details = getattr(err, "errors", lambda: [])()
    why = type(err).__name__
    if details:
        why = details[0].get("msg", why)
    raw = next(
        (
            detail["input"]
            for detail in details
            if isinstance(detail.get("input"), str)
        ),
        "",
    )
    try:
        request = json.loads(raw)
    except ValueError:
        return None, why
    found = None
    if isinstance(request, dict):
        found = request.get("id")
    if isinstance(found, bool) or not isinstance(found, (str, int)):
        found = None
    return found, why


# ---------------------------------------------------------------------------
# 14. Streamable HTTP (--http)
#
# For an agent on another computer. Every request must carry the token,
# checked before anything else so an unauthenticated caller learns nothing,
# not even where the endpoint is. Then the Host and Origin checks against
# DNS rebinding, then the path. Replies are plain JSON. A session is the
# Mcp-Session-Id in the handshake era, and the token in the 2026 era, which
# has no session id.
# ---------------------------------------------------------------------------

# A write-file of a few MiB, base64 and all; more is a 413.
HTTP_MAX_BODY_BYTES = 16 * 1024 * 1024
# Without a token (the sign-in, consent and OAuth forms): a form's worth.
HTTP_MAX_PUBLIC_BODY_BYTES = 16 * 1024
HTTP_MAX_SESSIONS = 64  # beyond this a new session gets 503
# One token's share of them: another token can always open one.
HTTP_SESSIONS_PER_TOKEN = 16
# Request bodies are read in shares, so a slow one holds up only its own
# caller: its address (an IPv6 /64) before the token is known, its token
# after. This many at once each...
HTTP_BODIES_PER_CALLER = 4
# ...and in all: with a token (16 x 16 MiB at most), and without one.
HTTP_MAX_BODIES_IN_FLIGHT = 16
HTTP_MAX_PUBLIC_BODIES = 32
# A caller's bodies waiting for its share; one more is a 429 at once.
# A waiting body holds no memory yet, so as many as a token has sessions:
# a client busy in all of them is made to wait, never refused.
HTTP_BODIES_WAITING_PER_CALLER = HTTP_SESSIONS_PER_TOKEN
# A body waits this long for a share, then it is a 429 (or a 503).
HTTP_BODY_WAIT_SECS = 10
# A body must keep arriving: a pause this long is a 408...
HTTP_BODY_IDLE_SECS = 10
# ...and so is a body still arriving after this.
HTTP_BODY_TIMEOUT_SECS = 60
HTTP_GRACEFUL_SHUTDOWN_SECS = 5
# A connection whose request headers are not in by then is closed.
HTTP_HEADER_TIMEOUT_SECS = 10
# An idle connection between requests is closed after this: later than
# the MCP clients' pools drop theirs (the Python SDK's httpx after 5 s,
# Node's fetch after 4 s), so the client lets go first. Closed first, it
# can meet the client's next request, which then fails as a reset. The
# header deadline, armed again once a response is done, closes it then
# anyway: the two are one bound.
HTTP_KEEP_ALIVE_SECS = HTTP_HEADER_TIMEOUT_SECS
# The request line and headers; more is a 400 and a close.
HTTP_MAX_HEADER_BYTES = 64 * 1024
# Beyond it the oldest connection still without headers is closed.
HTTP_MAX_CONNECTIONS = 128
# One address's share of them (a trusted proxy has none): beyond it, its
# own oldest connection without headers is closed.
HTTP_CONNECTIONS_PER_ADDRESS = 32
# uvicorn's own backstop: beyond it, 503.
HTTP_LIMIT_CONCURRENCY = 2 * HTTP_MAX_CONNECTIONS
HTTP_CLOSE = [(b"connection", b"close")]
# The scope extension that names a request's uvicorn cycle (by a weak
# reference), set by guarded_protocol: request_cycle reads it.
CYCLE_EXTENSION = "smol-mcp.cycle"
# Ends a session that never made a call (or the idle time, if less).
HTTP_UNUSED_SESSION_SECS = 300
# What a token hears of the machines its idle 2026-era state took: the
# newest this many, for this long.
IDLE_ENDED_KEPT = 32
IDLE_ENDED_SECS = 3600
# Requests that use a session; initialize, listings and pings alone do not.
SESSION_USES = (
    "tools/call",
    "resources/read",
    "resources/subscribe",
    "subscriptions/listen",
)
_SEND_TOKEN = (
    "send the token as 'Authorization: Bearer <token>' or "
    "'X-Smol-Mcp-Token: <token>'"
)
HTTP_UNAUTHORIZED = json.dumps(
    {"error": f"unauthorized: {_SEND_TOKEN}"}
).encode()
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")
HTTP_MIN_TOKEN_CHARS = 32
_MAKE_TOKEN = 'python3 -c "import secrets; print(secrets.token_urlsafe(32))"'
HTTP_TOKEN_ADVICE = f"make one with: {_MAKE_TOKEN} (or openssl rand -hex 24)"
SHUTDOWN_MESSAGE = (
    "the smol-mcp server is shutting down, so this call was stopped before "
    "it finished (what it started may have run in part). Reconnect once "
    "the server is back, and check the machine with get-machine before "
    "trying again."
)


def check_token_strength(
    secret: str, where: str = "SMOL_MCP_AUTH_TOKEN"
) -> None:
    """Refuse a token shorter than HTTP_MIN_TOKEN_CHARS, or not printable
    ASCII without spaces (a header is Latin-1 on the wire: a UTF-8
    client's would never match). Never shows it."""
    if not all("!" <= ch <= "~" for ch in secret):
        raise ConfigError(
            f"{where} must hold only printable ASCII characters without "
            "spaces, so every client sends it byte for byte; "
            f"{HTTP_TOKEN_ADVICE}"
        )
    if len(secret) < HTTP_MIN_TOKEN_CHARS:
        raise ConfigError(
            f"{where} is {len(secret)} characters long; --http needs at "
            f"least {HTTP_MIN_TOKEN_CHARS}, because anyone who reaches the "
            f"port can try to guess it; {HTTP_TOKEN_ADVICE}"
        )


def default_allowed_hosts(
    config: Config, host: str, port: int
) -> list[str] | None:
    """The Host values accepted: the configured list, else the bound
    port's loopback names. Off loopback, None: the name clients dial is
    unknowable, so the check is off (and logged)."""
    if config.http_allowed_hosts:
        return list(config.http_allowed_hosts)
    if host not in LOOPBACK_HOSTS:
        return None
    allowed = [f"127.0.0.1:{port}", f"localhost:{port}", f"[::1]:{port}"]
    if config.public_url:
        allowed.append(urllib.parse.urlsplit(config.public_url).netloc)
    return allowed


def offered_tokens(headers: dict) -> list[str]:
    """The tokens a request offers: its X-Smol-Mcp-Token header and its
    Authorization bearer token ("" for one it lacks)."""
    authorization = headers.get(b"authorization", b"").decode("latin-1")
    bearer = ""
    if authorization[:7].lower() == "bearer ":
        bearer = authorization[7:].strip()
    own = headers.get(b"x-smol-mcp-token", b"").decode("latin-1")
    return [own, bearer]


def address_key(host: str) -> str:
    """The address a per-address limit counts ``host`` under: an IPv4
    address itself, an IPv6 one its /64 (one subscriber's block, so a
    caller cannot rotate through it), an IPv4-mapped one its IPv4."""
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return host
    if address.version == 4:
        return str(address)
    if address.ipv4_mapped is not None:
        return str(address.ipv4_mapped)
    return str(ipaddress.ip_network(f"{address}/64", strict=False))


def is_trusted_proxy(host: str, proxies: list) -> bool:
    """Whether ``host`` is in one of the networks of ``proxies``."""
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False
    if address.version == 6 and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return any(address in network for network in proxies)


def hop_address(hop: str) -> str | None:
    """The address of one X-Forwarded-For entry (a port after it, or
    brackets around an IPv6 one, dropped); None if it names none."""
    hop = hop.strip()
    if hop.startswith("["):
        hop = hop[1:].partition("]")[0]
    elif hop.count(":") == 1:
        hop = hop.partition(":")[0]
    try:
        return str(ipaddress.ip_address(hop))
    except ValueError:
        return None


def forwarded_client(peer: str, forwarded: list[str], proxies: list) -> str:
    """The caller's address: ``peer``, or while the address reached is a
    trusted proxy's, the X-Forwarded-For entry (``forwarded``: each
    header's value) to the left of it. Only what the trusted proxies
    added is believed: an entry the caller wrote lies further left."""
    hops = [hop for value in forwarded for hop in value.split(",")]
    caller = peer
    for hop in reversed(hops):
        if not is_trusted_proxy(caller, proxies):
            break
        address = hop_address(hop)
        if address is None:
            break
        caller = address
    return caller


class BodyShares:
    """Slots for request bodies being read: ``per_caller`` for a caller
    and ``ceiling`` in all, so no one caller fills them. A body past its
    caller's share waits for a slot (HTTP_BODY_WAIT_SECS at most), unless
    HTTP_BODIES_WAITING_PER_CALLER of the caller's wait already."""

    def __init__(self, per_caller: int, ceiling: int):
        self.per_caller = per_caller
        self.ceiling = ceiling
        # A caller -> its bodies being read, and waiting for a slot.
        self.reading: dict[str, int] = {}
        self.waiting: dict[str, int] = {}
        self.total = 0
        # Set (and replaced) each time a slot is given back.
        self.freed: Any = None

    def room(self, caller: str) -> bool:
        """Whether a slot is free for ``caller``: its share, and in all."""
        mine = self.reading.get(caller, 0)
        return mine < self.per_caller and self.total < self.ceiling

    @asynccontextmanager
    async def share(self, caller: str):
        """Hold a slot for ``caller`` while inside: yields True, or False
        when none came (refused at once, or waited for too long)."""
        taken = await self.take(caller)
        try:
            yield taken
        finally:
            if taken:
                self.give_back(caller)

    async def take(self, caller: str) -> bool:
        """Take a slot for ``caller``, waiting for one if need be; False
        when the caller has too many waiting, or none came in time."""
        if not self.room(caller):
            if self.waiting.get(caller, 0) >= HTTP_BODIES_WAITING_PER_CALLER:
                return False
            self.waiting[caller] = self.waiting.get(caller, 0) + 1
            try:
                with anyio.move_on_after(HTTP_BODY_WAIT_SECS):
                    while not self.room(caller):
                        if self.freed is None:
                            self.freed = anyio.Event()
                        await self.freed.wait()
            finally:
                self.waiting[caller] -= 1
                if not self.waiting[caller]:
                    del self.waiting[caller]
            if not self.room(caller):
                return False
        self.reading[caller] = self.reading.get(caller, 0) + 1
        self.total += 1
        return True

    def give_back(self, caller: str) -> None:
        self.total -= 1
        self.reading[caller] -= 1
        if not self.reading[caller]:
            del self.reading[caller]
        if self.freed is not None:
            self.freed.set()
            self.freed = None

    def refusal(self, caller: str, who: str) -> tuple[int, dict]:
        """The status and answer for a body of ``caller`` (``who``, in
        words) that got no slot."""
        if self.reading.get(caller, 0) >= self.per_caller:
            why = (
                f"{who} has {self.per_caller} request bodies arriving "
                "already, its share: send each body whole and at once, or "
                "wait for one to finish, then try again"
            )
            return 429, {"error": why}
        why = (
            f"{self.ceiling} request bodies are arriving at once, all this "
            "server reads: try again in a few seconds"
        )
        return 503, {"error": why}


async def receive_body(
    receive: Callable, limit: int, arrived: bool = False
) -> tuple[bytes, str]:
    """The body as it arrives, and what went wrong: "" (nothing),
    "gone" (the client left), "big" (over ``limit``: as much again is
    read and dropped, so the client sees the 413, not a reset), "stalled"
    (nothing came for HTTP_BODY_IDLE_SECS) or "late" (still arriving
    after HTTP_BODY_TIMEOUT_SECS). One cancel scope bounds both; with
    ``arrived`` (the whole body came with the headers, so no read can
    wait) none is needed."""
    if arrived:
        return await read_pieces(receive, limit)
    late_at = anyio.current_time() + HTTP_BODY_TIMEOUT_SECS
    with anyio.CancelScope() as waiting:
        return await read_pieces(receive, limit, waiting, late_at)
    if waiting.deadline >= late_at:
        return b"", "late"
    return b"", "stalled"


async def read_pieces(
    receive: Callable,
    limit: int,
    waiting: anyio.CancelScope | None = None,
    late_at: float = 0,
) -> tuple[bytes, str]:
    """The body's pieces, joined, and "", "gone" or "big" (see
    receive_body). Before each piece, ``waiting``'s deadline moves to
    whichever comes first: HTTP_BODY_IDLE_SECS from now, or ``late_at``."""
    chunks = []
    size = 0
    while True:
        if waiting is not None:
            idle_at = anyio.current_time() + HTTP_BODY_IDLE_SECS
            waiting.deadline = min(late_at, idle_at)
        message = await receive()
        if message["type"] == "http.disconnect":
            return b"", "gone"
        data = message.get("body", b"")
        size += len(data)
        chunks.append(data)
        if size > limit:
            # Nothing more is kept.
            chunks.clear()
        more = message.get("more_body", False)
        if not more or size > 2 * limit:
            outcome = ""
            if size > limit:
                outcome = "big"
            return b"".join(chunks), outcome


def request_cycle(scope: dict) -> Any:
    """The uvicorn cycle serving the request of ``scope``, while it
    lives; None over any server but guarded_protocol's."""
    cycle = scope.get("extensions", {}).get(CYCLE_EXTENSION)
    if cycle is None:
        return None
    return cycle()


def body_arrived(scope: dict) -> bool:
    """Whether uvicorn holds the request's whole body already (it came
    with the headers): then reading it cannot wait. False over any server
    but guarded_protocol's."""
    cycle = request_cycle(scope)
    return cycle is not None and not cycle.more_body


def public_body_limit(path: str) -> tuple[int, dict]:
    """The size a body without a token may have at ``path``, and the
    413's answer past it: a registration's is an OAuth error."""
    if path == "/register":
        why = f"a registration is {OAUTH_MAX_REGISTRATION_BYTES} B at most"
        error = {"error": "invalid_client_metadata", "error_description": why}
        return OAUTH_MAX_REGISTRATION_BYTES, error
    why = (
        f"the request body is over {HTTP_MAX_PUBLIC_BODY_BYTES} bytes, "
        "the most a page or OAuth request without a token may send"
    )
    return HTTP_MAX_PUBLIC_BODY_BYTES, {"error": why}


class HttpGate:
    """ASGI middleware in front of everything: the caller's address, the
    token, then Host and Origin, then the path, then the body in its
    caller's share (lifespan events pass through). Not the SDK's
    TransportSecuritySettings, whose bare "Invalid Host header" comes after
    a POST's Content-Type check: ours names the setting to change."""

    def __init__(
        self,
        app: SmolMcp,
        lifespan_app: Any,
        mcp_endpoint: McpEndpoint,
        allowed_hosts: list[str] | None,
        public_app: Any,
    ):
        # The ASGI app that runs the SDK's lifespan; the MCP path's.
        self.lifespan_app = lifespan_app
        self.access = app.access
        self.mcp_endpoint = mcp_endpoint
        self.plain_api = PlainApi(app)
        self.pages = app.pages
        self.mcp_path = app.http.path
        self.allowed_hosts = allowed_hosts
        self.allowed_origins = app.config.http_allowed_origins
        # The sign-in, OAuth and console routes, reached without a token.
        self.public_app = public_app
        self.public_paths = (
            *PAGE_PATHS,
            *OAUTH_PATHS,
            "/.well-known/oauth-authorization-server",
            RESOURCE_METADATA,
            "/console",
            RESOURCE_METADATA + self.mcp_path,
        )
        self.proxies = [
            ipaddress.ip_network(proxy, strict=False)
            for proxy in app.config.trusted_proxies
        ]
        # Bodies read with a token, by token; without, by address.
        self.token_bodies = BodyShares(
            HTTP_BODIES_PER_CALLER, HTTP_MAX_BODIES_IN_FLIGHT
        )
        self.public_bodies = BodyShares(
            HTTP_BODIES_PER_CALLER, HTTP_MAX_PUBLIC_BODIES
        )

    async def __call__(
        self, scope: dict, receive: Callable, send: Callable
    ) -> None:
        if scope["type"] != "http":
            return await self.lifespan_app(scope, receive, send)
        self.find_caller(scope)
        headers = dict(scope["headers"])
        # A password or a live sign-in link opens the public paths (asked
        # only of those: it reads a file).
        public = self.is_public(scope["path"]) and self.oauth_on()
        principal = None
        if not public:
            # token_for compares the tokens' hashes.
            principal = self.access.token_for(offered_tokens(headers))
            if principal is None:
                oauth = self.oauth_on()
                return await self.refuse_unauthenticated(send, oauth)
        host = headers.get(b"host", b"").decode("latin-1")
        if self.allowed_hosts is not None and host not in self.allowed_hosts:
            wrong = (
                f"Host {host!r} is not allowed; set "
                "SMOL_MCP_HTTP_ALLOWED_HOSTS to the name clients dial"
            )
            return await send_json(send, 421, {"error": wrong})
        if public:
            await self.serve_public(scope, headers, receive, send)
        else:
            await self.serve_mcp(scope, headers, receive, send, principal)

    def oauth_on(self) -> bool:
        """Whether OAuth and the pages are on: an issuer, and an operator's
        password or a live sign-in link."""
        return self.pages is not None and self.pages.operator.enabled()

    def is_public(self, path: str) -> bool:
        """Whether ``path`` is a browser's page or an OAuth route."""
        return path in self.public_paths or path.startswith("/console/")

    def find_caller(self, scope: dict) -> None:
        """Behind a trusted proxy, make the scope's client the address
        its X-Forwarded-For names (every limit and session by address
        reads it there); from any other peer, leave it the peer."""
        client = scope.get("client")
        if not self.proxies or not client:
            return
        forwarded = [
            value.decode("latin-1")
            for name, value in scope["headers"]
            if name == b"x-forwarded-for"
        ]
        caller = forwarded_client(client[0], forwarded, self.proxies)
        if caller != client[0]:
            scope["client"] = (caller, 0)

    async def refuse_unauthenticated(self, send: Callable, oauth: bool):
        """The 401 for a request without a known token; with OAuth on, its
        challenge names the resource metadata that leads to sign-in."""
        challenge = "Bearer"
        if oauth:
            metadata = f"{self.pages.issuer}{RESOURCE_METADATA}{self.mcp_path}"
            challenge = f'Bearer resource_metadata="{metadata}"'
        # Connection: close makes the server stop reading whatever body is
        # still coming.
        refusal = [(b"www-authenticate", challenge.encode()), *HTTP_CLOSE]
        await send_json(send, 401, HTTP_UNAUTHORIZED, refusal)

    async def serve_public(
        self, scope: dict, headers: dict, receive: Callable, send: Callable
    ) -> None:
        """A browser's own pages, and the OAuth routes (with CORS for
        browser clients): no Origin check, no token."""
        body = await self.read_body(scope, headers, receive, send)
        if body is not None:
            await self.public_app(scope, replay_body(body, receive), send)

    async def serve_mcp(
        self,
        scope: dict,
        headers: dict,
        receive: Callable,
        send: Callable,
        principal: Principal,
    ) -> None:
        """A request with a token: the Origin and the path checked, then
        the MCP path's to the SDK, the plain API's to PlainApi."""
        origin = headers.get(b"origin", b"").decode("latin-1")
        allowed = self.allowed_origins
        if origin and allowed and origin not in allowed:
            wrong = (
                f"Origin {origin!r} is not allowed "
                "(SMOL_MCP_HTTP_ALLOWED_ORIGINS)"
            )
            return await send_json(send, 403, {"error": wrong})
        to_api = scope["path"].startswith(self.plain_api.path)
        if scope["path"] != self.mcp_path and not to_api:
            missing = f"not found; the MCP endpoint is {self.mcp_path}"
            return await send_json(send, 404, {"error": missing})
        scope.setdefault("state", {})["smol_principal"] = principal
        # The SDK binds a handshake-era session to the user that opened it:
        # the same Mcp-Session-Id with another token answers 404, as an
        # unknown one.
        scope["user"] = authenticated_user(principal)
        body = await self.read_body(scope, headers, receive, send, principal)
        if body is None:
            return
        serve = self.mcp_endpoint
        if to_api:
            serve = self.plain_api
        await serve(scope, replay_body(body, receive), send, body)

    async def read_body(
        self,
        scope: dict,
        headers: dict,
        receive: Callable,
        send: Callable,
        principal: Principal | None = None,
    ) -> bytes | None:
        """The whole body, read in its caller's share of BodyShares
        unless it came with the headers: with ``principal``, the token's
        share and up to HTTP_MAX_BODY_BYTES; without, the address's and
        public_body_limit's. Past the limit a 413, stalled or late a 408,
        no share a 429 or 503; None once answered."""
        if principal is None:
            shares = self.public_bodies
            caller = address_key((scope.get("client") or ("",))[0])
            who = f"the address {caller}"
            limit, too_big = public_body_limit(scope["path"])
        else:
            shares = self.token_bodies
            caller = principal.id
            who = principal.label()
            limit = HTTP_MAX_BODY_BYTES
            why = (
                f"the request body is over {HTTP_MAX_BODY_BYTES} bytes; "
                "send a smaller one (a large file goes in pieces)"
            )
            too_big = {"error": why}
        declared = headers.get(b"content-length", b"0").strip()
        over = declared.isdigit() and int(declared) > limit
        expecting = headers.get(b"expect", b"").lower() == b"100-continue"
        if over and expecting:
            # The client waits to be asked: tell it now.
            return await send_json(send, 413, too_big, HTTP_CLOSE)
        if body_arrived(scope):
            # Whole in uvicorn's buffer already: it cannot be slow, so it
            # takes no slot.
            body, outcome = await receive_body(receive, limit, True)
        else:
            body, outcome = await receive_in_share(
                shares, caller, receive, limit
            )
        if outcome == "share":
            status, refused = shares.refusal(caller, who)
            retry = [(b"retry-after", b"5"), *HTTP_CLOSE]
            return await send_json(send, status, refused, retry)
        if outcome == "gone":
            return None
        if over or outcome == "big":
            return await send_json(send, 413, too_big, HTTP_CLOSE)
        if outcome:
            late = {"error": body_late(outcome)}
            return await send_json(send, 408, late, HTTP_CLOSE)
        return body


async def receive_in_share(
    shares: BodyShares, caller: str, receive: Callable, limit: int
) -> tuple[bytes, str]:
    """receive_body in a slot of ``caller``'s share; the outcome is
    "share" when no slot came."""
    # take and give_back rather than share(): a context manager a request
    # costs more than the slot.
    if not await shares.take(caller):
        return b"", "share"
    try:
        return await receive_body(receive, limit)
    finally:
        shares.give_back(caller)


def body_late(outcome: str) -> str:
    """Why a body that did not arrive in time was refused, with what to
    do instead."""
    if outcome == "stalled":
        return (
            "the request body stopped arriving: nothing came for "
            f"{HTTP_BODY_IDLE_SECS} s; send it whole, without pauses"
        )
    return (
        "the request body did not arrive within "
        f"{HTTP_BODY_TIMEOUT_SECS} s; send a smaller one, or faster"
    )


# A pydantic model per request cost more than the rest of the gate: one per
# principal.
@functools.lru_cache(maxsize=64)
def authenticated_user(principal: Principal):
    """The principal as the SDK's request user (by the token's id, never
    its secret)."""
    from mcp.server.auth.middleware.bearer_auth import AuthenticatedUser
    from mcp.server.auth.provider import AccessToken

    token = AccessToken(
        token=principal.id,
        subject=principal.id,
        client_id=principal.name,
        scopes=sorted(principal.scopes),
    )
    return AuthenticatedUser(token)


def json_body(body: bytes, *path: str) -> Any:
    """A body's JSON, or the value at ``path`` in it; None if not strict
    JSON or there is no such value."""
    try:
        return functools.reduce(
            lambda value, key: value[key], path, strict_json(body)
        )
    except (ValueError, KeyError, TypeError):
        return None


def body_requests(body: bytes) -> list[dict]:
    """A body's JSON-RPC requests (each with a method and an id), not its
    notifications or answers (the body is read once); raise JsonRefused
    for a body that strict JSON refuses (the SDK would read it)."""
    try:
        message = strict_json(body)
    except JsonRefused:
        raise
    except ValueError:
        # Not JSON: the SDK answers it.
        message = None
    messages = message
    if not isinstance(message, list):
        messages = [message]
    return [
        m
        for m in messages
        if isinstance(m, dict)
        and isinstance(m.get("method"), str)
        and isinstance(m.get("id"), (str, int))
    ]


def asks_progress(request: dict) -> bool:
    """Whether a JSON-RPC request is a tool call that gave a progress
    token (its client takes live output)."""
    if request["method"] != "tools/call":
        return False
    params = request.get("params")
    if not isinstance(params, dict):
        return False
    meta = params.get("_meta")
    return isinstance(meta, dict) and "progressToken" in meta


def replay_body(body: bytes, receive: Callable) -> Callable:
    """A receive that hands the inner app the body already read, then
    whatever comes next."""
    pending = [{"type": "http.request", "body": body, "more_body": False}]

    async def again() -> dict:
        if pending:
            return pending.pop()
        return await receive()

    return again


@functools.cache
def guarded_protocol(trusted_proxies: tuple[str, ...] = ()) -> type:
    """uvicorn's h11 protocol with the bounds it lacks: request headers
    within HTTP_HEADER_TIMEOUT_SECS; past HTTP_MAX_CONNECTIONS the oldest
    connection without them closed (never one busy with a request), and
    past HTTP_CONNECTIONS_PER_ADDRESS from one address (not one of
    ``trusted_proxies``) its own oldest. Built on first use: no uvicorn at
    import."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    # This subclasses uvicorn's internal H11Protocol and reads its
    # self.conn (h11's state) and self.connections, because header
    # timeouts and the connection cap need the connection level, which no
    # public API reaches. That is why the dependency lists pin uvicorn and
    # h11 exactly.
    proxies = [
        ipaddress.ip_network(proxy, strict=False) for proxy in trusted_proxies
    ]

    class GuardedH11Protocol(H11Protocol):
        header_deadline: Any = None
        # The address its share counts under; None: no share (a proxy).
        share: str | None = None

        def waiting(self) -> bool:
            """Open, and no request has arrived on it yet."""
            return (
                self.conn.their_state is h11.IDLE
                and not self.transport.is_closing()
            )

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self.opened = time.monotonic()
            self.watch_headers()
            peer = ""
            if self.client:
                peer = self.client[0]
            if not is_trusted_proxy(peer, proxies):
                self.share = address_key(peer)
            # This one is the newest of them.
            if len(self.connections) > HTTP_MAX_CONNECTIONS:
                self.close_oldest_idle(None)
            if self.share is not None:
                self.close_oldest_idle(self.share)

        def close_oldest_idle(self, share: str | None) -> None:
            """Close the oldest connection without a request (this one,
            if it is the only one) when there are too many: in all
            (``share`` None), or from the address ``share``."""
            ours = [c for c in self.connections if isinstance(c, type(self))]
            limit = HTTP_MAX_CONNECTIONS
            if share is not None:
                ours = [c for c in ours if c.share == share]
                limit = HTTP_CONNECTIONS_PER_ADDRESS
            idle = [c for c in ours if c.waiting()]
            if len(ours) > limit and idle:
                min(idle, key=lambda c: c.opened).transport.close()

        def handle_events(self) -> None:
            """After data arrives, and once a response is done. A request
            that arrived names its cycle in its scope, for request_cycle:
            by a weak reference, as the cycle holds the scope. A strong
            one made a loop that kept each request's objects until the
            collector came, which then took a third longer under load."""
            cycle = self.cycle
            super().handle_events()
            if self.cycle is not cycle and self.cycle is not None:
                extensions = self.cycle.scope.setdefault("extensions", {})
                extensions[CYCLE_EXTENSION] = weakref.ref(self.cycle)
            self.watch_headers()

        def watch_headers(self) -> None:
            """Armed while no request is in, disarmed once one is."""
            idle = self.conn.their_state is h11.IDLE
            if idle and self.header_deadline is None:
                self.header_deadline = self.loop.call_later(
                    HTTP_HEADER_TIMEOUT_SECS, self.overdue
                )
            elif not idle and self.header_deadline is not None:
                self.header_deadline.cancel()
                self.header_deadline = None

        def overdue(self) -> None:
            self.header_deadline = None
            if self.waiting():
                self.transport.close()

        def connection_lost(self, exc: Exception | None) -> None:
            if self.header_deadline is not None:
                self.header_deadline.cancel()
            super().connection_lost(exc)

    return GuardedH11Protocol


def uvicorn_options(trusted_proxies: tuple[str, ...] = ()) -> dict:
    """The uvicorn settings --http runs with (the tests use the same)."""
    return dict(
        http=guarded_protocol(tuple(trusted_proxies)),
        lifespan="on",
        log_level="warning",
        # The peer's own address, as X-Forwarded-For would rotate the
        # limits (HttpGate believes it from a trusted proxy only).
        proxy_headers=False,
        timeout_keep_alive=HTTP_KEEP_ALIVE_SECS,
        limit_concurrency=HTTP_LIMIT_CONCURRENCY,
        h11_max_incomplete_event_size=HTTP_MAX_HEADER_BYTES,
        timeout_graceful_shutdown=HTTP_GRACEFUL_SHUTDOWN_SECS,
    )


async def send_json(
    send: Callable, status: int, answer: Any, headers: list | None = None
) -> None:
    """Send ``answer`` as the whole response: JSON, or bytes already
    encoded, with ``headers`` after its own."""
    body = answer
    if not isinstance(answer, bytes):
        body = json.dumps(answer).encode()
    head = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        *(headers or []),
    ]
    start = {"type": "http.response.start", "status": status, "headers": head}
    await send(start)
    await send({"type": "http.response.body", "body": body})


class PlainRequest:
    """What call_tool reads of a plain API call: the HTTP request (with the
    principal), the era, a client that asks nothing and takes no progress;
    ``failure``: the SmolError it ended with."""

    meta = None
    client_capabilities = None
    failure = None

    def __init__(self, scope: dict, protocol_version: str):
        from starlette.requests import Request

        self.request = Request(scope)
        self.protocol_version = protocol_version
        # call_tool reaches the client through ctx.session: this, again.
        self.session = self

    async def report_progress(self, *_: Any) -> None: ...


def plain_status(err: SmolError | None) -> int:
    """The plain API's status for a tool error (see the README)."""
    if isinstance(err, ApiError):
        if 400 <= err.status < 500:
            return err.status
        return 502
    kinds = (
        (ScopeMissing, 403),
        (ApprovalRefused, 409),
        (ArgumentError, 400),
        (SmolError, 422),
    )
    for kind, status in kinds:
        if isinstance(err, kind):
            return status
    return 500


def plain_api_path(mcp_path: str) -> str:
    """The plain API's path, beside the MCP path: /mcp has /api/tools."""
    return mcp_path.rsplit("/", 1)[0] + "/api/tools"


class PlainApi:
    """The plain HTTP API: GET {path} lists the token's tools, POST
    {path}/NAME with a JSON object of arguments calls one through call_tool
    as the token's 2026-era session (so the MCP path's scopes, ownership,
    approvals and log); a call is cancelled if its client goes."""

    def __init__(self, app: SmolMcp):
        self.app = app
        self.sessions = app.http
        self.path = plain_api_path(app.http.path)

    async def __call__(
        self, scope: dict, receive: Callable, send: Callable, body: bytes
    ) -> None:
        """The routes: GET {path} to list_tools, POST {path}/NAME to
        call_tool (which refuses any other request, saying how to call)."""
        name = scope["path"][len(self.path) :].lstrip("/")
        if not name and scope["method"] == "GET":
            return await self.list_tools(scope, send)
        await self.call_tool(scope, receive, send, name, body)

    async def list_tools(self, scope: dict, send: Callable) -> None:
        principal = scope["state"]["smol_principal"]
        tools = self.app.tool_list(self.app.takes_target, principal)
        listed = [
            tool.model_dump(mode="json", by_alias=True, exclude_none=True)
            for tool in tools
        ]
        await send_json(send, 200, {"tools": listed})

    async def call_tool(
        self,
        scope: dict,
        receive: Callable,
        send: Callable,
        name: str,
        body: bytes,
    ) -> None:
        """Call tool ``name`` with the body's arguments: 200 and its
        structured content, or its error with plain_status's status;
        nothing if its client went away."""
        from mcp_types.version import MODERN_PROTOCOL_VERSIONS

        # No body: no arguments.
        try:
            arguments = strict_json(body or b"{}")
        except JsonRefused as err:
            return await send_json(send, 400, {"error": str(err)})
        except ValueError:
            # Not JSON: refusal says what the body must be.
            arguments = None
        principal = scope["state"]["smol_principal"]
        refusal = self.refusal(
            scope["method"], name, arguments, principal.tools()
        )
        if refusal is not None:
            status, error = refusal
            return await send_json(send, status, {"error": error})
        ctx = PlainRequest(scope, MODERN_PROTOCOL_VERSIONS[0])
        session = self.sessions.modern_session(principal)
        session.used = True
        session.in_flight += 1
        try:
            result = await self.call_while_connected(
                ctx, receive, name, arguments
            )
        finally:
            session.in_flight -= 1
            session.last_seen = time.monotonic()
        if result is None:
            return
        if result["isError"]:
            error = {"error": result["content"][0]["text"]}
            return await send_json(send, plain_status(ctx.failure), error)
        await send_json(send, 200, result["structuredContent"])

    def refusal(
        self, method: str, name: str, arguments: Any, tools: Iterable[str]
    ) -> tuple[int, str] | None:
        """The status and error of a request that calls no tool, or None
        when it may call one; an unknown name is matched against
        ``tools``, the caller's own."""
        api = self.path
        if method != "POST" or not name:
            return (
                405,
                f"POST {api}/NAME a JSON object of arguments; "
                f"GET {api} lists the tools",
            )
        if name not in TOOLS_BY_NAME:
            maybe = did_you_mean(name, tools)
            return (
                404,
                f"there is no tool named {name!r}{maybe}; GET {api} lists "
                "yours",
            )
        if not isinstance(arguments, dict):
            return (
                400,
                "the body must be a JSON object of the tool's arguments",
            )
        # json.loads takes "\ud800", which no UTF-8 carries to the engine
        # or the log.
        try:
            json.dumps(arguments, ensure_ascii=False).encode()
        except UnicodeEncodeError:
            return (
                400,
                "a string in the body holds a lone surrogate (\\udXXX): "
                "send UTF-8",
            )
        return None

    async def call_while_connected(
        self, ctx: PlainRequest, receive: Callable, name: str, arguments: dict
    ) -> Any:
        """call_tool's result, or None when the client went away first:
        then the call ends as one whose client went away."""
        result = None
        async with anyio.create_task_group() as group:

            async def watch_client() -> None:
                while (await receive())["type"] != "http.disconnect":
                    pass
                group.cancel_scope.cancel()

            group.start_soon(watch_client)
            params = sdk_types().CallToolRequestParams(
                name=name, arguments=arguments
            )
            result = await self.app.call_tool(ctx, params)
            group.cancel_scope.cancel()
        return result


class HttpSessions:
    """Sessions over HTTP, kept from what McpEndpoint and PlainApi see.
    Handshake era: one per Mcp-Session-Id, opened by initialize's answer,
    ended by the client's DELETE, the idle reaper (as a DELETE through the
    manager) or shutdown. 2026 era: one per token. Both end when idle."""

    def __init__(self, app: SmolMcp, manager: Any, path: str):
        self.app = app
        # The SDK's session manager, which ends a session on a DELETE.
        self.manager = manager
        self.path = path
        self.by_principal: dict[str, Session] = {}
        # Handshake era, by Mcp-Session-Id, for the idle reaper.
        self.by_id: dict[str, Session] = {}
        self.tasks: Any = None
        # An anyio Event, set when the process is told to stop.
        self.stopping: Any = None
        # The POSTs in the SDK's hands.
        self.serving: set[anyio.CancelScope] = set()
        # 2026 era: token name -> {(fleet, machine): (when, idle limit)}
        # of the ephemeral machines its state took with it as it idled
        # out, so that a call naming one hears why it is gone.
        self.idle_ended: dict[str, dict[tuple, tuple[float, int]]] = {}

    @asynccontextmanager
    async def running(self, tasks: Any):
        """Keep the books while the server runs its ``tasks``: end idle
        sessions and those of deleted tokens, stop what is served when
        told to stop, and at the end end every session left."""
        self.tasks = tasks
        chores = [self.start(self.reap_idle), self.start(self.watch_tokens)]
        if self.stopping is not None:
            chores.append(self.start(self.stop_serving))
        try:
            yield
        finally:
            for chore in chores:
                chore.cancel()
            self.app.access.tokens.flush_usage(force=True)
            for sessions in (self.by_principal, self.by_id):
                while sessions:
                    session = sessions.pop(next(iter(sessions)))
                    await self.app.end_session(session)

    def start(self, chore: Callable) -> anyio.CancelScope:
        """Run ``chore`` in the server's tasks until the scope returned is
        cancelled."""
        scope = anyio.CancelScope()

        async def run() -> None:
            with scope:
                await chore()

        self.tasks.start_soon(run)
        return scope

    async def reap_idle(self) -> None:
        """End the idle sessions, every quarter of the shorter idle time
        (30 s at most)."""
        config = self.app.config
        shorter = min(
            config.http_session_idle_secs, config.http_stateless_idle_secs
        )
        while True:
            await anyio.sleep(min(shorter / 4, 30))
            # The reaper must outlive any one session's trouble.
            try:
                await self.end_idle()
            except Exception as err:
                log.warning("ending idle sessions failed (%s)", describe(err))

    async def watch_tokens(self) -> None:
        """End the sessions of deleted tokens and save when tokens were
        last used, every TOKEN_WATCH_SECS."""
        while True:
            await anyio.sleep(TOKEN_WATCH_SECS)
            await self.end_revoked()
            self.app.access.tokens.flush_usage()

    async def stop_serving(self) -> None:
        """Once told to stop, stop the POSTs being served (one task for
        all: none per request); calls that can answer for themselves, as
        those waiting for approval, do first."""
        await self.stopping.wait()
        open_posts = len(self.serving)
        answering = await self.app.approvals.interrupt()
        # Each waiting call answers on its own POST: let those POSTs end
        # (bounded) before the rest are stopped, or a busy host cuts an
        # approval_interrupted answer off with the shutdown error.
        others = max(0, open_posts - answering)
        with anyio.move_on_after(2):
            while len(self.serving) > others:
                await anyio.sleep(0.05)
        for serving in list(self.serving):
            serving.cancel()

    def session_for(self, ctx) -> Session:
        """The session of a request the SDK serves: its token's in the 2026
        era (state per token name), else its Mcp-Session-Id's."""
        principal = self.app.principal_for(ctx)
        version = ctx.protocol_version
        if modern(ctx):
            return self.modern_session(principal)
        # McpEndpoint read it already (starlette's headers are read again
        # at each look).
        http_id = ctx.request.scope["state"].get("smol_http_id") or ""
        # Opened when initialize was answered; a request the SDK let
        # through after ours ended (a deleted token's session, closing)
        # gets one of its own.
        return self.by_id.get(http_id) or self.open_handshake(
            principal, http_id, version
        )

    def modern_session(self, principal: Principal) -> Session:
        """The 2026-era session of a token (made again if the token was)."""
        earlier = self.by_principal.get(principal.name)
        # The token was deleted and made again: its old session ends.
        if earlier is not None and earlier.principal.id != principal.id:
            del self.by_principal[principal.name]
            self.tasks.start_soon(self.app.end_session, earlier)
        if principal.name not in self.by_principal:
            label = f"token-{principal.name}-{secrets_module.token_hex(3)}"
            session = self.app.open_session(label, self.tasks)
            session.principal = principal
            self.by_principal[principal.name] = session
        return self.by_principal[principal.name]

    def open_handshake(
        self, principal: Principal, http_id: str, protocol: str | None
    ) -> Session:
        """A handshake-era session, kept by its Mcp-Session-Id if it has
        one."""
        label = (http_id or secrets_module.token_hex(4))[:8]
        session = self.app.open_session(label, self.tasks)
        session.principal = principal
        if http_id:
            session.http_id = http_id
            session.protocol = protocol
            self.by_id[http_id] = session
        return session

    async def end_revoked(self) -> None:
        """End the sessions of tokens deleted (or made again): once no call
        waits for approval (they answer approval_token_deleted), and
        TOKEN_END_GRACE_SECS for its other calls."""
        live = self.app.access.live_ids()
        for session in [*self.by_principal.values(), *self.by_id.values()]:
            name = session.principal.name
            if live.get(name) == session.principal.id:
                continue
            session.revoked_at = session.revoked_at or time.monotonic()
            waited = time.monotonic() - session.revoked_at
            grace = waited < TOKEN_END_GRACE_SECS
            if session.held or (session.in_flight and grace):
                continue
            log.info(
                "token %s was deleted: ending its session %s", name, session.id
            )
            await self.drop(session)

    async def end_idle(self) -> None:
        """End every session with no request in flight and none for its
        idle limit (idle_limit), whatever GET streams it holds open."""
        for session in [*self.by_principal.values(), *self.by_id.values()]:
            limit, why = self.idle_limit(session)
            quiet = time.monotonic() - session.last_seen
            if session.in_flight or quiet < limit:
                continue
            log.info(
                "session %s %s for %d s: ending it", session.id, why, limit
            )
            if session.http_id is None:
                self.note_idle_end(session, limit)
            await self.drop(session)

    def note_idle_end(self, session: Session, limit: int) -> None:
        """Remember the ephemeral machines a 2026-era token's state takes
        with it as it idles out: the newest IDLE_ENDED_KEPT a token."""
        now = time.monotonic()
        ended = self.idle_ended.setdefault(session.principal.name, {})
        for fleet, machines in session.machines.items():
            for machine in machines:
                ended[(fleet, machine)] = (now, limit)
        newest = sorted(ended.items(), key=lambda item: item[1][0])
        self.idle_ended[session.principal.name] = dict(
            newest[-IDLE_ENDED_KEPT:]
        )

    def idle_ended_note(
        self, principal: Principal, fleet: Any, machine: Any
    ) -> str:
        """Why ``machine`` is gone, when its token's 2026-era state took it
        as it idled out (within IDLE_ENDED_SECS); else ""."""
        ended = self.idle_ended.get(principal.name, {})
        when, limit = ended.get((fleet, machine), (None, 0))
        if when is None or time.monotonic() - when > IDLE_ENDED_SECS:
            return ""
        prefix = self.app.config.machine_prefix
        return (
            f"'{machine}' was an ephemeral machine of this token's,"
            f" deleted with its 2026-07-28 state after {limit} s without a"
            " request (httpStatelessIdleSecs): create a new one; a name"
            f" without the {prefix!r} prefix keeps a machine across pauses"
            " (delete it when done)"
        )

    def idle_limit(self, session: Session) -> tuple[int, str]:
        """How long ``session`` may be idle, and the word for why it ends.
        httpSessionIdleSecs, or less: HTTP_UNUSED_SESSION_SECS for one that
        never made a call; a 2026-era token's, whose client cannot say it
        left, httpStatelessIdleSecs unless it holds a listen stream open."""
        config = self.app.config
        limit = config.http_session_idle_secs
        why = "idle"
        stateless = session.http_id is None
        if stateless and not session.listening:
            limit = min(limit, config.http_stateless_idle_secs)
        if not session.used:
            limit = min(limit, HTTP_UNUSED_SESSION_SECS)
            why = "unused"
        return limit, why

    async def drop(self, session: Session) -> None:
        """Forget a session and end it; a handshake-era one first through
        the manager, as its client's DELETE would (the SDK closes its
        streams, its exit stack runs our cleanup)."""
        if session.http_id is None:
            self.by_principal = {
                k: v for k, v in self.by_principal.items() if v is not session
            }
            return await self.app.end_session(session)
        self.by_id.pop(session.http_id, None)
        statuses = []

        async def receive() -> dict:
            return {"type": "http.request", "body": b"", "more_body": False}

        async def send(message: dict) -> None:
            if message["type"] == "http.response.start":
                statuses.append(message["status"])

        try:
            scope = delete_scope(session, self.path)
            await self.manager.handle_request(scope, receive, send)
        except Exception as err:
            statuses.append(describe(err))
        if statuses != [200]:
            log.warning(
                "session %s: ending it for idleness answered %s",
                session.id,
                statuses,
            )
        await self.app.end_session(session)


class McpEndpoint:
    """The MCP path: each request handed to the SDK's app, keeping the
    books of HttpSessions as it passes (sessions opened and ended, calls
    in flight, the client that hung up, the shutdown)."""

    def __init__(
        self, sessions: HttpSessions, sdk_app: Any, streaming_app: Any
    ):
        self.sessions = sessions
        # The SDK's app answering in plain JSON, and the same in event
        # stream mode: a 2026-era call that asks for progress goes to the
        # second, whose answer turns into a stream once there is progress
        # to carry (a quick call's is plain JSON still).
        self.sdk_app = sdk_app
        self.streaming_app = streaming_app

    async def __call__(
        self, scope: dict, receive: Callable, send: Callable, body: bytes
    ) -> None:
        """Hand one request to the SDK and keep its session's books: a POST
        of requests is in flight while served (a listen stream, open while
        idle, is not), initialize's answer opens a handshake session, and
        an accepted DELETE ends one. Only those two answers are watched;
        a call's passes straight through."""
        principal = scope["state"]["smol_principal"]
        http_id, version = session_headers(scope["headers"])
        scope["state"]["smol_http_id"] = http_id
        requests = []
        if scope["method"] == "POST":
            try:
                requests = body_requests(body)
            except JsonRefused as err:
                # Before the SDK, which reads NaN and Infinity.
                unread = {"code": -32700, "message": str(err)}
                answer = {"jsonrpc": "2.0", "id": None, "error": unread}
                return await send_json(send, 400, answer)
        methods = [request["method"] for request in requests]
        if "initialize" in methods and not http_id:
            busy = self.over_share(principal)
            if busy is not None:
                return await send_json(send, 503, {"error": busy})
        watch = None
        # Only a handshake-era request without a session id can open one
        # (the 2026 era never does), and only a DELETE can end one.
        opens = not http_id and not modern_version(version)
        if opens or scope["method"] == "DELETE":
            watch = ResponseWatch(send, keep_body="initialize" in methods)
            send = watch
        session = self.session_of(principal, http_id, version, methods)
        listening = set(methods) == {"subscriptions/listen"}
        sdk_app = self.sdk_app
        if modern_version(version) and any(map(asks_progress, requests)):
            if accepts_stream(scope["headers"]):
                sdk_app = self.streaming_app
        if session is not None and listening:
            await self.listen(scope, receive, send, session, body)
        elif session is None or not methods or listening:
            await self.to_sdk(scope, receive, send, body, sdk_app)
        else:
            await self.serve(scope, receive, send, session, body, sdk_app)
        if watch is not None:
            self.settle(scope["method"], principal, http_id, watch)

    def over_share(self, principal: Principal) -> str | None:
        """Why ``principal`` may open no more sessions, or None. A token's
        share is HTTP_SESSIONS_PER_TOKEN; named tokens leave one share for
        the operator's own."""
        share = HTTP_SESSIONS_PER_TOKEN
        room = HTTP_MAX_SESSIONS - len(self.sessions.by_id)
        mine = sum(
            1
            for s in self.sessions.by_id.values()
            if s.principal.id == principal.id
        )
        named = principal.name != "default"
        if mine < share and not (named and room <= share):
            return None
        return (
            f"{principal.label()} has {share} sessions open, its share; "
            "end one (a client's DELETE, or let it idle out) before opening "
            "another"
        )

    def session_of(
        self,
        principal: Principal,
        http_id: str | None,
        version: str | None,
        methods: list,
    ) -> Session | None:
        """The session a request to the SDK counts for, marked used when it
        calls something (SESSION_USES); None when it has none yet."""
        if modern_version(version):
            session = None
            if methods:
                session = self.sessions.modern_session(principal)
        else:
            session = self.sessions.by_id.get(http_id or "")
        if session is None:
            return None
        if http_id and version:
            session.protocol = version
        if any(method in SESSION_USES for method in methods):
            session.used = True
        return session

    def settle(
        self,
        method: str,
        principal: Principal,
        http_id: str | None,
        watch: ResponseWatch,
    ) -> None:
        """After the SDK answered: open the handshake session an initialize
        answer named, end the one an accepted DELETE did."""
        opened = watch.headers.get(b"mcp-session-id", b"").decode("latin-1")
        answered = watch.status == 200
        if (
            not http_id
            and opened
            and answered
            and opened not in self.sessions.by_id
        ):
            # The protocol version that initialize settled on.
            settled = json_body(watch.body, "result", "protocolVersion")
            if not isinstance(settled, str):
                settled = None
            self.sessions.open_handshake(principal, opened, settled)
        if method == "DELETE" and answered and http_id in self.sessions.by_id:
            ended = self.sessions.by_id.pop(http_id)
            self.sessions.tasks.start_soon(
                self.sessions.app.end_session, ended
            )

    async def serve(
        self,
        scope: dict,
        receive: Callable,
        send: Callable,
        session: Session,
        body: bytes,
        sdk_app: Any,
    ) -> None:
        """Serve a POST of calls, in flight meanwhile. No task listens for
        its client hanging up: client_gone asks the connection when a call
        waiting for approval needs to know."""
        session.in_flight += 1
        try:
            await self.to_sdk(scope, receive, send, body, sdk_app)
        finally:
            session.in_flight -= 1
            session.last_seen = time.monotonic()

    async def listen(
        self,
        scope: dict,
        receive: Callable,
        send: Callable,
        session: Session,
        body: bytes,
    ) -> None:
        """Serve a 2026-era subscriptions/listen stream, counted open
        meanwhile: its client is still there, whatever it calls."""
        session.listening += 1
        try:
            await self.to_sdk(scope, receive, send, body, self.sdk_app)
        finally:
            session.listening -= 1
            session.last_seen = time.monotonic()

    async def to_sdk(
        self,
        scope: dict,
        receive: Callable,
        send: Callable,
        body: bytes,
        sdk_app: Any,
    ) -> None:
        """Hand a request to ``sdk_app``. Once told to stop (SIGTERM,
        SIGINT), a POST still served is stopped and answered with a
        JSON-RPC error saying so, not cut off by a plain-text 500."""
        stopping = self.sessions.stopping
        if scope["method"] != "POST" or stopping is None:
            return await sdk_app(scope, receive, send)
        sent = set()

        async def send_watch(message: dict) -> None:
            sent.add(message["type"])
            await send(message)

        # stop_serving cancels it.
        with anyio.CancelScope() as serving:
            self.sessions.serving.add(serving)
            try:
                # It came in after the others were stopped.
                if stopping.is_set():
                    serving.cancel()
                await sdk_app(scope, receive, send_watch)
            finally:
                self.sessions.serving.discard(serving)
        if stopping.is_set() and "http.response.start" not in sent:
            await send_json(send, 200, shutdown_answer(body))


def session_headers(headers: list) -> tuple[str | None, str | None]:
    """A request's Mcp-Session-Id and MCP-Protocol-Version (None for one
    it lacks)."""
    http_id = None
    version = None
    for name, value in headers:
        if name == b"mcp-session-id":
            http_id = value.decode("latin-1")
        elif name == b"mcp-protocol-version":
            version = value.decode("latin-1")
    return http_id, version


def accepts_stream(headers: list) -> bool:
    """Whether a request's Accept names text/event-stream (the SDK's event
    stream mode refuses, 406, a request that does not)."""
    for name, value in headers:
        if name == b"accept" and b"text/event-stream" in value:
            return True
    return False


def modern_version(version: str | None) -> bool:
    """Whether a request's MCP-Protocol-Version takes it to the SDK's
    2026-era entry: one given that no handshake-era version is (as the
    SDK's session manager routes it)."""
    return version is not None and version not in handshake_versions()


@functools.cache
def handshake_versions() -> frozenset[str]:
    """The SDK's handshake-era protocol versions (imported once: an import
    statement a request costs microseconds)."""
    from mcp_types.version import HANDSHAKE_PROTOCOL_VERSIONS

    return frozenset(HANDSHAKE_PROTOCOL_VERSIONS)


def client_gone(ctx: Any) -> bool:
    """Whether the HTTP client of the request ``ctx`` serves hung up
    before its answer: uvicorn marks the request's cycle when its
    connection is lost with the answer not yet sent. False for a stdio
    request, and over any server but guarded_protocol's."""
    request = getattr(ctx, "request", None)
    if request is None:
        return False
    cycle = request_cycle(request.scope)
    return cycle is not None and cycle.disconnected


class ResponseWatch:
    """A send that passes every message on, keeping the response's status
    and headers, and its body when ``keep_body``."""

    def __init__(self, send: Callable, keep_body: bool):
        self.send = send
        self.keep_body = keep_body
        self.status: int | None = None
        self.headers: dict = {}
        self.body = bytearray()

    async def __call__(self, message: dict) -> None:
        if message["type"] == "http.response.start":
            self.status = message["status"]
            self.headers = {
                k.lower(): v for k, v in message.get("headers", [])
            }
        elif message["type"] == "http.response.body" and self.keep_body:
            self.body.extend(message.get("body", b""))
        await self.send(message)


def shutdown_answer(body: bytes) -> Any:
    """The JSON-RPC answer to a body's requests (one, or a batch) that the
    shutdown stopped: an error with SHUTDOWN_MESSAGE for each."""
    request = json_body(body)
    error = {"code": -32000, "message": SHUTDOWN_MESSAGE}
    requests = request if isinstance(request, list) else [request]
    ids = [r.get("id") if isinstance(r, dict) else None for r in requests]
    answers = [{"jsonrpc": "2.0", "id": id_, "error": error} for id_ in ids]
    if isinstance(request, list):
        return answers
    return answers[0]


def delete_scope(session: Session, path: str) -> dict:
    """The ASGI scope of the DELETE that ends a handshake-era session, as
    its client would send it (its user too: the SDK checks whose session
    it is)."""
    protocol = session.protocol or "2025-06-18"
    headers = [
        (b"mcp-session-id", session.http_id.encode()),
        (b"mcp-protocol-version", protocol.encode()),
    ]
    local = ("127.0.0.1", 0)
    return {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "state": {},
        "method": "DELETE",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": headers,
        "client": local,
        "server": local,
        "user": authenticated_user(session.principal),
    }


def build_http_app(app: SmolMcp, host: str, port: int, path: str):
    """The ASGI application for --http: HttpGate in front of the SDK's
    session manager, and of the server's own pages when it has an issuer
    (see oauth_issuer)."""
    from mcp.server import streamable_http_manager as sdk_http
    from starlette.applications import Starlette

    config = app.config
    manager = sdk_http.StreamableHTTPSessionManager(
        app.server,
        max_request_body_size=HTTP_MAX_BODY_BYTES,
        max_sessions=HTTP_MAX_SESSIONS,
        json_response=True,
        session_idle_timeout=config.http_session_idle_secs,
    )
    # 2026-era calls that ask for progress only (McpEndpoint): that era
    # has no stream but the answer's own to carry it. Its server has the
    # same handlers and no lifespan of its own: the first one's serves.
    streaming = sdk_http.StreamableHTTPSessionManager(
        app.mcp_server(no_lifespan),
        max_request_body_size=HTTP_MAX_BODY_BYTES,
        max_sessions=HTTP_MAX_SESSIONS,
        json_response=False,
    )

    @asynccontextmanager
    async def lifespan(_: Any):
        # manager.run enters the server's lifespan once and ends every
        # session at exit.
        async with manager.run(), streaming.run():
            yield

    # The MCP path goes straight to the managers' apps (HttpGate checked
    # the path): a router and its middleware a request cost more than the
    # rest of the gate. Starlette runs the lifespan.
    lifespan_app = Starlette(lifespan=lifespan)
    app.http = HttpSessions(app, manager, path)
    endpoint = McpEndpoint(
        app.http,
        sdk_http.StreamableHTTPASGIApp(manager),
        sdk_http.StreamableHTTPASGIApp(streaming),
    )
    issuer = oauth_issuer(config, host, port)
    public_app = None
    if issuer:
        app.pages = Pages(app.access.state_dir, issuer)
        public_app = pages_app(app, issuer, path)
    allowed_hosts = default_allowed_hosts(config, host, port)
    return HttpGate(app, lifespan_app, endpoint, allowed_hosts, public_app)


def pages_app(app: SmolMcp, issuer: str, path: str) -> Any:
    """The ASGI app of what HttpGate lets through without a token: sign-in
    and consent, the SDK's OAuth routes on OAuthProvider, the console."""
    from starlette.applications import Starlette

    provider = OAuthProvider(app, issuer, issuer + path)
    groups = (
        SignInPages(app.pages, provider),
        OAuthEndpoints(app.pages, provider),
        TokenPages(app),
        ApprovalPages(app),
        ActivityPage(app),
    )
    routes = [route for group in groups for route in group.routes()]
    # A PageAnswer carries the response to send instead; a path or method
    # the pages lack is a page too, titled like every other.
    answers = {
        PageAnswer: lambda _, answer: answer.args[0],
        404: functools.partial(no_such_page, app.pages),
        405: functools.partial(no_such_page, app.pages),
    }
    return Starlette(routes=routes, exception_handlers=answers)


async def no_such_page(pages: Pages, request: Any, exc: Any) -> Any:
    """The page of a path the server's pages do not have (404), or of a
    method a path does not take (405, with its Allow header)."""
    if exc.status_code == 404:
        title = "No such page"
        said = "There is no page at this address."
    else:
        title = "Not a page to open"
        said = f"This address does not answer {request.method} requests."
    body = (
        f"<p>{esc(said)} The operator's console is at "
        '<a href="/console">/console</a>.</p>'
    )
    response = pages.page(request, title, body, exc.status_code)
    response.headers.update(exc.headers or {})
    return response


# -- the operator's console -------------------------------------------------
#
# /console: the tokens, the calls waiting for approval and the activity log,
# for the operator signed in to the server's own pages (section 14b; a
# bearer token opens none of it, the session cookie calls no tool). Plain
# HTML through Pages.page, no script; every form carries the CSRF token,
# every value an agent chose is escaped, each change is the terminal's own
# event naming operator and console.

CONSOLE_WHO = {"principal": "operator", "via": "console"}
# + the id: one waiting call, linked from the webhook.
REVIEW_PAGE = "/console/approvals/"
# The approvals list reloads itself this often while open.
CONSOLE_REFRESH_SECS = 5
CONSOLE_PAGE_ROWS = 50
# The activity page reads no further back than this many pages (10,000
# entries); the command line reads the rest.
CONSOLE_MAX_PAGES = 200
CONSOLE_PERIODS = dict(
    zip(AUTO_APPROVE_PERIODS, "1 hour,1 day,7 days,30 days,forever".split(","))
)
CONSOLE_PAGES = {
    "tokens": "Access tokens",
    "approvals": "Approvals",
    "activity": "Activity",
}
CONSOLE_NAV = " ".join(
    f'<a href="/console/{p}">{name}</a>' for p, name in CONSOLE_PAGES.items()
)
DEFAULT_TOKEN_CARD = (
    "<section><h2>default</h2><p>SMOL_MCP_AUTH_TOKEN: every scope and "
    "fleet, no approval; set in the server's environment</p></section>"
)


class ConsolePages:
    """What the console's page groups share: the server's pages, settings
    and access, and show(), which makes a page of the console."""

    def __init__(self, app: SmolMcp):
        self.app = app
        self.pages = app.pages
        self.config = app.config
        self.access = app.access

    def show(
        self, request: Any, title: str, body: str, status=200, head=""
    ) -> Any:
        """A console page, for the signed-in operator only: the console's
        links, then ``body``."""
        self.pages.require_operator(request)
        shown = f"<nav>{CONSOLE_NAV}</nav>{body}"
        return self.pages.page(request, title, shown, status, head=head)


class ApprovalPages(ConsolePages):
    """The calls waiting for approval, each a card with its arguments and
    the form that answers it; one call's own page is what the webhook
    links to."""

    def routes(self) -> list:
        from starlette.routing import Route

        return [
            Route("/console", self.to_approvals),
            Route("/console/approvals", self.waiting),
            Route("/console/approvals/{id}", self.waiting),
            Route("/console/approvals/{id}", self.answer, methods=["POST"]),
        ]

    def to_approvals(self, request: Any) -> Any:
        from starlette.responses import RedirectResponse

        self.pages.require_operator(request)
        return RedirectResponse("/console/approvals", 303)

    async def waiting(self, request: Any) -> Any:
        """The calls waiting, newest first, the page reloading itself; with
        an id, that call's review page, which does not reload under the
        person reading it (404 once the call is gone)."""
        # Before any work: a stranger reads nothing.
        session = self.pages.require_operator(request)
        calls = sorted(
            waiting_calls(self.config),
            key=lambda c: str(c["expiresAt"]),
            reverse=True,
        )
        wanted = request.path_params.get("id")
        if wanted is not None:
            calls = [call for call in calls if call["id"] == wanted]
        shown = [self.card(request, call) for call in calls]
        if not shown:
            shown = [nothing_waits(wanted)]
        # The last answer, shown once.
        notice = session.pop("notice", "")
        if notice:
            shown.insert(0, f'<p class="note">{esc(notice)}</p>')
        status = 200
        if wanted and not calls:
            status = 404
        head = ""
        if not wanted:
            head = (
                f'<meta http-equiv="refresh" content="{CONSOLE_REFRESH_SECS}">'
            )
        body = "".join(shown)
        return self.show(request, "Approvals", body, status, head)

    def card(self, request: Any, call: dict) -> str:
        """One waiting call: its tool and machine, token, time left,
        arguments, and the form that answers it."""
        on = ""
        if call.get("machine"):
            on = f" on {esc(call['machine'])}"
        arguments = json.dumps(
            call.get("arguments") or {}, indent=1, ensure_ascii=False
        )
        review = REVIEW_PAGE + esc(call["id"])
        form = self.pages.post_form(request, review, answer_fields())
        return (
            f"<section><h2>{esc(call['tool'])}{on}</h2>"
            f"<p>token <b>{esc(call['token'])}</b>, {card_time_left(call)}, "
            f'<a href="{review}">review {esc(call["id"])}</a></p>'
            f"<pre>{esc(arguments)}</pre>{form}</section>"
        )

    async def answer(self, request: Any) -> Any:
        """Approve, approve and auto-approve for a period, or reject a
        waiting call; back to the list, which says what was done."""
        from starlette.responses import RedirectResponse

        self.pages.require_operator(request)
        form = await self.pages.form(request)
        call_id = request.path_params["id"]
        choice = str(form.get("answer"))
        reason = str(form.get("reason", ""))[:500]
        # The period chosen.
        auto = None
        if choice == "auto":
            auto = str(form.get("auto"))
        try:
            known = choice in ("approve", "auto", "reject")
            if not known or auto not in (None, *CONSOLE_PERIODS):
                raise SmolError(
                    "Choose Approve, Approve + auto-approve (for a period) "
                    "or Reject."
                )
            approve = choice != "reject"
            held, until = answer_approval(
                self.config, call_id, approve, CONSOLE_WHO, auto, reason
            )
        except SmolError as err:
            return self.show(request, "Approvals", error_html(err), 409)
        notice = answered_notice(held, approve, until)
        self.pages.session(request)["notice"] = notice
        return RedirectResponse("/console/approvals", 303)


def nothing_waits(wanted: str | None) -> str:
    """What the approvals page says when no call (or not call ``wanted``)
    waits."""
    if not wanted:
        return "<p>No call waits for approval.</p>"
    return (
        f"<p>No call waits as {esc(wanted)}: it was answered, it timed "
        "out, or its client went away. "
        '<a href="/console/approvals">All waiting calls</a></p>'
    )


def card_time_left(call: dict) -> str:
    """How long a waiting call has before it times out, for its card."""
    left = seconds_left(call.get("expiresAt"))
    if left is None:
        return "time left unknown"
    return f"{left} s left"


def answer_fields() -> str:
    """The buttons of a waiting call's form: Approve, Approve +
    auto-approve for a period, Reject with a reason."""
    options = "".join(
        f'<option value="{k}">{v}</option>' for k, v in CONSOLE_PERIODS.items()
    )
    # The marks are hidden from a screen reader: the names say it.
    return (
        '<button class="approve" name="answer" value="approve">'
        '<span aria-hidden="true">&#10003; </span>Approve</button> '
        "<label>Auto-approve for "
        f'<select name="auto">{options}</select></label>'
        '<button class="approve auto" name="answer" value="auto">'
        "Approve + auto-approve</button>"
        '<label>Reason <input type="text" name="reason" maxlength="500">'
        "</label>"
        '<button class="reject" name="answer" value="reject">'
        '<span aria-hidden="true">&#10007; </span>Reject: do not run it'
        "</button>"
    )


def answered_notice(held: dict, approve: bool, until: str | None) -> str:
    """What the approvals list says, once, after an answer."""
    done = "approved: it runs now"
    if not approve:
        done = "rejected: it does not run"
    auto = ""
    if until:
        auto = f"; {held['token']} runs without asking until {until}"
    return f"{held['tool']} by {held['token']} {done}{auto}."


class TokenPages(ConsolePages):
    """The access tokens, each a card with its End auto-approval and
    Delete buttons (the default token shown, not changed), and the form for
    a new one, whose secret is shown once."""

    def routes(self) -> list:
        from starlette.routing import Route

        return [
            Route("/console/tokens", self.tokens, methods=["GET", "POST"]),
            Route("/console/tokens/{name}", self.change, methods=["POST"]),
        ]

    async def tokens(self, request: Any) -> Any:
        """GET: the tokens, and the form for a new one; POST: make it, and
        show its secret above the same page (400 and why, if it cannot be
        made)."""
        self.pages.require_operator(request)
        made = ""
        status = 200
        if request.method == "POST":
            made, status = await self.create(request)
        # A person's page shows the file as it is now.
        self.access.tokens.file.expire()
        used = self.access.tokens.last_used()
        cards = [
            self.card(request, record, used)
            for record in self.access.tokens.records()
        ]
        # Not in the tokens file: the page can show it, not change it.
        if self.config.auth_token:
            cards.append(DEFAULT_TOKEN_CARD)
        listed = "".join(cards) or "<p>No tokens yet.</p>"
        form = self.pages.post_form(
            request, "/console/tokens", self.new_token_fields()
        )
        body = f"{made}{listed}<h2>New token</h2>{form}"
        return self.show(request, "Access tokens", body, status)

    def new_token_fields(self) -> str:
        """The fields of the form that makes a token."""
        scopes = "".join(checkbox_html("scope", scope) for scope in SCOPES)
        fleets = "".join(
            checkbox_html("target", fleet, checked=True) for fleet in FLEETS
        )
        approval = checkbox_html(
            "approval", "changes", "Require approval for changes"
        )
        return (
            '<label>Name <input type="text" name="name" maxlength="64" '
            "required></label>"
            f"<fieldset><legend>Scopes</legend>{scopes}</fieldset>"
            f"<fieldset><legend>Fleets</legend>{fleets}</fieldset>"
            f"{approval}{self.pages.confirm_field('a new token')}"
            "<button>Create token</button>"
        )

    async def create(self, request: Any) -> tuple[str, int]:
        """Make the token the form asks for: its secret and how to use it,
        with 200; or why not, with 400."""
        form = await self.pages.form(request)
        try:
            why = await self.pages.confirm(request, form)
            if why:
                raise SmolError(why)
            name = str(form.get("name", "")).strip()
            scopes = parse_scopes(",".join(form.getlist("scope")))
            targets = parse_targets(",".join(form.getlist("target")))
            approval = "none"
            if form.get("approval") == "changes":
                approval = "changes"
            _, secret = self.access.tokens.create(
                name, scopes, targets, approval
            )
        except SmolError as err:
            return error_html(err), 400
        made = {
            "event": "token",
            "outcome": "created",
            "token": name,
            "scopes": scopes,
            "targets": targets,
            "approval": approval,
        }
        cli_record(self.config, made, CONSOLE_WHO)
        return self.secret_shown(name, secret), 200

    def secret_shown(self, name: str, secret: str) -> str:
        """A new token's secret, shown this once, with each client's setup
        entry and a curl of the plain API."""
        url = self.pages.issuer + self.app.http.path
        entries = "".join(
            f"<h3>{client}</h3>"
            f"<pre>{esc(token_entry(client, url, self.config, name, secret))}"
            "</pre>"
            for client in SETUP_CLIENTS
        )
        api = self.pages.issuer + plain_api_path(self.app.http.path)
        return (
            f"<p>Created <b>{esc(name)}</b>. Its secret, shown this once "
            f"(only its hash is kept):</p><pre>{esc(secret)}</pre>{entries}"
            f"<h3>curl</h3><pre>curl -H 'Authorization: Bearer "
            f"{esc(secret)}' {esc(api)}</pre>"
        )

    def card(self, request: Any, record: dict, used: dict) -> str:
        """One token: its scopes, fleets, client, approval, auto-approval,
        when made and last used, and its buttons."""
        name = record["name"]
        until = self.access.auto.shown(name, record.get("id", ""))
        auto = {"off": "off", "forever": "forever"}.get(
            until, f"until {until}"
        )
        end = ""
        if until != "off":
            end = (
                '<button name="action" value="auto-off">End auto-approval'
                "</button> "
            )
        delete = '<button name="action" value="delete">Delete</button>'
        action = f"/console/tokens/{urllib.parse.quote(name)}"
        scopes = ", ".join(record["scopes"])
        fleets = ", ".join(record["targets"])
        client = record.get("client") or "-"
        created = record.get("createdAt", "-")
        last_used = used.get(name, "never")
        return (
            f"<section><h2>{esc(name)}</h2><p>scopes {esc(scopes)}; "
            f"fleets {esc(fleets)}; client {esc(client)}<br>"
            f"approval {esc(record['approval'])}; "
            f"auto-approval {esc(auto)}<br>"
            f"created {esc(created)}; last used {esc(last_used)}</p>"
            f"{self.pages.post_form(request, action, end + delete)}</section>"
        )

    async def change(self, request: Any) -> Any:
        """Delete a token, or end its auto-approval; back to the tokens
        (404 when there was nothing to do)."""
        from starlette.responses import RedirectResponse

        self.pages.require_operator(request)
        form = await self.pages.form(request)
        name = request.path_params["name"]
        action = form.get("action")
        if action == "delete" and self.access.tokens.delete(name):
            deleted = {"event": "token", "outcome": "deleted", "token": name}
            cli_record(self.config, deleted, CONSOLE_WHO)
        elif action == "auto-off" and self.access.auto.end(name):
            ended = {
                "event": "approval",
                "approval": "auto-approval ended",
                "token": name,
            }
            cli_record(self.config, ended, CONSOLE_WHO)
        else:
            nothing = f"<p>Nothing to do for {esc(name)}.</p>"
            return self.show(request, "Access tokens", nothing, 404)
        return RedirectResponse("/console/tokens", 303)


class ActivityPage(ConsolePages):
    """The activity log, newest first, filtered by token, machine and
    period, CONSOLE_PAGE_ROWS entries a page."""

    def routes(self) -> list:
        from starlette.routing import Route

        return [Route("/console/activity", self.activity)]

    async def activity(self, request: Any) -> Any:
        """The entries ?token=, ?machine= and ?since= ask for, page ?page=
        of them, with the filter's form and links to the pages around."""
        # Before any work: a stranger reads nothing.
        self.pages.require_operator(request)
        query = request.query_params
        asked = {
            key: query.get(key, "").strip()[:100]
            for key in ("token", "machine", "since")
        }
        page = page_number(query)
        since = None
        error = ""
        try:
            if asked["since"]:
                since = parse_period(asked["since"])
        except ValueError as err:
            error = error_html(err)
        keep = activity_filter(
            asked["token"] or None, asked["machine"] or None, since
        )
        rows = CONSOLE_PAGE_ROWS
        # Read no further back than this page and one more entry (a full
        # log is large).
        limit = page * rows + 1
        entries = self.access.activity.entries(keep, limit=limit)[::-1]
        listed = entries[(page - 1) * rows :][:rows]
        older = len(entries) > page * rows
        rest = ""
        if older and page == CONSOLE_MAX_PAGES:
            older = False
            rest = " Older entries: <code>smol_mcp.py activity</code>."
        items = "".join(
            f"<li>{' &middot; '.join(map(esc, activity_row(entry)))}</li>"
            for entry in listed
        )
        body = (
            f"{filter_form(asked)}{error}<p>Newest first (since: 90s, 15m, "
            f"1h, 2d, 1w); page {page}.{page_links(asked, page, older)}"
            f"{rest}</p>"
            f"<ol>{items}</ol>"
        )
        return self.show(request, "Activity", body)


def page_number(query: Any) -> int:
    """The page of the activity log asked for: ?page=N, 1 unless it is a
    number of six digits at most, CONSOLE_MAX_PAGES at most."""
    asked = query.get("page", "")
    if not re.fullmatch(r"[0-9]{1,6}", asked):
        return 1
    return min(max(1, int(asked)), CONSOLE_MAX_PAGES)


def filter_form(asked: dict) -> str:
    """The activity page's filter: a box for each of token, machine,
    since."""
    box = '<label>{} <input type="text" name="{}" value="{}"></label>'
    inputs = "".join(
        box.format(key.title(), key, esc(value))
        for key, value in asked.items()
    )
    return (
        f'<form method="get" action="/console/activity">{inputs}'
        "<button>Filter</button></form>"
    )


def page_links(asked: dict, page: int, older: bool) -> str:
    """The links to the newer and the older page, where there is one."""
    links = []
    for number, label, shown in (
        (page - 1, "Newer", page > 1),
        (page + 1, "Older", older),
    ):
        if shown:
            query = urllib.parse.urlencode({**asked, "page": number})
            links.append(f' <a href="?{esc(query)}">{label}</a>')
    return "".join(links)


def describe_mount_roots(config: Config) -> str:
    """One line on the host directories an agent can mount, for the
    startup log and doctor."""
    roots = parse_mount_roots(config.mount_roots)
    if not roots:
        none = "none (mounts and host-path images are refused; mountRoots)"
        return f"host directories exposed to agents: {none}"
    covered = [
        own
        for own in server_directories(config)
        if any(within(own, r) for r, _ in roots)
    ]
    shown = ", ".join(
        f"{r} ({'read-write on request' if w else 'read-only'})"
        for r, w in roots
    )
    own = ""
    if covered:
        own = (
            f"; never mountable, being this server's own: {', '.join(covered)}"
        )
    return f"host directories exposed to agents (mountRoots): {shown}{own}"


async def run_http(app: SmolMcp, host: str, port: int, path: str) -> None:
    """Serve --http on ``host``:``port`` until a stop signal."""
    import uvicorn

    asgi = build_http_app(app, host, port, path)
    if asgi.allowed_hosts is None:
        off = (
            "the Host check is off, because the name clients dial is not "
            "knowable here; set it"
        )
        log.warning(
            "bound to %s with no SMOL_MCP_HTTP_ALLOWED_HOSTS: %s to that name",
            host,
            off,
        )
    # Before saying "serving": a taken port says so.
    listening = listen_socket(host, port)
    log.info("serving Streamable HTTP on http://%s:%d%s", host, port, path)
    log.info("%s", describe_mount_roots(app.config))
    bound = dataclasses.replace(app.config, http_host=host, http_port=port)
    log.info("oauth: %s", oauth_report(bound))
    options = uvicorn_options(app.config.trusted_proxies)
    config = uvicorn.Config(asgi, host=host, port=port, **options)
    loop = asyncio.get_running_loop()
    app.http.stopping = anyio.Event()

    class Server(uvicorn.Server):
        """Told of a stop signal at once (so calls in flight are answered,
        see McpEndpoint.to_sdk), and exiting 0 after: uvicorn re-raises
        the signal once it is done."""

        def handle_exit(self, sig: int, frame: Any) -> None:
            # A call waiting for approval answers approval_interrupted.
            app.stopping = True
            # In a signal handler: the loop sets it.
            loop.call_soon_threadsafe(app.http.stopping.set)
            super().handle_exit(sig, frame)

    # SIGTERM and SIGINT end the lifespan, which cleans up; uvicorn
    # restores the handlers it found and re-raises the signal once done,
    # so what it finds must be a handler that does nothing (the signal was
    # handled already).
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    freeze_heap()
    await Server(config).serve(sockets=[listening])


def freeze_heap() -> None:
    """Put what the process holds once it is set up (the modules, the
    tools, the SDK) beyond the garbage collector's full passes, which
    otherwise walk all of it: 60 to 100 ms with every request waiting, a
    few times a minute under load (the p99 of 16 agents at once). What
    is made later is collected as before."""
    gc.collect()
    gc.freeze()


def listen_socket(host: str, port: int) -> socket.socket:
    """The listening socket of --http, or a SmolError saying what to do."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP by name: asyncio sets TCP_NODELAY only on such sockets,
    # and without it Nagle and delayed ACKs hold every answer 40 ms
    # (socket.create_server's proto is 0).
    listening = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        listening.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listening.bind((host, port))
        listening.listen(2048)
        return listening
    except OSError as err:
        listening.close()
        why = f"cannot listen on {host}:{port}: {os.strerror(err.errno)}"
        advice = (
            "check --host (SMOL_MCP_HTTP_HOST) names an address of this host"
        )
        if err.errno == errno.EADDRINUSE:
            advice = (
                "another program is listening there (find it with "
                f"`ss -ltnp 'sport = :{port}'`): stop it, or choose another "
                "port with --port or SMOL_MCP_HTTP_PORT"
            )
        raise SmolError(f"{why}; {advice}") from None


# ---------------------------------------------------------------------------
# 14b. Sign-in and OAuth (--http)
#
# A client connects by URL alone: this server is its own OAuth
# authorization server (the SDK's routes over a provider kept in the state
# directory), and the person who consents is the operator, signed in to the
# server's own pages with a password or a one-time link made on the host. A
# grant is a named token, so all section 11 says of tokens holds for it.
# Pages are plain HTML made here: no JavaScript, no files beside the module.
# ---------------------------------------------------------------------------

# In the state directory.
OPERATOR_FILE = "operator.json"
OAUTH_CLIENTS_FILE = "oauth-clients.json"
# A one-time sign-in link is good for this long, and once.
SIGNIN_LINK_SECS = 600
# A session is bound to its browser's address and User-Agent.
SIGNIN_SESSION_SECS = 8 * 3600
# No password: a grant wider than Sandbox needs a session this young.
SIGNIN_FRESH_SECS = 300
# Failed sign-ins per address in a window, then it waits.
SIGNIN_TRIES = 5
SIGNIN_WINDOW_SECS = 300
# Failed sign-ins from all addresses in a window, then every one waits.
SIGNIN_ALL_TRIES = 50
SIGNIN_CHECKS = 2  # password checks (16 MiB of scrypt each) running at once
OAUTH_REGISTRATIONS = 10  # client registrations per address in a window
# Addresses each table of those counts keeps; a locked one never goes.
SIGNIN_MAX_KEYS = 1024
# Signed-in browsers kept; past it the oldest is signed out.
SIGNIN_MAX_SESSIONS = 16
SESSION_COOKIE = "smol_session"
FORM_COOKIE = "smol_form"
MIN_PASSWORD_CHARS = 12
PASSWORD_ATTRS = (
    'type="password" name="password" maxlength="1024" '
    'autocomplete="current-password"'
)
# And /console/...: reached without a token.
PAGE_PATHS = ("/signin", "/signout", "/consent")
# RFC 9728, + the MCP path.
RESOURCE_METADATA = "/.well-known/oauth-protected-resource"
# The SDK's routes.
OAUTH_PATHS = ("/authorize", "/token", "/register", "/revoke")
# Registrations kept; past it the oldest without a grant is dropped.
OAUTH_MAX_CLIENTS = 64
OAUTH_ACCESS_SECS = 3600
OAUTH_REFRESH_SECS = 30 * 86400
OAUTH_CODE_SECS = 300
# Consent requests held, in all, per client and per address asking; past
# a share its own oldest go, past all the oldest of whoever holds most.
OAUTH_MAX_PENDING = 32
OAUTH_CLIENT_PENDING = 4
OAUTH_ADDRESS_PENDING = 8
# Registered clients without a grant that one address may hold; past it
# its own oldest goes.
OAUTH_ADDRESS_CLIENTS = 8
OAUTH_MAX_REGISTRATION_BYTES = 8192
# The address of the OAuth request being served, set by
# OAuthEndpoints.screen: the SDK's handlers hand the provider no request.
OAUTH_CALLER: contextvars.ContextVar[str] = contextvars.ContextVar(
    "oauth_caller", default=""
)
# What is kept of a registration: what this server uses (registeredFrom,
# the address it came from, is ours).
OAUTH_CLIENT_FIELDS = {
    "registeredFrom",
    "client_id",
    "client_secret",
    "client_id_issued_at",
    "client_secret_expires_at",
    "client_name",
    "redirect_uris",
    "token_endpoint_auth_method",
    "grant_types",
    "response_types",
    "scope",
}
# The consent page's grants, besides Choose scopes.
GRANTS = {
    "Full": (*MACHINES_SCOPES, "activity.read"),
    "Read-only": ("machines.read", "activity.read"),
    "Sandbox": SANDBOX_SCOPES,
}
GRANT_NOTES = {
    "Full": "every tool, on every machine",
    "Read-only": (
        "list machines, read their details and logs, and the activity log"
    ),
    "Sandbox": "create and use machines of its own; it never sees the others",
    "Choose scopes": "exactly the scopes ticked here",
}
FORM_REFUSED = (
    "<p>This form was not sent from this site's page, or the page is out "
    "of date. Go back, reload the page and send it again, or "
    '<a href="/signin">sign in</a>.</p>'
)
LINK_REFUSED = (
    "That sign-in link is used, expired (links last 10 minutes) or wrong: "
    "make another with `smol_mcp.py operator link`."
)
CONSENT_GONE = (
    "<p>This request is unknown or over 10 minutes old: connect the client "
    "again.</p>"
)
PAGE_STYLE = (
    "body{font:16px/1.5 system-ui,sans-serif;max-width:40em;margin:0 auto;"
    "padding:0 1em}"
    "header{display:flex;flex-wrap:wrap;justify-content:space-between;"
    "align-items:center;gap:.5em;border-bottom:1px solid #ccc;"
    "padding:.5em 0}"
    "input,button{font:inherit;padding:.3em .6em}"
    "label{display:block;margin:.4em 0}"
    "input[type=text],input[type=password]{width:100%;"
    "box-sizing:border-box}"
    "fieldset{border:1px solid #ccc;margin:1em 0}"
    ".error{color:#a00}"
    ".note{color:#555}"
    "nav a{margin-right:1em}"
    "section{border-bottom:1px solid #ccc;padding-bottom:.5em}"
    "pre{white-space:pre-wrap;overflow-wrap:anywhere;background:#f4f4f4;"
    "padding:.5em}"
    ".approve{background:#1a7f37;color:#fff;border:1px solid #116329;"
    "font-weight:bold}"
    ".approve.auto{background:#fff;color:#116329}"
    ".reject{background:#fff;color:#b00020;border:2px solid #b00020;"
    "font-weight:bold}"
)


# -- HTML: escaping, the pieces the pages share, the layout ------------------


def esc(value: Any) -> str:
    """Text made safe inside HTML: every value a page shows goes through
    this."""
    return html.escape(str(value), quote=True)


def error_html(error: Any) -> str:
    """An error, as a page shows it."""
    return f'<p class="error">{esc(error)}</p>'


def checkbox_html(
    name: str, value: str, label: str = "", checked: bool = False
) -> str:
    """A checkbox in its label (the value, unless ``label`` is given)."""
    mark = " checked" if checked else ""
    return (
        f'<label><input type="checkbox" name="{esc(name)}" '
        f'value="{esc(value)}"{mark}> {esc(label or value)}</label>'
    )


def page_html(title: str, body: str, who: str = "", head: str = "") -> str:
    """A whole page around ``body``, readable on a phone: ``head`` in its
    head, ``who`` (who is signed in) in its header."""
    return (
        '<!doctype html><html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width,initial-scale=1">'
        f"{head}<title>{esc(title)} - smol-mcp</title>"
        f"<style>{PAGE_STYLE}</style></head>"
        f"<body><header><strong>smol-mcp</strong>{who}</header>"
        f"<h1>{esc(title)}</h1>{body}</body></html>"
    )


def page_headers(form_to: str = "") -> dict:
    """A page's headers: a CSP that allows only PAGE_STYLE and forms
    posting here (and to ``form_to``, one source, else none), no framing,
    no caching, no referrer."""
    digest = hashlib.sha256(PAGE_STYLE.encode()).digest()
    style = base64.b64encode(digest).decode()
    if re.search(r"[;,\s'\"]", form_to):
        form_to = ""
    policy = (
        f"default-src 'none'; style-src 'sha256-{style}'; "
        f"form-action 'self' {form_to}; frame-ancestors 'none'; "
        "base-uri 'none'"
    )
    return {
        "content-security-policy": policy,
        "x-frame-options": "DENY",
        "cache-control": "no-store",
        "referrer-policy": "no-referrer",
    }


class PageAnswer(Exception):
    """The answer a page sends instead, raised with it: a signed-out
    browser sent to sign in, a form without its CSRF token refused (see
    Pages.require_operator and Pages.form)."""


class Operator:
    """The operator's password (scrypt, salted) and one-time sign-in
    links: never in clear."""

    def __init__(self, state_dir: str | Path):
        self.file = StateFile(Path(state_dir) / OPERATOR_FILE, dict)

    @staticmethod
    def _scrypt(password: str, salt: str) -> str:
        return hashlib.scrypt(
            password.encode(), salt=bytes.fromhex(salt), n=2**14, r=8, p=1
        ).hex()

    def set_password(self, password: str) -> None:
        if len(password) < MIN_PASSWORD_CHARS:
            raise ConfigError(
                f"the password has {len(password)} characters; use at "
                f"least {MIN_PASSWORD_CHARS} (a few words work well)"
            )
        salt = secrets_module.token_hex(16)
        hashed = {"salt": salt, "scrypt": self._scrypt(password, salt)}
        self.file.update(lambda data: data.__setitem__("password", hashed))

    def check_password(self, password: str) -> bool:
        saved = self.file.read().get("password")
        if not saved or not password or len(password) > 1024:
            return False
        return hmac.compare_digest(
            self._scrypt(password, saved["salt"]), saved["scrypt"]
        )

    def generation(self) -> str | None:
        """The password's salt: new with each password, so a session of
        the old one ends."""
        return (self.file.read().get("password") or {}).get("salt")

    def new_link(self) -> str:
        secret = secrets_module.token_urlsafe(32)
        link = {
            "sha256": secret_hash(secret),
            "expiresAt": time.time() + SIGNIN_LINK_SECS,
        }

        def add(data: dict) -> None:
            live = [
                old
                for old in data.get("links", [])
                if old["expiresAt"] > time.time()
            ]
            data["links"] = [*live[-9:], link]

        self.file.update(add)
        return secret

    def use_link(self, secret: str) -> bool:
        """Whether ``secret`` is a live link; it is spent either way."""
        digest = secret_hash(secret)
        now = time.time()

        def take(data: dict) -> bool:
            links = data.get("links", [])
            found = [
                k for k in links if hmac.compare_digest(k["sha256"], digest)
            ]
            data["links"] = [
                k for k in links if k not in found and k["expiresAt"] > now
            ]
            return any(k["expiresAt"] > now for k in found)

        return (
            bool(secret) and self.file.path.exists() and self.file.update(take)
        )

    def enabled(self) -> bool:
        """A password or a live link exists: OAuth and the pages are on."""
        try:
            data = self.file.read()
        except SmolError:
            return False
        links = data.get("links", [])
        return bool(data.get("password")) or any(
            k["expiresAt"] > time.time() for k in links
        )


class RecentEvents:
    """Recent events (failed sign-ins, registrations) by key (an address,
    or "*" for all), within SIGNIN_WINDOW_SECS, for ``keys`` keys at
    most. Room for a new key comes from keys whose window has passed,
    then from the key quiet the longest of those not locked: a locked
    key (as many events as its limit) stays until its window passes,
    however many keys come after it."""

    def __init__(self, keys: int):
        self.keys = keys
        # A key -> the times of its events in the window; its limit.
        self.times: dict[str, list[float]] = {}
        self.limits: dict[str, int] = {}

    def recent(self, key: str, now: float) -> list[float]:
        """The times of ``key``'s events still in the window; a key
        with none left is forgotten."""
        kept = [
            t for t in self.times.get(key, []) if now - t < SIGNIN_WINDOW_SECS
        ]
        if kept:
            self.times[key] = kept
        else:
            self.times.pop(key, None)
            self.limits.pop(key, None)
        return kept

    def wait_secs(self, key: str, limit: int) -> int:
        """How long ``key`` must wait before its next event, ``limit``
        of them being allowed in a window."""
        now = time.time()
        recent = self.recent(key, now)
        if len(recent) < limit:
            return 0
        return int(recent[-limit] + SIGNIN_WINDOW_SECS - now) + 1

    def add(self, key: str, when: float, limit: int) -> bool:
        """Count an event of ``key`` at ``when``; False, counting nothing,
        when there is no room for a new key (every key kept is locked)."""
        if key not in self.times and not self.make_room(when):
            return False
        times = self.times.setdefault(key, [])
        times.append(when)
        # The newest ``limit`` are all wait_secs reads.
        del times[:-limit]
        self.limits[key] = limit
        return True

    def make_room(self, now: float) -> bool:
        """Room for one more key, if need be by forgetting the key quiet
        the longest that is not locked; False when every key is locked."""
        if len(self.times) < self.keys:
            return True
        for key in list(self.times):
            self.recent(key, now)
        if len(self.times) < self.keys:
            return True
        unlocked = [
            key
            for key, times in self.times.items()
            if len(times) < self.limits[key]
        ]
        if not unlocked:
            return False
        quiet = min(unlocked, key=lambda key: self.times[key][-1])
        del self.times[quiet]
        del self.limits[quiet]
        return True

    def take_back(self, key: str, when: float) -> None:
        """Uncount the event of ``key`` at ``when``, if it is counted."""
        times = self.times.get(key, [])
        if when in times:
            times.remove(when)

    def clear(self) -> None:
        self.times.clear()
        self.limits.clear()


class Pages:
    """What the server's own pages share: who is signed in (sessions of
    this process, by an HttpOnly SameSite=Strict cookie), sign-in rate
    limits, CSRF tokens, and the page itself (page_html, page_headers)."""

    def __init__(self, state_dir: str | Path, issuer: str):
        self.operator = Operator(state_dir)
        self.issuer = issuer
        # The cookie's SHA-256 -> expires, csrf, how, who.
        self.sessions: dict[str, dict] = {}
        # Failed sign-ins by address, and "*" for all.
        self.failures = RecentEvents(SIGNIN_MAX_KEYS)
        # Client registrations by address: apart, so that registrations
        # never push a failed sign-in out.
        self.registrations = RecentEvents(SIGNIN_MAX_KEYS)
        # Addresses with a password check under way.
        self.checking: set[str] = set()
        # SIGNIN_CHECKS at once, made in the event loop.
        self.limiter: Any = None

    @staticmethod
    def who(request: Any) -> list:
        """The browser a session is bound to: a cookie replayed from
        another address or program (one an agent's published loopback port
        caught) is no session at all."""
        return [
            request.client.host if request.client else "",
            request.headers.get("user-agent"),
        ]

    def address(self, request: Any) -> str:
        """The address the sign-in and registration limits count a
        request under (an IPv6 /64 is one: see address_key)."""
        return address_key(self.who(request)[0])

    def session(self, request: Any) -> dict | None:
        """This browser's signed-in session; None if it has none, or one
        expired, of another browser, or of an earlier password."""
        cookie = request.cookies.get(SESSION_COOKIE)
        if not cookie:
            return None
        found = self.sessions.get(secret_hash(cookie))
        if (
            not found
            or found["expires"] < time.time()
            or found["who"] != self.who(request)
        ):
            return None
        if found["salt"] != self.operator.generation():
            return None
        return found

    def require_operator(self, request: Any) -> dict:
        """The signed-in operator's session, or a PageAnswer sending the
        browser to sign in and back here after it. Every handler of a page
        for the operator calls this first."""
        from starlette.responses import RedirectResponse

        session = self.session(request)
        if session is not None:
            return session
        query = f"?{request.url.query}" if request.url.query else ""
        target = back_to(request.url.path + query)
        signin = "/signin?" + urllib.parse.urlencode({"next": target})
        raise PageAnswer(RedirectResponse(signin, 303))

    def csrf(self, request: Any) -> str:
        """This browser's CSRF token: its session's, or before sign-in one
        kept in a cookie of its own (double submit). Every form carries it
        in a hidden field."""
        session = self.session(request)
        if session:
            return session["csrf"]
        return request.cookies.get(FORM_COOKIE, "")

    def csrf_input(self, request: Any) -> str:
        """The hidden field of the CSRF token; a browser without one gets
        a new one, the same for every form of the page, which page() sets
        as its form cookie."""
        token = self.csrf(request)
        if not token:
            token = getattr(request.state, "new_form_token", "")
        if not token:
            token = secrets_module.token_urlsafe(32)
            request.state.new_form_token = token
        return f'<input type="hidden" name="csrf" value="{esc(token)}">'

    def post_form(self, request: Any, action: str, fields: str) -> str:
        """A form posting ``fields`` to ``action`` (safe in HTML already),
        with the CSRF token."""
        return (
            f'<form method="post" action="{action}">'
            f"{self.csrf_input(request)}{fields}</form>"
        )

    async def form(self, request: Any) -> Any:
        """The posted form once its CSRF token matched, else a PageAnswer
        of 403."""
        form = await request.form()
        expected = self.csrf(request)
        sent = str(form.get("csrf", ""))
        if not expected or not hmac.compare_digest(sent, expected):
            refused = self.page(request, "Form refused", FORM_REFUSED, 403)
            raise PageAnswer(refused)
        return form

    def page(
        self,
        request: Any,
        title: str,
        body: str,
        status=200,
        form_to="",
        head="",
    ) -> Any:
        """A whole page around ``body`` (HTML built with esc() on every
        value): who is signed in with a Sign out button, the headers of
        page_headers (``form_to``: where a form's answer redirects)."""
        from starlette.responses import HTMLResponse

        who = ""
        if self.session(request):
            who = self.signed_in(request)
        text = page_html(title, body, who, head)
        headers = page_headers(form_to)
        response = HTMLResponse(text, status, headers=headers)
        if getattr(request.state, "new_form_token", None):
            self.cookie(response, FORM_COOKIE, request.state.new_form_token)
        return response

    def signed_in(self, request: Any) -> str:
        """The header's note of who is signed in, with its Sign out
        button."""
        return (
            '<form method="post" action="/signout">Signed in as the '
            f"operator of {esc(self.issuer)} {self.csrf_input(request)}"
            "<button>Sign out</button></form>"
        )

    def cookie(
        self, response: Any, name: str, value: str, **options: Any
    ) -> None:
        secure = self.issuer.startswith("https:")
        response.set_cookie(
            name,
            value,
            **options,
            httponly=True,
            samesite="strict",
            secure=secure,
        )

    async def check_password(
        self, request: Any, password: str
    ) -> tuple[int, str]:
        """(0, "") when ``password`` is the operator's, else an HTTP status
        and why not. A try counts as failed before scrypt runs (success
        takes it back), one check per address at a time and SIGNIN_CHECKS
        in all, so neither concurrency nor rotating addresses outrun it."""
        address = self.address(request)
        now = time.time()
        wait = max(
            self.failures.wait_secs(address, SIGNIN_TRIES),
            self.failures.wait_secs("*", SIGNIN_ALL_TRIES),
        )
        if wait or address in self.checking:
            return (
                429,
                f"Too many failed sign-ins from {address} or all: wait "
                f"{wait or 1} s.",
            )
        if not self.failures.add(address, now, SIGNIN_TRIES):
            return (
                429,
                "Too many addresses failed to sign in lately: wait a few "
                "minutes, or sign in with `smol_mcp.py operator link`.",
            )
        self.failures.add("*", now, SIGNIN_ALL_TRIES)
        if self.limiter is None:
            self.limiter = anyio.CapacityLimiter(SIGNIN_CHECKS)
        self.checking.add(address)
        try:
            right = await anyio.to_thread.run_sync(
                self.operator.check_password, password, limiter=self.limiter
            )
        finally:
            self.checking.discard(address)
        if not right:
            return (
                401,
                "That password is not right (`smol_mcp.py operator "
                "set-password` sets one).",
            )
        # Success takes the try back.
        for key in (address, "*"):
            self.failures.take_back(key, now)
        return 0, ""

    async def confirm(self, request: Any, form: Any) -> str:
        """Why the operator is not proven to be here for a wide change (a
        grant beyond Sandbox, a new token), or "" once proven: by this
        form's password, or without one by a link sign-in minutes ago."""
        if self.operator.generation() is not None:
            password = str(form.get("password", ""))
            _, why = await self.check_password(request, password)
            return why
        started = self.session(request)["started"]
        if time.time() - started < SIGNIN_FRESH_SECS:
            return ""
        return (
            "Sign in again with a new `smol_mcp.py operator link` first: "
            "wider grants need a sign-in of the last "
            f"{SIGNIN_FRESH_SECS // 60} minutes."
        )

    def confirm_field(self, what: str) -> str:
        """The password field of a form whose change confirm() checks."""
        if self.operator.generation() is None:
            return ""
        return f"<label>Password, for {what} <input {PASSWORD_ATTRS}></label>"

    def start_session(self, request: Any, response: Any, how: str) -> None:
        """Sign this browser in, ``how`` (password or one-time link): a
        session of its own, its cookie set on ``response``; past
        SIGNIN_MAX_SESSIONS the oldest is signed out."""
        cookie = secrets_module.token_urlsafe(32)
        now = time.time()
        self.sessions = {
            k: v for k, v in self.sessions.items() if v["expires"] > now
        }
        while len(self.sessions) >= SIGNIN_MAX_SESSIONS:
            oldest = min(
                self.sessions, key=lambda k: self.sessions[k]["expires"]
            )
            del self.sessions[oldest]
        self.sessions[secret_hash(cookie)] = {
            "expires": now + SIGNIN_SESSION_SECS,
            "csrf": secrets_module.token_urlsafe(32),
            "how": how,
            "who": self.who(request),
            "started": now,
            "salt": self.operator.generation(),
        }
        self.cookie(
            response, SESSION_COOKIE, cookie, max_age=SIGNIN_SESSION_SECS
        )


def oauth_issuer(config: Config, host: str, port: int) -> str | None:
    """The address the pages and OAuth name this server by: publicUrl,
    else the loopback address it is bound to; None off loopback (the name
    clients dial is not knowable here)."""
    if config.public_url:
        return config.public_url.rstrip("/")
    if host not in LOOPBACK_HOSTS:
        return None
    shown = "[::1]" if host == "::1" else host
    return f"http://{shown}:{port}"


def back_to(target: str) -> str:
    """Where to go after signing in: a path on this server, nowhere
    else."""
    if (
        target.startswith("/")
        and not target.startswith("//")
        and "\\" not in target
    ):
        return target
    return "/signin"


@functools.cache
def oauth_client_class() -> type:
    """The SDK's client record, with the redirect check of RFC 8252 7.3: a
    loopback redirect may come back on another port (a native app listens
    on whichever is free); others match exactly."""
    from mcp.shared.auth import OAuthClientInformationFull

    def but_port(uri: Any) -> tuple:
        return uri.scheme, uri.host, uri.path, uri.query

    class OAuthClient(OAuthClientInformationFull):
        def validate_redirect_uri(self, redirect_uri: Any) -> Any:
            loopback = (*LOOPBACK_HOSTS, "[::1]")
            if redirect_uri is not None and redirect_uri.host in loopback:
                registered = map(but_port, self.redirect_uris or [])
                if but_port(redirect_uri) in registered:
                    return redirect_uri
            return super().validate_redirect_uri(redirect_uri)

    return OAuthClient


# An app's own redirect scheme is a reverse domain name (com.example.app),
# so never one a browser or the system has (ws, blob, view-source, intent).
APP_SCHEME_RE = re.compile(r"[a-z][a-z0-9+-]*(\.[a-z0-9+-]+)+")
# The callbacks of MCP clients whose own scheme is not a reverse domain,
# taken exactly as their documentation gives them: Cursor registers this
# one beside its https and loopback ones, and a registration is refused
# whole if any of its URIs is. PKCE binds the code to the client that
# asked, as for any other app's scheme.
NATIVE_CLIENT_CALLBACKS = frozenset(
    {
        "cursor://anysphere.cursor-mcp/oauth/callback",
    }
)


def unsafe_redirect(uri: Any) -> bool:
    """Whether a redirect URI is refused: one over 512 characters, with a
    fragment, a wildcard or a user in it, or other than https, http on
    loopback, an app's own scheme (RFC 8252 7.1) or one of
    NATIVE_CLIENT_CALLBACKS exactly."""
    text = str(uri)
    if len(text) > 512 or "#" in text or uri.fragment is not None:
        return True
    if uri.username is not None or "*" in (uri.host or ""):
        return True
    if uri.scheme == "https":
        return not uri.host
    if uri.scheme == "http":
        return uri.host not in (*LOOPBACK_HOSTS, "[::1]")
    if text in NATIVE_CLIENT_CALLBACKS:
        return False
    return APP_SCHEME_RE.fullmatch(uri.scheme) is None


def registration_refusal(client_info: Any) -> tuple[str, str] | None:
    """The OAuth error and its description for a registration this server
    refuses, or None: it takes 1 to 8 redirect URIs, none unsafe_redirect,
    and a name of 100 characters at most, without control or format
    characters."""
    uris = client_info.redirect_uris or []
    unsafe = [str(uri) for uri in uris if unsafe_redirect(uri)]
    name = client_info.client_name or ""
    if (
        not unsafe
        and 1 <= len(uris) <= 8
        and len(name) <= 100
        and printable(name) == name
    ):
        return None
    error = "invalid_client_metadata"
    if unsafe:
        error = "invalid_redirect_uri"
    why = (
        "register 1 to 8 redirect URIs, each https, http on loopback or an "
        "app's own scheme named as a reverse domain (com.example.app:/cb), "
        "without a fragment, a wildcard or a user "
        f"(refused: {', '.join(unsafe) or 'none'}), and a name of 100 "
        "characters at most, without control or format characters"
    )
    return error, why


def rotate_grant(
    data: dict,
    grant_id: str,
    spent: str | None,
    access: str,
    refresh: str,
    now: float,
    scopes: list | None = None,
) -> dict | None:
    """In the tokens file's ``data``, give a grant the hashes of new
    ``access`` and ``refresh`` tokens, its earlier refresh tokens spent,
    the access token only ``scopes`` of the grant's when they are fewer;
    its record, or None when it was deleted, or ``spent`` was used already
    (by the client, or by whoever stole it)."""
    record = next(
        (r for r in data.get("tokens", []) if r.get("id") == grant_id), None
    )
    if record is None:
        return None
    refreshes = [kept["sha256"] for kept in record.get("refresh", [])]
    if spent is not None and secret_hash(spent) not in refreshes:
        return None
    record["spent"] = [*record.get("spent", [])[-31:], *refreshes]
    live = [
        kept for kept in record.get("access", []) if kept["expiresAt"] > now
    ][-3:]
    new_access = {
        "sha256": secret_hash(access),
        "expiresAt": now + OAUTH_ACCESS_SECS,
    }
    # A refresh that asks for less gets less (RFC 6749 section 6); the
    # refresh token keeps the whole grant.
    if scopes is not None and set(scopes) != set(record["scopes"]):
        new_access["scopes"] = [s for s in record["scopes"] if s in scopes]
    record["access"] = [*live, new_access]
    new_refresh = {
        "sha256": secret_hash(refresh),
        "expiresAt": now + OAUTH_REFRESH_SECS,
    }
    record["refresh"] = [new_refresh]
    return record


class OAuthProvider:
    """The SDK's OAuthAuthorizationServerProvider over the state directory:
    registered clients in a file of their own (OAUTH_MAX_CLIENTS at most),
    consent requests and codes in memory (minutes long), and each grant a
    named token whose record holds its client and the hashes of its access
    and refresh tokens, so `tokens delete` ends all of them at once."""

    def __init__(self, app: SmolMcp, issuer: str, resource: str):
        self.tokens = app.access.tokens
        self.activity = app.access.activity
        self.clients = StateFile(
            Path(app.access.state_dir) / OAUTH_CLIENTS_FILE, dict
        )
        self.issuer = issuer
        self.resource = resource
        # A consent request's id -> (client, params, expires, address).
        self.pending: dict[str, tuple] = {}
        # A code -> its AuthorizationCode (subject: the grant's id).
        self.codes: dict[str, Any] = {}
        # Codes exchanged already: a second use ends their grant.
        self.used: set[str] = set()

    async def get_client(self, client_id: str) -> Any:
        info = self.clients.read().get(client_id)
        if not info:
            return None
        return oauth_client_class().model_validate(info)

    async def register_client(self, client_info: Any) -> None:
        """Keep a registration that registration_refusal passes: what this
        server uses of it, its secret only as a hash, the address it came
        from; room made by make_room."""
        from mcp.server.auth.provider import RegistrationError

        refusal = registration_refusal(client_info)
        if refusal is not None:
            raise RegistrationError(*refusal)
        kept = client_info.model_dump(
            mode="json", exclude_none=True, include=OAUTH_CLIENT_FIELDS
        )
        # Only its hash: the token routes hash what is sent.
        if "client_secret" in kept:
            kept["client_secret"] = secret_hash(kept["client_secret"])
        address = OAUTH_CALLER.get()
        kept["registeredFrom"] = address

        def add(data: dict) -> bool:
            if not self.make_room(data, address):
                return False
            data[client_info.client_id] = kept
            return True

        # Raised out here: the SDK's frozen errors cannot pass through the
        # file lock's with.
        if not self.clients.update(add):
            why = (
                f"{OAUTH_MAX_CLIENTS} clients with grants are registered: "
                "the operator must delete one (`tokens delete NAME`) first"
            )
            raise RegistrationError("invalid_client_metadata", why)

    def make_room(self, data: dict, address: str) -> bool:
        """Room in ``data`` for a client from ``address``: past
        OAUTH_ADDRESS_CLIENTS without a grant from there, its own oldest
        goes; past OAUTH_MAX_CLIENTS, the oldest without a grant of the
        address holding most. False when all have grants."""
        spare = self.clients_without_grant(data)
        own = [c for c in spare if data[c].get("registeredFrom") == address]
        if len(own) >= OAUTH_ADDRESS_CLIENTS:
            del data[own[0]]
        elif len(data) >= OAUTH_MAX_CLIENTS:
            if not spare:
                return False
            kept = {c: data[c].get("registeredFrom") for c in spare}
            del data[oldest_of_most(kept)]
        return True

    def clients_without_grant(self, data: dict) -> list[str]:
        """The clients in ``data`` that no grant names, oldest first."""
        # A grant made a moment ago counts.
        self.tokens.file.expire()
        granted = {record.get("clientId") for record in self.tokens.records()}
        return [client_id for client_id in data if client_id not in granted]

    async def authorize(self, client: Any, params: Any) -> str:
        """Hold the request for the consent page, and send the browser
        there."""
        from mcp.server.auth.provider import AuthorizeError

        asked = params.resource
        if asked is not None and asked.rstrip("/") != self.resource:
            why = f"this server is the resource {self.resource}, not {asked}"
            raise AuthorizeError("invalid_target", why)
        now = time.time()
        address = OAUTH_CALLER.get()
        self.pending = {k: v for k, v in self.pending.items() if v[2] > now}
        # All but the client's newest few go, and the address's: a flood
        # from one place pushes out its own requests, never another's.
        same_client = client.client_id
        self.keep_newest(
            lambda held: held[0].client_id == same_client, OAUTH_CLIENT_PENDING
        )
        self.keep_newest(
            lambda held: held[3] == address, OAUTH_ADDRESS_PENDING
        )
        # Then the oldest of whoever holds most: a flood refuses no one.
        while len(self.pending) >= OAUTH_MAX_PENDING:
            askers = {k: v[3] for k, v in self.pending.items()}
            del self.pending[oldest_of_most(askers)]
        request_id = secrets_module.token_urlsafe(16)
        expires = now + SIGNIN_LINK_SECS
        self.pending[request_id] = (client, params, expires, address)
        return f"{self.issuer}/consent?request={request_id}"

    def keep_newest(self, mine: Callable, share: int) -> None:
        """Make room for one more of the pending requests ``mine`` picks:
        all but the newest ``share`` - 1 of them go."""
        picked = [k for k, held in self.pending.items() if mine(held)]
        for old in picked[: max(len(picked) - (share - 1), 0)]:
            del self.pending[old]

    def model(self, name: str, record: dict, **fields: Any) -> Any:
        """The SDK's ``name`` (AuthorizationCode, RefreshToken, AccessToken)
        of a grant."""
        from mcp.server.auth import provider

        mine = dict(
            client_id=record["clientId"],
            scopes=record["scopes"],
            subject=record["id"],
        )
        return getattr(provider, name)(
            **{**fields, **mine, "resource": self.resource}
        )

    def new_code(self, params: Any, record: dict) -> str:
        """A new authorization code for the grant ``record``."""
        code = secrets_module.token_urlsafe(32)
        now = time.time()
        self.codes = {
            k: v for k, v in self.codes.items() if v.expires_at > now
        }
        self.used &= self.codes.keys()
        fields = {
            "code": code,
            "expires_at": now + OAUTH_CODE_SECS,
            **params.model_dump(),
        }
        self.codes[code] = self.model("AuthorizationCode", record, **fields)
        return code

    async def load_authorization_code(self, client: Any, code: str) -> Any:
        found = self.codes.get(code)
        if found is None or found.client_id != client.client_id:
            return None
        # Replayed: whoever holds what it gave may be the thief.
        if code in self.used:
            return self.end_grant(
                found.subject, "its authorization code was used twice"
            )
        return found

    async def exchange_authorization_code(self, client: Any, code: Any) -> Any:
        self.used.add(code.code)
        return self.issue(code.subject, None)

    async def load_refresh_token(self, client: Any, token: str) -> Any:
        digest = secret_hash(token)
        mine = [
            r
            for r in self.tokens.records()
            if r.get("clientId") == client.client_id
        ]
        for record in mine:
            if digest in record.get("spent", []):
                return self.end_grant(
                    record["id"], "a spent refresh token was used again"
                )
            for kept in record.get("refresh", []):
                if hmac.compare_digest(kept["sha256"], digest):
                    expires = int(kept["expiresAt"])
                    return self.model(
                        "RefreshToken", record, token=token, expires_at=expires
                    )
        return None

    async def exchange_refresh_token(
        self, client: Any, refresh_token: Any, scopes: list
    ) -> Any:
        # The SDK refused scopes the refresh token lacks.
        return self.issue(refresh_token.subject, refresh_token.token, scopes)

    def issue(
        self, grant_id: str, spent: str | None, scopes: list | None = None
    ) -> Any:
        """New access and refresh tokens for a grant, only their hashes
        kept, the access token only ``scopes`` of it if given; ``spent``,
        the refresh token they replace, stops working."""
        from mcp.server.auth.provider import TokenError
        from mcp.shared.auth import OAuthToken

        access = new_token_secret()
        refresh = new_token_secret()
        rotate = functools.partial(
            rotate_grant,
            grant_id=grant_id,
            spent=spent,
            access=access,
            refresh=refresh,
            now=time.time(),
            scopes=scopes,
        )
        record = self.tokens.file.update(rotate)
        if record is None and spent is not None:
            self.end_grant(grant_id, "a spent refresh token was used again")
        if record is None:
            raise TokenError(
                "invalid_grant",
                "this grant was deleted, or the token used already",
            )
        granted = record["access"][-1].get("scopes", record["scopes"])
        return OAuthToken(
            access_token=access,
            refresh_token=refresh,
            expires_in=OAUTH_ACCESS_SECS,
            scope=" ".join(granted),
        )

    async def load_access_token(self, token: str) -> Any:
        record = self.tokens.match([token])
        if record is None or not record.get("clientId"):
            return None
        return self.model("AccessToken", record, token=token)

    async def revoke_token(self, token: Any) -> None:
        """A client that revokes a token ends its whole grant, as `tokens
        delete` does."""
        self.end_grant(token.subject, "")

    def end_grant(self, grant_id: str | None, why: str) -> None:
        """Delete the grant: its access and refresh tokens stop at once
        (OAuth 2.1 4.3.1)."""
        for record in self.tokens.records():
            if record.get("id") != grant_id:
                continue
            if not self.tokens.delete(record["name"]):
                continue
            entry = {
                "principal": record["name"],
                "event": "token",
                "outcome": "revoked",
            }
            if why:
                entry["reason"] = why
            self.activity.append(entry)


class SignInPages:
    """Signing in and out, with the operator's password or a one-time link,
    and the consent page, where the operator answers a client's OAuth
    request with a grant."""

    def __init__(self, pages: Pages, provider: OAuthProvider):
        self.pages = pages
        self.provider = provider

    def routes(self) -> list:
        from starlette.routing import Route

        return [
            Route("/signin", self.signin, methods=["GET", "POST"]),
            Route("/signout", self.signout, methods=["POST"]),
            Route("/consent", self.consent, methods=["GET", "POST"]),
        ]

    async def signin(self, request: Any) -> Any:
        """GET: the sign-in form (signed in already: on to ``next``);
        POST: sign in, then on to ``next``, or the form again with why
        not."""
        from starlette.responses import RedirectResponse

        target = back_to(request.query_params.get("next", "/signin"))
        if request.method != "GET":
            return await self.check_signin(request, target)
        if self.pages.session(request) is None:
            link = request.query_params.get("link", "")
            return self.signin_page(request, target, link)
        if target != "/signin":
            return RedirectResponse(target, 303)
        signed_in = "<p>You are signed in.</p>"
        return self.pages.page(request, "Signed in", signed_in)

    async def check_signin(self, request: Any, target: str) -> Any:
        """Sign in with the form's password or live link, then on to
        ``target``; else the sign-in page again, saying why not."""
        from starlette.responses import RedirectResponse

        form = await self.pages.form(request)
        link = str(form.get("link", ""))
        # A link is 256 random bits made on the host: never rate limited,
        # so it always works.
        if link:
            status = 0
            error = ""
            if not self.pages.operator.use_link(link):
                status = 401
                error = LINK_REFUSED
        else:
            password = str(form.get("password", ""))
            status, error = await self.pages.check_password(request, password)
        if status:
            return self.signin_page(request, target, link, status, error)
        response = RedirectResponse(target, 303)
        how = "one-time link" if link else "password"
        self.pages.start_session(request, response, how)
        return response

    def signin_page(
        self,
        request: Any,
        target: str,
        link: str,
        status: int = 200,
        error: str = "",
    ) -> Any:
        """The sign-in page: a password field, or a one-time ``link``'s
        hidden one; ``error``, why the last try failed."""
        shown = error_html(error) if error else ""
        head = ""
        if "hop" not in request.query_params and request.method == "GET":
            # A SameSite=Strict cookie is not sent along a chain of
            # redirects from another site (the client's): reloading from
            # this page sends it.
            again = "/signin?" + urllib.parse.urlencode(
                {**request.query_params, "hop": 1}
            )
            head = f'<meta http-equiv="refresh" content="0;url={esc(again)}">'
        field = (
            f"<label>Password <input {PASSWORD_ATTRS} required autofocus>"
            "</label>"
        )
        if link:
            field = (
                f'<input type="hidden" name="link" value="{esc(link)}">'
                "<p>Sign in with the one-time link made by "
                "<code>operator link</code> on the host.</p>"
            )
        url = "/signin?" + urllib.parse.urlencode({"next": target})
        fields = f'{field}<button type="submit">Sign in</button>'
        form = self.pages.post_form(request, esc(url), fields)
        body = (
            f'{shown}{form}<p class="note">No password yet? On the host: '
            "<code>smol_mcp.py operator set-password</code>, or "
            "<code>smol_mcp.py operator link</code> for a one-time link.</p>"
        )
        return self.pages.page(request, "Sign in", body, status, head=head)

    async def signout(self, request: Any) -> Any:
        from starlette.responses import RedirectResponse

        await self.pages.form(request)
        cookie = request.cookies.get(SESSION_COOKIE, "")
        self.pages.sessions.pop(secret_hash(cookie), None)
        response = RedirectResponse("/signin?hop=1", 303)
        response.delete_cookie(
            SESSION_COOKIE, httponly=True, samesite="strict"
        )
        return response

    async def consent(self, request: Any) -> Any:
        """GET: what a client asks for, and the grants to choose from;
        POST: the operator's answer, sent back to the client (or the page
        again, with what was wrong)."""
        self.pages.require_operator(request)
        request_id = request.query_params.get("request", "")
        held = self.provider.pending.get(request_id)
        if request.method == "POST":
            # Taken before any await: a flood of /authorize meanwhile
            # cannot push it out, nor a second answer use it again.
            held = self.provider.pending.pop(request_id, None)
        if held is None or held[2] < time.time():
            return self.pages.page(
                request, "No such request", CONSENT_GONE, 404
            )
        client, params, _, _ = held
        client_name = client.client_name or client.client_id
        chosen = {"grant": "Sandbox", "name": "", "approval": ""}
        error = ""
        if request.method == "POST":
            answered = None
            try:
                answered, error = await self.answer(request, held, chosen)
            finally:
                # Not answered (the form was wrong): held again, in the
                # table as it is now (authorize() makes a new one).
                if answered is None:
                    self.provider.pending[request_id] = held
            if answered is not None:
                return answered
        body = self.consent_form(
            request, request_id, client_name, params, chosen, error
        )
        status = 400 if error else 200
        title = f"Connect {client_name}?"
        target = urllib.parse.urlsplit(str(params.redirect_uri))
        form_to = redirect_source(target)
        return self.pages.page(request, title, body, status, form_to)

    async def answer(
        self, request: Any, held: tuple, chosen: dict
    ) -> tuple[Any, str]:
        """The operator's answer to the consent request ``held``: (the
        redirect back to its client, "") once answered, with Deny or with
        Allow and a code; else (None, why not), ``chosen`` as the form
        had it."""
        client, params, _, _ = held
        form = await self.pages.form(request)
        if form.get("action") != "Allow":
            denied = redirect_back(
                params,
                error="access_denied",
                error_description="the operator said no",
            )
            return denied, ""
        chosen.update({key: str(form.get(key, "")) for key in chosen})
        try:
            record = await self.grant(request, form, client, chosen)
        except ConfigError as err:
            return None, error_html(err)
        granted = {
            "principal": "operator",
            "token": record["name"],
            "event": "token",
            "outcome": "granted",
            "client": client.client_name or client.client_id,
        }
        self.provider.activity.append(granted)
        code = self.provider.new_code(params, record)
        return redirect_back(params, code=code), ""

    async def grant(
        self, request: Any, form: Any, client: Any, chosen: dict
    ) -> dict:
        """The named token the consent form makes, its record; a
        ConfigError when no scope is chosen, the name is taken or wrong, or
        a grant beyond Sandbox lacks the operator's confirmation."""
        ticked = form.getlist("scope")
        scopes = GRANTS.get(chosen["grant"]) or tuple(
            s for s in SCOPES if s in ticked
        )
        if not scopes:
            raise ConfigError(
                "Tick at least one scope, or pick another grant."
            )
        if not set(scopes) <= set(GRANTS["Sandbox"]):
            why = await self.pages.confirm(request, form)
            if why:
                raise ConfigError(why)
        approval = "changes" if chosen["approval"] else "none"
        owner = {
            "client": client.client_name or client.client_id,
            "clientId": client.client_id,
        }
        record, _ = self.provider.tokens.create(
            chosen["name"].strip(), scopes, tuple(FLEETS), approval, **owner
        )
        return record

    def consent_form(
        self,
        request: Any,
        request_id: str,
        client_name: str,
        params: Any,
        chosen: dict,
        error: str,
    ) -> str:
        """The consent page's body: who asks, returning where, for what;
        the grants, the scopes to choose, the token's name."""
        target = urllib.parse.urlsplit(str(params.redirect_uri))
        taken = {r["name"] for r in self.provider.tokens.records()}
        free = free_token_name(client_name, taken | set(RESERVED_TOKEN_NAMES))
        grants = "".join(
            grant_choice(grant, note, grant == chosen["grant"])
            for grant, note in GRANT_NOTES.items()
        )
        scopes = "".join(checkbox_html("scope", scope) for scope in SCOPES)
        approval = checkbox_html(
            "approval",
            "on",
            "Require approval for changes",
            bool(chosen["approval"]),
        )
        fields = (
            f"<fieldset><legend>Grant</legend>{grants}<fieldset>"
            "<legend>Scopes, with Choose scopes</legend>"
            f"{scopes}</fieldset></fieldset>"
            '<label>Token name <input type="text" name="name" '
            f'maxlength="64" required value="{esc(chosen["name"] or free)}">'
            f"</label>{approval}"
            f"{self.pages.confirm_field('a grant beyond Sandbox')}"
            '<p><button type="submit" name="action" value="Allow">Allow'
            '</button> <button type="submit" name="action" value="Deny" '
            "formnovalidate>Deny</button></p>"
        )
        asked = " ".join(params.scopes or []) or "nothing in particular"
        action = f"/consent?request={esc(request_id)}"
        return (
            f"{error}<p><strong>{esc(client_name)}</strong>, returning to "
            f"{redirect_shown(target)}, asks to use the machines "
            f"of this server (it asked for: {esc(asked)}).</p>"
            f"{self.pages.post_form(request, action, fields)}"
        )


def oldest_of_most(owners: dict) -> str:
    """Of ``owners`` (a key -> its owner, oldest key first), the oldest
    key of the owner holding the most keys."""
    counts: dict = {}
    for owner in owners.values():
        counts[owner] = counts.get(owner, 0) + 1
    most = max(counts.values())
    return next(key for key, owner in owners.items() if counts[owner] == most)


def grant_choice(grant: str, note: str, checked: bool) -> str:
    """One of the consent page's grants, a radio button with its note."""
    mark = " checked" if checked else ""
    return (
        f'<label><input type="radio" name="grant" value="{esc(grant)}"'
        f'{mark}> {esc(grant)} <span class="note">({esc(note)})</span>'
        "</label>"
    )


def free_token_name(client_name: str, taken: set) -> str:
    """A name for a client's grant: its own, made a token name, with -2,
    -3 and so on after it if that is taken."""
    base = re.sub(r"[^A-Za-z0-9._-]+", "-", client_name).strip("-._")[:56]
    base = base or "client"
    names = (base, *(f"{base}-{i}" for i in range(2, 999)))
    return next(name for name in names if name not in taken)


def redirect_shown(target: Any) -> str:
    """Where a redirect URI (split) returns, as the consent page says it
    (HTML): the host of an http(s) one; an app's own scheme named as a
    scheme, so github.com:/cb never reads as the site github.com."""
    if target.scheme in ("http", "https"):
        return f"<strong>{esc(target.hostname)}</strong>"
    return (
        "the app that opens links of the scheme "
        f"<strong>{esc(target.scheme)}:</strong>"
    )


def redirect_source(target: Any) -> str:
    """The CSP source of a redirect URI (split): where the consent form's
    answer goes, scheme://host[:port], or scheme: for an app's own."""
    if target.netloc:
        return f"{target.scheme}://{target.netloc}"
    return f"{target.scheme}:"


def redirect_back(params: Any, **answer: str) -> Any:
    """The browser sent back to the client's redirect URI with ``answer``
    (a code, or an error) and the client's state."""
    from mcp.server.auth.provider import construct_redirect_uri
    from starlette.responses import RedirectResponse

    url = construct_redirect_uri(
        str(params.redirect_uri), state=params.state, **answer
    )
    return RedirectResponse(url, 303)


class OAuthEndpoints:
    """The SDK's OAuth routes on OAuthProvider (its metadata, /authorize,
    and /token, /register and /revoke behind screen()), and the protected
    resource's metadata (RFC 9728)."""

    def __init__(self, pages: Pages, provider: OAuthProvider):
        self.pages = pages
        self.provider = provider

    def routes(self) -> list:
        from mcp.server.auth.routes import (
            create_auth_routes,
            create_protected_resource_routes,
        )
        from mcp.server.auth.settings import (
            ClientRegistrationOptions,
            RevocationOptions,
        )
        from pydantic import AnyHttpUrl
        from starlette.routing import Route

        scopes = list(SCOPES)
        issuer = AnyHttpUrl(self.provider.issuer)
        resource_url = AnyHttpUrl(self.provider.resource)
        clients = ClientRegistrationOptions(
            enabled=True, valid_scopes=scopes, default_scopes=scopes
        )
        revocation = RevocationOptions(enabled=True)
        routes = create_auth_routes(
            self.provider, issuer, None, clients, revocation
        )
        resource = create_protected_resource_routes(
            resource_url, [issuer], scopes, "smol-mcp"
        )
        # RFC 9728's place for the resource metadata, and the root some
        # clients look at first.
        root = Route(
            RESOURCE_METADATA, resource[0].endpoint, methods=["GET", "OPTIONS"]
        )
        return [*map(self.screened, routes), *resource, root]

    def screened(self, route: Any) -> Any:
        """The SDK's /authorize, /token, /register or /revoke behind
        screen(); its other routes as they are."""
        from starlette.routing import Route

        if route.path not in OAUTH_PATHS:
            return route
        screen = functools.partial(self.screen, route=route)
        return Route(route.path, screen, methods=route.methods)

    async def screen(self, request: Any, route: Any) -> Any:
        """Before the SDK's OAuth routes: the caller's address made known
        to the provider (OAUTH_CALLER); a registration rate limited per
        address; a `resource` other than this server refused (RFC 8707);
        the client's secret hashed, as only its hash is kept. A refusal,
        or the SDK's route on what it gets."""
        OAUTH_CALLER.set(self.pages.address(request))
        body = await request.body()
        headers = request.scope["headers"]
        path = request.url.path
        if request.method == "POST" and path == "/register":
            refusal = self.registration_limit(request)
            if refusal is not None:
                return refusal
        elif request.method == "POST" and path != "/authorize":
            form = dict(urllib.parse.parse_qsl(body.decode(errors="replace")))
            asked = form.get("resource", self.provider.resource)
            if asked.rstrip("/") != self.provider.resource:
                why = (
                    f"this server is the resource {self.provider.resource}, "
                    f"not {form['resource']}"
                )
                return oauth_error("invalid_target", why, 400)
            authorization = request.headers.get("authorization", "")
            body, headers = hash_client_secret(form, headers, authorization)
        scope = {**request.scope, "headers": headers}
        return lambda _, receive, send: route.app(
            scope, replay_body(body, receive), send
        )

    def registration_limit(self, request: Any) -> Any:
        """A 429 past OAUTH_REGISTRATIONS from one address in a window (or
        with every address kept locked); None when it may go on (it
        counts, then). HttpGate kept the body within
        OAUTH_MAX_REGISTRATION_BYTES."""
        key = self.pages.address(request)
        counts = self.pages.registrations
        wait = counts.wait_secs(key, OAUTH_REGISTRATIONS)
        if wait:
            why = (
                f"{OAUTH_REGISTRATIONS} registrations from this address: "
                f"wait {wait} s"
            )
            return oauth_error("invalid_client_metadata", why, 429)
        if not counts.add(key, time.time(), OAUTH_REGISTRATIONS):
            why = (
                "too many addresses registered clients lately: wait a few "
                "minutes"
            )
            return oauth_error("invalid_client_metadata", why, 429)
        return None


def oauth_error(error: str, why: str, status: int) -> Any:
    """An OAuth error answer: ``error`` and its description."""
    from starlette.responses import JSONResponse

    answer = {"error": error, "error_description": why}
    return JSONResponse(answer, status)


def hash_client_secret(
    form: dict, headers: list, authorization: str
) -> tuple[bytes, list]:
    """A token route's form and headers with the client's secret (in the
    form, or in ``authorization`` if Basic) replaced by its hash: the body,
    and the headers with that authorization and the new content-length."""
    if "client_secret" in form:
        form["client_secret"] = secret_hash(form["client_secret"])
    body = urllib.parse.urlencode(form).encode()
    new = {}
    if authorization[:6].lower() == "basic ":
        new[b"authorization"] = hashed_basic(authorization)
    new[b"content-length"] = str(len(body)).encode()
    kept = [(k, v) for k, v in headers if k not in new]
    return body, [*kept, *new.items()]


def hashed_basic(authorization: str) -> bytes:
    """A Basic authorization header with its secret replaced by the
    secret's hash."""
    try:
        decoded = base64.b64decode(authorization[6:]).decode()
    except ValueError:
        decoded = ""
    who, _, secret = decoded.partition(":")
    hashed = f"{who}:{secret_hash(urllib.parse.unquote(secret))}"
    return b"Basic " + base64.b64encode(hashed.encode())


# ---------------------------------------------------------------------------
# 15. Command line
# ---------------------------------------------------------------------------

SETUP_CLIENTS = (
    "claude-code",
    "claude-desktop",
    "cursor",
    "opencode",
    "codex",
)


def invocation() -> str:
    """Return the command the user ran this program as.

    That is `smol-mcp`, or `uv run` or `python3` followed by a file.
    """
    if not sys.argv or not sys.argv[0].endswith(".py"):
        return "smol-mcp"
    runner = "uv run" if os.environ.get("UV") else "python3"
    return f"{runner} {shlex.quote(sys.argv[0])}"


# The text after --help's options; each setting's variable comes from its
# declaration, the fleets from FLEETS (help_epilog). Each line of the
# output starts a line here.
HELP_EPILOG = (
    "environment (each also a camelCase key in"
    " ~/.config/smol-mcp/config.json):\n"
    "  {smolvm:<28}the smolvm binary (default: smolvm on PATH, else the\n"
    "                              smol/smol-vmm of an installed"
    " smolmachines package)\n"
    "  {local_url:<28}use a running serve (unix:///abs.sock) instead of"
    " starting one\n"
    "  {targets:<28}auto | {fleets} | both, or a list such as {pair}\n"
    "                              (auto: every fleet that is set up;"
    " doctor says which)\n"
    "  {cloud_token:<28}the smol cloud account key (a secret: never copied"
    " anywhere)\n"
    "  {network_default:<28}blocked | open: egress of a machine when a call"
    " says nothing\n"
    "  {reply_tokens:<28}the most a tool result may cost a model, in tokens"
    " ({tokens_default})\n"
    "  {auth_token:<28}required by --http: the token clients send as a"
    " Bearer\n"
    "  {trusted_proxies:<28}--http behind a reverse proxy: its addresses"
    " (off)\n"
    "  SMOLVM_VM_UID_DROP=off      read by smolvm itself: needed as root"
    " with /dev/kvm at mode 0600\n"
    "  SMOL_MCP_CONFIG             another config file; the README has"
    " every setting\n"
    "\n"
    "examples:\n"
    "  smol-mcp doctor                        what works on this host, and"
    " what to do if not\n"
    "  smol-mcp doctor --probe                create, start, run true in"
    " and delete a machine\n"
    "  smol-mcp setup claude-code --write     add the server to this"
    " project's .mcp.json\n"
    "  smol-mcp operator set-password         let --http clients connect"
    " by URL (OAuth, a consent page)\n"
    "  SMOL_MCP_AUTH_TOKEN=$(openssl rand -hex 16) smol-mcp --http"
    " --port 8080\n"
)


def help_epilog() -> str:
    """Return the text after --help's options, naming every fleet."""
    values = {
        "tokens_default": Config.reply_tokens,
        "fleets": " | ".join(FLEETS),
        "pair": ",".join(list(FLEETS)[:2]),
    }
    return HELP_EPILOG.format_map({s.attr: s.env for s in SETTINGS} | values)


def parse_args(argv: list[str]) -> argparse.Namespace:
    """Return the parsed command line; exit with a usage error if wrong."""
    parser = argparse.ArgumentParser(
        prog=invocation(),
        description=(
            "An MCP server that gives an AI agent microVMs (smol machines)"
            " to work in. Serves MCP over stdio by default."
        ),
        epilog=help_epilog().replace("smol-mcp ", invocation() + " "),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_main_options(parser)
    helpers = parser.add_subparsers(dest="command")
    add_doctor_parser(helpers)
    add_setup_parser(helpers)
    add_parity_parser(helpers)
    token_commands = add_tokens_parser(helpers)
    add_activity_parser(helpers)
    approval_commands = add_approvals_parser(helpers)
    add_operator_parser(helpers)
    # usage and errors list them
    for commands in (helpers, token_commands, approval_commands):
        commands.metavar = "{" + ",".join(commands.choices) + "}"
    args = parser.parse_args(argv)
    check_usage(parser, args)
    return args


def add_flag(command: argparse.ArgumentParser, name: str, text: str) -> None:
    """Add an option that is off unless given."""
    command.add_argument(name, action="store_true", help=text)


def add_json_flag(
    command: argparse.ArgumentParser, what: str = "a JSON array"
) -> None:
    """Add --json, which prints ``what`` instead of text for a person."""
    add_flag(command, "--json", f"print {what}, for scripts")


def add_main_options(parser: argparse.ArgumentParser) -> None:
    """Add --version, and --http with the options that go with it."""
    parser.add_argument(
        "--version", action="version", version=f"smol-mcp {__version__}"
    )
    add_flag(parser, "--http", "serve Streamable HTTP instead of stdio")
    parser.add_argument(
        "--host", help="with --http: address to bind (default 127.0.0.1)"
    )
    parser.add_argument(
        "--port", type=int, help="with --http: port (default 8080)"
    )
    parser.add_argument(
        "--path", help="with --http: endpoint path (default /mcp)"
    )


def add_doctor_parser(helpers) -> None:
    """Add `doctor [--probe]` to the subcommands ``helpers``."""
    text = "say whether each fleet works on this host, and what to do if not"
    doctor = helpers.add_parser("doctor", help=text)
    probe = (
        "also create, start, run `true` in and delete a throwaway local"
        " machine"
    )
    add_flag(doctor, "--probe", probe)


def add_setup_parser(helpers) -> None:
    """Add `setup CLIENT` and its options."""
    text = "print (or --write) the configuration for an MCP client"
    setup = helpers.add_parser("setup", help=text)
    setup.add_argument("client", choices=SETUP_CLIENTS)
    write = "merge it into the client's config file (backup first)"
    add_flag(setup, "--write", write)
    add_flag(setup, "--force", "with --write: replace an existing smol entry")
    url = (
        "an entry for a smol-mcp --http server at URL instead of a local"
        " stdio one"
    )
    setup.add_argument("--http", dest="http_url", metavar="URL", help=url)
    oauth = (
        "with --http: an entry without a secret; the client signs in"
        " through the browser"
    )
    add_flag(setup, "--oauth", oauth)


def add_parity_parser(helpers) -> None:
    """Add `parity`."""
    text = (
        "compare the routes this server calls with the running serve's OpenAPI"
    )
    helpers.add_parser("parity", help=text)


def add_tokens_parser(helpers):
    """Add `tokens` and its commands; return those (usage lists them)."""
    text = "create, list and delete the named tokens of --http"
    tokens = helpers.add_parser("tokens", help=text)
    commands = tokens.add_subparsers(dest="tokens_command", required=True)
    add_token_create_parser(commands)
    listing = commands.add_parser(
        "list", help="show every token, never a secret"
    )
    add_json_flag(listing)
    text = "cut a token off; a running server refuses it at once"
    commands.add_parser("delete", help=text).add_argument("name")
    text = (
        "end a token's auto-approval (`approvals approve --auto-for` starts"
        " one)"
    )
    auto = commands.add_parser("auto-approve", help=text)
    auto.add_argument("name", help="a token name, or stdio")
    auto.add_argument("state", choices=("off",))
    return commands


def add_token_create_parser(commands) -> None:
    """Add `tokens create NAME` and its options."""
    create = commands.add_parser(
        "create", help="make a token; its secret is shown once"
    )
    create.add_argument(
        "name",
        help="a name that says which agent holds it, such as laptop-claude",
    )
    chosen = create.add_mutually_exclusive_group()
    chosen.add_argument(
        "--scopes", help=f"comma-separated, from: {', '.join(SCOPES)}"
    )
    presets = "; ".join(
        f"{name}: {scopes}" for name, scopes in SCOPE_PRESETS.items()
    )
    chosen.add_argument("--preset", choices=SCOPE_PRESETS, help=presets)
    fleets = f"the fleets it may use: {fleets_accepted()} (default both)"
    create.add_argument("--targets", help=fleets)
    changes = (
        "changes: changing calls wait for a person (recorded with the token)"
    )
    create.add_argument(
        "--approval", choices=APPROVAL_MODES, default="none", help=changes
    )
    client = "also print that client's entry for it"
    create.add_argument("--client", choices=SETUP_CLIENTS, help=client)
    url = "the server URL for --client (default: httpHost, httpPort, httpPath)"
    create.add_argument("--url", help=url)
    add_json_flag(create, "one JSON object")


def add_activity_parser(helpers) -> None:
    """Add `activity` and its filters."""
    activity = helpers.add_parser(
        "activity", help="show what agents changed (the activity log)"
    )
    activity.add_argument(
        "--token", help="only this principal (a token name, or stdio)"
    )
    activity.add_argument("--machine", help="only entries about this machine")
    activity.add_argument(
        "--since", help="only the last period, such as 15m, 1h or 7d"
    )
    add_json_flag(activity)
    activity.add_argument(
        "--limit",
        type=int,
        default=ACTIVITY_RESOURCE_ENTRIES,
        help="the latest N entries",
    )


def add_approvals_parser(helpers):
    """Add `approvals` and its commands; return those (usage lists them)."""
    approvals = helpers.add_parser(
        "approvals", help="list, approve and deny calls that wait"
    )
    commands = approvals.add_subparsers(
        dest="approvals_command", required=True
    )
    listing = commands.add_parser(
        "list", help="the calls that wait for a person"
    )
    add_json_flag(listing)
    approve = commands.add_parser("approve", help="let a waiting call run")
    approve.add_argument("id")
    auto_for = (
        "also let this token run changing tools without asking for this long"
    )
    approve.add_argument(
        "--auto-for", choices=tuple(AUTO_APPROVE_PERIODS), help=auto_for
    )
    add_flag(approve, "--yes", "with --auto-for: release the rest")
    deny = commands.add_parser(
        "deny", help="refuse a waiting call; nothing runs"
    )
    deny.add_argument("id")
    deny.add_argument(
        "--reason",
        default="",
        help="told to the agent and kept in the activity log",
    )
    return commands


def add_operator_parser(helpers) -> None:
    """Add `operator set-password|link`."""
    text = (
        "the person who signs in to the pages of --http and consents to"
        " clients"
    )
    operator = helpers.add_parser("operator", help=text)
    password = (
        "set-password: read a password from stdin (no echo at a terminal)"
    )
    link = "link: print a one-time sign-in URL, good for 10 minutes"
    operator.add_argument(
        "operator_command",
        choices=("set-password", "link"),
        help=f"{password}; {link}",
    )


def check_usage(
    parser: argparse.ArgumentParser, args: argparse.Namespace
) -> None:
    """Exit through parser.error when options do not go together."""
    # "is not None": --port 0 and --host "" are given too.
    given = [args.host, args.port, args.path]
    if (args.command or not args.http) and given != [None] * 3:
        parser.error("--host, --port and --path go with --http")
    if args.command == "setup" and args.oauth and not args.http_url:
        parser.error("setup --oauth goes with --http URL")
    if args.path is not None and not args.path.startswith("/"):
        parser.error(f"--path must start with '/', got {args.path!r}")
    if args.port is not None and not 1 <= args.port <= 65535:
        parser.error(f"--port must be between 1 and 65535, got {args.port}")
    url = args.command == "setup" and args.http_url
    if url and not url.startswith(("http://", "https://")):
        example = "http://b.local:8080/mcp"
        parser.error(
            f"setup --http takes the server's URL, such as {example};"
            f" got {url!r}"
        )


# -- doctor ------------------------------------------------------------------
# The directories an installed package lives in (pip's, uv's).
PACKAGE_DIRS = ("site-packages", "dist-packages")


def is_installed(path: Path) -> bool:
    """Return whether ``path`` lies in an installed package's directory."""
    return any(part in PACKAGE_DIRS for part in path.parts)


def engine_get_command(here: Path, prefix: str) -> str:
    """Return how to add the engine wheel the way this server was installed.

    ``here`` is this file, ``prefix`` the sys.prefix of its Python.
    """
    if not is_installed(here):
        return f"uv run --with smolmachines==1.32.2 {here} doctor"
    if "/uv/tools/" in prefix + "/":
        return (
            "uv tool install --force --with smolmachines==1.32.2 smol-mcp"
            "  # or your source"
        )
    python = Path(prefix) / "bin" / "python"
    return f"{python} -m pip install smolmachines==1.32.2"


# What doctor prints when there is no engine: commands a person copies
# whole, each printed on one line however the source splits it.
ENGINE_ON_RAMP = (
    "  get an engine (smolvm 1.32.2 is the smol/smol-vmm binary inside the"
    " smolmachines wheel):\n"
    "    {get}\n"
    "        (then run the server the same way, or let `setup` carry the"
    " engine's path into the entry)\n"
    "  or unpack the wheel once and point SMOLVM at it:\n"
    "    python3 -m pip download --no-deps smolmachines==1.32.2"
    " -d /tmp/smolmachines-wheel\n"
    "    python3 -m zipfile -e"
    " /tmp/smolmachines-wheel/smolmachines-1.32.2-*.whl"
    " ~/.local/share/smolmachines\n"
    "    chmod +x ~/.local/share/smolmachines/smol/smol-vmm\n"
    "    export SMOLVM=~/.local/share/smolmachines/smol/smol-vmm"
)


def doctor(app: SmolMcp, probe: bool = False) -> int:
    """Print smol://targets for a person; return 0 if served fleets work.

    With ``probe``, also take a throwaway local machine through its life
    (probe_local): what it found outranks the checks.
    """
    document = targets_document(app)
    mode = f"mode {document['mode']} (SMOL_MCP_TARGETS={app.config.targets})"
    print(f"smol-mcp {__version__}: {mode}")
    # whether each served fleet is usable
    usable = {}
    for name, facts in document["fleets"].items():
        if not facts["served"]:
            print(f"\n{name}: not served ({facts['reason']})")
            continue
        print_fleet_report(app, name, facts)
        usable[name] = facts["usable"]
    if probe:
        local = app.local.name
        if local not in app.fleets:
            unserved = f"the {local} fleet is not served (SMOL_MCP_TARGETS)"
            print(f"\nprobe: {unserved}, so there is nothing to probe")
            return 1
        # a machine that ran outranks the checks above
        usable[local] = probe_local(app, document["fleets"][local])
    print(f"\ntokens: {tokens_file_report(app.config)}")
    print(f"oauth: {oauth_report(app.config)}")
    return 0 if all(usable.values()) else 1


def print_fleet_report(app: SmolMcp, name: str, facts: dict) -> None:
    """Print what doctor found about one served fleet, then its advice."""
    details, advice = FLEETS[name].doctor_report(app, facts)
    verdict = "usable" if facts["usable"] else "NOT USABLE"
    print(f"\n{name}: {verdict}")
    for line in details:
        print(f"  {line}")
    if facts["reason"]:
        heading = "note" if facts["usable"] else "to do"
        print(f"  {heading}: {facts['reason']}")
    for line in advice:
        print(line)


def probe_local(app: SmolMcp, facts: dict) -> bool:
    """Take a throwaway local machine through its life; return if it ran.

    The probe creates, starts, runs `true` in and deletes a machine: what
    the host does, not just what it allows. ``facts`` are the checks'
    findings for the local fleet, quoted when the probe contradicts them.
    """
    probe = LocalProbe(app)
    print(
        f"\nprobe: machine {probe.name} (no image, no network;"
        " deleted at the end)"
    )
    ok = probe.run()
    doubt = ""
    if ok and not facts["usable"]:
        doubt = f" (the check above said NOT USABLE: {facts['reason']})"
    can = "can" if ok else "cannot"
    print(
        f"  result: the {probe.fleet.name} fleet {can} run machines"
        f" here{doubt}"
    )
    return ok


# What each step of the probe does, said as it starts.
PROBE_STEPS = {
    "serve": "reaching smolvm serve (starting it if need be)",
    "create": "creating the machine",
    "start": "booting it (a first boot can take a minute)",
    "ready": "waiting until its guest runs a command",
    "run": "running true in it",
    "delete": "deleting it",
}
# On a terminal, a step still under way says so this often.
PROBE_NOTE_SECS = 5


class LocalProbe:
    """A throwaway machine on the local fleet, taken a step at a time."""

    def __init__(self, app: SmolMcp, terminal: bool | None = None):
        self.fleet = app.local
        self.config = app.config
        prefix = self.config.machine_prefix
        self.name = f"{prefix}probe-{secrets_module.token_hex(3)}"
        self.created = False
        # Notes while a step waits go to a person at a terminal only.
        if terminal is None:
            terminal = sys.stdout.isatty()
        self.terminal = terminal

    def run(self) -> bool:
        """Take each step, printing how it went; return if all worked.

        The machine is deleted at the end if it was made, or perhaps made
        (Ctrl-C mid-create), whatever happened to the steps.
        """
        fleet = self.fleet
        ok = False
        interrupted = False
        fleet.acquire()
        try:
            ok = self.step("serve", fleet.ensure_serve)
            self.created = ok and self.step("create", self.create)
            ok = self.created and self.step("start", self.start)
            ok = ok and self.step("ready", self.wait_ready)
            ok = ok and self.step("run", self.run_true)
        except KeyboardInterrupt:
            # Ctrl-C: perhaps mid-create, so the machine may exist
            interrupted = True
            raise
        finally:
            if self.created or interrupted:
                ok = self.step("delete", self.delete) and ok
            fleet.release()
        return ok

    def step(self, label: str, action: Callable[[], Any]) -> bool:
        """Run one step, saying what it does as it starts, and its time
        when it ends; return False if it failed."""
        print(f"  {label:<8} {PROBE_STEPS[label]}", flush=True)
        started = time.monotonic()
        try:
            with self.waiting_notes(label, started):
                action()
        except SmolError as err:
            text = self.failure_text(err)
            took = time.monotonic() - started
            print(f"  {label:<8} FAILED after {took:.1f} s: {text}")
            return False
        print(f"  {label:<8} ok in {time.monotonic() - started:.1f} s")
        return True

    @contextmanager
    def waiting_notes(self, label: str, started: float) -> Iterator[None]:
        """On a terminal, print a note every PROBE_NOTE_SECS while the
        body runs; elsewhere (a log, a pipe) nothing."""
        if not self.terminal:
            yield
            return
        done = threading.Event()

        def note() -> None:
            while not done.wait(PROBE_NOTE_SECS):
                waited = time.monotonic() - started
                print(
                    f"  {label:<8} still waiting after {waited:.0f} s",
                    flush=True,
                )

        ticker = threading.Thread(target=note, daemon=True)
        ticker.start()
        try:
            yield
        finally:
            done.set()
            ticker.join()

    def failure_text(self, err: SmolError) -> str:
        """Return why a step failed, quoting the boot log if it failed to boot.

        The log is read now: the machine is deleted at the end.
        """
        lines = None
        if is_boot_failure(err):
            try:
                lines = self.fleet.console_lines(self.name)[-BOOT_LOG_LINES:]
            except SmolError:
                lines = []
        explained = explain_start_failure(err, "blocked", lines)
        return redact(str(explained), self.config.secret_values())

    def create(self) -> None:
        """Create the machine: no image, no network."""
        machine = {
            "name": self.name,
            "cpus": 1,
            "memoryMb": 512,
            "network": False,
        }
        what = f"create machine '{self.name}'"
        self.fleet.request(what, "POST", "/api/v1/machines", machine)

    def start(self) -> None:
        self.fleet.start_machine(self.name)

    def wait_ready(self) -> None:
        """Wait until the guest runs a command; raise SmolError if too late."""
        limit = self.config.ready_timeout_secs
        deadline = time.monotonic() + limit
        while (answer := self.fleet.probe_ready(self.name)) is not None:
            if time.monotonic() > deadline:
                late = (
                    f"the guest did not run a command within {limit} s"
                    " (readyTimeoutSecs)"
                )
                raise SmolError(f"{late}; its last answer: {answer}")
            time.sleep(0.5)

    def run_true(self) -> None:
        """Run `true` in the guest; raise SmolError if it exits non-zero."""
        result = self.fleet.exec(self.name, ["true"], timeout_secs=30)
        if result.exit_code != 0:
            stderr = result.stderr.decode("utf-8", "replace")
            raise SmolError(f"`true` exited with {result.exit_code}: {stderr}")

    def delete(self) -> None:
        """Delete the machine; a 404 is fine if it was never made."""
        try:
            self.fleet.delete_machine(self.name)
        except ApiError as err:
            # not found, and not created: interrupted before it was made
            if self.created or err.status != 404:
                raise


# -- setup -------------------------------------------------------------------
def launch_command() -> list[str]:
    """Return the client's command, absolute: GUIs lack the shell's PATH.

    That is the installed `smol-mcp` script, else `uv run --script` this
    file, else this Python running it.
    """
    here = Path(__file__).resolve()
    if is_installed(here):
        # beside this Python, it works without the environment activated
        script = Path(sys.executable).parent / "smol-mcp"
        if not script.exists():
            script = shutil.which("smol-mcp")
        if script:
            return [str(Path(script).absolute())]
    if uv := shutil.which("uv"):
        return [str(Path(uv).absolute()), "run", "--script", str(here)]
    return [str(Path(sys.executable).absolute()), str(here)]


# Referenced in an entry, never copied (project files get committed); a
# webhook URL is a secret.
SECRET_ENVS = (
    "SMOL_CLOUD_TOKEN",
    "SMOL_MCP_AUTH_TOKEN",
    "SMOL_MCP_APPROVAL_WEBHOOK",
)
# Read by smolvm itself, not by smol-mcp.
ENGINE_ENVS = ("SMOLVM_VM_UID_DROP", "SMOLVM_LIB_DIR")


def entry_environment(
    environ: dict[str, str],
) -> tuple[dict[str, str], list[str]]:
    """Return a stdio entry's env, and the names of the secrets set here.

    The env holds the settings made here, so that doctor's checks hold
    for the client too; a secret is named, never copied.
    """
    env = {
        s.env: environ[s.env]
        for s in SETTINGS
        if s.env in environ and s.env not in SECRET_ENVS
    }
    env.update(
        {name: environ[name] for name in ENGINE_ENVS if name in environ}
    )
    # perhaps found through XDG_CONFIG_HOME, which a client may lack
    config_file = config_file_path(environ)
    if config_file.exists():
        env["SMOL_MCP_CONFIG"] = str(config_file.absolute())
    if not environ.get("SMOL_LOCAL_URL"):
        engine = engine_path(environ)
        if engine:
            env["SMOLVM"] = engine
    return env, [name for name in SECRET_ENVS if environ.get(name)]


def engine_path(environ: dict[str, str]) -> str | None:
    """Return the absolute path of the smolvm a server would run, or None."""
    configured = environ.get("SMOLVM", Config.smolvm)
    if os.sep in configured:
        found = configured
    else:
        found = shutil.which(configured, path=environ.get("PATH"))
    if found is None and configured == Config.smolvm:
        found = wheel_engine()
    if not found:
        return None
    return str(Path(found).absolute())


def codex_timeouts(config: Config) -> dict[str, int]:
    """Return an entry's timeouts for Codex, in seconds.

    Codex allows 10 s to start and 60 s a call: too short for a first
    `uv run`, a create or a command.
    """
    longest = (
        config.serve_start_timeout_secs
        + config.ready_timeout_secs
        + config.max_exec_timeout_secs
        + 60
    )
    return {"startup_timeout_sec": 60, "tool_timeout_sec": longest}


def secret_reference(client: str, name: str) -> str | None:
    """Return how the client's config names an environment variable.

    None for Claude Desktop, which cannot.
    """
    form = {
        "claude-code": "${NAME}",
        "cursor": "${env:NAME}",
        "opencode": "{env:NAME}",
    }.get(client)
    return form and form.replace("NAME", name)


def client_entry(
    client: str, http_url: str | None, config: Config
) -> tuple[str, dict]:
    """Return (top-level key, server entry) in the client's shape.

    A secret is referenced in the client's own syntax, never copied.
    """
    if http_url:
        return http_entry(client, http_url, config)
    command = launch_command()
    env, secrets = entry_environment(os.environ)
    if (
        "SMOLVM" in env
        and env["SMOLVM"] == wheel_engine()
        and command[1:3] == ["run", "--script"]
    ):
        # uv's environment of the moment may be pruned; the client's
        # `uv run` brings the wheel back
        version = importlib.metadata.version("smolmachines")
        command[2:2] = ["--with", f"smolmachines=={version}"]
        del env["SMOLVM"]
    for name in secrets:
        reference = secret_reference(client, name)
        if reference:
            env[name] = reference
    if client == "opencode":
        entry = {"type": "local", "command": command, "enabled": True}
        if env:
            entry["environment"] = env
        return "mcp", entry
    entry = {"command": command[0], "args": command[1:]}
    key = "mcpServers"
    if client == "codex":
        key = "mcp_servers"
        entry.update(codex_timeouts(config))
        # Codex forwards env_vars from its own environment
        if secrets:
            entry["env_vars"] = secrets
    if env:
        entry["env"] = env
    return key, entry


def http_entry(
    client: str, url: str, config: Config, variable="SMOL_MCP_AUTH_TOKEN"
) -> tuple:
    """Return (top-level key, entry) for a smol-mcp --http server at ``url``.

    ``variable`` is the environment variable that holds the token.
    """
    header = {"Authorization": f"Bearer {secret_reference(client, variable)}"}
    if client == "opencode":
        entry = {
            "type": "remote",
            "url": url,
            "enabled": True,
            "headers": header,
        }
        return "mcp", entry
    if client == "codex":
        entry = {
            "url": url,
            "bearer_token_env_var": variable,
            **codex_timeouts(config),
        }
        return "mcp_servers", entry
    if client == "claude-desktop":
        return "mcpServers", desktop_bridge_entry(url, variable)
    return "mcpServers", {"type": "http", "url": url, "headers": header}


def desktop_bridge_entry(url: str, variable: str) -> dict:
    """Return Claude Desktop's entry for an HTTP server: a stdio bridge.

    Claude Desktop speaks stdio only, so a pinned npm bridge carries HTTP
    (npx runs what it fetches). It has no shell environment either: npx
    is absolute, node is found beside it, the token is pasted in by hand.
    """
    npx = shutil.which("npx")
    command = "npx"
    path = {}
    if npx:
        command = str(Path(npx).absolute())
        path = {"PATH": f"{Path(npx).parent}:/usr/local/bin:/usr/bin:/bin"}
    header = "Authorization:${AUTH_HEADER}"
    return {
        "command": command,
        "args": ["-y", "mcp-remote@0.15.1", url, "--header", header],
        "env": {
            "AUTH_HEADER": f"Bearer <paste the {variable} value here>",
            **path,
        },
    }


def client_config_path(client: str) -> tuple[Path, str]:
    """Return where the client reads its entry, and whose file that is.

    The second item is "project" or "user".
    """
    home = Path.home()
    here = Path.cwd()
    if client == "claude-code":
        return here / ".mcp.json", "project"
    if client == "cursor":
        return here / ".cursor" / "mcp.json", "project"
    if client == "opencode":
        plain = here / "opencode.json"
        commented = here / "opencode.jsonc"
        if commented.exists() and not plain.exists():
            return commented, "project"
        return plain, "project"
    if client == "codex":
        codex_home = os.environ.get("CODEX_HOME") or home / ".codex"
        return Path(codex_home) / "config.toml", "user"
    # Claude Desktop: macOS's place for it, elsewhere the XDG directory
    if sys.platform == "darwin":
        support = home / "Library" / "Application Support"
    else:
        support = Path(os.environ.get("XDG_CONFIG_HOME") or home / ".config")
    return support / "Claude" / "claude_desktop_config.json", "user"


def toml_value(value: Any) -> str:
    """Return ``value`` as TOML, for the types an entry holds.

    json.dumps writes a bool, an int and a string as TOML does; any other
    type raises TypeError.
    """
    if isinstance(value, (bool, int, str)):
        return json.dumps(value)
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(item) for item in value) + "]"
    if isinstance(value, dict):
        pairs = ", ".join(
            f"{toml_key(k)} = {toml_value(v)}" for k, v in value.items()
        )
        return "{ " + pairs + " }"
    raise TypeError(type(value).__name__)


def toml_key(key: str) -> str:
    """Return ``key`` as TOML writes it: bare if it can be, else quoted."""
    if re.fullmatch(r"[A-Za-z0-9_-]+", key):
        return key
    return json.dumps(key)


def toml_table(name: str, fields: dict) -> str:
    """Return the TOML table [name] holding ``fields``."""
    lines = [f"{toml_key(k)} = {toml_value(v)}\n" for k, v in fields.items()]
    return f"[{name}]\n" + "".join(lines)


def render_entry(client: str, key: str, entry: dict) -> str:
    """Return the entry as the client's config file holds it, under key."""
    if client == "codex":
        return toml_table(f"{key}.smol", entry)
    document = {key: {"smol": entry}}
    if client == "opencode":
        document = {"$schema": "https://opencode.ai/config.json", **document}
    return json.dumps(document, indent=2) + "\n"


def one_liner(client: str, entry: dict) -> str | None:
    """Return the client's own command that adds the same entry, or None."""
    # `codex mcp add` cannot set the timeouts or env_vars an entry needs
    if client == "codex":
        return f"{invocation()} setup codex --write"
    add = ["claude", "mcp", "add"]
    if client == "claude-code" and "url" in entry and "headers" not in entry:
        return shlex.join([*add, "--transport", "http", "smol", entry["url"]])
    if client != "claude-code" or "command" not in entry:
        return None
    env = entry.get("env", {}).items()
    flags = [part for name, value in env for part in ("-e", f"{name}={value}")]
    argv = [entry["command"], *entry["args"]]
    command = [*add, "--scope", "project", *flags, "smol", "--", *argv]
    return shlex.join(command)


def back_up(path: Path, state_dir: str) -> Path:
    """Copy ``path`` into the state directory ``state_dir`` (stateDir);
    return the copy's path.

    Not beside the file: beside a project file, a copy would be read or
    committed.
    """
    # The copy may hold a secret: the state directory's checks apply.
    backups = ensure_state_dir(state_dir) / "backups"
    backups.mkdir(mode=0o700, exist_ok=True)
    flat = str(path.absolute()).strip("/").replace("/", "%")
    backup = backups / f"{flat}.{time.strftime('%Y%m%dT%H%M%S')}"
    shutil.copy2(path, backup)
    return backup


BY_HAND = "fix it, or paste the entry by hand"
FORCE = "run again with --force to replace it"


def merge_json(
    path: Path, text: str, key: str, entry: dict, client: str, force: bool
) -> tuple:
    """Return (``text`` with the smol entry merged, whether it replaced one).

    Raise SmolError when the file is not plain JSON, has another shape,
    has a smol entry already (unless ``force``), or would not read back.
    """
    try:
        existing = json.loads(text) if text.strip() else {}
    except ValueError as err:
        raise not_plain_json(path, text, err) from None
    if not isinstance(existing, dict) or not isinstance(
        existing.get(key, {}), dict
    ):
        shape = f'a JSON object with an object under "{key}"'
        raise SmolError(f"{path} does not hold {shape}; {BY_HAND}")
    replacing = "smol" in existing.get(key, {})
    if replacing and not force:
        raise SmolError(
            f'{path} already has a "smol" entry under "{key}"; {FORCE}'
        )
    existing.setdefault(key, {})["smol"] = entry
    if client == "opencode":
        existing.setdefault("$schema", "https://opencode.ai/config.json")
    # in the file's own indentation
    found = re.search(r"\n([ \t]+)\S", text)
    indent = found.group(1) if found else 2
    merged = json.dumps(existing, indent=indent) + "\n"
    if json.loads(merged)[key]["smol"] != entry:
        raise SmolError(
            f"the merged {path} did not read back as written;"
            " nothing was written"
        )
    return merged, replacing


def not_plain_json(path: Path, text: str, err: ValueError) -> SmolError:
    """Return the error for a file json.loads refused: JSONC, or broken.

    JSONC (// and /* */ comments, trailing commas) parses once those are
    taken out; rewriting it would drop them. A broken file does not.
    """
    # group 1 is a string, kept; the rest is a comment, dropped
    comment = r'("(?:\\.|[^"\\])*"?)|//[^\n]*|/\*.*?(?:\*/|\Z)'
    plain = re.sub(
        comment, lambda match: match.group(1) or "", text, flags=re.S
    )
    try:
        json.loads(re.sub(r",(\s*[}\]])", r"\1", plain))
    except ValueError:
        return SmolError(f"{path} does not parse as JSON ({err}); {BY_HAND}")
    why = (
        f"{path} has comments or trailing commas (JSONC); rewriting it"
        " would drop them"
    )
    fix = "paste the entry printed by `setup` without --write into it by hand"
    return SmolError(f"{why}, so {fix}")


def merge_toml(
    path: Path, text: str, key: str, entry: dict, client: str, force: bool
) -> tuple:
    """Return (``text`` with [key.smol] appended, whether it replaced one).

    Every other setting is kept. Raise SmolError when the file is not
    TOML, has [key.smol] already (unless ``force``), or the result would
    not read back with every setting as it was. tomllib is imported
    here: only `setup --write` reads TOML.
    """
    import tomllib

    try:
        existing = tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        raise SmolError(
            f"{path} is not valid TOML ({err}); {BY_HAND}"
        ) from None
    text = inline_as_tables(text, key, existing)
    replacing = "smol" in existing.get(key, {})
    if replacing:
        if not force:
            raise SmolError(f"{path} already has [{key}.smol]; {FORCE}")
        text = without_smol_table(text, key)
    parts = [text]
    if text and not text.endswith("\n"):
        parts.append("\n")
    # a blank line before the new table
    if text.strip():
        parts.append("\n")
    parts.append(render_entry(client, key, entry))
    merged = "".join(parts)
    if not toml_reads_back(merged, existing, key, entry):
        raise SmolError(
            f"appending [{key}.smol] to {path} would not give valid TOML"
            " with every other setting kept (for example when"
            f" {key} is written as an inline table, {key} = {{...}});"
            " nothing was written: paste the entry printed by `setup`"
            " without --write by hand"
        )
    return merged, replacing


def inline_as_tables(text: str, key: str, existing: dict) -> str:
    """Return ``text`` with an inline `key = {...}` written as tables.

    An inline table takes no [key.smol] after it, so its servers become
    [key.NAME] tables (the smol one is left to the merge). ``text`` comes
    back as it was when there is none, or when a value is of a type
    toml_value does not write (the merge's check then refuses it).
    """
    lines = text.splitlines(keepends=True)
    top = next(
        (i for i, line in enumerate(lines) if line.lstrip().startswith("[")),
        len(lines),
    )
    inline = [
        i for i in range(top) if re.match(rf'\s*("?){key}\1\s*=', lines[i])
    ]
    if not inline or not isinstance(existing.get(key), dict):
        return text
    del lines[inline[0]]
    servers = [
        (name, server)
        for name, server in existing[key].items()
        if name != "smol"
    ]
    try:
        tables = [
            toml_table(f"{key}.{toml_key(name)}", server)
            for name, server in servers
        ]
    except TypeError:
        return text
    return "".join(lines).rstrip("\n") + "\n\n" + "\n".join(tables)


def without_smol_table(text: str, key: str) -> str:
    """Return ``text`` without its [key.smol] table and that one's tables."""
    header = (
        rf'\s*\[\s*("?){key}\1\s*\.\s*("?)smol\2\s*(\.[^\]]*)?\]\s*(#.*)?$'
    )
    kept = []
    skipping = False
    for line in text.splitlines(keepends=True):
        # a table header starts or ends the smol table
        if line.lstrip().startswith("["):
            skipping = bool(re.match(header, line))
        if not skipping:
            kept.append(line)
    return "".join(kept)


def toml_reads_back(merged: str, existing: dict, key: str, entry: dict):
    """Return whether ``merged`` holds ``existing`` and the entry, exactly."""
    import tomllib

    expected = {**existing, key: {**existing.get(key, {}), "smol": entry}}
    try:
        return tomllib.loads(merged) == expected
    except tomllib.TOMLDecodeError:
        return False


CONNECTOR_STEPS = (
    "# claude-desktop connects to a URL through its Connectors, not a file:\n"
    "#   1. Settings > Connectors > Add custom connector\n"
    "#   2. Name: smol    Remote MCP server URL: {url}\n"
    "#   3. Add, then Connect: a browser opens this server's sign-in and"
    " consent pages; Allow.\n"
    "# Claude connects from Anthropic's servers: the URL must be https and"
    " reachable from the\n"
    "# internet (run --http behind TLS, with publicUrl set to that address)."
)


def setup(args: Any, config: Config) -> int:
    """Print the client's entry, or merge it into its file (--write).

    Before writing, the file is backed up, and both it and the result
    must parse. Advice goes to stderr: stdout stays pastable as it is.
    """
    client = args.client
    if args.oauth and client == "claude-desktop":
        print(CONNECTOR_STEPS.format(url=args.http_url))
        return 0
    key, entry = client_entry(client, args.http_url, config)
    if args.oauth:
        # the client signs in through the browser: the entry holds no secret
        unsent = ("headers", "bearer_token_env_var")
        entry = {k: v for k, v in entry.items() if k not in unsent}
    path, scope = client_config_path(client)
    command = one_liner(client, entry)
    if args.oauth and client == "codex":
        login = "# then sign in once with: codex mcp login smol"
        print(login, file=sys.stderr)
    if client == "claude-desktop" and not args.http_url:
        warn_of_secrets_by_hand()
    if not args.write:
        where = f"# {client}: add this to {path} (the {scope} file)"
        print(where, file=sys.stderr)
        if command:
            print(f"# or run: {command}", file=sys.stderr)
        print(render_entry(client, key, entry), end="")
        return 0
    if write_entry(args, path, key, entry, config.state_dir):
        done = "replaced the smol entry in"
    else:
        done = "wrote the smol entry into"
    print(f"{done} {path} (the {scope} file {client} reads)")
    # Codex's one-liner is this very command
    if command and client != "codex":
        print(f"(the same with the client's own command: {command})")
    return 0


def warn_of_secrets_by_hand() -> None:
    """Name the secrets set here, which a Claude Desktop entry cannot hold."""
    held = entry_environment(os.environ)[1]
    if held:
        hint = (
            f"add {', '.join(held)} to the entry's env by hand"
            " (secrets are not copied for you)"
        )
        print(
            f"# claude-desktop reads no environment: {hint}", file=sys.stderr
        )


def write_entry(
    args: Any, path: Path, key: str, entry: dict, state_dir: str
) -> bool:
    """Merge the entry into ``path``, backed up into ``state_dir``; return
    if it replaced one."""
    try:
        text = path.read_text() if path.exists() else ""
    except OSError as err:
        raise SmolError(str(err)) from None
    merge = merge_toml if args.client == "codex" else merge_json
    merged, replacing = merge(path, text, key, entry, args.client, args.force)
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists():
        print(f"backed up {path} to {back_up(path, state_dir)}")
    path.write_text(merged)
    return replacing


# -- tokens ------------------------------------------------------------------
def token_entry(
    client: str, url: str, config: Config, name: str, secret: str
) -> str:
    """Return a new token's entry for ``client``, as text for a person.

    The text says where the entry goes and how the client gets the secret.
    """
    variable = "SMOL_MCP_TOKEN_" + re.sub(r"[^A-Za-z0-9]", "_", name).upper()
    key, entry = http_entry(client, url, config, variable)
    where = client_config_path(client)[0]
    if secret_reference(client, variable) or client == "codex":
        how = (
            f"and give the client the secret as {variable}:\n"
            f"#   export {variable}='{secret}'"
        )
    else:
        # it reads no environment: the value goes into the entry itself
        how = (
            "with the secret pasted in place of"
            f" <paste the {variable} value here>:"
        )
    heading = f"# {client}: add this to {where}, {how}\n"
    return heading + render_entry(client, key, entry)


def tokens_command(args: Any, config: Config) -> int:
    """tokens create / list / delete / auto-approve: the tokens of --http.

    They are kept in the state directory.
    """
    store = TokenStore(config.state_dir)
    if args.tokens_command == "create":
        return create_token(args, config, store)
    auto = AutoApprovals(config.state_dir)
    if args.tokens_command == "auto-approve":
        return end_auto_approval(args, config, auto)
    if args.tokens_command == "list":
        return list_tokens(args, store, auto)
    return delete_token(args, config, store)


def create_token(args: Any, config: Config, store: TokenStore) -> int:
    """tokens create: make a token and print its secret, this once."""
    if not args.scopes and not args.preset:
        presets = "; ".join(
            f"--preset {name} ({s})" for name, s in SCOPE_PRESETS.items()
        )
        raise ArgumentError(
            f"say what the token may do: --scopes LIST, or {presets}"
        )
    scopes = parse_scopes(args.scopes or SCOPE_PRESETS[args.preset])
    record, secret = store.create(
        args.name, scopes, parse_targets(args.targets), args.approval
    )
    granted = {key: record[key] for key in ("scopes", "targets", "approval")}
    created = {"event": "token", "outcome": "created", "token": record["name"]}
    cli_record(config, {**created, **granted})
    if args.json:
        shown = {"name": record["name"], "secret": secret, **granted}
        print(json.dumps(shown))
        return 0
    scope_names = ", ".join(record["scopes"])
    fleet_names = ", ".join(record["targets"])
    allowed = (
        f"scopes {scope_names}; fleets {fleet_names};"
        f" approval {record['approval']}"
    )
    print(f"created token '{record['name']}': {allowed}")
    print(f"secret (shown this once; only its hash is kept): {secret}")
    if args.client:
        address = f"{config.http_host}:{config.http_port}"
        url = args.url or f"http://{address}{config.http_path}"
        entry = token_entry(args.client, url, config, record["name"], secret)
        print("\n" + entry, end="")
    return 0


def end_auto_approval(args: Any, config: Config, auto: AutoApprovals) -> int:
    """tokens auto-approve NAME off: its changing calls wait again."""
    if not auto.end(args.name):
        print(
            f"smol-mcp: {args.name!r} has no auto-approval; nothing changed",
            file=sys.stderr,
        )
        return 1
    ended = {
        "event": "approval",
        "approval": "auto-approval ended",
        "token": args.name,
    }
    cli_record(config, ended)
    print(
        f"auto-approval of {args.name!r} is off: its changing calls wait for"
        " a person again"
    )
    return 0


# The table of `tokens list`; CLIENT is an OAuth grant's, by its
# registered name.
TOKEN_COLUMNS = (
    "NAME",
    "SCOPES",
    "FLEETS",
    "APPROVAL",
    "AUTO-APPROVE",
    "CLIENT",
    "CREATED",
    "LAST USED",
)


def list_tokens(args: Any, store: TokenStore, auto: AutoApprovals) -> int:
    """tokens list: every token, as a table or JSON, never a secret."""
    records = store.records()
    used = store.last_used()
    listed = [token_summary(record, auto, used) for record in records]
    if args.json:
        print(json.dumps(listed))
        return 0
    if not records:
        create = "smol_mcp.py tokens create NAME --scopes LIST"
        print(
            f"no tokens yet (create one with: {create});"
            f" file {store.file.path}"
        )
        return 0
    rows = [TOKEN_COLUMNS]
    for record, shown in zip(records, listed):
        rows.append(
            (
                record["name"],
                ",".join(record["scopes"]),
                ",".join(record["targets"]),
                record["approval"],
                shown["autoApprove"],
                record.get("client", "-"),
                record.get("createdAt", "-"),
                used.get(record["name"], "never"),
            )
        )
    print_table(rows)
    return 0


def token_summary(record: dict, auto: AutoApprovals, used: dict) -> dict:
    """Return a token as `tokens list --json` shows it: never its secret."""
    name = record["name"]
    keys = ("name", "scopes", "targets", "approval")
    summary = {key: record[key] for key in keys}
    summary["autoApprove"] = auto.shown(name, record.get("id", ""))
    summary["client"] = record.get("client")
    summary["lastUsed"] = used.get(name)
    return summary


def delete_token(args: Any, config: Config, store: TokenStore) -> int:
    """tokens delete NAME: a running server refuses it within a second."""
    if not store.delete(args.name):
        names = ", ".join(r["name"] for r in store.records()) or "none"
        unknown = (
            f"there is no token named {args.name!r} (the tokens: {names})"
        )
        print(f"smol-mcp: {unknown}", file=sys.stderr)
        return 1
    deleted = {"event": "token", "outcome": "deleted", "token": args.name}
    cli_record(config, deleted)
    ends = "ends its sessions (their ephemeral machines are deleted)"
    print(
        f"deleted token '{args.name}': a running server refuses it within a"
        f" second and {ends}"
    )
    return 0


def operator_command(args: Any, config: Config) -> int:
    """operator set-password / link: how the operator signs in to --http."""
    operator = Operator(config.state_dir)
    if args.operator_command == "link":
        issuer = oauth_issuer(config, config.http_host, config.http_port)
        if issuer is None:
            why = "so the address a browser reaches it at is not knowable here"
            fix = "set publicUrl (SMOL_MCP_PUBLIC_URL) to it"
            raise ConfigError(f"--http is bound off loopback, {why}: {fix}")
        print(f"{issuer}/signin?link={operator.new_link()}")
        elsewhere = "for a server on another address keep the path and query"
        print(f"(good for 10 minutes, once; {elsewhere})", file=sys.stderr)
        return 0
    operator.set_password(read_password())
    cli_record(config, {"event": "operator", "outcome": "password set"})
    print(
        f"operator password set (scrypt hash in {operator.file.path});"
        " sign in at /signin"
    )
    return 0


def read_password() -> str:
    """Return a new password: typed twice at a terminal, else stdin's line.

    Raise ConfigError when the two typed differ.
    """
    if not sys.stdin.isatty():
        return sys.stdin.readline().rstrip("\r\n")
    password = getpass.getpass("operator password: ")
    if getpass.getpass("again: ") != password:
        raise ConfigError("the two passwords differ; nothing changed")
    return password


def cli_record(config: Config, entry: dict, who: dict | None = None) -> None:
    """Log an entry made by the OS user at the terminal, or by ``who``.

    ``who`` is the console's operator. A log that cannot be written is
    a warning, not a failure.
    """
    try:
        who = who or {"principal": "cli", "user": os_user()}
        ActivityLog(config.state_dir).append({**who, **entry})
    except (OSError, SmolError) as err:
        print(
            f"smol-mcp: warning: could not write the activity log ({err})",
            file=sys.stderr,
        )


# -- activity and approvals --------------------------------------------------
def printable(text: Any) -> str:
    """Return ``text`` with control and format characters escaped.

    ESC, newline and bidi controls in a value cannot forge rows then.
    """
    return "".join(
        ch if ch.isprintable() else ascii(ch)[1:-1] for ch in str(text)
    )


def print_table(
    rows: list[tuple], after: Callable[[int], None] = lambda index: None
) -> None:
    """Print rows in aligned columns, escaped; ``after(i)`` follows row i."""
    rows = [tuple(printable(cell) for cell in row) for row in rows]
    widths = [
        max(len(str(row[i])) for row in rows) for i in range(len(rows[0]))
    ]
    for index, row in enumerate(rows):
        cells = (str(cell).ljust(width) for cell, width in zip(row, widths))
        print("  ".join(cells).rstrip())
        after(index)


def activity_command(args: Any, config: Config) -> int:
    """activity: the log for a person (a table) or a script (--json)."""
    since = None
    if args.since:
        try:
            since = parse_period(args.since)
        except ValueError as err:
            raise ConfigError(f"--since: {err}") from None
    log_file = ActivityLog(config.state_dir)
    wanted = activity_filter(args.token, args.machine, since)
    entries = log_file.entries(wanted, args.limit)
    if args.json:
        print(json.dumps(entries))
    elif not entries:
        filtered = args.token or args.machine or since
        matching = " that matches" if filtered else ""
        print(f"no activity recorded{matching} (log: {log_file.path})")
    else:
        header = ("TIME", "WHO", "WHAT", "MACHINE", "OUTCOME")
        print_table([header, *map(activity_row, entries)])
        if len(entries) == args.limit:
            print(f"(the latest {args.limit} entries; --limit N shows more)")
    return 0


def activity_row(entry: dict) -> tuple:
    """Return an activity entry as a person reads it, in a table's row.

    The `activity` table and the console show it so.
    """
    what, outcome = activity_what(entry)
    return (
        entry.get("time", "?"),
        activity_who(entry),
        what,
        entry.get("machine") or "-",
        outcome[:100],
    )


def activity_who(entry: dict) -> str:
    """Return who made an activity entry: principal, OS user, channel."""
    parts = [entry.get("principal", "?")]
    if entry.get("user"):
        parts.append(f"({entry['user']})")
    if entry.get("via"):
        parts.append(f"via {entry['via']}")
    return " ".join(parts)


def activity_what(entry: dict) -> tuple[str, str]:
    """Return (what was done, how it ended) for an activity entry."""
    event = entry.get("event")
    if event == "approval":
        subject = entry.get("tool") or entry.get("token", "")
        what = f"approval {entry.get('approval', '?')} {subject}"
        said = [
            f"{key} {entry[key]}" for key in ("id", "by") if entry.get(key)
        ]
        notes = (*said, entry.get("reason", ""), entry.get("error", ""))
        return what, " ".join(filter(None, notes))
    if event == "token":
        return f"token {entry.get('outcome')}", entry.get("token", "")
    parts = [str(entry.get("outcome", ""))]
    if "exitCode" in entry:
        parts.append(f" (exit {entry['exitCode']})")
    if entry.get("approvedBy"):
        parts.append(f", approved by {entry['approvedBy']}")
    return entry.get("tool") or entry.get("event", "?"), "".join(parts)


def print_waiting(shown: list[dict]) -> None:
    """Print waiting calls, a row each, then each argument on its own line."""
    rows = [("ID", "TOKEN", "TOOL", "MACHINE", "TIME LEFT")]
    for r in shown:
        left = time_left(r["expiresAt"])
        rows.append(
            (r["id"], r["token"], r["tool"], r["machine"] or "-", left)
        )

    def arguments(index: int) -> None:
        # row 0 is the header, row i the call shown[i - 1]
        if index:
            print_arguments(shown[index - 1].get("arguments") or {})

    print_table(rows, arguments)


def time_left(expires_at: Any) -> str:
    """Return the seconds until ``expires_at`` for a person, or "?"."""
    left = seconds_left(expires_at)
    if left is None:
        return "?"
    return f"{left} s"


def print_arguments(arguments: dict) -> None:
    """Print a waiting call's arguments, one a line, escaped.

    A value cut short in the request is shown as its head and digest.
    """
    for key, value in arguments.items():
        if isinstance(value, dict) and set(value) == {
            "cut",
            "bytes",
            "sha256",
        }:
            value = (
                f"{value['cut']}... ({value['bytes']} bytes,"
                f" sha256 {value['sha256']})"
            )
        if not isinstance(value, str):
            value = json.dumps(value, ensure_ascii=False)
        print(f"    {printable(key)}: {printable(value)}")


def approvals_command(args: Any, config: Config) -> int:
    """approvals list / approve / deny: answer waiting calls, from the host."""
    if args.approvals_command == "list":
        return list_approvals(args, config)
    approve = args.approvals_command == "approve"
    auto_for = None
    if approve:
        auto_for = args.auto_for
    if auto_for:
        # it releases the token's other waiting calls: show them first
        others = others_waiting(config, args.id)
        if others and not args.yes:
            print_waiting(others)
            print(
                f"\n--auto-for also lets these {len(others)} calls run;"
                " add --yes to go on"
            )
            return 1
    reason = getattr(args, "reason", "")
    request, until = answer_approval(
        config, args.id, approve, None, auto_for, reason
    )
    token = request.get("token")
    call = f"{args.id}: {request.get('tool')} by {token}"
    if approve:
        print(f"approved {call} runs now")
    else:
        print(f"denied {call} does not run")
    if until:
        end = f"end it with: tokens auto-approve {token} off"
        print(
            f"{token} runs changing tools without asking until {until}; {end}"
        )
    return 0


def list_approvals(args: Any, config: Config) -> int:
    """approvals list: the calls that wait, as a table or JSON."""
    shown = waiting_calls(config)
    if args.json:
        print(json.dumps(shown))
    elif not shown:
        print("no call waits for approval")
    else:
        print_waiting(shown)
        how = "approvals approve ID [--auto-for 1h|1d|7d|30d|forever]"
        print(f"\nanswer with: {how}, or approvals deny ID [--reason TEXT]")
    return 0


def others_waiting(config: Config, approval_id: str) -> list[dict]:
    """Return the calls that wait beside ``approval_id`` from its token."""
    pending = ApprovalDesk(config.state_dir).pending()
    token = next(
        (r.get("principalId") for r in pending if r["id"] == approval_id),
        None,
    )
    if not token:
        return []
    return [
        r
        for r in pending
        if r["id"] != approval_id and r.get("principalId") == token
    ]


def waiting_calls(config: Config) -> list[dict]:
    """Return the calls that wait for approval, as people are shown them.

    `approvals list` and the console show them so.
    """
    desk = ApprovalDesk(config.state_dir)
    if not desk.directory.exists():
        return []
    keys = ("id", "token", "tool", "machine", "expiresAt", "arguments")
    return [{key: r.get(key) for key in keys} for r in desk.pending()]


def answer_approval(
    config: Config,
    approval_id: str,
    approve: bool,
    who: dict | None,
    auto_for=None,
    reason="",
) -> tuple[dict, str | None]:
    """Answer a waiting call; return (its request, auto-approval's end).

    ``who`` is the console's operator, or None at the terminal. The end
    is None unless ``auto_for`` starts an auto-approval.
    """
    who = who or {"principal": "cli", "user": os_user(), "via": "terminal"}
    answer = {
        "decision": "approve" if approve else "deny",
        "by": who.get("user") or who["principal"],
        "answeredAt": utc_now(),
        "via": who["via"],
    }
    if auto_for:
        answer["autoFor"] = auto_for
    elif not approve:
        answer["reason"] = reason
    request = ApprovalDesk(config.state_dir).respond(approval_id, answer)
    if not auto_for:
        return request, None
    token = str(request.get("token"))
    principal = str(request.get("principalId", ""))
    until = AutoApprovals(config.state_dir).grant(token, principal, auto_for)
    started = {
        "event": "approval",
        "approval": "auto-approval started",
        "token": token,
    }
    cli_record(config, {**started, "until": until, "id": approval_id}, who)
    return request, until


def oauth_report(config: Config) -> str:
    """Return whether --http runs OAuth, and the issuer it advertises.

    That is for --http at httpHost and httpPort.
    """
    issuer = oauth_issuer(config, config.http_host, config.http_port)
    if not Operator(config.state_dir).enabled():
        return (
            "off: no operator password or link (`operator set-password`"
            " turns it on)"
        )
    if issuer is None:
        host = config.http_host
        return (
            f"off: --http on {host} needs publicUrl, the https:// address"
            " clients reach"
        )
    return (
        f"on with --http, issuer {issuer} (clients connect by URL;"
        f" sign-in at {issuer}/signin)"
    )


def tokens_file_report(config: Config) -> str:
    """Return what doctor says of the tokens file; never a secret.

    That is where it is, how many tokens it holds, and its mode.
    """
    store = TokenStore(config.state_dir)
    path = store.file.path
    if not path.exists():
        state = "set" if config.auth_token else "unset"
        return f"no tokens file yet ({path}); SMOL_MCP_AUTH_TOKEN is {state}"
    try:
        count = len(store.records())
    except SmolError as err:
        return f"NOT READABLE: {err}"
    mode = path.stat().st_mode & 0o777
    if mode == 0o600:
        verdict = "ok"
    else:
        verdict = "TOO OPEN: run chmod 600 on it"
    return f"{count} token(s) in {path}, mode {oct(mode)[2:]} ({verdict})"


# -- parity ------------------------------------------------------------------
# What a person must act on: printed in capitals, with a note.
PARITY_NOTES = {
    "unknown": "new in this smolvm; decide whether a tool should call it",
    "missing": "called by smol-mcp but absent from this serve",
}


def parity(app: SmolMcp) -> int:
    """Print the routes against the serve's OpenAPI document.

    Return 1 when a route this server calls is missing there, else 0.
    """
    fleet = app.local
    fleet.acquire()
    try:
        openapi = fleet.request(
            "read the OpenAPI document", "GET", "/api-docs/openapi.json"
        )
    finally:
        fleet.release()
    # called, skipped (with reasons), unknown, missing
    report = parity_report(openapi)
    counts = ", ".join(
        f"{len(routes)} {kind}" for kind, routes in report.items()
    )
    print(f"smolvm {fleet.version}: {counts}")
    for kind, routes in report.items():
        print_parity_routes(kind, routes)
    return 1 if report["missing"] else 0


def print_parity_routes(kind: str, routes: list) -> None:
    """Print the routes of one kind, each with its note if it has one."""
    label = kind
    if kind in PARITY_NOTES:
        label = kind.upper()
    for route in routes:
        note = PARITY_NOTES.get(kind)
        if kind == "skipped":
            # a skipped route comes with the reason it is skipped
            route, note = route
        method, path = route
        if note:
            print(f"  {label:8} {method:6} {path}: {note}")
        else:
            print(f"  {label:8} {method:6} {path}")


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``smol-mcp`` and ``python3 smol_mcp.py``."""
    if argv is None:
        argv = sys.argv[1:]
    args = parse_args(argv)
    logging.basicConfig(
        level=logging.WARNING,
        stream=sys.stderr,
        format="smol-mcp: %(message)s",
    )
    # our progress lines; the SDK's chatter stays at warnings
    log.setLevel(logging.INFO)
    helpers = {
        "setup": setup,
        "tokens": tokens_command,
        "activity": activity_command,
        "approvals": approvals_command,
        "operator": operator_command,
    }
    try:
        config = load_config()
        if args.command in helpers:
            return helpers[args.command](args, config)
        if args.http and not args.command:
            check_http_access(config)
        app = SmolMcp(config)
        if args.command == "doctor":
            try:
                return doctor(app, args.probe)
            except KeyboardInterrupt:
                print("smol-mcp: interrupted", file=sys.stderr)
                return 130
        if args.command == "parity":
            return parity(app)
        if args.http:
            # a SmolError here is about the port: nothing was served yet
            host = args.host or config.http_host
            port = args.port or config.http_port
            anyio.run(run_http, app, host, port, args.path or config.http_path)
    except SmolError as err:
        print(f"smol-mcp: {err}", file=sys.stderr)
        return 2
    if args.http:
        # done: a worker thread a stopped call abandoned must not hold the
        # exit
        logging.shutdown()
        sys.stdout.flush()
        os._exit(0)
    if sys.stdin.isatty():
        print(stdio_greeting(), file=sys.stderr, flush=True)
    anyio.run(run_stdio, app)
    return 0


def check_http_access(config: Config) -> None:
    """Raise ConfigError unless --http has a way to let clients in.

    A token, or an operator for clients that connect by URL: these tools
    run machines. A weak SMOL_MCP_AUTH_TOKEN is refused too.
    """
    if not (Access(config).live_ids() or Operator(config.state_dir).enabled()):
        raise ConfigError(
            "--http refuses to start without a token, because these tools"
            " run machines: create one with"
            f" `{invocation()} tokens create NAME --preset sandbox`, or set"
            " SMOL_MCP_AUTH_TOKEN and have clients send it as"
            " 'Authorization: Bearer <token>'"
            f" ({HTTP_TOKEN_ADVICE}), or let clients connect by URL:"
            f" `{invocation()} operator set-password`"
        )
    if config.auth_token:
        check_token_strength(config.auth_token)


def stdio_greeting() -> str:
    """Return what a person who ran the server at a terminal is told."""
    return (
        "smol-mcp: this is an MCP server speaking JSON-RPC on stdin, waiting"
        " for a client (Ctrl-C to stop); to check this host run"
        f" `{invocation()} doctor`, to configure a client"
        f" `{invocation()} setup CLIENT` (see --help)"
    )


def main_http() -> int:
    """Entry point of ``smol-mcp-http``."""
    return main(["--http", *sys.argv[1:]])


if __name__ == "__main__":
    sys.exit(main())
