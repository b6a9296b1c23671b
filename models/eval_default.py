"""Held-out loss of a saved default model, by our engine and by transformers.

    .venv/bin/python models/eval_default.py [--model models/tiny] [--data data]

Both read the same checkpoint in fp32 and score the same held-out windows; the issue asks
that they agree within 1e-3. Exits 1 if they do not. Fetches the corpus if it is missing.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch
from prepare_corpus import prepare
from tokenizers import Tokenizer
from train_default import ROOT, eval_windows, heldout_loss, logits_of, tokenize

from symphony.engine.loader import load_model

TOLERANCE = 1e-3


def losses(model_dir: Path, data: Path) -> tuple[float, float]:
    """(ours, transformers') held-out loss in nats."""
    from transformers import AutoModelForCausalLM  # reference only, not a runtime dependency

    corpus = data / "corpus"
    if not (corpus / "eval.txt").exists():
        prepare(data)
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    windows = eval_windows(tokenize(tok, corpus / "eval.txt", data / "tokens"))
    ours = load_model(model_dir)
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    mine = heldout_loss(lambda x: logits_of(ours, x), windows)
    theirs = heldout_loss(lambda x: hf(input_ids=x).logits, windows)
    return mine, theirs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=ROOT / "models" / "tiny")
    ap.add_argument("--data", type=Path, default=ROOT / "data")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    mine, theirs = losses(args.model, args.data)
    print(f"symphony:     {mine:.6f} nats (perplexity {math.exp(mine):.3f})")
    print(f"transformers: {theirs:.6f} nats (perplexity {math.exp(theirs):.3f})")
    print(f"difference:   {abs(mine - theirs):.2e} (tolerance {TOLERANCE:g})")
    sys.exit(0 if abs(mine - theirs) <= TOLERANCE else 1)


if __name__ == "__main__":
    main()
