#!/usr/bin/env python3
"""`ckptio export` against what the machine allows: reading the checkpoint
back (`ckptio verify`, every byte and CRC32C) plus writing one file of its
size (fio, O_DIRECT, fsync at the end), measured in the same run.

    .venv/bin/python bench/export_bench.py [--sizes-gib 1,4] [--dir DIR]
        [--ckptio build/src/cli/ckptio] [--python-path build/python]

For each size: a checkpoint of ~100 tensors made with the ckptio module, then
verify, fio and export, each timed around the whole command, --reps times
(min/median/max). Prints a markdown table; the target (issue 14) is export
<= 1.5 x (verify + fio write) at 1 GiB and at 4 GiB.
"""
import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time


def timed(cmd):
    t = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - t


def make_checkpoint(root, gib, python_path):
    code = f"""
import sys; sys.path.insert(0, {python_path!r})
import numpy as np, ckptio
n = 100
per = ({gib} << 30) // n // 4
state = {{f"layer{{i}}/w": np.full(per, i, np.float32) for i in range(n)}}
with ckptio.CheckpointManager({root!r}, keep=1) as m:
    m.save(1, state)
"""
    subprocess.run([sys.executable, "-c", code], check=True)


def fio_write(path, gib):
    t = time.perf_counter()
    subprocess.run(["fio", "--name=w", f"--filename={path}", "--rw=write", "--bs=8M", f"--size={gib}G",
                    "--ioengine=psync", "--direct=1", "--end_fsync=1"], check=True, capture_output=True)
    took = time.perf_counter() - t  # around the whole command, as for ckptio
    os.unlink(path)
    return took


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes-gib", default="1,4")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--ckptio", default="build/src/cli/ckptio")
    ap.add_argument("--python-path", default="build/python")
    a = ap.parse_args()
    base = tempfile.mkdtemp(prefix="ckptio-export-bench-", dir=a.dir)
    rows = []
    try:
        for gib in [int(x) for x in a.sizes_gib.split(",")]:
            root = os.path.join(base, f"ckpt{gib}")
            make_checkpoint(root, gib, os.path.abspath(a.python_path))
            out = os.path.join(base, "export.safetensors")
            verify, fio, export = [], [], []
            for _ in range(a.reps):
                verify.append(timed([a.ckptio, "verify", root]))
                fio.append(fio_write(os.path.join(base, "fio.tmp"), gib))
                export.append(timed([a.ckptio, "export", root, "--out", out]))
                os.unlink(out)
            rows.append((gib, verify, fio, export))
            shutil.rmtree(root)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    med = statistics.median
    print("| state | verify (s) | fio O_DIRECT write (s) | export (s) | export / (verify + write) | target |")
    print("|---|---|---|---|---|---|")
    for gib, verify, fio, export in rows:
        span = lambda xs: f"{med(xs):.2f} ({min(xs):.2f}-{max(xs):.2f})"  # noqa: E731
        ratio = med(export) / (med(verify) + med(fio))
        print(f"| {gib} GiB | {span(verify)} | {span(fio)} | {span(export)} | {ratio:.2f}x | <= 1.5x |")
    print(f"\nmedian (min-max) of {a.reps} runs each, interleaved; load average "
          f"{open('/proc/loadavg').read().split()[0]}")


if __name__ == "__main__":
    main()
