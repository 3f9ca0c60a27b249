"""Secrets never leak: every GCS path, run with a service-account key, an
authorized-user refresh token and the metadata server, through successes and
failures, with tracing on and a secret header in the config: no access token,
key, refresh token or client secret appears in any output line, error message,
trace file or config dump."""
import json
import os
import socket

import pytest
from safetensors.numpy import save_file
import numpy as np

SECRET_HEADER = "Bearer header-secret-0123456789"
# A credential under a header name that says nothing about secrets.
INNOCENT_NAMED_HEADER = ("X-Upstream", "Bearer upstream-secret-9876543210")


def secrets_of(testbed):
    out = list(testbed.registry.tokens())
    sa = json.load(open(testbed.tokens.sa_key_path))
    key_lines = [l for l in sa["private_key"].splitlines() if l and not l.startswith("-----")]
    out += key_lines
    au = json.load(open(testbed.tokens.authorized_user_path))
    out += [au["refresh_token"], au["client_secret"]]
    out.append(SECRET_HEADER.split()[1])
    out.append(INNOCENT_NAMED_HEADER[1].split()[1])
    return [s for s in out if len(s) >= 8]


def env_for(gcs_env, creds):
    env = dict(gcs_env)
    env.pop("STORAGE_EMULATOR_HOST", None)  # an emulator means "no credentials": use real ones
    env.pop("GOOGLE_APPLICATION_CREDENTIALS", None)
    if creds != "metadata":
        env["GOOGLE_APPLICATION_CREDENTIALS"] = creds
    return env


@pytest.mark.parametrize("kind", ["service_account", "authorized_user", "metadata"])
def test_no_secret_reaches_output_errors_traces_or_config(kind, tmp_path, run, gcs_env, gcs_auth, gcs_proxy,
                                                          gcs_bucket):
    creds = {"service_account": gcs_auth.tokens.sa_key_path,
             "authorized_user": gcs_auth.tokens.authorized_user_path,
             "metadata": "metadata"}[kind]
    env = env_for(gcs_env, creds)
    trace = tmp_path / "trace.json"
    config = tmp_path / "c.json"
    config.write_text(json.dumps({
        "gcs": {"endpoint": gcs_proxy.url, "allow_http_credentials": True, "chunk_size": "256KiB",
                "headers": {"Authorization-Extra": SECRET_HEADER, INNOCENT_NAMED_HEADER[0]: INNOCENT_NAMED_HEADER[1]},
                "retry": {"max_attempts": 2, "initial_backoff": "1ms", "max_backoff": "5ms"}},
        "trace": {"path": str(trace)}}))
    data = tmp_path / "in.safetensors"
    save_file({"w": np.arange(300_000, dtype=np.float32)}, str(data))
    root = f"gs://{gcs_bucket}/secret-{kind}"
    outputs = []

    def ckptio(*args):
        p = run(*args, "--config", config, check=False, env=env)
        outputs.extend([p.stdout, p.stderr])
        return p

    gcs_proxy.settings(require_bearer="issued")
    assert ckptio("save", root, "--step", 1, "--from", data).returncode == 0
    assert ckptio("ls", root).returncode == 0
    assert ckptio("verify", root).returncode == 0
    assert ckptio("export", root, "--out", tmp_path / "out.safetensors").returncode == 0
    # Failures: the server refuses every token; a 403 with a message; retries exhausted.
    gcs_proxy.set_rules([{"method": "PUT", "status": 401}])
    assert ckptio("save", root, "--step", 2, "--from", data).returncode != 0
    gcs_proxy.set_rules([{"method": "GET", "status": 403, "message": "denied"}])
    assert ckptio("verify", root).returncode != 0
    gcs_proxy.set_rules([{"method": "POST", "status": 503}])
    assert ckptio("save", root, "--step", 3, "--from", data).returncode != 0
    # A server whose error echoes the request, Authorization header and all.
    gcs_proxy.set_rules([{"method": "GET", "status": 400, "message": "Invalid argument",
                          "echo_request_headers": True}])
    echoed = ckptio("ls", root)
    assert echoed.returncode != 0 and "you sent:" in echoed.stderr and "Bearer <redacted>" in echoed.stderr
    gcs_proxy.set_rules([])
    show = ckptio("config", "show")
    assert show.returncode == 0 and "Authorization-Extra" in show.stdout and INNOCENT_NAMED_HEADER[0] in show.stdout
    assert trace.exists()
    outputs.append(trace.read_text())

    found = secrets_of(gcs_auth)
    assert gcs_auth.registry.tokens()  # tokens were really issued and used
    text = "\n".join(outputs)
    for secret in found:
        assert secret not in text, f"a secret leaked ({secret[:4]}...)"
    # The proxy saw the real header on the wire (it was sent, just never printed).
    assert any(e.get("bearer_ok") for e in gcs_proxy.log())


def test_a_token_goes_to_a_plain_http_endpoint_only_with_the_opt_in(tmp_path, run, gcs_env, gcs_auth, gcs_proxy,
                                                                    gcs_bucket):
    env = env_for(gcs_env, gcs_auth.tokens.sa_key_path)
    config = tmp_path / "c.json"
    root = f"gs://{gcs_bucket}/plain-http"
    issued = len(gcs_auth.registry.tokens())
    config.write_text(json.dumps({"gcs": {"endpoint": gcs_proxy.url}}))
    refused = run("ls", root, "--config", config, check=False, env=env)
    assert refused.returncode != 0
    assert f"over plain http to {gcs_proxy.url}" in refused.stderr
    assert "gcs.allow_http_credentials" in refused.stderr and root in refused.stderr
    assert gcs_proxy.log() == [] and len(gcs_auth.registry.tokens()) == issued  # no token fetched, none sent
    config.write_text(json.dumps({"gcs": {"endpoint": gcs_proxy.url, "allow_http_credentials": True}}))
    assert run("ls", root, "--config", config, env=env).returncode == 0
    assert gcs_proxy.log() and all(e["authorization"] == "Bearer" for e in gcs_proxy.log())


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_without_credentials_the_error_names_every_source_tried(tmp_path, run, gcs_env, gcs_bucket):
    env = env_for(gcs_env, "metadata")  # no emulator, no key file: the metadata server is the last resort
    host = f"127.0.0.1:{closed_port()}"  # and nothing answers there
    env["GCE_METADATA_HOST"] = host
    env.pop("GCE_METADATA_IP", None)
    config = tmp_path / "c.json"
    config.write_text(json.dumps({"gcs": {"retry": {"max_attempts": 1}}}))
    root = f"gs://{gcs_bucket}/nocreds"
    p = run("ls", root, "--config", config, check=False, env=env)
    assert p.returncode != 0
    assert root in p.stderr and f"metadata server {host}" in p.stderr
    for source in ("STORAGE_EMULATOR_HOST", "GOOGLE_APPLICATION_CREDENTIALS", "GCE_METADATA_HOST"):
        assert source in p.stderr, source
