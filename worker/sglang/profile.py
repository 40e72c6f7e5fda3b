"""Timing SGLang's admission inside a live server: ``SGLFAIR_PROFILE_ADMISSION=FILE``.

With the variable set, the plugin (``plugin.register``) wraps SGLang 0.5.23's
``Scheduler._get_new_batch_prefill_raw`` — the scheduler's whole prefill-batch step:
``calc_priority`` (our policy's order when the plugin is on, SGLang's own otherwise), the
``PrefillAdder`` loop and building the batch — and appends one JSON line per call that found
requests waiting to ``FILE`` (with ``.<pid>`` appended, one file per scheduler process)::

    {"waiting": 1000, "running": 8, "admitted": 3, "s": 0.0042}

and, where the plugin's shadow follows KV events, one line per batch result whose drain
applied events (``record_drain``, off the admission step)::

    {"drain": 12, "s": 0.0003}

It works with the plugin off too (``SGLFAIR_SCHEDULE_POLICY`` unset), so SGLang's own
policy is measured in the same loop: ``bench/bench_sglang_live.py`` compares the two.
A call that returns before ordering the queue (no room for another request) records
``admitted: 0`` in microseconds; the bench reads the calls that admitted.
"""

from __future__ import annotations

import json
import os
import time
from typing import IO, Any

ENV_PROFILE = "SGLFAIR_PROFILE_ADMISSION"
TARGET = "sglang.srt.managers.scheduler.Scheduler._get_new_batch_prefill_raw"

_path: str | None = None
_out: IO[str] | None = None


def profile_path(environ: Any = None) -> str | None:
    env = os.environ if environ is None else environ
    path = env.get(ENV_PROFILE, "").strip()
    return path or None


def register_profiler(path: str) -> None:
    """Wrap the prefill-batch step; each scheduler process writes ``path.<pid>`` (opened at
    its first call, so the server's other processes write nothing)."""
    global _path
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    if _path is not None:
        return
    _path = path
    HookRegistry.register(TARGET, _around_prefill_batch, HookType.AROUND)


def _file() -> IO[str]:
    global _out
    if _out is None:
        _out = open(f"{_path}.{os.getpid()}", "a", buffering=1)  # noqa: SIM115 - the process's
    return _out


def record_drain(elapsed_s: float, events: int) -> None:
    """The plugin's KV-event drain after a batch result (``EventShadow.drain``), when
    profiling: one line ``{"drain": events, "s": ...}``; nothing otherwise."""
    if _path is not None:
        _file().write(json.dumps({"drain": events, "s": round(elapsed_s, 7)}) + "\n")


def _around_prefill_batch(original: Any, scheduler: Any, *args: Any, **kwargs: Any) -> Any:
    waiting = len(scheduler.waiting_queue)
    if not waiting:
        return original(scheduler, *args, **kwargs)
    start = time.perf_counter()
    out = original(scheduler, *args, **kwargs)
    elapsed = time.perf_counter() - start
    batch = out[0] if isinstance(out, tuple) else out
    running = out[1] if isinstance(out, tuple) and len(out) > 1 else None
    admitted = len(batch.reqs) if batch is not None else 0
    record = {
        "waiting": waiting,
        "running": len(running.reqs) if running is not None else None,
        "admitted": admitted,
        "s": round(elapsed, 7),
    }
    _file().write(json.dumps(record) + "\n")
    return out
