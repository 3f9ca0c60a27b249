"""Ctrl-C (a real SIGINT) in a trainer that is waiting for a save.

The child saves step 1, then starts a 64 MiB save of step 2 written in
4 KiB synchronous writes (a second or more, so the signal lands while it is
in flight) and waits for it."""
import os
import signal
import subprocess
import sys
import textwrap
import threading

import numpy as np

import ckptio

CHILD = """
import signal
import sys
import numpy as np
import ckptio

# Ctrl-C raises KeyboardInterrupt even where this test runs with SIGINT
# ignored (a job started with & by a shell without job control): Python
# leaves an ignored SIGINT ignored.
signal.signal(signal.SIGINT, signal.default_int_handler)

root = sys.argv[1]
mgr = ckptio.CheckpointManager(root, staging_memory="80MiB", io={"block_size": "4KiB", "queue_depth": 1})
mgr.save(1, {"w": np.full(1 << 20, 1, np.uint8)})
mgr.wait_until_finished()
handle = mgr.save(2, {"w": np.full(64 << 20, 2, np.uint8)})
try:
    print("waiting", flush=True)
    mgr.wait_until_finished()
    print("finished", flush=True)
except KeyboardInterrupt:
    print(f"interrupted done={handle.done()}", flush=True)
    raise
"""


def start_child(root, child_env):
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(CHILD), str(root)], env=child_env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    watchdog = threading.Timer(300, proc.kill)  # a hung child fails the test instead of hanging it
    watchdog.daemon = True
    watchdog.start()
    return proc


def read_rest(proc, seen):
    """The whole output once the child has exited (not communicate(): it
    would skip what the line iterator has buffered)."""
    seen.append(proc.stdout.read())
    proc.wait()
    return "".join(seen)


def read_until(proc, needle, seen):
    for line in proc.stdout:
        seen.append(line)
        if needle in line:
            return line
    raise AssertionError(f"the child never printed {needle!r}:\n{''.join(seen)}")


def check_intact(root, want_steps):
    """In this process (fresh to the root): the newest checkpoint is one of
    want_steps, complete and bit-exact, and every CRC32C matches."""
    with ckptio.CheckpointManager(root, read_only=True) as reader:
        step = reader.latest_step()
        assert step in want_steps
        w = reader.restore(step)["w"]
        assert w.shape == ((64 << 20) if step == 2 else (1 << 20),)
        assert np.all(w == step)
        assert reader.verify(step)["step"] == step
        return step


def test_ctrl_c_during_wait_raises_keyboard_interrupt_and_the_checkpoint_stays_intact(tmp_path, child_env):
    root = tmp_path / "ckpt"
    proc = start_child(root, child_env)
    seen = []
    try:
        read_until(proc, "waiting", seen)
        proc.send_signal(signal.SIGINT)
        line = read_until(proc, "interrupted", seen)
        # The wait was interrupted while the save was still running.
        assert line.strip() == "interrupted done=False"
        # Meanwhile, the newest committed checkpoint is whole.
        check_intact(root, {1, 2})
        out = read_rest(proc, seen)
    finally:
        proc.kill()
    assert proc.returncode != 0 and "KeyboardInterrupt" in out
    # The save carried on in the background and the exit waited for it.
    assert "waiting for checkpoint saves in flight to commit" in out
    assert check_intact(root, {2}) == 2
    assert sorted(os.listdir(root)) == [".ckptio.lock", "checkpoint_1", "checkpoint_2"]


def test_a_second_ctrl_c_abandons_the_save_and_the_previous_checkpoint_stays_intact(tmp_path, child_env):
    root = tmp_path / "ckpt"
    proc = start_child(root, child_env)
    seen = []
    try:
        read_until(proc, "waiting", seen)
        proc.send_signal(signal.SIGINT)
        assert read_until(proc, "interrupted", seen).strip() == "interrupted done=False"
        read_until(proc, "waiting for checkpoint saves in flight", seen)  # the exit waits...
        proc.send_signal(signal.SIGINT)                                   # ...until Ctrl-C again
        out = read_rest(proc, seen)
    finally:
        proc.kill()
    assert "saves in flight abandoned" in out
    assert proc.returncode in (-signal.SIGINT, 128 + signal.SIGINT, 1), out  # not a crash
    # Step 2 never committed: the newest checkpoint is step 1, whole.
    assert check_intact(root, {1}) == 1
    # Its debris goes when a writer opens the root again.
    assert any(".tmp-" in name for name in os.listdir(root))
    with ckptio.CheckpointManager(root, staging_memory="8MiB") as writer:
        assert writer.all_steps() == [1]
    assert sorted(os.listdir(root)) == [".ckptio.lock", "checkpoint_1"]
