"""A throwaway Debian system to install the wheel into: an overlay over the root make_root.sh made,
entered with chroot.

    with Overlay(root, work_dir) as sysroot:
        sysroot.run("python3", "-m", "venv", "/home/user/venv")           # as `user` (uid 1000)
        sysroot.run("update-ca-certificates", user="root")
        sysroot.path("/etc/ssl/certs")                                   # the host's view of a path

Writes go to an upper directory that is removed afterwards, so the cached root stays as
debootstrap left it. /proc and /dev are the host's (bound); /data is a directory of the host's
file system (bound), where checkpoints go: what a user's disk is, rather than the overlay.
The network is the host's (same network namespace): 127.0.0.1 reaches the host's test servers.
The environment is empty but for the few variables a login would set, so nothing of the host's
(SSL_CERT_FILE, PIP_*, PYTHONPATH, LD_LIBRARY_PATH) leaks in.
"""
from __future__ import annotations

import os
import pathlib
import shutil
import subprocess

USER_ENV = {"HOME": "/home/user", "USER": "user", "LOGNAME": "user", "LANG": "C.UTF-8",
            "PATH": "/usr/local/bin:/usr/bin:/bin"}
ROOT_ENV = {"HOME": "/root", "USER": "root", "LANG": "C.UTF-8",
            "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"}


class Overlay:
    def __init__(self, lower: pathlib.Path, work: pathlib.Path):
        self.lower = pathlib.Path(lower)
        self.work = pathlib.Path(work)
        self.merged = self.work / "merged"
        self.data_host = self.work / "data"  # bound at /data
        self._mounts: list[pathlib.Path] = []

    def __enter__(self) -> "Overlay":
        for d in ("upper", "ovl-work", "merged", "data"):
            (self.work / d).mkdir(parents=True, exist_ok=True)
        os.chown(self.data_host, 1000, 1000)
        try:
            self._mount("-t", "overlay", "overlay", "-o",
                        f"lowerdir={self.lower},upperdir={self.work / 'upper'},workdir={self.work / 'ovl-work'}",
                        target=self.merged)
            self._mount("-t", "proc", "proc", target=self.merged / "proc")
            self._mount("--rbind", "/dev", target=self.merged / "dev")
            (self.merged / "data").mkdir(exist_ok=True)
            self._mount("--bind", str(self.data_host), target=self.merged / "data")
            # Name resolution as the host has it (pip reaches PyPI).
            shutil.copy("/etc/resolv.conf", self.merged / "etc/resolv.conf")
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc):
        for target in reversed(self._mounts):
            subprocess.run(["umount", "-R", "-l", str(target)], check=False)
        self._mounts.clear()
        shutil.rmtree(self.work, ignore_errors=True)

    def _mount(self, *args, target: pathlib.Path):
        subprocess.run(["mount", *args, str(target)], check=True)
        self._mounts.append(target)

    def path(self, inside: str) -> pathlib.Path:
        """Where a path of the chroot is, seen from the host."""
        return self.merged / inside.lstrip("/")

    def run(self, *argv, user: str = "user", env: dict | None = None, check: bool = True, timeout: float = 900,
            input: str | None = None) -> subprocess.CompletedProcess:
        """Runs argv inside, as `user` (or root), with a login's environment plus `env`."""
        base = dict(USER_ENV if user == "user" else ROOT_ENV)
        base.update(env or {})
        spec = ["--userspec=1000:1000"] if user == "user" else []
        cmd = ["chroot", *spec, str(self.merged), "/usr/bin/env", "-i",
               *[f"{k}={v}" for k, v in base.items()], *map(str, argv)]
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, input=input,
                           cwd="/")
        if check and p.returncode != 0:
            raise AssertionError(f"{' '.join(map(str, argv))} exited {p.returncode} in the Debian root:\n"
                                 f"--- stdout\n{p.stdout[-4000:]}\n--- stderr\n{p.stderr[-4000:]}")
        return p
