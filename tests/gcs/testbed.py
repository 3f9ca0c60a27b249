"""Everything a GCS test needs, started and stopped together.

    from testbed import GcsTestbed
    with GcsTestbed() as tb:
        tb.emulator      # emulator.GcsEmulator   (direct: tb.emulator.url)
        tb.proxy         # fault_proxy.FaultProxy in front of it (tb.proxy.url = STORAGE_EMULATOR_HOST)
        tb.tokens        # auth_servers.TokenServer (tb.tokens.sa_key_path, .authorized_user_path, .token_uri)
        tb.metadata      # auth_servers.MetadataServer (tb.metadata.host_port)
        tb.registry      # auth_servers.TokenRegistry shared by both; the proxy's "issued" tokens
        tb.env()         # os.environ + the variables below, for a child process

Variables (see README.md): STORAGE_EMULATOR_HOST, CKPTIO_TEST_EMULATOR, CKPTIO_TEST_PROXY,
CKPTIO_TEST_BUCKET, CKPTIO_TEST_PROJECT, CKPTIO_TEST_TOKEN_URI, CKPTIO_TEST_SA_KEY,
CKPTIO_TEST_AUTHORIZED_USER, CKPTIO_TEST_METADATA_HOST; and, so that nothing can reach real
Google endpoints or the real metadata server: GCE_METADATA_HOST / GCE_METADATA_IP set to the
stand-in, GOOGLE_APPLICATION_CREDENTIALS removed, 127.0.0.1 and localhost added to NO_PROXY.
"""
from __future__ import annotations

import os

from auth_servers import MetadataServer, TokenRegistry, TokenServer
from emulator import DEFAULT_PROJECT, GcsEmulator
from fault_proxy import FaultProxy


def no_proxy_value(current: str | None) -> str:
    items = [x for x in (current or "").split(",") if x.strip()]
    for h in ("127.0.0.1", "localhost"):
        if h not in items:
            items.append(h)
    return ",".join(items)


class GcsTestbed:
    def __init__(self, bucket: str = "ckptio-test", project: str = DEFAULT_PROJECT, pristine: bool = False,
                 token_expires_in: int = 3600):
        self.bucket, self.project = bucket, project
        self.registry = TokenRegistry()
        self.emulator = GcsEmulator(bucket=bucket, project=project, pristine=pristine)
        self.tokens = TokenServer(self.registry, expires_in=token_expires_in, project_id=project)
        self.metadata = MetadataServer(self.registry, expires_in=token_expires_in, project_id=project)
        self.proxy: FaultProxy | None = None
        self._started: list = []

    def start(self) -> "GcsTestbed":
        try:
            self.emulator.start()
            self._started.append(self.emulator)
            self.proxy = FaultProxy(self.emulator.url, token_validator=self.registry.is_valid)
            self.proxy.start()
            self._started.append(self.proxy)
            self.tokens.start()
            self._started.append(self.tokens)
            self.metadata.start()
            self._started.append(self.metadata)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self):
        while self._started:
            s = self._started.pop()
            try:
                s.stop()
            except Exception:  # noqa: BLE001 - keep tearing down the rest
                pass

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()

    def variables(self, metadata_env: bool = True) -> dict[str, str]:
        v = {
            "STORAGE_EMULATOR_HOST": self.proxy.url,
            "CKPTIO_TEST_EMULATOR": self.emulator.url,
            "CKPTIO_TEST_PROXY": self.proxy.url,
            "CKPTIO_TEST_BUCKET": self.bucket,
            "CKPTIO_TEST_PROJECT": self.project,
            "CKPTIO_TEST_TOKEN_URI": self.tokens.token_uri,
            "CKPTIO_TEST_SA_KEY": self.tokens.sa_key_path,
            "CKPTIO_TEST_AUTHORIZED_USER": self.tokens.authorized_user_path,
            "CKPTIO_TEST_METADATA_HOST": self.metadata.host_port,
        }
        if metadata_env:
            v["GCE_METADATA_HOST"] = self.metadata.host_port
            v["GCE_METADATA_IP"] = self.metadata.host_port
        return v

    def env(self, base: dict | None = None, metadata_env: bool = True) -> dict[str, str]:
        env = dict(os.environ if base is None else base)
        env.pop("GOOGLE_APPLICATION_CREDENTIALS", None)
        env.update(self.variables(metadata_env))
        env["NO_PROXY"] = no_proxy_value(env.get("NO_PROXY"))
        env["no_proxy"] = no_proxy_value(env.get("no_proxy"))
        return env
