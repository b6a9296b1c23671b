"""Decode attention's memory bandwidth against a plain copy on the same device, in one run.

Decode attention reads every K and V row of every sequence once and does little arithmetic
on it, so its ceiling is the memory system: the figure that matters is its achieved bytes/s
as a fraction of what a device-to-device copy (`Tensor.copy_`) reaches. Target on a GPU:
at least 70%.

On CUDA it times the Triton kernel (bf16); on the CPU the C kernel (fp32), both against
the torch reference for scale. Bytes counted: K and V of every attended row, the queries
and the output; a copy moves its buffer's bytes twice (read and write).

    python bench/kernels.py [--batch 64] [--context 4096] [--q-heads 32] [--kv-heads 8]
                            [--head-dim 128] [--page-size 16] [--repeat 20]
"""

from __future__ import annotations

import argparse
import platform
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Run as a script, this file's folder comes first on sys.path, and this file's name would then
# hide the project's `kernels` package; the repository root lets `bench.timing` be imported.
sys.path = [str(ROOT)] + [p for p in sys.path if Path(p or ".").resolve() != ROOT / "bench"]

import torch  # noqa: E402

from bench.timing import timed  # noqa: E402
from kernels import decode_attention, decode_attention_ref  # noqa: E402
from kernels.paged_cpu import decode_attention_c  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--q-heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--skip-ref", action="store_true", help="do not time the torch reference")
    args = ap.parse_args()

    cuda = torch.cuda.is_available()
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    b, n, size = args.batch, args.context, args.page_size
    pages_per_seq = -(-n // size)
    shape = (b * pages_per_seq, size, args.kv_heads, args.head_dim)
    k_cache = torch.empty(shape, dtype=dtype, device=device).uniform_(-1, 1)
    v_cache = torch.empty(shape, dtype=dtype, device=device).uniform_(-1, 1)
    # Every sequence owns its pages, in shuffled order: no two sequences share a byte.
    table = torch.randperm(b * pages_per_seq, device=device).view(b, pages_per_seq)
    table = table.to(torch.int32)
    kv_lens = torch.full((b,), n, dtype=torch.int32, device=device)
    q = torch.randn(b, args.q_heads, args.head_dim, dtype=dtype, device=device)
    scale = args.head_dim**-0.5
    call = (q, k_cache, v_cache, table, kv_lens, None, scale)

    kernel = (lambda: decode_attention(*call)) if cuda else (lambda: decode_attention_c(*call))
    name = "Triton decode_attention" if cuda else "C decode_attention_c"
    elem = k_cache.element_size()
    attn_bytes = 2 * b * n * args.kv_heads * args.head_dim * elem + 2 * q.numel() * elem
    buffer = torch.empty(attn_bytes // elem, dtype=dtype, device=device).uniform_(-1, 1)
    target = torch.empty_like(buffer)

    t_copy = timed(lambda: target.copy_(buffer), args.repeat, cuda)
    t_kernel = timed(kernel, args.repeat, cuda)
    copy_bw, kernel_bw = 2 * attn_bytes / t_copy, attn_bytes / t_kernel

    where = torch.cuda.get_device_name() if cuda else platform.processor() or platform.machine()
    print(f"# {device} ({where}, "
          f"{torch.get_num_threads()} threads), {dtype}; batch {b}, context {n}, "
          f"{args.q_heads} q heads / {args.kv_heads} kv heads x {args.head_dim}, "
          f"page size {size}; best of {args.repeat}")
    print(f"{'what':<28}{'ms':>10}{'GB/s':>10}{'of copy':>10}")
    print(f"{'copy_ (read + write)':<28}{t_copy * 1e3:>10.3f}{copy_bw / 1e9:>10.1f}{1:>9.2f}x")
    print(f"{name:<28}{t_kernel * 1e3:>10.3f}{kernel_bw / 1e9:>10.1f}"
          f"{kernel_bw / copy_bw:>9.2f}x")
    if not args.skip_ref:
        t_ref = timed(lambda: decode_attention_ref(*call), max(2, args.repeat // 5), cuda)
        print(f"{'torch reference':<28}{t_ref * 1e3:>10.3f}{attn_bytes / t_ref / 1e9:>10.1f}"
              f"{attn_bytes / t_ref / copy_bw:>9.2f}x")
    out = kernel()
    want = decode_attention_ref(q[:2].float(), k_cache.float(), v_cache.float(), table[:2],
                                kv_lens[:2], None, scale)
    err = ((out[:2].float() - want).abs().max() / want.abs().max()).item()
    print(f"relative error of the first two sequences against the fp32 reference: {err:.1e}")


if __name__ == "__main__":
    main()
