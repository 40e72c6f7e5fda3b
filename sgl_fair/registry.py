"""A name → class registry for classes built from a ``Config`` dataclass.

Local policies (``sgl_fair.policies``), router policies (``sgl_fair.router.policies``) and
program kinds (``sgl_fair.workloads.programs``) each keep one::

    POLICIES = Registry("policy", load=_import_builtin_modules)

    @POLICIES.register("vtc")
    class VTC: Config = ...          # the class defines a frozen ``Config`` dataclass

    POLICIES.make("vtc", lift=True)  # unknown names or options: a one-line ValueError

``load`` imports the built-in modules (running their decorators) on first lookup, so
importing the registry never imports every policy.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping
from typing import Any


def build_config(kind: str, name: str, config_cls: type, options: Mapping[str, Any]) -> Any:
    """``config_cls(**options)`` for ``kind`` ``name`` (a policy, an allocator, an engine);
    an unknown option is a one-line ``ValueError`` that lists the known ones."""
    fields = {f.name for f in dataclasses.fields(config_cls)}
    unknown = sorted(set(options) - fields)
    if unknown:
        raise ValueError(
            f"{kind} {name!r} has no option {unknown[0]!r}; "
            f"options: {', '.join(sorted(fields)) or '(none)'}"
        )
    return config_cls(**options)


class Registry:
    """``attr``: the class attribute that receives the registered name (``cls.name``)."""

    def __init__(
        self, kind: str, *, load: Callable[[], None] | None = None, attr: str = "name"
    ) -> None:
        self.kind = kind
        self._load = load or (lambda: None)
        self._attr = attr
        self._classes: dict[str, type] = {}

    def register(self, name: str) -> Callable[[type], type]:
        """Class decorator: files the class under ``name`` and sets ``cls.<attr>``."""

        def deco(cls: type) -> type:
            if name in self._classes:
                raise ValueError(f"{self.kind} {name!r} registered twice")
            setattr(cls, self._attr, name)
            self._classes[name] = cls
            return cls

        return deco

    def names(self) -> list[str]:
        self._load()
        return sorted(self._classes)

    def __contains__(self, name: object) -> bool:
        self._load()
        return name in self._classes

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def get(self, name: str) -> type:
        self._load()
        try:
            return self._classes[name]
        except KeyError:
            raise ValueError(
                f"unknown {self.kind} {name!r}; choose one of: {', '.join(sorted(self._classes))}"
            ) from None

    def config(self, name: str, **options: Any) -> Any:
        """``name``'s ``Config(**options)``; unknown options raise a one-line ValueError."""
        return build_config(self.kind, name, self.get(name).Config, options)

    def make(self, name: str, **options: Any) -> Any:
        """Build ``name`` with ``Config(**options)``; unknown options raise a ValueError."""
        return self.get(name)(self.config(name, **options))
