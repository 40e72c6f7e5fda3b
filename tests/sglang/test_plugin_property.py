"""A property of the plugin inside SGLang's real admission code: whatever comes, no exception
escapes a hook, every request ends (finished or aborted), and the ledger is empty at the end.

Each example drives one policy through random steps on the rig (``sglang_rig.py``: SGLang's
real ``Req``, ``RadixCache`` and ``_get_new_batch_prefill_raw``, the plugin's hook functions):
arrivals through the plugin's arrival hook (some under a rid already live, some with no client,
some with garbage SLOs in ``custom_params`` or priorities), admission passes, batch results
that add a token and finish some requests (or end them aborted), aborts of queued requests,
and retractions of running ones back to the queue. Then every request is ended.

``SGLFAIR_PROPERTY_EXAMPLES=N`` for a wider, randomized run (``make bench``); 40 here.
"""

from __future__ import annotations

import os
import random
from types import SimpleNamespace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sglang.srt.managers.schedule_batch import FINISH_ABORT, FINISH_LENGTH
from sglang_rig import Rig, make_req

from sgl_fair.request import SLO_PARAM
from sgl_fair.worker.sglang import plugin
from sgl_fair.worker.sglang.settings import PluginSettings

pytestmark = pytest.mark.usefixtures("plugin_hooks")

WIDE = int(os.environ.get("SGLFAIR_PROPERTY_EXAMPLES", "0"))
POLICIES = ("fcfs", "vtc", "dlpm", "lpm", "lcf", "rpm", "fairserve", "bros")
BAD_SLOS = (None, "x", [1], [None, 2], [-1, 0.1], {"a": 1}, [float("nan"), 1], [1e300, 1e300])


def _queue(scheduler, req, *args, **kwargs):
    """SGLang's ``_add_request_to_queue``, as far as the queue goes."""
    scheduler.waiting_queue.append(req)


class Run:
    def __init__(self, policy: str, rng: random.Random, cache: str = "radix") -> None:
        self.rng = rng
        self.rig = Rig(max_running_requests=6, kv_tokens=20_000, cache=cache)
        self.s = self.rig.scheduler
        self.fair = plugin.install_policy(self.s, PluginSettings(policy, {}))
        self.running: list = []
        self.n = 0
        self.s._release_aborted_request = lambda req: None  # a refusal's 429 (plugin.reject)
        self.s.send_abort_output = lambda out, req: None

    def arrive(self) -> None:
        rng = self.rng
        self.n += 1
        rid = f"r{rng.randrange(self.n)}" if rng.random() < 0.2 else f"r{self.n}"
        client = rng.choice(["a", "b", "c", None])
        ids = [rng.randrange(5, 60) for _ in range(rng.randrange(1, 40))]
        req = make_req(ids, client, max_new_tokens=rng.randrange(1, 8), rid=rid)
        if rng.random() < 0.2:
            req.sampling_params.custom_params = {SLO_PARAM: rng.choice(BAD_SLOS)}
        if rng.random() < 0.2:
            req.priority = rng.choice([None, -5, 0, 100, 10**9])
        plugin._around_add_request(_queue, self.s, req)

    def admit(self) -> None:
        self.running += self.rig.admit()

    def step(self) -> None:
        """A batch result: a token for each running request; some finish, some abort."""
        for r in self.running:
            r.output_ids.append(7)  # SGLang appends to its array in place
            u = self.rng.random()
            if u < 0.1:
                r.finished_reason = FINISH_ABORT("client went away")
            elif u < 0.5 or len(r.output_ids) >= r.sampling_params.max_new_tokens:
                r.finished_reason = FINISH_LENGTH(len(r.output_ids))
        plugin._after_batch_result(None, self.s, SimpleNamespace(reqs=list(self.running)))
        self.running = [r for r in self.running if not r.finished()]

    def abort_queued(self) -> None:
        q = self.s.waiting_queue
        if q:
            q.remove(self.rng.choice(q))  # Scheduler.abort_request, then our hook
            plugin._after_abort(None, self.s)

    def retract(self) -> None:
        if self.running:
            r = self.running.pop(self.rng.randrange(len(self.running)))
            batch = SimpleNamespace(tree_cache=self.rig.tree)
            plugin._after_retract(([r], 0.5, []), batch)
            self.s.waiting_queue.append(r)  # SGLang queues a retracted request again

    def end(self) -> None:
        """Everything ends: queued requests are aborted, running ones finish."""
        while self.s.waiting_queue:
            self.abort_queued()
        for r in self.running:
            r.finished_reason = FINISH_LENGTH(len(r.output_ids) or 1)
        plugin._after_batch_result(None, self.s, SimpleNamespace(reqs=list(self.running)))
        self.running = []
        self.fair.calc_priority(self.s.waiting_queue)  # a pass over the empty queue


@settings(
    max_examples=WIDE or 40,
    derandomize=not WIDE,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    database=None,
)
@given(
    policy=st.sampled_from(POLICIES),
    seed=st.integers(0, 2**32 - 1),
    steps=st.lists(st.sampled_from("aaaAsxr"), min_size=1, max_size=60),
)
def test_no_input_brings_the_plugin_down_and_every_request_ends(policy, seed, steps):
    run = Run(policy, random.Random(seed))
    try:
        do = {"a": run.arrive, "A": run.admit, "s": run.step, "x": run.abort_queued,
              "r": run.retract}  # fmt: skip
        for op in steps:
            do[op]()  # no exception escapes a hook
        run.end()
        assert len(run.fair.ledger) == 0, run.fair.ledger.mirrors
        assert run.fair.errors.counts == {}, run.fair.errors.counts
    finally:
        run.fair.detach()
