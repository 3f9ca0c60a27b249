"""A GCS endpoint (or metadata server) that accepts connections and never
answers: a metadata operation ends at gcs.retry.deadline, a stalled attempt
is cut by gcs.timeouts.stall. Checked by what the server saw and what the
error says, never by the time it took."""
import json
import socket
import threading

import pytest


class SilentServer:
    """Accepts connections on 127.0.0.1, reads what comes, never answers."""

    def __init__(self):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.connections = 0
        self.held = []
        self.lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with self.lock:
                self.connections += 1
                self.held.append(conn)  # kept open, never written to
            threading.Thread(target=self._drain, args=(conn,), daemon=True).start()

    @staticmethod
    def _drain(conn):
        try:
            while conn.recv(65536):
                pass
        except OSError:
            pass

    def close(self):
        self.sock.close()
        with self.lock:
            for c in self.held:
                c.close()


@pytest.fixture
def silent():
    s = SilentServer()
    yield s
    s.close()


def config_file(tmp_path, gcs):
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"gcs": gcs}))
    return path


def test_ls_of_an_endpoint_that_never_answers_ends_at_gcs_retry_deadline(tmp_path, run, gcs_env, gcs_bucket, silent):
    env = dict(gcs_env, STORAGE_EMULATOR_HOST=silent.url)
    # The stall timeout (60 s by default) would end an attempt long after the deadline.
    config = config_file(tmp_path, {"retry": {"deadline": "2s"}})
    root = f"gs://{gcs_bucket}/never"
    p = run("ls", root, "--config", config, check=False, env=env)
    assert p.returncode != 0
    assert f"list {root}/: GET {silent.url}/storage/v1/b/{gcs_bucket}/o: not done within its time limit" in p.stderr
    assert "gcs.retry.deadline 2000 ms reached" in p.stderr
    assert "stalled" not in p.stderr
    assert silent.connections == 1  # the one attempt had the whole deadline


def test_a_token_fetch_from_a_metadata_server_that_never_answers_ends_at_gcs_retry_deadline(tmp_path, run, gcs_env,
                                                                                             gcs_bucket, silent):
    env = dict(gcs_env, GCE_METADATA_HOST=f"127.0.0.1:{silent.port}")
    for name in ("STORAGE_EMULATOR_HOST", "GOOGLE_APPLICATION_CREDENTIALS", "GCE_METADATA_IP"):
        env.pop(name, None)
    config = config_file(tmp_path, {"retry": {"deadline": "2s"}})
    root = f"gs://{gcs_bucket}/never"
    p = run("ls", root, "--config", config, check=False, env=env)
    assert p.returncode != 0
    assert f"list {root}/: cannot authenticate to GCS" in p.stderr
    assert (f"GET {silent.url}/computeMetadata/v1/instance/service-accounts/default/token: "
            "not done within its time limit") in p.stderr
    assert "gcs.retry.deadline 2000 ms reached" in p.stderr
    assert silent.connections == 1


def test_a_stalled_request_is_cut_by_gcs_timeouts_stall_and_retried(tmp_path, run, gcs_env, gcs_bucket, silent):
    env = dict(gcs_env, STORAGE_EMULATOR_HOST=silent.url)
    config = config_file(tmp_path, {"timeouts": {"stall": "1s"},
                                    "retry": {"max_attempts": 3, "initial_backoff": "1ms", "deadline": "10m"}})
    root = f"gs://{gcs_bucket}/stalled"
    p = run("ls", root, "--config", config, check=False, env=env)
    assert p.returncode != 0
    assert f"list {root}/: GET {silent.url}/storage/v1/b/{gcs_bucket}/o" in p.stderr
    assert "gave up after 3 attempts" in p.stderr and "gcs.retry.max_attempts 3 reached" in p.stderr
    assert silent.connections == 3  # each attempt was cut, and the next one made
