"""Router <-> worker links over zmq: the wire form of ``sgl_fair.messages`` and the endpoints.

Sockets (the router binds what it owns, so workers may start, die and restart freely)::

    router  PULL  bind  {base}/router-in  <── PUSH  connect  every worker   Tokens, Finished, Load,
                                                                           Hello, Flushed
    router  PUSH  bind  {base}/w{i}-in    ──> PULL  connect  worker i      Dispatch, Abort,
                                                                           FlushCache, Shutdown
    router  SUB   connect {kv(i)}         <── PUB   bind     worker i      KV events, SGLang's
                                                                           format and framing

A frame is one kind byte followed by the msgpack of the message (msgspec); a ``Dispatch``
carries only the request's submitted fields. The KV-event sockets speak exactly what an
SGLang worker started with ``--kv-events-config '{"publisher": "zmq", ...}'`` publishes, so
the same router can follow SGLang workers (``sgl_fair.kv_events``).
"""

from __future__ import annotations

import os
import typing
from dataclasses import dataclass, fields
from typing import Any

import msgspec

from sgl_fair.messages import (
    Abort,
    Dispatch,
    Evicted,
    Finished,
    FlushCache,
    Flushed,
    Hello,
    KVSnapshot,
    Load,
    Shutdown,
    Tokens,
)
from sgl_fair.request import SUBMITTED_FIELDS, Request

_hints = typing.get_type_hints(Request)
# The request's submitted fields as a positional msgpack array: compact and fast.
RequestWire = msgspec.defstruct(
    "RequestWire",
    [(name, _hints[name]) for name in SUBMITTED_FIELDS],
    array_like=True,
    frozen=True,
    gc=False,
)
_REQUEST_DEFAULTS = {f.name for f in fields(Request)}


class DispatchWire(msgspec.Struct, array_like=True, frozen=True, gc=False):
    worker: int
    sent_s: float
    req: RequestWire  # type: ignore[valid-type]
    tag: tuple[int, int] | None = None  # Dispatch.tag (a router replica's, to a bridge)


# kind byte <-> message type; never renumber (a router and its workers must agree).
_KINDS: dict[type, int] = {
    DispatchWire: 1,
    Abort: 2,
    FlushCache: 3,
    Shutdown: 4,
    Tokens: 10,
    Finished: 11,
    Load: 12,
    Hello: 13,
    Flushed: 14,
    Evicted: 15,
    KVSnapshot: 16,
}
_DECODERS = {k: msgspec.msgpack.Decoder(t) for t, k in _KINDS.items()}
_encoder = msgspec.msgpack.Encoder()


class WireError(ValueError):
    """A frame that is not one of our messages (wrong kind byte, or bad msgpack)."""


def encode(msg: Any) -> bytes:
    if type(msg) is Dispatch:
        req = msg.req
        wire = RequestWire(*[getattr(req, name) for name in SUBMITTED_FIELDS])
        msg = DispatchWire(msg.worker, msg.sent_s, wire, msg.tag)
    kind = _KINDS.get(type(msg))
    if kind is None:
        raise TypeError(f"not a wire message: {type(msg).__name__}")
    return bytes((kind,)) + _encoder.encode(msg)


def decode(frame: bytes) -> Any:
    if not frame:
        raise WireError("empty frame")
    dec = _DECODERS.get(frame[0])
    if dec is None:
        raise WireError(f"unknown message kind {frame[0]}")
    try:
        msg = dec.decode(memoryview(frame)[1:])
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise WireError(f"bad frame: {e}") from None
    if type(msg) is DispatchWire:
        r = msg.req
        req = Request(**{name: getattr(r, name) for name in SUBMITTED_FIELDS})
        return Dispatch(msg.worker, req, msg.sent_s, msg.tag)
    return msg


@dataclass(frozen=True)
class Endpoints:
    """Where the sockets live. ``base`` is ``ipc://DIR`` (one machine) or ``tcp://HOST:PORT``
    (ports PORT, PORT+1 … : router-in, then per worker its input and KV publisher)."""

    base: str

    @classmethod
    def ipc(cls, directory: str) -> Endpoints:
        os.makedirs(directory, exist_ok=True)
        return cls(f"ipc://{directory}")

    def _tcp(self, offset: int) -> str:
        host, port = self.base[len("tcp://") :].rsplit(":", 1)
        return f"tcp://{host}:{int(port) + offset}"

    @property
    def router_in(self) -> str:
        if self.base.startswith("tcp://"):
            return self._tcp(0)
        return f"{self.base}/router-in"

    def worker_in(self, i: int) -> str:
        if self.base.startswith("tcp://"):
            return self._tcp(1 + 2 * i)
        return f"{self.base}/w{i}-in"

    def worker_kv(self, i: int) -> str:
        if self.base.startswith("tcp://"):
            return self._tcp(2 + 2 * i)
        return f"{self.base}/w{i}-kv"


__all__ = ["Endpoints", "RequestWire", "WireError", "decode", "encode"]
