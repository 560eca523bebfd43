# One command each, on a fresh machine: `make conformance` and `make test`.
# torch is installed first and pinned by TORCH_SPEC (a GPU runner or a fork passes its own, e.g.
# TORCH_SPEC=/path/to/torch-*.whl, or TORCH_SPEC= to keep the torch already in the venv).

PYTHON     ?= python3
VENV       ?= .venv
TORCH_SPEC ?= torch==2.13.0
# `make conformance TORCHRUN="--nproc-per-node 8"`: the suite as the ranks of a torchrun job (its
# world size by default, rank 0 prints the table); torchrun's own options go here.
TORCHRUN   ?=
WORLD_SIZE ?= $(if $(TORCHRUN),,$(POOL_WORLD_SIZE))
POOL_WORLD_SIZE := 1,2
IMPL       ?=
PYTEST_ARGS ?=
# Parts of the tests run at once (--shard K/N, SPEC HX-35): on this 2-core machine two pytest processes
# keep both cores busy where one leaves one idle (the controller waits on its ranks, a one-rank test
# uses one core); three were no faster (the longest part 528 s against 522 s). JOBS=1 runs one. Under
# torchrun (TORCHRUN=...) always one.
JOBS       ?= 2
# Adapters whose rank tests are run once more after a native memory error (--rerun-crashes, SPEC HX-33):
# upstream torch's CPU/gloo build segfaults now and then in a gloo thread while DTensor gathers
# optimizer state, or aborts there on glibc's "malloc(): unaligned tcache chunk detected". The
# reference is Python on those same collectives (its FSDP's gathers, and the suite's oracles'
# full_tensor, where CI saw its two crashes); the suite under glibc's heap checks finds no corruption of
# its own (docs/faults.md). A fork's adapter is not among them (not even one derived from torch's): its
# crashes fail the run. Every rerun crash is listed after the run. `make test RERUN_CRASHES=` turns it
# off; `make stress` never reruns.
RERUN_CRASHES ?= torch,torch-fsdp2,reference
# `make mutation`: mutants per section (a number, or all), the sample's seed, which sections, how many at
# once. About 150 a section know its kill rate within about 5 points; a fresh seed draws mutants no test
# was written against.
MUTATION_SAMPLE   ?= 150
MUTATION_SEED     ?= 0
MUTATION_SECTIONS ?= FP,SD,OS,ML,AS
MUTATION_JOBS     ?= 1
MUTATION_ARGS     ?=
# `make asv-gate`: the commit to compare HEAD (TIP) against, and extra tools.asv_gate options.
# `make bench`, `make asv`, `make asv-gate` pass IMPL (an adapter: a shipped name or pkg.mod:Adapter) as
# BENCH_IMPL: bench/asv measure it beside the reference, torch and raw; the gate times it instead of
# the reference.
BASE      ?= main
TIP       ?= HEAD
GATE_ARGS ?=

PY      := $(VENV)/bin/python
comma   := ,
STAMP   := $(VENV)/.installed
IMPL_ARG := $(if $(IMPL),--impl $(IMPL),)
RERUN_ARG := $(if $(RERUN_CRASHES),--rerun-crashes $(RERUN_CRASHES),)
BENCH_ENV := $(if $(IMPL),BENCH_IMPL=$(IMPL),)

.PHONY: setup bytecode conformance lint test test-plain test-bench stress bench asv asv-gate mutation matrix stacks clean

$(PY):
	$(PYTHON) -m venv $(VENV)

# Re-run only when the dependency declarations change: a second `make test` adds no set-up time.
# --no-compile: pip would compile every module of every package, one core, 25 of its 56 s here; the
# interpreters of the run compile what they import (under half of torch's modules) once, on both cores, and
# keep it in __pycache__ (PYTHONDONTWRITEBYTECODE is unexported below).
# torch comes from pip, which reads this machine's configuration (its wheels, its cap on torch); the
# rest from uv (pinned in constraints.txt), which resolves and fetches in parallel: 12 s where pip took
# 36 s of a set-up that nothing else runs beside. Where uv cannot be had or fails, pip installs the same.
EXTRAS := .[bench,fairscale,dev,models]
$(STAMP): pyproject.toml constraints.txt | $(PY)
	$(if $(strip $(TORCH_SPEC)),$(PY) -m pip install -q --no-compile "$(TORCH_SPEC)")
	($(PY) -m pip install -q -c constraints.txt uv && $(VENV)/bin/uv pip install -q --python $(PY) -c constraints.txt -e "$(EXTRAS)") \
		|| $(PY) -m pip install -q --no-compile -c constraints.txt -e "$(EXTRAS)"
	@touch $@

# Python and pytest keep compiled and assertion-rewritten modules in __pycache__ (git ignores it). Where
# PYTHONDONTWRITEBYTECODE is set, as it is on this machine, nothing is kept: each of a run's ~60 pytest
# sessions rewrote the suite's modules and the pytest plugins' (hypothesis, anyio) again, and each of its
# ~200 interpreters compiled the checkout again. A fresh clone's make test spent 1,219 busy core-seconds
# where the same tests with those caches in place spent 1,076. A stale file is never read (it is checked
# against its source).
unexport PYTHONDONTWRITEBYTECODE

# The checkout's own bytecode, compiled on every core before the parts start (so that they do not each
# compile the same modules at once); only what changed since the last run is compiled.
bytecode: $(STAMP)
	@$(PY) -m compileall -qq -j0 conformance reference tools bench tests || true

setup: $(STAMP) bytecode

# The main job: run the suite and print the table of requirement ID x implementation.
conformance: setup
	$(if $(TORCHRUN),$(VENV)/bin/torchrun $(TORCHRUN),$(PY)) -m tools.report run $(if $(WORLD_SIZE),--world-size $(WORLD_SIZE),) $(IMPL_ARG) $(if $(TORCHRUN),,--jobs $(JOBS)) -- $(RERUN_ARG) $(PYTEST_ARGS)

# Everything CI runs: lint and types (configured in pyproject.toml), harness and tool self-tests and the
# conformance suite in JOBS parts, all at once (each job's output whole when it ends), and every
# benchmark once: with JOBS > 1 as one more job beside the parts (after them, its minutes would leave a
# core idle), else after the part. Lint is a job beside the parts, not a step before them: mypy's 20 s
# on one core left the other idle, and a lint failure still fails the run.
SHARDS := $(shell seq 1 $(JOBS))
BENCH_JOB := $(if $(filter-out 1,$(JOBS)),test-bench,)
test: setup
	@$(MAKE) --no-print-directory -j$(words lint test-plain $(SHARDS) $(BENCH_JOB)) -Otarget lint test-plain $(addprefix test-shard-,$(SHARDS)) $(BENCH_JOB)
	$(if $(BENCH_JOB),,@$(MAKE) --no-print-directory test-bench)

# Every pytest benchmark once at its smallest size, and every asv benchmark once as `asv run --quick`
# calls it (bench/test_asv_suite.py, through asv's runner library): a benchmark broken under either fails.
test-bench: setup
	$(PY) -m pytest bench --benchmark-disable -q -p no:cacheprovider

# The reference's plain path (SDC_REFERENCE_FAST_PATHS=0: what a reviewer checks against SPEC.md) judged
# by the checkpoint tests at world size 1, 14 s: the parts judge the fast paths only, and two plain-path
# defects (an empty bytes value refused, a damaged record met only while reading) passed them unseen.
test-plain: setup
	SDC_REFERENCE_FAST_PATHS=0 $(PY) -m pytest conformance/test_checkpoint.py --impl reference --world-size 1 -q -p no:logging -p no:cacheprovider

# `-p no:logging`: pytest's log capture attaches its handlers to every non-propagating logger (torch has
# 55) around each phase of each of the ~9,000 tests, about 5% of a part's CPU; nothing here reads
# captured log records, and a warning logged in a failing test still shows in its captured stderr.
test-shard-%: setup
	$(PY) -m pytest tests conformance -p no:logging --world-size $(WORLD_SIZE) $(if $(filter-out 1,$(JOBS)),--shard $*/$(JOBS),) $(IMPL_ARG) $(RERUN_ARG) $(PYTEST_ARGS)

# The installed suite on torch releases (default: every minor from pyproject's lower bound, newest
# patch), each installed from the registry into a bare venv of its own (several GB, removed after), and
# docs/compatibility.md written from the results; fails where a release is not green. Hours for all.
MATRIX_RELEASES ?=
MATRIX_WORLD_SIZE ?= 1,2
matrix: setup
	$(PY) -m tools.matrix run $(foreach r,$(subst $(comma), ,$(MATRIX_RELEASES)),--release $(r)) --world-size $(MATRIX_WORLD_SIZE) --jobs $(JOBS) $(IMPL_ARG) $(if $(PYTEST_ARGS),-- $(PYTEST_ARGS),)

# The installed suite against the checkpoint stacks built on torch (megatron-core, DeepSpeed, torchtitan;
# STACKS=deepspeed for one), each in a venv of its own under .stacks/ (1-2 GB each, kept for reruns), and
# docs/stacks.md written from the results; fails where a stack has a failure no known deviation explains.
STACKS ?=
STACKS_WORLD_SIZE ?= 1,2
stacks: setup
	TORCH_SPEC="$(TORCH_SPEC)" $(PY) -m tools.stacks run $(foreach s,$(subst $(comma), ,$(STACKS)),--stack $(s)) --world-size $(STACKS_WORLD_SIZE) $(if $(PYTEST_ARGS),-- $(PYTEST_ARGS),)

# The suite STRESS_RUNS times with fresh random examples under glibc's heap checks (its per-thread cache off,
# MALLOC_PERTURB_): reports every test that failed in any run; exits non-zero if one did.
STRESS_RUNS ?= 5
stress: setup
	$(PY) -m tools.stress --runs $(STRESS_RUNS) --world-size $(WORLD_SIZE) $(IMPL_ARG) $(if $(PYTEST_ARGS),-- $(PYTEST_ARGS),)

# ruff (lint and import order) and mypy (strict on reference/, checked elsewhere), a few seconds each.
lint: setup
	$(PY) -m ruff check .
	$(PY) -m mypy

# Side-by-side pytest-benchmark tables (reference, IMPL if given, torch, raw), a few minutes; the scale
# simulation (bench/scale) up to 1,024 ranks here, `python -m bench.scale` for up to 16,384.
bench: setup
	@mkdir -p .benchmarks
	$(BENCH_ENV) $(PY) -m pytest bench --benchmark-only --benchmark-group-by=group --benchmark-columns=min,median,max \
		--benchmark-json=.benchmarks/bench.json $(PYTEST_ARGS)
	$(PY) -m tools.bench_table .benchmarks/bench.json

# A smoke run of every asv benchmark at its smallest size on this commit (the full grid: `asv run HEAD^!`).
asv: setup
	$(VENV)/bin/asv machine --yes
	$(BENCH_ENV) BENCH_QUICK=1 $(VENV)/bin/asv run --quick --show-stderr HEAD^!

# The regression gate: one benchmark per core call of the reference (or IMPL) in bench/bench_gate.py,
# BASE vs TIP, rounds interleaved; exits 1 when one is confirmed 1.1x slower or more (median of the
# per-round ratios, slower in every round). Baselines (upstream, raw) are recorded for TIP after it.
asv-gate: setup
	$(BENCH_ENV) $(PY) -m tools.asv_gate --base $(BASE) --tip $(TIP) $(GATE_ARGS)

# The suite's power: mutants of reference/ judged by each section's conformance tests alone (--impl
# reference; what a fork sees), then the survivors by its self-tests too; MUTATION_SAMPLE per section
# (hours here: add MUTATION_ARGS=--resume to go on after an interruption), MUTATION_SAMPLE=all for every
# one. Prints both tables and the survivors; also in .mutation/report.md and report.json. Measures, never
# fails (add MUTATION_ARGS="--fail-under 95" to gate on the conformance-only rate). Not part of `make test`.
mutation: setup
	$(PY) -m tools.mutation --sample $(MUTATION_SAMPLE) --seed $(MUTATION_SEED) --sections $(MUTATION_SECTIONS) --jobs $(MUTATION_JOBS) $(MUTATION_ARGS)

clean:
	rm -rf $(VENV) .asv .pytest_cache .benchmarks *.egg-info .mutation .stress .matrix .stacks
