# pdproxy: `make run` (a working deployment on this machine) and `make test` (everything CI runs).
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.pdproxy-installed
ENGINES ?= real
PYTEST_ARGS ?=

-include engines/engines.mk

.PHONY: install run test test-fast check bench clean

$(STAMP): pyproject.toml
	@echo "==> creating $(VENV) and installing pdproxy with its test and dev extras"
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	@touch $@

install: $(STAMP)

## run: pdproxy in front of one prefill and one decode (ENGINES=real|sim, CONNECTOR=nixl|nixl-push), until Ctrl-C
run: install
	$(PY) -m engines.demo --engines $(ENGINES) --connector $(CONNECTOR)

## test: every tier, the real-engine one included (it installs vLLM's CPU build on first use,
## and the Debian tools of the browser, deploy and etcd tiers where it can: tests/install-tools.sh)
## The tiers without real engines run on two xdist workers, a whole file each, the longest
## files first (tests/conftest.py), then in collection order (their servers
## are on loopback with free ports; their figures are relative to a baseline taken in the
## same test, so a neighbour's load cannot fail them); the real-engine tier runs alone after
## (its engines are pinned to the cores, and a test's timing is against its own engines).
## Both run even when the first fails; "no tests collected" (exit 5) is no failure.
FAST_TIER := -m "not real_engine" -n 2 --dist loadfile --no-loadscope-reorder
test: install
	@bash tests/install-tools.sh
	@fast=0; real=0; \
	$(PY) -m pytest $(FAST_TIER) --durations=20 $(PYTEST_ARGS) || fast=$$?; \
	$(PY) -m pytest -m real_engine --durations=20 $(PYTEST_ARGS) || real=$$?; \
	for rc in $$fast $$real; do [ $$rc -eq 0 ] || [ $$rc -eq 5 ] || exit $$rc; done

## test-fast: unit and loopback tiers only, no real vLLM engines
test-fast: install
	$(PY) -m pytest $(FAST_TIER) $(PYTEST_ARGS)

check: install
	$(VENV)/bin/ruff format --check pdproxy engines tests bench
	$(VENV)/bin/ruff check pdproxy engines tests bench
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports

## bench: direct-to-decode vs through pdproxy on its default flags, against sim engines, on
## completions and chat (a-chat, b-chat), in one run; pdproxy's TTFT by phase and its loop's
## lag under 64 streams; then the scheduler's own cost per decision (64 instances) and the
## prefix index's bound. A quiet pdproxy (logs at warning) is measured alternately beside it;
## BENCH_ARGS="--only a b-chat --variant api-key|access-log|rev=REV|none" measures another.
## ANCHOR=vllm-router also measures vllm-router (installed from PyPI into its own venv).
## Tables on stdout, JSON + Markdown + PNG in bench/results/ (BENCH_ARGS="--json PATH").
BENCH_ARGS ?=
ANCHOR ?=
bench: install
	$(PY) -m bench.run $(if $(ANCHOR),--anchor $(ANCHOR)) $(BENCH_ARGS)
	$(PY) -m bench.sched_micro
	$(PY) -m bench.kv_events_micro
	$(PY) -m bench.model_routing

## fuzz: the differential test of the legs' HTTP/1.1 client against h11, at length
## (FUZZ_EXAMPLES random answers, a new seed each run; make test runs 300, derandomized)
FUZZ_EXAMPLES ?= 20000
.PHONY: fuzz
fuzz: install
	PDPROXY_FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) $(PY) -m pytest -q tests/unit/test_http1_differential.py $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache

## bench-flow: issue 31's flow-control scenarios (priority, fairness, deadlines, limits) on a
## 1P1D sim fleet, each beside the same run with flow control off (FLOW_ARGS=--quick: 6 s each).
.PHONY: bench-flow
bench-flow: install
	$(PY) -m bench.flow --json bench/results/flow.json $(FLOW_ARGS)

## bench-faults: success and switch-over times when one engine of a 2P2D sim fleet fails
FAULTS_ARGS ?=
.PHONY: bench-faults
bench-faults: install
	$(PY) -m bench.faults $(FAULTS_ARGS)

## soak: 100,000 requests through pdproxy while seeded random faults hit the engines (not in test)
SOAK_ARGS ?=
.PHONY: soak
soak: install
	$(PY) -m bench.soak $(SOAK_ARGS)

## bench-sched: scheduling policies on a 4P4D sim fleet, three workloads (SCHED_ARGS=--quick: ~1 min),
## then the multi-tenant run with KV events and vllm-router's cache_aware (TENANTS_ARGS=--no-anchor ...)
SCHED_ARGS ?=
TENANTS_ARGS ?=
.PHONY: bench-sched
bench-sched: install
	$(PY) -m pip install -q -e '.[dev,bench]'
	$(PY) -m bench.sched $(SCHED_ARGS)
	$(PY) -m bench.sched_tenants $(filter --quick,$(SCHED_ARGS)) $(TENANTS_ARGS)

## bench-render-once: --render-once against the text path on the real CPU NIXL pair (SmolLM2), same run
RENDER_ONCE_ARGS ?=
.PHONY: bench-render-once
bench-render-once: install engines-smollm2
	$(PY) -m bench.render_once $(RENDER_ONCE_ARGS)

## bench-first-token: --first-token-from-prefill against without, on the real CPU NIXL pair (SmolLM2), same run
FIRST_TOKEN_ARGS ?=
.PHONY: bench-first-token
bench-first-token: install engines-smollm2
	$(PY) -m bench.first_token $(FIRST_TOKEN_ARGS)

## bench-push: nixl-push's both legs at once against the prefill first, on the real CPU push pair (SmolLM2), same run
PUSH_ARGS ?=
.PHONY: bench-push
bench-push: install engines-smollm2
	$(PY) -m bench.push $(PUSH_ARGS)

## bench-workers: --workers 1 against 2, same run: req/s, CPU per request and stream, memory, added TTFT (WORKERS_ARGS=--rounds 1)
WORKERS_ARGS ?=
.PHONY: bench-workers
bench-workers: install
	$(PY) -m bench.workers $(WORKERS_ARGS)

## bench-cpu-split: where pdproxy's and vllm-router's CPU goes under (a) and (b) (kernel, the
## router's own code, the event loop, libc), by perf's software clock; needs perf (Debian:
## linux-perf). SPLIT_ARGS="--only b-chat --rounds 4"
SPLIT_ARGS ?= --only a b
.PHONY: bench-cpu-split
bench-cpu-split: install
	$(PY) -m bench.anchor install
	$(PY) -m bench.cpu_split $(SPLIT_ARGS)
