"""Probe a GCS JSON API endpoint (an emulator) with raw HTTP and print what it supports.

    python tests/gcs/probe_emulator.py http://127.0.0.1:PORT [--bucket NAME]

Every check uses plain ``http.client`` requests (no Google client), so what it reports is what a
libcurl-based client sees on the wire. Used to choose the emulator (see README.md) and to re-check
after upgrading it. Prints one line per check: ``OK``/``NO``/``ERR``, the check, details.
"""
from __future__ import annotations

import argparse
import base64
import hashlib
import http.client
import json
import os
import sys
import urllib.parse
import uuid

import google_crc32c

CHUNK = 256 * 1024


def crc32c_b64(data: bytes) -> str:
    return base64.b64encode(google_crc32c.value(data).to_bytes(4, "big")).decode()


def md5_b64(data: bytes) -> str:
    return base64.b64encode(hashlib.md5(data).digest()).decode()


class Raw:
    """One keep-alive HTTP/1.1 connection; reconnects when the server closed it."""

    def __init__(self, base: str):
        u = urllib.parse.urlsplit(base)
        self.host, self.port = u.hostname, u.port
        self.conn = None
        self.closed_by_server = 0

    def request(self, method, url, body=None, headers=None):
        headers = dict(headers or {})
        if url.startswith("http"):
            u = urllib.parse.urlsplit(url)
            url = u.path + ("?" + u.query if u.query else "")
        for _ in range(2):
            if self.conn is None:
                self.conn = http.client.HTTPConnection(self.host, self.port, timeout=30)
            try:
                self.conn.request(method, url, body=body, headers=headers)
                r = self.conn.getresponse()
                data = r.read()
                if r.will_close:
                    self.closed_by_server += 1
                    self.conn.close()
                    self.conn = None
                return r.status, {k.lower(): v for k, v in r.getheaders()}, data
            except (ConnectionError, http.client.RemoteDisconnected):
                self.conn.close()
                self.conn = None
        raise ConnectionError(f"{method} {url} failed twice")


def q(s: str) -> str:
    return urllib.parse.quote(s, safe="")


def run(base: str, bucket: str) -> list[tuple[str, str, str]]:
    raw = Raw(base)
    out: list[tuple[str, str, str]] = []

    def rec(name, ok, detail=""):
        out.append(("OK" if ok else "NO", name, detail))

    def guard(name, fn):
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - a probe reports, it does not stop
            out.append(("ERR", name, f"{type(e).__name__}: {e}"))

    # -- bucket
    def bucket_create():
        s, h, b = raw.request("POST", "/storage/v1/b?project=test", json.dumps({"name": bucket}),
                              {"Content-Type": "application/json"})
        rec("bucket create POST /storage/v1/b", s == 200, f"{s} {b[:80]!r}")
        s, h, b = raw.request("GET", f"/storage/v1/b/{bucket}")
        rec("bucket get", s == 200, f"{s}")
        s, h, b = raw.request("POST", "/storage/v1/b?project=test", json.dumps({"name": bucket}),
                              {"Content-Type": "application/json"})
        rec("bucket create again -> 409", s == 409, f"{s}")
        s, h, b = raw.request("GET", "/storage/v1/b/no-such-bucket-xyz/o")
        rec("list in missing bucket -> 404", s == 404, f"{s} {b[:120]!r}")
    guard("bucket", bucket_create)

    data = os.urandom(2 * CHUNK + 12345)
    total = len(data)
    name = "dir/resumable-" + uuid.uuid4().hex[:8]

    # -- resumable upload
    def start_session(nm, extra=""):
        s, h, b = raw.request(
            "POST", f"/upload/storage/v1/b/{bucket}/o?uploadType=resumable&name={q(nm)}{extra}",
            b"", {"Content-Length": "0"})
        return s, h.get("location", "")

    def resumable():
        s, loc = start_session(name)
        rec("resumable: POST ...?uploadType=resumable&name=N -> Location", s == 200 and bool(loc),
            f"{s} Location={loc}")
        if not loc:
            return
        s2, h2, _ = raw.request(
            "POST", f"/upload/storage/v1/b/{bucket}/o?uploadType=resumable",
            json.dumps({"name": name + "-meta"}), {"Content-Type": "application/json; charset=UTF-8",
                                                   "X-Upload-Content-Type": "application/octet-stream"})
        rec("resumable: POST with JSON body {name} -> Location", s2 == 200 and "location" in h2,
            f"{s2} Location={h2.get('location')}")
        s, h, b = raw.request("PUT", loc, data[:CHUNK], {"Content-Range": f"bytes 0-{CHUNK-1}/*"})
        rec("resumable: non-final chunk -> 308", s == 308, f"{s}")
        rec("resumable: 308 carries Range: bytes=0-262143", h.get("range") == f"bytes=0-{CHUNK-1}",
            f"Range={h.get('range')!r}")
        s, h, b = raw.request("PUT", loc, data[CHUNK:2 * CHUNK], {"Content-Range": f"bytes {CHUNK}-{2*CHUNK-1}/*"})
        rec("resumable: 2nd non-final chunk -> 308 Range: bytes=0-524287", s == 308 and h.get("range") == f"bytes=0-{2*CHUNK-1}",
            f"{s} Range={h.get('range')!r}")
        s, h, b = raw.request("PUT", loc, data[2 * CHUNK:],
                              {"Content-Range": f"bytes {2*CHUNK}-{total-1}/{total}",
                               "x-goog-hash": f"crc32c={crc32c_b64(data)}"})
        meta = json.loads(b) if s in (200, 201) else {}
        rec("resumable: final chunk 'bytes a-b/total' -> 200 + metadata", s in (200, 201), f"{s}")
        rec("resumable: final response crc32c (b64 big-endian)", meta.get("crc32c") == crc32c_b64(data),
            f"{meta.get('crc32c')} want {crc32c_b64(data)}")
        rec("resumable: final response md5Hash", meta.get("md5Hash") == md5_b64(data), f"{meta.get('md5Hash')}")
        rec("resumable: final response size/generation", str(meta.get("size")) == str(total) and bool(meta.get("generation")),
            f"size={meta.get('size')} generation={meta.get('generation')}")
        s, h, b = raw.request("PUT", loc, b"", {"Content-Range": "bytes */*"})
        rec("resumable: status query after completion -> 200/201 + metadata", s in (200, 201), f"{s} {b[:80]!r}")
        s, h, b = raw.request("GET", f"/storage/v1/b/{bucket}/o/{q(name)}")
        meta = json.loads(b) if s == 200 else {}
        rec("object metadata GET: crc32c + md5Hash", meta.get("crc32c") == crc32c_b64(data)
            and meta.get("md5Hash") == md5_b64(data), f"{s} crc32c={meta.get('crc32c')} md5={meta.get('md5Hash')}")
        s, h, b = raw.request("GET", f"/storage/v1/b/{bucket}/o/{q(name)}?alt=media")
        rec("media GET /storage/v1/b/B/o/N?alt=media", s == 200 and b == data, f"{s} len={len(b)}")
        rec("media GET: x-goog-hash response header", "crc32c=" in h.get("x-goog-hash", ""), f"{h.get('x-goog-hash')!r}")
        s, h, b = raw.request("GET", f"/download/storage/v1/b/{bucket}/o/{q(name)}?alt=media")
        rec("media GET /download/storage/v1/b/B/o/N?alt=media", s == 200 and b == data, f"{s} len={len(b)}")
        s, h, b = raw.request("GET", f"/download/storage/v1/b/{bucket}/o/{q(name)}?alt=media",
                              headers={"Range": "bytes=100-199"})
        rec("ranged GET Range: bytes=100-199 -> 206", s == 206 and b == data[100:200],
            f"{s} len={len(b)} Content-Range={h.get('content-range')!r}")
        s, h, b = raw.request("GET", f"/storage/v1/b/{bucket}/o/{q(name)}?alt=media",
                              headers={"Range": f"bytes={total-10}-"})
        rec("ranged GET open-ended 'bytes=N-' -> 206", s == 206 and b == data[-10:], f"{s} len={len(b)}")
        s, h, b = raw.request("GET", f"/storage/v1/b/{bucket}/o/{q(name)}?alt=media",
                              headers={"Range": f"bytes={total+10}-{total+20}"})
        rec("ranged GET past end -> 416", s == 416, f"{s}")
        bad_loc = loc.replace("upload_id=", "upload_id=nonexistent")
        s, h, b = raw.request("PUT", bad_loc, b"", {"Content-Range": "bytes */*"})
        rec("resumable: unknown upload_id -> 404", s == 404, f"{s}")
    guard("resumable", resumable)

    def resumable_query():
        nm = name + "-q"
        s, loc = start_session(nm)
        raw.request("PUT", loc, data[:CHUNK], {"Content-Range": f"bytes 0-{CHUNK-1}/*"})
        s, h, b = raw.request("PUT", loc, b"", {"Content-Range": "bytes */*"})
        rec("resumable: status query 'bytes */*' -> 308 + Range", s == 308 and h.get("range") == f"bytes=0-{CHUNK-1}",
            f"{s} Range={h.get('range')!r}")
        s, h, b = raw.request("PUT", loc, b"", {"Content-Range": f"bytes */{total}"})
        rec("resumable: status query 'bytes */TOTAL' -> 308 + Range", s == 308 and h.get("range") == f"bytes=0-{CHUNK-1}",
            f"{s} Range={h.get('range')!r}")
        s, h, b = raw.request("PUT", loc, data[CHUNK:], {"Content-Range": f"bytes {CHUNK}-{total-1}/{total}"})
        s2, h2, b2 = raw.request("GET", f"/storage/v1/b/{bucket}/o/{q(nm)}?alt=media")
        rec("resumable: upload completes correctly after status queries", s in (200, 201) and b2 == data,
            f"final {s}; object {s2} len={len(b2)} (want {total})")
        s, loc = start_session(nm + "-empty-query")
        s, h, b = raw.request("PUT", loc, b"", {"Content-Range": "bytes */*"})
        rec("resumable: status query before any data -> 308 without Range", s == 308 and "range" not in h,
            f"{s} Range={h.get('range')!r}")
    guard("resumable query", resumable_query)

    def resumable_overlap():
        nm = name + "-overlap"
        s, loc = start_session(nm)
        raw.request("PUT", loc, data[:CHUNK], {"Content-Range": f"bytes 0-{CHUNK-1}/*"})
        # resend from an offset before the committed one (the client missed the 308): GCS ignores the overlap
        s, h, b = raw.request("PUT", loc, data[CHUNK // 2:2 * CHUNK],
                              {"Content-Range": f"bytes {CHUNK//2}-{2*CHUNK-1}/*"})
        rec("resumable: overlapping resend accepted, Range advances", s == 308 and h.get("range") == f"bytes=0-{2*CHUNK-1}",
            f"{s} Range={h.get('range')!r} {b[:100]!r}")
        s, loc2 = start_session(nm + "-gap")
        raw.request("PUT", loc2, data[:CHUNK], {"Content-Range": f"bytes 0-{CHUNK-1}/*"})
        s, h, b = raw.request("PUT", loc2, data[:CHUNK],  # a full-size chunk, but 256 KiB past the commit
                              {"Content-Range": f"bytes {2*CHUNK}-{3*CHUNK-1}/*"})
        rec("resumable: chunk past the committed offset (gap) rejected", s >= 400 or h.get("range") == f"bytes=0-{CHUNK-1}",
            f"{s} Range={h.get('range')!r} {b[:100]!r}")
    guard("resumable overlap", resumable_overlap)

    def resumable_chunk_rules():
        nm = name + "-small"
        s, loc = start_session(nm)
        s, h, b = raw.request("PUT", loc, data[:1000], {"Content-Range": "bytes 0-999/*"})
        rec("resumable: non-final chunk < 256 KiB rejected (400)", s == 400, f"{s} {b[:80]!r}")
        s, loc = start_session(nm + "-unaligned")
        n = CHUNK + 1000
        s, h, b = raw.request("PUT", loc, data[:n], {"Content-Range": f"bytes 0-{n - 1}/*"})
        rec("resumable: non-final chunk not a 256 KiB multiple: only the aligned part kept", s == 308
            and h.get("range") == f"bytes=0-{CHUNK - 1}", f"{s} Range={h.get('range')!r}")
    guard("resumable chunk rules", resumable_chunk_rules)

    def resumable_badcrc():
        nm = name + "-badcrc"
        s, loc = start_session(nm)
        raw.request("PUT", loc, data[:CHUNK], {"Content-Range": f"bytes 0-{CHUNK-1}/*"})
        bad = crc32c_b64(b"not the data")
        s, h, b = raw.request("PUT", loc, data[CHUNK:],
                              {"Content-Range": f"bytes {CHUNK}-{total-1}/{total}",
                               "x-goog-hash": f"crc32c={bad}"})
        rec("resumable: final chunk with wrong x-goog-hash crc32c rejected (400)", s == 400, f"{s} {b[:100]!r}")
    guard("resumable bad crc", resumable_badcrc)

    def resumable_cancel():
        nm = "cancel-" + uuid.uuid4().hex[:6]
        s, h, b = raw.request("POST", f"/upload/storage/v1/b/{bucket}/o?uploadType=resumable&name={nm}",
                              b"", {"Content-Length": "0"})
        loc = h.get("location")
        s, h, b = raw.request("DELETE", loc)
        rec("resumable: DELETE session URI cancels (GCS: 499)", s == 499, f"{s}")
        s, h, b = raw.request("PUT", loc, b"", {"Content-Range": "bytes */*"})
        rec("resumable: query after cancel -> 404/410", s in (404, 410), f"{s}")
    guard("resumable cancel", resumable_cancel)

    def resumable_single_shot():
        nm = "single-" + uuid.uuid4().hex[:6]
        s, h, b = raw.request("POST", f"/upload/storage/v1/b/{bucket}/o?uploadType=resumable&name={nm}&ifGenerationMatch=0",
                              b"", {"Content-Length": "0"})
        loc = h.get("location")
        small = b"hello resumable"
        s, h, b = raw.request("PUT", loc, small, {"Content-Range": f"bytes 0-{len(small)-1}/{len(small)}"})
        rec("resumable: one-shot (whole object in one PUT)", s in (200, 201), f"{s}")
        s, h, b = raw.request("POST", f"/upload/storage/v1/b/{bucket}/o?uploadType=resumable&name={nm}&ifGenerationMatch=0",
                              b"", {"Content-Length": "0"})
        if s == 412:
            rec("resumable: ifGenerationMatch=0 on existing -> 412 (at start or at finalize)", True, "412 at session start")
        else:
            loc = h.get("location")
            s, h, b = raw.request("PUT", loc, small, {"Content-Range": f"bytes 0-{len(small)-1}/{len(small)}"})
            rec("resumable: ifGenerationMatch=0 on existing -> 412 (at start or at finalize)", s == 412, f"finalize {s}")
        nm = "empty-" + uuid.uuid4().hex[:6]
        s, h, b = raw.request("POST", f"/upload/storage/v1/b/{bucket}/o?uploadType=resumable&name={nm}", b"",
                              {"Content-Length": "0"})
        loc = h.get("location")
        s, h, b = raw.request("PUT", loc, b"", {"Content-Range": "bytes */0"})
        rec("resumable: empty object via 'bytes */0'", s in (200, 201), f"{s} {b[:60]!r}")
    guard("resumable one-shot", resumable_single_shot)

    # -- simple / multipart
    def simple():
        nm = "simple-" + uuid.uuid4().hex[:6]
        body = b"simple upload body"
        url = f"/upload/storage/v1/b/{bucket}/o?uploadType=media&name={nm}&ifGenerationMatch=0"
        s, h, b = raw.request("POST", url, body, {"Content-Type": "application/octet-stream"})
        meta = json.loads(b) if s == 200 else {}
        rec("simple upload uploadType=media ifGenerationMatch=0", s == 200 and meta.get("crc32c") == crc32c_b64(body),
            f"{s} crc32c={meta.get('crc32c')}")
        s, h, b = raw.request("POST", url, body, {"Content-Type": "application/octet-stream"})
        rec("simple upload ifGenerationMatch=0 again -> 412", s == 412, f"{s} {b[:120]!r}")
        nm2 = "simple-bad-" + uuid.uuid4().hex[:6]
        s, h, b = raw.request("POST", f"/upload/storage/v1/b/{bucket}/o?uploadType=media&name={nm2}", body,
                              {"Content-Type": "application/octet-stream", "x-goog-hash": f"crc32c={crc32c_b64(b'x')}"})
        rec("simple upload with wrong x-goog-hash crc32c -> 400", s == 400, f"{s} {b[:120]!r}")
        boundary = "ckptio-boundary"
        nm3 = "multi-" + uuid.uuid4().hex[:6]
        mp = (f"--{boundary}\r\nContent-Type: application/json; charset=UTF-8\r\n\r\n"
              + json.dumps({"name": nm3, "crc32c": crc32c_b64(body)})
              + f"\r\n--{boundary}\r\nContent-Type: application/octet-stream\r\n\r\n").encode() + body + \
            f"\r\n--{boundary}--\r\n".encode()
        url = f"/upload/storage/v1/b/{bucket}/o?uploadType=multipart&ifGenerationMatch=0"
        hdr = {"Content-Type": f"multipart/related; boundary={boundary}"}
        s, h, b = raw.request("POST", url, mp, hdr)
        rec("multipart upload ifGenerationMatch=0", s == 200, f"{s} {b[:100]!r}")
        s, h, b = raw.request("POST", url, mp, hdr)
        rec("multipart upload ifGenerationMatch=0 again -> 412", s == 412, f"{s}")
        mp_bad = mp.replace(crc32c_b64(body).encode(), crc32c_b64(b"zz").encode()).replace(nm3.encode(), (nm3 + "x").encode())
        s, h, b = raw.request("POST", url, mp_bad, hdr)
        rec("multipart with wrong crc32c in metadata -> 400", s == 400, f"{s} {b[:120]!r}")
    guard("simple/multipart", simple)

    # -- list
    def listing():
        pre = "lst-" + uuid.uuid4().hex[:6] + "/"
        names = [f"{pre}a/{i}" for i in range(3)] + [f"{pre}b/x", f"{pre}top1", f"{pre}top2", f"{pre}top3"]
        for nm in names:
            raw.request("POST", f"/upload/storage/v1/b/{bucket}/o?uploadType=media&name={q(nm)}", b"x",
                        {"Content-Type": "application/octet-stream"})
        s, h, b = raw.request("GET", f"/storage/v1/b/{bucket}/o?prefix={q(pre)}&delimiter=/")
        j = json.loads(b)
        rec("list prefix+delimiter: prefixes + items", sorted(j.get("prefixes", [])) == [pre + "a/", pre + "b/"]
            and len(j.get("items", [])) == 3, f"{s} prefixes={j.get('prefixes')} items={[i['name'] for i in j.get('items', [])]}")
        seen, token, pages = [], None, 0
        while pages < 20:
            url = f"/storage/v1/b/{bucket}/o?prefix={q(pre)}&maxResults=2" + (f"&pageToken={q(token)}" if token else "")
            s, h, b = raw.request("GET", url)
            j = json.loads(b)
            pages += 1
            seen += [i["name"] for i in j.get("items", [])]
            token = j.get("nextPageToken")
            if not token:
                break
        rec("list maxResults=2 paging via nextPageToken", sorted(seen) == sorted(names) and pages >= 4,
            f"pages={pages} got={len(seen)}/{len(names)}")
        seen, token, pages, prefixes = [], None, 0, []
        while pages < 20:
            url = f"/storage/v1/b/{bucket}/o?prefix={q(pre)}&delimiter=/&maxResults=2" + (f"&pageToken={q(token)}" if token else "")
            s, h, b = raw.request("GET", url)
            j = json.loads(b)
            pages += 1
            seen += [i["name"] for i in j.get("items", [])]
            prefixes += j.get("prefixes", [])
            token = j.get("nextPageToken")
            if not token:
                break
        rec("list delimiter + maxResults paging", pages >= 2 and sorted(seen) == sorted(names[-3:]) and sorted(set(prefixes)) == [pre + "a/", pre + "b/"],
            f"pages={pages} items={len(seen)} prefixes={sorted(set(prefixes))}")
        s, h, b = raw.request("GET", f"/storage/v1/b/{bucket}/o?prefix={q(pre)}&fields=items(name,size),nextPageToken")
        rec("list with fields= projection", s == 200, f"{s}")
        # delete
        s, h, b = raw.request("DELETE", f"/storage/v1/b/{bucket}/o/{q(names[0])}")
        rec("delete object -> 204", s == 204, f"{s}")
        s, h, b = raw.request("DELETE", f"/storage/v1/b/{bucket}/o/{q(names[0])}")
        rec("delete missing -> 404", s == 404, f"{s} {b[:120]!r}")
        try:
            err = json.loads(b)
            rec("error body {'error': {'code', 'message'}}", isinstance(err.get("error"), dict)
                and err["error"].get("code") == 404 and "message" in err["error"], f"{b[:120]!r}")
        except ValueError:
            rec("error body {'error': {'code', 'message'}}", False, f"not JSON: {b[:120]!r}")
        s, h, b = raw.request("GET", f"/storage/v1/b/{bucket}/o/{q(names[0])}")
        rec("metadata GET missing -> 404", s == 404, f"{s}")
        s, h, b = raw.request("GET", f"/storage/v1/b/{bucket}/o/{q(names[1])}?ifGenerationMatch=1")
        rec("GET ifGenerationMatch mismatch -> 412", s == 412, f"{s}")
    guard("list", listing)

    def keepalive():
        r2 = Raw(base)
        for _ in range(3):
            r2.request("GET", f"/storage/v1/b/{bucket}/o?maxResults=1")
        rec("HTTP/1.1 keep-alive (server keeps the connection)", r2.closed_by_server == 0,
            f"server closed {r2.closed_by_server}/3")
    guard("keep-alive", keepalive)

    def expect100():
        # libcurl sends 'Expect: 100-continue' for large PUT/POST bodies.
        nm = "expect-" + uuid.uuid4().hex[:6]
        import socket
        body = b"e" * 2048
        sk = socket.create_connection((raw.host, raw.port), timeout=1)
        sk.sendall((f"POST /upload/storage/v1/b/{bucket}/o?uploadType=media&name={nm} HTTP/1.1\r\n"
                    f"Host: {raw.host}:{raw.port}\r\nContent-Length: {len(body)}\r\n"
                    "Content-Type: application/octet-stream\r\nExpect: 100-continue\r\n\r\n").encode())
        try:
            first = sk.recv(200)
        except socket.timeout:
            first = b"(timeout)"
        got100 = first.startswith(b"HTTP/1.1 100") or first.startswith(b"HTTP/1.0 100")
        sk.sendall(body)
        rest = b""
        try:
            while b"\r\n\r\n" not in rest or len(rest) < 20:
                d = sk.recv(4096)
                if not d:
                    break
                rest += d
        except socket.timeout:
            pass
        sk.close()
        rec("Expect: 100-continue answered with 100", got100, f"first={first[:40]!r}")
    guard("expect", expect100)

    def chunked_req():
        nm = "chunked-" + uuid.uuid4().hex[:6]
        conn = http.client.HTTPConnection(raw.host, raw.port, timeout=10)
        conn.request("POST", f"/upload/storage/v1/b/{bucket}/o?uploadType=media&name={nm}",
                     body=iter([b"abc", b"defg"]), headers={"Content-Type": "application/octet-stream"},
                     encode_chunked=True)
        r = conn.getresponse()
        b = r.read()
        conn.close()
        meta = json.loads(b) if r.status == 200 else {}
        rec("request body with Transfer-Encoding: chunked", r.status == 200 and str(meta.get("size")) == "7",
            f"{r.status} size={meta.get('size')}")
    guard("chunked", chunked_req)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("base", help="emulator base URL, e.g. http://127.0.0.1:4443")
    ap.add_argument("--bucket", default="probe-" + uuid.uuid4().hex[:8])
    a = ap.parse_args(argv)
    res = run(a.base.rstrip("/"), a.bucket)
    for st, name, detail in res:
        print(f"{st:3} {name:70} {detail}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
