"""A checkpoint's identity: KV files made with one model are refused by any other."""

from __future__ import annotations

import hashlib
from pathlib import Path

CHUNK = 1 << 24


def fingerprint(model_dir: str | Path) -> str:
    """sha256 over config.json and every weight file's bytes, in name order; for a GGUF
    file (config, weights and tokenizer in one), over the file's bytes.

    Hashing the weights themselves (not only shapes) tells two fine-tunes of one base
    apart, and two quantizations of one model; it reads the checkpoint once, at kernel start.
    """
    model_dir = Path(model_dir)
    h = hashlib.sha256()
    if model_dir.is_file():
        # Under a name of its own, so no directory's hash can equal it; the file's own name
        # is left out, as renaming it changes no weight.
        paths = [("gguf", model_dir)]
    else:
        paths = [(p.name, p) for p in [model_dir / "config.json",
                                       *sorted(model_dir.glob("*.safetensors"))]]
    for name, path in paths:
        h.update(name.encode() + b"\0")
        with open(path, "rb") as f:
            while chunk := f.read(CHUNK):
                h.update(chunk)
    return h.hexdigest()
