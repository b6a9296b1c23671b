"""Prefill attention against torch's scaled_dot_product_attention on the same shapes, in one run.

A prefill's attention is compute-bound: the figure is time against SDPA (flash on a GPU, where
torch picks it) on the same causal queries, keys and values, SDPA reading them contiguous and
the Triton kernel from the paged pool. Target on a GPU (issue 31): at least 0.7x of SDPA.
Without CUDA the Triton kernel runs interpreted (TRITON_INTERPRET=1, set here when absent), so
sizes must stay tiny there: that run checks the script, not speed.

    python bench/prefill_kernels.py [--batch 4] [--seq 2048] [--q-heads 32] [--kv-heads 8]
                                    [--head-dim 128] [--page-size 16] [--repeat 10]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Run as a script, this file's folder comes first on sys.path, and bench/kernels.py would then
# hide the project's `kernels` package; the repository root lets `bench.timing` be imported.
sys.path = [str(ROOT)] + [p for p in sys.path if Path(p or ".").resolve() != ROOT / "bench"]

import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton loads

from bench.timing import timed  # noqa: E402
from kernels import prefill_attention  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--q-heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--repeat", type=int, default=10)
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    dtype = torch.bfloat16 if cuda else torch.float32
    b, n, hq, hkv, d, size = (args.batch, args.seq, args.q_heads, args.kv_heads, args.head_dim,
                              args.page_size)
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(b, n, hq, d, generator=gen).to(dtype).to(device)
    k = torch.randn(b, n, hkv, d, generator=gen).to(dtype).to(device)
    v = torch.randn(b, n, hkv, d, generator=gen).to(dtype).to(device)

    # The pool: each sequence's rows on pages in a shuffled order.
    pages = -(-n // size)
    perm = torch.randperm(b * pages, generator=gen)
    table = perm.view(b, pages).to(torch.int32).to(device)
    k_cache = torch.zeros(b * pages, size, hkv, d, dtype=dtype, device=device)
    v_cache = torch.zeros_like(k_cache)
    rows = torch.arange(n, device=device)
    for i in range(b):
        page, slot = table[i].long()[rows // size], rows % size
        k_cache[page, slot], v_cache[page, slot] = k[i], v[i]
    q_flat = q.reshape(b * n, hq, d)
    q_start = torch.arange(0, b * n + 1, n, dtype=torch.int32, device=device)
    kv_lens = torch.full((b,), n, dtype=torch.int32, device=device)
    scale = d**-0.5

    def ours():
        return prefill_attention(q_flat, k_cache, v_cache, table, q_start, kv_lens, None,
                                 scale, n)

    # SDPA on contiguous [B, H, N, D], K and V repeated to the query heads beforehand.
    qs = q.transpose(1, 2).contiguous()
    ks = k.repeat_interleave(hq // hkv, dim=2).transpose(1, 2).contiguous()
    vs = v.repeat_interleave(hq // hkv, dim=2).transpose(1, 2).contiguous()
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def theirs():
        return sdpa(qs, ks, vs, is_causal=True, scale=scale)

    backend = "default"
    if cuda:
        try:
            from torch.nn.attention import SDPBackend, sdpa_kernel

            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                theirs()
            plain = theirs

            def theirs():  # noqa: F811  (flash, where it takes these shapes)
                with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                    return plain()

            backend = "flash"
        except (ImportError, RuntimeError) as e:
            backend = f"default ({type(e).__name__})"

    t_ours = timed(ours, args.repeat, cuda)
    t_theirs = timed(theirs, args.repeat, cuda)
    flops = 2 * b * hq * n * n * d  # causal: half of 4 B H N^2 D
    where = torch.cuda.get_device_name() if cuda else "cpu (Triton interpreted)"
    print(f"# {where}, {dtype}; batch {b} x {n} tokens, {hq} q heads / {hkv} kv heads x {d}, "
          f"page size {size}; best of {args.repeat}")
    print(f"{'what':<34}{'ms':>10}{'TFLOP/s':>10}{'of SDPA':>10}")
    print(f"{'SDPA ' + backend:<34}{t_theirs * 1e3:>10.3f}{flops / t_theirs / 1e12:>10.2f}"
          f"{1:>9.2f}x")
    print(f"{'Triton prefill_attention (paged)':<34}{t_ours * 1e3:>10.3f}"
          f"{flops / t_ours / 1e12:>10.2f}{t_theirs / t_ours:>9.2f}x")
    got = ours().view(b, n, hq, d).float()
    want = theirs().transpose(1, 2).float()
    err = ((got - want).abs().max() / want.abs().max()).item()
    print(f"relative error against SDPA: {err:.1e}")
    if err > (3e-2 if dtype == torch.bfloat16 else 1e-3):
        sys.exit(f"prefill_attention disagrees with SDPA: {err:.1e}")


if __name__ == "__main__":
    main()
