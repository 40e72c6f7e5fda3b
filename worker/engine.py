"""The scheduler ↔ engine seam (ARCHITECTURE seam #2).

    batch = scheduler.step(now)      # what to run: a prefill batch or a decode batch
    result = engine.run(batch)       # how long it took and which tokens came out
    scheduler.apply(result, now)     # account tokens, finish, free

The simulated engine answers from a cost model; the SGLang backend runs the model.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from sgl_fair.request import Request


@dataclass(frozen=True, slots=True)
class PrefillChunk:
    """Compute ``num_tokens`` tokens of ``req`` starting at position ``start``.

    ``start`` counts tokens whose KV already exists (cached prefix, earlier chunks).
    The chunk that completes the prompt (``last``) also samples the first output token.
    """

    req: Request
    start: int
    num_tokens: int
    last: bool


@dataclass(frozen=True, slots=True)
class KVCopy:
    """One KV copy between the device pool and host memory (bidirectional blocks' lazy
    checkpoints): device block ``block`` slots [slot, slot + num_tokens) <-> host slots
    [host_offset, host_offset + num_tokens). ``to_host``: a checkpoint (device -> host), else
    a restore (host -> device). A real engine does a batch's copies in order before computing;
    the simulator charges the restores (``Batch.swap_in_tokens``)."""

    to_host: bool
    host_offset: int
    block: int
    slot: int
    num_tokens: int


@dataclass(frozen=True, slots=True)
class Batch:
    """One engine step: prefill chunks and/or one decode token each (mixed only for
    batch-selecting policies; the default scheduler path emits one kind per step)."""

    prefill: tuple[PrefillChunk, ...] = ()
    decode: tuple[Request, ...] = ()
    # KV tokens copied host -> device before this step (bidirectional blocks' checkpoints);
    # the copy overlaps the step, so it costs max(step, copy), not the sum.
    swap_in_tokens: int = 0
    # The copies behind it and any checkpoints this step's allocations made, in the order the
    # allocator made them (empty unless the scheduler's cache records them: a real engine).
    kv_copies: tuple[KVCopy, ...] = ()

    @property
    def is_prefill(self) -> bool:
        return bool(self.prefill)

    @property
    def num_prefill_tokens(self) -> int:
        return sum(c.num_tokens for c in self.prefill)

    def sampling_requests(self) -> list[Request]:
        """Requests that get one new token from this step, in result order."""
        return [c.req for c in self.prefill if c.last] + list(self.decode)


@dataclass(frozen=True, slots=True)
class StepResult:
    batch: Batch
    duration_s: float
    # One token id per ``batch.sampling_requests()``, same order.
    next_token_ids: Sequence[int]


@dataclass(frozen=True, slots=True)
class Logprobs:
    """What ``Engine.logprobs`` returns for a finished request (``Request.return_logprob``)."""

    input: tuple[float | None, ...]  # prompt positions logprob_start_len.. (None at position 0)
    output: tuple[float, ...]  # one per output token
    output_top: tuple[tuple[tuple[float, int], ...], ...]  # per output position, best first


@runtime_checkable
class Engine(Protocol):
    def run(self, batch: Batch) -> StepResult: ...

    def logprobs(self, req: Request) -> Logprobs:
        """Log-probabilities of ``req``'s prompt (from ``req.logprob_start_len``) and output."""
        ...
