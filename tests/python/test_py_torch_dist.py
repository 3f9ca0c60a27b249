"""ckptio.torch across processes: torch.distributed (gloo on 127.0.0.1) jobs of
separate Python processes (tests/python/torch_dist_worker.py, one per rank).

Real torch from PyPI on the CPU: FSDP2 (fully_shard) and DTensors on a CPU
device mesh, torch.distributed.checkpoint's save / async_save / load with
ckptio's StorageWriter and StorageReader, a local root and the GCS emulator.
Kept to four jobs (about a minute here): each rank imports torch.
"""
import json
import os
import pathlib
import signal
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")

from conftest import free_port  # noqa: E402

WORKER = str(pathlib.Path(__file__).with_name("torch_dist_worker.py"))


def start(role, world, out, roots, env):
    port = str(free_port())
    return [subprocess.Popen([sys.executable, WORKER, role, str(rank), str(world), port, str(out), *roots],
                             env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            for rank in range(world)]


def finish(procs, timeout=300):
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=timeout)[0])
    finally:
        for p in procs:
            p.kill()
    for p, out in zip(procs, outs):
        assert p.returncode == 0, f"rank {procs.index(p)} exited {p.returncode}:\n{out}"
    return outs


def assert_same(expected, got, path=""):
    """Bit for bit: tensors (as bytes, dtype and shape), containers, values."""
    if isinstance(expected, torch.Tensor):
        assert isinstance(got, torch.Tensor), path
        assert (expected.dtype, expected.shape) == (got.dtype, got.shape), path
        assert expected.contiguous().view(-1).view(torch.uint8).tolist() == \
            got.contiguous().view(-1).view(torch.uint8).tolist(), path
    elif isinstance(expected, dict):
        assert expected.keys() == got.keys(), path
        for k in expected:
            assert_same(expected[k], got[k], f"{path}/{k}")
    elif isinstance(expected, (list, tuple)):
        assert type(expected) is type(got) and len(expected) == len(got), path
        for i, (e, g) in enumerate(zip(expected, got)):
            assert_same(e, g, f"{path}/{i}")
    else:
        assert type(expected) is type(got) and expected == got, (path, expected, got)


def test_fsdp2_state_saved_by_dcp_on_4_ranks_loads_bit_exact_on_2_locally_and_on_gcs(tmp_path, child_env, gcs_env,
                                                                                       gcs_client, gcs_bucket):
    env = dict(child_env, **{k: v for k, v in gcs_env.items()
                             if k.startswith(("STORAGE_EMULATOR", "GCE_METADATA")) or k.lower() == "no_proxy"})
    env.pop("GOOGLE_APPLICATION_CREDENTIALS", None)
    roots = [str(tmp_path / "root"), f"gs://{gcs_bucket}/dcp"]
    finish(start("save", 4, tmp_path, roots, env))
    finish(start("load", 2, tmp_path, roots, env))
    for step in (1, 2):
        expected = torch.load(tmp_path / f"expected-{step}.pt", weights_only=True)
        for i in range(len(roots)):
            # Step 2 was an async_save whose parameters changed right after it returned.
            assert_same(expected, torch.load(tmp_path / f"loaded-{i}-{step}.pt", weights_only=True), f"root {i}")
    # The official client reads the commit point; the values are JSON, the DTensors chunks.
    manifest = json.loads(gcs_client.bucket(gcs_bucket).blob("dcp/checkpoint_2/manifest.json").download_as_bytes())
    tensors = {t["name"]: t for t in manifest["tensors"]}
    assert {t["array"] for t in manifest["tensors"] if "array" in t} >= {"model.0.weight", "extra"}
    assert len([t for t in manifest["tensors"] if t.get("array") == "extra"]) == 2  # replicated: written once
    assert tensors["step"]["dtype"] == "U8"
    assert manifest["metadata"]["ckptio_dcp"]["items"]["step"] == {"value": True}


def test_a_rank_killed_mid_save_commits_nothing_and_the_previous_step_loads(tmp_path, child_env):
    import ckptio
    import ckptio.torch
    import torch.distributed.checkpoint as dcp

    root = tmp_path / "root"
    procs = start("kill", 2, tmp_path, [str(root)], child_env)
    assert procs[1].wait(timeout=300) == -signal.SIGKILL
    # Rank 0 now waits for rank 1 at the commit's barrier, until killed too.
    procs[0].kill()
    out0 = procs[0].communicate(timeout=60)[0]
    assert "step 2 saved" not in out0
    assert not (root / "checkpoint_2" / "manifest.json").exists()
    with ckptio.CheckpointManager(root, read_only=True) as mgr:
        assert mgr.all_steps() == [1]
    expected = torch.load(tmp_path / "expected-1.pt", weights_only=True)
    # Loaded whole, in this process (no process group): 2 ranks' chunks onto 1.
    target = {"model": {k: torch.zeros_like(v) for k, v in expected["model"].items()},
              "extra": torch.zeros_like(expected["extra"]), "step": 0}
    dcp.load(target, storage_reader=ckptio.torch.StorageReader(root), no_dist=True)
    assert_same({"model": expected["model"], "extra": expected["extra"], "step": 1}, target)


def test_torch_distributed_gives_the_manager_its_ranks_and_barrier(tmp_path, child_env):
    outs = finish(start("manager", 2, tmp_path, [str(tmp_path / "root")], child_env))
    assert "rank 0 ok" in outs[0] and "rank 1 ok" in outs[1]
    names = {step: sorted(t["name"] for t in json.loads(
        (tmp_path / "root" / f"checkpoint_{step}" / "manifest.json").read_text())["tensors"]) for step in (5, 6)}
    assert names == {5: ["common", "shared@0,0", "shared@5,0"], 6: ["rank0", "rank1"]}
