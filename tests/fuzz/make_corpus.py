#!/usr/bin/env python3
"""Writes the seed corpora of the fuzz targets: tests/fuzz/corpus/<target>/.

The valid seeds are real files: a safetensors file written by the Python
`safetensors` package, the shard and manifest.json that `ckptio save` and
`ckptio demo` write, and `ckptio config defaults`. The broken seeds are
hand-made from them: truncated, bad lengths, hostile names, huge sizes,
duplicate keys, NUL bytes, deep nesting. Run it with the project's venv (it
needs numpy and safetensors) and a built CLI:

  .venv/bin/python tests/fuzz/make_corpus.py --ckptio build/src/cli/ckptio

It replaces the corpus directories (not the regressions). The fuzzers' own
discoveries are not kept in git: they live in build-fuzz/corpus/.
"""
import argparse
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile

import numpy as np
from safetensors.numpy import save_file

HERE = os.path.dirname(os.path.abspath(__file__))
CORPUS = os.path.join(HERE, "corpus")


def write(target, name, data):
    if isinstance(data, str):
        data = data.encode()
    with open(os.path.join(CORPUS, target, name), "wb") as f:
        f.write(data)


def st_file(header, data=b"", length=None):
    """A safetensors file: 8-byte length, header (dict or raw bytes), data."""
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    n = len(raw) if length is None else length
    return struct.pack("<Q", n) + raw + data


def run(cmd, **kw):
    return subprocess.run(cmd, check=True, capture_output=True, text=True, **kw).stdout


# ---- safetensors -----------------------------------------------------------

def safetensors_seeds(tmp, ckptio):
    t = "fuzz_safetensors"
    py = os.path.join(tmp, "py.safetensors")
    save_file({
        "embed.weight": np.arange(6, dtype=np.float32).reshape(2, 3),
        "layers.0/bias": np.array([1, 2], dtype=np.float16),
        "step": np.array(7, dtype=np.int64),
        "mask": np.array([True, False, True]),
        "empty": np.zeros((0, 4), dtype=np.uint8),
    }, py, metadata={"format": "np", "note": "written by safetensors"})
    with open(py, "rb") as f:
        valid = f.read()
    write(t, "valid-python-safetensors", valid)
    (n,) = struct.unpack("<Q", valid[:8])
    header = json.loads(valid[8:8 + n])
    data = valid[8 + n:]

    # The shard ckptio writes from it (header padded with spaces to 4 KiB).
    root = os.path.join(tmp, "ckpt")
    run([ckptio, "save", root, "--step", "1", "--from", py, "--metadata", '{"run":"fuzz"}'])
    shard_dir = os.path.join(root, "checkpoint_1")
    shard = sorted(f for f in os.listdir(shard_dir) if f.endswith(".safetensors"))[0]
    with open(os.path.join(shard_dir, shard), "rb") as f:
        write(t, "valid-ckptio-shard", f.read())

    write(t, "valid-empty-header", st_file({}))
    write(t, "valid-metadata-only", st_file({"__metadata__": {"a": "b"}}))
    write(t, "valid-scalar-and-zero", st_file(
        {"s": {"dtype": "F64", "shape": [], "data_offsets": [0, 8]},
         "z": {"dtype": "BF16", "shape": [3, 0], "data_offsets": [8, 8]},
         "f8": {"dtype": "F8_E4M3", "shape": [2], "data_offsets": [8, 10]}},
        b"\x00" * 10))

    write(t, "bad-truncated-length", valid[:5])
    write(t, "bad-truncated-header", valid[:8 + n // 2])
    write(t, "bad-truncated-data", valid[:-3])
    write(t, "bad-length-past-end", st_file({}, length=1000))
    write(t, "bad-length-huge", struct.pack("<Q", 2**64 - 1) + b"{}")
    write(t, "bad-length-over-limit", struct.pack("<Q", 100_000_001) + b"{}")
    write(t, "bad-not-object", st_file([1, 2]))
    write(t, "bad-json", st_file(b'{"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]'))
    write(t, "bad-duplicate-key", st_file(
        b'{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},'
        b'"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}', b"\x00"))
    for i, name in enumerate(["../../etc/passwd", "/etc/passwd", "a\u0000b", "__metadata__",
                              "a/../../b", ""]):
        write(t, f"bad-name-{i}", st_file(
            {name: {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}}, b"\x00"))
    write(t, "bad-name-invalid-utf8", st_file(
        b'{"\xff\xfe":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}', b"\x00"))
    bad = dict(header)
    bad["embed.weight"] = dict(bad["embed.weight"], data_offsets=[0, 2**64 - 1])
    write(t, "bad-offset-huge", st_file(bad, data))
    write(t, "bad-shape-overflow", st_file(
        {"x": {"dtype": "F32", "shape": [2**32, 2**32, 2**32], "data_offsets": [0, 0]}}))
    write(t, "bad-overlap", st_file(
        {"a": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]},
         "b": {"dtype": "U8", "shape": [2], "data_offsets": [1, 3]}}, b"\x00" * 3))
    write(t, "bad-hole", st_file(
        {"a": {"dtype": "U8", "shape": [1], "data_offsets": [1, 2]}}, b"\x00" * 2))
    write(t, "bad-dtype", st_file({"a": {"dtype": "F31", "shape": [1], "data_offsets": [0, 4]}},
                                  b"\x00" * 4))
    write(t, "bad-metadata-deep", st_file(
        b'{"__metadata__":' + b"[" * 200 + b"]" * 200 + b"}"))
    write(t, "bad-deep-nesting", st_file(b"[" * 5000 + b"]" * 5000))


# ---- manifest ----------------------------------------------------------------

def manifest_seeds(tmp, ckptio):
    t = "fuzz_manifest"
    with open(os.path.join(tmp, "ckpt", "checkpoint_1", "manifest.json")) as f:
        saved = f.read()
    write(t, "valid-ckptio-save", saved)
    demo = os.path.join(tmp, "demo")
    run([ckptio, "demo", "--state-size", "8MiB", "--saves", "1", "--compute", "0s",
         "--dir", demo])
    manifests = sorted(os.path.join(d, "manifest.json") for d, _, files in os.walk(demo)
                       if "manifest.json" in files)
    with open(manifests[-1]) as f:
        write(t, "valid-ckptio-demo", f.read())

    m = json.loads(saved)

    def variant(name, change):
        v = json.loads(json.dumps(m))
        change(v)
        write(t, name, json.dumps(v, indent=1))

    shard0 = m["shards"][0]["name"]

    def rename_shard(new):
        def change(v):
            v["shards"][0]["name"] = new
            for tensor in v["tensors"]:
                tensor["shard"] = new
        return change

    for i, name in enumerate(["../../etc/passwd", "/etc/passwd", ".", "..", "a/b",
                              "shard\u0000.safetensors", "", "x" * 300]):
        variant(f"bad-shard-name-{i}", rename_shard(name))
    variant("bad-tensor-name-dotdot", lambda v: v["tensors"][0].update(name="../../x"))
    variant("bad-tensor-name-nul", lambda v: v["tensors"][0].update(name="a\u0000b"))
    variant("bad-offset-overflow", lambda v: v["tensors"][0].update(offset=2**64 - 1))
    variant("bad-offset-past-shard",
            lambda v: v["tensors"][0].update(offset=v["shards"][0]["bytes"]))
    variant("bad-shard-huge", lambda v: v["shards"][0].update(bytes=2**51 + 1))
    variant("bad-shape-huge", lambda v: v["tensors"][0].update(shape=[2**40, 2**40]))
    variant("bad-unknown-shard", lambda v: v["tensors"][0].update(shard="other"))
    variant("bad-crc", lambda v: v["shards"][0].update(crc32c="xyz"))
    variant("bad-version", lambda v: v.update(format_version=3))
    variant("bad-step-negative", lambda v: v.update(step=-1))
    variant("bad-created", lambda v: v.update(created="2024-13-01T00:00:00Z"))
    variant("bad-unknown-field", lambda v: v.update(extra=1))
    variant("bad-overlap", lambda v: v["tensors"][1].update(offset=v["tensors"][0]["offset"]))
    variant("bad-shard-twice", lambda v: v["shards"].append(dict(v["shards"][0])))
    variant("bad-tensor-twice", lambda v: v["tensors"].append(dict(v["tensors"][0])))

    # format_version 2: "embed.weight" [2, 3] as two chunks of one row each,
    # at the offsets of its rows (a reader checks CRCs against the data only).
    def chunk_embed(v):
        v["format_version"] = 2
        tensors = []
        for t in v["tensors"]:
            if t["name"] != "embed.weight":
                tensors.append(t)
                continue
            rows, row_bytes = t["shape"][0], t["bytes"] // t["shape"][0]
            for r in range(rows):
                tensors.append(dict(t, name=f"embed.weight@{r},0", array="embed.weight",
                                    global_shape=t["shape"], start=[r, 0], shape=[1] + t["shape"][1:],
                                    offset=t["offset"] + r * row_bytes, bytes=row_bytes))
        v["tensors"] = tensors

    def chunk_embed_then(change):
        def both(v):
            chunk_embed(v)
            change(v)
        return both

    def drop_tensor(name):
        return lambda v: v.update(tensors=[t for t in v["tensors"] if t["name"] != name])

    variant("valid-chunked", chunk_embed)
    variant("bad-chunk-gap", chunk_embed_then(drop_tensor("embed.weight@1,0")))
    variant("bad-chunk-version-1", chunk_embed_then(lambda v: v.update(format_version=1)))
    for depth in (62, 63, 64, 200):
        nested = json.loads("[" * depth + "]" * depth)
        variant(f"metadata-depth-{depth}", lambda v, n=nested: v.update(metadata={"d": n}))
    write(t, "bad-duplicate-key", saved.replace('"step"', '"step": 5, "step"', 1))
    write(t, "bad-truncated", saved[: len(saved) // 2])
    write(t, "bad-nul", saved[:40] + "\0" + saved[40:])
    write(t, "bad-not-object", "[]")
    write(t, "bad-number-overflow", saved.replace('"metadata": {', '"metadata": {"x": 1e400, ', 1))
    assert shard0


# ---- config ------------------------------------------------------------------

def config_seeds(ckptio):
    t = "fuzz_config"
    write(t, "valid-defaults", run([ckptio, "config", "defaults"]))
    write(t, "valid-empty", "{}")
    write(t, "valid-some", json.dumps({
        "shard_size": "512MiB", "snapshot": "borrow", "keep": 0, "prefix": "",
        "io": {"block_size": 1048576, "direct": False},
        "gcs": {"endpoint": "http://user:secret@127.0.0.1:9023/x", "chunk_size": "16MB",
                "headers": {"Authorization": "Bearer abc", "X-Trace": "1"},
                "retry": {"max_attempts": 3, "initial_backoff": 0.25, "deadline": "1h30m"},
                "http_version": "2"},
        "preemption": {"on_sigterm": True, "grace": "1.5s"}}))
    write(t, "valid-comments", '// c\n{ /* block */ "keep": 1e3, "threads": 4 }\n')
    write(t, "bad-dotted-key", '{"io.block_size": "4MiB"}')
    write(t, "bad-unknown-key", '{"io": {"blocksize": "4MiB"}}')
    write(t, "bad-duplicate-key", '{"keep": 1, "keep": 2}')
    write(t, "bad-duplicate-nested", '{"gcs": {"retry": {"deadline": "1s", "deadline": "2s"}}}')
    write(t, "bad-size-huge", '{"shard_size": "18446744073709551616B"}')
    write(t, "bad-size-fraction", '{"staging_memory": "1.0000000000000000001GiB"}')
    write(t, "bad-duration-huge", '{"gcs": {"retry": {"deadline": "300000000000h"}}}')
    write(t, "bad-duration-number", '{"preemption": {"grace": 1e300}}')
    write(t, "bad-negative", '{"keep": -1, "shard_size": -5}')
    write(t, "bad-header-crlf", '{"gcs": {"headers": {"X-A": "a\\r\\nHost: evil"}}}')
    write(t, "bad-prefix-slash", '{"prefix": "../../etc/"}')
    write(t, "bad-trace-nul", '{"trace": {"path": "/tmp/t\\u0000.json"}}')
    write(t, "bad-enum-nested", '{"snapshot": ' + "[" * 100 + "]" * 100 + "}")
    write(t, "bad-deep-nesting", "[" * 5000 + "]" * 5000)
    write(t, "bad-unterminated-comment", '{"keep": 1 /* ')
    write(t, "bad-not-object", '"keep"')
    write(t, "bad-nul-byte", '{"keep":\0 1}')


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ckptio", required=True, help="the ckptio CLI binary")
    args = ap.parse_args()
    ckptio = os.path.abspath(args.ckptio)
    for target in ("fuzz_safetensors", "fuzz_manifest", "fuzz_config"):
        shutil.rmtree(os.path.join(CORPUS, target), ignore_errors=True)
        os.makedirs(os.path.join(CORPUS, target))
    with tempfile.TemporaryDirectory() as tmp:
        safetensors_seeds(tmp, ckptio)
        manifest_seeds(tmp, ckptio)
        config_seeds(ckptio)
    return 0


if __name__ == "__main__":
    sys.exit(main())
