"""``sgl_fair.kv_hash_index.HashIndex`` against a dict: random batches of inserts (keys that
collide on their home slot included, and the same slot probed by several keys of one batch),
deletes, lookups and the rebuilds that growth forces."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from sgl_fair.kv_hash_index import HashIndex, as_keys

KEYS = st.integers(min_value=-(2**63), max_value=2**64 - 1)
OPS = st.lists(
    st.tuples(st.sampled_from(["insert", "delete", "get"]), st.lists(KEYS, max_size=40)),
    max_size=30,
)


@settings(max_examples=150, deadline=None)
@given(OPS, st.booleans())
def test_the_index_is_a_dict(ops, clustered):
    index, model = HashIndex(capacity=16), {}
    next_val = 0
    for kind, raw in ops:
        if clustered:  # keys 1 apart: many share a home slot or probe into each other
            raw = [k % 64 for k in raw]
        keys = list(dict.fromkeys(k & 0xFFFFFFFFFFFFFFFF for k in raw))
        if kind == "insert":
            new = [k for k in keys if k not in model]
            vals = np.arange(next_val, next_val + len(new), dtype=np.int64)
            next_val += len(new)
            if new:
                index.insert_new(as_keys(new), vals)
            model.update(zip(new, vals.tolist(), strict=True))
        elif kind == "delete" and keys:
            index.delete(as_keys(keys))
            for k in keys:
                model.pop(k, None)
        elif keys:
            got = index.get(as_keys(keys)).tolist()
            assert got == [model.get(k, -1) for k in keys]
        assert index.size == len(model)
    if model:
        assert index.get(as_keys(list(model))).tolist() == list(model.values())
