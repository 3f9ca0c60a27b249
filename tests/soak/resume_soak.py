#!/usr/bin/env python3
"""SIGKILL soak of the copy to a GCS remote tier (not in make test):

    .venv/bin/python tests/soak/resume_soak.py [KILLS] [--build build]

Each round starts a saver process on one local tier whose remote tier is the GCS emulator of
tests/gcs (its fault proxy shaping uploads to 8 MiB/s, so copies take a while), which saves the
next step (one 4 MiB shard, 256 KiB chunks) and then waits for its copy; the round SIGKILLs it at a
random moment of the copy. A last process finishes what is left. Then: every step must be
committed in the remote tier and restore bit-exact and verify, and the proxy's log must show no
upload started twice and no byte sent twice (each kill's copy resumed by the next process).
Exit status 0 if so.
"""
import argparse
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

CHILD = r"""
import sys
sys.path.insert(0, sys.argv[4])
import numpy as np, ckptio
root, remote, step = sys.argv[1], sys.argv[2], int(sys.argv[3])
m = ckptio.CheckpointManager(root, staging_memory="64MiB", shard_size="2MiB", gcs={"chunk_size": "256KiB"},
                             tiers={"remote": remote, "remote_keep": 0})
if step not in m.all_steps(tier="local"):
    m.save(step, {"w": np.random.default_rng(step).standard_normal(1 << 20).astype(np.float32)})
    m.wait_until_finished()
print("committed", flush=True)
m.wait_until_finished(tier="remote")
m.close()
"""


def expected(step):
    import numpy as np
    return np.random.default_rng(step).standard_normal(1 << 20).astype(np.float32)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("kills", nargs="?", type=int, default=20)
    ap.add_argument("--build", default=os.path.join(REPO, "build"))
    ap.add_argument("--seed", type=int, default=7)
    a = ap.parse_args()
    python_path = os.path.join(os.path.abspath(a.build), "python")
    sys.path.insert(0, os.path.join(REPO, "tests", "gcs"))
    sys.path.insert(0, python_path)
    import testbed  # noqa: E402
    rng = random.Random(a.seed)
    base = tempfile.mkdtemp(prefix="ckptio-resume-soak-")
    local = os.path.join(base, "local")
    try:
        with testbed.GcsTestbed() as bed:
            env = bed.env()
            remote = f"gs://{bed.bucket}/soak"
            bed.proxy.settings(bandwidth_bytes_per_s=8 << 20)
            kills = 0
            for step in range(1, a.kills + 2):
                p = subprocess.Popen([sys.executable, "-c", CHILD, local, remote, str(step), python_path], env=env,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                if p.stdout.readline().strip() != "committed":
                    sys.exit(f"resume_soak: the saver of step {step} failed:\n{p.communicate()[1]}")
                if step <= a.kills:
                    time.sleep(rng.uniform(0, 1.0))  # a random moment of the copy
                    if p.poll() is None:
                        p.kill()
                        kills += 1
                _, err = p.communicate()
                if p.returncode not in (0, -9):
                    sys.exit(f"resume_soak: the saver of step {step} exited {p.returncode}:\n{err}")
            bed.proxy.settings(bandwidth_bytes_per_s=0)
            os.environ.update(env)
            import ckptio  # noqa: E402
            with ckptio.CheckpointManager(remote, staging_memory="64MiB") as r:
                steps = r.all_steps()
                bad = [s for s in steps if r.restore(s)["w"].tobytes() != expected(s).tobytes()]
                for s in steps:
                    r.verify(s)
                sizes = sum(r.info(s)["bytes"] for s in steps)
            log = bed.proxy.log()
            starts = sum(1 for e in log if e["method"] == "POST" and "uploadType=resumable" in e["query"])
            resumes = sum(1 for e in log if e["method"] == "PUT" and
                          (e["headers"].get("content-range") or "").startswith("bytes */"))
            sent = sum(e["request_body_bytes"] for e in log if e["method"] == "PUT" and "upload_id=" in e["query"])
            print(f"kills {kills}; remote steps {len(steps)} of {a.kills + 1}; bad {bad}; sessions started {starts}; "
                  f"sessions resumed {resumes}; chunk bytes sent {sent} for {sizes} bytes of shards")
            # Every shard goes through a session (4 MiB > one chunk); the manifests in one request each.
            ok = steps == list(range(1, a.kills + 2)) and not bad and starts == len(steps) and sent == sizes
            print("resume_soak:", "ok" if ok else "FAILED")
            return 0 if ok else 1
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
