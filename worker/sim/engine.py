"""The simulated engine: step durations from a cost model, synthetic output tokens.

It is a drop-in ``Engine``: the scheduler cannot tell it from a real one. Output
token ids are drawn from a private range above any vocabulary so generated text
never accidentally matches a prompt in the prefix cache.
"""

from __future__ import annotations

import itertools

from sgl_fair.worker.engine import Batch, StepResult
from sgl_fair.worker.sim.cost_model import CostModel

SYNTHETIC_TOKEN_BASE = 1 << 30


class SimEngine:
    def __init__(self, cost_model: CostModel) -> None:
        self.cost_model = cost_model
        self._token_ids = itertools.count(SYNTHETIC_TOKEN_BASE)

    def run(self, batch: Batch) -> StepResult:
        duration = self.cost_model.step_time(
            prefill_chunks=[(c.num_tokens, c.start) for c in batch.prefill],
            decode_context_lens=[r.seq_len for r in batch.decode],
        )
        n = sum(1 for c in batch.prefill if c.last) + len(batch.decode)
        tokens = [next(self._token_ids) for _ in range(n)]
        return StepResult(batch, duration, tokens)
