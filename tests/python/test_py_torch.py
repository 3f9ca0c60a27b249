"""ckptio with torch tensors (real torch from PyPI, CPU), in one process:
CheckpointManager.save / restore / restore_into of torch state, and
torch.distributed.checkpoint with ckptio's StorageWriter / StorageReader
without a process group (the multi-rank jobs are in test_py_torch_dist.py)."""
import json
import pathlib
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import torch.distributed.checkpoint as dcp  # noqa: E402

import ckptio  # noqa: E402
import ckptio.torch  # noqa: E402

DTYPES = [torch.bool, torch.uint8, torch.int8, torch.uint16, torch.int16, torch.float16, torch.bfloat16,
          torch.uint32, torch.int32, torch.float32, torch.uint64, torch.int64, torch.float64,
          torch.float8_e4m3fn, torch.float8_e5m2]


def raw(t):
    """A tensor's bytes, for bit-exact comparisons (NaN payloads included)."""
    t = t.detach().cpu().contiguous()
    return t.reshape(-1).view(torch.uint8).tolist() if t.numel() else []


def random_tensor(dtype, shape, seed):
    g = torch.Generator().manual_seed(seed)
    bits = torch.randint(0, 256, (int(np.prod(shape)) * dtype.itemsize,), dtype=torch.uint8, generator=g)
    if dtype == torch.bool:
        return (bits[:int(np.prod(shape))] & 1).bool().reshape(shape)
    return bits.view(dtype).reshape(shape)


def make_model(seed):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(4, 16)).sum().backward()
    optim.step()
    return model, optim


def test_every_dtype_round_trips_bit_exact_with_views_and_non_contiguous_tensors(tmp_path, small):
    state = {str(dt).split(".")[1]: random_tensor(dt, (5, 7), i) for i, dt in enumerate(DTYPES)}
    base = random_tensor(torch.float32, (8, 6), 99)
    state["transposed"] = base.t()
    state["strided"] = base[::3, 1::2]
    state["scalar"] = torch.tensor(3.5, dtype=torch.float64)
    state["empty"] = torch.zeros(0, 4, dtype=torch.bfloat16)
    state["grad"] = torch.randn(3, requires_grad=True)
    with ckptio.CheckpointManager(tmp_path, **small) as mgr:
        mgr.save(1, state)
        expected = {k: raw(v) for k, v in state.items()}
        for v in state.values():  # changed right after save() returned: not in the checkpoint
            if v.numel() and v.is_contiguous() and not v.requires_grad:
                v.view(-1).view(torch.uint8).bitwise_not_()
        base.add_(1.0)
        mgr.wait_until_finished()
        back = mgr.restore(1)
    for k, v in back.items():
        assert isinstance(v, torch.Tensor), k
        assert v.dtype == state[k].dtype and v.shape == state[k].shape, k
        assert raw(v) == expected[k], k


def test_restore_into_fills_the_tensors_in_place(tmp_path, small):
    model, optim = make_model(0)
    with ckptio.CheckpointManager(tmp_path, **small) as mgr:
        mgr.save(3, {"model": model.state_dict(), "optim": optim.state_dict(), "epoch": 2})
        mgr.wait_until_finished()
        model2, optim2 = make_model(1)
        target = {"model": model2.state_dict(), "optim": optim2.state_dict(), "epoch": 0}
        ptrs = {k: v.data_ptr() for k, v in model2.state_dict().items()}
        assert mgr.restore_into(None, target) == 3
    assert target["epoch"] == 2
    for k, v in model2.state_dict().items():  # the model itself, no load_state_dict
        assert v.data_ptr() == ptrs[k], k
        assert raw(v) == raw(model.state_dict()[k]), k
    for p, p2 in zip(model.parameters(), model2.parameters()):  # and the optimizer's own state tensors
        assert raw(optim.state[p]["exp_avg"]) == raw(optim2.state[p2]["exp_avg"])


def test_background_snapshots_with_wait_before_step_save_each_steps_exact_state(tmp_path, small):
    """snapshot="background": save() returns before the copy; the optimizer step waits for it
    (wait_before_step), so every checkpoint holds the state as of its save() call."""
    model, optim = make_model(2)
    ckptio.torch.wait_before_step(mgr := ckptio.CheckpointManager(tmp_path, snapshot="background", keep=0, **small),
                                  optim)
    expected, handles = {}, []
    with mgr:
        for step in range(1, 6):
            state = {"model": model.state_dict(), "optim": optim.state_dict(), "step": step}
            handles.append(mgr.save(step, state))
            expected[step] = {k: raw(v) for k, v in model.state_dict().items()}
            model(torch.randn(4, 16)).sum().backward()  # reads the parameters while they are copied
            optim.step()  # waits for the copy, then changes every parameter
            optim.zero_grad()
        for h in handles:
            h.wait()
        assert mgr.all_steps() == [1, 2, 3, 4, 5]
        for step in range(1, 6):
            back = mgr.restore(step)
            assert back["step"] == step
            assert {k: raw(v) for k, v in back["model"].items()} == expected[step], step
        assert expected[1] != expected[5]  # the optimizer did change them


def test_a_tensor_changed_while_its_background_copy_is_pending_fails_that_save_naming_it(tmp_path, small,
                                                                                          monkeypatch):
    import threading
    state = {"a": torch.arange(1000, dtype=torch.float32), "b": torch.ones(1 << 16)}
    # The snapshot thread runs the check once the copy is taken. Here it first waits for this
    # thread's change, so the change lands while the snapshot is pending, whatever the timing
    # (a bare race loses when the copy is done before save() takes the GIL back).
    changed, real = threading.Event(), ckptio._torch.snapshot_check

    def gated(watched, step):
        check = real(watched, step)

        def after_the_change():
            assert changed.wait(60), "the test's change never came"
            check()
        return after_the_change
    with ckptio.CheckpointManager(tmp_path, snapshot="background", **small) as mgr:
        mgr.save(1, state).wait()
        monkeypatch.setattr(ckptio._torch, "snapshot_check", gated)
        handle = mgr.save(2, state)
        torch.autograd.graph.increment_version(state["b"])  # what an in-place op records
        changed.set()
        with pytest.raises(ckptio.CkptioError, match=r"step 2 is not saved: 'b' changed in place"):
            handle.wait_snapshot()
        with pytest.raises(ckptio.CkptioError, match="'b' changed in place"):
            handle.wait()
        assert not (tmp_path / "checkpoint_2").exists()
        with pytest.raises(ckptio.CkptioError, match="an earlier background save failed"):
            mgr.save(3, state)  # reported once...
        mgr.save(3, state).wait()  # ...then saves go on
        assert mgr.all_steps() == [1, 3]
        assert raw(mgr.restore(1)["b"]) == raw(torch.ones(1 << 16))


def test_nested_optimizer_state_round_trips_and_loads_into_an_optimizer(tmp_path, small):
    model, optim = make_model(0)
    with ckptio.CheckpointManager(tmp_path, **small) as mgr:
        mgr.save(1, {"optim": optim.state_dict(), "sched": {"last_epoch": 4, "lrs": [0.1, 0.2], "betas": (0.9, 0.99)}})
        mgr.wait_until_finished()
        back = mgr.restore()
        model2, optim2 = make_model(1)
        like = mgr.restore(1, target={"optim": optim2.state_dict(), "sched": {"last_epoch": 0, "lrs": [0.0, 0.0],
                                                                             "betas": (0.0, 0.0)}})
    assert back["sched"] == {"last_epoch": 4, "lrs": [0.1, 0.2], "betas": (0.9, 0.99)}
    assert back["optim"]["param_groups"] == optim.state_dict()["param_groups"]
    assert sorted(back["optim"]["state"]) == [0, 1, 2, 3]
    optim2.load_state_dict(back["optim"])
    for p, p2 in zip(model.parameters(), model2.parameters()):
        for key in ("step", "exp_avg", "exp_avg_sq"):
            assert raw(optim.state[p][key]) == raw(optim2.state[p2][key]), key
    assert like["optim"]["param_groups"] == optim.state_dict()["param_groups"]
    assert like["sched"] == back["sched"]


def test_restore_with_a_target_gives_the_targets_dtypes_and_devices(tmp_path, small):
    w = random_tensor(torch.float32, (4, 4), 1)
    with ckptio.CheckpointManager(tmp_path, **small) as mgr:
        mgr.save(1, {"w": w, "n": np.arange(3), "s": 7})
        mgr.wait_until_finished()
        got = mgr.restore(1, target={"w": torch.zeros(4, 4, dtype=torch.float64), "n": np.zeros(3, np.int64), "s": 0})
        with pytest.raises(ValueError, match="'w'.*shape"):
            mgr.restore(1, target={"w": torch.zeros(4, 5)})
        with pytest.raises(ValueError, match="'w'.*shape"):
            mgr.restore_into(1, {"w": torch.zeros(2, 8)})
        with pytest.raises(ValueError, match="no tensor.*'x'"):
            mgr.restore_into(1, {"x": torch.zeros(1)})
    assert got["w"].dtype == torch.float64 and got["w"].device.type == "cpu"
    assert torch.equal(got["w"], w.double())
    assert isinstance(got["n"], np.ndarray) and got["s"] == 7


@pytest.mark.parametrize("leaf, message", [
    (object(), "'opt/extra': builtins.object"),
    (torch.zeros(2, dtype=torch.complex64), "'opt/extra': dtype torch.complex64"),
    (torch.zeros(3, 3).to_sparse(), "'opt/extra': a torch.sparse_coo tensor"),
])
def test_an_object_ckptio_cannot_store_is_an_error_naming_its_key(tmp_path, small, leaf, message):
    with ckptio.CheckpointManager(tmp_path, **small) as mgr:
        with pytest.raises(TypeError, match=message):
            mgr.save(1, {"opt": {"w": torch.zeros(2), "extra": leaf}})
        assert mgr.all_steps() == []
    with pytest.raises(TypeError, match="'x.y'.*never pickles"):
        ckptio.torch.encode_value({"a": object()}, "x.y")


def dcp_state(seed):
    model, optim = make_model(seed)
    return {"model": model.state_dict(), "optim": optim.state_dict(), "step": seed, "w": torch.randn(3, 5).t()}


def assert_loaded(saved, root, step, **options):
    target = dcp_state(7)
    dcp.load(target, storage_reader=ckptio.torch.StorageReader(root, **options), checkpoint_id=step, no_dist=True)
    assert target["step"] == saved["step"]
    for k in ("model", "w"):
        tree = saved[k] if k == "model" else {"w": saved["w"]}
        got = target[k] if k == "model" else {"w": target["w"]}
        for name, v in tree.items():
            assert raw(got[name]) == raw(v), name
    assert target["optim"]["param_groups"] == saved["optim"]["param_groups"]


@pytest.fixture
def quiet_dcp():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def test_dcp_save_and_async_save_then_load_in_one_process(tmp_path, small, quiet_dcp):
    writer = ckptio.torch.StorageWriter(tmp_path, keep=2, **small)
    s1, s2, s3 = dcp_state(1), dcp_state(2), dcp_state(3)
    dcp.save(s1, storage_writer=writer, checkpoint_id=1)
    expected2 = {k: raw(v) for k, v in s2["model"].items()}
    fut = dcp.async_save(s2, storage_writer=writer, checkpoint_id=2)
    for v in s2["model"].values():  # after the snapshot
        v.add_(1.0)
    fut.result()
    dcp.async_save(s3, storage_writer=writer).result()  # no checkpoint_id: the next step
    writer.close()
    with ckptio.CheckpointManager(tmp_path, read_only=True) as mgr:
        assert mgr.all_steps() == [2, 3]  # keep=2 pruned step 1
    for v in s2["model"].values():
        v.sub_(1.0)
    target = dcp_state(7)
    dcp.load(target, storage_reader=ckptio.torch.StorageReader(tmp_path), checkpoint_id=2, no_dist=True)
    assert {k: raw(v) for k, v in target["model"].items()} == expected2
    assert_loaded(s3, tmp_path, None)  # the latest


def test_dcp_on_gcs_and_on_two_tiers(tmp_path, gcs_root, gcs_client, gcs_bucket, small, quiet_dcp):
    s1, s2 = dcp_state(1), dcp_state(2)
    writer = ckptio.torch.StorageWriter(gcs_root, **small)
    dcp.save(s1, storage_writer=writer, checkpoint_id=1)
    writer.close()
    assert_loaded(s1, gcs_root, 1)
    manifest = json.loads(gcs_client.bucket(gcs_bucket).blob("run/checkpoint_1/manifest.json").download_as_bytes())
    assert manifest["metadata"]["ckptio_dcp"]["items"]["optim.param_groups.0.lr"] == {"value": True}
    # Two tiers: committed locally, copied to gs://; a new machine reads the remote tier.
    remote = gcs_root + "-tiers"
    writer = ckptio.torch.StorageWriter(tmp_path / "local", tiers={"remote": remote}, **small)
    dcp.async_save(s2, storage_writer=writer, checkpoint_id=5).result()
    writer.manager.wait_until_finished(tier="remote")
    writer.close()
    assert_loaded(s2, remote, 5)
    assert_loaded(s2, tmp_path / "local", 5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here: the GPU path (pinned staging, "
                    "ckptio's own stream) runs on a machine with one")
def test_cuda_tensors_are_saved_through_pinned_memory_and_restored_onto_the_gpu(tmp_path, small):
    w = random_tensor(torch.float32, (256, 256), 3).cuda()
    bf = random_tensor(torch.bfloat16, (64,), 4).cuda()
    with ckptio.CheckpointManager(tmp_path, **small) as mgr:
        mgr.save(1, {"w": w, "bf": bf})
        expected = raw(w)
        w.add_(1.0)  # after save() returned: the copy to the host is done
        mgr.wait_until_finished()
        got = mgr.restore(1, target={"w": torch.zeros_like(w), "bf": torch.zeros_like(bf)})
        into = {"w": torch.zeros_like(w), "bf": torch.zeros_like(bf)}
        ptr = into["w"].data_ptr()
        mgr.restore_into(1, into)
    assert got["w"].device == w.device and raw(got["w"]) == expected
    assert into["w"].data_ptr() == ptr and raw(into["w"]) == expected
    assert raw(got["bf"]) == raw(bf)


def test_the_readme_training_loop_runs_as_written_and_resumes(tmp_path, run_python):
    readme = (pathlib.Path(__file__).resolve().parents[2] / "README.md").read_text()
    section = readme[readme.index("### PyTorch"):]
    code = section.split("```python\n", 1)[1].split("```", 1)[0]
    script = f"import os\nos.chdir({str(tmp_path)!r})\n" + code + \
        "print('steps', ckptio.CheckpointManager('checkpoints', read_only=True).all_steps())\n"
    assert "steps [40, 60, 80]" in run_python(script).stdout
    assert "steps [140, 160, 180]" in run_python(script).stdout  # resumed from step 80
