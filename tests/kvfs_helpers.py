"""A real KV pool with small dimensions, and appends that write K/V the way a forward does."""

from __future__ import annotations

import torch

from kernels import store_kv_ref
from kvfs.fs import FileSystem, Handle, Reservation
from kvfs.inodes import DEFAULT_INODE_QUOTA
from kvfs.pages import PageStore
from kvfs.pool import KVPool, PageShape
from symphony.engine.config import ModelConfig

TINY = ModelConfig.from_dict({
    "architectures": ["LlamaForCausalLM"], "vocab_size": 100, "hidden_size": 32,
    "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2,
})
PAGE = 4


def make_fs(pages: int = 64, host: int = 16, disk: int = 0, tmp_path=None, shards: int = 1,
            inode_quota: int | None = DEFAULT_INODE_QUOTA, **quota) -> FileSystem:
    """A file system over a pool of TINY's page shape, its device tier in `shards` shards."""
    shape = PageShape(TINY.num_layers, TINY.num_kv_heads, TINY.head_dim, PAGE, torch.float32)
    pool = KVPool(shape, pages, host, "cpu", shards)
    swap = tmp_path / "swap" if tmp_path is not None else None
    return FileSystem(PageStore(pool, swap, disk, **quota), fingerprint="tiny-model",
                      inode_quota=inode_quota)


def kv_for(tokens: list[int], positions: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """K/V rows determined by (token, position), so contents can be checked later."""
    seed = torch.tensor(tokens, dtype=torch.float32)[:, None] * 1000 + torch.tensor(
        positions, dtype=torch.float32)[:, None]
    shape = (TINY.num_layers, len(tokens), TINY.num_kv_heads, TINY.head_dim)
    ramp = torch.arange(shape[0] * shape[2] * shape[3], dtype=torch.float32)
    k = (seed + ramp[None, :] * 1e-3).view(len(tokens), shape[0], shape[2], shape[3])
    k = k.permute(1, 0, 2, 3).contiguous()
    return k, -k


def append(fs: FileSystem, handle: Handle, tokens: list[int], positions=None) -> None:
    """What pred does: reserve slots, write K/V through the page table, commit."""
    start = handle.inode.length
    positions = positions or list(range(start, start + len(tokens)))
    res = fs.reserve(handle, len(tokens))
    write_kv(fs, res, tokens, positions)
    fs.commit(res, tokens, positions)


def write_kv(fs: FileSystem, res: Reservation, tokens: list[int], positions: list[int]) -> None:
    """The forward pass's part of a pred: the K/V of `tokens` through res's page table."""
    idx = torch.arange(res.start, res.start + len(tokens))
    slots = torch.tensor(res.page_table)[idx // PAGE] * PAGE + idx % PAGE
    k, v = kv_for(tokens, positions)
    pool = fs.store.pool
    for rank in range(pool.shards):  # each rank writes the heads of its shard
        heads, (k_cache, v_cache) = pool.heads(rank), pool.shard(rank)
        for layer in range(TINY.num_layers):
            store_kv_ref(k[layer][:, heads.start:heads.stop], v[layer][:, heads.start:heads.stop],
                         k_cache[layer], v_cache[layer], slots)


def attended(fs: FileSystem, handle: Handle) -> list[int]:
    """Indices of entries still in attention."""
    ex = handle.inode.excluded
    return [i for i in range(handle.inode.length) if not any(s <= i < e for s, e in ex)]


def assert_kv(fs: FileSystem, handle: Handle) -> None:
    """Every attended entry holds exactly the K/V its (token, position) was written with."""
    inode = handle.inode
    keep = attended(fs, handle)
    if not keep:
        return
    inode_k = []
    for i in keep:
        k, _ = fs.store.read(inode.pages[i // PAGE])
        inode_k.append(k[:, i % PAGE])
    want, _ = kv_for([inode.tokens[i] for i in keep], [inode.positions[i] for i in keep])
    assert torch.equal(torch.stack(inode_k, 1), want)
