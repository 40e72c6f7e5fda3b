import heapq
import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sgl_fair.radix import RadixTree
from sgl_fair.request import Request
from sgl_fair.worker.sim.engine import SYNTHETIC_TOKEN_BASE, synthetic_token
from sgl_fair.workloads.arrivals import Constant, Gamma, Phases
from sgl_fair.workloads.lengths import Fixed
from sgl_fair.workloads.programs import (
    BASE_RATE_PER_S,
    PROGRAM_KINDS,
    PROGRAMS,
    WORKLOADS,
    Chat,
    Judge,
    LongQA,
    ProgramClient,
    ToT,
    ToTConfig,
    generate_programs,
    make_program,
    program_demand,
    workload,
)

VOCAB = 32000


def common_prefix_len(a, b) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def node_of(req: Request) -> str:
    return req.rid.split("/", 1)[1]


def finish(req: Request) -> None:
    req.output_ids = [synthetic_token(req.rid, i) for i in range(req.output_len)]


def play(program, seed: int = 0) -> dict[str, Request]:
    """A fake driver: runs ``program`` to completion, finishing ready calls in a random
    order after random service times, never before their arrival. Asserts the protocol:
    a call is issued only once all its parents finished, never arriving before them."""
    rng = np.random.default_rng(seed)
    plans = {p.node: p for p in program.calls}
    finished_s: dict[str, float] = {}
    issued: dict[str, Request] = {}
    seq = itertools.count()
    pending: list[tuple[float, int, Request]] = []  # heap by arrival

    def accept(reqs, now):
        for r in reqs:
            node = node_of(r)
            assert node not in issued, "issued twice"
            for parent in plans[node].parents:
                assert parent in finished_s, f"{r.rid} issued before parent {parent} finished"
                assert r.arrival_s >= finished_s[parent]
            assert r.arrival_s >= now
            issued[node] = r
            heapq.heappush(pending, (r.arrival_s, next(seq), r))

    now = program.start_s
    program.check_invariants()
    accept(program.start(now), now)
    program.check_invariants()
    assert all(r.arrival_s == now for r in issued.values())
    running: list[Request] = []
    while pending or running:
        while pending and pending[0][0] <= now:  # arrived: "admitted"
            running.append(heapq.heappop(pending)[2])
        if not running:
            now = pending[0][0]
            continue
        req = running.pop(int(rng.integers(len(running))))  # finish in a random order
        now += float(rng.exponential(0.5))
        assert not program.done
        finish(req)
        finished_s[node_of(req)] = now
        accept(program.on_finished(req, now), now)
        program.check_invariants()
    assert program.done and program.finish_s == now
    assert program.num_issued == program.num_calls == len(issued)
    return issued


def check_common(program, calls: dict[str, Request]) -> None:
    """Invariants every program kind keeps."""
    plans = {p.node: p for p in program.calls}
    assert set(calls) == set(plans)
    for node, r in calls.items():
        plan = plans[node]
        assert r.rid == f"{program.program_id}/{node}"
        assert r.client == program.client
        assert r.interaction_id == program.program_id and r.app == program.kind
        parent_stages = [calls[p].stage for p in plan.parents]
        assert r.stage == (1 + max(parent_stages) if parent_stages else 0)
        assert r.max_new_tokens == r.output_len == plan.output_len
        assert r.input_len == program.input_len(node)  # known before anything ran
        # Prompt tokens: vocabulary ids, or outputs of this call's parents (never anything else).
        parent_outputs = {t for p in plan.parents for t in calls[p].output_ids}
        parent_outputs |= {t for p in plan.parents for t in calls[p].input_ids}
        for t in r.input_ids:
            assert 0 <= t < VOCAB or (t >= SYNTHETIC_TOKEN_BASE and t in parent_outputs)
    assert program.input_tokens == sum(r.input_len for r in calls.values())
    assert program.output_tokens == sum(r.output_len for r in calls.values())


def radix_of(calls: dict[str, Request]) -> RadixTree:
    tree = RadixTree()
    for r in calls.values():
        tree.insert(r.all_ids())
        tree.check_invariants()
    return tree


def check_tot(program: ToT, calls: dict[str, Request]) -> None:
    root_len = program.question_len
    roots = [r for n, r in calls.items() if "." not in n]
    assert len(roots) == program.config.branches
    distinct = root_len
    for node, r in calls.items():
        parent = node.rpartition(".")[0]
        base = calls[parent].all_ids() if parent else roots[0].input_ids[:root_len]
        assert r.input_ids[: len(base)] == base  # starts with parent's prompt + output
        assert r.input_len > len(base)  # plus an instruction of its own
        distinct += r.input_len - len(base) + r.output_len
        siblings = [calls[f"{parent}.{i}" if parent else str(i)] for i in range(len(roots))]
        for sib in siblings:
            if sib is not r:  # siblings share the parent's prompt + output, nothing more
                assert common_prefix_len(r.input_ids, sib.input_ids) == len(base)
    assert radix_of(calls).total_tokens == distinct


def check_judge(program: Judge, calls: dict[str, Request]) -> None:
    n = program.config.dimensions
    ctx = program.context_len
    dims, merge = [calls[f"dim{i}"] for i in range(n)], calls["merge"]
    assert merge.stage == 1 and all(d.stage == 0 for d in dims)
    expected = dims[0].all_ids()
    for d in dims[1:]:
        expected += d.input_ids[ctx:] + tuple(d.output_ids)
    assert merge.input_ids[: len(expected)] == expected
    merge_instr_len = merge.input_len - len(expected)
    assert 30 <= merge_instr_len <= 60
    for i, d in enumerate(dims):
        shared = common_prefix_len(merge.input_ids, d.input_ids)
        assert shared == (d.input_len if i == 0 else ctx)  # header + extra + article
        for e in dims[i + 1 :]:
            assert common_prefix_len(d.input_ids, e.input_ids) == ctx
    per_dim = [d.input_len - ctx + d.output_len for d in dims]
    distinct = ctx + sum(per_dim) + sum(per_dim[1:]) + merge_instr_len + merge.output_len
    assert radix_of(calls).total_tokens == distinct


def check_longqa(program: LongQA, calls: dict[str, Request]) -> None:
    ctx = program.context_len
    qs = list(calls.values())
    assert all(q.stage == 0 for q in qs)
    for a, b in itertools.combinations(qs, 2):
        assert common_prefix_len(a.input_ids, b.input_ids) == ctx
    distinct = ctx + sum(q.input_len - ctx + q.output_len for q in qs)
    assert radix_of(calls).total_tokens == distinct


def check_chat(program: Chat, calls: dict[str, Request]) -> None:
    turns = [calls[f"turn{i + 1}"] for i in range(len(calls))]
    for prev, nxt in itertools.pairwise(turns):
        assert nxt.input_ids[: prev.seq_len] == prev.all_ids()
        assert nxt.input_len > prev.seq_len
    assert radix_of(calls).total_tokens == turns[-1].seq_len  # one chain


CHECKS = {"tot": check_tot, "judge": check_judge, "longqa": check_longqa, "chat": check_chat}


def play_and_check(program, seed: int = 0) -> dict[str, Request]:
    calls = play(program, seed)
    check_common(program, calls)
    CHECKS[program.kind](program, calls)
    return calls


# ---- the program kinds ----------------------------------------------------------------------


def test_kinds_are_registered():
    assert set(PROGRAM_KINDS) == set(PROGRAMS) == set(CHECKS)


@pytest.mark.parametrize(("branches", "num_calls"), [(2, 30), (4, 340)])
def test_tot_call_counts_and_prefix_sharing(branches, num_calls):
    p = make_program("tot", "c0-tot-0", "c0", start_s=3.0, seed=7, branches=branches)
    assert p.num_calls == num_calls and p.num_issued == 0
    calls = play_and_check(p, seed=branches)
    assert len(calls) == num_calls
    assert max(r.stage for r in calls.values()) == 3  # tree height 4


@pytest.mark.parametrize("dimensions", [1, 2, 16])
def test_judge_merges_after_all_dimensions(dimensions):
    p = make_program("judge", "j", "c1", start_s=0.0, seed=3, dimensions=dimensions)
    assert p.num_calls == dimensions + 1
    roots = p.start(0.0)
    assert sorted(node_of(r) for r in roots) == sorted(f"dim{i}" for i in range(dimensions))
    for i, r in enumerate(roots):
        finish(r)
        ready = p.on_finished(r, 1.0 + i)
        assert [node_of(m) for m in ready] == (["merge"] if i == dimensions - 1 else [])
    merge = ready[0]
    assert merge.arrival_s == float(dimensions)
    finish(merge)
    assert p.on_finished(merge, 9.0) == [] and p.done
    check_judge(p, {node_of(r): r for r in [*roots, merge]})


def test_longqa_issues_all_questions_at_start():
    p = make_program("longqa", "q", "c2", start_s=1.0, seed=5, questions=7)
    roots = p.start(1.0)
    assert len(roots) == p.num_calls == 7
    assert all(r.arrival_s == 1.0 for r in roots)
    assert 3000 + 64 <= p.context_len <= 8000 + 64
    play_and_check(make_program("longqa", "q", "c2", start_s=1.0, seed=5, questions=7))


def test_chat_turns_wait_for_think_time():
    p = make_program("chat", "chat", "c3", start_s=0.0, seed=1, mean_turns=6.0)
    assert p.num_calls >= 2  # this seed gives a real conversation
    (turn,) = p.start(0.0)
    now = 0.0
    while True:
        finish(turn)
        now += 2.0
        ready = p.on_finished(turn, now)
        if not ready:
            break
        (turn,) = ready
        assert turn.arrival_s > now  # the user thinks before typing
        now = turn.arrival_s
    assert p.done and p.num_issued == p.num_calls
    play_and_check(make_program("chat", "chat", "c3", start_s=0.0, seed=1, mean_turns=6.0))


def test_prompt_tokens_do_not_depend_on_play_order():
    a = play_and_check(make_program("tot", "t", "c0", start_s=0, seed=11), seed=1)
    b = play_and_check(make_program("tot", "t", "c0", start_s=0, seed=11), seed=2)
    assert {n: r.input_ids for n, r in a.items()} == {n: r.input_ids for n, r in b.items()}


def test_programs_of_a_client_share_its_header_only():
    p, q = (make_program("tot", f"t{i}", "c0", start_s=0, seed=i) for i in (1, 2))
    other = make_program("tot", "t3", "c1", start_s=0, seed=1)
    a, b, c = (prog.start(0.0)[0].input_ids for prog in (p, q, other))
    assert common_prefix_len(a, b) >= ToTConfig().header_len
    assert common_prefix_len(a, c) < 2  # another client: another system prompt


# ---- misbehaviour (Tab. 3) ------------------------------------------------------------------


def test_s2_prefixes_are_longer_by_the_documented_amount():
    base = make_program("judge", "j", "c", start_s=0, seed=4)
    s2 = make_program("judge", "j", "c", start_s=0, seed=4, extra_prefix=600)
    h = base.config.header_len
    for a, b in zip(base.start(0.0), s2.start(0.0), strict=True):
        assert b.input_len == a.input_len + 600
        assert b.input_ids[:h] == a.input_ids[:h] and b.input_ids[h + 600 :] == a.input_ids[h:]

    base = make_program("tot", "t", "c", start_s=0, seed=4)
    s2_params = workload("tot", "s2")[0].params
    s2 = make_program("tot", "t", "c", start_s=0, seed=4, **s2_params)
    extra = s2.question_len - base.question_len
    assert 1500 <= extra <= 2500
    for a, b in zip(base.start(0.0), s2.start(0.0), strict=True):
        assert b.input_len == a.input_len + extra

    base = make_program("longqa", "q", "c", start_s=0, seed=4)
    s2 = make_program("longqa", "q", "c", start_s=0, seed=4, doc_scale=3.0)
    assert s2.document_len == 3 * base.document_len


def test_on_failed_stops_the_program():
    p = make_program("tot", "t", "c", start_s=0, seed=2)
    r0, r1 = p.start(0.0)
    finish(r0)
    children = p.on_finished(r0, 1.0)
    assert len(children) == 2 and p.num_issued == 4
    p.on_failed(r1, 1.5)
    p.check_invariants()
    assert not p.done and p.finish_s is None  # two calls still in flight
    finish(children[0])
    assert p.on_finished(children[0], 2.0) == []  # stopped: no grandchildren
    p.on_failed(children[1], 2.5)
    p.check_invariants()
    assert p.done and p.failed and p.num_issued == 4 < p.num_calls and p.finish_s == 2.5


def test_foreign_duplicate_and_short_finishes_raise():
    p = make_program("judge", "j", "c", start_s=0, seed=2)
    other = make_program("judge", "k", "c", start_s=0, seed=2)
    d0, d1 = p.start(0.0)
    (o0, _) = other.start(0.0)
    finish(o0)
    with pytest.raises(ValueError, match="not a call"):
        p.on_finished(o0, 1.0)
    impostor = Request(d1.rid, "c", (1, 2, 3), d1.output_len, 0.0)
    finish(impostor)
    with pytest.raises(ValueError, match="not a call"):
        p.on_finished(impostor, 1.0)
    with pytest.raises(ValueError, match="of .* output tokens"):
        p.on_finished(d0, 1.0)  # no output yet
    p.check_invariants()  # the refused finishes changed nothing
    finish(d0)
    assert p.on_finished(d0, 1.0) == []
    # A copy that travelled over a wire (same rid and prompt) is the same call.
    wire_copy = d1.unscheduled_copy()
    finish(wire_copy)
    assert [node_of(r) for r in p.on_finished(wire_copy, 1.5)] == ["merge"]
    p.check_invariants()
    with pytest.raises(ValueError, match="already"):
        p.on_finished(d0, 2.0)
    with pytest.raises(ValueError, match="already"):
        p.on_failed(d0, 2.0)
    with pytest.raises(ValueError, match="not a call"):
        p.on_failed(o0, 2.0)
    with pytest.raises(RuntimeError):
        p.start(3.0)


def test_make_program_rejects_unknown_kinds_and_params():
    with pytest.raises(ValueError, match="unknown program kind 'mcts'"):
        make_program("mcts", "p", "c", start_s=0, seed=0)
    with pytest.raises(ValueError, match="has no option 'branch'"):
        make_program("tot", "p", "c", start_s=0, seed=0, branch=3)
    with pytest.raises(ValueError, match="'branches'"):
        make_program("tot", "p", "c", start_s=0, seed=0, branches=0)
    with pytest.raises(ValueError, match="'branches'"):
        make_program("tot", "p", "c", start_s=0, seed=0, branches=40)  # 2.6M calls
    with pytest.raises(ValueError, match="'extra_prefix'"):
        make_program("judge", "p", "c", start_s=0, seed=0, extra_prefix=-1)
    with pytest.raises(ValueError, match="'doc_scale'"):
        make_program("longqa", "p", "c", start_s=0, seed=0, doc_scale=0)
    with pytest.raises(ValueError, match="'seed'"):
        make_program("chat", "p", "c", start_s=0, seed=-1)


# ---- workloads --------------------------------------------------------------------------


def rates(clients):
    return [c.arrivals.rate_per_s for c in clients]


def test_s1_s2_misbehaver_is_c0():
    tot = workload("tot", "s1")
    assert [c.client for c in tot] == ["c0", "c1", "c2", "c3"]
    assert [c.well_behaved for c in tot] == [False, True, True, True]
    assert tot[0].params == {"branches": 4} and all(not c.params for c in tot[1:])
    assert len(set(rates(tot))) == 1  # same program rate: more calls per program
    assert workload("judge", "s1")[0].params == {"dimensions": 16}
    assert workload("judge", "s2")[0].params == {"extra_prefix": 600}
    assert workload("longqa", "s2")[0].params == {"doc_scale": 3.0}
    qa = workload("longqa", "s1")
    assert rates(qa)[0] == pytest.approx(4 * rates(qa)[1]) and not qa[0].params
    assert all(c.well_behaved and not c.params for c in workload("judge", None))


def test_rates_scale_with_dp_and_rate_scale():
    for name in ("tot", "judge", "longqa", "mixed"):
        one = rates(workload(name, "s1"))
        assert rates(workload(name, "s1", dp=4, rate_scale=0.5)) == pytest.approx(
            [2 * r for r in one]
        )
    assert rates(workload("tot", dp=1)) == [BASE_RATE_PER_S["tot"]] * 4


def test_mixed_cycles_program_kinds():
    mixed = workload("mixed", "s1", num_clients=6)
    assert [c.kind for c in mixed] == ["tot", "judge", "longqa", "chat", "tot", "judge"]
    assert mixed[0].params == {"branches": 4} and not mixed[0].well_behaved
    assert all(c.well_behaved for c in workload("mixed"))


def test_chat_flood_follows_fig8():
    duration_s = 2000.0
    clients = workload("chat", duration_s=duration_s, rate_scale=0.25)
    assert [c.well_behaved for c in clients] == [True, True, False, False]
    assert all(c.arrivals.cv == 3.0 for c in (clients[0], clients[3]))
    programs = generate_programs(clients, duration_s, seed=3)
    counts = {}
    for p in programs:
        half = int(p.start_s >= duration_s / 2)
        counts[p.client, half] = counts.get((p.client, half), 0) + 1
    # c2 and c3 flood (8x) in the first half; c2 returns to normal in the second.
    assert counts["c2", 0] > 3 * counts["c0", 0] and counts["c3", 0] > 3 * counts["c0", 0]
    assert counts["c3", 1] > 3 * counts["c2", 1]


def test_workload_rejects_bad_fields():
    for kwargs, field in [
        ({"name": "mcts"}, "name"),
        ({"name": "tot", "scenario": "s3"}, "scenario"),
        ({"name": "tot", "dp": 0}, "dp"),
        ({"name": "tot", "rate_scale": -1.0}, "rate_scale"),
        ({"name": "tot", "cv": float("nan")}, "cv"),
        ({"name": "tot", "scenario": "s1", "num_clients": 1}, "num_clients"),
        ({"name": "chat"}, "duration_s"),
        ({"name": "chat", "duration_s": 60.0, "num_clients": 3}, "num_clients"),
        ({"name": "chat", "scenario": "s1", "duration_s": 60.0}, "scenario"),
    ]:
        with pytest.raises(ValueError, match=f"'{field}'"):
            workload(**kwargs)
    with pytest.raises(ValueError, match="'kind'"):
        ProgramClient("c0", "mcts", Constant(1.0))
    with pytest.raises(ValueError, match="'dimension'"):
        ProgramClient("c0", "judge", Constant(1.0), {"dimension": 3})


def test_generate_programs_is_sorted_unique_and_deterministic():
    clients = workload("mixed", "s2", num_clients=5, rate_scale=1.5)
    a = generate_programs(clients, 60.0, seed=5)
    b = generate_programs(clients, 60.0, seed=5)
    c = generate_programs(clients, 60.0, seed=6)
    starts = [p.start_s for p in a]
    assert starts == sorted(starts) and all(0 <= t < 60.0 for t in starts)
    assert len({p.program_id for p in a}) == len(a) > 10
    assert {p.kind for p in a} == set(PROGRAM_KINDS)

    def tokens(programs):
        return [
            (p.program_id, p.start_s, [r.input_ids for r in p.start(p.start_s)]) for p in programs
        ]

    ta = tokens(a)
    assert ta == tokens(b)
    assert ta != tokens(c)
    assert [p.well_behaved for p in a] == [p.client != "c0" for p in a]


def test_adding_a_client_leaves_the_others_unchanged():
    two = [ProgramClient("a", "longqa", Gamma(1.0, 2.0)), ProgramClient("b", "chat", Gamma(1.0))]
    three = [*two, ProgramClient("c", "tot", Constant(1.0), {"branches": 3})]
    x = [p for p in generate_programs(two, 20.0, seed=1)]
    y = [p for p in generate_programs(three, 20.0, seed=1) if p.client != "c"]
    assert [(p.program_id, p.start_s, p.start(0)[0].input_ids) for p in x] == [
        (p.program_id, p.start_s, p.start(0)[0].input_ids) for p in y
    ]


def test_program_demand_matches_a_played_run():
    clients = [
        ProgramClient("a", "judge", Constant(0.5), {"dimensions": 3}),
        ProgramClient("b", "chat", Phases(((10.0, Constant(1.0)),))),
    ]
    programs = generate_programs(clients, 10.0, seed=2)
    demand = program_demand(programs)
    played = {"a": [0, 0, 0, 0], "b": [0, 0, 0, 0]}
    for p in programs:
        calls = play_and_check(p)
        row = played[p.client]
        row[0] += 1
        row[1] += len(calls)
        row[2] += sum(r.input_len for r in calls.values())
        row[3] += sum(r.output_len for r in calls.values())
    assert {c: list(d) for c, d in demand.items()} == played
    assert demand["a"].num_calls == 4 * demand["a"].num_programs == 20


def test_every_workload_builds():
    for name in WORKLOADS:
        for scenario in (None,) if name == "chat" else (None, "s1", "s2"):
            clients = workload(name, scenario, duration_s=100.0, rate_scale=0.2)
            programs = generate_programs(clients, 100.0)
            kinds = {c.client: c.kind for c in clients}
            assert programs and all(p.kind == kinds[p.client] for p in programs)


# ---- property tests -------------------------------------------------------------------------

_PARAMS = {
    "tot": st.fixed_dictionaries(
        {"branches": st.integers(1, 3), "depth": st.integers(1, 4)},
        optional={"extra_question_len": st.integers(0, 50), "thought_len": st.integers(1, 9)},
    ),
    "judge": st.fixed_dictionaries(
        {"dimensions": st.integers(1, 6)}, optional={"extra_prefix": st.integers(0, 40)}
    ),
    "longqa": st.fixed_dictionaries(
        {"questions": st.integers(1, 6)},
        optional={"doc_scale": st.floats(0.01, 0.2), "answer_len": st.just(Fixed(1))},
    ),
    "chat": st.fixed_dictionaries(
        {"mean_turns": st.floats(1.0, 8.0), "max_turns": st.integers(1, 12)},
        optional={"think_s": st.floats(0.0, 30.0), "reply_len": st.integers(1, 5)},
    ),
}


@settings(max_examples=60, deadline=None)
@given(
    data=st.data(),
    kind=st.sampled_from(sorted(_PARAMS)),
    seed=st.integers(0, 2**32),
    play_seed=st.integers(0, 100),
)
def test_dag_invariants_hold_for_any_seed_and_params(data, kind, seed, play_seed):
    params = data.draw(_PARAMS[kind])
    program = make_program(kind, "p-1", "c7", start_s=2.5, seed=seed, **params)
    again = make_program(kind, "p-1", "c7", start_s=2.5, seed=seed, **params)
    calls = play_and_check(program, play_seed)
    calls_again = play(again, play_seed + 1)
    assert {n: r.input_ids for n, r in calls.items()} == {
        n: r.input_ids for n, r in calls_again.items()
    }
