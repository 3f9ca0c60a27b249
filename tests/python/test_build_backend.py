"""`pip install .` builds outside the source tree, so a read-only checkout installs.

The real build takes minutes; here meson-python's build_wheel is replaced by a
recorder, to check what the wrapper (python/build_backend) hands it. The whole
read-only install is run by hand (see the README's Python section).
"""
import pathlib
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "python" / "build_backend"))
import ckptio_build_backend  # noqa: E402
import mesonpy  # noqa: E402


@pytest.fixture
def recorded(monkeypatch):
    calls = []

    def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
        build_dir = pathlib.Path(config_settings["build-dir"])
        calls.append({"settings": dict(config_settings), "existed": build_dir.is_dir()})
        return "ckptio-0.1.0-cp311-cp311-linux_x86_64.whl"

    monkeypatch.setattr(mesonpy, "build_wheel", build_wheel)
    return calls


def test_the_wheel_is_built_in_a_temporary_directory_outside_the_source_tree(recorded, tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)  # where pip runs the backend
    name = ckptio_build_backend.build_wheel(str(tmp_path), {"setup-args": ["-Dx=y"]})
    assert name.endswith(".whl")
    (call,) = recorded
    build_dir = pathlib.Path(call["settings"]["build-dir"])
    assert call["existed"]
    assert REPO not in build_dir.parents and build_dir != REPO
    assert call["settings"]["setup-args"] == ["-Dx=y"]  # the caller's settings pass through
    assert not build_dir.exists()  # removed afterwards
    assert not list(REPO.glob(".mesonpy-*"))


def test_a_build_dir_the_caller_chose_is_used_as_is(recorded, tmp_path):
    mine = tmp_path / "mine"
    ckptio_build_backend.build_wheel(str(tmp_path), {"build-dir": str(mine)})
    assert recorded[0]["settings"]["build-dir"] == str(mine)
