"""The PEP 517 backend of `pip install .` and of the sdist: meson-python, building outside the source tree,
after a check of what the system must provide.

meson-python builds in a temporary directory it makes inside the source tree
(``.mesonpy-*``), so ``pip install .`` from a read-only checkout (a mounted
volume, a package manager's tree) failed before meson even ran. This wrapper
gives meson-python a temporary build directory under $TMPDIR instead, unless
the caller chose one (``-Cbuild-dir=...``), and removes it afterwards.

Building from source (``pip install .``, or ``pip install ckptio`` where no
wheel fits and pip takes the sdist) needs a C++ compiler, pkg-config, Python's
headers and a few -dev packages. Where one is missing, meson stopped with a
traceback about a pkg-config lookup; the check here stops first, with one
message that names every missing package and the command that installs them.
A caller that brings its own toolchain (``-Csetup-args=--native-file=...``, as
``make wheel`` does) is trusted and not checked. Every other hook is
meson-python's own.
"""
import contextlib
import os
import shutil
import subprocess
import sysconfig
import tempfile

import mesonpy
from mesonpy import (  # noqa: F401  (PEP 517 hooks, passed through)
    get_requires_for_build_editable,
    get_requires_for_build_sdist,
    get_requires_for_build_wheel,
)

# (pkg-config module, minimum version, Debian/Ubuntu package): meson.build's dependency() calls.
# nlohmann_json is not here: meson falls back to downloading it (subprojects/nlohmann_json.wrap).
SYSTEM_LIBRARIES = [
    ("liburing", "2.2", "liburing-dev"),
    ("libcurl", "7.80", "libcurl4-openssl-dev"),
    ("openssl", "3.0", "libssl-dev"),
    ("libisal", "2.25", "libisal-dev"),
    ("libxxhash", "0.8.0", "libxxhash-dev"),
]


class MissingBuildDependencies(SystemExit):
    """Raised by build_wheel / build_editable: the message names what to install."""


def _find_compiler():
    cxx = os.environ.get("CXX", "").split()
    candidates = [cxx[0]] if cxx else ["c++", "g++", "clang++"]
    return next((shutil.which(c) for c in candidates if shutil.which(c)), None)


def _pkg_config_problem(pkg_config, module, minimum):
    """None if pkg-config finds `module` >= minimum, else what is wrong."""
    if subprocess.run([pkg_config, "--exists", module], capture_output=True).returncode != 0:
        return "not found"
    if subprocess.run([pkg_config, f"--atleast-version={minimum}", module], capture_output=True).returncode != 0:
        found = subprocess.run([pkg_config, "--modversion", module], capture_output=True, text=True).stdout.strip()
        return f"{found} found, {minimum} or newer needed"
    return None


def missing_build_dependencies():
    """[(what, why, Debian package), ...] for everything building from source needs and cannot find."""
    missing = []
    if _find_compiler() is None:
        missing.append(("a C++20 compiler (g++ 12 or newer)", "no c++, g++ or clang++ on PATH", "g++"))
    include = sysconfig.get_paths().get("include", "")
    if not os.path.isfile(os.path.join(include, "Python.h")):
        missing.append(("Python's headers", f"no Python.h in {include}", "python3-dev"))
    pkg_config = shutil.which(os.environ.get("PKG_CONFIG", "pkg-config")) or shutil.which("pkgconf")
    if pkg_config is None:
        missing.append(("pkg-config", "not on PATH", "pkg-config"))
        # Without it nothing below can be checked: name all of it.
        missing += [(f"{m} >= {v}", "not checked (no pkg-config)", deb) for m, v, deb in SYSTEM_LIBRARIES]
        return missing
    for module, minimum, deb in SYSTEM_LIBRARIES:
        problem = _pkg_config_problem(pkg_config, module, minimum)
        if problem is not None:
            missing.append((f"{module} >= {minimum}", problem, deb))
    return missing


def _message(missing):
    width = max(len(what) for what, _, _ in missing)
    lines = ["ckptio cannot be built from source here; missing:"]
    lines += [f"  {what:<{width}}  {why}  (Debian/Ubuntu: {deb})" for what, why, deb in missing]
    debs = " ".join(deb for _, _, deb in missing)
    modules = " ".join(f"'pkgconfig({what.split()[0]})'" for what, _, _ in missing if what.split()[0] in
                       {m for m, _, _ in SYSTEM_LIBRARIES})
    lines += ["Install them, on Debian/Ubuntu:", f"  sudo apt-get install {debs}"]
    if modules:
        lines += ["on Fedora/RHEL (with a C++ compiler, pkgconf and python3-devel):", f"  sudo dnf install {modules}"]
    lines += ["or install the binary wheel, which needs none of them: pip install --only-binary ckptio ckptio"]
    return "\n".join(lines)


def _check_system(settings):
    setup_args = settings.get("setup-args", [])
    if isinstance(setup_args, str):
        setup_args = [setup_args]
    if any(a.startswith(("--native-file", "--cross-file")) for a in setup_args):
        return  # the caller's own toolchain (make wheel)
    missing = missing_build_dependencies()
    if missing:
        raise MissingBuildDependencies(_message(missing))


@contextlib.contextmanager
def _outside_the_tree(config_settings):
    settings = dict(config_settings or {})
    if "build-dir" in settings or "builddir" in settings:
        yield settings
        return
    with tempfile.TemporaryDirectory(prefix="ckptio-wheel-build-") as build_dir:
        settings["build-dir"] = build_dir
        yield settings


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    _check_system(dict(config_settings or {}))
    with _outside_the_tree(config_settings) as settings:
        return mesonpy.build_wheel(wheel_directory, settings, metadata_directory)


def build_editable(wheel_directory, config_settings=None, metadata_directory=None):
    _check_system(dict(config_settings or {}))
    return mesonpy.build_editable(wheel_directory, config_settings, metadata_directory)


def build_sdist(sdist_directory, config_settings=None):
    with _outside_the_tree(config_settings) as settings:
        return mesonpy.build_sdist(sdist_directory, settings)
