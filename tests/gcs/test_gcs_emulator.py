"""Self-tests of the emulator setup: the capabilities the C++ backend relies on, checked with raw HTTP.

The probe (probe_emulator.py) is the capability table of README.md; these tests pin it, for the
emulator as the tests run it (with the compatibility layer) and for the package alone (pristine),
so that an upgrade of gcp-storage-emulator that changes behaviour shows up here.
"""
from __future__ import annotations

import os
import socket
import threading
import urllib.parse
import uuid

import pytest

from emulator import GcsEmulator, wait_until
from probe_emulator import CHUNK, Raw, run

# What the package does differently from GCS without the compatibility layer (README.md).
PRISTINE_DEVIATIONS = {
    "resumable: status query after completion -> 200/201 + metadata",
    "ranged GET past end -> 416",
    "resumable: status query before any data -> 308 without Range",
    "resumable: overlapping resend accepted, Range advances",
    "resumable: non-final chunk < 256 KiB rejected (400)",
    "resumable: non-final chunk not a 256 KiB multiple: only the aligned part kept",
    "resumable: final chunk with wrong x-goog-hash crc32c rejected (400)",
    "resumable: DELETE session URI cancels (GCS: 499)",
    "resumable: query after cancel -> 404/410",
    "resumable: ifGenerationMatch=0 on existing -> 412 (at start or at finalize)",
    "simple upload ifGenerationMatch=0 again -> 412",
    "simple upload with wrong x-goog-hash crc32c -> 400",
    "multipart upload ifGenerationMatch=0 again -> 412",
    "list maxResults=2 paging via nextPageToken",
    "list delimiter + maxResults paging",
    "delete object -> 204",
    "error body {'error': {'code', 'message'}}",
    "GET ifGenerationMatch mismatch -> 412",
    "HTTP/1.1 keep-alive (server keeps the connection)",
    "Expect: 100-continue answered with 100",
}


def test_every_capability_with_compat_layer(gcs_emulator):
    results = run(gcs_emulator.url, f"probe-{uuid.uuid4().hex[:10]}")
    bad = [r for r in results if r[0] != "OK"]
    assert not bad, "\n".join(f"{s} {n}: {d}" for s, n, d in bad)
    assert len(results) >= 50


def test_pristine_package_deviates_exactly_as_documented():
    with GcsEmulator(bucket="pristine", pristine=True) as emu:
        results = run(emu.url, "probe-pristine")
    failed = {name for st, name, _ in results if st != "OK"}
    assert failed == PRISTINE_DEVIATIONS, (sorted(failed - PRISTINE_DEVIATIONS), sorted(PRISTINE_DEVIATIONS - failed))


def test_fresh_state_bucket_and_helpers(gcs_emulator):
    b = gcs_emulator.create_bucket()
    assert gcs_emulator.list(bucket=b) == []
    meta = gcs_emulator.upload("a/b c", b"xyz", bucket=b)
    assert meta["size"] == "3" and gcs_emulator.read("a/b c", bucket=b) == b"xyz"
    assert gcs_emulator.metadata("a/b c", bucket=b)["crc32c"] == meta["crc32c"]
    assert gcs_emulator.list("a/", bucket=b) == ["a/b c"]
    assert gcs_emulator.delete("a/b c", bucket=b) == 204
    assert gcs_emulator.metadata("a/b c", bucket=b) is None
    with pytest.raises(RuntimeError):
        gcs_emulator.create_bucket(b)  # 409


def test_listening_on_loopback_only(gcs_emulator):
    u = urllib.parse.urlsplit(gcs_emulator.url)
    assert u.hostname == "127.0.0.1"
    with open("/proc/net/tcp") as f:
        rows = [line.split() for line in f.readlines()[1:]]
    port_hex = f"{u.port:04X}"
    listening = [r[1] for r in rows if r[3] == "0A" and r[1].endswith(":" + port_hex)]
    assert listening == ["0100007F:" + port_hex]


def test_client_gone_mid_chunk_keeps_256k_aligned_prefix(gcs_emulator):
    b = gcs_emulator.create_bucket()
    raw = Raw(gcs_emulator.url)
    s, h, _ = raw.request("POST", f"/upload/storage/v1/b/{b}/o?uploadType=resumable&name=x", b"")
    loc = urllib.parse.urlsplit(h["location"])
    data = os.urandom(3 * CHUNK)
    sk = socket.create_connection(("127.0.0.1", urllib.parse.urlsplit(gcs_emulator.url).port))
    sk.sendall((f"PUT {loc.path}?{loc.query} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(data)}\r\n"
                f"Content-Range: bytes 0-{len(data) - 1}/*\r\n\r\n").encode() + data[:2 * CHUNK + 5000])
    sk.close()

    def committed():
        s, h, _ = raw.request("PUT", f"{loc.path}?{loc.query}", b"", {"Content-Range": "bytes */*"})
        return (s, h["range"]) if "range" in h else None
    assert wait_until(committed, "the emulator to keep a prefix of the cut chunk") == (308, f"bytes=0-{2 * CHUNK - 1}")
    # resume from the committed offset
    s, _, _ = raw.request("PUT", f"{loc.path}?{loc.query}", data[2 * CHUNK:],
                          {"Content-Range": f"bytes {2 * CHUNK}-{len(data) - 1}/{len(data)}"})
    assert s == 200 and gcs_emulator.read("x", bucket=b) == data


def test_a_stalled_upload_does_not_block_other_requests(gcs_emulator):
    b = gcs_emulator.create_bucket()
    sk = socket.create_connection(("127.0.0.1", urllib.parse.urlsplit(gcs_emulator.url).port), timeout=60)
    try:
        sk.sendall((f"POST /upload/storage/v1/b/{b}/o?uploadType=media&name=slow HTTP/1.1\r\nHost: x\r\n"
                    "Content-Length: 100000\r\n\r\n").encode() + b"x" * 1000)
        # Answered while the upload waits for the rest of its body, which it gets only afterwards:
        # a server that served one request at a time would never answer (the client's timeout ends it).
        assert gcs_emulator.list(bucket=b) == []
        sk.sendall(b"x" * 99_000)
        assert sk.makefile("rb").readline().split()[1] == b"200"
    finally:
        sk.close()
    assert gcs_emulator.read("slow", bucket=b) == b"x" * 100_000


def test_parallel_resumable_uploads(gcs_emulator):
    b = gcs_emulator.create_bucket()
    blobs = {f"p/{i}": os.urandom(CHUNK * 2 + i) for i in range(6)}
    errors = []

    def upload(name, data):
        try:
            raw = Raw(gcs_emulator.url)
            _, h, _ = raw.request("POST", f"/upload/storage/v1/b/{b}/o?uploadType=resumable&name={name}", b"")
            loc = h["location"]
            for off in range(0, len(data), CHUNK):
                part = data[off:off + CHUNK]
                last = off + len(part) == len(data)
                cr = f"bytes {off}-{off + len(part) - 1}/{len(data) if last else '*'}"
                st, _, _ = raw.request("PUT", loc, part, {"Content-Range": cr})
                assert st == (200 if last else 308)
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    ts = [threading.Thread(target=upload, args=kv) for kv in blobs.items()]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not errors
    assert all(gcs_emulator.read(n, bucket=b) == d for n, d in blobs.items())
