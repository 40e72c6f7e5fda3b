"""The docs' code runs: every ```python block of a guide, in order, in a fresh interpreter.

A guide's blocks share one namespace (a walk-through builds on its earlier steps). Each guide
runs in its own process, so what it registers (a policy, an allocator) never leaks into the
registries the other tests see.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
GUIDES = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def python_blocks(path: Path) -> list[str]:
    """The runnable blocks; a block that talks to a running server (it names a URL) is
    left to the end-to-end tests, which start one."""
    return [b for b in BLOCK.findall(path.read_text()) if "http://" not in b]


@pytest.mark.parametrize("path", [p for p in GUIDES if python_blocks(p)], ids=lambda p: p.name)
def test_guide_code_runs(path: Path):
    code = "\n\n".join(python_blocks(path))
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=600, cwd=ROOT
    )
    assert out.returncode == 0, f"{path.name}'s code failed:\n{out.stderr[-3000:]}"


def test_the_guides_have_code():
    """The walk-throughs this test keeps true exist (it would pass vacuously without them)."""
    assert len(python_blocks(ROOT / "docs" / "extending.md")) >= 5
    assert python_blocks(ROOT / "README.md")
