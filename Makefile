VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed

.PHONY: install test run bench lint proto

# `make run` and `make test` work straight after cloning: they install first when needed.
$(STAMP): pyproject.toml
	@if [ "$$(id -u)" = 0 ] && ! dpkg -s fuse3 libfuse3-dev pkg-config >/dev/null 2>&1; then \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
		apt-get install -y -qq fuse3 libfuse3-dev pkg-config >/dev/null; fi
	test -x $(PY) || python3 -m venv $(VENV)
	@# The CPU wheel of torch must come first: left to the resolver, torch drags in CUDA.
	$(PY) -c "import torch, sys; sys.exit(0 if torch.__version__.startswith('2.13.0') \
		or torch.cuda.is_available() else 1)" 2>/dev/null || $(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[dev]'
	touch $@

install:
	rm -f $(STAMP)
	$(MAKE) $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q

run: $(STAMP)
	$(VENV)/bin/symphony generate --prompt "def fibonacci(n):" --max-new-tokens 64
	$(VENV)/bin/symphony generate --prompt "The" --max-new-tokens 64 --temperature 0.8 --seed 0

bench: $(STAMP)
	$(PY) bench/engine.py
	$(PY) bench/kvfs.py

lint: $(STAMP)
	$(VENV)/bin/ruff check .

# The stubs are committed; this remakes them from the proto (tests/test_proto.py checks they are fresh).
proto: $(STAMP)
	$(PY) -m grpc_tools.protoc -I. --python_out=. --grpc_python_out=. syscalls/symphony.proto
