"""Tree-of-Thoughts and LLM-as-a-judge written in SGLang's frontend language.

The token-level programs (``tot``, ``judge``) fix every prompt up front; these are the same
shapes as a user would write them with ``@sgl.function``, ``fork``, ``sgl.gen`` and
``sgl.select``, run by SGLang's own interpreter against any ``/generate`` server through
:class:`~.sgl_endpoint.ClientEndpoint` (which adds the client's identity to every call)::

    ToT (branches b, depth d)               Judge (n candidates)
    header + question                       header + question
      ├─ fork(b) ─ gen thought ─ fork(b) …     ├─ fork(n) ─ gen answer         (unless given)
      │        (d levels; a leaf then:         ├─ fork(n) ─ gen critique + select verdict
      │         select verdict yes/no)         └─ list verdicts + select best candidate
      └─ list the "yes" lines (≤ 8) + select the best line + gen the final answer

HTTP ``/generate`` calls per run (``calls()``; the server counts items: a select's choices
are one call of several items)::

    ToT     gen     b + b² + … + b^d thoughts, + 1 final answer
            fork    1 + b + … + b^(d-1)   (one per inner node: commits its prompt, 1 item)
            select  b^d + 1, two calls each: the prefix (1 item), then the choices
                    (2 items per leaf verdict, up to 8 for the final pick)
    Judge   gen     2n (n with given answers)
            fork    2 (1 with given answers)
            select  n + 1, two calls each: the prefix, then the choices (3 per verdict,
                    n for the best candidate)

b=2, d=2: 20 calls (27 items); n=3: 16 calls (24 items). Temperature 0 by default, so a run
is a function of its seed (the question, and for ``given_answers`` the candidates).

Run ``python -m sgl_fair.workloads.programs.sgl_frontend --url URL --program tot|judge
--client alice --num 3 [--api-key K]``: ``--num`` runs go through ``run_batch`` on
``--num-threads`` threads; a short line per run, then the calls the client made.
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple, NoReturn

import sglang as sgl

from .program_config import check_int
from .questions import context_for, question_for
from .sgl_endpoint import CallLog, ClientEndpoint, FrontendCallError, requests_by_kind

PROG = "python -m sgl_fair.workloads.programs.sgl_frontend"
MAX_FINAL_CHOICES = 8  # lines the final ToT pick chooses among (a bounded prompt)
MAX_LEAVES = 1024


class ProgramFailed(RuntimeError):
    """A program could not finish (message: the first failed call, or what went wrong)."""


def _check(state: Any) -> None:
    """Raise if ``state``'s executor failed. Needed before giving a state more work: a failed
    executor's thread has stopped, and what is submitted to it then would wait forever."""
    err = state.error()
    if err is not None:
        raise ProgramFailed(str(err)) from None


def _value(state: Any, name: str) -> str:
    try:
        return state[name]
    except KeyError:  # the executor failed before producing it
        raise ProgramFailed(f"{name!r} not produced: {state.error()}") from None


def _committed(s: Any) -> None:
    """``fork`` commits the shared prefix (a ``max_new_tokens`` 0 call, so the branches find
    it cached) only if the text has already reached the state, which fills it on its own
    thread: wait for it, so every run makes the same calls."""
    s.sync()
    _check(s)


# ---------------------------------------------------------------------------------------------
# Tree-of-Thoughts

TOT_HEADER = (
    "You solve grade-school math word problems by exploring several lines of reasoning, a tree "
    "of thoughts: every step proposes one short reasoning step that continues the line above "
    "it. A reviewer then says whether each line is on track, the most promising line is "
    "chosen, and it gives the final answer as a number.\n\n"
)


class ToTResult(NamedTuple):
    question: str
    lines: list[list[str]]  # per leaf, its thoughts from the root down
    verdicts: list[str]  # per leaf, "yes" or "no"
    shortlist: list[int]  # leaves the final pick chose among
    best: int  # the chosen leaf
    answer: str

    def summary(self) -> str:
        yes = sum(v == "yes" for v in self.verdicts)
        line = " / ".join(self.lines[self.best])
        return (
            f"{len(self.verdicts)} lines ({yes} on track), best ({self.best + 1}): "
            f"{_short(line, 70)!r}; answer: {_short(self.answer, 40)!r}"
        )


@sgl.function
def tree_of_thoughts(s, question, branches=2, depth=2, max_tokens=32, context=""):
    s += TOT_HEADER + context + "Question: " + question + "\n"
    _committed(s)
    paths: list[list[Any]] = [[s]]  # root, then one state per level down to a leaf
    for level in range(1, depth + 1):
        grown = []
        for path in paths:
            _check(path[-1])
            forks = path[-1].fork(branches)
            _check(path[-1])  # its fork commit
            for i, f in enumerate(forks):
                step = f"Step {level}, idea {i + 1}:"
                step += sgl.gen("thought", max_tokens=max_tokens, stop="\n") + "\n"
                if level == depth:  # one submission per state: see _check
                    step += "Is this line of reasoning on track? Answer: "
                    step += sgl.select("verdict", choices=["yes", "no"])
                f += step
                grown.append([*path, f])
        paths = grown
    lines = [[_value(st, "thought").strip() for st in p[1:]] for p in paths]
    verdicts = [_value(p[-1], "verdict") for p in paths]
    shortlist = [k for k, v in enumerate(verdicts) if v == "yes"] or list(range(len(paths)))
    shortlist = shortlist[:MAX_FINAL_CHOICES]
    final = "Lines of reasoning under consideration:\n"
    final += "".join(f"({k + 1}) " + " / ".join(lines[k]) + "\n" for k in shortlist)
    final += "The most promising line is ("
    final += sgl.select("best", choices=[str(k + 1) for k in shortlist]) + ").\nFinal answer:"
    final += sgl.gen("answer", max_tokens=max_tokens, stop="\n")
    _check(s)
    s += final
    best = int(_value(s, "best")) - 1
    return ToTResult(question, lines, verdicts, shortlist, best, _value(s, "answer").strip())


@dataclass(frozen=True)
class ToTProgram:
    """Tree-of-Thoughts: ``branches`` thoughts per node for ``depth`` levels, ``max_tokens``
    per generation; ``context_words`` of pasted background before the question."""

    kind: ClassVar[str] = "tot"
    branches: int = 2
    depth: int = 2
    max_tokens: int = 32
    context_words: int = 0

    def __post_init__(self) -> None:
        check_int(self, "branches", minimum=1, maximum=64)
        check_int(self, "depth", minimum=1, maximum=16)
        check_int(self, "max_tokens", minimum=1)
        check_int(self, "context_words", minimum=0)
        if self.num_leaves > MAX_LEAVES:
            raise ValueError(
                f"ToTProgram: branches {self.branches} with depth {self.depth} makes "
                f"{self.num_leaves} leaves (more than {MAX_LEAVES})"
            )

    @property
    def function(self) -> Any:
        return tree_of_thoughts

    @property
    def num_leaves(self) -> int:
        return self.branches**self.depth

    def arguments(self, seed: int) -> dict[str, Any]:
        return {
            "question": question_for(seed).text,
            "branches": self.branches,
            "depth": self.depth,
            "max_tokens": self.max_tokens,
            "context": context_for(seed, self.context_words),
        }

    def calls(self) -> Counter[str]:
        """HTTP ``/generate`` calls of one run, by the kind the endpoint records."""
        b, d = self.branches, self.depth
        return Counter(
            {
                "gen": sum(b**k for k in range(1, d + 1)) + 1,
                "fork": sum(b**k for k in range(d)) if b > 1 else 0,
                "select.prefix": self.num_leaves + 1,
                "select.choices": self.num_leaves + 1,
            }
        )


# ---------------------------------------------------------------------------------------------
# LLM-as-a-judge

JUDGE_HEADER = (
    "You are an impartial grader of answers to grade-school math word problems. For each "
    "candidate answer you write a one-line critique that checks the arithmetic, then give a "
    "verdict: correct, partially correct or incorrect. Finally you name the best candidate.\n\n"
)
VERDICTS = ("correct", "partially correct", "incorrect")
VERDICT_SCORE = {"correct": 2, "partially correct": 1, "incorrect": 0}


class JudgeResult(NamedTuple):
    question: str
    answers: list[str]
    critiques: list[str]
    verdicts: list[str]
    score: int  # sum of VERDICT_SCORE over the candidates
    best: int  # the candidate the judge picked

    def summary(self) -> str:
        counts = Counter(self.verdicts)
        said = ", ".join(f"{counts[v]} {v}" for v in VERDICTS if counts[v])
        return (
            f"{len(self.answers)} candidates ({said}), best ({self.best + 1}): "
            f"{_short(self.answers[self.best], 60)!r}"
        )


@sgl.function
def llm_judge(s, question, answers=None, num_candidates=3, max_tokens=32, context=""):
    s += JUDGE_HEADER + context + "Question: " + question + "\n"
    _committed(s)
    if answers is None:  # generate the candidates, each on its own branch
        cands = s.fork(num_candidates)
        _check(s)
        for i, c in enumerate(cands):
            c += f"Candidate answer {i + 1}:" + sgl.gen("answer", max_tokens=max_tokens, stop="\n")
        answers = [_value(c, "answer").strip() for c in cands]
    _check(s)
    judges = s.fork(len(answers))
    _check(s)
    for i, (j, answer) in enumerate(zip(judges, answers, strict=True)):
        j += (
            f"Candidate answer {i + 1}: {answer}\nCritique:"
            + sgl.gen("critique", max_tokens=max_tokens, stop="\n")
            + "\nVerdict: "
            + sgl.select("verdict", choices=list(VERDICTS))
        )
    critiques = [_value(j, "critique").strip() for j in judges]
    verdicts = [_value(j, "verdict") for j in judges]
    final = "Verdicts:\n" + "".join(f"({i + 1}) {v}\n" for i, v in enumerate(verdicts))
    final += "The best candidate is ("
    final += sgl.select("best", choices=[str(i + 1) for i in range(len(answers))]) + ")."
    _check(s)
    s += final
    score = sum(VERDICT_SCORE[v] for v in verdicts)
    best = int(_value(s, "best")) - 1
    return JudgeResult(question, list(answers), critiques, verdicts, score, best)


@dataclass(frozen=True)
class JudgeProgram:
    """LLM-as-a-judge over ``num_candidates`` answers (generated, or with ``given_answers``
    the built-in ones, cycled), ``max_tokens`` per generation; ``context_words`` of pasted
    background before the question."""

    kind: ClassVar[str] = "judge"
    num_candidates: int = 3
    max_tokens: int = 32
    given_answers: bool = False
    context_words: int = 0

    def __post_init__(self) -> None:
        check_int(self, "num_candidates", minimum=1, maximum=256)
        check_int(self, "max_tokens", minimum=1)
        check_int(self, "context_words", minimum=0)
        object.__setattr__(self, "given_answers", bool(self.given_answers))

    @property
    def function(self) -> Any:
        return llm_judge

    def arguments(self, seed: int) -> dict[str, Any]:
        q = question_for(seed)
        answers = None
        if self.given_answers:
            answers = [q.candidates[i % len(q.candidates)] for i in range(self.num_candidates)]
        return {
            "question": q.text,
            "answers": answers,
            "num_candidates": self.num_candidates,
            "max_tokens": self.max_tokens,
            "context": context_for(seed, self.context_words),
        }

    def calls(self) -> Counter[str]:
        n, given = self.num_candidates, self.given_answers
        forks = (0 if given or n == 1 else 1) + (1 if n > 1 else 0)
        return Counter(
            {
                "gen": n if given else 2 * n,
                "fork": forks,
                "select.prefix": n + 1,
                "select.choices": n + 1,
            }
        )


FRONTEND_PROGRAMS: dict[str, type[ToTProgram] | type[JudgeProgram]] = {
    "tot": ToTProgram,
    "judge": JudgeProgram,
}
FrontendProgram = ToTProgram | JudgeProgram


def make_frontend_program(kind: str, **params: Any) -> FrontendProgram:
    """The program ``kind`` with ``params`` (its fields); ValueError naming what is wrong."""
    cls = FRONTEND_PROGRAMS.get(kind)
    if cls is None:
        known = ", ".join(FRONTEND_PROGRAMS)
        raise ValueError(f"unknown frontend program {kind!r} (known: {known})")
    try:
        return cls(**params)
    except TypeError:
        fields = ", ".join(f for f in cls.__dataclass_fields__ if f != "kind")
        bad = ", ".join(sorted(set(params) - set(cls.__dataclass_fields__)))
        raise ValueError(f"{kind}: unknown parameter {bad} (known: {fields})") from None


def run_program(program: FrontendProgram, backend: Any, seed: int, *, temperature: float = 0.0):
    """One run on ``backend``; the result, or ProgramFailed naming the first failure."""
    state = program.function.run(
        **program.arguments(seed), backend=backend, temperature=temperature
    )
    _check(state)
    return state.ret_value


def run_programs(
    program: FrontendProgram,
    backend: Any,
    seeds: Sequence[int],
    *,
    num_threads: int | str = "auto",
    temperature: float = 0.0,
) -> list[Any]:
    """One run per seed through ``run_batch`` (SGLang caches the programs' shared prefix
    first, then runs them on ``num_threads`` threads); the results in seed order."""
    if len(seeds) == 1:
        return [run_program(program, backend, seeds[0], temperature=temperature)]
    states = program.function.run_batch(
        [program.arguments(seed) for seed in seeds],
        backend=backend,
        temperature=temperature,
        num_threads=num_threads,
    )
    for state in states:
        _check(state)
    return [state.ret_value for state in states]


def _counts(counts: Counter[str]) -> str:
    return ", ".join(f"{k} {n}" for k, n in sorted(counts.items()))


def _short(text: str, n: int) -> str:
    return text if len(text) <= n else text[: n - 1] + "…"


# ---------------------------------------------------------------------------------------------
# CLI


class _UsageError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise _UsageError(message)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog=PROG, description="Run SGLang frontend programs as one client.")
    p.add_argument("--url", required=True, help="server base URL, e.g. http://127.0.0.1:30000")
    p.add_argument("--program", required=True, choices=sorted(FRONTEND_PROGRAMS))
    p.add_argument("--client", required=True, help="client id (X-Client-Id, routing_key)")
    p.add_argument("--api-key", default=None, help="sent as Authorization: Bearer")
    p.add_argument("--num", type=int, default=1, help="runs (seeds seed .. seed+num-1)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-threads", type=int, default=16, help="run_batch threads")
    p.add_argument("--branches", type=int, default=None, help="tot")
    p.add_argument("--depth", type=int, default=None, help="tot")
    p.add_argument("--num-candidates", type=int, default=None, help="judge")
    p.add_argument("--given-answers", action="store_true", help="judge: built-in candidates")
    p.add_argument("--max-tokens", type=int, default=None)
    p.add_argument("--context-words", type=int, default=None)
    p.add_argument("--timeout", type=float, default=120.0, help="per call, seconds")
    return p


def _program_from_args(args: argparse.Namespace) -> FrontendProgram:
    names = ("branches", "depth", "num_candidates", "max_tokens", "context_words")
    params = {k: getattr(args, k) for k in names if getattr(args, k) is not None}
    if args.given_answers:
        params["given_answers"] = True
    try:
        return make_frontend_program(args.program, **params)
    except ValueError as e:
        raise _UsageError(str(e)) from None


def main(argv: Sequence[str] | None = None) -> int:
    """0: every run finished; 1: a run failed; 2: bad flags or an unreachable server."""
    try:
        args = build_parser().parse_args(argv)
        program = _program_from_args(args)
        if args.num < 1 or args.seed < 0 or args.num_threads < 1 or not args.timeout > 0:
            raise _UsageError("--num, --num-threads and --timeout must be > 0, --seed >= 0")
        log = CallLog()
        try:
            endpoint = ClientEndpoint(
                args.url, args.client, api_key=args.api_key, timeout_s=args.timeout, log=log
            )
        except FrontendCallError as e:
            raise _UsageError(f"cannot reach the server: {e}") from None
    except _UsageError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    # Failed calls are reported below; SGLang's executor would also print each traceback.
    warnings.filterwarnings("ignore", message="Error in stream_executor")
    seeds = list(range(args.seed, args.seed + args.num))
    t0 = time.monotonic()
    status = 0
    try:
        results = run_programs(program, endpoint, seeds, num_threads=args.num_threads)
    except (ProgramFailed, FrontendCallError) as e:
        print(f"{PROG}: {program.kind} failed: {e}", file=sys.stderr)
        results, status = [], 1
    took = time.monotonic() - t0
    for seed, result in zip(seeds, results, strict=False):
        print(f"{program.kind} seed {seed}: {result.summary()}")
    calls = log.close()
    by_kind = requests_by_kind(calls)
    failed = sum(c.state == "failed" for c in calls)
    print(
        f"client {args.client}: {by_kind.total()} /generate calls ({_counts(by_kind)}), "
        f"{len(calls)} prompts, {failed} failed, in {took:.2f} s; "
        f"per run: {_counts(program.calls())}"
    )
    return status


if __name__ == "__main__":
    sys.exit(main())
