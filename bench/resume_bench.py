#!/usr/bin/env python3
"""Uploads that survive a restart (issue 17): what a copy to the remote tier sends again after the
process making it is SIGKILLed mid-upload.

    .venv/bin/python bench/resume_bench.py [--object-mib 256] [--chunk-mib 16] [--kills 2,8,14]
        [--python-path build/python] [--dir DIR]

One tensor of --object-mib float32 (one shard file) is saved to a local tier whose remote tier is
the GCS emulator of tests/gcs, behind its fault proxy, on 127.0.0.1; gcs.chunk_size --chunk-mib.
For each kill point K, a saver process commits the step locally and starts the copy; the proxy
holds the copy's chunk K+1 (the server has K chunks) and the saver is SIGKILLed. A second process
opens the same local tier, which takes the copy up, and waits for the remote commit. The proxy's
log counts the bytes each process sent; the baseline is a copy that is not interrupted.

  acknowledged      bytes the server held when the saver was killed
  sent after        bytes of the object's chunks the second process sent
  sent again        sent after - (object - acknowledged): bytes the server had and got twice
  restart to commit the second process's open to its remote commit, against the uninterrupted copy
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))

SAVER = r"""
import json, sys, time
sys.path.insert(0, sys.argv[1])
import numpy as np, ckptio
root, opts, mib, mode = sys.argv[2], json.loads(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
t = time.perf_counter()  # resume: the open takes the copy up
with ckptio.CheckpointManager(root, **opts) as m:
    if mode == "save":
        m.save(1, {"w": np.arange((mib << 20) // 4, dtype=np.float32)})
        m.wait_until_finished()
        print("committed", flush=True)
        t = time.perf_counter()
    m.wait_until_finished(tier="remote")
    print(json.dumps({"copy": time.perf_counter() - t, "bytes_resumed": m.stats()["bytes_resumed"]}), flush=True)
"""


def saver(python_path, root, opts, mib, mode, env):
    return subprocess.Popen([sys.executable, "-c", SAVER, python_path, root, json.dumps(opts), str(mib), mode],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(p, what):
    out, err = p.communicate(timeout=1800)
    if p.returncode != 0:
        sys.exit(f"resume_bench: {what} failed:\n{err}")
    return json.loads(out.strip().splitlines()[-1])


def chunk_bytes(log):
    return sum(e["request_body_bytes"] for e in log if e["method"] == "PUT" and "upload_id=" in e["query"])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--object-mib", type=int, default=256)
    ap.add_argument("--chunk-mib", type=int, default=16)
    ap.add_argument("--kills", default="2,8,14", help="chunks the server holds when the saver is killed")
    ap.add_argument("--python-path", default="build/python")
    ap.add_argument("--dir", default=None)
    a = ap.parse_args()
    python_path = os.path.abspath(a.python_path)
    sys.path.insert(0, os.path.join(HERE, "..", "tests", "gcs"))
    import testbed  # noqa: E402  (tests/gcs: the emulator and the fault proxy on 127.0.0.1)
    base = tempfile.mkdtemp(prefix="ckptio-resume-", dir=a.dir or os.path.join(HERE, "results"))
    chunk = a.chunk_mib << 20
    try:
        with testbed.GcsTestbed() as bed:
            env = bed.env()
            proxy = bed.proxy

            def opts(name):
                return {"staging_memory": f"{a.object_mib + 64}MiB", "shard_size": f"{2 * a.object_mib}MiB",
                        "tiers": {"remote": f"gs://{bed.bucket}/{name}"}, "gcs": {"chunk_size": f"{a.chunk_mib}MiB"}}

            print(f"# Resumed copies: a {a.object_mib} MiB shard, {a.chunk_mib} MiB chunks, saver SIGKILLed "
                  f"mid-copy, GCS emulator on 127.0.0.1\n")
            print(f"Command: `{' '.join(sys.argv)}`\n")
            proxy.reset()
            p = saver(python_path, os.path.join(base, "full"), opts("full"), a.object_mib, "save", env)
            p.stdout.readline()
            full = finish(p, "the uninterrupted copy")
            size = chunk_bytes(proxy.log())
            rows = []
            for k in [int(x) for x in a.kills.split(",")]:
                name = f"kill{k}"
                root = os.path.join(base, name)
                proxy.reset()
                proxy.set_rules([{"id": "hold", "method": "PUT", "path": "upload_id=",
                                  "headers": {"Content-Range": r"^bytes \d+-"}, "skip": k, "times": 1,
                                  "stall_seconds": 3600}])
                p = saver(python_path, root, opts(name), a.object_mib, "save", env)
                if p.stdout.readline().strip() != "committed":
                    sys.exit(f"resume_bench: the saver failed:\n{p.stderr.read()}")
                deadline = time.monotonic() + 600
                while not proxy.rules()[0]["fired"] and p.poll() is None and time.monotonic() < deadline:
                    time.sleep(0.05)
                p.kill()
                p.wait()
                proxy.set_rules([])
                before = proxy.log()
                acked = max([int(e["response_headers"]["range"].split("-")[1]) + 1 for e in before
                             if e["method"] == "PUT" and e["status"] == 308 and "range" in e["response_headers"]],
                            default=0)
                since = before[-1]["id"] + 1
                r = finish(saver(python_path, root, opts(name), a.object_mib, "resume", env), "the resumed copy")
                sent = chunk_bytes(proxy.log(since))
                rows.append((k, acked, sent, sent - (size - acked), r["bytes_resumed"], r["copy"]))
            mib = 1 << 20
            print(f"Uninterrupted copy: {size / mib:.1f} MiB sent, {full['copy']:.2f} s.\n")
            print("| killed with | acknowledged | sent after restart | sent again | bytes_resumed "
                  "| open to remote commit | vs uninterrupted copy |")
            print("|---|---:|---:|---:|---:|---:|---:|")
            for k, acked, sent, again, resumed, copy in rows:
                print(f"| {k} of {-(-size // chunk)} chunks | {acked / mib:.1f} MiB | {sent / mib:.1f} MiB "
                      f"({sent / size:.2f}x the object) | {again} B | {resumed / mib:.1f} MiB "
                      f"| {copy:.2f} s | {copy / full['copy']:.2f}x |")
            print("\nWithout resuming, a restart sends the whole object again (1.00x) however much the server "
                  "held.")
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
