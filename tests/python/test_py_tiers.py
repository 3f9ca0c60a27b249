"""Two tiers (config "tiers"): saves commit to the local directory, committed steps are copied to
the GCS emulator in the background (tests/gcs), reads take the newest step of either tier. The
official google-cloud-storage client checks what landed in the bucket."""
import json
import os

import numpy as np

import ckptio


def same(a, b):
    a, b = np.asarray(a), np.asarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def state(step):
    return {"w": np.full((128, 128), step, np.float32), "b": np.arange(64, dtype=np.int64) * step}


def objects(client, bucket, prefix="run/"):
    return {b.name: b for b in client.list_blobs(bucket, prefix=prefix)}


def test_committed_steps_are_copied_to_the_remote_tier_which_keeps_its_own(tmp_path, gcs_root, gcs_client,
                                                                            gcs_bucket, small):
    local = str(tmp_path / "local")
    with ckptio.CheckpointManager(local, keep=2, tiers={"remote": gcs_root, "remote_keep": 3}, **small) as mgr:
        for step in range(1, 5):
            mgr.save(step, state(step))
        mgr.wait_until_finished(tier="remote")
        assert mgr.stats()["steps_replicated"] == 4
        assert sorted(d for d in os.listdir(local) if d.startswith("checkpoint_")) == ["checkpoint_3", "checkpoint_4"]
        assert mgr.all_steps() == [2, 3, 4]  # step 2 only in the remote tier now
        assert same(mgr.restore(2)["w"], state(2)["w"])
        assert same(mgr.restore()["b"], state(4)["b"])
    blobs = objects(gcs_client, gcs_bucket)
    assert not any("checkpoint_1/" in n for n in blobs)
    for step in (2, 3, 4):
        assert f"run/checkpoint_{step}/manifest.json" in blobs
    # The remote copy is the local checkpoint, byte for byte.
    with open(f"{local}/checkpoint_4/manifest.json", "rb") as f:
        assert blobs["run/checkpoint_4/manifest.json"].download_as_bytes() == f.read()
    for name in os.listdir(f"{local}/checkpoint_4"):
        with open(f"{local}/checkpoint_4/{name}", "rb") as f:
            assert blobs[f"run/checkpoint_4/{name}"].download_as_bytes() == f.read()


def test_a_new_machine_restores_from_the_remote_tier_and_a_damaged_local_copy_falls_back(tmp_path, gcs_root,
                                                                                         small, capfd):
    tiers = {"remote": gcs_root}
    local = tmp_path / "local"
    with ckptio.CheckpointManager(str(local), tiers=tiers, **small) as mgr:
        for step in (10, 20):
            mgr.save(step, state(step))
        mgr.wait_until_finished(tier="remote")
    # A shard of the newest local step is damaged: the read takes the remote copy, and says so.
    shard = next(p for p in (local / "checkpoint_20").iterdir() if p.name.startswith("shard-"))
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0xFF
    shard.write_bytes(bytes(data))
    with ckptio.CheckpointManager(str(local), tiers=tiers, **small) as mgr:
        back = mgr.restore(20)
        assert same(back["w"], state(20)["w"])
    assert "is damaged" in capfd.readouterr().err
    # A machine with an empty local disk: the newest step comes from the remote tier.
    with ckptio.CheckpointManager(str(tmp_path / "fresh"), tiers=tiers, **small) as mgr:
        assert mgr.latest_step() == 20
        assert same(mgr.restore()["b"], state(20)["b"])


def test_incremental_steps_copied_to_the_remote_tier_refer_to_what_it_already_has(tmp_path, gcs_root, gcs_client,
                                                                                  gcs_bucket, small):
    frozen = np.random.default_rng(3).standard_normal((256, 256)).astype(np.float32)  # 256 KiB
    with ckptio.CheckpointManager(str(tmp_path / "local"), keep=1, incremental=True, shard_size="256KiB",
                                  tiers={"remote": gcs_root, "remote_keep": 2}, **small) as mgr:
        for step in range(1, 4):
            mgr.save(step, {"base": frozen, "lora": np.full(16, step, np.float32)})
            mgr.wait_until_finished(tier="remote")
        back = mgr.restore(2)  # in the remote tier only
        assert same(back["base"], frozen) and same(back["lora"], np.full(16, 2, np.float32))
    blobs = objects(gcs_client, gcs_bucket)
    manifest = json.loads(blobs["run/checkpoint_3/manifest.json"].download_as_bytes())
    assert manifest["format_version"] == 3
    refs = [s["name"] for s in manifest["shards"] if "/" in s["name"]]
    assert refs == ["checkpoint_1/shard-00000.safetensors"]
    # Step 1 is pruned in the remote tier too, but keeps the frozen shard steps 2 and 3 use.
    assert "run/checkpoint_1/manifest.json" not in blobs
    assert "run/checkpoint_1/shard-00000.safetensors" in blobs
    assert sum(b.size for n, b in blobs.items() if n.startswith("run/checkpoint_3/")) < 64 * 1024
