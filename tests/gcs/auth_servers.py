"""Stand-ins for Google's OAuth2 token endpoint and the GCE metadata server, on 127.0.0.1.

    python tests/gcs/auth_servers.py token [--port 0] [--dir DIR] [--expires-in 3600]
    python tests/gcs/auth_servers.py metadata [--port 0] [--expires-in 3600]

Each prints its port as the first line of stdout (the token server then prints one JSON line with
the paths of the credential files it wrote), and serves until SIGINT/SIGTERM.

TokenServer (``POST /token``):
  * grant_type=urn:ietf:params:oauth:grant-type:jwt-bearer&assertion=JWT: the JWT must be RS256,
    signed with the private key of the service-account JSON file this server generated
    (``sa_key_path``); "kid", if present, must be its private_key_id; claims: iss = client_email,
    aud = token_uri, scope containing an accepted scope, iat not in the future (60 s skew),
    exp > now, exp - iat <= 3600.
  * grant_type=refresh_token with client_id, client_secret, refresh_token of the authorized_user
    JSON file it generated (``authorized_user_path``).
  Answers ``{"access_token", "expires_in", "token_type": "Bearer"}`` or Google's error shape
  ``{"error": "invalid_grant", "error_description": ...}``. Bodies may be form-encoded or JSON.

MetadataServer: ``GET /computeMetadata/v1/instance/service-accounts/default/token`` requires the
header ``Metadata-Flavor: Google`` (403 without) and answers with a token; also ``.../email``,
``.../default/?recursive=true``, ``/computeMetadata/v1/project/project-id`` and ``/`` (a ping).

Both record every request (``requests``: path, grant/kind, ok, reason, status; never a token or a
secret) and issue tokens into a shared ``TokenRegistry`` so the fault proxy can require them
(``FaultProxy(..., token_validator=registry.is_valid)`` and a ``require_bearer: "issued"`` rule).
``fail_next(503, 503)`` makes the next requests fail with those statuses; ``expires_in`` is settable.
"""
from __future__ import annotations

import argparse
import base64
import json
import os
import secrets
import shutil
import signal
import sys
import tempfile
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import padding, rsa

JWT_BEARER = "urn:ietf:params:oauth:grant-type:jwt-bearer"
STORAGE_SCOPES = (
    "https://www.googleapis.com/auth/devstorage.read_write",
    "https://www.googleapis.com/auth/devstorage.full_control",
    "https://www.googleapis.com/auth/devstorage.read_only",
    "https://www.googleapis.com/auth/cloud-platform",
)
# Google documents aud = its token endpoint; google-auth always sends that constant, google-cloud-cpp
# sends the key file's token_uri (the same value in real key files). Both are accepted here.
GOOGLE_TOKEN_AUD = "https://oauth2.googleapis.com/token"
CLOCK_SKEW = 60
MAX_LIFETIME = 3600


def b64url_decode(s: str | bytes) -> bytes:
    if isinstance(s, str):
        s = s.encode()
    return base64.urlsafe_b64decode(s + b"=" * (-len(s) % 4))


def b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def sign_jwt(private_key, claims: dict, header: dict | None = None) -> str:
    """An RS256 JWT (what a correct client sends); tests use it to build good and bad assertions."""
    header = header or {"alg": "RS256", "typ": "JWT"}
    signing_input = b64url(json.dumps(header, separators=(",", ":")).encode()) + "." + \
        b64url(json.dumps(claims, separators=(",", ":")).encode())
    sig = private_key.sign(signing_input.encode(), padding.PKCS1v15(), hashes.SHA256())
    return signing_input + "." + b64url(sig)


class TokenRegistry:
    """Tokens issued by the auth servers, with their expiry; thread-safe."""

    def __init__(self):
        self._lock = threading.Lock()
        self._tokens: dict[str, tuple[float, str]] = {}

    def issue(self, source: str, expires_in: int) -> str:
        tok = "ya29.ckptio-test-" + secrets.token_urlsafe(24)
        with self._lock:
            self._tokens[tok] = (time.time() + expires_in, source)
        return tok

    def is_valid(self, token: str) -> bool:
        with self._lock:
            v = self._tokens.get(token)
        return v is not None and v[0] > time.time()

    def revoke(self, token: str):
        with self._lock:
            self._tokens.pop(token, None)

    def issued(self) -> list[dict]:
        with self._lock:
            return [{"token": t, "expires_at": e, "source": s} for t, (e, s) in self._tokens.items()]

    def tokens(self) -> list[str]:
        with self._lock:
            return list(self._tokens)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    owner: "_AuthServer"

    def log_message(self, format, *args):  # noqa: A002
        pass

    def _body(self) -> bytes:
        n = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(n) if n else b""

    def send(self, status: int, body, content_type="application/json", extra: dict | None = None):
        data = json.dumps(body).encode() if isinstance(body, (dict, list)) else (body or "").encode()
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        for k, v in (extra or {}).items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(data)

    def _dispatch(self, method: str):
        body = self._body() if method == "POST" else b""
        self.owner._serve(self, method, body)

    def do_GET(self):
        self._dispatch("GET")

    def do_POST(self):
        self._dispatch("POST")


class _AuthServer:
    kind = "auth"

    def __init__(self, registry: TokenRegistry | None = None, host: str = "127.0.0.1", port: int = 0,
                 expires_in: int = 3600):
        if host not in ("127.0.0.1", "localhost", "::1"):
            raise ValueError("test servers listen on loopback only")
        self.registry = registry or TokenRegistry()
        self.host, self.port = host, port
        self.expires_in = expires_in
        self.requests: list[dict] = []
        self._lock = threading.Lock()
        self._fail: list[int] = []
        self.delay_s = 0.0
        self._httpd: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def count(self) -> int:
        with self._lock:
            return len(self.requests)

    @property
    def failures(self) -> list[str]:
        with self._lock:
            return [r["reason"] for r in self.requests if not r["ok"]]

    def fail_next(self, *statuses: int):
        """The next len(statuses) token requests answer with these HTTP statuses."""
        with self._lock:
            self._fail.extend(statuses)

    def reset(self):
        with self._lock:
            self.requests.clear()
            self._fail.clear()

    def _record(self, **kw) -> dict:
        kw.setdefault("time", time.time())
        with self._lock:
            self.requests.append(kw)
        return kw

    def _take_failure(self) -> int | None:
        with self._lock:
            return self._fail.pop(0) if self._fail else None

    def _serve(self, h: _Handler, method: str, body: bytes):
        raise NotImplementedError

    def start(self):
        handler = type("Handler", (_Handler,), {"owner": self})
        self._httpd = ThreadingHTTPServer((self.host, self.port), handler)
        self._httpd.daemon_threads = True
        self.port = self._httpd.server_address[1]
        self._thread = threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.1},
                                        name=f"{self.kind}-server", daemon=True)
        self._thread.start()
        return self

    def stop(self):
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._httpd = None
        if self._thread is not None:
            self._thread.join(5)
            self._thread = None

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()


class TokenServer(_AuthServer):
    kind = "token"

    def __init__(self, registry: TokenRegistry | None = None, host: str = "127.0.0.1", port: int = 0,
                 expires_in: int = 3600, key_dir: str | None = None, project_id: str = "ckptio-test",
                 accepted_scopes: tuple[str, ...] | None = STORAGE_SCOPES):
        super().__init__(registry, host, port, expires_in)
        self.project_id = project_id
        self.client_email = f"ckptio-test@{project_id}.iam.gserviceaccount.com"
        self.accepted_scopes = accepted_scopes
        self._own_dir = key_dir is None
        self.key_dir = key_dir or tempfile.mkdtemp(prefix="ckptio-auth-")
        self.private_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        self.public_key = self.private_key.public_key()
        self.private_key_id = secrets.token_hex(20)
        self.client_id = "".join(str(secrets.randbelow(10)) for _ in range(21))
        self.user_client_id = secrets.token_hex(8) + ".apps.googleusercontent.com"
        self.user_client_secret = "GOCSPX-" + secrets.token_urlsafe(18)
        self.refresh_token = "1//ckptio-test-" + secrets.token_urlsafe(30)
        self.sa_key_path = os.path.join(self.key_dir, "service_account.json")
        self.authorized_user_path = os.path.join(self.key_dir, "authorized_user.json")

    @property
    def token_uri(self) -> str:
        return f"{self.url}/token"

    def private_key_pem(self) -> str:
        return self.private_key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                              serialization.NoEncryption()).decode()

    def start(self):
        super().start()
        sa = {"type": "service_account", "project_id": self.project_id, "private_key_id": self.private_key_id,
              "private_key": self.private_key_pem(), "client_email": self.client_email,
              "client_id": self.client_id, "token_uri": self.token_uri, "universe_domain": "googleapis.com"}
        au = {"type": "authorized_user", "client_id": self.user_client_id,
              "client_secret": self.user_client_secret, "refresh_token": self.refresh_token,
              "token_uri": self.token_uri, "universe_domain": "googleapis.com"}
        for path, data in ((self.sa_key_path, sa), (self.authorized_user_path, au)):
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                json.dump(data, f, indent=2)
        return self

    def stop(self):
        super().stop()
        if self._own_dir:
            shutil.rmtree(self.key_dir, ignore_errors=True)

    def make_assertion(self, key=None, header: dict | None = None, **claim_overrides) -> str:
        """A JWT assertion as a correct client would build it; override claims/key to make bad ones.
        A claim set to None is left out."""
        now = int(time.time())
        claims = {"iss": self.client_email, "scope": STORAGE_SCOPES[0], "aud": self.token_uri,
                  "iat": now, "exp": now + 3600}
        claims.update(claim_overrides)
        claims = {k: v for k, v in claims.items() if v is not None}
        hdr = header or {"alg": "RS256", "typ": "JWT", "kid": self.private_key_id}
        return sign_jwt(key or self.private_key, claims, hdr)

    # ---- request handling
    def _serve(self, h: _Handler, method: str, body: bytes):
        path = urllib.parse.urlsplit(h.path).path
        if self.delay_s:
            time.sleep(self.delay_s)
        if method != "POST" or path != "/token":
            self._record(path=path, grant_type=None, ok=False, reason=f"no such endpoint {method} {path}", status=404)
            h.send(404, {"error": "not_found", "error_description": f"{method} {path}"})
            return
        ctype = (h.headers.get("Content-Type") or "").split(";")[0].strip().lower()
        try:
            if ctype == "application/json":
                form = {k: str(v) for k, v in json.loads(body or b"{}").items()}
            else:
                form = {k: v[0] for k, v in urllib.parse.parse_qs(body.decode(), keep_blank_values=True).items()}
        except (ValueError, UnicodeDecodeError, AttributeError):
            form = {}
        grant = form.get("grant_type")
        forced = self._take_failure()
        if forced is not None:
            self._record(path=path, grant_type=grant, ok=False, reason=f"injected {forced}", status=forced)
            h.send(forced, {"error": "internal_failure", "error_description": f"injected failure {forced}"})
            return
        if grant == JWT_BEARER:
            reason = self._check_jwt(form.get("assertion") or "")
            source = "jwt-bearer"
        elif grant == "refresh_token":
            reason = self._check_refresh(form)
            source = "refresh_token"
        else:
            reason = f"unsupported grant_type {grant!r}"
            source = None
        if reason is not None:
            status = 401 if reason.startswith("invalid_client") else 400
            err = "invalid_client" if status == 401 else ("unsupported_grant_type" if source is None else "invalid_grant")
            self._record(path=path, grant_type=grant, ok=False, reason=reason, status=status)
            h.send(status, {"error": err, "error_description": reason})
            return
        tok = self.registry.issue(source, self.expires_in)
        self._record(path=path, grant_type=grant, ok=True, reason=None, status=200)
        out = {"access_token": tok, "expires_in": self.expires_in, "token_type": "Bearer"}
        if source == "refresh_token":
            out["scope"] = STORAGE_SCOPES[0]
        h.send(200, out, extra={"Cache-Control": "no-cache, no-store, max-age=0, must-revalidate"})

    def _check_refresh(self, form: dict) -> str | None:
        if form.get("client_id") != self.user_client_id or form.get("client_secret") != self.user_client_secret:
            return "invalid_client: The OAuth client was not found."
        if form.get("refresh_token") != self.refresh_token:
            return "Bad Request: unknown refresh_token"
        return None

    def _check_jwt(self, assertion: str) -> str | None:
        parts = assertion.split(".")
        if len(parts) != 3:
            return "Invalid JWT: not three dot-separated parts"
        try:
            header = json.loads(b64url_decode(parts[0]))
            claims = json.loads(b64url_decode(parts[1]))
            sig = b64url_decode(parts[2])
        except (ValueError, UnicodeDecodeError):
            return "Invalid JWT: bad base64url or JSON"
        if not isinstance(header, dict) or not isinstance(claims, dict):
            return "Invalid JWT: header/claims not objects"
        if header.get("alg") != "RS256":
            return f"Invalid JWT: alg {header.get('alg')!r}, want RS256"
        if "kid" in header and header["kid"] != self.private_key_id:
            return "Invalid JWT Signature: kid is not the key's private_key_id"
        try:
            self.public_key.verify(sig, (parts[0] + "." + parts[1]).encode(), padding.PKCS1v15(), hashes.SHA256())
        except InvalidSignature:
            return "Invalid JWT Signature."
        if claims.get("iss") != self.client_email:
            return f"Invalid JWT: iss {claims.get('iss')!r} is not the service account's client_email"
        if claims.get("aud") not in (self.token_uri, GOOGLE_TOKEN_AUD):
            return f"Invalid JWT: aud {claims.get('aud')!r}, want {GOOGLE_TOKEN_AUD!r} or the token_uri"
        scope = claims.get("scope")
        if not isinstance(scope, str) or not scope.strip():
            return "Invalid JWT: missing scope"
        if self.accepted_scopes is not None and not set(scope.split()) & set(self.accepted_scopes):
            return f"Invalid JWT: scope {scope!r} grants no storage access"
        iat, exp = claims.get("iat"), claims.get("exp")
        if not isinstance(iat, (int, float)) or not isinstance(exp, (int, float)):
            return "Invalid JWT: iat/exp missing or not numbers"
        now = time.time()
        if iat > now + CLOCK_SKEW:
            return "Invalid JWT: iat is in the future. Check your iat and exp values in the JWT claim."
        if exp <= now:
            return "Invalid JWT: Token must be a short-lived token (60 minutes) and in a reasonable timeframe. " \
                   "Check your iat and exp values in the JWT claim. (expired)"
        if exp <= iat or exp - iat > MAX_LIFETIME:
            return "Invalid JWT: Token must be a short-lived token (60 minutes) and in a reasonable timeframe. " \
                   "Check your iat and exp values in the JWT claim. (lifetime)"
        return None


class MetadataServer(_AuthServer):
    kind = "metadata"
    TOKEN_PATH = "/computeMetadata/v1/instance/service-accounts/default/token"

    def __init__(self, registry: TokenRegistry | None = None, host: str = "127.0.0.1", port: int = 0,
                 expires_in: int = 3600, project_id: str = "ckptio-test",
                 email: str = "ckptio-test-compute@developer.gserviceaccount.com"):
        super().__init__(registry, host, port, expires_in)
        self.project_id, self.email = project_id, email

    @property
    def host_port(self) -> str:
        """The value for GCE_METADATA_HOST."""
        return f"{self.host}:{self.port}"

    def _serve(self, h: _Handler, method: str, body: bytes):
        u = urllib.parse.urlsplit(h.path)
        path = u.path
        flavor = {"Metadata-Flavor": "Google"}
        if self.delay_s:
            time.sleep(self.delay_s)
        if path == "/" or path == "":
            self._record(path=path, kind="ping", ok=True, reason=None, status=200)
            h.send(200, "", content_type="application/text", extra=flavor)
            return
        if (h.headers.get("Metadata-Flavor") or "") != "Google":
            self._record(path=path, kind="token" if path == self.TOKEN_PATH else "other", ok=False,
                         reason="missing Metadata-Flavor: Google header", status=403)
            h.send(403, "Missing required header: Metadata-Flavor: Google\n", content_type="text/plain", extra=flavor)
            return
        if method != "GET":
            self._record(path=path, kind="other", ok=False, reason=f"method {method}", status=405)
            h.send(405, "Method not allowed\n", content_type="text/plain", extra=flavor)
            return
        forced = self._take_failure()
        if forced is not None:
            self._record(path=path, kind="token", ok=False, reason=f"injected {forced}", status=forced)
            h.send(forced, f"injected failure {forced}\n", content_type="text/plain", extra=flavor)
            return
        base = "/computeMetadata/v1/instance/service-accounts/default"
        if path == self.TOKEN_PATH:
            tok = self.registry.issue("metadata", self.expires_in)
            self._record(path=path, kind="token", ok=True, reason=None, status=200)
            h.send(200, {"access_token": tok, "expires_in": self.expires_in, "token_type": "Bearer"}, extra=flavor)
        elif path == base + "/email":
            self._record(path=path, kind="email", ok=True, reason=None, status=200)
            h.send(200, self.email, content_type="application/text", extra=flavor)
        elif path in (base, base + "/"):
            self._record(path=path, kind="info", ok=True, reason=None, status=200)
            h.send(200, {"aliases": ["default"], "email": self.email, "scopes": list(STORAGE_SCOPES[-1:])},
                   extra=flavor)
        elif path == "/computeMetadata/v1/project/project-id":
            self._record(path=path, kind="project", ok=True, reason=None, status=200)
            h.send(200, self.project_id, content_type="application/text", extra=flavor)
        else:
            self._record(path=path, kind="other", ok=False, reason="not found", status=404)
            h.send(404, "Not Found\n", content_type="text/plain", extra=flavor)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="OAuth2 token endpoint / GCE metadata server stand-ins")
    ap.add_argument("which", choices=("token", "metadata"))
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--dir", default=None, help="token: where to write the credential files (default: temp)")
    ap.add_argument("--expires-in", type=int, default=3600)
    a = ap.parse_args(argv)
    if a.which == "token":
        srv = TokenServer(port=a.port, expires_in=a.expires_in, key_dir=a.dir)
    else:
        srv = MetadataServer(port=a.port, expires_in=a.expires_in)
    srv.start()
    print(srv.port, flush=True)
    if isinstance(srv, TokenServer):
        print(json.dumps({"token_uri": srv.token_uri, "service_account": srv.sa_key_path,
                          "authorized_user": srv.authorized_user_path}), flush=True)
    else:
        print(json.dumps({"GCE_METADATA_HOST": srv.host_port}), flush=True)
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    signal.signal(signal.SIGINT, lambda *_: done.set())
    done.wait()
    srv.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
