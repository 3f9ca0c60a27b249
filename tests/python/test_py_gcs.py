"""The Python module on gs://, against the GCS emulator behind the fault proxy
(tests/gcs); the official google-cloud-storage client checks what landed."""
import json

import ml_dtypes
import numpy as np
import pytest

import ckptio


def same(a, b):
    a, b = np.asarray(a), np.asarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def test_a_pytree_round_trips_through_gcs(gcs_root, gcs_client, gcs_bucket, small):
    rng = np.random.default_rng(5)
    tree = {"params": {"w": rng.standard_normal((300, 300)).astype(np.float32),
                       "b": np.arange(8).astype(ml_dtypes.bfloat16)},
            "layers": [np.ones(3, np.int8), (np.float64(2.5), 7)]}
    with ckptio.CheckpointManager(gcs_root, keep=2, shard_size="256KiB", gcs={"chunk_size": "256KiB"},
                                  **small) as mgr:
        for step in (10, 20, 30):
            mgr.save(step, tree, metadata={"step": step})
        mgr.wait_until_finished()
        assert mgr.all_steps() == [20, 30]
        back = mgr.restore()
        assert mgr.metadata(20) == {"step": 20}
    assert same(back["params"]["w"], tree["params"]["w"]) and same(back["params"]["b"], tree["params"]["b"])
    assert isinstance(back["layers"], list) and back["layers"][1][1] == 7
    # What the official client sees: the manifest last written, pruned steps gone.
    names = {b.name for b in gcs_client.list_blobs(gcs_bucket, prefix="run/")}
    assert "run/checkpoint_30/manifest.json" in names and not any("checkpoint_10/" in n for n in names)
    manifest = json.loads(gcs_client.bucket(gcs_bucket).blob("run/checkpoint_30/manifest.json")
                          .download_as_bytes())
    assert len(manifest["shards"]) > 1
    assert [t["name"] for t in manifest["tensors"]] == ["params/w", "params/b", "layers/0", "layers/1/0",
                                                        "layers/1/1"]


def test_the_flax_drop_in_on_gcs(gcs_root, flax_ckpt):
    for step in range(1, 6):
        path = flax_ckpt.save_checkpoint(gcs_root, {"params": {"w": np.full((64, 64), step, np.float32)},
                                                    "step": step}, step, keep=2)
        assert path == f"{gcs_root}/checkpoint_{step}"
    assert flax_ckpt.latest_checkpoint(gcs_root) == f"{gcs_root}/checkpoint_5"
    assert flax_ckpt.available_steps(gcs_root) == [4, 5]
    restored = flax_ckpt.restore_checkpoint(gcs_root, target={"params": {"w": None}, "step": 0})
    assert restored["step"] == 5 and same(restored["params"]["w"], np.full((64, 64), 5, np.float32))
    named = flax_ckpt.restore_checkpoint(f"{gcs_root}/checkpoint_4", target=None)
    assert named["step"] == 4


def test_a_failed_background_upload_raises_with_the_servers_message(gcs_root, gcs_proxy, small):
    with ckptio.CheckpointManager(gcs_root, gcs={"retry": {"max_attempts": 2}}, **small) as mgr:
        mgr.save(1, {"w": np.ones(1000)})
        mgr.wait_until_finished()
        gcs_proxy.set_rules([{"method": ["POST", "PUT"], "path": "/upload/", "status": 403,
                              "message": "ckptio-test: the bucket is read-only today"}])
        handle = mgr.save(2, {"w": np.zeros(1000)})  # the snapshot succeeds; the upload cannot
        with pytest.raises(ckptio.PermissionDeniedError, match="the bucket is read-only today") as e:
            mgr.wait_until_finished()
        assert isinstance(e.value, PermissionError) and e.value.code == "PermissionDenied"
        assert isinstance(handle.error(), ckptio.PermissionDeniedError)
        gcs_proxy.set_rules([])
        assert mgr.all_steps() == [1]   # nothing half-committed
        assert same(mgr.restore()["w"], np.ones(1000))


def test_incremental_saves_on_gcs_upload_what_changed_and_keep_what_is_referenced(gcs_root, gcs_client, gcs_bucket,
                                                                                 small):
    rng = np.random.default_rng(11)
    frozen = {f"base{i}": rng.standard_normal((256, 256)).astype(np.float32) for i in range(3)}  # 256 KiB each
    saved = {}
    with ckptio.CheckpointManager(gcs_root, keep=2, incremental=True, shard_size="256KiB", **small) as mgr:
        for step in range(1, 5):
            tree = {"base": frozen, "lora": np.full((32, 32), step, np.float32)}
            before = mgr.stats()
            mgr.save(step, tree)
            mgr.wait_until_finished()
            saved[step] = tree
            stats = mgr.stats()
            uploaded = stats["bytes_committed"] - before["bytes_committed"]
            if step > 1:  # the frozen 768 KiB are referenced, not uploaded again
                assert stats["bytes_reused"] - before["bytes_reused"] == 3 * 256 * 256 * 4
                assert uploaded < 16 * 1024
        assert mgr.all_steps() == [3, 4]
        for step in (3, 4):
            back = mgr.restore(step)
            assert same(back["lora"], saved[step]["lora"])
            assert all(same(back["base"][k], frozen[k]) for k in frozen)
    blobs = {b.name: b.size for b in gcs_client.list_blobs(gcs_bucket, prefix="run/")}
    # Step 1 is pruned (no manifest) but keeps the frozen shards steps 3 and 4 use; step 2 is gone.
    assert "run/checkpoint_1/manifest.json" not in blobs and not any("checkpoint_2/" in n for n in blobs)
    kept = sorted(n for n in blobs if n.startswith("run/checkpoint_1/"))
    manifest = json.loads(gcs_client.bucket(gcs_bucket).blob("run/checkpoint_4/manifest.json").download_as_bytes())
    assert manifest["format_version"] == 3
    referenced = sorted("run/" + s["name"] for s in manifest["shards"] if s["name"].startswith("checkpoint_1/"))
    assert kept == referenced and len(kept) == 3
