"""A fault-injecting HTTP/1.1 reverse proxy for testing a GCS client against an emulator.

    python tests/gcs/fault_proxy.py --upstream http://127.0.0.1:PORT [--port 0]

prints the port it listens on (127.0.0.1 only) as the first line of stdout, then serves until
SIGINT/SIGTERM. In-process: ``FaultProxy(upstream).start()`` (or ``with FaultProxy(...) as p:``).

Every request is forwarded to the upstream unless a rule says otherwise. Bodies are streamed in
pieces (never buffered whole), Content-Length and chunked framing are both supported in both
directions, client connections are kept alive, ``Expect: 100-continue`` is answered by the proxy.

Control API (JSON), on the same port, never forwarded:

    GET  /__proxy/health                 {"ok": true, "upstream": ...}
    POST /__proxy/rules                  [rule, ...] or {"rules": [...], "append": false}: set the rules
    GET  /__proxy/rules                  the rules with their counters ("seen", "fired")
    POST /__proxy/reset                  clear rules, log and settings ({"keep_settings": true} keeps them)
    POST /__proxy/release                {"name": N}: let the requests a "hold": N rule holds go on
    GET  /__proxy/log[?since=ID]         {"entries": [...], "next": ID}: requests seen (oldest first)
    GET  /__proxy/settings, POST /__proxy/settings   global latency/bandwidth/auth settings

A rule (all keys optional; unknown keys are rejected with 400):

    match      "method": "PUT" | ["PUT", "POST"]     "path": regex searched in path+query as sent
               "headers": {"Content-Range": regex}  (a missing header never matches)
    occurrence "nth": 2 | [2, 4]  (the 2nd/4th matching request), or "times": 3 (the first 3),
               "skip": K (ignore the first K matches; with "times": fire on K+1..K+times).
               No occurrence key: every matching request. Each rule counts its own matches;
               the first rule (in order) that fires handles the request.
    actions    "status": 503, "message": "...", "body": {...}|"text", "response_headers": {...}
                   respond with a GCS-style JSON error {"error": {"code": 503, "message": ...}}
                   (or "body") without forwarding; with "after_forward": true the request is
                   forwarded first and the upstream response is replaced.
                   "drain": false answers without reading the request body, then closes.
                   "echo_request_headers": true appends "; you sent: {...}" with every request
                   header, credentials included, to the message (a server that echoes the request).
               "reset_after_request_bytes": N   read N bytes of the request body, then close the
                   client connection with RST. The N bytes are streamed to the upstream, which then
                   sees the request cut ("forward_partial": false: nothing is forwarded). If N is
                   at least the body length, the whole request is forwarded, its response awaited
                   (the upstream has committed it), and the client gets an RST instead.
               "stall_seconds": S   send nothing for S seconds, then "stall_then": "close" (default,
                   FIN), "reset" (RST) or "forward" (carry on: a long latency). With
                   "after_forward": true the stall starts once the upstream has answered.
               "cut_response_after": N   send the headers (full Content-Length) and N body bytes,
                   then close.
               "truncate_response_body": N   send only the first N bytes of the upstream's body,
                   framed as if that were all of it (Content-Length N, or the chunked end): the
                   client gets a complete response with a broken body (e.g. a 200 whose JSON is
                   cut after the upstream committed the request).
               "corrupt_response_byte": K | [K, ...]   flip (xor 0xFF) response body byte(s).
               "latency_ms": ms   delay before forwarding.
               "hold": "name"   hold the request (nothing forwarded, nothing answered) until the test
                   releases that name (POST /__proxy/release {"name": ...}, or release() in-process; a
                   reset releases every hold), then carry on with the request: a copy the test pauses.
               "bandwidth_bytes_per_s": B   shape this request's body and its response body.
               "require_bearer": ["tok", ...] | "issued"   answer 401 unless the request carries
                   "Authorization: Bearer <tok>" with an allowed token ("issued": any unexpired
                   token of the token/metadata servers wired in). A request that passes is not
                   handled by this rule.
               "id": "name"   shown in the log and /__proxy/rules.

Settings (POST /__proxy/settings, merged): "latency_ms", "bandwidth_bytes_per_s" (a cap shared by
all connections, each direction), "upload_bytes_per_s", "download_bytes_per_s", "require_bearer".
In-process, ``shaped_bytes()`` says how many bytes each of those caps has let through.

Log entry: id, conn, time, method, path, query, headers (selected request headers), authorization
(the scheme only, e.g. "Bearer", never the credentials), bearer_ok, request_body_bytes (received
from the client), request_complete, forwarded, upstream_status, status (sent to the client, None if
none), response_headers (selected), response_body_bytes (sent), rule, action, outcome, duration_ms;
for a forwarded request also body_ms (when its body was all forwarded) and upstream_ms (when the
upstream's response head came), both from the start of the request like duration_ms.
"""
from __future__ import annotations

import argparse
import asyncio
import copy
import ipaddress
import json
import re
import signal
import socket
import ssl
import struct
import sys
import threading
import time
import urllib.parse
import urllib.request
from typing import Any, Callable

PIECE = 64 * 1024
MAX_HEAD = 256 * 1024
MAX_LOG = 200_000
HOP_BY_HOP = {"connection", "keep-alive", "proxy-connection", "te", "trailer", "upgrade", "expect",
              "transfer-encoding", "content-length"}
LOGGED_REQUEST_HEADERS = ("content-range", "range", "x-goog-hash", "content-length", "transfer-encoding",
                          "content-type", "expect", "x-upload-content-length", "x-upload-content-type",
                          "content-encoding", "user-agent")
LOGGED_RESPONSE_HEADERS = ("range", "location", "content-range", "content-length", "x-goog-hash",
                           "transfer-encoding", "content-type")
RULE_KEYS = {"id", "method", "path", "headers", "nth", "times", "skip", "status", "message", "body",
             "response_headers", "after_forward", "drain", "reset_after_request_bytes", "forward_partial",
             "stall_seconds", "stall_then", "cut_response_after", "corrupt_response_byte", "latency_ms",
             "bandwidth_bytes_per_s", "require_bearer", "echo_request_headers", "truncate_response_body", "hold"}
SETTING_KEYS = {"latency_ms", "bandwidth_bytes_per_s", "upload_bytes_per_s", "download_bytes_per_s",
                "require_bearer"}
REASONS = {400: "badRequest", 401: "authError", 403: "forbidden", 404: "notFound", 408: "requestTimeout",
           409: "conflict", 410: "gone", 412: "conditionNotMet", 429: "rateLimitExceeded",
           500: "backendError", 502: "badGateway", 503: "backendError", 504: "gatewayTimeout"}
PHRASES = {100: "Continue", 200: "OK", 201: "Created", 204: "No Content", 206: "Partial Content",
           308: "Resume Incomplete", 400: "Bad Request", 401: "Unauthorized", 403: "Forbidden",
           404: "Not Found", 408: "Request Timeout", 409: "Conflict", 410: "Gone",
           412: "Precondition Failed", 416: "Requested Range Not Satisfiable", 429: "Too Many Requests",
           499: "Client Closed Request", 500: "Internal Server Error", 502: "Bad Gateway",
           503: "Service Unavailable", 504: "Gateway Timeout"}


def gcs_error(code: int, message: str | None = None) -> dict:
    message = message or f"{PHRASES.get(code, 'Error')} (injected by fault proxy)"
    reason = REASONS.get(code, "error")
    return {"error": {"code": code, "message": message,
                      "errors": [{"domain": "global", "reason": reason, "message": message}]}}


class ControlError(Exception):
    pass


class IncompleteBody(Exception):
    """The peer closed the connection before the whole body arrived."""


class Rule:
    def __init__(self, spec: dict, index: int):
        if not isinstance(spec, dict):
            raise ControlError(f"rule #{index} is not an object")
        unknown = set(spec) - RULE_KEYS
        if unknown:
            raise ControlError(f"rule #{index}: unknown keys {sorted(unknown)}")
        self.spec = copy.deepcopy(spec)
        self.name = str(spec.get("id", f"#{index}"))
        m = spec.get("method")
        self.methods = None if m in (None, "*") else {x.upper() for x in ([m] if isinstance(m, str) else m)}
        try:
            self.path = re.compile(spec["path"]) if spec.get("path") else None
            self.headers = {k.lower(): re.compile(v) for k, v in (spec.get("headers") or {}).items()}
        except re.error as e:
            raise ControlError(f"rule {self.name}: bad regex: {e}") from None
        nth = spec.get("nth")
        self.nth = None if nth is None else set([nth] if isinstance(nth, int) else nth)
        self.times = spec.get("times")
        self.skip = int(spec.get("skip") or 0)
        self.seen = 0
        self.fired = 0
        rb = spec.get("require_bearer")
        if rb is not None and rb != "issued" and not isinstance(rb, list):
            raise ControlError(f"rule {self.name}: require_bearer must be a list of tokens or \"issued\"")
        st = spec.get("stall_then", "close")
        if st not in ("close", "reset", "forward"):
            raise ControlError(f"rule {self.name}: stall_then must be close, reset or forward")
        c = spec.get("corrupt_response_byte")
        self.corrupt = set() if c is None else set([c] if isinstance(c, int) else c)

    def matches(self, method: str, target: str, headers: "Headers") -> bool:
        if self.methods is not None and method.upper() not in self.methods:
            return False
        if self.path is not None and not self.path.search(target):
            return False
        for k, rx in self.headers.items():
            v = headers.get(k)
            if v is None or not rx.search(v):
                return False
        return True

    def occurrence_ok(self) -> bool:
        n = self.seen
        if self.nth is not None:
            return n in self.nth
        if n <= self.skip:
            return False
        return self.times is None or n <= self.skip + int(self.times)

    def describe(self) -> dict:
        d = copy.deepcopy(self.spec)
        d.update(id=self.name, seen=self.seen, fired=self.fired)
        return d


class Headers:
    """Ordered, case-preserving header list with case-insensitive lookup."""

    def __init__(self, items: list[tuple[str, str]] | None = None):
        self.items = list(items or [])

    def get(self, name: str, default=None):
        name = name.lower()
        for k, v in self.items:
            if k.lower() == name:
                return v
        return default

    def remove(self, name: str):
        name = name.lower()
        self.items = [(k, v) for k, v in self.items if k.lower() != name]

    def set(self, name: str, value: str):
        self.remove(name)
        self.items.append((name, value))

    def encode(self) -> bytes:
        return b"".join(f"{k}: {v}\r\n".encode("latin-1") for k, v in self.items)


async def read_head(reader: asyncio.StreamReader) -> tuple[str, Headers] | None:
    """Start line + headers, or None on a clean EOF before anything arrived."""
    try:
        raw = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError as e:
        if not e.partial.strip():
            return None
        raise IncompleteBody("connection closed inside a header block") from None
    except asyncio.LimitOverrunError:
        raise ControlError("header block too large") from None
    lines = raw.decode("latin-1").split("\r\n")
    while lines and lines[0] == "":  # tolerate stray CRLF between requests
        lines.pop(0)
    start = lines[0] if lines else ""
    items = []
    for line in lines[1:]:
        if not line:
            continue
        k, sep, v = line.partition(":")
        if sep:
            items.append((k.strip(), v.strip()))
    return start, Headers(items)


class BodyReader:
    """Reads a message body piecewise: Content-Length, chunked, until EOF, or none."""

    def __init__(self, reader: asyncio.StreamReader, length: int | None, chunked: bool, until_eof=False):
        self.r, self.chunked, self.until_eof = reader, chunked, until_eof
        self.remaining = length or 0
        self.chunk_left = 0
        self.done = not chunked and not until_eof and not length
        self.total = 0

    async def read(self, n: int) -> bytes:
        if self.done or n <= 0:
            return b""
        if self.until_eof:
            d = await self.r.read(n)
            if not d:
                self.done = True
            self.total += len(d)
            return d
        if self.chunked:
            if self.chunk_left == 0:
                line = await self.r.readline()
                if not line.endswith(b"\n"):
                    raise IncompleteBody("chunk size line cut")
                try:
                    size = int(line.split(b";")[0].strip() or b"0", 16)
                except ValueError:
                    raise IncompleteBody("malformed chunk size") from None
                if size == 0:
                    while True:
                        t = await self.r.readline()
                        if t in (b"\r\n", b"\n"):
                            break
                        if not t:
                            raise IncompleteBody("trailers cut")
                    self.done = True
                    return b""
                self.chunk_left = size
            d = await self.r.read(min(n, self.chunk_left))
            if not d:
                raise IncompleteBody("chunk data cut")
            self.chunk_left -= len(d)
            if self.chunk_left == 0:
                try:
                    await self.r.readexactly(2)
                except asyncio.IncompleteReadError:
                    raise IncompleteBody("chunk terminator cut") from None
            self.total += len(d)
            return d
        d = await self.r.read(min(n, self.remaining))
        if not d:
            raise IncompleteBody(f"body cut after {self.total} bytes")
        self.remaining -= len(d)
        self.total += len(d)
        if self.remaining == 0:
            self.done = True
        return d

    async def drain(self, on_piece: Callable[[int], None] | None = None):
        while True:
            d = await self.read(PIECE)
            if not d:
                return
            if on_piece:
                on_piece(len(d))


def body_framing(headers: Headers, is_request: bool, status: int | None = None, method: str | None = None):
    """(length, chunked, until_eof) of a message body."""
    if not is_request and (method == "HEAD" or status in (204, 304) or (status is not None and status < 200)):
        return 0, False, False
    te = (headers.get("transfer-encoding") or "").lower()
    if "chunked" in te:
        return None, True, False
    cl = headers.get("content-length")
    if cl is not None:
        try:
            return int(cl), False, False
        except ValueError:
            raise ControlError(f"bad Content-Length {cl!r}") from None
    if is_request:
        return 0, False, False
    return None, False, True


class TokenBucket:
    """Byte-rate shaper; waiting callers queue up through the (possibly negative) balance."""

    def __init__(self, rate: float):
        self.rate = float(rate)
        self.burst = max(4096.0, self.rate / 50.0)
        self.tokens = self.burst
        self.last = time.monotonic()
        self.consumed = 0  # bytes shaped so far

    async def consume(self, n: int):
        self.consumed += n
        now = time.monotonic()
        self.tokens = min(self.burst, self.tokens + (now - self.last) * self.rate)
        self.last = now
        self.tokens -= n
        if self.tokens < 0:
            await asyncio.sleep(-self.tokens / self.rate)


class ProxyState:
    def __init__(self, token_validator: Callable[[str], bool] | None = None):
        self.lock = threading.Lock()
        self.rules: list[Rule] = []
        self.log: list[dict] = []
        self.next_id = 1
        self.settings: dict[str, Any] = {}
        self.buckets: dict[str, TokenBucket] = {}
        self.token_validator = token_validator
        self.holds: dict[str, threading.Event] = {}

    def hold(self, name: str) -> threading.Event:
        with self.lock:
            return self.holds.setdefault(name, threading.Event())

    def release(self, name: str | None = None):
        """Releases the holds called `name` (None: every hold), now and for later requests."""
        with self.lock:
            if name is not None:
                self.holds.setdefault(name, threading.Event())
            for n, ev in self.holds.items():
                if name is None or n == name:
                    ev.set()

    def set_rules(self, specs: list[dict], append: bool = False):
        if not isinstance(specs, list):
            raise ControlError("rules must be a list")
        with self.lock:
            base = self.rules if append else []
            new = [Rule(s, len(base) + i) for i, s in enumerate(specs)]
            self.rules = base + new

    def set_settings(self, s: dict):
        if not isinstance(s, dict):
            raise ControlError("settings must be an object")
        unknown = set(s) - SETTING_KEYS
        if unknown:
            raise ControlError(f"unknown settings {sorted(unknown)}")
        with self.lock:
            for k, v in s.items():
                if v is None:
                    self.settings.pop(k, None)
                else:
                    self.settings[k] = v
            self.buckets = {}
            up = self.settings.get("upload_bytes_per_s") or self.settings.get("bandwidth_bytes_per_s")
            down = self.settings.get("download_bytes_per_s") or self.settings.get("bandwidth_bytes_per_s")
            if up:
                self.buckets["up"] = TokenBucket(up)
            if down:
                self.buckets["down"] = TokenBucket(down)

    def reset(self, keep_settings: bool = False):
        self.release()
        with self.lock:
            self.rules = []
            self.log = []
            self.holds = {}
        if not keep_settings:
            with self.lock:
                self.settings = {}
                self.buckets = {}

    def new_entry(self, conn: int, method: str, target: str, headers: Headers) -> dict:
        u = urllib.parse.urlsplit(target)
        auth = headers.get("authorization")
        e = {"conn": conn, "time": time.time(), "method": method, "path": u.path, "query": u.query,
             "headers": {h: headers.get(h) for h in LOGGED_REQUEST_HEADERS if headers.get(h) is not None},
             "authorization": (auth.split(" ", 1)[0] if auth else None), "bearer_ok": None,
             "request_body_bytes": 0, "request_complete": None, "forwarded": False,
             "upstream_status": None, "status": None, "response_headers": {}, "response_body_bytes": 0,
             "rule": None, "action": None, "outcome": "in_progress", "duration_ms": None}
        with self.lock:
            e["id"] = self.next_id
            self.next_id += 1
            self.log.append(e)
            if len(self.log) > MAX_LOG:
                del self.log[: len(self.log) - MAX_LOG]
        return e

    def pick_rule(self, method: str, target: str, headers: Headers, bearer_ok: Callable[[Any], bool]):
        with self.lock:
            matched = [r for r in self.rules if r.matches(method, target, headers)]
            for r in matched:
                r.seen += 1
            for r in matched:
                if not r.occurrence_ok():
                    continue
                rb = r.spec.get("require_bearer")
                if rb is not None and bearer_ok(rb):
                    continue
                r.fired += 1
                return r
        return None

    def log_snapshot(self, since: int = 0) -> dict:
        with self.lock:
            entries = [dict(e) for e in self.log if e["id"] >= since]
            nxt = self.next_id
        return {"entries": entries, "next": nxt}


def _rst(writer: asyncio.StreamWriter | None):
    """Close with RST (SO_LINGER 0)."""
    if writer is None:
        return
    try:
        sock = writer.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass
    writer.transport.abort()


async def _fin_close(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, linger: float = 1.0):
    """Close with FIN: shut down our side, discard what the peer still sends (closing a socket with
    unread data would send an RST instead), then close."""
    try:
        if writer.can_write_eof():
            writer.write_eof()

        async def discard():
            while await reader.read(PIECE):
                pass

        await asyncio.wait_for(discard(), linger)
    except (asyncio.TimeoutError, ConnectionError, OSError):
        pass
    writer.close()


class _Upstream:
    def __init__(self, reader, writer):
        self.reader, self.writer = reader, writer

    def abort(self):
        try:
            self.writer.transport.abort()
        except Exception:  # noqa: BLE001
            pass


class FaultProxy:
    """The proxy. ``start()`` runs it on its own event loop thread; ``serve()`` is the coroutine."""

    def __init__(self, upstream: str, host: str = "127.0.0.1", port: int = 0,
                 token_validator: Callable[[str], bool] | None = None, tls: ssl.SSLContext | None = None):
        # tls: serve https with this server context (a TLS front like GCS's own; tls.py makes a test
        # CA and certificate); the upstream stays plain http.
        u = urllib.parse.urlsplit(upstream)
        if u.scheme != "http" or not u.hostname:
            raise ValueError(f"upstream must be http://host:port, got {upstream!r}")
        _check_loopback(host)
        self.upstream = upstream.rstrip("/")
        self.up_host, self.up_port = u.hostname, u.port or 80
        self.host, self.port = host, port
        self.tls = tls
        self.state = ProxyState(token_validator)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.AbstractServer | None = None
        self._thread: threading.Thread | None = None
        self._tasks: set[asyncio.Task] = set()
        self._conn_seq = 0
        self._ready = threading.Event()
        self._start_error: BaseException | None = None

    # ------------------------------------------------------------ lifecycle
    @property
    def url(self) -> str:
        return f"{self.scheme}://{self.host}:{self.port}"

    @property
    def scheme(self) -> str:
        return "https" if self.tls is not None else "http"

    async def start_async(self):
        self._loop = asyncio.get_running_loop()
        self._server = await asyncio.start_server(self._client, self.host, self.port, limit=MAX_HEAD,
                                                  reuse_address=True, backlog=256, ssl=self.tls)
        self.port = self._server.sockets[0].getsockname()[1]

    async def stop_async(self):
        if self._server is not None:
            self._server.close()
        for t in list(self._tasks):
            t.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._server is not None:
            try:
                await asyncio.wait_for(self._server.wait_closed(), 2)
            except (asyncio.TimeoutError, Exception):  # noqa: BLE001
                pass

    def start(self) -> "FaultProxy":
        def run():
            loop = asyncio.new_event_loop()
            asyncio.set_event_loop(loop)
            try:
                loop.run_until_complete(self.start_async())
            except BaseException as e:  # noqa: BLE001
                self._start_error = e
                self._ready.set()
                return
            self._ready.set()
            try:
                loop.run_forever()
            finally:
                loop.run_until_complete(self.stop_async())
                loop.close()

        self._thread = threading.Thread(target=run, name="fault-proxy", daemon=True)
        self._thread.start()
        self._ready.wait(10)
        if self._start_error is not None:
            raise RuntimeError(f"fault proxy failed to start: {self._start_error}")
        return self

    def stop(self):
        if self._thread is not None and self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
            self._thread = None

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()

    # ------------------------------------------------------------ in-process control (thread-safe)
    def set_rules(self, rules: list[dict], append: bool = False):
        self.state.set_rules(rules, append)

    def add_rule(self, **rule):
        self.state.set_rules([rule], append=True)

    def reset(self, keep_settings: bool = False):
        self.state.reset(keep_settings)

    def settings(self, **kw) -> dict:
        if kw:
            self.state.set_settings(kw)
        with self.state.lock:
            return dict(self.state.settings)

    def log(self, since: int = 0) -> list[dict]:
        return self.state.log_snapshot(since)["entries"]

    def release(self, name: str):
        """Lets the requests held by "hold": name rules go on (and later ones pass)."""
        self.state.release(name)

    def rules(self) -> list[dict]:
        with self.state.lock:
            return [r.describe() for r in self.state.rules]

    def shaped_bytes(self) -> dict[str, int]:
        """Bytes each global bandwidth cap ("up", "down") has let through since the settings set it."""
        with self.state.lock:
            return {k: b.consumed for k, b in self.state.buckets.items()}

    # ------------------------------------------------------------ connection handling
    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        task = asyncio.current_task()
        self._tasks.add(task)
        self._conn_seq += 1
        conn = self._conn_seq
        up: list[_Upstream | None] = [None]
        try:
            while True:
                try:
                    head = await read_head(reader)
                except (IncompleteBody, ControlError, ConnectionError):
                    break
                if head is None:
                    break
                start, headers = head
                parts = start.split()
                if len(parts) != 3 or not parts[2].startswith("HTTP/"):
                    await self._send_simple(writer, 400, {"error": {"code": 400, "message": "bad request line"}},
                                            close=True)
                    break
                method, target, version = parts
                if target.startswith("http://") or target.startswith("https://"):
                    u = urllib.parse.urlsplit(target)
                    target = u.path + ("?" + u.query if u.query else "")
                conn_hdr = (headers.get("connection") or "").lower()
                client_close = "close" in conn_hdr or (version == "HTTP/1.0" and "keep-alive" not in conn_hdr)
                if target.startswith("/__proxy/"):
                    keep = await self._control(reader, writer, method, target, headers)
                    if not keep or client_close:
                        break
                    continue
                keep = await self._proxy_one(conn, reader, writer, method, target, version, headers, up)
                if not keep or client_close:
                    break
        except asyncio.CancelledError:
            pass
        except (ConnectionError, OSError):
            pass
        except Exception:  # noqa: BLE001 - a bug here must not kill the server; show it and drop the connection
            import traceback
            traceback.print_exc()
            _rst(writer)
        finally:
            if up[0] is not None:
                up[0].abort()
            try:
                if not writer.transport.is_closing():
                    writer.close()
            except Exception:  # noqa: BLE001
                pass
            self._tasks.discard(task)

    async def _send_simple(self, writer, status: int, body, close=False, extra: dict | None = None,
                           content_type="application/json; charset=UTF-8") -> int:
        if isinstance(body, (dict, list)):
            data = json.dumps(body).encode()
        elif isinstance(body, str):
            data = body.encode()
            if content_type.startswith("application/json"):
                content_type = "text/plain; charset=utf-8"
        else:
            data = body or b""
        h = Headers([("Content-Type", content_type), ("Content-Length", str(len(data)))])
        for k, v in (extra or {}).items():
            h.set(k, str(v))
        if close:
            h.set("Connection", "close")
        writer.write(f"HTTP/1.1 {status} {PHRASES.get(status, 'Status')}\r\n".encode() + h.encode() + b"\r\n"
                     + data)
        await writer.drain()
        return len(data)

    # ------------------------------------------------------------ control API
    async def _control(self, reader, writer, method, target, headers) -> bool:
        length, chunked, _ = body_framing(headers, True)
        if (headers.get("expect") or "").lower() == "100-continue":
            writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        br = BodyReader(reader, length, chunked)
        parts = []
        while True:
            d = await br.read(PIECE)
            if not d:
                break
            parts.append(d)
        raw = b"".join(parts)
        u = urllib.parse.urlsplit(target)
        q = urllib.parse.parse_qs(u.query)
        path = u.path.rstrip("/")
        try:
            payload = json.loads(raw) if raw.strip() else None
        except ValueError:
            await self._send_simple(writer, 400, {"error": {"code": 400, "message": "body is not JSON"}})
            return True
        st = self.state
        try:
            if path == "/__proxy/health":
                out = {"ok": True, "upstream": self.upstream}
            elif path == "/__proxy/rules" and method == "POST":
                if isinstance(payload, dict):
                    st.set_rules(payload.get("rules", []), bool(payload.get("append")))
                else:
                    st.set_rules(payload if payload is not None else [])
                out = {"ok": True, "rules": self.rules()}
            elif path == "/__proxy/rules" and method == "GET":
                out = {"rules": self.rules()}
            elif path == "/__proxy/reset" and method == "POST":
                st.reset(bool((payload or {}).get("keep_settings")) if isinstance(payload, dict) else False)
                out = {"ok": True}
            elif path == "/__proxy/release" and method == "POST":
                if not isinstance(payload, dict) or not isinstance(payload.get("name"), str):
                    raise ControlError('release needs {"name": "..."}')
                st.release(payload["name"])
                out = {"ok": True}
            elif path == "/__proxy/log" and method == "GET":
                out = st.log_snapshot(int((q.get("since") or ["0"])[0]))
            elif path == "/__proxy/settings" and method == "POST":
                out = {"ok": True, "settings": self.settings(**(payload or {}))}
            elif path == "/__proxy/settings" and method == "GET":
                out = {"settings": self.settings()}
            else:
                await self._send_simple(writer, 404, {"error": {"code": 404, "message": f"no control endpoint "
                                                                                        f"{method} {path}"}})
                return True
        except (ControlError, ValueError, TypeError) as e:
            await self._send_simple(writer, 400, {"error": {"code": 400, "message": str(e)}})
            return True
        await self._send_simple(writer, 200, out)
        return True

    # ------------------------------------------------------------ proxying
    def _bearer_ok(self, headers: Headers, allowed) -> bool:
        auth = headers.get("authorization") or ""
        scheme, _, tok = auth.partition(" ")
        tok = tok.strip()
        if scheme.lower() != "bearer" or not tok:
            return False
        if allowed == "issued":
            v = self.state.token_validator
            return bool(v and v(tok))
        return tok in set(allowed)

    async def _connect_upstream(self) -> _Upstream:
        r, w = await asyncio.wait_for(asyncio.open_connection(self.up_host, self.up_port, limit=MAX_HEAD), 10)
        return _Upstream(r, w)

    async def _proxy_one(self, conn, reader, writer, method, target, version, headers: Headers, up) -> bool:
        """Handle one proxied request. Returns whether the client connection stays open."""
        st = self.state
        t0 = time.monotonic()
        entry = st.new_entry(conn, method, target, headers)
        with st.lock:
            settings = dict(st.settings)
            up_bucket, down_bucket = st.buckets.get("up"), st.buckets.get("down")

        def finish(outcome: str):
            entry["outcome"] = outcome
            entry["duration_ms"] = round((time.monotonic() - t0) * 1000, 3)

        try:
            length, chunked, _ = body_framing(headers, True)
        except ControlError as e:
            entry["status"] = 400
            await self._send_simple(writer, 400, gcs_error(400, str(e)), close=True)
            finish("bad_request")
            return False
        body = BodyReader(reader, length, chunked)
        expect = (headers.get("expect") or "").lower() == "100-continue"
        sent_continue = False

        async def send_continue():
            nonlocal sent_continue
            if expect and not sent_continue and not body.done:
                sent_continue = True
                writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
                await writer.drain()

        def count_up(n):
            entry["request_body_bytes"] += n

        # global auth
        g_bearer = settings.get("require_bearer")
        if g_bearer is not None or headers.get("authorization"):
            entry["bearer_ok"] = self._bearer_ok(headers, g_bearer) if g_bearer is not None else None
        if g_bearer is not None and not entry["bearer_ok"]:
            entry["action"] = "require_bearer(global)"
            return await self._answer(writer, body, expect, entry, finish, 401, "Invalid Credentials", None,
                                      {"WWW-Authenticate": 'Bearer realm="https://accounts.google.com/"'},
                                      drain=True, count_up=count_up)

        def rule_bearer_ok(allowed) -> bool:
            ok = self._bearer_ok(headers, allowed)
            if ok:
                entry["bearer_ok"] = True
            return ok

        rule = st.pick_rule(method, target, headers, rule_bearer_ok)
        spec = rule.spec if rule else {}
        entry["rule"] = rule.name if rule else None

        latency = float(settings.get("latency_ms") or 0) + float(spec.get("latency_ms") or 0)
        if latency > 0:
            await asyncio.sleep(latency / 1000.0)
        rule_bucket = TokenBucket(spec["bandwidth_bytes_per_s"]) if spec.get("bandwidth_bytes_per_s") else None

        async def shape(n, direction_bucket):
            if rule_bucket is not None:
                await rule_bucket.consume(n)
            if direction_bucket is not None:
                await direction_bucket.consume(n)

        after_forward = bool(spec.get("after_forward"))

        if "require_bearer" in spec:  # the rule fired: the bearer check failed
            entry["bearer_ok"] = False
            entry["action"] = "require_bearer"
            return await self._answer(writer, body, expect, entry, finish, spec.get("status", 401),
                                      spec.get("message") or "Invalid Credentials", spec.get("body"),
                                      {"WWW-Authenticate": 'Bearer realm="https://accounts.google.com/"',
                                       **(spec.get("response_headers") or {})},
                                      drain=spec.get("drain", True), count_up=count_up)

        # hold until the test releases it
        if spec.get("hold") is not None:
            entry["action"] = "hold"
            released = self.state.hold(str(spec["hold"]))
            while not released.is_set():
                await asyncio.sleep(0.01)

        # stall before forwarding
        if spec.get("stall_seconds") is not None and not after_forward:
            entry["action"] = "stall"
            await asyncio.sleep(float(spec["stall_seconds"]))
            then = spec.get("stall_then", "close")
            if then == "close":
                finish("stalled_then_closed")
                await _fin_close(reader, writer)
                return False
            if then == "reset":
                _rst(writer)
                finish("stalled_then_reset")
                return False

        reset_n = spec.get("reset_after_request_bytes")
        forward_partial = spec.get("forward_partial", True)

        # respond without forwarding
        if "status" in spec and not after_forward and reset_n is None:
            entry["action"] = "status"
            message = spec.get("message")
            if spec.get("echo_request_headers"):
                code = int(spec["status"])
                message = (f"{message or PHRASES.get(code, 'Error')}; you sent: "
                           f"{dict((k, v) for k, v in headers.items)!r}")
            return await self._answer(writer, body, expect, entry, finish, int(spec["status"]), message,
                                      spec.get("body"), spec.get("response_headers"),
                                      drain=spec.get("drain", True), count_up=count_up)

        # reset without forwarding anything
        if reset_n is not None and not forward_partial:
            entry["action"] = "reset"
            await send_continue()
            try:
                while entry["request_body_bytes"] < reset_n:
                    d = await body.read(min(PIECE, reset_n - entry["request_body_bytes"]))
                    if not d:
                        break
                    count_up(len(d))
                    await shape(len(d), up_bucket)
            except IncompleteBody:
                finish("client_disconnected")
                return False
            entry["request_complete"] = body.done
            _rst(writer)
            finish("reset")
            return False

        # ---- forward
        if up[0] is not None and (up[0].reader.at_eof() or up[0].writer.transport.is_closing()):
            up[0].abort()  # the upstream closed the idle connection
            up[0] = None
        if up[0] is None:
            try:
                up[0] = await self._connect_upstream()
            except (OSError, asyncio.TimeoutError) as e:
                entry["action"] = "upstream_unreachable"
                return await self._answer(writer, body, expect, entry, finish, 502,
                                          f"fault proxy: upstream {self.upstream} unreachable: {e}", None, None,
                                          drain=True, count_up=count_up)
        u = up[0]
        fh = Headers([(k, v) for k, v in headers.items if k.lower() not in HOP_BY_HOP])
        if chunked:
            fh.set("Transfer-Encoding", "chunked")
        elif length:
            fh.set("Content-Length", str(length))
        elif method in ("POST", "PUT", "PATCH"):
            fh.set("Content-Length", "0")
        entry["forwarded"] = True
        try:
            u.writer.write(f"{method} {target} HTTP/1.1\r\n".encode("latin-1") + fh.encode() + b"\r\n")
            await send_continue()
            piece = PIECE
            for b in (rule_bucket, up_bucket):
                if b is not None:
                    piece = min(piece, max(1024, int(b.rate // 50)))
            cut_request = False
            while True:
                want = piece
                if reset_n is not None:
                    want = min(want, reset_n - entry["request_body_bytes"])
                    if want <= 0:
                        if not body.done:
                            cut_request = True
                            break
                        want = piece
                try:
                    d = await body.read(want)
                except IncompleteBody:
                    entry["request_complete"] = False
                    u.abort()
                    up[0] = None
                    finish("client_disconnected")
                    return False
                if not d:
                    break
                count_up(len(d))
                await shape(len(d), up_bucket)
                u.writer.write((b"%x\r\n" % len(d)) + d + b"\r\n" if chunked else d)
                await u.writer.drain()
            entry["request_complete"] = body.done
            entry["body_ms"] = round((time.monotonic() - t0) * 1000, 3)
            if cut_request:
                entry["action"] = "reset"
                u.abort()  # FIN: the upstream reads the partial body, then EOF
                up[0] = None
                _rst(writer)
                finish("reset")
                return False
            if chunked:
                u.writer.write(b"0\r\n\r\n")
            await u.writer.drain()
            # ---- upstream response head
            while True:
                rh = await read_head(u.reader)
                if rh is None:
                    raise IncompleteBody("upstream closed before responding")
                status_line, rhead = rh
                sp = status_line.split(None, 2)
                ustatus = int(sp[1])
                if ustatus >= 200 or ustatus == 101:
                    break
            entry["upstream_ms"] = round((time.monotonic() - t0) * 1000, 3)
            upstream_keep = not ("close" in (rhead.get("connection") or "").lower() or sp[0] == "HTTP/1.0")
        except (IncompleteBody, ConnectionError, OSError, ValueError, IndexError) as e:
            if up[0] is not None:
                up[0].abort()
                up[0] = None
            if entry["request_complete"] is None:
                entry["request_complete"] = body.done
            if not body.done:
                _rst(writer)
                finish(f"upstream_error: {e}")
                return False
            entry["action"] = entry["action"] or "upstream_error"
            entry["status"] = 502
            await self._send_simple(writer, 502, gcs_error(502, f"fault proxy: upstream failed: {e}"), close=True)
            finish(f"upstream_error: {e}")
            return False
        entry["upstream_status"] = ustatus
        entry["response_headers"] = {h: rhead.get(h) for h in LOGGED_RESPONSE_HEADERS if rhead.get(h) is not None}
        rlen, rchunked, reof = body_framing(rhead, False, ustatus, method)
        rbody = BodyReader(u.reader, rlen, rchunked, reof)

        async def discard_upstream_body():
            try:
                await rbody.drain()
            except (IncompleteBody, ConnectionError, OSError):
                u.abort()
                up[0] = None
                return
            if not upstream_keep or reof:
                u.abort()
                up[0] = None

        # ---- after-forward actions
        if after_forward and reset_n is not None:
            entry["action"] = "reset"
            await discard_upstream_body()
            _rst(writer)
            finish("reset_after_forward")
            return False
        if reset_n is not None:  # N >= body length: forwarded whole, upstream answered; reset anyway
            entry["action"] = "reset"
            await discard_upstream_body()
            _rst(writer)
            finish("reset_after_forward")
            return False
        if after_forward and spec.get("stall_seconds") is not None:
            entry["action"] = "stall_after_forward"
            await asyncio.sleep(float(spec["stall_seconds"]))
            then = spec.get("stall_then", "close")
            if then in ("close", "reset"):
                u.abort()
                up[0] = None
                if then == "reset":
                    _rst(writer)
                finish("stalled_then_" + then)
                return False
        if after_forward and "status" in spec:
            entry["action"] = "status_after_forward"
            await discard_upstream_body()
            st_code = int(spec["status"])
            payload = spec.get("body") if spec.get("body") is not None else gcs_error(st_code, spec.get("message"))
            entry["status"] = st_code
            entry["response_body_bytes"] = await self._send_simple(writer, st_code, payload,
                                                                   extra=spec.get("response_headers"))
            finish("ok")
            return True

        # ---- relay the response
        out = Headers([(k, v) for k, v in rhead.items if k.lower() not in HOP_BY_HOP])
        loc = out.get("location")
        client_host = headers.get("host") or f"{self.host}:{self.port}"
        if loc and loc.startswith(self.upstream):
            out.set("Location", f"{self.scheme}://{client_host}" + loc[len(self.upstream):])
        elif loc and self.tls is not None and loc.startswith(f"http://{client_host}/"):
            # The emulator wrote the client's Host with its own scheme, plain http.
            out.set("Location", "https" + loc[len("http"):])
        close_after = False
        cut = spec.get("cut_response_after")
        truncate = spec.get("truncate_response_body")
        if truncate is not None:
            truncate = int(truncate)
        if rchunked or reof:
            if version == "HTTP/1.1":
                out.set("Transfer-Encoding", "chunked")
            else:
                close_after = True
        elif rlen is not None and (ustatus >= 200 and method != "HEAD" and ustatus not in (204, 304)):
            out.set("Content-Length", str(rlen if truncate is None else min(truncate, rlen)))
        elif rhead.get("content-length") is not None:
            out.set("Content-Length", rhead.get("content-length"))
        relay_chunked = (rchunked or reof) and version == "HTTP/1.1"
        if close_after:
            out.set("Connection", "close")
        entry["status"] = ustatus
        if cut is not None:
            entry["action"] = "cut"
        elif truncate is not None:
            entry["action"] = "truncate"
        elif rule is not None and rule.corrupt:
            entry["action"] = "corrupt"
        elif rule is not None:
            entry["action"] = entry["action"] or "shape"
        phrase = sp[2] if len(sp) > 2 else PHRASES.get(ustatus, "")
        try:
            writer.write(f"HTTP/1.1 {ustatus} {phrase}\r\n".encode("latin-1") + out.encode() + b"\r\n")
            piece = PIECE
            for b in (rule_bucket, down_bucket):
                if b is not None:
                    piece = min(piece, max(1024, int(b.rate // 50)))
            sent = 0
            while True:
                want = piece if cut is None else min(piece, int(cut) - sent)
                if truncate is not None:
                    want = min(want, truncate - sent)
                if (cut is not None or truncate is not None) and want <= 0:
                    break
                try:
                    d = await rbody.read(want)
                except IncompleteBody:
                    u.abort()
                    up[0] = None
                    _rst(writer)
                    finish("upstream_cut_response")
                    return False
                if not d:
                    break
                if rule is not None and rule.corrupt:
                    hit = [k - sent for k in rule.corrupt if sent <= k < sent + len(d)]
                    if hit:
                        b = bytearray(d)
                        for i in hit:
                            b[i] ^= 0xFF
                        d = bytes(b)
                await shape(len(d), down_bucket)
                writer.write((b"%x\r\n" % len(d)) + d + b"\r\n" if relay_chunked else d)
                sent += len(d)
                entry["response_body_bytes"] = sent
                await writer.drain()
            if cut is not None and not rbody.done:
                await writer.drain()
                u.abort()
                up[0] = None
                writer.close()
                finish("cut")
                return False
            if truncate is not None and not rbody.done:
                await discard_upstream_body()  # the client's response is complete as framed
            if relay_chunked:
                writer.write(b"0\r\n\r\n")
            await writer.drain()
        except (ConnectionError, OSError):
            u.abort()
            up[0] = None
            finish("client_disconnected")
            return False
        if not upstream_keep or reof:
            u.abort()
            up[0] = None
        finish("ok")
        return not close_after

    async def _answer(self, writer, body: BodyReader, expect: bool, entry, finish, status: int, message,
                      payload, extra, drain: bool, count_up) -> bool:
        """Answer the client without forwarding."""
        if payload is None:
            payload = gcs_error(status, message)
        close = False
        if expect or not drain:
            close = not body.done  # the client may not send the body: answer and close
        else:
            try:
                await body.drain(count_up)
            except IncompleteBody:
                entry["request_complete"] = False
                finish("client_disconnected")
                return False
        entry["request_complete"] = body.done
        entry["status"] = status
        try:
            entry["response_body_bytes"] = await self._send_simple(writer, status, payload, close=close, extra=extra)
        except (ConnectionError, OSError):
            finish("client_disconnected")
            return False
        finish("ok")
        return not close


class ProxyClient:
    """Control a running proxy over HTTP (what a test of a standalone proxy or a C++ test does)."""

    def __init__(self, url: str):
        self.url = url.rstrip("/")

    def _call(self, method: str, path: str, payload=None):
        data = None if payload is None else json.dumps(payload).encode()
        req = urllib.request.Request(self.url + path, data=data, method=method,
                                     headers={"Content-Type": "application/json"})
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # never via *_proxy
        with opener.open(req, timeout=30) as r:
            return json.loads(r.read())

    def set_rules(self, rules: list[dict], append: bool = False):
        return self._call("POST", "/__proxy/rules", {"rules": rules, "append": append})

    def reset(self, keep_settings: bool = False):
        return self._call("POST", "/__proxy/reset", {"keep_settings": keep_settings})

    def log(self, since: int = 0) -> list[dict]:
        return self._call("GET", f"/__proxy/log?since={since}")["entries"]

    def release(self, name: str):
        return self._call("POST", "/__proxy/release", {"name": name})

    def rules(self) -> list[dict]:
        return self._call("GET", "/__proxy/rules")["rules"]

    def settings(self, **kw) -> dict:
        if kw:
            return self._call("POST", "/__proxy/settings", kw)["settings"]
        return self._call("GET", "/__proxy/settings")["settings"]


def _check_loopback(host: str):
    try:
        ok = ipaddress.ip_address(host).is_loopback
    except ValueError:
        ok = host == "localhost"
    if not ok:
        raise ValueError(f"refusing to listen on {host!r}: test servers listen on loopback only")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="Fault-injecting HTTP/1.1 reverse proxy (see module docstring).")
    ap.add_argument("--upstream", required=True, help="http://127.0.0.1:PORT of the emulator")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--rules", help="JSON file with initial rules")
    a = ap.parse_args(argv)
    proxy = FaultProxy(a.upstream, a.host, a.port)
    if a.rules:
        with open(a.rules) as f:
            proxy.set_rules(json.load(f))

    async def run():
        await proxy.start_async()
        print(proxy.port, flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        await proxy.stop_async()

    asyncio.run(run())
    return 0


if __name__ == "__main__":
    sys.exit(main())
