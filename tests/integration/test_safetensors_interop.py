"""ckptio's shards are safetensors files that the `safetensors` package from
PyPI reads, and ckptio commits files that package wrote."""
import json
import os

import google_crc32c
import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import load_file, save_file

DTYPES = [np.float32, np.float16, np.float64, np.int8, np.int16, np.int32, np.int64,
          np.uint8, np.uint16, np.uint32, np.uint64, np.bool_]


def random_tensors(seed, prefix, count=8):
    rng = np.random.default_rng(seed)
    out = {}
    for i in range(count):
        dtype = DTYPES[i % len(DTYPES)]
        shape = tuple(int(x) for x in rng.integers(1, 40, size=int(rng.integers(0, 4))))
        raw = rng.integers(0, 256, size=int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize,
                           dtype=np.uint8)
        if dtype == np.bool_:
            raw = raw % 2
        out[f"{prefix}/t{i}"] = raw.view(dtype).reshape(shape)
    out[f"{prefix}/big"] = rng.standard_normal((700, 1000)).astype(np.float32)  # > 1 shard at 1 MiB
    return out


def load_checkpoint(step_dir):
    manifest = json.load(open(os.path.join(step_dir, "manifest.json")))
    tensors = {}
    for shard in manifest["shards"]:
        tensors.update(load_file(os.path.join(step_dir, shard["name"])))
    return manifest, tensors


@pytest.fixture
def inputs(tmp_path):
    a = random_tensors(1, "enc")
    b = random_tensors(2, "dec")
    save_file(a, str(tmp_path / "a.safetensors"))
    save_file(b, str(tmp_path / "b.safetensors"), metadata={"origin": "numpy"})
    return {**a, **b}, tmp_path / "a.safetensors", tmp_path / "b.safetensors"


def test_committed_files_load_back_equal_with_the_safetensors_package(tmp_path, inputs, run):
    expected, a, b = inputs
    root = tmp_path / "ckpt"
    config = tmp_path / "c.json"
    config.write_text('{"shard_size": "1MiB"}')
    run("save", root, "--step", 5, "--from", a, "--from", b, "--config", config)
    manifest, got = load_checkpoint(root / "checkpoint_5")
    assert len(manifest["shards"]) > 1
    assert sorted(got) == sorted(expected)
    for name, value in expected.items():
        assert got[name].dtype == value.dtype, name
        assert got[name].shape == value.shape, name
        assert got[name].tobytes() == value.tobytes(), name  # bit-exact (random floats include NaNs)


def test_manifest_crc32c_matches_the_bytes_python_reads(tmp_path, inputs, run):
    _, a, b = inputs
    root = tmp_path / "ckpt"
    run("save", root, "--step", 1, "--from", a, "--from", b)
    manifest, got = load_checkpoint(root / "checkpoint_1")
    for t in manifest["tensors"]:
        crc = google_crc32c.value(np.ascontiguousarray(got[t["name"]]).tobytes())
        assert f"{crc:08x}" == t["crc32c"], t["name"]
    for s in manifest["shards"]:
        data = (root / "checkpoint_1" / s["name"]).read_bytes()
        assert len(data) == s["bytes"]
        assert f"{google_crc32c.value(data):08x}" == s["crc32c"], s["name"]


def test_export_writes_one_safetensors_file_equal_to_the_checkpoint(tmp_path, inputs, run):
    expected, a, b = inputs
    root = tmp_path / "ckpt"
    run("save", root, "--step", 3, "--from", a, "--from", b)
    out = tmp_path / "all.safetensors"
    run("export", root, "--out", out)
    got = load_file(str(out))
    assert sorted(got) == sorted(expected)
    for name, value in expected.items():
        assert got[name].tobytes() == value.tobytes(), name  # bit-exact (random floats include NaNs)


def test_demo_checkpoints_load_with_the_safetensors_package(tmp_path, run):
    run("demo", "--state-size", "32MiB", "--saves", 2, "--compute", "0.1s", "--dir", tmp_path / "demo")
    step_dirs = sorted((tmp_path / "demo" / "async").glob("checkpoint_*"))
    assert step_dirs
    manifest = json.load(open(step_dirs[-1] / "manifest.json"))
    numpy_dtypes = {"F64", "F32", "F16", "I64", "I32", "I16", "I8", "U64", "U32", "U16", "U8", "BOOL"}
    checked = 0
    for shard in manifest["shards"]:
        with safe_open(str(step_dirs[-1] / shard["name"]), framework="np") as f:
            in_shard = [t for t in manifest["tensors"] if t["shard"] == shard["name"]]
            assert sorted(f.keys()) == sorted(t["name"] for t in in_shard)
            for t in in_shard:
                if t["dtype"] not in numpy_dtypes:  # bfloat16/float8: numpy has no such dtype
                    continue
                value = f.get_tensor(t["name"])
                assert list(value.shape) == t["shape"]
                assert f"{google_crc32c.value(np.ascontiguousarray(value).tobytes()):08x}" == t["crc32c"]
                checked += 1
    assert checked > 0
