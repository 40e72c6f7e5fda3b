"""Long-document QA, LooGLE-like (the DLPM paper's §6.1): several questions on one document.

The questions do not depend on each other, so all are issued at start::

    header + document ─┬─ + question_0 → answer_0
                       ├─ + question_1 → answer_1
                       └─ …

Nodes ``"q0"`` …, all ``stage`` 0. Calls per program: ``questions``.

Lengths (tokens), and why:

* ``header_len`` 64: the QA instruction ("answer from the document only …"), shared by all of
  a client's programs.
* ``document_len`` Uniform(3000, 8000): LooGLE's documents run far longer (tens of thousands of
  words); we keep the part a serving benchmark typically feeds an 8B model, long enough that
  prefill dominates (the paper's point: a very high prefix-to-output ratio).
* ``questions`` 6 (LooGLE has several questions per document; the brief's 4–8).
* ``question_len`` Uniform(20, 60), ``answer_len`` Uniform(16, 64): short factual QA.
* ``doc_scale`` 1; the S2 misbehaver sets 3 (documents 3× longer). The document length is
  ``round(document_len × doc_scale)`` from the same draw, so for one seed the S2 document
  is exactly 3× the well-behaved one.

Per program (means): 6 calls of ~5.7k prompt tokens (34.3k in all, 5.9k new with a warm
cache), 240 output tokens. S2: ~17k-token prompts, 102k prompt tokens (17k new).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ..lengths import LengthDist, Uniform
from .base import CallPlan, GeneratedProgram, draw_diverging, register_program
from .program_config import ProgramConfig, check_int, check_real, length, sample_len, sample_lens


@dataclass(frozen=True)
class LongQAConfig(ProgramConfig):
    questions: int = 6
    doc_scale: float = 1.0
    header_len: int = 64
    document_len: LengthDist | int = length(Uniform(3000, 8000))
    question_len: LengthDist | int = length(Uniform(20, 60))
    answer_len: LengthDist | int = length(Uniform(16, 64))

    def __post_init__(self) -> None:
        check_int(self, "questions", minimum=1, maximum=1024)
        check_real(self, "doc_scale", positive=True)
        super().__post_init__()


@register_program("longqa")
class LongQA(GeneratedProgram):
    Config = LongQAConfig

    def plan(
        self, cfg: LongQAConfig, client: str, rngs: Sequence[np.random.Generator], shared_seed: int
    ) -> list[CallPlan]:
        rng_len, rng_tok, rng_doc = rngs
        self.document_len = max(1, round(sample_len(cfg.document_len, rng_len) * cfg.doc_scale))
        context = self.draw_context(client, shared_seed, (rng_doc, self.document_len))
        self.context_len = len(context)

        n = cfg.questions
        questions = draw_diverging(rng_tok, sample_lens(cfg.question_len, n, rng_len))
        answer_lens = sample_lens(cfg.answer_len, n, rng_len)
        calls = [
            CallPlan(f"q{i}", (), (context, question), out_len)
            for i, (question, out_len) in enumerate(zip(questions, answer_lens, strict=True))
        ]
        return calls
