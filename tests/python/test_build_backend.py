"""`pip install .` builds outside the source tree, so a read-only checkout installs; where the
system lacks a -dev package, it stops with a message naming it instead of a meson traceback.

The real build takes minutes; here meson-python's build_wheel is replaced by a
recorder, to check what the wrapper (python/build_backend) hands it. The whole
read-only install is run by hand (see the README's Python section); the
message on a system without the packages, for real, by tests/wheel (a Debian
root with none of them).
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


def _pc_dir(tmp_path, versions):
    """A pkg-config directory holding .pc files of these versions (module -> version)."""
    d = tmp_path / "pkgconfig"
    d.mkdir()
    for module, version in versions.items():
        (d / f"{module}.pc").write_text(f"Name: {module}\nDescription: test\nVersion: {version}\n")
    return d


@pytest.fixture
def system_with(monkeypatch, tmp_path):
    """The system's pkg-config sees only the given modules."""
    def make(**versions):
        monkeypatch.setenv("PKG_CONFIG_LIBDIR", str(_pc_dir(tmp_path, versions)))
        monkeypatch.delenv("PKG_CONFIG_PATH", raising=False)
    return make


ALL_NEW_ENOUGH = {"liburing": "2.3", "libcurl": "7.88.1", "openssl": "3.0.11", "libisal": "2.30.0",
                  "libxxhash": "0.8.1"}


def test_no_dev_package_at_all_names_every_one_and_meson_never_runs(recorded, system_with, tmp_path):
    system_with()
    with pytest.raises(SystemExit) as raised:
        ckptio_build_backend.build_wheel(str(tmp_path))
    message = str(raised.value)
    assert recorded == []
    assert message.startswith("ckptio cannot be built from source here; missing:")
    for module, deb in [("liburing >= 2.2", "liburing-dev"), ("libcurl >= 7.80", "libcurl4-openssl-dev"),
                        ("openssl >= 3.0", "libssl-dev"), ("libisal >= 2.25", "libisal-dev"),
                        ("libxxhash >= 0.8.0", "libxxhash-dev")]:
        assert f"{module}" in message and f"(Debian/Ubuntu: {deb})" in message
    assert ("  sudo apt-get install liburing-dev libcurl4-openssl-dev libssl-dev libisal-dev libxxhash-dev"
            in message.splitlines())
    assert "sudo dnf install 'pkgconfig(liburing)' 'pkgconfig(libcurl)'" in message
    assert "Traceback" not in message


def test_one_missing_package_is_the_only_one_named(recorded, system_with, tmp_path):
    system_with(**{m: v for m, v in ALL_NEW_ENOUGH.items() if m != "libisal"})
    with pytest.raises(SystemExit) as raised:
        ckptio_build_backend.build_wheel(str(tmp_path))
    lines = str(raised.value).splitlines()
    assert lines[1].split() == ["libisal", ">=", "2.25", "not", "found", "(Debian/Ubuntu:", "libisal-dev)"]
    assert "  sudo apt-get install libisal-dev" in lines
    assert recorded == []


def test_a_package_too_old_says_which_version_was_found(recorded, system_with, tmp_path):
    system_with(**dict(ALL_NEW_ENOUGH, liburing="2.1"))
    with pytest.raises(SystemExit) as raised:
        ckptio_build_backend.build_wheel(str(tmp_path))
    assert "liburing >= 2.2  2.1 found, 2.2 or newer needed  (Debian/Ubuntu: liburing-dev)" in str(raised.value)


def test_everything_there_goes_on_to_meson(recorded, system_with, tmp_path):
    system_with(**ALL_NEW_ENOUGH)
    ckptio_build_backend.build_wheel(str(tmp_path))
    assert len(recorded) == 1


def test_a_toolchain_of_the_callers_own_is_not_checked(recorded, system_with, tmp_path):
    system_with()  # nothing: make wheel's native file names its own pkg-config directory
    ckptio_build_backend.build_wheel(str(tmp_path), {"setup-args": ["--native-file=/x/native.ini", "-Dy=z"]})
    assert len(recorded) == 1
