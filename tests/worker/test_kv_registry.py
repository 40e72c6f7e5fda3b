"""KV allocators by name: every registered one is a working KVAllocator; bad names and options
fail with a one-line ValueError that lists what exists."""

from __future__ import annotations

import pytest

from sgl_fair.worker.kv import (
    BidirectionalAllocator,
    KVAllocator,
    PagedAllocator,
    TokenAllocator,
    allocator_names,
    make_allocator,
)


def test_builtin_allocators_are_registered_by_name() -> None:
    assert allocator_names() == ["bidirectional", "paged", "token"]
    assert type(make_allocator("token", 64)) is TokenAllocator
    assert type(make_allocator("paged", 64)) is PagedAllocator
    assert type(make_allocator("bidirectional", 64)) is BidirectionalAllocator


@pytest.mark.parametrize("name", ["token", "paged", "bidirectional"])
def test_every_allocator_allocates_frees_and_conserves(name: str) -> None:
    alloc = make_allocator(name, 64)
    assert isinstance(alloc, KVAllocator) and alloc.capacity_tokens == 64
    assert alloc.can_allocate("r", 20)
    alloc.allocate("r", 20)
    assert alloc.held("r") == 20 and alloc.num_free_tokens() <= 44
    alloc.free("r", 5)
    alloc.check_invariants()
    alloc.free("r")
    assert alloc.held("r") == 0 and alloc.num_free_tokens() == 64
    alloc.check_invariants()


def test_options_reach_the_allocator() -> None:
    paged = make_allocator("paged", 64, block_size=8)
    assert paged.block_size == 8 and paged.num_blocks == 8
    bidi = make_allocator("bidirectional", 64, block_size=4, host_capacity_tokens=12)
    assert (bidi.block_size, bidi.num_host_blocks, bidi.host_capacity_tokens) == (4, 3, 12)
    assert make_allocator("bidirectional", 64).host_capacity_tokens == 64  # default: as device


def test_unknown_allocator_names_the_known_ones() -> None:
    with pytest.raises(ValueError, match=r"unknown KV allocator 'radix'.*bidirectional, paged"):
        make_allocator("radix", 64)


@pytest.mark.parametrize(
    ("name", "options", "message"),
    [
        ("token", {"block_size": 16}, r"'token' has no option 'block_size'; options: \(none\)"),
        ("paged", {"page_size": 16}, r"'paged' has no option 'page_size'; options: block_size"),
        ("paged", {"block_size": 0}, r"block_size must be an integer >= 1 \(got 0\)"),
        ("paged", {"block_size": "16k"}, r"block_size must be an integer >= 1 \(got '16k'\)"),
        ("bidirectional", {"host_capacity_tokens": -1}, r"host_capacity_tokens must be an integer"),
        (
            "bidirectional",
            {"host_capacity_tokens": 1.5},
            r"host_capacity_tokens must be an integer",
        ),
    ],
)
def test_bad_options_are_refused(name: str, options: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make_allocator(name, 64, **options)
