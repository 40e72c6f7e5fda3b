"""The worker's modules keep to their own state: no module reaches into a scheduler's private
attributes (``sched._x``), and no import cycle among ``worker/``'s modules (issue 32).

Both checks read the source statically (``ast``). Import edges are the module-level ones,
``if TYPE_CHECKING:`` blocks included (a cycle there is still two modules that cannot be
read apart); imports inside functions are lazy by design (the registries' loaders) and a
package ``__init__`` importing its own modules is how packages work, so neither counts.
Each check is a function of the source text, so the tests below also prove it can fail.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
WORKER = ROOT / "worker"
# Names a module gives a scheduler it was handed (the scheduler's own module uses ``self``).
SCHEDULER_NAMES = frozenset({"sched", "scheduler", "core", "worker_sched"})
# Where ``scheduler`` is SGLang's own Scheduler (the plugin patches it), not ours.
FOREIGN_SCHEDULER = ("sgl_fair.worker.sglang.",)


def module_name(path: Path) -> str:
    rel = path.relative_to(WORKER).with_suffix("")
    parts = [p for p in rel.parts if p != "__init__"]
    return ".".join(["sgl_fair.worker", *parts])


def private_reaches(source: str) -> list[str]:
    """``name._attr`` (or ``self.name._attr``) where ``name`` is a scheduler handed in."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Attribute) or not node.attr.startswith("_"):
            continue
        if node.attr.startswith("__"):
            continue
        base = node.value
        if isinstance(base, ast.Attribute) and isinstance(base.value, ast.Name):
            held = base.value.id == "self" and base.attr in SCHEDULER_NAMES
        else:
            held = isinstance(base, ast.Name) and base.id in SCHEDULER_NAMES
        if held:
            out.append(f"line {node.lineno}: {ast.unparse(node)}")
    return out


def _top_level_imports(tree: ast.Module) -> list[ast.stmt]:
    out: list[ast.stmt] = []
    todo = list(tree.body)
    while todo:
        stmt = todo.pop()
        if isinstance(stmt, (ast.Import, ast.ImportFrom)):
            out.append(stmt)
        elif isinstance(stmt, (ast.If, ast.Try)):
            todo.extend(stmt.body)
            todo.extend(getattr(stmt, "orelse", []))
            for handler in getattr(stmt, "handlers", []):
                todo.extend(handler.body)
    return out


def import_edges(name: str, source: str, modules: set[str]) -> set[str]:
    """The worker modules ``name`` imports at module level (a submodule named in a
    ``from package import x`` counts as importing it)."""
    edges = set()
    for stmt in _top_level_imports(ast.parse(source)):
        if isinstance(stmt, ast.Import):
            targets = [a.name for a in stmt.names]
        else:
            base = stmt.module or ""
            targets = [base, *(f"{base}.{a.name}" for a in stmt.names)]
        edges.update(t for t in targets if t in modules and t != name)
    if name.endswith(".__init__") or (WORKER / Path(*name.split(".")[2:]) / "__init__.py").exists():
        package = name
        edges = {e for e in edges if not e.startswith(package + ".")}  # its own modules
    return edges


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state and (found := visit(nxt)) is not None:
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)) is not None:
            return found
    return None


def worker_sources() -> dict[str, str]:
    return {module_name(p): p.read_text() for p in sorted(WORKER.rglob("*.py"))}


def import_graph(sources: dict[str, str]) -> dict[str, set[str]]:
    modules = set(sources)
    return {name: import_edges(name, src, modules) for name, src in sources.items()}


def test_no_module_reaches_into_a_schedulers_private_state():
    ours = {n: s for n, s in worker_sources().items() if not n.startswith(FOREIGN_SCHEDULER)}
    found = {name: hits for name, src in ours.items() if (hits := private_reaches(src))}
    assert not found, f"private reaches into a scheduler: {found}"


def test_no_import_cycle_in_the_worker():
    cycle = find_cycle(import_graph(worker_sources()))
    assert cycle is None, f"import cycle: {' -> '.join(cycle or [])}"


def test_the_checks_can_fail():
    """What the old scheduler split did (issue 32) is caught by both checks."""
    old_step = (
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n"
        "    from sgl_fair.worker.scheduler import Scheduler\n"
        "def step(sched):\n"
        "    sched._retract(sched._victim(sched.running))\n"
    )
    old_scheduler = "from sgl_fair.worker.select_step import step\n"
    assert len(private_reaches(old_step)) == 2
    assert private_reaches("def f(self):\n    self.core._now = 1\n")
    assert not private_reaches("def f(self):\n    self._now = 1\n    x.__class__\n")
    sources = {"sgl_fair.worker.select_step": old_step, "sgl_fair.worker.scheduler": old_scheduler}
    assert find_cycle(import_graph(sources)) is not None
    lazy = {
        **sources,
        "sgl_fair.worker.select_step": "def f():\n    import sgl_fair.worker.scheduler\n",
    }
    assert find_cycle(import_graph(lazy)) is None
