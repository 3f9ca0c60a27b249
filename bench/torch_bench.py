#!/usr/bin/env python3
"""PyTorch trainers' checkpoints: torch.save, torch.distributed.checkpoint's
async_save with its FileSystemWriter, ckptio's CheckpointManager.save, and
DCP's async_save with ckptio's StorageWriter, on the same state and loop, in
1 process and in 2 gloo ranks (127.0.0.1); fio's write and read rates before each row.

    .venv/bin/python bench/torch_bench.py [--size-gib 1] [--tensors 100] [--saves 10]
        [--compute-s 1.5] [--processes 1,2] [--dir DIR] [--python-path build/python]

The state: --size-gib of float32 tensors in all (--tensors of them, split
between the ranks, each rank its own names). Per tool and process count, in
fresh processes (each rank its own), after one untimed warm-up save (and,
first, 2 threads copying the same tensors into warm memory: the floor of a
copy snapshot, which ckptio's blocked time is set against):
  loop      --saves saves, each after --compute-s of idle compute (a host
            waiting for its accelerator), as each tool's user would write it:
            torch.save to a file per rank and step; DCP's async_save after
            waiting for the previous one's future (its documented pattern);
            ckptio's save; ckptio with snapshot="background": wait_snapshots()
            where the optimizer step would change the state (the end of the
            compute), then save; the same with on_busy="skip" (1 process only: a
            multi-host job refuses it), a save that would wait for staging or a
            slot dropped and counted; then the final wait. Three steps kept by each.
  fio       the disk's write and read rates, measured again right before each row
            (restore_bench.fio: O_DIRECT, a new file of the state's size written in 1
            MiB requests, 32 in flight, then read so and in 16 MiB ones, 8 in flight,
            the faster read taken, the page cache dropped before each): on this VM
            they drift from minute to minute, 0.3-2.9 GB/s
  floor     the least overhead the disk allows a tool that makes every save
            durable: --saves states written at that row's fio write rate, against
            the loop without saves (0 when the disk keeps up with the loop)
  blocked   the median time a save held the trainer (for DCP, the wait for
            the previous future included; for snapshot="background", the
            wait_snapshots() before it)
  overhead  (loop wall, final wait included) / (the same loop without saves) - 1;
            and without the final wait (the per-save cost alone)
  restore   the last step into the state's tensors, its files evicted from
            the page cache first: torch.load, dcp.load, restore_into,
            dcp.load with ckptio's StorageReader; as a ratio to the row's fio read
  peak RSS  over the RSS with the state built, before the tool's set-up
            (VmHWM, reset through /proc/self/clear_refs): staging and the
            warm-up save included; the largest rank's; for ckptio's manager,
            its staging_resident_bytes beside it; "code" is the part that is
            the libraries' code and other file pages first touched by the
            tool (RssFile's growth: shared, not memory the tool holds)
"""
import argparse
import ctypes
import gc
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import restore_bench  # fio(): the disk's read and write, as restore_bench measures them
import sharded_bench  # evict(): its files out of the page cache, as the other benches do it

HERE = os.path.dirname(os.path.abspath(__file__))
TOOLS = ["torch.save", "dcp-fs", "ckptio", "ckptio-bg", "ckptio-bg-skip", "dcp-ckptio"]
LABELS = {"none": "no saves", "torch.save": "`torch.save`",
          "dcp-fs": "DCP `async_save` (FileSystemWriter)", "ckptio": "`ckptio.CheckpointManager.save`",
          "ckptio-bg": "`ckptio.CheckpointManager.save`, `snapshot=\"background\"`",
          "ckptio-bg-skip": "the same with `on_busy=\"skip\"`",
          "dcp-ckptio": "DCP `async_save` (ckptio's StorageWriter)"}


def status(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(field)


def reset_peak():
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return status("VmRSS")


# ------------------------------------------------------------------ one rank


def worker(a):
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    rank, world = a.rank, a.world
    if world > 1:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(a.port))
        dist.init_process_group("gloo", rank=rank, world_size=world)

    def barrier():
        if world > 1:
            dist.barrier()

    n = a.tensors // world
    per = a.size // a.tensors // 4
    gen = torch.Generator().manual_seed(rank)
    state = {f"r{rank}/w{i}": torch.randn(per, generator=gen) for i in range(n)}
    nbytes = n * per * 4
    import ckptio  # its code (the extension, libckptio): loaded before the baseline, as torch is
    import ckptio.torch
    rss0 = reset_peak()  # the state built, nothing of the tool's yet: staging counts
    file0 = status("RssFile")
    root = a.dir
    os.makedirs(root, exist_ok=True)

    mgr = writer = fut = None
    if a.tool == "ckptio":
        mgr = ckptio.CheckpointManager(os.path.join(root, "ckptio"), keep=3)
    elif a.tool == "ckptio-bg":
        mgr = ckptio.CheckpointManager(os.path.join(root, "ckptio"), keep=3, snapshot="background")
    elif a.tool == "ckptio-bg-skip":  # a save that would wait for staging or a slot is dropped instead
        mgr = ckptio.CheckpointManager(os.path.join(root, "ckptio"), keep=3, snapshot="background", on_busy="skip")
    elif a.tool == "dcp-ckptio":
        writer = ckptio.torch.StorageWriter(os.path.join(root, "dcp-ckptio"), keep=3)
    kept = []

    def save(step):
        nonlocal fut
        if a.tool == "torch.save":
            path = os.path.join(root, f"step{step}-rank{rank}.pt")
            torch.save(state, path)
            kept.append(path)
            if len(kept) > 3:
                os.unlink(kept.pop(0))
        elif a.tool == "ckptio":
            mgr.save(step, state)
        elif a.tool in ("ckptio-bg", "ckptio-bg-skip"):
            mgr.wait_snapshots()  # the optimizer step's wait (ckptio.torch.wait_before_step)
            mgr.save(step, state)
        elif a.tool in ("dcp-fs", "dcp-ckptio"):
            if fut is not None:
                fut.result()
                fut = None
                if a.tool == "dcp-fs" and rank == 0 and len(kept) > 3:
                    shutil.rmtree(kept.pop(0), ignore_errors=True)
            if a.tool == "dcp-fs":
                path = os.path.join(root, f"step{step}")
                kept.append(path)
                fut = dcp.async_save(state, checkpoint_id=path)
            else:
                fut = dcp.async_save(state, storage_writer=writer, checkpoint_id=step)

    def final_wait():
        nonlocal fut
        if mgr is not None:
            mgr.wait_until_finished()
        if fut is not None:
            fut.result()
            fut = None

    out = {"rank": rank, "bytes": nbytes}
    if a.tool != "none":
        save(0)  # warm-up
        final_wait()
    barrier()
    blocked = []
    t0 = time.perf_counter()
    for step in range(1, a.saves + 1):
        time.sleep(a.compute_s)
        if a.tool != "none":
            s = time.perf_counter()
            save(step)
            blocked.append(time.perf_counter() - s)
    w = time.perf_counter()
    final_wait()
    out["final_wait"] = time.perf_counter() - w
    out["wall"] = time.perf_counter() - t0
    out["blocked"] = statistics.median(blocked) if blocked else 0.0
    out["peak_extra"] = status("VmHWM") - rss0
    out["code"] = status("RssFile") - file0
    out["staging"] = mgr.stats()["staging_resident_bytes"] if mgr is not None else None
    out["skipped"] = mgr.stats()["saves_skipped"] if mgr is not None else 0
    barrier()
    if a.tool != "none":
        last = mgr.latest_step() if a.tool == "ckptio-bg-skip" else a.saves  # the same bytes at every step
        for v in state.values():
            v.zero_()
        sharded_bench.evict(root)
        barrier()
        s = time.perf_counter()
        if a.tool == "torch.save":
            loaded = torch.load(os.path.join(root, f"step{last}-rank{rank}.pt"), weights_only=True)
            for k, v in state.items():
                v.copy_(loaded[k])
            del loaded
        elif a.tool == "dcp-fs":
            dcp.load(state, checkpoint_id=os.path.join(root, f"step{last}"))
        elif a.tool in ("ckptio", "ckptio-bg", "ckptio-bg-skip"):
            mgr.restore_into(last, state)
        else:
            dcp.load(state, storage_reader=ckptio.torch.StorageReader(os.path.join(root, "dcp-ckptio")),
                     checkpoint_id=last)
        out["restore"] = time.perf_counter() - s
        check = torch.Generator().manual_seed(rank)
        out["restored_ok"] = all(torch.equal(v, torch.randn(per, generator=check)) for v in state.values())
        barrier()
    if mgr is not None:
        mgr.close()
    if writer is not None:
        writer.close()
    print("RESULT " + json.dumps(out), flush=True)
    if world > 1:
        dist.destroy_process_group()


def memcpy_2threads(a):
    """The median time of 2 threads copying the state's tensors (half each, numpy.copyto, which
    releases the GIL) into warm memory: the floor of a copy snapshot on this machine."""
    import threading

    import numpy as np
    import torch
    per = a.size // a.tensors // 4
    gen = torch.Generator().manual_seed(0)
    src = [torch.randn(per, generator=gen).numpy() for _ in range(a.tensors)]
    dst = [np.ones(per, dtype=np.float32) for _ in range(a.tensors)]  # touched: warm
    halves = [list(range(0, a.tensors, 2)), list(range(1, a.tensors, 2))]

    def copy(idx):
        for i in idx:
            np.copyto(dst[i], src[i])

    times = []
    for _ in range(7):
        threads = [threading.Thread(target=copy, args=(h,)) for h in halves]
        t = time.perf_counter()
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        times.append(time.perf_counter() - t)
    print("RESULT " + json.dumps({"seconds": statistics.median(times[1:])}), flush=True)


# ------------------------------------------------------------------ driver


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(a, tool, world, work):
    d = tempfile.mkdtemp(prefix=f"{tool}-{world}p-", dir=work)
    port = free_port()
    env = dict(os.environ)
    if a.python_path:
        env["PYTHONPATH"] = os.pathsep.join([a.python_path] + [p for p in [env.get("PYTHONPATH")] if p])
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", tool, "--world", str(world), "--port", str(port),
           "--dir", d, "--size", str(a.size), "--tensors", str(a.tensors), "--saves", str(a.saves),
           "--compute-s", str(a.compute_s)]
    procs = [subprocess.Popen(cmd + ["--rank", str(r)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True) for r in range(world)]
    outs = [p.communicate()[0] for p in procs]  # every rank's, so that the one that failed first is shown
    results = []
    for rank, (p, out) in enumerate(zip(procs, outs)):
        lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
        if p.returncode != 0 or not lines:
            for r, (q, o) in enumerate(zip(procs, outs)):
                sys.stderr.write(f"--- rank {r} (exit {q.returncode}):\n{o[-3000:]}\n")
            raise RuntimeError(f"{tool} on {world} process(es) failed (rank {rank}: {p.returncode})")
        results.append(json.loads(lines[-1][7:]))
    shutil.rmtree(d, ignore_errors=True)
    return results


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-gib", type=float, default=1.0)
    ap.add_argument("--tensors", type=int, default=100)
    ap.add_argument("--saves", type=int, default=10)
    ap.add_argument("--compute-s", type=float, default=1.5)
    ap.add_argument("--processes", default="1,2")
    ap.add_argument("--tools", default=",".join(TOOLS))
    ap.add_argument("--dir", default=None)
    ap.add_argument("--python-path", default=None)
    ap.add_argument("--worker", default=None)
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--world", type=int, default=1)
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--size", type=int, default=0)
    a = ap.parse_args()
    if a.worker == "memcpy":
        memcpy_2threads(a)
        return
    if a.worker:
        a.tool = a.worker
        worker(a)
        return
    a.size = int(a.size_gib * (1 << 30))
    work = tempfile.mkdtemp(prefix="torch-bench-", dir=a.dir or os.path.join(os.path.dirname(HERE), "bench", "results"))
    try:
        memcpy = run(a, "memcpy", 1, work)[0]["seconds"]
        print(f"# PyTorch checkpoints: {a.size / (1 << 30):g} GiB of float32 in {a.tensors} tensors, "
              f"{a.saves} saves, {a.compute_s} s of idle compute before each\n")
        print(f"The loop asks for {a.size / a.compute_s / 1e6:,.0f} MB/s of writes (one state per {a.compute_s} s). "
              "The disk's rates drift from minute to minute here, so fio measures them again before each row "
              f"(restore_bench.fio: O_DIRECT, a new file of the state's size written in 1 MiB requests, 32 in flight, then read so and in 16 MiB ones, 8 in flight, the faster read taken). torch "
              f"{__import__('torch').__version__}; load average {open('/proc/loadavg').read().split()[0]} "
              "at the start.\n")
        print(f"2 threads copying the same tensors into warm memory (numpy.copyto, half each; the floor of a "
              f"copy snapshot here): {memcpy * 1000:.0f} ms.\n")
        for world in [int(p) for p in a.processes.split(",")]:
            base = max(r["wall"] for r in run(a, "none", world, work))
            print(f"## {world} process{'es' if world > 1 else ''} (gloo on 127.0.0.1)\n" if world > 1 else
                  "## 1 process\n")
            print(f"The loop without saves: {base:.2f} s.\n")
            print("| tool | fio write / read | wall | overhead | the disk's floor | overhead without the final wait "
                  "| blocked per save | final wait | restore | restore / fio read | peak extra RSS | of which code "
                  "| less the code |")
            print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
            for tool in a.tools.split(","):
                if tool == "ckptio-bg-skip" and world > 1:
                    continue  # refused in a multi-host job: each process would skip on its own
                read_s, write_s = restore_bench.fio(os.path.join(work, "fio.tmp"), a.size)
                write, read = a.size / write_s, a.size / read_s
                rs = run(a, tool, world, work)
                wall = max(r["wall"] for r in rs)
                restore = max(r["restore"] for r in rs)
                nbytes = sum(r["bytes"] for r in rs)
                ok = "" if all(r["restored_ok"] for r in rs) else " (restore WRONG)"
                per_save = max(r["wall"] - r["final_wait"] for r in rs)
                blocked = max(r["blocked"] for r in rs)
                vs_memcpy = f" ({blocked / memcpy:.2f}x the memcpy)" if tool == "ckptio" and world == 1 else ""
                staged = [r["staging"] for r in rs if r.get("staging") is not None]
                staging = f" (staging {max(staged) / (1 << 20):,.0f} MiB)" if staged else ""
                top = max(rs, key=lambda r: r["peak_extra"])  # the largest rank's
                skipped = sum(r["skipped"] for r in rs)
                label = LABELS[tool] + (f" ({skipped} of {a.saves} saves skipped)" if tool == "ckptio-bg-skip" else "")
                floor = max(0.0, a.saves * nbytes / write / base - 1)  # every save made durable, at fio's rate
                print(f"| {label} | {write / 1e6:,.0f} / {read / 1e6:,.0f} MB/s | {wall:.2f} s "
                      f"| {100 * (wall / base - 1):+.1f}% | {'-' if skipped else f'{100 * floor:+.1f}%'} "
                      f"| {100 * (per_save / base - 1):+.1f}% "
                      f"| {1000 * blocked:.0f} ms{vs_memcpy} | {max(r['final_wait'] for r in rs):.2f} s "
                      f"| {restore:.2f} s{ok} | {nbytes / restore / read:.2f}x "
                      f"| {top['peak_extra'] / (1 << 20):,.0f} MiB{staging} | {top['code'] / (1 << 20):.1f} MiB "
                      f"| {(top['peak_extra'] - top['code']) / (1 << 20):,.0f} MiB |", flush=True)
            print()
        print(f"Command: `.venv/bin/python bench/torch_bench.py --size-gib {a.size_gib:g} --tensors {a.tensors} "
              f"--saves {a.saves} --compute-s {a.compute_s} --processes {a.processes}"
              + (f" --tools {a.tools}" if a.tools != ",".join(TOOLS) else "")
              + (f" --python-path {a.python_path}" if a.python_path else "") + "`")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
