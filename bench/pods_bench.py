#!/usr/bin/env python3
"""Pods (issue 28): two tiers over several jax processes, against one process and against saving
straight to GCS, with fio in the same run.

    .venv-bench/bin/python bench/pods_bench.py [--size-gib 1] [--saves 10] [--compute 2]
        [--ckptio-python build/python] [--dir DIR] [--out bench/results/pods.md]

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

COLS = 1024
mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("a", "b"))
SPEC = {"ab": P("a", "b"), "a": P("a"), "rep": P()}

def layout(nbytes):
    rows = lambda f: max(8, int(nbytes * f) // (4 * COLS) // 8 * 8)
    out = [("embed/positions", (rows(1 / 64), COLS), "rep")]
    for layer in range(4):
        p = f"layers/{layer}/"
        out += [(p + "w_in", (rows(0.075), COLS), "ab"), (p + "w_out", (rows(0.075), COLS), "ab"),
                (p + "adam_mu", (rows(0.094), COLS), "a")]
    return out

def value(seed, index, shape):
    rows = np.arange(shape[0], dtype=np.float32)[index[0]][:, None]
    cols = np.arange(shape[1], dtype=np.float32)[index[1]][None, :]
    return rows * 0.001 + cols + seed

def state():
    out = {}
    for seed, (name, shape, kind) in enumerate(layout(args["bytes"])):
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
              for name, shape, kind in layout(args["bytes"])}
    with manager() as mgr:
        sync("restore")
        t = time.perf_counter()
        back = mgr.restore(target=target)
        jax.block_until_ready(back)
        took = time.perf_counter() - t
        step = mgr.latest_step()
        bytes_remote = mgr.stats()["bytes_read_remote"]
    for seed, (name, shape, kind) in enumerate(layout(args["bytes"])):
        got = np.asarray(multihost_utils.process_allgather(back[name], tiled=True)) if count > 1 else np.asarray(back[name])
        want = value(seed, (slice(None), slice(None)), shape)
        assert got.tobytes() == want.tobytes(), name
    out = dict(took=took, step=step, bytes_remote=bytes_remote)
print("RESULT", json.dumps(out), flush=True)
"""


def free_port():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def job(count, mode, args, a, env):
    """Runs the child in `count` processes; their results by process."""
    env = dict(env, XLA_FLAGS=f"--xla_force_host_platform_device_count={8 // count}", JAX_PLATFORMS="cpu",
               PYTHONUNBUFFERED="1")
    port = str(free_port())
    procs = [subprocess.Popen([sys.executable, "-c", CHILD, str(i), port, str(count), a.ckptio_python, mode,
                               json.dumps(args)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i in range(count)]
    outs = [p.communicate(timeout=3600)[0] for p in procs]
    results = []
    for i, (p, out) in enumerate(zip(procs, outs)):
        line = next((line for line in out.splitlines() if line.startswith("RESULT ")), None)
        if p.returncode != 0 or line is None:
            sys.exit(f"pods_bench: process {i} of {count} ({mode}) failed:\n{out[-3000:]}")
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
    ap.add_argument("--dir", default=None)
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
        for name, count, remote in (("1 process, two tiers", 1, "one"), ("2 processes, two tiers", 2, "two"),
                                    ("2 processes, GCS only", 2, None)):
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
                args = {"bytes": nbytes, "saves": a.saves, "compute": a.compute, "roots": roots, "remote": remote}
                saved = job(count, "save", args, a, env)
                # The disk drifts from run to run and within one: each row's restores are set
                # against a fio read measured just before them.
                read_rate = fio(os.path.join(base, "fio.tmp"), max(1, round(nbytes / GIB)))["read"]
                restores = {}
                if remote:
                    drop_caches(roots)
                    restores["all copies local"] = job(count, "restore", args, a, env)
                    if count > 1:
                        shutil.rmtree(roots[1])
                        drop_caches(roots)
                        restores["one host replaced"] = job(count, "restore", args, a, env)
                    for r in roots:
                        shutil.rmtree(r, ignore_errors=True)
                    restores["all copies remote"] = job(count, "restore", args, a, env)
                else:
                    restores["all copies remote"] = job(count, "restore", args, a, env)
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
        local = max(med(r["local"]) for r in saved)
        remote = max(med(r["remote"]) for r in saved)
        wall = max(r["wall"] for r in saved)
        compute = saved[0]["compute"]
        final = max(r["final_wait"] for r in saved)
        caught = max(r["caught_up"] for r in saved)
        skipped = max(r["skipped"] for r in saved)
        if base_row is None:
            base_row = (blocked, local)
        ratio = f" ({blocked / base_row[0]:.2f}x / {local / base_row[1]:.2f}x of 1 process)" if name != \
            "1 process, two tiers" else ""
        commit = f"{local:.2f} s" + (f" ({gb / local:.2f} GB/s, {gb / local / (rates['write'] / 1e9):.2f}x fio write)")
        lines.append(f"| {name}{ratio} | {blocked * 1e3:.0f} ms | {commit} | "
                     f"{'(the commit is remote)' if 'GCS only' in name else f'{remote:.2f} s'} | "
                     f"{(wall - compute) / compute * 100:.1f}% | {final:.2f} s | {caught:.2f} s | {skipped} |")
    lines.append("\nblocked: median over the 3 waited saves and the loop's saves; with 2 processes the slower "
                 "process's median, as for the commits.\n")
    lines.append("## Restart restores (page cache dropped; the slower process)\n")
    lines.append("| row | restore | GB/s | fio read before this row's restores | vs that fio read | "
                 "bytes read from the remote tier (by process) |")
    lines.append("|---|---:|---:|---:|---:|---|")
    for name, (_, restores, read_rate) in rows.items():
        for what, results in restores.items():
            took = max(r["took"] for r in results)
            remote_bytes = ", ".join(f"{r['bytes_remote'] / 1e6:.0f} MB" for r in results) \
                if "GCS only" not in name else "all of it (the root is on GCS; no tier to count)"
            lines.append(f"| {name}: {what} | {took:.2f} s | {gb / took:.2f} | {read_rate / 1e9:.2f} GB/s | "
                         f"{gb / took / (read_rate / 1e9):.2f}x | {remote_bytes} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
