#!/usr/bin/env python3
"""What the first save costs a Python trainer next to later ones (issue 14).

    .venv/bin/python bench/first_save_bench.py [--state-gib 1] [--saves 5] [--reps 3]
        [--python-path build/python] [--dir DIR]

Each row runs in a fresh process: a state of ~100 float32 tensors, a
CheckpointManager, then --saves saves with 1.5 s of (simulated) compute
between them; "blocked" is the time save() held the trainer (the snapshot).
Rows:
  auto                staging_memory "auto" (the default): staging grows with the first save, which
                      therefore faults its pages in while it copies
  explicit, at once   staging_memory set to 2x the state: pre-faulted in the background from open;
                      the first save right after open races the pre-fault
  explicit, after 2 s the same with 2 s of compute before the first save (a trainer's first steps)
Prints first-save and later-save blocked times, min/median/max over --reps.
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

CHILD = r"""
import json, sys, time
sys.path.insert(0, sys.argv[1])
import numpy as np, ckptio
root, gib, saves, staging, gap = sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5], float(sys.argv[6])
n = 100
per = (gib << 30) // n // 4
state = {f"layer{i}/w": np.full(per, i, np.float32) for i in range(n)}
opts = {} if staging == "auto" else {"staging_memory": staging}
blocked = []
with ckptio.CheckpointManager(root, keep=2, **opts) as m:
    time.sleep(gap)
    for step in range(1, saves + 1):
        t = time.perf_counter()
        m.save(step, state)
        blocked.append(time.perf_counter() - t)
        time.sleep(1.5)
        for v in state.values():
            v += 1  # the trainer's next step changes the state
    m.wait_until_finished()
print(json.dumps(blocked))
"""


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--state-gib", type=int, default=1)
    ap.add_argument("--saves", type=int, default=5)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--python-path", default="build/python")
    ap.add_argument("--dir", default=None)
    a = ap.parse_args()
    rows = [("auto", "auto", 0.0), ("explicit, at once", f"{2 * a.state_gib}GiB", 0.0),
            ("explicit, after 2 s", f"{2 * a.state_gib}GiB", 2.0)]
    base = tempfile.mkdtemp(prefix="ckptio-first-save-", dir=a.dir)
    results = {name: ([], []) for name, _, _ in rows}
    try:
        for _ in range(a.reps):
            for name, staging, gap in rows:
                root = os.path.join(base, "ckpt")
                out = subprocess.run([sys.executable, "-c", CHILD, os.path.abspath(a.python_path), root,
                                      str(a.state_gib), str(a.saves), staging, str(gap)],
                                     check=True, capture_output=True, text=True).stdout
                blocked = json.loads(out)
                results[name][0].append(blocked[0])
                results[name][1].extend(blocked[1:])
                shutil.rmtree(root)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    ms = lambda xs: f"{1000 * statistics.median(xs):.0f} ({1000 * min(xs):.0f}-{1000 * max(xs):.0f})"  # noqa: E731
    print(f"| {a.state_gib} GiB state, staging | first save blocked (ms) | later saves blocked (ms) | first / later |")
    print("|---|---|---|---|")
    for name, _, _ in rows:
        first, later = results[name]
        print(f"| {name} | {ms(first)} | {ms(later)} | {statistics.median(first) / statistics.median(later):.1f}x |")
    print(f"\nmedian (min-max) over {a.reps} fresh processes ({a.saves - 1} later saves each); load average "
          f"{open('/proc/loadavg').read().split()[0]}")


if __name__ == "__main__":
    main()
