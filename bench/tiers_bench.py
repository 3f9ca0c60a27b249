#!/usr/bin/env python3
"""Two tiers (issue 17): what the remote copy costs the trainer, and how long it takes.

    .venv/bin/python bench/tiers_bench.py [--state-mib 512] [--saves 5] [--compute 2]
        [--python-path build/python] [--dir DIR]

A state of --state-mib of float32 tensors (64 of them); the GCS emulator of tests/gcs on
127.0.0.1 is the remote tier. Each row runs in a fresh process.

Seed loop (--saves saves, --compute seconds of idle "compute" between them, the state changed
in place after each save, then wait_until_finished for the tier the row writes):
  local only      one tier, a local directory
  two tiers       the same directory plus tiers.remote = the emulator (remote_every 1)
  GCS only        the emulator as the only root
overhead = (loop wall time - compute time) / compute time.

Copy time: for each of 3 saves, in a quiet loop: "local commit" = save() to wait_until_finished(),
then "local commit to remote commit" = wait_until_finished(tier="remote") after it; against an
upload-only save of the same bytes (the GCS-only manager: save() to committed). Then the copy time
with gcs.max_upload_bandwidth at 1/8 of the state per second: the rate it reached against the cap.
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

CHILD = r"""
import json, sys, time
sys.path.insert(0, sys.argv[1])
import numpy as np, ckptio
root, remote, mib, saves, compute, what = (sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]),
                                          float(sys.argv[6]), sys.argv[7])
n = 64
state = {f"layer{i}": np.full((mib << 20) // n // 4, i, np.float32) for i in range(n)}
opts = {"keep": 2, "staging_memory": f"{2 * mib}MiB"}
if len(sys.argv) > 8:
    opts["gcs"] = {"max_upload_bandwidth": sys.argv[8]}
if remote:
    opts["tiers"] = {"remote": remote, "remote_keep": 2}
tier = "remote" if remote else "local"
out = {}
with ckptio.CheckpointManager(root, **opts) as m:
    if what == "loop":
        blocked = []
        t0 = time.perf_counter()
        for step in range(1, saves + 1):
            t = time.perf_counter()
            m.save(step, state)
            blocked.append(time.perf_counter() - t)
            time.sleep(compute)
            for v in state.values():
                v += 1
        m.wait_until_finished()  # the trainer's loop ends with its own tier committed
        wall = time.perf_counter() - t0
        m.wait_until_finished(tier=tier)
        stats = m.stats()
        out = {"wall": wall, "compute": saves * compute, "blocked": blocked,
               "caught_up": time.perf_counter() - t0 - wall, "copied": stats["steps_replicated"],
               "skipped": stats["replications_skipped"]}
    else:
        local, remote_copy = [], []
        for step in range(1, 4):
            t = time.perf_counter()
            m.save(step, state)
            m.wait_until_finished()
            t1 = time.perf_counter()
            m.wait_until_finished(tier=tier)
            local.append(t1 - t)
            remote_copy.append(time.perf_counter() - t1)
            for v in state.values():
                v += 1
        out = {"local": local, "copy": remote_copy}
print(json.dumps(out))
"""


def run(python_path, root, remote, a, what, env, cap=None):
    out = subprocess.run([sys.executable, "-c", CHILD, python_path, root, remote, str(a.state_mib), str(a.saves),
                          str(a.compute), what] + ([cap] if cap else []), capture_output=True, text=True, env=env)
    if out.returncode != 0:
        sys.exit(f"tiers_bench: the {what} run on {root} failed:\n{out.stderr}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--state-mib", type=int, default=512)
    ap.add_argument("--saves", type=int, default=5)
    ap.add_argument("--compute", type=float, default=2.0)
    ap.add_argument("--python-path", default="build/python")
    ap.add_argument("--dir", default=None)
    a = ap.parse_args()
    python_path = os.path.abspath(a.python_path)
    sys.path.insert(0, os.path.join(HERE, "..", "tests", "gcs"))
    import testbed  # noqa: E402  (tests/gcs: the emulator on 127.0.0.1)
    base = tempfile.mkdtemp(prefix="ckptio-tiers-", dir=a.dir or os.path.join(HERE, "results"))
    try:
        with testbed.GcsTestbed() as bed:
            env = bed.env()
            gs = f"gs://{bed.bucket}"
            print(f"# Two tiers: {a.state_mib} MiB of state, local disk + GCS emulator on 127.0.0.1\n")
            print(f"Command: `{' '.join(sys.argv)}`\n")
            rows = {
                "local only": run(python_path, os.path.join(base, "a"), "", a, "loop", env),
                "two tiers": run(python_path, os.path.join(base, "b"), f"{gs}/b", a, "loop", env),
                "GCS only": run(python_path, f"{gs}/c", "", a, "loop", env),
            }
            print(f"### Seed loop: {a.saves} saves, {a.compute:g} s of idle compute between them\n")
            print("The loop ends when its saves are committed in the root's own tier (what the trainer waits")
            print("for); with two tiers the copies go on: \"remote caught up\" is how much later the remote tier")
            print("had them (copies that fell behind by more than remote_keep are skipped and counted).\n")
            print("| root | blocked per save (median) | loop wall | overhead | remote caught up | copied / skipped |")
            print("|---|---:|---:|---:|---:|---:|")
            for name, r in rows.items():
                over = (r["wall"] - r["compute"]) / r["compute"]
                remote = f"{r['caught_up']:.2f} s later | {r['copied']} / {r['skipped']}" if name == "two tiers" \
                    else "| "
                print(f"| {name} | {statistics.median(r['blocked']) * 1e3:.1f} ms | {r['wall']:.2f} s "
                      f"| {over * 100:.1f}% | {remote} |")
            copy = run(python_path, os.path.join(base, "d"), f"{gs}/d", a, "copy", env)
            upload = run(python_path, f"{gs}/e", "", a, "copy", env)
            print("\n### Copy time (3 saves each, median)\n")
            print("| | time | vs upload-only save |")
            print("|---|---:|---:|")
            up = statistics.median(upload["local"])
            print(f"| local commit (save to committed, local tier) | {statistics.median(copy['local']):.2f} s | |")
            print(f"| local commit to remote commit (the copy) | {statistics.median(copy['copy']):.2f} s "
                  f"| {statistics.median(copy['copy']) / up:.2f}x |")
            print(f"| upload-only save of the same bytes (GCS root) | {up:.2f} s | 1.00x |")
            cap_mib = max(1, a.state_mib // 8)  # a cap well under what the emulator takes here
            capped = run(python_path, os.path.join(base, "f"), f"{gs}/f", a, "copy", env, f"{cap_mib}MiB")
            took = statistics.median(capped["copy"])
            print(f"\n### Copy with gcs.max_upload_bandwidth = {cap_mib} MiB/s (3 saves, median)\n")
            print("| copy time | at least (bytes / cap) | rate | vs cap |")
            print("|---:|---:|---:|---:|")
            print(f"| {took:.2f} s | {a.state_mib / cap_mib:.2f} s | {a.state_mib / took:.1f} MiB/s "
                  f"| {a.state_mib / took / cap_mib:.2f}x |")
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
