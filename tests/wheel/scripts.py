"""Python programs the wheel's tests run inside the Debian root, with the venv the wheel went into.
Each prints one JSON line for the test to check; a failed check inside raises (exit status 1)."""

# A trainer-shaped state: a few dtypes (bfloat16 through ml_dtypes), a scalar, nested dicts. The
# same seed makes the same state in another process, which checks what it restores against it.
STATE = r'''
import numpy as np, ml_dtypes

def make_state(step):
    rng = np.random.default_rng(1234 + step)
    return {"params": {"dense": {"kernel": rng.standard_normal((512, 256), dtype=np.float32),
                                 "bias": rng.standard_normal(256).astype(ml_dtypes.bfloat16)},
                       "embed": rng.integers(-2**31, 2**31, size=(1000, 64), dtype=np.int32)},
            "opt": {"count": np.int64(step), "mu": rng.standard_normal((512, 256)).astype(np.float16)},
            "step": np.int64(step)}

def leaves(tree, prefix=""):
    if isinstance(tree, dict):
        for k, v in sorted(tree.items()):
            yield from leaves(v, f"{prefix}{k}/")
    else:
        yield prefix[:-1], np.asarray(tree)

def same(a, b):
    la, lb = dict(leaves(a)), dict(leaves(b))
    assert la.keys() == lb.keys(), (sorted(la), sorted(lb))
    for k in la:
        x, y = la[k], lb[k]
        assert x.dtype == y.dtype and x.shape == y.shape, (k, x.dtype, y.dtype, x.shape, y.shape)
        assert x.tobytes() == y.tobytes(), k
    return len(la)
'''

# argv: root, steps to save (comma-separated), keep. Saves, waits, verifies, restores in-process.
SAVE = STATE + r'''
import json, sys, time, ckptio
t0 = time.monotonic()
root, steps, keep = sys.argv[1], [int(s) for s in sys.argv[2].split(",")], int(sys.argv[3])
with ckptio.CheckpointManager(root, keep=keep) as mgr:
    for step in steps:
        mgr.save(step, make_state(step), metadata={"epoch": step // 2})
    mgr.wait_until_finished()
    committed = time.monotonic()
    verified = mgr.verify()
    leaves_checked = same(mgr.restore(), make_state(steps[-1]))
    print(json.dumps({"all_steps": mgr.all_steps(), "latest": mgr.latest_step(), "verify": verified,
                      "leaves_checked": leaves_checked, "metadata": mgr.metadata(steps[-1]),
                      "seconds_to_commit": committed - t0, "version": ckptio.__version__}))
'''

# argv: root. Another process: restores every committed step and checks it against make_state.
RESTORE = STATE + r'''
import json, sys, ckptio
with ckptio.CheckpointManager(sys.argv[1], read_only=True) as mgr:
    checked = {}
    for step in mgr.all_steps():
        checked[step] = same(mgr.restore(step), make_state(step))
        mgr.verify(step)
    print(json.dumps({"checked": checked}))
'''

# What the test measures from `pip install` on: import, one save of a 64 MiB state, committed.
FIRST_SAVE = r'''
import json, sys, time
t0 = time.monotonic()
import numpy as np, ckptio
imported = time.monotonic()
state = {"w": np.ones((16, 1024, 1024), dtype=np.float32)}
with ckptio.CheckpointManager(sys.argv[1]) as mgr:
    mgr.save(1, state)
    mgr.wait_until_finished()
    committed = time.monotonic()
    steps = mgr.all_steps()
assert steps == [1], steps
print(json.dumps({"import_s": imported - t0, "save_s": committed - imported}))
'''
