"""A stand-in for the `smolvm serve` local machine API (smolvm 1.32.2), for tests.

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
host-side registry fetch without DNS.

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
CACHEDISKSPEC = STRUCT(
    "CacheDiskSpec",
    [
        ("base", OPT(STR), False),
        ("mountPath", STR, True),
        ("sourceUrl", OPT(STR), False),
        ("sha256", OPT(STR), False),
        ("slot", ANY, False),
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
        ("egressRules", SEQ(ANYSTRUCT("EgressRule")), False),
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

# Field order as the real serve lists them in its unknown-field refusal (observed).
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
                    "control character (\\u0000-\\u001F) found while parsing a string"
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
                                f"invalid length {idx}, expected struct {name} with "
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
                        pending = f"unknown field `{key}`, {_one_of(listed, 'field')}"
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
    "failed to start machine: agent operation failed: wait for ready: agent did not "
    "become ready within 30 seconds: no boot progress for 30 seconds"
)
BOOT_FAIL_AUTO = "agent did not become ready within 30 seconds: no boot progress for 30 seconds"

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
        return f"machine name must start with a letter or digit (got: {_dumps(name)})"
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


def registry_offline_error(image):
    return (
        "HTTP request failed: error sending request for url ("
        f"{registry_manifest_url(image)}): client error (Connect): dns error: "
        "failed to lookup address information: Name or service not known"
    )


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
        else:
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
            "root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/:/bin/false\n"
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
            "fake smolvm: no static busybox on this host (install busybox-static)"
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

CLONE_NEWNET = 0x40000000
LABEL = r"[A-Za-z0-9]([A-Za-z0-9-]*[A-Za-z0-9])?"
HOST_PATTERN_RE = re.compile(rf"(\*\.)?{LABEL}(\.{LABEL})*")


def egress_restricted(m):
    """Open egress is `network: true` with no allow list; anything else is a policy."""
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
                f"{busybox} ip link set lo up && echo up && exec {busybox} sleep 2147483647",
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
        """Listening sockets inside the namespace: made by a thread that moves
        itself into it (setns changes only the calling thread) and then ends."""
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
        """Splice an allowed connection to the same destination on the host's loopback."""
        conn.setblocking(True)
        try:
            upstream = socket.create_connection((ip, port), timeout=10)
        except OSError:
            conn.setsockopt(
                socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0)
            )
            conn.close()
            return
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

        back = threading.Thread(
            target=pump, args=(upstream, conn), daemon=True
        )
        back.start()
        pump(conn, upstream)
        back.join()
        conn.close()
        upstream.close()

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


def stream_in_guest(
    root, argv, env, workdir, stdin, timeout, user, netns=None
):
    """Run argv in the guest like run_in_guest, yielding ("stdout"|"stderr",
    text) as the command writes, then ("exit", code). Raises GuestUnavailable."""
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


def kill_guest_processes(root):
    """End every process whose root directory is the guest root `root` (what
    stopping the VM does to them). Linux /proc only; elsewhere nothing."""
    try:
        pids = [int(d) for d in os.listdir("/proc") if d.isdigit()]
    except OSError:
        return
    real = os.path.realpath(root)
    killed = []
    for pid in pids:
        try:
            if os.path.realpath(os.readlink(f"/proc/{pid}/root")) == real:
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
    """One SSE event; multi-line text as several data lines (the standard's framing)."""
    lines = text.replace("\r\n", "\n").replace("\r", "\n").split("\n")
    return (
        f"event: {event}\n"
        + "".join(f"data: {line}\n" for line in lines)
        + "\n"
    ).encode()


def copy_guest_root(src, dst):
    """Copy a guest root (for a branch): symlinks kept, device nodes recreated."""
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
    "allowedHosts",
    "storageGb",
    "overlayGb",
    "blockIo",
    "diskDurability",
    "parentMachine",
    "branchable",
    "forkable",
    "branchpointHeld",
    "forkpointHeld",
    "diskUsedMb",
    "createdAt",
]

BOOT_LINES = [
    "[    0.000000] Linux version 6.12.34 (smolvm@builder) #1 SMP PREEMPT_DYNAMIC",
    "[    0.112233] virtio_blk virtio1: [vda] 41943040 512-byte logical blocks",
    "[    0.301245] EXT4-fs (vda): mounted filesystem with ordered data mode",
    "smolvm-agent: starting",
    "smolvm-agent: ready",
]

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
}


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

    # ---- lifecycle
    def start(self):
        self._tmp = tempfile.mkdtemp(prefix="fake-smolvm-")
        self._load_state()
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
                        "Failed to deserialize the JSON body into the target type: "
                        + e.with_path(),
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
        with self._lock:
            self.requests.append((method, target, parsed))
        route, params = self._route(path)
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

    @staticmethod
    def _route(path):
        if path == "/health":
            return "health", ()
        if path == "/readyz":
            return "readyz", ()
        if path == "/api-docs/openapi.json":
            return "openapi", ()
        if path == "/api/v1/machines":
            return "machines", ()
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
        }
        if tail in simple:
            return simple[tail], (name,)
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
        err = validate_machine_name(name)
        if err:
            return api_error(400, "BAD_REQUEST", err)
        cpus = req.get("cpus")
        mem = req.get("memoryMb")
        storage = req.get("storageGb")
        overlay = req.get("overlayGb")
        pre = "config operation failed: validate resources: "
        if cpus == 0:
            return api_error(
                400, "BAD_REQUEST", pre + "CPU count must be at least 1"
            )
        if mem is not None and mem < 64:
            return api_error(
                400,
                "BAD_REQUEST",
                pre + f"memory must be at least 64 MiB (got {mem} MiB)",
            )
        if storage == 0:
            return api_error(
                400,
                "BAD_REQUEST",
                pre + "storage disk size must be greater than 0 GiB",
            )
        if overlay == 0:
            return api_error(
                400,
                "BAD_REQUEST",
                pre + "overlay disk size must be greater than 0 GiB",
            )
        if req.get("nestedVirt"):
            return api_error(
                403,
                "FORBIDDEN",
                "nested virtualization is disabled on this server; start "
                "`smolvm serve` with --allow-nested-virt to enable it",
            )
        sources = [
            k
            for k in ("registryRef", "from", "image")
            if req.get(k) is not None
        ]
        if len(sources) > 1:
            return api_error(
                400,
                "BAD_REQUEST",
                "'registryRef', 'from', and 'image' are mutually exclusive",
            )
        for ev in req.get("env", []):
            n = ev["name"]
            if not n or not all(
                c.isascii() and (c.isalnum() or c == "_") for c in n
            ):
                return api_error(
                    400,
                    "BAD_REQUEST",
                    f"env entry with {len(n.encode())}-byte name rejected: env key must "
                    "contain only ASCII alphanumeric and underscore",
                )
        for sname, ref in req.get("secrets", {}).items():
            kind = "env"
            if isinstance(ref, dict) and ref:
                k0 = next(iter(ref))
                kind = k0[5:] if k0.startswith("from_") else k0
            return api_error(
                400,
                "BAD_REQUEST",
                f"secret '{sname}': source kind '{kind}' is not allowed in scope Untrusted; "
                "secret refs may only be resolved on the trusted local host",
            )
        if (req.get("cmd") or req.get("entrypoint")) and not sources:
            return api_error(
                400,
                "BAD_REQUEST",
                "cmd/entrypoint require an image, from, or registryRef; an imageless machine "
                "has no workload to launch them in (use exec instead)",
            )
        image = req.get("image")
        if image is not None and (
            image.startswith("/")
            or image.startswith("./")
            or image.startswith("../")
        ):
            return api_error(
                400,
                "BAD_REQUEST",
                "local images are disabled on this server; start `smolvm serve` with "
                "--local-image-dir to accept archives and rootfs directories under it",
            )
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
        if req.get("cacheDisk") is not None:
            return api_error(
                400,
                "BAD_REQUEST",
                "cache disks are disabled on this server; start "
                "`smolvm serve` with --cache-disk-dir to enable them",
            )
        restart = req.get("restart") or {}
        if restart.get("policy") is not None and restart["policy"] not in (
            "never",
            "always",
            "on-failure",
            "unless-stopped",
        ):
            return api_error(
                400,
                "BAD_REQUEST",
                f"invalid restart policy: {restart['policy']}",
            )
        ports = req.get("ports", [])
        if ports and req.get("networkBackend") == "tsi":
            return api_error(
                400,
                "BAD_REQUEST",
                "published ports require networkBackend 'virtio-net' (TSI is outbound-only); "
                "omit networkBackend or set it to 'virtio-net'",
            )
        mounts = []
        for i, mt in enumerate(req.get("mounts", [])):
            src = mt["source"]
            if not src.startswith("/"):
                return api_error(
                    400,
                    "BAD_REQUEST",
                    f"mount operation failed: validate source: path must be absolute: {src}",
                )
            if not os.path.exists(src):
                return api_error(
                    400, "BAD_REQUEST", f"mount source not found: {src}"
                )
            mounts.append(
                {
                    "tag": f"smolvm{i}",
                    "source": os.path.normpath(src),
                    "target": mt["target"],
                    "readonly": mt.get("readonly", False),
                    "staged": mt.get("staged", False),
                }
            )
        out_ports = []
        for p in ports:
            e = {"host": p["host"], "guest": p["guest"]}
            if p.get("protocol") == "udp":
                e["protocol"] = "udp"
            out_ports.append(e)
        out_ports.sort(key=lambda e: 1 if e.get("protocol") == "udp" else 0)
        with self._lock:
            if name in self._machines:
                return api_error(
                    409, "CONFLICT", f"machine '{name}' already exists"
                )
            m = {"name": name}
            if image is not None:
                m["image"] = image
            m.update(
                {
                    "state": "created",
                    "cpus": 4 if cpus is None else cpus,
                    "memoryMb": 8192 if mem is None else mem,
                    "mounts": mounts,
                    "ports": out_ports,
                    "network": req.get("network", False),
                    "gpu": req.get("gpu", False),
                    "cuda": req.get("cuda", False),
                }
            )
            if req.get("networkBackend") is not None:
                m["networkBackend"] = req["networkBackend"]
            if req.get("allowedCidrs") is not None:
                m["allowedCidrs"] = req["allowedCidrs"]
            if req.get("allowedHosts") is not None:
                m["allowedHosts"] = req["allowedHosts"]
            m.update(
                {
                    "storageGb": 20 if storage is None else storage,
                    "overlayGb": 10 if overlay is None else overlay,
                    "blockIo": req.get("blockIo") or "sync",
                    "diskDurability": req.get("diskDurability") or "full",
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
                    "_env": [
                        [e["name"], e["value"]] for e in req.get("env", [])
                    ],
                    "_workdir": req.get("workdir"),
                    "_console": [],
                    "_workload": [],
                    "_images": [],
                }
            )
            self._machines[name] = m
            self._root(name)
            self._save_state()
            return json_response(200, self._info(m))

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
                # Not observed on the real serve (no branch could be made there).
                return api_error(
                    409,
                    "CONFLICT",
                    f"machine '{name}' has {len(live)} branched child machine(s) "
                    f"({', '.join(c['name'] for c in live)}); delete them first or pass "
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
            err = self._boot(m, "auto")
            if err is not None:
                return None, err
        return m, None

    def _h_exec(self, method, qs, headers, body, name, stream=False):
        req = self._json_body(headers, body, EXEC_REQUEST)
        if not req["command"]:
            return api_error(400, "BAD_REQUEST", "command cannot be empty")
        for sname, ref in req.get("secrets", {}).items():
            kind = "env"
            if isinstance(ref, dict) and ref:
                k0 = next(iter(ref))
                kind = k0[5:] if k0.startswith("from_") else k0
            return api_error(
                400,
                "BAD_REQUEST",
                f"secret '{sname}': source kind '{kind}' is not allowed in scope Untrusted; "
                "secret refs may only be resolved on the trusted local host",
            )
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
            # Per the documents (see the module docstring); background is not meaningful here.
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
            # Not observed: the real answer carries the PID of the detached process.
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
                        f"mode must be octal permission bits such as 0644, got '{s}'",
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
                f'unknown log source \'{source}\': use "console" or "workload"',
            )
        with self._lock:
            m = self._get(name)
            if m is None:
                return not_found_machine(name)
            if not m["_has_logs"]:
                return api_error(
                    404,
                    "NOT_FOUND",
                    f"machine '{name}' has no logs yet — it may not have been started",
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
                            f"pattern {_rust_debug_str(host)}: use an exact DNS hostname or "
                            "*.domain",
                        )
            for cidr in req.get("allowCidrs", []):
                try:
                    ipaddress.ip_network(cidr, strict=False)
                except ValueError:
                    return api_error(
                        400,
                        "BAD_REQUEST",
                        f"invalid CIDR '{cidr}': expected format like 10.0.0.0/8 or 1.1.1.1",
                    )
            removals = req.get("removeAllowHosts", []) + req.get(
                "removeAllowCidrs", []
            )
            if req.get("resetAllowList") and removals:
                return api_error(
                    400,
                    "BAD_REQUEST",
                    "config operation failed: update: resetAllowList cannot be combined with "
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
                            f"config operation failed: update: '{entry}' is not "
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
                        "config operation failed: update: removing the last allowed host or CIDR "
                        "would allow egress to every host; say so explicitly (--net on the CLI, "
                        "allowAll on the API), or turn networking off instead"
                    ),
                )
            if m["state"] == "running" and not (had_list and (hosts or cidrs)):
                return api_error(
                    409,
                    "CONFLICT",
                    f"machine '{name}' is running: this egress change does not "
                    "keep an allow list in force, so it needs the machine stopped",
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

    def _h_fork(self, method, qs, headers, body, name):
        return self._h_branches(method, qs, headers, body, name)

    def _h_branches(self, method, qs, headers, body, name):
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
            hint = f"start it with `machine start --forkable --name {name}`"
            if src["state"] != "running" and (
                src["branchable"] or not src["_everStarted"]
            ):
                return api_error(
                    409,
                    "CONFLICT",
                    f"agent operation failed: fork: golden '{name}' is not running forkable; "
                    f"{hint}",
                )
            if not src["branchable"]:
                return api_error(
                    409,
                    "CONFLICT",
                    f"agent operation failed: fork: golden '{name}' control socket not "
                    "responding (agent operation failed: connect control socket: Connection "
                    f"refused (os error 111)); {hint}",
                )
            src_root = self._root(name)
            dst_root = tempfile.mkdtemp(prefix=f"{child}-", dir=self._tmp)
            os.rmdir(dst_root)
            shutil.copytree(
                src_root, dst_root, symlinks=True, copy_function=_copy_node
            )
            self._roots[child] = dst_root
            fork_env = [
                e.split("=", 1) if "=" in e else [e, ""]
                for e in req.get("env", [])
            ]
            if fork_env:
                os.makedirs(
                    os.path.join(dst_root, "etc/smolvm"), exist_ok=True
                )
                with open(
                    os.path.join(dst_root, "etc/smolvm/fork-env"), "w"
                ) as f:
                    for k, v in fork_env:
                        f.write(f"{k}={_dumps(v)}\n")
            if "ports" in req:
                ports = [
                    {
                        "host": p["host"],
                        "guest": p["guest"],
                        **(
                            {"protocol": "udp"}
                            if p.get("protocol") == "udp"
                            else {}
                        ),
                    }
                    for p in req["ports"]
                ]
            else:
                ports = [dict(p, host=_free_port()) for p in src["ports"]]
            c = json.loads(json.dumps(src))
            c.update(
                {
                    "name": child,
                    "state": "running",
                    "pid": self._new_pid(),
                    "ports": ports,
                    "parentMachine": name,
                    "branchable": req.get("branchable", False),
                    "forkable": req.get("branchable", False),
                    "createdAt": int(time.time()),
                    "_created": time.time(),
                    "_start_attempted": True,
                    "_everStarted": True,
                    "_has_logs": True,
                    "_console": [],
                    "_workload": [],
                    "_chainDepth": src["_chainDepth"] + 1,
                    "_forkEnv": src.get("_forkEnv", []) + fork_env,
                }
            )
            self._machines[child] = c
            self._save_state()
            return json_response(200, self._info(c))


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
            "error: fake smolvm supports only --version, serve start and serve openapi (got "
            f"{argv})",
            file=sys.stderr,
        )
        return 2
    opts = {
        "--listen": None,
        "--state-dir": None,
        "--guest-rollout-port": None,
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
                        f"error: a value is required for '{key} <VALUE>' but none was supplied",
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
            f"Error: config operation failed: bind guest rollout ingress: 127.0.0.1:{port}: "
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
            f"Error: refusing to listen on non-loopback address {listen}: the API has no "
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
