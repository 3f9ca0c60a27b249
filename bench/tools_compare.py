#!/usr/bin/env python3
"""Side by side: what checkpointing costs a trainer with orbax, flax and ckptio.

    .venv-bench/bin/python bench/tools_compare.py [--state-size 1GiB] [--saves 10]
        [--compute 2] [--keep 3] [--tools orbax,flax,ckptio] [--dir DIR]
        [--gcs-state-size 128MiB] [--gcs-saves 5] [--gcs-tools orbax,ckptio]
        [--skip-gcs] [--out bench/results/tools.md]

The same state for every tool (~100 tensors of mixed dtypes laid out like
`ckptio demo`'s: BF16, F32, F16, I32, U8), saved --saves times with --compute
seconds of simulated compute before each save, keeping --keep, on the same
local disk:

  orbax   orbax-checkpoint's CheckpointManager, async (jax on CPU)
  flax    flax.training.checkpoints.save_checkpoint (blocking)
  ckptio  ckptio.CheckpointManager (the Python module, from build-py/python);
          if `import ckptio` fails there, the C++ CLI's
          `ckptio bench seed --modes ckptio` with the same state and flags

then orbax (tensorstore) and ckptio on the GCS emulator (tests/gcs/with_gcs.py
starts it; TENSORSTORE_GCS_HTTP_URL and STORAGE_EMULATOR_HOST point both at
it) with a smaller state: the emulator is one Python process holding every
object in memory on the same 2 cores.

Each tool runs in its own process. One untimed warm-up save first (thread
pools, jax's first transfer, ckptio's staging pre-fault: what a trainer's
first minutes hide). The compute is time-boxed numpy work on the trainer's
thread that releases the GIL, as XLA's compute does. Per tool: time the save
calls blocked the trainer, the final wait, total wall time, overhead =
(total - compute) / compute, and bytes/s = state bytes / the time of one
more save followed at once by the wait for it (outside the totals). A tool
that cannot run here gets a row saying why.

Runs under .venv-bench (bench/requirements.txt; `make venv-bench`).
"""
import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
GIB = 1 << 30
MIB = 1 << 20


def parse_size(text):
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(B|KiB|MiB|GiB)?\s*", text)
    if not m:
        raise argparse.ArgumentTypeError(f"a size like 1GiB, 128MiB or 4096, got {text!r}")
    unit = {"B": 1, None: 1, "KiB": 1 << 10, "MiB": MIB, "GiB": GIB}[m.group(2)]
    value = int(float(m.group(1)) * unit)
    if value < 1 << 16:
        raise argparse.ArgumentTypeError(f"a state of at least 64KiB, got {text!r}")
    return value


def parse_seconds(text):
    value = float(text[:-1] if text.endswith("s") else text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"seconds >= 0, got {text!r}")
    return value


def human_size(n):
    return f"{n / GIB:g} GiB" if n >= GIB else f"{n / MIB:g} MiB"


# ---------------------------------------------------------------- the state


def state_specs():
    """(name, dtype, weight) of ckptio demo's tensors (src/cli/demo_state.cc)."""
    specs = [("embed/tokens", "bfloat16", 6)]
    for layer in range(19):
        p = f"layers/{layer}/"
        scale = 1.0 + 0.25 * (layer % 4)
        specs += [(p + "attn/qkv/kernel", "bfloat16", 3 * scale), (p + "attn/out/kernel", "bfloat16", scale),
                  (p + "mlp/kernel", "float32", 4 * scale), (p + "mlp/bias", "float16", 0.01),
                  (p + "norm/scale", "float32", 0.002)]
    specs += [("final_norm/scale", "float32", 0.002), ("head/kernel", "float16", 4), ("opt/count", "int32", 0),
              ("data/mask", "uint8", None)]
    return specs


def make_state(nbytes):
    """A nested dict of numpy arrays holding exactly nbytes bytes."""
    import ml_dtypes
    import numpy as np

    dtypes = {"bfloat16": np.dtype(ml_dtypes.bfloat16), "float32": np.dtype(np.float32),
              "float16": np.dtype(np.float16), "int32": np.dtype(np.int32), "uint8": np.dtype(np.uint8)}
    specs = state_specs()
    total_weight = sum(w for _, _, w in specs if w)
    budget, used = nbytes - 4, 0
    tree = {}
    rng = np.random.default_rng(7)
    for name, dtype_name, weight in specs:
        dtype = dtypes[dtype_name]
        if weight is None:
            shape = (nbytes - used,)
        elif weight == 0:
            shape = ()
        else:
            elems = int(budget * weight / total_weight) // dtype.itemsize
            shape = (elems // 1024, 1024) if elems >= 1024 else (elems,)
        count = int(np.prod(shape, dtype=np.int64)) if shape else 1
        raw = rng.integers(0, 256, size=count * dtype.itemsize, dtype=np.uint8)
        array = raw.view(dtype).reshape(shape)
        used += array.nbytes
        node = tree
        parts = name.split("/")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = array
    return tree


def tree_bytes(tree):
    return sum(tree_bytes(v) for v in tree.values()) if isinstance(tree, dict) else tree.nbytes


def tree_count(tree):
    return sum(tree_count(v) for v in tree.values()) if isinstance(tree, dict) else 1


class Trainer:
    """Time-boxed compute on the caller's thread. numpy ufuncs over a 4 MiB
    buffer release the GIL, as a jax trainer's XLA computations do, so a
    tool's Python background threads can run meanwhile."""

    def __init__(self):
        import numpy as np

        self.np = np
        self.scratch = np.ones(MIB, np.float32)

    def compute(self, seconds):
        """Returns (wall seconds, CPU seconds of this thread)."""
        wall0, cpu0 = time.perf_counter(), time.thread_time()
        deadline = wall0 + seconds
        while time.perf_counter() < deadline:
            self.np.multiply(self.scratch, 1.0000001, out=self.scratch)
            self.np.add(self.scratch, 1e-7, out=self.scratch)
        return time.perf_counter() - wall0, time.thread_time() - cpu0


# ---------------------------------------------------------------- the tools


class OrbaxAsync:
    via = "orbax-checkpoint CheckpointManager, async, StandardSave, jax on CPU"

    def __init__(self, root, keep, state_bytes):
        import orbax.checkpoint as ocp

        self.ocp = ocp
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=True)
        self.mgr = ocp.CheckpointManager(root, options=options)

    def prepare(self, tree):
        import jax

        return jax.device_put(tree)

    def save(self, step, state):
        self.mgr.save(step, args=self.ocp.args.StandardSave(state))

    def wait(self):
        self.mgr.wait_until_finished()

    def steps(self):
        return len(self.mgr.all_steps())

    def close(self):
        self.mgr.close()


class FlaxBlocking:
    via = "flax.training.checkpoints.save_checkpoint (blocking)"

    def __init__(self, root, keep, state_bytes):
        from flax.training import checkpoints

        self.checkpoints, self.root, self.keep = checkpoints, root, keep

    def prepare(self, tree):
        import jax

        return jax.device_put(tree)

    def save(self, step, state):
        self.checkpoints.save_checkpoint(self.root, target=state, step=step, keep=self.keep)

    def wait(self):
        pass

    def steps(self):
        if self.root.startswith("gs://"):
            return None
        return sum(1 for d in os.listdir(self.root) if re.fullmatch(r"checkpoint_\d+", d))

    def close(self):
        pass


class CkptioPython:
    via = "ckptio Python module"

    def __init__(self, root, keep, state_bytes):
        import ckptio

        options = {"staging_memory": 2 * state_bytes + 64 * MIB}  # two saves in flight, as `ckptio bench seed`
        if root.startswith("gs://"):  # as `ckptio bench seed` on GCS: one request per object
            options.update(shard_size="32MiB", gcs={"chunk_size": "32MiB"})
        self.mgr = ckptio.CheckpointManager(root, keep=keep, **options)

    def prepare(self, tree):
        return tree

    def save(self, step, state):
        self.mgr.save(step, state)

    def wait(self):
        self.mgr.wait_until_finished()

    def steps(self):
        return len(self.mgr.all_steps())

    def close(self):
        self.mgr.close()


TOOLS = {"orbax": OrbaxAsync, "flax": FlaxBlocking, "ckptio": CkptioPython}


def run_child(a):
    """One tool in this process; prints RESULT <json>."""
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    if a.child == "ckptio":
        sys.path.insert(0, a.ckptio_python)
    tree = make_state(a.state_size)
    tool = TOOLS[a.child](a.root, a.keep, a.state_size)
    state = tool.prepare(tree)
    trainer = Trainer()
    tool.save(0, state)  # the untimed warm-up
    tool.wait()
    blocked, computes, compute_cpu = [], 0.0, 0.0
    start = time.perf_counter()
    for step in range(1, a.saves + 1):
        wall, cpu = trainer.compute(a.compute)
        computes += wall
        compute_cpu += cpu
        t0 = time.perf_counter()
        tool.save(step, state)
        blocked.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    tool.wait()
    final_wait = time.perf_counter() - t0
    total = time.perf_counter() - start
    kept = tool.steps()
    t0 = time.perf_counter()
    tool.save(a.saves + 1, state)
    tool.wait()
    one_save = time.perf_counter() - t0
    tool.close()
    via = tool.via
    if a.child == "ckptio":
        via = f"ckptio Python module (PYTHONPATH={os.path.relpath(a.ckptio_python, ROOT)})"
    result = {"tool": a.child, "via": via, "state_bytes": tree_bytes(tree), "tensors": tree_count(tree),
              "saves": a.saves, "blocked": blocked, "final_wait": final_wait, "total": total, "compute": computes,
              "compute_cpu": compute_cpu, "kept": kept, "one_save": one_save}
    print("RESULT " + json.dumps(result), flush=True)


def ckptio_cli(a, root):
    """ckptio through `ckptio bench seed --modes ckptio` (same state layout and
    compute loop in C++), when the Python module is not importable."""
    out = tempfile.mkdtemp(prefix="tools-seed-")
    try:
        cmd = [a.ckptio_bin, "bench", "seed", "--modes", "ckptio", "--state-size", str(a.state_size),
               "--saves", str(a.saves), "--compute", f"{a.compute}s", "--keep", str(a.keep), "--dest", root,
               "--out", out, "--no-audit", "--cleanup"]
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=a.timeout)
        row = next((line for line in p.stdout.splitlines() if line.startswith("| ckptio |")), None)
        if p.returncode != 0 or row is None:
            raise RuntimeError(f"{' '.join(cmd)} failed (exit {p.returncode}): {last_line(p.stderr or p.stdout)}")
        # | mode | total | compute | blocked in saves | final wait | overhead | speedup | bytes/s | CPU | kept |
        cells = [c.strip() for c in row.strip("|").split("|")]
        secs = [float(c.split()[0]) for c in cells[1:5]]
        return {"tool": "ckptio", "via": "C++ CLI `ckptio bench seed --modes ckptio` (`import ckptio` failed)",
                "state_bytes": a.state_size, "tensors": 100, "saves": a.saves, "blocked": [secs[2] / a.saves] * a.saves,
                "final_wait": secs[3], "total": secs[0], "compute": secs[1], "compute_cpu": None, "kept": None,
                "one_save": None, "rate_text": cells[7] + " (while saves were in flight)"}
    finally:
        shutil.rmtree(out, ignore_errors=True)


# ---------------------------------------------------------------- the runner


def last_line(text):
    lines = [line.strip() for line in (text or "").splitlines() if line.strip()]
    useful = [line for line in lines if not line.startswith(("W0", "I0", "WARNING:absl"))] or lines
    return (useful[-1] if useful else "no output")[:300]


def ckptio_importable(a):
    probe = f"import sys; sys.path.insert(0, {a.ckptio_python!r}); import ckptio"
    p = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    return p.returncode == 0, last_line(p.stderr)


def run_tool(a, tool, root, env):
    """Runs one tool in a child process; a failure becomes a row's reason."""
    if tool == "ckptio":
        ok, why = ckptio_importable(a)
        if not ok:
            try:
                return ckptio_cli(a, root)
            except Exception as e:  # noqa: BLE001 - the row says why
                return {"tool": tool, "error": f"`import ckptio` failed ({why}); CLI fallback: {e}"}
    cmd = [sys.executable, os.path.abspath(__file__), "--child", tool, "--root", root,
           "--state-size", str(a.state_size), "--saves", str(a.saves), "--compute", str(a.compute),
           "--keep", str(a.keep), "--ckptio-python", a.ckptio_python]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=a.timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"tool": tool, "error": f"did not finish within {a.timeout:.0f} s"}
    for line in p.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    return {"tool": tool, "error": f"exit {p.returncode}: {last_line(p.stderr)}"}


def run_backend(a, tools, root_of, env):
    results = []
    for tool in tools:
        print(f"tools_compare: {tool} -> {root_of(tool)} ...", file=sys.stderr, flush=True)
        r = run_tool(a, tool, root_of(tool), env)
        if "error" in r:
            print(f"tools_compare: {tool}: {r['error']}", file=sys.stderr, flush=True)
        results.append(r)
    return results


def run_local(a):
    base = os.path.abspath(a.dir)
    os.makedirs(base, exist_ok=True)
    work = tempfile.mkdtemp(prefix="tools-", dir=base)
    try:
        return run_backend(a, a.tools, lambda t: os.path.join(work, t), dict(os.environ))
    finally:
        shutil.rmtree(work, ignore_errors=True)


def run_gcs_inside(a):
    """Inside tests/gcs/with_gcs.py: the emulator is up."""
    emulator = os.environ["CKPTIO_TEST_EMULATOR"]  # direct, not through the fault proxy
    bucket = os.environ["CKPTIO_TEST_BUCKET"]
    env = dict(os.environ)
    env.update({"TENSORSTORE_GCS_HTTP_URL": emulator, "GOOGLE_AUTH_TOKEN_FOR_TESTING": "emulator",
                "STORAGE_EMULATOR_HOST": emulator, "FSSPEC_GS_TOKEN": "anon", "FSSPEC_GCS_TOKEN": "anon",
                # gcsfs's bucket-type probe speaks gRPC over TLS, which the emulator does not
                "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false"})
    os.environ.update(env)  # the CLI fallback runs from this process
    results = run_backend(a, a.tools, lambda t: f"gs://{bucket}/tools/{t}", env)
    with open(a.json_out, "w") as f:
        json.dump(results, f)


def run_gcs(a):
    """Starts the emulator around a copy of this script (tests/gcs/with_gcs.py,
    under the test venv), which runs the GCS tools."""
    test_python = os.path.join(ROOT, ".venv", "bin", "python")
    if not os.path.exists(test_python):
        return [{"tool": t, "error": f"no {test_python} for the GCS emulator (run `make venv`)"} for t in a.gcs_tools]
    fd, json_out = tempfile.mkstemp(prefix="tools-gcs-", suffix=".json")
    os.close(fd)
    cmd = [test_python, os.path.join(ROOT, "tests", "gcs", "with_gcs.py"), "--quiet", "--",
           sys.executable, os.path.abspath(__file__), "--inside-gcs", "--json-out", json_out,
           "--tools", ",".join(a.gcs_tools), "--state-size", str(a.gcs_state_size), "--saves", str(a.gcs_saves),
           "--compute", str(a.compute), "--keep", str(a.keep), "--ckptio-python", a.ckptio_python,
           "--ckptio-bin", a.ckptio_bin, "--timeout", str(a.timeout)]
    try:
        p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=None, text=True, timeout=a.timeout * len(a.gcs_tools) + 60)
        with open(json_out) as f:
            text = f.read()
        if p.returncode != 0 or not text:
            return [{"tool": t, "error": f"the GCS emulator run failed (exit {p.returncode})"} for t in a.gcs_tools]
        return json.loads(text)
    except subprocess.TimeoutExpired:
        return [{"tool": t, "error": "the GCS emulator run timed out"} for t in a.gcs_tools]
    finally:
        os.unlink(json_out)


# ---------------------------------------------------------------- the report

NAMES = {"orbax": "orbax-checkpoint (async)", "flax": "flax save_checkpoint (blocking)", "ckptio": "ckptio"}


def overhead(r):
    return (r["total"] - r["compute"]) / r["compute"] if r["compute"] > 0 else 0.0


def per_save(r):
    return sum(r["blocked"]) / len(r["blocked"])


def rate_text(r):
    if r.get("one_save"):
        return f"{r['state_bytes'] / r['one_save'] / 1e6:.0f} MB/s"
    return r.get("rate_text", "-")


def table(results, storage):
    orbax = next((r for r in results if r["tool"] == "orbax" and "error" not in r), None)
    lines = ["| tool | storage | blocked per save | vs orbax async | final wait | total | overhead vs compute "
             "| bytes/s (one save, end to end) | trainer CPU in compute | kept |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        name = NAMES.get(r["tool"], r["tool"])
        if "error" in r:
            lines.append(f"| {name} | {storage} | could not run here: {r['error']} | | | | | | | |")
            continue
        vs = f"{per_save(r) / per_save(orbax):.2f}x" if orbax else "-"
        cpu = f"{100 * r['compute_cpu'] / r['compute']:.0f}%" if r.get("compute_cpu") is not None else "-"
        kept = "-" if r.get("kept") is None else str(r["kept"])
        lines.append(f"| {name} | {storage} | {per_save(r) * 1e3:.0f} ms | {vs} | {r['final_wait']:.2f} s "
                     f"| {r['total']:.1f} s | {100 * overhead(r):.1f}% | {rate_text(r)} | {cpu} | {kept} |")
    return "\n".join(lines)


def targets(results):
    ok = {r["tool"]: r for r in results if "error" not in r}
    c, o = ok.get("ckptio"), ok.get("orbax")
    out = []
    if c and o:
        ratio = per_save(c) / per_save(o)
        out.append(f"- ckptio blocked per save <= 0.5x orbax async's: {ratio:.2f}x, "
                   f"{'met' if ratio <= 0.5 else 'MISSED'}")
    others = [r for t, r in ok.items() if t != "ckptio"]
    if c and others:
        worst = min(overhead(r) for r in others)
        out.append(f"- ckptio total overhead lower than every other tool's: {100 * overhead(c):.1f}% vs "
                   f"{100 * worst:.1f}% (the best other), {'met' if overhead(c) < worst else 'MISSED'}")
    return "\n".join(out) or "- not evaluated: a tool did not run"


def versions():
    from importlib import metadata

    out = []
    for dist in ("orbax-checkpoint", "flax", "jax", "tensorstore", "numpy"):
        try:
            out.append(f"{dist} {metadata.version(dist)}")
        except metadata.PackageNotFoundError:
            out.append(f"{dist} not installed")
    return ", ".join(out)


def report(a, local, gcs, seconds):
    first = next((r for r in local if "error" not in r), None)
    tensors = first["tensors"] if first else "~100"
    loadavg = " ".join(open("/proc/loadavg").read().split()[:3])
    parts = [
        "## Side by side: orbax, flax and ckptio\n",
        f"{os.cpu_count()} cpus; {versions()}; measured in {seconds:.0f} s; load average at the end {loadavg} "
        "(a machine shared with other work).\n",
        f"Local disk ({os.path.abspath(a.dir)}): a {human_size(a.state_size)} state in {tensors} tensors "
        f"(BF16, F32, F16, I32, U8), {a.saves} saves, {a.compute:g} s of compute before each, keep {a.keep}.\n",
        table(local, "local disk"),
    ]
    if gcs is not None:
        parts += [f"\nGCS emulator (gcp-storage-emulator, in memory, no shaping): a {human_size(a.gcs_state_size)} "
                  f"state, {a.gcs_saves} saves, {a.compute:g} s of compute before each, keep {a.keep}. Smaller than "
                  "the local state: the emulator is one Python process holding every object in memory on the same "
                  "cores as the trainer. orbax writes through tensorstore (TENSORSTORE_GCS_HTTP_URL) and gcsfs "
                  "(its directory operations).\n", table(gcs, "GCS emulator")]
    parts += [
        "\nTargets (local disk):\n" + targets(local),
        "\n- blocked per save: mean time the save call held the trainer. final wait: wait_until_finished at the "
        "end (inside total). overhead: (total - compute) / compute. bytes/s: state bytes / (one more save + the "
        "wait for it), outside the totals. trainer CPU in compute: the trainer thread's CPU time / its compute "
        "time (background work competing for the 2 cores shows here). kept: committed checkpoints after the "
        "last save's wait.",
        "- Every tool: its own process, one untimed warm-up save, the same time-boxed numpy compute that releases "
        "the GIL. ckptio: " + ", ".join(sorted({r.get('via', '') for r in local + (gcs or [])
                                                 if r.get('tool') == 'ckptio' and 'via' in r})) + ".",
        f"- Reproduce: `make bench` or `{' '.join(['.venv-bench/bin/python', 'bench/tools_compare.py'] + sys.argv[1:])}`.",
    ]
    return "\n".join(parts) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--state-size", type=parse_size, default=GIB)
    ap.add_argument("--saves", type=int, default=10)
    ap.add_argument("--compute", type=parse_seconds, default=2.0, help="seconds of compute before each save")
    ap.add_argument("--keep", type=int, default=3)
    ap.add_argument("--tools", default="orbax,flax,ckptio")
    ap.add_argument("--dir", default=os.path.join(ROOT, "bench", "results", "tmp"),
                    help="where the local runs write (a fresh directory under it, removed at the end)")
    ap.add_argument("--gcs-state-size", type=parse_size, default=128 * MIB)
    ap.add_argument("--gcs-saves", type=int, default=5)
    ap.add_argument("--gcs-tools", default="orbax,ckptio")
    ap.add_argument("--skip-gcs", action="store_true")
    ap.add_argument("--skip-local", action="store_true")
    ap.add_argument("--out", help="also write the report here (markdown)")
    ap.add_argument("--ckptio-python", default=os.path.join(ROOT, "build-py", "python"))
    ap.add_argument("--ckptio-bin", default=os.environ.get("CKPTIO", os.path.join(ROOT, "build", "src", "cli", "ckptio")))
    ap.add_argument("--timeout", type=float, default=0, help="seconds per tool (default: from the run's size)")
    ap.add_argument("--child", choices=sorted(TOOLS), help=argparse.SUPPRESS)
    ap.add_argument("--root", help=argparse.SUPPRESS)
    ap.add_argument("--inside-gcs", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--json-out", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    for name in ("saves", "gcs_saves", "keep"):
        if getattr(a, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(a, name)}")

    def tool_list(text, flag):
        tools = [t for t in text.split(",") if t]
        bad = [t for t in tools if t not in TOOLS]
        if bad or not tools:
            ap.error(f"{flag} takes {', '.join(TOOLS)}, got {text!r}")
        return tools

    a.tools, a.gcs_tools = tool_list(a.tools, "--tools"), tool_list(a.gcs_tools, "--gcs-tools")
    if not a.timeout:
        a.timeout = 120 + max(a.saves, a.gcs_saves) * (a.compute + 30)
    if a.child:
        return run_child(a)
    if a.inside_gcs:
        return run_gcs_inside(a)
    t0 = time.perf_counter()
    local = [] if a.skip_local else run_local(a)
    gcs = None if a.skip_gcs else run_gcs(a)
    text = report(a, local, gcs, time.perf_counter() - t0)
    print(text, end="")
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
