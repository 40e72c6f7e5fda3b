"""A hash table from 64-bit block hashes to int64 values, in numpy arrays (no object per key).

``KVEventDecoder`` (``kv_decoder.py``) keeps one entry per cached page, and SGLang's default
page size is 1: a Python dict would cost one GC-tracked int per cached token. This is open
addressing with linear probing over two flat arrays; every operation takes a batch of keys
and probes them together (one numpy pass per probe round). Keys are Python ints read modulo
2**64 (SGLang's hashes are 64-bit).
"""

from __future__ import annotations

import numpy as np

_MIX_INT = 0x9E3779B97F4A7C15  # Fibonacci hashing: spreads small consecutive keys
_MIX = np.uint64(_MIX_INT)
_M64 = (1 << 64) - 1
_EMPTY = -1
_TOMB = -2
_MAX_LOAD = 0.6  # used + deleted slots over capacity before a rebuild
# Batches this small are probed key by key in Python: each numpy call costs ~1 µs whatever
# its size, and a probe round is a dozen of them. The router's decoder looks one parent hash
# up per event, and SGLang's events carry a request's new pages (tens at page size 1). On
# this repository's CPU (2**20 slots, 200k keys): one key 1.7 µs against 22 µs by numpy;
# lookups break even near 40 keys, inserts near 80.
_SMALL_GET = 32
_SMALL_INSERT = 64


def as_keys(hashes: list[int]) -> np.ndarray:
    """Python ints as int64 keys (two's complement of the low 64 bits)."""
    try:
        return np.array(hashes, dtype=np.int64)
    except OverflowError:
        return np.array([h & 0xFFFFFFFFFFFFFFFF for h in hashes], dtype=np.uint64).view(np.int64)


class HashIndex:
    """``key → value`` (value ≥ 0), batch operations only."""

    def __init__(self, capacity: int = 1024) -> None:
        self._alloc(capacity)
        self.size = 0
        self._used = 0  # live + deleted slots

    def _alloc(self, capacity: int) -> None:
        self._bits = max(int(capacity - 1).bit_length(), 4)
        cap = 1 << self._bits
        self._keys = np.zeros(cap, dtype=np.int64)
        self._vals = np.full(cap, _EMPTY, dtype=np.int64)
        self._shift = np.uint64(64 - self._bits)

    @property
    def nbytes(self) -> int:
        return self._keys.nbytes + self._vals.nbytes

    def _home(self, keys: np.ndarray) -> np.ndarray:
        return ((keys.view(np.uint64) * _MIX) >> self._shift).astype(np.int64)

    def slots(self, keys: np.ndarray) -> np.ndarray:
        """Each key's slot, -1 where absent."""
        if len(keys) <= _SMALL_GET:
            return np.array([self._slot1(k) for k in keys.tolist()], dtype=np.int64)
        out = np.full(len(keys), -1, dtype=np.int64)
        pending = np.arange(len(keys))
        idx = self._home(keys)
        mask = (1 << self._bits) - 1
        kk, vv = self._keys, self._vals
        while pending.size:
            v = vv[idx]
            hit = (v >= 0) & (kk[idx] == keys[pending])
            out[pending[hit]] = idx[hit]
            go = (v != _EMPTY) & ~hit
            pending = pending[go]
            idx = (idx[go] + 1) & mask
        return out

    def get(self, keys: np.ndarray) -> np.ndarray:
        """Each key's value, -1 where absent."""
        if len(keys) <= _SMALL_GET:
            vals = self._vals
            found = [self._slot1(k) for k in keys.tolist()]
            return np.array([vals.item(i) if i >= 0 else -1 for i in found], dtype=np.int64)
        s = self.slots(keys)
        return np.where(s >= 0, self._vals[s], -1)

    def _slot1(self, key: int) -> int:
        """One key's slot (``key``: an int64's value), -1 where absent."""
        i = (((key & _M64) * _MIX_INT) & _M64) >> (64 - self._bits)
        mask = (1 << self._bits) - 1
        kk, vv = self._keys, self._vals
        while True:
            v = vv.item(i)
            if v == _EMPTY:
                return -1
            if v >= 0 and kk.item(i) == key:
                return i
            i = (i + 1) & mask

    def insert_new(self, keys: np.ndarray, vals: np.ndarray) -> None:
        """Add keys known to be absent and distinct."""
        n = len(keys)
        if (self._used + n) > _MAX_LOAD * len(self._keys):
            self._rebuild(self.size + n)
        mask = (1 << self._bits) - 1
        if n <= _SMALL_INSERT:
            kk, vv = self._keys, self._vals
            for key, val in zip(keys.tolist(), vals.tolist(), strict=True):
                i = (((key & _M64) * _MIX_INT) & _M64) >> (64 - self._bits)
                while True:
                    v = vv.item(i)
                    if v < 0:  # empty or deleted: ours
                        self._used += v == _EMPTY
                        kk[i] = key
                        vv[i] = val
                        break
                    i = (i + 1) & mask
            self.size += n
            return
        pending = np.arange(n)
        idx = self._home(keys)
        kk, vv = self._keys, self._vals
        while pending.size:
            free = vv[idx] < 0
            # Two keys of the batch may probe the same free slot: write every candidate's key
            # there and read back; the one whose key stayed (the last written; keys are
            # distinct) takes the slot. Cheaper than np.unique's sort per round.
            cand = np.flatnonzero(free)
            slots = idx[cand]
            was_empty = vv[slots] == _EMPTY
            ks = keys[pending[cand]]
            kk[slots] = ks
            won = kk[slots] == ks
            win = cand[won]
            self._used += int(was_empty[won].sum())
            vv[idx[win]] = vals[pending[win]]
            lose = np.ones(len(pending), dtype=bool)
            lose[win] = False
            pending = pending[lose]
            idx = (idx[lose] + 1) & mask
        self.size += n

    def set_at(self, slots: np.ndarray, vals: np.ndarray) -> None:
        self._vals[slots] = vals

    def delete(self, keys: np.ndarray) -> None:
        s = self.slots(keys)
        s = np.unique(s[s >= 0])
        self._vals[s] = _TOMB
        self.size -= len(s)

    def clear(self) -> None:
        self._alloc(1024)
        self.size = 0
        self._used = 0

    def _rebuild(self, need: int) -> None:
        live = self._vals >= 0
        keys, vals = self._keys[live], self._vals[live]
        self._alloc(max(int(need / (_MAX_LOAD * 0.75)), 1024))
        self.size = 0
        self._used = 0
        if len(keys):
            self.insert_new(keys, vals)
