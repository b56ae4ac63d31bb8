"""A stand-in for the `smolvm serve` local machine API (smolvm 1.32.2), for
tests.

FakeSmolvm serves HTTP/1.1 on a Unix socket, in a background thread, with the
routes, field names, status codes, content types and error bodies of the real
serve, so that the MCP server can be tested without a hypervisor. The
executable `tests/fakes/smolvm` beside this file wraps it as a CLI that can be
spawned in place of the real binary (`smolvm serve start --listen PATH`).

Observed on a real 1.32.2 serve and copied byte for byte: the health body;
the create, list and get records (key order, defaults, omitted keys, the
`diskChainDepth` that only get adds, list sorted by name, ports grouped tcp
before udp, mount tags); every create validation text that does not need a
registry; duplicate-name 409; delete, and the 404 of a second delete; stop of
a never-started machine; logs of a never-started machine (404 "has no logs
yet"), a bad log source, and the SSE framing and headers of the log stream;
the branch refusals (bad child name is a 500, child named like the source,
child name taken, unknown source, source not running or not branchable);
exec's 409 with autoStart false and its 400 for an empty command; the mode
check of a file upload; the 415, the 400 for a body that is not JSON, and the
422 texts for bodies that do not deserialize, including the serde field path
and the `at line L column C` position; the 400 texts for query strings that
do not deserialize; the 405 with its allow header; the empty 404 of an unknown
route; the served OpenAPI document; the `x-trace-id` header; the start body
being read only when it is sent as JSON; a never-started machine turning
`stopped` about 3.5 s after create; the 500 bodies of a failed boot and of a
host-side registry fetch without DNS; the image references the serve
refuses, at create (local sources) and at the first start without network
(its parse of a reference, then the registry URL built from it: see
image_reference_refusal).

Stand-ins, because no guest could boot where the real serve was observed:
a successful start, exec, file transfer, branch and image pull. The guest is a
directory on the host populated with a statically linked busybox, and exec
runs the command there with chroot (under `unshare -r` when not root). Exit
code 124 for a command that ran past timeoutSecs is what the smol cloud
documents, assumed here for the local serve. The 404 text for a missing guest
file, the shape of a background exec answer, the `kind` names of a directory
listing, the wording of the 409 for deleting a source with live branched
children, where `pid` and `parentMachine` sit in the record, the boot lines
written to the console log, and the image info returned by a pull are not
observed either. `follow=true` on logs ends the stream instead of keeping it
open. Metering gauges (cpuSeconds, rssMb, ...) are not reported.

Egress (the `egress` and `egress-events` routes, and a restricted guest's
network): what is observed and what is assumed is listed above GuestNet.

Warm machines (pause and resume, PUT ports, cache disks and their publish,
fork pools and leases, /capacity): every answer that needs no running guest
is observed and compared byte for byte against a real serve by the suite's
RealServeWarmRoutesIntegration, including what start, stop, exec, files and
pull answer a paused machine (seen on a record set to `paused` by hand).
What a running guest or a running branch source would do (a pause itself, a
pool filled with workers, a lease) follows the spec and the binary's
strings: each handler says which is which.

Published ports: the real serve listens on 127.0.0.1 and [::1] of the host
for each TCP port of a machine while it runs, never on every interface; with
SMOLVM_PUBLISH_ADDR set to an IPv4 address it listens on that address (and
[::1], but on 0.0.0.0 alone), and it ignores any other value; a start whose
host port is taken answers 409 PORT_IN_USE (all observed with `ss` while a
failing start held its listeners). So does this fake, forwarding each
connection to the guest port (in the guest's network namespace when it has
one), and it journals each listener it opens and closes in `published`.
What a PUT of a taken port answers a running machine is the OpenAPI's 409
PORT_IN_USE, its text modelled on the start's; UDP ports are not bound.

The exec stream route (`POST .../exec/stream`) follows the documents, not an
observation (nobody has seen a booted guest's stream): the spec and CLI help
say `text/event-stream` with `event: stdout` / `event: stderr` and a final
`event: exit` carrying `{"exitCode":N}`. How output is cut into events is not
documented: here each piece the command writes is one event, its text split
into `data:` lines the way the SSE standard frames multi-line data (so a
reader that joins them with LF gets the text back, a trailing newline
included). Its refusals (404, 409, 400, 415, 422) are exec's, as the spec
gives both routes the same body type and error responses. Stopping or
deleting a machine ends every process still running in its guest, as
stopping a VM would (not observed: no guest ran here).
"""

from __future__ import annotations

import base64
import collections
import ctypes
import datetime
import errno
import hashlib
import io
import ipaddress
import json
import os
import random
import re
import selectors
import shutil
import signal
import socket
import socketserver
import stat
import struct
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
import urllib.parse
from email.utils import formatdate
from http import HTTPStatus
from pathlib import Path

HERE = Path(__file__).resolve().parent
OPENAPI_PATH = HERE / "smolvm-1.32.2-openapi.json"

# --------------------------------------------------------------------------
# serde_json + serde_path_to_error emulation
#
# The real serve deserializes bodies with serde_json through axum's Json
# extractor, which wraps serde_path_to_error. The error text, its field path
# and the `line L column C` position are reproduced here by parsing the body
# the way serde_json does, against a schema of the Rust request types.
# --------------------------------------------------------------------------

BOOL = ("bool",)
STR = ("str",)
ANY = ("any",)


def INT(kind):
    return ("int", kind)


def OPT(t):
    return ("opt", t)


def SEQ(t):
    return ("seq", t)


def MAP(t):
    return ("map", t)


def STRUCT(name, fields, deny=True, aliases=None, listed=None):
    """fields: list of (key, type, required). listed: names serde reports as
    expected (the declared fields plus aliases, in declaration order)."""
    return (
        "struct",
        name,
        fields,
        deny,
        aliases or {},
        listed if listed is not None else [f[0] for f in fields],
    )


def ENUM(name, variants):
    return ("enum", name, variants)


def ANYSTRUCT(name):
    return ("anystruct", name)


_INT_RANGES = {
    "u8": (0, 2**8 - 1),
    "u16": (0, 2**16 - 1),
    "u32": (0, 2**32 - 1),
    "u64": (0, 2**64 - 1),
    "usize": (0, 2**64 - 1),
    "i32": (-(2**31), 2**31 - 1),
    "i64": (-(2**63), 2**63 - 1),
}

ENVVAR = STRUCT(
    "EnvVar", [("name", STR, True), ("value", STR, True)], deny=False
)
PORTSPEC = STRUCT(
    "PortSpec",
    [
        ("host", INT("u16"), True),
        ("guest", INT("u16"), True),
        ("protocol", ENUM("PortProtocol", ["tcp", "udp"]), False),
    ],
)
MOUNTSPEC = STRUCT(
    "MountSpec",
    [
        ("source", STR, True),
        ("target", STR, True),
        ("readonly", BOOL, False),
        ("staged", BOOL, False),
    ],
)
RESTARTSPEC = STRUCT(
    "RestartSpec",
    [("policy", OPT(STR), False), ("maxRetries", OPT(INT("u32")), False)],
)
# Observed: `base` and `mountPath` are both required (a create without
# `base` is a 422 "missing field `base`").
CACHEDISKSPEC = STRUCT(
    "CacheDiskSpec",
    [
        ("base", STR, True),
        ("mountPath", STR, True),
        ("sourceUrl", OPT(STR), False),
        ("sha256", OPT(STR), False),
        ("slot", BOOL, False),
    ],
)
# Observed on 1.32.2: a rule denies unknown fields (listed in this
# order), `action` is required, `cidr` is not; `ports` is a PortRange,
# `[start, end]` or `{"start", "end"}`.
PORTRANGE = STRUCT(
    "PortRange", [("start", INT("u16"), True), ("end", INT("u16"), True)]
)
EGRESSRULE = STRUCT(
    "EgressRule",
    [
        ("transport", OPT(ENUM("Transport", ["tcp", "udp", "icmp"])), False),
        ("cidr", OPT(STR), False),
        ("ports", OPT(PORTRANGE), False),
        ("action", ENUM("Action", ["allow", "deny", "redirect"]), True),
    ],
)
CREDENTIALPOLICY = STRUCT("CredentialPolicy", [("credentials", ANY, False)])
SECRETS = MAP(ANYSTRUCT("SecretRef"))

CREATE_REQUEST = STRUCT(
    "CreateMachineRequest",
    [
        ("name", OPT(STR), False),
        ("cpus", OPT(INT("u8")), False),
        ("memoryMb", OPT(INT("u32")), False),
        ("mounts", SEQ(MOUNTSPEC), False),
        ("ports", SEQ(PORTSPEC), False),
        ("network", BOOL, False),
        ("gpu", BOOL, False),
        ("cuda", BOOL, False),
        ("nestedVirt", BOOL, False),
        ("autoGraph", BOOL, False),
        ("entrypoint", SEQ(STR), False),
        ("cmd", SEQ(STR), False),
        ("dockerSocket", BOOL, False),
        ("stopSignal", OPT(STR), False),
        ("stopTimeoutSecs", OPT(INT("u64")), False),
        ("storageGb", OPT(INT("u64")), False),
        ("overlayGb", OPT(INT("u64")), False),
        ("blockIo", OPT(ENUM("BlockIoEngine", ["sync", "async"])), False),
        (
            "diskDurability",
            OPT(ENUM("DiskDurability", ["full", "deferred"])),
            False,
        ),
        ("cacheDisk", OPT(CACHEDISKSPEC), False),
        ("allowedCidrs", OPT(SEQ(STR)), False),
        ("egressRules", SEQ(EGRESSRULE), False),
        ("allowedHosts", OPT(SEQ(STR)), False),
        ("credentials", OPT(CREDENTIALPOLICY), False),
        (
            "networkBackend",
            OPT(ENUM("NetworkBackend", ["tsi", "virtio-net"])),
            False,
        ),
        ("guestSubnet", OPT(STR), False),
        ("restart", OPT(RESTARTSPEC), False),
        ("image", OPT(STR), False),
        ("from", OPT(STR), False),
        ("registryRef", OPT(STR), False),
        ("registryIdentityToken", OPT(STR), False),
        ("blobPeers", SEQ(STR), False),
        ("secrets", SECRETS, False),
        ("env", SEQ(ENVVAR), False),
        ("workdir", OPT(STR), False),
    ],
)

EXEC_REQUEST = STRUCT(
    "ExecRequest",
    [
        ("command", SEQ(STR), True),
        ("env", SEQ(ENVVAR), False),
        ("secrets", SECRETS, False),
        ("workdir", OPT(STR), False),
        ("user", OPT(STR), False),
        ("timeoutSecs", OPT(INT("u64")), False),
        ("stdin", OPT(STR), False),
        ("background", BOOL, False),
        ("autoStart", BOOL, False),
    ],
)

FORK_REQUEST = STRUCT(
    "ForkRequest",
    [
        ("name", STR, True),
        ("branchable", BOOL, False),
        ("ports", SEQ(PORTSPEC), False),
        ("shareWeights", BOOL, False),
        ("waitReady", BOOL, False),
        ("hold", BOOL, False),
        ("freezeSource", BOOL, False),
        ("readyTimeoutSecs", OPT(INT("u64")), False),
        ("env", SEQ(STR), False),
        ("secrets", SECRETS, False),
        ("labels", MAP(STR), False),
    ],
    aliases={"forkable": "branchable"},
    listed=[
        "name",
        "branchable",
        "forkable",
        "ports",
        "shareWeights",
        "waitReady",
        "hold",
        "freezeSource",
        "readyTimeoutSecs",
        "env",
        "secrets",
        "labels",
    ],
)

PULL_REQUEST = STRUCT(
    "PullImageRequest",
    [
        ("image", STR, True),
        ("ociPlatform", OPT(STR), False),
        ("proxy", OPT(STR), False),
        ("noProxy", OPT(STR), False),
    ],
)

# Field order as the real serve lists them in its unknown-field refusal
# (observed).
UPDATE_EGRESS_REQUEST = STRUCT(
    "UpdateEgressRequest",
    [
        ("allowHosts", SEQ(STR), False),
        ("allowHostPatterns", SEQ(STR), False),
        ("allowCidrs", SEQ(STR), False),
        ("removeAllowHosts", SEQ(STR), False),
        ("removeAllowCidrs", SEQ(STR), False),
        ("outboundLocalhostOnly", BOOL, False),
        ("allowAll", BOOL, False),
        ("resetAllowList", BOOL, False),
        ("allowUdp", SEQ(STR), False),
        ("removeAllowUdp", SEQ(STR), False),
    ],
)

START_REQUEST = STRUCT(
    "StartMachineRequest",
    [
        ("branchable", BOOL, False),
        ("branchPoolSize", OPT(INT("u32")), False),
        ("cudaVramLimitMib", OPT(INT("u64")), False),
        ("registryAuth", ANY, False),
        ("egressInterceptor", ANY, False),
    ],
    deny=False,
)

# The bodies of the warm-machine routes. Which of them refuse an unknown
# field, the field order of each refusal and the required fields are
# observed on 1.32.2 (a lease body ignores an unknown field, as do the
# files inside it).
SET_PORTS_REQUEST = STRUCT("SetPortsRequest", [("ports", SEQ(PORTSPEC), True)])

PUBLISH_CACHE_DISK_REQUEST = STRUCT(
    "PublishCacheDiskRequest",
    [("base", STR, True), ("uploadUrls", OPT(SEQ(STR)), False)],
)

# serde lists a field's names sorted, so the alias `golden` comes first.
CREATE_POOL_REQUEST = STRUCT(
    "CreateForkPoolRequest",
    [
        ("name", STR, True),
        ("source", STR, True),
        ("desiredReady", INT("u32"), True),
        ("maxActive", OPT(INT("u32")), False),
        ("autoAdmission", OPT(BOOL), False),
        ("shareWeights", BOOL, False),
        ("freezeSource", BOOL, False),
        ("readyTimeoutSecs", OPT(INT("u64")), False),
        ("leaseTtlSecs", OPT(INT("u64")), False),
    ],
    aliases={"golden": "source"},
    listed=[
        "name",
        "golden",
        "source",
        "desiredReady",
        "maxActive",
        "autoAdmission",
        "shareWeights",
        "freezeSource",
        "readyTimeoutSecs",
        "leaseTtlSecs",
    ],
)

RESIZE_POOL_REQUEST = STRUCT(
    "ResizeForkPoolRequest", [("desiredReady", INT("u32"), True)]
)

LEASE_FILE = STRUCT(
    "ForkLeasePayloadFile",
    [
        ("path", STR, True),
        ("dataBase64", STR, True),
        ("mode", OPT(INT("u32")), False),
    ],
    deny=False,
)

ROLLOUT_ACCESS = STRUCT(
    "RolloutLeaseAccess",
    [("executor", STR, True), ("policy", STR, True)],
    deny=False,
)

ACQUIRE_LEASE_REQUEST = STRUCT(
    "AcquireForkLeaseRequest",
    [
        ("idempotencyKey", STR, True),
        ("env", SEQ(STR), False),
        ("files", SEQ(LEASE_FILE), False),
        ("waitSecs", OPT(INT("u64")), False),
        ("ttlSecs", OPT(INT("u64")), False),
        ("awaitWorkerReady", BOOL, False),
        ("workerReadyTimeoutSecs", OPT(INT("u64")), False),
        ("rolloutAccess", OPT(ROLLOUT_ACCESS), False),
    ],
    deny=False,
)


class SerdeError(Exception):
    """category: 'data' (axum answers 422) or 'syntax' / 'eof' (400)."""

    def __init__(self, msg, category, path, line, column):
        super().__init__(msg)
        self.msg = msg
        self.category = category
        self.path = list(path)
        self.line = line
        self.column = column

    def path_text(self):
        out = ""
        sep = ""
        for seg in self.path:
            if isinstance(seg, int):
                out += f"[{seg}]"
            else:
                out += sep + seg
            sep = "."
        return out

    def inner(self):
        return f"{self.msg} at line {self.line} column {self.column}"

    def with_path(self):
        p = self.path_text()
        return f"{p}: {self.inner()}" if p else self.inner()


def _rust_debug_str(s):
    out = ['"']
    for ch in s:
        o = ord(ch)
        if ch == '"':
            out.append('\\"')
        elif ch == "\\":
            out.append("\\\\")
        elif ch == "\n":
            out.append("\\n")
        elif ch == "\r":
            out.append("\\r")
        elif ch == "\t":
            out.append("\\t")
        elif ch == "\0":
            out.append("\\0")
        elif o < 0x20 or o == 0x7F or 0x80 <= o < 0xA0:
            out.append("\\u{%x}" % o)
        else:
            out.append(ch)
    out.append('"')
    return "".join(out)


def _float_text(x):
    # Observed: 1.5 -> `1.5`, 1e2 -> `100.0`, 99999999999999999999 -> `1e+20`,
    # 1.5e-7 -> `1.5e-7`, -0 -> `-0.0`.
    r = repr(float(x))
    if "e" in r:
        mant, _, exp = r.partition("e")
        sign = exp[0] if exp[0] in "+-" else ""
        r = f"{mant}e{sign}{exp.lstrip('+-').lstrip('0') or '0'}"
    return r


def _one_of(names, what):
    if not names:
        return f"there are no {what}s"
    if len(names) == 1:
        return f"expected `{names[0]}`"
    if len(names) == 2:
        return f"expected `{names[0]}` or `{names[1]}`"
    return "expected one of " + ", ".join(f"`{n}`" for n in names)


def _expecting(t):
    k = t[0]
    if k == "bool":
        return "a boolean"
    if k == "str":
        return "a string"
    if k == "int":
        return t[1]
    if k == "seq":
        return "a sequence"
    if k == "map":
        return "a map"
    if k in ("struct", "anystruct"):
        return f"struct {t[1]}"
    if k == "enum":
        return f"enum {t[1]}"
    if k == "opt":
        return _expecting(t[1])
    if k == "unit":
        return "unit"
    return "any valid JSON value"


class _Num:
    __slots__ = ("kind", "value")

    def __init__(self, kind, value):
        self.kind = kind  # 'u64' | 'i64' | 'f64'
        self.value = value

    def unexpected(self):
        if self.kind == "f64":
            return f"floating point `{_float_text(self.value)}`"
        return f"integer `{self.value}`"


class _Deserializer:
    def __init__(self, data: bytes):
        self.b = data
        self.i = 0
        self.path = []

    # positions, as serde_json's SliceRead computes them
    def _pos_of(self, idx):
        line = self.b.count(b"\n", 0, idx) + 1
        nl = self.b.rfind(b"\n", 0, idx)
        col = idx - (nl + 1)
        return line, col

    def position(self):
        return self._pos_of(self.i)

    def peek_position(self):
        return self._pos_of(min(self.i + 1, len(self.b)))

    def error(self, msg, category="syntax"):
        line, col = self.position()
        return SerdeError(msg, category, self.path, line, col)

    def peek_error(self, msg, category="syntax"):
        line, col = self.peek_position()
        return SerdeError(msg, category, self.path, line, col)

    def data_error(self, msg):
        return self.error(msg, "data")

    def peek(self):
        return self.b[self.i] if self.i < len(self.b) else None

    def ws(self):
        while self.i < len(self.b) and self.b[self.i] in b" \n\t\r":
            self.i += 1
        return self.peek()

    def eat(self):
        self.i += 1

    def next_char(self):
        if self.i >= len(self.b):
            return None
        c = self.b[self.i]
        self.i += 1
        return c

    def parse_ident(self, rest: bytes):
        for expected in rest:
            c = self.next_char()
            if c is None:
                raise self.error("EOF while parsing a value", "eof")
            if c != expected:
                raise self.error("expected ident")

    # ---- scalars
    def parse_str(self):
        """Called after the opening quote was eaten."""
        out = bytearray()
        b = self.b
        while True:
            if self.i >= len(b):
                raise self.error("EOF while parsing a string", "eof")
            c = b[self.i]
            self.i += 1
            if c == 0x22:
                break
            if c == 0x5C:
                e = self.next_char()
                if e is None:
                    raise self.error("EOF while parsing a string", "eof")
                simple = {
                    0x22: b'"',
                    0x5C: b"\\",
                    0x2F: b"/",
                    0x62: b"\b",
                    0x66: b"\f",
                    0x6E: b"\n",
                    0x72: b"\r",
                    0x74: b"\t",
                }
                if e in simple:
                    out += simple[e]
                elif e == 0x75:
                    cp = self._hex4()
                    if 0xD800 <= cp <= 0xDBFF:
                        if (
                            self.i + 1 < len(b)
                            and b[self.i] == 0x5C
                            and b[self.i + 1] == 0x75
                        ):
                            self.i += 2
                            lo = self._hex4()
                            if not 0xDC00 <= lo <= 0xDFFF:
                                raise self.error(
                                    "lone leading surrogate in hex escape"
                                )
                            cp = (
                                0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00)
                            )
                        else:
                            if self.i >= len(b):
                                raise self.error(
                                    "EOF while parsing a string", "eof"
                                )
                            self.i += 1
                            raise self.error("unexpected end of hex escape")
                    elif 0xDC00 <= cp <= 0xDFFF:
                        raise self.error(
                            "lone leading surrogate in hex escape"
                        )
                    out += chr(cp).encode("utf-8")
                else:
                    raise self.error("invalid escape")
            elif c < 0x20:
                raise self.error(
                    "control character (\\u0000-\\u001F) found while parsing "
                    "a string"
                )
            else:
                out.append(c)
        try:
            return out.decode("utf-8")
        except UnicodeDecodeError:
            raise self.error("invalid unicode code point")

    def _hex4(self):
        if self.i + 4 > len(self.b):
            self.i = len(self.b)
            raise self.error("EOF while parsing a string", "eof")
        chunk = self.b[self.i : self.i + 4]
        self.i += 4
        try:
            text = chunk.decode("ascii")
            if not all(c in "0123456789abcdefABCDEF" for c in text):
                raise ValueError
        except (UnicodeDecodeError, ValueError):
            raise self.error("invalid escape")
        return int(text, 16)

    def parse_number(self, positive):
        """serde_json parse_integer: the sign was already eaten if negative."""
        start = self.i
        c = self.next_char()
        if c is None:
            raise self.error("EOF while parsing a value", "eof")
        if c == 0x30:
            p = self.peek()
            if p is not None and 0x30 <= p <= 0x39:
                raise self.peek_error("invalid number")
        elif not (0x31 <= c <= 0x39):
            raise self.error("invalid number")
        while self.peek() is not None and 0x30 <= self.peek() <= 0x39:
            self.i += 1
        is_float = False
        if self.peek() == 0x2E:
            is_float = True
            self.i += 1
            n = 0
            while self.peek() is not None and 0x30 <= self.peek() <= 0x39:
                self.i += 1
                n += 1
            if n == 0:
                if self.peek() is None:
                    raise self.peek_error("EOF while parsing a value", "eof")
                raise self.peek_error("invalid number")
        if self.peek() in (0x65, 0x45):
            is_float = True
            self.i += 1
            if self.peek() in (0x2B, 0x2D):
                self.i += 1
            c = self.next_char()
            if c is None:
                raise self.error("EOF while parsing a value", "eof")
            if not (0x30 <= c <= 0x39):
                raise self.error("invalid number")
            while self.peek() is not None and 0x30 <= self.peek() <= 0x39:
                self.i += 1
        text = self.b[start : self.i].decode()
        if is_float:
            v = float(text)
            if v in (float("inf"), float("-inf")):
                raise self.error("number out of range")
            return _Num("f64", v if positive else -v)
        n = int(text)
        if not positive and n == 0:
            return _Num("f64", -0.0)
        if positive:
            if n > 2**64 - 1:
                return _Num("f64", float(n))
            return _Num("u64", n)
        if n > 2**63:
            return _Num("f64", -float(n))
        return _Num("i64", -n)

    def invalid_type(self, unexpected, t):
        return self.data_error(
            f"invalid type: {unexpected}, expected {_expecting(t)}"
        )

    def peek_invalid_type(self, t):
        p = self.ws()
        if p == 0x6E:
            self.eat()
            self.parse_ident(b"ull")
            return self.invalid_type("null", t)
        if p in (0x74, 0x66):
            self.eat()
            self.parse_ident(b"rue" if p == 0x74 else b"alse")
            return self.invalid_type(
                "boolean `%s`" % ("true" if p == 0x74 else "false"), t
            )
        if p == 0x2D:
            self.eat()
            return self.invalid_type(self.parse_number(False).unexpected(), t)
        if p is not None and 0x30 <= p <= 0x39:
            return self.invalid_type(self.parse_number(True).unexpected(), t)
        if p == 0x22:
            self.eat()
            return self.invalid_type(
                "string " + _rust_debug_str(self.parse_str()), t
            )
        if p == 0x5B:
            return self.invalid_type("sequence", t)
        if p == 0x7B:
            return self.invalid_type("map", t)
        if p is None:
            return self.peek_error("EOF while parsing a value", "eof")
        return self.peek_error("expected value")

    # ---- typed deserialization
    def de(self, t):
        k = t[0]
        if k == "opt":
            if self.ws() == 0x6E:
                self.eat()
                self.parse_ident(b"ull")
                return None
            return self.de(t[1])
        p = self.ws()
        if p is None:
            raise self.peek_error("EOF while parsing a value", "eof")
        if k == "bool":
            if p in (0x74, 0x66):
                self.eat()
                self.parse_ident(b"rue" if p == 0x74 else b"alse")
                return p == 0x74
            raise self.peek_invalid_type(t)
        if k == "str":
            if p == 0x22:
                self.eat()
                return self.parse_str()
            raise self.peek_invalid_type(t)
        if k == "int":
            if p == 0x2D:
                self.eat()
                num = self.parse_number(False)
            elif 0x30 <= p <= 0x39:
                num = self.parse_number(True)
            else:
                raise self.peek_invalid_type(t)
            if num.kind == "f64":
                raise self.invalid_type(num.unexpected(), t)
            lo, hi = _INT_RANGES[t[1]]
            if not lo <= num.value <= hi:
                raise self.data_error(
                    f"invalid value: {num.unexpected()}, expected {t[1]}"
                )
            return num.value
        if k == "seq":
            if p != 0x5B:
                raise self.peek_invalid_type(t)
            self.eat()
            out = []
            idx = 0
            err = None
            try:
                while self._has_next_element(idx == 0):
                    self.path.append(idx)
                    try:
                        out.append(self.de(t[1]))
                    finally:
                        self.path.pop()
                    idx += 1
            except SerdeError as e:
                err = e
            self._end_seq_after(err)
            return out
        if k == "map":
            if p != 0x7B:
                raise self.peek_invalid_type(t)
            self.eat()
            out = {}
            err = None
            try:
                first = True
                while True:
                    key = self._next_key(first)
                    first = False
                    if key is None:
                        break
                    self._colon()
                    self.path.append(key)
                    try:
                        out[key] = self.de(t[1])
                    finally:
                        self.path.pop()
            except SerdeError as e:
                err = e
            self._end_map_after(err)
            return out
        if k == "anystruct":
            if p != 0x7B:
                raise self.peek_invalid_type(t)
            return self.de(ANY)
        if k == "enum":
            if p == 0x22:
                self.eat()
                s = self.parse_str()
                if s not in t[2]:
                    raise self.data_error(
                        f"unknown variant `{s}`, {_one_of(t[2], 'variant')}"
                    )
                return s
            if p == 0x7B:
                self.eat()
                if self.ws() != 0x22:
                    raise self.peek_error("key must be a string")
                self.eat()
                s = self.parse_str()
                if s not in t[2]:
                    raise self.data_error(
                        f"unknown variant `{s}`, {_one_of(t[2], 'variant')}"
                    )
                self._colon()
                self.path.append(s)
                try:
                    if self.ws() == 0x6E:
                        self.eat()
                        self.parse_ident(b"ull")
                    else:
                        raise self.peek_invalid_type(("unit",))
                finally:
                    self.path.pop()
                q = self.ws()
                if q == 0x7D:
                    self.eat()
                    return s
                if q is None:
                    raise self.peek_error("EOF while parsing an object", "eof")
                raise self.error("expected value")
            raise self.peek_error("expected value")
        if k == "struct":
            return self._de_struct(t, p)
        if k == "any":
            return self._de_any()
        raise AssertionError(t)

    def _has_next_element(self, first):
        p = self.ws()
        if p is None:
            raise self.peek_error("EOF while parsing a list", "eof")
        if p == 0x5D:
            return False
        if first:
            return True
        if p == 0x2C:
            self.eat()
            q = self.ws()
            if q == 0x5D:
                raise self.peek_error("trailing comma")
            if q is None:
                raise self.peek_error("EOF while parsing a value", "eof")
            return True
        raise self.peek_error("expected `,` or `]`")

    def _end_seq_after(self, err):
        end_err = None
        p = self.ws()
        if p == 0x5D:
            self.eat()
        elif p == 0x2C:
            self.eat()
            end_err = self.peek_error(
                "trailing comma"
                if self.ws() == 0x5D
                else "trailing characters"
            )
        elif p is None:
            end_err = self.peek_error("EOF while parsing a list", "eof")
        else:
            end_err = self.peek_error("trailing characters")
        if err is not None:
            raise err
        if end_err is not None:
            raise end_err

    def _next_key(self, first):
        p = self.ws()
        if p == 0x7D:
            return None
        if p == 0x2C and not first:
            self.eat()
            p = self.ws()
        elif p is None:
            raise self.peek_error("EOF while parsing an object", "eof")
        elif not first:
            raise self.peek_error("expected `,` or `}`")
        if p == 0x22:
            self.eat()
            return self.parse_str()
        if p == 0x7D:
            raise self.peek_error("trailing comma")
        if p is None:
            raise self.peek_error("EOF while parsing a value", "eof")
        raise self.peek_error("key must be a string")

    def _colon(self):
        p = self.ws()
        if p == 0x3A:
            self.eat()
            return
        if p is None:
            raise self.peek_error("EOF while parsing an object", "eof")
        raise self.peek_error("expected `:`")

    def _end_map_after(self, err):
        end_err = None
        p = self.ws()
        if p == 0x7D:
            self.eat()
        elif p == 0x2C:
            end_err = self.peek_error("trailing comma")
        elif p is None:
            end_err = self.peek_error("EOF while parsing an object", "eof")
        else:
            end_err = self.peek_error("trailing characters")
        if err is not None:
            raise err
        if end_err is not None:
            raise end_err

    def _de_struct(self, t, p):
        _, name, fields, deny, aliases, listed = t
        by_key = {f[0]: f for f in fields}
        if p == 0x5B:
            # serde's derived visit_seq: the fields in declaration order
            self.eat()
            out = {}
            err = None
            try:
                idx = 0
                for f in fields:
                    if not self._has_next_element(idx == 0):
                        if f[2]:
                            raise _Pending(
                                f"invalid length {idx}, expected struct "
                                f"{name} with "
                                f"{len(fields)} elements"
                            )
                        continue
                    self.path.append(idx)
                    try:
                        out[f[0]] = self.de(f[1])
                    finally:
                        self.path.pop()
                    idx += 1
            except SerdeError as e:
                err = e
            except _Pending as pend:
                self._end_seq_after(None)
                raise self.data_error(pend.msg)
            self._end_seq_after(err)
            return out
        if p != 0x7B:
            raise self.peek_invalid_type(t)
        self.eat()
        out = {}
        err = None
        pending = None
        pending_path = None
        try:
            first = True
            while True:
                key = self._next_key(first)
                first = False
                if key is None:
                    break
                canon = aliases.get(key, key)
                if canon not in by_key:
                    if deny:
                        # serde_json fixes the position of this error only
                        # at the struct level, after the whitespace that
                        # follows the key; the path names the key.
                        pending = (
                            f"unknown field `{key}`, "
                            f"{_one_of(listed, 'field')}"
                        )
                        pending_path = key
                        break
                    self._colon()
                    self.path.append(key)
                    try:
                        self._de_any()
                    finally:
                        self.path.pop()
                    continue
                if canon in out:
                    pending = f"duplicate field `{canon}`"
                    break
                self._colon()
                self.path.append(key)
                try:
                    out[canon] = self.de(by_key[canon][1])
                finally:
                    self.path.pop()
            if pending is None:
                for f in fields:
                    if f[2] and f[0] not in out:
                        pending = f"missing field `{f[0]}`"
                        break
        except SerdeError as e:
            err = e
        if err is not None:
            try:
                self._end_map_after(None)
            except SerdeError:
                pass
            raise err
        if pending is not None:
            try:
                self._end_map_after(None)
            except SerdeError:
                pass
            if pending_path is not None:
                self.path.append(pending_path)
            try:
                raise self.data_error(pending)
            finally:
                if pending_path is not None:
                    self.path.pop()
        self._end_map_after(None)
        return out

    def _de_any(self):
        p = self.ws()
        if p is None:
            raise self.peek_error("EOF while parsing a value", "eof")
        if p == 0x6E:
            self.eat()
            self.parse_ident(b"ull")
            return None
        if p in (0x74, 0x66):
            self.eat()
            self.parse_ident(b"rue" if p == 0x74 else b"alse")
            return p == 0x74
        if p == 0x2D:
            self.eat()
            return self.parse_number(False).value
        if 0x30 <= p <= 0x39:
            return self.parse_number(True).value
        if p == 0x22:
            self.eat()
            return self.parse_str()
        if p == 0x5B:
            self.eat()
            out = []
            err = None
            try:
                idx = 0
                while self._has_next_element(idx == 0):
                    out.append(self._de_any())
                    idx += 1
            except SerdeError as e:
                err = e
            self._end_seq_after(err)
            return out
        if p == 0x7B:
            self.eat()
            out = {}
            err = None
            try:
                first = True
                while True:
                    key = self._next_key(first)
                    first = False
                    if key is None:
                        break
                    self._colon()
                    out[key] = self._de_any()
            except SerdeError as e:
                err = e
            self._end_map_after(err)
            return out
        raise self.peek_error("expected value")

    def end(self):
        if self.ws() is not None:
            raise self.peek_error("trailing characters")


class _Pending(Exception):
    def __init__(self, msg):
        self.msg = msg


def serde_parse(data: bytes, schema):
    """Deserialize like serde_json::from_slice via serde_path_to_error.
    Returns the value or raises SerdeError."""
    d = _Deserializer(data)
    v = d.de(schema)
    d.end()
    return v


# ---- serde_urlencoded (axum Query) emulation


class QueryError(Exception):
    pass


def parse_query(qs: str, schema: dict):
    """schema: key -> 'bool' | 'str' | int kind. Unknown keys are ignored."""
    out = {}
    seen = set()
    for part in qs.split("&") if qs else []:
        if not part:
            continue
        k, _, v = part.partition("=")
        k = urllib.parse.unquote_plus(k)
        v = urllib.parse.unquote_plus(v)
        if k not in schema:
            continue
        if k in seen:
            raise QueryError(f"duplicate field `{k}`")
        seen.add(k)
        kind = schema[k]
        if kind == "bool":
            if v == "true":
                out[k] = True
            elif v == "false":
                out[k] = False
            else:
                raise QueryError(
                    f"{k}: provided string was not `true` or `false`"
                )
        elif kind == "str":
            out[k] = v
        else:
            lo, hi = _INT_RANGES[kind]
            s = v[1:] if v.startswith("+") else v
            if v == "":
                raise QueryError(
                    f"{k}: cannot parse integer from empty string"
                )
            neg = lo < 0 and s.startswith("-")
            digits = s[1:] if neg else s
            if not digits or not digits.isascii() or not digits.isdigit():
                raise QueryError(f"{k}: invalid digit found in string")
            n = -int(digits) if neg else int(digits)
            if n > hi:
                raise QueryError(
                    f"{k}: number too large to fit in target type"
                )
            if n < lo:
                raise QueryError(
                    f"{k}: number too small to fit in target type"
                )
            out[k] = n
    return out


# --------------------------------------------------------------------------
# HTTP plumbing
# --------------------------------------------------------------------------

VARY = "origin, access-control-request-method, access-control-request-headers"
JSON_CT = "application/json"
TEXT_CT = "text/plain; charset=utf-8"

BOOT_FAIL_START = (
    "failed to start machine: agent operation failed: wait for ready: agent "
    "did not "
    "become ready within 30 seconds: no boot progress for 30 seconds"
)
BOOT_FAIL_AUTO = (
    "agent did not become ready within 30 seconds: no boot progress for 30 "
    "seconds"
)

NAME_MAX = 128


def _dumps(obj):
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False)


class Response:
    def __init__(
        self, status, body=b"", ctype=None, headers=None, stream=None
    ):
        self.status = status
        self.body = body.encode() if isinstance(body, str) else body
        self.ctype = ctype
        self.headers = headers or []
        self.stream = stream  # iterable of bytes chunks (chunked transfer)


def json_response(status, obj):
    return Response(status, _dumps(obj), JSON_CT)


def api_error(status, code, msg):
    return json_response(status, {"error": msg, "code": code})


def not_found_machine(name):
    return api_error(404, "NOT_FOUND", f"machine '{name}' not found")


def empty_404():
    return Response(404)


class _HTTPError(Exception):
    def __init__(self, resp):
        self.resp = resp


def _is_json_ctype(value):
    if not value:
        return False
    mime = value.split(";", 1)[0].strip().lower()
    typ, _, sub = mime.partition("/")
    return typ == "application" and (sub == "json" or sub.endswith("+json"))


def validate_machine_name(name):
    """The real serve's machine-name rules; returns the error text or None."""
    if name == "":
        return "machine name cannot be empty"
    n = len(name)
    if n > NAME_MAX:
        return f"machine name too long: {n} characters (max {NAME_MAX})"
    first = name[0]
    if not (first.isascii() and first.isalnum()):
        return (
            "machine name must start with a letter or digit (got: "
            f"{_dumps(name)})"
        )
    for ch in name:
        if not (ch.isascii() and (ch.isalnum() or ch in "-_")):
            return (
                "machine name contains invalid character: "
                + _rust_char_debug(ch)
            )
    return None


def _rust_char_debug(ch):
    o = ord(ch)
    if ch == "'":
        return "'\\''"
    if ch == "\\":
        return "'\\\\'"
    if ch == "\n":
        return "'\\n'"
    if ch == "\r":
        return "'\\r'"
    if ch == "\t":
        return "'\\t'"
    if ch == "\0":
        return "'\\0'"
    if o < 0x20 or o == 0x7F:
        return "'\\u{%x}'" % o
    return f"'{ch}'"


def registry_manifest_url(image):
    ref = image
    digest = None
    if "@" in ref:
        ref, digest = ref.split("@", 1)
    first, _, rest = ref.partition("/")
    if rest and ("." in first or ":" in first or first == "localhost"):
        host, repo = first, rest
    else:
        host, repo = "registry-1.docker.io", ref
    tag = "latest"
    last = repo.rsplit("/", 1)[-1]
    if ":" in last:
        repo, tag = repo.rsplit(":", 1)
    if host == "registry-1.docker.io" and "/" not in repo:
        repo = "library/" + repo
    return f"https://{host}/v2/{repo}/manifests/{digest or tag}"


# How the real serve reads an image reference when it fetches the image
# on the host: observed on 1.32.2 for about 300 references, at an
# explicit start of a machine created without network (with or without
# an allow list); a create accepts any reference that is not a local
# source. Rust's str::trim strips these first.
RUST_WHITESPACE = (
    "\t\n\x0b\x0c\r \x85\xa0\u1680\u2000\u2001\u2002\u2003\u2004"
    "\u2005\u2006\u2007\u2008\u2009\u200a\u2028\u2029\u202f\u205f\u3000"
)
REPOSITORY_COMPONENT_RE = re.compile(r"[A-Za-z0-9._-]+")
BAD_REFERENCE = "config operation failed: image-auth: bad reference: "


def image_reference_refusal(image):
    """The 500's text for an image reference the engine cannot fetch
    without asking a registry, or None: first the reference's own parse
    (`bad reference: ...`), then the URL built from its registry (a bad
    port). Not modelled: `invalid international domain name` for a
    registry such as `.`, and what the registry itself answers."""
    why = reference_parse_refusal(image.strip(RUST_WHITESPACE))
    if why is not None:
        return BAD_REFERENCE + why
    return registry_url_refusal(image.strip(RUST_WHITESPACE))


def reference_parse_refusal(ref):
    """Why the engine's reference parser refuses ``ref`` (trimmed), in
    its order: the digest, the tag, the registry, the repository's
    components; or None."""
    if not ref:
        return "empty reference"
    name, at, digest = ref.partition("@")
    if at:
        if not digest.startswith("sha256:"):
            return (
                f"unsupported digest algorithm in '{digest}': only sha256 "
                "is supported"
            )
        digits = digest[len("sha256:") :]
        # Counted in bytes, as Rust's str::len.
        if len(digits.encode()) != 64:
            return f"digest has {len(digits.encode())} hex chars, expected 64"
        if not re.fullmatch(r"[0-9A-Fa-f]+", digits):
            return "digest contains non-hex characters"
    last = name.rfind("/") + 1
    colon = name.find(":", last)
    if colon >= 0:
        tag = name[colon + 1 :]
        name = name[:colon]
        # With a digest the tag is not used.
        if not tag and not at:
            return "empty tag"
    components = name.split("/")
    first = components[0]
    if len(components) > 1 and ("." in first or ":" in first):
        components = components[1:]
    elif len(components) > 2:
        return (
            f"first component '{first}' doesn't look like a registry hostname"
        )
    if not components[-1]:
        return "empty name"
    if "" in components:
        return "empty repository component (check for double slashes)"
    for component in components:
        if component in (".", "..") or not REPOSITORY_COMPONENT_RE.fullmatch(
            component
        ):
            return (
                "invalid repository component (path traversal or disallowed "
                "characters)"
            )
    return None


def registry_url_refusal(ref):
    """The HTTP client's refusal of the registry URL of a parsed ``ref``
    (a port that is not a number up to 65535, an unclosed IPv6
    bracket), or None."""
    first, slash, _ = ref.partition("@")[0].partition("/")
    if not slash or not ("." in first or ":" in first):
        return None
    port = ""
    if first.startswith("["):
        if "]" not in first:
            return "HTTP request failed: builder error: invalid IPv6 address"
        port = first.split("]", 1)[1].removeprefix(":")
    elif ":" in first:
        port = first.split(":", 1)[1]
    if port and not (re.fullmatch(r"[0-9]+", port) and int(port) <= 65535):
        return "HTTP request failed: builder error: invalid port number"
    return None


def registry_offline_error(image):
    return (
        "HTTP request failed: error sending request for url ("
        f"{registry_manifest_url(image)}): client error (Connect): dns error: "
        "failed to lookup address information: Name or service not known"
    )


# --------------------------------------------------------------------------
# create-time checks (each returns the refusal or None)
# --------------------------------------------------------------------------


def local_image_refusal(image):
    """The create's refusal of an image that names a local source on a
    serve without --local-image-dir (observed: `file://`, `-`, a path
    starting with /, ./ or ../ or a drive letter, a .tar, .tar.gz or .tgz
    archive), or None: anything else is a registry reference."""
    if image.startswith("file://"):
        return (
            "`file://` is not a supported prefix; give the path directly: "
            f"`{image[len('file://') :]}`"
        )
    if image == "-":
        return (
            "image '-' requires CLI stdin; give the API a server-local "
            "archive path"
        )
    local = (
        image.startswith(("/", "./", "../"))
        or image.endswith((".tar", ".tar.gz", ".tgz"))
        or re.match(r"[A-Za-z]:/", image)
    )
    if local:
        return (
            "local images are disabled on this server; start "
            "`smolvm serve` with --local-image-dir to accept archives "
            "and rootfs directories under it"
        )
    return None


RESOURCE_PREFIX = "config operation failed: validate resources: "

# Observed on a paused record: start, exec (autoStart true), exec/stream,
# files and images/pull all answer this 409 (none resumes the machine);
# stop answers it with " or delete".
SAVED_EXECUTION = "machine has saved execution; use resume"

# From the binary's strings, not observed: the 409 of a start of a frozen
# branch base; the fake answers it to exec and files as well.
FROZEN_BASE = (
    "machine '{name}' is frozen as a reusable fork base; fork it again, or "
    "delete its descendants and stop it before restarting"
)


def held_refusal(m):
    """The 409 for booting a machine that holds saved execution (paused)
    or is a frozen branch base, or None."""
    if m["state"] == "paused":
        return api_error(409, "CONFLICT", SAVED_EXECUTION)
    if m["state"] == "frozen":
        return api_error(409, "CONFLICT", FROZEN_BASE.format(name=m["name"]))
    return None


RESTART_POLICIES = ("never", "always", "on-failure", "unless-stopped")


def published_ports(ports):
    """Ports as the record shows them: `protocol` only for udp, and the
    tcp ones first (observed)."""
    out = []
    for p in ports:
        entry = {"host": p["host"], "guest": p["guest"]}
        if p.get("protocol") == "udp":
            entry["protocol"] = "udp"
        out.append(entry)
    out.sort(key=lambda e: 1 if e.get("protocol") == "udp" else 0)
    return out


def port_refusal(ports, on_create=True):
    """A port 0 or a host port mapped twice for one protocol (observed:
    PUT ports accepts port 0 and words the duplicate with a prefix)."""
    prefix = ""
    if not on_create:
        prefix = "config operation failed: published ports: "
    seen = set()
    for p in ports:
        if on_create and (p["host"] == 0 or p["guest"] == 0):
            return api_error(
                400,
                "BAD_REQUEST",
                "port 0 is not valid for VM port forwarding",
            )
        key = (p["host"], p.get("protocol") or "tcp")
        if key in seen:
            return api_error(
                400,
                "BAD_REQUEST",
                f"{prefix}duplicate host port {p['host']}: each host port "
                "can only be mapped once",
            )
        seen.add(key)
    return None


def egress_rule_refusal(rules):
    """The 400 for the first egress rule the serve refuses, or None.
    Observed on 1.32.2: the CIDR is checked first (an address, with or
    without a prefix, host bits allowed, blanks around it ignored), then
    ports (never with icmp, from 1, start <= end), then redirect (tcp
    only)."""
    for i, rule in enumerate(rules):
        cidr = rule.get("cidr")
        transport = rule.get("transport")
        ports = rule.get("ports")
        if cidr is not None and not rule_cidr_valid(cidr):
            why = "invalid CIDR"
        elif ports is not None and not (
            transport != "icmp" and 1 <= ports["start"] <= ports["end"]
        ):
            why = "invalid port range or transport"
        elif rule["action"] == "redirect" and transport != "tcp":
            why = "redirect requires TCP transport"
        else:
            continue
        return api_error(400, "BAD_REQUEST", f"egress rule {i}: {why}")
    return None


def rule_cidr_valid(cidr):
    """Whether an egress rule's `cidr` parses as the serve reads it
    (observed: 1.2.3.4, 1.2.3.4/8 and 10.0.0.0/08 pass; 010.0.0.0/8,
    [::1]/128, 1.2.3.0/33 and "" do not)."""
    address, slash, prefix = cidr.strip().partition("/")
    try:
        parsed = ipaddress.ip_address(address)
    except ValueError:
        return False
    if "%" in address:
        return False
    if not slash:
        return True
    return prefix.isdigit() and int(prefix) <= parsed.max_prefixlen


def echoed_rule(rule):
    """A rule as the record echoes it (observed): transport, cidr, ports
    as {"start", "end"}, action, each only when set."""
    shown = {}
    for key in ("transport", "cidr", "ports", "action"):
        if rule.get(key) is not None:
            shown[key] = rule[key]
    if "ports" in shown:
        shown["ports"] = {
            "start": shown["ports"]["start"],
            "end": shown["ports"]["end"],
        }
    return shown


def network_backend_refusal(req):
    """Observed on 1.32.2: an egress policy (an allow list, even an
    empty one, or an egress rule) on TSI, and virtio-net without network
    or a policy (the rules count as one)."""
    policy = (
        req.get("allowedHosts") is not None
        or req.get("allowedCidrs") is not None
        or bool(req.get("egressRules"))
    )
    backend = req.get("networkBackend")
    if backend == "tsi" and policy:
        return api_error(
            400,
            "BAD_REQUEST",
            "config operation failed: egress: egress policy "
            "(--allow-cidr/--allow-host/--outbound-localhost-only/"
            "--block-private) requires the virtio-net backend; TSI does not "
            "enforce it. Remove --net-backend tsi or set it to virtio-net",
        )
    if backend == "virtio-net" and not (req.get("network") or policy):
        return api_error(
            400,
            "BAD_REQUEST",
            "config operation failed: --net-backend: --net-backend "
            "virtio-net requires --net",
        )
    return None


def mount_refusal(mounts):
    for mt in mounts:
        src = mt["source"]
        if not src.startswith("/"):
            return api_error(
                400,
                "BAD_REQUEST",
                "mount operation failed: validate source: path must be "
                f"absolute: {src}",
            )
        if not os.path.exists(src):
            return api_error(
                400, "BAD_REQUEST", f"mount source not found: {src}"
            )
    return None


def resource_refusal(req):
    cpus = req.get("cpus")
    mem = req.get("memoryMb")
    err = None
    if cpus == 0:
        err = "CPU count must be at least 1"
    elif mem is not None and mem < 64:
        err = f"memory must be at least 64 MiB (got {mem} MiB)"
    elif req.get("storageGb") == 0:
        err = "storage disk size must be greater than 0 GiB"
    elif req.get("overlayGb") == 0:
        err = "overlay disk size must be greater than 0 GiB"
    if err is None:
        return None
    return api_error(400, "BAD_REQUEST", RESOURCE_PREFIX + err)


def secret_refusal(secrets):
    """Any secret ref: an API caller is untrusted (observed)."""
    for sname, ref in secrets.items():
        kind = "env"
        if isinstance(ref, dict) and ref:
            k0 = next(iter(ref))
            kind = k0[5:] if k0.startswith("from_") else k0
        return api_error(
            400,
            "BAD_REQUEST",
            f"secret '{sname}': source kind '{kind}' is not allowed in "
            "scope Untrusted; secret refs may only be resolved on the "
            "trusted local host",
        )
    return None


def env_refusal(env):
    for ev in env:
        n = ev["name"]
        if not n or not all(
            c.isascii() and (c.isalnum() or c == "_") for c in n
        ):
            return api_error(
                400,
                "BAD_REQUEST",
                f"env entry with {len(n.encode())}-byte name rejected: env "
                "key must contain only ASCII alphanumeric and underscore",
            )
    return None


def restart_refusal(restart):
    policy = restart.get("policy")
    if policy is not None and policy not in RESTART_POLICIES:
        return api_error(
            400, "BAD_REQUEST", f"invalid restart policy: {policy}"
        )
    return None


# --------------------------------------------------------------------------
# cache disks
#
# Observed on 1.32.2 with --cache-disk-dir: every refusal text of create,
# publish and DELETE /api/v1/cache-bases; a publish answering
# {base, sizeBytes, sha256} and writing `.BASE.sha256` beside the base; a
# never-run machine on a raw base failing its publish with a 500; the
# record's `cacheDisk` with a trailing slash dropped from mountPath. The
# fake's own bases are not qcow2: they start with qcow2's magic and then
# hold a tar of the cache directory, so a machine created from a published
# base sees the files the publisher wrote there (what a cache disk is for).
# A real serve cannot read them, nor the fake a real one (it sees an empty
# cache). uploadUrls are checked, never used.
# --------------------------------------------------------------------------

CACHE_DISABLED = (
    "cache disks are disabled on this server; start `smolvm serve` with "
    "--cache-disk-dir to enable them"
)

CACHE_RESERVED_PATHS = (
    "/proc",
    "/sys",
    "/dev",
    "/run",
    "/workspace",
    "/storage",
)

QCOW2_MAGIC = b"QFI\xfb"

# [assumption] which object stores an uploadUrl may name: the two Google
# hosts are in the binary's strings; the rest is a guess.
OBJECT_STORE_SUFFIXES = (
    "storage.googleapis.com",
    "storage.cloud.google.com",
    ".amazonaws.com",
    ".r2.cloudflarestorage.com",
)


def normal_guest_path(path):
    """A guest path as the serve keeps it: empty and `.` components
    dropped, `..` kept (observed: `/cache/` reads `/cache`)."""
    parts = [part for part in path.split("/") if part not in ("", ".")]
    return "/" + "/".join(parts)


def cache_base_refusal(base):
    """The text refusing a cache base name, or None: a file name, never a
    path, never starting with a dot (observed)."""
    if base and "/" not in base and not base.startswith("."):
        return None
    return (
        f"{_rust_debug_str(base)}: cache base must be a file name (not a "
        "path, not starting with '.')"
    )


def upload_url_refusal(urls):
    if urls is None:
        return None
    if not 1 <= len(urls) <= 32:
        return "uploadUrls must name 1 to 32 parts"
    for url in urls:
        parsed = urllib.parse.urlsplit(url)
        if parsed.scheme != "https":
            return "checkpoint source url must be https"
        host = parsed.hostname or ""
        if not host.endswith(OBJECT_STORE_SUFFIXES):
            return (
                f"checkpoint source host {host} is not an allowed object store"
            )
    return None


def is_qcow2(path):
    try:
        with open(path, "rb") as f:
            return f.read(4) == QCOW2_MAGIC
    except OSError:
        return False


def host_memory_mb():
    """(MemTotal, MemAvailable) of this host in MB; (0, 0) without
    /proc/meminfo."""
    found = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                found[key] = int(value.split()[0]) // 1024
    except (OSError, ValueError, IndexError):
        return 0, 0
    return found.get("MemTotal", 0), found.get("MemAvailable", 0)


def write_cache_base(path, source_dir):
    """Write the fake's base (see above) holding `source_dir`; returns
    (size in bytes, sha256 hex)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        if os.path.isdir(source_dir):
            for entry in sorted(os.listdir(source_dir)):
                tar.add(os.path.join(source_dir, entry), arcname=entry)
    data = QCOW2_MAGIC + buf.getvalue()
    tmp = f"{path}.partial"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)
    digest = hashlib.sha256(data).hexdigest()
    st = os.stat(path)
    folder, name = os.path.split(path)
    # The sidecar as the real serve writes it: size, mtime, inode, digest.
    with open(os.path.join(folder, f".{name}.sha256"), "w") as f:
        f.write(f"{st.st_size} {st.st_mtime_ns / 1e9:.9f} {st.st_ino}\n")
        f.write(digest)
    return len(data), digest


def read_cache_base(path, target_dir):
    """Unpack a fake base into `target_dir`; a base the fake did not write
    (a real qcow2 or raw image) leaves it empty."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError:
        return
    if not data.startswith(QCOW2_MAGIC):
        return
    try:
        with tarfile.open(fileobj=io.BytesIO(data[4:])) as tar:
            tar.extractall(target_dir, filter="tar")
    except (tarfile.TarError, OSError):
        pass


# --------------------------------------------------------------------------
# fork pools and leases (the handlers say what is observed)
# --------------------------------------------------------------------------

POOL_MAX_READY = 256
DEFAULT_LEASE_TTL = 600
LEASE_TTL_MIN = 30
LEASE_TTL_MAX = 86400
LEASE_TTL_RANGE = (
    f"lease TTL must be between {LEASE_TTL_MIN} and {LEASE_TTL_MAX} seconds"
)
LEASE_MAX_FILES = 32
LEASE_MAX_BYTES = 1 << 20
ENV_KEY_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def pool_not_found(name):
    return api_error(404, "NOT_FOUND", f"fork pool '{name}' not found")


def lease_not_found(lease_id):
    return api_error(404, "NOT_FOUND", f"fork lease '{lease_id}' not found")


def lease_info(lease):
    """ForkLeaseInfo: the spec's fields, private keys left out."""
    return {k: v for k, v in lease.items() if not k.startswith("_")}


def lease_digest(req):
    """What makes two lease requests under one key the same request: the
    payload and the lease options, not how long the caller would wait."""
    kept = {
        k: v
        for k, v in req.items()
        if k not in ("waitSecs", "workerReadyTimeoutSecs")
    }
    return hashlib.sha256(_dumps(kept).encode()).hexdigest()


def pool_create_refusal(req):
    """The text of a pool create's 400, or None: the checks in the
    observed order."""
    err = validate_machine_name(req["name"])
    if err:
        return err.replace("machine name", "pool name")
    err = validate_machine_name(req["source"])
    if err:
        return err.replace("machine name", "golden machine name")
    if not 1 <= req["desiredReady"] <= POOL_MAX_READY:
        return f"desiredReady must be between 1 and {POOL_MAX_READY}"
    if req.get("maxActive") == 0:
        return "maxActive must be greater than zero when set"
    if req.get("autoAdmission") and not req.get("shareWeights"):
        return (
            "autoAdmission requires shareWeights so residency controls CUDA "
            "workers"
        )
    ready_timeout = req.get("readyTimeoutSecs")
    if ready_timeout is not None and not 1 <= ready_timeout <= 3600:
        return "readyTimeoutSecs must be between 1 and 3600"
    ttl = req.get("leaseTtlSecs")
    if ttl is not None and not LEASE_TTL_MIN <= ttl <= LEASE_TTL_MAX:
        return LEASE_TTL_RANGE
    return None


def lease_request_refusal(req):
    """The text of a lease request's 400 (checked before the pool is
    looked up), or None: the checks in the observed order."""
    key = req["idempotencyKey"]
    control = any(ord(ch) < 0x20 or ord(ch) == 0x7F for ch in key)
    if not 1 <= len(key.encode()) <= 256 or control:
        return "idempotencyKey must contain 1-256 non-control bytes"
    timeout = req.get("workerReadyTimeoutSecs")
    if timeout is not None and not req.get("awaitWorkerReady"):
        return "workerReadyTimeoutSecs requires awaitWorkerReady=true"
    if timeout is not None and not 1 <= timeout <= 240:
        return "workerReadyTimeoutSecs must be between 1 and 240"
    if (req.get("waitSecs") or 0) > 600:
        return "waitSecs must be at most 600"
    return lease_env_refusal(req.get("env", [])) or lease_files_refusal(
        req.get("files", [])
    )


def lease_env_refusal(env):
    for i, entry in enumerate(env):
        if not entry.partition("=")[0] or "=" not in entry:
            return f"env entry {i} must be KEY=VALUE with a non-empty KEY"
    for entry in env:
        key = entry.partition("=")[0]
        if not ENV_KEY_RE.fullmatch(key):
            return (
                f"config operation failed: fork env: invalid key '{key}': "
                "must match [A-Za-z_][A-Za-z0-9_]*"
            )
    return None


def safe_relative_path(path):
    parts = path.split("/")
    return (
        bool(path)
        and "\\" not in path
        and "\0" not in path
        and all(part not in ("", ".", "..") for part in parts)
    )


def lease_files_refusal(files):
    if len(files) > LEASE_MAX_FILES:
        return f"lease payload may contain at most {LEASE_MAX_FILES} files"
    seen = set()
    total = 0
    for f in files:
        path = f["path"]
        if not safe_relative_path(path):
            return (
                f"lease payload path '{path}' must be a safe relative path "
                "under /workspace"
            )
        if path in seen:
            return f"lease payload path '{path}' is duplicated"
        seen.add(path)
        if (f.get("mode") or 0) & ~0o777:
            return (
                f"lease payload mode for '{path}' must contain only Unix "
                "permission bits"
            )
        try:
            total += len(base64.b64decode(f["dataBase64"], validate=True))
        except ValueError:
            return (
                f"lease payload dataBase64 for '{path}' is not valid "
                "standard base64"
            )
        # Observed: checked as the files are read, before a later file's
        # duplicate path.
        if total > LEASE_MAX_BYTES:
            return (
                "lease payload decoded contents must total at most "
                f"{LEASE_MAX_BYTES} bytes"
            )
    return None


class _Server(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True
    allow_reuse_address = True


class _TCPServer(socketserver.ThreadingMixIn, socketserver.TCPServer):
    daemon_threads = True
    allow_reuse_address = True


class _Handler(socketserver.StreamRequestHandler):
    timeout = 300

    def handle(self):
        fake: FakeSmolvm = self.server.fake  # type: ignore[attr-defined]
        with fake._lock:
            fake._conns.add(self.connection)
        try:
            self._serve(fake)
        finally:
            with fake._lock:
                fake._conns.discard(self.connection)

    def _serve(self, fake):
        while True:
            try:
                line = self.rfile.readline(65537)
            except (OSError, ValueError):
                return
            if not line:
                return
            if line in (b"\r\n", b"\n"):
                continue
            try:
                method, target, version = (
                    line.decode("latin-1").strip().split(" ", 2)
                )
            except ValueError:
                self._write(Response(400), keep=False)
                return
            headers = {}
            while True:
                h = self.rfile.readline(65537)
                if not h or h in (b"\r\n", b"\n"):
                    break
                k, _, v = h.decode("latin-1").partition(":")
                headers[k.strip().lower()] = v.strip()
            body = b""
            if headers.get("transfer-encoding", "").lower() == "chunked":
                while True:
                    size = int(
                        self.rfile.readline().split(b";")[0].strip() or b"0",
                        16,
                    )
                    if size == 0:
                        while self.rfile.readline() not in (
                            b"\r\n",
                            b"\n",
                            b"",
                        ):
                            pass
                        break
                    body += self.rfile.read(size)
                    self.rfile.readline()
            elif "content-length" in headers:
                body = self.rfile.read(int(headers["content-length"]))
            conn = headers.get("connection", "").lower()
            keep = not (
                conn == "close"
                or (version == "HTTP/1.0" and conn != "keep-alive")
            )
            try:
                resp = fake._dispatch(method, target, headers, body)
            except Exception as exc:  # a bug in the fake: say so loudly
                import traceback

                traceback.print_exc()
                resp = api_error(
                    500, "INTERNAL_ERROR", f"fake smolvm bug: {exc!r}"
                )
            try:
                self._write(resp, keep, head=(method == "HEAD"))
            except (BrokenPipeError, ConnectionResetError):
                return
            if not keep:
                return

    def _write(self, resp: Response, keep=True, head=False):
        fake = self.server.fake  # type: ignore[attr-defined]
        try:
            reason = HTTPStatus(resp.status).phrase
        except ValueError:
            reason = ""
        lines = [f"HTTP/1.1 {resp.status} {reason}"]
        for k, v in resp.headers:
            if k == "allow":
                lines.append(f"{k}: {v}")
        if resp.ctype:
            lines.append(f"content-type: {resp.ctype}")
        for k, v in resp.headers:
            if k != "allow":
                lines.append(f"{k}: {v}")
        lines.append(f"x-trace-id: {fake._trace_id()}")
        lines.append(f"vary: {VARY}")
        if resp.stream is not None:
            lines.append("transfer-encoding: chunked")
        elif resp.status != 204:
            # Observed: a 204 carries no content-length at all.
            lines.append(f"content-length: {len(resp.body)}")
        if not keep:
            lines.append("connection: close")
        lines.append("date: " + formatdate(usegmt=True))
        self.wfile.write(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1"))
        if head:
            self.wfile.flush()
            return
        if resp.stream is not None:
            for chunk in resp.stream:
                if chunk:
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                    self.wfile.flush()
            self.wfile.write(b"0\r\n\r\n")
        else:
            self.wfile.write(resp.body)
        self.wfile.flush()


# --------------------------------------------------------------------------
# the guest stand-in
# --------------------------------------------------------------------------


def find_busybox():
    for cand in (
        os.environ.get("FAKE_SMOLVM_BUSYBOX"),
        "/usr/bin/busybox",
        "/bin/busybox",
        shutil.which("busybox"),
    ):
        if cand and os.path.isfile(cand):
            return cand
    return None


_APPLETS_CACHE = {}


def busybox_applets(busybox):
    if busybox not in _APPLETS_CACHE:
        out = subprocess.run(
            [busybox, "--list"], capture_output=True, check=True
        ).stdout
        _APPLETS_CACHE[busybox] = [
            a for a in out.decode().split() if a and "/" not in a
        ]
    return _APPLETS_CACHE[busybox]


def populate_guest_root(root: str):
    """A tiny Linux userland: a static busybox, /bin applet links, and the
    usual directories. Without busybox the root is left with directories only
    and exec answers 500."""
    for d in (
        "bin",
        "usr/bin",
        "sbin",
        "tmp",
        "root",
        "workspace",
        "etc/smolvm",
        "dev",
        "proc",
        "var/tmp",
        "home",
    ):
        os.makedirs(os.path.join(root, d), exist_ok=True)
    os.chmod(os.path.join(root, "tmp"), 0o1777)
    with open(os.path.join(root, "etc/passwd"), "w") as f:
        f.write(
            "root:x:0:0:root:/root:/bin/sh\n"
            "nobody:x:65534:65534:nobody:/:/bin/false\n"
        )
    with open(os.path.join(root, "etc/group"), "w") as f:
        f.write("root:x:0:\nnogroup:x:65534:\n")
    with open(os.path.join(root, "etc/hostname"), "w") as f:
        f.write("smolvm\n")
    bb = find_busybox()
    if bb:
        dst = os.path.join(root, "usr/bin/busybox")
        try:
            os.link(bb, dst)
        except OSError:
            shutil.copy2(bb, dst)
        for applet in busybox_applets(bb):
            link = os.path.join(root, "bin", applet)
            if not os.path.lexists(link):
                os.symlink("/usr/bin/busybox", link)
    if os.geteuid() == 0:
        for name, minor, mode in (
            ("null", 3, 0o666),
            ("zero", 5, 0o666),
            ("random", 8, 0o666),
            ("urandom", 9, 0o666),
        ):
            path = os.path.join(root, "dev", name)
            try:
                os.mknod(path, mode | stat.S_IFCHR, os.makedev(1, minor))
                os.chmod(path, mode)
            except OSError:
                pass


def guest_resolve(root: str, gpath: str, follow_last=True):
    """Host path of guest path `gpath`, resolving symlinks as the guest
    would (absolute targets are relative to the guest root)."""
    parts = collections.deque(p for p in gpath.split("/"))
    cur = []
    hops = 0
    while parts:
        p = parts.popleft()
        if p in ("", "."):
            continue
        if p == "..":
            if cur:
                cur.pop()
            continue
        host = os.path.join(root, *cur, p)
        if os.path.islink(host) and (parts or follow_last):
            hops += 1
            if hops > 40:
                raise OSError(errno.ELOOP, "Too many levels of symbolic links")
            target = os.readlink(host)
            if target.startswith("/"):
                cur = []
            parts.extendleft(reversed(target.split("/")))
            continue
        cur.append(p)
    return os.path.join(root, *cur)


def _lossy(b: bytes):
    return b.decode("utf-8", errors="replace")


class GuestUnavailable(Exception):
    """The guest root has no busybox, so nothing can run in it."""


class GuestRun:
    """The outcome of run_in_guest: exit_code, stdout and stderr (bytes),
    timed_out, and for a background command its pid and Popen (proc)."""

    __slots__ = ("exit_code", "stdout", "stderr", "timed_out", "pid", "proc")

    def __init__(
        self,
        exit_code=0,
        stdout=b"",
        stderr=b"",
        timed_out=False,
        pid=None,
        proc=None,
    ):
        self.exit_code = exit_code
        self.stdout = stdout
        self.stderr = stderr
        self.timed_out = timed_out
        self.pid = pid
        self.proc = proc


def guest_command(root, argv, workdir, user, netns=None):
    """The host command line that runs argv in the guest root `root`, in
    `workdir`, as `user`, in the network namespace `netns` when the guest has
    one of its own. Raises GuestUnavailable when the root has no busybox."""
    if not os.path.exists(os.path.join(root, "usr/bin/busybox")):
        raise GuestUnavailable(
            "fake smolvm: no static busybox on this host (install "
            "busybox-static)"
        )
    chroot = shutil.which("chroot") or "/usr/sbin/chroot"
    pre = [chroot] + ([f"--userspec={user}"] if user else [])
    pre += [
        root,
        "/usr/bin/busybox",
        "sh",
        "-c",
        'cd -- "$1" || exit 1; shift; exec "$@"',
        "sh",
        workdir,
    ]
    if os.geteuid() != 0:
        pre = ["unshare", "-r"] + pre
    if netns:
        pre = [
            shutil.which("nsenter") or "/usr/bin/nsenter",
            f"--net={netns}",
        ] + pre
    return pre + list(argv)


def run_in_guest(
    root, argv, env, workdir, stdin, timeout, user, background, netns=None
):
    """Run argv in the guest root `root` (chroot, under `unshare -r` when not
    root), in `workdir`, with exactly the environment `env`, inside the
    network namespace `netns` (a path) when one is given. A foreground
    command is killed (its whole process group) after `timeout` seconds and
    then reports exit code 124; a command killed by signal N reports 128+N.
    A background command is detached at once and its pid returned. Raises
    GuestUnavailable when the root has no busybox."""
    cmd = guest_command(root, argv, workdir, user, netns)
    if background:
        p = subprocess.Popen(
            cmd,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        return GuestRun(pid=p.pid, proc=p)
    p = subprocess.Popen(
        cmd,
        env=env,
        stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    data = stdin.encode() if stdin is not None else None
    timed_out = False
    try:
        out, err = p.communicate(data, timeout=timeout if timeout else None)
        code = p.returncode
        if code < 0:
            code = 128 - code
    except subprocess.TimeoutExpired:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except OSError:
            pass
        out, err = p.communicate()
        # 124 is what the smol cloud documents for a timed-out command;
        # the local serve's value is an assumption (not observed).
        code = 124
        timed_out = True
    return GuestRun(
        exit_code=code, stdout=out, stderr=err, timed_out=timed_out
    )


# --------------------------------------------------------------------------
# the guest's network under a restricted egress policy
# --------------------------------------------------------------------------
#
# Observed on the real 1.32.2 serve: the egress and egress-events routes, their
# refusals and the record an amendment answers (see the handlers). Documented
# (OpenAPI) but not observable without a booted guest: that the engine refuses
# a guest's outbound connect outside the allow list and records it as
# {"timestamp", "operation": "connect", "dest": "ip:port"}, and that a change
# on a running machine holds from its next connection. Assumed here: what the
# guest sees for a refused connect (this fake accepts and at once resets it),
# that a machine with no network at all counts as a restricted policy that
# records denials, and how the engine resolves an allowed host name (this
# fake knows only the names in its `guest_hosts` table, which it also writes
# into the guest's /etc/hosts). UDP (`sendto`) is not modelled.
#
# How: as root, a restricted guest gets its own network namespace (loopback
# only) and its commands run in it with nsenter. In that namespace the fake
# listens on each (address, port) of `guest_hosts` x `guest_ports`; a
# connection to one is either spliced to the same address and port on the
# host's loopback (allowed) or recorded as a denial and reset (refused). Every
# other destination fails in the guest without a record. Without root the
# guest shares the host's network, as before, and nothing is recorded.
#
# A create's egress rules (`egressRules`: their refusals, the record's echo,
# kept through an amendment, copied to a branch child as the allow list is)
# are observed except the child's copy; they are not enforced here: the
# guest's stand-in destinations are on the host's loopback, a range the
# deny rules smol-mcp sends cover.

CLONE_NEWNET = 0x40000000
LABEL = r"[A-Za-z0-9]([A-Za-z0-9-]*[A-Za-z0-9])?"
HOST_PATTERN_RE = re.compile(rf"(\*\.)?{LABEL}(\.{LABEL})*")


def egress_restricted(m):
    """Open egress is `network: true` with no allow list; anything else is
    a policy."""
    return not (
        m["network"] and "allowedHosts" not in m and "allowedCidrs" not in m
    )


def host_allowed(name, entries):
    """Whether guest host `name` matches an allow-list entry: `host` covers the
    name and its subdomains, `*.domain` its subdomains only."""
    for entry in entries:
        entry = entry.lower()
        if entry.startswith("*."):
            if name.endswith(entry[1:]) and name != entry[2:]:
                return True
        elif name == entry or name.endswith("." + entry):
            return True
    return False


class GuestNet:
    """A restricted guest's network namespace and the listeners that stand in
    for the engine's egress filter. `decide(ip, port)` says whether a
    connection is allowed (and records a denial when it is not)."""

    def __init__(self, busybox, destinations, decide):
        self.decide = decide
        self.closed = False
        self.holder = subprocess.Popen(
            [
                "unshare",
                "-n",
                busybox,
                "sh",
                "-c",
                f"{busybox} ip link set lo up && echo up && exec {busybox} "
                "sleep 2147483647",
            ],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        if self.holder.stdout.readline().strip() != b"up":
            self.holder.kill()
            self.holder.wait()
            raise OSError(
                "fake smolvm: could not make a network namespace for the guest"
            )
        self.path = f"/proc/{self.holder.pid}/ns/net"
        self.listeners = self._listen(sorted(destinations))
        self._selector = selectors.DefaultSelector()
        for sock in self.listeners:
            self._selector.register(sock, selectors.EVENT_READ)
        threading.Thread(
            target=self._accept_loop, name="fake-guest-net", daemon=True
        ).start()

    def _listen(self, destinations):
        """Listening sockets inside the namespace: made by a thread that
        moves itself into it (setns changes only the calling thread) and
        then ends."""
        made, failure = [], []

        def inside():
            libc = ctypes.CDLL(None, use_errno=True)
            fd = os.open(self.path, os.O_RDONLY)
            try:
                if libc.setns(fd, CLONE_NEWNET) != 0:
                    raise OSError(
                        ctypes.get_errno(),
                        "setns into the guest's network namespace failed",
                    )
            finally:
                os.close(fd)
            for ip, port in destinations:
                sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                sock.bind((ip, port))
                sock.listen(64)
                sock.setblocking(False)
                made.append(sock)

        def run():
            try:
                inside()
            except OSError as exc:
                failure.append(exc)

        worker = threading.Thread(target=run, name="fake-guest-netns")
        worker.start()
        worker.join()
        if failure:
            self.close()
            raise failure[0]
        return made

    def _accept_loop(self):
        while not self.closed:
            try:
                ready = self._selector.select(timeout=0.2)
            except (OSError, ValueError):
                return
            for key, _ in ready:
                try:
                    conn, _ = key.fileobj.accept()
                except OSError:
                    continue
                ip, port = conn.getsockname()[:2]
                if self.decide(ip, port):
                    threading.Thread(
                        target=self._forward,
                        args=(conn, ip, port),
                        daemon=True,
                    ).start()
                else:
                    conn.setsockopt(
                        socket.SOL_SOCKET,
                        socket.SO_LINGER,
                        struct.pack("ii", 1, 0),
                    )
                    conn.close()

    @staticmethod
    def _forward(conn, ip, port):
        """Splice an allowed connection to the same destination on the
        host's loopback."""
        conn.setblocking(True)
        try:
            upstream = socket.create_connection((ip, port), timeout=10)
        except OSError:
            conn.setsockopt(
                socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0)
            )
            conn.close()
            return
        splice(conn, upstream)

    def close(self):
        self.closed = True
        for sock in getattr(self, "listeners", []):
            try:
                sock.close()
            except OSError:
                pass
        if self.holder.poll() is None:
            self.holder.kill()
        self.holder.wait()


def splice(conn, upstream):
    """Pass bytes both ways between two connected sockets until each side
    has finished sending, then close both."""
    upstream.settimeout(None)

    def pump(src, dst):
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            try:
                dst.shutdown(socket.SHUT_WR)
            except OSError:
                pass

    back = threading.Thread(target=pump, args=(upstream, conn), daemon=True)
    back.start()
    pump(conn, upstream)
    back.join()
    conn.close()
    upstream.close()


def stream_in_guest(
    root, argv, env, workdir, stdin, timeout, user, netns=None
):
    """Run argv in the guest like run_in_guest, yielding
    ("stdout"|"stderr", text) as the command writes, then ("exit", code).
    Raises GuestUnavailable."""
    import codecs
    import queue

    p = subprocess.Popen(
        guest_command(root, argv, workdir, user, netns),
        env=env,
        stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    pieces = queue.Queue()

    def pump(pipe, event):
        decoder = codecs.getincrementaldecoder("utf-8")("replace")
        while True:
            chunk = os.read(pipe.fileno(), 65536)
            text = decoder.decode(chunk, final=not chunk)
            if text:
                pieces.put((event, text))
            if not chunk:
                break
        pieces.put((event, None))

    for pipe, event in ((p.stdout, "stdout"), (p.stderr, "stderr")):
        threading.Thread(target=pump, args=(pipe, event), daemon=True).start()
    if stdin is not None:
        try:
            p.stdin.write(stdin.encode())
            p.stdin.close()
        except OSError:
            pass
    deadline = time.monotonic() + timeout if timeout else None
    open_pipes, timed_out = 2, False
    while open_pipes:
        wait = (
            None if deadline is None else max(0.0, deadline - time.monotonic())
        )
        try:
            event, text = pieces.get(timeout=wait)
        except queue.Empty:
            timed_out = True
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except OSError:
                pass
            deadline = None
            continue
        if text is None:
            open_pipes -= 1
        else:
            yield event, text
    code = p.wait()
    yield "exit", 124 if timed_out else (128 - code if code < 0 else code)


def guest_pids(root):
    """The processes whose root directory is the guest root `root`. Linux
    /proc only; elsewhere none."""
    try:
        pids = [int(d) for d in os.listdir("/proc") if d.isdigit()]
    except OSError:
        return []
    real = os.path.realpath(root)
    found = []
    for pid in pids:
        try:
            if os.path.realpath(os.readlink(f"/proc/{pid}/root")) == real:
                found.append(pid)
        except OSError:
            pass
    return found


def signal_guest_processes(root, signum):
    """Send `signum` to every process of the guest at `root`: SIGSTOP is
    what a pause does to them (execution saved, nothing runs), SIGCONT
    what a resume does (execution goes on from where it was saved)."""
    for pid in guest_pids(root):
        try:
            os.kill(pid, signum)
        except OSError:
            pass


def kill_guest_processes(root):
    """End every process whose root directory is the guest root `root` (what
    stopping the VM does to them). Linux /proc only; elsewhere nothing."""
    killed = []
    for pid in guest_pids(root):
        try:
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)
        except OSError:
            pass
    deadline = (
        time.monotonic() + 5
    )  # gone for good (reaped), as they would be with their VM
    while killed and time.monotonic() < deadline:
        killed = [pid for pid in killed if os.path.exists(f"/proc/{pid}")]
        time.sleep(0.05)


def sse_event(event, text):
    """One SSE event; multi-line text as several data lines (the standard's
    framing)."""
    lines = text.replace("\r\n", "\n").replace("\r", "\n").split("\n")
    return (
        f"event: {event}\n"
        + "".join(f"data: {line}\n" for line in lines)
        + "\n"
    ).encode()


def copy_guest_root(src, dst):
    """Copy a guest root (for a branch): symlinks kept, device nodes
    recreated."""
    shutil.copytree(src, dst, symlinks=True, copy_function=_copy_node)


# --------------------------------------------------------------------------
# the fake serve
# --------------------------------------------------------------------------

INFO_ORDER = [
    "name",
    "image",
    "state",
    "stateReason",
    "pid",
    "cpus",
    "memoryMb",
    "mounts",
    "ports",
    "network",
    "gpu",
    "cuda",
    "networkBackend",
    "allowedCidrs",
    "egressRules",
    "allowedHosts",
    "storageGb",
    "overlayGb",
    "blockIo",
    "diskDurability",
    "cacheDisk",
    "parentMachine",
    "branchable",
    "forkable",
    "branchpointHeld",
    "forkpointHeld",
    "diskUsedMb",
    "createdAt",
]

BOOT_LINES = [
    "[    0.000000] Linux version 6.12.34 (smolvm@builder) #1 SMP "
    "PREEMPT_DYNAMIC",
    "[    0.112233] virtio_blk virtio1: [vda] 41943040 512-byte logical "
    "blocks",
    "[    0.301245] EXT4-fs (vda): mounted filesystem with ordered data mode",
    "smolvm-agent: starting",
    "smolvm-agent: ready",
]

# The routes about pools and leases: a request to one lets the pools fill.
POOL_ROUTES = (
    "pools",
    "pool",
    "pool_size",
    "leases",
    "lease",
    "lease_heartbeat",
    "lease_complete",
)
ROUTE_METHODS = {
    "health": "GET,HEAD",
    "machines": "GET,HEAD,POST",
    "machine": "GET,HEAD,DELETE",
    "start": "POST",
    "stop": "POST",
    "exec": "POST",
    "exec_stream": "POST",
    "files": "PUT,GET,HEAD",
    "logs": "GET,HEAD",
    "images": "GET,HEAD",
    "pull": "POST",
    "branches": "POST",
    "fork": "POST",
    "openapi": "GET,HEAD",
    "readyz": "GET,HEAD",
    "egress": "POST",
    "egress_events": "GET,HEAD",
    "pause": "POST",
    "resume": "POST",
    "ports": "PUT",
    "publish": "POST",
    "cache_base": "DELETE",
    "capacity": "GET,HEAD",
    "pools": "POST,GET,HEAD",
    "pool": "GET,HEAD,DELETE",
    "pool_size": "PUT",
    "leases": "POST",
    "lease": "GET,HEAD",
    "lease_heartbeat": "POST",
    "lease_complete": "POST",
}


PUBLISH_DEFAULT = "127.0.0.1"
PORT_IN_USE = (
    "cannot publish host TCP {address}:{host} to guest TCP {guest}: "
    "Address already in use (os error 98)"
)
# Observed: a start whose host port is taken.
PORT_IN_USE_AT_START = (
    "failed to start machine: agent operation failed: monitor agent: Error: "
    "agent operation failed: configure virtio-net: failed to start virtio "
    "network runtime: {taken} (boot process exited (code 1) before the "
    "agent was ready)"
)


def publish_address(value):
    """Where published ports bind for SMOLVM_PUBLISH_ADDR `value`: an IPv4
    address as given, anything else ignored (observed)."""
    try:
        return str(ipaddress.IPv4Address(value or ""))
    except ValueError:
        return PUBLISH_DEFAULT


def connect_in_netns(path, port):
    """A connection to 127.0.0.1:`port` inside the network namespace at
    `path`, made by a thread that moves itself there (see GuestNet)."""
    made = []

    def inside():
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            fd = os.open(path, os.O_RDONLY)
            try:
                if libc.setns(fd, CLONE_NEWNET) != 0:
                    return
            finally:
                os.close(fd)
            made.append(socket.create_connection(("127.0.0.1", port), 10))
        except OSError:
            pass

    worker = threading.Thread(target=inside, name="fake-publish-netns")
    worker.start()
    worker.join()
    if not made:
        raise OSError(f"nothing answers guest port {port}")
    return made[0]


class PublishedPorts:
    """The host listeners of running machines' published TCP ports, and a
    thread that forwards each connection to its guest port. `journal` gets
    ("listen"|"close", machine, address, host port, guest port)."""

    def __init__(self, address, journal, netns_of):
        self.address = address
        self.journal = journal
        # machine name -> its network namespace path, or None
        self.netns_of = netns_of
        # (machine, host, guest) -> [listening sockets]
        self.open = {}
        self._selector = selectors.DefaultSelector()
        self._closed = False
        self._thread = None

    def addresses(self):
        """The listeners one port gets (observed: the address and [::1],
        but 0.0.0.0 alone)."""
        if self.address == "0.0.0.0":
            return [(socket.AF_INET, self.address)]
        return [(socket.AF_INET, self.address), (socket.AF_INET6, "::1")]

    def bind(self, name, host, guest):
        """Listen for (`name`, `host`, `guest`); raise OSError when the
        address's port is taken (a [::1] that cannot be had is skipped)."""
        key = (name, host, guest)
        if key in self.open:
            return
        socks = []
        for family, address in self.addresses():
            sock = socket.socket(family, socket.SOCK_STREAM)
            try:
                sock.bind((address, host))
                sock.listen(64)
            except OSError:
                sock.close()
                if family == socket.AF_INET:
                    for other in socks:
                        other.close()
                    raise
                continue
            sock.setblocking(False)
            socks.append(sock)
        self.open[key] = socks
        for sock in socks:
            self._selector.register(sock, selectors.EVENT_READ, key)
        self.journal.append(("listen", name, self.address, host, guest))
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._accept_loop, name="fake-publish", daemon=True
            )
            self._thread.start()

    def close(self, key):
        for sock in self.open.pop(key, []):
            try:
                self._selector.unregister(sock)
            except (KeyError, ValueError):
                pass
            sock.close()
        name, host, guest = key
        self.journal.append(("close", name, self.address, host, guest))

    def keep_only(self, wanted):
        """Close every listener whose key is not in `wanted`."""
        for key in [k for k in self.open if k not in wanted]:
            self.close(key)

    def stop(self):
        self._closed = True
        self.keep_only(set())
        self._selector.close()

    def _accept_loop(self):
        while not self._closed:
            try:
                ready = self._selector.select(timeout=0.2)
            except (OSError, ValueError):
                return
            for selected, _ in ready:
                try:
                    conn, _ = selected.fileobj.accept()
                except OSError:
                    continue
                name, _, guest = selected.data
                threading.Thread(
                    target=self._forward,
                    args=(conn, name, guest),
                    daemon=True,
                ).start()

    def _forward(self, conn, name, guest):
        conn.setblocking(True)
        netns = self.netns_of(name)
        try:
            if netns:
                upstream = connect_in_netns(netns, guest)
            else:
                upstream = socket.create_connection(("127.0.0.1", guest), 10)
        except OSError:
            conn.close()
            return
        splice(conn, upstream)


class FakeSmolvm:
    """A fake `smolvm serve` on an AF_UNIX socket (or loopback TCP when
    `socket_path` is a (host, port) tuple).

    boot: "ok" (a start succeeds) or "fail" (a start answers the real 500
    after boot_delay seconds and leaves the machine stopped).
    registry: "ok" or "offline" (the first start of an image machine with no
    network and no allow list answers the real host-side registry 500).
    settle_secs: a never-started machine reads `stopped` after this long.
    state_file: persist machine records there as JSON, and load them on start.
    guest_hosts, guest_ports: the loopback destinations a restricted guest
    can try (name -> 127.x address, and the ports); see GuestNet.
    cache_disk_dir: the serve's --cache-disk-dir (None: cache disks are
    refused, as by a serve started without the flag); see the cache disk
    handlers.
    pool_fill_secs: how long a fork pool takes to make one clean worker
    (0: a worker is ready at the first look after it is asked for).
    publish_addr: SMOLVM_PUBLISH_ADDR (None: this process's environment),
    where published ports listen; `published` journals the listeners.
    """

    def __init__(
        self,
        socket_path,
        *,
        version="1.32.2",
        boot="ok",
        boot_delay=0.0,
        registry="ok",
        settle_secs=3.5,
        state_file=None,
        guest_hosts=None,
        guest_ports=(),
        cache_disk_dir=None,
        pool_fill_secs=0.0,
        publish_addr=None,
    ):
        if boot not in ("ok", "fail"):
            raise ValueError("boot must be 'ok' or 'fail'")
        if registry not in ("ok", "offline"):
            raise ValueError("registry must be 'ok' or 'offline'")
        self.socket_path = socket_path
        self.version = version
        self.boot = boot
        self.boot_delay = float(boot_delay)
        self.registry = registry
        self.settle_secs = float(settle_secs)
        self.state_file = state_file
        self.guest_hosts = {
            k.lower(): v for k, v in (guest_hosts or {}).items()
        }
        self.guest_ports = tuple(guest_ports)
        self.cache_disk_dir = cache_disk_dir
        self.pool_fill_secs = float(pool_fill_secs)
        self._pools = {}
        self._leases = {}
        self._boot_id = None
        self._nets = {}
        self.requests = []
        self._machines = {}
        self._roots = {}
        self._lock = threading.RLock()
        self._trace = 0
        self._server = None
        self._thread = None
        self._started_at = time.monotonic()
        self._tmp = None
        self._next_pid = 4000 + random.randint(0, 1000)
        self._openapi = None
        self._conns = set()
        if publish_addr is None:
            publish_addr = os.environ.get("SMOLVM_PUBLISH_ADDR")
        self.publish_addr = publish_address(publish_addr)
        self.published = []
        self._ports = None

    # ---- lifecycle
    def start(self):
        self._tmp = tempfile.mkdtemp(prefix="fake-smolvm-")
        self._ports = PublishedPorts(
            self.publish_addr, self.published, self._netns_path
        )
        self._load_state()
        # Machines outlive the serve, and so do their listeners.
        with self._lock:
            self._sync_published()
        if isinstance(self.socket_path, tuple):
            self._server = _TCPServer(self.socket_path, _Handler)
        else:
            path = str(self.socket_path)
            if os.path.exists(path):
                os.unlink(path)
            old = os.umask(0o177)
            try:
                self._server = _Server(path, _Handler)
            finally:
                os.umask(old)
        self._server.fake = self
        self._started_at = time.monotonic()
        # Observed form: the serve's pid and the start time in nanoseconds.
        self._boot_id = f"{os.getpid()}-{time.time_ns()}"
        self._thread = threading.Thread(
            target=self._server.serve_forever,
            name="fake-smolvm",
            kwargs={"poll_interval": 0.1},
            daemon=True,
        )
        self._thread.start()
        return self

    def stop(self):
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            with self._lock:
                conns = list(self._conns)
            for c in conns:  # drop keep-alive clients, as a dying serve would
                try:
                    c.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
            self._server = None
            if not isinstance(self.socket_path, tuple):
                try:
                    os.unlink(str(self.socket_path))
                except OSError:
                    pass
        if self._ports is not None:
            self._ports.stop()
            self._ports = None
        for net in list(self._nets.values()):
            net.close()
        self._nets.clear()
        if self._tmp:
            for root in list(self._roots.values()):
                kill_guest_processes(root)
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
        """name -> the machine's record (a dict: the MachineInfo keys, plus
        private keys starting with '_'). States are brought up to date."""
        with self._lock:
            self._tick_pools()
            for m in self._machines.values():
                self._settle(m)
            return self._machines

    def append_log(self, name, line, source="console"):
        with self._lock:
            m = self._machines[name]
            m["_workload" if source == "workload" else "_console"].append(line)
            m["_has_logs"] = True
            self._save_state()

    def guest_root(self, name):
        with self._lock:
            return self._root(name)

    # ---- persistence
    def _save_state(self):
        if not self.state_file:
            return
        tmp = f"{self.state_file}.tmp"
        with open(tmp, "w") as f:
            json.dump({"machines": self._machines}, f)
        os.replace(tmp, self.state_file)

    def _load_state(self):
        if self.state_file and os.path.exists(self.state_file):
            with open(self.state_file) as f:
                self._machines = json.load(f).get("machines", {})

    # ---- helpers
    def _trace_id(self):
        with self._lock:
            self._trace += 1
            return f"{self._trace:08x}{os.getpid() & 0xFFFFFFFF:08x}"

    def _root(self, name):
        root = self._roots.get(name)
        if root is None or not os.path.isdir(root):
            root = tempfile.mkdtemp(prefix=f"{name}-", dir=self._tmp)
            populate_guest_root(root)
            with open(os.path.join(root, "etc/hosts"), "w") as f:
                f.write("127.0.0.1 localhost\n")
                f.writelines(
                    f"{ip} {host}\n" for host, ip in self.guest_hosts.items()
                )
            self._roots[name] = root
        return root

    def _settle(self, m):
        if (
            m["state"] == "created"
            and not m["_start_attempted"]
            and time.time() - m["_created"] >= self.settle_secs
        ):
            m["state"] = "stopped"

    def _get(self, name):
        m = self._machines.get(name)
        if m is not None:
            self._settle(m)
        return m

    def _info(self, m, detail=False):
        out = {}
        if detail:
            out["diskChainDepth"] = m["_chainDepth"]
        for k in INFO_ORDER:
            if k in m:
                out[k] = m[k]
        return out

    def _new_pid(self):
        self._next_pid += 1
        return self._next_pid

    def _boot(self, m, for_route):
        """Boot a machine that is not running. Returns None or an error
        Response. for_route: 'start' or 'auto' (exec/files/pull)."""
        m["_start_attempted"] = True
        self._save_state()
        refused = None
        if m.get("image") is not None and not m["_imageFetched"]:
            refused = image_reference_refusal(m["image"])
        if refused is not None:
            # Observed at a start without network; assumed for a start
            # with it and for the auto start of exec, files and pull,
            # which boot the guest at once on the real serve (no guest
            # boots where it was observed): a reference that cannot be
            # parsed cannot be pulled from inside the guest either.
            return api_error(500, "INTERNAL_ERROR", refused)
        if (
            self.registry == "offline"
            and m.get("image")
            and not m["network"]
            and "allowedHosts" not in m
            and "allowedCidrs" not in m
            and not m["_imageFetched"]
        ):
            return api_error(
                500, "INTERNAL_ERROR", registry_offline_error(m["image"])
            )
        if self.boot_delay:
            self._lock.release()
            try:
                time.sleep(self.boot_delay)
            finally:
                self._lock.acquire()
        if m["name"] not in self._machines:
            return not_found_machine(m["name"])
        taken = self._bind_ports(m, m["ports"])
        if taken is not None:
            return api_error(
                409,
                "PORT_IN_USE",
                PORT_IN_USE_AT_START.format(taken=taken),
            )
        m["_has_logs"] = True
        m["_everStarted"] = True
        m["_console"].extend(BOOT_LINES[:3])
        if self.boot == "fail":
            m["_console"].append("smolvm: no boot progress for 30 seconds")
            m["state"] = "stopped"
            m.pop("pid", None)
            self._save_state()
            return api_error(
                500,
                "INTERNAL_ERROR",
                BOOT_FAIL_START if for_route == "start" else BOOT_FAIL_AUTO,
            )
        m["_console"].extend(BOOT_LINES[3:])
        m["_imageFetched"] = True
        m["state"] = "running"
        m["pid"] = self._new_pid()
        self._root(m["name"])
        self._save_state()
        return None

    # ---- request parsing
    def _json_body(self, headers, body, schema):
        if not _is_json_ctype(headers.get("content-type")):
            raise _HTTPError(
                Response(
                    415,
                    "Expected request with `Content-Type: application/json`",
                    TEXT_CT,
                )
            )
        try:
            return serde_parse(body, schema)
        except SerdeError as e:
            if e.category == "data":
                raise _HTTPError(
                    Response(
                        422,
                        "Failed to deserialize the JSON body into the target "
                        "type: " + e.with_path(),
                        TEXT_CT,
                    )
                )
            raise _HTTPError(
                Response(
                    400,
                    "Failed to parse the request body as JSON: "
                    + e.with_path(),
                    TEXT_CT,
                )
            )

    @staticmethod
    def _query(qs, schema):
        try:
            return parse_query(qs, schema)
        except QueryError as e:
            raise _HTTPError(
                Response(
                    400, f"Failed to deserialize query string: {e}", TEXT_CT
                )
            )

    # ---- dispatch
    def _dispatch(self, method, target, headers, body):
        path, _, qs = target.partition("?")
        parsed = None
        if body and "/files/" not in path:
            try:
                parsed = json.loads(body)
            except ValueError:
                parsed = None
        route, params = self._route(path)
        with self._lock:
            self.requests.append((method, target, parsed))
            self._tick_pools(make=route in POOL_ROUTES)
        if route is None:
            return empty_404()
        allowed = ROUTE_METHODS[route].split(",")
        if method not in allowed:
            return Response(405, headers=[("allow", ROUTE_METHODS[route])])
        handler = getattr(self, f"_h_{route}")
        try:
            return handler(method, qs, headers, body, *params)
        except _HTTPError as e:
            return e.resp
        finally:
            # Whatever the request did (a stop, a delete, a pause, a
            # resume, a branch), running machines' ports are listened on.
            with self._lock:
                self._sync_published()

    @staticmethod
    def _route(path):
        top = {
            "/health": "health",
            "/readyz": "readyz",
            "/capacity": "capacity",
            "/api-docs/openapi.json": "openapi",
            "/api/v1/machines": "machines",
            "/api/v1/pools": "pools",
        }
        if path in top:
            return top[path], ()
        if path.startswith("/api/v1/pools/"):
            return FakeSmolvm._pool_route(path[len("/api/v1/pools/") :])
        if path.startswith("/api/v1/cache-bases/"):
            base = path[len("/api/v1/cache-bases/") :]
            if not base or "/" in base:
                return None, ()
            return "cache_base", (urllib.parse.unquote(base),)
        prefix = "/api/v1/machines/"
        if not path.startswith(prefix):
            return None, ()
        rest = path[len(prefix) :]
        name_raw, _, tail = rest.partition("/")
        if not name_raw:
            return None, ()
        name = urllib.parse.unquote(name_raw)
        if tail == "" and "/" not in rest:
            return "machine", (name,)
        if tail.startswith("files/"):
            fpath = tail[len("files/") :]
            if not fpath:
                return None, ()
            return "files", (name, urllib.parse.unquote(fpath))
        simple = {
            "start": "start",
            "stop": "stop",
            "exec": "exec",
            "exec/stream": "exec_stream",
            "logs": "logs",
            "images": "images",
            "images/pull": "pull",
            "branches": "branches",
            "fork": "fork",
            "egress": "egress",
            "egress-events": "egress_events",
            "pause": "pause",
            "resume": "resume",
            "ports": "ports",
            "cache-disk/publish": "publish",
        }
        if tail in simple:
            return simple[tail], (name,)
        return None, ()

    @staticmethod
    def _pool_route(rest):
        """The route and parameters of a path under /api/v1/pools/."""
        parts = [urllib.parse.unquote(part) for part in rest.split("/")]
        if not all(parts):
            return None, ()
        if len(parts) == 1:
            return "pool", (parts[0],)
        if len(parts) == 2 and parts[1] == "size":
            return "pool_size", (parts[0],)
        if len(parts) < 2 or parts[1] != "leases":
            return None, ()
        if len(parts) == 2:
            return "leases", (parts[0],)
        if len(parts) == 3:
            return "lease", (parts[0], parts[2])
        if len(parts) == 4 and parts[3] in ("heartbeat", "complete"):
            return f"lease_{parts[3]}", (parts[0], parts[2])
        return None, ()

    # ---- handlers
    def _h_health(self, method, qs, headers, body):
        with self._lock:
            ms = [self._get(n) for n in list(self._machines)]
            running = sum(1 for m in ms if m["state"] == "running")
            return json_response(
                200,
                {
                    "status": "ok",
                    "version": self.version,
                    "machines": {"total": len(ms), "running": running},
                    "uptime_seconds": int(time.monotonic() - self._started_at),
                    "nested_virt": False,
                },
            )

    def _h_readyz(self, method, qs, headers, body):
        return Response(200)

    def _h_openapi(self, method, qs, headers, body):
        if self._openapi is None:
            with open(OPENAPI_PATH, encoding="utf-8") as f:
                self._openapi = _dumps(json.load(f)).encode()
        return Response(200, self._openapi, JSON_CT)

    def _h_machines(self, method, qs, headers, body):
        if method in ("GET", "HEAD"):
            with self._lock:
                return json_response(
                    200,
                    {
                        "machines": [
                            self._info(self._get(n))
                            for n in sorted(self._machines)
                        ]
                    },
                )
        req = self._json_body(headers, body, CREATE_REQUEST)
        return self._create(req)

    def _create(self, req):
        name = req.get("name")
        if name is None:
            name = "vm-%08x" % random.getrandbits(32)
        refusal = self._create_refusal(req, name)
        if refusal is not None:
            return refusal
        mounts = [
            {
                "tag": f"smolvm{i}",
                "source": os.path.normpath(mt["source"]),
                "target": mt["target"],
                "readonly": mt.get("readonly", False),
                "staged": mt.get("staged", False),
            }
            for i, mt in enumerate(req.get("mounts", []))
        ]
        with self._lock:
            if name in self._machines:
                return api_error(
                    409, "CONFLICT", f"machine '{name}' already exists"
                )
            m = self._new_record(req, name, mounts)
            self._machines[name] = m
            root = self._root(name)
            if "cacheDisk" in m:
                self._attach_cache(root, m["cacheDisk"])
            self._save_state()
            return json_response(200, self._info(m))

    def _new_record(self, req, name, mounts):
        """A created machine's record: the MachineInfo keys in the order
        the real serve writes them, and the fake's private keys."""
        cpus = req.get("cpus")
        mem = req.get("memoryMb")
        storage = req.get("storageGb")
        overlay = req.get("overlayGb")
        m = {"name": name}
        if req.get("image") is not None:
            m["image"] = req["image"]
        m.update(
            {
                "state": "created",
                "cpus": 4 if cpus is None else cpus,
                "memoryMb": 8192 if mem is None else mem,
                "mounts": mounts,
                "ports": published_ports(req.get("ports", [])),
                "network": req.get("network", False),
                "gpu": req.get("gpu", False),
                "cuda": req.get("cuda", False),
            }
        )
        for key in ("networkBackend", "allowedCidrs", "allowedHosts"):
            if req.get(key) is not None:
                m[key] = req[key]
        if req.get("egressRules"):
            m["egressRules"] = [echoed_rule(r) for r in req["egressRules"]]
        m.update(
            {
                "storageGb": 20 if storage is None else storage,
                "overlayGb": 10 if overlay is None else overlay,
                "blockIo": req.get("blockIo") or "sync",
                "diskDurability": req.get("diskDurability") or "full",
            }
        )
        if req.get("cacheDisk") is not None:
            spec = req["cacheDisk"]
            m["cacheDisk"] = {
                "base": spec["base"],
                "mountPath": normal_guest_path(spec["mountPath"]),
                "slot": spec.get("slot", False),
            }
        m.update(
            {
                "branchable": False,
                "forkable": False,
                "branchpointHeld": False,
                "forkpointHeld": False,
                "diskUsedMb": 0,
                "createdAt": int(time.time()),
                "_created": time.time(),
                "_start_attempted": False,
                "_everStarted": False,
                "_has_logs": False,
                "_imageFetched": False,
                "_chainDepth": 1,
                "_env": [[e["name"], e["value"]] for e in req.get("env", [])],
                "_workdir": req.get("workdir"),
                "_console": [],
                "_workload": [],
                "_images": [],
            }
        )
        return m

    def _create_refusal(self, req, name):
        """The create's 4xx (or the registry's 500), or None. Observed on
        1.32.2, pair by pair: the checks run in this order (the name is
        checked only after the image and port shape)."""
        sources = [
            k
            for k in ("registryRef", "from", "image")
            if req.get(k) is not None
        ]
        for check in (
            lambda: self._nested_refusal(req),
            lambda: self._source_refusal(req, sources),
            lambda: self._name_refusal(name),
            lambda: mount_refusal(req.get("mounts", [])),
            lambda: port_refusal(req.get("ports", [])),
            lambda: egress_rule_refusal(req.get("egressRules", [])),
            lambda: self._origin_refusal(req),
            lambda: self._cache_refusal(req.get("cacheDisk")),
            lambda: resource_refusal(req),
            lambda: network_backend_refusal(req),
            lambda: secret_refusal(req.get("secrets", {})),
            lambda: env_refusal(req.get("env", [])),
            lambda: restart_refusal(req.get("restart") or {}),
        ):
            refusal = check()
            if refusal is not None:
                return refusal
        return None

    @staticmethod
    def _nested_refusal(req):
        if req.get("nestedVirt"):
            return api_error(
                403,
                "FORBIDDEN",
                "nested virtualization is disabled on this server; start "
                "`smolvm serve` with --allow-nested-virt to enable it",
            )
        return None

    @staticmethod
    def _source_refusal(req, sources):
        """Several sources, a local image, published ports on TSI, and a
        workload command with no image: the create's first checks."""
        if len(sources) > 1:
            return api_error(
                400,
                "BAD_REQUEST",
                "'registryRef', 'from', and 'image' are mutually exclusive",
            )
        image = req.get("image")
        if image is not None and local_image_refusal(image):
            return api_error(400, "BAD_REQUEST", local_image_refusal(image))
        if req.get("ports") and req.get("networkBackend") == "tsi":
            return api_error(
                400,
                "BAD_REQUEST",
                "published ports require networkBackend 'virtio-net' (TSI "
                "is outbound-only); omit networkBackend or set it to "
                "'virtio-net'",
            )
        if (req.get("cmd") or req.get("entrypoint")) and not sources:
            return api_error(
                400,
                "BAD_REQUEST",
                "cmd/entrypoint require an image, from, or registryRef; an "
                "imageless machine has no workload to launch them in (use "
                "exec instead)",
            )
        return None

    @staticmethod
    def _name_refusal(name):
        err = validate_machine_name(name)
        if err:
            return api_error(400, "BAD_REQUEST", err)
        return None

    @staticmethod
    def _origin_refusal(req):
        """A packed `from` that is not there, and the host-side registry
        fetch of a `registryRef` (this host has no DNS)."""
        if req.get("from") is not None:
            return api_error(
                400, "BAD_REQUEST", f"sidecar file not found: {req['from']}"
            )
        if req.get("registryRef") is not None:
            return api_error(
                500,
                "INTERNAL_ERROR",
                "registry pull failed: "
                + registry_offline_error(
                    "registry.smolmachines.com/" + req["registryRef"]
                ),
            )
        return None

    def _cache_refusal(self, spec):
        """A cacheDisk the serve refuses (observed texts, in this order),
        or None."""
        if spec is None:
            return None
        if self.cache_disk_dir is None:
            return api_error(400, "BAD_REQUEST", CACHE_DISABLED)
        base = spec["base"]
        mount = spec["mountPath"]
        err = cache_base_refusal(base)
        if err is None and not mount.startswith("/"):
            err = (
                f"{_rust_debug_str(mount)}: cache mount path must be an "
                "absolute guest path"
            )
        normal = normal_guest_path(mount)
        if err is None and normal == "/":
            err = "cache disk cannot be mounted over the guest's root"
        for reserved in CACHE_RESERVED_PATHS:
            inside = normal == reserved or normal.startswith(reserved + "/")
            if err is None and inside:
                err = (
                    f"{mount}: cache disk cannot be mounted at or under "
                    f"{reserved}"
                )
        path = os.path.join(self.cache_disk_dir, base)
        if err is None and not os.path.exists(path):
            err = (
                f"{path}: cannot stat cache base (No such file or "
                "directory (os error 2))"
            )
        if err is None:
            return None
        return api_error(400, "BAD_REQUEST", err)

    def _h_machine(self, method, qs, headers, body, name):
        if method in ("GET", "HEAD"):
            with self._lock:
                m = self._get(name)
                if m is None:
                    return not_found_machine(name)
                return json_response(200, self._info(m, detail=True))
        q = self._query(qs, {"force": "bool", "cascade": "bool"})
        with self._lock:
            m = self._get(name)
            if m is None:
                return not_found_machine(name)
            children = [
                c
                for c in self._machines.values()
                if c.get("parentMachine") == name
            ]
            live = [
                c
                for c in children
                if self._get(c["name"])["state"] == "running"
            ]
            if live and not q.get("cascade"):
                # Not observed on the real serve (no branch could be made
                # there).
                return api_error(
                    409,
                    "CONFLICT",
                    f"machine '{name}' has {len(live)} branched child "
                    "machine(s) "
                    f"({', '.join(c['name'] for c in live)}); delete them "
                    "first or pass "
                    "cascade=true",
                )
            if q.get("cascade"):
                self._delete_tree(name)
            else:
                self._delete_one(name)
            self._save_state()
            return json_response(200, {"deleted": name})

    def _delete_tree(self, name):
        for c in [
            c["name"]
            for c in self._machines.values()
            if c.get("parentMachine") == name
        ]:
            self._delete_tree(c)
        self._delete_one(name)

    def _delete_one(self, name):
        self._machines.pop(name, None)
        net = self._nets.pop(name, None)
        if net is not None:
            net.close()
        root = self._roots.pop(name, None)
        if root:
            kill_guest_processes(root)
            shutil.rmtree(root, ignore_errors=True)

    def _h_start(self, method, qs, headers, body, name):
        q = self._query(
            qs,
            {
                "branchable": "bool",
                "forkable": "bool",
                "branchPoolSize": "u32",
                "forkPoolSize": "u32",
                "cudaVramLimitMib": "u64",
            },
        )
        req = {}
        if body and _is_json_ctype(headers.get("content-type")):
            try:
                req = serde_parse(body, START_REQUEST)
            except SerdeError as e:
                return api_error(
                    400,
                    "BAD_REQUEST",
                    f"invalid JSON request body: {e.inner()}",
                )
            if req is None:
                req = {}
        branchable = bool(
            q.get("branchable")
            or q.get("forkable")
            or req.get("branchable")
            or q.get("branchPoolSize")
            or q.get("forkPoolSize")
            or req.get("branchPoolSize")
        )
        with self._lock:
            m = self._get(name)
            if m is None:
                return not_found_machine(name)
            held = held_refusal(m)
            if held is not None:
                return held
            if branchable and not m["branchable"]:
                m["branchable"] = m["forkable"] = True
                self._save_state()
            if m["state"] != "running":
                err = self._boot(m, "start")
                if err is not None:
                    return err
            return json_response(200, self._info(m))

    def _h_stop(self, method, qs, headers, body, name):
        self._query(qs, {"timeout": "u64"})
        with self._lock:
            m = self._get(name)
            if m is None:
                return not_found_machine(name)
            if m["state"] == "paused":
                # Observed (a paused record): stop keeps saved execution.
                return api_error(
                    409, "CONFLICT", SAVED_EXECUTION + " or delete"
                )
            m["state"] = "stopped"
            m.pop("pid", None)
            if name in self._roots:
                kill_guest_processes(self._roots[name])
            self._save_state()
            return json_response(200, self._info(m))

    def _ensure_running(self, name, auto_start=True):
        """For exec/files/pull: returns (machine, None) or (None, Response)."""
        m = self._get(name)
        if m is None:
            return None, not_found_machine(name)
        if m["state"] != "running":
            if not auto_start:
                return None, api_error(
                    409,
                    "CONFLICT",
                    "machine is not running and autoStart is false",
                )
            held = held_refusal(m)
            if held is not None:
                return None, held
            err = self._boot(m, "auto")
            if err is not None:
                return None, err
        return m, None

    def _h_exec(self, method, qs, headers, body, name, stream=False):
        req = self._json_body(headers, body, EXEC_REQUEST)
        if not req["command"]:
            return api_error(400, "BAD_REQUEST", "command cannot be empty")
        refusal = secret_refusal(req.get("secrets", {}))
        if refusal is not None:
            return refusal
        with self._lock:
            m, err = self._ensure_running(name, req.get("autoStart", True))
            if err is not None:
                return err
            root = self._root(name)
            env = {"PATH": "/bin:/usr/bin:/sbin:/usr/sbin", "HOME": "/root"}
            env.update({k: v for k, v in m["_env"]})
            env.update({k: v for k, v in m.get("_forkEnv", [])})
            workdir = req.get("workdir") or m.get("_workdir") or "/"
            user = req.get("user") if m.get("image") else None
            netns = self._guest_netns(m)
        env.update({e["name"]: e["value"] for e in req.get("env", [])})
        if stream:
            # Per the documents (see the module docstring); background is
            # not meaningful here.
            if not os.path.exists(os.path.join(root, "usr/bin/busybox")):
                return api_error(
                    500,
                    "INTERNAL_ERROR",
                    "fake smolvm: no static busybox on this host",
                )
            events = stream_in_guest(
                root,
                req["command"],
                env,
                workdir,
                req.get("stdin"),
                req.get("timeoutSecs"),
                user,
                netns,
            )
            chunks = (
                sse_event(e, _dumps({"exitCode": v}) if e == "exit" else v)
                for e, v in events
            )
            return Response(
                200,
                ctype="text/event-stream",
                headers=[("cache-control", "no-cache")],
                stream=chunks,
            )
        return self._run_in_guest(
            root,
            req["command"],
            env,
            workdir,
            req.get("stdin"),
            req.get("timeoutSecs"),
            user,
            req.get("background", False),
            netns,
        )

    def _h_exec_stream(self, method, qs, headers, body, name):
        return self._h_exec(method, qs, headers, body, name, stream=True)

    def _guest_netns(self, m):
        """The network namespace a restricted guest's commands run in (root
        only; see GuestNet), made on first use; None for open egress."""
        if (
            os.geteuid() != 0
            or not egress_restricted(m)
            or find_busybox() is None
        ):
            return None
        name = m["name"]
        net = self._nets.get(name)
        if net is None:
            destinations = {
                (ip, port)
                for ip in self.guest_hosts.values()
                for port in self.guest_ports
            }
            net = self._nets[name] = GuestNet(
                find_busybox(),
                destinations,
                lambda ip, port: self._egress_decide(name, ip, port),
            )
        return net.path

    def _netns_path(self, name):
        """The guest's network namespace, if it has one of its own."""
        net = self._nets.get(name)
        return net.path if net is not None else None

    def _bind_ports(self, m, ports):
        """Listen on each TCP port of `ports` for running machine `m`;
        return the refusal's text for the first host port taken (nothing
        new stays open then), or None."""
        fresh = []
        for p in ports:
            if p.get("protocol") == "udp":
                continue
            key = (m["name"], p["host"], p["guest"])
            if key in self._ports.open:
                continue
            try:
                self._ports.bind(*key)
            except OSError:
                for opened in fresh:
                    self._ports.close(opened)
                return PORT_IN_USE.format(
                    address=self.publish_addr, host=p["host"], guest=p["guest"]
                )
            fresh.append(key)
        return None

    def _sync_published(self):
        """Listeners for exactly the TCP ports of running machines: new
        ones opened where they can be, the rest closed."""
        if self._ports is None:
            return
        wanted = set()
        for m in self._machines.values():
            if m["state"] != "running":
                continue
            for p in m["ports"]:
                if p.get("protocol") != "udp":
                    wanted.add((m["name"], p["host"], p["guest"]))
        self._ports.keep_only(wanted)
        for key in wanted - set(self._ports.open):
            try:
                self._ports.bind(*key)
            except OSError:
                pass

    def _egress_decide(self, name, ip, port):
        """Allow a guest connection under the machine's policy as it is now,
        or record the denial the way the engine reports it."""
        with self._lock:
            m = self._machines.get(name)
            if m is None:
                return False
            if not egress_restricted(m):
                return True
            addr = ipaddress.ip_address(ip)
            for cidr in m.get("allowedCidrs", []):
                try:
                    if addr in ipaddress.ip_network(cidr, strict=False):
                        return True
                except ValueError:
                    continue
            names = [
                host
                for host, host_ip in self.guest_hosts.items()
                if host_ip == ip
            ]
            if any(
                host_allowed(host, m.get("allowedHosts", [])) for host in names
            ):
                return True
            stamp = datetime.datetime.now(datetime.UTC).strftime(
                "%Y-%m-%dT%H:%M:%S.%fZ"
            )
            m.setdefault("_egressEvents", []).append(
                {
                    "timestamp": stamp,
                    "operation": "connect",
                    "dest": f"{ip}:{port}",
                }
            )
            self._save_state()
            return False

    def _run_in_guest(
        self,
        root,
        argv,
        env,
        workdir,
        stdin,
        timeout,
        user,
        background,
        netns=None,
    ):
        try:
            r = run_in_guest(
                root,
                argv,
                env,
                workdir,
                stdin,
                timeout,
                user,
                background,
                netns,
            )
        except GuestUnavailable as e:
            return api_error(500, "INTERNAL_ERROR", str(e))
        if background:
            # Not observed: the real answer carries the PID of the detached
            # process.
            out = f"{r.pid}\n".encode()
            return json_response(
                200,
                {
                    "exitCode": 0,
                    "stdout": _lossy(out),
                    "stderr": "",
                    "stdoutB64": base64.b64encode(out).decode(),
                    "stderrB64": "",
                },
            )
        out, err = r.stdout, r.stderr
        return json_response(
            200,
            {
                "exitCode": r.exit_code,
                "stdout": _lossy(out),
                "stderr": _lossy(err),
                "stdoutB64": base64.b64encode(out).decode(),
                "stderrB64": base64.b64encode(err).decode(),
            },
        )

    def _h_files(self, method, qs, headers, body, name, fpath):
        if method == "PUT":
            q = self._query(qs, {"mode": "str", "uid": "u32", "gid": "u32"})
            mode = None
            if q.get("mode"):
                s = q["mode"]
                if (
                    not s
                    or len(s) > 5
                    or any(c not in "01234567" for c in s)
                    or int(s, 8) > 0o7777
                ):
                    return api_error(
                        400,
                        "BAD_REQUEST",
                        "mode must be octal permission bits such as 0644, "
                        f"got '{s}'",
                    )
                mode = int(s, 8)
        gpath = "/" + fpath.lstrip("/")
        with self._lock:
            m, err = self._ensure_running(name)
            if err is not None:
                return err
            root = self._root(name)
        try:
            host = guest_resolve(root, gpath)
        except OSError as e:
            return api_error(500, "INTERNAL_ERROR", f"{gpath}: {e.strerror}")
        if method == "PUT":
            try:
                os.makedirs(os.path.dirname(host), exist_ok=True)
                fd, tmp = tempfile.mkstemp(
                    dir=os.path.dirname(host), prefix=".upload-"
                )
                with os.fdopen(fd, "wb") as f:
                    f.write(body)
                os.chmod(tmp, mode if mode is not None else 0o644)
                if "uid" in q or "gid" in q:
                    os.chown(tmp, q.get("uid", -1), q.get("gid", -1))
                os.replace(tmp, host)
            except OSError as e:
                # Not observed: the wording of a failed guest write.
                return api_error(
                    500,
                    "INTERNAL_ERROR",
                    f"failed to write {gpath}: {e.strerror}",
                )
            return json_response(200, {"path": gpath, "size": len(body)})
        if os.path.isdir(host):
            entries = []
            for de in sorted(os.scandir(host), key=lambda d: d.name):
                if de.is_symlink():
                    kind = "symlink"
                elif de.is_dir():
                    kind = "dir"
                elif de.is_file():
                    kind = "file"
                else:
                    kind = "other"
                try:
                    size = de.stat(follow_symlinks=False).st_size
                except OSError:
                    size = 0
                entries.append({"name": de.name, "kind": kind, "size": size})
            return json_response(200, {"entries": entries})
        if not os.path.exists(host):
            # Not observed on the real serve: the wording of this 404.
            return api_error(404, "NOT_FOUND", f"file not found: {gpath}")
        try:
            with open(host, "rb") as f:
                data = f.read()
        except OSError as e:
            return api_error(
                500, "INTERNAL_ERROR", f"failed to read {gpath}: {e.strerror}"
            )
        return Response(200, data, "application/octet-stream")

    def _h_logs(self, method, qs, headers, body, name):
        q = self._query(
            qs,
            {
                "tail": "usize",
                "follow": "bool",
                "source": "str",
                "format": "str",
            },
        )
        source = q.get("source") or "console"
        if source not in ("console", "workload"):
            return api_error(
                400,
                "BAD_REQUEST",
                f"unknown log source '{source}': use \"console\" or "
                '"workload"',
            )
        with self._lock:
            m = self._get(name)
            if m is None:
                return not_found_machine(name)
            if not m["_has_logs"]:
                return api_error(
                    404,
                    "NOT_FOUND",
                    f"machine '{name}' has no logs yet — it may not have been "
                    "started",
                )
            lines = list(
                m["_workload" if source == "workload" else "_console"]
            )
        if q.get("format") == "json":
            keep = []
            for ln in lines:
                try:
                    json.loads(ln)
                    keep.append(ln)
                except ValueError:
                    pass
            lines = keep
        if "tail" in q:
            lines = lines[-q["tail"] :] if q["tail"] else []
        # follow=true: the real serve keeps the stream open; the fake ends it.
        chunks = [f"data: {ln}\n\n".encode() for ln in lines]
        return Response(
            200,
            ctype="text/event-stream",
            headers=[("cache-control", "no-cache")],
            stream=chunks,
        )

    def _h_images(self, method, qs, headers, body, name):
        with self._lock:
            m = self._get(name)
            if m is None:
                return not_found_machine(name)
            return json_response(200, {"images": list(m["_images"])})

    def _h_egress_events(self, method, qs, headers, body, name):
        q = self._query(qs, {"limit": "usize"})
        with self._lock:
            m = self._get(name)
            if m is None:
                return not_found_machine(name)
            events = list(m.get("_egressEvents", []))
        limit = q.get("limit", 200)
        return json_response(
            200,
            {
                "events": events[len(events) - limit :]
                if limit < len(events)
                else events
            },
        )

    def _h_egress(self, method, qs, headers, body, name):
        """Observed on 1.32.2 (a created machine): the 404, the 422 for an
        unknown field, the 400s for no change, a bad host or pattern, a bad
        CIDR, removing a host that is not listed and emptying the list; a
        success answering the record with `network: true` and the merged
        lists. Assumed: the 409 text for a running machine, the texts for
        an unlisted CIDR and for a reset combined with removals."""
        req = self._json_body(headers, body, UPDATE_EGRESS_REQUEST)
        lists = (
            "allowHosts",
            "allowHostPatterns",
            "allowCidrs",
            "removeAllowHosts",
            "removeAllowCidrs",
            "allowUdp",
            "removeAllowUdp",
        )
        flags = ("outboundLocalhostOnly", "allowAll", "resetAllowList")
        with self._lock:
            m = self._get(name)
            if m is None:
                return not_found_machine(name)
            if not any(req.get(k) for k in lists + flags):
                return api_error(
                    400, "BAD_REQUEST", "request contains no egress changes"
                )
            for key, what in (
                ("allowHosts", "allow host"),
                ("allowHostPatterns", "allow host pattern"),
            ):
                for host in req.get(key, []):
                    if not HOST_PATTERN_RE.fullmatch(host):
                        return api_error(
                            400,
                            "BAD_REQUEST",
                            f"config operation failed: {what}: invalid host "
                            f"pattern {_rust_debug_str(host)}: use an exact "
                            "DNS hostname or "
                            "*.domain",
                        )
            for cidr in req.get("allowCidrs", []):
                try:
                    ipaddress.ip_network(cidr, strict=False)
                except ValueError:
                    return api_error(
                        400,
                        "BAD_REQUEST",
                        f"invalid CIDR '{cidr}': expected format like "
                        "10.0.0.0/8 or 1.1.1.1",
                    )
            removals = req.get("removeAllowHosts", []) + req.get(
                "removeAllowCidrs", []
            )
            if req.get("resetAllowList") and removals:
                return api_error(
                    400,
                    "BAD_REQUEST",
                    "config operation failed: update: resetAllowList cannot "
                    "be combined with "
                    "removals",
                )
            had_list = "allowedHosts" in m or "allowedCidrs" in m
            hosts = (
                []
                if req.get("resetAllowList")
                else list(m.get("allowedHosts", []))
            )
            cidrs = (
                []
                if req.get("resetAllowList")
                else list(m.get("allowedCidrs", []))
            )
            for entries, removed, what in (
                (hosts, "removeAllowHosts", "allowed hosts"),
                (cidrs, "removeAllowCidrs", "allowed CIDRs"),
            ):
                for entry in req.get(removed, []):
                    if entry not in entries:
                        return api_error(
                            400,
                            "BAD_REQUEST",
                            f"config operation failed: update: '{entry}' is "
                            "not "
                            f"in machine '{name}''s {what}",
                        )
                    entries.remove(entry)
            added_cidrs = req.get("allowCidrs", []) + (
                ["127.0.0.0/8", "::1/128"]
                if req.get("outboundLocalhostOnly")
                else []
            )
            for entries, added in (
                (
                    hosts,
                    req.get("allowHosts", [])
                    + req.get("allowHostPatterns", []),
                ),
                (cidrs, added_cidrs),
            ):
                entries.extend(
                    entry
                    for entry in dict.fromkeys(added)
                    if entry not in entries
                )
            if not hosts and not cidrs and not req.get("allowAll"):
                return api_error(
                    400,
                    "BAD_REQUEST",
                    (
                        "config operation failed: update: removing the last "
                        "allowed host or CIDR "
                        "would allow egress to every host; say so explicitly "
                        "(--net on the CLI, "
                        "allowAll on the API), or turn networking off instead"
                    ),
                )
            if m["state"] == "running" and not (had_list and (hosts or cidrs)):
                return api_error(
                    409,
                    "CONFLICT",
                    f"machine '{name}' is running: this egress change does "
                    "not "
                    "keep an allow list in force, so it needs the machine "
                    "stopped",
                )
            m["network"] = True
            for key, entries in (
                ("allowedHosts", hosts),
                ("allowedCidrs", cidrs),
            ):
                if entries:
                    m[key] = entries
                else:
                    m.pop(key, None)
            self._save_state()
            return json_response(200, self._info(m))

    def _h_pull(self, method, qs, headers, body, name):
        req = self._json_body(headers, body, PULL_REQUEST)
        with self._lock:
            m, err = self._ensure_running(name)
            if err is not None:
                return err
            # Assumed: a pull reads the reference as a start does (no
            # guest ran a pull where the serve was observed).
            refused = image_reference_refusal(req["image"])
            if refused is not None:
                return api_error(500, "INTERNAL_ERROR", refused)
            if self.registry == "offline":
                return api_error(
                    500, "INTERNAL_ERROR", registry_offline_error(req["image"])
                )
            arch = "amd64"
            if req.get("ociPlatform") and "/" in req["ociPlatform"]:
                arch = req["ociPlatform"].split("/")[1]
            info = {
                "reference": req["image"],
                "digest": "sha256:"
                + hashlib.sha256(req["image"].encode()).hexdigest(),
                "size": 3_600_000 + len(req["image"]) * 1000,
                "architecture": arch,
                "os": "linux",
                "layerCount": 1,
            }
            m["_images"] = [
                i for i in m["_images"] if i["reference"] != req["image"]
            ] + [info]
            self._save_state()
            return json_response(200, {"image": info})

    # ---- pause and resume
    def _h_pause(self, method, qs, headers, body, name):
        """Observed: the body is not read; an unknown machine is a 404
        worded unlike the other routes'; a machine that is not running is
        a 409. A real pause of a running guest could not be observed (no
        guest boots there): per the spec and the CLI help it saves RAM and
        disk, then stops at that boundary, answering the record in state
        `paused` (the engine passes through `pausing` while it saves). The
        fake stops the guest's processes (SIGSTOP) so that a resume goes on
        from where they were."""
        with self._lock:
            m = self._get(name)
            if m is None:
                return api_error(
                    404, "NOT_FOUND", f"machine not found: {name}"
                )
            if m["state"] != "running":
                return api_error(
                    409, "CONFLICT", f"machine '{name}' must be running"
                )
            m["state"] = "paused"
            m.pop("pid", None)
            signal_guest_processes(self._root(name), signal.SIGSTOP)
            self._save_state()
            return json_response(200, self._info(m))

    def _h_resume(self, method, qs, headers, body, name):
        """Observed: the 404 and the 409 of a machine that is not paused.
        A resume itself could not be observed: per the spec it answers the
        record, running again under the same name. With boot="fail" the
        fake answers the failed boot's 500 and stays paused
        (assumption)."""
        with self._lock:
            m = self._get(name)
            if m is None:
                return not_found_machine(name)
            if m["state"] != "paused":
                return api_error(
                    409,
                    "CONFLICT",
                    "machine is not paused; use start for a fresh boot",
                )
            if self.boot == "fail":
                return api_error(500, "INTERNAL_ERROR", BOOT_FAIL_START)
            m["state"] = "running"
            m["pid"] = self._new_pid()
            signal_guest_processes(self._root(name), signal.SIGCONT)
            self._save_state()
            return json_response(200, self._info(m))

    # ---- published ports
    def _h_ports(self, method, qs, headers, body, name):
        """Observed on created and stopped machines: the whole set replaces
        the old one (port 0 accepted, tcp listed first), the 404, the 400
        for a host port mapped twice, the 422s. For a running machine the
        spec says TCP changes apply at once and a UDP change is a 409; the
        409's text is the binary's string. A paused machine's ports are
        replaced too (observed). The fake forwards no port, so this is the
        record only. Observed as well: the real serve publishes each port
        on 127.0.0.1 and [::1] of the host, never on all interfaces."""
        req = self._json_body(headers, body, SET_PORTS_REQUEST)
        refusal = port_refusal(req["ports"], on_create=False)
        if refusal is not None:
            return refusal
        ports = published_ports(req["ports"])
        with self._lock:
            m = self._get(name)
            if m is None:
                return not_found_machine(name)
            udp_before = [p for p in m["ports"] if p.get("protocol")]
            udp_after = [p for p in ports if p.get("protocol")]
            if m["state"] == "running" and udp_before != udp_after:
                return api_error(
                    409,
                    "CONFLICT",
                    "published UDP ports cannot change on a running "
                    "machine; stop it first",
                )
            if m["state"] == "running":
                # [OpenAPI] a running machine serves the new set at once,
                # and a taken host port is a 409 PORT_IN_USE.
                taken = self._bind_ports(m, ports)
                if taken is not None:
                    return api_error(409, "PORT_IN_USE", taken)
            m["ports"] = ports
            self._save_state()
            return json_response(200, self._info(m))

    # ---- cache disks (see the section above write_cache_base)
    def _attach_cache(self, root, spec):
        """Give a new machine its cache directory, holding its base."""
        target = guest_resolve(root, spec["mountPath"])
        os.makedirs(target, exist_ok=True)
        base = os.path.join(self.cache_disk_dir, spec["base"])
        read_cache_base(base, target)

    def _h_publish(self, method, qs, headers, body, name):
        req = self._json_body(headers, body, PUBLISH_CACHE_DISK_REQUEST)
        if self.cache_disk_dir is None:
            return api_error(400, "BAD_REQUEST", CACHE_DISABLED)
        base = req["base"]
        err = cache_base_refusal(base)
        if err is not None:
            return api_error(400, "BAD_REQUEST", err)
        with self._lock:
            m = self._get(name)
            if m is None:
                return not_found_machine(name)
            return self._publish(m, base, req.get("uploadUrls"))

    def _publish(self, m, base, upload_urls):
        name = m["name"]
        if "cacheDisk" not in m:
            return api_error(
                400, "BAD_REQUEST", f"machine '{name}' has no cache disk"
            )
        if m["state"] == "running":
            # The binary's string; not observed (nothing ran there).
            return api_error(
                409,
                "CONFLICT",
                f"stop machine '{name}' before publishing its cache disk: "
                "a running machine is still writing it",
            )
        path = os.path.join(self.cache_disk_dir, base)
        if os.path.exists(path):
            return api_error(
                409,
                "CONFLICT",
                f"cache base '{base}' already exists; publish each version "
                "under a new name",
            )
        err = upload_url_refusal(upload_urls)
        if err is not None:
            return api_error(400, "BAD_REQUEST", err)
        old = os.path.join(self.cache_disk_dir, m["cacheDisk"]["base"])
        if not m["_everStarted"] and not is_qcow2(old):
            # Observed: a never-run machine over a raw base.
            return api_error(
                500, "INTERNAL_ERROR", f"open {old}: Not a qcow2 file"
            )
        cache = guest_resolve(self._root(name), m["cacheDisk"]["mountPath"])
        size, digest = write_cache_base(path, cache)
        return json_response(
            200, {"base": base, "sizeBytes": size, "sha256": digest}
        )

    def _h_cache_base(self, method, qs, headers, body, base):
        """Observed: 204 with no body for a base removed or never there,
        the 409 naming a machine attached to it, the name refusal."""
        if self.cache_disk_dir is None:
            return api_error(400, "BAD_REQUEST", CACHE_DISABLED)
        err = cache_base_refusal(base)
        if err is not None:
            return api_error(400, "BAD_REQUEST", err)
        with self._lock:
            for m in self._machines.values():
                if m.get("cacheDisk", {}).get("base") == base:
                    return api_error(
                        409,
                        "CONFLICT",
                        f"cache base '{base}' is attached to machine "
                        f"'{m['name']}'",
                    )
            path = os.path.join(self.cache_disk_dir, base)
            sidecar = os.path.join(self.cache_disk_dir, f".{base}.sha256")
            for gone in (path, sidecar):
                try:
                    os.unlink(gone)
                except FileNotFoundError:
                    pass
        return Response(204)

    # ---- node capacity
    def _h_capacity(self, method, qs, headers, body):
        """The observed keys, in the observed order. The fake measures no
        use (the used_* gauges read 0); allocations count its running
        machines; host memory is this host's."""
        with self._lock:
            running = [
                self._get(n)
                for n in list(self._machines)
                if self._get(n)["state"] == "running"
            ]
        total, available = host_memory_mb()
        return json_response(
            200,
            {
                "allocated_cpus": sum(m["cpus"] for m in running),
                "allocated_memory_mb": sum(m["memoryMb"] for m in running),
                "used_cpus": 0.0,
                "used_memory_mb": 0,
                "used_memory_pss_mb": 0,
                "used_memory_private_mb": 0,
                "used_memory_shared_mapped_mb": 0,
                "host_memory_total_mb": total,
                "host_memory_available_mb": available,
                "branch_reserve_mb": total // 20,
                "branch_child_overhead_mb": 64,
                "used_disk_gb": 0,
                "checkpoint_store_bytes": 0,
                "boot_id": self._boot_id,
            },
        )

    # ---- fork pools and leases
    #
    # Observed on 1.32.2: every refusal of these routes that needs no
    # running source, in its order, with its text; the pool record's keys
    # and order (`maxActive` only when set), the 503 of a lease from a pool
    # with no clean worker (also after waitSecs), an empty pool deleted at
    # once. From the spec and the binary's strings, not observed (no source
    # can run there): a pool filled by branching its running, branchable
    # source into held workers (`pool-POOL-XXXXXXXX`, branchpointHeld true
    # until leased), a lease answering {id, pool, machine, state,
    # createdAt, expiresAt}, a repeated idempotencyKey answering the same
    # lease (a different request under it is a 409), heartbeat, complete
    # replacing the worker, the 409 texts for a lease that is no longer
    # active, a pool at maxActive, a pool with active leases deleted
    # without force, a clone used as a source, a pool name taken.
    # Assumed: the lease id's form, leaseTtlSecs 600 when unset, the 409
    # for a source that is not branchable, a lease activating at once (the
    # fake runs no workload, so awaitWorkerReady has nothing to wait for),
    # pool deletion finishing at once, an expired lease's worker removed.
    def _h_pools(self, method, qs, headers, body):
        if method in ("GET", "HEAD"):
            with self._lock:
                pools = [
                    self._pool_info(self._pools[n])
                    for n in sorted(self._pools)
                ]
            return json_response(200, {"pools": pools})
        req = self._json_body(headers, body, CREATE_POOL_REQUEST)
        err = pool_create_refusal(req)
        if err is not None:
            return api_error(400, "BAD_REQUEST", err)
        with self._lock:
            refusal = self._pool_source_refusal(req)
            if refusal is not None:
                return refusal
            pool = {
                "name": req["name"],
                "source": req["source"],
                "desiredReady": req["desiredReady"],
                "freezeSource": req.get("freezeSource", False),
                "maxActive": req.get("maxActive"),
                "autoAdmission": bool(req.get("autoAdmission")),
                "shareWeights": req.get("shareWeights", False),
                "leaseTtlSecs": req.get("leaseTtlSecs") or DEFAULT_LEASE_TTL,
                "createdAt": int(time.time()),
                "_slots": [],
                "_ready": [],
            }
            self._pools[pool["name"]] = pool
            self._fill(pool, time.time())
            return json_response(200, self._pool_info(pool))

    def _pool_source_refusal(self, req):
        source = req["source"]
        src = self._get(source)
        if src is None:
            return not_found_machine(source)
        if src["state"] not in ("running", "frozen"):
            return api_error(
                409, "CONFLICT", f"golden machine '{source}' is not running"
            )
        if not src["branchable"]:
            return api_error(
                409,
                "CONFLICT",
                f"golden machine '{source}' is not branchable; start it "
                f"with `machine start --forkable --name {source}`",
            )
        if src.get("parentMachine"):
            return api_error(
                409, "CONFLICT", "a fork clone cannot be used as a pool golden"
            )
        if req["name"] in self._pools:
            return api_error(
                409, "CONFLICT", f"fork pool '{req['name']}' already exists"
            )
        return None

    def _pool_info(self, pool):
        """ForkPoolInfo, its keys in the observed order."""
        out = {
            "name": pool["name"],
            "source": pool["source"],
            "golden": pool["source"],
            "desiredReady": pool["desiredReady"],
            "freezeSource": pool["freezeSource"],
        }
        if pool["maxActive"] is not None:
            out["maxActive"] = pool["maxActive"]
        out.update(
            {
                "autoAdmission": pool["autoAdmission"],
                "shareWeights": pool["shareWeights"],
                "leaseTtlSecs": pool["leaseTtlSecs"],
                "provisioning": len(pool["_slots"]),
                "ready": len(pool["_ready"]),
                "activating": 0,
                "active": len(self._active_leases(pool["name"])),
                "retiring": 0,
                "deleting": False,
                "createdAt": pool["createdAt"],
            }
        )
        return out

    def _active_leases(self, pool_name):
        return [
            lease
            for lease in self._leases.values()
            if lease["pool"] == pool_name and lease["state"] == "active"
        ]

    def _tick_pools(self, make=True):
        """What the engine does in the background, done when the fake is
        next asked anything: expire leases past their expiry; and, asked
        about a pool (``make``), turn workers that are due into ready
        ones and top pools up to desiredReady. [assumption] The engine
        refills in the background, so a request about something else
        never waits while a worker is made: nor does the fake's."""
        now = time.time()
        for lease in self._leases.values():
            if lease["state"] == "active" and now >= lease["expiresAt"]:
                lease["state"] = "expired"
                self._delete_one(lease["machine"])
        if not make:
            return
        for pool in list(self._pools.values()):
            self._fill(pool, now)

    def _fill(self, pool, now):
        src = self._get(pool["source"])
        usable = (
            src is not None
            and src["state"] in ("running", "frozen")
            and src["branchable"]
        )
        due = [t for t in pool["_slots"] if t <= now]
        pool["_slots"] = [t for t in pool["_slots"] if t > now]
        for _ in due if usable else ():
            if pool["freezeSource"]:
                self._freeze(src)
            pool["_ready"].append(self._make_worker(pool, src))
        pool["_ready"] = [w for w in pool["_ready"] if w in self._machines]
        missing = pool["desiredReady"] - len(pool["_ready"])
        missing -= len(pool["_slots"])
        if missing > 0 and usable:
            pool["_slots"] += [now + self.pool_fill_secs] * missing
        while missing < 0 and pool["_slots"]:
            pool["_slots"].pop()
            missing += 1
        while missing < 0 and pool["_ready"]:
            self._delete_one(pool["_ready"].pop())
            missing += 1
        if due:
            self._save_state()

    def _make_worker(self, pool, src):
        """A held worker: a branch of the source, parked at its branch
        point (branchpointHeld) until a lease takes it."""
        name = f"pool-{pool['name']}-{random.getrandbits(32):08x}"
        while name in self._machines:
            name = f"pool-{pool['name']}-{random.getrandbits(32):08x}"
        c = self._make_child(src, name)
        c["branchpointHeld"] = c["forkpointHeld"] = True
        return name

    def _h_pool(self, method, qs, headers, body, pool_name):
        if method in ("GET", "HEAD"):
            with self._lock:
                pool = self._pools.get(pool_name)
                if pool is None:
                    return pool_not_found(pool_name)
                return json_response(200, self._pool_info(pool))
        q = self._query(qs, {"force": "bool"})
        with self._lock:
            pool = self._pools.get(pool_name)
            if pool is None:
                return pool_not_found(pool_name)
            active = self._active_leases(pool_name)
            if active and not q.get("force"):
                return api_error(
                    409,
                    "CONFLICT",
                    f"fork pool '{pool_name}' has active leases; complete "
                    "them or use force=true",
                )
            for lease in active:
                lease["state"] = "cancelled"
                self._delete_one(lease["machine"])
            for worker in pool["_ready"]:
                self._delete_one(worker)
            del self._pools[pool_name]
            # A deleted pool's leases go with it (assumption).
            for lease_id, lease in list(self._leases.items()):
                if lease["pool"] == pool_name:
                    del self._leases[lease_id]
            self._save_state()
            return json_response(200, {"deleted": pool_name})

    def _h_pool_size(self, method, qs, headers, body, pool_name):
        req = self._json_body(headers, body, RESIZE_POOL_REQUEST)
        if req["desiredReady"] > POOL_MAX_READY:
            return api_error(
                400,
                "BAD_REQUEST",
                f"desiredReady must be at most {POOL_MAX_READY}",
            )
        with self._lock:
            pool = self._pools.get(pool_name)
            if pool is None:
                return pool_not_found(pool_name)
            pool["desiredReady"] = req["desiredReady"]
            self._fill(pool, time.time())
            return json_response(200, self._pool_info(pool))

    def _h_leases(self, method, qs, headers, body, pool_name):
        req = self._json_body(headers, body, ACQUIRE_LEASE_REQUEST)
        err = lease_request_refusal(req)
        if err is not None:
            return api_error(400, "BAD_REQUEST", err)
        with self._lock:
            refusal, lease = self._lease_refusal(req, pool_name)
            if refusal is not None:
                return refusal
            if lease is not None:
                return json_response(200, lease_info(lease))
        deadline = time.monotonic() + (req.get("waitSecs") or 0)
        while True:
            with self._lock:
                pool = self._pools.get(pool_name)
                if pool is None:
                    return pool_not_found(pool_name)
                self._fill(pool, time.time())
                if pool["_ready"]:
                    lease = self._grant(pool, req)
                    return json_response(200, lease_info(lease))
            if time.monotonic() >= deadline:
                return api_error(
                    503,
                    "UNAVAILABLE",
                    f"fork pool '{pool_name}' has no clean worker ready",
                )
            time.sleep(0.05)

    def _lease_refusal(self, req, pool_name):
        """(refusal, None), (None, the lease already granted under this
        idempotencyKey), or (None, None) to grant a new one."""
        pool = self._pools.get(pool_name)
        if pool is None:
            return pool_not_found(pool_name), None
        ttl = req.get("ttlSecs")
        if ttl is not None and not LEASE_TTL_MIN <= ttl <= LEASE_TTL_MAX:
            return api_error(400, "BAD_REQUEST", LEASE_TTL_RANGE), None
        if req.get("rolloutAccess") is not None:
            src = self._get(pool["source"]) or {}
            if not src.get("network"):
                return api_error(
                    409,
                    "CONFLICT",
                    "rolloutAccess requires a pool golden with networking "
                    "enabled",
                ), None
            return api_error(
                400,
                "BAD_REQUEST",
                "fake smolvm: rolloutAccess is not supported",
            ), None
        key = req["idempotencyKey"]
        for lease in self._leases.values():
            if lease["pool"] == pool_name and lease["_key"] == key:
                if lease["_digest"] != lease_digest(req):
                    return api_error(
                        409,
                        "CONFLICT",
                        f"idempotency key '{key}' was reused with a "
                        "different request",
                    ), None
                return None, lease
        limit = pool["maxActive"]
        if limit is not None and len(self._active_leases(pool_name)) >= limit:
            return api_error(
                409,
                "CONFLICT",
                f"fork pool '{pool_name}' reached active lease limit",
            ), None
        return None, None

    def _grant(self, pool, req):
        """Hand the oldest ready worker to a new lease: the job's env and
        files are installed, it is no longer held, and the pool asks for a
        replacement."""
        worker = pool["_ready"].pop(0)
        m = self._machines[worker]
        m["branchpointHeld"] = m["forkpointHeld"] = False
        self._add_fork_env(m, req.get("env", []))
        root = self._root(worker)
        for f in req.get("files", []):
            host = guest_resolve(root, "/workspace/" + f["path"])
            os.makedirs(os.path.dirname(host), exist_ok=True)
            with open(host, "wb") as out:
                out.write(base64.b64decode(f["dataBase64"]))
            mode = f.get("mode")
            os.chmod(host, 0o644 if mode is None else mode)
        ttl = req.get("ttlSecs") or pool["leaseTtlSecs"]
        now = time.time()
        lease = {
            "id": f"lease-{random.getrandbits(64):016x}",
            "pool": pool["name"],
            "machine": worker,
            "state": "active",
            "createdAt": int(now),
            "expiresAt": int(now + ttl),
            "_key": req["idempotencyKey"],
            "_digest": lease_digest(req),
            "_ttl": ttl,
        }
        self._leases[lease["id"]] = lease
        self._fill(pool, now)
        self._save_state()
        return lease

    def _h_lease(self, method, qs, headers, body, pool_name, lease_id):
        with self._lock:
            lease = self._leases.get(lease_id)
            if lease is None or lease["pool"] != pool_name:
                return api_error(
                    404,
                    "NOT_FOUND",
                    f"lease '{lease_id}' not found in fork pool '{pool_name}'",
                )
            return json_response(200, lease_info(lease))

    def _h_lease_heartbeat(self, method, qs, headers, body, pool, lease_id):
        """The body is not read (observed)."""
        with self._lock:
            lease = self._leases.get(lease_id)
            if lease is None or lease["pool"] != pool:
                return lease_not_found(lease_id)
            if lease["state"] != "active":
                return api_error(
                    409,
                    "CONFLICT",
                    f"fork lease '{lease_id}' is no longer active",
                )
            lease["expiresAt"] = int(time.time() + lease["_ttl"])
            return json_response(200, lease_info(lease))

    def _h_lease_complete(self, method, qs, headers, body, pool, lease_id):
        """The body is not read (observed). The worker is removed and the
        pool asks for a new one."""
        with self._lock:
            lease = self._leases.get(lease_id)
            if lease is None or lease["pool"] != pool:
                return lease_not_found(lease_id)
            if lease["state"] != "active":
                return api_error(
                    409,
                    "CONFLICT",
                    f"fork lease '{lease_id}' is '{lease['state']}', not "
                    "active",
                )
            lease["state"] = "completed"
            self._delete_one(lease["machine"])
            if pool in self._pools:
                self._fill(self._pools[pool], time.time())
            self._save_state()
            return json_response(200, lease_info(lease))

    def _h_fork(self, method, qs, headers, body, name):
        return self._h_branches(method, qs, headers, body, name)

    def _h_branches(self, method, qs, headers, body, name):
        """Branch refusals: observed. freezeSource (the source kept as a
        paused branch base, state `frozen`, that later branches reuse)
        follows the spec and the binary's strings: no branch could be made
        where the real serve was observed."""
        req = self._json_body(headers, body, FORK_REQUEST)
        child = req["name"]
        err = validate_machine_name(child)
        if err:
            err = err.replace("machine name", "clone name")
            return api_error(
                500,
                "INTERNAL_ERROR",
                f"config operation failed: clone name: {err}",
            )
        if child == name:
            return api_error(
                409,
                "CONFLICT",
                f"clone name '{child}' is already used by the golden",
            )
        with self._lock:
            if child in self._machines:
                return api_error(
                    409, "CONFLICT", f"machine '{child}' already exists"
                )
            src = self._get(name)
            if src is None:
                return api_error(404, "NOT_FOUND", f"vm not found: {name}")
            refusal = branch_source_refusal(src)
            if refusal is not None:
                return refusal
            ports = None
            if "ports" in req:
                ports = published_ports(req["ports"])
            c = self._make_child(
                src,
                child,
                ports=ports,
                env=req.get("env", []),
                branchable=req.get("branchable", False),
            )
            if req.get("freezeSource"):
                self._freeze(src)
            self._save_state()
            return json_response(200, self._info(c))

    def _make_child(self, src, child, ports=None, env=(), branchable=False):
        """A running child of `src`: a copy of its guest, its record with
        the child's name, ports remapped to free host ports unless given,
        and `env` ("KEY=VALUE") delivered at /etc/smolvm/fork-env."""
        dst_root = tempfile.mkdtemp(prefix=f"{child}-", dir=self._tmp)
        os.rmdir(dst_root)
        shutil.copytree(
            self._root(src["name"]),
            dst_root,
            symlinks=True,
            copy_function=_copy_node,
        )
        self._roots[child] = dst_root
        if ports is None:
            ports = [dict(p, host=_free_port()) for p in src["ports"]]
        c = json.loads(json.dumps(src))
        c.update(
            {
                "name": child,
                "state": "running",
                "pid": self._new_pid(),
                "ports": ports,
                "parentMachine": src["name"],
                "branchable": branchable,
                "forkable": branchable,
                "branchpointHeld": False,
                "forkpointHeld": False,
                "createdAt": int(time.time()),
                "_created": time.time(),
                "_start_attempted": True,
                "_everStarted": True,
                "_has_logs": True,
                "_console": [],
                "_workload": [],
                "_chainDepth": src["_chainDepth"] + 1,
                "_forkEnv": list(src.get("_forkEnv", [])),
            }
        )
        self._machines[child] = c
        self._add_fork_env(c, env)
        return c

    def _add_fork_env(self, m, env):
        """Merge `env` ("KEY=VALUE" strings) into a machine's fork env: the
        file /etc/smolvm/fork-env (dotenv) and its later execs."""
        pairs = [e.split("=", 1) if "=" in e else [e, ""] for e in env]
        if not pairs:
            return
        merged = dict(m.get("_forkEnv", []))
        merged.update(dict(pairs))
        m["_forkEnv"] = [[k, v] for k, v in merged.items()]
        root = self._root(m["name"])
        os.makedirs(os.path.join(root, "etc/smolvm"), exist_ok=True)
        with open(os.path.join(root, "etc/smolvm/fork-env"), "w") as f:
            for k, v in m["_forkEnv"]:
                f.write(f"{k}={_dumps(v)}\n")

    def _freeze(self, src):
        """Keep a branch source as a frozen base: its guest stops running
        (its processes are stopped, not ended) and it has no VM pid."""
        if src["state"] == "frozen":
            return
        src["state"] = "frozen"
        src.pop("pid", None)
        signal_guest_processes(self._root(src["name"]), signal.SIGSTOP)


def branch_source_refusal(src):
    """The observed 409s of a branch from a source that is not running as
    a branch source, or None. A frozen base can be branched again."""
    name = src["name"]
    hint = f"start it with `machine start --forkable --name {name}`"
    live = src["state"] in ("running", "frozen")
    if not live and (src["branchable"] or not src["_everStarted"]):
        return api_error(
            409,
            "CONFLICT",
            f"agent operation failed: fork: golden '{name}' is not running "
            f"forkable; {hint}",
        )
    if not src["branchable"]:
        return api_error(
            409,
            "CONFLICT",
            f"agent operation failed: fork: golden '{name}' control socket "
            "not responding (agent operation failed: connect control "
            f"socket: Connection refused (os error 111)); {hint}",
        )
    return None


def _copy_node(src, dst):
    """copytree's copy function: device nodes are recreated, not read."""
    st = os.lstat(src)
    if stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode):
        try:
            os.mknod(dst, st.st_mode, st.st_rdev)
        except OSError:
            pass
        return dst
    if stat.S_ISFIFO(st.st_mode) or stat.S_ISSOCK(st.st_mode):
        return dst
    return shutil.copy2(src, dst)


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --------------------------------------------------------------------------
# the CLI (`tests/fakes/smolvm`)
# --------------------------------------------------------------------------


def _parse_listen(value):
    """Returns a socket path or a (host, port) tuple; raises ValueError for a
    non-loopback TCP address."""
    if value.startswith("unix://"):
        return value[len("unix://") :]
    if "/" in value or not value.rsplit(":", 1)[-1].isdigit():
        return value
    host, _, port = value.rpartition(":")
    host = host.strip("[]")
    if host not in ("127.0.0.1", "localhost", "::1"):
        raise ValueError(host)
    return (host, int(port))


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    version = os.environ.get("FAKE_SMOLVM_VERSION", "1.32.2")
    if argv[:1] in (["--version"], ["-V"]):
        print(f"smolvm {version}")
        return 0
    if argv[:2] == ["serve", "openapi"]:
        with open(OPENAPI_PATH, encoding="utf-8") as f:
            sys.stdout.write(
                json.dumps(json.load(f), indent=2, ensure_ascii=False) + "\n"
            )
        return 0
    if argv[:2] != ["serve", "start"]:
        print(
            "error: fake smolvm supports only --version, serve start and "
            "serve openapi (got "
            f"{argv})",
            file=sys.stderr,
        )
        return 2
    opts = {
        "--listen": None,
        "--state-dir": None,
        "--guest-rollout-port": None,
        "--cache-disk-dir": None,
    }
    rest = argv[2:]
    i = 0
    while i < len(rest):
        a = rest[i]
        key, eq, val = a.partition("=")
        if key == "-l":
            key = "--listen"
        if key in opts:
            if not eq:
                i += 1
                if i >= len(rest):
                    print(
                        f"error: a value is required for '{key} <VALUE>' but "
                        "none was supplied",
                        file=sys.stderr,
                    )
                    return 2
                val = rest[i]
            opts[key] = val
        # every other flag of the real serve is accepted and ignored
        i += 1
    port = (
        opts["--guest-rollout-port"]
        or os.environ.get("SMOLVM_GUEST_ROLLOUT_HOST_PORT")
        or "10081"
    )
    if os.environ.get("FAKE_SMOLVM_PORT_IN_USE") == "1":
        print(
            "Error: config operation failed: bind guest rollout ingress: "
            f"127.0.0.1:{port}: "
            "Address already in use (os error 98)",
            file=sys.stderr,
        )
        return 1
    listen = opts["--listen"]
    if listen is None:
        base = os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir()
        listen = os.path.join(base, "smolvm.sock")
    try:
        addr = _parse_listen(listen)
    except ValueError:
        print(
            f"Error: refusing to listen on non-loopback address {listen}: the "
            "API has no "
            "authentication; use a Unix socket or a loopback address",
            file=sys.stderr,
        )
        return 1
    state_file = os.environ.get("FAKE_SMOLVM_STATE_FILE") or None
    fake = FakeSmolvm(
        addr,
        version=version,
        boot=os.environ.get("FAKE_SMOLVM_BOOT", "ok"),
        boot_delay=float(os.environ.get("FAKE_SMOLVM_BOOT_DELAY", "0") or 0),
        registry=os.environ.get("FAKE_SMOLVM_REGISTRY", "ok"),
        settle_secs=float(
            os.environ.get("FAKE_SMOLVM_SETTLE_SECS", "3.5") or 3.5
        ),
        state_file=state_file,
        guest_hosts=dict(
            pair.split("=", 1)
            for pair in os.environ.get("FAKE_SMOLVM_GUEST_HOSTS", "").split(
                ","
            )
            if pair
        ),
        guest_ports=[
            int(p)
            for p in os.environ.get("FAKE_SMOLVM_GUEST_PORTS", "").split(",")
            if p
        ],
        cache_disk_dir=opts["--cache-disk-dir"],
        pool_fill_secs=float(
            os.environ.get("FAKE_SMOLVM_POOL_FILL_SECS", "0") or 0
        ),
    )
    stop = threading.Event()

    def on_signal(signum, frame):
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    fake.start()
    where = (
        f"unix://{addr}"
        if isinstance(addr, str)
        else f"http://{addr[0]}:{addr[1]}"
    )
    print(
        f"smolvm API server listening on {where}", file=sys.stderr, flush=True
    )
    while not stop.wait(0.2):
        pass
    print(
        "Shutting down server (VMs continue running)...",
        file=sys.stderr,
        flush=True,
    )
    fake.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
