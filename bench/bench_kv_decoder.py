"""KV event decoder cost (issue 39): per-event time vs prefix depth, memory, GC pause.

Shapes are SGLang's at page size 1: one ``BlockStored`` per radix node, one hash per token,
parent = the last hash of the parent node. For each prefix depth D a chain of D tokens is
stored (nodes of 32 tokens), then a 32-token node is stored and removed again, repeatedly,
(a) below the chain's last hash and (b) below a mid-chain hash (what follows a node split).
Two ways, each timed per event: ``apply`` (the decoder alone, each op with its whole path:
what a consumer got before ``follow``) and ``follow`` (the decoder and the tree it feeds,
``OwnerFollower`` into a ``RadixTree``: what the router and the plugin's shadow run now).
Memory: tracemalloc over 1M cached tokens (1,000 prompts of 1,000 tokens, nodes of 32);
GC: a full ``gc.collect()`` with those 1M tokens held.

    python bench/bench_kv_decoder.py [--json] [--quick]
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import statistics
import sys
import time
import tracemalloc

from sgl_fair.kv_decoder import KVEventDecoder
from sgl_fair.kv_events import BlockRemoved, BlockStored
from sgl_fair.kv_follow import OwnerFollower
from sgl_fair.radix import RadixTree

NODE = 32


class _Ids:
    def __init__(self) -> None:
        self._next = itertools.count(1)

    def take(self, n: int) -> list[int]:
        return [next(self._next) * 0x9E3779B1 for _ in range(n)]


class _Feed:
    """``dec.apply(events)`` or, with a tree, ``dec.follow(events, OwnerFollower(tree))``."""

    def __init__(self, follow: bool) -> None:
        self.dec = KVEventDecoder()
        self.follower = OwnerFollower(RadixTree(), 0) if follow else None

    def __call__(self, events: list) -> None:
        if self.follower is None:
            self.dec.apply(events)
        else:
            self.dec.follow(events, self.follower)


def _chain(dec: _Feed, ids: _Ids, depth: int, first_token: int) -> list[int]:
    """Store a chain of ``depth`` tokens in nodes of NODE; returns its hashes."""
    hashes: list[int] = []
    parent = None
    tok = first_token
    for start in range(0, depth, NODE):
        n = min(NODE, depth - start)
        hs = ids.take(n)
        toks = [(tok + i) % 150_000 for i in range(n)]
        tok += n
        dec([BlockStored(hs, parent, toks, 1, None)])
        parent = hs[-1]
        hashes.extend(hs)
    return hashes


def per_event(depth: int, reps: int, follow: bool = False) -> dict:
    dec = _Feed(follow)
    ids = _Ids()
    chain = _chain(dec, ids, depth, 7)
    out = {}
    for label, parent in (("leaf", chain[-1]), ("mid", chain[len(chain) // 2 - 5])):
        st, rm = [], []
        for r in range(reps):
            hs = ids.take(NODE)
            toks = [(200_000 + r * NODE + i) % 150_000 for i in range(NODE)]
            ev = BlockStored(hs, parent, toks, 1, None)
            t0 = time.perf_counter()
            dec([ev])
            t1 = time.perf_counter()
            dec([BlockRemoved(hs)])
            t2 = time.perf_counter()
            st.append(t1 - t0)
            rm.append(t2 - t1)
        out[f"store_{label}_us"] = statistics.median(st) * 1e6
        out[f"remove_{label}_us"] = statistics.median(rm) * 1e6
    return out


def _fill(dec: _Feed, tokens: int) -> None:
    ids = _Ids()
    per = 1000
    for p in range(tokens // per):
        _chain(dec, ids, per, p * 131)


def memory(tokens: int) -> float:
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    dec = _Feed(False)
    _fill(dec, tokens)
    gc.collect()
    used = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    del dec
    return used / tokens


def marks_memory(tokens: int) -> float:
    """Bytes per cached token of what ``follow`` adds to the decoder: each run's marks (the
    pages that ended a store) and the handles kept for them (the tree's own nodes aside)."""
    dec = _Feed(True)
    _fill(dec, tokens)
    used = 0
    for seg in dec.dec._segs.values():
        if seg.marks is not None:
            used += sys.getsizeof(seg.marks) + sys.getsizeof(seg.handles)
    return used / tokens


def gc_pause(tokens: int) -> float:
    dec = _Feed(False)
    _fill(dec, tokens)
    gc.collect()
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        gc.collect()
        times.append(time.perf_counter() - t0)
    del dec
    gc.collect()
    return statistics.median(times) * 1e3


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--quick", action="store_true", help="fewer reps, 200k tokens")
    args = ap.parse_args(argv)
    reps = 50 if args.quick else 200
    tokens = 200_000 if args.quick else 1_000_000
    depths = (1_000, 4_000, 16_000, 32_000)
    rows = {d: per_event(d, reps) for d in depths}
    follow = {d: per_event(d, reps, follow=True) for d in depths}
    res = {
        "per_event": rows,
        "store_leaf_ratio_32k_1k": rows[32_000]["store_leaf_us"] / rows[1_000]["store_leaf_us"],
        "store_mid_ratio_32k_1k": rows[32_000]["store_mid_us"] / rows[1_000]["store_mid_us"],
        "follow_per_event": follow,
        "follow_ratio_32k_1k": {k: follow[32_000][k] / follow[1_000][k] for k in follow[1_000]},
        "tokens": tokens,
        "bytes_per_token": memory(tokens),
        "follow_marks_bytes_per_token": marks_memory(tokens),
        "gc_collect_ms": gc_pause(tokens),
    }
    if args.json:
        print(json.dumps(res, indent=1))
    else:
        for title, table in (("apply (decoder, whole paths)", rows), ("follow (+ tree)", follow)):
            print(f"{title}\ndepth   store-leaf µs  store-mid µs  remove-leaf µs  remove-mid µs")
            for d, r in table.items():
                print(
                    f"{d:>6}  {r['store_leaf_us']:>12.1f}  {r['store_mid_us']:>12.1f}"
                    f"  {r['remove_leaf_us']:>14.1f}  {r['remove_mid_us']:>13.1f}"
                )
        print(f"apply, store 32k/1k: leaf {res['store_leaf_ratio_32k_1k']:.2f}"
              f"  mid {res['store_mid_ratio_32k_1k']:.2f}")  # fmt: skip
        print("follow, 32k/1k: " + "  ".join(
            f"{k.removesuffix('_us')} {v:.2f}" for k, v in res["follow_ratio_32k_1k"].items()
        ) + "  (target ≤ 1.5)")  # fmt: skip
        print(f"follow's marks: {res['follow_marks_bytes_per_token']:.2f} B/token")
        print(f"bytes/token at {tokens:,} tokens: {res['bytes_per_token']:.1f}  (target ≤ 32)")
        print(f"full gc.collect(): {res['gc_collect_ms']:.1f} ms  (target ≤ 20)")
    return res


if __name__ == "__main__":
    main()
