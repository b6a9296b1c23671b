"""The `symphony` command."""

from __future__ import annotations

import argparse
import json
import sys

from symphony.engine.errors import ModelError


def add_sampling_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--greedy", action="store_true", help="argmax decoding (the default)")
    p.add_argument("--temperature", type=float, help="sample at this temperature")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--seed", type=int)


def sampling_params(args: argparse.Namespace):
    from symphony.engine.sampler import SamplingParams

    sampled = args.temperature is not None and not args.greedy
    return SamplingParams(
        temperature=args.temperature if sampled else 0.0,
        top_k=args.top_k,
        top_p=args.top_p,
        min_p=args.min_p,
        seed=args.seed,
    )


def parse_ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.replace(",", " ").split()]
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"--prompt-ids wants integers: {e}") from e


def cmd_generate(args: argparse.Namespace) -> int:
    import torch

    from symphony.engine.engine import Engine
    from symphony.engine.generate import generate

    dtype = getattr(torch, args.dtype) if args.dtype else None
    engine = Engine(args.model, device=args.device, dtype=dtype, kv_pages=args.kv_pages)
    tok = engine.tokenizer
    if args.prompt is not None:
        if tok is None:
            raise ModelError(f"{engine.model_dir}: no tokenizer.json; use --prompt-ids")
        prompt = tok.encode(args.prompt)
    else:
        prompt = args.prompt_ids
    out = generate(engine, [prompt], sampling_params(args), args.max_new_tokens)[0]
    text = tok.decode(out) if tok else None
    if args.json:
        result = {"prompt_ids": prompt, "output_ids": out}
        if text is not None:
            result["text"] = text
        print(json.dumps(result))
    elif text is None:
        print(" ".join(map(str, out)))
    else:
        print((args.prompt or "") + text)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="symphony", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="run the engine in-process on one prompt (no daemon)")
    g.add_argument("--model", help="Hugging Face checkpoint directory (default: the shipped model)")
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt")
    src.add_argument("--prompt-ids", type=parse_ids)
    add_sampling_flags(g)
    g.add_argument("--json", action="store_true", help="print one JSON object")
    g.add_argument("--device", help="cpu or cuda (default: cuda when available)")
    g.add_argument(
        "--dtype",
        choices=["float32", "float16", "bfloat16"],
        help="weights and KV (default: float32 on cpu, bfloat16 on cuda)",
    )
    g.add_argument("--kv-pages", type=int, default=1024)
    g.set_defaults(func=cmd_generate)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ModelError, ValueError, MemoryError) as e:
        print(f"symphony: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
