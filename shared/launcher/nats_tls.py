"""TLS for the nats-server `kvmesh up` starts (`--nats-tls`): a throwaway CA and a server certificate for
the listen address, made with the openssl command line, valid two days, written beside the server's
config (readable by this user only). Services verify the server with the CA (NATS_TLS_CA).

For compose (compose/docker-compose.tls.yml), one certificate for every server's host name:
    python -m shared.launcher.nats_tls compose/certs nats nats-2 nats-3
"""
from __future__ import annotations

import ipaddress
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

VALID_DAYS = "2"


@dataclass(frozen=True)
class TlsFiles:
    ca: Path
    cert: Path
    key: Path


def _san(host: str) -> str:
    try:
        ipaddress.ip_address(host)
        return f"IP:{host}"
    except ValueError:
        return f"DNS:{host}"


def make_tls(directory: Path, host: str, *more_hosts: str) -> TlsFiles:
    """The CA and one server certificate valid for `host` and `more_hosts` (names or addresses)."""
    openssl = shutil.which("openssl")
    if openssl is None:
        raise RuntimeError("--nats-tls needs the openssl command line to make the mesh's certificates")
    d = Path(directory)
    ca_key, ca, key, csr, cert = d / "ca.key", d / "ca.pem", d / "server.key", d / "server.csr", d / "server.pem"
    san = "subjectAltName=" + ",".join(_san(h) for h in (host, *more_hosts))
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


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print("usage: python -m shared.launcher.nats_tls DIR HOST [HOST...]  (a CA and a server certificate "
              "for those host names, valid two days)", file=sys.stderr)
        return 2
    directory = Path(argv[0])
    directory.mkdir(parents=True, exist_ok=True)
    files = make_tls(directory, *argv[1:])
    print(f"CA {files.ca}, certificate {files.cert}, key {files.key}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
