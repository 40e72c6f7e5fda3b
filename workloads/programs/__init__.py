"""Programs: DAGs of LLM calls issued by one client, closed-loop (see ``base``).

Kinds (one module each): ``tot`` (Tree-of-Thoughts), ``judge`` (LLM-as-a-judge,
branch-solve-merge), ``longqa`` (long-document QA), ``chat`` (multi-turn chat).
Workloads of programs (the DLPM paper's §6–7): ``workloads``.
"""

from .base import (
    PROGRAMS,
    CallPlan,
    Out,
    Program,
    PromptOf,
    make_program,
    program_class,
    register_program,
)
from .chat import Chat, ChatConfig
from .judge import Judge, JudgeConfig
from .longqa import LongQA, LongQAConfig
from .tot import ToT, ToTConfig
from .workloads import (
    BASE_RATE_PER_S,
    MISBEHAVIOUR,
    SCENARIOS,
    WORKLOADS,
    ClientDemand,
    ProgramClient,
    generate_programs,
    program_demand,
    workload,
)

# Every kind module above registered itself; the paper's order.
PROGRAM_KINDS: tuple[str, ...] = ("tot", "judge", "longqa", "chat")

__all__ = [
    "BASE_RATE_PER_S",
    "MISBEHAVIOUR",
    "PROGRAMS",
    "PROGRAM_KINDS",
    "SCENARIOS",
    "WORKLOADS",
    "CallPlan",
    "Chat",
    "ChatConfig",
    "ClientDemand",
    "Judge",
    "JudgeConfig",
    "LongQA",
    "LongQAConfig",
    "Out",
    "Program",
    "ProgramClient",
    "PromptOf",
    "ToT",
    "ToTConfig",
    "generate_programs",
    "make_program",
    "program_class",
    "program_demand",
    "register_program",
    "workload",
]
