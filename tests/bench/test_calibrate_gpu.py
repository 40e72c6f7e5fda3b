"""``bench/calibrate_gpu.py`` takes its specs from ``worker/sim/hardware.py``, installed or not.

A GPU machine may have only torch and a copy of the repository: the script then loads
``hardware.py`` by path. Either way it must see exactly the simulator's numbers (there is no
second copy of them to drift).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from sgl_fair.worker.sim.hardware import GPUS, MODELS

BENCH = Path(__file__).resolve().parents[2] / "bench"
MODEL_FIELDS = (
    "name",
    "num_layers",
    "hidden_size",
    "num_heads",
    "num_kv_heads",
    "head_dim",
    "intermediate_size",
    "vocab_size",
    "dtype_bytes",
)


def expected() -> dict:
    return {
        "gpus": {g.name: [g.name, g.peak_flops, g.mem_bw] for g in GPUS.values()},
        "models": {m.name: [getattr(m, f) for f in MODEL_FIELDS] for m in MODELS.values()},
    }


# Prints what load_specs gives for every spec, as JSON; argv[1]: block sgl_fair or not.
PROBE = f"""
import json, sys
if sys.argv[1] == "block":
    sys.modules["sgl_fair"] = None  # as on a GPU machine without the package installed
sys.path.insert(0, {str(BENCH)!r})
from calibrate_gpu import load_specs
gpus, models, sources = {{}}, {{}}, set()
for g in {sorted(GPUS)!r}:
    for m in {sorted(MODELS)!r}:
        model, gpu, source = load_specs(m, g)
        gpus[gpu.name] = [gpu.name, gpu.peak_flops, gpu.mem_bw]
        models[model.name] = [getattr(model, f) for f in {MODEL_FIELDS!r}]
        sources.add(source)
print(json.dumps({{"gpus": gpus, "models": models, "sources": sorted(sources)}}))
"""


@pytest.mark.parametrize(
    ("mode", "source"),
    [("block", "worker/sim/hardware.py"), ("installed", "sgl_fair.worker.sim.hardware")],
)
def test_calibrate_gpu_specs_are_the_simulators(mode, source):
    out = subprocess.run(
        [sys.executable, "-c", PROBE, mode], capture_output=True, text=True, check=False
    )
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert got.pop("sources") == [source]
    assert got == expected()
