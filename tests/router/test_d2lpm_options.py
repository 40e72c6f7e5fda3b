"""D2LPM's options beyond the paper (router/policies/d2lpm.py): sliding deficits and the load
measured in outstanding tokens. The paper's rules are tested in ``test_d2lpm.py``; each test
here shows an option changes a decision the paper's rule makes, and what it keeps (the
deficits' bounds)."""

from __future__ import annotations

import itertools

import pytest
from router_helpers import finished, make_req
from test_d2lpm import OUT_LEN, PROMPT_MAX, W_E, W_O, Cluster, U, d2lpm, simulate

from sgl_fair.messages import FinishReason
from sgl_fair.request import Request
from sgl_fair.router.policies.outstanding import OutstandingWork

# ---- sliding deficits ------------------------------------------------------------------------


def chain(deficits: str) -> list[int]:
    """Quantum 100, 2 workers. a's first call costs 150 (worker 0 goes 50 into debt), an
    unrelated call of a's costs 95 on worker 1; then a's follow-up to the first call (50 new
    tokens). Returns the three workers."""
    r, p = d2lpm(num_workers=2, quantum=100.0, deficits=deficits)
    first = tuple(range(150))
    out = [r.dispatch(make_req(first, "a"), 0.0).worker]
    out.append(r.dispatch(make_req(range(5000, 5095), "a"), 0.0).worker)
    out.append(r.dispatch(make_req(first + tuple(range(9000, 9050)), "a"), 0.0).worker)
    return out


def test_the_paper_rule_moves_a_follow_up_off_its_holder_late_in_a_round():
    # D0 = -50, D1 = 5: only worker 1 is eligible, so the follow-up recomputes 150 tokens there.
    assert chain("rounds") == [0, 1, 1]


def test_the_sliding_rule_keeps_it_where_the_spread_allows():
    # Charged 150 on worker 0 and 95 on worker 1: 55 apart, under one quantum, so worker 0
    # is still within its share and keeps the follow-up (its prefix is cached there).
    assert chain("sliding") == [0, 1, 0]


def test_sliding_deficits_lift_the_least_charged_worker_to_one_quantum():
    r, p = d2lpm(num_workers=3, quantum=100.0, quanta={2: 200.0}, deficits="sliding")
    r.dispatch(make_req(range(30), "a"), 0.0)  # fresh client: all level, worker 0 charged 30
    assert [p.deficit(u, "a") for u in range(3)] == [70.0, 100.0, 200.0]
    r.dispatch(make_req(range(100, 350), "a"), 0.0)  # no holder; least queued among 1, 2
    r.dispatch(make_req(range(400, 420), "a"), 0.0)  # slides first
    # charged: w0 30, w1 250 (0 queued -> worker 1 was picked), then the lift puts the least
    # charged (per quantum) at one quantum before the third call is charged
    levels = [p.deficit(u, "a") / p.quantum_of(u) for u in range(3)]
    assert max(levels) <= 1.0
    r.add_worker(3)
    r.dispatch(make_req(range(600, 605), "a"), 0.0)
    assert p.deficit(3, "a") > 0  # a joining worker starts level with the least charged


def test_the_sliding_rule_keeps_the_papers_per_worker_spread_bound():
    """As ``test_router_spreads_each_clients_service_evenly_over_workers``: any two workers'
    charged service for one client stays within ``Q + w_e·max_input + k·w_o·max_output``."""
    quantum, k = 1500.0, 8
    bound = quantum + W_E * PROMPT_MAX + k * W_O * OUT_LEN
    worst = {"spread": 0.0}

    def check(state: Cluster) -> None:
        for client in "AB":
            charged = [state.charged.get((client, u), 0.0) for u in state.router.workers]
            worst["spread"] = max(worst["spread"], max(charged) - min(charged))
            assert max(charged) - min(charged) < bound, (client, charged)

    simulate(quantum, local="fcfs", k=k, steps=3000, check=check, deficits="sliding")
    assert worst["spread"] > quantum / 2  # the bound is approached, not trivially met


@pytest.mark.parametrize("quantum,q_local", [(1000.0, 400.0), (2500.0, 400.0)])
def test_two_backlogged_clients_stay_within_the_bound_with_sliding_deficits(quantum, q_local):
    """Thm 5.1's end-to-end check (``test_two_backlogged_clients_service_stays_within_the_
    bound``) with the sliding rule."""
    n = 4
    diffs = simulate(quantum, local="dlpm", k=8 * n, steps=6000, q_local=q_local,
                     deficits="sliding")  # fmt: skip
    settled = diffs[len(diffs) // 4 :]
    assert max(settled) - min(settled) <= 2 * n * (quantum + q_local + U)
    assert max(map(abs, diffs)) <= n * n * quantum + 2 * n * (q_local + U)


@pytest.mark.parametrize("options", [{"deficits": "fluid"}, {"load": "bytes"},
                                     {"default_output_len": 0.0}])  # fmt: skip
def test_bad_options_are_refused(options):
    with pytest.raises(ValueError, match=next(iter(options))):
        d2lpm(**options)


# ---- the load in outstanding tokens -----------------------------------------------------------


def loaded_router(load: str):
    """Worker 0 holds one 2,000-token request, worker 1 three 10-token ones (sharing a prefix,
    so locality keeps them together under either load measure)."""
    r, p = d2lpm(num_workers=2, quantum=100_000.0, load=load)
    fresh = itertools.count(10**6)
    big = make_req(tuple(itertools.islice(fresh, 2000)), "big", output_len=500)
    assert r.dispatch(big, 0.0).worker == 0
    shared = tuple(itertools.islice(fresh, 4))
    smalls = []
    for _ in range(3):
        s = make_req(shared + tuple(itertools.islice(fresh, 6)), "small", output_len=500)
        assert r.dispatch(s, 0.0).worker == 1
        smalls.append(s)
    return r, p, fresh, big, smalls


def test_requests_load_counts_requests_and_tokens_load_counts_their_size():
    r, _, fresh, _, _ = loaded_router("requests")
    assert r.dispatch(make_req(tuple(itertools.islice(fresh, 10)), "new"), 0.0).worker == 0
    r, p, fresh, _, _ = loaded_router("tokens")
    assert p._work.of(0) > 2 * p._work.of(1)
    assert r.dispatch(make_req(tuple(itertools.islice(fresh, 10)), "new"), 0.0).worker == 1


def test_outstanding_work_is_priced_once_and_removed_exactly():
    r, p, _, big, smalls = loaded_router("tokens")
    default = p.config.default_output_len
    assert p._work.of(0) == pytest.approx(W_E * 2000 + W_O * default)
    # the first small one misses all 10 tokens, the next two only 6
    assert p._work.of(1) == pytest.approx(W_E * (10 + 6 + 6) + 3 * W_O * default)
    r.handle(finished(1, smalls[0], range(7), reason=FinishReason.ABORTED), 1.0)
    r.handle(finished(0, big, range(300)), 1.0)
    assert p._work.of(0) == 0.0
    assert p._work.of(1) == pytest.approx(W_E * (6 + 6) + 2 * W_O * default)
    for s in smalls[1:]:
        r.handle(finished(1, s, range(5)), 1.0)
    assert p._work.of(1) == 0.0
    r.check_invariants()


def test_the_expected_output_is_the_clients_mean_capped_by_max_new_tokens():
    work = OutstandingWork(extend_weight=1.0, output_weight=2.0, default_output_len=128.0)
    req = Request("x", "a", (1, 2), output_len=4, arrival_s=0.0, max_new_tokens=1000)
    assert work.expected_output(req) == 128.0
    for i, n in enumerate((200, 400)):
        done = make_req((i,), "a")
        work.dispatched(done, 0, 1)
        work.finished(finished(0, done, range(n)))
    assert work.expected_output(req) == 300.0
    capped = Request("y", "a", (1, 2), output_len=4, arrival_s=0.0, max_new_tokens=50)
    assert work.expected_output(capped) == 50.0
    assert work.expected_output(make_req((9,), "b")) == min(128.0, 4)  # b: default, capped


def test_a_removed_worker_takes_its_outstanding_work_with_it():
    r, p, fresh, big, _ = loaded_router("tokens")
    r.remove_worker(0)
    assert p._work.of(0) == 0.0
    r.handle(finished(0, big, range(3)), 1.0)  # stale: ignored
    assert p._work.of(1) > 0
