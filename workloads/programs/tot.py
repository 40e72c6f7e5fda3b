"""Tree-of-Thoughts on a GSM8K-style question (the DLPM paper's §6.1: tree height 4).

Every tree node below the root (the question) is one call; each call has ``branches``
children, so a tree makes ``b + b² + … + b^depth`` calls (b=2 → 30, b=4 → 340, Tab. 3)::

    header + [extra] + question ─┬─ + instr_0 → thought_0 ─┬─ + instr_00 → thought_00 ...
                                 │                          └─ + instr_01 → thought_01 ...
                                 └─ + instr_1 → thought_1 ...

A level-1 call's prompt is ``header + extra + question + instr``; a level-k call's prompt
is its parent's prompt + the parent's thought + its own ``instr``. Siblings share exactly
their parent's prompt + thought (their instructions' first tokens differ). Node names are
the branch path: ``"0"``, ``"0.1"``, ``"0.1.1"``, ``"0.1.1.0"``; ``stage = level - 1``.

Lengths (tokens), and why:

* ``header_len`` 256: system prompt + a one-shot worked GSM8K example and the
  "think step by step, propose one approach" format; shared by all of a client's trees.
* ``question_len`` Uniform(40, 160): GSM8K questions are ~45 words (≈ 60 tokens), with a
  tail to ~150 tokens.
* ``instruction_len`` Uniform(8, 24): "Consider approach 2 …" / "Continue this reasoning".
* ``thought_len`` Uniform(64, 160): one reasoning step of a GSM8K solution (full solutions
  run ~100–250 tokens, a thought is one or two steps).
* ``extra_question_len`` 0; the S2 misbehaver sets Uniform(1500, 2500) (mean 2,000): a long
  pasted context before the question, drawn per tree, so its whole tree shares it.

Per tree (means): b=2: 30 calls, prompts 372 → 756 tokens by level (20.0k prompt tokens in
all), 3,350 output tokens; only ~580 prompt tokens are new (question + instructions) when the
cache keeps each parent's prompt + thought. b=4: 340 calls, 245k prompt tokens (5.6k new),
38k output tokens. S2: 79k prompt tokens (2.6k new), prompts up to ~2.8k tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ..lengths import LengthDist, Uniform
from .base import CallPlan, GeneratedProgram, Out, PromptOf, draw_diverging, register_program
from .program_config import ProgramConfig, check_int, length, sample_len, sample_lens

MAX_CALLS = 20_000  # a guard against typos like branches=40


@dataclass(frozen=True)
class ToTConfig(ProgramConfig):
    branches: int = 2
    depth: int = 4
    header_len: int = 256
    question_len: LengthDist | int = length(Uniform(40, 160))
    extra_question_len: LengthDist | int = length(0, allow_zero=True)
    instruction_len: LengthDist | int = length(Uniform(8, 24))
    thought_len: LengthDist | int = length(Uniform(64, 160))

    def __post_init__(self) -> None:
        check_int(self, "branches", minimum=1, maximum=64)
        check_int(self, "depth", minimum=1, maximum=16)
        super().__post_init__()
        if self.num_calls > MAX_CALLS:
            raise ValueError(
                f"ToTConfig: field 'branches' {self.branches} with depth {self.depth} makes "
                f"{self.num_calls} calls per tree (more than {MAX_CALLS})"
            )

    @property
    def num_calls(self) -> int:
        return sum(self.branches**k for k in range(1, self.depth + 1))


@register_program("tot")
class ToT(GeneratedProgram):
    Config = ToTConfig

    def plan(
        self, cfg: ToTConfig, client: str, rngs: Sequence[np.random.Generator], shared_seed: int
    ) -> list[CallPlan]:
        rng_len, rng_tok, rng_extra = rngs
        question = self.draw_context(
            client,
            shared_seed,
            (rng_extra, sample_len(cfg.extra_question_len, rng_extra)),
            (rng_tok, sample_len(cfg.question_len, rng_len)),
        )
        self.question_len = len(question)  # the shared root of the tree, header included

        calls: list[CallPlan] = []
        frontier: list[str | None] = [None]  # None: the question (the tree's root)
        for _ in range(cfg.depth):
            next_frontier: list[str | None] = []
            for parent in frontier:
                instrs = draw_diverging(
                    rng_tok, sample_lens(cfg.instruction_len, cfg.branches, rng_len)
                )
                thought_lens = sample_lens(cfg.thought_len, cfg.branches, rng_len)
                for i, (instr, out_len) in enumerate(zip(instrs, thought_lens, strict=True)):
                    if parent is None:
                        node, parents, parts = str(i), (), (question, instr)
                    else:
                        node, parents = f"{parent}.{i}", (parent,)
                        parts = (PromptOf(parent), Out(parent), instr)
                    calls.append(CallPlan(node, parents, parts, out_len))
                    next_frontier.append(node)
            frontier = next_frontier
        return calls
