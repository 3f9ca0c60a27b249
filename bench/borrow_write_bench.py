#!/usr/bin/env python3
"""What a save of borrowed jax state costs the host: CPU seconds and time to disk.

A state of jax.Arrays on 8 CPU devices (a (4, 2) mesh) is borrowed, not copied,
by ckptio.CheckpointManager. Its buffers start 64-byte-aligned anywhere in a
page; O_DIRECT needs 512-byte-aligned memory. Each save is measured in two
ways: "background" (the trainer goes on for 1 s, then waits: the writes go out
straight from the jax buffers, no copy) and "waited on" (wait_until_finished
right after save(): the writes are copied into the huge-page bounce buffers,
which make fewer, larger device requests). CPU = the process's user + system
time over the save (getrusage), so the rest of the process must be idle.

  .venv/bin/python bench/borrow_write_bench.py [--size-gib 1] [--saves 5]
      [--dir DIR] [--python-path build/python]

Prints a markdown table; fio's O_DIRECT write rate on the same disk is the limit.
"""
import argparse
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def cpu():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def fio_write(path):
    out = subprocess.run(["fio", "--name=w", f"--filename={path}", "--size=1G", "--bs=8M", "--rw=write",
                          "--direct=1", "--ioengine=io_uring", "--iodepth=4", "--end_fsync=1",
                          "--output-format=terse"], capture_output=True, text=True, check=True).stdout
    os.unlink(path)
    return float(out.split(";")[47]) * 1024  # write bandwidth, KiB/s -> B/s


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-gib", type=float, default=1.0)
    ap.add_argument("--saves", type=int, default=5)
    ap.add_argument("--dir", default=os.path.join(ROOT, "bench", "results", "tmp", "borrow"))
    ap.add_argument("--python-path", default=os.path.join(ROOT, "build", "python"))
    a = ap.parse_args()
    sys.path.insert(0, a.python_path)
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    import ckptio

    mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("a", "b"))
    rows = max(8, int(a.size_gib * (1 << 30) / 8 / 8192 / 4) // 8 * 8)
    state = {f"w{i}": jax.device_put(jnp.full((rows, 8192), i, jnp.float32) + jnp.arange(8192, dtype=jnp.float32),
                                     NamedSharding(mesh, P("a", "b"))) for i in range(8)}
    jax.block_until_ready(state)
    gib = sum(x.nbytes for x in state.values()) / (1 << 30)
    os.makedirs(a.dir, exist_ok=True)
    fio = fio_write(os.path.join(a.dir, "fio.tmp"))
    root = os.path.join(a.dir, "ckpt")
    shutil.rmtree(root, ignore_errors=True)
    m = ckptio.CheckpointManager(root, keep=2)
    m.save(0, state)
    m.wait_until_finished()
    step = 0
    results = {}
    for mode in ("background", "waited on"):
        cpus, times = [], []
        for _ in range(a.saves):
            step += 1
            c0, t0 = cpu(), time.perf_counter()
            m.save(step, state)
            if mode == "background":
                time.sleep(1.0)
            m.wait_until_finished()
            t1 = time.perf_counter()
            cpus.append((cpu() - c0) / gib)
            times.append(t1 - t0)
        results[mode] = (statistics.median(cpus), statistics.median(times))
    m.close()
    shutil.rmtree(a.dir, ignore_errors=True)
    print(f"## A save of borrowed jax state: {gib:.2f} GiB over 8 CPU devices, median of {a.saves} saves\n")
    print(f"fio O_DIRECT write on the same disk: {fio / 1e9:.2f} GB/s. ckptio with no options.\n")
    print("| save | CPU per GiB | time to disk | rate | / fio write |")
    print("|---|---:|---:|---:|---:|")
    c, t = results["background"]
    print(f"| background (trainer goes on 1 s, then waits) | {c:.3f} s | (within the 1 s) | | |")
    c, t = results["waited on"]
    rate = gib * (1 << 30) / t
    print(f"| waited on (wait_until_finished right after) | {c:.3f} s | {t:.3f} s | {rate / 1e9:.2f} GB/s | "
          f"{rate / fio:.2f}x |")


if __name__ == "__main__":
    main()
