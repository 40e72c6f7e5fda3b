"""The torch engine under the real scheduler (``make_torch_worker``): exact end to end.

Requests with shared prefixes (the prefix cache reuses their KV), chunked prefills and a KV
pool small enough to retract, over the token, paged and bidirectional allocators (the last
with RT and BE requests, so BE KV is checkpointed to host and restored by ``kv_copies``):
every request's greedy output equals greedy generation with ``forward_full``.

Skipped without torch, unless ``SGLFAIR_REQUIRE_SGLANG=1`` (CI), where that fails.
"""

from __future__ import annotations

import random

import pytest
from requires import require

require("torch")

import torch  # noqa: E402

from sgl_fair.policies import make_policy  # noqa: E402
from sgl_fair.request import Request, ServiceClass  # noqa: E402
from sgl_fair.worker.scheduler import SchedulerConfig  # noqa: E402
from sgl_fair.worker.sim.runner import simulate  # noqa: E402
from sgl_fair.worker.torch_engine.model import LlamaConfig, LlamaModel  # noqa: E402
from sgl_fair.worker.torch_engine.runner import make_torch_worker  # noqa: E402

VOCAB = 1024
OUT = 5


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def model() -> LlamaModel:
    cfg = LlamaConfig.preset("tiny", vocab_size=VOCAB)
    return LlamaModel.random(cfg, seed=0, dtype=torch.float64)


def workload(n: int, seed: int = 0) -> list[Request]:
    rng = random.Random(seed)
    shared = [tuple(rng.randrange(3, VOCAB) for _ in range(k)) for k in (21, 9)]
    reqs = []
    for i in range(n):
        head = shared[i % 2] if i % 3 else ()
        tail = tuple(rng.randrange(3, VOCAB) for _ in range(rng.randrange(3, 30)))
        cls = ServiceClass.RT if i % 2 else ServiceClass.BE
        reqs.append(
            Request(
                f"q{i}",
                f"c{i % 3}",
                head + tail,
                OUT,
                i * 0.002,
                service_class=cls,
                sampling={"temperature": 0},
            )
        )
    return reqs


def greedy_full(model: LlamaModel, prompt, n: int) -> list[int]:
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(torch.argmax(model.forward_full(ids)[-1])))
    return ids[len(prompt) :]


@pytest.mark.parametrize(
    ("allocator", "opts", "policy", "kv_tokens"),
    [
        ("token", {}, "dlpm", 256),
        ("paged", {"block_size": 16}, "fcfs", 256),
        # A small pool: RT growth checkpoints BE slots to host and they are swapped back.
        ("bidirectional", {"block_size": 16, "host_capacity_tokens": 256}, "bros", 256),
        # The same without pressure: no checkpoint/swap-in cycle at all.
        ("bidirectional", {"block_size": 16, "host_capacity_tokens": 256}, "bros", 4096),
        ("bidirectional", {"block_size": 16, "host_capacity_tokens": 256}, "vtc", 256),
    ],
)
def test_scheduler_and_torch_engine_equal_greedy_full(model, allocator, opts, policy, kv_tokens):
    """Exactness: every allocator, with and without forced checkpoint/swap-in cycles, with
    radix prefix sharing (asserted used), gives the tokens of a no-cache full recompute."""
    sched, engine = make_torch_worker(
        policy=make_policy(policy),
        model=model,
        allocator=allocator,
        allocator_opts=opts,
        kv_tokens=kv_tokens,
        config=SchedulerConfig(chunked_prefill_size=24, max_running_requests=6),
    )
    copies = []
    run = engine.run
    engine.run = lambda batch: copies.extend(batch.kv_copies) or run(batch)
    reqs = workload(12)
    result = simulate(reqs, scheduler=sched, engine=engine, check_every=1)
    assert sum(r.first_prefix_len or 0 for r in reqs) > 0  # the prefix cache was used
    if allocator == "bidirectional" and kv_tokens == 256 and policy == "bros":
        assert any(c.to_host for c in copies) and any(not c.to_host for c in copies)
    if kv_tokens > 1024:
        assert not copies
    assert result.unfinished == 0
    for r in reqs:
        assert r.done, r
        assert r.output_ids == greedy_full(model, r.input_ids, OUT), r.rid
