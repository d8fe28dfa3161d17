"""TLS on a joining host: a server certificate for this host's address, signed by the mesh's CA from the
join file, so that clients and the other servers' routes (which verify with that CA) accept this server."""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from shared.launcher.nats_tls import VALID_DAYS, TlsFiles, _san


def _write_private(path: Path, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)


def sign_with_ca(directory: Path, ca_pem: str, ca_key_pem: str, host: str) -> TlsFiles:
    openssl = shutil.which("openssl")
    if openssl is None:
        raise RuntimeError("joining a mesh with TLS needs the openssl command line to make this host's certificate")
    d = Path(directory)
    ca, ca_key, key, csr, cert = d / "ca.pem", d / "ca.key", d / "server.key", d / "server.csr", d / "server.pem"
    ca.write_text(ca_pem)
    _write_private(ca_key, ca_key_pem)
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    steps = [
        ([openssl, "req", *ec, "-subj", f"/CN={host}", "-keyout", str(key), "-out", str(csr)], None),
        ([openssl, "x509", "-req", "-in", str(csr), "-CA", str(ca), "-CAkey", str(ca_key), "-CAcreateserial",
          "-days", VALID_DAYS, "-out", str(cert), "-extfile", "/dev/stdin"], f"subjectAltName={_san(host)}"),
    ]
    for argv, stdin in steps:
        out = subprocess.run(argv, input=stdin, capture_output=True, text=True, timeout=60)
        if out.returncode != 0:
            raise RuntimeError(f"openssl failed making this host's certificate: {out.stderr.strip()[-500:]}")
    key.chmod(0o600)
    return TlsFiles(ca, cert, key)
