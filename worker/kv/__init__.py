"""sgl_fair.worker.kv: KV-cache allocators behind one check-then-commit interface."""

from sgl_fair.worker.kv.base import CACHE, KVAllocator, OutOfMemory
from sgl_fair.worker.kv.bidirectional import BidirectionalAllocator
from sgl_fair.worker.kv.paged import PagedAllocator
from sgl_fair.worker.kv.prefix_cache import KVUsage, PrefixHandle, PrefixKVCache
from sgl_fair.worker.kv.registry import allocator_names, make_allocator
from sgl_fair.worker.kv.token import TokenAllocator

__all__ = [
    "CACHE",
    "BidirectionalAllocator",
    "KVAllocator",
    "KVUsage",
    "OutOfMemory",
    "PagedAllocator",
    "PrefixHandle",
    "PrefixKVCache",
    "TokenAllocator",
    "allocator_names",
    "make_allocator",
]
