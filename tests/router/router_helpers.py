"""Shared helpers for the router tests: a naive model of who holds what, request builders.

The model of the global tree is, per worker, the set of token strings it holds, closed
under prefixes (``()`` included). A worker holds ``s`` iff the tree credits it with every
token of ``s``; so matches, eviction reports and dead workers are plain set operations.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable

from sgl_fair.messages import Finished, FinishReason
from sgl_fair.request import Request
from sgl_fair.router.global_tree import GlobalMatch, GlobalTree

Held = dict[int, set[tuple[int, ...]]]

_rids = itertools.count()


def prefixes(tokens: tuple[int, ...]) -> set[tuple[int, ...]]:
    return {tokens[:i] for i in range(len(tokens) + 1)}


def longest_prefix(model: set[tuple[int, ...]], tokens: tuple[int, ...]) -> int:
    length = 0
    while length < len(tokens) and tokens[: length + 1] in model:
        length += 1
    return length


def model_match(held: Held, tokens: tuple[int, ...]) -> GlobalMatch:
    per_worker = {u: n for u, strings in held.items() if (n := longest_prefix(strings, tokens))}
    length = max(per_worker.values(), default=0)
    holders = frozenset(u for u, n in per_worker.items() if n == length)
    return GlobalMatch(length, holders, per_worker)


def model_evict(held: Held, worker: int, path: tuple[int, ...], start: int) -> None:
    """``worker`` no longer holds ``path[start:]`` nor anything below it."""
    branch = path[: start + 1]
    if worker in held and len(branch) == start + 1:
        held[worker] -= {p for p in held[worker] if len(p) > start and p[: start + 1] == branch}


def tree_holdings(tree: GlobalTree) -> Held:
    """What the tree credits each worker with, as prefix-closed string sets."""
    held: Held = {}
    stack = [((), tree.tree.root)]
    while stack:
        prefix, node = stack.pop()
        for child in node.children.values():
            for i in range(1, len(child.key) + 1):
                for u in child.owners:
                    held.setdefault(u, {()}).add(prefix + child.key[:i])
            stack.append((prefix + child.key, child))
    return held


def nonempty(held: Held) -> Held:
    """Drop workers holding nothing (the model keeps them as ``{()}``)."""
    return {u: s for u, s in held.items() if len(s) > 1}


def tree_strings(tree: GlobalTree) -> set[tuple[int, ...]]:
    return set().union(*tree_holdings(tree).values()) - {()} if tree.total_tokens else set()


def make_req(tokens: Iterable[int], client: str = "c", *, output_len: int = 4) -> Request:
    return Request(f"r{next(_rids)}", client, tuple(tokens), output_len, 0.0)


def finished(
    worker: int,
    req: Request,
    output: Iterable[int] = (),
    *,
    t_s: float = 0.0,
    reason: FinishReason = FinishReason.LENGTH,
) -> Finished:
    return Finished(worker, t_s, req.rid, req.client, reason, req.input_ids, tuple(output), 0, None)
