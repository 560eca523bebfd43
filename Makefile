# One command each, on a fresh machine: `make conformance` and `make test`.
# torch is installed first and pinned by TORCH_SPEC (a GPU runner or a fork passes its own, e.g.
# TORCH_SPEC=/path/to/torch-*.whl, or TORCH_SPEC= to keep the torch already in the venv).

PYTHON     ?= python3
VENV       ?= .venv
TORCH_SPEC ?= torch==2.13.0
WORLD_SIZE ?= 1,2
IMPL       ?=
PYTEST_ARGS ?=

PY      := $(VENV)/bin/python
STAMP   := $(VENV)/.installed
IMPL_ARG := $(if $(IMPL),--impl $(IMPL),)

.PHONY: setup conformance test bench asv clean

$(PY):
	$(PYTHON) -m venv $(VENV)

# Re-run only when the dependency declarations change: a second `make test` adds no set-up time.
$(STAMP): pyproject.toml constraints.txt | $(PY)
	$(if $(strip $(TORCH_SPEC)),$(PY) -m pip install -q "$(TORCH_SPEC)")
	$(PY) -m pip install -q -c constraints.txt -e ".[bench,fairscale]"
	@touch $@

setup: $(STAMP)

# The main job: run the suite and print the table of requirement ID x implementation.
conformance: setup
	$(PY) -m tools.report run --world-size $(WORLD_SIZE) $(IMPL_ARG) -- $(PYTEST_ARGS)

# Everything CI runs: harness and tool self-tests, the conformance suite, every benchmark once.
test: setup
	$(PY) -m pytest tests conformance --world-size $(WORLD_SIZE) $(IMPL_ARG) $(PYTEST_ARGS)
	$(PY) -m pytest bench --benchmark-disable -q -p no:cacheprovider

# Side-by-side pytest-benchmark tables (reference vs torch vs raw), a few minutes.
bench: setup
	@mkdir -p .benchmarks
	$(PY) -m pytest bench --benchmark-only --benchmark-group-by=group --benchmark-columns=min,median,max \
		--benchmark-json=.benchmarks/bench.json $(PYTEST_ARGS)
	$(PY) -m tools.bench_table .benchmarks/bench.json

# A smoke run of every asv benchmark at its smallest size on this commit (the full grid: `asv run HEAD^!`).
asv: setup
	$(VENV)/bin/asv machine --yes
	BENCH_QUICK=1 $(VENV)/bin/asv run --quick --show-stderr HEAD^!

clean:
	rm -rf $(VENV) .asv .pytest_cache .benchmarks *.egg-info
