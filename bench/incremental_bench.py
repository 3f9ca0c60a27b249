#!/usr/bin/env python3
"""Incremental saves against full saves: the LoRA case (issue 17).

    .venv/bin/python bench/incremental_bench.py [--frozen-mib 1024] [--trainable-mib 32] [--saves 10]
        [--python-path build/python] [--dir DIR] [--gcs]

A state of --frozen-mib of frozen base weights (64 tensors) plus --trainable-mib of trainable
weights (64 tensors) that change before every save; --saves saves, each waited for, keep=3.
Each mode runs in a fresh process on the same disk:
  full          the default: every tensor written at every save
  incremental   incremental: true: tensors whose XXH3-128 and CRC32C did not change since the
                last committed step are referenced, not written
With --gcs, the same two rows on gs:// (the GCS emulator from tests/gcs, on 127.0.0.1), at the
sizes given.

Columns: bytes written per save (first save, then the median of the others; from the manager's
stats, shard files only, plus the manifest), the trainer's blocked time per save (the snapshot:
save() returning), and the time from save() to committed (wait_until_finished), median of saves
2..N; the disk's O_DIRECT write limit (fio, same run) for scale.
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

CHILD = r"""
import json, os, sys, time
sys.path.insert(0, sys.argv[1])
import numpy as np, ckptio
root, frozen_mib, trainable_mib, saves, incremental = (sys.argv[2], int(sys.argv[3]), int(sys.argv[4]),
                                                      int(sys.argv[5]), sys.argv[6] == "1")
rng = np.random.default_rng(0)
n = 64
state = {"base": {f"layer{i}": rng.standard_normal((frozen_mib << 20) // n // 4, dtype=np.float32) for i in range(n)},
         "lora": {f"layer{i}": rng.standard_normal((trainable_mib << 20) // n // 4, dtype=np.float32)
                  for i in range(n)}}
rows = []
with ckptio.CheckpointManager(root, keep=3, incremental=incremental,
                              staging_memory=f"{2 * (frozen_mib + trainable_mib)}MiB") as m:
    for step in range(1, saves + 1):
        for v in state["lora"].values():
            v += 1.0  # the trainer's step: only the adapters change
        before = m.stats()
        t = time.perf_counter()
        m.save(step, state)
        blocked = time.perf_counter() - t
        m.wait_until_finished()
        committed = time.perf_counter() - t
        after = m.stats()
        written = after["bytes_committed"] - before["bytes_committed"]
        rows.append({"blocked": blocked, "committed": committed, "written": written,
                     "reused": after["bytes_reused"] - before["bytes_reused"]})
    back = m.restore()  # the last step restores bit-exact
    for part in ("base", "lora"):
        assert all(np.array_equal(back[part][k], v) for k, v in state[part].items())
print(json.dumps(rows))
"""


def fio_write_limit(directory):
    """O_DIRECT sequential write throughput of the disk under `directory`, in bytes/s (0 if fio fails)."""
    path = os.path.join(directory, "fio.tmp")
    try:
        out = subprocess.run(["fio", "--name=w", f"--filename={path}", "--rw=write", "--bs=4M", "--size=1G",
                              "--direct=1", "--ioengine=io_uring", "--iodepth=8", "--output-format=json"],
                             capture_output=True, text=True, check=True).stdout
        return json.loads(out)["jobs"][0]["write"]["bw_bytes"]
    except (OSError, subprocess.CalledProcessError, KeyError, ValueError):
        return 0
    finally:
        if os.path.exists(path):
            os.remove(path)


def run(python_path, root, a, incremental, env=None):
    out = subprocess.run([sys.executable, "-c", CHILD, python_path, root, str(a.frozen_mib), str(a.trainable_mib),
                          str(a.saves), "1" if incremental else "0"],
                         capture_output=True, text=True, env=env)
    if out.returncode != 0:
        sys.exit(f"incremental_bench: the {'incremental' if incremental else 'full'} run failed:\n{out.stderr}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def mib(n):
    return f"{n / (1 << 20):.1f} MiB"


def table(title, results):
    print(f"\n### {title}\n")
    print("| mode | written, save 1 | written, saves 2.. (median) | reused per save | blocked (median) "
          "| save to commit (median) | commit time vs full |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    full_commit = statistics.median(r["committed"] for r in results["full"][1:])
    for mode, rows in results.items():
        later = rows[1:]
        commit = statistics.median(r["committed"] for r in later)
        print(f"| {mode} | {mib(rows[0]['written'])} | {mib(statistics.median(r['written'] for r in later))} "
              f"| {mib(statistics.median(r['reused'] for r in later))} "
              f"| {statistics.median(r['blocked'] for r in later) * 1e3:.1f} ms | {commit * 1e3:.0f} ms "
              f"| {commit / full_commit:.2f}x |")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--frozen-mib", type=int, default=1024)
    ap.add_argument("--trainable-mib", type=int, default=32)
    ap.add_argument("--saves", type=int, default=10)
    ap.add_argument("--python-path", default="build/python")
    ap.add_argument("--dir", default=None)
    ap.add_argument("--gcs", action="store_true")
    a = ap.parse_args()
    python_path = os.path.abspath(a.python_path)
    base = tempfile.mkdtemp(prefix="ckptio-incr-", dir=a.dir or os.path.join(HERE, "results"))
    try:
        limit = fio_write_limit(base)
        print(f"# Incremental saves: {a.frozen_mib} MiB frozen + {a.trainable_mib} MiB trainable, {a.saves} saves\n")
        print(f"Disk O_DIRECT sequential write (fio, this run): {limit / 1e9:.2f} GB/s. "
              f"Command: `{' '.join(sys.argv)}`")
        results = {}
        for mode, incremental in (("full", False), ("incremental", True)):
            root = os.path.join(base, mode)
            results[mode] = run(python_path, root, a, incremental)
            shutil.rmtree(root, ignore_errors=True)
        table("local disk", results)
        if a.gcs:
            sys.path.insert(0, os.path.join(HERE, "..", "tests", "gcs"))
            import testbed  # noqa: E402  (tests/gcs: the emulator on 127.0.0.1)
            with testbed.GcsTestbed() as bed:
                env = bed.env()
                results = {mode: run(python_path, f"gs://{bed.bucket}/{mode}", a, incremental, env)
                           for mode, incremental in (("full", False), ("incremental", True))}
            table("GCS (emulator on 127.0.0.1)", results)
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
