"""KV allocators by name, as policies are: ``make_allocator("paged", 4096, block_size=16)``.

Each block allocator registers itself with ``@register_allocator(name)`` and owns a frozen
``Config`` dataclass listing its options (the token allocator's is empty). Unknown names and
unknown options raise a one-line ``ValueError`` that lists what exists.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from sgl_fair.registry import Registry
from sgl_fair.worker.kv.base import KVAllocator
from sgl_fair.worker.kv.token import TokenAllocator


def _load_builtin() -> None:
    # Importing every module of this package runs their @register_allocator decorators: a new
    # allocator file here is registered with no other change.
    import importlib
    import pkgutil

    import sgl_fair.worker.kv as package

    for module in pkgutil.iter_modules(package.__path__):
        importlib.import_module(f"{package.__name__}.{module.name}")


# attr: the registered name lands on `cls.allocator_name` (allocators have no `name` of their own).
ALLOCATORS = Registry("KV allocator", load=_load_builtin, attr="allocator_name")
register_allocator = ALLOCATORS.register
allocator_names = ALLOCATORS.names
allocator_class = ALLOCATORS.get

register_allocator("token")(TokenAllocator)


def make_allocator(name: str, capacity_tokens: int, **options: Any) -> KVAllocator:
    """Build allocator ``name`` over ``capacity_tokens`` KV slots with its ``Config`` options."""
    cls = ALLOCATORS.get(name)
    config = ALLOCATORS.config(name, **options)
    return cls(capacity_tokens, **dataclasses.asdict(config))
