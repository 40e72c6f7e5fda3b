"""KV-cache events in SGLang's wire format: workers publish, the router's global tree follows.

SGLang (``sglang/srt/disaggregation/kv_events.py``) reports what enters and leaves a
worker's radix cache as msgpack ``KVEventBatch`` es on a zmq PUB socket, for KV-aware
routers (Dynamo, sgl-router). We speak exactly that format, so the router that follows our
simulated workers can later follow real SGLang workers unchanged::

    worker: PrefixKVCache ──changes──▶ KVEventEncoder ──events──▶ encode_batch ─▶ zmq PUB
    router: zmq SUB ─▶ parse_multipart ─▶ decode_batch ─▶ KVEventDecoder ──TreeOps──▶ Router

Wire format (what SGLang 0.5.23 sends; the structs below reproduce it field for field):

* a zmq multipart message ``(topic, seq as 8 big-endian bytes, payload)``; ``seq`` counts
  from 0 per publisher, so a subscriber sees a gap when it lost messages;
* ``payload`` is a msgpack array ``[ts, [event, ...], attn_dp_rank]``;
* each event is a msgpack map tagged by its class name (``{"type": "BlockStored", ...}``),
  optional fields left at their default omitted.

Blocks: a block is one *page* of KV (``block_size`` tokens). Its hash is chained from the
root: it depends on the page's tokens and its parent page's hash, so two equal hashes name
the same token path from the root up to that page. ``BlockStored`` carries a chain of
consecutive pages (``parent_block_hash`` links the first one, None at the root; the token
ids are concatenated); ``BlockRemoved`` lists pages dropped; ``AllBlocksCleared`` empties
the cache. Each page is stored once and removed once.

Page rounding (our workers, ``KVEventEncoder``): only *full* pages are published, so the
router credits a worker with its cached paths rounded down to a page multiple; it never
claims a token the worker does not hold, and misses at most ``page_size - 1`` per path.

The router's side, ``KVEventDecoder`` (events to token-path operations), is in
``sgl_fair/kv_decoder.py``. Both are pure (msgspec + stdlib): the zmq sockets live with the
processes.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import msgspec

# ---- SGLang's structs ----------------------------------------------------------------------
# Same class names (they are the tags on the wire), same field order and defaults.


class EventBatch(msgspec.Struct, array_like=True, gc=False):
    """A step's events; ``array_like`` makes it the positional array ``[ts, events, rank]``."""

    ts: float
    events: list[Any]
    attn_dp_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base of the events: tagged maps, ``"type"`` = class name; None optionals omitted."""


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    # Token ids; with EAGLE speculative decoding SGLang's cache keys are bigrams and a page
    # lists ``(token, next token)`` pairs (``mem_cache/events.py``, ``record_store``): pair j
    # is the KV of the page's token j. ``KVEventDecoder`` reads a pair as its first token.
    token_ids: list[int | tuple[int, int]]
    block_size: int
    lora_id: int | None
    medium: str | None = None
    cache_salt: str | None = None
    session_id: str | None = None
    lora_name: str | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


# SGLang's StorageMedium.GPU: what its radix cache publishes for device-memory pages (host
# and disk tiers of the hierarchical cache publish other mediums).
MEDIUM_GPU = "GPU"

# ---- bytes ---------------------------------------------------------------------------------

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(KVEventBatch)


def encode_batch(batch: EventBatch) -> bytes:
    """The msgpack payload of one batch (SGLang's publisher encodes the same way)."""
    return _encoder.encode(batch)


def decode_batch(payload: bytes) -> KVEventBatch:
    """Parse a payload; raises ValueError if it is not a well-formed ``KVEventBatch``.

    Unknown event types are errors, not skipped: msgspec validates the tagged union, and a
    consumer that silently dropped a store or a removal would drift from the worker.
    """
    try:
        return _decoder.decode(payload)
    except msgspec.MsgspecError as exc:
        raise ValueError(f"not a KV event batch: {exc}") from exc


def multipart(topic: bytes, seq: int, payload: bytes | EventBatch) -> tuple[bytes, bytes, bytes]:
    """The three zmq frames SGLang's ``ZmqEventPublisher`` sends for one batch."""
    if not 0 <= seq < 1 << 64:
        raise ValueError(f"seq must fit 8 unsigned bytes (got {seq})")
    if isinstance(payload, EventBatch):
        payload = encode_batch(payload)
    return bytes(topic), seq.to_bytes(8, "big"), bytes(payload)


def parse_multipart(frames: Sequence[bytes]) -> tuple[bytes, int, bytes]:
    """``(topic, seq, payload)`` of a received message; ValueError if it is malformed."""
    if len(frames) != 3:
        raise ValueError(f"a KV event message has 3 frames (topic, seq, data), not {len(frames)}")
    topic, seq, payload = (bytes(frame) for frame in frames)
    if len(seq) != 8:
        raise ValueError(f"the seq frame must be 8 bytes, got {len(seq)}")
    return topic, int.from_bytes(seq, "big"), payload


# ---- worker side ---------------------------------------------------------------------------

Tokens = tuple[int, ...]
# What a worker's cache did, in order: ("stored", path, start): it now also holds
# path[start:] (it held path[:start] already); ("removed", path, start): it dropped
# path[start:] and anything below; ("cleared", (), 0): it dropped everything.
Change = tuple[str, Sequence[int], int]


def _page_hashes(path: Tokens, num_pages: int, page_size: int) -> list[int]:
    """Chained hashes of the first ``num_pages`` pages of ``path``.

    ``hash((parent_hash, *page_tokens))`` with parent 0 at the root. A tuple of ints hashes
    the same in every process of the same interpreter build: PYTHONHASHSEED randomizes only
    str/bytes hashes, and an int's hash is its value mod 2**61 - 1. The result is a C
    ``Py_hash_t``, already a signed 64-bit int on 64-bit builds (what the wire's int64 needs).
    Nobody but the encoder that made a hash ever recomputes it (the router uses hashes as
    opaque ids), so even a different Python version on the router side cannot matter.

    Not cryptographic (ints hash mod 2**61 - 1, so the chain carries ~61 bits): a collision,
    accidental or crafted, only costs locality — a page not published, or a claim dropped —
    never a wrong answer, since the router's tree is a routing hint.
    """
    hashes = []
    h = 0
    if page_size == 1:
        for token in path[:num_pages]:
            h = hash((h, token))
            hashes.append(h)
        return hashes
    for i in range(0, num_pages * page_size, page_size):
        h = hash((h, *path[i : i + page_size]))
        hashes.append(h)
    return hashes


class KVEventEncoder:
    """Turns a worker's cache changes into SGLang events, one page = ``page_size`` tokens.

    Only full pages are published: page ``i`` of a path covers ``path[i*P:(i+1)*P]`` and is
    published once the cache holds all of it. The encoder remembers the hashes it published,
    so a page is stored once and removed once, and never removed unless it was stored.
    """

    def __init__(self, page_size: int = 16) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1 (got {page_size})")
        self.page_size = page_size
        self._published: set[int] = set()

    @property
    def num_published(self) -> int:
        """Pages currently published (stored and not removed since)."""
        return len(self._published)

    def events(self, changes: Iterable[Change]) -> list[KVEvent]:
        """The events for ``changes`` (in order), coalesced as SGLang's recorder does."""
        out: list[KVEvent] = []
        for kind, path, start in changes:
            if kind == "stored":
                self._stored(tuple(path), start, out)
            elif kind == "removed":
                self._removed(tuple(path), start, out)
            elif kind == "cleared":
                self._published.clear()
                out.append(AllBlocksCleared())
            else:
                raise ValueError(f"unknown cache change {kind!r}")
        return out

    def _stored(self, path: Tokens, start: int, out: list[KVEvent]) -> None:
        size = self.page_size
        num_full = len(path) // size
        if num_full == 0 or start >= num_full * size:
            return  # nothing new completes a page
        published = self._published
        hashes = _page_hashes(path, num_full, size)
        # Every unpublished full page of the path, not only those at or after `start`: the
        # cache holds all of path, and normally the pages before `start` were published
        # already (so this is exactly the pages the new tokens complete). If recording began
        # late, a store heals the chain instead of publishing an orphan. Runs of consecutive
        # new pages are handled in bulk (normally one run: the path's tail).
        i = 0
        while i < num_full:
            if hashes[i] in published:
                i += 1
                continue
            j = i + 1
            while j < num_full and hashes[j] not in published:
                j += 1
            run = hashes[i:j]
            published.update(run)
            parent = hashes[i - 1] if i else None
            tokens = path[i * size : j * size]
            tail = out[-1] if out else None
            if (
                isinstance(tail, BlockStored)
                and tail.block_size == size
                and parent is not None
                and tail.block_hashes[-1] == parent
            ):
                tail.block_hashes.extend(run)
                tail.token_ids.extend(tokens)
            else:
                out.append(
                    BlockStored(
                        block_hashes=run,
                        parent_block_hash=parent,
                        token_ids=list(tokens),
                        block_size=size,
                        lora_id=None,
                        medium=MEDIUM_GPU,
                    )
                )
            i = j

    def _removed(self, path: Tokens, start: int, out: list[KVEvent]) -> None:
        size = self.page_size
        num_full = len(path) // size
        first = max(start, 0) // size  # the page holding path[start] is no longer whole
        if first >= num_full or not self._published:
            return
        published = self._published
        gone = [h for h in _page_hashes(path, num_full, size)[first:] if h in published]
        if not gone:
            return
        published.difference_update(gone)
        tail = out[-1] if out else None
        if isinstance(tail, BlockRemoved):
            tail.block_hashes.extend(gone)
        else:
            out.append(BlockRemoved(block_hashes=gone, medium=MEDIUM_GPU))


def cached_paths(root: Any) -> list[Tokens]:
    """Every root-to-leaf token path of a radix tree (``sgl_fair.radix``'s nodes): a worker's
    cache as its snapshot (``KVSnapshot``) stores it through ``KVEventEncoder``."""
    out: list[Tokens] = []
    stack = [(child, child.key) for child in root.children.values()]
    while stack:
        node, path = stack.pop()
        if not node.children:
            out.append(path)
        stack.extend((c, path + c.key) for c in node.children.values())
    return out


__all__ = [
    "MEDIUM_GPU",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "Change",
    "EventBatch",
    "KVCacheEvent",
    "KVEvent",
    "KVEventBatch",
    "KVEventEncoder",
    "cached_paths",
    "decode_batch",
    "encode_batch",
    "multipart",
    "parse_multipart",
]
