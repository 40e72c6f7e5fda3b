"""The scheduler's plain state: its configuration, what it reports, and the waiting queue.

``SchedulerConfig``, ``RunLog`` and ``SchedulerStats`` are imported from
``sgl_fair.worker.scheduler`` by callers; they live here to keep that module to its job.
The waiting queue is a list kept in arrival order (``Request.arrival_key``): ``enqueue``
inserts (a retracted request goes back to its place), ``without`` removes a pass's admitted
requests.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from sgl_fair.records import RequestRecord, ServiceEvent
from sgl_fair.request import Request

if TYPE_CHECKING:  # types only: these import nothing of the scheduler's
    from sgl_fair.policies.base import PolicyCaps
    from sgl_fair.radix import MatchMemo
    from sgl_fair.worker.kv.prefix_cache import PrefixHandle, PrefixKVCache


@dataclass(frozen=True)
class SchedulerConfig:
    """Flags named after SGLang's ServerArgs where SGLang has one."""

    max_running_requests: int = 256
    chunked_prefill_size: int = 8192
    init_new_token_ratio: float = 0.7
    min_new_token_ratio: float = 0.1
    new_token_ratio_decay_steps: int = 600
    clip_max_new_tokens: int = 4096
    retract_decode_steps: int = 20
    # While admission is blocked (the last walk stopped for lack of room), re-walk the queue
    # every k decode steps even if nothing finished. 0 = SGLang's `batch_is_full`: wait for a
    # finish, retraction or arrival. A fair policy's order shifts with every charged token,
    # so k = 1 admits the least-served client's request the first step it fits, at the cost
    # of an O(waiting) walk per step.
    recheck_blocked_every: int = 0
    # Share each client's hold on the running batch and KV while others wait (the share
    # guard, ``worker/share_guard.py``): a starving client's request may retract running
    # requests of the client holding the most. Off here (the papers' schedulers); the live
    # server turns it on for fair policies.
    share_guard: bool = False
    # vLLM's engine rules (the BROS paper's engine; ``bros-bicache``'s ``paged-recompute-vllm``
    # arm), off by default. ``admission_watermark``: a waiting request is admitted
    # only if the KV pool keeps this share of its tokens free beyond what the request takes
    # (vLLM's block manager ``watermark``, 0.01 there: ``can_allocate`` is OK only when free
    # blocks − required blocks ≥ watermark blocks). ``prefill_after_retract=False``: a step that
    # retracted a running request for KV admits no waiting request (vLLM's ``_schedule_default``
    # either prefills or decodes, and only its decode pass preempts), so a request preempted for
    # recompute is admitted again in a later step, when its blocks are free above the watermark.
    admission_watermark: float = 0.0
    prefill_after_retract: bool = True

    def __post_init__(self) -> None:
        for name in ("max_running_requests", "chunked_prefill_size", "clip_max_new_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1 (got {getattr(self, name)})")
        if not 0.0 <= self.admission_watermark < 1.0:
            raise ValueError(
                f"admission_watermark must be in [0, 1) (got {self.admission_watermark})"
            )
        if not 0 < self.min_new_token_ratio <= self.init_new_token_ratio <= 1:
            raise ValueError("need 0 < min_new_token_ratio <= init_new_token_ratio <= 1")

    @property
    def new_token_ratio_decay(self) -> float:
        span = self.init_new_token_ratio - self.min_new_token_ratio
        return span / max(self.new_token_ratio_decay_steps, 1)


@dataclass
class RunLog:
    """Where a scheduler reports: service events and every request that left."""

    events: list[ServiceEvent] = field(default_factory=list)
    done: list[Request] = field(default_factory=list)

    def records(self) -> list[RequestRecord]:
        return [RequestRecord.from_request(r) for r in self.done]


@dataclass
class SchedulerStats:
    num_prefill_steps: int = 0
    num_decode_steps: int = 0
    num_retractions: int = 0
    num_share_retractions: int = 0  # retractions by the share guard's admission rule
    num_unjams: int = 0  # steps that found nothing to run with work here (scheduler_liveness)
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0


def enqueue(waiting: list[Request], req: Request) -> None:
    """Insert ``req`` into ``waiting`` in arrival order (usually an append)."""
    if waiting and req.arrival_key() < waiting[-1].arrival_key():
        bisect.insort(waiting, req, key=Request.arrival_key)
    else:
        waiting.append(req)


def without(waiting: list[Request], gone: Sequence[Request]) -> list[Request]:
    """``waiting`` less ``gone``, order kept: each found by bisection and cut out with slice
    copies — O(k log n) plus one copy, not an O(n) Python filter per admission pass."""
    if len(gone) * 16 > len(waiting):
        ids = set(map(id, gone))
        return [r for r in waiting if id(r) not in ids]
    key, at = Request.arrival_key, []
    for req in gone:
        k = req.arrival_key()
        i = bisect.bisect_left(waiting, k, key=key)
        while i < len(waiting) and waiting[i] is not req and key(waiting[i]) == k:
            i += 1  # equal keys: find this very request
        if i == len(waiting) or waiting[i] is not req:  # not in order: look it up
            i = next(j for j, r in enumerate(waiting) if r is req)
        at.append(i)
    at.sort()
    out: list[Request] = []
    prev = 0
    for i in at:
        out += waiting[prev:i]
        prev = i + 1
    out += waiting[prev:]
    return out


class SchedulerCore(Protocol):
    """The scheduler's public state and parts, as its job modules see it (``admission``,
    ``retraction``, ``step_paths``, ``select_step``, ``decode_growth``, ``share_guard``,
    ``scheduler_liveness``). Declared here so that none of them imports ``scheduler.py``
    (no import cycle) and none reaches into another's private state."""

    policy: Any
    policy_caps: PolicyCaps
    kv: PrefixKVCache
    config: SchedulerConfig
    stats: SchedulerStats
    log: RunLog
    cost: Any
    now: float
    waiting: list[Request]
    running: list[Request]
    chunked: Request | None
    new_token_ratio: float
    handles: dict[Request, PrefixHandle]
    match_memo: dict[Request, MatchMemo]
    in_batch: tuple[Request, ...]
    # The last admission walk stopped for lack of memory or slots (SGLang's ``batch_is_full``).
    admission_blocked: bool
    blocked_decode_steps: int
    restored_tokens: int  # KV a continued chunk got back from host, this step
    admission: Any  # admission.Admission
    retraction: Any  # retraction.Retraction
    growth: Any  # decode_growth.DecodeGrowth

    def has_work(self) -> bool: ...

    def prefix_len(self, req: Request) -> int: ...

    def kv_need(self, req: Request) -> int: ...

    def kv_room(self, req: Request) -> float: ...

    def kv_freed_by(self, victim: Request, req: Request) -> float: ...

    def checkpointed_slots(self, req: Request) -> int: ...

    def copies(self) -> tuple: ...
