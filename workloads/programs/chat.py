"""Multi-turn chat: one conversation, Chatbot-Arena-like (the DLPM paper's §6.3, Fig. 8).

Each turn's prompt is the previous turn's prompt + its reply + the next user message::

    system + user_1 → reply_1
    system + user_1 + reply_1 + user_2 → reply_2
    …

Turn i+1 is issued a user *think time* after turn i finished: ``on_finished`` returns it
with ``arrival_s = now + think``, and the driver holds it until then. Nodes ``"turn1"`` …,
``stage = turn - 1``.

Lengths and times, and why:

* ``num turns`` = min(Geometric(1 / ``mean_turns``), ``max_turns``) with mean_turns 4,
  max_turns 12 (mean ≈ 3.9): Arena conversations are mostly 1–3 turns with a long tail.
* ``system_len`` 64: the deployment's system prompt, shared by all of a client's chats.
* ``user_len`` LogNormal(mean 80, σ 0.8) clipped to [20, 300]: short questions, heavy tail
  of pasted text.
* ``reply_len`` LogNormal(mean 200, σ 0.5) clipped to [50, 400]: Arena replies average
  ~200 tokens.
* ``think_s`` 5.0: mean of the exponential think time between a reply and the next message.

Per conversation (means): 3.9 calls of ~200 output tokens (~770 in all), ~3.6k prompt tokens
in all of which ~0.3k are new with a warm cache (the user messages).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ..lengths import LengthDist, LogNormal
from .base import (
    CallPlan,
    GeneratedProgram,
    Out,
    PromptOf,
    draw_tokens,
    register_program,
    shared_tokens,
)
from .program_config import check_int, check_length, check_real, sample_lens


@dataclass(frozen=True)
class ChatConfig:
    mean_turns: float = 4.0
    max_turns: int = 12
    system_len: int = 64
    user_len: LengthDist | int = LogNormal(mean=80.0, sigma=0.8, lo=20, hi=300)
    reply_len: LengthDist | int = LogNormal(mean=200.0, sigma=0.5, lo=50, hi=400)
    think_s: float = 5.0

    def __post_init__(self) -> None:
        check_real(self, "mean_turns")
        if self.mean_turns < 1:
            raise ValueError(f"ChatConfig: field 'mean_turns' must be >= 1 (got {self.mean_turns})")
        check_int(self, "max_turns", minimum=1, maximum=1024)
        check_int(self, "system_len", minimum=0)
        check_length(self, "user_len")
        check_length(self, "reply_len")
        check_real(self, "think_s")


@register_program("chat")
class Chat(GeneratedProgram):
    Config = ChatConfig

    def plan(
        self, cfg: ChatConfig, client: str, rngs: Sequence[np.random.Generator], shared_seed: int
    ) -> list[CallPlan]:
        rng_len, rng_tok, rng_time = rngs
        system = shared_tokens(self.kind, client, cfg.system_len, shared_seed=shared_seed)
        num_turns = min(int(rng_len.geometric(1.0 / cfg.mean_turns)), cfg.max_turns)
        user_lens = sample_lens(cfg.user_len, num_turns, rng_len)
        reply_lens = sample_lens(cfg.reply_len, num_turns, rng_len)
        think_s = rng_time.exponential(cfg.think_s, num_turns).tolist()

        calls: list[CallPlan] = []
        for i in range(num_turns):
            user = draw_tokens(rng_tok, user_lens[i])
            if i == 0:
                calls.append(CallPlan("turn1", (), (system + user,), reply_lens[0]))
                continue
            prev = calls[-1].node
            parts = (PromptOf(prev), Out(prev), user)
            calls.append(CallPlan(f"turn{i + 1}", (prev,), parts, reply_lens[i], think_s[i]))
        return calls
