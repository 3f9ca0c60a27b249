"""Start/stop the GCS emulator (gcp-storage-emulator from PyPI, see README.md) for tests.

    from emulator import GcsEmulator
    with GcsEmulator(bucket="ckptio-test") as emu:       # fresh, in memory, on a free 127.0.0.1 port
        emu.url                                           # http://127.0.0.1:PORT (JSON API root)
        emu.upload("dir/a", b"...")                       # raw JSON-API helpers (urllib, no proxy)
        emu.read("dir/a"), emu.metadata("dir/a"), emu.list(prefix="dir/"), emu.delete("dir/a")

The emulator runs as a child process (``emulator_compat.py``), killed with its parent if that dies
(PR_SET_PDEATHSIG), with a fresh temp data dir removed at stop. ``pristine=True`` runs the package
without the compatibility layer (see README.md).
"""
from __future__ import annotations

import ctypes
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid

HERE = os.path.dirname(os.path.abspath(__file__))
EMULATOR_SCRIPT = os.path.join(HERE, "emulator_compat.py")
DEFAULT_PROJECT = "ckptio-test"

# Loopback traffic must never go through an HTTP proxy from the environment.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def _pdeathsig():  # runs in the child between fork and exec
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def spawn(cmd: list[str], **kw) -> subprocess.Popen:
    """Popen whose child dies with us (Linux), in its own process group."""
    return subprocess.Popen(cmd, preexec_fn=_pdeathsig if sys.platform.startswith("linux") else None,
                            start_new_session=True, **kw)


def read_port(proc: subprocess.Popen, timeout: float, what: str) -> int:
    """The first stdout line of a child that prints its port."""
    deadline = time.monotonic() + timeout
    buf = b""
    fd = proc.stdout.fileno()
    while b"\n" not in buf:
        left = deadline - time.monotonic()
        if left <= 0 or proc.poll() is not None:
            raise RuntimeError(f"{what} did not report its port (exit={proc.poll()}, got {buf!r})")
        r, _, _ = select.select([fd], [], [], min(left, 0.2))
        if r:
            chunk = os.read(fd, 4096)
            if not chunk:
                continue
            buf += chunk
    return int(buf.split(b"\n", 1)[0].strip())


def wait_until(condition, what: str, timeout: float = 60, interval: float = 0.02):
    """Polls `condition()` until it returns something true, and returns that. Waits for an event,
    never times anything: `timeout` only ends a test whose event never comes (AssertionError
    naming `what`), so it is generous enough for a loaded machine."""
    deadline = time.monotonic() + timeout
    while True:
        got = condition()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"gave up after {timeout} s waiting for {what}")
        time.sleep(interval)


def http(method: str, url: str, body: bytes | None = None, headers: dict | None = None,
         timeout: float = 30) -> tuple[int, dict, bytes]:
    """One request with urllib (environment proxies ignored); returns (status, headers, body)."""
    req = urllib.request.Request(url, data=body, method=method, headers=headers or {})
    try:
        with _OPENER.open(req, timeout=timeout) as r:
            return r.status, {k.lower(): v for k, v in r.headers.items()}, r.read()
    except urllib.error.HTTPError as e:
        return e.code, {k.lower(): v for k, v in e.headers.items()}, e.read()


def q(name: str) -> str:
    return urllib.parse.quote(name, safe="")


class GcsEmulator:
    def __init__(self, bucket: str = "ckptio-test", project: str = DEFAULT_PROJECT, pristine: bool = False,
                 host: str = "127.0.0.1", port: int = 0, verbose: bool = False, startup_timeout: float = 30):
        self.bucket, self.project, self.pristine = bucket, project, pristine
        self.host, self.port = host, port
        self.verbose, self.startup_timeout = verbose, startup_timeout
        self.proc: subprocess.Popen | None = None
        self.data_dir: str | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> "GcsEmulator":
        self.data_dir = tempfile.mkdtemp(prefix="ckptio-gcs-emulator-")
        cmd = [sys.executable, EMULATOR_SCRIPT, "--host", self.host, "--port", str(self.port),
               "--data-dir", self.data_dir]
        if self.bucket:
            cmd += ["--bucket", self.bucket]
        if self.pristine:
            cmd.append("--pristine")
        if self.verbose:
            cmd.append("--verbose")
        self._stderr = open(os.path.join(self.data_dir, "emulator.log"), "wb")
        self.proc = spawn(cmd, stdout=subprocess.PIPE, stderr=self._stderr, stdin=subprocess.DEVNULL)
        try:
            self.port = read_port(self.proc, self.startup_timeout, "gcs emulator")
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_ready(self):
        deadline = time.monotonic() + self.startup_timeout
        while True:
            try:
                st, _, _ = http("GET", f"{self.url}/storage/v1/b/{self.bucket}" if self.bucket else f"{self.url}/",
                                timeout=2)
                if st == 200:
                    return
            except OSError:
                pass
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise RuntimeError(f"gcs emulator not ready: {self.log_tail()}")
            time.sleep(0.05)

    def log_tail(self, n: int = 4000) -> str:
        try:
            with open(os.path.join(self.data_dir, "emulator.log"), "rb") as f:
                return f.read()[-n:].decode("utf-8", "replace")
        except (OSError, TypeError):
            return ""

    def stop(self):
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.terminate()
                try:
                    self.proc.wait(5)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait(5)
            if self.proc.stdout:
                self.proc.stdout.close()
            self.proc = None
        if getattr(self, "_stderr", None) is not None:
            self._stderr.close()
            self._stderr = None
        if self.data_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)
            self.data_dir = None

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()

    # ---- raw JSON-API helpers (straight to the emulator)
    def create_bucket(self, name: str | None = None) -> str:
        name = name or f"b-{uuid.uuid4().hex[:12]}"
        st, _, body = http("POST", f"{self.url}/storage/v1/b?project={self.project}",
                           json.dumps({"name": name}).encode(), {"Content-Type": "application/json"})
        if st != 200:
            raise RuntimeError(f"create bucket {name}: {st} {body[:200]!r}")
        return name

    def upload(self, name: str, data: bytes, bucket: str | None = None, **params) -> dict:
        qs = urllib.parse.urlencode({"uploadType": "media", "name": name, **params})
        st, _, body = http("POST", f"{self.url}/upload/storage/v1/b/{bucket or self.bucket}/o?{qs}", data,
                           {"Content-Type": "application/octet-stream"})
        if st != 200:
            raise RuntimeError(f"upload {name}: {st} {body[:200]!r}")
        return json.loads(body)

    def read(self, name: str, bucket: str | None = None) -> bytes:
        st, _, body = http("GET", f"{self.url}/storage/v1/b/{bucket or self.bucket}/o/{q(name)}?alt=media")
        if st != 200:
            raise KeyError(f"{name}: {st}")
        return body

    def metadata(self, name: str, bucket: str | None = None) -> dict | None:
        st, _, body = http("GET", f"{self.url}/storage/v1/b/{bucket or self.bucket}/o/{q(name)}")
        return json.loads(body) if st == 200 else None

    def list(self, prefix: str = "", bucket: str | None = None) -> list[str]:
        names, token = [], None
        while True:
            qs = urllib.parse.urlencode({"prefix": prefix, **({"pageToken": token} if token else {})})
            st, _, body = http("GET", f"{self.url}/storage/v1/b/{bucket or self.bucket}/o?{qs}")
            if st != 200:
                raise RuntimeError(f"list: {st} {body[:200]!r}")
            j = json.loads(body)
            names += [i["name"] for i in j.get("items", [])]
            token = j.get("nextPageToken")
            if not token:
                return names

    def delete(self, name: str, bucket: str | None = None) -> int:
        return http("DELETE", f"{self.url}/storage/v1/b/{bucket or self.bucket}/o/{q(name)}")[0]
