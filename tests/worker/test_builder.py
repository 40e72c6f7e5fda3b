"""The worker builder (``worker.builder``): one assembly for every engine, engines by name.

A kind registered from outside is built with no change to the builder (it never branches on
the engine's name); bad names and options are one-line errors; the live worker's
``build_core`` builds the simulated and the torch engine from its config through the kinds.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Any

import pytest

from sgl_fair.policies import make_policy
from sgl_fair.request import Request
from sgl_fair.worker import builder
from sgl_fair.worker.builder import build_worker, engine_kind, register_engine
from sgl_fair.worker.engine import StepResult
from sgl_fair.worker.live import (
    TORCH_DEFAULT_KV_TOKENS,
    LiveWorkerConfig,
    build_core,
    build_live,
)
from sgl_fair.worker.sim.cost_model import CostModel
from sgl_fair.worker.sim.engine import SimEngine
from sgl_fair.worker.sim.runner import simulate
from sgl_fair.worker.sim.text import EosLengths

COST = CostModel.from_names("A10G-24GB", "Llama-2-7B")


class CountingEngine:
    """Every step takes ``step_s``; each sampled token is the request's output position."""

    def __init__(self, step_s: float) -> None:
        self.step_s = step_s

    def run(self, batch):
        tokens = [r.num_output for r in batch.sampling_requests()]
        return StepResult(batch, self.step_s, tokens)


class CountingKind:
    @dataclass(frozen=True)
    class Config:
        step_s: float = 0.5

    exact_kv = False
    synchronous = False

    def default_cost_model(self) -> CostModel:
        return COST

    def default_kv_tokens(self, cost_model: CostModel) -> int:
        return 777

    def make_engine(self, config: Any, scheduler: Any, allocator: Any, cost_model: Any):
        return CountingEngine(config.step_s)

    def live_parts(self, cfg: Any) -> dict[str, Any]:
        return {}

    def describe(self, cfg: Any) -> str:
        return "counting"


@pytest.fixture
def counting():
    register_engine("counting-test", CountingKind())
    yield "counting-test"
    del builder._ENGINES["counting-test"]


def test_a_registered_kind_is_built_and_runs(counting):
    sched, engine = build_worker(
        policy=make_policy("fcfs"), engine=counting, engine_opts={"step_s": 0.25}
    )
    assert isinstance(engine, CountingEngine) and engine.step_s == 0.25
    assert sched.kv.capacity_tokens == 777  # the kind's default pool
    reqs = [Request(f"r{i}", "c", tuple(range(1, 9)), 3, 0.0) for i in range(2)]
    result = simulate(reqs, scheduler=sched, engine=engine, check_every=1)
    assert result.unfinished == 0
    assert [list(r.output_ids) for r in reqs] == [[0, 1, 2], [0, 1, 2]]


def test_sim_engine_defaults_and_options():
    sched, engine = build_worker(
        policy=make_policy("fcfs"), cost_model=COST, engine_opts={"token_range": (5, 50)}
    )
    assert isinstance(engine, SimEngine) and engine.token_range == (5, 50)
    assert sched.kv.capacity_tokens == COST.kv_capacity_tokens()
    sched, _ = build_worker(policy=make_policy("fcfs"), cost_model=COST, kv_tokens=1234)
    assert sched.kv.capacity_tokens == 1234


def test_bad_names_and_options_are_one_line_errors():
    with pytest.raises(ValueError, match=r"unknown engine 'nope'; choose one of: .*sim.*torch"):
        build_worker(policy=make_policy("fcfs"), engine="nope", cost_model=COST)
    with pytest.raises(ValueError, match=r"engine 'sim' has no option 'speed'; options: eos"):
        build_worker(policy=make_policy("fcfs"), cost_model=COST, engine_opts={"speed": 2})
    with pytest.raises(ValueError, match="the sim engine needs a cost_model"):
        build_worker(policy=make_policy("fcfs"))
    with pytest.raises(ValueError, match="registered twice"):
        register_engine("sim", CountingKind())


def test_live_sim_core_from_its_config():
    cfg = LiveWorkerConfig(wid=3, endpoints="ipc:///tmp/x", kv_tokens=2000, eos_token_id=7)
    core = build_core(cfg)
    assert core.wid == 3 and isinstance(core.engine, SimEngine)
    assert core.scheduler.kv.capacity_tokens == 2000
    assert core.engine.token_range == (259, 32000)
    assert core.engine.eos_token_id is None  # the model stops on its own only with eos_lengths
    assert engine_kind("sim").describe(cfg) == "sim H100-80GB Llama-3.1-8B"
    assert not engine_kind("sim").synchronous
    cfg = LiveWorkerConfig(wid=0, endpoints="x", eos_token_id=7, eos_lengths=EosLengths())
    assert build_core(cfg).engine.eos_token_id == 7
    # the context length its Hello carries: the simulated model's
    assert build_live(LiveWorkerConfig(wid=0, endpoints="x", model="Llama-2-7B"))[1] == 4096


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="needs torch")
def test_live_torch_core_from_its_config():
    from sgl_fair.worker.torch_engine.engine import TorchEngine
    from sgl_fair.worker.torch_engine.runner import LIVE_DEFAULT_KV_TOKENS

    cfg = LiveWorkerConfig(wid=0, endpoints="x", backend="torch", model="tiny", vocab_size=300)
    core = build_core(cfg)
    assert isinstance(core.engine, TorchEngine)
    assert core.scheduler.kv.capacity_tokens == TORCH_DEFAULT_KV_TOKENS == LIVE_DEFAULT_KV_TOKENS
    assert engine_kind("torch").synchronous
    assert engine_kind("torch").describe(cfg) == "torch tiny (reference, float32)"
    assert build_live(cfg)[1] == 8192  # the tiny preset's positions


@pytest.mark.parametrize(("policy", "says"), [("bros", True), ("vtc", False)])
def test_the_torch_engine_says_which_cost_table_a_batch_selecting_policy_prices_by(policy, says):
    """BROS packs its batches by iteration costs; on the torch engine they come from the
    simulator's cost table (not this engine's measured steps): its description says so."""
    from sgl_fair.worker.live import LiveWorkerConfig
    from sgl_fair.worker.torch_engine.runner import TorchEngineKind

    cfg = LiveWorkerConfig(0, "unused", backend="torch", policy=policy)
    text = TorchEngineKind().describe(cfg)
    assert text.startswith("torch Llama-3.1-8B")
    assert ("bros prices batches by the simulated H100-80GB Llama-3.1-8B" in text) is says
