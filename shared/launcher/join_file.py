"""The join file: what the first host of a mesh writes (`kvmesh up --write-join FILE`) so that another host
can join it (`kvmesh up --join FILE`).

It holds the NATS route URLs of the first host's servers, the CA (certificate and key) when the bus uses TLS,
and the mesh secret. Nothing role-wide crosses hosts: every credential a host needs is derived from the
secret by that host's launcher (mesh_secret.py): one password per process, named as the process, and the
route password that admits a server into the cluster. A process gets only its own password, never the
secret. Whoever holds the file can join the mesh, so it is written readable by its owner only, and should be
carried to the other host as a secret (scp, a secrets manager).
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

KIND = "kvmesh-join"
VERSION = 1


class JoinFileError(ValueError):
    """The join file cannot be used (missing, unreadable, not a join file, or a field is wrong)."""


@dataclass(frozen=True)
class JoinFile:
    secret: str  # hex; every credential of the mesh is derived from it (mesh_secret.py)
    routes: tuple[str, ...]  # nats-route://host:port of the first host's servers (no credentials in them)
    secure_bus: bool = True  # False: the mesh runs an open bus (--insecure-bus), no users anywhere
    # The bus's CA when it uses TLS: a joining host signs its own server certificate with it.
    tls_ca: str | None = field(default=None, repr=False)
    tls_ca_key: str | None = field(default=None, repr=False)
    # Mesh-wide facts the joining host's workers must agree on: the model id folded into block hashes
    # (None: each worker's default, the model directory's name), whether a kvstore serves, how many prefill
    # workers the first host runs (a decode worker prefills remotely only when some may answer).
    served_model_name: str | None = None
    kvstore: bool = True
    prefill: int = 0

    def __post_init__(self) -> None:
        try:
            if len(bytes.fromhex(self.secret)) < 16:
                raise ValueError
        except (TypeError, ValueError):
            raise JoinFileError("join file: secret must be at least 16 bytes of hex") from None
        if not self.routes:
            raise JoinFileError("join file: no routes (the first host's nats-server cluster addresses)")
        for route in self.routes:
            u = urlsplit(route)
            if u.scheme != "nats-route" or not u.hostname or not u.port or u.username or u.password:
                raise JoinFileError(f"join file: route must be nats-route://host:port, got {route!r}")
        if (self.tls_ca is None) != (self.tls_ca_key is None):
            raise JoinFileError("join file: tls_ca and tls_ca_key come together")

    @property
    def tls(self) -> bool:
        return self.tls_ca is not None

    def write(self, path: Path) -> Path:
        """Written readable by this user only (it admits whoever holds it); replaces an older file."""
        body = {"kind": KIND, "version": VERSION, **asdict(self), "routes": list(self.routes)}
        path = Path(path)
        tmp = path.with_name(f".{path.name}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(body, f, indent=1)
        os.replace(tmp, path)
        return path

    @classmethod
    def read(cls, path: Path) -> JoinFile:
        try:
            body = json.loads(Path(path).read_text())
        except OSError as e:
            raise JoinFileError(f"cannot read the join file {path}: {e.strerror or e}") from None
        except ValueError:
            raise JoinFileError(f"{path} is not a join file (not JSON)") from None
        if not isinstance(body, dict) or body.get("kind") != KIND:
            raise JoinFileError(f"{path} is not a kvmesh join file")
        if body.get("version") != VERSION:
            raise JoinFileError(f"{path}: join file version {body.get('version')!r}, this kvmesh reads {VERSION}")
        known = {"secret", "routes", "secure_bus", "tls_ca", "tls_ca_key", "served_model_name", "kvstore", "prefill"}
        fields = {k: v for k, v in body.items() if k in known}
        if not isinstance(fields.get("routes"), list) or not all(isinstance(r, str) for r in fields["routes"]):
            raise JoinFileError(f"{path}: routes must be a list of nats-route URLs")
        fields["routes"] = tuple(fields["routes"])
        try:
            return cls(**fields)
        except TypeError as e:
            raise JoinFileError(f"{path}: {e}") from None
