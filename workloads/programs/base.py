"""A program: a DAG of LLM calls issued by one client, closed-loop.

A program is fixed at construction as call plans (:class:`CallPlan`) in topological order. A
call's prompt is a sequence of *parts*: literal token ids (drawn when the program is built),
:class:`Out` (a parent's output) or :class:`PromptOf` (a parent's prompt). Output lengths
are fixed up front, so every prompt length, and so ``num_calls`` and the token demand, is
known before anything runs; only the output *tokens* come from the engine::

    parent:  prompt_p = [literal ...]                      -> output_p
    child:   prompt_c = PromptOf(p) + Out(p) + [literal]   -> prompt_p + output_p + instruction

The driver (the cluster simulator, or a test) plays the protocol::

    ready = program.start(now)                   # root calls
    ... a call finishes (req.output_ids filled) ...
    ready += program.on_finished(req, now)       # calls whose parents have all finished
    ... or is rejected/aborted ...
    program.on_failed(req, now)                  # the program stops issuing calls

A returned call may carry ``arrival_s > now`` (a chat user's think time): the driver must
hold it until then. ``arrival_s`` is never before the finish of any of its parents.

Request fields: ``rid = f"{program_id}/{node}"``, ``interaction_id = program_id``,
``app = kind``, ``stage`` = the call's depth in the DAG (roots 0, else 1 + the deepest
parent), ``max_new_tokens = output_len``.

Token ids: prompts use the vocabulary range ``[0, VOCAB_SIZE)``; the simulator's outputs are
``>= 2**30``, so an output never continues a prompt by accident. Where a shape implies that
two prompts diverge (siblings' instructions, Judge's dimensions, LongQA's questions), their
first diverging literal tokens are drawn distinct, so prompts share exactly what the shape
implies, never one lucky token more.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from sgl_fair.registry import Registry
from sgl_fair.request import Request

from ..traces import DEFAULT_VOCAB_SIZE, group_tokens

VOCAB_SIZE = DEFAULT_VOCAB_SIZE
Tokens = tuple[int, ...]


@dataclass(frozen=True)
class Out:
    """Prompt part: the output of call ``node`` (a parent)."""

    node: str


@dataclass(frozen=True)
class PromptOf:
    """Prompt part: the whole prompt of call ``node`` (a parent)."""

    node: str


Part = Tokens | Out | PromptOf


@dataclass(frozen=True)
class CallPlan:
    """One call of a program. ``delay_s``: issued this long after its last parent finished."""

    node: str
    parents: tuple[str, ...]
    parts: tuple[Part, ...]
    output_len: int
    delay_s: float = 0.0


class Program:
    """One program instance. Subclasses build the plan; this class plays the protocol."""

    kind: ClassVar[str] = ""

    def __init__(
        self,
        program_id: str,
        client: str,
        *,
        start_s: float,
        well_behaved: bool,
        calls: Sequence[CallPlan],
    ) -> None:
        if not isinstance(program_id, str) or not program_id:
            raise ValueError("program: field 'program_id' must be a non-empty string")
        if not isinstance(client, str) or not client:
            raise ValueError(f"program {program_id!r}: field 'client' must be a non-empty string")
        if not (isinstance(start_s, (int, float)) and math.isfinite(start_s) and start_s >= 0):
            raise ValueError(f"program {program_id!r}: field 'start_s' must be a number >= 0")
        self.program_id = program_id
        self.client = client
        self.start_s = float(start_s)
        self.well_behaved = bool(well_behaved)
        self.calls: tuple[CallPlan, ...] = tuple(calls)
        self._plans: dict[str, CallPlan] = {}
        self._stages: dict[str, int] = {}
        self._input_lens: dict[str, int] = {}
        self._children: dict[str, list[str]] = {}
        for plan in self.calls:
            self._add_plan(plan)
        if not self.calls:
            raise ValueError(f"program {program_id!r}: a program needs at least one call")

        self._started = False
        self._failed = False
        self._num_issued = 0
        self._num_waiting = {p.node: len(p.parents) for p in self.calls}  # parents unfinished
        self._num_unissued_children = {n: len(c) for n, c in self._children.items()}
        self._in_flight: dict[str, Request] = {}  # issued, neither finished nor failed
        self._finish_s: dict[str, float] = {}
        self._failed_nodes: set[str] = set()
        self._last_event_s: float | None = None
        # A call's prompt and output, kept only while a child still needs them.
        self._prompts: dict[str, Tokens] = {}
        self._outputs: dict[str, Tokens] = {}

    def _add_plan(self, plan: CallPlan) -> None:
        where = f"program {self.program_id!r} call {plan.node!r}"
        if plan.node in self._plans:
            raise ValueError(f"{where}: duplicate node")
        if plan.output_len < 1 or plan.delay_s < 0:
            raise ValueError(f"{where}: output_len must be >= 1 and delay_s >= 0")
        for p in plan.parents:
            if p not in self._plans:
                raise ValueError(f"{where}: parent {p!r} must come earlier in the plan")
        input_len = 0
        for part in plan.parts:
            if isinstance(part, (Out, PromptOf)):
                if part.node not in plan.parents:
                    raise ValueError(f"{where}: part refers to {part.node!r}, not a parent")
                ref = self._plans[part.node]
                input_len += ref.output_len if isinstance(part, Out) else self._input_lens[ref.node]
            else:
                input_len += len(part)
        if input_len < 1:
            raise ValueError(f"{where}: empty prompt")
        self._plans[plan.node] = plan
        self._input_lens[plan.node] = input_len
        self._stages[plan.node] = 1 + max((self._stages[p] for p in plan.parents), default=-1)
        self._children[plan.node] = []
        for p in plan.parents:
            self._children[p].append(plan.node)

    # ---- what the program is ------------------------------------------------------------

    @property
    def num_calls(self) -> int:
        return len(self.calls)

    @property
    def num_issued(self) -> int:
        return self._num_issued

    @property
    def num_finished(self) -> int:
        return len(self._finish_s)

    @property
    def failed(self) -> bool:
        return self._failed

    @property
    def done(self) -> bool:
        """Every issued call finished or failed, and nothing more will be issued."""
        if self._in_flight or not self._started:
            return False
        return self._failed or len(self._finish_s) == self.num_calls

    @property
    def finish_s(self) -> float | None:
        """When the program became done (its last call finished or failed); None before."""
        return self._last_event_s if self.done else None

    def input_len(self, node: str) -> int:
        return self._input_lens[node]

    def stage(self, node: str) -> int:
        return self._stages[node]

    def rid(self, node: str) -> str:
        return f"{self.program_id}/{node}"

    @property
    def input_tokens(self) -> int:
        """Prompt tokens over all calls (counting shared prefixes once per call)."""
        return sum(self._input_lens.values())

    @property
    def output_tokens(self) -> int:
        return sum(p.output_len for p in self.calls)

    def check_invariants(self) -> None:
        """Bookkeeping is consistent; tests call it after every operation."""
        issued = {*self._in_flight, *self._finish_s, *self._failed_nodes}
        assert len(issued) == self._num_issued <= self.num_calls
        assert len(self._in_flight) + len(self._finish_s) + len(self._failed_nodes) == len(issued)
        assert self._failed == bool(self._failed_nodes)
        for node in issued:  # issued only once every parent finished
            assert all(p in self._finish_s for p in self._plans[node].parents), node
        for node, plan in self._plans.items():
            unissued = sum(c not in issued for c in self._children[node])
            assert self._num_unissued_children[node] == unissued, node
            assert self._num_waiting[node] == sum(p not in self._finish_s for p in plan.parents)
        # Parts are kept only while a child still needs them (and never after a failure).
        assert all(self._num_unissued_children[n] for n in (*self._prompts, *self._outputs))
        assert set(self._outputs) <= set(self._finish_s) and set(self._prompts) <= issued
        assert not (self._failed and (self._prompts or self._outputs))

    # ---- the protocol ---------------------------------------------------------------------

    def start(self, now: float) -> list[Request]:
        """The root calls, arriving at ``now``."""
        if self._started:
            raise RuntimeError(f"program {self.program_id!r} started twice")
        self._started = True
        self._last_event_s = now
        return [self._issue(p, now) for p in self.calls if not p.parents]

    def on_finished(self, req: Request, now: float) -> list[Request]:
        """``req`` finished with its output in ``req.output_ids``: the calls now ready."""
        node = self._own_node(req)
        if len(req.output_ids) != req.output_len:
            raise ValueError(
                f"request {req.rid!r} finished with {len(req.output_ids)} of "
                f"{req.output_len} output tokens"
            )
        del self._in_flight[node]
        self._finish_s[node] = now
        self._last_event_s = now
        children = self._children[node]
        for child in children:
            self._num_waiting[child] -= 1
        if self._failed:
            return []
        if self._num_unissued_children[node]:
            self._outputs[node] = tuple(req.output_ids)
        ready = [c for c in children if self._num_waiting[c] == 0]
        return [self._issue(self._plans[c], now) for c in ready]

    def on_failed(self, req: Request, now: float) -> None:
        """``req`` was rejected or aborted: the program issues no further calls."""
        node = self._own_node(req)
        del self._in_flight[node]
        self._failed_nodes.add(node)
        self._prompts.clear()  # nothing more will be issued
        self._outputs.clear()
        self._failed = True
        self._last_event_s = now

    def _own_node(self, req: Request) -> str:
        # By rid and prompt rather than identity: a live driver may hand back a copy that
        # travelled over the wire.
        prefix = f"{self.program_id}/"
        node = req.rid[len(prefix) :] if req.rid.startswith(prefix) else ""
        if node in self._finish_s or node in self._failed_nodes:
            raise ValueError(f"request {req.rid!r} already finished or failed")
        issued = self._in_flight.get(node)
        if issued is None or (issued is not req and issued.input_ids != req.input_ids):
            raise ValueError(f"request {req.rid!r} is not a call of program {self.program_id!r}")
        return node

    def _issue(self, plan: CallPlan, now: float) -> Request:
        prompt = self._build_prompt(plan)
        if self._num_unissued_children[plan.node]:
            self._prompts[plan.node] = prompt
        for parent in plan.parents:
            self._num_unissued_children[parent] -= 1
            if self._num_unissued_children[parent] == 0:  # its last child: free the parts
                self._prompts.pop(parent, None)
                self._outputs.pop(parent, None)
        req = Request(
            rid=self.rid(plan.node),
            client=self.client,
            input_ids=prompt,
            output_len=plan.output_len,
            arrival_s=now + plan.delay_s,
            max_new_tokens=plan.output_len,
            interaction_id=self.program_id,
            app=self.kind,
            stage=self._stages[plan.node],
        )
        self._in_flight[plan.node] = req
        self._num_issued += 1
        return req

    def _build_prompt(self, plan: CallPlan) -> Tokens:
        pieces: list[Tokens] = []
        for part in plan.parts:
            if isinstance(part, Out):
                pieces.append(self._outputs[part.node])
            elif isinstance(part, PromptOf):
                pieces.append(self._prompts[part.node])
            else:
                pieces.append(part)
        return tuple(itertools.chain.from_iterable(pieces))

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}({self.program_id!r}, client={self.client!r}, "
            f"calls={self.num_issued}/{self.num_calls}, done={self.done})"
        )


# ---------------------------------------------------------------------------------------------
# Helpers for the program kinds


class GeneratedProgram(Program):
    """A program drawn from a frozen ``Config`` and a seed, as every built-in kind is.

    Construction is shared here (the config default, three independent random streams — see
    :func:`program_rngs` — and the client's shared header seed); a kind implements ``plan``,
    which returns its calls in topological order. A kind whose calls all extend one context
    (a :class:`ProgramConfig`: the client's header, then the program's own text) opens its
    plan with :meth:`draw_context`.
    """

    Config: ClassVar[type]

    def __init__(
        self,
        program_id: str,
        client: str,
        *,
        start_s: float,
        seed: int,
        well_behaved: bool = True,
        shared_seed: int = 0,
        config: Any = None,
    ) -> None:
        self.config = config if config is not None else self.Config()
        calls = self.plan(self.config, client, program_rngs(seed, 3), shared_seed)
        super().__init__(
            program_id, client, start_s=start_s, well_behaved=well_behaved, calls=calls
        )

    def plan(
        self, cfg: Any, client: str, rngs: Sequence[np.random.Generator], shared_seed: int
    ) -> list[CallPlan]:
        raise NotImplementedError

    def draw_context(
        self, client: str, shared_seed: int, *runs: tuple[np.random.Generator, int]
    ) -> Tokens:
        """The context every call starts with: the client's header (``config.header_len``
        tokens, the same in all its programs of this kind), then one run of fresh tokens per
        ``(stream, length)`` in ``runs`` (an extra prefix; the question, article or document)."""
        header = shared_tokens(self.kind, client, self.config.header_len, shared_seed=shared_seed)
        return header + tuple(itertools.chain.from_iterable(draw_tokens(r, n) for r, n in runs))


def draw_tokens(rng: np.random.Generator, n: int) -> Tokens:
    return tuple(rng.integers(0, VOCAB_SIZE, n, dtype=np.int64).tolist())


def draw_diverging(rng: np.random.Generator, lens: Sequence[int]) -> list[Tokens]:
    """Token runs, one per length, whose first tokens are pairwise distinct (siblings)."""
    heads = rng.choice(VOCAB_SIZE, size=len(lens), replace=False).tolist()
    return [(head, *draw_tokens(rng, n - 1)) for head, n in zip(heads, lens, strict=True)]


def shared_tokens(kind: str, client: str, length: int, *, shared_seed: int) -> Tokens:
    """A client's header for a program kind (system prompt, few-shot text, judge rubric): the
    same for every program of that client and kind, so programs share it across the cache."""
    return _shared_tokens(kind, client, length, shared_seed)


@functools.lru_cache(maxsize=1024)  # a pure function: the cache only saves the redraw
def _shared_tokens(kind: str, client: str, length: int, shared_seed: int) -> Tokens:
    return tuple(group_tokens(f"{kind}/{client}/header", length, seed=shared_seed).tolist())


def program_rngs(seed: int, num: int) -> list[np.random.Generator]:
    """Independent streams of one program: changing what one stream draws (e.g. an S2 extra
    prefix) leaves the others, so a variant shares every other draw with the original."""
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValueError(f"program: field 'seed' must be an integer >= 0 (got {seed!r})")
    return [np.random.default_rng([int(seed), stream]) for stream in range(num)]


# ---------------------------------------------------------------------------------------------
# Registry


# Program kinds by name; ``cls.kind`` is set by the decorator.
PROGRAMS = Registry("program kind", attr="kind")


def register_program(kind: str) -> Callable[[type[Program]], type[Program]]:
    return PROGRAMS.register(kind)


def make_config(kind: str, params: dict[str, Any]) -> Any:
    """The kind's frozen config from ``params``; ValueError naming an unknown field."""
    return PROGRAMS.config(kind, **params)


def program_class(kind: str) -> type[Program]:
    return PROGRAMS.get(kind)


def make_program(
    kind: str,
    program_id: str,
    client: str,
    *,
    start_s: float,
    seed: int,
    well_behaved: bool = True,
    shared_seed: int = 0,
    **params: Any,
) -> Program:
    """A program of ``kind`` with config ``params`` (the kind's ``Config`` fields).

    ``seed`` draws everything particular to this program; ``shared_seed`` the client's header
    that all its programs of this kind share.
    """
    config = make_config(kind, params)
    return program_class(kind)(
        program_id,
        client,
        start_s=start_s,
        seed=seed,
        well_behaved=well_behaved,
        shared_seed=shared_seed,
        config=config,
    )
