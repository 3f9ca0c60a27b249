"""Fixtures for the tests of the Python module `ckptio` (python/).

The tests import the module built by meson: $CKPTIO_BUILD/python (default
build/python, which `make test` builds against .venv/bin/python3). With
CKPTIO_TEST_INSTALLED=1 they import whatever `import ckptio` finds instead
(e.g. after `pip install .`).
"""
import os
import pathlib
import socket
import subprocess
import sys
import textwrap

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]

if os.environ.get("CKPTIO_TEST_INSTALLED") == "1":
    MODULE_PATH = None
else:
    MODULE_PATH = (REPO / os.environ.get("CKPTIO_BUILD", "build") / "python").resolve()
    if not list(MODULE_PATH.glob("ckptio/_ckptio*.so")):
        raise pytest.UsageError(
            f"the ckptio Python module is not built in {MODULE_PATH}: configure the build with "
            f"-Dpython_interpreter={REPO / '.venv/bin/python3'} (make test does) and run ninja")
    sys.path.insert(0, str(MODULE_PATH))

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Eight CPU devices in the test process, for sharded jax.Arrays (test_py_sharded.py);
# set before anything imports jax. Child processes choose their own.
HOST_DEVICES = "--xla_force_host_platform_device_count=8"
os.environ.setdefault("XLA_FLAGS", HOST_DEVICES)

# The GCS emulator, fault proxy and official client fixtures (tests/gcs).
sys.path.insert(0, str(REPO / "tests" / "gcs"))
from gcs_fixtures import *  # noqa: E402,F401,F403

# Small staging memory: the default (2 GiB, pre-faulted) is for trainers.
SMALL = {"staging_memory": "64MiB", "threads": 2}


@pytest.fixture
def small():
    """Options for a test manager."""
    return dict(SMALL)


@pytest.fixture
def flax_ckpt():
    """ckptio.flax with small staging; its managers closed after the test."""
    import ckptio.flax

    ckptio.flax.configure(**SMALL)
    yield ckptio.flax
    ckptio.flax.close()
    ckptio.flax.configure()


@pytest.fixture
def child_env():
    """The environment for a child Python that imports the same ckptio."""
    env = dict(os.environ)
    if env.get("XLA_FLAGS") == HOST_DEVICES:
        del env["XLA_FLAGS"]
    if MODULE_PATH is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(MODULE_PATH)] + [p for p in [env.get("PYTHONPATH")] if p])
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONUNBUFFERED"] = "1"
    return env


@pytest.fixture
def run_python(child_env):
    """Runs a Python snippet in a fresh interpreter; returns the CompletedProcess."""
    def run(code, check=True, env=None, timeout=300):
        p = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                           env=env or child_env, timeout=timeout)
        if check and p.returncode != 0:
            raise AssertionError(f"child exited {p.returncode}:\n{p.stdout}\n{p.stderr}")
        return p
    return run


@pytest.fixture
def gcs_root(gcs_env, monkeypatch):
    """A gs:// root in a fresh emulator bucket, with this process's
    environment pointing ckptio at the emulator (through the fault proxy)."""
    for key, value in gcs_env.items():
        if key.startswith(("STORAGE_EMULATOR", "GCE_METADATA", "CKPTIO_TEST_")) or key.lower() == "no_proxy":
            monkeypatch.setenv(key, value)
    monkeypatch.delenv("GOOGLE_APPLICATION_CREDENTIALS", raising=False)
    return f"gs://{gcs_env['CKPTIO_TEST_BUCKET']}/run"


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_processes(code, count, extra_args, env, timeout=300):
    """Runs `count` Python processes of `code` at once, each with the
    arguments (index, port, *extra_args): a jax.distributed job on a free
    port of 127.0.0.1. Returns [(returncode, output), ...] by index; all are
    killed if one outlives the timeout."""
    port = free_port()
    procs = [subprocess.Popen([sys.executable, "-c", code, str(i), str(port), *map(str, extra_args)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(count)]
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=timeout)[0])
    finally:
        for p in procs:
            p.kill()
    return [(p.returncode, out) for p, out in zip(procs, outs)]
