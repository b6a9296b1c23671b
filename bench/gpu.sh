#!/bin/sh
# The GPU run (issue 31): bench/gpu.sh OUT_DIR on a CUDA machine, bench/gpu.sh --dry-run OUT_DIR
# anywhere. bench/gpu.py says what it does. PYTHON picks the interpreter (default: the
# project's .venv where there is one, else python3).
cd "$(dirname "$0")/.." || exit 2
if [ -z "$PYTHON" ]; then
    if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python
    elif command -v python3 >/dev/null; then PYTHON=python3
    else PYTHON=python; fi
fi
exec "$PYTHON" bench/gpu.py "$@"
