"""Shared fixtures: the ckptio binary under test and a runner for it."""
import os
import subprocess

import pytest


@pytest.fixture(scope="session")
def ckptio_bin():
    path = os.environ.get("CKPTIO_BIN", "build/src/cli/ckptio")
    assert os.access(path, os.X_OK), f"ckptio binary not found at {path} (set CKPTIO_BIN)"
    return os.path.abspath(path)


@pytest.fixture
def run(ckptio_bin):
    def _run(*args, check=True, env=None):
        p = subprocess.run([ckptio_bin, *map(str, args)], capture_output=True, text=True, env=env)
        if check and p.returncode != 0:
            raise AssertionError(f"ckptio {' '.join(map(str, args))} exited {p.returncode}: {p.stderr}")
        return p
    return _run


# The GCS emulator, fault proxy and official client fixtures (tests/gcs).
import pathlib  # noqa: E402
import sys  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "gcs"))
from gcs_fixtures import *  # noqa: E402,F401,F403
