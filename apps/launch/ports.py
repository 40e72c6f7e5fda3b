"""Sockets: free TCP ports on loopback (for the servers the launcher starts, and tests) and
the file limit that bounds how many connections a process can hold."""

from __future__ import annotations

import socket
from collections.abc import Sequence


def free_ports(n: int, host: str = "127.0.0.1", *, avoid: Sequence[int] = ()) -> list[int]:
    """``n`` distinct ports that are free on ``host`` now."""
    ports: list[int] = []
    while len(ports) < n:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
        if port not in ports and port not in avoid:
            ports.append(port)
    return ports


def port_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def hold_ports(host: str, ports: Sequence[int]) -> list[socket.socket] | int:
    """Bind each of ``ports`` on ``host`` with SO_REUSEADDR, never listening: their owners
    (processes started later, binding with SO_REUSEADDR too) can still listen on them, while
    nothing else can take one meanwhile: no outgoing connection gets one as its ephemeral
    port, no plain bind succeeds. Held for as long as the owners may restart. The first port
    already in use, instead, if one is."""
    held: list[socket.socket] = []
    for port in ports:
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            s.close()
            for h in held:
                h.close()
            return port
        held.append(s)
    return held


def raise_fd_limit() -> None:
    """Soft file limit up to the hard one: every connection holds a socket, and a burst (or a
    load test of thousands of calls) holds thousands at once."""
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        want = hard if hard != resource.RLIM_INFINITY else 1 << 16
        if soft != resource.RLIM_INFINITY and soft < want:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    except (ImportError, ValueError, OSError):
        pass


def connection_budget(reserve: int = 512) -> int:
    """How many client connections the process can hold: its file limit less ``reserve``
    descriptors for sockets to the workers, logs and libraries."""
    try:
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    except (ImportError, ValueError, OSError):
        return 1024
    if soft == resource.RLIM_INFINITY:
        return 1 << 16
    return max(64, soft - reserve)
