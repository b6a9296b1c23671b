"""A checkpoint's identity: KV files made with one model are refused by any other."""

from __future__ import annotations

import hashlib
from pathlib import Path

CHUNK = 1 << 24


def fingerprint(model_dir: str | Path) -> str:
    """sha256 over config.json and every weight file's bytes, in name order.

    Hashing the weights themselves (not only shapes) tells two fine-tunes of one base
    apart; it reads the checkpoint once, at kernel start.
    """
    model_dir = Path(model_dir)
    h = hashlib.sha256()
    for path in [model_dir / "config.json", *sorted(model_dir.glob("*.safetensors"))]:
        h.update(path.name.encode() + b"\0")
        with open(path, "rb") as f:
            while chunk := f.read(CHUNK):
                h.update(chunk)
    return h.hexdigest()
