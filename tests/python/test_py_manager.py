"""ckptio.CheckpointManager: pytrees of numpy and jax arrays in and out."""
import collections
import os
import json
import threading
import tracemalloc

import ml_dtypes
import numpy as np
import pytest

import ckptio

ALL_DTYPES = [np.bool_, np.uint8, np.int8, np.uint16, np.int16, np.float16, ml_dtypes.bfloat16, np.uint32,
              np.int32, np.float32, np.uint64, np.int64, np.float64, ml_dtypes.float8_e4m3fn,
              ml_dtypes.float8_e5m2]


def random_array(rng, dtype, shape):
    """Every bit pattern is fair game (NaNs included): compared as bytes."""
    dtype = np.dtype(dtype)
    if dtype == np.bool_:
        return rng.integers(0, 2, size=shape).astype(np.bool_)
    raw = rng.integers(0, 256, size=int(np.prod(shape)) * dtype.itemsize, dtype=np.uint8)
    return raw.view(dtype).reshape(shape)


def same(a, b):
    a, b = np.asarray(a), np.asarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


Adam = collections.namedtuple("Adam", ["count", "mu", "nu"])


def test_every_dtype_round_trips_bit_exact_including_bfloat16_and_float8(tmp_path, small):
    rng = np.random.default_rng(1)
    tree = {np.dtype(d).name: random_array(rng, d, (3, 5)) for d in ALL_DTYPES}
    with ckptio.CheckpointManager(tmp_path / "ckpt", **small) as mgr:
        mgr.save(1, tree)
        mgr.wait_until_finished()
        back = mgr.restore()
    assert list(back) == list(tree)
    for name, value in tree.items():
        assert same(back[name], value), name
    assert back["bfloat16"].dtype == ml_dtypes.bfloat16
    assert back["float8_e4m3fn"].dtype == ml_dtypes.float8_e4m3fn


def test_a_pytree_comes_back_with_the_same_containers_scalars_and_leaves(tmp_path, small):
    rng = np.random.default_rng(2)
    tree = {
        "params": {"dense": {"kernel": rng.standard_normal((4, 3)).astype(np.float32),
                             "bias": np.zeros(3, ml_dtypes.bfloat16)}},
        "opt_state": (Adam(count=np.int32(7), mu={"w": np.ones(2)}, nu={"w": np.full(2, 2.0)}), None),
        "layers": [np.arange(3), {"scale": np.float16(0.5)}],
        "step": 12, "lr": 3e-4, "done": False, "name": "run-7",
        3: np.array(1.5),                               # an int key
        "empty": {}, "no_layers": [],
        "transposed": rng.standard_normal((3, 4)).T,   # not C-contiguous
        "nothing": np.zeros((0, 4), np.int64),
    }
    with ckptio.CheckpointManager(tmp_path / "ckpt", **small) as mgr:
        mgr.save(5, tree)
        back = mgr.restore(5)
    assert list(back) == list(tree)
    assert type(back["opt_state"]) is tuple and back["opt_state"][1] is None
    adam = back["opt_state"][0]
    assert type(adam).__name__ == "Adam" and adam._fields == ("count", "mu", "nu")
    assert isinstance(adam.count, np.int32) and adam.count == 7
    assert same(adam.mu["w"], np.ones(2)) and same(adam.nu["w"], np.full(2, 2.0))
    assert isinstance(back["layers"], list) and same(back["layers"][0], np.arange(3))
    assert isinstance(back["layers"][1]["scale"], np.float16)
    assert back["step"] == 12 and type(back["step"]) is int
    assert back["lr"] == 3e-4 and type(back["lr"]) is float
    assert back["done"] is False and back["name"] == "run-7"
    assert same(back[3], np.array(1.5))
    assert back["empty"] == {} and back["no_layers"] == []
    assert same(back["transposed"], np.ascontiguousarray(tree["transposed"]))
    assert same(back["nothing"], tree["nothing"])
    for path in (("params", "dense", "kernel"), ("params", "dense", "bias")):
        a, b = back, tree
        for key in path:
            a, b = a[key], b[key]
        assert same(a, b)


def test_tensor_names_follow_flax_state_dict_paths(tmp_path, small):
    tree = {"params": {"dense": {"kernel": np.ones((2, 2))}}, "opt": [np.zeros(1), (np.ones(1),)],
            "step": 3}
    with ckptio.CheckpointManager(tmp_path / "ckpt", **small) as mgr:
        mgr.save(1, tree)
    manifest = json.loads((tmp_path / "ckpt/checkpoint_1/manifest.json").read_text())
    names = [t["name"] for t in manifest["tensors"]]
    assert names == ["params/dense/kernel", "opt/0", "opt/1/0", "step"]


def test_restore_shaped_like_a_target(tmp_path, small):
    saved = {"w": np.arange(6.0).reshape(2, 3), "layers": [np.ones(2), np.zeros(2)], "step": 9,
             "extra": np.ones(1)}
    target = {"w": np.empty((2, 3)), "layers": (np.empty(2), np.empty(2)), "step": 0}
    with ckptio.CheckpointManager(tmp_path / "ckpt", **small) as mgr:
        mgr.save(1, saved)
        back = mgr.restore(target=target)
        assert set(back) == {"w", "layers", "step"}   # what the target asks for
        assert type(back["layers"]) is tuple             # the target's containers
        assert back["step"] == 9 and type(back["step"]) is int
        assert same(back["w"], saved["w"]) and same(back["layers"][1], np.zeros(2))
        with pytest.raises(ValueError, match="no tensor for 1 leaf.*'missing'"):
            mgr.restore(target={"w": np.empty((2, 3)), "missing": np.empty(1)})
        with pytest.raises(ValueError, match="'w'.*shape \\(2, 3\\).*\\(3, 2\\)"):
            mgr.restore(target={"w": np.empty((3, 2))})


def test_jax_arrays_on_cpu_save_and_restore_as_numpy(tmp_path, small):
    import jax
    import jax.numpy as jnp

    key = jax.random.PRNGKey(0)
    params = {"dense": {"kernel": jax.random.normal(key, (8, 4), jnp.bfloat16),
                        "bias": jnp.zeros((4,), jnp.float32)},
              "embed": jax.random.normal(key, (16, 8)).astype(jnp.float8_e4m3fn)}
    state = {"params": params, "step": jnp.array(3, jnp.int32)}
    with ckptio.CheckpointManager(tmp_path / "ckpt", **small) as mgr:
        mgr.save(3, state)
        back = mgr.restore()
    assert isinstance(back["params"]["dense"]["kernel"], np.ndarray)
    for got, want in zip(jax.tree_util.tree_leaves(back), jax.tree_util.tree_leaves(state)):
        assert same(got, np.asarray(want))
    assert back["params"]["dense"]["kernel"].dtype == ml_dtypes.bfloat16


def test_save_returns_after_the_snapshot_so_arrays_may_change_at_once(tmp_path, small):
    w = np.arange(1 << 20, dtype=np.float32)
    with ckptio.CheckpointManager(tmp_path / "ckpt", **small) as mgr:
        handle = mgr.save(1, {"w": w})
        w[:] = -1  # the trainer's next step
        handle.wait()
        assert handle.done() and handle.error() is None and handle.step == 1
        assert handle.timings["bytes"] >= w.nbytes
        back = mgr.restore()
    assert same(back["w"], np.arange(1 << 20, dtype=np.float32))


def test_numpy_buffers_are_read_in_place_and_restored_without_a_copy(tmp_path):
    big = np.ones(32 << 20, dtype=np.uint8)  # 32 MiB
    with ckptio.CheckpointManager(tmp_path / "ckpt", staging_memory="128MiB") as mgr:
        tracemalloc.start()
        try:
            mgr.save(1, {"big": big})
            contiguous_peak = tracemalloc.get_traced_memory()[1]
            tracemalloc.reset_peak()
            mgr.save(2, {"big": big[::-1]})  # not contiguous: the one copy ckptio makes
            after_strided, strided_peak = tracemalloc.get_traced_memory()
            tracemalloc.reset_peak()
            mgr.wait_until_finished()
            back = mgr.restore(1)["big"]
            restore_peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
    assert contiguous_peak < big.nbytes // 8     # no copy of the array by Python or numpy
    assert strided_peak >= big.nbytes            # (the measurement does see a copy)
    assert after_strided < big.nbytes // 8       # freed when save() returns, not by a later gc
    assert restore_peak < big.nbytes // 8        # the restored array wraps ckptio's buffer
    assert back.flags.writeable and back.flags.c_contiguous and same(back, big)


def test_the_gil_is_released_while_cpp_saves_and_waits(tmp_path):
    counter = [0]
    stop = threading.Event()

    def spin():
        while not stop.is_set():
            counter[0] += 1

    state = {"w": np.ones(96 << 20, dtype=np.uint8)}
    with ckptio.CheckpointManager(tmp_path / "ckpt", staging_memory="256MiB") as mgr:
        mgr.save(1, state)
        mgr.wait_until_finished()  # warm up
        t = threading.Thread(target=spin)
        t.start()
        try:
            mgr.save(2, state)
            before = counter[0]
            mgr.wait_until_finished()
            during_wait = counter[0] - before
            before = counter[0]
            mgr.restore(2)
            during_restore = counter[0] - before
        finally:
            stop.set()
            t.join()
    # With the GIL held by C++ the other thread could not run a single bytecode.
    assert during_wait > 1000 and during_restore > 1000


def test_metadata_keep_and_steps(tmp_path, small):
    with ckptio.CheckpointManager(tmp_path / "ckpt", keep=2, keep_every=4, **small) as mgr:
        assert mgr.latest_step() is None and mgr.all_steps() == []
        for step in range(1, 8):
            mgr.save(step, {"x": np.full(3, step)}, metadata={"epoch": step // 2})
        mgr.wait_until_finished()
        assert mgr.all_steps() == [4, 6, 7]   # the newest 2, and multiples of 4
        assert mgr.latest_step() == 7
        assert mgr.metadata() == {"epoch": 3} and mgr.metadata(4) == {"epoch": 2}
        assert mgr.options["keep"] == 2 and mgr.options["keep_every"] == 4
        assert mgr.verify(7)["tensors"] == 1
        assert mgr.stats()["saves_committed"] == 7
        mgr.delete(7)
        assert mgr.latest_step() == 6


def test_a_read_only_manager_restores_while_the_writer_keeps_the_lock(tmp_path, small):
    root = tmp_path / "ckpt"
    with ckptio.CheckpointManager(root, **small) as writer:
        writer.save(1, {"x": np.ones(2)})
        writer.wait_until_finished()
        reader = ckptio.CheckpointManager(root, read_only=True)
        writer.save(2, {"x": np.full(2, 2.0)})
        writer.wait_until_finished()
        assert reader.all_steps() == [1, 2]  # listed again on each call
        assert same(reader.restore()["x"], np.full(2, 2.0))
        with pytest.raises(ckptio.FailedPreconditionError, match="read-only"):
            reader.save(3, {"x": np.ones(2)})
        reader.close()


def test_close_releases_the_root_for_another_writer(tmp_path, small):
    root = tmp_path / "ckpt"
    mgr = ckptio.CheckpointManager(root, **small)
    mgr.save(1, {"x": np.ones(2)})
    mgr.close()
    assert mgr.closed
    with pytest.raises(ckptio.FailedPreconditionError, match="closed"):
        mgr.latest_step()
    with ckptio.CheckpointManager(root, **small) as again:
        assert again.all_steps() == [1]


def test_errors_from_cpp_raise_python_exceptions_with_its_message(tmp_path, small):
    root = tmp_path / "ckpt"
    with ckptio.CheckpointManager(root, **small) as mgr:
        mgr.save(1, {"x": np.ones(2)})
        mgr.wait_until_finished()
        with pytest.raises(ckptio.AlreadyExistsError) as e:
            mgr.save(1, {"x": np.ones(2)})
        assert isinstance(e.value, FileExistsError) and isinstance(e.value, ckptio.CkptioError)
        assert e.value.code == "AlreadyExists"
        assert str(e.value) == f"checkpoint step 1 already exists in {root} (set overwrite to replace it)"

        with pytest.raises(FileNotFoundError, match="step 99|checkpoint_99") as e:
            mgr.restore(99)
        assert isinstance(e.value, ckptio.NotFoundError)

        with pytest.raises(ckptio.CkptioError, match="lock"):
            ckptio.CheckpointManager(root, **small)   # one writer per root

        with pytest.raises(ckptio.InvalidArgumentError, match="duplicate.*'?a/b'?|a/b.*duplicate|twice"):
            mgr.save(2, {"a/b": np.ones(1), "a": {"b": np.ones(1)}})
    with pytest.raises(ValueError, match='unknown option "stagin_memory"'):
        ckptio.CheckpointManager(root, stagin_memory="1GiB")
    with pytest.raises(ValueError, match='option "keep"'):
        ckptio.CheckpointManager(root, keep="three")
    config = tmp_path / "bad.json"
    config.write_text('{"io": {"queue_depth": "deep"}}')
    with pytest.raises(ckptio.InvalidArgumentError, match=f"{config}.*io.queue_depth"):
        ckptio.CheckpointManager(root, config=config)
    with pytest.raises(TypeError, match="'c'.*complex128 is not supported"):
        with ckptio.CheckpointManager(root, **small) as mgr:
            mgr.save(1, {"c": np.ones(2, np.complex128)})
    with pytest.raises(TypeError, match="step must be an integer"):
        with ckptio.CheckpointManager(root, **small) as mgr:
            mgr.save(1.5, {})


def test_a_config_file_sets_options_and_keywords_override_it(tmp_path, monkeypatch):
    config = tmp_path / "ckptio.json"
    config.write_text('{"keep": 5, "staging_memory": "32MiB", "shard_size": "1MiB"}')
    with ckptio.CheckpointManager(tmp_path / "a", config=config, keep=1) as mgr:
        assert mgr.options["keep"] == 1 and mgr.options["shard_size"] == "1MiB"
    monkeypatch.setenv("CKPTIO_CONFIG", str(config))
    with ckptio.CheckpointManager(tmp_path / "b", io={"queue_depth": 2}) as mgr:
        assert mgr.options["keep"] == 5 and mgr.options["io"]["queue_depth"] == 2
        mgr.save(1, {f"w{i}": np.ones(1 << 17) for i in range(4)})  # 1 MiB each: a shard each
    manifest = json.loads((tmp_path / "b/checkpoint_1/manifest.json").read_text())
    assert len(manifest["shards"]) == 4


def test_the_shards_load_with_the_safetensors_package(tmp_path):
    from safetensors import safe_open
    from safetensors.numpy import load_file

    rng = np.random.default_rng(3)
    tree = {"params": {f"w{i}": rng.standard_normal((256, 256)).astype(np.float32) for i in range(8)},
            "ints": rng.integers(-9, 9, (5, 7), dtype=np.int64), "mask": np.array([True, False]),
            "bf16": random_array(rng, ml_dtypes.bfloat16, (4, 4)), "step": 10}
    with ckptio.CheckpointManager(tmp_path / "ckpt", staging_memory="32MiB", shard_size="512KiB") as mgr:
        mgr.save(10, tree)
    ckpt = tmp_path / "ckpt/checkpoint_10"
    manifest = json.loads((ckpt / "manifest.json").read_text())
    assert len(manifest["shards"]) > 1
    dtypes = {t["name"]: t["dtype"] for t in manifest["tensors"]}
    loaded = {}
    for shard in manifest["shards"]:
        path = str(ckpt / shard["name"])
        if "BF16" not in [dtypes[n] for n in safe_open(path, framework="np").keys()]:
            loaded.update(load_file(path))
            continue
        # safetensors.numpy has no bfloat16: the others through safe_open,
        # the bfloat16 bytes at the offsets the shard's own header gives.
        with safe_open(path, framework="np") as f:
            for name in f.keys():
                if dtypes[name] != "BF16":
                    loaded[name] = f.get_tensor(name)
        with open(path, "rb") as f:
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
            body = f.read()
        for name, info in header.items():
            if name != "__metadata__" and info["dtype"] == "BF16":
                begin, end = info["data_offsets"]
                loaded[name] = np.frombuffer(body[begin:end], ml_dtypes.bfloat16).reshape(info["shape"])
    assert sorted(loaded) == sorted([f"params/w{i}" for i in range(8)] + ["ints", "mask", "bf16", "step"])
    for i in range(8):
        assert same(loaded[f"params/w{i}"], tree["params"][f"w{i}"])
    assert same(loaded["ints"], tree["ints"]) and same(loaded["mask"], tree["mask"])
    assert same(loaded["bf16"], tree["bf16"]) and same(loaded["step"], np.array(10, np.int64))


def test_a_checkpoint_written_without_a_tree_restores_as_nested_dicts(tmp_path):
    # Written through the C++ CLI: no tree description in the metadata.
    import os
    import subprocess

    from safetensors.numpy import save_file

    src = tmp_path / "in.safetensors"
    save_file({"params/dense/kernel": np.ones((2, 2), np.float32), "opt/step": np.array(4, np.int64)},
              str(src))
    cli = os.path.join(os.path.dirname(__file__), "..", "..", os.environ.get("CKPTIO_BUILD", "build"),
                       "src/cli/ckptio")
    cli = os.environ.get("CKPTIO_BIN", cli)
    subprocess.run([cli, "save", str(tmp_path / "ckpt"), "--step", "4", "--from", str(src)], check=True,
                   capture_output=True)
    with ckptio.CheckpointManager(tmp_path / "ckpt", read_only=True) as mgr:
        back = mgr.restore()
        assert mgr.metadata() in ({}, None) or isinstance(mgr.metadata(), dict)
        # With a target too (this raised TypeError: the missing tree was handed on as one).
        shaped = mgr.restore(target={"params": {"dense": {"kernel": np.zeros((2, 2), np.float32)}}})
    assert same(back["params"]["dense"]["kernel"], np.ones((2, 2), np.float32))
    assert same(back["opt"]["step"], np.array(4, np.int64))
    assert list(shaped) == ["params"] and same(shaped["params"]["dense"]["kernel"], np.ones((2, 2), np.float32))


def _evict(directory):
    """Drops the page cache of every file under `directory` (written back first)."""
    for path in directory.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def _cached_fraction(path):
    """The fraction of `path`'s pages in the page cache (mincore)."""
    import ctypes
    import mmap

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    size = path.stat().st_size
    pages = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        assert addr not in (None, ctypes.c_void_p(-1).value), os.strerror(ctypes.get_errno())
        vec = ctypes.create_string_buffer(pages)
        try:
            assert libc.mincore(addr, size, vec) == 0, os.strerror(ctypes.get_errno())
        finally:
            libc.munmap(addr, size)
    finally:
        os.close(fd)
    return sum(b & 1 for b in vec.raw) / pages


def _direct_reads_work(directory):
    probe = directory / "direct-probe"
    probe.write_bytes(b"\0" * 4096)
    try:
        os.close(os.open(probe, os.O_RDONLY | os.O_DIRECT))
        return True
    except OSError:  # tmpfs, some FUSE file systems: every read goes through the cache
        return False
    finally:
        probe.unlink()


def test_cold_restores_read_around_the_page_cache_into_any_memory_bytes_equal(tmp_path, small):
    rng = np.random.default_rng(31)
    tree = {"big": random_array(rng, np.uint8, (8 * 2**20 + 123,)),  # an odd length: a tail past the last block
            "floats": random_array(rng, np.float32, (3, 2**18 + 7)),
            "mid": random_array(rng, np.int16, (150_001,)),
            "tiny": random_array(rng, np.float64, (5,))}
    root = tmp_path / "ckpt"
    with ckptio.CheckpointManager(root, **small) as mgr:
        mgr.save(1, tree)
        mgr.wait_until_finished()
        shards = sorted(root.glob("checkpoint_1/*.safetensors"))
        assert shards
        direct = _direct_reads_work(tmp_path)

        _evict(root)
        back = mgr.restore(1)
        for name, value in tree.items():
            assert same(back[name], value), name
        if direct:
            # Read around the cache: what is cached is the blocks at the ends of the reads.
            assert max(_cached_fraction(p) for p in shards) < 0.25

        # Into arrays whose memory agrees with nothing: 1..7 bytes past an allocation.
        def misaligned(value, skew):
            raw = np.empty(value.nbytes + skew, np.uint8)[skew:]
            return raw.view(value.dtype).reshape(value.shape)

        targets = {name: misaligned(value, 1 + i) for i, (name, value) in enumerate(tree.items())}
        assert not targets["big"].ctypes.data % 4096 == 0
        _evict(root)
        assert mgr.restore_into(1, targets) == 1
        for name, value in tree.items():
            assert targets[name].tobytes() == value.tobytes(), name
        if direct:
            assert max(_cached_fraction(p) for p in shards) < 0.25


def test_a_restart_restores_before_its_explicit_staging_is_prefaulted(tmp_path):
    # A root that holds checkpoints is restored first: the pre-fault of an
    # explicit staging_memory waits for the restore (all of its calls), then
    # goes ahead; a restore or restore_into that fails releases it too.
    state = {"w": np.arange(1 << 20, dtype=np.float32), "b": np.ones(7, np.int32)}
    with ckptio.CheckpointManager(tmp_path, staging_memory="16MiB") as m:
        m.save(1, state)
        m.wait_until_finished()
    with ckptio.CheckpointManager(tmp_path, staging_memory="16MiB") as m:
        with pytest.raises(ValueError):
            m.restore_into(1, {"w": np.zeros(3, np.float32)})  # the wrong shape
        back = m.restore(1)
        assert back["w"].tobytes() == state["w"].tobytes() and back["b"].tobytes() == state["b"].tobytes()
        m.save(2, state)
        m.wait_until_finished()
        m._m.wait_until_ready()
        assert m.stats()["staging_resident_bytes"] == 16 << 20
    with ckptio.CheckpointManager(tmp_path, staging_memory="16MiB") as m:
        into = {"w": np.zeros(1 << 20, np.float32), "b": np.zeros(7, np.int32)}
        assert m.restore_into(2, into) == 2
        assert into["w"].tobytes() == state["w"].tobytes()
        # Every hold was released (a failed restore_into's too): the pre-fault
        # runs to the end (a hold left would hang here).
        m._m.wait_until_ready()
        assert m.stats()["staging_resident_bytes"] == 16 << 20
