# sgl-fair — the README's commands. Each target creates .venv and installs what it needs.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
SGL_STAMP := $(VENV)/.sglang-cpu
SGL_REQ := requirements/sglang-cpu.txt
SGL_CONSTRAINTS := requirements/sglang-cpu-constraints.txt

.PHONY: setup sglang-cpu test demo demo-bros demo-sglang bench bench-report lint clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[dev]'
	touch $(STAMP)

setup: $(STAMP)

# SGLang 0.5.23's scheduler-side modules on CPU (torch CPU build + sglang --no-deps), for the
# plugin's tests; a GPU install is `pip install -e '.[sglang]'` instead (README).
$(SGL_STAMP): $(STAMP) $(SGL_REQ) $(SGL_CONSTRAINTS)
	$(BIN)/python -m pip install -q -c $(SGL_CONSTRAINTS) -r $(SGL_REQ) -e '.[dev]'
	$(BIN)/python -m pip install -q --no-deps sglang==0.5.23
	touch $(SGL_STAMP)

sglang-cpu: $(SGL_STAMP)

test: $(STAMP) $(SGL_STAMP)
	SGLFAIR_REQUIRE_SGLANG=1 $(BIN)/python -m pytest tests

demo: $(STAMP)
	$(BIN)/python -m sgl_fair.demo

demo-bros: $(STAMP)
	$(BIN)/python -m sgl_fair.demo bros

# The fairness demo on a real SGLang server on this CPU: a tiny random Llama, and the CPU test
# shim (tests/sglang/cpu_shim: torchvision stub, one vLLM rotary op) on the servers' path.
TINY_MODEL := runs/tiny-llama
demo-sglang: $(STAMP) $(SGL_STAMP)
	$(BIN)/python tests/sglang/live_rig.py $(TINY_MODEL)
	PYTHONPATH=tests/sglang/cpu_shim:tests/sglang SGLANG_CPU_OMP_THREADS_BIND=0 OMP_NUM_THREADS=1 \
		$(BIN)/python -m sgl_fair.demo sglang --cpu --model-path $(TINY_MODEL)

bench: $(STAMP) $(SGL_STAMP)
	$(BIN)/python bench/run_all.py

# BENCHMARKS.md's current-figures table from the stored results (bench/results/*.json; the
# headline figures are declared in bench/figures.py); `bench/report.py --check` only checks.
bench-report: $(STAMP)
	$(BIN)/python bench/report.py

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

clean:
	rm -rf $(VENV) runs build *.egg-info .pytest_cache .ruff_cache
