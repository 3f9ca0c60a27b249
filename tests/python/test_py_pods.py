"""Pods: two tiers and incremental saves over several jax processes (jax.distributed on 127.0.0.1,
CPU devices, gloo), each process with a local tier of its own and one gs:// remote tier (the GCS
emulator behind the fault proxy, tests/gcs). The official google-cloud-storage client reads back
what landed in the bucket; process_allgather gathers the restored global arrays."""
import json
import os
import re
import shutil
import subprocess
import sys
import time

import pytest

from conftest import free_port, run_processes

HERE = os.path.dirname(os.path.abspath(__file__))

# The child: one process of a jax.distributed job. Its state is LoRA-shaped: a large frozen
# array sharded over the whole mesh, a frozen one replicated across the processes (each holds
# all of it, writes half, keeps the rest as a local copy), a small trainable one, and the step
# counter (written by process 0, a local copy on the others).
CHILD = r"""
import json, os, sys, time
index, port, count, mode, roots_json = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5]
import numpy as np
import jax
jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=count, process_id=index)
import jax.numpy as jnp
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, Mesh, PartitionSpec as P
import ckptio

roots = json.loads(roots_json)
mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("a", "b"))
SPECS = {"frozen": ((512, 256), P("a", "b")), "frozen_rep": ((64, 256), P(None, "b")),
         "lora": ((64, 16), P("a"))}

def value(name, step):
    shape = SPECS[name][0]
    seed = sum(map(ord, name)) + (0 if name.startswith("frozen") else 1000 * step)
    return (np.arange(np.prod(shape), dtype=np.float32).reshape(shape) + seed) * 0.5

def state(step):
    out = {name: jax.device_put(value(name, step), NamedSharding(mesh, spec)) for name, (_, spec) in SPECS.items()}
    out["opt"] = {"count": np.int64(step)}
    if roots.get("big_leaf"):  # a numpy leaf: process 0 writes it (a file of several upload chunks)
        out["embed"] = np.arange(1 << 18, dtype=np.float32) + step
    return out

def manager():
    return ckptio.CheckpointManager(roots["local"][index], keep=3, incremental=True, staging_memory="32MiB",
                                    threads=2, gcs={"chunk_size": "256KiB"},
                                    multihost={"timeout": roots.get("timeout", "60s")},
                                    tiers={"remote": roots["remote"], "remote_keep": roots.get("remote_keep", 5)})

def check(mgr, step, on=None):
    # `on`: another mesh, (2, 4), every array P("b", "a"): each process needs rows another one saved.
    other = Mesh(np.array(jax.devices()).reshape(2, 4), ("a", "b"))
    target = {name: jax.ShapeDtypeStruct(shape, jnp.float32, sharding=NamedSharding(mesh, spec) if on is None
                                         else NamedSharding(other, P("b", "a")))
              for name, (shape, spec) in SPECS.items()}
    target["opt"] = {"count": np.int64(0)}
    if roots.get("big_leaf"):
        target["embed"] = np.zeros(1 << 18, np.float32)
    back = mgr.restore(step, target=target)
    for name in SPECS:
        got = np.asarray(multihost_utils.process_allgather(back[name], tiled=True))
        assert got.tobytes() == value(name, step).tobytes(), name
    assert int(back["opt"]["count"]) == step, back["opt"]

if mode == "save":
    with manager() as mgr:
        for step in roots["steps"]:
            mgr.save(step, state(step)).wait()  # as saves minutes apart: each compares with the one before
        mgr.wait_until_finished(tier="remote")
        check(mgr, roots["steps"][-1])
        print(index, "stats", json.dumps(mgr.stats()), flush=True)
elif mode in ("restore", "restore-other-mesh"):
    with manager() as mgr:
        step = mgr.latest_step()
        check(mgr, step, on="other" if mode == "restore-other-mesh" else None)
        print(index, "restored", step, "stats", json.dumps(mgr.stats()), flush=True)
elif mode == "skips":  # process 0's first copy is held by the proxy while the steps commit locally
    with manager() as mgr:
        for step in roots["steps"]:
            mgr.save(step, state(step)).wait()
        print(index, "saved", flush=True)
        mgr.wait_until_finished(tier="remote")
        print(index, "stats", json.dumps(mgr.stats()), "remote", mgr.all_steps(tier="remote"), flush=True)
elif mode == "save-held":  # the copy is held by the proxy: killed by the test while it waits
    mgr = manager()
    mgr.save(roots["steps"][0], state(roots["steps"][0]))
    mgr.wait_until_finished()
    print(index, "committed", flush=True)
    mgr.wait_until_finished(tier="remote")
    print(index, "copied", flush=True)
    time.sleep(600)
print(index, "done", flush=True)
"""


def objects(client, bucket, prefix="pod/"):
    return {b.name: b for b in client.list_blobs(bucket, prefix=prefix)}


def start_job(count, mode, roots, env):
    port = free_port()
    env = dict(env, XLA_FLAGS=f"--xla_force_host_platform_device_count={8 // count}")
    return [subprocess.Popen([sys.executable, "-c", CHILD, str(i), str(port), str(count), mode, json.dumps(roots)],
                             env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            for i in range(count)]


def run_job(count, mode, roots, env, timeout=300):
    env = dict(env, XLA_FLAGS=f"--xla_force_host_platform_device_count={8 // count}")
    results = run_processes(CHILD, count, [count, mode, json.dumps(roots)], env, timeout)
    for i, (returncode, out) in enumerate(results):
        assert returncode == 0 and f"{i} done" in out, f"process {i} of {count} ({mode}):\n{out}"
    return [out for _, out in results]


def stats_of(out):
    return json.loads(re.search(r"stats (\{.*\})", out).group(1))


def data_bytes(directory):
    return sum(os.path.getsize(os.path.join(directory, f)) for f in os.listdir(directory)
               if f.endswith(".safetensors"))


@pytest.fixture
def pod_env(child_env, gcs_env):
    env = dict(child_env, **{k: v for k, v in gcs_env.items() if k.startswith(("STORAGE_EMULATOR", "GCE_METADATA"))})
    env.pop("GOOGLE_APPLICATION_CREDENTIALS", None)
    return env


@pytest.mark.parametrize("count", [2, 4])
def test_a_pod_saves_to_local_tiers_and_gcs_and_a_replaced_host_alone_reads_from_gcs(
        tmp_path, count, pod_env, gcs_bucket, gcs_direct_client):
    local = [str(tmp_path / f"host{i}") for i in range(count)]
    remote = f"gs://{gcs_bucket}/pod"
    roots = {"local": local, "remote": remote, "steps": [1, 2, 3]}
    outs = run_job(count, "save", roots, pod_env)
    for out in outs:
        stats = stats_of(out)
        assert stats["saves_committed"] == 3 and stats["bytes_read_remote"] == 0, out

    # The remote tier, read with the official client: every step's manifest, and every file it names.
    blobs = objects(gcs_direct_client, gcs_bucket)
    for step in (1, 2, 3):
        manifest = json.loads(blobs[f"pod/checkpoint_{step}/manifest.json"].download_as_bytes())
        assert manifest["step"] == step
        for shard in manifest["shards"]:  # "checkpoint_1/shard-..." : a file of an earlier step
            path = shard["name"] if "/" in shard["name"] else f"checkpoint_{step}/{shard['name']}"
            assert blobs[f"pod/{path}"].size == shard["bytes"]
        # One manifest for the pod, the same on every host (whose files are its own part).
        for i in range(count):
            local_manifest = json.loads(open(f"{local[i]}/checkpoint_{step}/manifest.json").read())
            assert [t["name"] for t in local_manifest["tensors"]] == [t["name"] for t in manifest["tensors"]]
            assert [t["crc32c"] for t in local_manifest["tensors"]] == [t["crc32c"] for t in manifest["tensors"]]
    # Each later step adds only the trainable bytes (the lora rows, the counter, the file headers),
    # to each local tier and to the remote one.
    frozen = (512 * 256 + 64 * 256) * 4
    lora = 64 * 16 * 4
    for step in (2, 3):
        remote_bytes = sum(b.size for n, b in blobs.items()
                           if n.startswith(f"pod/checkpoint_{step}/") and n.endswith(".safetensors"))
        assert lora <= remote_bytes <= lora + 8 + count * 2 * 4096, remote_bytes
        for i in range(count):
            assert data_bytes(f"{local[i]}/checkpoint_{step}") <= lora + 8 + 2 * 4096
    assert sum(data_bytes(f"{local[i]}/checkpoint_1") for i in range(count)) >= frozen

    # A restart reads everything from the local tiers.
    for out in run_job(count, "restore", roots, pod_env):
        assert stats_of(out)["bytes_read_remote"] == 0, out
    if count == 2:
        # Onto another mesh: what a process holds comes from its disk, the rest (rows another
        # process saved) from the remote tier; exact either way.
        for out in run_job(count, "restore-other-mesh", roots, pod_env):
            assert "restored 3" in out and stats_of(out)["bytes_read_remote"] > 0, out
    # Host 1 is replaced (an empty disk): it alone reads from the remote tier, and the result is exact.
    shutil.rmtree(local[1])
    outs = run_job(count, "restore", roots, pod_env)
    for i, out in enumerate(outs):
        read_remote = stats_of(out)["bytes_read_remote"]
        assert (read_remote > 0) == (i == 1), f"process {i}: {out}"
        assert "restored 3" in out


def test_a_pod_killed_mid_copy_keeps_the_remote_tier_and_the_next_run_sends_only_what_is_missing(
        tmp_path, pod_env, gcs_proxy, gcs_bucket, gcs_direct_client):
    local = [str(tmp_path / f"host{i}") for i in range(2)]
    remote = f"gs://{gcs_bucket}/pod"
    roots = {"local": local, "remote": remote, "steps": [1], "big_leaf": True}
    run_job(2, "save", roots, pod_env)
    chunk = 256 * 1024
    # Step 2's copy: process 0's file holding the 1 MiB leaf goes up in 256 KiB chunks (the other
    # files fit in one request each); its 3rd chunk gets no answer, and the pod is killed.
    gcs_proxy.set_rules([{"id": "hold", "method": "PUT", "path": "upload_id=",
                          "headers": {"Content-Range": r"^bytes \d+-"}, "skip": 2, "times": 1,
                          "stall_seconds": 300}])
    held_roots = dict(roots, steps=[2], timeout="30s")
    first = gcs_proxy.log()
    start = first[-1]["id"] + 1 if first else 0
    procs = start_job(2, "save-held", held_roots, pod_env)
    try:
        deadline = time.monotonic() + 300
        held = lambda: next(r for r in gcs_proxy.rules() if r.get("id") == "hold")["fired"]  # noqa: E731
        while not held() and all(p.poll() is None for p in procs) and time.monotonic() < deadline:
            time.sleep(0.05)  # polls the proxy's counter
        assert held() == 1, "the copy never reached its 3rd chunk"
    finally:
        for p in procs:
            p.kill()
        outs = [p.communicate()[0] for p in procs]
    for i, out in enumerate(outs):
        assert f"{i} committed" in out and f"{i} copied" not in out, out
    gcs_proxy.set_rules([])
    log = gcs_proxy.log(start)
    acknowledged = max(int(e["response_headers"]["range"].split("-")[1]) + 1 for e in log
                       if e["method"] == "PUT" and "upload_id=" in e["query"] and e["status"] == 308)
    assert acknowledged == 2 * chunk
    blobs = objects(gcs_direct_client, gcs_bucket)
    assert "pod/checkpoint_1/manifest.json" in blobs and "pod/checkpoint_2/manifest.json" not in blobs
    journal = json.loads(open(f"{local[0]}/.ckptio-replication.json").read())
    [(shard, recorded)] = [(f, r) for f, r in journal["sessions"].items() if r["bytes"] > 4 * chunk]
    upload_id = re.search(r"upload_id=([^&]+)", recorded["uri"]).group(1)

    # The next run (the same hosts) finishes the copy (process 0 resumes its session), saves step 3
    # and restores it.
    since = log[-1]["id"] + 1
    outs = run_job(2, "save", dict(held_roots, steps=[3]), pod_env)
    after = gcs_proxy.log(since)
    size = os.path.getsize(f"{local[0]}/checkpoint_2/{shard}")
    resent = sum(e["request_body_bytes"] for e in after if e["method"] == "PUT" and upload_id in e["query"])
    assert resent == size - acknowledged
    assert not any(e["method"] == "POST" and shard in e["query"] and "checkpoint_2" in e["query"] for e in after)
    blobs = objects(gcs_direct_client, gcs_bucket)
    assert "pod/checkpoint_2/manifest.json" in blobs
    assert blobs[f"pod/checkpoint_2/{shard}"].download_as_bytes() == open(f"{local[0]}/checkpoint_2/{shard}",
                                                                           "rb").read()
    assert stats_of(outs[0])["bytes_resumed"] == acknowledged


def test_copies_that_fall_behind_are_skipped_alike_on_every_host(tmp_path, pod_env, gcs_proxy, gcs_bucket):
    local = [str(tmp_path / f"host{i}") for i in range(2)]
    roots = {"local": local, "remote": f"gs://{gcs_bucket}/pod", "steps": [1, 2, 3, 4, 5], "remote_keep": 1}
    # Process 0's upload of step 1 waits at the proxy while steps 2-5 commit locally: its queue
    # outgrows remote_keep + 1, so it skips the oldest waiting steps (2 at step 4, 3 at step 5)
    # and tells process 1, which may have sent its parts of them already.
    gcs_proxy.set_rules([{"id": "hold", "method": "POST", "path": "checkpoint_1%2Fshard-p00000", "times": 1,
                          "hold": "leader"}])
    procs = start_job(2, "skips", roots, pod_env)
    outs = ["", ""]
    try:
        for i, p in enumerate(procs):
            for line in p.stdout:
                outs[i] += line
                if f"{i} saved" in line:
                    break
        assert next(r for r in gcs_proxy.rules() if r["id"] == "hold")["fired"] == 1
        gcs_proxy.release("leader")
        for i, p in enumerate(procs):
            outs[i] += p.communicate(timeout=300)[0]
    finally:
        for p in procs:
            p.kill()
    for i, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode == 0 and f"{i} done" in out, out
    skipped = [stats_of(out)["replications_skipped"] for out in outs]
    assert skipped == [2, 2], outs
    remote = [re.search(r"remote (\[.*\])", out).group(1) for out in outs]
    assert remote[0] == remote[1] == "[5]", outs  # remote_keep 1; steps 1, 4, 5 were copied
