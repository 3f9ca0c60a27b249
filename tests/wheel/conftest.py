"""Fixtures of the wheel's tests (make test-wheel; packaging/README.md).

Environment (set by the Makefile): CKPTIO_WHEEL (the .whl), CKPTIO_SDIST (the .tar.gz),
CKPTIO_TEST_ROOT (the Debian root of make_root.sh), CKPTIO_WHEEL_TOOLS (a bin/ with auditwheel).
"""
import json
import os
import pathlib
import shutil
import sys
import time

import pytest

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "gcs"))

from root import Overlay  # noqa: E402

VENV = "/home/user/venv"


def _required(name):
    value = os.environ.get(name)
    if not value:
        raise pytest.UsageError(f"{name} is not set: run these tests with `make test-wheel`")
    return value


@pytest.fixture(scope="session")
def wheel():
    return pathlib.Path(_required("CKPTIO_WHEEL"))


@pytest.fixture(scope="session")
def sdist():
    return pathlib.Path(_required("CKPTIO_SDIST"))


@pytest.fixture(scope="session")
def tools():
    return pathlib.Path(_required("CKPTIO_WHEEL_TOOLS"))


def pip_network_env():
    """What pip needs, inside the root, to reach PyPI the way this machine does: a proxy, an index,
    and the CA of a TLS-inspecting proxy (PIP_CERT). For pip only: ckptio's processes never get it."""
    env = {k: v for k, v in os.environ.items()
           if k in ("PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL", "PIP_DEFAULT_TIMEOUT", "http_proxy", "https_proxy",
                    "no_proxy", "HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY")}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    return env


@pytest.fixture(scope="session")
def debian(tmp_path_factory):
    if os.geteuid() != 0:
        pytest.fail("the wheel's tests mount an overlay and chroot: they run as root (make test-wheel)")
    root = pathlib.Path(_required("CKPTIO_TEST_ROOT"))
    with Overlay(root, tmp_path_factory.mktemp("debian")) as sysroot:
        cert = os.environ.get("PIP_CERT")
        if cert:
            shutil.copy(cert, sysroot.data_host / "pip-ca.pem")
        yield sysroot


def pip_env(debian):
    env = pip_network_env()
    if (debian.data_host / "pip-ca.pem").exists():
        env["PIP_CERT"] = "/data/pip-ca.pem"
    return env


@pytest.fixture(scope="session")
def installed(debian, wheel):
    """The wheel in a venv of `user`, as a user would install it; the time from `pip install` to
    the first committed save, measured (printed and written next to the wheel, never asserted)."""
    shutil.copy(wheel, debian.data_host / wheel.name)
    debian.run("python3", "-m", "venv", VENV)
    timing = {}
    t0 = time.monotonic()
    debian.run(f"{VENV}/bin/pip", "install", "-q", f"/data/{wheel.name}", env=pip_env(debian))
    timing["pip_install_s"] = time.monotonic() - t0
    from scripts import FIRST_SAVE, RESTORE, SAVE
    for name, text in (("first_save.py", FIRST_SAVE), ("save.py", SAVE), ("restore.py", RESTORE)):
        (debian.data_host / name).write_text(text)
    t1 = time.monotonic()
    out = debian.run(f"{VENV}/bin/python", "/data/first_save.py", "/data/first-save").stdout
    timing["python_first_save_s"] = time.monotonic() - t1
    timing["install_to_first_save_s"] = time.monotonic() - t0
    timing.update(json.loads(out.strip().splitlines()[-1]))
    # Again into a second venv, now that pip's cache holds numpy and ml_dtypes (a user who has
    # installed them before, or a second environment).
    debian.run("python3", "-m", "venv", "/home/user/venv2")
    t2 = time.monotonic()
    debian.run("/home/user/venv2/bin/pip", "install", "-q", f"/data/{wheel.name}", env=pip_env(debian))
    debian.run("/home/user/venv2/bin/python", "/data/first_save.py", "/data/first-save-2")
    timing["warm_cache_install_to_first_save_s"] = time.monotonic() - t2
    timing = {k: round(v, 2) if isinstance(v, float) else v for k, v in timing.items()}
    report = wheel.parent / "install-timing.json"
    report.write_text(json.dumps(timing, indent=1) + "\n")
    print(f"\nwheel install to first committed save: {json.dumps(timing)}", file=sys.stderr)
    return timing
