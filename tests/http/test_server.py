"""A small HTTP/1.1 server for the HttpClient tests (keep-alive, ranges,
uploads, stalls, resets). Prints its port on the first line of stdout.

  GET  /bytes?n=N          N deterministic bytes (byte i = i*7 % 251); honours Range
  PUT|POST /sink           reads the body; answers {"bytes": n, "sha256": hex}
  GET  /stall?s=S          sends nothing for S seconds, then 200
  GET  /reset              closes the connection with a TCP reset, no response
  GET  /status?code=C      answers with that status and a JSON error body
  GET  /stats              {"connections": accepted, "max_concurrent": peak open}
"""
import hashlib
import json
import socket
import struct
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

LOCK = threading.Lock()
STATS = {"connections": 0, "open": 0, "max_concurrent": 0}


def pattern(n, start=0):
    return bytes(((i * 7) % 251) for i in range(start, start + n))


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def setup(self):
        super().setup()
        with LOCK:
            STATS["connections"] += 1
            STATS["open"] += 1
            STATS["max_concurrent"] = max(STATS["max_concurrent"], STATS["open"])

    def finish(self):
        super().finish()
        with LOCK:
            STATS["open"] -= 1

    def log_message(self, *args):
        pass

    def reply(self, code, body, ctype="application/json", extra=None):
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        for k, v in (extra or {}).items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        url = urlparse(self.path)
        q = {k: v[0] for k, v in parse_qs(url.query).items()}
        if url.path == "/bytes":
            n = int(q["n"])
            rng = self.headers.get("Range")
            if rng:
                a, b = rng.split("=")[1].split("-")
                a, b = int(a), min(int(b), n - 1)
                self.reply(206, pattern(b - a + 1, a), "application/octet-stream",
                           {"Content-Range": f"bytes {a}-{b}/{n}"})
            else:
                self.reply(200, pattern(n), "application/octet-stream")
        elif url.path == "/stall":
            time.sleep(float(q.get("s", "5")))
            self.reply(200, b"{}")
        elif url.path == "/reset":
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.connection.close()
            self.close_connection = True
        elif url.path == "/status":
            code = int(q["code"])
            self.reply(code, json.dumps({"error": {"code": code, "message": f"status {code} as asked"}}).encode())
        elif url.path == "/stats":
            with LOCK:
                self.reply(200, json.dumps(STATS).encode())
        else:
            self.reply(404, b'{"error": {"code": 404, "message": "no such path"}}')

    def do_PUT(self):
        n = int(self.headers.get("Content-Length", "0"))
        h = hashlib.sha256()
        left = n
        while left:
            chunk = self.rfile.read(min(left, 1 << 20))
            if not chunk:
                break
            h.update(chunk)
            left -= len(chunk)
        self.reply(200, json.dumps({"bytes": n - left, "sha256": h.hexdigest(),
                                    "method": self.command}).encode())

    do_POST = do_PUT


def main():
    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    print(server.server_address[1], flush=True)
    server.serve_forever()


if __name__ == "__main__":
    sys.exit(main())
