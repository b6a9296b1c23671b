"""EleutherAI's lm-eval through `symphony serve` against lm-eval's own Hugging Face backend
on the same checkpoint (issue 29): the same per-item log-likelihoods and generations.

lm-eval runs as a user runs it (its command line, `python -m lm_eval`), on three small
local tasks (JSONL in bench/lm_eval_tasks/, YAML written here; no hub):

- symphony_mc: multiple choice (8 questions of 4 choices: loglikelihood, acc, acc_norm);
- symphony_rolling: rolling perplexity of 4 standard-library docstrings, one past the
  model's 1024-token context (loglikelihood_rolling: windows of max_length tokens after
  the prefix token, BOS);
- symphony_gen: generate_until, greedy, until a blank line, 32 tokens at most.

The runs: `hf` (the reference, float32 on the CPU) at batch sizes 1 and 4;
`local-completions` (POST /v1/completions with token-id prompts, lm-eval's own tokenizer:
a batch is an array of token-id arrays; scoring is echo + logprobs + max_tokens 1) at batch
sizes 1 and 4, and at batch size 1 with num_concurrent 8; `local-chat-completions` (POST
/v1/chat/completions, text messages: generate_until only, as lm-eval allows) against `hf`
with --apply_chat_template. Every run has add_bos_token=True, so both sides score the
same token ids, and hf has max_length=1022: lm-eval's API models keep one token of
max_length (1024, the model's context) for the one they generate and cut rolling windows
of one less again (1022 tokens scored in a request of 1023 + 1), its hf model windows of
max_length, so the windows are the same. Each API run's per-item results are compared
with the reference's: log-likelihoods (largest difference), is_greedy flags and generated
texts (how many equal).

    python bench/lm_eval_serve.py [--model models/tiny] [--limit N] [--out DIR]
        [--only hf1,hf4,cmpl1,cmpl4,cmpl1c8,chat1,chat4]

Prints the commands, wall times and a comparison in markdown (for bench/RESULTS.md).
Needs `pip install 'lm-eval[api]'` (0.4.13 here). Starts its own kernel (`symphony
start`, --kv-pages 1024) and `symphony serve` (no API key), in a temporary directory, and
stops both.
"""

from __future__ import annotations

import argparse
import datetime
import glob
import json
import os
import platform
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TASKS = ROOT / "bench" / "lm_eval_tasks"
TASK_NAMES = ("symphony_mc", "symphony_rolling", "symphony_gen")

YAML = {
    "symphony_mc": """task: symphony_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}/symphony_mc.jsonl
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
target_delimiter: ""
metric_list:
  - metric: acc
  - metric: acc_norm
""",
    "symphony_rolling": """task: symphony_rolling
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}/symphony_rolling.jsonl
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
metric_list:
  - metric: word_perplexity
  - metric: byte_perplexity
  - metric: bits_per_byte
""",
    "symphony_gen": """task: symphony_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}/symphony_gen.jsonl
test_split: test
output_type: generate_until
doc_to_text: "{{{{prompt}}}}"
doc_to_target: "{{{{target}}}}"
generation_kwargs:
  until: ["\\n\\n"]
  max_gen_toks: 32
  do_sample: false
  temperature: 0
metric_list:
  - metric: exact_match
""",
}


def write_tasks(directory: Path) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    for name, text in YAML.items():
        (directory / f"{name}.yaml").write_text(text.format(data=TASKS))


class Served:
    """A kernel on the model and `symphony serve` on it; both stopped on leaving."""

    def __init__(self, tmp: Path, model: str):
        self.tmp, self.model = tmp, model
        self.socket = tmp / "k.sock"
        self.url = ""
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> Served:
        cli = [sys.executable, "-m", "symphony.cli"]
        r = subprocess.run([*cli, "start", "--socket", str(self.socket), "--state-dir",
                            str(self.tmp / "state"), "--model", self.model, "--device", "cpu",
                            "--kv-pages", "1024"], capture_output=True, text=True, cwd=ROOT)
        if r.returncode != 0:
            raise RuntimeError(f"symphony start failed: {r.stderr.strip()}")
        log = open(self.tmp / "serve.log", "ab")  # noqa: SIM115 (the server's, till it ends)
        self.proc = subprocess.Popen([*cli, "serve", "--socket", str(self.socket), "--port",
                                      "0"], stdout=subprocess.PIPE, stderr=log, text=True,
                                     cwd=ROOT, env={k: v for k, v in os.environ.items()
                                                    if k != "SYMPHONY_API_KEY"})
        line = self.proc.stdout.readline()
        m = re.match(r"symphony serve: listening on (http://\S+)", line)
        if not m:
            self.__exit__()
            raise RuntimeError(f"symphony serve did not start: {line!r}")
        self.url = m.group(1)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(60)
        subprocess.run([sys.executable, "-m", "symphony.cli", "stop", "--socket",
                        str(self.socket)], capture_output=True, text=True, cwd=ROOT)


def runs(model: str, url: str, name: str) -> dict[str, tuple[str, str, int, tuple[str, ...],
                                                          list[str], str]]:
    """label: (lm-eval model, model_args, batch size, tasks, more flags, reference)."""
    # lm-eval's API models keep a token of max_length for the one they generate (1023 of
    # 1024) and cut rolling windows of one less again (1022 tokens scored a request of
    # 1023), its hf model windows of max_length: hf's max_length=1022 makes them the same.
    hf = f"pretrained={model},dtype=float32,add_bos_token=True,max_length=1022"
    api = (f"model={name},tokenizer_backend=huggingface,tokenizer={model},max_length=1024,"
           f"add_bos_token=True,max_retries=1,timeout=600")
    cmpl = f"base_url={url}/v1/completions,{api}"
    chat = f"base_url={url}/v1/chat/completions,model={name},max_retries=1,timeout=600"
    every, gen, tmpl = TASK_NAMES, ("symphony_gen",), ["--apply_chat_template"]
    return {
        "hf1": ("hf", hf, 1, every, ["--device", "cpu"], ""),
        "hf4": ("hf", hf, 4, every, ["--device", "cpu"], "hf1"),
        "cmpl1": ("local-completions", cmpl + ",num_concurrent=1", 1, every, [], "hf1"),
        "cmpl4": ("local-completions", cmpl + ",num_concurrent=1", 4, every, [], "hf1"),
        "cmpl1c8": ("local-completions", cmpl + ",num_concurrent=8", 1, every, [], "hf1"),
        "hfchat": ("hf", hf, 1, gen, ["--device", "cpu", *tmpl], ""),
        "chat1": ("local-chat-completions", chat + ",num_concurrent=1", 1, gen, tmpl,
                  "hfchat"),
        "chat4": ("local-chat-completions", chat + ",num_concurrent=1", 4, gen, tmpl,
                  "hfchat"),
    }


def lm_eval(label: str, spec: tuple, out: Path, tasks_dir: Path, limit: int | None
            ) -> tuple[list[str], float, int, str]:
    model, args, batch, tasks, more, _ = spec
    cmd = [sys.executable, "-m", "lm_eval", "--model", model, "--model_args", args,
           "--tasks", ",".join(tasks), "--include_path", str(tasks_dir), "--batch_size",
           str(batch), "--log_samples", "--output_path", str(out / label), "--seed", "1234",
           *more, *(["--limit", str(limit)] if limit else [])]
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1", "OPENAI_API_KEY": "none", "TOKENIZERS_PARALLELISM":
           "false"}
    start = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    (out / f"{label}.log").write_text(r.stdout + r.stderr)
    return cmd, time.perf_counter() - start, r.returncode, (r.stdout + r.stderr)[-3000:]


def samples(out: Path, label: str, task: str) -> dict[int, list]:
    """doc_id: its filtered responses."""
    files = sorted(glob.glob(str(out / label / "**" / f"samples_{task}_*.jsonl"),
                             recursive=True))
    if not files:
        return {}
    result = {}
    for line in Path(files[-1]).read_text().splitlines():
        s = json.loads(line)
        result[s["doc_id"]] = s["filtered_resps"]
    return result


def metrics(out: Path, label: str) -> dict[str, dict[str, float]]:
    files = sorted(glob.glob(str(out / label / "**" / "results_*.json"), recursive=True))
    if not files:
        return {}
    res = json.loads(Path(files[-1]).read_text())["results"]
    return {task: {k.split(",")[0]: v for k, v in vals.items()
                   if isinstance(v, float) and "stderr" not in k} for task, vals in res.items()}


def compare(out: Path, label: str, ref: str, tasks: tuple[str, ...]) -> list[str]:
    """Markdown rows: per task, what agrees with the reference."""
    rows = []
    for task in tasks:
        a, b = samples(out, label, task), samples(out, ref, task)
        if not a or not b:
            rows.append(f"| {label} | {task} | missing samples |")
            continue
        if task == "symphony_gen":
            same = sum(a[d] == b[d] for d in b)
            rows.append(f"| {label} | {task} | {same} of {len(b)} greedy generations "
                        f"identical |")
            continue
        diffs, greedy, n = [], 0, 0
        for d in b:
            for x, y in zip(a[d], b[d], strict=True):
                lx, ly = (x[0], y[0]) if isinstance(x, list) else (x, y)
                diffs.append(abs(float(lx) - float(ly)))
                if isinstance(x, list):
                    greedy += bool(x[1]) == bool(y[1])
                n += 1
        if task == "symphony_mc":
            rows.append(f"| {label} | {task} | {n} log-likelihoods (question, choice), "
                        f"largest difference {max(diffs):.2e}; {greedy} of {n} is_greedy "
                        f"equal |")
        else:
            rows.append(f"| {label} | {task} | {n} documents' log-likelihoods (each the sum "
                        f"over its windows), largest difference {max(diffs):.2e} |")
    return rows


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import lm_eval
    import torch

    return (f"{cpu}, {os.cpu_count()} cores, CPU only; torch {torch.__version__}, "
            f"lm-eval {lm_eval.__version__}; "
            f"{datetime.datetime.now().isoformat(timespec='seconds')}; load average "
            f"{os.getloadavg()[0]:.2f}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="models/tiny", help="checkpoint directory "
                    "(transformers' and the kernel's; default %(default)s)")
    ap.add_argument("--limit", type=int, help="documents per task (default: all)")
    ap.add_argument("--out", type=Path, help="where lm-eval writes (default: a temporary "
                    "directory)")
    ap.add_argument("--only", default="hf1,hf4,cmpl1,cmpl4,cmpl1c8,hfchat,chat1,chat4",
                    help="which runs (default: all)")
    a = ap.parse_args()
    model = str((ROOT / a.model).resolve()) if not Path(a.model).is_absolute() else a.model
    out = a.out or Path(tempfile.mkdtemp(prefix="lm-eval-serve-"))
    out.mkdir(parents=True, exist_ok=True)
    tasks_dir = out / "tasks"
    write_tasks(tasks_dir)
    print(f"# machine: {machine()}")
    with Served(out, model) as served:
        with urllib.request.urlopen(served.url + "/v1/models") as r:
            name = json.load(r)["data"][0]["id"]
        specs = runs(model, served.url, name)
        order: list[str] = []
        for label in (x for x in a.only.split(",") if x):
            ref = specs[label][5]
            order += [x for x in (ref, label) if x and x not in order]  # the reference first
        done: dict[str, tuple[list[str], float, int]] = {}
        for label in order:
            spec = specs[label]
            cmd, wall, rc, tail = lm_eval(label, spec, out, tasks_dir, a.limit)
            done[label] = (cmd, wall, rc)
            shown = " ".join(shlex.quote(c) for c in cmd[1:]).replace(str(out), "$OUT")
            print(f"\n{label}: exit {rc}, {wall:.0f} s\n    python {shown}", flush=True)
            if rc != 0:
                print(tail)
    print("\n| run | task | per item, against the reference (hf1; hfchat for chat) |\n"
          "|---|---|---|")
    for label, (_, _, rc) in done.items():
        ref = specs[label][5]
        if rc == 0 and ref and done.get(ref, (None, None, 1))[2] == 0:
            for row in compare(out, label, ref, specs[label][3]):
                print(row)
    print("\n| run | exit | wall s | metrics |\n|---|---|---|---|")
    for label, (_, wall, rc) in done.items():
        shown = "; ".join(f"{task}: " + ", ".join(f"{k} {v:.4g}" for k, v in vals.items())
                          for task, vals in metrics(out, label).items())
        print(f"| {label} | {rc} | {wall:.0f} | {shown} |")
    print(f"\n(lm-eval's outputs: {out})")
    return 0 if all(rc == 0 for _, _, rc in done.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
