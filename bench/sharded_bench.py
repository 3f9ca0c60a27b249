#!/usr/bin/env python3
"""Sharded jax.Arrays: ckptio against orbax-checkpoint on one process with 8
CPU devices, and both against the disk (fio, in the same run).

    .venv-bench/bin/python bench/sharded_bench.py [--size-gib 1] [--saves 3]
        [--loop-saves 10] [--compute-s 2.0] [--tools ckptio,orbax] [--keep 3]
        [--dir DIR] [--processes 1] [--loop-saves-2p 5] [--out bench/results/sharded.md]

The state: float32 arrays of --size-gib in all, on a (4, 2) mesh ('a', 'b')
of the 8 CPU devices XLA_FLAGS=--xla_force_host_platform_device_count=8 makes:
8 arrays P('a', 'b'), 4 arrays P('a') (each held twice, along 'b') and one
small array fully replicated (held 8 times). Each tool runs in a fresh process
(its peak RSS its own), as tools_compare.py uses it: ckptio's
CheckpointManager(root, keep=K) with every other option at its default, and
orbax's async CheckpointManager with args.StandardSave.

Per tool, after one untimed warm-up save:
  blocked   --saves saves, each waited for before the next: the time the save
            call held the caller (median)
  idle loop the same saves with the host sleeping --compute-s before each
            (a host waiting while its accelerator computes)
  seed loop --loop-saves saves with a fixed amount of jitted jax compute
            (batched matmuls on the 8 devices, calibrated to --compute-s on
            its own) before each; overhead = (loop wall, final wait included
            - the same compute's wall without saves, the mean of a run
            before the loop and one after it) / the latter. The
            compute takes both cores: a CPU-bound trainer that the tool's
            background work competes with.
  restore   the last step, with the checkpoint's pages evicted from the page
            cache first (fsync + POSIX_FADV_DONTNEED on its files: a cold
            read, as after a restart), onto: the same mesh (abstract targets,
            ShapeDtypeStruct with a sharding), twice: the first restore of
            the process (one-time set-up included), then again; another mesh,
            (8,) with every 2-D array cut into column strips P(None, 'x')
            (each device reads across every saved chunk); and the live arrays
            as target. Then, in a new process started after the saving one
            ended (as after a restart: the restored arrays' memory is all
            fresh), the same mesh once more.
  memory    peak RSS over the RSS before each phase (VmHWM, reset through
            /proc/self/clear_refs): what the tool adds on top of the state;
            for restores, beyond the host memory the restored arrays hold
            (a buffer shared by replicas counted once).

--processes 2 then runs each tool again in 2 processes of 4 CPU devices each
(jax.distributed on 127.0.0.1, gloo collectives), on the (4, 2) mesh over the
8 global devices: the same layout built with jax.make_array_from_callback (each
process computes only its own shards), both processes writing to one root.
ckptio gets CheckpointManager(root, keep=K) alone (its process index, count and
barrier come from jax.distributed), orbax the same manager as above. The same
phases, with --loop-saves-2p saves in the loops, each phase started with both
processes at a barrier; the restores are checked bit-exact on arrays gathered
whole (process_allgather). The report's second table gives the slower
process's times and the larger process's memory, and each process's below it.

fio reads and writes a file of the state's size (at least 1 GiB) O_DIRECT on
the same disk in the same run; restore throughput (state bytes / restore time)
is given as a ratio to fio's read rate.
"""
import argparse
import ctypes
import gc
import json
import os
import resource
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import export_bench  # fio_write: the disk's write limit, as export_bench measures it
import tools_compare as tc  # the tools as tools_compare uses them, and its helpers

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
DEVICES = 8
COLS = 1024


# ---------------------------------------------------------------- the state


def layout(nbytes):
    """[(name, (rows, COLS), kind)]: kind "ab" is P('a', 'b'), "a" is P('a'),
    "rep" fully replicated. Rows are multiples of 8 (every mesh here divides
    them)."""

    def rows(fraction):
        return max(8, int(nbytes * fraction) // (4 * COLS) // 8 * 8)

    arrays = [("embed/positions", (rows(1 / 64), COLS), "rep")]
    for layer in range(4):
        p = f"layers/{layer}/"
        arrays += [(p + "w_in", (rows(0.075), COLS), "ab"), (p + "w_out", (rows(0.075), COLS), "ab"),
                   (p + "adam_mu", (rows(0.094), COLS), "a")]
    return arrays


def mesh_of(shape, names):
    import jax
    import numpy as np

    return jax.sharding.Mesh(np.array(jax.devices()[:DEVICES]).reshape(shape), names)


def specs(where):
    """The sharding of each kind of array on `where`: "saved" (the (4, 2)
    mesh) or "other" (the (8,) mesh, column strips)."""
    from jax.sharding import NamedSharding, PartitionSpec as P

    if where == "saved":
        mesh = mesh_of((4, 2), ("a", "b"))
        return {"ab": NamedSharding(mesh, P("a", "b")), "a": NamedSharding(mesh, P("a")),
                "rep": NamedSharding(mesh, P())}
    mesh = mesh_of((DEVICES,), ("x",))
    return {"ab": NamedSharding(mesh, P(None, "x")), "a": NamedSharding(mesh, P(None, "x")),
            "rep": NamedSharding(mesh, P())}


def make_state(nbytes):
    """The state on the (4, 2) mesh, one array at a time (the host copy of
    each dropped once it is on the devices)."""
    import jax
    import numpy as np

    rng = np.random.default_rng(7)
    sharding = specs("saved")
    pairs = []
    for name, shape, kind in layout(nbytes):
        host = rng.random(shape, dtype=np.float32)
        pairs.append((name, jax.device_put(host, sharding[kind])))
        del host
    state = tc.nest(pairs)
    jax.block_until_ready(state)
    return state


def hashed(seed, index, shape):
    """The values of array number `seed` of global `shape` at `index` (a
    tuple of slices): a hash of each element's position, in [0, 1), so that
    a process computes the blocks it holds and no others."""
    import numpy as np

    rows = np.arange(*index[0].indices(shape[0]), dtype=np.uint32)
    cols = np.arange(*index[1].indices(shape[1]), dtype=np.uint32)
    h = rows[:, None] * np.uint32(shape[1]) + cols[None, :] + np.uint32(seed * 0x9E3779B9 & 0xFFFFFFFF)
    h *= np.uint32(0x85EBCA6B)
    h ^= h >> np.uint32(13)
    h *= np.uint32(0xC2B2AE35)
    h ^= h >> np.uint32(16)
    return (h >> np.uint32(8)).astype(np.float32) * np.float32(2.0 ** -24)


def make_global_state(nbytes):
    """The state on the (4, 2) mesh over the 8 devices of both processes,
    each process computing only the shards its own devices hold."""
    import jax

    sharding = specs("saved")
    pairs = [(name, jax.make_array_from_callback(shape, sharding[kind],
                                                 lambda index, seed=seed, shape=shape: hashed(seed, index, shape)))
             for seed, (name, shape, kind) in enumerate(layout(nbytes))]
    state = tc.nest(pairs)
    jax.block_until_ready(state)
    return state


def abstract(where, nbytes):
    import jax
    import numpy as np

    sharding = specs(where)
    return tc.nest((name, jax.ShapeDtypeStruct(shape, np.float32, sharding=sharding[kind]))
                for name, shape, kind in layout(nbytes))


def leaves(tree):
    import jax

    return jax.tree_util.tree_leaves(tree)


def device_bytes(tree):
    """Bytes the tree's arrays take on the devices, replicas included."""
    return sum(s.data.nbytes for x in leaves(tree) for s in x.addressable_shards)


def held_bytes(tree):
    """Bytes of host memory the tree's arrays hold on CPU devices: replicas
    that share one buffer (jax aliases a host buffer put on several CPU
    devices) counted once, so that a peak over them is not read low."""
    seen = {}
    for x in leaves(tree):
        for s in x.addressable_shards:
            try:
                key = s.data.unsafe_buffer_pointer()
            except Exception:  # not a single buffer: counted whole
                key = id(s)
            seen[key] = max(seen.get(key, 0), s.data.nbytes)
    return sum(seen.values())


# ---------------------------------------------------------------- measuring


def status(field):
    """A /proc/self/status size (VmRSS, VmHWM) in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def reset_peak():
    """Resets VmHWM to the current RSS (Linux >= 4.0), after handing the
    memory freed so far back to the kernel (else a phase that reuses it would
    seem to need none). Returns the RSS."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass  # not glibc: the peaks may read low
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return status("VmRSS")


def evict(root):
    """Drops root's files from the page cache (after fsync: dirty pages stay
    cached), so that the next read comes from the disk. A file that vanishes
    under the walk is skipped: a step that ckptio's retention is still
    deleting (*.tmp-del-*) after the last save's wait."""
    for d, _, files in os.walk(root):
        for name in files:
            try:
                fd = os.open(os.path.join(d, name), os.O_RDONLY)
            except FileNotFoundError:
                continue
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


class Compute:
    """A fixed amount of jitted jax work: batched 512x512 matmuls, one per
    device, repeated `calls` times (calibrated to take the seconds asked for
    on their own)."""

    def __init__(self, seconds):
        import jax
        import jax.numpy as jnp
        import numpy as np
        from jax.sharding import NamedSharding, PartitionSpec as P

        sharding = NamedSharding(mesh_of((4, 2), ("a", "b")), P(("a", "b")))
        host = np.random.default_rng(1).random((DEVICES, 512, 512), dtype=np.float32) / 512
        # From a callback, not device_put: with 2 processes each puts only its own devices' blocks.
        self.x = jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])
        self.f = jax.jit(lambda x: jnp.tanh(x @ x + 0.5))
        self.calls = 1
        self.step()  # compiles
        # Calibrated over about a second (not a few calls): on a loaded machine a short sample was off by 1.6x.
        self.calls, took = 4, 0.0
        while took < min(1.0, seconds):
            self.calls *= 2
            t0 = time.perf_counter()
            self.step()
            took = time.perf_counter() - t0
        self.calls = max(1, round(seconds * self.calls / took))

    def step(self):
        x = self.x
        for _ in range(self.calls):
            x = self.f(x)
        x.block_until_ready()


class Orbax(tc.OrbaxAsync):
    def restore(self, step, target):
        return self.mgr.restore(step, args=self.ocp.args.StandardRestore(target))


class Ckptio(tc.CkptioPython):
    via = tc.CkptioPython.via + " (a state of jax.Arrays is borrowed, not copied: jax never writes a buffer in " \
        "place while ckptio holds a view of it)"

    def restore(self, step, target):
        return self.mgr.restore(step, target=target)


TOOLS = {"ckptio": Ckptio, "orbax": Orbax}
RESTORES = {"first": "first restore, same mesh (one-time set-up included)",
            "same": "same (4, 2) mesh, abstract target", "other": "(8,) mesh, P(None, 'x'), abstract target",
            "arrays": "the live arrays as target"}
# Run by run_tool in a process of its own after the others (--restart).
RESTART = ("restart", "in a new process, as after a restart: same mesh, into fresh memory")


class OneProcess:
    """The 1-process run: 8 local devices, nothing to wait for."""

    index, count = 0, 1

    def __init__(self, a):
        pass

    def sync(self, name):
        pass

    def make_state(self, nbytes):
        return make_state(nbytes)

    def gather(self, x):
        import numpy as np

        return np.asarray(x)

    def agree(self, n):
        return n

    def close(self):
        pass


class TwoProcesses:
    """This process as one of the 2 of a jax.distributed job on 127.0.0.1,
    4 CPU devices each (gloo for the collectives that sync and gather use)."""

    count = 2

    def __init__(self, a):
        import jax
        from jax.experimental import multihost_utils

        self.jax, self.mh, self.index = jax, multihost_utils, a.process_id
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(coordinator_address=f"127.0.0.1:{a.port}", num_processes=2,
                                   process_id=a.process_id)

    def sync(self, name):
        """Returns once both processes have called it: each phase starts together."""
        self.mh.sync_global_devices(name)

    def make_state(self, nbytes):
        return make_global_state(nbytes)

    def gather(self, x):
        """The whole of global array x, on every process."""
        return self.mh.process_allgather(x, tiled=True)

    def agree(self, n):
        """The larger of the processes' n (their compute calibrated apart)."""
        import numpy as np

        return int(np.max(self.mh.process_allgather(np.array([n], dtype=np.int64))))

    def close(self):
        self.sync("done")  # neither process leaves while the other still talks to the coordinator
        self.jax.distributed.shutdown()


def check(job, restored, state, names):
    """The restored arrays hold the state's values, bit for bit (two arrays
    checked: the replicated one and a P('a', 'b') one), gathered whole."""
    import numpy as np

    for name in names:
        x, y = restored, state
        for part in name.split("/"):
            x, y = x[part], y[part]
        if not np.array_equal(job.gather(x), job.gather(y)):
            raise AssertionError(f"restored {name} differs from the saved array")


def run_child(a):
    """One tool in this process (or in this and a twin, --process-id);
    prints RESULT <json>."""
    if a.child == "ckptio":
        sys.path.insert(0, a.ckptio_python)
    job = (OneProcess if a.process_id is None else TwoProcesses)(a)
    import jax

    if len(jax.devices()) < DEVICES:
        raise SystemExit(f"{len(jax.devices())} jax devices, not {DEVICES}: XLA_FLAGS={os.environ.get('XLA_FLAGS')}")
    load_before = tc.loadavg()
    state = job.make_state(a.size)
    state_bytes = sum(x.nbytes for x in leaves(state))
    state_device_bytes = device_bytes(state)
    compute = Compute(a.compute_s)
    compute.calls = job.agree(compute.calls)
    rss_state = status("VmRSS")
    tool = TOOLS[a.child](a.root, a.keep)
    step = 1
    job.sync("warm-up")
    t0 = time.perf_counter()
    tool.save(step, state)  # the untimed warm-up
    tool.wait()
    first_save = time.perf_counter() - t0
    held = status("VmRSS") - rss_state
    if hasattr(tool, "events"):
        tool.events.clear()

    job.sync("blocked")
    rss0 = reset_peak()
    blocked = []
    for _ in range(a.saves):
        step += 1
        t0 = time.perf_counter()
        tool.save(step, state)
        blocked.append(time.perf_counter() - t0)
        tool.wait()
    save_extra = status("VmHWM") - rss0

    def pure_compute():
        job.sync("pure")
        t0 = time.perf_counter()
        for _ in range(a.loop_saves):
            compute.step()
        return time.perf_counter() - t0

    # The compute alone, before the loop and after it: the machine's speed
    # drifts by several % over minutes here, as much as the overhead measured;
    # the loop is set against the mean of the two, and the report gives both.
    pure_before = pure_compute()
    job.sync("loop")
    rss0 = reset_peak()
    loop_blocked = []
    start = time.perf_counter()
    for _ in range(a.loop_saves):
        compute.step()
        step += 1
        t0 = time.perf_counter()
        tool.save(step, state)
        loop_blocked.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    tool.wait()
    final_wait = time.perf_counter() - t0
    loop = time.perf_counter() - start
    loop_extra = status("VmHWM") - rss0
    pure_after = pure_compute()
    pure = (pure_before + pure_after) / 2
    # The same loop with the host idle between saves (time.sleep), as a host
    # waits while its accelerator computes: the tool's background work has
    # the cores to itself.
    job.sync("idle")
    idle_start, idle_cpu0 = time.perf_counter(), time.process_time()
    for _ in range(a.loop_saves):
        time.sleep(a.compute_s)
        step += 1
        tool.save(step, state)
    tool.wait()
    idle_loop = time.perf_counter() - idle_start
    # The process's CPU (every thread) in the idle loop: the tool's alone, as
    # nothing else runs; what its saves take from a trainer whose compute
    # keeps every core busy.
    save_cpu = (time.process_time() - idle_cpu0) / a.loop_saves
    events = {name: list(values) for name, values in getattr(tool, "events", {}).items()}

    restores = {}
    for kind in RESTORES:
        target = state if kind == "arrays" else abstract("other" if kind == "other" else "saved", a.size)
        job.sync(f"evict {kind}")  # every process has finished step `step` (and process 0 committed it)
        if job.index == 0:
            evict(a.root)  # the page cache is the machine's: once is enough
        job.sync(f"restore {kind}")
        rss0 = reset_peak()
        t0 = time.perf_counter()
        restored = tool.restore(step, target)
        jax.block_until_ready(restored)
        took = time.perf_counter() - t0
        peak = status("VmHWM") - rss0
        restored_bytes = held_bytes(restored)
        check(job, restored, state, ["embed/positions", "layers/0/w_in"])
        restores[kind] = {"seconds": took, "extra": peak - restored_bytes, "held_bytes": restored_bytes}
        del restored
    tool.close()
    result = {"tool": a.child, "via": tool.via, "state_bytes": state_bytes, "device_bytes": state_device_bytes,
              "arrays": len(leaves(state)), "first_save": first_save, "held": held, "blocked": blocked,
              "save_extra": save_extra,
              "compute_calls": compute.calls, "pure": pure, "pure_runs": [pure_before, pure_after], "loop": loop, "loop_blocked": loop_blocked,
              "final_wait": final_wait, "loop_extra": loop_extra, "idle_loop": idle_loop, "save_cpu": save_cpu,
              "idle_pure": a.loop_saves * a.compute_s, "restores": restores, "events": events,
              "max_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
              "load_before": load_before, "load_after": tc.loadavg(), "last_step": step}
    job.close()
    print("RESULT " + json.dumps(result), flush=True)


# The kernel hands free memory back to the hypervisor in batches, starting 2 s
# after it is freed (free page reporting, on this VM for blocks of 8 MiB and
# up): 1 GiB freed took 3.5 GB/s to populate again 3 s later, 1.2 GB/s after
# 6 s, 0.54 GB/s after 12 s (one thread). A trainer restarting takes longer.
PAGE_REPORTING_S = 15.0


def run_restart(a):
    """The restore of step --restart in a new process, as after a restart:
    nothing of the saving process's memory is left to reuse. Prints RESULT
    <json>: its time, its peak RSS beyond the restored arrays."""
    if a.child == "ckptio":
        sys.path.insert(0, a.ckptio_python)
    job = (OneProcess if a.process_id is None else TwoProcesses)(a)
    import jax

    target = abstract("saved", a.size)
    tool = TOOLS[a.child](a.root, a.keep)
    time.sleep(PAGE_REPORTING_S)  # the memory the saving process freed goes back to the hypervisor
    job.sync("evict")
    if job.index == 0:
        evict(a.root)
    job.sync("restore")
    rss0 = reset_peak()
    t0 = time.perf_counter()
    restored = tool.restore(a.restart, target)
    jax.block_until_ready(restored)
    took = time.perf_counter() - t0
    extra = status("VmHWM") - rss0 - held_bytes(restored)
    check(job, restored, job.make_state(a.size), ["embed/positions", "layers/0/w_in"])
    tool.close()
    job.close()
    print("RESULT " + json.dumps({"tool": a.child, "seconds": took, "extra": extra}), flush=True)


# ---------------------------------------------------------------- the runner


def child_env(devices=DEVICES):
    """The environment of a child with `devices` CPU devices (any count in
    XLA_FLAGS replaced)."""
    env = dict(os.environ)
    flags = [f for f in env.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f]
    env["XLA_FLAGS"] = " ".join(flags + [f"--xla_force_host_platform_device_count={devices}"])
    env["JAX_PLATFORMS"] = "cpu"
    return env


def child_cmd(a, tool, root, loop_saves):
    return [sys.executable, os.path.abspath(__file__), "--child", tool, "--root", root,
            "--size-gib", str(a.size_gib), "--saves", str(a.saves), "--loop-saves", str(loop_saves),
            "--compute-s", str(a.compute_s), "--keep", str(a.keep), "--ckptio-python", a.ckptio_python]


def run_tool(a, tool, root):
    r = run_one(a, tool, child_cmd(a, tool, root, a.loop_saves))
    if "error" not in r:
        restart = run_one(a, tool, child_cmd(a, tool, root, a.loop_saves) + ["--restart", str(r["last_step"])])
        if "error" in restart:
            r["restart_error"] = restart["error"]
        else:
            r["restores"]["restart"] = restart
    return r


def run_one(a, tool, cmd):
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=a.timeout, env=child_env())
    except subprocess.TimeoutExpired:
        return {"tool": tool, "error": f"did not finish within {a.timeout:.0f} s"}
    for line in p.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    return {"tool": tool, "error": f"exit {p.returncode}: {tc.last_line(p.stderr)}"}


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_tool_2p(a, tool, root):
    """One tool in 2 processes of 4 devices each (jax.distributed, process 0
    the coordinator), both writing to root; their results merged."""
    r = run_two(a, tool, child_cmd(a, tool, root, a.loop_saves_2p))
    if "error" not in r:
        restart = run_two(a, tool, child_cmd(a, tool, root, a.loop_saves_2p)
                          + ["--restart", str(r["last_step"])], merge_restart)
        if "error" in restart:
            r["restart_error"] = restart["error"]
        else:
            r["restores"]["restart"] = restart
            for p, q in zip(r["per_process"], restart["per_process"]):
                p["restores"]["restart"] = q
    return r


def merge_restart(procs):
    return {"seconds": max(p["seconds"] for p in procs), "extra": max(p["extra"] for p in procs),
            "per_process": procs}


def run_two(a, tool, cmd, merge_results=None):
    """cmd in 2 processes; their RESULTs merged (merge by default)."""
    merge_results = merge_results or merge
    cmd = cmd + ["--port", str(free_port())]
    env = child_env(DEVICES // 2)
    with tempfile.TemporaryFile("w+") as out0, tempfile.TemporaryFile("w+") as out1, \
            tempfile.TemporaryFile("w+") as err0, tempfile.TemporaryFile("w+") as err1:
        outs, errs = (out0, out1), (err0, err1)
        procs = [subprocess.Popen(cmd + ["--process-id", str(i)], stdout=outs[i], stderr=errs[i], text=True, env=env)
                 for i in range(2)]
        timed_out = wait_both(procs, a.timeout)
        results, failures = [], []
        for i, p in enumerate(procs):
            outs[i].seek(0)
            errs[i].seek(0)
            found = [json.loads(line[len("RESULT "):]) for line in outs[i] if line.startswith("RESULT ")]
            if found:
                results.append(found[0])
            else:
                failures.append((i, p.returncode, tc.last_line(errs[i].read())))
    if timed_out and len(results) < 2:
        return {"tool": tool, "error": f"did not finish within {a.timeout:.0f} s"}
    if failures:
        # The first process to fail says why; its twin then only sees the coordinator go away.
        i, code, why = failures[0]
        return {"tool": tool, "error": f"process {i} exit {code}: {why}"}
    return merge_results(results)


def wait_both(procs, timeout):
    """Waits for both processes; once one has failed, gives the other 30 s
    (it may be stuck at a barrier) and then kills it. True if the time ran out."""
    deadline = time.monotonic() + timeout
    while any(p.poll() is None for p in procs):
        if any(p.returncode not in (None, 0) for p in procs):
            deadline = min(deadline, time.monotonic() + 30)
        if time.monotonic() > deadline:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
            return True
        time.sleep(0.2)
    return False


def merge(procs):
    """One result of the 2 processes': every time the slower process's (per
    save for the per-save lists), every memory figure the larger process's,
    the device bytes both processes'; the processes' own under per_process."""
    r = dict(procs[0])
    for key in ("blocked", "loop_blocked", "pure_runs"):
        r[key] = [max(xs) for xs in zip(*(p[key] for p in procs))]
    for key in ("first_save", "pure", "loop", "final_wait", "idle_loop", "held", "save_extra", "loop_extra",
                "max_rss"):
        r[key] = max(p[key] for p in procs)
    r["restores"] = {kind: {"seconds": max(p["restores"][kind]["seconds"] for p in procs),
                            "extra": max(p["restores"][kind]["extra"] for p in procs)} for kind in RESTORES}
    r["device_bytes"] = sum(p["device_bytes"] for p in procs)
    r["save_cpu"] = sum(p["save_cpu"] for p in procs)  # the machine's CPU, both processes
    r["load_before"] = [max(p["load_before"][0] for p in procs)]
    r["load_after"] = [max(p["load_after"][0] for p in procs)]
    r["per_process"] = procs
    return r


def fio_read(path, gib):
    """fio's O_DIRECT sequential read rate (bytes/s) of a gib-GiB file, laid
    out by fio first (untimed)."""
    common = ["fio", "--name=r", f"--filename={path}", "--bs=8M", f"--size={gib}G", "--ioengine=psync",
              "--direct=1"]
    subprocess.run(common + ["--rw=write", "--end_fsync=1"], check=True, capture_output=True)
    p = subprocess.run(common + ["--rw=read", "--output-format=json"], check=True, capture_output=True, text=True)
    os.unlink(path)
    return json.loads(p.stdout[p.stdout.index("{"):])["jobs"][0]["read"]["bw_bytes"]


def measure_fio(work, nbytes):
    gib = max(1, round(nbytes / tc.GIB))
    path = os.path.join(work, "fio.tmp")
    try:
        read = fio_read(path, gib)
        write = gib * tc.GIB / export_bench.fio_write(path, gib)
        return {"gib": gib, "read": read, "write": write}
    except (OSError, subprocess.CalledProcessError) as e:
        return {"gib": gib, "error": str(e)[:200]}


# ---------------------------------------------------------------- the report


def mb_s(x):
    return f"{x / 1e6:,.0f} MB/s"


def mib(x):
    return f"{x / tc.MIB:,.0f} MiB"


def rows(results, fio):
    """(metric, {tool: cell}, ratio of ckptio over orbax or "")."""
    ok = {r["tool"]: r for r in results if "error" not in r}
    med = statistics.median
    read = fio.get("read")

    def overhead(r):
        return (r["loop"] - r["pure"]) / r["pure"]

    def idle_overhead(r):
        return (r["idle_loop"] - r["idle_pure"]) / r["idle_pure"]

    def restore(kind):
        def cell(r):
            s = r["restores"][kind]["seconds"]
            rate = r["state_bytes"] / s
            return f"{s:.2f} s ({mb_s(rate)}" + (f", {rate / read:.2f}x fio read)" if read else ")")
        return cell, lambda r: r["restores"][kind]["seconds"]

    metrics = [
        ("first save, end to end (untimed warm-up; set-up included)", lambda r: f"{r['first_save']:.2f} s",
         lambda r: r["first_save"]),
        ("blocked per save (median, each save waited for)", lambda r: tc.ms(med(r["blocked"])),
         lambda r: med(r["blocked"])),
        ("seed loop overhead (final wait included)", lambda r: tc.pct(overhead(r)), overhead),
        ("seed loop: blocked per save (median)", lambda r: tc.ms(med(r["loop_blocked"])),
         lambda r: med(r["loop_blocked"])),
        ("seed loop: final wait", lambda r: f"{r['final_wait']:.2f} s", lambda r: r["final_wait"]),
        ("seed loop overhead, host idle between saves (an accelerator computes)",
         lambda r: tc.pct(idle_overhead(r)), idle_overhead),
        ("CPU per save (every thread of the process, the host-idle loop)", lambda r: tc.ms(r["save_cpu"]),
         lambda r: r["save_cpu"]),
    ]
    metrics += [(f"restore: {title}", *restore(kind)) for kind, title in list(RESTORES.items()) + [RESTART]]
    metrics += [
        ("RSS held between saves (after the warm-up save, over the state's)", lambda r: mib(r["held"]),
         lambda r: r["held"]),
        ("peak RSS over the state, blocked saves", lambda r: mib(r["save_extra"]), lambda r: r["save_extra"]),
        ("peak RSS over the state, seed loop", lambda r: mib(r["loop_extra"]), lambda r: r["loop_extra"]),
        ("peak RSS beyond the restored arrays (worst restore)",
         lambda r: mib(max(x["extra"] for x in r["restores"].values())),
         lambda r: max(x["extra"] for x in r["restores"].values())),
        ("process peak RSS (ru_maxrss)", lambda r: mib(r["max_rss"]), lambda r: r["max_rss"]),
    ]
    out = []
    for title, cell, value in metrics:
        cells, values = {}, {}
        for t, r in ok.items():
            try:
                cells[t], values[t] = cell(r), value(r)
            except KeyError:  # a phase that did not run (its error is reported below the table)
                cells[t] = "-"
        ratio = ""
        if "ckptio" in values and "orbax" in values and values["orbax"] > 0:
            ratio = f"{values['ckptio'] / values['orbax']:.2f}x"
        out.append((title, cells, ratio))
    return out


def table(results, fio, tools):
    errors = {r["tool"]: r["error"] for r in results if "error" in r}
    head = "| | " + " | ".join(tools) + " | ckptio / orbax |"
    lines = [head, "|---|" + "---:|" * len(tools) + "---:|"]
    for title, cells, ratio in rows(results, fio):
        lines.append(f"| {title} | " + " | ".join(cells.get(t, "-") for t in tools) + f" | {ratio} |")
    for tool, why in errors.items():
        lines.append(f"| {tool} could not run here | {why} |" + " |" * len(tools))
    for r in results:
        if "restart_error" in r:
            lines.append(f"| {r['tool']}: the restore in a new process failed | {r['restart_error']} |"
                         + " |" * len(tools))
    return "\n".join(lines)


def report(a, results, fio, seconds, command, results_2p=None):
    ok = [r for r in results if "error" not in r]
    first = ok[0] if ok else None
    state = (f"{tc.human_size(first['state_bytes'])} of float32 in {first['arrays']} arrays "
             f"({mib(first['device_bytes'])} on the devices, replicas included)" if first else
             f"{a.size_gib:g} GiB")
    if "error" in fio:
        disk = f"fio could not run here: {fio['error']}"
    else:
        disk = (f"fio O_DIRECT on the same disk, {fio['gib']} GiB, 8 MiB requests: read {mb_s(fio['read'])}, "
                f"write {mb_s(fio['write'])} (fsync at the end)")
    loads = [x for r in ok for x in (r["load_before"][0], r["load_after"][0])]
    calls = ", ".join(f"{r['tool']} {r['compute_calls']} calls, "
                      + " and ".join(f"{x / a.loop_saves:.2f}" for x in r["pure_runs"])
                      + " s per step alone before and after its loop" for r in ok)
    parts = [
        "## Sharded jax.Arrays: ckptio and orbax-checkpoint, one process, 8 CPU devices\n",
        f"{os.cpu_count()} cpus; {tc.versions()}; measured in {seconds / 60:.1f} min; 1-minute load average "
        f"{min(loads):.2f}-{max(loads):.2f} over the runs.\n" if loads else "",
        f"State: {state}, on a (4, 2) mesh: 8 arrays P('a', 'b'), 4 P('a'), 1 replicated. Each tool in a fresh "
        f"process, keep {a.keep}, one untimed warm-up save; {a.saves} blocked saves; a seed loop of "
        f"{a.loop_saves} saves with {a.compute_s:g} s of jitted matmuls before each ({calls}); restores of the "
        "last step with its files evicted from the page cache. Disk: " + disk + ".\n",
        "\n".join(f"- {r['via']}." for r in ok) + "\n",
        table(results, fio, a.tools),
        "",
        tc.orbax_split([dict(r, saves=a.saves + a.loop_saves) for r in ok if r["tool"] == "orbax"]),
        "",
        "Restore cells: time, state bytes / time, and that over fio's O_DIRECT read rate. The restores in the "
        "saving process can reuse memory the process already holds (freed by earlier saves and restores: orbax's "
        "saves copy the state to host memory, ckptio's borrow it, so ckptio's first restore finds little); the "
        f"restore in a new process (started {PAGE_REPORTING_S:g} s after the saving process ended, as a restarted "
        "trainer would: this VM's kernel hands freed memory back to the hypervisor, and taking it again costs a "
        "hypervisor fault per page, 0.5-1.2 GB/s here) cannot: all of the restored arrays' memory is fresh there, "
        "for both tools. Peak RSS rows: VmHWM "
        "over the RSS before the phase (the state already resident), for restores beyond the host memory the "
        "restored arrays hold (a buffer that replicas share counted once: jax aliases one host buffer put on "
        "several CPU devices). Seed loop overhead: (wall of the loop, final wait included - wall of the same compute "
        "without saves, the mean of a run before the loop and one after it) / the latter.\n",
        "Peak RSS beyond the restored arrays, each restore: " + "; ".join(
            f"{r['tool']} " + ", ".join(f"{kind} {mib(x['extra'])}" for kind, x in r["restores"].items())
            for r in ok) + ".\n",
        "Blocked per save, each save (ms): " + "; ".join(
            f"{r['tool']} {' '.join(f'{b * 1e3:.0f}' for b in r['blocked'])}, in the loop "
            f"{' '.join(f'{b * 1e3:.0f}' for b in r['loop_blocked'])}" for r in ok) + ".\n",
        report_2p(a, results_2p, fio) if results_2p is not None else
        "2 processes x 4 devices (jax.distributed on 127.0.0.1): not measured in this run (--processes 2).\n",
        f"Reproduce: `{command}`.",
    ]
    return "\n".join(p for p in parts if p is not None) + "\n"


def report_2p(a, results, fio):
    ok = [r for r in results if "error" not in r]
    calls = ", ".join(f"{r['tool']} {r['compute_calls']} calls, "
                      + " and ".join(f"{x / a.loop_saves_2p:.2f}" for x in r["pure_runs"])
                      + " s per step alone before and after its loop"
                      for r in ok)

    def both(r, fn, fmt):
        return " / ".join(fmt(fn(p)) for p in r["per_process"])

    per_process = [
        f"{r['tool']}: process peak RSS {both(r, lambda p: p['max_rss'], mib)}; peak over the state, blocked "
        f"saves {both(r, lambda p: p['save_extra'], mib)}, seed loop {both(r, lambda p: p['loop_extra'], mib)}, "
        f"worst restore beyond the arrays {both(r, lambda p: max(x['extra'] for x in p['restores'].values()), mib)}"
        f"; blocked per save, the blocked saves then the loop's (ms) "
        + both(r, lambda p: p["blocked"] + p["loop_blocked"], lambda xs: " ".join(f"{x * 1e3:.0f}" for x in xs))
        + "; restores, " + ", ".join(r["restores"]) + " (s) " + both(r, lambda p: p["restores"],
                                   lambda rs: " ".join(f"{x['seconds']:.2f}" for x in rs.values()))
        for r in ok]
    return "\n".join([
        "### 2 processes x 4 devices\n",
        "The same layout, built with jax.make_array_from_callback on the (4, 2) mesh over the 8 devices of 2 "
        "processes (jax.distributed on 127.0.0.1, 4 CPU devices each, gloo collectives), each process computing "
        "only the shards its devices hold; both write to the same root on the same disk. ckptio: "
        "`CheckpointManager(root, keep=K)` and nothing else (process index, count and barrier come from "
        "jax.distributed); orbax: the same async CheckpointManager and StandardSave. Both processes meet at a "
        "barrier before each phase; every time is the slower process's (blocked: the slower per save, then the "
        f"median), every memory figure the larger process's. Seed and idle loops of {a.loop_saves_2p} saves "
        f"({calls}). Restores (the last step, evicted from the page cache) go onto the (4, 2) mesh and the (8,) "
        "mesh over the 8 global devices; two arrays checked bit-exact, gathered whole with process_allgather.\n",
        table(results, fio, a.tools),
        "",
        "Per process (process 0 / process 1): " + ("; ".join(per_process) if per_process else "none ran") + ".\n",
    ])


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-gib", type=float, default=1.0, help="the state's size (float32, GiB)")
    ap.add_argument("--saves", type=int, default=3, help="blocked saves, each waited for")
    ap.add_argument("--loop-saves", type=int, default=10, help="saves in the seed loop")
    ap.add_argument("--compute-s", type=float, default=2.0, help="seconds of compute before each loop save")
    ap.add_argument("--keep", type=int, default=3)
    ap.add_argument("--tools", default="ckptio,orbax")
    ap.add_argument("--dir", default=os.path.join(ROOT, "bench", "results", "tmp"),
                    help="where the runs write (a fresh directory under it, removed at the end)")
    ap.add_argument("--processes", type=int, default=1, choices=(1, 2),
                    help="2: also each tool in 2 processes x 4 devices (jax.distributed on 127.0.0.1)")
    ap.add_argument("--loop-saves-2p", type=int, default=10, help="saves in the seed and idle loops, 2 processes")
    ap.add_argument("--out", help="also write the report here (markdown)")
    ap.add_argument("--ckptio-python", default=os.path.join(ROOT, "build", "python"),
                    help="where the ckptio module was built (default build/python)")
    ap.add_argument("--timeout", type=float, default=600, help="seconds per tool")
    ap.add_argument("--child", choices=sorted(TOOLS), help=argparse.SUPPRESS)
    ap.add_argument("--root", help=argparse.SUPPRESS)
    ap.add_argument("--process-id", type=int, choices=(0, 1), help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--restart", type=int, help=argparse.SUPPRESS)
    command = " ".join([".venv-bench/bin/python", os.path.relpath(os.path.abspath(__file__), ROOT)]
                       + (sys.argv[1:] if argv is None else argv))
    a = ap.parse_args(argv)
    a.size = int(a.size_gib * tc.GIB)
    if a.size < 64 * tc.MIB:
        ap.error(f"--size-gib must be at least 1/16 (64 MiB), got {a.size_gib}")
    for name in ("saves", "loop_saves", "loop_saves_2p", "keep"):
        if getattr(a, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(a, name)}")
    a.tools = [t for t in a.tools.split(",") if t]
    if not a.tools or any(t not in TOOLS for t in a.tools):
        ap.error(f"--tools takes {', '.join(TOOLS)}, got {','.join(a.tools)!r}")
    a.ckptio_python = os.path.abspath(a.ckptio_python)
    if a.child:
        return run_restart(a) if a.restart is not None else run_child(a)

    base = os.path.abspath(a.dir)
    os.makedirs(base, exist_ok=True)
    work = tempfile.mkdtemp(prefix="sharded-", dir=base)
    t0 = time.perf_counter()
    results = []
    try:
        print("sharded_bench: fio ...", file=sys.stderr, flush=True)
        fio = measure_fio(work, a.size)
        for tool in a.tools:
            print(f"sharded_bench: {tool} (load {tc.loadavg()[0]:.2f}) ...", file=sys.stderr, flush=True)
            root = os.path.join(work, tool)
            r = run_tool(a, tool, root)
            shutil.rmtree(root, ignore_errors=True)
            print(f"sharded_bench: {tool}: {r.get('error') or 'done'}", file=sys.stderr, flush=True)
            results.append(r)
        results_2p = None
        if a.processes == 2:
            results_2p = []
            for tool in a.tools:
                print(f"sharded_bench: {tool}, 2 processes (load {tc.loadavg()[0]:.2f}) ...", file=sys.stderr,
                      flush=True)
                root = os.path.join(work, tool + "-2p")
                r = run_tool_2p(a, tool, root)
                shutil.rmtree(root, ignore_errors=True)
                print(f"sharded_bench: {tool}, 2 processes: {r.get('error') or 'done'}", file=sys.stderr,
                      flush=True)
                results_2p.append(r)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    text = report(a, results, fio, time.perf_counter() - t0, command, results_2p)
    print(text, end="")
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
