"""KV-cache events in SGLang's wire format: bytes, the worker's encoder, the router's decoder.

The end-to-end properties drive a real ``PrefixKVCache`` (and a real ``Scheduler``) with
random shared-prefix prompts and a small KV pool, ship every step's events through bytes
and zmq frames to a decoder and a real ``Router``, and check the router's tree against the
worker's cache at page granularity: the router credits the worker with exactly the full
pages it holds — never a token more, never a whole page less.
"""

from __future__ import annotations

import hashlib
import itertools
import random
import subprocess
import sys

import msgspec
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from sgl_fair.kv_decoder import Cleared, KVEventDecoder, Removed, Stored
from sgl_fair.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    KVEventEncoder,
    decode_batch,
    encode_batch,
    multipart,
    parse_multipart,
)
from sgl_fair.policies import make_policy
from sgl_fair.radix import RadixTree
from sgl_fair.request import Request
from sgl_fair.router import GlobalTree, Router, make_router_policy
from sgl_fair.worker.engine import Batch, StepResult
from sgl_fair.worker.kv import PrefixKVCache, TokenAllocator
from sgl_fair.worker.scheduler import Scheduler, SchedulerConfig

WORKER = 0


def stored(hashes, parent, tokens, size, **kw) -> BlockStored:
    return BlockStored(
        block_hashes=list(hashes),
        parent_block_hash=parent,
        token_ids=list(tokens),
        block_size=size,
        lora_id=None,
        **kw,
    )


def seq(start: int, length: int) -> tuple[int, ...]:
    return tuple(range(start, start + length))


# ---- wire format -----------------------------------------------------------------------------


def sample_batch() -> KVEventBatch:
    return KVEventBatch(
        ts=12.5,
        events=[
            stored([11, -22], None, [1, 2, 3, 4], 2, medium="GPU", session_id="s"),
            BlockRemoved(block_hashes=[-22]),
            AllBlocksCleared(),
        ],
        attn_dp_rank=3,
    )


def test_round_trip_through_bytes():
    batch = sample_batch()
    assert decode_batch(encode_batch(batch)) == batch
    topic, seq_no, payload = parse_multipart(list(multipart(b"kv@w1", 7, batch)))
    assert (topic, seq_no) == (b"kv@w1", 7)
    assert decode_batch(payload) == batch


def test_wire_layout_matches_sglang():
    """The batch is a positional array, events are maps tagged by class name, in field
    order, optional fields at None omitted (required ones encoded as nil)."""
    expected = [
        12.5,
        [
            {
                "type": "BlockStored",
                "block_hashes": [11, -22],
                "parent_block_hash": None,
                "token_ids": [1, 2, 3, 4],
                "block_size": 2,
                "lora_id": None,
                "medium": "GPU",
                "session_id": "s",
            },
            {"type": "BlockRemoved", "block_hashes": [-22]},
            {"type": "AllBlocksCleared"},
        ],
        3,
    ]
    assert encode_batch(sample_batch()) == msgspec.msgpack.encode(expected)


def test_wire_bytes_by_hand():
    payload = encode_batch(KVEventBatch(ts=1.0, events=[AllBlocksCleared()]))
    assert payload == (
        b"\x93"  # array of 3: ts, events, attn_dp_rank
        + b"\xcb" + bytes.fromhex("3ff0000000000000")  # ts: float64 1.0
        + b"\x91"  # one event
        + b"\x81\xa4type\xb0AllBlocksCleared"  # {"type": "AllBlocksCleared"}
        + b"\xc0"  # attn_dp_rank: nil
    )  # fmt: skip


def test_decode_without_attn_dp_rank_and_of_sglang_shaped_input():
    payload = msgspec.msgpack.encode(
        [3.0, [{"type": "BlockRemoved", "block_hashes": [5], "medium": "CPU_PINNED"}]]
    )
    batch = decode_batch(payload)
    assert batch.attn_dp_rank is None and batch.ts == 3.0
    assert batch.events == [BlockRemoved(block_hashes=[5], medium="CPU_PINNED")]


@pytest.mark.parametrize(
    "payload",
    [
        msgspec.msgpack.encode([1.0, [{"type": "BlockMoved", "block_hashes": [1]}]]),
        msgspec.msgpack.encode([1.0, [{"type": "BlockRemoved"}]]),  # missing field
        msgspec.msgpack.encode({"ts": 1.0, "events": []}),  # a map, not an array
        b"\xc1garbage",
        b"",
    ],
)
def test_garbage_is_a_value_error(payload):
    with pytest.raises(ValueError, match="not a KV event batch"):
        decode_batch(payload)


def test_multipart_frames():
    frames = multipart(b"", 0, b"x")
    assert frames == (b"", b"\x00" * 8, b"x")
    assert parse_multipart([bytearray(b"t"), memoryview(b"\x00" * 7 + b"\x02"), b"p"]) == (
        b"t",
        2,
        b"p",
    )
    with pytest.raises(ValueError, match="3 frames"):
        parse_multipart([b"t", b"\x00" * 8])
    with pytest.raises(ValueError, match="8 bytes"):
        parse_multipart([b"t", b"\x00" * 4, b"p"])
    with pytest.raises(ValueError, match="seq"):
        multipart(b"t", -1, b"p")


def test_cross_decode_with_sglang():
    """Our bytes decode with SGLang's classes and SGLang's bytes with ours (needs sglang)."""
    sgl = pytest.importorskip("sglang.srt.disaggregation.kv_events")
    ours = sample_batch()
    theirs = msgspec.msgpack.Decoder(sgl.KVEventBatch).decode(encode_batch(ours))
    assert msgspec.msgpack.encode(theirs) == encode_batch(ours)
    assert [type(e).__name__ for e in theirs.events] == [type(e).__name__ for e in ours.events]
    sgl_batch = sgl.KVEventBatch(
        ts=2.0,
        events=[
            sgl.BlockStored(
                block_hashes=[1, 2],
                parent_block_hash=None,
                token_ids=[7, 8],
                block_size=1,
                lora_id=None,
                medium=sgl.StorageMedium.GPU,
            ),
            sgl.BlockRemoved(block_hashes=[2], medium=sgl.StorageMedium.GPU),
            sgl.AllBlocksCleared(),
        ],
    )
    decoded = decode_batch(msgspec.msgpack.encode(sgl_batch))
    assert decoded.events == [
        stored([1, 2], None, [7, 8], 1, medium="GPU"),
        BlockRemoved(block_hashes=[2], medium="GPU"),
        AllBlocksCleared(),
    ]
    assert KVEventDecoder().apply(decoded) == [Stored((7, 8)), Removed((7, 8), 1), Cleared()]


# ---- encoder ---------------------------------------------------------------------------------


def test_only_full_pages_are_published():
    enc = KVEventEncoder(page_size=4)
    (ev,) = enc.events([("stored", seq(0, 10), 0)])
    assert isinstance(ev, BlockStored)
    assert ev.token_ids == list(seq(0, 8)) and ev.block_size == 4
    assert len(ev.block_hashes) == 2 and ev.parent_block_hash is None
    assert enc.events([("stored", seq(0, 3), 0)]) == []  # not even one page
    assert enc.num_published == 2


def test_completing_a_partial_page_publishes_it():
    enc = KVEventEncoder(page_size=4)
    (first,) = enc.events([("stored", seq(0, 10), 0)])
    # Two more tokens complete page 2 (tokens 8..11), which started before `start`.
    (ev,) = enc.events([("stored", seq(0, 12), 10)])
    assert ev.parent_block_hash == first.block_hashes[-1]
    assert ev.token_ids == list(seq(8, 4)) and len(ev.block_hashes) == 1
    # A sibling completing the same partial page differently is another page.
    (sib,) = enc.events([("stored", seq(0, 10) + (99, 98), 10)])
    assert sib.parent_block_hash == first.block_hashes[-1]
    assert sib.block_hashes != ev.block_hashes and sib.token_ids == [8, 9, 99, 98]


def test_store_once_remove_once_and_never_what_was_not_stored():
    enc = KVEventEncoder(page_size=4)
    path = seq(0, 12)
    assert enc.events([("removed", path, 0)]) == []  # never stored
    (st1,) = enc.events([("stored", path, 0)])
    assert enc.events([("stored", path, 0)]) == []  # stored already
    assert enc.events([("stored", path, 5)]) == []
    assert enc.events([("removed", seq(0, 11), 9)]) == []  # partial page 2 never stored
    assert enc.events([("removed", (5,) * 12, 0)]) == []  # another path
    (rm,) = enc.events([("removed", path, 6)])  # page 1 (4..7) overlaps path[6:]
    assert rm.block_hashes == st1.block_hashes[1:]
    assert enc.events([("removed", path, 6)]) == []  # removed already
    (rm0,) = enc.events([("removed", path, 0)])
    assert rm0.block_hashes == st1.block_hashes[:1]
    assert enc.num_published == 0


def test_encoder_coalesces_like_sglang():
    enc = KVEventEncoder(page_size=16)
    a, b = seq(0, 2000), seq(5000, 40)
    events = enc.events(
        [
            ("stored", a[:1000], 0),
            ("stored", a, 1000),  # continues the chain: same event
            ("stored", b, 0),  # a new chain from the root: a new event
            ("removed", a, 1990),
            ("removed", b, 10),  # consecutive removals: one event
            ("stored", a[:1990], 1984),  # (a's last page again; before: 1984..1999)
            ("cleared", (), 0),
        ]
    )
    kinds = [type(e).__name__ for e in events]
    assert kinds == ["BlockStored", "BlockStored", "BlockRemoved", "AllBlocksCleared"]
    assert len(events[0].block_hashes) == 125 and len(events[0].token_ids) == 2000
    assert len(events[1].block_hashes) == 2
    assert len(events[2].block_hashes) == 1 + 2  # a's page 124, b's pages 0 and 1
    assert enc.num_published == 0
    with pytest.raises(ValueError, match="unknown cache change"):
        enc.events([("moved", (), 0)])
    with pytest.raises(ValueError, match="page_size"):
        KVEventEncoder(page_size=0)


def test_a_late_store_heals_the_chain():
    """Recording switched on late: the first store publishes every held full page."""
    enc = KVEventEncoder(page_size=2)
    (ev,) = enc.events([("stored", seq(0, 7), 5)])
    assert ev.parent_block_hash is None and ev.token_ids == list(seq(0, 6))


_HASH_SCRIPT = """
from sgl_fair.kv_events import KVEventEncoder
(ev,) = KVEventEncoder(page_size=3).events([("stored", tuple(range(100, 130)), 0)])
print(ev.block_hashes)
"""


def test_hashes_do_not_depend_on_the_hash_seed():
    outs = {
        subprocess.run(
            [sys.executable, "-c", _HASH_SCRIPT],
            capture_output=True,
            text=True,
            check=True,
            env={"PYTHONHASHSEED": seed},
        ).stdout
        for seed in ("0", "1", "12345")
    }
    assert len(outs) == 1
    (ev,) = KVEventEncoder(page_size=3).events([("stored", tuple(range(100, 130)), 0)])
    assert outs == {f"{ev.block_hashes}\n"}
    assert all(-(2**63) <= h < 2**63 for h in ev.block_hashes)


# ---- decoder ---------------------------------------------------------------------------------


def test_decoder_rebuilds_paths_and_removes_maximal_subtrees():
    dec = KVEventDecoder()
    ops = dec.apply(
        [
            stored([1, 2], None, [10, 11, 12, 13], 2),
            stored([3], 2, [14, 15], 2),
            stored([4], 2, [16, 17], 2),  # a sibling of 3
        ]
    )
    assert ops == [Stored((10, 11, 12, 13)), Stored(seq(10, 6)), Stored((10, 11, 12, 13, 16, 17))]
    assert sorted(dec.leaf_paths()) == [seq(10, 6), (10, 11, 12, 13, 16, 17)]
    # Child first, as SGLang lists a leaf before the node above it; 4 stays.
    assert dec.apply([BlockRemoved(block_hashes=[3, 2])]) == [Removed((10, 11, 12, 13), 2)]
    # 2 went with 3, so 4 (below 2) is forgotten too: its removal is unknown.
    assert dec.num_blocks == 1
    assert dec.apply([BlockRemoved(block_hashes=[4])]) == []
    assert dec.num_unknown_removed == 1
    assert dec.apply([stored([5], 4, [1, 1], 2)]) == []
    assert dec.num_orphans == 1


def test_removal_keeps_the_tokens_a_sibling_page_still_holds():
    """Pages with one parent may share leading tokens; the router's tree is token-exact."""
    enc, dec = KVEventEncoder(page_size=4), KVEventDecoder()
    router = Router(make_router_policy("rr"), 1, insert_outputs=False)
    a, b, c = (1, 2, 3, 4, 5, 0, 0, 0), (1, 2, 3, 4, 5, 1, 0, 0), (1, 2, 3, 4, 5, 1, 7, 7)

    def ship(*changes):
        ops = dec.apply(enc.events(changes))
        router.apply_kv_ops(WORKER, ops, 0.0)
        return ops

    ship(("stored", a, 0), ("stored", b, 5), ("stored", c, 6))
    # b's page (5, 1, 0, 0) goes; (5, 1) is still held through c's page, (5,) through a's.
    assert ship(("removed", b, 6)) == [Removed(b, 6)]
    assert [router.tree.match(p).per_worker[WORKER] for p in (a, b, c)] == [8, 6, 8]
    # Both remaining siblings in one event: nothing of the page survives.
    assert ship(("removed", a, 5), ("removed", c, 6)) == [Removed(a, 4), Removed(c, 4)]
    assert router.tree.match(c).per_worker == {WORKER: 4}
    # At the root too.
    ship(("stored", (1, 2, 3, 9), 0))
    assert ship(("removed", (1, 2, 3, 4), 0)) == [Removed((1, 2, 3, 4), 3)]
    assert router.tree.match((1, 2, 3, 9)).per_worker == {WORKER: 4}
    router.check_invariants()


def test_decoder_robustness():
    dec = KVEventDecoder()
    assert dec.apply([stored([1], 99, [1, 2], 2)]) == []  # parent never seen: late join
    assert dec.num_orphans == 1
    assert dec.apply([stored([1, 2], None, [1, 2, 3], 2)]) == []  # 2 does not divide 3
    assert dec.apply([stored([1], None, [1, 2, 3, 4], 2)]) == []  # 2 pages, 1 hash
    assert dec.apply([stored([], None, [], 2)]) == []
    assert dec.num_malformed == 3
    assert dec.apply([BlockRemoved(block_hashes=[7, 8])]) == []
    assert dec.num_unknown_removed == 2
    assert dec.num_blocks == 0
    # Duplicate stores are harmless: the same op again, nothing new remembered.
    ev = stored([1, 2], None, [1, 2, 3, 4], 2)
    assert dec.apply([ev]) == dec.apply([ev]) == [Stored((1, 2, 3, 4))]
    assert dec.num_blocks == 2
    # A known hash claimed for another path keeps its first meaning.
    assert dec.apply([stored([2], None, [9, 9], 2)]) == []
    assert dec.num_malformed == 4 and dec.path(2) == (1, 2, 3, 4)
    # Other storage tiers are not followed.
    assert dec.apply([stored([5], None, [5, 5], 2, medium="CPU_PINNED")]) == []
    assert dec.apply([BlockRemoved(block_hashes=[1], medium="DISK")]) == []
    assert dec.num_ignored == 2 and dec.num_blocks == 2
    assert dec.apply(KVEventBatch(ts=0.0, events=[AllBlocksCleared()])) == [Cleared()]
    assert dec.num_blocks == 0
    assert dec.apply([stored([3], 2, [5, 6], 2)]) == []  # forgotten by the clear
    assert dec.num_orphans == 2
    with pytest.raises(TypeError):
        dec.apply(["BlockStored"])


class SGLangStyleRecorder:
    """What SGLang's ``KVCacheEventRecorder`` emits for radix nodes (for the decoder test).

    One ``BlockStored`` per page of a node (the last page may be short, ``block_size`` is
    the page's length), hashes chained by SHA-256 from the root, the first page linked to
    the parent node's last page hash; consecutive events coalesced under SGLang's rule.
    """

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self.queue: list = []

    def _hashes(self, path: tuple[int, ...]) -> list[int]:
        out, prior = [], b""
        for i in range(0, len(path), self.page_size):
            page = path[i : i + self.page_size]
            digest = hashlib.sha256(prior + b"".join(t.to_bytes(4, "little") for t in page))
            prior = digest.digest()
            out.append(int.from_bytes(prior[:8], "big", signed=True))
        return out

    def _enqueue(self, ev) -> None:
        tail = self.queue[-1] if self.queue else None
        if isinstance(tail, BlockRemoved) and isinstance(ev, BlockRemoved):
            tail.block_hashes.extend(ev.block_hashes)
        elif (
            isinstance(tail, BlockStored)
            and isinstance(ev, BlockStored)
            and tail.block_size == ev.block_size
            and ev.parent_block_hash == tail.block_hashes[-1]
        ):
            tail.block_hashes.extend(ev.block_hashes)
            tail.token_ids.extend(ev.token_ids)
        else:
            self.queue.append(ev)

    def store(self, above: tuple[int, ...], key: tuple[int, ...]) -> None:
        """A new node ``key`` below the node ending at ``above`` (page-aligned)."""
        hashes = self._hashes(above + key)
        first = len(above) // self.page_size
        parent = hashes[first - 1] if first else None
        for i, h in enumerate(hashes[first:]):
            page = key[i * self.page_size : (i + 1) * self.page_size]
            self._enqueue(stored([h], parent, page, len(page), medium="GPU"))
            parent = h

    def remove(self, above: tuple[int, ...], key: tuple[int, ...]) -> None:
        hashes = self._hashes(above + key)[len(above) // self.page_size :]
        self._enqueue(BlockRemoved(block_hashes=hashes, medium="GPU"))

    def take(self) -> list:
        out, self.queue = self.queue, []
        return out


def test_sglang_recorder_page_size_1():
    rec, dec = SGLangStyleRecorder(1), KVEventDecoder()
    a, b = seq(1, 10), seq(1, 5) + (99, 100)
    rec.store((), a)
    # Inserting b splits a's node at 5 (SGLang emits nothing for a split; page hashes stay)
    # and adds the node (99, 100) below the first half.
    rec.store(a[:5], (99, 100))
    events = rec.take()
    assert [len(e.block_hashes) for e in events] == [10, 2]  # one event per node, coalesced
    assert dec.apply(KVEventBatch(ts=0.0, events=events)) == [Stored(a), Stored(b)]
    assert dec.num_blocks == 12
    rec.remove(a[:5], a[5:])  # evict a's tail, then the (99, 100) leaf, then the shared node
    rec.remove(a[:5], (99, 100))
    # A removal names the removed subtree's first page: path[start:] and all below it.
    assert dec.apply(rec.take()) == [Removed(a[:6], 5), Removed(b[:6], 5)]
    rec.remove((), a[:5])
    assert dec.apply(rec.take()) == [Removed(a[:1], 0)]
    assert dec.num_blocks == 0
    assert (dec.num_orphans, dec.num_malformed, dec.num_unknown_removed) == (0, 0, 0)


def test_sglang_recorder_short_last_page_and_router():
    rec, dec = SGLangStyleRecorder(4), KVEventDecoder()
    path = seq(1, 10)  # pages of 4, 4 and 2 tokens
    rec.store((), path[:8])
    rec.store(path[:8], path[8:])
    rec.store((), seq(50, 4))
    events = rec.take()
    assert [(len(e.block_hashes), e.block_size) for e in events] == [(2, 4), (1, 2), (1, 4)]
    router = Router(make_router_policy("rr"), 2, insert_outputs=False)
    router.apply_kv_ops(1, dec.apply(events), 1.0)
    assert router.tree.match(path).per_worker == {1: 10}
    assert router.tree.match(seq(50, 6)).per_worker == {1: 4}
    rec.remove(path[:8], path[8:])
    router.apply_kv_ops(1, dec.apply(rec.take()), 2.0)
    assert router.tree.match(path).per_worker == {1: 8}
    router.check_invariants()


# ---- router ----------------------------------------------------------------------------------


def test_router_apply_kv_ops():
    router = Router(make_router_policy("rr"), 2, insert_outputs=True)
    p = seq(1, 8)
    router.apply_kv_ops(0, [Stored(p), Stored(seq(20, 4))], 1.0)
    router.apply_kv_ops(1, [Stored(p[:4])], 1.0)
    assert router.tree.match(p).per_worker == {0: 8, 1: 4}
    router.apply_kv_ops(0, [Removed(p, 4)], 2.0)
    assert router.tree.match(p).per_worker == {0: 4, 1: 4}
    s = router.stats[0]
    assert (s.num_kv_events, s.num_evicted_blocks, s.num_evicted_tokens) == (3, 1, 4)
    assert router._evicted_s[0] == 2.0  # a Finished stamped before 2.0 must not re-insert
    router.apply_kv_ops(0, [Cleared()], 3.0)
    assert router.tree.match(p).per_worker == {1: 4} and 0 in router.workers
    assert router.tree.match(seq(20, 4)).per_worker == {}
    assert router.stats[0].num_evicted_tokens == 4 + 4  # (20..23): nobody else held it
    router.remove_worker(1)
    router.apply_kv_ops(1, [Stored(p)], 4.0)
    assert router.stats[1].num_stale == 1 and router.tree.match(p).per_worker == {}
    with pytest.raises(TypeError):
        router.apply_kv_ops(0, ["stored"], 5.0)
    router.check_invariants()


def test_router_tree_bound_holds_for_kv_ops():
    router = Router(make_router_policy("rr"), 1, max_tree_tokens=100)
    for k in range(10):
        router.apply_kv_ops(0, [Stored(seq(1000 * k, 30))], float(k))
        router.check_invariants()


# ---- end to end: a worker's cache → bytes → the router's tree ----------------------------------


class Follower:
    """A worker's recorded cache, its encoder, and the router side: decoder and Router."""

    def __init__(self, kv: PrefixKVCache, page_size: int) -> None:
        self.kv = kv
        kv.record_kv_events()
        self.page_size = page_size
        self.encoder = KVEventEncoder(page_size)
        self.decoder = KVEventDecoder()
        self.router = Router(make_router_policy("rr"), 1, insert_outputs=False)
        self.seq = itertools.count()
        self.t = 0.0

    def sync(self) -> None:
        self.t += 1.0
        events = self.encoder.events(self.kv.drain_kv_events())
        frames = multipart(b"kv", next(self.seq), KVEventBatch(ts=self.t, events=events))
        _, _, payload = parse_multipart(frames)
        batch = decode_batch(payload)
        self.router.apply_kv_ops(WORKER, self.decoder.apply(batch), batch.ts)

    def check(self) -> None:
        p, kv, tree = self.page_size, self.kv, self.router.tree
        dec = self.decoder
        assert (dec.num_orphans, dec.num_malformed, dec.num_unknown_removed) == (0, 0, 0)
        # The router never over-claims: whatever it credits, the worker holds.
        for path in credited_paths(tree, WORKER):
            assert len(path) % p == 0, path
            assert kv.tree.match_len(path) == len(path), path
        # Every full page the worker holds is credited (a match may run on into a page that
        # the router credits along another branch: those tokens are held too, see above).
        for path in leaf_paths(kv.tree):
            got = tree.match(path, touch=False).per_worker.get(WORKER, 0)
            assert got // p * p == len(path) // p * p, (path, got)
        pages = full_pages(kv.tree, p)
        assert self.encoder.num_published == dec.num_blocks == pages
        self.router.check_invariants()
        kv.check_invariants()


def leaf_paths(tree: RadixTree) -> list[tuple[int, ...]]:
    out, stack = [], [((), tree.root)]
    while stack:
        path, node = stack.pop()
        if not node.children and node is not tree.root:
            out.append(path)
        stack.extend((path + c.key, c) for c in node.children.values())
    return out


def credited_paths(tree: GlobalTree, worker: int) -> list[tuple[int, ...]]:
    """Maximal paths the router credits ``worker`` with (its owner-leaves)."""
    root = tree.tree.root
    out, stack = [], [((), root)]
    while stack:
        path, node = stack.pop()
        below = [c for c in node.children.values() if worker in c.owners]
        if not below and node is not root:
            out.append(path)
        stack.extend((path + c.key, c) for c in below)
    return out


def full_pages(tree: RadixTree, page_size: int) -> int:
    """Distinct full pages the tree holds: per node, the page boundaries inside its key."""
    num, stack = 0, [(0, tree.root)]
    while stack:
        end, node = stack.pop()
        num += end // page_size - (end - len(node.key)) // page_size
        stack.extend((end + len(c.key), c) for c in node.children.values())
    return num


BASES = ((), seq(100, 5), seq(200, 13), seq(300, 21), seq(300, 9) + seq(400, 8))
prompts = st.builds(
    lambda base, tail: base + tuple(tail),
    st.sampled_from(BASES),
    st.lists(st.integers(0, 3), max_size=12),
).filter(bool)


class CacheFollowerMachine(RuleBasedStateMachine):
    """Random requests on a small cache (so it evicts), the router following its events.

    Calls ``PrefixKVCache`` as the scheduler does: lock the cached prefix, allocate the
    rest plus a slot for the next token, commit; decode more tokens and commit them;
    release; flush when idle.
    """

    page_size = 4
    capacity = 64

    def __init__(self) -> None:
        super().__init__()
        self.f = Follower(PrefixKVCache(TokenAllocator(self.capacity)), self.page_size)
        self.running: list[list] = []  # [owner, tokens, handle]
        self.owners = itertools.count()

    @property
    def kv(self) -> PrefixKVCache:
        return self.f.kv

    @precondition(lambda self: len(self.running) < 4)
    @rule(tokens=prompts)
    def start(self, tokens):
        kv, owner = self.kv, next(self.owners)
        handle = kv.acquire_prefix(tokens, limit=len(tokens) - 1)
        need = len(tokens) - handle.prefix_len + 1
        if not kv.can_allocate(owner, need):
            kv.tree.unlock(handle.node)
        else:
            kv.allocate(owner, need)
            self.running.append([owner, tokens, kv.commit(owner, tokens, handle)])
        self.f.sync()

    @precondition(lambda self: self.running)
    @rule(i=st.integers(0, 9), more=st.lists(st.integers(0, 3), min_size=1, max_size=9))
    def decode(self, i, more):
        req = self.running[i % len(self.running)]
        owner, tokens, handle = req
        if self.kv.can_allocate(owner, len(more)):
            self.kv.allocate(owner, len(more))
            req[1] = tokens + tuple(more)
            req[2] = self.kv.commit(owner, req[1], handle)
        self.f.sync()

    @precondition(lambda self: self.running)
    @rule(i=st.integers(0, 9))
    def finish(self, i):
        owner, _, handle = self.running.pop(i % len(self.running))
        self.kv.release(owner, handle)
        self.f.sync()

    @rule()
    def flush(self):
        assert self.kv.flush() == (not self.running)
        if not self.running:
            assert self.kv.tree.total_tokens == 0
        self.f.sync()

    @invariant()
    def router_follows_the_cache(self):
        self.f.check()


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_router_follows_worker_cache(page_size):
    machine = type(f"Follow{page_size}", (CacheFollowerMachine,), {"page_size": page_size})
    machine.TestCase.settings = settings(
        max_examples=150,
        stateful_step_count=50,
        deadline=None,
        derandomize=True,
        # Deterministic examples; only the timing health checks could vary (a loaded CI box).
        suppress_health_check=list(HealthCheck),
    )
    machine.TestCase().runTest()


class ListEngine:
    """A complete engine for the scheduler: fixed durations, output ids from a small pool."""

    def __init__(self) -> None:
        self._ids = itertools.cycle(range(1, 6))

    def run(self, batch: Batch) -> StepResult:
        tokens = [next(self._ids) for _ in batch.sampling_requests()]
        return StepResult(batch, 0.01, tokens)


@pytest.mark.parametrize("page_size", [1, 16])
def test_router_follows_a_real_scheduler(page_size):
    """The scheduler's own call sequence (chunked prefill, decode, retraction, eviction)."""
    rng = random.Random(page_size)
    bases = [seq(1000 * (k + 1), 40 + 7 * k) for k in range(3)]
    reqs = [
        Request(f"r{n}", "ab"[n % 2], rng.choice(bases) + seq(10 * n, rng.randint(1, 30)), 8, 0)
        for n in range(60)
    ]
    kv = PrefixKVCache(TokenAllocator(400))
    sched = Scheduler(
        policy=make_policy("fcfs"), kv=kv, config=SchedulerConfig(chunked_prefill_size=64)
    )
    follower, engine = Follower(kv, page_size), ListEngine()
    for r in reqs:
        sched.add_request(r, 0.0)
    now = 0.0
    for _ in range(5000):
        batch = sched.step(now)
        follower.sync()  # admission may evict
        follower.check()
        if batch is None:
            break
        result = engine.run(batch)
        now += result.duration_s
        sched.apply(result, now)
        follower.sync()
        follower.check()
    assert all(r.num_output == r.output_len for r in reqs)
    assert kv.num_evicted_tokens > 0  # the pool was small enough to evict
    assert kv.flush()
    follower.sync()
    follower.check()
    assert follower.router.tree.total_tokens == 0


def test_flush_refuses_while_busy_and_recording_is_off_by_default():
    kv = PrefixKVCache(TokenAllocator(32))
    tokens = seq(1, 10)
    handle = kv.acquire_prefix(tokens, limit=9)
    kv.allocate("r", 10)
    handle = kv.commit("r", tokens, handle)
    assert kv.drain_kv_events() == []  # not recording
    kv.record_kv_events()
    kv.record_evictions()
    assert not kv.flush()  # locked and private
    kv.release("r", handle)
    assert kv.flush() and kv.tree.total_tokens == 0
    assert kv.drain_kv_events() == [("cleared", (), 0)]
    assert kv.drain_evicted() == [(tokens, 0)]
    assert kv.num_evicted_tokens == 0
    kv.check_invariants()


def test_prefix_cache_records_stores_and_evictions_in_order():
    kv = PrefixKVCache(TokenAllocator(20))
    kv.record_kv_events()
    a, b = seq(1, 12), seq(1, 6) + seq(50, 4)

    def compute(owner, tokens):
        handle = kv.acquire_prefix(tokens, limit=len(tokens))
        kv.allocate(owner, len(tokens) - handle.prefix_len)
        kv.release(owner, kv.commit(owner, tokens, handle))

    compute("x", a)
    compute("y", b)  # shares 6 tokens: 4 new
    compute("y2", b)  # nothing new: no event
    compute("z", seq(90, 10))  # needs 10, 4 free: evicts the LRU leaf a[6:]
    assert kv.drain_kv_events() == [
        ("stored", a, 0),
        ("stored", b, 6),
        ("removed", a, 6),
        ("stored", seq(90, 10), 0),
    ]
    assert kv.drain_kv_events() == []
