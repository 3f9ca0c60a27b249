#!/usr/bin/env python3
"""Side by side: what checkpointing costs a trainer with orbax, flax and ckptio.

    .venv-bench/bin/python bench/tools_compare.py [--reps 3] [--compute-kind idle|busy|idle,busy]
        [--state-size 1GiB] [--saves 5] [--compute SECONDS] [--keep 3]
        [--tools orbax,flax,ckptio] [--dir DIR] [--gcs-state-size 128MiB]
        [--gcs-saves 5] [--gcs-tools orbax,ckptio] [--skip-gcs] [--skip-local]
        [--out bench/results/tools.md]

The same state for every tool (~100 tensors of mixed dtypes laid out like
`ckptio demo`'s: BF16, F32, F16, I32, U8), put on the (CPU) device with
jax.device_put as a jax trainer holds it, saved --saves times with --compute
seconds of simulated compute before each save, keeping --keep, on the same
local disk. Each tool is used as its documentation shows:

  orbax   orbax-checkpoint's CheckpointManager with default options (async)
          but max_to_keep, `args.StandardSave(state)` (its default PyTree
          handler), wait_until_finished() only after the last save
  flax    flax.training.checkpoints.save_checkpoint(dir, state, step,
          keep=K): blocking (flax's documented default; orbax underneath)
  ckptio  ckptio.CheckpointManager(root, keep=K) from the Python module
          (build/python), every other option at its default (staging_memory
          "auto"), wait_until_finished() only after the last save

then orbax (tensorstore) and ckptio on the GCS emulator (tests/gcs/with_gcs.py
starts it; TENSORSTORE_GCS_HTTP_URL and STORAGE_EMULATOR_HOST point both at
it) with a smaller state: the emulator is one Python process holding every
object in memory on the same 2 cores.

--compute-kind says what the trainer's thread does between saves:
  idle  it waits (time.sleep), as a host does while its accelerator computes:
        a tool's background work has the host's cores to itself (default
        compute 1.5 s)
  busy  time-boxed numpy work on the trainer's thread that releases the GIL
        (as XLA's CPU compute does): a CPU-bound trainer sharing the cores
        with the tool's background work (default compute 2 s)
A comma list runs each kind; the first is the headline table.

--reps N: each repetition runs every tool once per kind, each in a fresh
process, in a rotated order (the tools interleaved, so that the machine's
load drifts hit all of them alike). The report gives min/median/max over the
repetitions of "blocked per save" and of the overhead, and the median of the
other columns, plus each run's figures and load average.

Per run: one untimed warm-up save first (thread pools, jax's first
transfer, ckptio's staging: what a trainer's first minutes hide); then the
time the save calls blocked the trainer, the final wait, total wall time,
overhead = (total - compute) / compute, the process's CPU time beyond the
trainer thread's, and bytes/s = state bytes / the time of one more save
followed at once by the wait for it (outside the totals). orbax's own
jax.monitoring events split its blocked time (waiting for the previous save,
device-to-host copy). A tool that cannot run here gets a row saying why.

Runs under .venv-bench (bench/requirements.txt; `make venv-bench`).
"""
import argparse
import json
import os
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
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
    pairs = []
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
        pairs.append((name, array))
    return nest(pairs)


def nest(pairs):
    """Nested dicts from ("a/b/c", value) pairs."""
    tree = {}
    for name, value in pairs:
        node = tree
        parts = name.split("/")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = value
    return tree


def tree_bytes(tree):
    return sum(tree_bytes(v) for v in tree.values()) if isinstance(tree, dict) else tree.nbytes


def tree_count(tree):
    return sum(tree_count(v) for v in tree.values()) if isinstance(tree, dict) else 1


class Trainer:
    """What the trainer's thread does between saves (--compute-kind).

    idle: it waits, as a host does while its accelerator computes.
    busy: time-boxed numpy ufuncs over a 4 MiB buffer on this thread; they
    release the GIL, as a jax trainer's XLA computations do, so a tool's
    Python background threads can run meanwhile, but one of the 2 cores is
    taken."""

    def __init__(self, kind):
        import numpy as np

        self.np, self.kind = np, kind
        self.scratch = np.ones(MIB, np.float32)

    def compute(self, seconds):
        """Returns (wall seconds, CPU seconds of this thread)."""
        wall0, cpu0 = time.perf_counter(), time.thread_time()
        deadline = wall0 + seconds
        if self.kind == "idle":
            while (left := deadline - time.perf_counter()) > 0:
                time.sleep(left)
        else:
            while time.perf_counter() < deadline:
                self.np.multiply(self.scratch, 1.0000001, out=self.scratch)
                self.np.add(self.scratch, 1e-7, out=self.scratch)
        return time.perf_counter() - wall0, time.thread_time() - cpu0


# ---------------------------------------------------------------- the tools


def device_state(tree):
    """The state as a jax trainer holds it: jax arrays on its device (CPU here)."""
    import jax

    state = jax.device_put(tree)
    jax.block_until_ready(state)
    return state


class OrbaxAsync:
    """As orbax's docs show it: a CheckpointManager (async by default), the
    state through args.StandardSave, wait_until_finished() at the end."""

    via = ("orbax: `ocp.CheckpointManager(root, options=ocp.CheckpointManagerOptions(max_to_keep=K))` "
           "(async by default), `save(step, args=ocp.args.StandardSave(state))`, `wait_until_finished()` "
           "after the last save")

    def __init__(self, root, keep):
        import jax
        import orbax.checkpoint as ocp

        self.ocp = ocp
        # orbax's own timings (jax.monitoring events), in seconds: those recorded on the trainer's
        # thread while a save() call ran under "save:<event>", the others (its background thread,
        # the final wait) under the bare event name.
        self.events, self.in_save = {}, False
        jax.monitoring.register_event_duration_secs_listener(self.on_event)
        self.mgr = ocp.CheckpointManager(root, options=ocp.CheckpointManagerOptions(max_to_keep=keep))

    def on_event(self, event, duration, **_):
        name = event.rsplit("/", 1)[-1]
        if self.in_save and threading.current_thread() is threading.main_thread():
            name = "save:" + name
        self.events.setdefault(name, []).append(duration)

    def save(self, step, state):
        self.in_save = True
        try:
            self.mgr.save(step, args=self.ocp.args.StandardSave(state))
        finally:
            self.in_save = False

    def wait(self):
        self.mgr.wait_until_finished()

    def steps(self):
        return len(self.mgr.all_steps())

    def delete_all(self):
        for step in self.mgr.all_steps():
            self.mgr.delete(step)

    def close(self):
        self.mgr.close()


class FlaxBlocking:
    """flax.training.checkpoints.save_checkpoint as its docs show it: blocking."""

    via = "flax: `checkpoints.save_checkpoint(dir, state, step, keep=K)` (blocking; orbax underneath)"

    def __init__(self, root, keep):
        from flax.training import checkpoints

        self.checkpoints, self.root, self.keep = checkpoints, root, keep

    def save(self, step, state):
        self.checkpoints.save_checkpoint(self.root, target=state, step=step, keep=self.keep)

    def wait(self):
        pass

    def steps(self):
        if self.root.startswith("gs://"):
            return None
        return sum(1 for d in os.listdir(self.root) if re.fullmatch(r"checkpoint_\d+", d))

    def delete_all(self):
        pass

    def close(self):
        pass


class CkptioPython:
    """ckptio's Python CheckpointManager with every option at its default
    (staging_memory "auto"): nothing the README does not tell every user."""

    via = ("ckptio: `ckptio.CheckpointManager(root, keep=K)` (every other option at its default: "
           "staging_memory \"auto\", snapshot \"copy\"), `save(step, state)`, `wait_until_finished()` "
           "after the last save")

    def __init__(self, root, keep):
        import ckptio

        self.mgr = ckptio.CheckpointManager(root, keep=keep)

    def save(self, step, state):
        self.mgr.save(step, state)

    def wait(self):
        self.mgr.wait_until_finished()

    def steps(self):
        return len(self.mgr.all_steps())

    def delete_all(self):
        for step in self.mgr.all_steps():
            self.mgr.delete(step)

    def close(self):
        self.mgr.close()


TOOLS = {"orbax": OrbaxAsync, "flax": FlaxBlocking, "ckptio": CkptioPython}


def loadavg():
    return [float(x) for x in open("/proc/loadavg").read().split()[:3]]


def run_child(a):
    """One tool, one kind of compute, in this process; prints RESULT <json>."""
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    if a.child == "ckptio":
        sys.path.insert(0, a.ckptio_python)
    load_before = loadavg()
    tree = make_state(a.state_size)
    state_bytes, tensors = tree_bytes(tree), tree_count(tree)
    state = device_state(tree)
    del tree  # a trainer holds its state once, on the device
    tool = TOOLS[a.child](a.root, a.keep)
    trainer = Trainer(a.compute_kind)
    tool.save(0, state)  # the untimed warm-up
    tool.wait()
    if hasattr(tool, "events"):
        tool.events.clear()
    blocked, computes, compute_cpu = [], 0.0, 0.0
    cpu0, usage0 = time.process_time(), resource.getrusage(resource.RUSAGE_SELF)
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
    tool_cpu = time.process_time() - cpu0 - compute_cpu
    usage = resource.getrusage(resource.RUSAGE_SELF)
    kernel_cpu, page_faults = usage.ru_stime - usage0.ru_stime, usage.ru_minflt - usage0.ru_minflt
    events = {name: list(values) for name, values in getattr(tool, "events", {}).items()}
    kept = tool.steps()
    t0 = time.perf_counter()
    tool.save(a.saves + 1, state)
    tool.wait()
    one_save = time.perf_counter() - t0
    if a.root.startswith("gs://"):
        tool.delete_all()  # the emulator holds every object in memory
    tool.close()
    result = {"tool": a.child, "kind": a.compute_kind, "via": tool.via, "state_bytes": state_bytes,
              "tensors": tensors, "saves": a.saves, "blocked": blocked, "final_wait": final_wait,
              "total": total, "compute": computes, "compute_cpu": compute_cpu, "tool_cpu": tool_cpu,
              "kernel_cpu": kernel_cpu, "page_faults": page_faults, "kept": kept,
              "one_save": one_save, "events": events, "load_before": load_before, "load_after": loadavg()}
    print("RESULT " + json.dumps(result), flush=True)


# ---------------------------------------------------------------- the runner


def last_line(text):
    lines = [line.strip() for line in (text or "").splitlines() if line.strip()]
    useful = [line for line in lines if not line.startswith(("W0", "I0", "WARNING:absl"))] or lines
    return (useful[-1] if useful else "no output")[:300]


def run_tool(a, tool, kind, root, env, state_size, saves):
    """Runs one tool in a child process; a failure becomes a row's reason."""
    cmd = [sys.executable, os.path.abspath(__file__), "--child", tool, "--root", root,
           "--compute-kind", kind, "--compute", str(a.compute[kind]), "--state-size", str(state_size),
           "--saves", str(saves), "--keep", str(a.keep), "--ckptio-python", a.ckptio_python]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=a.timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"tool": tool, "kind": kind, "error": f"did not finish within {a.timeout:.0f} s"}
    for line in p.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    why = last_line(p.stderr)
    if tool == "ckptio" and "ckptio" in why and ("ModuleNotFound" in why or "ImportError" in why):
        why += f" (the module is built by `make build` into build/python; --ckptio-python {a.ckptio_python})"
    return {"tool": tool, "kind": kind, "error": f"exit {p.returncode}: {why}"}


def run_all(a, tools, root_of, env, state_size, saves, where):
    """--reps repetitions; in each, every kind, and in each kind every tool
    once, in an order rotated by one per repetition. Returns {kind: [run]}."""
    results = {kind: [] for kind in a.kinds}
    for rep in range(a.reps):
        for kind in a.kinds:
            order = tools[rep % len(tools):] + tools[:rep % len(tools)]
            for tool in order:
                root = root_of(tool, kind, rep)
                print(f"tools_compare: {where} rep {rep + 1}/{a.reps} {kind} {tool} (load {loadavg()[0]:.2f}) ...",
                      file=sys.stderr, flush=True)
                r = run_tool(a, tool, kind, root, env, state_size, saves)
                r["rep"] = rep
                if "error" in r:
                    print(f"tools_compare: {tool}: {r['error']}", file=sys.stderr, flush=True)
                else:
                    print(f"tools_compare: {tool}: blocked {per_save(r) * 1e3:.0f} ms per save, overhead "
                          f"{100 * overhead(r):.1f}%", file=sys.stderr, flush=True)
                results[kind].append(r)
                if not root.startswith("gs://"):
                    shutil.rmtree(root, ignore_errors=True)  # 1 GiB x keep per run: do not let them pile up
    return results


def run_local(a):
    base = os.path.abspath(a.dir)
    os.makedirs(base, exist_ok=True)
    work = tempfile.mkdtemp(prefix="tools-", dir=base)
    try:
        return run_all(a, a.tools, lambda t, k, r: os.path.join(work, f"{k}-{r}-{t}"), dict(os.environ),
                       a.state_size, a.saves, "local")
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
    results = run_all(a, a.tools, lambda t, k, r: f"gs://{bucket}/tools/{k}-{r}-{t}", env, a.state_size, a.saves,
                      "GCS")
    with open(a.json_out, "w") as f:
        json.dump(results, f)


def run_gcs(a):
    """Starts the emulator around a copy of this script (tests/gcs/with_gcs.py,
    under the test venv), which runs the GCS tools."""
    test_python = os.path.join(ROOT, ".venv", "bin", "python")

    def failed(why):
        return {kind: [{"tool": t, "kind": kind, "error": why} for t in a.gcs_tools] for kind in a.kinds}

    if not os.path.exists(test_python):
        return failed(f"no {test_python} for the GCS emulator (run `make venv`)")
    fd, json_out = tempfile.mkstemp(prefix="tools-gcs-", suffix=".json")
    os.close(fd)
    cmd = [test_python, os.path.join(ROOT, "tests", "gcs", "with_gcs.py"), "--quiet", "--",
           sys.executable, os.path.abspath(__file__), "--inside-gcs", "--json-out", json_out,
           "--tools", ",".join(a.gcs_tools), "--state-size", str(a.gcs_state_size), "--saves", str(a.gcs_saves),
           "--compute-kind", ",".join(a.kinds), "--compute", ",".join(f"{k}={a.compute[k]}" for k in a.kinds),
           "--reps", str(a.reps), "--keep", str(a.keep), "--ckptio-python", a.ckptio_python,
           "--timeout", str(a.timeout)]
    try:
        runs = a.reps * len(a.kinds) * len(a.gcs_tools)
        p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=None, text=True, timeout=a.timeout * runs + 60)
        with open(json_out) as f:
            text = f.read()
        if p.returncode != 0 or not text:
            return failed(f"the GCS emulator run failed (exit {p.returncode})")
        return json.loads(text)
    except subprocess.TimeoutExpired:
        return failed("the GCS emulator run timed out")
    finally:
        os.unlink(json_out)


# ---------------------------------------------------------------- the report

NAMES = {"orbax": "orbax-checkpoint (async)", "flax": "flax save_checkpoint (blocking)", "ckptio": "ckptio"}
KIND_TITLES = {"idle": "A trainer whose host waits between saves (idle: an accelerator computes)",
               "busy": "A CPU-bound trainer (busy: numpy compute on the trainer's thread, same 2 cores)"}


def overhead(r):
    return (r["total"] - r["compute"]) / r["compute"] if r["compute"] > 0 else 0.0


def per_save(r):
    return sum(r["blocked"]) / len(r["blocked"])


def ok_runs(runs, tool):
    return [r for r in runs if r["tool"] == tool and "error" not in r]


def spread(values, fmt):
    """median (min-max) of values, each through fmt; the unit once."""
    if len(values) == 1 or min(values) == max(values):
        return fmt(values[0])
    low, mid, high = (fmt(v) for v in (min(values), statistics.median(values), max(values)))
    unit = mid.rsplit(" ", 1)[1] if " " in mid else ""
    if unit and low.endswith(" " + unit) and high.endswith(" " + unit):
        low, high = low[:-len(unit) - 1], high[:-len(unit) - 1]
    return f"{mid} ({low}-{high})"


def paired(runs, tool, other, fn):
    """fn(tool's run, other's run) for each repetition both ran in."""
    mine = {r["rep"]: r for r in ok_runs(runs, tool)}
    theirs = {r["rep"]: r for r in ok_runs(runs, other)}
    return [fn(mine[rep], theirs[rep]) for rep in sorted(mine) if rep in theirs]


def ms(x):
    return f"{x * 1e3:,.0f} ms" if x >= 0.0095 else f"{x * 1e3:.1f} ms"


def pct(x):
    return f"{100 * x:.1f}%"


def table(runs, tools, storage):
    lines = ["| tool | storage | blocked per save | vs orbax async (same rep) | overhead vs compute | final wait "
             "| total | bytes/s (one save, end to end) | tool CPU per save (kernel) | page faults per save "
             "| trainer CPU in compute | kept | runs |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for tool in tools:
        name = NAMES.get(tool, tool)
        good = ok_runs(runs, tool)
        errors = [r["error"] for r in runs if r["tool"] == tool and "error" in r]
        if not good:
            why = errors[0] if errors else "not run"
            lines.append(f"| {name} | {storage} | could not run here: {why} | | | | | | | | | | |")
            continue
        ratios = paired(runs, tool, "orbax", lambda m, o: per_save(m) / per_save(o))
        vs = "1.00x" if tool == "orbax" else spread(ratios, lambda x: f"{x:.2f}x") if ratios else "-"
        med = statistics.median
        rate = med(r["state_bytes"] / r["one_save"] for r in good) / 1e6
        tool_cpu = med(r["tool_cpu"] / r["saves"] for r in good)
        kernel_cpu = med(r["kernel_cpu"] / r["saves"] for r in good)
        faults = med(r["page_faults"] / r["saves"] for r in good)
        cpu = med(r["compute_cpu"] / r["compute"] for r in good)
        kept = "/".join(sorted({str(r["kept"]) for r in good})) if all(r["kept"] is not None for r in good) else "-"
        count = f"{len(good)}" + (f" (+{len(errors)} failed)" if errors else "")
        lines.append(f"| {name} | {storage} | {spread([per_save(r) for r in good], ms)} | {vs} "
                     f"| {spread([overhead(r) for r in good], pct)} | {med(r['final_wait'] for r in good):.2f} s "
                     f"| {med(r['total'] for r in good):.1f} s | {rate:.0f} MB/s | {tool_cpu:.2f} s ({kernel_cpu:.2f} s) "
                     f"| {faults / 1e3:,.0f}k | {100 * cpu:.0f}% | {kept} | {count} |")
    return "\n".join(lines)


def orbax_split(runs):
    """What orbax's own jax.monitoring events say its blocked time went to."""
    good = [r for r in ok_runs(runs, "orbax") if r.get("events")]
    if not good:
        return ""

    def in_save(name):
        return spread([sum(r["events"].get("save:" + name, [])) / r["saves"] for r in good], ms)

    text = (f"orbax's own timings (its jax.monitoring events during the save calls, per save): waiting for the "
            f"previous save to finish {in_save('wait_for_prev_duration_secs')} (`wait_for_prev_duration_secs`), "
            f"device-to-host copy {in_save('blocking_d2h_duration_secs')} (`blocking_d2h_duration_secs`)")
    background = [statistics.mean(r["events"]["background_duration_secs"]) for r in good
                  if r["events"].get("background_duration_secs")]
    if background:
        text += (f"; its background thread took {spread(background, lambda x: f'{x:.2f} s')} to write and "
                 "commit a save (`background_duration_secs`)")
    return text + "."


def targets(runs, tools):
    ckptio, orbax = ok_runs(runs, "ckptio"), ok_runs(runs, "orbax")
    out = []
    if ckptio and orbax:
        ratios = paired(runs, "ckptio", "orbax", lambda c, o: per_save(c) / per_save(o))
        med = statistics.median(per_save(r) for r in ckptio) / statistics.median(per_save(r) for r in orbax)
        every = sum(x <= 0.5 for x in ratios)
        out.append(f"- ckptio blocked per save <= 0.5x orbax async's: {med:.2f}x (medians; "
                   f"{min(ratios):.2f}-{max(ratios):.2f}x rep by rep), {'met' if med <= 0.5 else 'MISSED'}"
                   f" (in {every} of {len(ratios)} reps)")
    others = [t for t in tools if t != "ckptio" and ok_runs(runs, t)]
    if ckptio and others:
        mine = statistics.median(overhead(r) for r in ckptio)
        best_tool = min(others, key=lambda t: statistics.median(overhead(r) for r in ok_runs(runs, t)))
        best = statistics.median(overhead(r) for r in ok_runs(runs, best_tool))
        reps = sorted({r["rep"] for r in ckptio})
        every = sum(all(overhead(c) < overhead(o) for t in others for o in ok_runs(runs, t) if o["rep"] == c["rep"])
                    for c in ckptio)
        out.append(f"- ckptio overhead lower than every other tool's: {pct(mine)} vs {pct(best)} "
                   f"({NAMES[best_tool]}, the best other; medians), {'met' if mine < best else 'MISSED'} "
                   f"(in {every} of {len(reps)} reps)")
    return "\n".join(out) or "- not evaluated: a tool did not run"


def every_run(local, gcs, kinds):
    lines = ["| kind | storage | rep | tool | blocked per save (each save, ms) | overhead | final wait "
             "| page faults per save | load average before -> after |", "|---|---|---:|---|---|---:|---:|---:|---|"]
    for kind in kinds:
        for storage, results in (("local disk", local), ("GCS emulator", gcs)):
            for r in sorted((results or {}).get(kind, []), key=lambda r: (r["rep"], r["tool"])):
                if "error" in r:
                    lines.append(f"| {kind} | {storage} | {r['rep'] + 1} | {r['tool']} | {r['error']} | | | | |")
                    continue
                each = " ".join(f"{b * 1e3:.0f}" for b in r["blocked"])
                load = f"{r['load_before'][0]:.2f} -> {r['load_after'][0]:.2f}"
                lines.append(f"| {kind} | {storage} | {r['rep'] + 1} | {r['tool']} | {ms(per_save(r))} ({each}) "
                             f"| {pct(overhead(r))} | {r['final_wait']:.2f} s | {r['page_faults'] / r['saves'] / 1e3:,.0f}k "
                             f"| {load} |")
    return "\n".join(lines)


def versions():
    from importlib import metadata

    out = []
    for dist in ("orbax-checkpoint", "flax", "jax", "tensorstore", "numpy"):
        try:
            out.append(f"{dist} {metadata.version(dist)}")
        except metadata.PackageNotFoundError:
            out.append(f"{dist} not installed")
    return ", ".join(out)


def report(a, local, gcs, seconds, command):
    every = [r for results in (local or {}, gcs or {}) for runs in results.values() for r in runs if "error" not in r]
    loads = [r["load_before"][0] for r in every] + [r["load_after"][0] for r in every]
    load_text = f"{min(loads):.2f}-{max(loads):.2f}" if loads else "-"
    tensors = every[0]["tensors"] if every else "~100"
    vias = []
    for tool in TOOLS:
        via = next((r["via"] for r in every if r["tool"] == tool), None)
        if via:
            vias.append(f"- {via}.")
    parts = [
        "## Side by side: orbax, flax and ckptio\n",
        f"{os.cpu_count()} cpus; {versions()}; {a.reps} repetition(s), each running every tool once per kind of "
        f"compute in a fresh process, the tools interleaved (order rotated each repetition); measured in "
        f"{seconds / 60:.0f} min; 1-minute load average {load_text} over the runs (a machine shared with other "
        "work: the last table gives each run's).\n",
        "What each tool was given (each as its documentation shows; the same jax arrays, from `jax.device_put`, "
        "for all; one untimed warm-up save first):\n",
        "\n".join(vias) + "\n",
    ]
    for kind in a.kinds:
        headline = " (the headline)" if kind == a.kinds[0] and len(a.kinds) > 1 else ""
        parts += [f"### {KIND_TITLES[kind]}{headline}\n"]
        if local is not None:
            runs = local.get(kind, [])
            parts += [f"Local disk: a {human_size(a.state_size)} state in {tensors} tensors (BF16, F32, F16, I32, U8), "
                      f"{a.saves} saves, {a.compute[kind]:g} s of {kind} compute before each, keep {a.keep}.\n",
                      table(runs, a.tools, "local disk"), ""]
            split = orbax_split(runs)
            if split:
                parts += [split, ""]
            parts += ["Targets (local disk):\n" + targets(runs, a.tools), ""]
        if gcs is not None:
            runs = gcs.get(kind, [])
            parts += [f"GCS emulator (gcp-storage-emulator, in memory, no shaping): a {human_size(a.gcs_state_size)} "
                      f"state, {a.gcs_saves} saves, {a.compute[kind]:g} s of {kind} compute before each, keep "
                      f"{a.keep}. Smaller than the local state: the emulator is one Python process holding every "
                      "object in memory on the same cores as the trainer. orbax writes through tensorstore "
                      "(TENSORSTORE_GCS_HTTP_URL) and gcsfs (its directory operations); ckptio with its defaults "
                      "(256 MiB shards, 16 MiB upload chunks).\n",
                      table(runs, a.gcs_tools, "GCS emulator"), ""]
            split = orbax_split(runs)
            if split:
                parts += [split, ""]
            parts += ["Targets (GCS emulator):\n" + targets(runs, a.gcs_tools), ""]
    parts += [
        "Columns: blocked per save: the mean time a save call held the trainer in a run; median (min-max) over the "
        "repetitions. vs orbax async: that, over orbax's in the same repetition. overhead: (total - compute) / "
        "compute, median (min-max). final wait: wait_until_finished after the last save (inside total). "
        "bytes/s: state bytes / (one more save + the wait for it), outside the totals. tool CPU per save: the "
        "process's CPU time during the saves and the final wait beyond the trainer thread's, per save (what the "
        "tool takes from the host's cores), in parentheses the kernel's share (system time: page faults, I/O). page "
        "faults per save: the process's minor faults during the saves, per save (4 KiB pages first touched: 262k "
        "for 1 GiB of fresh memory). trainer CPU in compute: the trainer thread's CPU time / its compute "
        "time (busy: background work competing for the 2 cores shows here; idle: ~0%). kept: committed "
        "checkpoints after the last save's wait. Columns without a range are medians.\n",
        "Every run (blocked per save: the mean, then each save's):\n",
        every_run(local, gcs, a.kinds),
        f"\nReproduce: `{command}`.",
    ]
    return "\n".join(parts) + "\n"


DEFAULT_COMPUTE = {"idle": 1.5, "busy": 2.0}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=3, help="repetitions: every tool once per kind in each")
    ap.add_argument("--compute-kind", default="idle",
                    help="idle, busy, or a comma list (the first is the headline table)")
    ap.add_argument("--compute", help="seconds of compute before each save: one value for every kind, or "
                    "kind=seconds,... (default idle=1.5,busy=2)")
    ap.add_argument("--state-size", type=parse_size, default=GIB)
    ap.add_argument("--saves", type=int, default=5)
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
    ap.add_argument("--ckptio-python", default=os.path.join(ROOT, "build", "python"),
                    help="where the ckptio module was built (default build/python)")
    ap.add_argument("--timeout", type=float, default=0, help="seconds per run (default: from the run's size)")
    ap.add_argument("--child", choices=sorted(TOOLS), help=argparse.SUPPRESS)
    ap.add_argument("--root", help=argparse.SUPPRESS)
    ap.add_argument("--inside-gcs", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--json-out", help=argparse.SUPPRESS)
    command = " ".join([".venv-bench/bin/python", os.path.relpath(os.path.abspath(__file__), ROOT)]
                       + (sys.argv[1:] if argv is None else argv))
    a = ap.parse_args(argv)
    for name in ("reps", "saves", "gcs_saves", "keep"):
        if getattr(a, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(a, name)}")

    def tool_list(text, flag):
        tools = [t for t in text.split(",") if t]
        bad = [t for t in tools if t not in TOOLS]
        if bad or not tools:
            ap.error(f"{flag} takes {', '.join(TOOLS)}, got {text!r}")
        return tools

    a.tools, a.gcs_tools = tool_list(a.tools, "--tools"), tool_list(a.gcs_tools, "--gcs-tools")
    a.kinds = [k for k in a.compute_kind.split(",") if k]
    if not a.kinds or any(k not in DEFAULT_COMPUTE for k in a.kinds) or len(set(a.kinds)) != len(a.kinds):
        ap.error(f"--compute-kind takes idle, busy or idle,busy, got {a.compute_kind!r}")
    a.compute = parse_compute(ap, a.compute)
    if not a.timeout:
        a.timeout = 180 + max(a.saves, a.gcs_saves) * (max(a.compute.values()) + 30)
    if a.child:
        a.compute_kind, a.compute = a.kinds[0], a.compute[a.kinds[0]]
        return run_child(a)
    if a.inside_gcs:
        return run_gcs_inside(a)
    t0 = time.perf_counter()
    local = None if a.skip_local else run_local(a)
    gcs = None if a.skip_gcs else run_gcs(a)
    text = report(a, local, gcs, time.perf_counter() - t0, command)
    print(text, end="")
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)
    return 0


def parse_compute(ap, text):
    compute = dict(DEFAULT_COMPUTE)
    if text is None:
        return compute
    try:
        if "=" not in text:
            value = parse_seconds(text)
            return {k: value for k in compute}
        for item in text.split(","):
            kind, _, value = item.partition("=")
            if kind not in compute:
                raise argparse.ArgumentTypeError(f"unknown kind {kind!r}")
            compute[kind] = parse_seconds(value)
        return compute
    except (ValueError, argparse.ArgumentTypeError) as e:
        ap.error(f"--compute takes seconds or kind=seconds,... (idle=1.5,busy=2), got {text!r}: {e}")


if __name__ == "__main__":
    sys.exit(main())
