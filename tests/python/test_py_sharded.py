"""Sharded jax.Arrays: saved as the chunks each process holds (their boxes in
the manifest), restored onto any mesh, any number of processes.

One process with the 8 CPU devices conftest.py asks for, and jax.distributed
jobs of 2 processes on 127.0.0.1 started here, saving to the local disk and
to the GCS emulator, restored onto other meshes and process counts."""
import json
import pathlib
import subprocess
import sys
import textwrap
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import ckptio
from conftest import run_processes

SHAPE = (64, 16)
HERE = str(pathlib.Path(__file__).parent)


def global_value(name, step):
    """The global array `name` holds at `step`: distinct bytes per name and step."""
    seed = sum(map(ord, name)) + 1000 * step
    return (np.arange(np.prod(SHAPE), dtype=np.float32).reshape(SHAPE) + seed) * 0.5


def mesh(shape):
    return Mesh(np.array(jax.devices()).reshape(shape), tuple("abc"[:len(shape)]))


# Every kind of sharding: two axes, one axis, fully replicated, partially replicated.
SPECS = {"two": ((4, 2), P("a", "b")), "one": ((4, 2), P("a")), "rep": ((4, 2), P()),
         "part": ((4, 2), P(None, "b"))}


def sharded_state(step):
    state = {name: jax.device_put(global_value(name, step), NamedSharding(mesh(m), spec))
             for name, (m, spec) in SPECS.items()}
    state["opt"] = {"count": step, "lr": np.float32(0.1)}
    return state


def chunks_by_array(manifest):
    arrays = {}
    for t in manifest["tensors"]:
        arrays.setdefault(t.get("array", t["name"]), []).append(t)
    return arrays


def test_every_sharding_kind_round_trips_bit_exact_and_the_manifest_records_each_chunks_box(tmp_path, small):
    with ckptio.CheckpointManager(tmp_path, **small) as mgr:
        mgr.save(1, sharded_state(1))
        mgr.wait_until_finished()
        back = mgr.restore(1)
    for name in SPECS:
        assert isinstance(back[name], np.ndarray) and back[name].tobytes() == global_value(name, 1).tobytes(), name
    assert back["opt"] == {"count": 1, "lr": np.float32(0.1)}

    manifest = json.loads((tmp_path / "checkpoint_1" / "manifest.json").read_text())
    assert manifest["format_version"] == 2
    arrays = chunks_by_array(manifest)
    # (4, 2) mesh over both axes: 8 boxes of 16 x 8.
    assert sorted(tuple(t["start"]) for t in arrays["two"]) == [(r, c) for r in (0, 16, 32, 48) for c in (0, 8)]
    assert {tuple(t["shape"]) for t in arrays["two"]} == {(16, 8)}
    assert {t["name"] for t in arrays["two"]} == {f"two@{r},{c}" for r in (0, 16, 32, 48) for c in (0, 8)}
    assert all(t["global_shape"] == list(SHAPE) for t in arrays["two"])
    # Replicated data is written once: each array's bytes on disk are its global bytes, not x replicas.
    for name in SPECS:
        assert sum(t["bytes"] for t in arrays[name]) == global_value(name, 1).nbytes, name
    assert [t["name"] for t in arrays["rep"]] == ["rep"]  # fully replicated: one whole tensor
    assert sorted(tuple(t["start"]) for t in arrays["part"]) == [(0, 0), (0, 8)]


@pytest.mark.parametrize("target_mesh,spec", [((2, 4), P("a", "b")), ((8,), P("a")), ((8,), P(None, "a")),
                                              ((1,), P()), ((4, 2), P("b", "a")), ((2, 4), P(None, "b"))],
                         ids=["2x4", "8-rows", "8-cols", "one-device", "transposed", "partly-replicated"])
def test_a_checkpoint_saved_on_a_4x2_mesh_restores_onto_another_mesh(tmp_path, small, target_mesh, spec):
    with ckptio.CheckpointManager(tmp_path, **small) as mgr:
        mgr.save(1, sharded_state(1))
        mgr.wait_until_finished()
        devices = np.array(jax.devices()[:int(np.prod(target_mesh))]).reshape(target_mesh)
        sharding = NamedSharding(Mesh(devices, tuple("abc"[:len(target_mesh)])), spec)
        target = {name: jax.ShapeDtypeStruct(SHAPE, jnp.float32, sharding=sharding) for name in SPECS}
        back = mgr.restore(1, target=target)
    for name in SPECS:
        assert isinstance(back[name], jax.Array) and back[name].sharding == sharding, name
        assert np.asarray(back[name]).tobytes() == global_value(name, 1).tobytes(), name
        for shard in back[name].addressable_shards:  # each device holds its own slice
            assert np.asarray(shard.data).tobytes() == global_value(name, 1)[shard.index].tobytes()


def test_a_restore_in_many_small_batches_reads_every_box_bit_exact(tmp_path, small, monkeypatch):
    # Batches of 4 KiB: every array is a batch or more of its own, each
    # chunk read into a temporary and copied out batch by batch.
    monkeypatch.setattr(ckptio._jax.Reads.__init__, "__defaults__", (4096,))
    with ckptio.CheckpointManager(tmp_path, **small) as mgr:
        mgr.save(1, sharded_state(1))
        mgr.wait_until_finished()
        sharding = NamedSharding(mesh((8,)), P(None, "a"))  # column strips: every chunk through a temporary
        back = mgr.restore(1, target={name: jax.ShapeDtypeStruct(SHAPE, jnp.float32, sharding=sharding)
                                      for name in SPECS})
    for name in SPECS:
        for shard in back[name].addressable_shards:
            assert np.asarray(shard.data).tobytes() == global_value(name, 1)[shard.index].tobytes(), name


def test_arrays_onto_cpu_devices_are_not_batched_their_buffers_being_the_result(tmp_path, small, monkeypatch):
    # Batches of 4 KiB, but the host buffers become the CPU devices' arrays
    # (no extra memory to bound): every array is read in one restore_slices
    # call, so the reads of one array overlap the page faults of the next.
    monkeypatch.setattr(ckptio._jax.Reads.__init__, "__defaults__", (4096,))
    batches = []
    real = ckptio._jax.Reads.run

    def spy(self, manager, step):
        if self.slices:
            batches.append(len(self.slices))
        return real(self, manager, step)

    monkeypatch.setattr(ckptio._jax.Reads, "run", spy)
    with ckptio.CheckpointManager(tmp_path, **small) as mgr:
        mgr.save(1, sharded_state(1))
        mgr.wait_until_finished()
        target = {name: jax.ShapeDtypeStruct(SHAPE, jnp.float32, sharding=NamedSharding(mesh(m), spec))
                  for name, (m, spec) in SPECS.items()}  # as saved: every box a chunk, read in place
        back = mgr.restore(1, target=target)
        assert len(batches) == 1 and batches[0] >= 8 + 4 + 1 + 2, batches  # two, one, rep, part: every chunk
    for name in SPECS:
        for shard in back[name].addressable_shards:
            assert np.asarray(shard.data).tobytes() == global_value(name, 1)[shard.index].tobytes(), name


# Arrays whose boxes on other meshes are rows of 1 KiB and more: read as
# strided slices, each row straight into place (no temporary of the chunk).
LONG_ROWS = {"wide": ((64, 2048), P("a", "b")), "deep": ((4, 32, 2048), P("a", None, "b"))}


@pytest.mark.parametrize("target_mesh,specs", [((8,), {"wide": P(None, "a"), "deep": P(None, None, "a")}),
                                               ((2, 4), {"wide": P("a", "b"), "deep": P(None, "a", "b")})],
                         ids=["8-cols", "2x4"])
def test_boxes_of_long_rows_restore_onto_another_mesh_read_straight_into_place(tmp_path, small, monkeypatch,
                                                                                  target_mesh, specs):
    strided = []
    real = ckptio._jax._strided_rows

    def spy(*args):
        out = real(*args)
        strided.append(out is not None)
        return out

    monkeypatch.setattr(ckptio._jax, "_strided_rows", spy)
    values = {name: np.random.default_rng(i).random(shape, dtype=np.float32)
              for i, (name, (shape, _)) in enumerate(LONG_ROWS.items())}
    state = {name: jax.device_put(values[name], NamedSharding(mesh((4, 2)), spec))
             for name, (_, spec) in LONG_ROWS.items()}
    devices = np.array(jax.devices()).reshape(target_mesh)
    on = Mesh(devices, tuple("abc"[:len(target_mesh)]))
    target = {name: jax.ShapeDtypeStruct(shape, jnp.float32, sharding=NamedSharding(on, specs[name]))
              for name, (shape, _) in LONG_ROWS.items()}
    with ckptio.CheckpointManager(tmp_path, **small) as mgr:
        mgr.save(1, state)
        mgr.wait_until_finished()
        back = mgr.restore(1, target=target)
        assert strided and all(strided)  # every box of every chunk went straight into place
        for name in LONG_ROWS:
            assert np.asarray(back[name]).tobytes() == values[name].tobytes(), name
            for shard in back[name].addressable_shards:
                assert np.asarray(shard.data).tobytes() == values[name][shard.index].tobytes(), name
        # The rows of a strided slice must fit its buffer: refused, naming the tensor.
        buf = np.empty(100, np.uint8)
        with pytest.raises(ckptio.InvalidArgumentError, match=r'tensor "wide@0,0": 3 rows of 40 bytes at '
                                                              r"dst_stride 40 do not fit the buffer of 100 bytes"):
            mgr._m.restore_slices(1, [("wide@0,0", 0, buf, 40, 3, 4096, 40)])


def test_a_subtree_restores_alone_and_numpy_and_sharded_checkpoints_restore_into_each_other(tmp_path, small):
    sharding = NamedSharding(mesh((2, 4)), P("b", "a"))
    with ckptio.CheckpointManager(tmp_path / "a", **small) as mgr:
        mgr.save(1, sharded_state(1))
        part = mgr.restore(1, target={"two": jax.ShapeDtypeStruct(SHAPE, jnp.float32, sharding=sharding)})
        assert list(part) == ["two"] and np.asarray(part["two"]).tobytes() == global_value("two", 1).tobytes()
        as_numpy = mgr.restore(1, target={"one": np.zeros(SHAPE, np.float32)})
        assert isinstance(as_numpy["one"], np.ndarray)
        assert as_numpy["one"].tobytes() == global_value("one", 1).tobytes()
    with ckptio.CheckpointManager(tmp_path / "b", **small) as mgr:  # saved from numpy
        mgr.save(1, {"w": global_value("w", 1)})
        back = mgr.restore(1, target={"w": jax.ShapeDtypeStruct(SHAPE, jnp.float32, sharding=sharding)})
        assert back["w"].sharding == sharding
        assert np.asarray(back["w"]).tobytes() == global_value("w", 1).tobytes()
        like = mgr.restore(1, target={"w": jax.device_put(np.zeros(SHAPE, np.float32), sharding)})
        assert like["w"].sharding == sharding and np.asarray(like["w"]).tobytes() == global_value("w", 1).tobytes()


def test_restore_buffers_are_small_pages_and_populated_here_only_when_not_read_straight_into_place(
        tmp_path, small, monkeypatch):
    # Arrays read straight into place are populated by the reads (C++);
    # arrays filled row by row or by copies out of a chunk are populated here,
    # on the populate pool. madvise is a recorder here (the advice is only a
    # hint: the restore is right without it); the decisions are the code's.
    from ckptio import _jax

    calls = []
    monkeypatch.setattr(_jax, "_madvise", lambda addr, length, advice: calls.append((advice, addr, length)) or 0)
    shape = (512, 64)  # 128 KiB of float32: rows of 256 bytes, under _MIN_RUN
    value = np.arange(np.prod(shape), dtype=np.float32).reshape(shape)
    with ckptio.CheckpointManager(tmp_path, **small) as mgr:
        mgr.save(1, {"w": jax.device_put(value, NamedSharding(mesh((4, 2)), P("a")))})
        mgr.wait_until_finished()

        def restore(m, spec):
            calls.clear()
            sharding = NamedSharding(mesh(m), spec)
            back = mgr.restore(1, target={"w": jax.ShapeDtypeStruct(shape, jnp.float32, sharding=sharding)})
            assert np.asarray(back["w"]).tobytes() == value.tobytes()
            both = threading.Barrier(2)  # each pool thread at it: every task before them has run
            for f in [_jax._populate_pool().submit(both.wait, timeout=60) for _ in range(2)]:
                f.result()
            return ([(a, n) for advice, a, n in calls if advice == _jax._MADV_POPULATE_WRITE],
                    [n for advice, _, n in calls if advice == _jax._MADV_NOHUGEPAGE])

        # The saving mesh: each device's box is one saved chunk, read into place.
        populated, small_pages = restore((4, 2), P("a"))
        assert populated == [] and small_pages == [value.nbytes // 4] * 4
        # Column strips across every saved chunk: rows of 32 bytes, copied out of each chunk.
        populated, small_pages = restore((8,), P(None, "a"))
        assert sorted(small_pages) == [value.nbytes // 8] * 8 + [256 << 20]  # the outputs, the scratch
        assert sum(n for _, n in populated) == value.nbytes
        assert all(a % _jax._ALIGN == 0 for a, _ in populated)
        assert len({a for a, _ in populated}) == len(populated) == 8  # each output once, 16 KiB in one window


def test_a_target_that_differs_from_the_checkpoint_raises_naming_the_tensor(tmp_path, small):
    sharding = NamedSharding(mesh((4, 2)), P("a"))
    with ckptio.CheckpointManager(tmp_path, **small) as mgr:
        mgr.save(1, sharded_state(1))
        with pytest.raises(ValueError, match=r"tensor 'two': the checkpoint has shape \(64, 16\), the target \(64, 8\)"):
            mgr.restore(1, target={"two": jax.ShapeDtypeStruct((64, 8), jnp.float32, sharding=sharding)})
        with pytest.raises(ValueError, match=r"tensor 'one': the checkpoint has dtype float32, the target bfloat16"):
            mgr.restore(1, target={"one": jax.ShapeDtypeStruct(SHAPE, jnp.bfloat16, sharding=sharding)})
        with pytest.raises(ValueError, match=r"no tensor for 1 leaf\(s\) of the target: 'missing'"):
            mgr.restore(1, target={"missing": jax.ShapeDtypeStruct(SHAPE, jnp.float32, sharding=sharding)})


def test_saving_an_array_already_donated_away_names_the_leaf_and_commits_nothing(tmp_path, small):
    state = sharded_state(1)
    step = jax.jit(lambda s: jax.tree.map(lambda x: x + 1, s), donate_argnums=0)
    step({"one": state["one"]})  # the caller kept the old reference: a common slip
    with ckptio.CheckpointManager(tmp_path, **small) as mgr:
        with pytest.raises(ValueError, match=r"cannot save 'one': the jax.Array was deleted \(donated"):
            mgr.save(1, state)
        mgr.wait_until_finished()
        assert mgr.all_steps() == []


@pytest.mark.parametrize("snapshot", ["borrowed", "copied"])
def test_a_step_that_donates_the_state_right_after_a_save_does_not_change_the_checkpoint(tmp_path, snapshot):
    # jax on the CPU refuses a donation while something outside holds the
    # buffer (the borrowed numpy view): the step then writes a new buffer.
    # A state of jax.Arrays is borrowed; with a numpy leaf the save copies.
    sharding = NamedSharding(mesh((4, 2)), P("a", "b"))
    state = {"w": jax.device_put(global_value("w", 1), sharding),
             "b": jax.device_put(global_value("b", 1), NamedSharding(mesh((8,)), P()))}
    extra = {"np": np.ones(4)} if snapshot == "copied" else {}
    step = jax.jit(lambda s: jax.tree_util.tree_map(lambda x: x * 3.0 - 7.0, s), donate_argnums=0)
    with ckptio.CheckpointManager(tmp_path, staging_memory="64MiB") as mgr:
        mgr.save(1, dict(state, **extra))
        state = step(state)  # donates the saved buffers while the save may still read them
        jax.block_until_ready(state)
        mgr.wait_until_finished()
        back = mgr.restore(1)
    assert back["w"].tobytes() == global_value("w", 1).tobytes()
    assert back["b"].tobytes() == global_value("b", 1).tobytes()
    assert np.asarray(state["w"]).tobytes() == (global_value("w", 1) * 3.0 - 7.0).tobytes()


CHILD = r"""
import json, sys
import numpy as np
index, port, count, roots_json = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), sys.argv[4]
import jax
jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=count, process_id=index)
import jax.numpy as jnp
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, Mesh, PartitionSpec as P
sys.path.insert(0, sys.argv[5])
import test_py_sharded as t
import ckptio

roots = json.loads(roots_json)
for root in roots["save"]:
    # No process_index, process_count or barrier: they come from jax.distributed.
    with ckptio.CheckpointManager(root, staging_memory="16MiB", threads=2) as mgr:
        for step in (1, 2):
            mgr.save(step, t.sharded_state(step))
        mgr.wait_until_finished()
        print(index, root, "steps", mgr.all_steps(), flush=True)

def check(root, step, mesh_shape, spec):
    sharding = NamedSharding(t.mesh(mesh_shape), spec)
    target = {name: jax.ShapeDtypeStruct(t.SHAPE, jnp.float32, sharding=sharding) for name in t.SPECS}
    target["opt"] = {"count": 0, "lr": np.float32(0)}
    with ckptio.CheckpointManager(root, read_only=True) as mgr:
        back = mgr.restore(step, target=target)
    for name in t.SPECS:
        got = np.asarray(multihost_utils.process_allgather(back[name], tiled=True))
        assert got.tobytes() == t.global_value(name, step).tobytes(), (root, name)
    assert back["opt"] == {"count": step, "lr": np.float32(0.1)}, back["opt"]
    print(index, "restored", root, step, mesh_shape, flush=True)

for root in roots["save"]:
    check(root, 1, (2, 4), P("a", "b"))
    check(root, 2, (8,), P(None, "a"))
for root in roots["restore"]:  # saved by one process with 8 devices
    check(root, 1, (4, 2), P("b", "a"))
print(index, "done", flush=True)
"""


def run_job(count, roots, env):
    env = dict(env, XLA_FLAGS=f"--xla_force_host_platform_device_count={8 // count}")
    results = run_processes(CHILD, count, [count, json.dumps(roots), HERE], env)
    for i, (returncode, out) in enumerate(results):
        assert returncode == 0 and f"{i} done" in out, f"process {i} of {count}:\n{out}"
    return [out for _, out in results]


def test_two_processes_save_a_sharded_state_to_disk_and_gcs_and_it_restores_on_one_and_two(
        tmp_path, small, child_env, gcs_env, gcs_root, gcs_direct_client):
    one = tmp_path / "saved-by-one"
    with ckptio.CheckpointManager(one, **small) as mgr:
        mgr.save(1, sharded_state(1))
    local = tmp_path / "saved-by-two"
    env = dict(child_env, **{k: v for k, v in gcs_env.items() if k.startswith(("STORAGE_EMULATOR", "GCE_METADATA"))})
    env.pop("GOOGLE_APPLICATION_CREDENTIALS", None)
    run_job(2, {"save": [str(local), gcs_root], "restore": [str(one)]}, env)

    # Two processes -> one: every global array bit-exact on a mesh of this process's 8 devices.
    sharding = NamedSharding(mesh((8,)), P("a"))
    for root in (local, gcs_root):
        with ckptio.CheckpointManager(root, read_only=True) as mgr:
            assert mgr.all_steps() == [1, 2]
            target = {name: jax.ShapeDtypeStruct(SHAPE, jnp.float32, sharding=sharding) for name in SPECS}
            back = mgr.restore(2, target=target)
            for name in SPECS:
                assert np.asarray(back[name]).tobytes() == global_value(name, 2).tobytes(), (root, name)
            assert mgr.verify(2)["tensors"] > len(SPECS)

    # Each process wrote its own chunks; replicated data once in total, split between the two.
    manifest = json.loads((local / "checkpoint_2" / "manifest.json").read_text())
    arrays = chunks_by_array(manifest)
    for name in SPECS:
        assert sum(t["bytes"] for t in arrays[name]) == global_value(name, 2).nbytes, name
    assert {t["shard"].split("-")[1] for t in arrays["rep"]} == {"p00000", "p00001"}
    assert sorted(tuple(t["start"]) for t in arrays["rep"]) == [(0, 0), (32, 0)]
    assert [t["name"] for t in arrays["opt/count"]] == ["opt/count"]  # process 0 alone wrote the scalars
    # The official client reads the same manifest from the emulator.
    bucket = gcs_direct_client.bucket(gcs_root.split("/")[2])
    remote = json.loads(bucket.blob("run/checkpoint_2/manifest.json").download_as_bytes())
    assert sorted(t["name"] for t in remote["tensors"]) == sorted(t["name"] for t in manifest["tensors"])


def test_the_flax_drop_in_saves_sharded_state_and_restores_it_onto_the_targets_shardings(tmp_path, flax_ckpt):
    state = sharded_state(3)
    flax_ckpt.save_checkpoint_multiprocess(str(tmp_path), state, 3)
    sharding = NamedSharding(mesh((2, 4)), P(None, "a"))
    target = {name: jax.ShapeDtypeStruct(SHAPE, jnp.float32, sharding=sharding) for name in SPECS}
    target["opt"] = {"count": 0, "lr": np.float32(0)}
    back = flax_ckpt.restore_checkpoint(str(tmp_path), target)
    for name in SPECS:
        assert back[name].sharding == sharding
        assert np.asarray(back[name]).tobytes() == global_value(name, 3).tobytes(), name
    assert back["opt"] == {"count": 3, "lr": np.float32(0.1)}


def test_a_loop_written_for_orbax_runs_with_only_its_import_changed(tmp_path):
    from ckptio import orbax as ocp

    sharding = NamedSharding(mesh((4, 2)), P("a", "b"))
    options = ocp.CheckpointManagerOptions(max_to_keep=2, save_interval_steps=2)
    with ocp.CheckpointManager(tmp_path / "run", options=options, staging_memory="64MiB") as mgr:
        saved = []
        for step in range(1, 8):
            state = {"w": jax.device_put(global_value("w", step), sharding), "step": step}
            saved.append(mgr.save(step, args=ocp.args.StandardSave(state)))
        mgr.wait_until_finished()
        assert saved == [True, True, False, True, False, True, False]  # orbax's: the first, then every 2nd
        assert mgr.all_steps() == [4, 6] and mgr.latest_step() == 6
        abstract = {"w": jax.ShapeDtypeStruct(SHAPE, jnp.float32, sharding=sharding), "step": 0}
        back = mgr.restore(mgr.latest_step(), args=ocp.args.StandardRestore(abstract))
    assert back["step"] == 6 and back["w"].sharding == sharding
    assert np.asarray(back["w"]).tobytes() == global_value("w", 6).tobytes()
    assert sorted(p.name for p in (tmp_path / "run").iterdir() if not p.name.startswith(".")) == ["4", "6"]


def test_orbax_calls_with_its_positional_order_and_keywords_work(tmp_path):
    from ckptio import orbax as ocp

    sharding = NamedSharding(mesh((4, 2)), P("a"))
    state = {"w": jax.device_put(global_value("w", 3), sharding)}
    with ocp.CheckpointManager(tmp_path / "run", staging_memory="64MiB") as mgr:
        with pytest.raises(FileNotFoundError, match="no committed checkpoint"):
            mgr.restore(None)
        assert mgr.save(3, state, None, {"loss": 0.5}, custom_metadata={"lr": 0.1})  # items, save_kwargs, metrics
        assert mgr.save(4, ocp.args.StandardSave(state), metrics={"loss": 0.4})
        mgr.wait_until_finished()
        assert mgr.metadata(3) == {"lr": 0.1}
        abstract = {"w": jax.ShapeDtypeStruct(SHAPE, jnp.float32, sharding=sharding)}
        back = mgr.restore(3, abstract)  # items: the target, positionally
        assert back["w"].sharding == sharding and np.asarray(back["w"]).tobytes() == global_value("w", 3).tobytes()
    with ocp.CheckpointManager(tmp_path / "other", staging_memory="64MiB") as other:
        back = other.restore(None, args=ocp.args.StandardRestore(abstract), directory=tmp_path / "run")
        assert np.asarray(back["w"]).tobytes() == global_value("w", 3).tobytes()
        assert other.all_steps() == []


def test_an_orbax_restore_of_the_latest_step_waits_for_the_save_still_in_flight(tmp_path):
    from ckptio import orbax as ocp

    sharding = NamedSharding(mesh((4, 2)), P("a"))
    abstract = {"w": jax.ShapeDtypeStruct(SHAPE, jnp.float32, sharding=sharding)}
    with ocp.CheckpointManager(tmp_path / "run", staging_memory="64MiB") as mgr:
        for step in (1, 2):
            mgr.save(step, args=ocp.args.StandardSave({"w": jax.device_put(global_value("w", step), sharding)}))
        plain = mgr.restore(None, args=ocp.args.StandardRestore(abstract))  # no wait_until_finished before
        assert np.asarray(plain["w"]).tobytes() == global_value("w", 2).tobytes()
        mgr.save(3, args=ocp.args.Composite(state=ocp.args.StandardSave({"w": global_value("w", 3)}),
                                            meta=ocp.args.JsonSave({"step": 3})))
        both = mgr.restore(None, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
        assert both.meta == {"step": 3}


def test_orbax_options_decide_which_steps_are_saved_as_orbax_does(tmp_path):
    from ckptio import orbax as ocp

    # Each expected list is what orbax-checkpoint 0.12.8 returned for the same calls.
    def saved(**options):
        with ocp.CheckpointManager(tmp_path / str(len(list(tmp_path.iterdir()))), None,
                                   ocp.CheckpointManagerOptions(**options), staging_memory="16MiB") as mgr:
            return [mgr.save(step, args=ocp.args.StandardSave({"w": np.full(3, step)})) for step in range(1, 8)]

    assert saved(save_interval_steps=2, save_on_steps=[5]) == [True, True, False, True, True, True, False]
    assert saved(should_save_fn=lambda step, last: step % 3 == 0) == [False, False, True, False, False, True, False]
    with pytest.raises(NotImplementedError, match="best_fn"):
        ocp.CheckpointManagerOptions(best_fn=lambda metrics: metrics["loss"])
    with ocp.CheckpointManager(tmp_path / "ro", options=ocp.CheckpointManagerOptions(max_to_keep=1)) as mgr:
        mgr.save(1, args=ocp.args.StandardSave({"w": np.arange(3)}))
    with ocp.CheckpointManager(tmp_path / "ro", options=ocp.CheckpointManagerOptions(read_only=True)) as mgr:
        assert not mgr.should_save(2) and mgr.save(2, args=ocp.args.StandardSave({"w": np.arange(3)})) is False
        assert mgr.all_steps() == [1] and mgr.restore(1)["w"].tolist() == [0, 1, 2]


def test_an_orbax_composite_of_a_sharded_state_and_json_metadata_round_trips(tmp_path):
    from ckptio import orbax as ocp

    sharding = NamedSharding(mesh((4, 2)), P("a", "b"))
    state = {"w": jax.device_put(global_value("w", 5), sharding), "step": 5}
    meta = {"lr": 0.25, "name": "run-7", "epochs": [1, 2], "done": False}
    with ocp.CheckpointManager(tmp_path / "run", item_names=("state", "meta"), staging_memory="64MiB") as mgr:
        assert mgr.save(5, args=ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)))
        mgr.wait_until_finished()
        abstract = {"w": jax.ShapeDtypeStruct(SHAPE, jnp.float32, sharding=sharding), "step": 0}
        back = mgr.restore(5, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract),
                                                      meta=ocp.args.JsonRestore()))
        assert back.meta == meta and type(back.meta["lr"]) is float and type(back["meta"]["epochs"][0]) is int
        assert back.state["step"] == 5 and back.state["w"].sharding == sharding
        assert np.asarray(back.state["w"]).tobytes() == global_value("w", 5).tobytes()
        only_meta = mgr.restore(5, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
        assert list(only_meta) == ["meta"] and only_meta.meta == meta
        as_saved = mgr.restore(5)  # no args: every item, as saved
        assert sorted(as_saved) == ["meta", "state"] and as_saved.meta == meta
        assert np.asarray(as_saved.state["w"]).tobytes() == global_value("w", 5).tobytes()
        with pytest.raises(ValueError, match=r"has no item 'dataset' \(it holds 'meta', 'state'\)"):
            mgr.restore(5, args=ocp.args.Composite(dataset=ocp.args.JsonRestore()))


def test_four_processes_of_two_devices_save_and_restore_from_and_onto_one(tmp_path, small, child_env):
    one = tmp_path / "saved-by-one"
    with ckptio.CheckpointManager(one, **small) as mgr:
        mgr.save(1, sharded_state(1))
    four = tmp_path / "saved-by-four"
    run_job(4, {"save": [str(four)], "restore": [str(one)]}, child_env)
    sharding = NamedSharding(mesh((2, 4)), P("b"))
    with ckptio.CheckpointManager(four, read_only=True) as mgr:
        target = {name: jax.ShapeDtypeStruct(SHAPE, jnp.float32, sharding=sharding) for name in SPECS}
        back = mgr.restore(2, target=target)
    for name in SPECS:
        assert np.asarray(back[name]).tobytes() == global_value(name, 2).tobytes(), name
    arrays = chunks_by_array(json.loads((four / "checkpoint_2" / "manifest.json").read_text()))
    # The replicated array, split four ways, one quarter from each process.
    assert sorted(t["shard"].split("-")[1] for t in arrays["rep"]) == ["p00000", "p00001", "p00002", "p00003"]
    for name in SPECS:
        assert sum(t["bytes"] for t in arrays[name]) == global_value(name, 2).nbytes, name


def test_a_state_of_jax_arrays_is_borrowed_not_copied_into_staging(tmp_path, capfd):
    # Staging far smaller than the state: a copied save could not fit and
    # would be written before save() returns (said on stderr); a borrowed one
    # needs staging for the shard headers only.
    big = np.arange(2 << 20, dtype=np.float32)  # 8 MiB
    with ckptio.CheckpointManager(tmp_path / "jax", staging_memory="1MiB") as mgr:
        mgr.save(1, {"w": jax.device_put(big, NamedSharding(mesh((8,)), P("a"))), "step": 1})
        mgr.save(2, {"w": jnp.asarray(big) + 1, "step": 2})
        mgr.wait_until_finished()
        assert mgr.restore(2)["w"].tobytes() == (big + 1).tobytes()
    assert "more than staging_memory" not in capfd.readouterr().err
    with ckptio.CheckpointManager(tmp_path / "numpy", staging_memory="1MiB") as mgr:
        mgr.save(1, {"w": big})  # the caller's numpy array may change after save(): copied
    assert "more than staging_memory" in capfd.readouterr().err


CHILD_KILLED = r"""
import os, signal, sys
index, port, root = int(sys.argv[1]), sys.argv[2], sys.argv[3]
import jax
jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2, process_id=index,
                           heartbeat_timeout_seconds=5)
sys.path.insert(0, sys.argv[4])
import test_py_sharded as t
import ckptio

mgr = ckptio.CheckpointManager(root, staging_memory="16MiB", threads=2)
mgr.save(1, t.sharded_state(1))
mgr.wait_until_finished()
print(index, "committed 1", flush=True)
mgr.save(2, t.sharded_state(2))
if index == 1:
    os.kill(os.getpid(), signal.SIGKILL)  # mid-save: its part of step 2 may be written or not
try:
    mgr.wait_until_finished()
    print(index, "committed 2", flush=True)
except ckptio.CkptioError as e:
    print(index, "failed:", e, flush=True)
os._exit(0)  # (jax also ends this process once it learns a peer died)
"""


def test_a_process_killed_mid_save_leaves_no_commit_the_other_names_it_and_the_previous_step_restores(
        tmp_path, child_env):
    root = tmp_path / "ckpt"
    env = dict(child_env, XLA_FLAGS="--xla_force_host_platform_device_count=4")
    (rc0, out0), (rc1, out1) = run_processes(CHILD_KILLED, 2, [root, HERE], env, timeout=120)
    outs = [out0, out1]
    assert rc1 == -9 and "1 committed 1" in outs[1], outs[1]
    assert "0 committed 1" in outs[0] and "0 committed 2" not in outs[0], outs[0]
    # The survivor's error says which save failed, at which barrier, and which process is gone
    # (jax's coordination service also ends the survivor when it learns a peer died: it may
    # do so before ckptio's error is printed, and then its own message names the process).
    ours = ("0 failed: cannot save step 2" in outs[0] and 'barrier "written/2"' in outs[0]
            and "Task 1 heartbeat timeout" in outs[0])
    jaxs = "tasks are unhealthy (stopped sending heartbeats):\n1\n" in outs[0]
    assert ours or jaxs, outs[0]
    assert not (root / "checkpoint_2" / "manifest.json").exists()
    with ckptio.CheckpointManager(root, staging_memory="16MiB") as mgr:  # a writer clears the debris
        assert mgr.all_steps() == [1]
        back = mgr.restore(1)
    assert sorted(p.name for p in root.iterdir() if not p.name.startswith(".")) == ["checkpoint_1"]
    for name in SPECS:
        assert back[name].tobytes() == global_value(name, 1).tobytes(), name


def test_ckptio_export_writes_each_sharded_array_whole(tmp_path, small):
    import conftest
    from safetensors.numpy import load_file

    if conftest.MODULE_PATH is None:
        pytest.skip("the command line is tested from the build tree")
    cli = conftest.MODULE_PATH.parent / "src" / "cli" / "ckptio"
    cube = np.arange(8 * 6 * 16, dtype=np.int32).reshape(8, 6, 16)
    state = dict(sharded_state(1))
    # Chunks split on the last axes too: runs of a few elements each in the export.
    state["cube"] = jax.device_put(cube, NamedSharding(mesh((2, 2, 2)), P("a", "b", "c")))
    state["cols"] = jax.device_put(cube, NamedSharding(mesh((8,)), P(None, None, "a")))
    with ckptio.CheckpointManager(tmp_path / "ckpt", **small) as mgr:
        mgr.save(1, state)
    out = tmp_path / "all.safetensors"
    done = subprocess.run([str(cli), "export", str(tmp_path / "ckpt"), "--out", str(out)], capture_output=True,
                          text=True)
    assert done.returncode == 0, done.stderr
    assert "8 tensors" in done.stdout, done.stdout
    exported = load_file(str(out))
    assert sorted(exported) == sorted(list(SPECS) + ["cube", "cols", "opt/count", "opt/lr"])
    for name in SPECS:
        assert exported[name].tobytes() == global_value(name, 1).tobytes(), name
    assert exported["cube"].tobytes() == cube.tobytes() and exported["cols"].tobytes() == cube.tobytes()
    assert exported["opt/count"] == 1
