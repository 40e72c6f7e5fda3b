"""KV allocators by name, as policies are: ``make_allocator("paged", 4096, block_size=16)``.

Each block allocator registers itself with ``@register_allocator(name)`` and owns a frozen
``Config`` dataclass listing its options; the token allocator has none. Unknown names and
unknown options raise a one-line ``ValueError`` that lists what exists.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from sgl_fair.registry import Registry
from sgl_fair.worker.kv.base import KVAllocator
from sgl_fair.worker.kv.token import TokenAllocator


def _load_builtin() -> None:
    # Importing the modules runs their @register_allocator decorators.
    from sgl_fair.worker.kv import bidirectional, paged  # noqa: F401


# attr: the registered name lands on `cls.allocator_name` (allocators have no `name` of their own).
ALLOCATORS = Registry("KV allocator", load=_load_builtin, attr="allocator_name")
register_allocator = ALLOCATORS.register
allocator_names = ALLOCATORS.names
allocator_class = ALLOCATORS.get

register_allocator("token")(TokenAllocator)


def make_allocator(name: str, capacity_tokens: int, **options: Any) -> KVAllocator:
    """Build allocator ``name`` over ``capacity_tokens`` KV slots with its ``Config`` options."""
    cls = ALLOCATORS.get(name)
    if getattr(cls, "Config", None) is None:
        if options:
            raise ValueError(
                f"KV allocator {name!r} has no option {sorted(options)[0]!r}; options: (none)"
            )
        return cls(capacity_tokens)
    config = ALLOCATORS.config(name, **options)
    return cls(capacity_tokens, **dataclasses.asdict(config))
