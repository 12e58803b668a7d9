"""TCP with TLS and client certificates: the certificate's common name is the tenant; a client
without a certificate is refused by the handshake."""

from __future__ import annotations

import subprocess

import pytest

from kvtierd.client import KvtierClient, TlsOptions
from kvtierd.errors import Unavailable
from kvtierd.launch.daemon_process import DaemonProcess, small_daemon_args
from tests.server.e2e_runner import LAYOUT


def openssl(*args: str, cwd) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def issue(cwd, name: str, ca: str, extensions: str = "") -> None:
    """A key and a certificate for CN=`name`, signed by the CA `ca`."""
    openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-subj", f"/CN={name}",
            "-out", f"{name}.csr", cwd=cwd)
    ext = ["-extfile", "ext.cnf"] if extensions else []
    if extensions:
        (cwd / "ext.cnf").write_text(extensions)
    openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.crt", "-CAkey", f"{ca}.key", "-CAcreateserial",
            "-days", "2", "-out", f"{name}.crt", *ext, cwd=cwd)


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    cwd = tmp_path_factory.mktemp("pki")
    for ca in ("ca", "rogue-ca"):
        openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{ca}.key", "-subj", f"/CN={ca}",
                "-days", "2", "-out", f"{ca}.crt", cwd=cwd)
    issue(cwd, "server", "ca", "subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    issue(cwd, "tenant-blue", "ca")
    issue(cwd, "intruder", "rogue-ca")
    return cwd


def tls(pki, name: str | None) -> TlsOptions:
    read = lambda f: (pki / f).read_bytes()  # noqa: E731
    if name is None:
        return TlsOptions(root_ca=read("ca.crt"))
    return TlsOptions(root_ca=read("ca.crt"), cert_chain=read(f"{name}.crt"), private_key=read(f"{name}.key"))


def test_client_certificate_names_the_tenant_and_others_are_refused(tmp_path, pki):
    extra = ["--tcp", "127.0.0.1:0", "--tls-cert", str(pki / "server.crt"), "--tls-key", str(pki / "server.key"),
             "--tls-client-ca", str(pki / "ca.crt")]
    with DaemonProcess(small_daemon_args(str(tmp_path), extra=extra)) as daemon:
        with KvtierClient(daemon.tcp_address, tls=tls(pki, "tenant-blue")) as client:
            session = client.attach(LAYOUT)
            assert session.tenant == "tenant-blue"
            assert session.lookup(session.namespace.hash_blocks(list(range(8)))).total.num_blocks == 0
        for name in (None, "intruder"):  # no certificate; one from another CA
            with KvtierClient(daemon.tcp_address, tls=tls(pki, name), timeout_s=2, max_attempts=1) as client:
                with pytest.raises(Unavailable):
                    client.stats()
        with KvtierClient(daemon.tcp_address, timeout_s=2, max_attempts=1) as plaintext, pytest.raises(Unavailable):
            plaintext.stats()
