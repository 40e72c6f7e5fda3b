"""What the plugin does when its own code fails inside SGLang's scheduler.

SGLang calls our hooks from its scheduler loop, and an exception there ends the loop: the
server stops serving. So each hook body runs guarded: an error is logged (with its traceback
the first time per hook, then only counted), counted per hook, and SGLang goes on in its own
order for that pass (the adapter closes its walk; a request's arrival is still queued). The
counts are in the scheduler's internal state (``/server_info``'s ``internal_states``, key
``sgl_fair``), so an operator sees a plugin that keeps failing instead of a quiet FCFS server.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

log = logging.getLogger("sgl_fair.sglang")


class HookErrors:
    def __init__(self) -> None:
        self.counts: dict[str, int] = {}

    def run(self, hook: str, fn: Callable[..., Any], *args: Any, fallback: Any = None) -> Any:
        """``fn(*args)``; on an exception, count it and return ``fallback``."""
        try:
            return fn(*args)
        except Exception:  # noqa: BLE001 - never into SGLang's loop
            self.failed(hook)
            return fallback

    def failed(self, hook: str) -> None:
        """Count a failure of ``hook`` (call from an ``except`` block)."""
        n = self.counts.get(hook, 0) + 1
        self.counts[hook] = n
        if n == 1:
            log.exception("sgl-fair: %s failed; SGLang's own order for this pass", hook)
        else:
            log.warning("sgl-fair: %s failed again (%d times)", hook, n)

    @property
    def total(self) -> int:
        return sum(self.counts.values())
