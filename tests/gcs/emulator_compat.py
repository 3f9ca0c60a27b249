"""Run the gcp-storage-emulator package (PyPI, not ours) with a thin HTTP-level compatibility layer.

    python tests/gcs/emulator_compat.py [--host 127.0.0.1] [--port 0] [--bucket NAME ...] [--pristine]

Prints the bound port on the first line of stdout, then serves until SIGTERM/SIGINT.

The emulator itself (request routing, object and bucket storage, resumable session state, CRC32C/MD5
of stored objects, listing with prefix/delimiter, ranged reads, multipart parsing) is the package's
code, unmodified. This module wraps its request handler and only:

* speaks HTTP/1.1 (persistent connections, ``Expect: 100-continue``) on a threaded server, running
  the package's handler under one global lock (its storage is not thread-safe); request bodies are
  read before taking the lock and responses are written after releasing it, so a slow client does
  not block the others;
* fixes deviations from the documented GCS JSON API that would make a correct client fail or hide
  a client bug (each one is listed in README.md, "Compatibility layer"), by checking a request
  before handing it to the package, or fixing up the package's response.

``--pristine`` runs the package exactly as its own ``gcp-storage-emulator start`` does (single
threaded HTTP/1.0 server, stock handler), for comparison (see probe_emulator.py).
"""
from __future__ import annotations

import argparse
import base64
import email.parser
import hashlib
import io
import json
import logging
import os
import re
import signal
import sys
import tempfile
import threading
import urllib.parse
from functools import partial
from http import HTTPStatus
from http.server import HTTPServer, ThreadingHTTPServer

import google_crc32c
from gcp_storage_emulator import server as gse_server
from gcp_storage_emulator.exceptions import NotFound
from gcp_storage_emulator.handlers import buckets as gse_buckets
from gcp_storage_emulator.storage import RESUMABLE_DIR, Storage

CHUNK_ALIGN = 256 * 1024

_UPLOAD_RE = re.compile(r"^/upload/storage/v1/b/(?P<bucket>[^/]+)/o$")
_OBJECT_RE = re.compile(r"^/(?:download/)?storage/v1/b/(?P<bucket>[^/]+)/o/(?P<object>.*[^/]+)$")
_LIST_RE = re.compile(r"^/storage/v1/b/(?P<bucket>[^/]+)/o$")
_CRANGE_RE = re.compile(r"^bytes (?:(?P<start>\d+)-(?P<end>\d+)|\*)/(?P<total>\d+|\*)$")
_RANGE_RE = re.compile(r"^\s*bytes=(?P<start>\d+)-(?P<end>\d*)\s*$")


def crc32c_b64(data: bytes) -> str:
    return base64.b64encode(google_crc32c.value(data).to_bytes(4, "big")).decode()


def md5_b64(data: bytes) -> str:
    return base64.b64encode(hashlib.md5(data).digest()).decode()


def parse_goog_hash(value: str | None) -> dict[str, str]:
    """``crc32c=AAAAAA==,md5=BBBB==`` -> {"crc32c": ..., "md5": ...}."""
    out: dict[str, str] = {}
    for part in (value or "").split(","):
        k, sep, v = part.strip().partition("=")
        if sep:
            out[k.strip().lower()] = v.strip()
    return out


def error_body(code: int, message: str, reason: str | None = None) -> bytes:
    reason = reason or {400: "invalid", 404: "notFound", 409: "conflict", 412: "conditionNotMet",
                        416: "requestedRangeNotSatisfiable"}.get(code, "error")
    return json.dumps({"error": {"code": code, "message": message,
                                 "errors": [{"domain": "global", "reason": reason, "message": message}]}}).encode()


class _Reply(Exception):
    """Raised by a pre-check to answer without calling the package's handler."""

    def __init__(self, status: int, body: bytes = b"", headers: dict[str, str] | None = None):
        super().__init__(status)
        self.status, self.body, self.headers = status, body, dict(headers or {})


class _State:
    def __init__(self, storage: Storage):
        self.storage = storage
        self.lock = threading.Lock()
        self.completed: dict[str, tuple[int, bytes]] = {}  # upload_id -> final (status, body)


class CompatHandler(gse_server.RequestHandler):
    protocol_version = "HTTP/1.1"

    def __init__(self, state: _State, *args, **kwargs):
        self.state = state
        super().__init__(state.storage, *args, **kwargs)

    # The package's do_* create a Router; route them all through _serve.
    def do_GET(self):
        self._serve("GET")

    def do_POST(self):
        self._serve("POST")

    def do_PUT(self):
        self._serve("PUT")

    def do_DELETE(self):
        self._serve("DELETE")

    def do_PATCH(self):
        self._serve("PATCH")

    # ---------------------------------------------------------------- plumbing
    def _read_body(self) -> tuple[bytes, bool]:
        """The whole request body and whether it arrived complete."""
        te = (self.headers.get("Transfer-Encoding") or "").lower()
        if "chunked" in te:
            parts = []
            while True:
                line = self.rfile.readline(65537)
                if not line:
                    return b"".join(parts), False
                try:
                    size = int(line.split(b";")[0].strip(), 16)
                except ValueError:
                    raise _Reply(400, error_body(400, "malformed chunked request body"))
                if size == 0:
                    while True:  # trailers
                        t = self.rfile.readline(65537)
                        if t in (b"\r\n", b"\n", b""):
                            break
                    return b"".join(parts), True
                data = self.rfile.read(size)
                parts.append(data)
                if len(data) < size:
                    return b"".join(parts), False
                self.rfile.readline(3)
        n = int(self.headers.get("Content-Length") or 0)
        data = self.rfile.read(n) if n else b""
        return data, len(data) == n

    def _set_header(self, name: str, value: str | None):
        del self.headers[name]
        if value is not None:
            self.headers[name] = value

    def _serve(self, method: str):
        reply: _Reply | None = None
        try:
            body, complete = self._read_body()
        except _Reply as r:
            body, complete, reply = b"", True, r
            self.close_connection = True
        except OSError:
            self.close_connection = True
            return
        if not complete:
            self.close_connection = True
        with self.state.lock:
            if reply is None:
                status, headers, out = self._handle_locked(method, body, complete)
            else:
                status, headers, out = reply.status, reply.headers, reply.body
        if not complete:
            return  # the client is gone; the request had its side effects (like a cut chunk on GCS)
        self._write(status, headers, out, method)

    def _write(self, status: int, headers: dict[str, str], body: bytes, method: str):
        phrase = {308: "Resume Incomplete", 499: "Client Closed Request"}.get(status)
        if phrase is None:
            try:
                phrase = HTTPStatus(status).phrase
            except ValueError:
                phrase = "Status"
        lines = [f"HTTP/1.1 {status} {phrase}", f"Server: {self.version_string()}",
                 f"Date: {self.date_time_string()}"]
        for k, v in headers.items():
            if k.lower() in ("content-length", "connection", "server", "date", "transfer-encoding"):
                continue
            lines.append(f"{k}: {v}")
        lines.append(f"Content-Length: {len(body)}")
        if self.close_connection:
            lines.append("Connection: close")
        self.log_request(status, len(body))
        try:
            self.wfile.write(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body)
            self.wfile.flush()
        except OSError:
            self.close_connection = True

    def _call_package(self, method: str, body: bytes) -> tuple[int, dict[str, str], bytes]:
        """Run the package's router on a buffered request; capture what it writes."""
        real_rfile, real_wfile = self.rfile, self.wfile
        self._set_header("Transfer-Encoding", None)
        self._set_header("Content-Length", str(len(body)))
        self.rfile, self.wfile = io.BytesIO(body), io.BytesIO()
        close_before = self.close_connection
        try:
            gse_server.Router(self).handle(method)
            raw = self.wfile.getvalue()
        finally:
            self.rfile, self.wfile = real_rfile, real_wfile
            self.close_connection = close_before
        head, _, out = raw.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split()[1])
        headers: dict[str, str] = {}
        for line in lines[1:]:
            k, _, v = line.partition(":")
            headers[k.strip()] = v.strip()
        return status, headers, out

    # ---------------------------------------------------------------- compat logic
    def _handle_locked(self, method: str, body: bytes, complete: bool):
        url = urllib.parse.urlsplit(self.path)
        query = urllib.parse.parse_qs(url.query, keep_blank_values=True)
        qget = lambda k: (query.get(k) or [None])[0]  # noqa: E731
        ctx: dict = {}
        try:
            body = self._pre(method, url.path, qget, body, complete, ctx)
            if not complete and ctx.get("resumable_id") is None:
                return 400, {}, b""  # a cut simple/multipart upload never creates an object
            status, headers, out = self._call_package(method, body)
        except _Reply as r:
            status, headers, out = r.status, r.headers, r.body
            if r.status in (200, 201) and ctx.get("resumable_id"):
                self.state.completed[ctx["resumable_id"]] = (r.status, r.body)
            if "Content-Type" not in headers and out:
                headers["Content-Type"] = "application/json"
            return status, headers, out
        return self._post(method, url.path, qget, status, headers, out, ctx)

    def _object_generation(self, bucket: str, name: str) -> int:
        try:
            return int(self.state.storage.get_file_obj(bucket, name).get("generation") or 0)
        except NotFound:
            return 0

    def _check_preconditions(self, qget, bucket: str, name: str | None):
        match, not_match = qget("ifGenerationMatch"), qget("ifGenerationNotMatch")
        if name is None or (match is None and not_match is None):
            return
        gen = self._object_generation(bucket, name)
        ok = True
        if match is not None and match.strip().lstrip("-").isdigit():
            ok = ok and int(match) == gen
        if not_match is not None and not_match.strip().lstrip("-").isdigit():
            ok = ok and int(not_match) != gen
        if not ok:
            raise _Reply(412, error_body(412, "At least one of the pre-conditions you specified did not hold."),
                         {"Content-Type": "application/json; charset=UTF-8"})

    def _check_hash(self, data: bytes, hash_header: str | None):
        h = parse_goog_hash(hash_header)
        if "crc32c" in h and h["crc32c"] != crc32c_b64(data):
            raise _Reply(400, error_body(400, f"Provided CRC32C \"{h['crc32c']}\" doesn't match calculated "
                                              f"CRC32C \"{crc32c_b64(data)}\"."))
        if "md5" in h and h["md5"] != md5_b64(data):
            raise _Reply(400, error_body(400, f"Provided MD5 hash \"{h['md5']}\" doesn't match calculated "
                                              f"MD5 hash \"{md5_b64(data)}\"."))

    def _multipart(self, body: bytes) -> tuple[dict, bytes | None]:
        ctype = self.headers.get("Content-Type") or ""
        try:
            msg = email.parser.BytesParser().parsebytes(f"Content-Type: {ctype}\r\n\r\n".encode() + body)
            parts = msg.get_payload()
            meta = json.loads(parts[0].get_payload())
            content = parts[1].get_payload(decode=True) if len(parts) > 1 else None
            return (meta if isinstance(meta, dict) else {}), content
        except Exception:  # noqa: BLE001 - malformed: leave it to the package
            return {}, None

    def _pre(self, method, path, qget, body: bytes, complete: bool, ctx: dict) -> bytes:
        st = self.state.storage
        m = _UPLOAD_RE.match(path)
        if m:
            bucket = urllib.parse.unquote(m["bucket"])
            upload_id = qget("upload_id")
            if upload_id is not None:
                return self._pre_session(method, bucket, upload_id, qget, body, complete, ctx)
            kind = qget("uploadType")
            if method != "POST" or kind not in ("media", "multipart", "resumable"):
                return body
            name = qget("name")
            if kind == "multipart":
                meta, content = self._multipart(body)
                name = name or meta.get("name")
                if content is not None:
                    self._check_hash(content, self.headers.get("x-goog-hash"))
            elif kind == "resumable" and name is None and body:
                try:
                    name = json.loads(body).get("name")
                except (ValueError, AttributeError):
                    pass
            elif kind == "media":
                self._check_hash(body, self.headers.get("x-goog-hash"))
            self._check_preconditions(qget, bucket, name)
            return body
        m = _OBJECT_RE.match(path)
        if m and method in ("GET", "DELETE"):
            bucket, name = urllib.parse.unquote(m["bucket"]), urllib.parse.unquote(m["object"])
            try:
                obj = st.get_file_obj(bucket, name)
            except NotFound:
                return body  # the package answers 404
            self._check_preconditions(qget, bucket, name)
            if method == "GET" and (qget("alt") == "media" or path.startswith("/download/")):
                ctx["media_obj"] = obj
                r = _RANGE_RE.match(self.headers.get("Range") or "")
                size = int(obj.get("size") or 0)
                if r and int(r["start"]) >= size and size > 0:
                    raise _Reply(416, error_body(416, "The requested range cannot be satisfied."),
                                 {"Content-Range": f"bytes */{size}"})
        return body

    def _pre_session(self, method, bucket, upload_id, qget, body, complete, ctx) -> bytes:
        st = self.state.storage
        ctx["resumable_id"] = upload_id
        if upload_id in self.state.completed:
            status, out = self.state.completed[upload_id]
            raise _Reply(status, out, {"Content-Type": "application/json"})
        if upload_id not in st.resumable:
            raise _Reply(404, error_body(404, "No such upload session."))
        if method == "DELETE":
            st.delete_resumable_file_obj(upload_id)
            try:
                st._delete_file(RESUMABLE_DIR, st.safe_id(upload_id))  # noqa: SLF001
            except Exception:  # noqa: BLE001 - nothing was uploaded yet
                pass
            raise _Reply(499, b"")
        if method not in ("PUT", "POST"):
            return body
        obj = st.resumable[upload_id]
        committed = st.get_resumable_byte_count(upload_id)
        cr = _CRANGE_RE.match((self.headers.get("Content-Range") or "").strip())
        if not cr:
            return body  # no/odd Content-Range: the package treats the body as the whole object
        total = None if cr["total"] == "*" else int(cr["total"])
        if cr["start"] is None:  # status query "bytes */*" or "bytes */TOTAL"
            if total is not None and committed >= total:
                existing = st.get_file(RESUMABLE_DIR, st.safe_id(upload_id), False) if committed else b""
                self._check_hash(existing[:total], self.headers.get("x-goog-hash"))
                self._check_preconditions(qget, bucket, obj.get("name"))
                return body  # the package finalizes
            raise _Reply(308, b"", {"Range": f"bytes=0-{committed - 1}"} if committed else {})
        start, end = int(cr["start"]), int(cr["end"])
        if not complete:
            # The client went away mid-chunk: keep what arrived, rounded down to 256 KiB of the object.
            keep_to = ((start + len(body)) // CHUNK_ALIGN) * CHUNK_ALIGN
            body = body[:max(0, keep_to - start)]
            if not body or start != committed:
                raise _Reply(308, b"")
            end, total = start + len(body) - 1, None
            self._set_header("Content-Range", f"bytes {start}-{end}/*")
            return body
        if end - start + 1 != len(body):
            raise _Reply(400, error_body(400, f"Content-Range {self.headers.get('Content-Range')} does not match "
                                              f"the {len(body)} bytes of the request body."))
        final = total is not None and end + 1 >= total
        if not final and len(body) < CHUNK_ALIGN:
            raise _Reply(400, error_body(400, "Invalid request. The number of bytes uploaded is required to be equal "
                                              "or greater than 262144, except for the final request (it's recommended "
                                              f"to be the exact multiple of 262144). The received request contained "
                                              f"{len(body)} bytes, which does not meet this requirement."))
        if start < committed:  # overlap with what is already committed: GCS ignores the overlap
            skip = committed - start
            if skip >= len(body):
                raise _Reply(308, b"", {"Range": f"bytes=0-{committed - 1}"})
            body, start = body[skip:], committed
            self._set_header("Content-Range", f"bytes {start}-{end}/{cr['total']}")
        if not final and start == committed:
            # GCS persists non-final data in multiples of 256 KiB; the 308's Range says how much.
            keep = ((start + len(body)) // CHUNK_ALIGN) * CHUNK_ALIGN - start
            if keep <= 0:
                raise _Reply(308, b"", {"Range": f"bytes=0-{committed - 1}"} if committed else {})
            if keep < len(body):
                body = body[:keep]
                self._set_header("Content-Range", f"bytes {start}-{start + keep - 1}/*")
        if total is not None and end + 1 >= total and start == committed:
            existing = st.get_file(RESUMABLE_DIR, st.safe_id(upload_id), False) if committed else b""
            self._check_hash((existing + body)[:total], self.headers.get("x-goog-hash"))
            self._check_preconditions(qget, bucket, obj.get("name"))
        return body

    def _post(self, method, path, qget, status, headers, out, ctx):
        upload_id = ctx.get("resumable_id")
        if upload_id is not None:
            if status == 308 and self.state.storage.get_resumable_byte_count(upload_id) == 0:
                headers.pop("Range", None)  # GCS: no Range header when nothing is persisted
            if status in (200, 201) and method in ("PUT", "POST"):
                self.state.completed[upload_id] = (status, out)
        if method == "DELETE" and status == 200 and _OBJECT_RE.match(path):
            status, out = 204, b""
            headers.pop("Content-type", None)
        if "media_obj" in ctx and status in (200, 206):
            obj = ctx["media_obj"]
            headers.setdefault("X-Goog-Hash", f"crc32c={obj.get('crc32c')},md5={obj.get('md5Hash')}")
            headers.setdefault("X-Goog-Generation", str(obj.get("generation")))
            headers.setdefault("X-Goog-Stored-Content-Length", str(obj.get("size")))
        if method == "GET" and status == 200 and _LIST_RE.match(path):
            out = self._page(out, qget)
        if status >= 400:
            out = self._fix_error(status, out)
            headers = {k: v for k, v in headers.items() if k.lower() != "content-type"}
            headers["Content-Type"] = "application/json; charset=UTF-8"
        return status, headers, out

    @staticmethod
    def _fix_error(status: int, out: bytes) -> bytes:
        try:
            j = json.loads(out) if out else None
        except ValueError:
            j = None
        if isinstance(j, dict) and isinstance(j.get("error"), dict):
            err = j["error"]
            err.setdefault("code", status)
            err.setdefault("message", HTTPStatus(status).phrase if status in HTTPStatus._value2member_map_ else "error")
            return json.dumps(j).encode()
        try:
            phrase = HTTPStatus(status).phrase
        except ValueError:
            phrase = "error"
        msg = out.decode("utf-8", "replace").strip() if out else phrase
        return error_body(status, msg or phrase)

    @staticmethod
    def _page(out: bytes, qget) -> bytes:
        """objects.list paging: maxResults (default 1000, counting items and prefixes) + pageToken."""
        try:
            data = json.loads(out)
            max_results = max(1, int(qget("maxResults") or 1000))
        except ValueError:
            return out
        entries = sorted([(i.get("name", ""), 0, i) for i in data.get("items") or []]
                         + [(p, 1, p) for p in data.get("prefixes") or []], key=lambda e: (e[0], e[1]))
        token = qget("pageToken")
        if token:
            try:
                after = base64.urlsafe_b64decode(token.encode() + b"==").decode()
            except (ValueError, UnicodeDecodeError):
                after = ""
            entries = [e for e in entries if e[0] > after]
        page, more = entries[:max_results], len(entries) > max_results
        data["items"] = [e[2] for e in page if e[1] == 0]
        data["prefixes"] = [e[2] for e in page if e[1] == 1]
        data.pop("nextPageToken", None)
        if not data["items"]:
            data.pop("items")
        if not data["prefixes"]:
            data.pop("prefixes")
        if more:
            data["nextPageToken"] = base64.urlsafe_b64encode(page[-1][0].encode()).decode().rstrip("=")
        return json.dumps(data).encode()

    def log_message(self, format, *args):  # noqa: A002 - signature of the base class
        logging.getLogger("gcs-emulator").debug(format % args)


class _ThreadingServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 128


def make_server(host: str = "127.0.0.1", port: int = 0, buckets=(), pristine: bool = False,
                data_dir: str | None = None, in_memory: bool = True):
    """Build (not start) the HTTP server; ``server.serve_forever()`` runs it."""
    data_dir = data_dir or tempfile.mkdtemp(prefix="gcs-emulator-")
    storage = Storage(use_memory_fs=in_memory, data_dir=os.path.abspath(data_dir))
    for b in buckets:
        gse_buckets.create_bucket(b, storage)
    if pristine:
        return HTTPServer((host, port), partial(gse_server.RequestHandler, storage))
    return _ThreadingServer((host, port), partial(CompatHandler, _State(storage)))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--bucket", action="append", default=[], help="create this bucket at start (repeatable)")
    ap.add_argument("--pristine", action="store_true", help="the package's own server, no compatibility layer")
    ap.add_argument("--data-dir", default=None, help="root for on-disk data (default: a fresh temp dir)")
    ap.add_argument("--on-disk", action="store_true", help="store objects on disk instead of in memory")
    ap.add_argument("--verbose", action="store_true", help="log every request to stderr")
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if a.verbose else logging.CRITICAL, stream=sys.stderr,
                        format="%(name)s: %(message)s")
    httpd = make_server(a.host, a.port, a.bucket, a.pristine, a.data_dir, in_memory=not a.on_disk)

    def _stop(*_):
        threading.Thread(target=httpd.shutdown, daemon=True).start()

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    print(httpd.server_address[1], flush=True)
    try:
        httpd.serve_forever(poll_interval=0.1)
    finally:
        httpd.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
