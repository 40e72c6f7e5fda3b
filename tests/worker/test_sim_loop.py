"""The one simulation loop (``worker.sim.loop.SimLoop``): arrivals, jumps, hooks, stops.

A fixed-duration engine makes every time computable by hand: each step takes 1 s, each
request needs one prefill step and ``output_len - 1`` decode steps.
"""

from __future__ import annotations

from sgl_fair.policies import make_policy
from sgl_fair.request import Phase, Request
from sgl_fair.worker.builder import build_worker
from sgl_fair.worker.engine import StepResult
from sgl_fair.worker.sim.cost_model import CostModel
from sgl_fair.worker.sim.loop import OpenArrivals, SimLoop

COST = CostModel.from_names("A10G-24GB", "Llama-2-7B")


class OneSecond:
    def run(self, batch):
        return StepResult(batch, 1.0, [7 for _ in batch.sampling_requests()])


def worker():
    sched, _ = build_worker(policy=make_policy("fcfs"), cost_model=COST, kv_tokens=4000)
    return sched, OneSecond()


def req(rid: str, t: float, out: int = 2) -> Request:
    return Request(rid, "c", tuple(range(1, 17)), out, t)


def test_idle_worker_jumps_to_the_next_arrival_and_steps_are_seen_in_order():
    sched, engine = worker()
    seen = []
    loop = SimLoop(
        sched,
        engine,
        OpenArrivals([req("late", 10.0), req("early", 0.0)]),
        on_step=lambda lp, batch, result, start: seen.append((start, lp.now, len(batch.prefill))),
        check_every=1,
    ).run()
    # early: prefill [0, 1), decode [1, 2); idle until 10; late: prefill [10, 11), decode
    assert seen == [(0.0, 1.0, 1), (1.0, 2.0, 0), (10.0, 11.0, 1), (11.0, 12.0, 0)]
    assert loop.now == 12.0 and loop.num_steps == 4 and loop.busy_s == 4.0
    assert all(r.phase is Phase.FINISHED for r in (sched.log.done))


def test_until_stops_and_leaves_later_arrivals_pending():
    sched, engine = worker()
    arrivals = OpenArrivals([req("a", 0.0, out=50), req("b", 2.5), req("c", 30.0)])
    loop = SimLoop(sched, engine, arrivals, until_s=5.0).run()
    assert loop.now == 5.0
    assert [r.rid for r in arrivals.released] == ["a", "b"] and arrivals.num_pending == 1


def test_closed_loop_hooks_add_work_and_stop_the_loop():
    """No arrival source: before_step submits a follow-up when the last request finished;
    stop ends the loop after the third request's last step."""
    sched, engine = worker()
    done: list[Request] = []
    submitted: list[Request] = []

    def before_step(lp: SimLoop) -> bool:
        if not submitted or submitted[-1].finish_s is not None:
            r = req(f"r{len(submitted)}", lp.now)
            submitted.append(r)
            sched.add_request(r, lp.now)
        return True

    def on_step(lp, batch, result, start):
        done.extend(r for r in batch.sampling_requests() if r.finish_s == lp.now)

    loop = SimLoop(
        sched, engine, before_step=before_step, on_step=on_step, stop=lambda lp: len(done) == 3
    ).run()
    assert [r.rid for r in done] == ["r0", "r1", "r2"]
    assert loop.now == 6.0 and loop.num_steps == 6
    assert [r.arrival_s for r in submitted] == [0.0, 2.0, 4.0]


def test_before_step_false_stops_before_stepping():
    sched, engine = worker()
    loop = SimLoop(sched, engine, OpenArrivals([req("a", 0.0)]), before_step=lambda lp: False)
    loop.run()
    assert loop.num_steps == 0 and sched.num_waiting == 1
