"""A name → class registry for policies built from a ``Config`` dataclass.

Local policies (``sgl_fair.policies``) and router policies (``sgl_fair.router.policies``)
each keep one::

    POLICIES = Registry("policy", load=_import_builtin_modules)

    @POLICIES.register("vtc")
    class VTC: Config = ...          # the class defines a frozen ``Config`` dataclass

    POLICIES.make("vtc", lift=True)  # unknown names or options: a one-line ValueError

``load`` imports the built-in modules (running their decorators) on first lookup, so
importing the registry never imports every policy.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any


class Registry:
    def __init__(self, kind: str, *, load: Callable[[], None]) -> None:
        self.kind = kind
        self._load = load
        self._classes: dict[str, type] = {}

    def register(self, name: str) -> Callable[[type], type]:
        """Class decorator: files the class under ``name`` and sets ``cls.name``."""

        def deco(cls: type) -> type:
            if name in self._classes:
                raise ValueError(f"{self.kind} {name!r} registered twice")
            cls.name = name
            self._classes[name] = cls
            return cls

        return deco

    def names(self) -> list[str]:
        self._load()
        return sorted(self._classes)

    def get(self, name: str) -> type:
        self._load()
        try:
            return self._classes[name]
        except KeyError:
            raise ValueError(
                f"unknown {self.kind} {name!r}; choose one of: {', '.join(sorted(self._classes))}"
            ) from None

    def make(self, name: str, **options: Any) -> Any:
        """Build ``name`` with ``Config(**options)``; unknown options raise a ValueError."""
        cls = self.get(name)
        fields = {f.name for f in dataclasses.fields(cls.Config)}
        unknown = sorted(set(options) - fields)
        if unknown:
            raise ValueError(
                f"{self.kind} {name!r} has no option {unknown[0]!r}; "
                f"options: {', '.join(sorted(fields)) or '(none)'}"
            )
        return cls(cls.Config(**options))
