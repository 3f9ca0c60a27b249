"""ckptio on gs:// against the GCS emulator, read back and written by the
official google-cloud-storage client."""
import base64
import json

import google_crc32c
import numpy as np
import pytest
from safetensors.numpy import load, save_file


def crc32c_b64(data: bytes) -> str:
    return base64.b64encode(google_crc32c.value(data).to_bytes(4, "big")).decode()


def sample(tmp_path):
    rng = np.random.default_rng(7)
    tensors = {
        "w": rng.standard_normal((600, 700)).astype(np.float32),   # > 1 shard at 1 MiB
        "b": rng.integers(-5, 5, size=(300,), dtype=np.int64),
        "mask": rng.integers(0, 2, size=(17, 3)).astype(np.bool_),
        "scalar": np.array(3.5, dtype=np.float64),
    }
    path = tmp_path / "in.safetensors"
    save_file(tensors, str(path))
    return tensors, path


def test_the_official_client_reads_back_what_ckptio_wrote(tmp_path, run, gcs_env, gcs_client, gcs_bucket):
    tensors, path = sample(tmp_path)
    config = tmp_path / "c.json"
    config.write_text('{"shard_size": "1MiB", "gcs": {"chunk_size": "256KiB"}}')
    run("save", f"gs://{gcs_bucket}/run", "--step", 1, "--from", path, "--config", config, env=gcs_env)

    bucket = gcs_client.bucket(gcs_bucket)
    manifest = json.loads(bucket.blob("run/checkpoint_1/manifest.json").download_as_bytes())
    assert len(manifest["shards"]) > 1
    got = {}
    for shard in manifest["shards"]:
        blob = bucket.get_blob(f"run/checkpoint_1/{shard['name']}")
        data = blob.download_as_bytes()
        assert len(data) == shard["bytes"] == blob.size
        assert blob.crc32c == crc32c_b64(data)                       # the server's CRC of what it stored
        assert f"{google_crc32c.value(data):08x}" == shard["crc32c"]  # equals ckptio's
        got.update(load(data))
    assert sorted(got) == sorted(tensors)
    for name, value in tensors.items():
        assert got[name].dtype == value.dtype and got[name].shape == value.shape
        assert got[name].tobytes() == value.tobytes(), name


# A 200 whose body is cut after 100 bytes, framed as complete: the server
# committed the object, the answer that says so arrived broken.
CUT_ANSWERS = {
    "the last chunk of a resumable upload": {"method": "PUT", "path": "upload_id=",
                                             "headers": {"Content-Range": r"/\d+$"}},
    "a one-request upload": {"method": "POST", "path": r"uploadType=media&name=cut%2Fcheckpoint_1%2Fshard"},
    "the manifest's commit": {"method": "POST", "path": r"uploadType=media&name=cut%2Fcheckpoint_1%2Fmanifest"},
}


@pytest.mark.parametrize("where", list(CUT_ANSWERS))
def test_a_200_cut_after_100_bytes_is_confirmed_by_the_stored_object(where, tmp_path, run, gcs_env, gcs_proxy,
                                                                     gcs_client, gcs_bucket):
    tensors, path = sample(tmp_path)
    config = tmp_path / "c.json"
    config.write_text('{"shard_size": "1MiB", "gcs": {"chunk_size": "256KiB"}}')
    gcs_proxy.set_rules([{**CUT_ANSWERS[where], "nth": 1, "truncate_response_body": 100}])
    run("save", f"gs://{gcs_bucket}/cut", "--step", 1, "--from", path, "--config", config, env=gcs_env)
    assert [r["fired"] for r in gcs_proxy.rules()] == [1]
    cut = [e for e in gcs_proxy.log() if e["action"] == "truncate"]
    assert len(cut) == 1 and cut[0]["status"] == 200 and cut[0]["response_body_bytes"] == 100
    gcs_proxy.set_rules([])

    bucket = gcs_client.bucket(gcs_bucket)
    manifest = json.loads(bucket.blob("cut/checkpoint_1/manifest.json").download_as_bytes())
    got = {}
    for shard in manifest["shards"]:
        blob = bucket.get_blob(f"cut/checkpoint_1/{shard['name']}")
        data = blob.download_as_bytes()
        assert len(data) == shard["bytes"] == blob.size
        assert blob.crc32c == crc32c_b64(data)
        assert f"{google_crc32c.value(data):08x}" == shard["crc32c"]
        got.update(load(data))
    assert sorted(got) == sorted(tensors)
    for name, value in tensors.items():
        assert got[name].tobytes() == value.tobytes(), name


def test_ckptio_restores_a_checkpoint_the_official_client_uploaded(tmp_path, run, gcs_env, gcs_client, gcs_bucket):
    tensors, path = sample(tmp_path)
    local = tmp_path / "local"
    run("save", local, "--step", 42, "--from", path)
    bucket = gcs_client.bucket(gcs_bucket)
    # Shards first, the manifest last: the commit order ckptio relies on.
    files = sorted((local / "checkpoint_42").iterdir(), key=lambda p: p.name == "manifest.json")
    for f in files:
        bucket.blob(f"uploaded/checkpoint_42/{f.name}").upload_from_filename(str(f))
    assert "step 42" in run("ls", f"gs://{gcs_bucket}/uploaded", env=gcs_env).stdout
    assert run("verify", f"gs://{gcs_bucket}/uploaded", env=gcs_env).returncode == 0
    out = tmp_path / "out.safetensors"
    run("export", f"gs://{gcs_bucket}/uploaded", "--out", out, env=gcs_env)
    got = load(out.read_bytes())
    assert sorted(got) == sorted(tensors)
    for name, value in tensors.items():
        assert got[name].tobytes() == value.tobytes(), name


def test_a_corrupted_object_fails_verify_with_exit_2(tmp_path, run, gcs_env, gcs_client, gcs_bucket):
    tensors, path = sample(tmp_path)
    run("save", f"gs://{gcs_bucket}/c", "--step", 1, "--from", path, env=gcs_env)
    bucket = gcs_client.bucket(gcs_bucket)
    blob = bucket.blob("c/checkpoint_1/shard-00000.safetensors")
    data = bytearray(blob.download_as_bytes())
    data[5000] ^= 0xFF  # inside the first tensor's bytes (data starts at 4096)
    blob.upload_from_string(bytes(data))
    p = run("verify", f"gs://{gcs_bucket}/c", check=False, env=gcs_env)
    assert p.returncode == 2
    assert "shard-00000.safetensors: tensor" in p.stderr and "CRC32C mismatch" in p.stderr
