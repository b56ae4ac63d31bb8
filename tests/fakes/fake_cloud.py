"""A stand-in for the smol cloud REST API, for tests.

FakeCloud serves HTTP/1.1 on 127.0.0.1 (an ephemeral port) in a background
thread, with the routes, field names, status codes and error body shapes that
the official Python SDK (smolmachines 1.32.2, `smol/transport.py`) sends and
reads, plus what the TypeScript product's README observed on the live service
in 2026-09 ("seed") and what the public docs repository `smol-machines/docs`
states ("public docs"). The guest is the busybox chroot of `fake_smolvm.py`.

Where a behaviour comes from, the code says so with one of these tags:

  [sdk]         read from smolmachines 1.32.2 (what it sends / reads / says
                in a comment about the control plane)
  [seed]        observed on the live service in 2026-09 by the seed's author
  [public docs] smol-machines/docs (cloud/api-reference.md, traps.md)
  [reference]   the project's notes on the cloud API (kept with its
                specification, outside this repository): the official
                client's routes and bodies, read section by section
  [assumption]  no source says; the most plausible choice, to be checked
                against the live service before a client relies on it

Standard library only, Python 3.11+.

    with FakeCloud(token="smk_test_token") as cloud:
        ...  # cloud.url == "http://127.0.0.1:PORT"
"""

from __future__ import annotations

import base64
import calendar
import http.server
import ipaddress
import json
import os
import platform
import random
import shutil
import signal
import socketserver
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
from pathlib import Path

HERE = Path(__file__).resolve().parent

if __package__:
    from . import fake_smolvm as _guest
else:  # imported with tests/fakes on sys.path, or run as a script
    if str(HERE) not in sys.path:
        sys.path.insert(0, str(HERE))
    import fake_smolvm as _guest

__all__ = ["FakeCloud"]

# --------------------------------------------------------------------------
# constants
# --------------------------------------------------------------------------

JSON_CT = "application/json"
TEXT_CT = "text/plain; charset=utf-8"
BYTES_CT = "application/octet-stream"

# [sdk] CLOUD_MAX_FILE_BYTES: "The largest file the cloud's file routes
# accept."
FILE_CAP = 100 * 1024 * 1024

# [public docs] a wrong key is a JSON 401 with exactly this body.
UNKNOWN_KEY_BODY = {"code": "unknown_key", "error": "unknown API key"}

# [seed] the exact text of the empty allow-list refusal (HTTP 400).
EMPTY_ALLOW_LIST = "allowCidrs network mode requires at least one CIDR or host"

CREATE_FIELDS = [
    "name",
    "source",
    "resources",
    "autoStopSeconds",
    "ttlSeconds",
    "forkable",
    "branchable",
    "network",
    "ports",
    "env",
    "workdir",
    "command",
    "credentials",
    "labels",
    "cacheDisk",
]
RESOURCE_FIELDS = ["diskGb", "cpus", "memoryMb", "diskDurability"]
NETWORK_FIELDS = ["mode", "cidrs", "hosts"]
PORT_FIELDS = ["port", "protocol"]
CACHE_DISK_FIELDS = ["cache", "version", "mountPath", "slot"]
EXEC_FIELDS = [
    "command",
    "env",
    "cwd",
    "timeoutSeconds",
    "user",
    "background",
    "stdin",
]
JOB_FIELDS = [
    "command",
    "env",
    "cwd",
    "timeoutSeconds",
    "user",
]  # [reference: "Detached jobs"]
BRANCH_FIELDS = ["name", "ports", "branchable", "forkable", "freezeSource"]
RESTORE_FIELDS = ["name", "network", "cacheDisk"]  # [sdk]
BRANCH_PORT_FIELDS = ["port", "hostPort", "protocol"]

# [assumption] defaults when `resources` leaves a size unset. The SDK assumes
# diskGb 20 when a record lacks it [sdk].
DEFAULT_CPUS = 2
DEFAULT_MEMORY_MB = 2048
DEFAULT_DISK_GB = 20

# [assumption] prices in micro-dollars, small enough that a few seconds of a
# 2-cpu machine costs tens of micros (the seed's whole cloud session: 449).
MICROS_PER_CPU_HOUR = 20_000
MICROS_PER_MEMORY_GB_HOUR = 2_500
MICROS_PER_DISK_GB_HOUR = 100
MICROS_PER_EGRESS_GB = 50_000

# [assumption] a per-minute request budget reported in x-ratelimit-remaining
# [public docs: the header exists]. The fake never answers 429.
RATE_LIMIT_PER_MINUTE = 1200

# [assumption] the console log of a boot; the local fake's kernel lines.
BOOT_LINES = list(_guest.BOOT_LINES)

PATH_ENV = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

# [assumption] the 500 text of a failed boot: the control plane relaying the
# node's agent error (wording from the local serve's failed boot).
BOOT_FAIL_TEXT = (
    "failed to start machine {id} on node {node}: agent did not become ready "
    "within "
    "30 seconds: no boot progress for 30 seconds"
)


# --------------------------------------------------------------------------
# small helpers
# --------------------------------------------------------------------------


def _rfc3339(t: float) -> str:
    return (
        time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(t))
        + f".{int((t % 1) * 1000):03d}Z"
    )


def _period_start(t: float) -> float:
    g = time.gmtime(t)
    return float(calendar.timegm((g.tm_year, g.tm_mon, 1, 0, 0, 0)))


def _period_end(t: float) -> float:
    g = time.gmtime(t)
    y, m = (g.tm_year + 1, 1) if g.tm_mon == 12 else (g.tm_year, g.tm_mon + 1)
    return float(calendar.timegm((y, m, 1, 0, 0, 0)))


def _hex(n: int) -> str:
    return "".join(random.choice("0123456789abcdef") for _ in range(n))


class Resp:
    __slots__ = ("status", "body", "ctype", "headers", "close", "stream")

    def __init__(
        self,
        status,
        body=b"",
        ctype=None,
        headers=None,
        close=False,
        stream=None,
    ):
        self.status = status
        self.body = body
        self.ctype = ctype
        self.headers = list(headers or [])
        self.close = (
            close or stream is not None
        )  # a stream ends with the connection
        self.stream = (
            stream  # an iterable of byte pieces, written as they come
        )


def json_resp(status, obj):
    return Resp(
        status, json.dumps(obj, separators=(",", ":")).encode(), JSON_CT
    )


def text_resp(status, text):
    return Resp(status, text.encode(), TEXT_CT)


class Bad(Exception):
    """An error answered as a plain-text body ([public docs]: 400, 403, 404,
    409, 422 and 501 bodies are plain text)."""

    def __init__(self, status, text, headers=None):
        super().__init__(text)
        self.status = status
        self.text = text
        self.headers = headers or []

    def resp(self):
        r = text_resp(self.status, self.text)
        r.headers += self.headers
        return r


# [assumption] serde-like wording for body validation errors (the control
# plane is a Rust service; the exact text was not observed). All are 400.
def _kind(v):
    if v is None:
        return "null"
    if isinstance(v, bool):
        return f"boolean `{str(v).lower()}`"
    if isinstance(v, int):
        return f"integer `{v}`"
    if isinstance(v, float):
        return f"floating point `{v}`"
    if isinstance(v, str):
        return f"string {json.dumps(v)}"
    if isinstance(v, list):
        return "sequence"
    return "map"


def _type_error(field, v, expected):
    return Bad(400, f"{field}: invalid type: {_kind(v)}, expected {expected}")


def _check_fields(obj, allowed, where=""):
    for k in obj:
        if k not in allowed:
            listed = ", ".join(f"`{a}`" for a in allowed)
            prefix = f"{where}: " if where else ""
            raise Bad(
                400, f"{prefix}unknown field `{k}`, expected one of {listed}"
            )


def _want_obj(v, field, nullable=False):
    if v is None and nullable:
        return None
    if not isinstance(v, dict):
        raise _type_error(field, v, "a map")
    return v


def _want_str(v, field, nullable=False):
    if v is None and nullable:
        return None
    if not isinstance(v, str):
        raise _type_error(field, v, "a string")
    return v


def _want_bool(v, field, nullable=False):
    if v is None and nullable:
        return None
    if not isinstance(v, bool):
        raise _type_error(field, v, "a boolean")
    return v


def _want_int(v, field, lo=0, hi=2**64 - 1, nullable=False, kind="u64"):
    if v is None and nullable:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise _type_error(field, v, kind)
    if not lo <= v <= hi:
        raise Bad(
            400,
            f"{field}: invalid value: integer `{v}`, expected {kind} in "
            f"{lo}..={hi}",
        )
    return v


def _want_str_list(v, field, nullable=False):
    if v is None and nullable:
        return None
    if not isinstance(v, list):
        raise _type_error(field, v, "a sequence")
    for i, x in enumerate(v):
        _want_str(x, f"{field}[{i}]")
    return list(v)


def _want_str_map(v, field, nullable=False):
    if v is None and nullable:
        return None
    if not isinstance(v, dict):
        raise _type_error(field, v, "a map")
    for k, x in v.items():
        _want_str(x, f"{field}.{k}")
    return dict(v)


# --------------------------------------------------------------------------
# HTTP plumbing
# --------------------------------------------------------------------------


class _Server(socketserver.ThreadingMixIn, http.server.HTTPServer):
    daemon_threads = True
    allow_reuse_address = True


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "fake-smol-cloud"
    sys_version = ""

    def log_message(self, fmt, *args):  # quiet
        pass

    def _any(self):
        self.server.fake._serve(self)

    do_GET = do_POST = do_PUT = do_DELETE = do_HEAD = do_PATCH = do_OPTIONS = (
        _any
    )


def _read_chunked(rfile, cap):
    out = bytearray()
    while True:
        line = rfile.readline(65537)
        if not line:
            raise ValueError("truncated chunked body")
        size = int(line.split(b";", 1)[0].strip() or b"0", 16)
        if size == 0:
            while rfile.readline(65537) not in (b"\r\n", b"\n", b""):
                pass
            return (b"", True) if out is None else (bytes(out), False)
        chunk = rfile.read(size)
        rfile.readline(3)
        if out is not None and len(out) + size > cap:
            out = None  # too large: keep draining, keep nothing
        if out is not None:
            out += chunk


# --------------------------------------------------------------------------
# the fake
# --------------------------------------------------------------------------


class FakeCloud:
    """A fake smol cloud control plane.

    token: the one API key accepted (as `authorization: Bearer <token>`).
    blocked_spelling: "accepted" (`network: {"mode":"blocked"}` works, as the
        SDK sends it) or "refused" (a 400 "unknown network mode `blocked`", a
        service that predates that spelling, so a client's fallback can be
        tested).
    files_route: False makes every `/files/...` route a plain 404, like a
        deployment that predates the suffix route [seed].
    exec_output_cap: the byte cap on the text `stdout`/`stderr` of an exec
        (1 MiB on the service [sdk]); the B64 fields are never cut.
    list_shape: "array" (a bare JSON array [seed]) or "object"
        (`{"machines":[...]}`, which the SDK also accepts [sdk]).
    branch_route: "branches" (both `/branches` and `/fork` work) or "fork"
        (`/branches` answers 404, the control plane before branch routes
        [sdk: the SDK's fallback]).
    ready_delay: seconds between a start and the machine reporting ready;
        exec waits it out (it waits for the agent [public docs]).
    boot: "ok" or "fail" (every start, including exec's auto-start, answers
        500 and leaves the machine in state "error").
    exec_b64: False omits `stdoutB64`/`stderrB64` from exec answers, a
        control plane that predates them [sdk: `_decode_exec_bytes` falls
        back to the text "when a control predates it"]; then the capped text
        is all a client gets.

    Test helpers: `.url`, `.machines` (id -> record: the public keys plus
    private ones starting with "_"), `.requests` (a list of (method,
    path_with_query, headers with lowercased names, parsed JSON body or None)),
    `.guest_root(id)`, `.append_log(id, line)`, `.usage(id)` (the usage report
    as `GET .../usage` answers it, also for a deleted machine), and
    `.set_port_listening(id, port, listening=True)` (something now listens on
    a published port, so `ready` and `url` can flip), and `.break_streams`
    (True: an exec stream ends after its first event, without `exit`).

    `exec/stream` and the detached jobs routes follow the project's notes on
    the cloud API (its sections "exec/stream" and "Detached jobs"), not an
    observation. So do pause and resume, checkpoints (capture, list,
    restore, delete), `PUT .../ports` and port links: the SDK's calls and
    the fields it reads, the rest tagged where it is written.
    """

    def __init__(
        self,
        *,
        token="smk_test_token",
        blocked_spelling="accepted",
        files_route=True,
        exec_output_cap=1 << 20,
        list_shape="array",
        branch_route="branches",
        ready_delay=0.0,
        boot="ok",
        exec_b64=True,
    ):
        if blocked_spelling not in ("accepted", "refused"):
            raise ValueError(
                "blocked_spelling must be 'accepted' or 'refused'"
            )
        if list_shape not in ("array", "object"):
            raise ValueError("list_shape must be 'array' or 'object'")
        if branch_route not in ("branches", "fork"):
            raise ValueError("branch_route must be 'branches' or 'fork'")
        if boot not in ("ok", "fail"):
            raise ValueError("boot must be 'ok' or 'fail'")
        self.token = token
        self.blocked_spelling = blocked_spelling
        self.files_route = files_route
        self.exec_output_cap = int(exec_output_cap)
        self.list_shape = list_shape
        self.branch_route = branch_route
        self.ready_delay = float(ready_delay)
        self.boot = boot
        self.exec_b64 = bool(exec_b64)
        self.break_streams = (
            False  # True: an exec stream ends after one event, without `exit`
        )
        self.requests = []
        self.url = None
        self._machines = {}  # id -> record (insertion order = creation order)
        self._checkpoints = {}  # id -> checkpoint (see _h_checkpoints)
        self._deleted = {}  # id -> record, for usage after deletion
        self._roots = {}
        self._lock = threading.RLock()
        self._server = None
        self._thread = None
        self._tmp = None
        self._hits = []  # request times, for x-ratelimit-remaining
        self._account_id = "acct_" + _hex(16)
        self._failures = []  # injected transient failures, see fail_next
        self._created_at = time.time()

    # ---- lifecycle
    def start(self):
        self._tmp = tempfile.mkdtemp(prefix="fake-cloud-")
        self._server = _Server(("127.0.0.1", 0), _Handler)
        self._server.fake = self
        host, port = self._server.server_address[:2]
        self.url = f"http://{host}:{port}"
        self._thread = threading.Thread(
            target=self._server.serve_forever,
            name="fake-cloud",
            kwargs={"poll_interval": 0.1},
            daemon=True,
        )
        self._thread.start()
        return self

    def stop(self):
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        with self._lock:
            for m in self._machines.values():
                self._kill_background(m)
        if self._tmp:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None
            self._roots.clear()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()

    # ---- test helpers
    @property
    def machines(self):
        with self._lock:
            self._sweep()
            for m in self._machines.values():
                self._refresh(m)
            return self._machines

    def guest_root(self, machine_id):
        with self._lock:
            return self._root(machine_id)

    def append_log(self, machine_id, line):
        with self._lock:
            self._machines[machine_id]["_console"].append(str(line))

    def usage(self, machine_id):
        with self._lock:
            m = self._machines.get(machine_id) or self._deleted[machine_id]
            return self._usage_report(m)

    def set_port_listening(self, machine_id, port, listening=True):
        with self._lock:
            m = self._machines[machine_id]
            if listening:
                m["_listening"].add(int(port))
            else:
                m["_listening"].discard(int(port))
            self._refresh(m)

    # ---- HTTP
    def _serve(self, h):
        method = h.command
        target = h.path
        headers = {k.lower(): v for k, v in h.headers.items()}
        too_big = False
        body = b""
        try:
            if "chunked" in headers.get("transfer-encoding", "").lower():
                body, too_big = _read_chunked(h.rfile, FILE_CAP)
            elif headers.get("content-length"):
                n = int(headers["content-length"])
                if n < 0:
                    raise ValueError(n)
                if n > FILE_CAP:
                    # Drain it, so the client is not cut off mid-send and
                    # reads the answer; then the connection is closed.
                    too_big = True
                    while n > 0:
                        got = h.rfile.read(min(n, 1 << 20))
                        if not got:
                            break
                        n -= len(got)
                else:
                    body = h.rfile.read(n)
        except ValueError:
            self._write(
                h,
                method,
                text_resp(400, "invalid request body framing"),
                close=True,
            )
            return
        parsed = None
        if body and JSON_CT in headers.get("content-type", "").lower():
            try:
                parsed = json.loads(body)
            except ValueError:
                parsed = None
        with self._lock:
            self.requests.append((method, target, headers, parsed))
        try:
            resp = self._handle(method, target, headers, body or b"", too_big)
        except Bad as e:
            resp = e.resp()
        except (
            Exception
        ) as e:  # a bug in the fake: say so rather than hang the client
            resp = text_resp(
                500, f"fake cloud internal error: {type(e).__name__}: {e}"
            )
        # A body that was not read leaves the connection unusable.
        self._write(h, method, resp, close=too_big or resp.close)

    def _write(self, h, method, resp, close=False):
        h.send_response(resp.status)
        if resp.ctype:
            h.send_header("content-type", resp.ctype)
        if resp.stream is None:
            h.send_header("content-length", str(len(resp.body)))
        # [sdk] the SDK quotes `x-request-id` in every error; its format is an
        # [assumption].
        h.send_header("x-request-id", "req_" + _hex(24))
        h.send_header(
            "x-ratelimit-remaining", str(self._rate_remaining())
        )  # [public docs]
        for k, v in resp.headers:
            h.send_header(k, v)
        if close:
            h.send_header("connection", "close")
            h.close_connection = True
        h.end_headers()
        if method != "HEAD" and resp.body:
            h.wfile.write(resp.body)
        h.wfile.flush()
        for piece in resp.stream or ():
            h.wfile.write(piece)
            h.wfile.flush()

    def _rate_remaining(self):
        now = time.monotonic()
        with self._lock:
            self._hits = [t for t in self._hits if now - t < 60] + [now]
            return max(0, RATE_LIMIT_PER_MINUTE - len(self._hits))

    def fail_next(
        self,
        method,
        path_prefix,
        status,
        times=1,
        *,
        body=b"service temporarily unavailable",
        content_type=None,
        retry_after="0",
    ):
        """Answer the next `times` matching requests with `status` and a plain
        text body, as a busy or restarting service would [assumption: the
        wording], with `retry-after: 0` so a retrying client does not wait.
        `body`, `content_type` and `retry_after` stand in for what a proxy or
        a captive portal in front of the service can answer instead (a 200
        HTML page, an empty or broken JSON body, a long Retry-After): not the
        service's own answers, but answers a client meets [assumption]."""
        with self._lock:
            self._failures.append(
                {
                    "method": method,
                    "prefix": path_prefix,
                    "status": status,
                    "times": times,
                    "body": body,
                    "content_type": content_type or TEXT_CT,
                    "retry_after": retry_after,
                }
            )

    # ---- routing
    def _handle(self, method, target, headers, body, too_big):
        # Auth first, on every path, known or not [public docs].
        auth = headers.get("authorization")
        if auth is None:
            return Resp(401)  # empty body [public docs]
        scheme, _, key = auth.strip().partition(" ")
        if scheme.lower() != "bearer" or key.strip() != self.token:
            return json_resp(401, UNKNOWN_KEY_BODY)
        with self._lock:
            self._sweep()
        path, _, qs = target.partition("?")
        with self._lock:
            for rule in self._failures:
                if (
                    rule["times"] > 0
                    and rule["method"] == method
                    and path.startswith(rule["prefix"])
                ):
                    rule["times"] -= 1
                    wait = rule["retry_after"]
                    extra = [("retry-after", wait)] if wait is not None else []
                    return Resp(
                        rule["status"],
                        rule["body"],
                        rule["content_type"],
                        headers=extra,
                    )
        q = urllib.parse.parse_qs(qs, keep_blank_values=True)
        if path == "/v1/account":
            self._allow(method, "GET,HEAD")
            return self._h_account()
        if path == "/v1/machines":
            self._allow(method, "GET,HEAD,POST")
            if method == "POST":
                if too_big:
                    raise Bad(413, "request body too large")
                return self._h_create(headers, body)
            return self._h_list(q)
        if path.startswith("/v1/checkpoints/"):
            return self._checkpoint_route(method, path, headers, body)
        prefix = "/v1/machines/"
        if not path.startswith(prefix):
            raise self._no_route()
        mid, slash, sub = path[len(prefix) :].partition("/")
        mid = urllib.parse.unquote(mid)
        if not mid:
            raise self._no_route()
        if not slash:
            self._allow(method, "GET,HEAD,DELETE")
            if method == "DELETE":
                return self._h_delete(mid, q)
            return json_resp(200, self._public(self._get(mid)))
        if sub == "files" or sub.startswith("files/"):
            if not self.files_route:
                # a deployment without the suffix route [seed]
                raise self._no_route()
            self._allow(method, "GET,HEAD,PUT")
            if method == "PUT" and too_big:
                self._get(mid)
                # [assumption] wording; the cap itself is [sdk].
                raise Bad(413, f"file exceeds the {FILE_CAP >> 20} MiB limit")
            return self._h_files(
                method, mid, urllib.parse.unquote(sub[len("files/") :]), body
            )
        if too_big:
            raise Bad(413, "request body too large")
        routes = {
            "start": ("POST", lambda: self._h_start(mid, q)),
            "stop": ("POST", lambda: self._h_stop(mid)),
            "usage": ("GET,HEAD", lambda: self._h_usage(mid)),
            "exec": ("POST", lambda: self._h_exec(mid, q, headers, body)),
            "exec/stream": (
                "POST",
                lambda: self._h_exec(mid, q, headers, body, stream=True),
            ),
            "jobs": (
                "GET,HEAD,POST",
                lambda: self._h_jobs(method, mid, headers, body),
            ),
            "logs": ("GET,HEAD", lambda: self._h_logs(mid, q)),
            "branches": (
                "POST",
                lambda: self._h_branch("branches", mid, headers, body),
            ),
            "fork": (
                "POST",
                lambda: self._h_branch("fork", mid, headers, body),
            ),
            "pause": ("POST", lambda: self._h_pause(mid)),
            "resume": ("POST", lambda: self._h_resume(mid)),
            "checkpoints": (
                "GET,HEAD,POST",
                lambda: self._h_checkpoints(method, mid),
            ),
            "ports": ("PUT", lambda: self._h_ports(mid, headers, body)),
            "port-links": (
                "POST,DELETE",
                lambda: self._h_port_links(method, mid),
            ),
        }
        job_id, job_sub = "", ""
        if sub.startswith("jobs/"):
            job_id, _, job_sub = sub[len("jobs/") :].partition("/")
        if job_id and job_sub in ("", "output", "cancel"):
            allowed = "POST" if job_sub == "cancel" else "GET,HEAD"
            self._allow(method, allowed)
            return self._h_job(mid, urllib.parse.unquote(job_id), job_sub, q)
        if sub not in routes or (
            sub == "branches" and self.branch_route == "fork"
        ):
            raise self._no_route()
        allowed, fn = routes[sub]
        self._allow(method, allowed)
        return fn()

    @staticmethod
    def _no_route():
        # [assumption] wording; plain text per [public docs].
        return Bad(404, "not found")

    @staticmethod
    def _allow(method, allowed):
        if method not in allowed.split(","):
            # [seed] a wrong method on a known route is 405 with `allow`;
            # the body text is an [assumption].
            raise Bad(405, "method not allowed", headers=[("allow", allowed)])

    @staticmethod
    def _json_body(headers, body):
        ctype = headers.get("content-type", "").lower()
        if JSON_CT not in ctype:
            # [assumption] an axum-like 415 for a body route sent without JSON.
            raise Bad(
                415, "Expected request with `Content-Type: application/json`"
            )
        try:
            obj = json.loads(body.decode("utf-8") if body else "")
        except (ValueError, UnicodeDecodeError) as e:
            raise Bad(
                400, f"failed to parse the request body as JSON: {e}"
            )  # [assumption]
        if not isinstance(obj, dict):
            raise _type_error("body", obj, "a map")
        return obj

    # ---- machine state
    def _root(self, mid):
        root = self._roots.get(mid)
        if root is None or not os.path.isdir(root):
            root = tempfile.mkdtemp(prefix=f"{mid}-", dir=self._tmp)
            # mkdtemp makes 0700, which would stop a per-command `user` from
            # reaching anything once chrooted; a guest's / is 0755.
            os.chmod(root, 0o755)
            _guest.populate_guest_root(root)
            self._roots[mid] = root
        return root

    def _get(self, mid):
        with self._lock:
            m = self._machines.get(mid)
            if m is None:
                # By id only: a name is a 404 too, so a client resolves names
                # with the list [sdk: connect_transport; seed]. Wording
                # [assumption].
                raise Bad(404, f"machine {mid} not found")
            self._refresh(m)
            return m

    def _refresh(self, m):
        now = time.time()
        if (
            m["state"] == "running"
            and not m["ready"]
            and now >= m["_bootDoneAt"]
        ):
            guest_ports = {p["port"] for p in m["ports"]}
            # [sdk][seed] ready means the agent answers and every published
            # port accepts connections: a port nobody listens on keeps ready
            # false and url null.
            if guest_ports <= m["_listening"]:
                m["ready"] = True
                m["readyAt"] = _rfc3339(max(m["_bootDoneAt"], m["_startedAt"]))
        if m["ready"] and m["ports"] and m["url"] is None:
            # [assumption] the ingress URL's form; .invalid routes nowhere.
            m["url"] = (
                f"https://{m['id']}-{m['ports'][0]['port']}.apps.smol.invalid"
            )
        if not m["ready"]:
            m["url"] = None

    def _sweep(self):
        """The control plane's own idle stop and TTL [seed: "a process that
        dies ... leaves them to the control plane's own idle stop and TTL"];
        applied lazily, on each request. The exact timing is [assumption]."""
        now = time.time()
        for mid, m in list(self._machines.items()):
            ttl = m["ttlSeconds"]
            if ttl is not None and now - m["_created"] >= ttl:
                self._delete(m, now)
                continue
            stop_after = m["autoStopSeconds"]
            # [reference] no auto-stop while a job runs
            running_job = any(j["state"] == "running" for j in m["_jobs"])
            if (
                stop_after is not None
                and m["state"] == "running"
                and not running_job
                and now - m["_lastActivity"] >= stop_after
            ):
                self._stop(m, now)
                m["_console"].append(
                    "control-plane: idle for %ss, stopping" % stop_after
                )

    def _alloc_host_port(self):
        # [sdk] the node picks the host port; the range is an [assumption].
        used = {
            p["hostPort"] for m in self._machines.values() for p in m["ports"]
        }
        while True:
            hp = random.randint(30000, 60999)
            if hp not in used:
                return hp

    def _boot(self, m, now):
        """stopped/error -> running. Raises Bad(500) when boot="fail"."""
        if self.boot == "fail":
            # [assumption] a failed boot leaves the machine in state "error"
            # (the SDK's readiness wait fails at once on it [sdk]); a later
            # start tries again; delete works.
            m["state"] = "error"
            m["ready"] = False
            m["readyAt"] = None
            m["_console"].append(
                "smolvm-agent: boot failed: no boot progress for 30 seconds"
            )
            raise Bad(500, BOOT_FAIL_TEXT.format(id=m["id"], node=m["_node"]))
        m["state"] = "running"
        m["ready"] = False
        m["readyAt"] = None
        m["url"] = None
        m["_startedAt"] = now
        m["_bootDoneAt"] = now + self.ready_delay
        m["_runSince"] = now
        m["_lastActivity"] = now
        m["_everStarted"] = True
        for p in m["ports"]:
            if p["hostPort"] is None:
                p["hostPort"] = self._alloc_host_port()
        m["_console"].extend(BOOT_LINES)
        if m["command"]:
            # [assumption] the fake records the workload command but does
            # not run it.
            m["_console"].append("workload: " + " ".join(m["command"]))
        self._refresh(m)

    def _stop(self, m, now):
        if m["_runSince"] is not None:
            m["_uptime"] += now - m["_runSince"]
            m["_runSince"] = None
        self._kill_background(m)
        m["state"] = "stopped"
        m["ready"] = False
        m["readyAt"] = None
        m["url"] = None
        # [assumption] a stopped machine's ports are not placed on a node, so
        # they read hostPort null [sdk: "a port not yet placed has no
        # hostPort"].
        for p in m["ports"]:
            p["hostPort"] = None
        # [public docs] the guest temp directory is memory-backed and emptied
        # on restart.
        root = self._roots.get(m["id"])
        if root:
            tmp = os.path.join(root, "tmp")
            for name in os.listdir(tmp) if os.path.isdir(tmp) else []:
                p = os.path.join(tmp, name)
                if os.path.isdir(p) and not os.path.islink(p):
                    shutil.rmtree(p, ignore_errors=True)
                else:
                    try:
                        os.unlink(p)
                    except OSError:
                        pass
        m["_console"].append("smolvm-agent: shutting down")

    def _delete(self, m, now):
        if m["_runSince"] is not None:
            m["_uptime"] += now - m["_runSince"]
            m["_runSince"] = None
        self._kill_background(m)
        m["state"] = "deleted"
        m["ready"] = False
        m["url"] = None
        m["_deletedAt"] = now
        del self._machines[m["id"]]
        self._deleted[m["id"]] = m
        root = self._roots.pop(m["id"], None)
        if root:
            shutil.rmtree(root, ignore_errors=True)

    def _kill_background(self, m):
        for job in m.get("_jobs", []):
            self._end_job(job, "lost")
        for p in m.get("_bg", []):
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except OSError:
                pass
            try:
                p.wait(timeout=2)
            except Exception:
                pass
        m["_bg"] = []

    def _public(self, m):
        """The record as the API returns it [sdk: section 4 fields]."""
        order = [
            "id",
            "name",
            "state",
            "ready",
            "readyAt",
            "url",
            "source",
            "resources",
            "network",
            "ports",
            "labels",
            "env",
            "workdir",
            "command",
            "credentials",
            "cacheDisk",
            "autoStopSeconds",
            "ttlSeconds",
            "expiresAt",
            "ephemeral",
            "forkable",
            "branchable",
            "parent",
            "sourceMachineId",
            "createdAt",
        ]
        out = {}
        for k in order:
            if k in m:
                v = m[k]
                out[k] = (
                    json.loads(json.dumps(v))
                    if isinstance(v, (dict, list))
                    else v
                )
        return out

    def _usage_report(self, m):
        """[sdk] section 5.6 shape. Numbers: uptime x size at the
        [assumption] prices above. A mid-life read is computed live here; the
        service's is a lower bound from a periodic rollup [sdk]."""
        end = m.get("_deletedAt") or time.time()
        up = m["_uptime"] + (
            end - m["_runSince"] if m["_runSince"] is not None else 0.0
        )
        life = max(0.0, end - m["_created"])
        res = m["resources"]
        cpu_h = up / 3600 * res["cpus"]
        mem_h = up / 3600 * res["memoryMb"] / 1024
        disk_h = life / 3600 * res["diskGb"]
        egress = 0.0
        cost = {
            "cpuMicros": int(round(cpu_h * MICROS_PER_CPU_HOUR)),
            "memoryMicros": int(round(mem_h * MICROS_PER_MEMORY_GB_HOUR)),
            "diskMicros": int(round(disk_h * MICROS_PER_DISK_GB_HOUR)),
            "egressMicros": int(round(egress * MICROS_PER_EGRESS_GB)),
        }
        cost["totalMicros"] = sum(cost.values())
        cost["amountDueMicros"] = cost[
            "totalMicros"
        ]  # [assumption] no credits
        return {
            "machineId": m["id"],
            "from": _rfc3339(_period_start(end)),
            "to": _rfc3339(end),
            "usage": {
                "totalUptimeSeconds": round(up, 3),
                "cpuHours": round(cpu_h, 9),
                "memoryGbHours": round(mem_h, 9),
                "diskGbHours": round(disk_h, 9),
                "egressGb": egress,
            },
            "cost": cost,
        }

    # ---- handlers
    def _h_account(self):
        # [assumption] the whole shape: the seed's test suite reads
        # `GET /v1/account` for the period spend, and the SDK never calls it.
        now = time.time()
        with self._lock:
            spend = sum(
                self._usage_report(m)["cost"]["totalMicros"]
                for m in list(self._machines.values())
                + list(self._deleted.values())
            )
        return json_resp(
            200,
            {
                "id": self._account_id,
                "email": "test@example.com",
                "plan": "payg",
                "periodStart": _rfc3339(_period_start(now)),
                "periodEnd": _rfc3339(_period_end(now)),
                "periodSpendMicros": spend,
                "spendLimitMicros": None,
                "machineCount": len(self._machines),
            },
        )

    def _h_list(self, q):
        want = []
        for spec in q.get("label", []):
            k, eq, v = spec.partition("=")
            if not eq or not k:
                raise Bad(
                    400, f"invalid label filter `{spec}`: expected key=value"
                )  # [assumption]
            want.append((k, v))
        with self._lock:
            rows = []
            for m in self._machines.values():
                self._refresh(m)
                if all(m["labels"].get(k) == v for k, v in want):
                    rows.append(self._public(m))
        # [seed] a bare array; [sdk] also accepts {"machines": [...]}.
        return json_resp(
            200, rows if self.list_shape == "array" else {"machines": rows}
        )

    def _parse_network(self, v):
        net = _want_obj(v, "network")
        _check_fields(net, NETWORK_FIELDS, "network")
        mode = (
            _want_str(net.get("mode"), "network.mode")
            if "mode" in net
            else None
        )
        if mode is None:
            raise Bad(400, "network: missing field `mode`")
        cidrs = (
            _want_str_list(net.get("cidrs"), "network.cidrs", nullable=True)
            or []
        )
        hosts = (
            _want_str_list(net.get("hosts"), "network.hosts", nullable=True)
            or []
        )
        if mode == "open":
            return {"mode": "open"}  # [sdk]
        if mode == "blocked":
            if self.blocked_spelling == "refused":
                # [assumption] a service predating the spelling (the seed
                # used an allow list to deny; the SDK sends `blocked`).
                raise Bad(400, "unknown network mode `blocked`")
            return {"mode": "blocked"}  # [sdk]
        if mode == "allowCidrs":
            if not cidrs and not hosts:
                raise Bad(400, EMPTY_ALLOW_LIST)  # [seed] exact text
            for c in cidrs:
                try:
                    ipaddress.ip_network(c, strict=False)
                except ValueError:
                    raise Bad(400, f"invalid CIDR `{c}`")  # [assumption]
            return {
                "mode": "allowCidrs",
                "cidrs": cidrs,
                "hosts": hosts,
            }  # [sdk]
        raise Bad(400, f"unknown network mode `{mode}`")  # [assumption]

    @staticmethod
    def _parse_ports(v, field, allowed):
        ports = []
        if not isinstance(v, list):
            raise _type_error(field, v, "a sequence")
        for i, p in enumerate(v):
            p = _want_obj(p, f"{field}[{i}]")
            _check_fields(p, allowed, f"{field}[{i}]")
            if "port" not in p:
                raise Bad(400, f"{field}[{i}]: missing field `port`")
            port = _want_int(
                p["port"], f"{field}[{i}].port", 1, 65535, kind="u16"
            )
            proto = p.get("protocol")
            if proto not in (None, "tcp"):
                # [sdk] TCP only on cloud; the status/wording is [assumption].
                raise Bad(
                    400,
                    f"{field}[{i}].protocol: only tcp ports can be published",
                )
            if "hostPort" in p:
                _want_int(
                    p["hostPort"],
                    f"{field}[{i}].hostPort",
                    0,
                    65535,
                    nullable=True,
                    kind="u16",
                )
            if port not in ports:
                ports.append(port)
        return ports

    def _h_create(self, headers, body):
        req = self._json_body(headers, body)
        # Strict: no field outside section 5.1, notably no `ephemeral` [sdk:
        # "There is no `ephemeral` field in the request"; seed constraint h].
        # The 400 and its serde-like wording are an [assumption].
        _check_fields(req, CREATE_FIELDS)
        if "forkable" in req and "branchable" in req:
            raise Bad(
                400, "duplicate field `forkable`"
            )  # serde alias [assumption]
        if "source" not in req or req["source"] is None:
            raise Bad(
                400, "missing field `source`"
            )  # [sdk] required; wording [assumption]
        src = _want_obj(req["source"], "source")
        _check_fields(src, ["type", "reference"], "source")
        stype = _want_str(src.get("type"), "source.type")
        # [sdk] builds type "image"; [public docs] a `.smolmachine` registry
        # reference is also a source (its type name is an [assumption]).
        if stype not in ("image", "smolmachine"):
            raise Bad(
                400,
                f"source.type: unknown variant `{stype}`, expected `image` or "
                "`smolmachine`",
            )
        ref = _want_str(src.get("reference"), "source.reference")
        if not ref.strip():
            raise Bad(400, "source.reference must not be empty")
        name = _want_str(req.get("name"), "name", nullable=True)
        if name is not None and (
            not 1 <= len(name) <= 128 or name.strip() != name
        ):
            raise Bad(
                400, f"invalid machine name {json.dumps(name)}"
            )  # [assumption]
        res_in = (
            _want_obj(req.get("resources"), "resources", nullable=True) or {}
        )
        _check_fields(res_in, RESOURCE_FIELDS, "resources")
        disk = _want_int(
            res_in.get("diskGb"),
            "resources.diskGb",
            1,
            2048,
            nullable=True,
            kind="u32",
        )
        cpus = _want_int(
            res_in.get("cpus"),
            "resources.cpus",
            1,
            64,
            nullable=True,
            kind="u8",
        )
        mem = _want_int(
            res_in.get("memoryMb"),
            "resources.memoryMb",
            128,
            262144,
            nullable=True,
            kind="u32",
        )
        dur = _want_str(
            res_in.get("diskDurability"),
            "resources.diskDurability",
            nullable=True,
        )
        if dur is not None and dur not in ("full", "deferred"):
            raise Bad(
                400,
                f"resources.diskDurability: unknown variant `{dur}`, expected "
                "`full` or `deferred`",
            )
        auto_stop = _want_int(
            req.get("autoStopSeconds"), "autoStopSeconds", nullable=True
        )
        ttl = _want_int(req.get("ttlSeconds"), "ttlSeconds", nullable=True)
        forkable = req.get("forkable", req.get("branchable", False))
        forkable = bool(_want_bool(forkable, "forkable", nullable=True))
        # [sdk][public docs] an omitted network opens egress; echoed as open.
        network = (
            self._parse_network(req["network"])
            if req.get("network") is not None
            else {"mode": "open"}
        )
        ports = (
            self._parse_ports(req["ports"], "ports", PORT_FIELDS)
            if req.get("ports") is not None
            else []
        )
        # Ports together with a blocked network are accepted: the seed's
        # product refuses that pair client-side, the SDK sends it without
        # complaint, and no source says the service refuses it [assumption].
        env = _want_str_map(req.get("env"), "env", nullable=True) or {}
        workdir = _want_str(req.get("workdir"), "workdir", nullable=True)
        command = _want_str_list(req.get("command"), "command", nullable=True)
        creds = _want_str_list(
            req.get("credentials"), "credentials", nullable=True
        )
        labels = (
            _want_str_map(req.get("labels"), "labels", nullable=True) or {}
        )
        cache = _want_obj(req.get("cacheDisk"), "cacheDisk", nullable=True)
        if cache is not None:
            _check_fields(cache, CACHE_DISK_FIELDS, "cacheDisk")
            _want_str(cache.get("cache"), "cacheDisk.cache")
        now = time.time()
        with self._lock:
            mid = "mach-" + _hex(12)
            while mid in self._machines or mid in self._deleted:
                mid = "mach-" + _hex(12)
            if name is None:
                # [assumption] the service names an unnamed machine by its id
                name = mid
            if any(x["name"] == name for x in self._machines.values()):
                raise Bad(
                    409, f"machine named `{name}` already exists"
                )  # [public docs] 409 text; wording [assumption]
            m = {
                "id": mid,
                "name": name,
                "state": "stopped",  # [sdk][seed] created stopped
                "ready": False,
                "readyAt": None,
                "url": None,
                "source": {"type": stype, "reference": ref},
                "resources": {
                    "cpus": cpus or DEFAULT_CPUS,
                    "memoryMb": mem or DEFAULT_MEMORY_MB,
                    "diskGb": disk or DEFAULT_DISK_GB,
                    "diskDurability": dur or "full",
                },
                "network": network,
                "ports": [{"port": p, "hostPort": None} for p in ports],
                "labels": labels,
                "env": env,
                "workdir": workdir,
                "command": command,
                "credentials": creds or [],
                "cacheDisk": cache,
                "autoStopSeconds": auto_stop,
                "ttlSeconds": ttl,
                "expiresAt": _rfc3339(now + ttl) if ttl is not None else None,
                # [sdk: records carry it; seed: TTL is what makes it]
                "ephemeral": ttl is not None,
                "forkable": forkable,  # [sdk] reads branchable, then forkable
                "branchable": forkable,
                "createdAt": _rfc3339(now),
                "_created": now,
                "_startedAt": 0.0,
                "_bootDoneAt": 0.0,
                "_runSince": None,
                "_uptime": 0.0,
                "_lastActivity": now,
                "_everStarted": False,
                "_bootForkable": False,
                "_listening": set(),
                "_console": [],
                "_bg": [],
                "_jobs": [],
                "_node": "node-" + _hex(6),
                "_deletedAt": None,
            }
            self._machines[mid] = m
            root = self._root(mid)
            if workdir:
                try:
                    os.makedirs(
                        _guest.guest_resolve(root, workdir), exist_ok=True
                    )
                except OSError:
                    pass
            # [assumption] 201; the SDK accepts any 2xx and reads `id`.
            return json_resp(201, self._public(m))

    def _h_start(self, mid, q):
        with self._lock:
            m = self._get(mid)
            self._refuse_paused(m)
            if m["state"] == "frozen":
                raise Bad(
                    409,
                    f"machine {mid} is frozen as a branch base and cannot "
                    "be started",
                )  # [assumption]
            # [sdk] `?forkable=true` only affects the boot; the stored create
            # flag is what branching checks [sdk comment], and the seed
            # branched without it. Recorded, not required.
            if q.get("forkable", [""])[-1] == "true":
                m["_bootForkable"] = True
            if (
                m["state"] != "running"
            ):  # [assumption] start of a running machine is a no-op
                self._boot(m, time.time())
            # [sdk] the response is ignored; the record is an [assumption].
            return json_resp(200, self._public(m))

    def _h_stop(self, mid):
        with self._lock:
            m = self._get(mid)
            self._refuse_paused(m, " or delete it")
            if m["state"] in ("running", "error", "frozen"):
                self._stop(m, time.time())
            return json_resp(
                200, self._public(m)
            )  # [assumption] idempotent, the record

    def _h_delete(self, mid, q):
        with self._lock:
            m = self._get(mid)
            self._delete(m, time.time())
            if q.get("includeUsage", [""])[-1] == "true":
                return json_resp(
                    200, self._usage_report(m)
                )  # [sdk] settled usage
            return Resp(204)  # [public docs]

    def _h_usage(self, mid):
        with self._lock:
            m = self._machines.get(mid) or self._deleted.get(mid)
            if m is None:
                raise Bad(404, f"machine {mid} not found")
            # [sdk] usage records survive deletion for 30 days, so a deleted
            # machine still answers here [assumption for the route itself].
            return json_resp(200, self._usage_report(m))

    def _ensure_running(self, m):
        """exec/files on a stopped machine start it and leave it running
        [public docs; seed]. Returns the time its agent answers."""
        self._refuse_paused(m)
        if m["state"] == "frozen":
            # [sdk] "a frozen source cannot run commands again"; 409
            # [assumption].
            raise Bad(
                409,
                f"machine {m['id']} is frozen as a branch base and cannot "
                "run commands",
            )
        now = time.time()
        if m["state"] != "running":
            self._boot(m, now)
        m["_lastActivity"] = now
        return m["_bootDoneAt"]

    @staticmethod
    def _wait_agent(boot_done):
        delay = boot_done - time.time()
        if delay > 0:
            time.sleep(delay)  # exec waits for the agent itself [public docs]

    @staticmethod
    def _command(req):
        """(argv, via_shell) of an exec or job body's `command`."""
        if "command" not in req:
            raise Bad(400, "missing field `command`")
        cmd = req["command"]
        if isinstance(cmd, str):
            if not cmd.strip():
                raise Bad(400, "command must not be empty")
            return ["sh", "-c", cmd], True  # [public docs] a shell string
        if isinstance(cmd, list):
            argv = _want_str_list(cmd, "command")  # [sdk] argv
            if not argv:
                raise Bad(400, "command must not be empty")  # [assumption]
            return argv, False
        raise _type_error("command", cmd, "an argv array or a string")

    def _guest_for(self, mid, cwd, env_req):
        """Start the machine if needed and wait for its agent; returns
        (machine, guest root, environment, working directory)."""
        with self._lock:
            m = self._get(mid)
            boot_done = self._ensure_running(m)
            root = self._root(mid)
            env = {"PATH": PATH_ENV, "HOME": "/root"}
            env.update(m["env"])
            workdir = cwd or m["workdir"] or "/"
        env.update(env_req)
        self._wait_agent(boot_done)
        return m, root, env, workdir

    def _h_exec(self, mid, q, headers, body, stream=False):
        output = q.get("output", ["both"])[-1]
        if output not in ("text", "b64", "both"):
            raise Bad(
                400,
                f"unknown output `{output}`, expected `text`, `b64` or `both`",
            )  # [assumption]
        req = self._json_body(headers, body)
        _check_fields(
            req, EXEC_FIELDS
        )  # strict [assumption]; `workdir` is not an exec field [sdk]
        argv, via_shell = self._command(req)
        env_req = _want_str_map(req.get("env"), "env", nullable=True) or {}
        cwd = _want_str(req.get("cwd"), "cwd", nullable=True)
        timeout = _want_int(
            req.get("timeoutSeconds"), "timeoutSeconds", nullable=True
        )
        if timeout == 0:
            raise Bad(
                400, "timeoutSeconds must be greater than zero"
            )  # [sdk] > 0; wording [assumption]
        user = _want_str(req.get("user"), "user", nullable=True)
        if user is not None and not user.strip():
            raise Bad(400, "user must not be empty")
        background = bool(
            _want_bool(req.get("background"), "background", nullable=True)
        )
        stdin = _want_str(req.get("stdin"), "stdin", nullable=True)
        m, root, env, workdir = self._guest_for(mid, cwd, env_req)
        out_extra = (
            {"user": user} if user is not None else {}
        )  # [sdk] the echo it checks
        if not via_shell and not self._exe_exists(
            root, argv[0], env.get("PATH", PATH_ENV), workdir
        ):
            # [public docs] a missing interpreter is 200 with exitCode 255;
            # the stderr text is an [assumption].
            err = (
                f"failed to exec `{argv[0]}`: No such file or directory (os "
                "error 2)\n"
            ).encode()
            return json_resp(
                200, self._exec_result(255, b"", err, output, out_extra)
            )
        if stream:
            return self._exec_stream(
                m, root, argv, env, workdir, stdin, timeout, user
            )
        try:
            r = _guest.run_in_guest(
                root,
                argv,
                env,
                workdir,
                stdin if not background else None,
                None if background else timeout,
                user,
                background,
            )
        except _guest.GuestUnavailable as e:
            raise Bad(500, str(e))
        with self._lock:
            m["_lastActivity"] = time.time()
            if background:
                m["_bg"].append(r.proc)
        if background:
            # [sdk] a detached command reports `pid=<n>` on stdout.
            return json_resp(
                200,
                self._exec_result(
                    0, f"pid={r.pid}\n".encode(), b"", output, out_extra
                ),
            )
        # [public docs] non-zero exit and timeout (124) are 200 results.
        return json_resp(
            200,
            self._exec_result(
                r.exit_code, r.stdout, r.stderr, output, out_extra
            ),
        )

    def _exec_stream(self, m, root, argv, env, workdir, stdin, timeout, user):
        """[reference: exec/stream] the exec body, answered as SSE `stdout`,
        `stderr`, `error` (message in data) and `exit` ({"exitCode":N}). How
        output is cut into events is an [assumption] (one event per piece the
        command writes, multi-line text as several data lines).
        break_streams: True ends the stream after its first output event,
        without `exit`, as a dropped connection would."""

        def pieces():
            try:
                events = _guest.stream_in_guest(
                    root, argv, env, workdir, stdin, timeout, user
                )
                for event, value in events:
                    if event == "exit":
                        value = json.dumps({"exitCode": value})
                    yield _guest.sse_event(event, value)
                    if self.break_streams:
                        return
            except _guest.GuestUnavailable as e:
                yield _guest.sse_event("error", str(e))
            with self._lock:
                m["_lastActivity"] = time.time()

        return Resp(
            200,
            ctype="text/event-stream",
            headers=[("cache-control", "no-cache")],
            stream=pieces(),
        )

    # ---- detached jobs [reference: "Detached jobs"]
    def _h_jobs(self, method, mid, headers, body):
        with self._lock:
            m = self._get(mid)
            if method != "POST":
                # [reference] newest first, up to 100
                newest = [
                    self._job_public(j) for j in reversed(m["_jobs"][-100:])
                ]
                return json_resp(200, {"jobs": newest})
        req = self._json_body(headers, body)
        _check_fields(req, JOB_FIELDS)  # strict, as exec [assumption]
        argv, _ = self._command(req)
        env_req = _want_str_map(req.get("env"), "env", nullable=True) or {}
        cwd = _want_str(req.get("cwd"), "cwd", nullable=True)
        timeout = _want_int(
            req.get("timeoutSeconds"), "timeoutSeconds", nullable=True
        )
        user = _want_str(req.get("user"), "user", nullable=True)
        m, root, env, workdir = self._guest_for(mid, cwd, env_req)
        job = {
            "id": "job_" + _hex(16),
            "machineId": mid,
            "command": req["command"],
            "state": "running",
            "createdAt": _rfc3339(time.time()),
            "exitCode": None,
            "finishedAt": None,
        }
        job["_dir"] = os.path.join(self._tmp, "jobs", job["id"])
        os.makedirs(job["_dir"])
        try:
            command = _guest.guest_command(root, argv, workdir, user)
        except _guest.GuestUnavailable as e:
            raise Bad(500, str(e))
        with (
            open(os.path.join(job["_dir"], "stdout"), "wb") as out,
            open(os.path.join(job["_dir"], "stderr"), "wb") as err,
        ):
            job["_proc"] = subprocess.Popen(
                command,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=err,
                start_new_session=True,
            )
        with self._lock:
            m["_jobs"].append(job)
        threading.Thread(
            target=self._job_waiter, args=(m, job, timeout), daemon=True
        ).start()
        return json_resp(200, self._job_public(job))

    def _job_waiter(self, m, job, timeout):
        proc = job["_proc"]
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self._end_job(
                job, "exited"
            )  # [reference] a timed-out job exits 143
            return
        with self._lock:
            if job["state"] == "running":
                job.update(
                    state="exited",
                    exitCode=128 - code if code < 0 else code,
                    finishedAt=_rfc3339(time.time()),
                )
                m["_lastActivity"] = time.time()

    def _end_job(self, job, state):
        """End a running job: TERM to its process group, KILL after 2 s. A
        cancelled or timed-out job reads exited 143 [reference]; one whose
        machine stopped under it reads lost [assumption]."""
        with self._lock:
            if job["state"] != "running":
                return
            job.update(
                state=state,
                exitCode=143 if state == "exited" else None,
                finishedAt=_rfc3339(time.time()),
            )
        proc = job["_proc"]
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(proc.pid, sig)
                proc.wait(timeout=2)
                return
            except subprocess.TimeoutExpired:
                continue
            except OSError:
                return

    def _job_public(self, job):
        out = {k: v for k, v in job.items() if not k.startswith("_")}
        for stream in ("stdout", "stderr"):
            try:
                out[f"{stream}Bytes"] = os.path.getsize(
                    os.path.join(job["_dir"], stream)
                )
            except OSError:
                out[f"{stream}Bytes"] = 0
        return out

    def _h_job(self, mid, job_id, sub, q):
        with self._lock:
            m = self._get(mid)
            job = next((j for j in m["_jobs"] if j["id"] == job_id), None)
            if job is None:
                raise Bad(
                    404, f"job {job_id} not found"
                )  # wording [assumption]
        if sub == "cancel":
            self._end_job(job, "exited")  # idempotent [reference]
            return json_resp(200, self._job_public(job))
        if sub == "":
            return json_resp(200, self._job_public(job))
        stream = q.get("stream", ["stdout"])[-1]
        if stream not in ("stdout", "stderr"):
            # [assumption] the wording
            raise Bad(
                400,
                f"unknown stream `{stream}`, expected `stdout` or `stderr`",
            )
        offset = _want_int(int(q.get("offset", ["0"])[-1] or 0), "offset")
        limit = q.get("limit", [None])[-1]
        with open(os.path.join(job["_dir"], stream), "rb") as f:
            f.seek(offset)
            data = f.read(int(limit) if limit else -1)
            size = os.fstat(f.fileno()).st_size
        next_offset = offset + len(data)
        return json_resp(
            200,
            {
                "stream": stream,
                "offset": offset,
                "nextOffset": next_offset,
                "data": data.decode("utf-8", "replace"),
                "dataB64": base64.b64encode(data).decode(),
                "eof": job["state"] != "running" and next_offset >= size,
            },
        )

    @staticmethod
    def _exe_exists(root, argv0, path_env, workdir):
        if "/" in argv0:
            g = (
                argv0
                if argv0.startswith("/")
                else workdir.rstrip("/") + "/" + argv0
            )
            return os.path.exists(_guest.guest_resolve(root, g))
        for d in path_env.split(":"):
            if d and os.path.isfile(
                _guest.guest_resolve(root, d.rstrip("/") + "/" + argv0)
            ):
                return True
        return False

    def _cap_text(self, raw):
        """[sdk] UTF-8 text capped at exec_output_cap bytes, cut on a
        character boundary, with the cut flagged."""
        enc = raw.decode("utf-8", errors="replace").encode("utf-8")
        if len(enc) <= self.exec_output_cap:
            return enc.decode("utf-8"), False
        cut = self.exec_output_cap
        while cut > 0 and (enc[cut] & 0xC0) == 0x80:
            cut -= 1
        return enc[:cut].decode("utf-8"), True

    def _exec_result(self, code, out, err, output, extra):
        so, so_cut = self._cap_text(out)
        se, se_cut = self._cap_text(err)
        res = {
            "exitCode": code,
            "stdout": so,
            "stderr": se,
            "stdoutTruncated": so_cut,
            "stderrTruncated": se_cut,
            # [sdk] byte-exact and untruncated
            "stdoutB64": base64.b64encode(out).decode(),
            "stderrB64": base64.b64encode(err).decode(),
        }
        # [sdk] `?output=` drops the other family: its fields stay present but
        # empty (the SDK reads an empty B64 beside non-empty text that way).
        # The flags of a dropped text family read false [assumption].
        if output == "text":
            res["stdoutB64"] = res["stderrB64"] = ""
        elif output == "b64":
            res.update(
                stdout="",
                stderr="",
                stdoutTruncated=False,
                stderrTruncated=False,
            )
        if not self.exec_b64:
            del res["stdoutB64"], res["stderrB64"]
        res.update(extra)
        return res

    def _h_files(self, method, mid, fpath, body):
        # [sdk] a suffix route; the SDK keeps a leading slash, so
        # `files//workspace/a` and `files/workspace/a` [seed] both mean
        # /workspace/a.
        gpath = "/" + fpath.lstrip("/")
        if gpath == "/" or gpath.endswith("/"):
            raise Bad(400, "a file path is required")  # [assumption]
        with self._lock:
            m = self._get(mid)
            boot_done = self._ensure_running(
                m
            )  # a read or write starts it [seed]
            root = self._root(mid)
        self._wait_agent(boot_done)
        try:
            host = _guest.guest_resolve(root, gpath)
        except OSError as e:
            raise Bad(400, f"{gpath}: {e.strerror}")
        if method == "PUT":
            tmp_root = os.path.join(root, "tmp")
            literal_tmp = gpath == "/tmp" or gpath.startswith("/tmp/")
            if not literal_tmp and (
                host == tmp_root or host.startswith(tmp_root + os.sep)
            ):
                # [public docs] an upload that resolves through a symlink into
                # a memory-backed path fails; status and text [assumption].
                raise Bad(
                    400,
                    f"{gpath} resolves into memory-backed /tmp; write under "
                    "/workspace",
                )
            if os.path.isdir(host):
                raise Bad(400, f"{gpath} is a directory")  # [assumption]
            try:
                os.makedirs(
                    os.path.dirname(host), exist_ok=True
                )  # [assumption] parents created
                fd, tmp = tempfile.mkstemp(
                    dir=os.path.dirname(host), prefix=".upload-"
                )
                with os.fdopen(fd, "wb") as f:
                    f.write(body)
                os.chmod(tmp, 0o644)  # [sdk] no mode on cloud; chmod via exec
                os.replace(tmp, host)
            except OSError as e:
                raise Bad(
                    500, f"failed to write {gpath}: {e.strerror}"
                )  # [assumption]
            # [assumption] the answer's shape (the SDK ignores it).
            return json_resp(200, {"path": gpath, "size": len(body)})
        if os.path.isdir(host):
            raise Bad(400, f"{gpath} is a directory")  # [assumption]
        if not os.path.isfile(host):
            raise Bad(
                404, f"file not found: {gpath}"
            )  # plain text [public docs]; wording [assumption]
        if os.path.getsize(host) > FILE_CAP:
            raise Bad(
                413, f"file exceeds the {FILE_CAP >> 20} MiB limit"
            )  # [sdk] cap; [assumption] status
        with open(host, "rb") as f:
            data = f.read()
        return Resp(200, data, BYTES_CT)  # [sdk] raw bytes

    def _h_logs(self, mid, q):
        raw = q.get("tail", ["100"])[
            -1
        ]  # [assumption] default 100 (the SDK always sends it)
        if not raw.isdigit():
            raise Bad(
                400, f"invalid tail `{raw}`: expected a non-negative integer"
            )  # [assumption]
        tail = int(raw)
        with self._lock:
            m = self._get(mid)
            lines = list(m["_console"])
        lines = lines[-tail:] if tail else []
        # [sdk] plain text, the last `tail` lines of the console log. A final
        # newline after the last line is an [assumption].
        return Resp(200, "".join(ln + "\n" for ln in lines).encode(), TEXT_CT)

    def _h_branch(self, route, mid, headers, body):
        req = self._json_body(headers, body)
        _check_fields(req, BRANCH_FIELDS)  # strict [assumption]
        if "forkable" in req and "branchable" in req:
            raise Bad(
                400, "duplicate field `branchable`"
            )  # serde alias [assumption]
        name = _want_str(req.get("name"), "name", nullable=True)
        ports = (
            self._parse_ports(req["ports"], "ports", BRANCH_PORT_FIELDS)
            if req.get("ports") is not None
            else None
        )
        # [sdk] `branchable` on /branches, `forkable` on /fork; both spellings
        # accepted on both routes [assumption].
        child_forkable = bool(
            _want_bool(
                req.get("branchable", req.get("forkable")),
                "branchable",
                nullable=True,
            )
        )
        freeze = bool(
            _want_bool(req.get("freezeSource"), "freezeSource", nullable=True)
        )
        now = time.time()
        with self._lock:
            src = self._get(mid)
            if not src["forkable"]:
                # [sdk] "without this field the golden is stored non-forkable
                # and every fork() 409s"; the wording is an [assumption].
                raise Bad(
                    409,
                    f"machine {mid} is not forkable: create it with "
                    "`forkable: true`",
                )
            if src["state"] not in ("running", "frozen"):
                raise Bad(
                    409, f"machine {mid} is not running"
                )  # [assumption] wording
            cid = "mach-" + _hex(12)
            while cid in self._machines or cid in self._deleted:
                cid = "mach-" + _hex(12)
            if name is None:
                name = cid
            if any(x["name"] == name for x in self._machines.values()):
                raise Bad(409, f"machine named `{name}` already exists")
            dst = tempfile.mkdtemp(prefix=f"{cid}-", dir=self._tmp)
            os.rmdir(dst)
            _guest.copy_guest_root(
                self._root(mid), dst
            )  # a copy of the source's disk
            self._roots[cid] = dst
            c = json.loads(json.dumps(self._public(src)))
            if (
                ports is None
            ):  # [assumption] omitted ports: the source's guest ports
                ports = [p["port"] for p in src["ports"]]
            # [assumption] the child inherits the source's settings; requested
            # host ports are ignored (the node picks them [sdk]).
            c.update(
                {
                    "id": cid,
                    "name": name,
                    "state": "running",
                    "ready": False,
                    "readyAt": None,
                    "url": None,
                    "ports": [{"port": p, "hostPort": None} for p in ports],
                    "forkable": child_forkable,
                    "branchable": child_forkable,
                    "parent": mid,
                    "sourceMachineId": mid,  # [assumption] field names
                    "createdAt": _rfc3339(now),
                    "expiresAt": _rfc3339(now + c["ttlSeconds"])
                    if c.get("ttlSeconds") is not None
                    else None,
                }
            )
            c.update(
                {
                    "_created": now,
                    "_startedAt": now,
                    "_bootDoneAt": now,
                    "_runSince": now,
                    "_uptime": 0.0,
                    "_lastActivity": now,
                    "_everStarted": True,
                    "_bootForkable": child_forkable,
                    "_listening": set(),
                    "_console": list(src["_console"])
                    + ["smolvm-agent: branched from " + mid],
                    "_bg": [],
                    "_jobs": [],
                    "_node": src["_node"],
                    "_deletedAt": None,
                }
            )
            for p in c["ports"]:
                p["hostPort"] = self._alloc_host_port()
            self._machines[cid] = c
            if freeze:
                # [sdk] freezeSource keeps the source paused as a reusable
                # base that cannot run commands again; state name "frozen"
                # and stopping its CPU meter are [assumption].
                if src["_runSince"] is not None:
                    src["_uptime"] += now - src["_runSince"]
                    src["_runSince"] = None
                src["state"] = "frozen"
                src["ready"] = False
                src["readyAt"] = None
                src["url"] = None
            self._refresh(c)
            # [sdk] the response is the child's record; 201 is an [assumption].
            return json_resp(201, self._public(c))

    # ---- pause and resume
    #
    # [sdk] `POST .../pause` (no body, answer ignored, 30 min timeout) and
    # `POST .../resume` (retried as idempotent, then readiness); "Save RAM
    # and disk durably, then stop at that execution boundary"; "A paused
    # machine must be resumed explicitly before it can serve work". The
    # state name `paused` is the local engine's (observed there); its
    # refusals of start, stop, exec and files mirror the local engine's
    # (observed on a paused record there). Everything else here, the texts
    # and statuses, is an [assumption]. The fake stops the guest's
    # processes on pause and lets them go on at resume, as saved execution
    # would.
    def _refuse_paused(self, m, extra=""):
        if m["state"] == "paused":
            raise Bad(
                409,
                f"machine {m['id']} is paused; resume it to continue its "
                f"saved execution{extra}",
            )

    def _h_pause(self, mid):
        with self._lock:
            m = self._get(mid)
            if m["state"] != "running":
                raise Bad(409, f"machine {mid} is not running")
            now = time.time()
            if m["_runSince"] is not None:
                m["_uptime"] += now - m["_runSince"]
                m["_runSince"] = None
            m["state"] = "paused"
            m["ready"] = False
            m["readyAt"] = None
            m["url"] = None
            root = self._root(mid)
            _guest.signal_guest_processes(root, signal.SIGSTOP)
            m["_console"].append("smolvm-agent: execution saved, paused")
            return json_resp(200, self._public(m))

    def _h_resume(self, mid):
        with self._lock:
            m = self._get(mid)
            if m["state"] == "running":
                # Resumed already: the SDK retries a resume, so a repeat
                # must not fail [assumption read from the SDK].
                return json_resp(200, self._public(m))
            if m["state"] != "paused":
                raise Bad(409, f"machine {mid} is not paused")
            now = time.time()
            m["state"] = "running"
            m["_startedAt"] = now
            m["_bootDoneAt"] = now + self.ready_delay
            m["_runSince"] = now
            m["_lastActivity"] = now
            _guest.signal_guest_processes(self._root(mid), signal.SIGCONT)
            m["_console"].append("smolvm-agent: resumed saved execution")
            self._refresh(m)
            return json_resp(200, self._public(m))

    # ---- checkpoints
    #
    # [sdk] capture `POST /v1/machines/{id}/checkpoints` (no body) answering
    # {id, machineId, status, sizeBytes, reusedBytes, arch, createdAt,
    # downloadUrl}; `GET /v1/machines/{id}/checkpoints` a bare array;
    # `POST /v1/checkpoints/{id}/restore` {name, network?, cacheDisk?}
    # answering the new machine's record (the SDK then starts it), its
    # network blocked when unset; `DELETE /v1/checkpoints/{id}` refused
    # while a machine restored from it exists. [assumption]: the id and
    # URL forms, status "ready", a capture only of a running machine (the
    # source keeps running), the 201s and 204, the texts, newest first.
    # The fake keeps the disk (the guest directory) and the record; the
    # RAM of a real checkpoint (running processes) is not kept.
    def _h_checkpoints(self, method, mid):
        with self._lock:
            m = self._get(mid)
            if method != "POST":
                rows = [
                    self._checkpoint_public(c)
                    for c in reversed(list(self._checkpoints.values()))
                    if c["machineId"] == mid
                ]
                return json_resp(200, rows)
            if m["state"] != "running":
                raise Bad(409, f"machine {mid} must be running")
            cid = "ckpt-" + _hex(12)
            while cid in self._checkpoints:
                cid = "ckpt-" + _hex(12)
            saved = os.path.join(self._tmp, "checkpoints", cid)
            os.makedirs(os.path.dirname(saved), exist_ok=True)
            _guest.copy_guest_root(self._root(mid), saved)
            checkpoint = {
                "id": cid,
                "machineId": mid,
                "status": "ready",
                "sizeBytes": _tree_size(saved),
                "reusedBytes": 0,
                "arch": platform.machine(),
                "createdAt": _rfc3339(time.time()),
                "downloadUrl": f"https://checkpoints.smol.invalid/{cid}",
                "_root": saved,
                "_record": json.loads(json.dumps(self._public(m))),
            }
            self._checkpoints[cid] = checkpoint
            return json_resp(201, self._checkpoint_public(checkpoint))

    @staticmethod
    def _checkpoint_public(c):
        return {k: v for k, v in c.items() if not k.startswith("_")}

    def _checkpoint_route(self, method, path, headers, body):
        rest = path[len("/v1/checkpoints/") :]
        cid, slash, sub = rest.partition("/")
        cid = urllib.parse.unquote(cid)
        if not cid or (slash and sub != "restore"):
            raise self._no_route()
        if sub == "restore":
            self._allow(method, "POST")
            return self._h_restore(cid, headers, body)
        self._allow(method, "DELETE")
        with self._lock:
            if cid not in self._checkpoints:
                raise Bad(404, f"checkpoint {cid} not found")
            for m in self._machines.values():
                if m.get("_checkpoint") == cid:
                    raise Bad(
                        409,
                        f"checkpoint {cid} is in use by machine {m['id']}",
                    )
            gone = self._checkpoints.pop(cid)
            shutil.rmtree(gone["_root"], ignore_errors=True)
            return Resp(204)

    def _h_restore(self, cid, headers, body):
        req = self._json_body(headers, body)
        _check_fields(req, RESTORE_FIELDS)
        name = _want_str(req.get("name"), "name", nullable=True)
        if not name:
            raise Bad(400, "missing field `name`")
        network = {"mode": "blocked"}  # [sdk] blocked when unset
        if req.get("network") is not None:
            network = self._parse_network(req["network"])
        cache = _want_obj(req.get("cacheDisk"), "cacheDisk", nullable=True)
        if cache is not None:
            _check_fields(cache, CACHE_DISK_FIELDS, "cacheDisk")
            _want_str(cache.get("cache"), "cacheDisk.cache")
        with self._lock:
            checkpoint = self._checkpoints.get(cid)
            if checkpoint is None:
                raise Bad(404, f"checkpoint {cid} not found")
            if any(x["name"] == name for x in self._machines.values()):
                raise Bad(409, f"machine named `{name}` already exists")
            m = self._restored(checkpoint, name, network, cache)
            return json_resp(201, self._public(m))

    def _restored(self, checkpoint, name, network, cache):
        """A new stopped machine holding the checkpoint's disk."""
        mid = "mach-" + _hex(12)
        while mid in self._machines or mid in self._deleted:
            mid = "mach-" + _hex(12)
        now = time.time()
        m = json.loads(json.dumps(checkpoint["_record"]))
        m.update(
            {
                "id": mid,
                "name": name,
                "state": "stopped",
                "ready": False,
                "readyAt": None,
                "url": None,
                "network": network,
                "ports": [
                    {"port": p["port"], "hostPort": None} for p in m["ports"]
                ],
                "createdAt": _rfc3339(now),
            }
        )
        if m.get("ttlSeconds") is not None:
            m["expiresAt"] = _rfc3339(now + m["ttlSeconds"])
        if cache is not None:
            m["cacheDisk"] = cache
        m.update(
            {
                "_created": now,
                "_startedAt": 0.0,
                "_bootDoneAt": 0.0,
                "_runSince": None,
                "_uptime": 0.0,
                "_lastActivity": now,
                "_everStarted": False,
                "_bootForkable": False,
                "_listening": set(),
                "_console": [],
                "_bg": [],
                "_jobs": [],
                "_node": "node-" + _hex(6),
                "_deletedAt": None,
                "_checkpoint": checkpoint["id"],
            }
        )
        dst = tempfile.mkdtemp(prefix=f"{mid}-", dir=self._tmp)
        os.rmdir(dst)
        _guest.copy_guest_root(checkpoint["_root"], dst)
        self._roots[mid] = dst
        self._machines[mid] = m
        return m

    # ---- published ports and port links
    def _h_ports(self, mid, headers, body):
        """[sdk] `PUT .../ports` {"ports":[{"port"}]}: the whole set, TCP
        guest ports; the node picks host ports. The answer (the record) and
        its 200 are an [assumption]; a running machine takes the change
        at once, and a new port nobody listens on makes it not ready
        ([sdk] ready means every published port accepts)."""
        req = self._json_body(headers, body)
        _check_fields(req, ["ports"])
        if "ports" not in req:
            raise Bad(400, "missing field `ports`")
        ports = self._parse_ports(req["ports"], "ports", PORT_FIELDS)
        with self._lock:
            m = self._get(mid)
            m["ports"] = [{"port": p, "hostPort": None} for p in ports]
            if m["state"] == "running":
                for p in m["ports"]:
                    p["hostPort"] = self._alloc_host_port()
                m["ready"] = False
                m["readyAt"] = None
            self._refresh(m)
            return json_resp(200, self._public(m))

    def _h_port_links(self, method, mid):
        """[sdk] POST answers {"urls": {"PORT": url}}, DELETE revokes them.
        The URL form, an empty map for a machine without ports and the 204
        are an [assumption]."""
        with self._lock:
            m = self._get(mid)
            if method == "DELETE":
                m["_portLinks"] = None
                return Resp(204)
            token = _hex(16)
            m["_portLinks"] = token
            urls = {
                str(p["port"]): f"https://{mid}-{p['port']}-{token}"
                ".apps.smol.invalid"
                for p in m["ports"]
            }
            return json_resp(200, {"urls": urls})


def _tree_size(root):
    total = 0
    for folder, _, names in os.walk(root):
        for name in names:
            try:
                total += os.lstat(os.path.join(folder, name)).st_size
            except OSError:
                pass
    return total


if __name__ == "__main__":
    with FakeCloud() as fc:
        print(
            f"fake smol cloud on {fc.url} (token {fc.token}); Ctrl-C to stop",
            flush=True,
        )
        try:
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            pass
