"""The simulated engine: step durations from a cost model, synthetic output tokens.

It is a drop-in ``Engine``: the scheduler cannot tell it from a real one. Output
token ids lie in a private range above any vocabulary, so generated text never
accidentally matches a prompt in the prefix cache, and are a pure function of the
request id and position (:func:`synthetic_token`): the same request yields the same
text on any worker and under any policy, as a seeded model would, so programs that
build prompts from earlier outputs are reproducible across runs.
"""

from __future__ import annotations

import zlib

from sgl_fair.worker.engine import Batch, StepResult
from sgl_fair.worker.sim.cost_model import CostModel

SYNTHETIC_TOKEN_BASE = 1 << 30
_SPAN = 1 << 30
_STRIDE = 7919  # odd, so positions 0 .. 2**30 - 1 of one request never collide


def synthetic_token(rid: str, position: int) -> int:
    """The ``position``-th output token of request ``rid`` (deterministic, >= 2**30)."""
    mixed = zlib.crc32(rid.encode()) * 1_000_003 + position * _STRIDE
    return SYNTHETIC_TOKEN_BASE + mixed % _SPAN


class SimEngine:
    def __init__(self, cost_model: CostModel) -> None:
        self.cost_model = cost_model

    def run(self, batch: Batch) -> StepResult:
        duration = self.cost_model.step_time(
            prefill_chunks=[(c.num_tokens, c.start) for c in batch.prefill],
            decode_context_lens=[r.seq_len for r in batch.decode],
        )
        tokens = [synthetic_token(r.rid, r.num_output) for r in batch.sampling_requests()]
        return StepResult(batch, duration, tokens)
