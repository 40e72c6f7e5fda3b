"""The layers import downward only, and source files stay small.

::

    apps/      sgl_fair.launch, .loadtest, .experiment, .demo     command-line apps   (layer 2)
       │ may import everything below
    router/  worker/  workloads/                                  services            (layer 1)
       │ may import the kernels and the core — never each other
    kernels/                                                      torch/triton kernels (layer ½)
       │ may import the core only (the worker's torch engine uses them)
    sgl_fair/                                                     the pure core       (layer 0)
         imports nothing above it

The check reads every source file's imports statically (``ast``), including imports inside
functions, so a lazy ``from sgl_fair.worker import ...`` in the router is caught too.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# folder -> the import name it installs as (pyproject.toml's package-dir)
PACKAGES = {
    "sgl_fair": "sgl_fair",
    "router": "sgl_fair.router",
    "worker": "sgl_fair.worker",
    "workloads": "sgl_fair.workloads",
    "kernels": "sgl_fair.kernels",
    "apps/launch": "sgl_fair.launch",
    "apps/loadtest": "sgl_fair.loadtest",
    "apps/experiment": "sgl_fair.experiment",
    "apps/demo": "sgl_fair.demo",
}
SERVICES = ("router", "worker", "workloads")
LIBS = ("kernels",)
APPS = ("launch", "loadtest", "experiment", "demo")


def layer_of(module: str) -> tuple[int, str] | None:
    """(rank, name) of the layer a dotted module belongs to; None outside the project."""
    parts = module.split(".")
    if parts[0] != "sgl_fair":
        return None
    sub = parts[1] if len(parts) > 1 else ""
    if sub in APPS:
        return 2, sub
    if sub in SERVICES:
        return 1, sub
    if sub in LIBS:
        return 0.5, sub
    return 0, "core"


def source_modules() -> list[tuple[Path, str]]:
    out = []
    for folder, package in PACKAGES.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT / folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            out.append((path, ".".join([package, *parts])))
    return out


def imported_modules(path: Path, module: str) -> list[tuple[int, str]]:
    """(line, absolute module) of every import in the file, relative ones resolved."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            found.append((node.lineno, target))
            # `from sgl_fair import launch` imports the submodule sgl_fair.launch
            found += [(node.lineno, f"{target}.{alias.name}") for alias in node.names]
    return found


def violations(path: Path, module: str) -> list[str]:
    src = layer_of(module)
    assert src is not None
    bad = []
    for line, target in imported_modules(path, module):
        dst = layer_of(target)
        if dst is None or dst == src:
            continue
        upward = dst[0] > src[0]
        sideways = dst[0] == src[0] and dst[0] == 1  # router <-> worker <-> workloads
        if upward or sideways:
            rel = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name
            bad.append(f"{rel}:{line}: {src[1]} (layer {src[0]}) imports {target} ({dst[1]})")
    return bad


def test_layers_import_downward_only():
    bad = [v for path, module in source_modules() for v in violations(path, module)]
    assert not bad, "imports against the layering:\n" + "\n".join(bad)


def test_walks_every_layer():
    """The check really covers the tree: each layer has modules in it."""
    layers = {layer_of(module)[1] for _, module in source_modules()}
    assert layers >= {"core", *LIBS, *SERVICES, *APPS}


@pytest.mark.parametrize(
    ("module", "source", "expect_bad"),
    [
        ("sgl_fair.router.server", "from sgl_fair.worker.live import X\n", True),
        ("sgl_fair.router.server", "def f():\n    from sgl_fair.launch import X\n", True),
        ("sgl_fair.radix", "import sgl_fair.router.router\n", True),
        ("sgl_fair.radix", "from sgl_fair import launch\n", True),
        ("sgl_fair.worker.live", "from ..router import transport\n", True),
        ("sgl_fair.worker.live", "from sgl_fair.transport import X\n", False),
        ("sgl_fair.launch.serve", "from sgl_fair.worker.live import X\n", False),
        ("sgl_fair.launch.serve", "from sgl_fair.experiment import X\n", False),
        ("sgl_fair.worker.torch.engine", "from sgl_fair.kernels import reference\n", False),
        ("sgl_fair.kernels.reference", "from sgl_fair.worker.engine import Batch\n", True),
        ("sgl_fair.radix", "import sgl_fair.kernels.reference\n", True),
    ],
)
def test_check_catches_upward_and_sideways_imports(tmp_path, module, source, expect_bad):
    """The check can fail: an upward or sideways import is reported."""
    probe = tmp_path / "probe.py"  # not an __init__: relative imports start at its package
    probe.write_text(source)
    found = violations(probe, module)
    assert bool(found) is expect_bad, found


# Files allowed past the size rule: none today. Data tables would go here, with a reason.
MAX_LINES = 500
SIZE_EXEMPT: dict[str, str] = {}


def test_source_files_stay_small():
    big = []
    for folder in [*PACKAGES, "bench"]:
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = str(path.relative_to(ROOT))
            num_lines = len(path.read_text().splitlines())
            if num_lines > MAX_LINES and rel not in SIZE_EXEMPT:
                big.append(f"{rel}: {num_lines} lines")
    assert not big, f"files over {MAX_LINES} lines (split them by job):\n" + "\n".join(big)
