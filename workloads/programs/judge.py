"""LLM-as-a-judge with branch-solve-merge over a synthetic article (the DLPM paper's §6.1).

One call per evaluation dimension, then a merge call once *all* dimensions finished::

    header + [extra] + article ─┬─ + dim_0 → judgement_0 ─┐
                                ├─ + dim_1 → judgement_1 ─┼─▶ merge
                                └─ …                      ┘

    merge prompt = header + extra + article + dim_0 + judgement_0 + dim_1 + judgement_1
                   + … + merge_instruction                       → verdict

So every dimension call shares ``header + extra + article`` with the merge call, and the
merge prompt extends dimension 0's prompt + judgement. Nodes ``"dim0"`` … and ``"merge"``;
``stage`` 0 for dimensions, 1 for the merge. Calls per program: ``dimensions + 1``.

Lengths (tokens), and why:

* ``header_len`` 128: the judge's role and rubric ("act as an impartial judge … score 1–10"),
  shared by all of a client's programs.
* ``article_len`` Uniform(600, 1000): the brief's synthetic articles (a short news piece).
* ``dimension_instruction_len`` Uniform(20, 40): "Evaluate the article's coherence …".
* ``judgement_len`` Uniform(100, 200): a short justification and a score.
* ``merge_instruction_len`` Uniform(30, 60), ``verdict_len`` Uniform(100, 200).
* ``extra_prefix`` 0; the S2 misbehaver sets 600 (Tab. 3: "extra 600 tokens before each
  article"), drawn per article (each article gets its own preamble).

Per program (means): 2 dimensions: 3 calls, ~960-token dimension prompts, a ~1.3k-token merge
prompt, 3.3k prompt tokens in all (1.1k new), 450 output tokens. 16 dimensions: 17 calls, a
~3.9k-token merge prompt, 19.3k prompt tokens (4.0k new), 2.6k output tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ..lengths import LengthDist, Uniform
from .base import (
    CallPlan,
    GeneratedProgram,
    Out,
    Part,
    draw_diverging,
    draw_tokens,
    register_program,
)
from .program_config import ProgramConfig, check_int, length, sample_len, sample_lens


@dataclass(frozen=True)
class JudgeConfig(ProgramConfig):
    dimensions: int = 2
    extra_prefix: int = 0
    header_len: int = 128
    article_len: LengthDist | int = length(Uniform(600, 1000))
    dimension_instruction_len: LengthDist | int = length(Uniform(20, 40))
    judgement_len: LengthDist | int = length(Uniform(100, 200))
    merge_instruction_len: LengthDist | int = length(Uniform(30, 60))
    verdict_len: LengthDist | int = length(Uniform(100, 200))

    def __post_init__(self) -> None:
        check_int(self, "dimensions", minimum=1, maximum=1024)
        check_int(self, "extra_prefix", minimum=0)
        super().__post_init__()


@register_program("judge")
class Judge(GeneratedProgram):
    Config = JudgeConfig

    def plan(
        self, cfg: JudgeConfig, client: str, rngs: Sequence[np.random.Generator], shared_seed: int
    ) -> list[CallPlan]:
        rng_len, rng_tok, rng_extra = rngs
        context = self.draw_context(
            client,
            shared_seed,
            (rng_extra, cfg.extra_prefix),
            (rng_tok, sample_len(cfg.article_len, rng_len)),
        )
        self.context_len = len(context)  # header + extra + article: what every call shares

        n = cfg.dimensions
        instrs = draw_diverging(rng_tok, sample_lens(cfg.dimension_instruction_len, n, rng_len))
        judgement_lens = sample_lens(cfg.judgement_len, n, rng_len)
        dims = [f"dim{i}" for i in range(n)]
        calls = [
            CallPlan(node, (), (context, instr), out_len)
            for node, instr, out_len in zip(dims, instrs, judgement_lens, strict=True)
        ]
        merge_instr = draw_tokens(rng_tok, sample_len(cfg.merge_instruction_len, rng_len))
        parts: list[Part] = [context]
        for node, instr in zip(dims, instrs, strict=True):
            parts += [instr, Out(node)]
        parts.append(merge_instr)
        calls.append(
            CallPlan("merge", tuple(dims), tuple(parts), sample_len(cfg.verdict_len, rng_len))
        )
        return calls
