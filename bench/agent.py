"""A multi-turn agent keeping its KV file against resending the conversation (issue 16).

lips/agent.py runs one scripted 8-turn task on --model (default: the tiny model,
models/tiny; 7 tool calls, python snippets and file lookups under a temporary --root, then
finish) twice over: keeping the conversation in one KV file, where each turn appends only
its thought, action and observation, and with --resend, where every turn prefills the whole
conversation so far into a fresh file, as a client of a prompt-based server must (no prefix
cache). Both decode greedily, so both write the same conversation; the bench checks that
they do.

The tiny model is not tuned for ReAct, so the actions are SCRIPTED (teacher-forced from
--script); the model writes the thoughts. What is measured is the system: the prefill
tokens each run computes (the kernel's own count for the process, less the tokens fed back
one at a time while decoding), the forward-pass time the kernel charged to the process
(accel seconds), and the LIP's wall time (connect to answer, tools included: they are the
same on both sides). Runs are interleaved and repeated.

    python bench/agent.py [--repeat 3] [--max-new-tokens 16] [--model DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Run as a script, this file's folder comes first on sys.path (bench/kvfs.py would hide the
# kvfs package); the repository root lets `bench.kernel` be imported for its helpers.
sys.path = [str(ROOT)] + [p for p in sys.path if Path(p or ".").resolve() != ROOT / "bench"]

from bench.kernel import KernelDaemon, header, machine_line, row  # noqa: E402

QUESTION = "How many orders did Paris place, and what did they cost in total?"
FILES = {
    "README.txt": "Orders of the shop, one per line in orders.csv: city, item, price.\n"
                  "Prices are in euros. See rates.txt for other currencies.\n",
    "orders.csv": "Paris,lamp,40\nLyon,desk,120\nParis,chair,35\nNice,lamp,40\n"
                  "Paris,shelf,80\nLyon,chair,35\n",
    "rates.txt": "EUR 1.00\nUSD 1.08\nGBP 0.85\n",
}
SCRIPT = [  # 8 turns: 7 tools, then the answer
    ("lookup", "README.txt"),
    ("lookup", "orders.csv"),
    ("python", "rows = [l.split(',') for l in open('orders.csv').read().split()]\n"
               "print([r for r in rows if r[0] == 'Paris'])"),
    ("python", "rows = [l.split(',') for l in open('orders.csv').read().split()]\n"
               "print(sum(1 for r in rows if r[0] == 'Paris'))"),
    ("python", "rows = [l.split(',') for l in open('orders.csv').read().split()]\n"
               "print(sum(int(r[2]) for r in rows if r[0] == 'Paris'))"),
    ("lookup", "rates.txt"),
    ("python", "print(round(155 * 1.08, 2))"),
    ("finish", "3 orders, 155 EUR (167.40 USD)"),
]


def run_agent(sock: Path, root: Path, script: Path, args: argparse.Namespace,
              *extra: str) -> dict:
    env = {**os.environ, "SYMPHONY_SOCKET": str(sock)}
    out = subprocess.run(
        [sys.executable, "lips/agent.py", "--question", QUESTION, "--script", str(script),
         "--root", str(root), "--max-new-tokens", str(args.max_new_tokens), "--json", *extra],
        env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    if out.returncode:
        raise RuntimeError(f"agent failed: {out.stderr.strip()}")
    return json.loads(out.stdout)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--max-new-tokens", type=int, default=16, help="per thought")
    p.add_argument("--model", default=str(ROOT / "models" / "tiny"),
                   help="checkpoint (default: models/tiny, the 5.5M test model "
                   "bench/RESULTS.md's figures were taken on)")
    args = p.parse_args()
    print(machine_line())
    print(f"# task: {len(SCRIPT)} scripted turns (actions teacher-forced, thoughts greedy, "
          f"up to {args.max_new_tokens} tokens or a newline); {args.repeat} runs each")
    with tempfile.TemporaryDirectory(prefix="bench-agent-") as tmp:
        root = Path(tmp) / "root"
        root.mkdir()
        for name, text in FILES.items():
            (root / name).write_text(text)
        script = Path(tmp) / "task.jsonl"
        script.write_text("".join(json.dumps({"action": a, "input": i}) + "\n"
                                  for a, i in SCRIPT))
        with KernelDaemon(Path(tmp), "k", ["--model", args.model]) as kernel:
            sides = {"kept": [], "resent": ["--resend"]}
            for extra in sides.values():  # warm the kernel up
                run_agent(kernel.socket, root, script, args, *extra)
            runs: dict[str, list[dict]] = {name: [] for name in sides}
            for _ in range(args.repeat):
                for name, extra in sides.items():
                    runs[name].append(run_agent(kernel.socket, root, script, args, *extra))
    kept, resent = runs["kept"][0], runs["resent"][0]
    same = all([t["thought"] for t in a["turns"]] == [t["thought"] for t in kept["turns"]]
               for a in runs["kept"] + runs["resent"])
    print(f"# conversation: {kept['conversation_tokens']} tokens "
          f"({kept['forced_tokens']} forced: preamble, question, actions, observations; "
          f"{kept['generated_tokens']} generated); the same in every run: {same}; "
          f"answer: {kept['answer']}")
    header("kept", "resent")
    for field, unit in (("prefill_tokens", "tokens"), ("computed_tokens", "tokens"),
                        ("accel_seconds", "s"), ("wall_s", "s")):
        row(field.replace("_", " "), unit, [r[field] for r in runs["kept"]],
            [r[field] for r in runs["resent"]], True, "lower")
    saved = resent["prefill_tokens"] - kept["prefill_tokens"]
    print(f"  prefill saved by keeping the KV file: {saved} tokens "
          f"({resent['prefill_tokens'] / kept['prefill_tokens']:.1f}x fewer)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
