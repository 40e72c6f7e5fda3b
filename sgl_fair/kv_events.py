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

This module is pure (msgspec + stdlib): the zmq sockets live with the processes.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections.abc import Iterable, Sequence
from itertools import chain
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
    token_ids: list[int]
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


# ---- router side ---------------------------------------------------------------------------


class Stored(msgspec.Struct, frozen=True, gc=False):
    """The worker holds all of ``path`` (and so every prefix of it)."""

    path: Tokens


class Removed(msgspec.Struct, frozen=True, gc=False):
    """The worker dropped ``path[start:]`` and everything below it (like ``Evicted``)."""

    path: Tokens
    start: int


class Cleared(msgspec.Struct, frozen=True, gc=False):
    """The worker dropped its whole cache."""


TreeOp = Stored | Removed | Cleared


Children = list[tuple[Tokens, int]]  # sibling pages as (tokens, hash), sorted


class _Block:
    """One known page: its parent page's hash (None at the root) and its own tokens.

    ``children`` is None, one hash, or a sorted list of ``(tokens, hash)``: most pages
    have at most one child (a chain; page size 1 means one block per token), so the
    common case costs no list. Sorting lets a removal find, in O(log n), the surviving
    sibling sharing the most leading tokens (it is adjacent in sorted order).
    """

    __slots__ = ("parent", "tokens", "children")

    def __init__(self, parent: int | None, tokens: Tokens) -> None:
        self.parent = parent
        self.tokens = tokens
        self.children: int | Children | None = None


def _common_len(a: Tokens, b: Tokens) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


class KVEventDecoder:
    """One worker's event stream → ``TreeOp`` s for the router's global tree.

    Keeps ``hash → (parent hash, page tokens)`` and rebuilds a page's full token path by
    walking its parents, so memory stays linear in the tokens cached (storing each page's
    whole path would be quadratic at page size 1, SGLang's default). Works for any block
    size, including SGLang's last, shorter page of a radix node (``block_size`` is per
    event there).

    Removals are token-exact: sibling pages (same parent) may share leading tokens — the
    page ``(5, 0, 0, 0)`` goes while ``(5, 1, 0, 0)`` stays — and the router's tree is a
    token tree, so a ``Removed`` starts where the page leaves every surviving sibling, not
    at the page's start (which would drop the sibling's claim too).

    Never raises on a well-typed but inconsistent stream (late join, lost messages, a
    buggy producer): what cannot be placed is skipped and counted.

    ``medium``: only events of that storage medium are followed (SGLang's hierarchical
    cache also publishes host-memory tiers, with the same hashes); events with no medium
    count as it. None follows every event.
    """

    def __init__(self, *, medium: str | None = MEDIUM_GPU) -> None:
        self.medium = medium
        self._blocks: dict[int, _Block] = {}
        self._roots: Children = []  # pages whose parent is the root
        # The last path built and the hash of its last page: the next event of a step
        # usually continues it (SGLang splits a node's chain when the last page is short).
        self._last: tuple[int, Tokens] | None = None
        self.num_orphans = 0  # BlockStored events whose parent hash is unknown
        self.num_malformed = 0  # BlockStored events whose sizes do not add up
        self.num_unknown_removed = 0  # hashes in BlockRemoved never stored (or gone)
        self.num_ignored = 0  # events of another storage medium

    @property
    def num_blocks(self) -> int:
        """Pages currently known to be held."""
        return len(self._blocks)

    def apply(self, batch: EventBatch | Iterable[KVEvent]) -> list[TreeOp]:
        """The tree operations for one batch (or a list of events), in order."""
        events = batch.events if isinstance(batch, EventBatch) else batch
        ops: list[TreeOp] = []
        for ev in events:
            if isinstance(ev, AllBlocksCleared):
                self._blocks.clear()
                self._roots.clear()
                self._last = None
                ops.append(Cleared())
                continue
            if not isinstance(ev, (BlockStored, BlockRemoved)):
                raise TypeError(f"not a KV cache event: {ev!r}")
            if self.medium is not None and ev.medium is not None and ev.medium != self.medium:
                self.num_ignored += 1
            elif isinstance(ev, BlockStored):
                self._stored(ev, ops)
            else:
                self._removed(ev, ops)
        return ops

    def leaf_paths(self) -> list[Tokens]:
        """The token path of every known page with no known child: together, every path the
        worker holds (what a follower rebuilds its tree from)."""
        return [self.path(h) for h, block in self._blocks.items() if not block.children]

    def path(self, block_hash: int) -> Tokens:
        """The token path from the root to the end of a known page (KeyError if unknown)."""
        last = self._last
        if last is not None and last[0] == block_hash:
            return last[1]
        blocks = self._blocks
        parts = []
        h: int | None = block_hash
        while h is not None:
            block = blocks[h]
            parts.append(block.tokens)
            h = block.parent
        return tuple(chain.from_iterable(reversed(parts)))

    # ---- stores --------------------------------------------------------------------------

    def _stored(self, ev: BlockStored, ops: list[TreeOp]) -> None:
        hashes, token_ids, size = ev.block_hashes, ev.token_ids, ev.block_size
        if not hashes or size < 1 or len(token_ids) != size * len(hashes):
            self.num_malformed += 1
            return
        blocks = self._blocks
        parent = ev.parent_block_hash
        if parent is None:
            prefix: Tokens = ()
        elif parent in blocks:
            prefix = self.path(parent)
        else:
            self.num_orphans += 1
            return
        tokens = tuple(token_ids)
        end = 0
        # The block new pages hang below (None at the root): within an event it is the
        # page just added, whose child slot is empty, so linking is one assignment.
        above = blocks[parent] if parent is not None else None
        for i, h in enumerate(hashes):
            page = tokens[i * size : (i + 1) * size]
            known = blocks.get(h)
            if known is None:
                block = blocks[h] = _Block(parent, page)
                if above is not None and above.children is None:
                    above.children = h
                else:
                    self._link(parent, h, page)
                above = block
            elif known.parent != parent or known.tokens != page:
                # The hash names another path (a collision, or a producer out of step):
                # keep the first meaning; what follows in this event cannot be placed.
                self.num_malformed += 1
                break
            else:  # stored twice (store once is the protocol, but a replay may repeat)
                above = known
            parent = h
            end = (i + 1) * size
        if end:
            path = prefix + tokens[:end]
            self._last = (hashes[end // size - 1], path)
            ops.append(Stored(path))

    def _siblings(self, parent: int | None) -> Children | None:
        """The sorted child list of ``parent`` (the root's if None), or None if it has <2."""
        if parent is None:
            return self._roots
        block = self._blocks.get(parent)
        if block is None or not isinstance(block.children, list):
            return None
        return block.children

    def _link(self, parent: int | None, h: int, tokens: Tokens) -> None:
        if parent is None:
            insort(self._roots, (tokens, h))
            return
        block = self._blocks[parent]
        c = block.children
        if c is None:
            block.children = h
        elif isinstance(c, list):
            insort(c, (tokens, h))
        else:
            block.children = sorted([(self._blocks[c].tokens, c), (tokens, h)])

    def _unlink(self, parent: int | None, h: int, tokens: Tokens) -> None:
        if parent is not None:
            block = self._blocks.get(parent)
            if block is None:
                return
            if not isinstance(block.children, list):
                if block.children == h:
                    block.children = None
                return
        siblings = self._siblings(parent)
        assert siblings is not None
        i = bisect_left(siblings, (tokens, h))
        if i < len(siblings) and siblings[i][1] == h:
            del siblings[i]

    # ---- removals ------------------------------------------------------------------------

    def _removed(self, ev: BlockRemoved, ops: list[TreeOp]) -> None:
        blocks = self._blocks
        known = [h for h in dict.fromkeys(ev.block_hashes) if h in blocks]
        self.num_unknown_removed += len(ev.block_hashes) - len(known)
        if not known:
            return
        gone = set(known)
        # A page whose parent goes in the same event is covered by its parent's removal.
        roots = [h for h in known if blocks[h].parent not in gone]
        for h in roots:
            path = self.path(h)
            start = len(path) - len(blocks[h].tokens) + self._still_held(h, gone)
            if start < len(path):
                ops.append(Removed(path, start))
        self._last = None
        for h in roots:
            self._forget(h)

    def _still_held(self, h: int, gone: set[int]) -> int:
        """Leading tokens of page ``h`` still held through a sibling page that stays."""
        block = self._blocks[h]
        siblings = self._siblings(block.parent)
        if not siblings:
            return 0
        tokens = block.tokens
        i = bisect_left(siblings, (tokens, h))
        held = 0
        j = i - 1  # the nearest surviving sibling on each side shares the most tokens
        while j >= 0 and siblings[j][1] in gone:
            j -= 1
        if j >= 0:
            held = _common_len(tokens, siblings[j][0])
        j = i + 1 if i < len(siblings) and siblings[i][1] == h else i
        while j < len(siblings) and siblings[j][1] in gone:
            j += 1
        if j < len(siblings):
            held = max(held, _common_len(tokens, siblings[j][0]))
        return held

    def _forget(self, root: int) -> None:
        """Drop ``root`` and every page below it."""
        blocks = self._blocks
        block = blocks.get(root)
        if block is None:
            return  # under another root forgotten already
        self._unlink(block.parent, root, block.tokens)
        stack = [root]
        while stack:
            block = blocks.pop(stack.pop(), None)
            if block is None:
                continue
            c = block.children
            if isinstance(c, list):
                stack.extend(h for _, h in c)
            elif c is not None:
                stack.append(c)


__all__ = [
    "MEDIUM_GPU",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "Change",
    "Cleared",
    "EventBatch",
    "KVCacheEvent",
    "KVEvent",
    "KVEventBatch",
    "KVEventDecoder",
    "KVEventEncoder",
    "Removed",
    "Stored",
    "TreeOp",
    "decode_batch",
    "encode_batch",
    "multipart",
    "parse_multipart",
]
