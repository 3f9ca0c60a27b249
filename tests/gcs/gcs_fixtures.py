"""pytest fixtures for GCS tests: import them into a conftest.py.

    # tests/<dir>/conftest.py
    import sys, pathlib
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "gcs"))
    from gcs_fixtures import *  # noqa: F401,F403

Session-wide (started once, stopped at the end of the session):
    gcs_testbed     testbed.GcsTestbed: emulator + fault proxy + token server + metadata server
    gcs_emulator    emulator.GcsEmulator  (.url direct, .bucket, raw helpers .upload/.read/.list/...)
    gcs_auth        the testbed (for .tokens, .metadata, .registry)
Per test:
    gcs_proxy       fault_proxy.FaultProxy, rules/log/settings reset before and after the test
    gcs_bucket      a fresh, empty bucket name in the emulator
    gcs_env         os.environ + the with_gcs.py variables (CKPTIO_TEST_BUCKET = gcs_bucket), for
                    subprocess.run(..., env=gcs_env)
    gcs_client      google.cloud.storage.Client talking through the proxy (anonymous)
    gcs_direct_client  the same, straight to the emulator
"""
from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from testbed import GcsTestbed, no_proxy_value  # noqa: E402

__all__ = ["gcs_testbed", "gcs_emulator", "gcs_auth", "gcs_proxy", "gcs_bucket", "gcs_env", "gcs_client",
           "gcs_direct_client", "storage_client"]


def storage_client(endpoint: str, project: str = "ckptio-test"):
    """An anonymous google-cloud-storage client for an emulator/proxy URL."""
    from google.auth.credentials import AnonymousCredentials
    from google.cloud import storage

    return storage.Client(project=project, credentials=AnonymousCredentials(),
                          client_options={"api_endpoint": endpoint})


@pytest.fixture(scope="session")
def gcs_testbed():
    for k in ("NO_PROXY", "no_proxy"):  # the Google client (requests) honours *_proxy variables
        os.environ[k] = no_proxy_value(os.environ.get(k))
    with GcsTestbed() as tb:
        yield tb


@pytest.fixture(scope="session")
def gcs_emulator(gcs_testbed):
    return gcs_testbed.emulator


@pytest.fixture(scope="session")
def gcs_auth(gcs_testbed):
    return gcs_testbed


@pytest.fixture
def gcs_proxy(gcs_testbed):
    gcs_testbed.proxy.reset()
    gcs_testbed.tokens.reset()
    gcs_testbed.metadata.reset()
    yield gcs_testbed.proxy
    gcs_testbed.proxy.reset()


@pytest.fixture
def gcs_bucket(gcs_emulator):
    return gcs_emulator.create_bucket()


@pytest.fixture
def gcs_env(gcs_testbed, gcs_proxy, gcs_bucket):
    env = gcs_testbed.env()
    env["CKPTIO_TEST_BUCKET"] = gcs_bucket
    return env


@pytest.fixture
def gcs_client(gcs_testbed, gcs_proxy):
    return storage_client(gcs_proxy.url, gcs_testbed.project)


@pytest.fixture
def gcs_direct_client(gcs_testbed):
    return storage_client(gcs_testbed.emulator.url, gcs_testbed.project)
