"""Two tiers (config "tiers"): saves commit to the local directory, committed steps are copied to
the GCS emulator in the background (tests/gcs), reads take the newest step of either tier. The
official google-cloud-storage client checks what landed in the bucket."""
import json
import os
import re
import subprocess
import sys
import time

import numpy as np
import pytest

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
        assert mgr.all_steps(tier="local") == [3, 4] and mgr.all_steps(tier="remote") == [2, 3, 4]
        with pytest.raises(ValueError, match="tier must be"):
            mgr.all_steps(tier="gcs")
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


SAVER = """
import json, sys
import numpy as np
import pytest
import ckptio
mgr = ckptio.CheckpointManager(sys.argv[1], **json.loads(sys.argv[2]))
mgr.save(1, {"w": np.arange(1 << 20, dtype=np.float32)})
mgr.wait_until_finished()
print("committed", flush=True)
mgr.wait_until_finished(tier="remote")  # the proxy holds a chunk: killed while waiting here
"""


def test_a_copy_killed_mid_upload_resumes_its_session_and_sends_only_the_missing_bytes(
        tmp_path, gcs_root, gcs_proxy, gcs_client, gcs_bucket, child_env, small):
    local = tmp_path / "local"
    chunk = 256 * 1024
    options = dict(small, tiers={"remote": gcs_root}, gcs={"chunk_size": "256KiB"})
    env = dict(child_env, **{k: v for k, v in os.environ.items() if k.startswith(("STORAGE_EMULATOR", "GCE_METADATA"))})
    # The 5th chunk of the copy gets no answer: the saver is SIGKILLed while the server holds 4.
    gcs_proxy.set_rules([{"id": "hold", "method": "PUT", "path": "upload_id=", "headers": {"Content-Range": r"^bytes \d+-"},
                          "skip": 4, "times": 1, "stall_seconds": 300}])
    saver = subprocess.Popen([sys.executable, "-c", SAVER, str(local), json.dumps(options)], env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert saver.stdout.readline().strip() == "committed", saver.stderr.read()
        held = lambda: next(r for r in gcs_proxy.rules() if r.get("id") == "hold")["fired"]  # noqa: E731
        deadline = time.monotonic() + 300
        while not held() and saver.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)  # polls the proxy's counter
        assert held() == 1, saver.stderr.read() if saver.poll() is not None else "the copy never reached chunk 5"
    finally:
        saver.kill()
        saver.wait()
    gcs_proxy.set_rules([])
    before = gcs_proxy.log()
    chunks = [e for e in before if e["method"] == "PUT" and "upload_id=" in e["query"]]
    acknowledged = max(int(e["response_headers"]["range"].split("-")[1]) + 1 for e in chunks if e["status"] == 308)
    assert acknowledged == 4 * chunk
    # The session was recorded in the local tier before its first byte was sent.
    journal = json.loads((local / ".ckptio-replication.json").read_text())
    assert journal["step"] == 1 and journal["remote"] == gcs_root
    [(shard, recorded)] = journal["sessions"].items()
    assert recorded["bytes"] == (local / "checkpoint_1" / shard).stat().st_size
    upload_id = re.search(r"upload_id=([^&]+)", recorded["uri"]).group(1)
    assert oct((local / ".ckptio-replication.json").stat().st_mode & 0o777) == "0o600"

    # A new process on the same local tier takes the copy up where the server's session stands.
    since = before[-1]["id"] + 1 if before else 0
    with ckptio.CheckpointManager(str(local), **options) as mgr:
        mgr.wait_until_finished(tier="remote")
        stats = mgr.stats()
    after = gcs_proxy.log(since)
    size = (local / "checkpoint_1" / shard).stat().st_size
    assert size > 8 * chunk
    starts = [e for e in after if e["method"] == "POST" and "uploadType=resumable" in e["query"]]
    assert starts == [], "the upload started again"
    resent = sum(e["request_body_bytes"] for e in after if e["method"] == "PUT" and upload_id in e["query"])
    assert resent == size - acknowledged
    assert stats["bytes_resumed"] == acknowledged and stats["steps_replicated"] == 1
    assert not (local / ".ckptio-replication.json").exists()
    blobs = objects(gcs_client, gcs_bucket)
    assert blobs[f"run/checkpoint_1/{shard}"].download_as_bytes() == (local / "checkpoint_1" / shard).read_bytes()
    assert "run/checkpoint_1/manifest.json" in blobs


def test_a_damaged_journal_or_a_fifo_or_symlink_in_its_place_is_reported_and_the_copy_starts_afresh(
        tmp_path, gcs_root, gcs_client, gcs_bucket, small, capfd):
    local = tmp_path / "local"
    journal = local / ".ckptio-replication.json"
    outside = tmp_path / "outside.json"
    outside.write_text('{"remote": "gs://elsewhere", "step": 1, "sessions": {}}')
    plant = [lambda: journal.write_text("{not json"),
             lambda: os.mkfifo(journal),
             lambda: journal.symlink_to(outside)]
    with ckptio.CheckpointManager(str(local), tiers={"remote": gcs_root}, gcs={"chunk_size": "256KiB"}, **small) as mgr:
        for step, put in enumerate(plant, start=1):
            put()
            mgr.save(step, {"w": np.full(300_000, step, np.float32)})  # 1.2 MB: a resumable upload
            mgr.wait_until_finished(tier="remote")
            assert not os.path.lexists(journal)
        assert mgr.stats()["steps_replicated"] == 3
    err = capfd.readouterr().err
    assert err.count("ignoring the replication journal") == 3 and err.count(str(journal)) >= 3
    assert "not a replication journal" in err and "not a regular file" in err and "symbolic links" in err
    assert outside.read_text() == '{"remote": "gs://elsewhere", "step": 1, "sessions": {}}'
    blobs = objects(gcs_client, gcs_bucket)
    for step in (1, 2, 3):
        assert f"run/checkpoint_{step}/manifest.json" in blobs


def test_a_new_machine_seeds_its_local_tier_from_the_remote_one(tmp_path, gcs_root, small):
    frozen = np.random.default_rng(5).standard_normal((256, 256)).astype(np.float32)  # 256 KiB
    first = dict(small, incremental=True, shard_size="256KiB", keep=1, tiers={"remote": gcs_root, "remote_keep": 2})
    with ckptio.CheckpointManager(str(tmp_path / "old"), **first) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, {"base": frozen, "lora": np.full(16, step, np.float32)}, metadata={"step": step})
            mgr.wait_until_finished(tier="remote")
    fresh = tmp_path / "fresh"
    seeding = dict(small, tiers={"remote": gcs_root, "seed_local": True})
    with ckptio.CheckpointManager(str(fresh), **seeding) as mgr:
        mgr.wait_until_finished(tier="remote")  # the copies between the tiers, this one included
        assert mgr.stats()["steps_seeded"] == 1
    # The local tier alone now has step 3, complete: the frozen shard step 3 refers to (stored by
    # step 1 in the remote tier) was copied as a file of step 3.
    with ckptio.CheckpointManager(str(fresh), **small) as mgr:
        assert mgr.all_steps() == [3]
        report = mgr.verify()  # raises if a byte or a CRC32C is wrong
        assert report["step"] == 3 and report["shards"] == 2
        back = mgr.restore()
        assert same(back["base"], frozen) and same(back["lora"], np.full(16, 3, np.float32))
    manifest = json.loads((fresh / "checkpoint_3" / "manifest.json").read_text())
    assert sorted(s["name"] for s in manifest["shards"]) == ["checkpoint_1.shard-00000.safetensors",
                                                            "shard-00000.safetensors"]
    # Opening again seeds nothing: the local tier is as new as the remote one.
    with ckptio.CheckpointManager(str(fresh), **seeding) as mgr:
        mgr.wait_until_finished(tier="remote")
        assert mgr.stats()["steps_seeded"] == 0


def test_a_damaged_remote_file_is_not_seeded_and_the_error_names_it(tmp_path, gcs_root, gcs_client, gcs_bucket,
                                                                     small):
    tiers = {"remote": gcs_root}
    with ckptio.CheckpointManager(str(tmp_path / "old"), tiers=tiers, **small) as mgr:
        mgr.save(7, state(7))
        mgr.wait_until_finished(tier="remote")
    blob = next(b for n, b in objects(gcs_client, gcs_bucket).items() if "/shard-" in n)
    data = bytearray(blob.download_as_bytes())
    data[-1] ^= 0xFF
    blob.upload_from_string(bytes(data))
    fresh = tmp_path / "fresh"
    with ckptio.CheckpointManager(str(fresh), tiers=dict(tiers, seed_local=True), **small) as mgr:
        with pytest.raises(ckptio.CorruptionError, match=r"shard-00000.safetensors: CRC32C .* but the manifest"):
            mgr.wait_until_finished(tier="remote")
        assert mgr.stats()["steps_seeded"] == 0
    assert [d for d in os.listdir(fresh) if d.startswith("checkpoint_")] == []


def test_copies_that_fall_behind_skip_the_oldest_waiting_step_never_a_kept_forever_one_nor_with_keep_all(
        tmp_path, gcs_root, gcs_proxy, small, capfd):
    def run(name, **tiers):
        # The copy of step 1 is held at the proxy while steps 2-5 commit locally.
        gcs_proxy.set_rules([{"id": "first", "method": "POST", "path": "/upload/", "times": 1, "hold": name}])
        remote = f"{gcs_root}-{name}"
        with ckptio.CheckpointManager(str(tmp_path / name), tiers=dict(tiers, remote=remote), **small) as mgr:
            mgr.save(1, state(1))
            mgr.wait_until_finished()
            deadline = time.monotonic() + 120
            while not gcs_proxy.rules()[0]["fired"] and time.monotonic() < deadline:
                time.sleep(0.02)  # polls the proxy's counter
            for step in range(2, 6):
                mgr.save(step, state(step))
                mgr.wait_until_finished()
            gcs_proxy.release(name)
            mgr.wait_until_finished(tier="remote")
            return mgr.stats(), mgr.all_steps(tier="remote")

    # Two may wait (remote_keep + 1): step 3 is skipped at step 4, step 5 at step 5 (2 and 4 are
    # kept forever by remote_keep_every 2).
    stats, remote = run("bounded", remote_keep=1, remote_keep_every=2)
    assert stats["replications_skipped"] == 2 and stats["steps_replicated"] == 3
    assert remote == [2, 4]  # step 1 copied, then pruned there
    err = capfd.readouterr().err
    assert err.count("is not copied to the remote tier") == 1 and "step 3 is not copied" in err
    # remote_keep 0 keeps every step: none is skipped.
    stats, remote = run("all", remote_keep=0)
    assert stats["replications_skipped"] == 0 and remote == [1, 2, 3, 4, 5]
