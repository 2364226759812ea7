# The two commands of a fresh machine; both set up .venv on first use.
#   make train   fine-tune the embedded default (MiniLM on fine-food reviews) offline, fast precision for this device
#   make test    check the style (ruff: lint and format, settings in pyproject.toml), then run the test suite
VENV := .venv
THREADS := $(shell nproc 2>/dev/null || sysctl -n hw.ncpu 2>/dev/null || echo 1)

.PHONY: setup train test lint
setup: $(VENV)/.installed
$(VENV)/.installed: pyproject.toml scripts/setup.sh
	bash scripts/setup.sh $(VENV)
	touch $@

# accelerate launch gives a single CPU process one thread unless told otherwise.
train: setup
	$(VENV)/bin/accelerate launch --num_processes 1 --num_cpu_threads_per_process $(THREADS) app/train.py --mixed_precision auto

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

test: lint
	$(VENV)/bin/python -m pytest -q -n 2
