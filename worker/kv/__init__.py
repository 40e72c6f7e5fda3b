"""sgl_fair.worker.kv: KV-cache allocators behind one check-then-commit interface."""

from sgl_fair.worker.kv.base import CACHE, KVAllocator, OutOfMemory
from sgl_fair.worker.kv.prefix_cache import KVUsage, PrefixHandle, PrefixKVCache
from sgl_fair.worker.kv.token import TokenAllocator

__all__ = [
    "CACHE",
    "KVAllocator",
    "KVUsage",
    "OutOfMemory",
    "PrefixHandle",
    "PrefixKVCache",
    "TokenAllocator",
]
