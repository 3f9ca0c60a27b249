"""A test certificate authority and a server certificate it signed, for an https endpoint on 127.0.0.1.

    from tls import TestCa
    ca = TestCa(directory)             # ca.pem (the CA), server.pem + server.key (localhost, 127.0.0.1)
    proxy = FaultProxy(emulator.url, tls=ca.server_context())   # https://127.0.0.1:PORT

A client trusts the server by trusting ca.pem: gcs.ca_file, or the system's bundle (the wheel's
test adds it with update-ca-certificates in a Debian root, as a user's machine trusts a private CA).
"""
from __future__ import annotations

import datetime
import ipaddress
import pathlib
import ssl

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "ckptio tests"),
                      x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _pem_key(key) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


class TestCa:
    """Writes ca.pem, server.pem and server.key into `directory` (ECDSA P-256, valid for a day)."""

    __test__ = False  # not a pytest class

    def __init__(self, directory, hosts=("localhost", "127.0.0.1"), common_name: str = "ckptio test CA"):
        d = pathlib.Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        now = datetime.datetime.now(datetime.timezone.utc)
        not_before, not_after = now - datetime.timedelta(hours=1), now + datetime.timedelta(days=1)
        ca_key = ec.generate_private_key(ec.SECP256R1())
        ca_cert = (x509.CertificateBuilder().subject_name(_name(common_name)).issuer_name(_name(common_name))
                   .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
                   .not_valid_before(not_before).not_valid_after(not_after)
                   .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
                   .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False,
                                                key_encipherment=False, data_encipherment=False,
                                                key_agreement=False, key_cert_sign=True, crl_sign=True,
                                                encipher_only=False, decipher_only=False), critical=True)
                   .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
                   .sign(ca_key, hashes.SHA256()))
        san = [x509.IPAddress(ipaddress.ip_address(h)) if h.replace(".", "").isdigit() else x509.DNSName(h)
               for h in hosts]
        key = ec.generate_private_key(ec.SECP256R1())
        cert = (x509.CertificateBuilder().subject_name(_name(hosts[0])).issuer_name(ca_cert.subject)
                .public_key(key.public_key()).serial_number(x509.random_serial_number())
                .not_valid_before(not_before).not_valid_after(not_after)
                .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                .add_extension(x509.SubjectAlternativeName(san), critical=False)
                .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
                .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
                               critical=False)
                .sign(ca_key, hashes.SHA256()))
        self.ca_path = d / "ca.pem"
        self.cert_path = d / "server.pem"
        self.key_path = d / "server.key"
        self.ca_path.write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
        self.cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        self.key_path.write_bytes(_pem_key(key))
        self.key_path.chmod(0o600)

    def server_context(self) -> ssl.SSLContext:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(self.cert_path, self.key_path)
        return ctx

    def client_context(self) -> ssl.SSLContext:
        return ssl.create_default_context(cafile=str(self.ca_path))
