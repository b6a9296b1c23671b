"""Train Symphony's default model from nothing but Debian packages, on a 2-core CPU.

    .venv/bin/python models/train_default.py            # corpus, tokenizer, training, eval
    .venv/bin/python models/train_default.py --steps 20 --out /tmp/tiny   # a smoke run

Steps: prepare the corpus (prepare_corpus.py), train the BPE tokenizer on its training
split, train a small Llama (our own `CausalLM`, so the engine runs exactly what was
trained) with fixed seeds, save it in Hugging Face layout with bf16 weights, reload the
saved files, and write the held-out loss and some samples to EVAL.md.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import platform
import random
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from default_tokenizer import (
    BOS,
    EOS,
    PAD,
    ROLES,
    SPECIAL_TOKENS,
    check_chat_template,
    plain_pieces,
    render_chat,
    save_tokenizer,
    train_tokenizer,
)
from prepare_corpus import SYSTEM, prepare
from tokenizers import Tokenizer

from symphony.engine.config import ModelConfig
from symphony.engine.loader import load_model, save_checkpoint
from symphony.engine.model import CausalLM

ROOT = Path(__file__).resolve().parent.parent
SEED = 1234
# Most steps train on short windows (cheaper attention), the last ones on the full context
# the config promises, so the model has seen every position it may be asked about.
SHORT_LEN, SEQ_LEN = 256, 1024
EVAL_WINDOWS = 64  # held-out windows of SEQ_LEN tokens: 65k tokens, seconds to score
# No trailing spaces: byte-level BPE glues a space to the word after it, so a prompt ending
# in one asks for a token sequence the model has never seen.
PROMPTS = ["def", "The", "import"]
RUN_PROMPT = "def fibonacci(n):"  # what `make run` asks for
CHAT_PROMPT = "What does `os.path.join` do?"


def model_config(vocab_size: int, ids: dict[str, int], args: argparse.Namespace) -> dict:
    """The Hugging Face config.json of the model."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab_size,
        "hidden_size": args.hidden,
        "intermediate_size": args.intermediate,
        "num_hidden_layers": args.layers,
        "num_attention_heads": args.heads,
        "num_key_value_heads": args.kv_heads,
        "head_dim": args.hidden // args.heads,
        "hidden_act": "silu",
        "max_position_embeddings": SEQ_LEN,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": True,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "initializer_range": 0.02,
        "use_cache": True,
        "bos_token_id": ids[BOS],
        "eos_token_id": ids[EOS],
        "pad_token_id": ids[PAD],
    }


class DenseCausal:
    """Training attention: the flattened batch is `batch` equal windows, each causal."""

    def __init__(self, batch: int):
        self.batch = batch

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        def split(x: torch.Tensor) -> torch.Tensor:  # [B*L, H, D] -> [B, H, L, D]
            return x.view(self.batch, -1, *x.shape[1:]).transpose(1, 2)

        out = F.scaled_dot_product_attention(
            split(q), split(k), split(v), is_causal=True, enable_gqa=True
        )
        return out.transpose(1, 2).reshape(q.shape)


def logits_of(model: CausalLM, ids: torch.Tensor) -> torch.Tensor:
    """ids [B, L] -> logits [B, L, V], every row starting at position 0."""
    b, n = ids.shape
    positions = torch.arange(n).repeat(b)
    hidden = model(ids.reshape(-1), positions, DenseCausal(b))
    return model.logits(hidden).view(b, n, -1)


def tokenize(tok: Tokenizer, path: Path, cache: Path) -> np.ndarray:
    """The token stream of a corpus file, cached by the digest of text and tokenizer."""
    text = path.read_text(encoding="utf-8")
    key = hashlib.sha256(text.encode() + tok.to_str().encode()).hexdigest()[:16]
    cached = cache / f"{path.stem}-{key}.npy"
    if cached.exists():
        return np.load(cached)
    # The file is a stream of <|bos|>...<|eos|> documents: split where documents start.
    docs = [BOS + d for d in text.split(BOS) if d]
    encoded = tok.encode_batch(docs, add_special_tokens=False)
    ids = np.concatenate([np.asarray(e.ids, dtype=np.int16) for e in encoded])
    cache.mkdir(parents=True, exist_ok=True)
    np.save(cached, ids)
    return ids


def eval_windows(stream: np.ndarray, windows: int = EVAL_WINDOWS) -> torch.Tensor:
    """[N, SEQ_LEN + 1] consecutive windows of the held-out stream, overlapping by one token
    so that every token after the first is predicted exactly once."""
    n = min(windows, (len(stream) - 1) // SEQ_LEN)
    rows = [stream[i * SEQ_LEN : i * SEQ_LEN + SEQ_LEN + 1] for i in range(n)]
    return torch.from_numpy(np.stack(rows).astype(np.int64))


@torch.no_grad()
def heldout_loss(logits_fn, windows: torch.Tensor, batch: int = 16) -> float:
    """Mean next-token cross-entropy (nats) over the windows; `logits_fn(ids [B, L])` may be
    ours or a transformers model's, which is how the two are compared."""
    total, count = 0.0, 0
    for i in range(0, len(windows), batch):
        w = windows[i : i + batch]
        logits = logits_fn(w[:, :-1]).float()
        total += F.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), w[:, 1:].reshape(-1), reduction="sum"
        ).item()
        count += w[:, 1:].numel()
    return total / count


@torch.no_grad()
def generate(
    model: CausalLM, prompt_ids: list[int], n: int, eos: int, temperature: float = 0.0,
    top_k: int = 0, seed: int = 0,
) -> list[int]:
    """Plain recompute-everything sampling; fine for a few samples of a small model."""
    gen = torch.Generator().manual_seed(seed)
    ids = list(prompt_ids)
    for _ in range(n):
        logits = logits_of(model, torch.tensor([ids[-SEQ_LEN:]]))[0, -1]
        if temperature == 0:
            nxt = int(logits.argmax())
        else:
            logits = logits / temperature
            if top_k:
                kth = logits.topk(top_k).values[-1]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            nxt = int(torch.multinomial(logits.softmax(-1), 1, generator=gen))
        ids.append(nxt)
        if nxt == eos:
            break
    return ids[len(prompt_ids) :]


def init_weights(model: CausalLM, layers: int) -> None:
    torch.manual_seed(SEED)
    for name, p in model.named_parameters():
        if p.dim() == 1:
            torch.nn.init.ones_(p)  # RMSNorm gains
        else:
            std = 0.02
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                std /= math.sqrt(2 * layers)  # residual writes: keep the stream's scale flat
            torch.nn.init.normal_(p, 0.0, std)


def lr_at(step: int, args: argparse.Namespace) -> float:
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    t = (step - args.warmup) / max(1, args.steps - args.warmup)
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))


def train(model: CausalLM, stream: np.ndarray, windows: torch.Tensor, args: argparse.Namespace):
    decay = [p for p in model.parameters() if p.dim() >= 2]
    keep = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": keep, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.95),
        eps=1e-8,
    )
    # Non-overlapping windows of each length, visited in a seeded order, reshuffled per epoch.
    rng = np.random.default_rng(SEED)
    orders: dict[int, list[int]] = {SHORT_LEN: [], SEQ_LEN: []}
    data = torch.from_numpy(stream.astype(np.int64))
    long_from = int(args.steps * (1 - args.long_frac))
    start = time.time()
    for step in range(args.steps):
        n = SEQ_LEN if step >= long_from else SHORT_LEN
        rows = args.batch_tokens // n
        if len(orders[n]) < rows:
            orders[n] += rng.permutation((len(stream) - 1) // n).tolist()
        chunks, orders[n] = orders[n][:rows], orders[n][rows:]
        batch = torch.stack([data[c * n : c * n + n + 1] for c in chunks])
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args)
        model.train()
        logits = logits_of(model, batch[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        last = step == args.steps - 1
        if step % args.log_every == 0 or last:
            elapsed = time.time() - start
            tps = (step + 1) * args.batch_tokens / elapsed
            line = f"step {step:5d}  len {n:4d}  loss {loss.item():.4f}  "
            line += f"lr {lr_at(step, args):.2e}  {tps:,.0f} tok/s  {elapsed / 60:.1f} min"
            if (step % args.eval_every == 0 and step) or last:
                model.eval()
                line += f"  heldout {heldout_loss(lambda x: logits_of(model, x), windows):.4f}"
            print(line, flush=True)
    return time.time() - start


def render_samples(model: CausalLM, tok: Tokenizer) -> list[tuple[str, str, str]]:
    """(kind, prompt, completion) for the greedy, sampled and chat samples of EVAL.md."""
    eos = tok.token_to_id(EOS)
    out = []
    for kind, temp in (("greedy", 0.0), ("sampled (T=0.8, top-k 40, seed 0)", 0.8)):
        for prompt in PROMPTS:
            ids = tok.encode(prompt).ids  # with bos, as the engine encodes prompts
            new = generate(model, ids, 64, eos, temperature=temp, top_k=40, seed=0)
            out.append((kind, prompt, tok.decode(new, skip_special_tokens=False)))
    ids = tok.encode(RUN_PROMPT).ids
    out.append(("greedy", RUN_PROMPT, tok.decode(generate(model, ids, 64, eos))))
    chat = render_chat(
        [{"role": "system", "content": SYSTEM}, {"role": "user", "content": CHAT_PROMPT}],
        add_generation_prompt=True,
    )
    new = generate(model, tok.encode(chat, add_special_tokens=False).ids, 96, eos)
    out.append(("chat, greedy", chat, tok.decode(new, skip_special_tokens=False)))
    return out


def write_eval(path: Path, facts: dict, samples: list[tuple[str, str, str]]) -> None:
    lines = ["# Default model: evaluation", ""]
    lines += [f"- {k}: {v}" for k, v in facts.items()]
    lines += ["", "## Samples", ""]
    for kind, prompt, completion in samples:
        lines += [f"### {kind}: {prompt!r}", "", "```", prompt + completion, "```", ""]
    path.write_text("\n".join(lines))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", type=Path, default=ROOT / "data")
    ap.add_argument("--out", type=Path, default=ROOT / "models" / "tiny")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--intermediate", type=int, default=704)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--steps", type=int, default=1800)
    ap.add_argument("--batch-tokens", type=int, default=4096)
    ap.add_argument("--long-frac", type=float, default=0.25, help="share of steps at SEQ_LEN")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--warmup", type=int, default=150)
    ap.add_argument("--log-every", type=int, default=25)
    ap.add_argument("--eval-every", type=int, default=500)
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "true" if args.threads > 1 else "false")
    random.seed(SEED)
    np.random.seed(SEED)
    torch.manual_seed(SEED)

    corpus = prepare(args.data)
    print(f"corpus: {corpus}", flush=True)
    train_text = (corpus / "train.txt").read_text(encoding="utf-8")
    tok = train_tokenizer(plain_pieces(train_text), args.vocab)
    del train_text
    save_tokenizer(tok, args.out, max_length=SEQ_LEN)
    check_chat_template(args.out)
    ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    train_stream = tokenize(tok, corpus / "train.txt", args.data / "tokens")
    eval_stream = tokenize(tok, corpus / "eval.txt", args.data / "tokens")
    windows = eval_windows(eval_stream)
    print(f"tokens: train {len(train_stream):,}  eval {len(eval_stream):,} "
          f"(scored: {windows[:, 1:].numel():,})", flush=True)

    config = model_config(tok.get_vocab_size(), ids, args)
    model = CausalLM(ModelConfig.from_dict(config))
    init_weights(model, args.layers)
    params = sum(p.numel() for p in model.parameters())
    print(f"model: {params:,} parameters", flush=True)
    seconds = train(model, train_stream, windows, args)
    model.eval()
    fp32_loss = heldout_loss(lambda x: logits_of(model, x), windows)

    save_checkpoint(model, config, args.out, dtype=torch.bfloat16)
    generation = {"bos_token_id": ids[BOS], "eos_token_id": ids[EOS], "pad_token_id": ids[PAD]}
    (args.out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    # Everything below measures what ships: the bf16 weights, read back by our loader.
    shipped = load_model(args.out)
    loss = heldout_loss(lambda x: logits_of(shipped, x), windows)
    manifest = json.loads((corpus / "manifest.json").read_text())
    # Shipped with the weights so a rerun can check it rebuilt the very same corpus.
    (args.out / "corpus.json").write_text(json.dumps(manifest, indent=2) + "\n")
    facts = {
        "parameters": f"{params:,} ({args.layers} layers, hidden {args.hidden}, "
        f"{args.heads} heads / {args.kv_heads} kv heads, vocab {tok.get_vocab_size()}, "
        f"tied embeddings)",
        "corpus": ", ".join(manifest["packages"]),
        "train tokens": f"{len(train_stream):,} ({args.steps * args.batch_tokens:,} seen: "
        f"{args.steps} steps of {args.batch_tokens} tokens, the last {args.long_frac:.0%} "
        f"in windows of {SEQ_LEN}, the rest {SHORT_LEN})",
        "training time": f"{seconds / 60:.1f} min on {args.threads} threads "
        f"({platform.processor() or platform.machine()}), torch {torch.__version__}",
        "held-out tokens scored": f"{windows[:, 1:].numel():,} (first {len(windows)} windows "
        f"of {SEQ_LEN} in eval.txt)",
        "held-out loss (bf16 weights as shipped)": f"{loss:.4f} nats, "
        f"perplexity {math.exp(loss):.2f}",
        "held-out loss (fp32 weights before saving)": f"{fp32_loss:.4f} nats",
        "roles": ", ".join(ROLES),
    }
    samples = render_samples(shipped, tok)
    write_eval(args.out / "EVAL.md", facts, samples)
    print((args.out / "EVAL.md").read_text())


if __name__ == "__main__":
    main()
