"""Router ↔ worker messages (ARCHITECTURE seam #3), one set for every transport.

The cluster simulator passes these objects through in-process queues with a network
delay; the live cluster sends the same structs over zmq (msgspec encodes them). Every
message names its ``worker``; times are the sender's clock (virtual or wall).

    router ──Dispatch──▶ worker            a request to queue
    router ◀──Tokens──── worker            new output tokens of one engine step
    router ◀─Finished─── worker            a request left: finished, rejected or aborted
    router ◀─Evicted──── worker            prefixes dropped from the worker's KV cache
    router ◀───Load───── worker            queue and memory gauges (periodic)

``Dispatch`` carries the ``Request`` object; its wire form is the request's
``SUBMITTED_FIELDS`` (the scheduler's bookkeeping never travels).
"""

from __future__ import annotations

import enum

import msgspec

from sgl_fair.request import Request

PROTOCOL_VERSION = 1

Tokens_ = tuple[int, ...]


class FinishReason(str, enum.Enum):
    LENGTH = "length"  # produced its output_len / max_new_tokens
    STOP = "stop"  # a stop condition (live engines)
    REJECTED = "rejected"  # refused at arrival (policy admission control, too large)
    ABORTED = "aborted"  # cancelled by the client or lost with its worker


class Dispatch(msgspec.Struct, frozen=True, gc=False):
    worker: int
    req: Request
    sent_s: float


class Tokens(msgspec.Struct, frozen=True, gc=False):
    """Tokens produced by one engine step: ``items`` holds ``(rid, new token ids)``."""

    worker: int
    t_s: float
    items: tuple[tuple[str, Tokens_], ...]


class Finished(msgspec.Struct, frozen=True, gc=False):
    worker: int
    t_s: float
    rid: str
    client: str
    reason: FinishReason
    input_ids: Tokens_  # what the worker computed (for the router's tree)
    output_ids: Tokens_
    prefix_len: int = 0  # cached prefix at (first) admission on the worker
    error: str | None = None  # why, for REJECTED / ABORTED

    @property
    def input_len(self) -> int:
        return len(self.input_ids)

    @property
    def num_output(self) -> int:
        return len(self.output_ids)

    @property
    def ok(self) -> bool:
        return self.reason in (FinishReason.LENGTH, FinishReason.STOP)


class Evicted(msgspec.Struct, frozen=True, gc=False):
    """Each block is ``(path, start)``: the worker no longer holds ``path[start:]`` (nor
    anything below it); ``path[:start]`` is unaffected by this block."""

    worker: int
    t_s: float
    blocks: tuple[tuple[Tokens_, int], ...]


class Load(msgspec.Struct, frozen=True, gc=False):
    worker: int
    t_s: float
    num_waiting: int
    num_running: int
    kv_used_tokens: int  # held by running requests (locked + private)
    kv_cached_tokens: int  # evictable prefix cache
    kv_capacity_tokens: int


WorkerMessage = Tokens | Finished | Evicted | Load

__all__ = [
    "PROTOCOL_VERSION",
    "Dispatch",
    "Evicted",
    "Finished",
    "FinishReason",
    "Load",
    "Tokens",
    "WorkerMessage",
]
