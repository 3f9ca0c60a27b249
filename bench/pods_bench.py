#!/usr/bin/env python3
"""Pods (issue 28): two tiers over several jax processes, against one process and against saving
straight to GCS, with fio in the same run.

    .venv/bin/python bench/pods_bench.py [--size-gib 1] [--saves 10] [--compute 2]
        [--ckptio-python build/python] [--orbax-python .venv-bench/bin/python] [--rows 1,2] [--dir DIR]
        [--out bench/results/pods.md]

The state: float32 arrays of --size-gib in all on a (4, 2) mesh ('a', 'b') of 8 CPU devices:
8 arrays P('a', 'b'), 4 arrays P('a') and one small array fully replicated (held by every
process: with two tiers each host keeps the part another process writes as a local copy),
built with jax.make_array_from_callback (each process makes its own shards). The GCS emulator
of tests/gcs (gcp-storage-emulator behind the fault proxy, no faults, on 127.0.0.1) is the
remote tier. Rows, each a fresh job:

  1 process, two tiers     one process with the 8 devices: a local directory + the emulator
  2 processes, two tiers   2 processes x 4 devices (jax.distributed, gloo): a local directory
                           per process (each host's own local tier) + the emulator
  2 processes, GCS only    the same processes saving straight to the emulator
  replicated, ckptio       2 processes that both hold all of the state (8 arrays P(None, 'b')):
                           process 0 writes it, process 1 keeps a local copy of its own
  replicated, orbax        orbax's emergency CheckpointManager on the same state (a (2, 4) mesh
                           ('replica', 'model'), one replica per process, P(None, 'model')):
                           process 1 saves the local copy, process 0 the persistent one on the
                           emulator (gcsfs, tensorstore); local and persistent on every save.
                           Run with --orbax-python (make venv-bench); skipped without it.
The array values are hashed floats: orbax compresses its chunks (zstd), ckptio does not, and
nothing here is compressible.

Per row, after one untimed save (waited for in every tier):
  commit     3 saves, each waited for: blocked = the time save() held the caller; local commit
             = save() to wait_until_finished(); remote commit = that to
             wait_until_finished(tier="remote") (two tiers: the copy; GCS only: the commit is
             remote). Medians; with 2 processes the slower process's.
  seed loop  --saves saves with --compute seconds of idle compute before each (a host waiting
             while its accelerator computes); overhead = (loop wall - compute) / compute, the
             loop ending with wait_until_finished() (the local tier); the final wait is given
             apart, and how long the remote tier took to catch up after it.
Restart restores, each in a new job after the saving one ended, page cache dropped first
(echo 3 > /proc/sys/vm/drop_caches, else fsync + POSIX_FADV_DONTNEED on the local files):
  all copies local   every host's local tier as the saves left it
  one host replaced  process 1's local tier deleted (it reads from the emulator)
  all copies remote  every local tier deleted
Restore time = the slower process's restore() (onto the saved mesh, jax.Array targets),
checked bit-exact (process_allgather); throughput = state bytes / time, against fio's
O_DIRECT read of a file of the state's size measured just before that row's restores (the
commits: against its write before the first row).
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
GIB = 1 << 30

SHARED = r"""
COLS = 1024

def layout(nbytes, replicated=False):
    rows = lambda f: max(8, int(nbytes * f) // (4 * COLS) // 8 * 8)
    if replicated:  # every process holds all of it: 8 arrays, each split over one process's devices
        return [(f"layers/{i}/w", (rows(1 / 8), COLS), "rep_b") for i in range(8)]
    out = [("embed/positions", (rows(1 / 64), COLS), "rep")]
    for layer in range(4):
        p = f"layers/{layer}/"
        out += [(p + "w_in", (rows(0.075), COLS), "ab"), (p + "w_out", (rows(0.075), COLS), "ab"),
                (p + "adam_mu", (rows(0.094), COLS), "a")]
    return out

def value(seed, index, shape):
    # Floats in [1, 2) with 23 hashed mantissa bits: nothing a compressor shrinks (orbax's zarr
    # chunks are zstd-compressed; ckptio stores the bytes as they are).
    rows = np.arange(shape[0], dtype=np.uint64)[index[0]][:, None]
    cols = np.arange(shape[1], dtype=np.uint64)[index[1]][None, :]
    x = (rows * np.uint64(shape[1]) + cols + np.uint64(seed * 7919)) * np.uint64(2654435761) % np.uint64(1 << 32)
    return ((x.astype(np.uint32) >> 9) | np.uint32(0x3F800000)).view(np.float32)
"""

CHILD = r"""
import json, os, sys, time
index, port, count, ckptio_path, mode, args = (int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), sys.argv[4],
                                               sys.argv[5], json.loads(sys.argv[6]))
sys.path.insert(0, ckptio_path)
import numpy as np
import jax
jax.config.update("jax_cpu_collectives_implementation", "gloo")
if count > 1:
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=count, process_id=index)
import jax.numpy as jnp
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, Mesh, PartitionSpec as P
import ckptio

mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("a", "b"))
SPEC = {"ab": P("a", "b"), "a": P("a"), "rep": P(), "rep_b": P(None, "b")}
#SHARED#
def state():
    out = {}
    for seed, (name, shape, kind) in enumerate(layout(args["bytes"], args.get("replicated", False))):
        sharding = NamedSharding(mesh, SPEC[kind])
        out[name] = jax.make_array_from_callback(shape, sharding, lambda idx, s=seed, sh=shape: value(s, idx, sh))
    jax.block_until_ready(out)
    return out

def sync(name):
    if count > 1:
        multihost_utils.sync_global_devices(name)

def manager():
    opts = dict(keep=3, staging_memory=f"{2 * args['bytes'] >> 20}MiB")
    if args.get("remote"):
        opts["tiers"] = {"remote": args["remote"], "remote_keep": 3}
    return ckptio.CheckpointManager(args["roots"][index], **opts)

out = {}
if mode == "save":
    s = state()
    with manager() as mgr:
        mgr.save(1, s)
        mgr.wait_until_finished(tier="remote")
        blocked, local, remote = [], [], []
        for step in (2, 3, 4):
            sync(f"commit{step}")
            t = time.perf_counter()
            mgr.save(step, s)
            t1 = time.perf_counter()
            mgr.wait_until_finished()
            t2 = time.perf_counter()
            mgr.wait_until_finished(tier="remote")
            t3 = time.perf_counter()
            blocked.append(t1 - t); local.append(t2 - t); remote.append(t3 - t2)
        sync("loop")
        loop_blocked = []
        t0 = time.perf_counter()
        for step in range(5, 5 + args["saves"]):
            time.sleep(args["compute"])
            t = time.perf_counter()
            mgr.save(step, s)
            loop_blocked.append(time.perf_counter() - t)
        t = time.perf_counter()
        mgr.wait_until_finished()
        wall = time.perf_counter() - t0
        final_wait = time.perf_counter() - t
        mgr.wait_until_finished(tier="remote")
        caught_up = time.perf_counter() - t0 - wall
        stats = mgr.stats()
        out = dict(blocked=blocked, local=local, remote=remote, loop_blocked=loop_blocked, wall=wall,
                   compute=args["saves"] * args["compute"], final_wait=final_wait, caught_up=caught_up,
                   skipped=stats["replications_skipped"], steps=mgr.all_steps())
else:  # restore
    target = {name: jax.ShapeDtypeStruct(shape, jnp.float32, sharding=NamedSharding(mesh, SPEC[kind]))
              for name, shape, kind in layout(args["bytes"], args.get("replicated", False))}
    with manager() as mgr:
        sync("restore")
        t = time.perf_counter()
        back = mgr.restore(target=target)
        jax.block_until_ready(back)
        took = time.perf_counter() - t
        step = mgr.latest_step()
        bytes_remote = mgr.stats()["bytes_read_remote"]
    for seed, (name, shape, kind) in enumerate(layout(args["bytes"], args.get("replicated", False))):
        got = np.asarray(multihost_utils.process_allgather(back[name], tiled=True)) if count > 1 else np.asarray(back[name])
        want = value(seed, (slice(None), slice(None)), shape)
        assert got.tobytes() == want.tobytes(), name
    out = dict(took=took, step=step, bytes_remote=bytes_remote)
print("RESULT", json.dumps(out), flush=True)
""".replace("#SHARED#", SHARED)

# orbax's emergency CheckpointManager on the replicated state: a (2, 4) mesh ("replica", "model"),
# one replica per process; process 0 (the primary slice) writes the persistent copy (the emulator,
# through gcsfs and tensorstore), the other process its local copy, both every save; a restore
# reads the local copy where one is complete and broadcasts it, else the persistent one.
ORBAX_CHILD = r"""
import json, os, sys, time
index, port, count, mode, args = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), sys.argv[5], json.loads(sys.argv[6])
import numpy as np
import jax
jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=count, process_id=index)
from absl import flags
flags.FLAGS(["pods_bench"], known_only=True)  # orbax's multihost code reads absl flags
import jax.numpy as jnp
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, Mesh, PartitionSpec as P
from etils import epath
import orbax.checkpoint as ocp
from orbax.checkpoint.experimental.emergency import checkpoint_manager as ecm
from orbax.checkpoint._src.multihost import multihost as omh
omh.initialize_runtime_to_distributed_ids()
omh.initialize_distributed_to_device_ids()
#SHARED#
mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("replica", "model"))
sharding = NamedSharding(mesh, P(None, "model"))
names = layout(args["bytes"], True)
abstract = {name: jax.ShapeDtypeStruct(shape, jnp.float32, sharding=sharding) for name, shape, _ in names}

def sync(name):
    multihost_utils.sync_global_devices(name)

def manager():
    local = args["roots"][index]
    os.makedirs(local, exist_ok=True)
    if index == 0:  # the caller creates both directories; an object makes the gs:// one exist
        (epath.Path(args["remote"]) / ".created").write_text("")
    sync("mkdir")
    opts = ecm.CheckpointManagerOptions(local=ecm.LocalCheckpointOptions(save_interval_steps=1, max_to_keep=3),
                                        persistent=ecm.PersistentCheckpointOptions(save_interval_steps=1,
                                                                                   max_to_keep=3))
    return ecm.CheckpointManager(local, args["remote"], mesh, abstract, options=opts)

out = {}
if mode == "save":
    s = {name: jax.make_array_from_callback(shape, sharding, lambda idx, i=i, sh=shape: value(i, idx, sh))
         for i, (name, shape, _) in enumerate(names)}
    jax.block_until_ready(s)
    mgr = manager()
    save = lambda step: mgr.save(step, args=ocp.args.Composite(state=ocp.args.PyTreeSave(s)))
    save(1)
    mgr.wait_until_finished()
    blocked, local, remote = [], [], []
    for step in (2, 3, 4):
        sync(f"commit{step}")
        t = time.perf_counter()
        save(step)
        t1 = time.perf_counter()
        mgr.wait_until_finished()  # its own slice: local on process 1, persistent on process 0
        t2 = time.perf_counter()
        blocked.append(t1 - t)
        (remote if mgr.in_primary_slice else local).append(t2 - t)
    sync("loop")
    loop_blocked = []
    t0 = time.perf_counter()
    for step in range(5, 5 + args["saves"]):
        time.sleep(args["compute"])
        t = time.perf_counter()
        save(step)
        loop_blocked.append(time.perf_counter() - t)
    t = time.perf_counter()
    mgr.wait_until_finished()
    wall = time.perf_counter() - t0
    out = dict(blocked=blocked, local=local, remote=remote, loop_blocked=loop_blocked, wall=wall,
               compute=args["saves"] * args["compute"], final_wait=time.perf_counter() - t, caught_up=0.0,
               skipped=0, primary=mgr.in_primary_slice)
    mgr.close()
else:
    mgr = manager()
    sync("restore")
    t = time.perf_counter()
    step = mgr.latest_step()
    back = mgr.restore(step, args=ocp.args.Composite(state=ocp.args.PyTreeRestore(abstract)))["state"]
    jax.block_until_ready(back)
    took = time.perf_counter() - t
    mgr.close()
    for i, (name, shape, _) in enumerate(names):
        got = np.asarray(multihost_utils.process_allgather(back[name], tiled=True))
        assert got.tobytes() == value(i, (slice(None), slice(None)), shape).tobytes(), name
    out = dict(took=took, step=int(step), bytes_remote=None)
print("RESULT", json.dumps(out), flush=True)
""".replace("#SHARED#", SHARED)



def free_port():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def job(count, mode, args, a, env, tool="ckptio"):
    """Runs the child of `tool` in `count` processes; their results by process."""
    env = dict(env, XLA_FLAGS=f"--xla_force_host_platform_device_count={8 // count}", JAX_PLATFORMS="cpu",
               PYTHONUNBUFFERED="1")
    if tool == "orbax":  # orbax's gs:// directories go through gcsfs, its arrays through tensorstore
        endpoint = env["STORAGE_EMULATOR_HOST"]
        env.update(TENSORSTORE_GCS_HTTP_URL=endpoint, GOOGLE_AUTH_TOKEN_FOR_TESTING="emulator", FSSPEC_GS_TOKEN="anon",
                   FSSPEC_GCS_TOKEN="anon", GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT="false")
    python, child = (a.orbax_python, ORBAX_CHILD) if tool == "orbax" else (sys.executable, CHILD)
    port = str(free_port())
    procs = [subprocess.Popen([python, "-c", child, str(i), port, str(count), a.ckptio_python, mode,
                               json.dumps(args)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i in range(count)]
    outs = [p.communicate(timeout=3600)[0] for p in procs]
    results = []
    for i, (p, out) in enumerate(zip(procs, outs)):
        line = next((line for line in out.splitlines() if line.startswith("RESULT ")), None)
        if p.returncode != 0 or line is None:
            sys.exit(f"pods_bench: process {i} of {count} ({tool} {mode}) failed:\n{out[-3000:]}")
        results.append(json.loads(line[len("RESULT "):]))
    return results


def drop_caches(roots):
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
    except OSError:  # not root: each local file's pages (sharded_bench's way)
        import sharded_bench
        for root in roots:
            sharded_bench.evict(root)


def fio(path, gib):
    """fio's O_DIRECT sequential read and write rates (bytes/s) of a gib-GiB file."""
    common = ["fio", "--name=p", f"--filename={path}", "--bs=8M", f"--size={gib}G", "--ioengine=libaio",
              "--iodepth=8", "--direct=1", "--output-format=json"]
    rates = {}
    for rw in ("write", "read"):
        p = subprocess.run(common + [f"--rw={rw}"] + (["--end_fsync=1"] if rw == "write" else []), check=True,
                           capture_output=True, text=True)
        rates[rw] = json.loads(p.stdout[p.stdout.index("{"):])["jobs"][0][rw]["bw_bytes"]
    os.unlink(path)
    return rates


def med(xs):
    return statistics.median(xs)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--size-gib", type=float, default=1.0)
    ap.add_argument("--saves", type=int, default=10)
    ap.add_argument("--compute", type=float, default=2.0)
    ap.add_argument("--ckptio-python", default="build/python")
    ap.add_argument("--orbax-python", default=os.path.join(ROOT, ".venv-bench", "bin", "python"),
                    help="a python with orbax-checkpoint (make venv-bench) for the orbax row; skipped if absent")
    ap.add_argument("--dir", default=None)
    ap.add_argument("--rows", default=None,
                    help="the rows to run, by number (1-5, in the order of the table above); default all")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    a.ckptio_python = os.path.abspath(a.ckptio_python)
    nbytes = int(a.size_gib * GIB)
    sys.path.insert(0, os.path.join(ROOT, "tests", "gcs"))
    import testbed  # noqa: E402  (tests/gcs: the emulator on 127.0.0.1)
    base = tempfile.mkdtemp(prefix="ckptio-pods-", dir=a.dir or os.path.join(HERE, "results"))
    lines = []
    try:
        rates = fio(os.path.join(base, "fio.tmp"), max(1, round(nbytes / GIB)))
        rows = {}
        table = [("1 process, two tiers", 1, "one", False, "ckptio"), ("2 processes, two tiers", 2, "two", False, "ckptio"),
                 ("2 processes, GCS only", 2, None, False, "ckptio"),
                 ("replicated, 2 processes: ckptio two tiers", 2, "rep", True, "ckptio")]
        if os.path.exists(a.orbax_python):
            table.append(("replicated, 2 processes: orbax emergency", 2, "orbax", True, "orbax"))
        else:
            print(f"pods_bench: no {a.orbax_python} (make venv-bench): the orbax row is skipped", file=sys.stderr)
        if a.rows:
            wanted = [int(i) for i in a.rows.split(",")]
            table = [table[i - 1] for i in wanted]
        for name, count, remote, replicated, tool in table:
            # An emulator per row: it holds what it is sent in memory, and freed too little of it
            # (OOM-killed at 18 GB in the second row of a 1 GiB run with one emulator for all).
            with testbed.GcsTestbed() as bed:
                env = bed.env()
                env["PYTHONPATH"] = os.pathsep.join([a.ckptio_python, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
                gs = f"gs://{bed.bucket}"
                remote = remote and f"{gs}/{remote}"
                key = name.replace(" ", "_").replace(",", "")
                roots = [os.path.join(base, key, f"host{i}") for i in range(count)] if remote else \
                    [f"{gs}/{key}"] * count
                args = {"bytes": nbytes, "saves": a.saves, "compute": a.compute, "roots": roots, "remote": remote,
                        "replicated": replicated}
                saved = job(count, "save", args, a, env, tool)
                # The disk drifts from run to run and within one: each row's restores are set
                # against a fio read measured just before them.
                read_rate = fio(os.path.join(base, "fio.tmp"), max(1, round(nbytes / GIB)))["read"]
                restores = {}
                if remote:
                    drop_caches(roots)
                    restores["all copies local"] = job(count, "restore", args, a, env, tool)
                    if count > 1:
                        shutil.rmtree(roots[1])
                        drop_caches(roots)
                        restores["one host replaced"] = job(count, "restore", args, a, env, tool)
                    for r in roots:
                        shutil.rmtree(r, ignore_errors=True)
                    restores["all copies remote"] = job(count, "restore", args, a, env, tool)
                else:
                    restores["all copies remote"] = job(count, "restore", args, a, env, tool)
                rows[name] = (saved, restores, read_rate)
    finally:
        shutil.rmtree(base, ignore_errors=True)

    gb = nbytes / 1e9
    lines.append(f"# Pods: {a.size_gib:g} GiB of state, two tiers over 2 jax processes\n")
    lines.append(f"Command: `{' '.join(sys.argv)}`  ")
    lines.append(f"Load average at the end: {open('/proc/loadavg').read().split()[:3]}  ")
    lines.append(f"fio (O_DIRECT, 8 MiB, iodepth 8, same disk, same run) before the saves: write "
                 f"{rates['write'] / 1e9:.2f} GB/s, read {rates['read'] / 1e9:.2f} GB/s; again before each row's "
                 "restores (their table). The remote tier is the GCS emulator on 127.0.0.1.\n")
    lines.append("## Saves\n")
    lines.append("| row | blocked per save | local commit | remote commit (after the local one) | "
                 f"seed loop overhead ({a.saves} saves, {a.compute:g} s idle) | of which final wait | "
                 "remote caught up | copies skipped |")
    lines.append("|---|---:|---:|---:|---:|---:|---:|---:|")
    base_row = None
    for name, (saved, _, _) in rows.items():
        blocked = max(med(r["blocked"] + r["loop_blocked"]) for r in saved)
        # orbax: only process 1 commits locally, only process 0 (its primary slice) persistently
        local = max(med(r["local"]) for r in saved if r["local"])
        remote = max((med(r["remote"]) for r in saved if r["remote"]), default=0.0)
        wall = max(r["wall"] for r in saved)
        compute = saved[0]["compute"]
        final = max(r["final_wait"] for r in saved)
        caught = max(r["caught_up"] for r in saved)
        skipped = max(r["skipped"] for r in saved)
        if base_row is None:
            base_row = (blocked, local)
        ratio = f" ({blocked / base_row[0]:.2f}x / {local / base_row[1]:.2f}x of 1 process)" \
            if name.startswith("2 processes") else ""
        commit = f"{local:.2f} s" + (f" ({gb / local:.2f} GB/s, {gb / local / (rates['write'] / 1e9):.2f}x fio write)")
        if "orbax" in name:
            remote_commit = f"{remote:.2f} s (process 0's wait: its persistent save, from save())"
        else:
            remote_commit = "(the commit is remote)" if "GCS only" in name else f"{remote:.2f} s"
        lines.append(f"| {name}{ratio} | {blocked * 1e3:.1f} ms | {commit} | {remote_commit} | "
                     f"{(wall - compute) / compute * 100:.1f}% | {final:.2f} s | {caught:.2f} s | {skipped} |")
    lines.append("\nblocked: median over the 3 waited saves and the loop's saves; with 2 processes the slower "
                 "process's median, as for the commits. The replicated rows hold the same 1 GiB on both "
                 "processes (8 arrays P(None, 'b'); orbax: a (2, 4) mesh ('replica', 'model'), P(None, 'model')): "
                 "ckptio's process 0 writes the shards and process 1 keeps its local copy; orbax's process 1 "
                 "writes the local copy and process 0 (its primary slice) the persistent one, on every save "
                 "(save_interval_steps 1 for both, max_to_keep 3); its local commit is process 1's "
                 "wait_until_finished().\n")
    lines.append("## Restart restores (page cache dropped; the slower process)\n")
    lines.append("| row | restore | GB/s (of the bytes all processes read) | fio read before this row's restores | "
                 "vs that fio read | "
                 "bytes read from the remote tier (by process) |")
    lines.append("|---|---:|---:|---:|---:|---|")
    for name, (_, restores, read_rate) in rows.items():
        for what, results in restores.items():
            took = max(r["took"] for r in results)
            if "GCS only" in name:
                remote_bytes = "all of it (the root is on GCS; no tier to count)"
            elif "orbax" in name:
                remote_bytes = "(not counted by orbax)"
            else:
                remote_bytes = ", ".join(f"{r['bytes_remote'] / 1e6:.0f} MB" for r in results)
            # ckptio reads a replicated state in full on every process: that many bytes in all
            # (orbax reads one copy and broadcasts it: the state's size).
            read = gb * (len(results) if name.startswith("replicated") and "orbax" not in name else 1)
            lines.append(f"| {name}: {what} | {took:.2f} s | {read / took:.2f} | {read_rate / 1e9:.2f} GB/s | "
                         f"{read / took / (read_rate / 1e9):.2f}x | {remote_bytes} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
