"""Triton kernels for the paged KV pool, each with a plain-torch reference of the same signature.

Standalone: nothing here imports the rest of the project.
"""

from kernels.decode_attention import (
    decode_attention,
    decode_attention_ref,
    decode_with_plan_ref,
    plan_decode_ref,
)
from kernels.prefill_attention import prefill_attention, prefill_attention_ref
from kernels.store_kv import store_kv, store_kv_ref

__all__ = [
    "decode_attention",
    "decode_attention_ref",
    "decode_with_plan_ref",
    "plan_decode_ref",
    "prefill_attention",
    "prefill_attention_ref",
    "store_kv",
    "store_kv_ref",
]
