"""The liveness property (``tests/worker/test_liveness_property.py``, issue 31), wide.

``make test`` runs the property on a seeded handful of mixes; this runs it on many random ones
(policies × allocators × chunk sizes × pool sizes × RT/BE × aborts)::

    python bench/bench_liveness.py --examples 2000     # or, the same:
    SGLFAIR_PROPERTY_EXAMPLES=2000 python -m pytest tests/worker/test_liveness_property.py

A failure prints Hypothesis's falsifying example (seed, policy, allocator, ...), which
``run_mix`` in that test file replays.

``--test plugin``: the SGLang plugin's property instead (``tests/sglang/test_plugin_property.py``,
issue 39: no input brings SGLang down, every request ends, the ledger empties), ≥ 500 in
``make bench``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TESTS = {
    "liveness": ROOT / "tests" / "worker" / "test_liveness_property.py",
    "plugin": ROOT / "tests" / "sglang" / "test_plugin_property.py",
}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=300)
    parser.add_argument("--test", choices=sorted(TESTS), default="liveness")
    args = parser.parse_args(argv)
    env = {**os.environ, "SGLFAIR_PROPERTY_EXAMPLES": str(args.examples)}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(TESTS[args.test])]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    out = {
        "test": args.test,
        "examples": args.examples,
        "passed": proc.returncode == 0,
        "seconds": round(time.perf_counter() - t0, 1),
    }
    if proc.returncode != 0:
        out["tail"] = proc.stdout[-4000:]
    return out


if __name__ == "__main__":
    print(json.dumps(main(), indent=2))
