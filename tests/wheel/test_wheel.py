"""The wheel as a user gets it: installed with pip into a venv of a Debian 12 system that has none
of the build's packages (make_root.sh), then used: the Python API, the `ckptio` command, GCS
over https. And what PyPI and auditwheel look at: the tag, the libraries it needs, its metadata.
The sdist, in the same system: it stops with a message naming the -dev packages.
"""
import json
import os
import re
import shutil
import subprocess
import zipfile

import pytest

from conftest import VENV, pip_env

PLATFORM = "manylinux_2_31_x86_64"
# A name only the https proxy can resolve (test_behind_an_https_proxy...).
PROXIED_HOST = "gcs.ckptio.test"
# What the binaries may need from the system: glibc's libraries, libgcc_s (manylinux's policy
# lists them all), the kernel's vDSO, the dynamic loader. libstdc++ is linked in.
SYSTEM_LIBRARIES = {"linux-vdso.so.1", "libc.so.6", "libm.so.6", "libdl.so.2", "libpthread.so.0", "librt.so.1",
                    "libgcc_s.so.1", "/lib64/ld-linux-x86-64.so.2"}


def extension_path():
    return f"{VENV}/lib/python3.11/site-packages/ckptio/_ckptio.cpython-311-x86_64-linux-gnu.so"


# ----------------------------------------------------------------------------- what PyPI sees
def test_auditwheel_confirms_the_manylinux_2_31_tag(wheel, tools):
    assert wheel.name.endswith(f"-cp311-cp311-{PLATFORM}.whl")
    shown = subprocess.run([tools / "auditwheel", "show", wheel], capture_output=True, text=True, check=True).stdout
    shown = " ".join(shown.split())
    assert f'is consistent with the following platform tag: "{PLATFORM}"' in shown
    # Nothing beyond glibc and libgcc_s: no libstdc++, no libcurl/libssl to graft.
    libraries = set(re.findall(r"(lib[\w+-]+\.so\.\d+) with versions", shown))
    assert libraries <= {"libc.so.6", "libm.so.6", "libdl.so.2", "libpthread.so.0", "librt.so.1", "libgcc_s.so.1"}


def test_metadata_offers_the_jax_and_torch_extras(wheel):
    with zipfile.ZipFile(wheel) as z:
        meta = z.read("ckptio-0.1.0.dist-info/METADATA").decode()
    requires = {line.split(": ", 1)[1] for line in meta.splitlines() if line.startswith("Requires-Dist: ")}
    assert {'jax; extra == "jax"', 'torch; extra == "torch"'} <= requires
    assert {r for r in requires if "extra" not in r} == {"numpy>=1.24", "ml_dtypes>=0.3"}


def test_the_wheel_holds_the_module_the_command_and_the_licenses_of_what_it_links(wheel):
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        sizes = {i.filename: i.file_size for i in z.infolist()}
    assert "ckptio-0.1.0.data/scripts/ckptio" in names
    assert "ckptio/_ckptio.cpython-311-x86_64-linux-gnu.so" in names
    for lib in ("curl", "openssl", "nghttp2", "isa-l", "liburing", "libstdc++", "nlohmann-json", "xxhash"):
        assert f"ckptio/licenses/{lib}.txt" in names
    assert os.path.getsize(wheel) <= 15 * 1024 * 1024
    print(f"\nwheel: {os.path.getsize(wheel) / 2**20:.1f} MiB; unpacked: "
          f"{sum(sizes.values()) / 2**20:.1f} MiB (extension {sizes['ckptio/_ckptio.cpython-311-x86_64-linux-gnu.so'] / 2**20:.1f}, "
          f"command {sizes['ckptio-0.1.0.data/scripts/ckptio'] / 2**20:.1f})")


def _undefined_symbols(path):
    """(name, version or None, weak) of every undefined dynamic symbol of an ELF file."""
    out = subprocess.run(["objdump", "-T", path], capture_output=True, text=True, check=True).stdout
    found = []
    for line in out.splitlines():
        if "*UND*" not in line:
            continue
        fields = line.split()
        name = fields[-1]
        version = re.search(r"\((\w+[\d.]*)\)|\s(GLIBC_[\d.]+|GCC_[\d.]+)\s", line)
        version = (version.group(1) or version.group(2)) if version else None
        found.append((name, version, " w " in line))
    return found


def test_no_symbol_is_left_to_chance_every_one_is_from_glibc_2_31_or_older(wheel, tmp_path):
    with zipfile.ZipFile(wheel) as z:
        z.extractall(tmp_path)
    for rel, python_api in [("ckptio/_ckptio.cpython-311-x86_64-linux-gnu.so", True),
                            ("ckptio-0.1.0.data/scripts/ckptio", False)]:
        symbols = _undefined_symbols(tmp_path / rel)
        assert symbols
        for name, version, weak in symbols:
            if version is None:
                # Unversioned: only the interpreter's C API (bound when Python loads the module), or
                # weak references (ITM, gmon) that may stay unbound.
                assert weak or (python_api and name.startswith(("Py", "_Py"))), f"{rel}: {name} is unbound"
            elif version.startswith("GLIBC_"):
                assert tuple(map(int, version[6:].split("."))) <= (2, 31), f"{rel}: {name}@{version}"
            else:
                assert version.startswith("GCC_"), f"{rel}: {name}@{version}"
        # The C++ runtime and the bundled libraries are inside: none of their symbols is wanted.
        assert not [n for n, _, _ in symbols if n.startswith(("_ZNSt", "curl_", "SSL_", "io_uring_", "crc32_"))]


# ----------------------------------------------------------------------------- in the Debian root
def test_the_root_has_none_of_the_builds_packages(debian):
    for path in ("/usr/bin/g++", "/usr/bin/c++", "/usr/bin/pkg-config", "/usr/include/liburing.h",
                 "/usr/include/openssl", "/usr/lib/x86_64-linux-gnu/libcurl.so.4",
                 "/usr/lib/x86_64-linux-gnu/liburing.so.2", "/usr/lib/x86_64-linux-gnu/libisal.so.2",
                 "/usr/lib/x86_64-linux-gnu/libnghttp2.so.14"):
        assert not debian.path(path).exists(), path
    # (libstdc++.so.6 is there: apt needs it. The wheel's binaries do not load it: see the ldd test.)


def test_ldd_names_nothing_but_glibc_libgcc_and_the_vdso(debian, installed):
    for binary in (extension_path(), f"{VENV}/bin/ckptio"):
        out = debian.run("ldd", binary).stdout
        names = set()
        for line in out.splitlines():
            line = line.strip()
            assert "not found" not in line, line
            names.add(line.split()[0])
        assert names <= SYSTEM_LIBRARIES, (binary, names - SYSTEM_LIBRARIES)
        assert {"libc.so.6", "libgcc_s.so.1"} <= names


def test_save_restore_verify_with_the_python_api(debian, installed):
    out = json.loads(debian.run(f"{VENV}/bin/python", "/data/save.py", "/data/ckpt", "1,2,3,4", "2").stdout)
    assert out["all_steps"] == [3, 4] and out["latest"] == 4
    assert out["verify"]["step"] == 4 and out["verify"]["tensors"] == 6 and out["verify"]["bytes_read"] > 1_000_000
    assert out["leaves_checked"] == 6 and out["metadata"] == {"epoch": 2}
    # Another process restores both steps from disk and compares every byte.
    again = json.loads(debian.run(f"{VENV}/bin/python", "/data/restore.py", "/data/ckpt").stdout)
    assert again == {"checked": {"3": 6, "4": 6}}
    committed = sorted(p.name for p in (debian.data_host / "ckpt").iterdir() if not p.name.startswith("."))
    assert committed == ["checkpoint_3", "checkpoint_4"]
    assert (debian.data_host / "ckpt/checkpoint_4/manifest.json").is_file()


def test_the_ckptio_command_runs_the_demo_and_lists_and_verifies(debian, installed):
    demo = debian.run(f"{VENV}/bin/ckptio", "demo", "--state-size", "32MiB", "--saves", "3", "--compute", "0.1s",
                      "--dir", "/data/demo")
    assert re.search(r"^ckptio .* \d+\.\d\dx$", demo.stdout, re.M), demo.stdout[-2000:]  # its table's row
    assert sorted(p.name for p in (debian.data_host / "demo").iterdir()) == ["async", "blocking"]
    for run in ("async", "blocking"):
        listed = debian.run(f"{VENV}/bin/ckptio", "ls", f"/data/demo/{run}").stdout
        assert re.findall(r"^step (\d+) .* 32\.0 MiB", listed, re.M) == ["100", "200", "300"], listed
        verified = debian.run(f"{VENV}/bin/ckptio", "verify", f"/data/demo/{run}").stdout
        assert re.findall(r"^step (\d+): OK", verified, re.M) == ["100", "200", "300"], verified


def test_the_bundled_libcurl_speaks_http_and_https_only_and_finds_debians_ca_bundle(debian, installed):
    lines = debian.run(f"{VENV}/bin/ckptio", "--version").stdout.splitlines()
    assert lines[0] == "ckptio 0.1.0"
    curl = lines[1]
    assert re.match(r"libcurl/7\.88\.1 OpenSSL/3\.0\.\d+ nghttp2/1\.52\.0; ", curl), curl
    assert "; protocols: http https; " in curl
    assert curl.endswith("; CA: /etc/ssl/certs/ca-certificates.crt")


# ----------------------------------------------------------------------------- GCS over https
@pytest.fixture(scope="module")
def https_gcs(tmp_path_factory, debian, installed):
    """The GCS emulator behind an https front (the fault proxy with a test CA's certificate), the
    token endpoint for a service account, and the test CA trusted by the root's system store the
    way an administrator adds a private CA: update-ca-certificates."""
    from fault_proxy import FaultProxy
    from testbed import GcsTestbed
    from tls import TestCa

    ca = TestCa(tmp_path_factory.mktemp("tls"), hosts=("localhost", "127.0.0.1", PROXIED_HOST))
    with GcsTestbed() as tb:
        proxy = FaultProxy(tb.emulator.url, tls=ca.server_context(), token_validator=tb.registry.is_valid)
        proxy.start()
        try:
            shutil.copy(ca.ca_path, debian.path("/usr/local/share/ca-certificates/ckptio-test-ca.crt"))
            debian.run("update-ca-certificates", user="root")
            sa = debian.data_host / "sa.json"
            shutil.copy(tb.tokens.sa_key_path, sa)
            os.chown(sa, 1000, 1000)
            config = debian.data_host / "gcs.json"
            config.write_text(json.dumps({"gcs": {"endpoint": f"https://localhost:{proxy.port}",
                                                   "chunk_size": "256KiB",
                                                   "retry": {"max_attempts": 2, "initial_backoff": "1ms"}}}))
            proxy.settings(require_bearer="issued")
            yield tb, proxy, ca, {"CKPTIO_CONFIG": "/data/gcs.json", "GOOGLE_APPLICATION_CREDENTIALS": "/data/sa.json",
                                  "GCE_METADATA_HOST": tb.metadata.host_port}
        finally:
            proxy.stop()


def test_a_save_to_gcs_over_https_trusts_the_systems_store_and_reads_back(debian, https_gcs):
    import google_crc32c

    tb, proxy, _, env = https_gcs
    root = f"gs://{tb.bucket}/run-https"
    out = json.loads(debian.run(f"{VENV}/bin/python", "/data/save.py", root, "5,6", "2", env=env).stdout)
    assert out["all_steps"] == [5, 6] and out["leaves_checked"] == 6
    again = json.loads(debian.run(f"{VENV}/bin/python", "/data/restore.py", root, env=env).stdout)
    assert again == {"checked": {"5": 6, "6": 6}}
    listed = debian.run(f"{VENV}/bin/ckptio", "ls", root, env=env).stdout
    assert re.findall(r"^step (\d+) ", listed, re.M) == ["5", "6"], listed
    # Every request went through TLS with a token the service account's signed JWT obtained.
    log = proxy.log()
    assert log and all(e["bearer_ok"] for e in log if e["method"] in ("PUT", "POST"))
    assert tb.tokens.count >= 1
    # The official client reads what ckptio wrote: the manifest's CRC32C of each shard matches.
    client = _anonymous_client(tb)
    manifest = json.loads(client.bucket(tb.bucket).blob("run-https/checkpoint_6/manifest.json").download_as_bytes())
    for shard in manifest["shards"]:
        data = client.bucket(tb.bucket).blob(f"run-https/checkpoint_6/{shard['name']}").download_as_bytes()
        assert len(data) == shard["bytes"]
        assert f"{google_crc32c.value(data):08x}" == shard["crc32c"]


def _anonymous_client(tb):
    from google.auth.credentials import AnonymousCredentials
    from google.cloud import storage

    return storage.Client(project=tb.project, credentials=AnonymousCredentials(),
                          client_options={"api_endpoint": tb.emulator.url})


def test_an_untrusted_certificate_is_refused(debian, https_gcs, tmp_path):
    from tls import TestCa

    tb, _, _, env = https_gcs
    other = TestCa(tmp_path / "other")  # a bundle without the test CA: SSL_CERT_FILE
    shutil.copy(other.ca_path, debian.data_host / "other-ca.pem")
    p = debian.run(f"{VENV}/bin/ckptio", "ls", f"gs://{tb.bucket}/run-https",
                   env=dict(env, SSL_CERT_FILE="/data/other-ca.pem"), check=False)
    assert p.returncode != 0
    assert "SSL certificate problem: unable to get local issuer certificate" in p.stderr, p.stderr


def test_rhels_bundle_location_is_found_too(debian, https_gcs):
    tb, _, _, env = https_gcs
    debian_bundle = debian.path("/etc/ssl/certs/ca-certificates.crt")
    rhel_bundle = debian.path("/etc/pki/tls/certs/ca-bundle.crt")
    rhel_bundle.parent.mkdir(parents=True, exist_ok=True)
    os.rename(debian_bundle, rhel_bundle)
    try:
        lines = debian.run(f"{VENV}/bin/ckptio", "--version").stdout.splitlines()
        assert lines[1].endswith("; CA: /etc/pki/tls/certs/ca-bundle.crt")
        listed = debian.run(f"{VENV}/bin/ckptio", "ls", f"gs://{tb.bucket}/run-https", env=env).stdout
        assert re.findall(r"^step (\d+) ", listed, re.M) == ["5", "6"], listed
    finally:
        os.rename(rhel_bundle, debian_bundle)


def test_behind_an_https_proxy_everything_goes_through_its_tunnel(debian, https_gcs):
    from connect_proxy import ConnectProxy

    tb, proxy, _, env = https_gcs
    (debian.data_host / "gcs-proxied.json").write_text(json.dumps({"gcs": {
        "endpoint": f"https://{PROXIED_HOST}:{proxy.port}", "chunk_size": "256KiB"}}))
    root = f"gs://{tb.bucket}/run-proxied"
    with ConnectProxy(resolve={PROXIED_HOST: "127.0.0.1"}) as tunnel:
        # https_proxy as a user sets it; the token endpoint is plain http on 127.0.0.1: direct.
        proxied = dict(env, CKPTIO_CONFIG="/data/gcs-proxied.json", https_proxy=tunnel.url)
        out = json.loads(debian.run(f"{VENV}/bin/python", "/data/save.py", root, "7", "1", env=proxied).stdout)
        assert out["all_steps"] == [7] and out["leaves_checked"] == 6
        listed = debian.run(f"{VENV}/bin/ckptio", "ls", root, env=proxied).stdout
        assert re.findall(r"^step (\d+) ", listed, re.M) == ["7"], listed
    # The root cannot resolve the name: only the proxy's tunnels reached the server.
    assert tunnel.tunnels and set(tunnel.tunnels) == {f"{PROXIED_HOST}:{proxy.port}"}
    assert _anonymous_client(tb).bucket(tb.bucket).blob("run-proxied/checkpoint_7/manifest.json").exists()


# ----------------------------------------------------------------------------- the sdist
def test_the_sdist_without_dev_packages_stops_with_a_message_naming_them(debian, sdist):
    shutil.copy(sdist, debian.data_host / sdist.name)
    debian.run("python3", "-m", "venv", "/home/user/venv-sdist")
    p = debian.run("/home/user/venv-sdist/bin/pip", "install", f"/data/{sdist.name}", env=pip_env(debian),
                   check=False)
    out = p.stdout + p.stderr
    assert p.returncode != 0
    assert "ckptio cannot be built from source here; missing:" in out, out[-3000:]
    for needed in ("a C++20 compiler", "Python's headers", "pkg-config", "liburing >= 2.2", "libisal >= 2.25"):
        assert needed in out, (needed, out[-3000:])
    assert ("sudo apt-get install g++ python3-dev pkg-config liburing-dev libcurl4-openssl-dev libssl-dev "
            "libisal-dev libxxhash-dev") in out
    assert "meson.build" not in out and "Traceback" not in out
