"""Run a command with a GCS emulator, the fault proxy and the auth stand-ins around it.

    python tests/gcs/with_gcs.py [options] -- <command> [args...]
    python tests/gcs/with_gcs.py [options]            # no command: print the exports, serve until ^C

Starts the emulator (in memory, fresh), the fault proxy in front of it, the OAuth2 token endpoint
and the metadata server stand-ins, all on 127.0.0.1; runs the command with these variables set:

    STORAGE_EMULATOR_HOST=http://127.0.0.1:<proxy>   the proxy in front of the emulator
    CKPTIO_TEST_EMULATOR=http://127.0.0.1:<emulator> the emulator, direct
    CKPTIO_TEST_PROXY=http://127.0.0.1:<proxy>       control API under /__proxy/
    CKPTIO_TEST_BUCKET, CKPTIO_TEST_PROJECT
    CKPTIO_TEST_TOKEN_URI=http://127.0.0.1:<tok>/token
    CKPTIO_TEST_SA_KEY=<service-account json>        CKPTIO_TEST_AUTHORIZED_USER=<authorized_user json>
    CKPTIO_TEST_METADATA_HOST=127.0.0.1:<md>         (also GCE_METADATA_HOST/GCE_METADATA_IP unless
                                                      --no-metadata-env)
and GOOGLE_APPLICATION_CREDENTIALS removed, NO_PROXY extended with 127.0.0.1,localhost.

Everything is torn down when the command exits (or crashes, or this launcher gets SIGINT/SIGTERM,
which are passed on to the command); the exit status is the command's (128+N if killed by signal N).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def _ensure_packages():
    """Re-run under the repository's .venv if this interpreter lacks the packages."""
    try:
        import cryptography  # noqa: F401
        import gcp_storage_emulator  # noqa: F401
        import google_crc32c  # noqa: F401
    except ImportError:
        venv = os.path.realpath(os.path.join(HERE, "..", "..", ".venv"))
        venv_py = os.path.join(venv, "bin", "python")
        if os.path.exists(venv_py) and os.path.realpath(sys.prefix) != venv \
                and not os.environ.get("CKPTIO_WITH_GCS_REEXEC"):
            os.environ["CKPTIO_WITH_GCS_REEXEC"] = "1"
            os.execv(venv_py, [venv_py, os.path.abspath(__file__), *sys.argv[1:]])
        raise


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    cmd: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, cmd = argv[:i], argv[i + 1:]
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bucket", default="ckptio-test")
    ap.add_argument("--project", default="ckptio-test")
    ap.add_argument("--pristine", action="store_true", help="emulator without the compatibility layer")
    ap.add_argument("--token-expires-in", type=int, default=3600)
    ap.add_argument("--no-metadata-env", action="store_true",
                    help="do not point GCE_METADATA_HOST/GCE_METADATA_IP at the stand-in")
    ap.add_argument("--proxy-log", help="write the proxy's request log (JSON) here at exit")
    ap.add_argument("--quiet", action="store_true", help="do not print the environment to stderr")
    ap.add_argument("command", nargs=argparse.REMAINDER, help="the command (better after --)")
    a = ap.parse_args(argv)
    cmd = a.command + cmd
    _ensure_packages()
    os.environ.pop("CKPTIO_WITH_GCS_REEXEC", None)
    sys.path.insert(0, HERE)
    from testbed import GcsTestbed

    tb = GcsTestbed(bucket=a.bucket, project=a.project, pristine=a.pristine, token_expires_in=a.token_expires_in)
    child: subprocess.Popen | None = None
    stop_requested = []

    def on_signal(signum, _frame):
        if child is not None and child.poll() is None:
            try:
                child.send_signal(signum)
            except ProcessLookupError:
                pass
        else:
            stop_requested.append(signum)
            raise KeyboardInterrupt

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    rc = 0
    try:
        tb.start()
        variables = tb.variables(metadata_env=not a.no_metadata_env)
        if not cmd:
            for k, v in variables.items():
                print(f"export {k}={v}", flush=True)
            print("# serving; Ctrl-C to stop", file=sys.stderr, flush=True)
            try:
                while True:
                    signal.pause()
            except KeyboardInterrupt:
                return 0
        if not a.quiet:
            print("with_gcs: " + " ".join(f"{k}={v}" for k, v in variables.items()), file=sys.stderr, flush=True)
        env = tb.env(metadata_env=not a.no_metadata_env)
        try:
            child = subprocess.Popen(cmd, env=env)
        except OSError as e:
            print(f"with_gcs: cannot run {cmd[0]!r}: {e}", file=sys.stderr)
            return 127
        while True:
            try:
                rc = child.wait()
                break
            except KeyboardInterrupt:
                continue
        if rc < 0:
            print(f"with_gcs: {cmd[0]} killed by signal {-rc}", file=sys.stderr, flush=True)
            rc = 128 - rc
        return rc
    except KeyboardInterrupt:
        return 128 + (stop_requested[0] if stop_requested else signal.SIGINT)
    finally:
        if child is not None and child.poll() is None:
            child.kill()
            child.wait()
        if a.proxy_log and tb.proxy is not None:
            try:
                with open(a.proxy_log, "w") as f:
                    json.dump(tb.proxy.log(), f, indent=1)
            except OSError as e:
                print(f"with_gcs: cannot write {a.proxy_log}: {e}", file=sys.stderr)
        tb.stop()
        for s, h in old.items():
            signal.signal(s, h)


if __name__ == "__main__":
    sys.exit(main())
