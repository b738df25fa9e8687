# floatxq: the two README commands (`make demo`, `make test`) plus lint and bench.
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.floatxq-installed
HYPOTHESIS_PROFILE ?= ci
TORCH_CPU ?= 2.13.0
export HYPOTHESIS_PROFILE

.PHONY: demo test lint bench install clean

$(PY):
	python3 -m venv $(VENV)

# Where torch is missing and no CUDA is present, take the CPU wheel (torch==2.13.0+cpu) instead of
# letting the resolver pull a multi-GB CUDA build just to run the tests: first from pip's configured
# sources (an index or find-links holding a +cpu build; fails at once where none has it), else from
# PyTorch's CPU index (PyPI beside it for Triton and torch's dependencies). On Linux Triton 3.6.0
# beside it: its wheel runs the kernels' interpreter on CPU, so `make test` executes the Triton
# kernels (small shapes, TRITON_INTERPRET=1 in a child pytest). A CUDA build of torch brings its
# own Triton. The `triton` extra (Linux only) adds Triton where torch was already installed.
$(STAMP): $(PY) pyproject.toml
	@if ! $(PY) -c "import torch" >/dev/null 2>&1; then \
	  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi >/dev/null 2>&1; then \
	    $(PIP) install "torch>=2.11"; \
	  else \
	    if [ "$$(uname -s)" = Linux ]; then extra='triton==3.6.0'; else extra=; fi; \
	    $(PIP) install "torch==$(TORCH_CPU)+cpu" $$extra \
	    || $(PIP) install "torch==$(TORCH_CPU)" $$extra \
	         --index-url https://download.pytorch.org/whl/cpu --extra-index-url https://pypi.org/simple; \
	  fi; \
	fi
	$(PIP) install -e ".[test,plot,triton]"
	@# MLX (its CPU backend on Linux) so the MLX tests run; where no wheel exists they skip
	-$(PIP) install "mlx[cpu]>=0.32" "mlx-lm>=0.32" || echo "MLX is not installable here: its tests will skip"
	@touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/floatxq demo

test: $(STAMP)
	$(PY) -m pytest -n 2 -q --doctest-modules floatxq tests property_tests

lint: $(STAMP)
	$(VENV)/bin/ruff check floatxq tests property_tests examples benchmarks
	$(VENV)/bin/ruff format --check floatxq tests property_tests examples benchmarks

bench: $(STAMP)
	$(PY) benchmarks/run_all.py

clean:
	rm -rf $(VENV) build *.egg-info
