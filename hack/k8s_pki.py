"""Certificates and keys for the local test control plane, generated at start with openssl.

One CA signs the API server's serving certificate (for 127.0.0.1 / localhost / the
in-cluster service IP) and the admin client certificate (group system:masters); a separate
key pair signs service-account tokens (ES256). Nothing here is secret beyond the test cluster's
lifetime: every start makes fresh material in the cluster's own directory.
"""

from __future__ import annotations

import dataclasses
import logging
import pathlib
import shutil
import subprocess

log = logging.getLogger(__name__)

CERT_DAYS = "30"


class PkiError(RuntimeError):
    """openssl is missing or failed."""


@dataclasses.dataclass(frozen=True)
class Pki:
    """Paths of the generated material."""

    ca_cert: pathlib.Path
    ca_key: pathlib.Path
    serving_cert: pathlib.Path
    serving_key: pathlib.Path
    admin_cert: pathlib.Path
    admin_key: pathlib.Path
    service_account_key: pathlib.Path
    service_account_pub: pathlib.Path


def _openssl(*args: str, cwd: pathlib.Path) -> None:
    exe = shutil.which("openssl")
    if exe is None:
        raise PkiError("openssl is not installed; it is needed to make the test cluster's certs")
    result = subprocess.run(
        [exe, *args], cwd=cwd, capture_output=True, text=True, timeout=60, check=False
    )
    if result.returncode != 0:
        raise PkiError(f"openssl {' '.join(args[:2])} failed: {result.stderr.strip()}")


def _new_key(path: pathlib.Path) -> None:
    # P-256 rather than RSA: generated in milliseconds, and every component accepts it.
    _openssl(
        "genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256", "-out", str(path),
        cwd=path.parent,
    )  # fmt: skip
    path.chmod(0o600)


def _sign(
    directory: pathlib.Path,
    name: str,
    subject: str,
    extensions: str,
    ca_cert: pathlib.Path,
    ca_key: pathlib.Path,
) -> tuple[pathlib.Path, pathlib.Path]:
    key = directory / f"{name}.key"
    csr = directory / f"{name}.csr"
    cert = directory / f"{name}.crt"
    ext = directory / f"{name}.ext"
    _new_key(key)
    _openssl("req", "-new", "-key", str(key), "-subj", subject, "-out", str(csr), cwd=directory)
    ext.write_text(extensions)
    _openssl(
        "x509", "-req", "-in", str(csr), "-CA", str(ca_cert), "-CAkey", str(ca_key),
        "-CAcreateserial", "-days", CERT_DAYS, "-sha256", "-extfile", str(ext),
        "-out", str(cert),
        cwd=directory,
    )  # fmt: skip
    csr.unlink()
    ext.unlink()
    return cert, key


def generate(directory: pathlib.Path, service_ip: str) -> Pki:
    """Make a CA, the API server's serving cert, an admin client cert and the SA key pair."""
    directory.mkdir(parents=True, exist_ok=True)
    ca_key = directory / "ca.key"
    ca_cert = directory / "ca.crt"
    _new_key(ca_key)
    _openssl(
        "req", "-x509", "-new", "-key", str(ca_key), "-subj", "/CN=bulkhead-test-ca",
        "-days", CERT_DAYS, "-sha256", "-out", str(ca_cert),
        "-addext", "basicConstraints=critical,CA:TRUE",
        "-addext", "keyUsage=critical,keyCertSign,cRLSign,digitalSignature",
        cwd=directory,
    )  # fmt: skip
    serving_cert, serving_key = _sign(
        directory,
        "apiserver",
        "/CN=kube-apiserver",
        "basicConstraints=CA:FALSE\n"
        "keyUsage=critical,digitalSignature,keyEncipherment\n"
        "extendedKeyUsage=serverAuth\n"
        "subjectAltName=IP:127.0.0.1,IP:" + service_ip + ",DNS:localhost,DNS:kubernetes,"
        "DNS:kubernetes.default,DNS:kubernetes.default.svc,"
        "DNS:kubernetes.default.svc.cluster.local\n",
        ca_cert,
        ca_key,
    )
    admin_cert, admin_key = _sign(
        directory,
        "admin",
        "/O=system:masters/CN=bulkhead-admin",
        "basicConstraints=CA:FALSE\n"
        "keyUsage=critical,digitalSignature,keyEncipherment\n"
        "extendedKeyUsage=clientAuth\n",
        ca_cert,
        ca_key,
    )
    sa_key = directory / "service-account.key"
    sa_pub = directory / "service-account.pub"
    _new_key(sa_key)
    _openssl("pkey", "-in", str(sa_key), "-pubout", "-out", str(sa_pub), cwd=directory)
    log.debug("generated test PKI in %s", directory)
    return Pki(ca_cert, ca_key, serving_cert, serving_key, admin_cert, admin_key, sa_key, sa_pub)
