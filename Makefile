VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip

.PHONY: install test run bench lint

install:
	@if [ "$$(id -u)" = 0 ] && ! dpkg -s fuse3 libfuse3-dev >/dev/null 2>&1; then \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq fuse3 libfuse3-dev pkg-config; fi
	test -x $(PY) || python3 -m venv $(VENV)
	@# The CPU wheel of torch must come first: left to the resolver, torch drags in CUDA.
	$(PY) -c "import torch, sys; sys.exit(0 if torch.__version__.startswith('2.13.0') or torch.cuda.is_available() else 1)" 2>/dev/null \
		|| $(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[dev]'

test:
	$(PY) -m pytest -q -x

run:
	$(VENV)/bin/symphony generate --prompt "def fibonacci(n):" --max-new-tokens 64 --temperature 0.7 --seed 0

bench:
	$(PY) bench/engine.py

lint:
	$(VENV)/bin/ruff check .
