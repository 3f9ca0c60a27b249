"""Self-tests of auth_servers.py: the token endpoint and metadata server stand-ins."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.parse

import pytest
from cryptography.hazmat.primitives.asymmetric import rsa

from auth_servers import JWT_BEARER, MetadataServer, TokenRegistry, TokenServer
from emulator import http, read_port, spawn

HERE = os.path.dirname(os.path.abspath(__file__))


def post_form(url: str, form: dict) -> tuple[int, dict]:
    st, _, body = http("POST", url, urllib.parse.urlencode(form).encode(),
                       {"Content-Type": "application/x-www-form-urlencoded"})
    return st, json.loads(body)


@pytest.fixture
def token_server(gcs_auth):
    ts = gcs_auth.tokens
    ts.reset()
    saved = ts.expires_in
    yield ts
    ts.expires_in = saved
    ts.reset()


def test_generated_credential_files(token_server):
    sa = json.load(open(token_server.sa_key_path))
    assert sa["type"] == "service_account" and sa["token_uri"] == token_server.token_uri
    assert sa["private_key"].startswith("-----BEGIN PRIVATE KEY-----")  # PKCS#8
    assert {"project_id", "private_key_id", "client_email"} <= set(sa)
    au = json.load(open(token_server.authorized_user_path))
    assert au["type"] == "authorized_user" and {"client_id", "client_secret", "refresh_token"} <= set(au)
    assert oct(os.stat(token_server.sa_key_path).st_mode & 0o777) == "0o600"


def test_correct_jwt_gets_a_token(token_server):
    token_server.expires_in = 1234
    st, out = post_form(token_server.token_uri, {"grant_type": JWT_BEARER, "assertion": token_server.make_assertion()})
    assert st == 200 and out["token_type"] == "Bearer" and out["expires_in"] == 1234
    assert token_server.registry.is_valid(out["access_token"])
    assert token_server.count == 1 and token_server.failures == []


@pytest.mark.parametrize("kind, reason", [
    ("bad_signature", "Invalid JWT Signature"),
    ("expired", "expired"),
    ("wrong_iss", "iss"),
    ("wrong_aud", "aud"),
    ("future_iat", "iat is in the future"),
    ("too_long", "lifetime"),
    ("no_scope", "missing scope"),
    ("other_scope", "grants no storage access"),
    ("alg_none", "alg"),
    ("wrong_kid", "kid"),
    ("garbage", "three"),
])
def test_bad_jwts_are_rejected_with_reason(token_server, kind, reason):
    now = int(time.time())
    ts = token_server
    if kind == "bad_signature":
        other = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        a = ts.make_assertion(key=other)
    elif kind == "expired":
        a = ts.make_assertion(iat=now - 4000, exp=now - 400)
    elif kind == "wrong_iss":
        a = ts.make_assertion(iss="someone@else.iam.gserviceaccount.com")
    elif kind == "wrong_aud":
        a = ts.make_assertion(aud="https://example.invalid/token")
    elif kind == "future_iat":
        a = ts.make_assertion(iat=now + 600, exp=now + 1200)
    elif kind == "too_long":
        a = ts.make_assertion(exp=now + 7200)
    elif kind == "no_scope":
        a = ts.make_assertion(scope=None)
    elif kind == "other_scope":
        a = ts.make_assertion(scope="https://www.googleapis.com/auth/bigquery")
    elif kind == "alg_none":
        a = ts.make_assertion(header={"alg": "none", "typ": "JWT"})
    elif kind == "wrong_kid":
        a = ts.make_assertion(header={"alg": "RS256", "typ": "JWT", "kid": "0" * 40})
    else:
        a = "not-a-jwt"
    issued_before = len(ts.registry.tokens())
    st, out = post_form(ts.token_uri, {"grant_type": JWT_BEARER, "assertion": a})
    assert st == 400 and out["error"] == "invalid_grant" and reason in out["error_description"]
    assert len(ts.failures) == 1 and reason in ts.failures[0]
    assert len(ts.registry.tokens()) == issued_before


def test_refresh_token_grant(token_server):
    au = json.load(open(token_server.authorized_user_path))
    form = {"grant_type": "refresh_token", "client_id": au["client_id"], "client_secret": au["client_secret"],
            "refresh_token": au["refresh_token"]}
    st, out = post_form(token_server.token_uri, form)
    assert st == 200 and token_server.registry.is_valid(out["access_token"])
    st, out = post_form(token_server.token_uri, {**form, "client_secret": "wrong"})
    assert st == 401 and out["error"] == "invalid_client"
    st, out = post_form(token_server.token_uri, {**form, "refresh_token": "wrong"})
    assert st == 400 and out["error"] == "invalid_grant"
    st, out = post_form(token_server.token_uri, {"grant_type": "password"})
    assert st == 400 and out["error"] == "unsupported_grant_type"
    assert token_server.count == 4 and len(token_server.failures) == 3


def test_injected_failures_then_success(token_server):
    token_server.fail_next(503, 500)
    form = {"grant_type": JWT_BEARER, "assertion": token_server.make_assertion()}
    assert post_form(token_server.token_uri, form)[0] == 503
    assert post_form(token_server.token_uri, form)[0] == 500
    assert post_form(token_server.token_uri, form)[0] == 200
    assert token_server.failures == ["injected 503", "injected 500"]


def test_official_google_auth_clients_against_token_server(token_server):
    """google-auth (what Google's own libraries use) gets tokens from the stand-in."""
    import google.auth.transport.requests as gtr
    from google.oauth2 import credentials as user_creds
    from google.oauth2 import service_account

    sa = service_account.Credentials.from_service_account_file(
        token_server.sa_key_path, scopes=["https://www.googleapis.com/auth/devstorage.read_write"])
    sa.refresh(gtr.Request())
    assert token_server.registry.is_valid(sa.token)
    # google-auth ignores token_uri in authorized_user files (always uses Google's): point it here
    u = user_creds.Credentials.from_authorized_user_file(token_server.authorized_user_path)
    u = u.with_token_uri(token_server.token_uri)
    u.refresh(gtr.Request())
    assert token_server.registry.is_valid(u.token)
    assert token_server.failures == []


def test_metadata_server_requires_flavor_header(gcs_auth):
    ms = gcs_auth.metadata
    ms.reset()
    url = f"{ms.url}{MetadataServer.TOKEN_PATH}"
    st, h, body = http("GET", url)
    assert st == 403 and h["metadata-flavor"] == "Google"
    st, h, body = http("GET", url, headers={"Metadata-Flavor": "Wrong"})
    assert st == 403
    st, h, body = http("GET", url, headers={"Metadata-Flavor": "Google"})
    out = json.loads(body)
    assert st == 200 and out["token_type"] == "Bearer" and out["expires_in"] == ms.expires_in
    assert gcs_auth.registry.is_valid(out["access_token"])
    assert [r["ok"] for r in ms.requests] == [False, False, True]
    assert ms.failures == ["missing Metadata-Flavor: Google header"] * 2


def test_official_google_auth_compute_engine_against_metadata_server(gcs_auth):
    ms = gcs_auth.metadata
    code = ("import google.auth.compute_engine as ce, google.auth.transport.requests as r\n"
            "c = ce.Credentials(); c.refresh(r.Request()); print(c.token)")
    env = dict(os.environ, GCE_METADATA_HOST=ms.host_port, GCE_METADATA_IP=ms.host_port)
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert gcs_auth.registry.is_valid(p.stdout.strip())


def test_issued_tokens_open_the_proxy(gcs_auth, gcs_proxy, gcs_bucket):
    from probe_emulator import Raw

    gcs_proxy.set_rules([{"require_bearer": "issued"}])
    st, out = post_form(gcs_auth.tokens.token_uri,
                        {"grant_type": JWT_BEARER, "assertion": gcs_auth.tokens.make_assertion()})
    raw = Raw(gcs_proxy.url)
    path = f"/storage/v1/b/{gcs_bucket}/o"
    assert raw.request("GET", path, headers={"Authorization": f"Bearer {out['access_token']}"})[0] == 200
    assert raw.request("GET", path, headers={"Authorization": "Bearer ya29.forged"})[0] == 401
    assert [e["bearer_ok"] for e in gcs_proxy.log()] == [True, False]


def test_standalone_and_context_manager():
    with TokenServer(TokenRegistry(), expires_in=5) as ts:
        assert os.path.exists(ts.sa_key_path)
        st, out = post_form(ts.token_uri, {"grant_type": JWT_BEARER, "assertion": ts.make_assertion()})
        assert st == 200 and out["expires_in"] == 5
    assert not os.path.exists(ts.sa_key_path)  # its temp dir is removed at stop
    for which in ("token", "metadata"):
        p = spawn([sys.executable, os.path.join(HERE, "auth_servers.py"), which, "--port", "0"],
                  stdout=subprocess.PIPE, stdin=subprocess.DEVNULL)
        try:
            port = read_port(p, 20, which)
            st, _, _ = http("GET", f"http://127.0.0.1:{port}/")
            assert st in (200, 404)
        finally:
            p.terminate()
            p.wait(10)
            p.stdout.close()
