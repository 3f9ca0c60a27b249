"""The official google-cloud-storage client through the fault proxy, and the with_gcs.py launcher."""
from __future__ import annotations

import base64
import os
import socket
import subprocess
import sys

import google_crc32c

HERE = os.path.dirname(os.path.abspath(__file__))


def crc32c_b64(data: bytes) -> str:
    return base64.b64encode(google_crc32c.value(data).to_bytes(4, "big")).decode()


def test_official_client_round_trip_through_proxy(gcs_client, gcs_proxy, gcs_bucket, gcs_emulator):
    bucket = gcs_client.bucket(gcs_bucket)
    data = os.urandom(1024 * 1024 + 123)
    # blob.open("wb") always uses a resumable session, chunk by chunk ("bytes a-b/*"), like ckptio
    with bucket.blob("ckpt/shard-00000.safetensors").open("wb", chunk_size=256 * 1024, checksum="crc32c") as f:
        f.write(data)
    small = bucket.blob("ckpt/manifest.json")
    small.upload_from_string(b'{"step": 1}', if_generation_match=0)
    # read back: whole, ranged, metadata, list
    assert bucket.blob("ckpt/shard-00000.safetensors").download_as_bytes(checksum="crc32c") == data
    assert bucket.blob("ckpt/shard-00000.safetensors").download_as_bytes(start=10, end=99) == data[10:100]
    meta = bucket.get_blob("ckpt/shard-00000.safetensors")
    assert meta.crc32c == crc32c_b64(data) and meta.size == len(data)
    assert sorted(b.name for b in gcs_client.list_blobs(gcs_bucket, prefix="ckpt/")) == [
        "ckpt/manifest.json", "ckpt/shard-00000.safetensors"]
    it = gcs_client.list_blobs(gcs_bucket, delimiter="/")
    assert list(it) == [] and it.prefixes == {"ckpt/"}
    # the resumable upload went through the proxy chunk by chunk
    puts = [e for e in gcs_proxy.log() if e["method"] == "PUT"]
    assert [e["status"] for e in puts] == [308, 308, 308, 308, 200]
    assert all(e["request_body_bytes"] == 256 * 1024 for e in puts[:4])
    assert puts[-1]["headers"]["content-range"] == f"bytes {4 * 256 * 1024}-{len(data) - 1}/{len(data)}"
    assert puts[-1]["headers"]["x-goog-hash"] == f"crc32c={crc32c_b64(data)}"  # checked by the emulator
    # and the emulator has exactly the bytes
    assert gcs_emulator.read("ckpt/shard-00000.safetensors", bucket=gcs_bucket) == data


def test_official_client_recovers_from_injected_faults(gcs_client, gcs_proxy, gcs_bucket, gcs_emulator):
    gcs_proxy.set_rules([{"method": "PUT", "path": "upload_id=", "nth": 2, "status": 503},
                         {"method": "GET", "path": "alt=media", "nth": 1, "status": 503}])
    data = os.urandom(768 * 1024)
    with gcs_client.bucket(gcs_bucket).blob("retry").open("wb", chunk_size=256 * 1024) as f:
        f.write(data)
    assert gcs_client.bucket(gcs_bucket).blob("retry").download_as_bytes() == data
    assert gcs_emulator.read("retry", bucket=gcs_bucket) == data
    assert [r["fired"] for r in gcs_proxy.rules()] == [1, 1]


def _port_open(url: str) -> bool:
    host, port = url.split("//")[1].split(":")
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex((host, int(port))) == 0


def test_with_gcs_launcher_env_exit_status_and_cleanup(tmp_path):
    child = (
        "import json, os, sys, urllib.request\n"
        "keys = ['STORAGE_EMULATOR_HOST','CKPTIO_TEST_EMULATOR','CKPTIO_TEST_PROXY','CKPTIO_TEST_BUCKET',"
        "'CKPTIO_TEST_TOKEN_URI','CKPTIO_TEST_SA_KEY','CKPTIO_TEST_AUTHORIZED_USER','CKPTIO_TEST_METADATA_HOST']\n"
        "env = {k: os.environ[k] for k in keys}\n"
        "o = urllib.request.build_opener(urllib.request.ProxyHandler({}))\n"
        "r = o.open(env['STORAGE_EMULATOR_HOST'] + '/storage/v1/b/' + env['CKPTIO_TEST_BUCKET'] + '/o')\n"
        "assert r.status == 200\n"
        "assert os.path.exists(env['CKPTIO_TEST_SA_KEY']) and 'GOOGLE_APPLICATION_CREDENTIALS' not in os.environ\n"
        "json.dump(env, open(sys.argv[1], 'w'))\n"
        "sys.exit(int(sys.argv[2]))\n")
    out = tmp_path / "env.json"
    env = dict(os.environ, GOOGLE_APPLICATION_CREDENTIALS="/nonexistent.json")
    p = subprocess.run([sys.executable, os.path.join(HERE, "with_gcs.py"), "--quiet", "--proxy-log",
                        str(tmp_path / "log.json"), "--", sys.executable, "-c", child, str(out), "3"],
                       env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode == 3, p.stderr
    import json
    seen = json.loads(out.read_text())
    assert seen["STORAGE_EMULATOR_HOST"] == seen["CKPTIO_TEST_PROXY"] != seen["CKPTIO_TEST_EMULATOR"]
    assert all("127.0.0.1" in seen[k] for k in ("STORAGE_EMULATOR_HOST", "CKPTIO_TEST_EMULATOR",
                                                 "CKPTIO_TEST_TOKEN_URI", "CKPTIO_TEST_METADATA_HOST"))
    log = json.loads((tmp_path / "log.json").read_text())
    assert log[0]["path"].endswith("/o") and log[0]["status"] == 200
    # everything is gone afterwards
    assert not _port_open(seen["CKPTIO_TEST_EMULATOR"]) and not _port_open(seen["CKPTIO_TEST_PROXY"])
    assert not os.path.exists(seen["CKPTIO_TEST_SA_KEY"])


def test_with_gcs_cleans_up_after_a_crashing_child(tmp_path):
    child = ("import os, sys\n"
             "open(sys.argv[1], 'w').write(os.environ['CKPTIO_TEST_EMULATOR'] + ' ' + os.environ['CKPTIO_TEST_PROXY'])\n"
             "os.abort()\n")
    out = tmp_path / "urls"
    p = subprocess.run([sys.executable, os.path.join(HERE, "with_gcs.py"), "--quiet", "--",
                        sys.executable, "-c", child, str(out)], capture_output=True, text=True, timeout=60)
    assert p.returncode == 128 + 6, p.stderr  # SIGABRT
    emu, proxy = out.read_text().split()
    assert not _port_open(emu) and not _port_open(proxy)
