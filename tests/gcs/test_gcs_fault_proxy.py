"""Self-tests of fault_proxy.py: each action does what it says, seen from raw HTTP clients."""
from __future__ import annotations

import http.client
import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from emulator import read_port, spawn, wait_until
from fault_proxy import FaultProxy, ProxyClient
from probe_emulator import CHUNK, Raw, crc32c_b64, q

HERE = os.path.dirname(os.path.abspath(__file__))


# Client timeouts only end a test whose answer never comes: generous, for a loaded machine. A test
# that expects no answer for a while sets a short one below a much longer stall.
def conn_for(url: str, timeout: float = 60) -> http.client.HTTPConnection:
    u = urllib.parse.urlsplit(url)
    return http.client.HTTPConnection(u.hostname, u.port, timeout=timeout)


def start_session(raw: Raw, bucket: str, name: str) -> str:
    s, h, _ = raw.request("POST", f"/upload/storage/v1/b/{bucket}/o?uploadType=resumable&name={q(name)}", b"",
                          {"Content-Length": "0"})
    assert s == 200, s
    return h["location"]


def raw_socket(url: str, timeout: float = 60) -> socket.socket:
    u = urllib.parse.urlsplit(url)
    return socket.create_connection((u.hostname, u.port), timeout=timeout)


def finished_log(proxy: FaultProxy, n: int) -> list[dict]:
    """The proxy's log once its first n entries are finished. The proxy logs a request's end just
    after sending its last byte, so a client can hold the whole answer a moment before the log says so."""
    def ready():
        log = proxy.log()
        return log if len(log) >= n and all(e["outcome"] != "in_progress" for e in log[:n]) else None
    return wait_until(ready, f"the proxy to log the end of {n} requests")


def recv_all(sk: socket.socket) -> bytes:
    out = b""
    while True:
        d = sk.recv(65536)
        if not d:
            return out
        out += d


# ----------------------------------------------------------------------------- status rules
def test_503_on_second_put_of_resumable_upload(gcs_proxy, gcs_emulator, gcs_bucket):
    gcs_proxy.set_rules([{"id": "503-2nd-put", "method": "PUT", "path": r"upload_id=", "nth": 2, "status": 503}])
    raw = Raw(gcs_proxy.url)
    data = os.urandom(2 * CHUNK + 1000)
    loc = start_session(raw, gcs_bucket, "obj")
    assert urllib.parse.urlsplit(loc).port == gcs_proxy.port  # the session URI points at the proxy
    s, h, _ = raw.request("PUT", loc, data[:CHUNK], {"Content-Range": f"bytes 0-{CHUNK - 1}/*"})
    assert (s, h.get("range")) == (308, f"bytes=0-{CHUNK - 1}")
    s, h, b = raw.request("PUT", loc, data[CHUNK:2 * CHUNK], {"Content-Range": f"bytes {CHUNK}-{2 * CHUNK - 1}/*"})
    assert s == 503
    assert json.loads(b)["error"]["code"] == 503 and json.loads(b)["error"]["message"]
    # the emulator never saw it: a status query still says one chunk
    s, h, _ = raw.request("PUT", loc, b"", {"Content-Range": "bytes */*"})
    assert (s, h.get("range")) == (308, f"bytes=0-{CHUNK - 1}")
    s, h, _ = raw.request("PUT", loc, data[CHUNK:2 * CHUNK], {"Content-Range": f"bytes {CHUNK}-{2 * CHUNK - 1}/*"})
    assert (s, h.get("range")) == (308, f"bytes=0-{2 * CHUNK - 1}")
    s, h, b = raw.request("PUT", loc, data[2 * CHUNK:],
                          {"Content-Range": f"bytes {2 * CHUNK}-{len(data) - 1}/{len(data)}",
                           "x-goog-hash": f"crc32c={crc32c_b64(data)}"})
    assert s == 200 and json.loads(b)["crc32c"] == crc32c_b64(data)
    assert gcs_emulator.read("obj", gcs_bucket) == data
    log = [e for e in gcs_proxy.log() if e["method"] == "PUT"]
    assert [e["status"] for e in log] == [308, 503, 308, 308, 200]
    assert log[1]["rule"] == "503-2nd-put" and log[1]["forwarded"] is False
    assert log[1]["request_body_bytes"] == CHUNK and log[1]["headers"]["content-range"] == f"bytes {CHUNK}-{2 * CHUNK - 1}/*"
    assert all(e["rule"] is None for i, e in enumerate(log) if i != 1)
    assert log[4]["headers"]["x-goog-hash"] == f"crc32c={crc32c_b64(data)}"
    assert [r["fired"] for r in gcs_proxy.rules()] == [1]


def test_503_after_forward_replaces_a_committed_response(gcs_proxy, gcs_bucket):
    gcs_proxy.set_rules([{"method": "PUT", "path": "upload_id=", "nth": 1, "status": 503, "after_forward": True}])
    raw = Raw(gcs_proxy.url)
    data = os.urandom(CHUNK)
    loc = start_session(raw, gcs_bucket, "committed")
    s, h, b = raw.request("PUT", loc, data, {"Content-Range": f"bytes 0-{CHUNK - 1}/*"})
    assert s == 503 and json.loads(b)["error"]["code"] == 503
    s, h, _ = raw.request("PUT", loc, b"", {"Content-Range": "bytes */*"})
    assert (s, h.get("range")) == (308, f"bytes=0-{CHUNK - 1}")  # committed upstream all the same
    e = gcs_proxy.log()[1]
    assert e["forwarded"] and e["upstream_status"] == 308 and e["status"] == 503 and e["action"] == "status_after_forward"


def test_503_after_forward_on_final_chunk_then_query_returns_the_object(gcs_proxy, gcs_emulator, gcs_bucket):
    gcs_proxy.set_rules([{"method": "PUT", "headers": {"Content-Range": r"/\d+$"}, "status": 503,
                          "after_forward": True, "times": 1}])
    raw = Raw(gcs_proxy.url)
    data = os.urandom(1000)
    loc = start_session(raw, gcs_bucket, "final")
    s, _, _ = raw.request("PUT", loc, data, {"Content-Range": "bytes 0-999/1000"})
    assert s == 503
    s, _, b = raw.request("PUT", loc, b"", {"Content-Range": "bytes */*"})
    assert s == 200 and json.loads(b)["crc32c"] == crc32c_b64(data)
    assert gcs_emulator.read("final", gcs_bucket) == data


@pytest.mark.parametrize("status", [429, 500, 401, 404, 410, 408, 502])
def test_status_codes_with_gcs_error_body(gcs_proxy, gcs_bucket, status):
    gcs_proxy.set_rules([{"method": "GET", "path": r"/o\?", "status": status, "message": f"injected {status}"}])
    st, hdr, body = Raw(gcs_proxy.url).request("GET", f"/storage/v1/b/{gcs_bucket}/o?prefix=x")
    assert st == status
    assert hdr["content-type"].startswith("application/json")
    assert json.loads(body)["error"] == {"code": status, "message": f"injected {status}",
                                         "errors": json.loads(body)["error"]["errors"]}


def test_occurrence_times_skip_nth_and_header_match(gcs_proxy, gcs_bucket):
    gcs_proxy.set_rules([
        {"id": "first3", "method": "GET", "path": "prefix=a", "times": 3, "status": 503},
        {"id": "skip1-times2", "method": "GET", "path": "prefix=b", "skip": 1, "times": 2, "status": 500},
        {"id": "nth", "method": "GET", "path": "prefix=c", "nth": [2, 4], "status": 429},
        {"id": "hdr", "method": "GET", "path": "prefix=d", "headers": {"X-Test": "^yes$"}, "status": 404},
    ])
    raw = Raw(gcs_proxy.url)
    got = {k: [raw.request("GET", f"/storage/v1/b/{gcs_bucket}/o?prefix={k}")[0] for _ in range(5)] for k in "abc"}
    assert got == {"a": [503, 503, 503, 200, 200], "b": [200, 500, 500, 200, 200], "c": [200, 429, 200, 429, 200]}
    assert raw.request("GET", f"/storage/v1/b/{gcs_bucket}/o?prefix=d")[0] == 200
    assert raw.request("GET", f"/storage/v1/b/{gcs_bucket}/o?prefix=d", headers={"X-Test": "yes"})[0] == 404
    counters = {r["id"]: (r["seen"], r["fired"]) for r in gcs_proxy.rules()}
    assert counters == {"first3": (5, 3), "skip1-times2": (5, 2), "nth": (5, 2), "hdr": (1, 1)}
    assert raw.closed_by_server == 0  # error answers keep the connection alive


def test_custom_body_and_headers(gcs_proxy, gcs_bucket):
    page = {"kind": "storage#objects", "items": [{"name": "fake"}], "nextPageToken": "tok"}
    gcs_proxy.set_rules([{"method": "GET", "path": "pageToken=", "nth": 1, "status": 200, "body": page,
                          "response_headers": {"X-Injected": "1"}}])
    st, h, b = Raw(gcs_proxy.url).request("GET", f"/storage/v1/b/{gcs_bucket}/o?pageToken=zzz")
    assert st == 200 and json.loads(b) == page and h["x-injected"] == "1"


# ----------------------------------------------------------------------------- connection faults
def test_reset_mid_body_is_an_rst_and_upstream_keeps_aligned_prefix(gcs_proxy, gcs_bucket):
    n = 300_000
    gcs_proxy.set_rules([{"id": "rst", "method": "PUT", "path": "upload_id=", "nth": 1,
                          "reset_after_request_bytes": n}])
    raw = Raw(gcs_proxy.url)
    loc = start_session(raw, gcs_bucket, "cut")
    data = os.urandom(2 * CHUNK)
    target = urllib.parse.urlsplit(loc)
    sk = raw_socket(gcs_proxy.url)
    sk.sendall((f"PUT {target.path}?{target.query} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(data)}\r\n"
                f"Content-Range: bytes 0-{len(data) - 1}/*\r\n\r\n").encode() + data[:n])
    with pytest.raises(ConnectionResetError):  # RST, not a clean EOF (which would return b"")
        sk.recv(1024)
    sk.close()
    entry = [e for e in finished_log(gcs_proxy, 2) if e["rule"] == "rst"][0]
    assert entry["request_body_bytes"] == n and entry["request_complete"] is False
    assert entry["outcome"] == "reset" and entry["status"] is None and entry["forwarded"]

    # the emulator got the first n bytes of a cut request and kept the 256 KiB-aligned prefix
    def committed():
        s, h, _ = raw.request("PUT", loc, b"", {"Content-Range": "bytes */*"})
        return (s, h["range"]) if "range" in h else None
    assert wait_until(committed, "the emulator to keep a prefix of the cut request") == (308, f"bytes=0-{CHUNK - 1}")


def test_reset_without_forwarding_and_http_client_view(gcs_proxy, gcs_bucket):
    gcs_proxy.set_rules([{"method": "PUT", "path": "upload_id=", "nth": 1, "reset_after_request_bytes": 1000,
                          "forward_partial": False}])
    raw = Raw(gcs_proxy.url)
    loc = start_session(raw, gcs_bucket, "cut2")
    c = conn_for(gcs_proxy.url)
    with pytest.raises((ConnectionResetError, BrokenPipeError, http.client.RemoteDisconnected)):
        c.request("PUT", loc, body=os.urandom(4 * CHUNK), headers={"Content-Range": f"bytes 0-{4 * CHUNK - 1}/*"})
        c.getresponse().read()
    c.close()
    e = finished_log(gcs_proxy, 2)[-1]
    assert e["request_body_bytes"] == 1000 and not e["forwarded"] and e["outcome"] == "reset"
    s, h, _ = raw.request("PUT", loc, b"", {"Content-Range": "bytes */*"})
    assert s == 308 and "range" not in h  # nothing reached the emulator


def test_reset_after_whole_request_was_committed(gcs_proxy, gcs_emulator, gcs_bucket):
    gcs_proxy.set_rules([{"method": "POST", "path": "uploadType=media", "nth": 1,
                          "reset_after_request_bytes": 1 << 30}])
    c = conn_for(gcs_proxy.url)
    with pytest.raises((ConnectionResetError, http.client.RemoteDisconnected)):
        c.request("POST", f"/upload/storage/v1/b/{gcs_bucket}/o?uploadType=media&name=done", body=b"x" * 5000)
        c.getresponse().read()
    e = gcs_proxy.log()[-1]
    assert e["upstream_status"] == 200 and e["status"] is None and e["request_body_bytes"] == 5000
    assert gcs_emulator.read("done", gcs_bucket) == b"x" * 5000


def test_stall_then_close_answers_nothing_and_closes_after_the_stall(gcs_proxy, gcs_bucket):
    gcs_proxy.set_rules([{"method": "GET", "path": "prefix=stall", "nth": 1, "stall_seconds": 0.3}])
    sk = raw_socket(gcs_proxy.url)
    sk.sendall(f"GET /storage/v1/b/{gcs_bucket}/o?prefix=stall HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    assert recv_all(sk) == b""  # not a byte of an answer, then FIN
    sk.close()
    e = gcs_proxy.log()[0]  # logged before the FIN was sent
    assert e["outcome"] == "stalled_then_closed" and not e["forwarded"] and e["status"] is None
    assert e["duration_ms"] >= 300  # the proxy's own clock: it closed only after the stall


def test_a_stall_on_one_connection_blocks_nobody_else(gcs_proxy, gcs_bucket):
    # A stall that outlasts the test (the proxy cancels it when it stops).
    gcs_proxy.set_rules([{"method": "GET", "path": "prefix=stall", "stall_seconds": 3600}])
    stalled = raw_socket(gcs_proxy.url)
    try:
        stalled.sendall(f"GET /storage/v1/b/{gcs_bucket}/o?prefix=stall HTTP/1.1\r\nHost: x\r\n\r\n".encode())
        wait_until(lambda: [e for e in gcs_proxy.log() if e["action"] == "stall"], "the proxy to stall the request")
        # A proxy that served one request at a time would not answer this before the hour is up.
        c = conn_for(gcs_proxy.url)
        c.request("GET", f"/storage/v1/b/{gcs_bucket}/o?prefix=other")
        assert c.getresponse().status == 200
        c.close()
        assert gcs_proxy.log()[0]["outcome"] == "in_progress"  # still stalled
    finally:
        stalled.close()


def test_stall_then_forward_holds_the_request_then_forwards_it(gcs_proxy, gcs_bucket):
    gcs_proxy.set_rules([{"method": "GET", "path": "prefix=slow", "nth": 1, "stall_seconds": 0.4,
                          "stall_then": "forward"}])
    c = conn_for(gcs_proxy.url)
    c.request("GET", f"/storage/v1/b/{gcs_bucket}/o?prefix=slow")
    assert c.getresponse().status == 200
    c.close()
    e = gcs_proxy.log()[0]
    assert e["action"] == "stall" and e["forwarded"] and e["upstream_status"] == 200
    assert e["body_ms"] >= 400  # the proxy's own clock: it forwarded the request only after the stall


def test_stall_close_is_a_clean_eof_even_with_an_unread_body(gcs_proxy, gcs_bucket):
    gcs_proxy.set_rules([{"method": "POST", "nth": 1, "stall_seconds": 0.2}])
    sk = raw_socket(gcs_proxy.url)
    sk.sendall((f"POST /upload/storage/v1/b/{gcs_bucket}/o?uploadType=media&name=z HTTP/1.1\r\nHost: x\r\n"
                "Content-Length: 5000\r\n\r\n").encode() + b"z" * 5000)
    assert recv_all(sk) == b""  # FIN after the stall, no response, no RST
    sk.close()
    assert gcs_proxy.log()[0]["forwarded"] is False


def test_stall_after_forward(gcs_proxy, gcs_emulator, gcs_bucket):
    gcs_proxy.set_rules([{"method": "POST", "nth": 1, "stall_seconds": 5, "after_forward": True}])
    c = conn_for(gcs_proxy.url, timeout=0.5)
    c.request("POST", f"/upload/storage/v1/b/{gcs_bucket}/o?uploadType=media&name=s", body=b"abc")
    with pytest.raises(socket.timeout):
        c.getresponse()
    c.close()
    # The stall starts once the upstream has answered (the emulator may answer after the client gave up).
    e = wait_until(lambda: [x for x in gcs_proxy.log() if x["action"] == "stall_after_forward"],
                   "the proxy to stall after the upstream's answer")[0]
    assert e["upstream_status"] == 200 and e["status"] is None
    assert gcs_emulator.read("s", gcs_bucket) == b"abc"  # committed, but the client never heard


def test_cut_response_after_n_bytes(gcs_proxy, gcs_emulator, gcs_bucket):
    data = os.urandom(100_000)
    gcs_emulator.upload("big", data, gcs_bucket)
    gcs_proxy.set_rules([{"method": "GET", "path": "alt=media", "nth": 1, "cut_response_after": 1000}])
    c = conn_for(gcs_proxy.url)
    c.request("GET", f"/storage/v1/b/{gcs_bucket}/o/big?alt=media")
    r = c.getresponse()
    assert r.status == 200 and int(r.getheader("Content-Length")) == len(data)
    with pytest.raises(http.client.IncompleteRead) as ei:
        r.read()
    assert ei.value.partial == data[:1000]
    e = finished_log(gcs_proxy, 1)[-1]
    assert e["response_body_bytes"] == 1000 and e["outcome"] == "cut"


def test_truncate_response_body_frames_the_cut_body_as_complete(gcs_proxy, gcs_emulator, gcs_bucket):
    data = os.urandom(100_000)
    gcs_emulator.upload("t", data, gcs_bucket)
    gcs_proxy.set_rules([{"method": "GET", "path": "alt=media", "nth": 1, "truncate_response_body": 100}])
    c = conn_for(gcs_proxy.url)
    c.request("GET", f"/storage/v1/b/{gcs_bucket}/o/t?alt=media")
    r = c.getresponse()
    assert r.status == 200 and int(r.getheader("Content-Length")) == 100
    assert r.read() == data[:100]  # a complete response, as framed
    # The connection is still good for the next request, which is not truncated.
    c.request("GET", f"/storage/v1/b/{gcs_bucket}/o/t?alt=media")
    assert c.getresponse().read() == data
    e = gcs_proxy.log()[-2]
    assert e["response_body_bytes"] == 100 and e["action"] == "truncate" and e["outcome"] == "ok"


def test_echo_request_headers_puts_the_credentials_in_the_error_body(gcs_proxy, gcs_bucket):
    gcs_proxy.set_rules([{"method": "GET", "status": 400, "message": "Invalid argument",
                          "echo_request_headers": True}])
    c = conn_for(gcs_proxy.url)
    c.request("GET", f"/storage/v1/b/{gcs_bucket}/o", headers={"Authorization": "Bearer ya29.echo-me"})
    r = c.getresponse()
    message = json.loads(r.read())["error"]["message"]
    assert r.status == 400
    assert message.startswith("Invalid argument; you sent: {") and "'Authorization': 'Bearer ya29.echo-me'" in message
    assert "echo-me" not in json.dumps(gcs_proxy.log())  # the proxy's own log still never holds it


def test_corrupt_response_bytes(gcs_proxy, gcs_emulator, gcs_bucket):
    data = os.urandom(200_000)
    gcs_emulator.upload("c", data, gcs_bucket)
    gcs_proxy.set_rules([{"method": "GET", "path": "alt=media", "times": 2,
                          "corrupt_response_byte": [5, 150_000]}])
    raw = Raw(gcs_proxy.url)
    _, _, got = raw.request("GET", f"/storage/v1/b/{gcs_bucket}/o/c?alt=media")
    diff = [i for i in range(len(data)) if got[i] != data[i]]
    assert len(got) == len(data) and diff == [5, 150_000] and got[5] == data[5] ^ 0xFF
    _, _, got = raw.request("GET", f"/storage/v1/b/{gcs_bucket}/o/c?alt=media", headers={"Range": "bytes=10-19"})
    # offsets count in the response body: byte 5 of this 10-byte body is flipped, 150000 is past its end
    assert got[5] == data[15] ^ 0xFF and got[:5] + got[6:] == data[10:15] + data[16:20]
    _, _, got = raw.request("GET", f"/storage/v1/b/{gcs_bucket}/o/c?alt=media")
    assert got == data  # times: 2 -> the third is clean


# ----------------------------------------------------------------------------- shaping
def test_latency(gcs_proxy, gcs_bucket):
    raw = Raw(gcs_proxy.url)
    gcs_proxy.set_rules([{"method": "GET", "latency_ms": 300}])
    assert raw.request("GET", f"/storage/v1/b/{gcs_bucket}/o")[0] == 200
    gcs_proxy.set_rules([])
    gcs_proxy.settings(latency_ms=200)
    assert raw.request("GET", f"/storage/v1/b/{gcs_bucket}/o")[0] == 200
    by_rule, by_setting = gcs_proxy.log()
    # The proxy's own clock, lower bounds only: each request was forwarded after its latency.
    assert by_rule["forwarded"] and by_rule["body_ms"] >= 300
    assert by_setting["forwarded"] and by_setting["body_ms"] >= 200


def test_bandwidth_rule_upload_and_download(gcs_proxy, gcs_bucket):
    rate = 1 << 20
    data = os.urandom(512 * 1024)
    gcs_proxy.set_rules([{"bandwidth_bytes_per_s": rate}])
    raw = Raw(gcs_proxy.url)
    st, _, _ = raw.request("POST", f"/upload/storage/v1/b/{gcs_bucket}/o?uploadType=media&name=bw", data,
                           {"Content-Type": "application/octet-stream"})
    assert st == 200
    st, _, got = raw.request("GET", f"/storage/v1/b/{gcs_bucket}/o/bw?alt=media")
    assert got == data
    up, down = finished_log(gcs_proxy, 2)
    # The proxy's own clock, lower bounds only (a loaded machine only adds to them): a body of
    # len/rate = 0.5 s takes at least 0.45 s (the first rate/50 bytes pass unshaped).
    shaped_ms = 0.9 * 1000 * len(data) / rate
    assert up["request_body_bytes"] == len(data)
    assert shaped_ms <= up["body_ms"] <= up["upstream_ms"] <= up["duration_ms"], up  # body, then the answer
    assert down["response_body_bytes"] == len(data)
    assert down["duration_ms"] - down["upstream_ms"] >= shaped_ms, down  # from the answer's head to its end


def test_bandwidth_global_setting_is_shared_by_connections(gcs_proxy, gcs_bucket, gcs_emulator):
    data = os.urandom(256 * 1024)
    gcs_emulator.upload("g", data, gcs_bucket)
    gcs_proxy.settings(download_bytes_per_s=1 << 20)
    results = []

    def fetch():
        results.append(Raw(gcs_proxy.url).request("GET", f"/storage/v1/b/{gcs_bucket}/o/g?alt=media")[2] == data)

    t0 = time.monotonic()
    ts = [threading.Thread(target=fetch) for _ in range(2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    took = time.monotonic() - t0
    assert results == [True, True]
    assert gcs_proxy.shaped_bytes() == {"down": 2 * len(data)}  # one cap shaped both bodies
    assert took >= 0.9 * 2 * len(data) / (1 << 20), took  # 2 x 256 KiB through 1 MiB/s: a lower bound only


# ----------------------------------------------------------------------------- protocol
def test_keep_alive_chunked_request_and_expect_continue(gcs_proxy, gcs_emulator, gcs_bucket):
    c = conn_for(gcs_proxy.url)
    for i in range(3):
        c.request("POST", f"/upload/storage/v1/b/{gcs_bucket}/o?uploadType=media&name=k{i}",
                  body=iter([b"ab", b"cde", b"f" * 70000]), encode_chunked=True)
        r = c.getresponse()
        assert r.status == 200 and json.loads(r.read())["size"] == str(70005)
    c.close()
    log = gcs_proxy.log()
    assert len({e["conn"] for e in log}) == 1 and all(e["request_body_bytes"] == 70005 for e in log)
    assert gcs_emulator.read("k2", gcs_bucket) == b"abcde" + b"f" * 70000
    sk = raw_socket(gcs_proxy.url)
    body = b"z" * 3000
    sk.sendall((f"POST /upload/storage/v1/b/{gcs_bucket}/o?uploadType=media&name=e HTTP/1.1\r\nHost: x\r\n"
                f"Content-Length: {len(body)}\r\nExpect: 100-continue\r\nConnection: close\r\n\r\n").encode())
    assert sk.recv(100).startswith(b"HTTP/1.1 100 Continue\r\n\r\n")
    sk.sendall(body)
    assert recv_all(sk).startswith(b"HTTP/1.1 200")
    sk.close()
    # an injected error on an Expect request is answered at once (no body read), then closed
    gcs_proxy.set_rules([{"method": "POST", "status": 503}])
    sk = raw_socket(gcs_proxy.url)
    sk.sendall((f"POST /upload/storage/v1/b/{gcs_bucket}/o?uploadType=media&name=e2 HTTP/1.1\r\nHost: x\r\n"
                f"Content-Length: {len(body)}\r\nExpect: 100-continue\r\n\r\n").encode())
    resp = recv_all(sk)
    assert resp.startswith(b"HTTP/1.1 503") and b"Connection: close" in resp
    sk.close()


class _ChunkedUpstream(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    payload = bytes(range(256)) * 40

    def do_GET(self):
        self.send_response(200)
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        for i in range(0, len(self.payload), 1000):
            part = self.payload[i:i + 1000]
            self.wfile.write(b"%x\r\n" % len(part) + part + b"\r\n")
        self.wfile.write(b"0\r\n\r\n")

    def log_message(self, *a):
        pass


def test_chunked_response_relay_cut_and_corrupt():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _ChunkedUpstream)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        with FaultProxy(f"http://127.0.0.1:{srv.server_address[1]}") as p:
            raw = Raw(p.url)
            st, h, b = raw.request("GET", "/x")
            assert st == 200 and b == _ChunkedUpstream.payload and h["transfer-encoding"] == "chunked"
            p.set_rules([{"nth": 1, "corrupt_response_byte": 2500}, {"nth": 2, "cut_response_after": 1500}])
            _, _, b = raw.request("GET", "/x")
            assert b[2500] == _ChunkedUpstream.payload[2500] ^ 0xFF
            c = conn_for(p.url)
            c.request("GET", "/x")
            with pytest.raises(http.client.IncompleteRead):
                c.getresponse().read()
    finally:
        srv.shutdown()
        srv.server_close()


# ----------------------------------------------------------------------------- auth + log hygiene
def test_log_never_contains_credentials_and_require_bearer(gcs_proxy, gcs_auth, gcs_bucket):
    secret = "ya29.SECRET-VALUE-never-logged"
    raw = Raw(gcs_proxy.url)
    path = f"/storage/v1/b/{gcs_bucket}/o"
    assert raw.request("GET", path, headers={"Authorization": f"Bearer {secret}"})[0] == 200
    gcs_proxy.set_rules([{"id": "auth", "require_bearer": ["good-token"]}])
    st, h, b = raw.request("GET", path, headers={"Authorization": f"Bearer {secret}"})
    assert st == 401 and json.loads(b)["error"]["code"] == 401 and "www-authenticate" in h
    assert raw.request("GET", path)[0] == 401
    assert raw.request("GET", path, headers={"Authorization": "Bearer good-token"})[0] == 200
    # "issued": tokens from the token/metadata stand-ins, while unexpired
    gcs_proxy.set_rules([{"require_bearer": "issued"}])
    tok = gcs_auth.registry.issue("test", 60)
    assert raw.request("GET", path, headers={"Authorization": f"Bearer {tok}"})[0] == 200
    assert raw.request("GET", path, headers={"Authorization": "Bearer good-token"})[0] == 401
    gcs_auth.registry.revoke(tok)
    assert raw.request("GET", path, headers={"Authorization": f"Bearer {tok}"})[0] == 401
    gcs_proxy.set_rules([])
    gcs_proxy.settings(require_bearer=["global-tok"])
    assert raw.request("GET", path)[0] == 401
    assert raw.request("GET", path, headers={"Authorization": "Bearer global-tok"})[0] == 200
    dump = json.dumps(gcs_proxy.log())
    assert secret not in dump and "good-token" not in dump and tok not in dump and "global-tok" not in dump
    assert gcs_proxy.log()[0]["authorization"] == "Bearer"
    assert [e["bearer_ok"] for e in gcs_proxy.log()[-2:]] == [False, True]


# ----------------------------------------------------------------------------- control API + standalone
def test_control_api_over_http(gcs_proxy, gcs_bucket):
    pc = ProxyClient(gcs_proxy.url)
    with pytest.raises(Exception) as ei:
        pc.set_rules([{"bogus_key": 1}])
    assert getattr(ei.value, "code", None) == 400
    pc.set_rules([{"id": "a", "method": "GET", "status": 503, "times": 1}])
    assert Raw(gcs_proxy.url).request("GET", f"/storage/v1/b/{gcs_bucket}/o")[0] == 503
    assert pc.rules()[0]["fired"] == 1
    assert [e["rule"] for e in pc.log()] == ["a"]
    since = pc.log()[-1]["id"] + 1
    Raw(gcs_proxy.url).request("GET", f"/storage/v1/b/{gcs_bucket}/o")
    assert len(pc.log(since)) == 1
    assert pc.settings(latency_ms=1)["latency_ms"] == 1
    pc.reset()
    assert pc.log() == [] and pc.rules() == [] and pc.settings() == {}


def test_standalone_proxy_streams_without_buffering(tmp_path):
    """python fault_proxy.py --port 0 prints its port; a 64 MiB upload does not grow it by 64 MiB."""

    class Sink(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_PUT(self):
            n = int(self.headers["Content-Length"])
            while n:
                n -= len(self.rfile.read(min(n, 1 << 20)))
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *a):
            pass

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Sink)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    proc = spawn([sys.executable, os.path.join(HERE, "fault_proxy.py"), "--upstream",
                  f"http://127.0.0.1:{srv.server_address[1]}", "--port", "0"],
                 stdout=subprocess.PIPE, stdin=subprocess.DEVNULL)
    try:
        port = read_port(proc, 20, "fault proxy")
        url = f"http://127.0.0.1:{port}"
        assert ProxyClient(url).rules() == []

        def rss_kib():
            with open(f"/proc/{proc.pid}/status") as f:
                return int(next(line for line in f if line.startswith("VmRSS")).split()[1])

        before = rss_kib()
        size = 64 << 20
        c = conn_for(url, timeout=60)
        block = os.urandom(1 << 20)
        c.putrequest("PUT", "/sink")
        c.putheader("Content-Length", str(size))
        c.endheaders()
        for _ in range(size // len(block)):
            c.send(block)
        assert c.getresponse().status == 200
        grown = rss_kib() - before
        assert grown < 24 * 1024, f"proxy RSS grew by {grown} KiB for a 64 MiB body"
        assert ProxyClient(url).log()[0]["request_body_bytes"] == size
    finally:
        proc.terminate()
        proc.wait(10)
        proc.stdout.close()
        srv.shutdown()
        srv.server_close()


def test_a_held_request_waits_for_its_release_then_goes_on(gcs_proxy, gcs_emulator, gcs_bucket):
    gcs_proxy.set_rules([{"id": "pause", "method": "POST", "path": "uploadType=media", "hold": "copy"}])
    raw = Raw(gcs_proxy.url)
    answers = []
    t = threading.Thread(target=lambda: answers.append(raw.request(
        "POST", f"/upload/storage/v1/b/{gcs_bucket}/o?uploadType=media&name=held", b"held bytes",
        {"Content-Type": "application/octet-stream"})))
    t.start()
    wait_until(lambda: gcs_proxy.rules()[0]["fired"] == 1, "the held request")
    # Held: not answered, not forwarded.
    assert answers == [] and [e["forwarded"] for e in gcs_proxy.log()] == [False]
    ProxyClient(gcs_proxy.url).release("copy")
    t.join(30)
    assert answers and answers[0][0] == 200
    assert gcs_emulator.read("held", gcs_bucket) == b"held bytes"
    assert gcs_proxy.log()[0]["action"] == "hold"


def test_with_tls_the_proxy_serves_https_and_session_uris_stay_https(gcs_emulator, gcs_bucket, tmp_path):
    import ssl

    from tls import TestCa

    ca = TestCa(tmp_path / "tls")
    with FaultProxy(gcs_emulator.url, tls=ca.server_context()) as proxy:
        assert proxy.url == f"https://127.0.0.1:{proxy.port}"
        conn = http.client.HTTPSConnection("127.0.0.1", proxy.port, timeout=60, context=ca.client_context())
        conn.request("POST", f"/upload/storage/v1/b/{gcs_bucket}/o?uploadType=resumable&name=tls-obj", b"",
                     {"Content-Length": "0", "Host": f"localhost:{proxy.port}"})
        r = conn.getresponse()
        r.read()
        assert r.status == 200
        loc = urllib.parse.urlsplit(r.getheader("Location"))
        assert (loc.scheme, loc.hostname, loc.port) == ("https", "localhost", proxy.port)
        body = os.urandom(1000)
        conn.request("PUT", f"{loc.path}?{loc.query}", body, {"Content-Range": "bytes 0-999/1000"})
        r = conn.getresponse()
        r.read()
        assert r.status == 200 and gcs_emulator.read("tls-obj", gcs_bucket) == body
        # A client that trusts another CA refuses the server's certificate.
        other = TestCa(tmp_path / "other")
        with pytest.raises(ssl.SSLCertVerificationError):
            stranger = http.client.HTTPSConnection("127.0.0.1", proxy.port, timeout=60,
                                                   context=other.client_context())
            stranger.request("GET", "/__proxy/health")
