"""The address this host reaches another at: the default --advertise-host of a joining host."""
from __future__ import annotations

import socket
from urllib.parse import urlsplit


def address_towards(url: str) -> str:
    """The local IP that packets to url's host leave from (a UDP connect sends nothing); 127.0.0.1 if none."""
    u = urlsplit(url)
    if not u.hostname:
        return "127.0.0.1"
    try:
        family = socket.getaddrinfo(u.hostname, u.port or 6222, type=socket.SOCK_DGRAM)[0][0]
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect((u.hostname, u.port or 6222))
            return s.getsockname()[0]
    except OSError:
        return "127.0.0.1"
