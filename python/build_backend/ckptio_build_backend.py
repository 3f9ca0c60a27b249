"""The PEP 517 backend of `pip install .`: meson-python, building outside the source tree.

meson-python builds in a temporary directory it makes inside the source tree
(``.mesonpy-*``), so ``pip install .`` from a read-only checkout (a mounted
volume, a package manager's tree) failed before meson even ran. This wrapper
gives meson-python a temporary build directory under $TMPDIR instead, unless
the caller chose one (``-Cbuild-dir=...``), and removes it afterwards. Every
other hook is meson-python's own.
"""
import contextlib
import tempfile

import mesonpy
from mesonpy import (  # noqa: F401  (PEP 517 hooks, passed through)
    build_editable,
    get_requires_for_build_editable,
    get_requires_for_build_sdist,
    get_requires_for_build_wheel,
)


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
    with _outside_the_tree(config_settings) as settings:
        return mesonpy.build_wheel(wheel_directory, settings, metadata_directory)


def build_sdist(sdist_directory, config_settings=None):
    with _outside_the_tree(config_settings) as settings:
        return mesonpy.build_sdist(sdist_directory, settings)
