"""TLS for the nats-server `kvmesh up` starts (`--nats-tls`): a throwaway CA and a server certificate for
the listen address, made with the openssl command line, valid two days, written beside the server's
config (readable by this user only). Services verify the server with the CA (NATS_TLS_CA)."""
from __future__ import annotations

import ipaddress
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

VALID_DAYS = "2"


@dataclass(frozen=True)
class TlsFiles:
    ca: Path
    cert: Path
    key: Path


def make_tls(directory: Path, host: str) -> TlsFiles:
    openssl = shutil.which("openssl")
    if openssl is None:
        raise RuntimeError("--nats-tls needs the openssl command line to make the mesh's certificates")
    d = Path(directory)
    ca_key, ca, key, csr, cert = d / "ca.key", d / "ca.pem", d / "server.key", d / "server.csr", d / "server.pem"
    try:
        ipaddress.ip_address(host)
        san = f"subjectAltName=IP:{host}"
    except ValueError:
        san = f"subjectAltName=DNS:{host}"
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    steps = [
        [openssl, "req", "-x509", *ec, "-days", VALID_DAYS, "-subj", "/CN=kvmesh mesh CA", "-keyout", str(ca_key),
         "-out", str(ca)],
        [openssl, "req", *ec, "-subj", f"/CN={host}", "-keyout", str(key), "-out", str(csr)],
        [openssl, "x509", "-req", "-in", str(csr), "-CA", str(ca), "-CAkey", str(ca_key), "-CAcreateserial",
         "-days", VALID_DAYS, "-out", str(cert), "-extfile", "/dev/stdin"],
    ]
    for argv in steps:
        out = subprocess.run(argv, input=san if argv[1] == "x509" else None, capture_output=True, text=True, timeout=60)
        if out.returncode != 0:
            raise RuntimeError(f"openssl failed making the mesh's certificates: {out.stderr.strip()[-500:]}")
    for p in (ca_key, key):
        p.chmod(0o600)
    return TlsFiles(ca, cert, key)
