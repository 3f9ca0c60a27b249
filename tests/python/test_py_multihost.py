"""Multi-host from Python: two processes started with jax.distributed on CPU
(127.0.0.1), each saving its half of the state through one CheckpointManager
per process, with jax's sync_global_devices as the barrier (run by ckptio on
a helper thread); process 0 commits one checkpoint."""
import json
import textwrap

import ml_dtypes
import numpy as np
import pytest

import ckptio
from conftest import run_processes

CHILD = """
import sys
import numpy as np
import ml_dtypes
import jax
from jax.experimental import multihost_utils
import ckptio

index, port, root = int(sys.argv[1]), sys.argv[2], sys.argv[3]
jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2, process_id=index)
calls = []

def barrier(name):
    calls.append(name)
    multihost_utils.sync_global_devices(name)

mgr = ckptio.CheckpointManager(root, keep=2, staging_memory="16MiB", threads=2, process_index=index,
                               process_count=2, barrier=barrier)
for step in (1, 2, 3):
    half = {"params": {f"w{index}": np.full((64, 32), step * 10 + index, np.float32),
                       f"b{index}": np.arange(8).astype(ml_dtypes.bfloat16) + index}}
    mgr.save(step, half)
mgr.wait_until_finished()
print("steps", mgr.all_steps(), flush=True)
print("barriers", ",".join(calls), flush=True)
mgr.close()
"""


def test_two_jax_processes_save_their_halves_and_one_checkpoint_restores_bit_exact(tmp_path, child_env):
    root = tmp_path / "ckpt"
    results = run_processes(textwrap.dedent(CHILD), 2, [root], child_env)
    for i, (returncode, out) in enumerate(results):
        assert returncode == 0, f"process {i}:\n{out}"
        # Process 0 prunes (keep=2); process 1 knows its own commits, not process 0's prunes.
        assert ("steps [2, 3]" if i == 0 else "steps [1, 2, 3]") in out or (i == 1 and "steps [2, 3]" in out), out
        # ckptio called the Python barrier for each step, in order.
        assert "barriers open,written/1,committed/1,written/2,committed/2,written/3,committed/3" in out, out

    manifest = json.loads((root / "checkpoint_3" / "manifest.json").read_text())
    assert sorted(t["name"] for t in manifest["tensors"]) == ["params/b0", "params/b1", "params/w0", "params/w1"]
    assert sorted(p.name for p in root.iterdir() if not p.name.startswith(".")) == ["checkpoint_2",
                                                                                     "checkpoint_3"]
    with ckptio.CheckpointManager(root, read_only=True) as reader:
        back = reader.restore()
        assert reader.verify(3)["tensors"] == 4
    for i in range(2):
        w, b = back["params"][f"w{i}"], back["params"][f"b{i}"]
        assert w.dtype == np.float32 and w.tobytes() == np.full((64, 32), 30 + i, np.float32).tobytes()
        assert b.dtype == ml_dtypes.bfloat16
        assert b.tobytes() == (np.arange(8).astype(ml_dtypes.bfloat16) + i).tobytes()


def test_an_exception_in_the_barrier_callable_fails_with_its_message(tmp_path):
    def barrier(name):
        raise RuntimeError(f"peer lost before {name}")

    with pytest.raises(ckptio.CkptioError, match="barrier.*RuntimeError: peer lost before") as e:
        ckptio.CheckpointManager(tmp_path / "ckpt", staging_memory="8MiB", process_index=0, process_count=2,
                                 barrier=barrier)
    with pytest.raises(TypeError, match="barrier must be a callable"):
        ckptio.CheckpointManager(tmp_path / "ckpt", process_count=2, barrier="sync")
