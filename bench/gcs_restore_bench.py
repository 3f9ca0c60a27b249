#!/usr/bin/env python3
"""Restores from GCS (issue 31): ckptio's ranged reads against curl making the same ranged GETs,
and against orbax (tensorstore) on the same emulator, over 1 to 16 connections.

    .venv-bench/bin/python bench/gcs_restore_bench.py [--size-mib 512] [--reps 3]
        [--connections 1,2,4,8,16] [--ckptio-python build/python] [--out bench/results/gcs_restore.md]

Starts the GCS emulator of the test suite (tests/gcs/with_gcs.py: gcp-storage-emulator, in memory,
on 127.0.0.1; every request here goes to it directly, not through the fault proxy) around itself.
The state: float32 arrays, --size-mib in all, 16 arrays and one of 1 MiB (restore_bench.py's
layout and hash). ckptio saves it once to gs://BUCKET/restore/ckptio (defaults: 256 MiB shards),
orbax once to gs://BUCKET/restore/orbax (StandardCheckpointer, through tensorstore).

Per repetition, each restore in a fresh process (the manager opened, then the clock started):

  ckptio C    restore() onto numpy with gcs.connections C (gcs.loops min(C, 2)): ckptio's reads
              of 16 MiB pieces, 8 in flight, spread over the loops, each received block
              checksummed as it arrives (in cache), the pieces' CRC32C folded into each tensor's
              and checked against the manifest; fresh memory (ckptio's own)
  warm C      restore_into() of numpy arrays allocated and touched before the clock starts
  curl C      the floor: one curl process (--parallel --parallel-max C) making the ranged GETs that
              ckptio makes (each tensor's bytes in 16 MiB ranges, as the manifest places them) into
              /dev/null: the least the same requests take on this endpoint, with no CRC and no
              memory written (the floor of restore_into() of warm arrays)
  curl-mem C  the same GETs, each into a file of its own on tmpfs (/dev/shm): the state's size of
              fresh memory first touched and written, as restore() must do with its output (the
              floor of restore()); the files deleted after each run
  orbax       StandardCheckpointer().restore(path, target of ShapeDtypeStructs) (tensorstore's
              own concurrency; TENSORSTORE_GCS_HTTP_URL points it at the emulator)

First tensor: a fresh manager's restore of the 1 MiB array alone (a target naming only it: the
manifest is read, then one ranged GET), against curl's GET of the manifest then the same ranged
GET on one connection; and curl's time to the first byte of that ranged GET.

Every ckptio and orbax restore is checked afterwards (the first and last 64 KiB of every array
against the hash); curl's byte count is checked against the planned ranges.
"""
import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
MIB = 1 << 20
PIECE = 16 * MIB  # src/pipeline/reader.cc kPiece

sys.path.insert(0, HERE)
from restore_bench import COMMON, SAVE, run, spread, state_bytes  # noqa: E402  (layout, hash, check, save, report)

RESTORE = COMMON + r"""
import resource
sys.path.insert(0, args["ckptio_python"])
row = args["row"]

def cpu():
    u = resource.getrusage(resource.RUSAGE_SELF)
    return u.ru_utime + u.ru_stime

if row == "orbax" or row == "first":
    import jax
    dev = jax.devices("cpu")[0]
    sharding = jax.sharding.SingleDeviceSharding(dev)
    target = nest((name, jax.ShapeDtypeStruct(shape, np.float32, sharding=sharding)) for name, shape in LAYOUT)
if row == "orbax":
    import orbax.checkpoint as ocp
    ckptr = ocp.StandardCheckpointer()
    c0, t0 = cpu(), time.perf_counter()
    out = jax.block_until_ready(ckptr.restore(args["root"], target))
else:
    import ckptio
    c = args["connections"]
    mgr = ckptio.CheckpointManager(args["root"], read_only=True, gcs={"connections": c, "loops": min(c, 2)})
    if row == "first":
        c0, t0 = cpu(), time.perf_counter()
        out = mgr.restore(1, target={"embed": {"bias": target["embed"]["bias"]}})
        out = jax.block_until_ready(out)
    elif row == "into-warm":
        out = nest((name, np.ones(shape, np.float32)) for name, shape in LAYOUT)  # touched: warm memory
        c0, t0 = cpu(), time.perf_counter()
        mgr.restore_into(1, out)
    else:
        c0, t0 = cpu(), time.perf_counter()
        out = mgr.restore(1)
seconds = time.perf_counter() - t0
cpu_seconds = cpu() - c0
flat = {k: np.asarray(v) for k, v in by_name(out).items()}
if row == "first":
    LAYOUT = [(n, s) for n, s in LAYOUT if n == "embed/bias"]
    # check() walks LAYOUT with its seeds: keep the array's own seed
    seed = [i for i, (n, _) in enumerate(layout(args["bytes"])) if n == "embed/bias"][0]
    f = flat["embed/bias"].reshape(-1)
    k = min(f.size, 16384)
    if f[:k].tobytes() != hashed(seed, 0, k).tobytes():
        raise SystemExit("embed/bias: the restored bytes differ from the saved ones")
else:
    check(flat)
print("RESULT " + json.dumps({"seconds": seconds, "cpu": cpu_seconds}))
"""


def get_json(url):
    with urllib.request.urlopen(url, timeout=60) as r:
        return json.loads(r.read())


def media_url(endpoint, bucket, name):
    return f"{endpoint}/storage/v1/b/{urllib.parse.quote(bucket, safe='')}/o/{urllib.parse.quote(name, safe='')}?alt=media"


def plan(endpoint, bucket, prefix):
    """The manifest's object and the ranged GETs ckptio makes for a whole restore: (url, first, last)."""
    listed = get_json(f"{endpoint}/storage/v1/b/{bucket}/o?prefix={urllib.parse.quote(prefix)}")
    manifests = [o["name"] for o in listed.get("items", []) if o["name"].endswith("/manifest.json")]
    if len(manifests) != 1:
        raise SystemExit(f"expected one manifest under gs://{bucket}/{prefix}, found {manifests}")
    manifest_name = manifests[0]
    step_dir = manifest_name[:-len("manifest.json")]
    with urllib.request.urlopen(media_url(endpoint, bucket, manifest_name), timeout=60) as r:
        manifest = json.loads(r.read())
    ranges, first = [], None
    for t in manifest["tensors"]:
        url = media_url(endpoint, bucket, step_dir + t["shard"])
        for done in range(0, t["bytes"], PIECE):
            n = min(PIECE, t["bytes"] - done)
            ranges.append((url, t["offset"] + done, t["offset"] + done + n - 1))
        if t["name"] == "embed/bias":
            first = (url, t["offset"], t["offset"] + t["bytes"] - 1)
    return media_url(endpoint, bucket, manifest_name), ranges, first


def curl_config(ranges, path, into=None):
    """into: a tmpfs directory to write each range to a file of its own (memory first touched, as a
    restore into fresh arrays touches it); else /dev/null."""
    with open(path, "w") as f:
        # Options in a config file hold for every URL unless a "next" separates them.
        for i, (url, a, b) in enumerate(ranges):
            out = os.path.join(into, str(i)) if into else "/dev/null"
            f.write("next\n" if i else "")
            f.write(f'url = "{url}"\nrange = {a}-{b}\noutput = "{out}"\nfail\nsilent\nshow-error\n'
                    f'write-out = "%{{size_download}}\\n"\n')


def children_cpu():
    u = resource.getrusage(resource.RUSAGE_CHILDREN)
    return u.ru_utime + u.ru_stime


def curl_all(cfg, connections, expected):
    c0, t0 = children_cpu(), time.perf_counter()
    p = subprocess.run(["curl", "-sS", "--parallel", "--parallel-max", str(connections), "-K", cfg],
                       capture_output=True, text=True, timeout=1800)
    seconds, cpu = time.perf_counter() - t0, children_cpu() - c0
    if p.returncode != 0:
        return {"error": f"curl exit {p.returncode}: {p.stderr.strip()[:200]}"}
    got = sum(int(x) for x in p.stdout.split())
    if got != expected:
        return {"error": f"curl read {got} bytes, wanted {expected}"}
    return {"seconds": seconds, "cpu": cpu}


def curl_first(manifest_url, first):
    url, a, b = first
    p = subprocess.run(["curl", "-sS", "--fail", manifest_url, "-o", "/dev/null", "-w", "%{time_total}\n",
                        "--next", "-sS", "--fail", "-r", f"{a}-{b}", url, "-o", "/dev/null",
                        "-w", "%{time_total} %{time_starttransfer}\n"], capture_output=True, text=True, timeout=300)
    if p.returncode != 0:
        return {"error": f"curl exit {p.returncode}: {p.stderr.strip()[:200]}"}
    lines = p.stdout.split("\n")
    manifest_total = float(lines[0])
    total, ttfb = (float(x) for x in lines[1].split())
    return {"seconds": manifest_total + total, "ttfb": ttfb}


def inside(a):
    endpoint = os.environ["CKPTIO_TEST_EMULATOR"]  # direct, not through the fault proxy
    bucket = os.environ["CKPTIO_TEST_BUCKET"]
    env = dict(os.environ, JAX_PLATFORMS="cpu", STORAGE_EMULATOR_HOST=endpoint, TENSORSTORE_GCS_HTTP_URL=endpoint,
               GOOGLE_AUTH_TOKEN_FOR_TESTING="emulator", FSSPEC_GS_TOKEN="anon", FSSPEC_GCS_TOKEN="anon",
               GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT="false")
    nbytes = a.size_mib * MIB
    base = {"bytes": nbytes, "ckptio_python": os.path.abspath(a.ckptio_python)}
    roots = {"ckptio": f"gs://{bucket}/restore/ckptio", "orbax": f"gs://{bucket}/restore/orbax"}
    for tool in ("ckptio", "orbax"):
        t0 = time.perf_counter()
        r = run(sys.executable, SAVE, dict(base, tool=tool, root=roots[tool]), env=env)
        print(f"save {tool}: {r} in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
        if "error" in r:
            if tool == "ckptio":
                raise SystemExit(f"the ckptio save failed: {r['error']}")
            a.orbax_error = r["error"]
    manifest_url, ranges, first = plan(endpoint, bucket, "restore/ckptio/")
    expected = sum(b - a_ + 1 for _, a_, b in ranges)

    def restore(row, **kw):  # a restore of ckptio's copy in a fresh process
        return run(sys.executable, RESTORE, dict(base, row=row, root=roots["ckptio"], **kw), env=env)

    results = {"ckptio": {c: [] for c in a.conns}, "into-warm": {c: [] for c in a.conns},
               "curl": {c: [] for c in a.conns}, "curl-mem": {c: [] for c in a.conns}, "orbax": [],
               "first": [], "curl-first": []}
    fd, cfg = tempfile.mkstemp(prefix="gcs-restore-", suffix=".curl")
    os.close(fd)
    fd, cfg_mem = tempfile.mkstemp(prefix="gcs-restore-mem-", suffix=".curl")
    os.close(fd)
    shm = tempfile.mkdtemp(prefix="gcs-restore-", dir="/dev/shm")
    try:
        curl_config(ranges, cfg)
        curl_config(ranges, cfg_mem, into=shm)
        for rep in range(a.reps):
            for c in a.conns:
                r = curl_all(cfg, c, expected)
                results["curl"][c].append(r)
                print(f"rep {rep + 1} curl {c}: {r}", file=sys.stderr)
                r = curl_all(cfg_mem, c, expected)
                results["curl-mem"][c].append(r)
                print(f"rep {rep + 1} curl into memory {c}: {r}", file=sys.stderr)
                for name in os.listdir(shm):  # its pages freed: the next run's are fresh again
                    os.unlink(os.path.join(shm, name))
                r = restore("ckptio", connections=c)
                results["ckptio"][c].append(r)
                print(f"rep {rep + 1} ckptio {c}: {r}", file=sys.stderr)
                r = restore("into-warm", connections=c)
                results["into-warm"][c].append(r)
                print(f"rep {rep + 1} into-warm {c}: {r}", file=sys.stderr)
            r = curl_first(manifest_url, first)
            results["curl-first"].append(r)
            r = restore("first", connections=max(a.conns))
            results["first"].append(r)
            print(f"rep {rep + 1} first tensor: ckptio {r}, curl {results['curl-first'][-1]}", file=sys.stderr)
            if not getattr(a, "orbax_error", None):
                r = run(sys.executable, RESTORE, dict(base, row="orbax", root=roots["orbax"]), env=env)
                results["orbax"].append(r)
                print(f"rep {rep + 1} orbax: {r}", file=sys.stderr)
    finally:
        os.unlink(cfg)
        os.unlink(cfg_mem)
        shutil.rmtree(shm, ignore_errors=True)
    results["expected"] = expected
    results["pieces"] = len(ranges)
    with open(a.json_out, "w") as f:
        json.dump(results, f)


def report(a, res, command, seconds):
    nbytes = state_bytes(a.size_mib * MIB)
    orbax = [r.get("seconds") for r in res["orbax"]]
    out = ["## Restores from GCS: ckptio's ranged reads against curl's and orbax's on the same emulator\n",
           f"`{command}`: {a.reps} repetition(s), each restore a fresh process; {seconds / 60:.1f} minutes, load "
           f"average at the end {open('/proc/loadavg').read().split()[0]}. The emulator: gcp-storage-emulator "
           "(tests/gcs), in memory, plain HTTP on 127.0.0.1, one Python process on the same 2 cores as the "
           f"client. State: {nbytes / MIB:.0f} MiB of float32 in 17 arrays, {res['pieces']} ranged GETs of up to "
           "16 MiB. Times are medians (min–max); vs curl: curl's time / ckptio's with the same connections "
           "in the same repetition (target >= 0.9x). curl floor: the ranged GETs into /dev/null, no memory "
           "written (the floor of restore_into() of warm arrays); curl into memory: the same GETs, each into a "
           "file of its own on tmpfs, so that 1 GiB of fresh memory is first touched as restore() must touch "
           "its output's (the floor of restore()).\n",
           "| connections | ckptio restore() | MB/s | CPU | ckptio restore_into() warm | MB/s | CPU | curl floor | MB/s "
           "| CPU | curl into memory | CPU | restore() vs curl into memory | restore() vs curl "
           "| restore_into() vs curl | restore() vs orbax |",
           "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    fmt_s = lambda s: f"{s:.2f} s"
    rate = lambda ts, n: spread([n / t / 1e6 for t in ts], lambda x: f"{x:.0f}")
    for c in a.conns:
        ck, warm, cu, cm = (res[k][str(c)] for k in ("ckptio", "into-warm", "curl", "curl-mem"))
        errors = [r["error"] for r in ck + warm + cu + cm if "error" in r]
        if errors:
            out.append(f"| {c} | failed: {errors[0]} |" + " |" * 14)
            continue
        t_ck, t_w, t_cu, t_cm = ([r["seconds"] for r in rows] for rows in (ck, warm, cu, cm))
        cpu = lambda rows: spread([r["cpu"] for r in rows], fmt_s)
        vs = lambda ts, floor=t_cu: spread([u / k for k, u in zip(ts, floor)], lambda x: f"{x:.2f}x")
        vo = [k / o for k, o in zip(t_ck, orbax) if o]
        out.append(f"| {c} | {spread(t_ck, fmt_s)} | {rate(t_ck, nbytes)} | {cpu(ck)} | {spread(t_w, fmt_s)} | "
                   f"{rate(t_w, nbytes)} | {cpu(warm)} | {spread(t_cu, fmt_s)} | {rate(t_cu, res['expected'])} | "
                   f"{cpu(cu)} | {spread(t_cm, fmt_s)} | {cpu(cm)} | {vs(t_ck, t_cm)} | {vs(t_ck)} | {vs(t_w)} "
                   f"| {spread(vo, lambda x: f'{x:.2f}x')} |")
    ok_orbax = [r for r in res["orbax"] if "seconds" in r]
    if ok_orbax:
        t_o = [r["seconds"] for r in ok_orbax]
        out.append(f"| orbax (tensorstore's own) | {spread(t_o, fmt_s)} | {rate(t_o, nbytes)} | "
                   f"{spread([r['cpu'] for r in ok_orbax], fmt_s)} |" + " |" * 11 + " 1.00x |")
    else:
        err = [r["error"] for r in res["orbax"] if "error" in r] or [getattr(a, "orbax_error", "not run")]
        out.append(f"| orbax | failed: {err[0]} |" + " |" * 14)
    out.append("\nCPU: the restoring process's user + system time during the call (all its threads); curl's, "
               "the curl process's. The emulator (not counted) shares the 2 cores.")
    first = [r.get("seconds") for r in res["first"] if "seconds" in r]
    cfirst = [r.get("seconds") for r in res["curl-first"] if "seconds" in r]
    ttfb = [r.get("ttfb") for r in res["curl-first"] if "ttfb" in r]
    out += ["",
            "First tensor (a fresh process, the manager open; the 1 MiB array alone):\n",
            "| | time |", "|---|---:|",
            f"| ckptio: manifest read + one ranged GET + CRC32C | {spread([t * 1e3 for t in first], lambda x: f'{x:.1f} ms')} |",
            f"| curl: GET manifest, then the ranged GET (one connection) | {spread([t * 1e3 for t in cfirst], lambda x: f'{x:.1f} ms')} |",
            f"| curl: time to the first byte of the ranged GET | {spread([t * 1e3 for t in ttfb], lambda x: f'{x:.1f} ms')} |",
            ""]
    return "\n".join(out)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-mib", type=int, default=512)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--connections", default="1,2,4,8,16")
    ap.add_argument("--ckptio-python", default=os.path.join(ROOT, "build", "python"))
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "gcs_restore.md"))
    ap.add_argument("--inside", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--json-out", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    try:
        a.conns = [int(x) for x in a.connections.split(",")]
    except ValueError:
        ap.error(f"--connections: a comma-separated list of numbers, got {a.connections!r}")
    if any(c < 1 for c in a.conns):
        ap.error("--connections: each at least 1")
    if a.inside:
        inside(a)
        return 0
    test_python = os.path.join(ROOT, ".venv", "bin", "python")
    if not os.path.exists(test_python):
        ap.error(f"no {test_python} for the GCS emulator (run `make venv`)")
    fd, json_out = tempfile.mkstemp(prefix="gcs-restore-", suffix=".json")
    os.close(fd)
    start = time.time()
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        cmd = [test_python, os.path.join(ROOT, "tests", "gcs", "with_gcs.py"), "--quiet", "--",
               sys.executable, os.path.abspath(__file__), *argv, "--inside", "--json-out", json_out]
        p = subprocess.run(cmd)
        if p.returncode != 0:
            print(f"gcs_restore_bench: the run inside the emulator failed (exit {p.returncode})", file=sys.stderr)
            return 1
        with open(json_out) as f:
            res = json.load(f)
    finally:
        os.unlink(json_out)
    text = report(a, res, ("python bench/gcs_restore_bench.py " + " ".join(argv)).strip(), time.time() - start)
    with open(a.out, "w") as f:
        f.write(text + "\n")
    print(text)
    failed = any("error" in r for rows in (res["ckptio"], res["into-warm"], res["curl"]) for runs in rows.values() for r in runs)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
