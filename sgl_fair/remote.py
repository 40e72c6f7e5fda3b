"""Remote workers over tcp: the endpoint's addresses, its two control messages, CURVE keys.

A standalone worker (``python -m sgl_fair.worker --bind tcp://HOST:PORT``) serves any number
of routers (replicas) from two sockets::

    worker ROUTER bind tcp://HOST:PORT    <──> DEALER connect  each router replica
        in:  Attach, Detach, Dispatch, Abort, FlushCache,
             Shutdown (= Detach from a router)
        out: to the replica that dispatched a request: its Tokens and Finished;
             to every attached replica: Load (the heartbeat) and, on attach, Hello
    worker PUB    bind tcp://HOST:PORT+1  ──> SUB    connect  each router replica
             KV events, SGLang's format (``sgl_fair.kv_events``), to every replica

Load rides the same stream as Tokens and Finished so each replica sees it in order after
the tokens it reports (the router's queue counts rely on that). A replica announces itself
with ``Attach`` every ``ATTACH_PERIOD_S``; a worker forgets a replica that is silent for
``peer_timeout_s`` or whose connection is gone, and aborts the requests it had dispatched
(nobody would read their tokens). Message ``worker`` ids are the worker's own; each router
renumbers them to its slot for the worker. A replica that shares fairness state tags each
``Dispatch`` (``Dispatch.tag``: the replica and the extend tokens it charged, as a bridge
sends it to its SGLang server's plugin); the worker's ``Load`` then carries the
``ServiceReport`` of every tagged dispatch (``worker/service_ledger.py``).

Keys (ZMQ CURVE, from files written by ``zmq.auth.create_certificates``): the worker holds a
secret certificate and a folder of the routers' public certificates it accepts; a router
holds its own secret certificate and the worker's public one. A non-loopback address without
keys is refused unless the operator says ``--insecure``.
"""

from __future__ import annotations

import ipaddress
import os
import time
from dataclasses import dataclass
from typing import Any

import msgspec

from sgl_fair.messages import PROTOCOL_VERSION
from sgl_fair.transport import WireError, decode

ATTACH_PERIOD_S = 1.0
# Kind bytes beside transport's (never reuse theirs; 42 was a tag frame before the tag rode
# in ``Dispatch``, protocol 2).
_ATTACH, _DETACH = 40, 41


class Attach(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """A router replica is here (sent on connect and every ``ATTACH_PERIOD_S``)."""

    router: str
    t_s: float
    version: int = PROTOCOL_VERSION


class Detach(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """A router replica leaves: abort what it dispatched, send it nothing more."""

    router: str


_enc = msgspec.msgpack.Encoder()
_dec = {
    _ATTACH: msgspec.msgpack.Decoder(Attach),
    _DETACH: msgspec.msgpack.Decoder(Detach),
}
_CONTROL_KINDS = {Attach: _ATTACH, Detach: _DETACH}


def encode_control(msg: Attach | Detach) -> bytes:
    return bytes((_CONTROL_KINDS[type(msg)],)) + _enc.encode(msg)


def decode_frame(frame: bytes) -> Any:
    """A router's frame: ``Attach`` / ``Detach``, else one of ``sgl_fair.transport``'s."""
    if frame and frame[0] in _dec:
        try:
            return _dec[frame[0]].decode(memoryview(frame)[1:])
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            raise WireError(f"bad frame: {e}") from None
    return decode(frame)


def attach(name: str) -> bytes:
    return encode_control(Attach(name, time.time()))


# ---- addresses --------------------------------------------------------------------------------


def parse_tcp(address: str, flag: str) -> tuple[str, int]:
    """``tcp://HOST:PORT`` -> (host, port); ValueError naming ``flag`` otherwise."""
    rest = address[len("tcp://") :] if address.startswith("tcp://") else None
    host, sep, port = (rest or "").rpartition(":")
    if rest is None or not sep or not host or not port.isdigit() or not 0 < int(port) < 65535:
        raise ValueError(
            f"{flag}: expected tcp://HOST:PORT with PORT below 65535 (got {address!r})"
        )
    return host.strip("[]"), int(port)


def kv_address(address: str) -> str:
    """The KV-event publisher of the endpoint at ``address``: the next port."""
    host, port = parse_tcp(address, "endpoint")
    host = f"[{host}]" if ":" in host else host
    return f"tcp://{host}:{port + 1}"


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


# ---- keys -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ServerKeys:
    """The worker's side: its secret certificate and the folder of accepted routers' public
    certificates."""

    secret_file: str
    authorized_dir: str

    def load(self) -> tuple[bytes, bytes]:
        import zmq.auth

        public, secret = zmq.auth.load_certificate(self.secret_file)
        if not secret:
            raise ValueError(f"{self.secret_file}: not a secret certificate (*.key_secret)")
        return public, secret


@dataclass(frozen=True)
class ClientKeys:
    """A router's side: its secret certificate and the worker's public one."""

    secret_file: str
    server_public_file: str


def make_keys(directory: str) -> dict[str, str]:
    """Write a worker and a router certificate pair under ``directory``; the router's public
    certificate also goes into ``directory/authorized`` (the worker's accepted set)."""
    import shutil

    import zmq.auth

    os.makedirs(directory, exist_ok=True)
    authorized = os.path.join(directory, "authorized")
    os.makedirs(authorized, exist_ok=True)
    worker_pub, worker_sec = zmq.auth.create_certificates(directory, "worker")
    router_pub, router_sec = zmq.auth.create_certificates(directory, "router")
    shutil.copy(router_pub, os.path.join(authorized, "router.key"))
    for path in (worker_sec, router_sec):
        os.chmod(path, 0o600)
    return {
        "worker_secret": worker_sec, "worker_public": worker_pub,
        "router_secret": router_sec, "router_public": router_pub, "authorized": authorized,
    }  # fmt: skip


def curve_server(sock: Any, keys: ServerKeys) -> None:
    public, secret = keys.load()
    sock.curve_secretkey = secret
    sock.curve_publickey = public
    sock.curve_server = True


def curve_client(sock: Any, keys: ClientKeys) -> None:
    import zmq.auth

    public, secret = zmq.auth.load_certificate(keys.secret_file)
    if not secret:
        raise ValueError(f"{keys.secret_file}: not a secret certificate (*.key_secret)")
    server_public, _ = zmq.auth.load_certificate(keys.server_public_file)
    sock.curve_secretkey = secret
    sock.curve_publickey = public
    sock.curve_serverkey = server_public


__all__ = [
    "ATTACH_PERIOD_S",
    "Attach",
    "ClientKeys",
    "Detach",
    "ServerKeys",
    "attach",
    "curve_client",
    "curve_server",
    "decode_frame",
    "encode_control",
    "is_loopback",
    "kv_address",
    "make_keys",
    "parse_tcp",
]
