"""The simulated engine: step durations from a cost model, synthetic output tokens.

It is a drop-in ``Engine``: the scheduler cannot tell it from a real one. Output
token ids are a pure function of the request id and position (:func:`synthetic_token`):
the same request yields the same text on any worker and under any policy, as a seeded
model would, so programs that build prompts from earlier outputs are reproducible
across runs. By default they lie in a private range above any vocabulary, so generated
text never accidentally matches a prompt in the prefix cache; a live server passes its
tokenizer's ``token_range`` so that outputs decode to text.

Log-probabilities are synthetic too, a pure function of (previous token, token): the
same prompt always scores the same, so ``sgl.select`` is deterministic.

A live server also gives the engine a ``TextModel`` (sentence ends, commas, newlines from
its tokenizer, so stop strings fire) and its EOS id: a request whose ``output_len`` is
below its ``max_new_tokens`` — the simulated model stops on its own (``sim.text``) — ends
with that id, as a model's output ends with EOS.
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from sgl_fair.request import Request
from sgl_fair.worker.engine import Batch, Logprobs, StepResult
from sgl_fair.worker.kv.base import KVAllocator
from sgl_fair.worker.sim.cost_model import CostModel
from sgl_fair.worker.sim.text import TextModel

SYNTHETIC_TOKEN_BASE = 1 << 30
_SPAN = 1 << 30
_STRIDE = 7919  # odd, so positions 0 .. 2**30 - 1 of one request never collide


def synthetic_token(
    rid: str, position: int, token_range: tuple[int, int] = (SYNTHETIC_TOKEN_BASE, 1 << 31)
) -> int:
    """The ``position``-th output token of request ``rid``, in ``[lo, hi)`` (deterministic)."""
    lo, hi = token_range
    mixed = zlib.crc32(rid.encode()) * 1_000_003 + position * _STRIDE
    return lo + mixed % (hi - lo)


def synthetic_logprob(prev: int, token: int) -> float:
    """log p(token | prev) of the synthetic model: in (-8, -0.001], deterministic."""
    h = (prev * 1_000_003 + token * 7919 + 12345) % 7993
    return -0.001 - h / 1000.0


class SimEngine:
    def __init__(
        self,
        cost_model: CostModel,
        *,
        token_range: tuple[int, int] | None = None,
        text: TextModel | None = None,
        eos_token_id: int | None = None,
    ) -> None:
        self.cost_model = cost_model
        self.text = text
        self.eos_token_id = eos_token_id
        self.token_range = token_range or (SYNTHETIC_TOKEN_BASE, 1 << 31)
        lo, hi = self.token_range
        if not 0 <= lo < hi:
            raise ValueError(f"token_range must satisfy 0 <= lo < hi (got {self.token_range})")

    def run(self, batch: Batch) -> StepResult:
        duration = self.cost_model.step_time(
            prefill_chunks=[(c.num_tokens, c.start) for c in batch.prefill],
            decode_context_lens=[r.seq_len for r in batch.decode],
            swap_in_tokens=batch.swap_in_tokens,  # overlapped with the step (SPEC §5)
        )
        if self.text is None and self.eos_token_id is None:
            rng = self.token_range
            tokens = [synthetic_token(r.rid, r.num_output, rng) for r in batch.sampling_requests()]
        else:
            tokens = [self.next_token(r) for r in batch.sampling_requests()]
        return StepResult(batch, duration, tokens)

    def next_token(self, req: Request) -> int:
        """The token ``req`` samples next: EOS at its natural end, else a mark or a word."""
        position = req.num_output
        eos = self.eos_token_id
        natural_end = req.output_len < req.max_new_tokens
        if eos is not None and natural_end and position == req.output_len - 1:
            return eos
        if self.text is not None:
            mark = self.text.mark_id(req.rid, position)
            if mark is not None:
                return mark
        return synthetic_token(req.rid, position, self.token_range)

    def logprobs(self, req: Request) -> Logprobs:
        ids = req.input_ids
        start = req.logprob_start_len
        inputs: tuple[float | None, ...] = ()
        if start >= 0:
            inputs = tuple(
                None if i == 0 else synthetic_logprob(ids[i - 1], ids[i])
                for i in range(start, len(ids))
            )
        seq = ids[-1:] + tuple(req.output_ids)
        outputs = tuple(synthetic_logprob(seq[i], seq[i + 1]) for i in range(len(seq) - 1))
        top: tuple[tuple[tuple[float, int], ...], ...] = ()
        k = req.top_logprobs_num
        if k > 0:
            lo, hi = self.token_range
            rows = []
            for i, lp in enumerate(outputs):
                # The sampled token is the most likely one (greedy); the alternatives score lower.
                alts = [(lp, seq[i + 1])]
                for j in range(1, k):
                    alt = lo + (seq[i + 1] - lo + j * 7919) % (hi - lo)
                    alts.append((lp - 0.5 * j, alt))
                rows.append(tuple(alts))
            top = tuple(rows)
        return Logprobs(inputs, outputs, top)


class SimEngineKind:
    """The simulated engine in the worker builder's registry (``worker.builder``): a
    count-only KV cache, the pool derived from the cost model's memory, durations from it."""

    @dataclass(frozen=True)
    class Config:
        token_range: tuple[int, int] | None = None
        text: TextModel | None = None
        eos_token_id: int | None = None

    exact_kv = False
    synchronous = False

    def default_cost_model(self) -> CostModel:
        raise ValueError("the sim engine needs a cost_model (its step durations)")

    def default_kv_tokens(self, cost_model: CostModel) -> int:
        return cost_model.kv_capacity_tokens()

    def make_engine(
        self, config: Config, scheduler: Any, allocator: KVAllocator, cost_model: CostModel
    ) -> SimEngine:
        return SimEngine(
            cost_model,
            token_range=config.token_range,
            text=config.text,
            eos_token_id=config.eos_token_id,
        )

    def live_parts(self, cfg: Any) -> dict[str, Any]:
        """``build_worker`` arguments for a live worker's config (``worker.live``): the EOS id
        only where the model stops on its own (``eos_lengths``)."""
        eos = cfg.eos_token_id if cfg.eos_lengths is not None else None
        return {
            "cost_model": CostModel.from_names(cfg.gpu, cfg.model, tp=cfg.tp),
            "kv_tokens": cfg.kv_tokens,
            "engine_opts": {"token_range": cfg.token_range, "text": cfg.text, "eos_token_id": eos},
        }

    def describe(self, cfg: Any) -> str:
        return f"sim {cfg.gpu} {cfg.model}"

    def context_len(self, parts: Mapping[str, Any]) -> int | None:
        return parts["cost_model"].model.context_len
