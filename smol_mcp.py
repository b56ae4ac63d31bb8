#!/usr/bin/env python3
# /// script
# requires-python = ">=3.10"
# dependencies = [
#     "mcp==2.3.0",
#     "httpx2==2.16.2",
# ]
# ///
"""smol-mcp: an MCP server that gives an AI agent microVMs to work in.

The agent creates a machine from an OCI image, runs commands in it, reads and
writes its files, branches it, follows its log and deletes it, through thirteen
MCP tools. Every command a tool runs executes inside a guest; the only host
process this server ever spawns is ``smolvm serve``, and only when a local tool
is first called.

Run it with ``uv run smol_mcp.py`` (stdio) or ``--http`` (Streamable HTTP).
Importing this module has no side effects; the public surface for embedding is
``load_config()``, ``build_server(config)``, ``LocalFleet``, ``CloudFleet``
and ``main()``.

The file reads top to bottom in the order a request flows:

     1. Configuration            8. Tools
     2. Errors                   9. Resources
     3. Local fleet             10. Sessions and cleanup
     4. Cloud fleet             11. The MCP server
     5. Normalised records      12. stdio
     6. Output budget           13. Streamable HTTP
     7. Argument validation     14. Command line
"""

from __future__ import annotations

import base64
import dataclasses
import datetime
import difflib
import errno
import functools
import hmac
import http.client
import ipaddress
import json
import logging
import os
import re
import secrets as secrets_module
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

__version__ = "0.1.0"

log = logging.getLogger("smol_mcp")


# ---------------------------------------------------------------------------
# 1. Configuration
#
# Environment over config file over default. The file is JSON with camelCase
# keys; anything unknown, mistyped or out of range stops startup with a message
# naming the key, because a setting that is silently ignored is worse than one
# that refuses to start.
# ---------------------------------------------------------------------------

DEFAULT_CLOUD_URL = "https://api.smolmachines.com"


@dataclass(frozen=True)
class Config:
    """Every setting, already validated. Build one with ``load_config()``."""

    smolvm: str = "smolvm"
    min_smolvm: str = "1.14.0"
    local_url: str = ""
    runtime_dir: str = ""
    machine_prefix: str = "mcp-"
    memory_mb: int = 2048
    cpus: int = 2
    network_default: str = "blocked"
    run_once_network: str = "blocked"
    ephemeral_ttl_secs: int = 3600
    ephemeral_auto_stop_secs: int = 900
    exec_timeout_secs: int = 120
    max_exec_timeout_secs: int = 900
    max_output_bytes: int = 65536
    ready_timeout_secs: int = 120
    serve_start_timeout_secs: int = 60
    logs_tail: int = 100
    logs_poll_secs: int = 2
    cloud_url: str = DEFAULT_CLOUD_URL
    cloud_token: str = field(default="", repr=False)
    targets: str = "auto"
    http_host: str = "127.0.0.1"
    http_port: int = 8080
    http_path: str = "/mcp"
    auth_token: str = field(default="", repr=False)
    http_session_idle_secs: int = 1800
    http_allowed_hosts: tuple[str, ...] = ()
    http_allowed_origins: tuple[str, ...] = ()

    def secret_values(self) -> list[str]:
        """The configured secrets, so they can be kept out of children and messages."""
        return [s for s in (self.cloud_token, self.auth_token) if s]


@dataclass(frozen=True)
class Setting:
    """One row of the settings table: file key, environment variable, parser."""

    key: str
    env: str
    attr: str
    kind: str  # "str", "int", "choice", "version", "list", "secret"
    choices: tuple[str, ...] = ()
    minimum: int | None = None
    maximum: int | None = None


SETTINGS: tuple[Setting, ...] = (
    Setting("smolvm", "SMOLVM", "smolvm", "str"),
    Setting("minSmolvm", "SMOL_MCP_MIN_SMOLVM", "min_smolvm", "version"),
    Setting("localUrl", "SMOL_LOCAL_URL", "local_url", "str"),
    Setting("runtimeDir", "SMOL_MCP_RUNTIME_DIR", "runtime_dir", "str"),
    Setting("machinePrefix", "SMOL_MCP_MACHINE_PREFIX", "machine_prefix", "str"),
    Setting("memoryMb", "SMOL_MCP_MEMORY_MB", "memory_mb", "int", minimum=128, maximum=1048576),
    Setting("cpus", "SMOL_MCP_CPUS", "cpus", "int", minimum=1, maximum=255),
    Setting("networkDefault", "SMOL_MCP_NETWORK_DEFAULT", "network_default", "choice", ("blocked", "open")),
    Setting("runOnceNetwork", "SMOL_MCP_RUN_ONCE_NETWORK", "run_once_network", "choice", ("blocked", "open")),
    Setting("ephemeralTtlSecs", "SMOL_MCP_EPHEMERAL_TTL_SECS", "ephemeral_ttl_secs", "int", minimum=60),
    Setting("ephemeralAutoStopSecs", "SMOL_MCP_EPHEMERAL_AUTO_STOP_SECS", "ephemeral_auto_stop_secs", "int", minimum=60),
    Setting("execTimeoutSecs", "SMOL_MCP_EXEC_TIMEOUT_SECS", "exec_timeout_secs", "int", minimum=1),
    Setting("maxExecTimeoutSecs", "SMOL_MCP_MAX_EXEC_TIMEOUT_SECS", "max_exec_timeout_secs", "int", minimum=1),
    Setting("maxOutputBytes", "SMOL_MCP_MAX_OUTPUT_BYTES", "max_output_bytes", "int", minimum=1024, maximum=64 * 1024 * 1024),
    Setting("readyTimeoutSecs", "SMOL_MCP_READY_TIMEOUT_SECS", "ready_timeout_secs", "int", minimum=1),
    Setting("serveStartTimeoutSecs", "SMOL_MCP_SERVE_START_TIMEOUT_SECS", "serve_start_timeout_secs", "int", minimum=1),
    Setting("logsTail", "SMOL_MCP_LOGS_TAIL", "logs_tail", "int", minimum=1, maximum=100000),
    Setting("logsPollSecs", "SMOL_MCP_LOGS_POLL_SECS", "logs_poll_secs", "int", minimum=1),
    Setting("cloudUrl", "SMOL_CLOUD_URL", "cloud_url", "str"),
    Setting("cloudToken", "SMOL_CLOUD_TOKEN", "cloud_token", "secret"),
    Setting("targets", "SMOL_MCP_TARGETS", "targets", "choice", ("auto", "local", "cloud", "both")),
    Setting("httpHost", "SMOL_MCP_HTTP_HOST", "http_host", "str"),
    Setting("httpPort", "SMOL_MCP_HTTP_PORT", "http_port", "int", minimum=1, maximum=65535),
    Setting("httpPath", "SMOL_MCP_HTTP_PATH", "http_path", "str"),
    Setting("authToken", "SMOL_MCP_AUTH_TOKEN", "auth_token", "secret"),
    Setting("httpSessionIdleSecs", "SMOL_MCP_HTTP_SESSION_IDLE_SECS", "http_session_idle_secs", "int", minimum=1),
    Setting("httpAllowedHosts", "SMOL_MCP_HTTP_ALLOWED_HOSTS", "http_allowed_hosts", "list"),
    Setting("httpAllowedOrigins", "SMOL_MCP_HTTP_ALLOWED_ORIGINS", "http_allowed_origins", "list"),
)


def config_file_path(environ: dict[str, str]) -> Path:
    """Where the config file is looked for: $SMOL_MCP_CONFIG, else the XDG path."""
    if environ.get("SMOL_MCP_CONFIG"):
        return Path(environ["SMOL_MCP_CONFIG"]).expanduser()
    base = environ.get("XDG_CONFIG_HOME") or str(Path(environ.get("HOME") or Path.home()) / ".config")
    return Path(base) / "smol-mcp" / "config.json"


def _parse_setting(setting: Setting, value: Any, source: str) -> Any:
    """Turn one raw value (a string from the environment, JSON from the file) into
    its typed form, or raise ConfigError naming the setting and what it accepts."""
    where = f"{setting.env}" if source == "env" else f'"{setting.key}" in the config file'
    if setting.kind in ("str", "secret", "version"):
        if not isinstance(value, str):
            raise ConfigError(f"{where} must be a string, got {_json_type(value)}")
        value = value.strip()
        if setting.kind == "version" and value and not re.fullmatch(r"\d+(\.\d+){0,2}", value):
            raise ConfigError(f"{where} must be a version such as 1.14.0 (or empty to skip the check), got {value!r}")
        return value
    if setting.kind == "choice":
        if not isinstance(value, str) or value.strip() not in setting.choices:
            raise ConfigError(f"{where} must be one of {', '.join(setting.choices)}; got {value!r}")
        return value.strip()
    if setting.kind == "int":
        if source == "env":
            if not re.fullmatch(r"\s*-?\d+\s*", value):
                raise ConfigError(f"{where} must be a whole number, got {value!r}")
            value = int(value)
        elif isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where} must be a whole number, got {_json_type(value)}")
        if setting.minimum is not None and value < setting.minimum:
            raise ConfigError(f"{where} must be at least {setting.minimum}, got {value}")
        if setting.maximum is not None and value > setting.maximum:
            raise ConfigError(f"{where} must be at most {setting.maximum}, got {value}")
        return value
    if setting.kind == "list":
        if source == "env":
            return tuple(part.strip() for part in value.split(",") if part.strip())
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ConfigError(f"{where} must be a list of strings")
        return tuple(v.strip() for v in value if v.strip())
    raise AssertionError(setting.kind)


def _json_type(value: Any) -> str:
    return {bool: "a boolean", int: "a number", float: "a number", str: "a string", list: "a list",
            dict: "an object", type(None): "null"}.get(type(value), type(value).__name__)


def load_config(environ: dict[str, str] | None = None) -> Config:
    """Read the config file and the environment into a validated Config.

    A missing file is fine; an unreadable or malformed one, an unknown key, a
    wrong type or an out-of-range value raises ConfigError with a sentence that
    names the key. Secrets never appear in those sentences.
    """
    environ = dict(os.environ if environ is None else environ)
    values: dict[str, Any] = {}
    path = config_file_path(environ)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        text = None
    except OSError as exc:
        raise ConfigError(f"cannot read the config file {path}: {exc.strerror}") from None
    if text is not None:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"the config file {path} is not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"the config file {path} must hold a JSON object of settings")
        by_key = {s.key: s for s in SETTINGS}
        for key, raw in data.items():
            if key not in by_key:
                hint = difflib.get_close_matches(key, by_key, n=1)
                maybe = f' (did you mean "{hint[0]}"?)' if hint else ""
                raise ConfigError(f'unknown key "{key}" in the config file {path}{maybe}; '
                                  f"the accepted keys are: {', '.join(by_key)}")
            values[by_key[key].attr] = _parse_setting(by_key[key], raw, "file")
    for setting in SETTINGS:
        if setting.env in environ:
            values[setting.attr] = _parse_setting(setting, environ[setting.env], "env")

    config = Config(**values)
    if config.exec_timeout_secs > config.max_exec_timeout_secs:
        raise ConfigError(f"execTimeoutSecs ({config.exec_timeout_secs}) must not be above "
                          f"maxExecTimeoutSecs ({config.max_exec_timeout_secs})")
    if not NAME_RE.fullmatch(config.machine_prefix + "x"):
        raise ConfigError("machinePrefix must start with a letter or digit and hold only letters, digits, "
                          f"'-' and '_', got {config.machine_prefix!r}")
    if not config.machine_prefix:
        raise ConfigError("machinePrefix must not be empty: it is what marks a machine as ephemeral")
    if not config.http_path.startswith("/"):
        raise ConfigError(f"httpPath must start with '/', got {config.http_path!r}")
    if config.local_url:
        parse_local_url(config.local_url)  # raises ConfigError when it is not a loopback or unix URL
    if not config.runtime_dir:
        config = dataclasses.replace(config, runtime_dir=default_runtime_dir(environ))
    return config


def default_runtime_dir(environ: dict[str, str]) -> str:
    """$XDG_RUNTIME_DIR/smol-mcp, else a per-user folder in the temp directory."""
    if environ.get("XDG_RUNTIME_DIR"):
        return str(Path(environ["XDG_RUNTIME_DIR"]) / "smol-mcp")
    return str(Path(tempfile.gettempdir()) / f"smol-mcp-{os.getuid()}")


def ensure_runtime_dir(path: str) -> Path:
    """Create the runtime directory with mode 0700 and refuse one we do not own:
    it holds the socket of an API without authentication."""
    directory = Path(path)
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    info = directory.stat()
    if info.st_uid != os.getuid():
        raise SmolError(f"the runtime directory {directory} belongs to another user; set SMOL_MCP_RUNTIME_DIR "
                        "to a directory of your own")
    if info.st_mode & 0o077:
        # Not tightened in place: it may be a shared directory such as /tmp that others rely on.
        raise SmolError(f"the runtime directory {directory} can be opened by other users (mode "
                        f"{oct(info.st_mode & 0o777)}); set SMOL_MCP_RUNTIME_DIR to a directory only you can open, "
                        "for example one made with mkdir -m 700")
    return directory


def parse_local_url(url: str) -> tuple[str, str | int]:
    """Split SMOL_LOCAL_URL into ("unix", path) or ("tcp", port).

    Only a Unix socket or a loopback TCP port is accepted: the local API has no
    authentication, so talking to it across a network would hand the host out.
    """
    parsed = urllib.parse.urlsplit(url)
    if parsed.scheme == "unix":
        path = parsed.path or parsed.netloc
        if not path.startswith("/"):
            raise ConfigError(f"SMOL_LOCAL_URL must name an absolute socket path, as unix:///path/to/serve.sock; got {url!r}")
        return "unix", path
    if parsed.scheme == "http" and parsed.hostname in ("127.0.0.1", "localhost", "::1") and parsed.port:
        return "tcp", parsed.port
    raise ConfigError("SMOL_LOCAL_URL must be unix:///absolute/path.sock or http://127.0.0.1:PORT (loopback only, "
                      f"because the local API has no authentication); got {url!r}")


# ---------------------------------------------------------------------------
# 2. Errors
#
# Every failure a caller can do something about is a SmolError whose text is a
# sentence saying what happened and what to do next. Tool handlers let these
# travel up; the dispatcher turns them into tool errors (isError: true).
# ---------------------------------------------------------------------------


class SmolError(Exception):
    """A failure to report to the caller; ``str(err)`` is the whole message."""


class ConfigError(SmolError):
    """A setting is unknown, mistyped or out of range."""


class ArgumentError(SmolError):
    """A tool argument is unknown, mistyped or out of range."""


class NotRunning(SmolError):
    """The machine is not running, so a command was not sent (the tools start it and retry)."""


class ApiError(SmolError):
    """The machine API refused a request. Keeps the status and the API's own
    code and message so callers can branch on them and pass the text through."""

    def __init__(self, fleet: str, action: str, status: int, code: str, message: str):
        self.fleet, self.action, self.status, self.code, self.api_message = fleet, action, status, code, message
        label = f"HTTP {status} {code}".strip()
        super().__init__(f"The {fleet} machine API refused to {action}: {message} ({label})")

    def with_hint(self, hint: str) -> "ApiError":
        """The same error with one more sentence telling the caller what to do."""
        err = ApiError(self.fleet, self.action, self.status, self.code, self.api_message)
        err.args = (f"{self.args[0]}. {hint}",)
        return err


def redact(text: str, secret_values: list[str]) -> str:
    """Replace every configured secret in ``text``: last line of defence for
    messages built from data we did not write."""
    for value in secret_values:
        if value:
            text = text.replace(value, "[redacted]")
    return text


# ---------------------------------------------------------------------------
# 3. Local fleet: smolvm serve over a Unix socket
#
# http.client over AF_UNIX to `smolvm serve start --listen <runtimeDir>/serve.sock`,
# spawned on the first local call and never at connect. Every method here
# blocks; the tool layer runs them in worker threads so one long command never
# stalls another session.
# ---------------------------------------------------------------------------

NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,127}")
ADDRESS_IN_USE_HINT = (
    "Only one smolvm serve can run per host with the default settings (it binds 127.0.0.1:10081), and one is "
    "already running. Point smol-mcp at it with SMOL_LOCAL_URL=unix:///path/to/its.sock (smolvm's own default is "
    "unix://$XDG_RUNTIME_DIR/smolvm.sock; it is then left running), or stop it."
)
# Engine settings the serve child may need; nothing else of ours is passed on.
CHILD_ENV_NAMES = ("PATH", "HOME", "USER", "LOGNAME", "LANG", "LC_ALL", "LC_CTYPE", "TMPDIR", "TZ", "XDG_RUNTIME_DIR",
                   "XDG_DATA_HOME", "XDG_CONFIG_HOME", "XDG_CACHE_HOME", "XDG_STATE_HOME", "RUST_LOG")
GUEST_MARKERS = ("/usr/local/bin/smolvm-agent", "/etc/smolvm")
READY_PROBE = ["true"]  # "ready" means a command has actually run in the guest
RANGE_READ_MIN_OFFSET = 4 * 1024 * 1024  # below this, streaming the file from its start is cheap enough
RANGE_READ_SCRIPT = 'stat -L -c %s "$1" && tail -c +$(($2 + 1)) "$1" | head -c "$3"'  # -L: a link's target


def inside_smol_guest() -> bool:
    """True when this process runs inside a smol machine, where there is no
    hypervisor to start a nested fleet with."""
    return any(os.path.exists(marker) for marker in GUEST_MARKERS)


def version_tuple(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", version)[:3])


def minimal_child_env(environ: dict[str, str], secret_values: list[str]) -> dict[str, str]:
    """The environment the serve child gets: a few basics and SMOLVM_* engine
    settings, never a token (SPEC 3), even one that hides in an allowed name."""
    env = {name: environ[name] for name in CHILD_ENV_NAMES if name in environ}
    env.update({name: value for name, value in environ.items() if name.startswith("SMOLVM_")})
    return {name: value for name, value in env.items() if value not in secret_values}


class UnixHTTPConnection(http.client.HTTPConnection):
    """http.client over an AF_UNIX stream socket."""

    def __init__(self, socket_path: str, timeout: float):
        super().__init__("localhost", timeout=timeout)
        self.socket_path = socket_path

    def connect(self) -> None:
        for attempt in range(20):
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(self.timeout)
            try:
                sock.connect(self.socket_path)
                self.sock = sock
                return
            except BlockingIOError:
                # The serve's listen backlog is full: nothing was sent, so wait a moment and try again.
                sock.close()
                time.sleep(0.01 * min(attempt + 1, 10))
            except OSError:
                sock.close()
                raise
        # Busy (or stopped), not gone: the caller waits for it rather than start another serve.
        full = f"the serve at {self.socket_path} kept its listen backlog full"
        raise BlockingIOError(errno.EAGAIN, full)


@dataclass
class MachineSpec:
    """A create request in the normalised vocabulary both fleets understand."""

    name: str
    image: str
    cpus: int
    memory_mb: int
    network: str  # "open" or "blocked"
    allow_hosts: list[str] = field(default_factory=list)
    allow_cidrs: list[str] = field(default_factory=list)
    ports: list[dict[str, int]] = field(default_factory=list)  # [{"guest", "host"?}]
    mounts: list[dict[str, Any]] = field(default_factory=list)  # [{"source", "target", "readonly"?}]
    storage_gb: int | None = None
    overlay_gb: int | None = None
    cmd: list[str] | None = None
    env: dict[str, str] = field(default_factory=dict)
    branchable: bool = False
    ephemeral: bool = False  # the cloud turns this into a TTL and an idle stop


@dataclass
class ExecResult:
    """What a command did, as raw bytes: the budget is applied later."""

    exit_code: int
    stdout: bytes
    stderr: bytes
    seconds: float
    cut_by_service: tuple[str, ...] = ()  # streams the API itself cut short (the cloud's text cap)


@dataclass
class FilePage:
    """One page of a guest file."""

    data: bytes
    size: int
    offset: int


class LocalFleet:
    """The machines of ``smolvm serve`` on this host.

    The serve is started on first use, shared by every session of the process
    (``acquire``/``release`` count them; the last release stops a serve we
    started), restarted if it dies, and never started when SMOL_LOCAL_URL names
    one to use instead.
    """

    name = "local"

    def __init__(self, config: Config, environ: dict[str, str] | None = None):
        self.config = config
        self.environ = dict(os.environ if environ is None else environ)
        self._lock = threading.RLock()
        self._process: subprocess.Popen | None = None
        self._users = 0
        self._ready = False
        self._pool = threading.local()  # one kept-alive connection per worker thread
        self.version: str | None = None
        if config.local_url:
            self._kind, self._address = parse_local_url(config.local_url)
        else:
            self._kind, self._address = "unix", str(Path(config.runtime_dir) / "serve.sock")

    # -- lifecycle ---------------------------------------------------------

    @property
    def endpoint(self) -> str:
        """A stable name for the serve we talk to, used to match cleanup records."""
        return self.config.local_url or f"unix://{self._address}"

    def acquire(self) -> None:
        with self._lock:
            self._users += 1

    def release(self) -> None:
        """One session let go. When the last session of the last smol-mcp
        process using our serve lets go, the serve is stopped; a serve named by
        SMOL_LOCAL_URL is never ours to stop."""
        with self._lock:
            self._users = max(0, self._users - 1)
            if self._users or self.config.local_url:
                return
            with bookkeeping(self.config.runtime_dir):
                (self._users_dir / str(os.getpid())).unlink(missing_ok=True)
            if self._other_processes_use_serve():
                self._process, self._ready = None, False  # theirs to stop now
                return
            self.stop_serve()

    @property
    def _users_dir(self) -> Path:
        return Path(self.config.runtime_dir) / "serve-users"

    def _other_processes_use_serve(self) -> bool:
        """Whether another live smol-mcp process marked itself as using our
        serve (processes with the same runtime directory share one)."""
        for marker in self._users_dir.glob("*"):
            pid = int(marker.name) if marker.name.isdigit() else 0
            if pid != os.getpid():
                try:
                    started = int(marker.read_text() or 0) or None
                except (OSError, ValueError):
                    started = None
                if process_alive(pid, started):
                    return True
                with bookkeeping(self.config.runtime_dir):
                    marker.unlink(missing_ok=True)  # a process that died without letting go
        return False

    def stop_serve(self) -> None:
        """Stop the serve on our socket: the child we spawned, or the one
        another smol-mcp process spawned and left to us (its pid is on file)."""
        with self._lock:
            process, self._process, self._ready = self._process, None, False
        pid_file = Path(self.config.runtime_dir) / "serve.pid"
        if process is not None:
            if process.poll() is None:
                process.terminate()
                try:
                    process.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait(timeout=5)
        elif not self.config.local_url and pid_file.exists():
            pid = int(pid_file.read_text().strip() or 0)
            if serve_process_on(pid, self._address):
                os.kill(pid, signal.SIGTERM)
        with bookkeeping(self.config.runtime_dir):
            pid_file.unlink(missing_ok=True)

    def smolvm_path(self) -> str | None:
        configured = self.config.smolvm
        if os.sep in configured:
            return configured if os.access(configured, os.X_OK) else None
        return shutil.which(configured, path=self.environ.get("PATH"))

    def ensure_serve(self) -> None:
        """Make sure a serve answers, starting ours if needed, and check its version once."""
        with self._lock:
            if self._ready and (self._process is None or self._process.poll() is None):
                return
            self._ready = False
            if inside_smol_guest():
                raise SmolError("The local target is unavailable inside a smol machine: there is no hypervisor here "
                                "to start a nested machine with. Use the cloud target, or run smol-mcp on the host.")
            if not self.config.local_url and not self._answers():
                self._start_serve_once()
            try:
                health = self._health()
            except OSError as exc:
                if self.config.local_url:
                    raise SmolError(f"nothing answers at SMOL_LOCAL_URL={self.config.local_url} ({exc.strerror or exc}); "
                                    "start the serve there, or unset SMOL_LOCAL_URL to let smol-mcp start its own") from None
                raise SmolError(f"the smolvm serve stopped answering on {self._address} ({exc.strerror or exc}); its "
                                f"log is {Path(self.config.runtime_dir) / 'serve.log'}") from None
            self.version = str(health.get("version", ""))
            if not self.config.local_url:
                with bookkeeping(self.config.runtime_dir):
                    self._users_dir.mkdir(mode=0o700, exist_ok=True)
                    started = process_start_time(os.getpid())
                    (self._users_dir / str(os.getpid())).write_text(str(started or ""))
            if self.config.min_smolvm and version_tuple(self.version) < version_tuple(self.config.min_smolvm):
                raise SmolError(f"smolvm {self.version} is older than the minimum {self.config.min_smolvm} this server "
                                "needs (older serves reject fields it sends). Upgrade smolvm, or set "
                                "SMOL_MCP_MIN_SMOLVM to an empty value to skip the check.")
            self._ready = True

    def _answers(self) -> bool:
        """True when something already serves the API on our socket (for example
        the serve of another smol-mcp process with the same runtime directory)."""
        try:
            self._health()
            return True
        except (OSError, SmolError):
            return False

    def _health(self) -> dict:
        status, _, body = self._raw_request("GET", "/health", timeout=5)
        if status != 200:
            raise SmolError(f"the local serve answered /health with HTTP {status}")
        return json.loads(body)

    def _start_serve_once(self) -> None:
        """Start the serve unless another smol-mcp process sharing the runtime
        directory is starting it right now: a file lock makes them take turns."""
        import fcntl
        runtime_dir = ensure_runtime_dir(self.config.runtime_dir)
        with open(runtime_dir / "serve.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if self._answers():
                return
            pid = self._live_serve_pid()
            if pid is None or not self._wait_while_busy(pid):
                self._start_serve()

    def _live_serve_pid(self) -> int | None:
        """The serve process on our socket that still runs, whether it answers
        or not: ours, or the one another smol-mcp process started (serve.pid)."""
        if self._process is not None and self._process.poll() is None:
            return self._process.pid
        try:
            pid = int((Path(self.config.runtime_dir) / "serve.pid").read_text().strip() or 0)
        except (OSError, ValueError):
            return None
        return pid if process_alive(pid) and serve_process_on(pid, self._address) else None

    def _wait_while_busy(self, pid: int) -> bool:
        """A serve that runs but does not answer is busy (or stopped), not dead:
        replacing it would orphan it and fight it for its port. Wait for it,
        within serveStartTimeoutSecs; False if it died meanwhile."""
        deadline = time.monotonic() + self.config.serve_start_timeout_secs
        while time.monotonic() < deadline:
            if not process_alive(pid):
                return False
            if self._answers():
                return True
            time.sleep(0.2)
        raise self._busy_error(pid)

    def _busy_error(self, pid: int | None) -> SmolError:
        which = f"the smolvm serve (pid {pid})" if pid else "the smolvm serve"
        return SmolError(
            f"{which} is running but did not answer on {self._address} within "
            f"{self.config.serve_start_timeout_secs} s: it is busy or stopped. It was left "
            "running, not replaced. Try again shortly; if it stays this way, see "
            f"{Path(self.config.runtime_dir) / 'serve.log'}, or end that process so a new one "
            "starts."
        )

    def _start_serve(self) -> None:
        binary = self.smolvm_path()
        if binary is None:
            raise SmolError(f"smolvm was not found (looked for {self.config.smolvm!r} on PATH). Install smolvm, set "
                            "SMOLVM to the path of the binary, or set SMOL_LOCAL_URL to a running serve.")
        runtime_dir = ensure_runtime_dir(self.config.runtime_dir)
        socket_path = Path(self._address)
        if len(str(socket_path).encode()) > 100:
            raise SmolError(f"the socket path {socket_path} is too long for a Unix socket; set SMOL_MCP_RUNTIME_DIR "
                            "to a shorter directory")
        socket_path.unlink(missing_ok=True)
        log_path = runtime_dir / "serve.log"
        env = minimal_child_env(self.environ, self.config.secret_values())
        with open(log_path, "ab") as log_file:
            log_start = log_file.tell()
            self._process = subprocess.Popen(
                [binary, "serve", "start", "--listen", str(socket_path)],
                stdin=subprocess.DEVNULL, stdout=log_file, stderr=log_file, env=env,
                start_new_session=True, close_fds=True)
        log.info("started smolvm serve (pid %s) on %s", self._process.pid, socket_path)
        with bookkeeping(self.config.runtime_dir):
            (runtime_dir / "serve.pid").write_text(str(self._process.pid))
        deadline = time.monotonic() + self.config.serve_start_timeout_secs
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                output = _read_from(log_path, log_start)
                self._process = None
                if "Address already in use" in output:
                    raise SmolError(f"smolvm serve could not start: {_last_line(output)}. {ADDRESS_IN_USE_HINT}")
                raise SmolError(f"smolvm serve exited at once: {_last_line(output) or 'no output'} "
                                f"(its log is {log_path})")
            if self._answers():
                return
            time.sleep(0.05)
        self.stop_serve()
        raise SmolError(f"smolvm serve did not answer within {self.config.serve_start_timeout_secs} s "
                        f"(serveStartTimeoutSecs); its log is {log_path}")

    # -- HTTP --------------------------------------------------------------

    def _connection(self, timeout: float) -> http.client.HTTPConnection:
        if self._kind == "unix":
            return UnixHTTPConnection(str(self._address), timeout)
        return http.client.HTTPConnection("127.0.0.1", int(self._address), timeout=timeout)

    def _pooled(self, timeout: float) -> http.client.HTTPConnection:
        """This worker thread's kept-alive connection: opening one per call
        costs about as much as the call itself. One the serve closed while it
        sat idle is replaced before it is used."""
        conn = getattr(self._pool, "conn", None)
        if conn is not None and conn.sock is not None and peer_closed(conn.sock):
            conn.close()
            conn = None
        if conn is None:
            conn = self._pool.conn = self._connection(timeout)
        conn.timeout = timeout
        if conn.sock is not None:
            conn.sock.settimeout(timeout)
        return conn

    def _raw_request(self, method: str, path: str, body: bytes | None = None, *, content_type: str | None = None,
                     timeout: float = 30, read: Callable | None = None) -> tuple[int, str, Any]:
        """Send one request on the pooled connection; ``read`` consumes a 200
        answer itself (for answers too large to hold whole)."""
        conn = self._pooled(timeout)
        try:
            headers = {"Content-Type": content_type} if content_type else {}
            conn.request(method, path, body=body, headers=headers)
            response = conn.getresponse()
            ctype = response.getheader("Content-Type", "")
            value = read(response) if read is not None and response.status == 200 else response.read()
            return response.status, ctype, value
        except BaseException:
            conn.close()  # half-used: never hand it to the next call
            self._pool.conn = None
            raise

    def _send_when_accepted(self, send: Callable) -> tuple[int, str, Any]:
        """Send; while the serve's listen backlog is full (EAGAIN on connect:
        it is busy or stopped, not gone) wait and resend, within a bound. The
        connection never opened, so the request was not received."""
        deadline = time.monotonic() + self.config.serve_start_timeout_secs
        while True:
            try:
                return send()
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise self._busy_error(self._live_serve_pid()) from None
                time.sleep(0.2)

    def request(self, action: str, method: str, path: str, payload: Any = None, *, raw: bytes | None = None,
                timeout: float = 30, read: Callable | None = None) -> Any:
        """One API call. Returns the parsed JSON body (or bytes for a raw
        response, or what ``read`` made of a 200); raises ApiError with the
        API's own message on a refusal. A serve that stopped answering is
        started again once."""
        self.ensure_serve()
        if payload is not None:
            body, content_type = json.dumps(payload).encode(), "application/json"
        elif raw is not None:
            body, content_type = raw, "application/octet-stream"
        else:
            body, content_type = None, None
        send = functools.partial(self._raw_request, method, path, body, content_type=content_type, timeout=timeout,
                                 read=read)
        try:
            status, ctype, data = self._send_when_accepted(send)
        except (ConnectionRefusedError, FileNotFoundError):
            # The connection never opened, so the request was not received: safe to resend.
            self._ready = False
            if self.config.local_url:
                raise SmolError(f"nothing answers at SMOL_LOCAL_URL={self.config.local_url}; start the serve there, "
                                "or unset SMOL_LOCAL_URL to let smol-mcp start its own") from None
            self.ensure_serve()
            status, ctype, data = send()
        except socket.timeout:
            raise SmolError(f"the local machine API did not answer within {timeout:.0f} s while trying to {action}") from None
        except (OSError, http.client.HTTPException) as exc:
            self._ready = False
            raise serve_dropped(action, exc) from None
        if status >= 400:
            raise api_error("local", action, status, ctype, data)
        if read is not None and status == 200:
            return data
        if "application/json" in ctype:
            return json.loads(data) if data else None
        return data

    # -- machines (normalised) ---------------------------------------------

    def list_machines(self) -> list[dict]:
        return [local_record(m) for m in self.request("list machines", "GET", "/api/v1/machines")["machines"]]

    def get_machine(self, name: str) -> dict:
        return local_record(self.request(f"get machine '{name}'", "GET", f"/api/v1/machines/{_q(name)}"))

    def machine_state(self, name: str) -> str:
        return self.get_machine(name)["state"]

    def create_machine(self, spec: MachineSpec) -> dict:
        body: dict[str, Any] = {"name": spec.name, "image": spec.image, "cpus": spec.cpus, "memoryMb": spec.memory_mb,
                                "network": spec.network == "open"}
        if spec.allow_hosts:
            body["allowedHosts"] = spec.allow_hosts
        if spec.allow_cidrs:
            body["allowedCidrs"] = spec.allow_cidrs
        if spec.ports:
            body["ports"] = [{"host": p.get("host") or free_loopback_port(), "guest": p["guest"]} for p in spec.ports]
        if spec.mounts:
            body["mounts"] = [{"source": m["source"], "target": m["target"], "readonly": bool(m.get("readonly"))}
                              for m in spec.mounts]
        if spec.storage_gb is not None:
            body["storageGb"] = spec.storage_gb
        if spec.overlay_gb is not None:
            body["overlayGb"] = spec.overlay_gb
        if spec.cmd is not None:
            body["cmd"] = spec.cmd
        if spec.env:
            body["env"] = [{"name": k, "value": v} for k, v in spec.env.items()]
        return local_record(self.request(f"create machine '{spec.name}'", "POST", "/api/v1/machines", body))

    def start_machine(self, name: str, branchable: bool = False) -> dict:
        # Branchability is a start option locally (a create field on cloud).
        query = "?branchable=true" if branchable else ""
        return local_record(self.request(f"start machine '{name}'", "POST", f"/api/v1/machines/{_q(name)}/start{query}",
                                         timeout=self.config.ready_timeout_secs + 60))

    def stop_machine(self, name: str) -> dict:
        return local_record(self.request(f"stop machine '{name}'", "POST", f"/api/v1/machines/{_q(name)}/stop",
                                         timeout=360))

    def delete_machine(self, name: str) -> dict:
        self.request(f"delete machine '{name}'", "DELETE", f"/api/v1/machines/{_q(name)}", timeout=120)
        return {"deleted": name}

    def exec(self, name: str, argv: list[str], *, timeout_secs: int, workdir: str | None = None,
             env: dict[str, str] | None = None, stdin: str | None = None) -> ExecResult:
        """Run a command in a running machine; NotRunning if it is not running.
        (The engine would boot it itself, but then nobody could report that it did.)"""
        body: dict[str, Any] = {"command": argv, "timeoutSecs": timeout_secs, "autoStart": False}
        if workdir:
            body["workdir"] = workdir
        if env:
            body["env"] = [{"name": k, "value": v} for k, v in env.items()]
        if stdin is not None:
            body["stdin"] = stdin
        started = time.monotonic()
        try:
            # The HTTP wait outlives the command's own timeout so the guest, not the socket, decides.
            data = self.request(f"run a command in machine '{name}'", "POST", f"/api/v1/machines/{_q(name)}/exec",
                                body, timeout=timeout_secs + 30, read=read_exec_answer)
        except ApiError as err:
            if err.status == 409 and "not running" in err.api_message:
                raise NotRunning(f"machine '{name}' is not running") from None
            raise
        except ValueError as err:
            raise SmolError(f"the local serve answered a command in machine '{name}' with a body this server could "
                            f"not read ({err})") from None
        return ExecResult(exit_code=int(data["exitCode"]), stdout=data["stdoutB64"], stderr=data["stderrB64"],
                          seconds=time.monotonic() - started)

    def probe_ready(self, name: str) -> str | None:
        """None once a command runs in the guest; while it is still coming up,
        what the guest answered instead. Raises if the machine stopped or is gone."""
        try:
            self.exec(name, READY_PROBE, timeout_secs=10)
            return None
        except NotRunning:
            raise SmolError(f"machine '{name}' stopped while waiting for its guest to answer; its log "
                            "(machine-logs) may say why") from None
        except ApiError as err:
            if err.status in (400, 404):
                raise
            return err.api_message

    def read_file(self, name: str, path: str, offset: int, length: int) -> FilePage:
        """One page of a file. The API has no range parameters, so a page deep
        into a large file is cut inside the guest (stat, tail and head) rather
        than downloading everything before it; an image without those tools
        falls back to streaming the file and keeping only the page."""
        if offset >= RANGE_READ_MIN_OFFSET:
            try:
                result = self.exec(name, ["sh", "-c", RANGE_READ_SCRIPT, "sh", path, str(offset), str(length)],
                                   timeout_secs=120)
                size_line, newline, data = bytes(result.stdout).partition(b"\n")
                if result.exit_code == 0 and newline and size_line.strip().isdigit():
                    return FilePage(data=data, size=int(size_line), offset=offset)
            except ApiError:
                pass  # no shell in this image, say: the download below still works
        return self._stream_page(name, path, offset, length)

    def _stream_page(self, name: str, path: str, offset: int, length: int) -> FilePage:
        self.ensure_serve()
        action = f"read {path} in machine '{name}'"
        conn = self._connection(timeout=self.config.ready_timeout_secs + 60)
        try:
            return self._read_page(conn, action, name, path, offset, length)
        except socket.timeout:
            raise SmolError(f"the local machine API stopped answering while trying to {action}") from None
        except (OSError, http.client.HTTPException) as exc:
            raise serve_dropped(action, exc) from None
        finally:
            conn.close()

    def _read_page(self, conn: http.client.HTTPConnection, action: str, name: str, path: str, offset: int,
                   length: int) -> FilePage:
        conn.request("GET", f"/api/v1/machines/{_q(name)}/files/{_q(path.lstrip('/'), '/')}")
        response = conn.getresponse()
        ctype = response.getheader("Content-Type", "")
        if response.status >= 400:
            raise api_error("local", action, response.status, ctype, response.read())
        if "application/json" in ctype:
            listing = json.loads(response.read() or b"{}")
            names = ", ".join(e.get("name", "?") for e in listing.get("entries", [])[:50])
            raise SmolError(f"{path} is a directory, not a file; it holds: {names or 'nothing'}. "
                            "Pass the path of a file inside it.")
        size = int(response.getheader("Content-Length") or -1)
        skipped = 0
        while skipped < offset:
            chunk = response.read(min(1 << 20, offset - skipped))
            if not chunk:
                break
            skipped += len(chunk)
        data = response.read(length) if skipped == offset else b""
        if size < 0:  # no length header (a streamed file): count what is left to learn the size
            rest = 0
            while chunk := response.read(1 << 20):
                rest += len(chunk)
            size = skipped + len(data) + rest
        return FilePage(data=data, size=size, offset=offset)

    def write_file(self, name: str, path: str, data: bytes) -> int:
        answer = self.request(f"write {path} in machine '{name}'", "PUT",
                              f"/api/v1/machines/{_q(name)}/files/{_q(path.lstrip('/'), '/')}", raw=data,
                              timeout=120 + len(data) / (1 << 20))
        return int((answer or {}).get("size", len(data))) if isinstance(answer, dict) else len(data)

    def console_lines(self, name: str) -> list[str]:
        """Every line of the guest console log (the API streams it as SSE)."""
        try:
            data = self.request(f"read the log of machine '{name}'", "GET",
                                f"/api/v1/machines/{_q(name)}/logs?source=console")
        except ApiError as err:
            if err.status == 404 and "no logs yet" in err.api_message:
                return []  # never started: nothing logged yet, which is an answer, not a failure
            raise
        return parse_sse_lines(data if isinstance(data, bytes) else json.dumps(data).encode())

    def branch_machine(self, name: str, child: str) -> dict:
        return local_record(self.request(f"branch machine '{name}' into '{child}'", "POST",
                                         f"/api/v1/machines/{_q(name)}/branches", {"name": child},
                                         timeout=self.config.ready_timeout_secs + 60))

    def pull_image(self, name: str, image: str) -> dict:
        answer = self.request(f"pull {image} into machine '{name}'", "POST", f"/api/v1/machines/{_q(name)}/images/pull",
                              {"image": image}, timeout=self.config.max_exec_timeout_secs + 60)
        return answer.get("image", answer)


# Every route of the local API, in its OpenAPI spelling: None for the ones this
# server calls, else why it does not. `smol_mcp.py parity` compares this with
# the running serve's spec, so a route a new smolvm adds shows up as a decision.
LOCAL_ROUTES: dict[tuple[str, str], str | None] = {
    ("GET", "/health"): None,
    ("GET", "/api/v1/machines"): None,
    ("POST", "/api/v1/machines"): None,
    ("GET", "/api/v1/machines/{name}"): None,
    ("DELETE", "/api/v1/machines/{name}"): None,
    ("POST", "/api/v1/machines/{name}/start"): None,
    ("POST", "/api/v1/machines/{name}/stop"): None,
    ("POST", "/api/v1/machines/{id}/exec"): None,
    ("GET", "/api/v1/machines/{id}/files/{path}"): None,
    ("PUT", "/api/v1/machines/{id}/files/{path}"): None,
    ("GET", "/api/v1/machines/{id}/logs"): None,
    ("POST", "/api/v1/machines/{id}/images/pull"): None,
    ("POST", "/api/v1/machines/{name}/branches"): None,
    ("GET", "/capacity"): "host scheduling numbers; no tool reports capacity",
    ("POST", "/api/v1/machines/{id}/exec/stream"): "results are returned whole, with the output budget",
    ("GET", "/api/v1/machines/{id}/images"): "no tool lists a machine's images",
    ("POST", "/api/v1/machines/{id}/run"): "running another image on an overlay is not in the tool vocabulary",
    ("POST", "/api/v1/machines/{name}/fork"): "the legacy name of branches",
    ("POST", "/api/v1/machines/{name}/fork-release"): "branch pools; this server has no pool vocabulary",
    ("POST", "/api/v1/machines/{name}/pause"): "no tool pauses or resumes a machine",
    ("POST", "/api/v1/machines/{name}/resume"): "no tool pauses or resumes a machine",
    ("POST", "/api/v1/machines/{name}/export"): "needs a pushToken minted by the control plane, which a local user "
                                                "cannot produce",
    ("POST", "/api/v1/machines/{name}/resize"): "no tool grows a machine after it exists",
    ("POST", "/api/v1/machines/{name}/sync"): "mounts are a create-time argument",
    ("GET", "/api/v1/machines/{name}/mounts"): "mounts are a create-time argument",
    ("POST", "/api/v1/machines/{name}/mounts"): "mounts are a create-time argument",
    ("DELETE", "/api/v1/machines/{name}/mounts"): "mounts are a create-time argument",
    ("PUT", "/api/v1/machines/{name}/ports"): "ports are a create-time argument",
    ("POST", "/api/v1/machines/{name}/egress"): "egress is decided at create, where the default is blocked",
    ("GET", "/api/v1/machines/{name}/egress-events"): "egress denial diagnostics; no tool reports them yet",
    ("GET", "/api/v1/machines/{name}/mediation-events"): "mediated egress is not used",
    ("PUT", "/api/v1/machines/{name}/credential-values"): "credential bindings are not used",
    ("POST", "/api/v1/machines/{name}/cache-disk/publish"): "cache disks are not used",
    ("DELETE", "/api/v1/cache-bases/{base}"): "cache disks are not used",
    **{(method, path): "fork pools and leases are a fleet surface, not an agent one" for method, path in (
        ("GET", "/api/v1/pools"), ("POST", "/api/v1/pools"), ("GET", "/api/v1/pools/{name}"),
        ("DELETE", "/api/v1/pools/{name}"), ("PUT", "/api/v1/pools/{name}/size"),
        ("POST", "/api/v1/pools/{name}/leases"), ("POST", "/api/v1/pools/{name}/lease-batches"),
        ("GET", "/api/v1/pools/{name}/leases/{lease}"), ("POST", "/api/v1/pools/{name}/leases/{lease}/heartbeat"),
        ("POST", "/api/v1/pools/{name}/leases/{lease}/complete"))},
    **{(method, path): "RL rollout executors are a batch surface, not an agent one" for method, path in (
        ("GET", "/api/v1/rollout-executors"), ("POST", "/api/v1/rollout-executors"),
        ("GET", "/api/v1/rollout-executors/{name}"), ("DELETE", "/api/v1/rollout-executors/{name}"),
        ("POST", "/api/v1/rollout-executors/{name}/generate"), ("POST", "/api/v1/rollout-executors/{name}/batches"),
        ("POST", "/api/v1/rollout-executors/{name}/policies"),
        ("POST", "/api/v1/rollout-executors/{name}/device-policies"),
        ("DELETE", "/api/v1/rollout-executors/{name}/policies/{policy}/{version}"))},
}


def parity_report(spec: dict) -> dict[str, list]:
    """Compare the serve's OpenAPI with LOCAL_ROUTES: what we call, what we
    skip and why, what is new (unknown) and what we call but it lacks (missing)."""
    offered = {(method.upper(), path) for path, operations in spec.get("paths", {}).items()
               for method in operations if method.lower() in ("get", "post", "put", "delete", "patch")}
    return {
        "called": sorted(route for route, reason in LOCAL_ROUTES.items() if reason is None and route in offered),
        "skipped": sorted((route, reason) for route, reason in LOCAL_ROUTES.items()
                          if reason is not None and route in offered),
        "unknown": sorted(offered - set(LOCAL_ROUTES)),
        "missing": sorted(route for route, reason in LOCAL_ROUTES.items() if reason is None and route not in offered),
    }


def serve_dropped(action: str, exc: BaseException) -> SmolError:
    """The serve closed the connection mid-call: it stopped or restarted."""
    return SmolError(f"the local serve closed the connection while trying to {action} ({type(exc).__name__}); it may "
                     "have stopped or restarted. Check the machine with get-machine before trying again.")


def api_error(fleet: str, action: str, status: int, content_type: str, data: bytes) -> ApiError:
    """Build an ApiError from either error shape the serve uses: JSON
    ``{"error", "code"}`` from handlers, plain text from the request parser."""
    text = data.decode("utf-8", "replace").strip()
    code = ""
    if "application/json" in content_type:
        try:
            parsed = json.loads(text)
            text, code = str(parsed.get("error") or text), str(parsed.get("code") or "")
        except (ValueError, AttributeError):
            pass
    if not text:
        text = "no such route on this serve (it may be older than this server expects)" if status == 404 else "no message"
    return ApiError(fleet, action, status, code, text)


def parse_sse_lines(data: bytes) -> list[str]:
    """The data lines of a server-sent-event stream, one log line per event."""
    lines = []
    for raw in data.decode("utf-8", "replace").splitlines():
        if raw.startswith("data:"):
            lines.append(raw[5:].removeprefix(" "))
    return lines


def free_loopback_port() -> int:
    """A host port that is free right now, for a published port given without one."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _q(value: str, safe: str = "") -> str:
    return urllib.parse.quote(value, safe=safe)


def peer_closed(sock: socket.socket) -> bool:
    """Whether an idle kept-alive socket was closed by the other end (it then
    reads as ready, with nothing to read)."""
    import select
    readable, _, _ = select.select([sock], [], [], 0)
    return bool(readable)


class JsonStream:
    """Just enough of a JSON reader to walk a flat object arriving on a
    socket, a chunk at a time, without holding it whole."""

    CHUNK = 1 << 18  # big enough that a 64 MiB answer is a few hundred reads
    SPECIAL = re.compile(rb'[\\"]')

    def __init__(self, stream: Any):
        self.stream, self.buf, self.pos = stream, bytearray(), 0

    def _fill(self) -> bool:
        if self.pos > self.CHUNK:  # drop what was consumed, so the buffer stays a chunk or two
            del self.buf[:self.pos]
            self.pos = 0
        chunk = self.stream.read(self.CHUNK)
        self.buf += chunk
        return bool(chunk)

    def next_token(self) -> bytes:
        """The next byte that is not white space."""
        while True:
            while self.pos < len(self.buf) and self.buf[self.pos] in b" \t\r\n":
                self.pos += 1
            if self.pos < len(self.buf):
                self.pos += 1
                return bytes(self.buf[self.pos - 1:self.pos])
            if not self._fill():
                raise ValueError("the answer ended early")

    def string(self, sink: Callable[[bytes], None] | None) -> None:
        """Pass the raw bytes of the string being read to ``sink`` (None skips
        them) up to its closing quote; escapes are passed through undecoded."""
        while True:
            found = self.SPECIAL.search(self.buf, self.pos)
            if found is None:
                if sink is not None:
                    sink(bytes(self.buf[self.pos:]))
                self.pos = len(self.buf)
                if not self._fill():
                    raise ValueError("a string did not end")
                continue
            end = found.start()
            if self.buf[end] == 0x5C:  # a backslash: the next byte is escaped, whatever it is
                while end + 1 >= len(self.buf):
                    consumed = self.pos
                    if not self._fill():
                        raise ValueError("a string did not end")
                    end -= consumed - self.pos  # _fill may have dropped the consumed part
                if sink is not None:
                    sink(bytes(self.buf[self.pos:end + 2]))
                self.pos = end + 2
                continue
            if sink is not None:
                sink(bytes(self.buf[self.pos:end]))
            self.pos = end + 1
            return

    def skip_string(self) -> None:
        """Skip the string being read. Only quotes are looked at: one is the end
        unless an odd run of backslashes comes before it. (Per-escape steps
        would crawl through output with a newline every few bytes.)"""
        carried = 0  # the backslashes that ended the part already consumed
        while True:
            quote = self.buf.find(b'"', self.pos)
            if quote < 0:
                rest = bytes(self.buf[self.pos:])
                run = len(rest) - len(rest.rstrip(b"\\"))
                carried = run + carried if run == len(rest) else run
                self.pos = len(self.buf)
                if not self._fill():
                    raise ValueError("a string did not end")
                continue
            before = bytes(self.buf[self.pos:quote])
            run = len(before) - len(before.rstrip(b"\\"))
            if run == len(before):
                run += carried
            self.pos = quote + 1
            if run % 2 == 0:
                return
            carried = 0  # an escaped quote: the string goes on

    def scalar(self, first: bytes) -> Any:
        """A number, true, false or null that began with ``first``."""
        token = bytearray(first)
        while True:
            while self.pos < len(self.buf) and self.buf[self.pos] not in b",}] \t\r\n":
                token.append(self.buf[self.pos])
                self.pos += 1
            if self.pos < len(self.buf) or not self._fill():
                return json.loads(token)


class Base64Sink:
    """Decode base64 that arrives in pieces into ``output``. It decodes in
    4-character blocks, so a piece's remainder waits for the next one."""

    def __init__(self, output: bytearray):
        self.output, self.pending = output, bytearray()

    def __call__(self, raw: bytes) -> None:
        self.pending += raw
        usable = len(self.pending) // 4 * 4
        self.output += base64.b64decode(bytes(self.pending[:usable]), validate=True)
        del self.pending[:usable]

    def close(self) -> None:
        if self.pending:
            raise ValueError("a base64 field ended mid-block")


def read_exec_answer(stream: Any) -> dict:
    """Read a local exec answer keeping only exitCode and the byte-exact
    stdoutB64 and stderrB64, decoded as they arrive. The lossy text copies of
    the two streams are skipped: holding the whole answer would cost about seven
    times the output's size in memory."""
    reader = JsonStream(stream)
    answer: dict[str, Any] = {"exitCode": None, "stdoutB64": bytearray(), "stderrB64": bytearray()}
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
            sink = Base64Sink(answer[key])
            reader.string(sink)
            sink.close()
        elif first == b'"':
            reader.skip_string()  # the lossy text copy, or a field this server does not read
        else:
            value = reader.scalar(first)
            if key == "exitCode":
                answer["exitCode"] = value
        token = reader.next_token()
    if answer["exitCode"] is None:
        raise ValueError("no exitCode")
    return answer


def serve_process_on(pid: int, socket_path: str) -> bool:
    """Whether ``pid`` is a smolvm serve listening on ``socket_path``: checked
    before signalling a pid read from a file, which could have been reused."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False  # gone, or no /proc (macOS): leave it be
    return b"serve" in cmdline and socket_path.encode() in cmdline


def _read_from(path: Path, offset: int) -> str:
    with open(path, "rb") as f:
        f.seek(offset)
        return f.read().decode("utf-8", "replace")


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.startswith("note:")]
    return lines[-1] if lines else ""


# ---------------------------------------------------------------------------
# 4. Cloud fleet: the smol cloud REST API
#
# httpx2 to $SMOL_CLOUD_URL with a bearer token. The cloud names a machine by a
# mach-... id; a name is resolved with one list call. Routes, bodies and the
# places where the official client and the live service disagree are in
# reference/smol-cloud-api.md: the client is followed, the service's observed
# behaviour is kept as a fallback.
# ---------------------------------------------------------------------------

CLOUD_TIMEOUT_SECS = 30
LOG_WINDOW_LINES = 10000  # the most log lines one cloud read asks for
CLOUD_RETRY_STATUSES = (408, 429, 502, 503, 504)
CLOUD_BLOCKED = {"mode": "blocked"}
# A deny-all for a service that refuses the "blocked" spelling: RFC 5737
# TEST-NET-1, reserved for documentation and routed nowhere. An empty
# allow-list is a 400 there, so the list is never sent empty.
CLOUD_BLOCKED_FALLBACK = {"mode": "allowCidrs", "cidrs": ["192.0.2.0/24"], "hosts": []}
CLOUD_EXEC_SCRIPT_READ = 'wc -c < "$1" && tail -c +$(($2 + 1)) "$1" | head -c "$3" | base64'
CLOUD_EXEC_SCRIPT_WRITE = 'mkdir -p "$(dirname "$1")" && base64 -d > "$1" && wc -c < "$1"'


class CloudFleet:
    """The machines of a smol cloud account. Blocking, like LocalFleet: the
    tool layer calls it from worker threads."""

    name = "cloud"

    def __init__(self, config: Config):
        import httpx2
        self.config = config
        self._client = httpx2.Client(
            base_url=config.cloud_url.rstrip("/"), timeout=CLOUD_TIMEOUT_SECS,
            headers={"Authorization": f"Bearer {config.cloud_token}", "User-Agent": f"smol-mcp/{__version__}"})
        self._blocked = CLOUD_BLOCKED  # becomes the fallback if the service refuses this spelling
        self._files_route = True  # False once the service has answered 404 for the suffix route

    def acquire(self) -> None:
        """Sessions share one HTTP client; nothing to start."""

    def release(self) -> None:
        """Nothing to stop: the cloud keeps no connection state of ours."""

    # -- HTTP --------------------------------------------------------------

    def request(self, action: str, method: str, path: str, payload: Any = None, *, raw: bytes | None = None,
                params: dict | None = None, timeout: float = CLOUD_TIMEOUT_SECS) -> Any:
        """One call with retries where they are safe: 429 always (it never ran),
        the other retryable statuses only for idempotent methods."""
        import httpx2
        if not self.config.cloud_token:
            raise SmolError("the cloud fleet needs an account key: set SMOL_CLOUD_TOKEN (or cloudToken in the "
                            "config file)")
        attempt = 0
        while True:
            try:
                response = self._client.request(
                    method, path, json=payload, content=raw, params=params, timeout=timeout,
                    headers={"Content-Type": "application/octet-stream"} if raw is not None else None)
            except httpx2.TimeoutException:
                raise SmolError(f"the cloud API did not answer within {timeout:.0f} s while trying to {action}") from None
            except httpx2.TransportError as exc:
                raise SmolError(f"could not reach the cloud API at {self.config.cloud_url} to {action}: "
                                f"{redact(str(exc), self.config.secret_values()) or type(exc).__name__}") from None
            retryable = response.status_code == 429 or (
                response.status_code in CLOUD_RETRY_STATUSES and method in ("GET", "PUT", "DELETE"))
            if retryable and attempt < 3:
                attempt += 1
                delay = _retry_after(response)
                time.sleep(min(0.5 * 2 ** attempt if delay is None else delay, 30))
                continue
            break
        if response.status_code >= 400:
            raise cloud_error(action, response, self.config.secret_values())
        if "application/json" in response.headers.get("content-type", ""):
            return response.json() if response.content else None
        return response.content

    # -- machines (normalised) ---------------------------------------------

    def _find(self, name: str) -> dict:
        """The raw record of a machine given its name or its mach-... id."""
        for record in self._list_raw():
            if record.get("name") == name or record.get("id") == name:
                return record
        raise ApiError("cloud", f"find machine '{name}'", 404, "NOT_FOUND", f"machine '{name}' not found")

    def _list_raw(self) -> list[dict]:
        answer = self.request("list machines", "GET", "/v1/machines")
        # The official client accepts either shape; the service has sent a bare array.
        machines = answer.get("machines", []) if isinstance(answer, dict) else answer
        if not isinstance(machines, list):  # a proxy's or captive portal's page, say
            raise SmolError(f"the cloud API at {self.config.cloud_url} answered the machine list "
                            "with something other than JSON (a proxy or captive portal in the "
                            "way?); check SMOL_CLOUD_URL and the network, then try again")
        return machines

    def list_machines(self) -> list[dict]:
        return [cloud_record(r) for r in self._list_raw()]

    def get_machine(self, name: str) -> dict:
        return cloud_record(self._find(name))

    def machine_state(self, name: str) -> str:
        return self.get_machine(name)["state"]

    def create_machine(self, spec: MachineSpec) -> dict:
        for argument, given in (("mounts", spec.mounts), ("overlayGb", spec.overlay_gb), ("cmd", spec.cmd)):
            if given:
                raise ArgumentError(f'"{argument}" is local only: the cloud fleet has no host directories, overlay '
                                    "disk or workload command to set; leave it out for a cloud machine")
        if any(port.get("host") for port in spec.ports):
            raise ArgumentError('"ports[].host" is local only: the cloud control plane picks the host port; pass only '
                                "the guest port")
        open_egress = spec.network == "open" or spec.allow_hosts or spec.allow_cidrs
        if spec.ports and not open_egress:
            raise ArgumentError('a cloud machine that publishes ports cannot also block egress; pass network: "open" '
                                "(or an allow-list) with ports, or leave the ports out")
        body: dict[str, Any] = {
            "name": spec.name,
            "source": {"type": "image", "reference": spec.image},
            "resources": {"diskGb": spec.storage_gb, "cpus": spec.cpus, "memoryMb": spec.memory_mb},
            # Ephemeral is expressed as a TTL and an idle stop; the service has no
            # "ephemeral" create field, and a machine it deletes on stop could never be started.
            "ttlSeconds": self.config.ephemeral_ttl_secs if spec.ephemeral else None,
            "autoStopSeconds": self.config.ephemeral_auto_stop_secs if spec.ephemeral else None,
            "forkable": spec.branchable,  # branchability is a create field on the cloud
            "network": self._network(spec),
            "ports": [{"port": p["guest"]} for p in spec.ports],
            "env": spec.env,
        }
        action = f"create machine '{spec.name}'"
        try:
            return cloud_record(self.request(action, "POST", "/v1/machines", body))
        except ApiError as err:
            if body["network"] is not CLOUD_BLOCKED or err.status not in (400, 422) or "blocked" not in err.api_message:
                raise
        # This service predates the "blocked" spelling: deny with the allow-list form from now on.
        log.info("the cloud API refused network mode \"blocked\"; denying egress with an allow-list of 192.0.2.0/24")
        self._blocked = body["network"] = CLOUD_BLOCKED_FALLBACK
        return cloud_record(self.request(action, "POST", "/v1/machines", body))

    def _network(self, spec: MachineSpec) -> dict:
        """Always a policy: on the cloud an omitted one means open egress."""
        if spec.allow_hosts or spec.allow_cidrs:
            return {"mode": "allowCidrs", "cidrs": spec.allow_cidrs, "hosts": spec.allow_hosts}
        return {"mode": "open"} if spec.network == "open" else self._blocked

    def start_machine(self, name: str, branchable: bool = False) -> dict:
        record = self._find(name)
        # The official client repeats branchability on the first start of a branch source.
        params = {"forkable": "true"} if branchable else None
        self.request(f"start machine '{name}'", "POST", f"/v1/machines/{record['id']}/start", params=params,
                     timeout=self.config.ready_timeout_secs + 60)
        return cloud_record(self.request(f"get machine '{name}'", "GET", f"/v1/machines/{record['id']}"))

    def stop_machine(self, name: str) -> dict:
        record = self._find(name)
        self.request(f"stop machine '{name}'", "POST", f"/v1/machines/{record['id']}/stop", timeout=360)
        return cloud_record(self.request(f"get machine '{name}'", "GET", f"/v1/machines/{record['id']}"))

    def delete_machine(self, name: str) -> dict:
        """Delete and return the settled bill, which the service computes at teardown."""
        record = self._find(name)
        usage = self.request(f"delete machine '{name}'", "DELETE", f"/v1/machines/{record['id']}",
                             params={"includeUsage": "true"}, timeout=120)
        return {"deleted": name, **({"usage": usage} if isinstance(usage, dict) else {})}

    def _exec(self, machine_id: str, name: str, argv: list[str], timeout_secs: int, workdir: str | None = None,
              env: dict[str, str] | None = None, stdin: str | None = None) -> tuple[dict, float]:
        body: dict[str, Any] = {"command": argv, "env": env or {}, "cwd": workdir, "timeoutSeconds": timeout_secs}
        if stdin is not None:
            body["stdin"] = stdin
        started = time.monotonic()
        answer = self.request(f"run a command in machine '{name}'", "POST", f"/v1/machines/{machine_id}/exec",
                              body, timeout=max(CLOUD_TIMEOUT_SECS, timeout_secs + 30))
        return answer, time.monotonic() - started

    def exec(self, name: str, argv: list[str], *, timeout_secs: int, workdir: str | None = None,
             env: dict[str, str] | None = None, stdin: str | None = None) -> ExecResult:
        """Run a command in a running machine; NotRunning if it is not running
        (cloud exec would start it silently)."""
        record = self._find(name)
        if record.get("state") not in RUNNING_STATES:
            raise NotRunning(f"machine '{name}' is not running")
        answer, seconds = self._exec(record["id"], name, argv, timeout_secs, workdir, env, stdin)
        cut = tuple(stream for stream in ("stdout", "stderr")
                    if answer.get(f"{stream}Truncated") and not answer.get(f"{stream}B64"))
        return ExecResult(exit_code=int(answer["exitCode"]), stdout=exec_stream(answer, "stdout"),
                          stderr=exec_stream(answer, "stderr"), seconds=seconds, cut_by_service=cut)

    def probe_ready(self, name: str) -> str | None:
        """None once a command runs in the guest. The service's own `ready`
        flag waits for published ports to answer too, so it is not the test."""
        record = self._find(name)
        state = record.get("state")
        if state in ("error", "stopped", "deleted"):
            raise SmolError(f"machine '{name}' is {state} instead of starting; its log (machine-logs) may say why")
        if state not in RUNNING_STATES:
            return f"state {state}"
        try:
            self._exec(record["id"], name, READY_PROBE, 10)
            return None
        except ApiError as err:
            if err.status in (401, 403, 404):
                raise
            return err.api_message

    def read_file(self, name: str, path: str, offset: int, length: int) -> FilePage:
        record = self._find(name)
        if self._files_route:
            try:
                return self._read_by_route(record["id"], name, path, offset, length)
            except ApiError as err:
                if err.status != 404:
                    raise
                # 404 is a missing file or a service without the suffix route; exec tells which.
        return self._read_by_exec(record["id"], name, path, offset, length)

    def _read_by_route(self, machine_id: str, name: str, path: str, offset: int, length: int) -> FilePage:
        url = f"/v1/machines/{machine_id}/files/{cloud_file_path(path)}"
        with self._client.stream("GET", url, timeout=CLOUD_TIMEOUT_SECS + 430) as response:
            if response.status_code >= 400:
                response.read()
                raise cloud_error(f"read {path} in machine '{name}'", response, self.config.secret_values())
            size = int(response.headers.get("content-length", -1))
            page, seen = bytearray(), 0
            for chunk in response.iter_bytes():
                if seen + len(chunk) > offset and len(page) < length:
                    start = max(0, offset - seen)
                    page += chunk[start:start + length - len(page)]
                seen += len(chunk)
                if len(page) >= length and size >= 0:
                    break
            return FilePage(data=bytes(page), size=size if size >= 0 else seen, offset=offset)

    def _read_by_exec(self, machine_id: str, name: str, path: str, offset: int, length: int) -> FilePage:
        """The fallback for a service without the files route: the size and one
        page, base64 on stdout. A page the exec response cap cut is refused:
        returning it short would look like the end of the file."""
        answer, _ = self._exec(machine_id, name, ["sh", "-c", CLOUD_EXEC_SCRIPT_READ, "sh", path, str(offset),
                                                  str(length)], 120)
        stdout = exec_stream(answer, "stdout")
        if answer.get("exitCode") != 0:
            error = exec_stream(answer, "stderr").decode("utf-8", "replace").strip()
            raise SmolError(f"could not read {path} in machine '{name}': {error or 'exit code ' + str(answer.get('exitCode'))}")
        size_line, _, encoded = stdout.partition(b"\n")
        size = int(size_line.strip() or 0)
        try:
            data = base64.b64decode(encoded)
        except ValueError:
            data = b""
        if len(data) != max(0, min(length, size - offset)):
            # The service caps exec output; a page cut short would read as the end of the file.
            raise SmolError(f"the cloud API cut the output of the read of {path} short (its exec output cap), so "
                            "the page is not returned; ask for a smaller length")
        return FilePage(data=data, size=size, offset=offset)

    def write_file(self, name: str, path: str, data: bytes) -> int:
        record = self._find(name)
        if self._files_route:
            try:
                self.request(f"write {path} in machine '{name}'", "PUT",
                             f"/v1/machines/{record['id']}/files/{cloud_file_path(path)}", raw=data,
                             timeout=CLOUD_TIMEOUT_SECS + len(data) / (256 * 1024))
                return len(data)
            except ApiError as err:
                if err.status != 404:
                    raise
                self._files_route = False  # a PUT cannot 404 for a missing file: the route is missing
                log.info("the cloud API has no files route here; reading and writing files through exec")
        answer, _ = self._exec(record["id"], name, ["sh", "-c", CLOUD_EXEC_SCRIPT_WRITE, "sh", path], 120,
                               stdin=base64.b64encode(data).decode("ascii"))
        if answer.get("exitCode") != 0:
            error = exec_stream(answer, "stderr").decode("utf-8", "replace").strip()
            raise SmolError(f"could not write {path} in machine '{name}': {error}")
        return int(exec_stream(answer, "stdout").strip() or len(data))

    def console_lines(self, name: str) -> list[str]:
        """The machine's console log, as the official client reads it (plain
        text, the last lines only)."""
        record = self._find(name)
        text = self.request(f"read the log of machine '{name}'", "GET", f"/v1/machines/{record['id']}/logs",
                            params={"tail": str(LOG_WINDOW_LINES)})
        if isinstance(text, (dict, list)):
            text = json.dumps(text)
        return (text.decode("utf-8", "replace") if isinstance(text, bytes) else str(text or "")).splitlines()

    def branch_machine(self, name: str, child: str) -> dict:
        record = self._find(name)
        body = {"name": child, "ports": []}
        action = f"branch machine '{name}' into '{child}'"
        try:
            created = self.request(action, "POST", f"/v1/machines/{record['id']}/branches", body, timeout=1800)
        except ApiError as err:
            if err.status != 404:
                raise
            # Older control planes only have the fork route (the source exists: it was just found).
            created = self.request(action, "POST", f"/v1/machines/{record['id']}/fork", body, timeout=1800)
        return cloud_record(created)

    def pull_image(self, name: str, image: str) -> dict:
        raise ArgumentError("pull-image is local only: the cloud control plane pulls a machine's image itself when "
                            "the machine is created")


def cloud_file_path(path: str) -> str:
    """The files route takes the path as a suffix, each segment percent-encoded
    and the leading slash kept, as the official client sends it."""
    return "/".join(urllib.parse.quote(segment, safe="") for segment in path.split("/"))


def exec_stream(answer: dict, stream: str) -> bytes:
    """One output stream of a cloud exec: the byte-exact base64 family when the
    service sent it, else the text (capped at 1 MiB by the service)."""
    encoded = answer.get(f"{stream}B64")
    if encoded:
        return base64.b64decode(encoded)
    return str(answer.get(stream) or "").encode("utf-8")


def cloud_error(action: str, response: Any, secret_values: list[str]) -> ApiError:
    """An ApiError from the cloud's error bodies: plain text for most statuses,
    JSON with code and error for some, an empty body for a missing key."""
    status = response.status_code
    text, code = response.text.strip(), ""
    if "application/json" in response.headers.get("content-type", ""):
        try:
            parsed = response.json()
            text, code = str(parsed.get("error") or parsed.get("message") or text), str(parsed.get("code") or "")
        except (ValueError, AttributeError):
            pass
    if status == 401:
        text = (f"the account key was refused ({text or 'no detail'}); check SMOL_CLOUD_TOKEN")
    elif not text:
        text = "no message"
    err = ApiError("cloud", action, status, code, redact(text, secret_values))
    request_id = response.headers.get("x-request-id")
    if request_id:
        err.args = (f"{err.args[0]} [request id {request_id}]",)
    return err


def _retry_after(response: Any) -> float | None:
    value = response.headers.get("retry-after", "")
    return float(value) if value.replace(".", "", 1).isdigit() else None


# ---------------------------------------------------------------------------
# 5. Normalised records
#
# A machine has the same keys on every fleet, null where a fleet has no such
# value, so no tool handler (and no agent) needs to know which API answered.
# ---------------------------------------------------------------------------

MACHINE_KEYS = ("id", "name", "state", "image", "cpus", "memoryMb", "network", "ports", "createdAt", "pid", "url",
                "branchable", "parent")


def local_record(info: dict) -> dict:
    """A local MachineInfo in the shared vocabulary. The local API names a
    machine only by its name, so ``id`` is the name too."""
    if info.get("network"):
        network = "open"
    elif info.get("allowedHosts") or info.get("allowedCidrs"):
        network = "allowlist"
    else:
        network = "blocked"
    return {
        "id": info["name"],
        "name": info["name"],
        "state": info.get("state"),
        "image": info.get("image"),
        "cpus": info.get("cpus"),
        "memoryMb": info.get("memoryMb"),
        "network": network,
        "ports": [{"guest": p.get("guest"), "host": p.get("host")} for p in info.get("ports") or []],
        "createdAt": iso_time(info.get("createdAt")),
        "pid": info.get("pid"),
        "url": None,  # the local fleet has no public ingress
        "branchable": bool(info.get("branchable") or info.get("forkable")),
        "parent": info.get("parentMachine"),
    }


def cloud_record(info: dict) -> dict:
    """A cloud machine in the shared vocabulary."""
    network = info.get("network") if isinstance(info.get("network"), dict) else {}
    mode = network.get("mode")
    if mode == "open":
        egress = "open"
    elif mode == "blocked" or (mode == "allowCidrs" and network.get("cidrs") == CLOUD_BLOCKED_FALLBACK["cidrs"]
                               and not network.get("hosts")):
        egress = "blocked"
    elif mode == "allowCidrs":
        egress = "allowlist"
    else:
        egress = None  # a record that does not echo its policy: unknown, not guessed
    source = info.get("source") if isinstance(info.get("source"), dict) else {}
    resources = info.get("resources") if isinstance(info.get("resources"), dict) else {}
    return {
        "id": info.get("id"),
        "name": info.get("name") or info.get("id"),
        "state": info.get("state"),
        "image": source.get("reference") or info.get("image"),
        "cpus": resources.get("cpus"),
        "memoryMb": resources.get("memoryMb"),
        "network": egress,
        "ports": [{"guest": p.get("port"), "host": p.get("hostPort")} for p in info.get("ports") or []],
        "createdAt": iso_time(info.get("createdAt")),
        "pid": None,  # the VM process runs on a node we cannot see
        "url": info.get("url"),
        "branchable": bool(info.get("branchable", info.get("forkable", False))),
        "parent": info.get("parent") or info.get("sourceMachineId"),
    }


def iso_time(value: Any) -> str | None:
    """Unix seconds as RFC 3339 UTC, the form the cloud API uses."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return datetime.datetime.fromtimestamp(value, datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    return value if isinstance(value, str) else None


# ---------------------------------------------------------------------------
# 6. Output budget
#
# A tool result is read by a model with a context budget. A stream longer than
# maxOutputBytes keeps its head and its tail, says how much fell between, and
# the whole stream is written into the machine so nothing is lost.
# ---------------------------------------------------------------------------

OVERFLOW_DIR = "/tmp/smol-mcp-output"


def utf8_prefix_end(data: bytes, end: int) -> int:
    """Largest cut <= end that does not split a UTF-8 character."""
    end = min(end, len(data))
    cut = end
    while cut > 0 and cut > end - 4 and (data[cut - 1] & 0xC0) == 0x80:
        cut -= 1
    if cut > 0 and data[cut - 1] >= 0xC0:  # a lead byte whose character is not complete before `end`
        need = 2 if data[cut - 1] < 0xE0 else 3 if data[cut - 1] < 0xF0 else 4
        if end - (cut - 1) < need:
            return cut - 1
    return end


def utf8_suffix_start(data: bytes, start: int) -> int:
    """Smallest cut >= start that begins a UTF-8 character."""
    while start < len(data) and (data[start] & 0xC0) == 0x80:
        start += 1
    return start


def head_and_tail(data: bytes, limit: int, where: str) -> tuple[str, int]:
    """The text to return for one stream and how many bytes were left out.
    ``where`` finishes the marker sentence (where the whole stream is)."""
    if len(data) <= limit:
        return data.decode("utf-8", "replace"), 0
    head_end = utf8_prefix_end(data, limit // 2)
    tail_start = utf8_suffix_start(data, len(data) - (limit - limit // 2))
    omitted = tail_start - head_end
    marker = f"\n[... smol-mcp: {omitted} bytes omitted here; {where} ...]\n"
    return data[:head_end].decode("utf-8", "replace") + marker + data[tail_start:].decode("utf-8", "replace"), omitted


# ---------------------------------------------------------------------------
# 7. Argument validation
#
# The SDK does not validate tool arguments, so this does, against the same
# JSON Schema the client is shown. Every refusal names the argument, and an
# unknown one gets the nearest accepted name, because `memory` for `memoryMb`
# is the usual mistake and the API's own message would not say which tool.
# ---------------------------------------------------------------------------

NAME_PATTERN = "^[A-Za-z0-9][A-Za-z0-9_-]{0,127}$"
ABSOLUTE_PATH_PATTERN = "^/"
FILE_PATH_PATTERN = "^/.*[^/]$"
PATTERN_RULES = {
    FILE_PATH_PATTERN: "must be the absolute path of a file (starting with /, not ending with /)",
    NAME_PATTERN: "must start with a letter or digit and hold only letters, digits, '-' and '_' (at most 128)",
    ABSOLUTE_PATH_PATTERN: "must be an absolute path (starting with /)",
    "^[A-Za-z_][A-Za-z0-9_]*$": "must be a variable name: letters, digits and '_', not starting with a digit",
}
TYPE_WORDS = {"string": "a string", "integer": "a whole number", "boolean": "true or false", "array": "a list",
              "object": "an object"}


def validate_arguments(tool: str, schema: dict, arguments: dict) -> dict:
    """Check ``arguments`` against the tool's input schema; raise ArgumentError
    naming the first argument that is unknown, missing, mistyped or out of range."""
    if not isinstance(arguments, dict):
        raise ArgumentError(f"{tool} takes an object of named arguments")
    properties = schema.get("properties", {})
    for key in arguments:
        if key not in properties:
            hint = difflib.get_close_matches(key, properties, n=1, cutoff=0.5)
            maybe = f' (did you mean "{hint[0]}"?)' if hint else ""
            raise ArgumentError(f'{tool} has no argument "{key}"{maybe}; it accepts: {", ".join(properties) or "none"}')
    for key in schema.get("required", []):
        if key not in arguments:
            raise ArgumentError(f'{tool} needs the argument "{key}": {properties[key].get("description", "")}'.rstrip(": "))
    for key, value in arguments.items():
        _check(properties[key], value, key)
    return arguments


def _type_ok(kind: str, value: Any) -> bool:
    if kind == "integer":
        return isinstance(value, int) and not isinstance(value, bool)  # JSON true is not 1
    return isinstance(value, {"string": str, "boolean": bool, "array": list, "object": dict}[kind])


def _check(schema: dict, value: Any, where: str) -> None:
    if "oneOf" in schema:
        errors = []
        for option in schema["oneOf"]:
            try:
                _check(option, value, where)
                return
            except ArgumentError as err:
                errors.append(str(err))
        for option, error in zip(schema["oneOf"], errors):
            if _type_ok(option["type"], value):
                raise ArgumentError(error)  # the right kind of value, wrong in its details: say which
        kinds = " or ".join(TYPE_WORDS[option["type"]] for option in schema["oneOf"])
        raise ArgumentError(f'"{where}" must be {kinds}, got {json.dumps(value)[:60]}')
    kind = schema.get("type")
    if kind and not _type_ok(kind, value):
        raise ArgumentError(f'"{where}" must be {TYPE_WORDS[kind]}, got {json.dumps(value)[:60]}')
    if "enum" in schema and value not in schema["enum"]:
        raise ArgumentError(f'"{where}" must be one of {", ".join(json.dumps(v) for v in schema["enum"])}; got {json.dumps(value)[:60]}')
    if kind == "integer":
        if "minimum" in schema and value < schema["minimum"]:
            raise ArgumentError(f'"{where}" must be at least {schema["minimum"]}, got {value}')
        if "maximum" in schema and value > schema["maximum"]:
            raise ArgumentError(f'"{where}" must be at most {schema["maximum"]}, got {value}')
    if kind == "string":
        if len(value) < schema.get("minLength", 0):
            raise ArgumentError(f'"{where}" must not be empty')
        if "maxLength" in schema and len(value) > schema["maxLength"]:
            raise ArgumentError(f'"{where}" must be at most {schema["maxLength"]} characters long')
        if "pattern" in schema and not re.search(schema["pattern"], value):
            rule = PATTERN_RULES.get(schema["pattern"], f"must match {schema['pattern']}")
            raise ArgumentError(f'"{where}" {rule}; got {json.dumps(value)[:60]}')
    if kind == "array":
        if "minItems" in schema and len(value) < schema["minItems"]:
            raise ArgumentError(f'"{where}" must hold at least {schema["minItems"]} item(s)')
        for index, item in enumerate(value):
            _check(schema.get("items", {}), item, f"{where}[{index}]")
    if kind == "object":
        properties = schema.get("properties")
        if properties is not None:
            for key in value:
                if key not in properties:
                    hint = difflib.get_close_matches(key, properties, n=1, cutoff=0.5)
                    maybe = f' (did you mean "{hint[0]}"?)' if hint else ""
                    raise ArgumentError(f'"{where}" has no field "{key}"{maybe}; it accepts: {", ".join(properties)}')
            for key in schema.get("required", []):
                if key not in value:
                    raise ArgumentError(f'"{where}" needs the field "{key}"')
            for key, item in value.items():
                _check(properties[key], item, f"{where}.{key}")
        if isinstance(schema.get("additionalProperties"), dict):
            names = schema.get("propertyNames", {})
            for key, item in value.items():
                if names:
                    _check(names, key, f"{where}.{key}")
                _check(schema["additionalProperties"], item, f"{where}.{key}")


# ---------------------------------------------------------------------------
# 8. Tools
#
# Thirteen tools with the names, arguments and result shapes of the TypeScript
# smol-mcp. Each handler gets a Call (its fleet, its session, a way to run a
# blocking API call in a worker thread, a progress reporter) and the validated
# arguments, and returns the structured result. A SmolError becomes a tool
# error; anything else is logged and reported without a stack trace.
# ---------------------------------------------------------------------------

CLEANUP_TIMEOUT_SECS = 20
SESSION_CALL_SLOTS = 8  # blocking calls of one session that run at once; more wait their turn
DELETE_RETRY_PAUSE_SECS = 1
PROGRESS_INTERVAL_SECS = 5


def _string(description: str, **extra: Any) -> dict:
    return {"type": "string", "description": description, **extra}


def _integer(description: str, minimum: int = 1, **extra: Any) -> dict:
    return {"type": "integer", "description": description, "minimum": minimum, **extra}


def _object(properties: dict, required: tuple[str, ...] = ()) -> dict:
    return {"type": "object", "properties": properties, "required": list(required), "additionalProperties": False}


ARG_NAME = _string("The machine's name (list-machines shows them).", minLength=1, pattern=NAME_PATTERN)
ARG_IMAGE = _string("An OCI image reference, such as alpine or python:3.12-alpine.", minLength=1)
ARG_CPUS = _integer("Virtual CPUs (default from SMOL_MCP_CPUS).", maximum=255)
ARG_MEMORY = _integer("Memory in MiB (default from SMOL_MCP_MEMORY_MB).", minimum=128)
ARG_NETWORK = _string("Egress: \"blocked\" (the default) or \"open\". A registry image on the local fleet needs "
                      "\"open\" for its first pull.", enum=["open", "blocked"])
ARG_ALLOW_HOSTS = {"type": "array", "items": _string("A host name.", minLength=1),
                   "description": "Allow egress only to these host names (and their subdomains)."}
ARG_ALLOW_CIDRS = {"type": "array", "items": _string("A CIDR such as 10.0.0.0/8.", minLength=1),
                   "description": "Allow egress only to these address ranges."}
ARG_ENV = {"type": "object", "description": "Environment variables, as a map of name to value.",
           "propertyNames": {"type": "string", "pattern": "^[A-Za-z_][A-Za-z0-9_]*$"},
           "additionalProperties": {"type": "string"}}
ARG_COMMAND = {"description": "The command: a list of arguments run as is, or a string run with sh -c.",
               "oneOf": [{"type": "string", "minLength": 1}, {"type": "array", "minItems": 1, "items": {"type": "string"}}]}
ARG_TIMEOUT = _integer("Seconds before the command is killed (default SMOL_MCP_EXEC_TIMEOUT_SECS, at most "
                       "SMOL_MCP_MAX_EXEC_TIMEOUT_SECS).")
ARG_WORKDIR = _string("Working directory inside the machine (an absolute path).", pattern=ABSOLUTE_PATH_PATTERN)
ARG_STDIN = _string("Text piped to the command's standard input.")
ARG_PATH = _string("An absolute path of a file inside the machine.", pattern=FILE_PATH_PATTERN)
ARG_ENCODING = _string("utf8 (the default) for text, base64 for bytes.", enum=["utf8", "base64"])
ARG_WAIT = {"type": "boolean", "description": "Wait until a command has run in the guest before answering (default true)."}

OUT_MACHINE = {
    "type": "object", "description": "A machine, with the same keys on every fleet.",
    "properties": {
        "id": {"type": "string"}, "name": {"type": "string"}, "state": {"type": ["string", "null"]},
        "image": {"type": ["string", "null"]}, "cpus": {"type": ["integer", "null"]},
        "memoryMb": {"type": ["integer", "null"]}, "network": {"type": ["string", "null"]}, "ports": {"type": "array"},
        "createdAt": {"type": ["string", "null"]}, "pid": {"type": ["integer", "null"]},
        "url": {"type": ["string", "null"]}, "branchable": {"type": "boolean"}, "parent": {"type": ["string", "null"]},
    },
    "required": list(MACHINE_KEYS),
}
OUT_EXEC_PROPERTIES = {
    "stdout": {"type": "string"}, "stderr": {"type": "string"}, "exitCode": {"type": "integer"},
    "truncated": {"type": "boolean"}, "timedOut": {"type": "boolean"},
    "overflow": {"type": "array", "items": {"type": "string"}}, "startedMachine": {"type": "boolean"},
}


def _out(properties: dict) -> dict:
    return {"type": "object", "properties": properties, "required": list(properties)}


@dataclass(eq=False)  # compared and hashed by identity: tool_schema caches per tool
class ToolSpec:
    """One tool: what the client is shown, and the handler that answers it."""

    name: str
    title: str
    description: str
    input_schema: dict
    output_schema: dict
    handler: Callable
    read_only: bool = False
    destructive: bool = False
    idempotent: bool = False
    open_world: bool = False


class Call:
    """What one tool call needs: its fleet, its session, worker threads for the
    blocking API, and progress notifications for the long waits."""

    def __init__(self, app: "SmolMcp", session: "Session", fleet: Any, ctx: Any):
        self.app, self.session, self.fleet, self.ctx = app, session, fleet, ctx
        self.config = app.config
        self.started = time.monotonic()
        self._last_progress = -1.0

    async def api(self, function: Callable, *args: Any, waiting: str | None = None, **kwargs: Any) -> Any:
        """Run one blocking API call in a worker thread. A cancelled call stops
        waiting at once (the thread finishes on its own). With ``waiting``, a
        progress notification says so every few seconds until it returns."""
        import anyio
        run = functools.partial(anyio.to_thread.run_sync, functools.partial(function, *args, **kwargs),
                                abandon_on_cancel=True, limiter=self.session.call_slots())
        if waiting is None:
            return await run()
        async with anyio.create_task_group() as group:
            async def heartbeat() -> None:
                while True:
                    await self.progress(None, f"{waiting}: {int(time.monotonic() - self.started)} s so far")
                    await anyio.sleep(PROGRESS_INTERVAL_SECS)

            group.start_soon(heartbeat)
            try:
                value, failure = await run(), None
            except Exception as err:  # carried out of the group, which would wrap it in an ExceptionGroup
                value, failure = None, err
            group.cancel_scope.cancel()
        if failure is not None:
            raise failure
        return value

    async def create(self, function: Callable, *args: Any) -> Any:
        """Run a call that creates a machine to completion, even if the tool
        call is cancelled meanwhile: abandoned, it could create a machine after
        the cleanup had already run, and nobody would delete it."""
        import anyio
        with anyio.CancelScope(shield=True):
            work = functools.partial(function, *args)
            return await anyio.to_thread.run_sync(work, limiter=self.session.call_slots())

    async def progress(self, total: float | None, message: str) -> None:
        """A progress notification (a no-op unless the client asked for them).
        The value is the call's elapsed seconds, so it only ever increases."""
        if self.ctx is None:
            return
        done = max(round(time.monotonic() - self.started, 3), self._last_progress + 0.001)
        self._last_progress = done
        try:
            token = (self.ctx.meta or {}).get("progress_token")
            if self.ctx.request is not None and token is not None:
                # Plain-JSON HTTP replies cannot carry notifications, so these ride
                # the client's GET stream (handshake era), matched by their token.
                await self.ctx.session.send_progress_notification(token, done, total, message)
            else:
                await self.ctx.session.report_progress(done, total, message)
        except Exception:  # progress is a courtesy; a client that went away must not fail the call
            log.debug("progress notification not sent", exc_info=True)

    def new_ephemeral_name(self) -> str:
        return f"{self.config.machine_prefix}{secrets_module.token_hex(4)}"

    async def delete_quietly(self, name: str) -> None:
        """Delete a machine this call created, even while the call is being
        cancelled, and forget it; a failure here is logged, not raised over the
        error that got us here (the session's cleanup tries again)."""
        import anyio
        with anyio.CancelScope(shield=True):
            try:
                with anyio.fail_after(CLEANUP_TIMEOUT_SECS):
                    await anyio.to_thread.run_sync(self.fleet.delete_machine, name, abandon_on_cancel=True)
                self.session.forget(self.fleet.name, name)
            except ApiError as err:
                if err.status == 404:
                    self.session.forget(self.fleet.name, name)
                else:
                    log.warning("could not delete machine %s: %s", name, err)
            except Exception as err:
                log.warning("could not delete machine %s: %s", name, err)


def resolve_network(args: dict, default: str) -> tuple[str, list[str], list[str]]:
    """(network, allowHosts, allowCidrs) for a create. An allow-list narrows
    egress, so it cannot be combined with an explicit open or blocked."""
    hosts, cidrs = list(args.get("allowHosts") or []), list(args.get("allowCidrs") or [])
    for index, cidr in enumerate(cidrs):
        try:
            ipaddress.ip_network(cidr, strict=False)
        except ValueError:
            raise ArgumentError(f'"allowCidrs[{index}]" must be an address range such as 10.0.0.0/8, got {cidr!r}') from None
    if (hosts or cidrs) and "network" in args:
        raise ArgumentError(f'"network": "{args["network"]}" cannot be combined with allowHosts/allowCidrs: an '
                            "allow-list already means egress to those destinations only. Pass one or the other.")
    if hosts or cidrs:
        return "blocked", hosts, cidrs
    return args.get("network", default), [], []


def exec_timeout(config: Config, args: dict) -> int:
    timeout = args.get("timeoutSecs", config.exec_timeout_secs)
    if timeout > config.max_exec_timeout_secs:
        raise ArgumentError(f'"timeoutSecs" is {timeout}, above the limit of {config.max_exec_timeout_secs} s '
                            "(SMOL_MCP_MAX_EXEC_TIMEOUT_SECS); ask for less, or split the work")
    return timeout


def command_argv(command: str | list[str]) -> list[str]:
    return ["sh", "-c", command] if isinstance(command, str) else list(command)


def explain_start_failure(err: Exception, network: str | None) -> Exception:
    """Add the one sentence that says what to do about a failed start."""
    if not isinstance(err, ApiError):
        return err
    text = err.api_message
    if network != "open" and ("registry" in text or "must be pulled" in text or "manifests" in text):
        return err.with_hint('The image has to be pulled from a registry and this machine has no egress; pass '
                             'network: "open" to create-machine (or run-once) to allow the pull')
    if "did not become ready" in text or "before the agent was ready" in text or "KvmOpen" in text:
        return err.with_hint("The microVM could not boot on this host; the smol://targets resource says whether a "
                             "usable hypervisor is present, and the machine's log (machine-logs) may say more")
    if "PORT_IN_USE" in err.code or "port" in text and "in use" in text:
        return err.with_hint("Another machine or process holds that host port; pick another in ports[].host")
    return err


async def wait_until_ready(call: Call, name: str) -> None:
    """Return once a command has actually run in the guest. The probe never
    boots a machine, so one stopped meanwhile is reported, not restarted."""
    import anyio
    limit = call.config.ready_timeout_secs
    started = time.monotonic()
    delay = 0.1
    while True:
        elapsed = time.monotonic() - started
        await call.progress(None, f"waiting for the guest of '{name}': {int(elapsed)} s of {limit} s")
        not_ready = await call.api(call.fleet.probe_ready, name)
        if not_ready is None:
            return
        if time.monotonic() - started >= limit:
            raise SmolError(f"the guest of machine '{name}' did not run a command within {limit} s "
                            f"(readyTimeoutSecs); its last answer: {not_ready}")
        await anyio.sleep(delay)
        delay = min(delay * 2, 2.0)


async def start_and_wait(call: Call, name: str, branchable: bool = False) -> dict:
    record = await call.api(call.fleet.start_machine, name, branchable, waiting=f"starting '{name}'")
    await wait_until_ready(call, name)
    return record


RUNNING_STATES = ("running", "started")  # the cloud reports "started" once the VM process launched


async def ensure_running(call: Call, name: str) -> bool:
    """Start a machine that is not running and wait for it; True if we started it."""
    if await call.api(call.fleet.machine_state, name) in RUNNING_STATES:
        return False
    await start_and_wait(call, name)
    return True


async def budget_exec(call: Call, name: str, result: ExecResult, timeout: int, keep_overflow: bool) -> dict:
    """The run-command result: both streams within the budget, and a stream
    that did not fit written whole into the machine, its path in ``overflow``."""
    limit = call.config.max_output_bytes
    shaped: dict[str, Any] = {"stdout": "", "stderr": "", "exitCode": result.exit_code, "truncated": False,
                              # 124 is what the guest reports for a command it killed at its timeout
                              "timedOut": result.exit_code == 124 and result.seconds >= timeout - 1, "overflow": []}
    stamp = f"{time.strftime('%Y%m%dT%H%M%S')}-{secrets_module.token_hex(3)}"
    for stream, data in (("stdout", result.stdout), ("stderr", result.stderr)):
        lost = ""
        if stream in result.cut_by_service:
            shaped["truncated"] = True
            lost = (f"\n[... smol-mcp: the cloud API cut {stream} here, at {len(data)} bytes; what followed was not "
                    "returned by the service and is lost ...]\n")
        if len(data) <= limit:
            shaped[stream] = data.decode("utf-8", "replace") + lost
            continue
        shaped["truncated"] = True
        where = ("run-once deletes its machine, so the whole stream was not kept; use create-machine and "
                 "run-command to keep it")
        if keep_overflow:
            path = f"{OVERFLOW_DIR}/{stamp}.{stream}"
            try:
                await call.api(call.fleet.write_file, name, path, data)
                shaped["overflow"].append(path)
                kept = "the first" if lost else "the whole"
                where = f"{kept} {len(data)} bytes of the stream are in the machine at {path} (read it with read-file)"
            except SmolError as err:
                where = f"the whole stream could not be saved in the machine: {err}"
        shaped[stream], _ = head_and_tail(data, limit, where)
        shaped[stream] += lost
    return shaped


# -- the handlers, in the order of the tools table ---------------------------

async def tool_list_machines(call: Call, args: dict) -> dict:
    return {"machines": await call.api(call.fleet.list_machines)}


async def tool_get_machine(call: Call, args: dict) -> dict:
    return {"machine": await call.api(call.fleet.get_machine, args["name"])}


def machine_spec(call: Call, args: dict, name: str, network_default: str) -> MachineSpec:
    network, hosts, cidrs = resolve_network(args, network_default)
    return MachineSpec(
        name=name, image=args["image"], ephemeral=call.session.is_ephemeral(name), cpus=args.get("cpus", call.config.cpus),
        memory_mb=args.get("memoryMb", call.config.memory_mb), network=network, allow_hosts=hosts, allow_cidrs=cidrs,
        ports=args.get("ports", []), mounts=args.get("mounts", []), storage_gb=args.get("storageGb"),
        overlay_gb=args.get("overlayGb"), cmd=args.get("cmd"), env=args.get("env", {}),
        branchable=args.get("branchable", False))


async def tool_create_machine(call: Call, args: dict) -> dict:
    name = args.get("name") or call.new_ephemeral_name()
    spec = machine_spec(call, args, name, call.config.network_default)
    start = args.get("start", True)
    if spec.branchable and not start and call.fleet.name == "local":
        raise ArgumentError('"branchable": true needs "start": true on the local fleet: the engine makes a machine '
                            "a branch source when it starts it")
    for index, mount in enumerate(spec.mounts):
        if not mount["source"].startswith("/"):
            raise ArgumentError(f'"mounts[{index}].source" must be an absolute host path, got {mount["source"]!r}')
    record = await create_recorded(call, name, call.fleet.create_machine, spec)
    ephemeral = call.session.is_ephemeral(name)
    if not start:
        return {"machine": record, "ephemeral": ephemeral, "ready": False}
    try:
        record = await start_and_wait(call, name, spec.branchable)
    except BaseException as err:
        await call.delete_quietly(name)
        if isinstance(err, Exception):
            raise explain_start_failure(err, spec.network) from None
        raise
    return {"machine": record, "ephemeral": ephemeral, "ready": True}


async def create_recorded(call: Call, name: str, create: Callable, *args: Any) -> dict:
    """Create a machine (or a branch child) so the session's record stays true:
    an ephemeral name is recorded before the call, so a crash right after it
    still cleans up, and forgotten only if the API refused it and this call
    was the one that recorded it."""
    added = call.session.is_ephemeral(name) and call.session.remember(call.fleet.name, name)
    try:
        return await call.create(create, *args)
    except SmolError:
        if added:
            call.session.forget(call.fleet.name, name)
        raise


async def tool_run_command(call: Call, args: dict) -> dict:
    name, argv, timeout = args["name"], command_argv(args["command"]), exec_timeout(call.config, args)
    options = dict(timeout_secs=timeout, workdir=args.get("workdir"), env=args.get("env"), stdin=args.get("stdin"))
    started_machine = False
    try:
        result = await call.api(call.fleet.exec, name, argv, waiting=f"running the command in '{name}'", **options)
    except NotRunning:
        # A stopped machine is started (and left running), the way the cloud API does it.
        await start_and_wait(call, name)
        started_machine = True
        result = await call.api(call.fleet.exec, name, argv, waiting=f"running the command in '{name}'", **options)
    shaped = await budget_exec(call, name, result, timeout, keep_overflow=True)
    return {**shaped, "startedMachine": started_machine}


async def tool_run_once(call: Call, args: dict) -> dict:
    timeout = exec_timeout(call.config, args)
    name = call.new_ephemeral_name()
    spec = machine_spec(call, args, name, call.config.run_once_network)
    try:
        await call.progress(None, f"creating {name} from {spec.image}")
        await create_recorded(call, name, call.fleet.create_machine, spec)
        try:
            await start_and_wait(call, name)
        except Exception as err:
            raise explain_start_failure(err, spec.network) from None
        result = await call.api(call.fleet.exec, name, command_argv(args["command"]), timeout_secs=timeout,
                                workdir=args.get("workdir"), env=args.get("env"), stdin=args.get("stdin"),
                                waiting=f"running the command in '{name}'")
        shaped = await budget_exec(call, name, result, timeout, keep_overflow=False)
        return {**shaped, "startedMachine": False, "name": name}
    finally:
        await call.delete_quietly(name)  # every path: success, error, timeout, cancellation


async def tool_read_file(call: Call, args: dict) -> dict:
    name, path, encoding = args["name"], args["path"], args.get("encoding", "utf8")
    offset = args.get("offset", 0)
    # base64 grows by a third, so its page is smaller to keep the reply within the budget
    limit = call.config.max_output_bytes if encoding == "utf8" else call.config.max_output_bytes * 3 // 4
    length = min(args.get("length", limit), limit)
    started_machine = await ensure_running(call, name)
    page = await call.api(call.fleet.read_file, name, path, offset, length)
    data = page.data
    if encoding == "utf8":
        if offset + len(data) < page.size:
            data = data[:utf8_prefix_end(data, len(data))]  # end the page on a character boundary
            if not data and page.data:
                raise ArgumentError(f'"length" {length} is too short for the character at offset {offset}; ask for '
                                    "at least 4 bytes")
        try:
            content = data.decode("utf-8")
        except UnicodeDecodeError as err:
            raise ArgumentError(f"{path} is not UTF-8 text (byte {offset + err.start} is not); read it with "
                                'encoding: "base64", or start at another offset') from None
    else:
        content = base64.b64encode(data).decode("ascii")
    return {"path": path, "content": content, "encoding": encoding, "size": page.size, "offset": offset,
            "bytes": len(data), "eof": offset + len(data) >= page.size, "startedMachine": started_machine}


async def tool_write_file(call: Call, args: dict) -> dict:
    name, path, encoding = args["name"], args["path"], args.get("encoding", "utf8")
    if encoding == "base64":
        try:
            data = base64.b64decode(args["content"], validate=True)
        except ValueError:
            raise ArgumentError('"content" is not valid base64; send the bytes base64-encoded, or pass '
                                'encoding: "utf8" for text') from None
    else:
        data = args["content"].encode("utf-8")
    # Readiness first: a file written before the workload's file system is up
    # lands under a path the workload then mounts over, and is never seen.
    started_machine = await ensure_running(call, name)
    if not started_machine:
        await wait_until_ready(call, name)
    written = await call.api(call.fleet.write_file, name, path, data)
    return {"path": path, "bytes": written, "startedMachine": started_machine}


async def tool_start_machine(call: Call, args: dict) -> dict:
    name, wait = args["name"], args.get("wait", True)
    record = await call.api(call.fleet.get_machine, name)
    if record["state"] not in RUNNING_STATES:
        try:
            record = await call.api(call.fleet.start_machine, name)
        except Exception as err:
            raise explain_start_failure(err, record["network"]) from None
    if wait:
        await wait_until_ready(call, name)
    return {"machine": record, "ready": wait}


async def tool_branch_machine(call: Call, args: dict) -> dict:
    source, wait = args["name"], args.get("wait", True)
    child = args.get("childName") or call.new_ephemeral_name()
    try:
        record = await create_recorded(call, child, call.fleet.branch_machine, source, child)
    except ApiError as err:
        if err.status == 409 and any(word in err.api_message for word in ("forkable", "control socket", "branchable")):
            raise err.with_hint("The source must be running and created as a branch source: create-machine with "
                                "branchable: true, then branch it while it runs") from None
        raise
    ephemeral = call.session.is_ephemeral(child)
    if wait:
        try:
            await wait_until_ready(call, child)
        except BaseException:
            await call.delete_quietly(child)
            raise
    return {"machine": record, "ephemeral": ephemeral, "ready": wait}


async def tool_stop_machine(call: Call, args: dict) -> dict:
    return {"machine": await call.api(call.fleet.stop_machine, args["name"])}


async def tool_delete_machine(call: Call, args: dict) -> dict:
    result = await call.api(call.fleet.delete_machine, args["name"])
    call.session.forget(call.fleet.name, args["name"])
    return result


def line_digest(line: str) -> str:
    import hashlib
    return hashlib.sha256(line.encode()).hexdigest()[:12]


CURSOR_LINES = 3  # the run of lines a cursor recognises its place by


def log_cursor(lines: list[str], end: int) -> str:
    """Where a reader stopped: how many lines it has seen, and a digest of the
    last few, so the place is found again when the cloud's tail window has
    moved on (the cloud log route has no cursor of its own). Several lines,
    because one blank or repeated line is found in many places."""
    return f"{end}:{line_digest(chr(10).join(lines[max(0, end - CURSOR_LINES):end])) if end else ''}"


def lines_after_cursor(lines: list[str], cursor: str) -> int:
    """The index of the first line a reader holding ``cursor`` has not seen."""
    count, _, digest = cursor.partition(":")
    if not count.isdigit():
        raise ArgumentError(f'"cursor" must be a cursor returned by machine-logs, got {cursor!r}')
    seen = int(count)
    if seen == 0:
        return 0
    if seen <= len(lines) and log_cursor(lines, seen) == cursor:
        return seen
    for end in range(len(lines), 0, -1):  # the window moved: find the run of lines last seen
        if log_cursor(lines, end).partition(":")[2] == digest:
            return end
    return 0  # the log started again from scratch: all of it is new


async def tool_machine_logs(call: Call, args: dict) -> dict:
    """The guest console; with the last cursor, only what arrived since."""
    lines = await call.api(call.fleet.console_lines, args["name"])
    if "cursor" in args:
        start = lines_after_cursor(lines, args["cursor"])
    else:
        start = max(0, len(lines) - args.get("tail", call.config.logs_tail))
    picked, used = [], 0
    for line in lines[start:]:
        used += len(line.encode()) + 1
        if used > call.config.max_output_bytes and picked:
            break  # the rest comes with the next cursor
        picked.append(line)
    return {"lines": picked, "cursor": log_cursor(lines, start + len(picked))}


async def tool_pull_image(call: Call, args: dict) -> dict:
    return {"image": await call.api(call.fleet.pull_image, args["name"], args["image"])}


TOOLS: tuple[ToolSpec, ...] = (
    ToolSpec(
        "list-machines", "List machines",
        "List every machine on the fleet, with its state, image, size, egress and published ports. Changes nothing.",
        _object({}), _out({"machines": {"type": "array", "items": OUT_MACHINE}}), tool_list_machines,
        read_only=True, idempotent=True),
    ToolSpec(
        "get-machine", "Get a machine",
        "Show one machine: state, image, size, egress, ports, pid and whether it can be branched. Changes nothing.",
        _object({"name": ARG_NAME}, ("name",)), _out({"machine": OUT_MACHINE}), tool_get_machine,
        read_only=True, idempotent=True),
    ToolSpec(
        "create-machine", "Create a machine",
        "Create a new microVM from an OCI image and (by default) start it, answering once a command has run in it. "
        "Egress is blocked unless network is \"open\" or an allow-list is given. A name starting with the ephemeral "
        "prefix (mcp- by default), or no name, makes a machine that is deleted when this session ends; any other "
        "name persists. Uses host CPU, memory and disk while it exists.",
        _object({
            "name": {**ARG_NAME, "description": "Name for the machine; omit for an ephemeral one (mcp-xxxxxxxx)."},
            "image": ARG_IMAGE, "cpus": ARG_CPUS, "memoryMb": ARG_MEMORY, "network": ARG_NETWORK,
            "allowHosts": ARG_ALLOW_HOSTS, "allowCidrs": ARG_ALLOW_CIDRS,
            "ports": {"type": "array", "description": "Ports to publish: guest port, and optionally the host port.",
                      "items": _object({"guest": _integer("Port inside the machine.", maximum=65535),
                                        "host": _integer("Port on the host (default: a free one).", maximum=65535)},
                                       ("guest",))},
            "mounts": {"type": "array", "description": "Host directories to attach (local fleet only).",
                       "items": _object({"source": _string("Absolute host path."),
                                         "target": _string("Absolute path inside the machine.",
                                                           pattern=ABSOLUTE_PATH_PATTERN),
                                         "readonly": {"type": "boolean", "description": "Mount read-only."}},
                                        ("source", "target"))},
            "storageGb": _integer("Storage disk size in GiB."),
            "overlayGb": _integer("Overlay disk size in GiB (local fleet only)."),
            "cmd": {"type": "array", "items": {"type": "string"}, "description": "Workload command (local fleet only)."},
            "env": ARG_ENV,
            "branchable": {"type": "boolean", "description": "Make it a branch source for branch-machine."},
            "start": {"type": "boolean", "description": "Start it and wait for the guest (default true)."},
        }, ("image",)),
        _out({"machine": OUT_MACHINE, "ephemeral": {"type": "boolean"}, "ready": {"type": "boolean"}}),
        tool_create_machine, open_world=True),
    ToolSpec(
        "run-command", "Run a command in a machine",
        "Run a command inside the named machine (never on this host) and return its stdout, stderr and exit code. "
        "A non-zero exit is a result, not an error. Output beyond the budget keeps its head and tail, and the whole "
        "stream is saved in the machine at the path listed in overflow. A stopped machine is started first.",
        _object({"name": ARG_NAME, "command": ARG_COMMAND, "timeoutSecs": ARG_TIMEOUT, "workdir": ARG_WORKDIR,
                 "env": ARG_ENV, "stdin": ARG_STDIN}, ("name", "command")),
        _out(OUT_EXEC_PROPERTIES), tool_run_command, destructive=True, open_world=True),
    ToolSpec(
        "run-once", "Run a command in a throwaway machine",
        "Create a machine from an image, run one command in it, and delete the machine on every path (success, "
        "failure, timeout, cancellation). Egress is blocked unless network is \"open\" or an allow-list is given.",
        _object({"image": ARG_IMAGE, "command": ARG_COMMAND, "timeoutSecs": ARG_TIMEOUT, "workdir": ARG_WORKDIR,
                 "env": ARG_ENV, "stdin": ARG_STDIN, "cpus": ARG_CPUS, "memoryMb": ARG_MEMORY, "network": ARG_NETWORK,
                 "allowHosts": ARG_ALLOW_HOSTS, "allowCidrs": ARG_ALLOW_CIDRS}, ("image", "command")),
        _out({**OUT_EXEC_PROPERTIES, "name": {"type": "string"}}), tool_run_once, open_world=True),
    ToolSpec(
        "read-file", "Read a file from a machine",
        "Read a file inside the named machine, a page at a time: offset and length pick the bytes, size is the whole "
        "file, eof says whether this page reached its end. Never returns more than the output budget. Starts a "
        "stopped machine.",
        _object({"name": ARG_NAME, "path": ARG_PATH, "encoding": ARG_ENCODING,
                 "offset": _integer("First byte to read (default 0).", minimum=0),
                 "length": _integer("Bytes to read (default and maximum: the output budget).")}, ("name", "path")),
        _out({"path": {"type": "string"}, "content": {"type": "string"}, "encoding": {"type": "string"},
              "size": {"type": "integer"}, "offset": {"type": "integer"}, "bytes": {"type": "integer"},
              "eof": {"type": "boolean"}, "startedMachine": {"type": "boolean"}}),
        tool_read_file, idempotent=True),  # not read-only: it starts a stopped machine
    ToolSpec(
        "write-file", "Write a file into a machine",
        "Write a file inside the named machine, replacing any file at that path and creating parent directories. "
        "Waits until the guest runs commands first, so the file is not hidden by the workload's file system.",
        _object({"name": ARG_NAME, "path": ARG_PATH, "content": _string("The file's content."),
                 "encoding": ARG_ENCODING}, ("name", "path", "content")),
        _out({"path": {"type": "string"}, "bytes": {"type": "integer"}, "startedMachine": {"type": "boolean"}}),
        tool_write_file, destructive=True, idempotent=True),
    ToolSpec(
        "start-machine", "Start a machine",
        "Start a stopped machine and (by default) wait until a command has run in it. A running machine is left as it is.",
        _object({"name": ARG_NAME, "wait": ARG_WAIT}, ("name",)),
        _out({"machine": OUT_MACHINE, "ready": {"type": "boolean"}}), tool_start_machine, idempotent=True,
        open_world=True),
    ToolSpec(
        "branch-machine", "Branch a machine",
        "Copy a running branch source (created with branchable: true), memory and disks included, into a new child "
        "machine that starts where the source is. Without childName the child is ephemeral. Branching on the local "
        "fleet needs a Linux or macOS host.",
        _object({"name": {**ARG_NAME, "description": "The running, branchable source machine."},
                 "childName": {**ARG_NAME, "description": "Name for the child; omit for an ephemeral one."},
                 "wait": ARG_WAIT}, ("name",)),
        _out({"machine": OUT_MACHINE, "ephemeral": {"type": "boolean"}, "ready": {"type": "boolean"}}),
        tool_branch_machine),
    ToolSpec(
        "stop-machine", "Stop a machine",
        "Stop the named machine. Its disks are kept; start-machine starts it again. Whatever runs in it is ended.",
        _object({"name": ARG_NAME}, ("name",)), _out({"machine": OUT_MACHINE}), tool_stop_machine,
        destructive=True, idempotent=True),
    ToolSpec(
        "delete-machine", "Delete a machine",
        "Delete the named machine and its disks for good. Anything not copied out of it is lost.",
        _object({"name": ARG_NAME}, ("name",)),
        {"type": "object", "properties": {"deleted": {"type": "string"}, "usage": {"type": "object"}},
         "required": ["deleted"]},
        tool_delete_machine, destructive=True),
    ToolSpec(
        "machine-logs", "Read a machine's log",
        "Read the latest lines of the machine's guest console. Pass the cursor from the last call to get only what "
        "arrived since. Changes nothing.",
        _object({"name": ARG_NAME, "tail": _integer("How many of the latest lines (default SMOL_MCP_LOGS_TAIL).",
                                                    maximum=100000),
                 "cursor": _string("The cursor from the previous machine-logs call.")}, ("name",)),
        _out({"lines": {"type": "array", "items": {"type": "string"}}, "cursor": {"type": "string"}}),
        tool_machine_logs, read_only=True),
    ToolSpec(
        "pull-image", "Pull an image into a machine",
        "Pull an OCI image into the named machine's image store (local fleet only; the machine is started to do it).",
        _object({"name": ARG_NAME, "image": ARG_IMAGE}, ("name", "image")),
        _out({"image": {"type": "object"}}), tool_pull_image, idempotent=True, open_world=True),
)
TOOLS_BY_NAME = {tool.name: tool for tool in TOOLS}


# ---------------------------------------------------------------------------
# 9. Resources
#
# smol://targets says what this process serves and whether each fleet can work
# on this host right now, without starting anything. The log template gives the
# latest console lines of a machine.
# ---------------------------------------------------------------------------

TARGETS_URI = "smol://targets"
LOGS_URI_TEMPLATE = "smol://machine/{target}/{name}/logs"
LOGS_URI_RE = re.compile(r"smol://machine/(?P<target>[^/]+)/(?P<name>[^/]+)/logs")


def hypervisor_status() -> tuple[bool, str]:
    """Whether this host can run microVMs, and if not, why and what to do."""
    if sys.platform == "darwin":
        return True, "Hypervisor.framework (macOS)"
    if not os.path.exists("/dev/kvm"):
        return False, "/dev/kvm does not exist: enable KVM (or nested virtualisation on this VM) and load the kvm module"
    if not os.access("/dev/kvm", os.R_OK | os.W_OK):
        return False, "/dev/kvm is not readable and writable by this user: add the user to the kvm group"
    return True, "/dev/kvm is usable"


def local_target_facts(fleet: LocalFleet) -> dict:
    """What smol://targets says about the local fleet. Only reads: it never
    spawns the serve (that happens on the first local tool call)."""
    facts: dict[str, Any] = {"served": True, "usable": True, "reason": None}
    guest = inside_smol_guest()
    hypervisor_ok, hypervisor_reason = hypervisor_status()
    binary = fleet.smolvm_path() if not fleet.config.local_url else None
    facts.update({
        "insideGuest": guest,
        "hypervisor": {"present": hypervisor_ok, "detail": hypervisor_reason},
        "smolvm": {"path": binary, "version": fleet.version},
        "serve": fleet.config.local_url or "started on the first local tool call",
        "minSmolvm": fleet.config.min_smolvm or None,
    })
    running_version = fleet.version or serve_version(fleet)  # asks a serve that already runs; starts none
    facts["smolvm"]["version"] = running_version
    if guest:
        facts.update(usable=False, reason="running inside a smol machine, which cannot start machines of its own")
    elif fleet.config.local_url:
        if running_version is None:
            facts.update(usable=False, reason=f"nothing answers at SMOL_LOCAL_URL={fleet.config.local_url}; start "
                                              "that serve, or unset SMOL_LOCAL_URL to let smol-mcp start its own")
        else:
            facts["reason"] = "uses the serve at SMOL_LOCAL_URL"
    elif binary is None:
        facts.update(usable=False, reason=f"smolvm was not found ({fleet.config.smolvm!r}); install it or set SMOLVM")
    elif not hypervisor_ok:
        facts.update(usable=False, reason=hypervisor_reason)
    elif running_version is None and rollout_port_taken():
        facts.update(usable=False, reason="another smolvm serve already runs on this host (127.0.0.1:10081 is "
                                          "taken); set SMOL_LOCAL_URL to its socket, or stop it")
    minimum = fleet.config.min_smolvm
    if running_version and minimum and version_tuple(running_version) < version_tuple(minimum):
        facts.update(usable=False, reason=f"smolvm {running_version} is older than {minimum}; upgrade it, or set "
                                          "SMOL_MCP_MIN_SMOLVM to an empty value to skip the check")
    elif not running_version and facts["usable"] and minimum:
        facts["reason"] = f"its version is checked against {minimum} when the first local call starts the serve"
    return facts


def serve_version(fleet: LocalFleet) -> str | None:
    """The version a serve already answering on the fleet's address reports."""
    try:
        return str(fleet._health().get("version") or "") or None
    except (OSError, SmolError, ValueError):
        return None


def rollout_port_taken() -> bool:
    """Whether something listens on 127.0.0.1:10081, the port every serve binds."""
    with socket.socket() as probe:
        probe.settimeout(0.2)
        return probe.connect_ex(("127.0.0.1", 10081)) == 0


async def follow_log(app: "SmolMcp", fleet: Any, name: str, notify: Callable) -> None:
    """Poll a machine's console every logsPollSecs and call ``notify`` when
    lines arrived since the last look (neither log route pushes to us)."""
    import anyio
    last = None
    while True:
        try:
            lines = await anyio.to_thread.run_sync(fleet.console_lines, name, abandon_on_cancel=True,
                                                   limiter=app.thread_limiter())
            seen = log_cursor(lines, len(lines))
            if last is not None and seen != last:
                await notify()
            last = seen
        except SmolError as err:  # a machine that is gone or stopped: keep looking, it may come back
            log.debug("log poll of %s: %s", name, err)
        await anyio.sleep(app.config.logs_poll_secs)


def cloud_target_facts(config: Config) -> dict:
    """What smol://targets says about the cloud fleet, without calling it."""
    facts = {"served": True, "usable": bool(config.cloud_token), "reason": None, "url": config.cloud_url,
             "tokenSet": bool(config.cloud_token)}
    if not config.cloud_token:
        facts["reason"] = "no account key: set SMOL_CLOUD_TOKEN"
    return facts


def targets_document(app: "SmolMcp") -> dict:
    """The mode and, per fleet, whether it is served and usable now, with the reason when not."""
    facts = {"local": local_target_facts(app.local), "cloud": cloud_target_facts(app.config)}
    for name, fleet_facts in facts.items():
        if name not in app.fleets:
            fleet_facts.update(served=False, usable=False,
                               reason=f"this process runs in {app.mode} mode (SMOL_MCP_TARGETS={app.config.targets})")
    return {"mode": app.mode, "fleets": facts}


# ---------------------------------------------------------------------------
# 10. Sessions and cleanup
#
# A machine whose name starts with machinePrefix is ephemeral: the session that
# created it deletes it when the session ends. Local records are files in the
# runtime directory, so the next process deletes what a SIGKILLed one left.
# ---------------------------------------------------------------------------


class Session:
    """One client's state: its ephemeral machines per fleet (and their record
    on disk), the fleet it chose in both mode, and its log subscriptions."""

    def __init__(self, app: "SmolMcp", session_id: str, tasks: Any = None):
        self.app, self.id = app, session_id
        self.machines: dict[str, set[str]] = {}
        self.record_path = Path(app.config.runtime_dir) / "sessions" / f"{os.getpid()}-{session_id}.json"
        self.target: str | None = None  # both mode: the fleet this session chose, if it chose one
        self.asked_fleet = False
        self.chose_during: Any = None  # the call whose question made the choice
        self._question_lock = self._slots = None
        self.tasks = tasks  # the task group its log pollers run in
        self.subscriptions: dict[str, Any] = {}  # uri -> the CancelScope of its poller (handshake era)
        self._bus = self._listener = None
        self.in_flight, self.last_seen = 0, time.monotonic()  # for the HTTP idle timeout
        self.used = False  # a call made since it opened: an unused HTTP session is ended sooner
        # Handshake era over HTTP: its Mcp-Session-Id and protocol version.
        self.http_id = self.protocol = None

    def call_slots(self):
        """The worker threads this session's blocking calls run in: a share of
        the process's pool, so one session's flood of long calls waits its turn
        in its own queue instead of holding every thread."""
        if self._slots is None:
            self._slots = SessionSlots(self.app.thread_limiter(), SESSION_CALL_SLOTS)
        return self._slots

    def question_lock(self):
        import anyio
        if self._question_lock is None:
            self._question_lock = anyio.Lock()
        return self._question_lock

    def events(self):
        """This session's event bus and listen handler (2026 era change
        notifications travel on a subscriptions/listen stream)."""
        if self._bus is None:
            from mcp.server.subscriptions import InMemorySubscriptionBus, ListenHandler
            self._bus = InMemorySubscriptionBus()
            self._listener = ListenHandler(self._bus)
        return self._bus, self._listener

    def stop_polling(self) -> None:
        for scope in self.subscriptions.values():
            scope.cancel()
        self.subscriptions.clear()

    def is_ephemeral(self, name: str) -> bool:
        return name.startswith(self.app.config.machine_prefix)

    def remember(self, fleet: str, name: str) -> bool:
        """Record an ephemeral machine; False if it was recorded already."""
        names = self.machines.setdefault(fleet, set())
        if name in names:
            return False
        names.add(name)
        self._save()
        return True

    def forget(self, fleet: str, name: str) -> None:
        if name in self.machines.get(fleet, set()):
            self.machines[fleet].discard(name)
            self._save()

    def _save(self) -> None:
        """Write the local record atomically (a crash mid-write must not lose it).
        The record is bookkeeping: a runtime directory that is read-only or full
        costs a warning, never the machine operation that changed it."""
        names = sorted(self.machines.get("local", set()))
        with bookkeeping(self.app.config.runtime_dir):
            if not names:
                self.record_path.unlink(missing_ok=True)
                return
            # The parent first: it is what keeps others out.
            ensure_runtime_dir(self.app.config.runtime_dir)
            self.record_path.parent.mkdir(mode=0o700, exist_ok=True)
            record = {
                "pid": os.getpid(),
                "started": process_start_time(os.getpid()),
                "endpoint": self.app.local.endpoint,
                "machines": names,
            }
            temporary = self.record_path.with_suffix(".tmp")
            temporary.write_text(json.dumps(record))
            temporary.replace(self.record_path)

    async def close(self) -> None:
        """Delete every ephemeral machine this session still holds; what cannot
        be deleted stays in the record for the next start to try again. A fleet
        that fails in any way is logged and the next one is still cleaned."""
        import anyio
        for fleet_name, names in list(self.machines.items()):
            try:
                deleted, refused = await anyio.to_thread.run_sync(
                    delete_in_passes,
                    self.app.fleets[fleet_name],
                    sorted(names),
                    abandon_on_cancel=True,
                )
            except Exception as err:
                log.warning(
                    "session %s ended: could not clean up its %s machines (%s): %s",
                    self.id,
                    fleet_name,
                    ", ".join(sorted(names)),
                    describe(err),
                )
                continue
            for name in deleted:
                log.info("session %s ended: deleted %s", self.id, name)
                self.forget(fleet_name, name)
            for name, err in refused:
                log.warning("session %s ended: could not delete %s: %s", self.id, name, err)


class SessionSlots:
    """A limiter for anyio's to_thread: a slot of the session first, then a
    thread of the shared pool. At most ``slots`` of one session's calls hold
    threads at once; the rest wait in order in that session's queue."""

    def __init__(self, shared: Any, slots: int):
        import anyio

        self.shared, self.own = shared, anyio.CapacityLimiter(slots)

    async def __aenter__(self) -> None:
        await self.own.acquire()
        try:
            await self.shared.acquire()
        except BaseException:
            self.own.release()
            raise

    async def __aexit__(self, *exc_info: Any) -> None:
        self.shared.release()
        self.own.release()


def delete_in_passes(fleet: Any, names: list[str]) -> tuple[list[str], list[tuple[str, Exception]]]:
    """Delete machines, children before their branch sources: a source with
    live children refuses (409), so deletes repeat in passes until one makes no
    progress. A pass that makes none is tried once more after a pause, as a
    transient fault (a 5xx, a proxy page) should not leave a machine billing.
    Returns what is gone (a 404 counts) and what was refused, why."""
    pending, gone, retried = list(names), [], False
    while pending:
        refused: list[tuple[str, Exception]] = []
        for name in pending:
            try:
                fleet.delete_machine(name)
            except ApiError as err:
                if err.status != 404:
                    refused.append((name, err))
                    continue
            except Exception as err:  # a cleanup goes on past any one machine's failure
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
    """An error for a log line: our sentence as it is, anything else with its type."""
    return str(err) if isinstance(err, SmolError) else f"{type(err).__name__}: {err}"


_warned_dirs: set[str] = set()


@contextmanager
def bookkeeping(runtime_dir: str):
    """Around a write of our own records in the runtime directory: an OSError
    (read-only, full, gone) becomes one warning line naming it, once."""
    try:
        yield
    except OSError as err:
        if runtime_dir not in _warned_dirs:
            _warned_dirs.add(runtime_dir)
            log.warning(
                "cannot write to the runtime directory %s (%s); machines work on, but one this "
                "process cannot delete will not be found by the next start. Make it writable (or "
                "set SMOL_MCP_RUNTIME_DIR).",
                runtime_dir,
                err.strerror or err,
            )


def _proc_stat(pid: int) -> list[str] | None:
    """/proc/PID/stat from the state field on (field 3 is [0]), None without it."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text[text.rfind(")") + 2 :].split()


def process_start_time(pid: int) -> int | None:
    """When the process started, in clock ticks since boot (field 22): with the
    pid it names one process, where a pid alone may have been reused."""
    fields = _proc_stat(pid)
    return int(fields[19]) if fields and len(fields) > 19 else None


def process_alive(pid: int, started: int | None = None) -> bool:
    """Whether pid is a running process (a zombie is dead: it only waits to be
    reaped) and, when started is known, the same one that wrote it down."""
    if pid <= 0:
        return False  # a record without a real pid belongs to nobody
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    fields = _proc_stat(pid)
    if fields is None:
        return not Path("/proc/self/stat").exists()  # no /proc at all (macOS): the signal answered
    if fields[0] in ("Z", "X"):
        return False
    return started is None or (len(fields) > 19 and int(fields[19]) == started)


def sweep_orphans(fleet: LocalFleet, runtime_dir: str) -> list[str]:
    """Delete the ephemeral machines recorded by processes that died without
    cleaning up (SIGKILL, power loss), on the same serve; return their names."""
    deleted = []
    for path in sorted((Path(runtime_dir) / "sessions").glob("*.json")):
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if (
            process_alive(int(record.get("pid", 0)), record.get("started"))
            or record.get("endpoint") != fleet.endpoint
        ):
            continue
        gone, refused = delete_in_passes(fleet, record.get("machines", []))
        deleted += gone
        kept = [name for name, _ in refused]
        for name, err in refused:
            log.warning("could not delete %s left by process %s: %s", name, record.get("pid"), err)
        with bookkeeping(runtime_dir):
            if kept:  # try again at the next start rather than forget them
                path.write_text(json.dumps({**record, "machines": kept}))
            else:
                path.unlink(missing_ok=True)
    if deleted:
        log.info("deleted %d machine(s) left by an earlier process: %s", len(deleted), ", ".join(deleted))
    return deleted


# ---------------------------------------------------------------------------
# 11. The MCP server
#
# One low-level mcp Server serves both protocol eras. Its lifespan is entered
# once per stdio process (and once per in-memory client), which is exactly the
# life of a stdio session, so the session lives there and is cleaned up as the
# lifespan exits, however the connection ended.
# ---------------------------------------------------------------------------


MODE_FLEETS = {"local": ("local",), "cloud": ("cloud",), "both": ("local", "cloud")}
ELICIT_TIMEOUT_SECS = 120
FLEET_QUESTION = ("This smol-mcp server reaches two fleets of machines: local (smolvm on the server's host; nothing "
                  "is billed) and cloud (your smol cloud account; machines are billed while they exist). Which one "
                  "is this session for? Choose both to name the fleet on every call.")
FLEET_QUESTION_SCHEMA = {
    "type": "object", "required": ["fleet"],
    "properties": {"fleet": {"type": "string", "title": "Fleet", "enum": ["local", "cloud", "both"],
                             "description": "local, cloud, or both (decide per call)"}},
}
ARG_TARGET = {"type": "string", "enum": ["local", "cloud"],
              "description": "Which fleet: \"local\" (smolvm on the server's host, nothing billed) or \"cloud\" (the "
                             "smol cloud account, billed while machines exist). Required: a machine on one fleet is "
                             "invisible on the other, so there is no default."}


def resolve_mode(config: Config) -> str:
    """The fleets this process serves, decided once at startup: auto means
    both when a cloud token is configured, else local."""
    if config.targets == "auto":
        return "both" if config.cloud_token else "local"
    if config.targets in ("cloud", "both") and not config.cloud_token:
        raise ConfigError(f"SMOL_MCP_TARGETS={config.targets} needs the cloud account key: set SMOL_CLOUD_TOKEN (or "
                          "cloudToken in the config file)")
    return config.targets


@functools.lru_cache(maxsize=None)
def tool_schema(tool: ToolSpec, with_target: bool) -> dict:
    """The input schema a client is shown: with a required target in both mode.
    (Cached: a 2026-era HTTP client has the tool list built before every call.)"""
    if not with_target:
        return tool.input_schema
    schema = json.loads(json.dumps(tool.input_schema))
    schema["properties"] = {"target": ARG_TARGET, **schema["properties"]}
    schema["required"] = ["target", *schema["required"]]
    return schema


def server_instructions(app: "SmolMcp") -> str:
    c = app.config
    fleets = {
        "local": "local (smolvm on the host this server runs on, started on the first local call; nothing billed)",
        "cloud": "cloud (the smol cloud account; machines are billed while they exist)",
    }
    served = " and ".join(fleets[name] for name in app.fleets)
    lines = [
        "smol-mcp gives you microVMs (smol machines) to work in instead of this computer: every command you run with "
        f"these tools executes inside a guest, never on the host. This process serves {served}.",
        "- Typical flow: create-machine (waits until the guest runs commands), run-command, write-file/read-file, "
        "delete-machine. run-once does create, run and delete in one call.",
        "- Egress is blocked unless you pass network: \"open\" or allowHosts/allowCidrs.",
        f"- Machines named {c.machine_prefix}… (and unnamed ones) are ephemeral: deleted when this session ends. Any "
        "other name persists.",
        f"- Output beyond {c.max_output_bytes} bytes per stream keeps its head and tail; the whole stream is saved in "
        "the machine at the path in overflow. read-file pages with offset/length.",
        f"- A non-zero exit code is a result, not an error. Commands time out after {c.exec_timeout_secs} s by "
        f"default (timeoutSecs up to {c.max_exec_timeout_secs}).",
        "- branch-machine needs a running source created with branchable: true.",
    ]
    if app.mode == "both":
        lines.append("- Every tool needs target: \"local\" or \"cloud\"; there is no default.")
    if "local" in app.fleets:
        lines.append("- Local: a registry image needs network: \"open\" for its first pull; mounts, overlayGb, cmd and "
                     "pull-image are local only; branch-machine needs a Linux or macOS host.")
    if "cloud" in app.fleets:
        lines.append("- Cloud: a command, read or write in a stopped machine starts it (startedMachine: true) and "
                     "leaves it running; published ports need open egress; delete-machine returns the settled usage.")
    lines.append("- smol://targets says whether each fleet is usable right now, and why not.")
    return "\n".join(lines)


class SmolMcp:
    """Everything one process serves: the config, the fleets, and the MCP server."""

    def __init__(self, config: Config, environ: dict[str, str] | None = None):
        self.config = config
        self.mode = resolve_mode(config)
        self.local = LocalFleet(config, environ)  # always built (it is inert) so smol://targets can describe it
        self.fleets: dict[str, Any] = {}
        for name in MODE_FLEETS[self.mode]:
            self.fleets[name] = self.local if name == "local" else CloudFleet(config)
        self._limiter = None
        self._swept = False
        self._tool_lists: dict[bool, list] = {}
        self.http: HttpSessions | None = None  # set when serving Streamable HTTP
        self.server = self._build_server()

    def thread_limiter(self):
        """Worker threads for blocking API calls: enough that long commands in
        some sessions never queue the short calls of others."""
        import anyio
        if self._limiter is None:
            self._limiter = anyio.CapacityLimiter(128)
        return self._limiter

    # -- handlers ----------------------------------------------------------

    def _build_server(self):
        import mcp_types as types
        from mcp.server import NotificationOptions, Server

        app = self

        class DualEraServer(Server):
            # The HTTP manager and Client(server) call this without arguments;
            # advertise tools.listChanged everywhere.
            def create_initialization_options(self, notification_options=None, experimental_capabilities=None,
                                              extensions=None):
                return super().create_initialization_options(
                    notification_options or NotificationOptions(tools_changed=True), experimental_capabilities,
                    extensions)

        @asynccontextmanager
        async def lifespan(server):
            # stdio and in memory: entered once per connection, so it is the session.
            # HTTP: entered once for the whole listener, which holds many sessions.
            import anyio
            async with anyio.create_task_group() as tasks:
                if app.http is not None:
                    async with app.http.running(tasks):
                        yield {}
                    return
                session = app.open_session(secrets_module.token_hex(4), tasks)
                try:
                    yield {"session": session}
                finally:
                    tasks.cancel_scope.cancel()  # its log pollers end with it
                    await app.end_session(session)

        async def list_tools(ctx, params):
            with_target = app.mode == "both" and app.session_for(ctx).target is None
            return types.ListToolsResult(tools=app.tool_list(with_target))

        async def call_tool(ctx, params):
            return await app.call_tool(ctx, params)

        async def subscribe(ctx, params):
            await app.subscribe(ctx, str(params.uri))
            return types.EmptyResult()

        async def unsubscribe(ctx, params):
            scope = app.session_for(ctx).subscriptions.pop(str(params.uri), None)
            if scope is not None:
                scope.cancel()
            return types.EmptyResult()

        async def listen(ctx, params):
            return await app.listen(ctx, params)

        async def list_resources(ctx, params):
            return types.ListResourcesResult(resources=[types.Resource(
                uri=TARGETS_URI, name="targets", title="Fleets served and whether they are usable",
                mime_type="application/json",
                description="The mode, each fleet this process serves, and whether it is usable on this host now.")])

        async def list_resource_templates(ctx, params):
            return types.ListResourceTemplatesResult(resource_templates=[types.ResourceTemplate(
                uri_template=LOGS_URI_TEMPLATE, name="machine-logs", title="A machine's console log",
                mime_type="text/plain", description="The latest lines of a machine's guest console.")])

        async def read_resource(ctx, params):
            return await app.read_resource(ctx, str(params.uri))

        return DualEraServer(
            "smol-mcp", version=__version__, title="smol machines", instructions=server_instructions(self),
            lifespan=lifespan, on_list_tools=list_tools, on_call_tool=call_tool, on_list_resources=list_resources,
            on_list_resource_templates=list_resource_templates, on_read_resource=read_resource,
            on_subscribe_resource=subscribe, on_unsubscribe_resource=unsubscribe, on_subscriptions_listen=listen)

    def tool_list(self, with_target: bool) -> list:
        """The tools as the client sees them, built once per shape: a 2026-era
        HTTP client has the list built before every tool call."""
        if with_target not in self._tool_lists:
            self._tool_lists[with_target] = [self.mcp_tool(tool, with_target) for tool in TOOLS]
        return self._tool_lists[with_target]

    def mcp_tool(self, tool: ToolSpec, with_target: bool):
        import mcp_types as types
        return types.Tool(
            name=tool.name, title=tool.title, description=tool.description,
            input_schema=tool_schema(tool, with_target), output_schema=tool.output_schema,
            annotations=types.ToolAnnotations(
                title=tool.title, read_only_hint=tool.read_only, destructive_hint=tool.destructive,
                idempotent_hint=tool.idempotent, open_world_hint=tool.open_world))

    def session_for(self, ctx) -> Session:
        """The session a request belongs to: on stdio and in memory, the one the
        connection's lifespan made; over HTTP, see HttpSessions."""
        if ctx.request is None:
            return ctx.lifespan_context["session"]
        return self.http.session_for(ctx)

    def open_session(self, session_id: str, tasks: Any) -> Session:
        """A new session; it holds the fleets (the serve) until end_session."""
        for fleet in self.fleets.values():
            fleet.acquire()
        return Session(self, session_id, tasks)

    def fleet_for(self, session: Session, name: str, arguments: dict, params: Any = None) -> Any:
        """The fleet a call goes to, taking `target` out of the arguments."""
        if self.mode != "both":
            return next(iter(self.fleets.values()))
        if session.target is not None and not (params is not None and params is session.chose_during
                                               and "target" in arguments):
            given = arguments.pop("target", session.target)
            if given != session.target:
                raise ArgumentError(f'this session chose the {session.target} fleet at its first call, so target '
                                    f'"{given}" is not available in it; use a new session (over HTTP with the '
                                    "2026-07-28 protocol, the session is the token) for the other fleet")
            return self.fleets[session.target]
        if "target" not in arguments:
            raise ArgumentError(f'{name} needs "target": "local" or "cloud". This server serves both fleets and '
                                "there is no default, because a machine on one fleet is invisible on the other "
                                "and the two bill differently.")
        target = arguments.pop("target")
        _check(ARG_TARGET, target, "target")
        return self.fleets[target]

    async def ask_fleet(self, ctx, session: Session, params):
        """In both mode, ask once per session which fleet it is for (when the
        client can answer questions). An answer of local or cloud narrows the
        session: `target` leaves every tool and the client is told the list
        changed. Returns the question itself when it travels as a 2026-era
        input-required result; None when the call can go on."""
        if self.mode != "both" or session.asked_fleet:
            return None
        async with session.question_lock():  # calls racing in at the start get one question between them
            return await self._ask_fleet_once(ctx, session, params)

    async def _ask_fleet_once(self, ctx, session: Session, params):
        import mcp_types as types
        from mcp_types.version import MODERN_PROTOCOL_VERSIONS
        if session.asked_fleet:
            return None
        capabilities = ctx.session.client_capabilities
        if capabilities is None or capabilities.elicitation is None or (
                capabilities.elicitation.form is None and capabilities.elicitation.url is not None):
            session.asked_fleet = True  # a client that cannot answer keeps the argument
            return None
        question = types.ElicitRequest(params=types.ElicitRequestFormParams(
            message=FLEET_QUESTION, requested_schema=FLEET_QUESTION_SCHEMA))
        modern = ctx.protocol_version in MODERN_PROTOCOL_VERSIONS
        if modern:
            answer = (params.input_responses or {}).get("fleet")
            if answer is None:
                return types.InputRequiredResult(request_state="smol-mcp:fleet", input_requests={"fleet": question})
            if isinstance(answer, dict):
                answer = types.ElicitResult.model_validate(answer)
        else:
            answer = await self.elicit(ctx, question)
        session.asked_fleet = True
        choice = (answer.content or {}).get("fleet") if answer is not None and answer.action == "accept" else None
        if choice in self.fleets and session.target is None:
            session.target = choice
            session.chose_during = params  # the call that asked may still name the other fleet explicitly
            log.info("session %s chose the %s fleet", session.id, choice)
            await self.announce_tools_changed(ctx, session, modern)
        return None

    async def elicit(self, ctx, question):
        """Send an elicitation and wait for the answer, within a bound: a client
        that never answers must not hold the call forever."""
        import mcp_types as types
        from mcp.shared.message import ServerMessageMetadata
        related = ctx.request_id if ctx.session.can_send_request else None
        try:
            return await ctx.session.send_request(
                question, types.ElicitResult, request_read_timeout_seconds=ELICIT_TIMEOUT_SECS,
                metadata=ServerMessageMetadata(related_request_id=related))
        except Exception as err:  # timed out, or no way back to the client: keep both fleets
            log.info("the fleet question got no answer (%s); the session keeps the target argument", err)
            return None

    async def announce_tools_changed(self, ctx, session: Session, modern: bool) -> None:
        if modern:
            from mcp.server.subscriptions import ToolsListChanged
            bus, _ = session.events()
            await bus.publish(ToolsListChanged())  # reaches the session's subscriptions/listen stream
        else:
            await ctx.session.send_tool_list_changed()

    async def call_tool(self, ctx, params):
        """Validate, dispatch, and turn every failure into a readable tool error."""
        import anyio
        import mcp_types as types
        name = params.name
        tool = TOOLS_BY_NAME.get(name)
        try:
            if tool is None:
                raise ArgumentError(f"there is no tool named {name!r}; the tools are: {', '.join(TOOLS_BY_NAME)}")
            session = self.session_for(ctx)
            question = await self.ask_fleet(ctx, session, params)
            if question is not None:
                return question
            arguments = dict(params.arguments or {})
            fleet = self.fleet_for(session, name, arguments, params)
            validate_arguments(name, tool.input_schema, arguments)
            if fleet is self.local:
                await self.sweep_once()
            result = await tool.handler(Call(self, session, fleet, ctx), arguments)
        except anyio.get_cancelled_exc_class():
            raise
        except SmolError as err:
            return tool_error(redact(explain(err), self.config.secret_values()))
        except Exception as err:
            log.exception("tool %s failed unexpectedly", name)
            return tool_error(redact(f"{name} failed unexpectedly ({type(err).__name__}: {err}). This is a bug in "
                                     "smol-mcp; the server log has the details.", self.config.secret_values()))
        return types.CallToolResult(content=[types.TextContent(type="text", text=json.dumps(result, indent=2))],
                                    structured_content=result)

    async def sweep_once(self) -> None:
        """Before the first local call of this process: delete what a crashed
        earlier process left behind."""
        if not self._swept:
            import anyio
            await anyio.to_thread.run_sync(sweep_orphans, self.local, self.config.runtime_dir)
            self._swept = True

    async def read_resource(self, ctx, uri: str):
        import mcp_types as types
        if uri == TARGETS_URI:
            import anyio
            document = await anyio.to_thread.run_sync(targets_document, self)  # it probes a socket and a port
            text, mime = json.dumps(document, indent=2), "application/json"
        elif match := LOGS_URI_RE.fullmatch(uri):
            fleet = self.fleets.get(match["target"])
            if fleet is None:
                raise_resource_error(f"{uri}: this server serves {' and '.join(self.fleets)}, not {match['target']}")
            try:
                lines = await Call(self, self.session_for(ctx), fleet, ctx).api(
                    fleet.console_lines, urllib.parse.unquote(match["name"]))
            except SmolError as err:
                raise_resource_error(redact(str(err), self.config.secret_values()))
            text, mime = "\n".join(lines[-self.config.logs_tail:]), "text/plain"
        else:
            raise_resource_error(f"unknown resource {uri}; the resources are {TARGETS_URI} and {LOGS_URI_TEMPLATE}")
        return types.ReadResourceResult(contents=[types.TextResourceContents(uri=uri, mime_type=mime, text=text)])

    def log_resource(self, uri: str) -> tuple[Any, str]:
        """(fleet, machine name) of a log resource URI, or a protocol error."""
        match = LOGS_URI_RE.fullmatch(uri)
        if match is None or match["target"] not in self.fleets:
            raise_resource_error(f"{uri} is not a log resource of this server; the form is {LOGS_URI_TEMPLATE} with "
                                 f"target {' or '.join(self.fleets)}")
        return self.fleets[match["target"]], urllib.parse.unquote(match["name"])

    async def subscribe(self, ctx, uri: str) -> None:
        """Handshake era: follow a log in a poller that lives until unsubscribe
        or the end of the session, notifying through this connection."""
        import anyio
        fleet, name = self.log_resource(uri)
        session = self.session_for(ctx)
        if uri in session.subscriptions:
            return
        scope = anyio.CancelScope()
        session.subscriptions[uri] = scope
        notify = ctx.session.send_resource_updated  # the captured session outlives this request

        async def poll() -> None:
            with scope:
                await follow_log(self, fleet, name, lambda: notify(uri))

        session.tasks.start_soon(poll)

    async def listen(self, ctx, params):
        """2026 era: change notifications and log updates travel on this stream;
        its pollers live exactly as long as it does."""
        import anyio
        from mcp.server.subscriptions import ResourceUpdated
        session = self.session_for(ctx)
        bus, handler = session.events()
        followed = [(uri, *self.log_resource(uri)) for uri in params.notifications.resource_subscriptions or []]
        async with anyio.create_task_group() as pollers:
            for uri, fleet, name in followed:
                pollers.start_soon(follow_log, self, fleet, name,
                                   lambda uri=uri: bus.publish(ResourceUpdated(uri=uri)))
            try:
                return await handler(ctx, params)
            finally:
                pollers.cancel_scope.cancel()

    async def end_session(self, session: Session) -> None:
        """Delete the session's ephemeral machines and let go of the fleets, even
        while being cancelled (a signal), within a bounded time."""
        import anyio
        with anyio.CancelScope(shield=True):
            # Nothing here may escape: over HTTP it would end the listener and every other session.
            try:
                session.stop_polling()
                with anyio.move_on_after(CLEANUP_TIMEOUT_SECS):
                    await session.close()
            except Exception as err:
                log.warning("session %s: its cleanup failed (%s)", session.id, describe(err))
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


def explain(err: SmolError) -> str:
    """The error text, plus what to do for the API refusals every tool can meet."""
    if isinstance(err, ApiError):
        if err.status == 404 and ("machine '" in err.api_message or "vm not found" in err.api_message):
            return str(err.with_hint("Check the name with list-machines"))
        if err.status == 404 and err.action.startswith(("read ", "write ")):
            return str(err.with_hint("Check the path: run-command with ls shows what is there"))
        if err.status == 409 and "already exists" in err.api_message:
            return str(err.with_hint("Pick another name, or use start-machine to start the existing machine"))
    return str(err)


def tool_error(message: str):
    import mcp_types as types
    return types.CallToolResult(content=[types.TextContent(type="text", text=message)], is_error=True)


def raise_resource_error(message: str):
    import mcp_types as types
    from mcp import MCPError
    raise MCPError(code=types.INVALID_PARAMS, message=message)


def build_server(config: Config | None = None):
    """The MCP server for ``config`` (default: ``load_config()``), ready to run
    on any transport."""
    return SmolMcp(config or load_config()).server


# ---------------------------------------------------------------------------
# 12. stdio
#
# The default transport. The session ends at stdin EOF, SIGTERM or SIGINT, and
# in every case the lifespan cleanup runs: the SDK alone would skip it on
# SIGTERM and hang on SIGINT (its stdin reader thread is blocked in read()).
# ---------------------------------------------------------------------------


async def run_stdio(server) -> None:
    import anyio
    from mcp.server.stdio import stdio_server

    signalled, answers = False, None
    async with anyio.create_task_group() as group:
        async def watch_signals() -> None:
            nonlocal signalled
            with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as received:
                async for _ in received:
                    signalled = True
                    if answers is not None:
                        await answers.refuse_pending()  # every call in flight hears why it stopped
                    group.cancel_scope.cancel()  # unwinds run(): the lifespan cleanup runs
                    return

        group.start_soon(watch_signals)
        async with stdio_server() as (read, write):
            read, write = AnsweredReads(read, write), AnsweredWrites(write)
            read.writes = answers = write
            try:
                await server.run(read, write, server.create_initialization_options())
            finally:
                if signalled:
                    logging.shutdown()
                    os._exit(0)  # the stdin reader thread would block a normal exit
        group.cancel_scope.cancel()


class StreamWrapper:
    """A stream of the SDK's transport with something added; closing closes it."""

    def __init__(self, inner: Any):
        self.inner = inner

    async def aclose(self) -> None:
        await self.inner.aclose()

    async def __aenter__(self) -> Any:
        return self

    async def __aexit__(self, *exc_info: Any) -> None:
        await self.aclose()


class AnsweredReads(StreamWrapper):
    """The stdio read stream, kept open at stdin's end until every request
    read before it has been answered: the SDK would end the session at EOF and
    drop an answer still being made. A line the SDK cannot parse is answered
    with a JSON-RPC parse error (with its id, when the line has one) rather
    than left unanswered."""

    def __init__(self, inner: Any, write: Any):
        super().__init__(inner)
        self.write = write
        self.writes: AnsweredWrites | None = None

    @property
    def last_context(self) -> Any:
        return getattr(self.inner, "last_context", None)

    async def receive(self) -> Any:
        import anyio
        import mcp_types as types
        from mcp.shared.message import SessionMessage

        try:
            item = await self.inner.receive()
        except anyio.EndOfStream:
            while self.writes.pending:
                await self.writes.changed()
            raise
        if isinstance(item, SessionMessage) and isinstance(item.message, types.JSONRPCRequest):
            self.writes.pending.add(item.message.id)
        elif isinstance(item, Exception):
            message = (
                f"this message could not be read ({item_error(item)}); send one JSON-RPC "
                "message per line, as UTF-8 JSON without lone surrogates"
            )
            error = types.ErrorData(code=types.PARSE_ERROR, message=message)
            await self.write.send(
                SessionMessage(types.JSONRPCError(jsonrpc="2.0", id=unparsed_id(item), error=error))
            )
        return item

    def __aiter__(self) -> "AnsweredReads":
        return self

    async def __anext__(self) -> Any:
        import anyio

        try:
            return await self.receive()
        except anyio.EndOfStream:
            raise StopAsyncIteration from None


class AnsweredWrites(StreamWrapper):
    """The stdio write stream, counting off the requests it answers."""

    def __init__(self, inner: Any):
        import anyio

        super().__init__(inner)
        self.pending: set = set()
        self._changed = anyio.Event()

    async def changed(self) -> None:
        import anyio

        await self._changed.wait()
        self._changed = anyio.Event()

    async def send(self, item: Any) -> None:
        await self.inner.send(item)
        answer_id = getattr(getattr(item, "message", None), "id", None)
        if answer_id in self.pending and not hasattr(item.message, "method"):
            self.pending.discard(answer_id)
            self._changed.set()

    async def refuse_pending(self) -> None:
        """Answer every request still in flight with the shutdown error."""
        import anyio
        import mcp_types as types
        from mcp.shared.message import SessionMessage

        with anyio.move_on_after(2):
            for request_id in list(self.pending):
                await self.send(
                    SessionMessage(
                        types.JSONRPCError(
                            jsonrpc="2.0",
                            id=request_id,
                            error=(types.ErrorData(code=-32000, message=SHUTDOWN_MESSAGE)),
                        )
                    )
                )
            await anyio.sleep(0.2)  # the transport's writer flushes the last one


def unparsed_id(err: Exception) -> Any:
    """The id of a request the SDK could not parse, read leniently, else None."""
    for detail in getattr(err, "errors", lambda: [])():
        if isinstance(detail.get("input"), str):
            try:
                request = json.loads(detail["input"])
            except ValueError:
                return None
            found = request.get("id") if isinstance(request, dict) else None
            return found if isinstance(found, (str, int)) and not isinstance(found, bool) else None
    return None


def item_error(err: Exception) -> str:
    details = getattr(err, "errors", lambda: [])()
    return details[0].get("msg", type(err).__name__) if details else type(err).__name__


# ---------------------------------------------------------------------------
# 13. Streamable HTTP (--http)
#
# For an agent on another computer. Every request must carry the token, checked
# before anything else so an unauthenticated caller learns nothing, not even
# where the endpoint is. Then the Host and Origin checks against DNS
# rebinding, then the path. Replies are plain JSON. A session is the
# Mcp-Session-Id in the handshake era, and the token in the 2026 era, which
# has no session id.
# ---------------------------------------------------------------------------

HTTP_MAX_BODY_BYTES = 16 * 1024 * 1024  # a write-file of a few MiB, base64 and all; more is a 413
HTTP_MAX_SESSIONS = 64  # beyond this a new session gets 503
HTTP_GRACEFUL_SHUTDOWN_SECS = 5
# A session that made no call since it opened is ended after this (or the idle time, if less).
HTTP_UNUSED_SESSION_SECS = 300
# Requests that use a session; initialize, listings and pings alone do not.
SESSION_USES = ("tools/call", "resources/read", "resources/subscribe", "subscriptions/listen")
HTTP_UNAUTHORIZED = json.dumps({"error": "unauthorized: send the token as 'Authorization: Bearer <token>' or "
                                         "'X-Smol-Mcp-Token: <token>'"}).encode()
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")


def default_allowed_hosts(config: Config, host: str, port: int) -> list[str] | None:
    """The Host values accepted: the configured list, else the loopback names of
    the bound port. Off loopback the name clients dial is not knowable here, so
    None: the check is off, and the startup log says so."""
    if config.http_allowed_hosts:
        return list(config.http_allowed_hosts)
    if host in LOOPBACK_HOSTS:
        return [f"127.0.0.1:{port}", f"localhost:{port}", f"[::1]:{port}"]
    return None


class HttpGate:
    """ASGI middleware in front of everything: the token, then Host and Origin,
    then the path. Lifespan events pass straight through."""

    def __init__(self, app: Any, *, tokens: dict[str, str], path: str, allowed_hosts: list[str] | None,
                 allowed_origins: tuple[str, ...]):
        self.app, self.tokens, self.path = app, tokens, path
        self.allowed_hosts, self.allowed_origins = allowed_hosts, allowed_origins

    def principal(self, headers: dict[bytes, bytes]) -> str | None:
        """The name of the token the request carries, compared in constant time."""
        authorization = headers.get(b"authorization", b"").decode("latin-1")
        offered = [headers.get(b"x-smol-mcp-token", b"").decode("latin-1")]
        if authorization[:7].lower() == "bearer ":
            offered.append(authorization[7:].strip())
        found = None
        for name, secret in self.tokens.items():
            for candidate in offered:
                if candidate and hmac.compare_digest(candidate.encode(), secret.encode()):
                    found = name
        return found

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        principal = self.principal(headers)
        if principal is None:
            await _respond(send, 401, HTTP_UNAUTHORIZED, [(b"www-authenticate", b"Bearer")])
            return
        host = headers.get(b"host", b"").decode("latin-1")
        if self.allowed_hosts is not None and host not in self.allowed_hosts:
            await _respond(send, 421, json.dumps({"error": f"Host {host!r} is not allowed; set "
                                                  "SMOL_MCP_HTTP_ALLOWED_HOSTS to the name clients dial"}).encode())
            return
        origin = headers.get(b"origin", b"").decode("latin-1")
        if origin and self.allowed_origins and origin not in self.allowed_origins:
            await _respond(send, 403, json.dumps({"error": f"Origin {origin!r} is not allowed "
                                                  "(SMOL_MCP_HTTP_ALLOWED_ORIGINS)"}).encode())
            return
        if scope["path"] != self.path:
            await _respond(send, 404, json.dumps({"error": f"not found; the MCP endpoint is {self.path}"}).encode())
            return
        scope.setdefault("state", {})["smol_principal"] = principal
        await self.app(scope, receive, send)


async def _respond(send: Callable, status: int, body: bytes, headers: list | None = None) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            *(headers or [])]})
    await send({"type": "http.response.body", "body": body})


class HttpSessions:
    """Sessions over HTTP. Handshake era: one per Mcp-Session-Id, ended by the
    SDK (DELETE, idle timeout, shutdown) through its connection's exit stack.
    2026 era: one per token, ended when it has made no request and has no call
    in flight for httpSessionIdleSecs, and at shutdown."""

    def __init__(self, app: SmolMcp):
        self.app = app
        self.by_principal: dict[str, Session] = {}
        self.by_id: dict[str, Session] = {}  # handshake era, by Mcp-Session-Id, for the idle reaper
        self.tasks: Any = None
        self.manager: Any = None
        self.path = "/mcp"
        self.stopping: Any = None  # an anyio Event, set when the process is told to stop

    @asynccontextmanager
    async def running(self, tasks: Any):
        import anyio
        self.tasks = tasks
        reaper = anyio.CancelScope()

        async def reap() -> None:
            with reaper:
                while True:
                    await anyio.sleep(min(self.app.config.http_session_idle_secs / 4, 30))
                    try:
                        await self.end_idle()
                    except Exception as err:  # the reaper must outlive any one session's trouble
                        log.warning("ending idle sessions failed (%s)", describe(err))

        tasks.start_soon(reap)
        try:
            yield
        finally:
            reaper.cancel()
            for principal in list(self.by_principal):
                await self.app.end_session(self.by_principal.pop(principal))

    def session_for(self, ctx) -> Session:
        from mcp_types.version import MODERN_PROTOCOL_VERSIONS
        if ctx.protocol_version in MODERN_PROTOCOL_VERSIONS:
            principal = ctx.request.scope.get("state", {}).get("smol_principal", "default")
            if principal not in self.by_principal:
                self.by_principal[principal] = self.app.open_session(
                    f"token-{principal}-{secrets_module.token_hex(3)}", self.tasks)
            return self.by_principal[principal]
        connection = ctx.session._connection  # private in mcp 2.3.0, which is pinned exactly
        session = connection.state.get("smol_session")
        if session is None:
            session = connection.state["smol_session"] = self.app.open_session(
                (connection.session_id or secrets_module.token_hex(4))[:8], self.tasks)
            if connection.session_id:
                session.http_id, session.protocol = connection.session_id, ctx.protocol_version
                self.by_id[connection.session_id] = session

            async def end() -> None:
                # The SDK bounds this exit stack at 5 s; the cleanup gets its own bound in the task group.
                self.by_id.pop(session.http_id or "", None)
                self.tasks.start_soon(self.app.end_session, session)

            connection.exit_stack.push_async_callback(end)
        return session

    async def track(self, ctx, call_next):
        """Server middleware, both eras: a session is busy while a request runs.
        A listen stream is not a request in flight: it stays open while idle."""
        if ctx.request is None:
            return await call_next(ctx)
        session = self.session_for(ctx)
        session.used = session.used or ctx.method in SESSION_USES
        if ctx.method == "subscriptions/listen":
            return await call_next(ctx)
        session.in_flight += 1
        try:
            return await call_next(ctx)
        finally:
            session.in_flight -= 1
            session.last_seen = time.monotonic()

    async def end_idle(self) -> None:
        """End every session with no request in flight and none for
        httpSessionIdleSecs (HTTP_UNUSED_SESSION_SECS if it never made a call),
        whatever streams its client holds open."""
        idle = self.app.config.http_session_idle_secs
        for session in [*self.by_principal.values(), *self.by_id.values()]:
            limit = idle if session.used else min(idle, HTTP_UNUSED_SESSION_SECS)
            if session.in_flight or time.monotonic() - session.last_seen < limit:
                continue
            log.info(
                "session %s %s for %d s: ending it",
                session.id,
                "idle" if session.used else "unused",
                limit,
            )
            if session.http_id is None:
                self.by_principal = {k: v for k, v in self.by_principal.items() if v is not session}
                await self.app.end_session(session)
            else:
                self.by_id.pop(session.http_id, None)
                await self.close_handshake_session(session)

    async def close_handshake_session(self, session: Session) -> None:
        """End a handshake-era session as its client's DELETE would, through the
        manager's public entry point: the SDK closes its streams and the
        connection's exit stack runs our cleanup."""
        headers = [
            (b"mcp-session-id", session.http_id.encode()),
            (b"mcp-protocol-version", (session.protocol or "2025-06-18").encode()),
        ]
        scope = {
            "type": "http",
            "asgi": {"version": "3.0"},
            "http_version": "1.1",
            "method": "DELETE",
            "scheme": "http",
            "path": self.path,
            "raw_path": self.path.encode(),
            "query_string": b"",
            "root_path": "",
            "headers": headers,
            "client": ("127.0.0.1", 0),
            "server": ("127.0.0.1", 0),
            "state": {},
        }
        statuses = []

        async def receive() -> dict:
            return {"type": "http.request", "body": b"", "more_body": False}

        async def send(message: dict) -> None:
            if message["type"] == "http.response.start":
                statuses.append(message["status"])

        try:
            await self.manager.handle_request(scope, receive, send)
        except Exception as err:
            statuses.append(describe(err))
        if statuses != [200]:
            log.warning("session %s: ending it for idleness answered %s", session.id, statuses)


SHUTDOWN_MESSAGE = (
    "the smol-mcp server is shutting down, so this call was stopped before it finished (what "
    "it started may have run in part). Reconnect once the server is back, and check the "
    "machine with get-machine before trying again."
)


class ShutdownAnswers:
    """ASGI middleware: when the process is told to stop (SIGTERM, SIGINT), a
    POST still being served is stopped and answered with a JSON-RPC error that
    says so, rather than held until the server's grace period ends and then
    cut off with a plain-text 500."""

    def __init__(self, app: Any, stopping: Callable[[], Any]):
        self.app, self.stopping = app, stopping  # stopping(): the Event set at shutdown, or None

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        stopping = self.stopping()
        if scope["type"] != "http" or scope["method"] != "POST" or stopping is None:
            await self.app(scope, receive, send)
            return
        import anyio

        body, started = bytearray(), False

        async def receive_copy() -> dict:
            message = await receive()
            if message["type"] == "http.request":
                body.extend(message.get("body", b""))
            return message

        async def send_watch(message: dict) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        async with anyio.create_task_group() as group:

            async def stop_on_shutdown() -> None:
                await stopping.wait()
                group.cancel_scope.cancel()

            group.start_soon(stop_on_shutdown)
            await self.app(scope, receive_copy, send_watch)
            group.cancel_scope.cancel()
        if stopping.is_set() and not started:
            await _respond(send, 200, json.dumps(shutdown_errors(bytes(body))).encode())


def shutdown_errors(body: bytes) -> Any:
    """The JSON-RPC error answer to a request body (one, or a batch)."""
    try:
        request = json.loads(body)
    except ValueError:
        request = None
    requests = request if isinstance(request, list) else [request]
    answers = [
        {
            "jsonrpc": "2.0",
            "id": r.get("id") if isinstance(r, dict) else None,
            "error": {"code": -32000, "message": SHUTDOWN_MESSAGE},
        }
        for r in requests
    ]
    return answers if isinstance(request, list) else answers[0]


def build_http_app(app: SmolMcp, host: str, port: int, path: str):
    """The ASGI application for --http: HttpGate in front of the SDK's
    Streamable HTTP session manager."""
    from mcp.server.streamable_http_manager import StreamableHTTPASGIApp, StreamableHTTPSessionManager
    from starlette.applications import Starlette
    from starlette.routing import Route

    config = app.config
    app.http = HttpSessions(app)
    app.server.middleware.append(app.http.track)
    manager = StreamableHTTPSessionManager(
        app.server, json_response=True, session_idle_timeout=config.http_session_idle_secs,
        max_request_body_size=HTTP_MAX_BODY_BYTES, max_sessions=HTTP_MAX_SESSIONS)
    app.http.manager, app.http.path = manager, path

    @asynccontextmanager
    async def lifespan(_):
        async with manager.run():  # enters the server's lifespan once; ends every session at exit
            yield

    inner = Starlette(routes=[Route(path, endpoint=StreamableHTTPASGIApp(manager))], lifespan=lifespan)
    inner = ShutdownAnswers(inner, lambda: app.http.stopping)
    return HttpGate(inner, tokens={"default": config.auth_token}, path=path,
                    allowed_hosts=default_allowed_hosts(config, host, port),
                    allowed_origins=config.http_allowed_origins)


async def run_http(app: SmolMcp, host: str, port: int, path: str) -> None:
    import uvicorn
    asgi = build_http_app(app, host, port, path)
    if asgi.allowed_hosts is None:
        log.warning("bound to %s with no SMOL_MCP_HTTP_ALLOWED_HOSTS: the Host check is off, because the name "
                    "clients dial is not knowable here; set it to that name", host)
    log.info("serving Streamable HTTP on http://%s:%d%s", host, port, path)
    config = uvicorn.Config(asgi, host=host, port=port, lifespan="on", log_level="warning",
                            timeout_graceful_shutdown=HTTP_GRACEFUL_SHUTDOWN_SECS)
    # SIGTERM and SIGINT end the lifespan, which cleans up.
    await stopping_server(config, app.http).serve()


def stopping_server(config: Any, sessions: HttpSessions):
    """uvicorn's Server, told about a stop signal the moment it arrives (so
    calls in flight are answered at once, see ShutdownAnswers), and exiting 0
    afterwards: uvicorn re-raises the signal once it is done, which would end
    the process by that signal after a clean shutdown."""
    import asyncio
    import anyio
    import uvicorn

    loop, stopping = asyncio.get_running_loop(), anyio.Event()
    sessions.stopping = stopping

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            loop.call_soon_threadsafe(stopping.set)  # in a signal handler: let the loop do the set
            super().handle_exit(sig, frame)

    for sig in (signal.SIGTERM, signal.SIGINT):
        # What uvicorn restores and re-raises into: handled already.
        signal.signal(sig, lambda *_: None)
    return Server(config)


# ---------------------------------------------------------------------------
# 14. Command line
# ---------------------------------------------------------------------------


SETUP_CLIENTS = ("claude-code", "claude-desktop", "cursor", "opencode", "codex")


def parse_args(argv: list[str]):
    import argparse
    parser = argparse.ArgumentParser(
        prog="smol-mcp", description="An MCP server that gives an AI agent microVMs (smol machines) to work in. "
                                     "Serves MCP over stdio by default.")
    parser.add_argument("--version", action="version", version=f"smol-mcp {__version__}")
    parser.add_argument("--http", action="store_true", help="serve Streamable HTTP instead of stdio")
    parser.add_argument("--host", help="with --http: address to bind (default 127.0.0.1)")
    parser.add_argument("--port", type=int, help="with --http: port (default 8080)")
    parser.add_argument("--path", help="with --http: endpoint path (default /mcp)")
    helpers = parser.add_subparsers(dest="command", metavar="{doctor,setup,parity}")
    helpers.add_parser("doctor", help="say whether each fleet works on this host, and what to do if not")
    setup = helpers.add_parser("setup", help="print (or --write) the configuration for an MCP client")
    setup.add_argument("client", choices=SETUP_CLIENTS)
    setup.add_argument("--write", action="store_true", help="merge it into the client's config file (backup first)")
    setup.add_argument("--http", dest="http_url", metavar="URL",
                       help="an entry for a smol-mcp --http server at URL instead of a local stdio one")
    helpers.add_parser("parity", help="compare the routes this server calls with the running serve's OpenAPI")
    args = parser.parse_args(argv)
    if (args.command or not args.http) and (args.host or args.port or args.path):
        parser.error("--host, --port and --path go with --http")
    if args.path is not None and not args.path.startswith("/"):
        parser.error(f"--path must start with '/', got {args.path!r}")
    if args.port is not None and not 1 <= args.port <= 65535:
        parser.error(f"--port must be between 1 and 65535, got {args.port}")
    if args.command == "setup" and args.http_url and not args.http_url.startswith(("http://", "https://")):
        parser.error(f"setup --http takes the server's URL, such as http://b.local:8080/mcp; got {args.http_url!r}")
    return args


# -- doctor ------------------------------------------------------------------


def doctor(app: SmolMcp) -> int:
    """Print what smol://targets knows, for a person; 0 when every served
    fleet is usable. The cloud key is tried with one list call."""
    document = targets_document(app)
    print(f"smol-mcp {__version__}: mode {document['mode']} (SMOL_MCP_TARGETS={app.config.targets})")
    healthy = True
    for name, facts in document["fleets"].items():
        if not facts["served"]:
            print(f"\n{name}: not served ({facts['reason']})")
            continue
        if name == "cloud" and facts["usable"]:
            try:
                count = len(app.fleets["cloud"].list_machines())
                facts["reason"] = f"the account key works ({count} machine(s) on the fleet)"
            except SmolError as err:
                facts.update(usable=False, reason=redact(str(err), app.config.secret_values()))
        healthy = healthy and facts["usable"]
        print(f"\n{name}: {'usable' if facts['usable'] else 'NOT USABLE'}")
        if name == "local":
            smolvm = facts["smolvm"]
            print(f"  smolvm: {smolvm['path'] or '(not found)'}"
                  + (f", version {smolvm['version']}" if smolvm["version"] else ""))
            print(f"  hypervisor: {facts['hypervisor']['detail']}")
            print(f"  serve: {facts['serve']}")
        else:
            print(f"  url: {facts['url']}, key set: {'yes' if facts['tokenSet'] else 'no'}")
        if facts["reason"]:
            print(f"  {'note' if facts['usable'] else 'to do'}: {facts['reason']}")
    return 0 if healthy else 1


# -- setup -------------------------------------------------------------------


def launch_command() -> list[str]:
    """The command a client should run: the installed console script when this
    module was installed as a package, else uv running this very file."""
    here = Path(__file__).resolve()
    if any(part in ("site-packages", "dist-packages") for part in here.parts):
        beside = Path(sys.executable).parent / "smol-mcp"  # works without the environment activated
        script = str(beside) if beside.exists() else shutil.which("smol-mcp")
        if script:
            return [script]
    return ["uv", "run", "--script", str(here)]


def client_entry(client: str, http_url: str | None) -> tuple[str, dict]:
    """(the top-level key, the server entry) in the client's own shape. Secrets
    are referenced through the client's environment syntax, never copied."""
    command = launch_command()
    if client == "opencode":
        if http_url:
            return "mcp", {"type": "remote", "url": http_url, "enabled": True,
                           "headers": {"Authorization": "Bearer {env:SMOL_MCP_AUTH_TOKEN}"}}
        return "mcp", {"type": "local", "command": command, "enabled": True}
    if client == "codex":
        if http_url:
            return "mcp_servers", {"url": http_url, "bearer_token_env_var": "SMOL_MCP_AUTH_TOKEN"}
        return "mcp_servers", {"command": command[0], "args": command[1:]}
    if http_url:
        if client == "claude-desktop":
            # It speaks stdio only, so the npm bridge carries HTTP; it reads no shell
            # environment, so the token has to be pasted into its env block by hand.
            return "mcpServers", {"command": "npx",
                                  "args": ["-y", "mcp-remote", http_url, "--header", "Authorization:${AUTH_HEADER}"],
                                  "env": {"AUTH_HEADER": "Bearer <paste the SMOL_MCP_AUTH_TOKEN value here>"}}
        reference = "${env:SMOL_MCP_AUTH_TOKEN}" if client == "cursor" else "${SMOL_MCP_AUTH_TOKEN}"
        return "mcpServers", {"type": "http", "url": http_url, "headers": {"Authorization": f"Bearer {reference}"}}
    return "mcpServers", {"command": command[0], "args": command[1:]}


def client_config_path(client: str) -> Path:
    home = Path.home()
    if client == "claude-code":
        return Path.cwd() / ".mcp.json"
    if client == "cursor":
        return Path.cwd() / ".cursor" / "mcp.json"
    if client == "opencode":
        return Path.cwd() / "opencode.json"
    if client == "codex":
        return home / ".codex" / "config.toml"
    if sys.platform == "darwin":
        return home / "Library" / "Application Support" / "Claude" / "claude_desktop_config.json"
    return Path(os.environ.get("XDG_CONFIG_HOME") or home / ".config") / "Claude" / "claude_desktop_config.json"


def render_entry(client: str, key: str, entry: dict) -> str:
    if client == "codex":
        lines = [f"[{key}.smol]"] + [f"{field} = {json.dumps(value)}" for field, value in entry.items()]
        return "\n".join(lines) + "\n"
    document = {key: {"smol": entry}}
    if client == "opencode":
        document = {"$schema": "https://opencode.ai/config.json", **document}
    return json.dumps(document, indent=2) + "\n"


def setup(client: str, http_url: str | None, write: bool) -> int:
    """Print the client's configuration block, or merge it into its file
    without disturbing other entries (after a backup; never into a file that
    does not parse)."""
    key, entry = client_entry(client, http_url)
    path = client_config_path(client)
    if not write:
        print(f"# {client}: add this to {path}", file=sys.stderr)  # stdout stays pastable as it is
        print(render_entry(client, key, entry), end="")
        return 0
    text = path.read_text() if path.exists() else ""
    if client == "codex":
        try:
            import tomllib
        except ImportError:
            print("smol-mcp: setup codex --write needs Python 3.11 or newer to check the TOML; print it and paste it",
                  file=sys.stderr)
            return 2
        try:
            existing = tomllib.loads(text)
        except tomllib.TOMLDecodeError as err:
            print(f"smol-mcp: {path} is not valid TOML ({err}); not touching it", file=sys.stderr)
            return 2
        if "smol" in existing.get(key, {}):
            print(f"smol-mcp: {path} already has [{key}.smol]; edit it by hand, or remove it and run this again",
                  file=sys.stderr)
            return 2
        merged = text + ("\n" if text and not text.endswith("\n") else "") + "\n" + render_entry(client, key, entry)
    else:
        try:
            existing = json.loads(text) if text.strip() else {}
            if not isinstance(existing, dict) or not isinstance(existing.get(key, {}), dict):
                raise ValueError(f'"{key}" is not an object')
        except ValueError as err:
            print(f"smol-mcp: {path} does not parse as this client's JSON ({err}); not touching it", file=sys.stderr)
            return 2
        existing.setdefault(key, {})["smol"] = entry
        if client == "opencode":
            existing.setdefault("$schema", "https://opencode.ai/config.json")
        merged = json.dumps(existing, indent=2) + "\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists():
        backup = path.with_name(path.name + f".bak-{time.strftime('%Y%m%d%H%M%S')}")
        shutil.copy2(path, backup)
        print(f"backed up {path} to {backup}")
    path.write_text(merged)
    print(f"wrote the smol entry into {path}")
    return 0


# -- parity ------------------------------------------------------------------


def parity(app: SmolMcp) -> int:
    """Print called / skipped / unknown / missing against the serve's spec;
    non-zero when a route this server calls is missing."""
    fleet = app.local
    fleet.acquire()
    try:
        spec = fleet.request("read the OpenAPI document", "GET", "/api-docs/openapi.json")
    finally:
        fleet.release()
    report = parity_report(spec)
    print(f"smolvm {fleet.version}: {len(report['called'])} called, {len(report['skipped'])} skipped, "
          f"{len(report['unknown'])} unknown, {len(report['missing'])} missing")
    for method, path in report["called"]:
        print(f"  called   {method:6} {path}")
    for (method, path), reason in report["skipped"]:
        print(f"  skipped  {method:6} {path}: {reason}")
    for method, path in report["unknown"]:
        print(f"  UNKNOWN  {method:6} {path}: new in this smolvm; decide whether a tool should call it")
    for method, path in report["missing"]:
        print(f"  MISSING  {method:6} {path}: called by smol-mcp but absent from this serve")
    return 1 if report["missing"] else 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``smol-mcp`` and ``python3 smol_mcp.py``."""
    args = parse_args(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="smol-mcp: %(message)s")
    log.setLevel(logging.INFO)  # ours: what a person watching stderr wants; the SDK's chatter stays at warnings
    if args.command == "setup":
        return setup(args.client, args.http_url, args.write)
    try:
        config = load_config()
        if args.http and not args.command and not config.auth_token:
            raise ConfigError("--http refuses to start without a token, because these tools run machines: set "
                              "SMOL_MCP_AUTH_TOKEN (for example to the output of `openssl rand -hex 16`) and have "
                              "clients send it as 'Authorization: Bearer <token>'")
        app = SmolMcp(config)
        if args.command == "doctor":
            return doctor(app)
        if args.command == "parity":
            return parity(app)
    except SmolError as err:
        print(f"smol-mcp: {err}", file=sys.stderr)
        return 2
    import anyio
    if args.http:
        anyio.run(run_http, app, args.host or config.http_host, args.port or config.http_port,
                  args.path or config.http_path)
        # Cleaned up and done: a worker thread a stopped call abandoned must not hold the exit.
        logging.shutdown()
        sys.stdout.flush()
        os._exit(0)
    else:
        anyio.run(run_stdio, app.server)
    return 0


def main_http() -> int:
    """Entry point of ``smol-mcp-http``."""
    return main(["--http", *sys.argv[1:]])


if __name__ == "__main__":
    sys.exit(main())
