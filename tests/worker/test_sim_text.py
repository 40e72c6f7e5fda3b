"""The simulated model's EOS and text: pure functions of the request id, at documented rates."""

from __future__ import annotations

import statistics

import pytest

from sgl_fair.messages import Finished, FinishReason
from sgl_fair.policies import make_policy
from sgl_fair.request import Request
from sgl_fair.worker.service import WorkerCore
from sgl_fair.worker.sim.cost_model import CostModel
from sgl_fair.worker.sim.runner import make_sim_worker
from sgl_fair.worker.sim.text import COMMA, NEWLINE, PERIOD, WORD, EosLengths, TextModel

TEXT = TextModel(period_id=49, comma_id=47, newline_id=13)


def test_eos_lengths_follow_the_documented_log_normal():
    eos = EosLengths()
    lengths = [eos.length(f"req-{i}") for i in range(20_000)]
    assert statistics.median(lengths) == pytest.approx(192, rel=0.05)
    assert statistics.mean(lengths) == pytest.approx(192 * 1.5, rel=0.05)  # exp(0.9² / 2)
    assert min(lengths) >= 1
    assert lengths == [eos.length(f"req-{i}") for i in range(20_000)]  # deterministic
    assert EosLengths(64, 0.0).length("anything") == 64


@pytest.mark.parametrize(
    ("spec", "expected"),
    [("off", None), ("100", EosLengths(100.0)), ("50,0.5", EosLengths(50.0, 0.5))],
)
def test_eos_spec_parses(spec, expected):
    assert EosLengths.parse(spec) == expected


@pytest.mark.parametrize("spec", ["", "abc", "1,2,3", "0.5", "100,-1", "inf"])
def test_bad_eos_spec_is_an_error_naming_the_form(spec):
    with pytest.raises(ValueError, match="MEDIAN|median|sigma"):
        EosLengths.parse(spec)


def test_text_marks_come_at_their_rates_and_never_twice_in_a_row():
    kinds = []
    for r in range(200):
        kinds += [TEXT.kind(f"r{r}", p) for p in range(500)]
    n = len(kinds)
    words = kinds.count(WORD)
    assert kinds.count(PERIOD) / words == pytest.approx(1 / 14, rel=0.15)
    assert kinds.count(COMMA) / words == pytest.approx(1 / 12, rel=0.15)
    assert kinds.count(NEWLINE) / kinds.count(PERIOD) == pytest.approx(1 / 4, rel=0.2)
    for a, b in zip(kinds, kinds[1:], strict=False):
        assert a == WORD or b == WORD or (a == PERIOD and b == NEWLINE), (a, b)
    assert all(TEXT.kind(f"r{r}", 0) == WORD for r in range(200))
    assert n == 100_000


def test_a_newline_follows_a_period_and_is_followed_by_a_word():
    for r in range(100):
        ks = [TEXT.kind(f"x{r}", p) for p in range(400)]
        for i, k in enumerate(ks):
            if k == NEWLINE:
                assert ks[i - 1] == PERIOD and (i + 1 == len(ks) or ks[i + 1] == WORD)


def worker(**engine_kw) -> WorkerCore:
    sched, engine = make_sim_worker(
        policy=make_policy("fcfs"),
        cost_model=CostModel.from_names("H100", "Llama-3.1-8B"),
        token_range=(259, 32_000),
        **engine_kw,
    )
    return WorkerCore(0, sched, engine)


def run_to_end(core: WorkerCore, reqs: list[Request]) -> dict[str, Finished]:
    now = 0.0
    for r in reqs:
        core.add(r, now)
    done = {}
    for _ in range(10_000):
        result = core.step(now)
        if result is not None:
            now += result.duration_s
            core.complete(result, now)
        for msg in core.drain(now).messages:
            if isinstance(msg, Finished):
                done[msg.rid] = msg
        if len(done) == len(reqs):
            return done
    raise AssertionError("did not finish")


def test_a_natural_end_emits_eos_and_finishes_as_stop():
    core = worker(text=TEXT, eos_token_id=2)
    short = Request("a", "c", (5, 6, 7), output_len=9, arrival_s=0.0, max_new_tokens=50)
    capped = Request("b", "c", (5, 6, 8), output_len=12, arrival_s=0.0)
    done = run_to_end(core, [short, capped])
    assert done["a"].reason is FinishReason.STOP and done["a"].output_ids[-1] == 2
    assert len(done["a"].output_ids) == 9
    assert done["b"].reason is FinishReason.LENGTH and 2 not in done["b"].output_ids
    assert len(done["b"].output_ids) == 12


def test_without_a_text_model_the_output_is_the_old_pure_word_stream():
    plain = run_to_end(worker(), [Request("a", "c", (5, 6), output_len=40, arrival_s=0.0)])
    texty = run_to_end(worker(text=TEXT), [Request("a", "c", (5, 6), output_len=40, arrival_s=0.0)])
    a, b = plain["a"].output_ids, texty["a"].output_ids
    assert all(259 <= t < 32_000 for t in a)
    changed = [i for i in range(40) if a[i] != b[i]]
    assert changed and all(b[i] in (49, 47, 13) for i in changed)  # only marks differ
