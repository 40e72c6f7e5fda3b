"""The decoder keeps no Python object per cached page (issue 39): SGLang's default page size
is 1, so one object per page is one GC-tracked object per cached token."""

from __future__ import annotations

import gc

from sgl_fair.kv_decoder import KVEventDecoder
from sgl_fair.kv_events import BlockRemoved, BlockStored


def _chain(dec: KVEventDecoder, first_hash: int, depth: int, node: int = 32) -> list[int]:
    hashes, parent = [], None
    for start in range(0, depth, node):
        hs = list(range(first_hash + start, first_hash + start + node))
        dec.apply([BlockStored(hs, parent, [h % 50_000 for h in hs], 1, None)])
        parent = hs[-1]
        hashes += hs
    return hashes


def test_no_gc_tracked_object_per_page():
    dec = KVEventDecoder()
    gc.collect()
    before = len(gc.get_objects())
    for p in range(10):
        _chain(dec, p * 10**6 + 1, 2_048)
    gc.collect()
    grown = len(gc.get_objects()) - before
    assert dec.num_blocks == 20_480
    assert grown < dec.num_blocks // 10, f"{grown} GC-tracked objects for 20,480 cached pages"


def test_token_ids_wider_than_32_bits():
    dec = KVEventDecoder()
    ops = dec.apply([BlockStored([1, 2], None, [5, 2**40], 1, None)])
    ops += dec.apply([BlockStored([3], 2, [2**62], 1, None)])
    assert dec.path(3) == (5, 2**40, 2**62)
    assert [op.path for op in ops] == [(5, 2**40), (5, 2**40, 2**62)]
    dec.apply([BlockRemoved([2])])
    assert dec.num_blocks == 1 and dec.leaf_paths() == [(5,)]
