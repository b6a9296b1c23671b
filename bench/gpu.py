"""The GPU run in one command (issue 31): install what the image lacks, then each check in a
step of its own, with its own time limit, its results written to OUT_DIR as it goes.

    bench/gpu.sh OUT_DIR             # on a CUDA machine: about 10 minutes on one H100
    bench/gpu.sh --dry-run OUT_DIR   # here: every step the CPU can run, at tiny sizes

Steps: wheels (install from bench/gpu-wheels/, `make gpu-wheels` fills it; the dry run checks
its manifest), api (tests/test_gpu_api.py: the torch/Triton names the GPU path touches),
kernels (tests/test_kernels.py: compiled on CUDA, fp32/fp16/bf16; interpreted in the dry run),
parity (tests/test_gpu_parity.py: the engine against transformers on the device;
tests/test_cuda_graphs.py: decode steps replayed from CUDA graphs against eager ones), daemon
(tests/test_kernel.py, test_crash.py, test_step_wire.py: a daemon on the device, CUDA IPC
of the KV pool, complete.py equal to generate, 16 concurrent LIPs, a killed LIP leaking
nothing, a dead engine process stopping the kernel), then bench/kernels.py and
bench/prefill_kernels.py, bench/engine.py (on a random Llama of Llama-3.2-1B's shape, our
decode with and without CUDA graphs) and bench/kernel.py, and a summary table printed last
(also OUT_DIR/summary.txt).

A step that fails or hangs costs only itself: it runs in a process group of its own, killed
at its limit. Each step's output is OUT_DIR/NN-step.log, pytest's OUT_DIR/step.xml, and a
line per step goes to OUT_DIR/results.jsonl when it ends. Exit status: 0 when every step
passed (or was skipped), 1 otherwise.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shlex
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WHEELS = ROOT / "bench" / "gpu-wheels"
MANIFEST = "MANIFEST.tsv"  # name, version, sha256, file: tab-separated, one wheel a line
# What the GPU image cannot take from a wheel: pyfuse3 links libfuse3, which it lacks.
SKIPPED = ("pyfuse3",)
LOCK = threading.Lock()


@dataclass
class Step:
    name: str
    limit: float  # seconds
    argv: list[str] | None  # None: run in this process (fn)
    env: dict[str, str] | None = None
    fn: object = None


def pytest_argv(out: Path, tag: str, *args: str) -> list[str]:
    return [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o",
            "addopts=", f"--junitxml={out / (tag + '.xml')}", *args]


def steps(dry: bool, out: Path) -> list[Step]:
    """The steps in order. On the GPU their limits add up to under 10 minutes (595 s), so
    that the run fits one H100 session even where every step hangs."""
    py = sys.executable
    model_env = {"SYMPHONY_MODEL": str(ROOT / "models" / "tiny")}
    s = [Step("wheels", 30 if dry else 40, None, fn=check_wheels if dry else install_wheels)]
    s.append(Step("api", 45 if dry else 30, pytest_argv(out, "api", "tests/test_gpu_api.py")))
    if dry:  # the Triton interpreter: a few cases, small
        kernels = pytest_argv(out, "kernels", *(
            f"tests/test_kernels.py::test_{t}" for t in (
                "store_kv[dtype0-16]", "prefill_attention[dtype0-8-1-24-16]",  # excluded ranges
                "decode_attention[dtype0-8-1-24-16]", "prefill_attention_tree[dtype0]")))
        # The graphs' static-buffer step on the interpreted Triton kernels; the suite has the rest.
        parity = pytest_argv(out, "parity", "tests/test_gpu_parity.py", "tests/test_cuda_graphs.py",
                             "-k", "fp32 and llama] or cuda_graphs and triton")
        daemon = pytest_argv(out, "daemon", "tests/test_kernel.py", "-k",
                             "killed_lip_leaks_nothing and sigkill")
    else:
        kernels = pytest_argv(out, "kernels", "tests/test_kernels.py")
        # (tests/test_engine_parity.py holds the CPU's paths: it has no CUDA case to run.)
        parity = pytest_argv(out, "parity", "tests/test_gpu_parity.py", *(
            f"tests/test_cuda_graphs.py::test_{t}" for t in (  # the rest is the CPU's
                "a_padded_static_step_gives_the_normal_paths_logits_and_kv",
                "replayed_graphs_give_the_normal_paths_logits_and_kv",
                "a_step_that_cannot_be_captured_runs_eagerly",
                "greedy_decoding_is_the_same_with_and_without_graphs")))
        daemon = pytest_argv(
            out, "daemon", "tests/test_step_wire.py",
            "tests/test_kernel.py::test_complete_equals_generate",
            "tests/test_kernel.py::test_sixteen_concurrent_lips_get_what_they_get_alone",
            "tests/test_kernel.py::test_killed_lip_leaks_nothing",
            "tests/test_crash.py::test_a_dead_engine_process_stops_the_kernel_and_loses_no_saved_file",
            "tests/test_crash.py::test_a_killed_kernel_takes_its_engine_process_with_it")
    # The dry run's limits are about twice its steps' times on a 2-core machine that others
    # load (50-60 s in all, three steps at a time).
    s += [Step("kernels", 60 if dry else 90, kernels),
          Step("parity", 75 if dry else 60, parity),
          Step("daemon", 90 if dry else 110, daemon)]
    if dry:
        s += [
            Step("bench-kernels", 45, shell(
                [py, "bench/kernels.py", "--batch", "2", "--context", "64", "--q-heads", "4",
                 "--kv-heads", "2", "--head-dim", "32", "--repeat", "1"],
                [py, "bench/prefill_kernels.py", "--batch", "2", "--seq", "40", "--q-heads",
                 "4", "--kv-heads", "2", "--head-dim", "32", "--repeat", "1"])),
            Step("bench-engine", 60, shell(
                [py, "bench/gpu.py", "--make-llama", "tiny", str(out / "llama-tiny")],
                [py, "bench/engine.py", "--model", str(out / "llama-tiny"), "--batches", "1",
                 "--prompt-len", "8", "--new-tokens", "3", "--prefill-len", "16",
                 "--prefill-batch", "1", "--repeat", "1", "--cuda-graphs", "both"])),
            # The pred path on the simulated accelerator: the kernel's own path, in seconds.
            Step("bench-kernel", 60, [py, "bench/kernel.py", "--only", "path", "--path-lips", "1",
                                      "--path-preds", "16", "--path-asyncio", "1x2",
                                      "--path-engine", "sleep:1", "--repeat", "1"], model_env),
        ]
    else:
        s += [
            # Decode against a copy (batch 64, 4k contexts), prefill against SDPA (4 x 2k).
            Step("bench-kernels", 45, shell([py, "bench/kernels.py", "--repeat", "10"],
                                            [py, "bench/prefill_kernels.py", "--repeat", "10"])),
            # A random Llama of Llama-3.2-1B's shape in bf16 (2.5 GB, made on the GPU).
            Step("bench-engine", 130, shell(
                [py, "bench/gpu.py", "--make-llama", "1b", str(out / "llama-1b")],
                [py, "bench/engine.py", "--model", str(out / "llama-1b"), "--batches",
                 "1,32,128", "--new-tokens", "32", "--prefill-len", "2048",
                 "--prefill-batch", "1", "--repeat", "2", "--cuda-graphs", "both"],
                ["rm", "-rf", str(out / "llama-1b")])),  # not to come back with OUT_DIR
            Step("bench-kernel", 90, [py, "bench/kernel.py", "--only", "tax,batch,path",
                                       "--repeat", "2", "--tokens", "32", "--path-lips", "1,32",
                                       "--path-preds", "1024", "--batch-modes", "procs,asyncio"],
                 model_env),
        ]
    return s


def shell(*argvs: list[str]) -> list[str]:
    """Commands run one after another in one step, stopping at the first that fails."""
    return ["sh", "-c", " && ".join(shlex.join(a) for a in argvs)]


LLAMA_SHAPES = {
    "tiny": dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096),
    # Llama-3.2-1B's.
    "1b": dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192,
               num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
               max_position_embeddings=131072, rope_theta=500000.0,
               rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                             "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
}


def make_llama(shape: str, out: Path) -> None:
    """A random-weight Llama of `shape` in bf16 (fp32 on the CPU), made on the GPU where
    there is one (a 1B model's init takes minutes on a CPU)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cuda = torch.cuda.is_available()
    dtype = torch.bfloat16 if cuda else torch.float32
    torch.manual_seed(0)
    cfg = LlamaConfig(**LLAMA_SHAPES[shape], tie_word_embeddings=True, bos_token_id=1,
                      eos_token_id=2)
    with torch.device("cuda" if cuda else "cpu"):
        model = LlamaForCausalLM(cfg).to(dtype)
    model.save_pretrained(out)
    print(f"{shape}: {sum(p.numel() for p in model.parameters()) / 1e9:.2f} B parameters, "
          f"{dtype}, in {out}")


def read_manifest(folder: Path) -> list[dict[str, str]]:
    """The manifest's rows; raises ValueError on a malformed one or a wheel that disagrees."""
    rows = []
    for n, line in enumerate((folder / MANIFEST).read_text().splitlines(), 1):
        if not line.strip() or line.startswith("#"):
            continue
        fields = line.split("\t")
        if len(fields) != 4:
            raise ValueError(f"{MANIFEST}:{n}: want name, version, sha256, file: {line!r}")
        name, version, sha, file = fields
        if len(sha) != 64 or any(c not in "0123456789abcdef" for c in sha):
            raise ValueError(f"{MANIFEST}:{n}: not a sha256: {sha!r}")
        if not file.endswith(".whl"):
            raise ValueError(f"{MANIFEST}:{n}: not a wheel: {file!r}")
        path = folder / file
        if not path.is_file():
            raise ValueError(f"{MANIFEST}:{n}: {file} is missing")
        if hashlib.sha256(path.read_bytes()).hexdigest() != sha:
            raise ValueError(f"{MANIFEST}:{n}: {file}'s sha256 differs")
        rows.append(dict(name=name, version=version, sha256=sha, file=file))
    return rows


def check_wheels(log) -> tuple[str, str]:
    if not (WHEELS / MANIFEST).exists():
        return "skip", f"no {WHEELS.relative_to(ROOT)}/{MANIFEST} (make gpu-wheels fills it)"
    rows = read_manifest(WHEELS)
    size = sum((WHEELS / r["file"]).stat().st_size for r in rows)
    for r in rows:
        print(r["name"], r["version"], r["file"], file=log)
    if size > 64 << 20:
        raise ValueError(f"the wheels take {size / 2**20:.1f} MiB, over 64")
    return "pass", f"{len(rows)} wheels, {size / 2**20:.1f} MiB, manifest and hashes agree"


def installed(name: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def install_wheels(log) -> tuple[str, str]:
    """The wheels the image lacks (one already there is kept: the image's own come first),
    then the project itself with --no-deps over the image's torch."""
    notes = []
    if (WHEELS / MANIFEST).exists():
        rows = [r for r in read_manifest(WHEELS) if r["name"] not in SKIPPED]
        want = [r for r in rows if installed(r["name"]) is None]
        if want:
            run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index",
                 *[str(WHEELS / r["file"]) for r in want]], log)
        notes.append(f"{len(want)} installed, {len(rows) - len(want)} already there")
    else:
        notes.append("no wheel folder")
    # Always: an egg-info left in the tree would pass for an installed project.
    try:
        run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index",
             "--no-build-isolation", "-e", str(ROOT)], log)
        notes.append("project installed")
    except subprocess.CalledProcessError:  # no setuptools there: the steps' PYTHONPATH does
        notes.append("project not installed: run from the tree (PYTHONPATH)")
    missing = [m for m in ("llguidance", "fastapi", "uvicorn", "prometheus_client", "gguf",
                           "hypothesis", "pytest", "transformers", "triton")
               if subprocess.run([sys.executable, "-c", f"import {m}"], stdout=log,
                                 stderr=log).returncode]
    notes.append(f"skipped by name: {', '.join(SKIPPED)}")
    if missing:
        return "fail", "; ".join(notes + [f"cannot import {', '.join(missing)}"])
    return "pass", "; ".join(notes)


def run(argv: list[str], log) -> None:
    print("$", " ".join(argv), file=log, flush=True)
    subprocess.run(argv, stdout=log, stderr=log, check=True, cwd=ROOT)


def run_step(step: Step, n: int, out: Path, base_env: dict[str, str]) -> dict:
    tag = f"{n:02d}-{step.name}"
    log_path = out / f"{tag}.log"
    t0 = time.monotonic()
    with open(log_path, "w") as log:
        if step.fn is not None:
            try:
                status, note = step.fn(log)
            except Exception as e:  # noqa: BLE001  (a step's failure is its result)
                status, note = "fail", f"{type(e).__name__}: {e}"
                print(note, file=log)
        else:
            print("$", " ".join(step.argv), file=log, flush=True)
            proc = subprocess.Popen(step.argv, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True,
                                    env={**base_env, **(step.env or {})})
            try:
                rc = proc.wait(step.limit)
                status = "pass" if rc == 0 else "fail"
                note = f"exit {rc}"
            except subprocess.TimeoutExpired:
                status, note = "timeout", f"killed at {step.limit:.0f} s"
            finally:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)  # daemons and LIPs it left
                except ProcessLookupError:
                    pass
                proc.wait()
    secs = time.monotonic() - t0
    if step.fn is None:
        note = f"{note}; {last_line(log_path)}"
    result = dict(n=n, step=step.name, status=status, seconds=round(secs, 1), limit=step.limit,
                  note=note, log=log_path.name)
    with LOCK, open(out / "results.jsonl", "a") as f:
        f.write(json.dumps(result) + "\n")
    print(f"[{tag}] {status} in {secs:.1f} s: {note}", flush=True)
    return result


def last_line(path: Path) -> str:
    lines = [ln.strip() for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
    return lines[-1][:160] if lines else ""


def summary(results: list[dict], header: str, wall: float) -> str:
    rows = [header, f"{'step':<14} {'status':<8} {'secs':>7} {'limit':>6}  note",
            "-" * 100]
    for r in results:
        rows.append(f"{r['step']:<14} {r['status']:<8} {r['seconds']:>7.1f} {r['limit']:>6.0f}"
                    f"  {r['note'][:140]}")
    bad = [r["step"] for r in results if r["status"] not in ("pass", "skip")]
    rows.append("-" * 100)
    rows.append(f"{wall:.1f} s in all; " + (f"FAILED: {', '.join(bad)}" if bad else "all passed"))
    return "\n".join(rows)


def main() -> int:
    if sys.argv[1:2] == ["--make-llama"]:  # a step's helper: --make-llama SHAPE DIR
        make_llama(sys.argv[2], Path(sys.argv[3]))
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path, help="folder for the logs and results (made if absent)")
    ap.add_argument("--dry-run", action="store_true",
                    help="on the CPU: the kernels interpreted, tiny sizes, the manifest checked")
    ap.add_argument("--only", help="a comma-separated subset of the steps")
    ap.add_argument("--jobs", type=int, help="steps run at once (default: 1 on the GPU, whose "
                    "timings must not overlap; 3 in the dry run, mostly waits on a small CPU)")
    args = ap.parse_args()
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.jsonl").unlink(missing_ok=True)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    import torch

    cuda = torch.cuda.is_available()
    if args.dry_run:
        env["TRITON_INTERPRET"] = "1"
        env["SYMPHONY_TEST_DEVICE"] = "cpu"
        env["CUDA_VISIBLE_DEVICES"] = ""  # the CPU, even where a GPU is
    elif not cuda:
        print("no CUDA device: use --dry-run", file=sys.stderr)
        return 2
    else:
        env.pop("TRITON_INTERPRET", None)
    device = torch.cuda.get_device_name(0) if cuda and not args.dry_run else platform.processor()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, text=True,
                            capture_output=True).stdout.strip() or "?"
    header = (f"bench/gpu.py{' --dry-run' if args.dry_run else ''} on {device or 'cpu'}, "
              f"torch {torch.__version__}, python {platform.python_version()}, commit {commit}, "
              f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    print(header, flush=True)
    chosen = steps(args.dry_run, out)
    if args.only:
        keep = set(args.only.split(","))
        unknown = keep - {s.name for s in chosen}
        if unknown:
            print(f"--only: no step {', '.join(sorted(unknown))} (the steps: "
                  f"{', '.join(s.name for s in chosen)})", file=sys.stderr)
            return 2
        chosen = [s for s in chosen if s.name in keep]
    jobs = args.jobs or (3 if args.dry_run else 1)
    t0 = time.monotonic()
    numbered = list(enumerate(chosen, 1))
    if jobs > 1:  # the longest first, so that it does not start last (the wheels still first)
        numbered.sort(key=lambda ns: (ns[1].name != "wheels", -ns[1].limit))
    with ThreadPoolExecutor(jobs) as pool:
        futures = {n: pool.submit(run_step, s, n, out, env) for n, s in numbered}
        results = [futures[n].result() for n in sorted(futures)]  # the steps' order
    table = summary(results, header, time.monotonic() - t0)
    (out / "summary.txt").write_text(table + "\n")
    print("\n" + table)
    return 0 if all(r["status"] in ("pass", "skip") for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
