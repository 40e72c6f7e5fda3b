"""Preble's own local scheduler: priority groups by cache-hit ratio, served round-robin
with larger quotas for higher hit ratios (Preble paper §4; SPEC §3 ``preble-local``).

Sources: SPEC §3's summary of the paper (P = 10 priority groups by hit ratio, served
round-robin with larger quotas for higher hit ratios, so cache hits are favoured and no
group starves; the paper's own text was not at hand) and the authors' artifact, WukLab/preble,
``python/sglang/srt/managers/router/model_rpc.py`` (``schedule_heuristic == "fcfs-mpq"``:
``multi_priority_queue``, ``get_schedule_group``, ``max_schedule_allowed = (group + 1) * k``
with ``k = 10``, FCFS inside a group), which fixes the rules below unless marked
*(our reading)*.

* **Hit ratio and group.** ``h = prefix / tokens``: ``prefix`` = ``view.prefix_len(req)``,
  the tokens cached on this worker now; ``tokens`` = ``req.seq_len`` (the prompt, plus the
  output a retracted request must re-prefill; 0 tokens → ``h = 0``). ``h = 0`` is group 0,
  otherwise group ``ceil(h·P) − 1``: ``h`` in ``(i/P, (i+1)/P]`` is group ``i`` (the
  artifact's rule; ``floor(h·P)`` differs only when ``h`` is an exact multiple of ``1/P``).
  Computed in integers, so no float rounding moves a request across a boundary.
* **Quota.** A turn of group ``g`` takes up to ``(g + 1) × quota_unit`` requests of that
  group, oldest first (``quota_unit`` = the artifact's ``k``, default 10).
* **Round robin, persistent.** The policy keeps a cursor, the group whose turn is next; it
  starts at the top group ``P − 1``. A walk (``order``) begins at the first group at or
  below the cursor that has waiting requests (wrapping to the top); a turn that is taken
  moves the cursor one group down (``g − 1``, wrapping from 0 to ``P − 1``). The walk's
  first turn is taken even if its first request does not fit — as in the artifact, where
  each scheduling step serves the pointer's group and moves the pointer down whatever that
  step admitted, so a group whose head does not fit yields its turn. Low-hit groups are
  served every cycle.
* **Work conserving** *(our reading)*. The artifact admits from one group per scheduling
  step. Here a walk lists every waiting request exactly once — after a turn it goes on to
  the next group down with that group's quota, round after round until the queue is
  exhausted — so the scheduler can fill a step's budget: a walk is the artifact's sequence
  of steps (pointer, pointer − 1, …) compressed into one while room is left. A later turn of
  a walk is taken only once it admitted a request (``on_admitted``): if its first request
  does not fit, the step was full, and that group starts the next walk. When memory admits
  only a few requests per step this is the artifact's one turn per step.
* **Groups are recomputed every walk** *(our reading)* from the current cache, so a request
  rises when its prefix gets cached (or falls when it is evicted). The artifact fixes a
  request's group when it first enters the multi-priority queue.

Cost per walk: one ``prefix_len`` per waiting request (as LPM) and O(n + P) for the rest.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from sgl_fair.policies.base import BasePolicy, SchedulerView, register
from sgl_fair.request import Request


def hit_group(prefix_len: int, num_tokens: int, groups: int) -> int:
    """Priority group of a request with ``prefix_len`` of ``num_tokens`` tokens cached.

    0 when nothing is cached (or the request has no tokens), else ``ceil(h·groups) − 1``
    for ``h = prefix_len / num_tokens``, clamped to ``[0, groups − 1]``.
    """
    if prefix_len <= 0 or num_tokens <= 0:
        return 0
    g = -(-prefix_len * groups // num_tokens) - 1  # ceil without floats
    return min(max(g, 0), groups - 1)


def _check_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"preble-local: {name} must be an integer >= 1 (got {value!r})")


@register("preble-local")
class PrebleLocal(BasePolicy):
    asks_prefix_len = True

    @dataclass(frozen=True)
    class Config:
        groups: int = 10  # P, the number of hit-ratio priority groups
        quota_unit: int = 10  # a turn of group g admits up to (g + 1) * quota_unit requests

        def __post_init__(self) -> None:
            _check_int("groups", self.groups)
            _check_int("quota_unit", self.quota_unit)

    def __init__(self, config: Config | None = None) -> None:
        super().__init__(config)
        # The group whose turn is next (the artifact's ``start_schedule_from``).
        self.cursor = self.config.groups - 1
        # The request the walk offered last and its group: admitting it takes the turn.
        self._offered: tuple[Request, int] | None = None

    def quota(self, group: int) -> int:
        return (group + 1) * self.config.quota_unit

    def group_of(self, req: Request, view: SchedulerView) -> int:
        return hit_group(view.prefix_len(req), req.seq_len, self.config.groups)

    def order(self, waiting: Sequence[Request], view: SchedulerView) -> Iterator[Request]:
        groups = self.config.groups
        buckets: list[list[Request]] = [[] for _ in range(groups)]
        for req in waiting:  # arrival order is kept inside each group
            buckets[hit_group(view.prefix_len(req), req.seq_len, groups)].append(req)
        return self._walk(buckets)

    def on_admitted(self, req: Request, extend_len: int) -> None:
        super().on_admitted(req, extend_len)
        offered = self._offered
        if offered is not None and offered[0] is req:
            self._take_turn(offered[1])

    def _take_turn(self, group: int) -> None:
        self.cursor = (group - 1) % self.config.groups

    def _walk(self, buckets: list[list[Request]]) -> Iterator[Request]:
        """Turns over the non-empty groups, highest first from the cursor, round after round.

        ``live`` lists the groups with requests not yet yielded, highest first; a group
        leaves it when exhausted, so each request is yielded exactly once.
        """
        groups = len(buckets)
        live = [g for g in range(groups - 1, -1, -1) if buckets[g]]
        if not live:
            return
        i = next((k for k, g in enumerate(live) if g <= self.cursor), 0)
        self._take_turn(live[i])  # the walk's first turn is taken, however it ends
        heads = [0] * groups
        try:
            while live:
                g = live[i]
                bucket = buckets[g]
                end = min(len(bucket), heads[g] + self.quota(g))
                while heads[g] < end:
                    req = bucket[heads[g]]
                    heads[g] += 1
                    self._offered = (req, g)
                    yield req  # resumed only if admitted
                if heads[g] == len(bucket):
                    live.pop(i)  # the next group down is now at i
                    if live:
                        i %= len(live)
                else:
                    i = (i + 1) % len(live)
        finally:
            self._offered = None
