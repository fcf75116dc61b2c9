"""Attention for the continuous-batching engine on CPU that costs what each request costs.

transformers' "sdpa" path for continuous batching packs every request of a step into ONE sequence
and runs one attention over it with a block-diagonal mask: N query tokens against the K/V of ALL
requests in the batch. A decode step of B requests with contexts of L tokens therefore does B × (B·L)
work instead of B × L, and first copies the K/V three times over (repeat_kv for grouped-query heads)
to do it. On this model at B=32 that quadratic term is most of the step (measured in
docs/benchmarks.md). There is no flash/paged kernel for CPU in transformers, so we supply one:

- decoding requests (one new token each, most of every step) are sorted by context length and
  split into a few length buckets; each bucket gathers its requests' K/V into a padded
  [b, kv_heads, L_max, D] batch and runs ONE batched SDPA with a per-row length mask and grouped-query
  heads handled by SDPA itself (enable_gqa, no copies). Buckets matter: one padded batch for all
  requests pads 55 short chats to the length of a 800-token system prompt and copied 5.6× the real
  K/V in every layer (2 s steps at 64 requests; see docs/benchmarks.md);
- prefilling requests: one SDPA per request over its own slice (causal, aligned to the end of its
  context), since prefill is compute-bound per request anyway.

How a step's requests are laid out (buckets, gather indices, masks) is worked out once per step and
reused by all layers: the layers of one forward pass see the same cu_seq_lens.

K/V are read straight from the paged cache. transformers' cache update writes the step's new K/V,
then gathers EVERY request's whole context into one packed tensor per layer (index_select over
read_index) for the attention to read; our buckets then gathered their rows again. For an opted-in
model the update hands over the cache itself and read_index instead (READ_INDEX in the kwargs), and
each bucket gathers its rows from the cache in one pass: one copy of the K/V a step needs, not two
copies of all of it.

The function is registered in place of "sdpa" and falls through to transformers' own SDPA for every
call that does not come from the continuous-batching engine (no cu_seq_lens_q) or from a model that
did not opt in with enable(model), so `generate` is unchanged, and greedy outputs of the engine stay
token-identical to transformers' own (tests/test_engine.py).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch
import torch.nn.functional as F

_installed = False
FLAG = "ceiling_varlen_attention"
# The kwarg our cache update adds: rows of the cache that make up the packed keys (see the module doc).
READ_INDEX = "ceiling_read_index"

# A bucket's fixed cost (one gather, one SDPA call, its mask) in padded-token equivalents: of 0, 16, 64,
# 256 and 1024 measured on this CPU (64 mixed decodes, docs/benchmarks.md), 64 was fastest.
BUCKET_COST_TOKENS = 64


def enable(model) -> None:
    """Serve this model's continuous-batching steps with per-request attention."""
    _install()
    setattr(model.config, FLAG, True)


def _install() -> None:
    """Wrap transformers' "sdpa" attention once per process; models that did not opt in are untouched."""
    global _installed
    if _installed:
        return
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    def sdpa_or_varlen(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
        cu_seq_lens_q = kwargs.get("cu_seq_lens_q")
        cu_seq_lens_k = kwargs.get("cu_seq_lens_k")
        opted_in = getattr(getattr(module, "config", None), FLAG, False)
        if not opted_in or not isinstance(cu_seq_lens_q, torch.Tensor) or not isinstance(cu_seq_lens_k, torch.Tensor):
            return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
        read_index = kwargs.get(READ_INDEX)
        return varlen_attention(query, key, value, cu_seq_lens_q, cu_seq_lens_k, scaling, read_index), None

    ALL_ATTENTION_FUNCTIONS["sdpa"] = sdpa_or_varlen
    _install_direct_cache_reads()
    _installed = True


def _install_direct_cache_reads() -> None:
    """Opted-in models' cache updates write the new K/V and hand over the cache and read_index, unread.

    The write is transformers' own (FullAttentionCacheAllocator.update, first half); only the read-back
    is left to the attention. Anything else (block tables, other allocators, models that did not opt
    in) takes transformers' path unchanged.
    """
    from transformers.generation.continuous_batching.cache import PagedAttentionCache
    from transformers.generation.continuous_batching.cache_allocators.full_attention import FullAttentionCacheAllocator

    packed_update = PagedAttentionCache.update

    def update(self, key_states, value_states, layer_idx, kwargs):
        allocator = self.layer_to_allocator[layer_idx]
        if (
            not getattr(self.config, FLAG, False)
            or kwargs.get("block_table") is not None
            or type(allocator) is not FullAttentionCacheAllocator
        ):
            return packed_update(self, key_states, value_states, layer_idx, kwargs)
        kwargs["cu_seq_lens_k"] = kwargs["cu_seq_lens_k"][allocator.layer_type].to(torch.int32)
        kwargs["max_length_k"] = kwargs["max_length_k"][allocator.layer_type]
        read_index = kwargs["read_index"][allocator.index]
        write_index = kwargs["write_index"][allocator.index]
        k_cache, v_cache = allocator._kv_token_views[layer_idx]  # [cache tokens, kv_heads, D]
        k_cache.index_copy_(0, write_index, key_states[0].transpose(0, 1))
        v_cache.index_copy_(0, write_index, value_states[0].transpose(0, 1))
        if read_index.numel() == 0:  # fresh prefills only: the new K/V are all there is
            return key_states, value_states
        kwargs[READ_INDEX] = read_index
        return k_cache.transpose(0, 1).unsqueeze(0), v_cache.transpose(0, 1).unsqueeze(0)

    PagedAttentionCache.update = update


@dataclass(frozen=True)
class DecodeBucket:
    """Decoding requests attended together: their query rows, where their keys are, and which are padding."""

    rows: torch.Tensor  # [b] rows of the packed query
    index: torch.Tensor  # [b * longest] rows of the packed K/V (padding repeats a real row)
    valid: torch.Tensor | None  # [b, 1, 1, longest], None when no row is padded
    batch: int
    longest: int


@dataclass(frozen=True)
class StepPlan:
    decode_buckets: list[DecodeBucket]
    prefills: list[tuple[int, int, int, int]]  # (query start, query length, key start, key length)
    query_rows: int  # rows of the packed query that belong to a request; the rest is padding


_plans = threading.local()  # one engine thread per weight variant: plans are per thread


def varlen_attention(
    query: torch.Tensor,  # [1, heads, total_q, D]
    key: torch.Tensor,  # [1, kv_heads, total_k, D], or the whole cache when read_index is given
    value: torch.Tensor,
    cu_seq_lens_q: torch.Tensor,  # [B + 1]
    cu_seq_lens_k: torch.Tensor,  # [B + 1]
    scaling: float | None,
    read_index: torch.Tensor | None = None,  # [total_k]: the cache row of each packed key
) -> torch.Tensor:
    """Causal attention of each request's queries over its own keys only → [1, total_q, heads, D]."""
    plan = step_plan(cu_seq_lens_q, cu_seq_lens_k)
    total_q = query.shape[2]
    make = query.new_zeros if plan.query_rows < total_q else query.new_empty
    output = make(total_q, query.shape[1], query.shape[3])
    if plan.decode_buckets or read_index is not None:
        keys_by_token, values_by_token = _by_token(key), _by_token(value)
    for bucket in plan.decode_buckets:
        rows = bucket.index if read_index is None else read_index.index_select(0, bucket.index)
        output[bucket.rows] = _decode_bucket(query[0, :, bucket.rows], keys_by_token, values_by_token, rows, bucket, scaling)
    for q0, q_len, k0, k_len in plan.prefills:
        if read_index is None:
            keys, values = key[:, :, k0 : k0 + k_len], value[:, :, k0 : k0 + k_len]
        else:
            rows = read_index[k0 : k0 + k_len]
            keys, values = (_unpack(states.index_select(0, rows)) for states in (keys_by_token, values_by_token))
        output[q0 : q0 + q_len] = _one_request(query[:, :, q0 : q0 + q_len], keys, values, scaling)
    return output.unsqueeze(0)


def step_plan(cu_seq_lens_q: torch.Tensor, cu_seq_lens_k: torch.Tensor) -> StepPlan:
    """The step's layout, built by its first layer and reused by the others."""
    key = (tuple(cu_seq_lens_q.tolist()), tuple(cu_seq_lens_k.tolist()))
    cached = getattr(_plans, "last", None)
    if cached is not None and cached[0] == key:
        return cached[1]
    plan = build_plan(*key)
    _plans.last = (key, plan)
    return plan


def build_plan(cu_q: tuple[int, ...], cu_k: tuple[int, ...]) -> StepPlan:
    decoding, prefills = [], []
    for i in range(len(cu_q) - 1):
        q_len, k_len = cu_q[i + 1] - cu_q[i], cu_k[i + 1] - cu_k[i]
        if q_len == 0:  # padding sequences may follow the real ones
            continue
        if q_len == 1:
            decoding.append((k_len, cu_q[i], cu_k[i]))
        else:
            prefills.append((cu_q[i], q_len, cu_k[i], k_len))
    decoding.sort()
    buckets = [_bucket(decoding[start:end]) for start, end in length_buckets([k for k, _, _ in decoding])]
    return StepPlan(buckets, prefills, query_rows=cu_q[-1])


def length_buckets(sorted_lengths: list[int], bucket_cost: int | None = None) -> list[tuple[int, int]]:
    """Split ascending lengths into [start, end) runs minimising padded positions + bucket_cost per run.

    A run is padded to its last (longest) member; dynamic programming over the split points is exact
    and cheap for a batch (64 requests: 2,000 steps, once per forward pass).
    """
    bucket_cost = BUCKET_COST_TOKENS if bucket_cost is None else bucket_cost
    n = len(sorted_lengths)
    best = [0] + [None] * n  # best[j]: cost of the first j lengths
    split = [0] * (n + 1)
    for end in range(1, n + 1):
        longest = sorted_lengths[end - 1]
        for start in range(end):
            cost = best[start] + (end - start) * longest + bucket_cost
            if best[end] is None or cost < best[end]:
                best[end], split[end] = cost, start
    runs, end = [], n
    while end > 0:
        runs.append((split[end], end))
        end = split[end]
    return runs[::-1]


def _bucket(members: list[tuple[int, int, int]]) -> DecodeBucket:
    """members: (key length, query row, key start) of each request, ascending by length."""
    lengths = torch.tensor([k for k, _, _ in members])
    longest = int(lengths[-1])
    positions = torch.arange(longest)
    valid = positions[None, :] < lengths[:, None]  # [b, longest]
    starts = torch.tensor([s for _, _, s in members])
    # Padding positions read a real row (the request's first) and are masked out.
    index = (starts[:, None] + torch.where(valid, positions[None, :], 0)).reshape(-1)
    padded = members[0][0] < longest  # ascending: only the shortest needs checking
    return DecodeBucket(
        rows=torch.tensor([r for _, r, _ in members]),
        index=index,
        valid=valid[:, None, None, :] if padded else None,
        batch=len(members),
        longest=longest,
    )


def _decode_bucket(queries, keys_by_token, values_by_token, rows, bucket: DecodeBucket, scaling) -> torch.Tensor:
    """One query token per request ([heads, b, D]) over its bucket's padded K/V → [b, heads, D].

    rows: [b * longest] rows of keys_by_token / values_by_token holding the bucket's K/V, padded.
    """
    shape = (bucket.batch, bucket.longest, keys_by_token.shape[1], keys_by_token.shape[2])
    keys = keys_by_token.index_select(0, rows).view(shape).transpose(1, 2)  # [b, kv_heads, L, D]
    values = values_by_token.index_select(0, rows).view(shape).transpose(1, 2)
    out = F.scaled_dot_product_attention(
        queries.transpose(0, 1).unsqueeze(2), keys, values, attn_mask=bucket.valid, scale=scaling, enable_gqa=True
    )
    return out[:, :, 0, :]


def _by_token(states: torch.Tensor) -> torch.Tensor:
    """[1, kv_heads, T, D] → [T, kv_heads, D], contiguous so that gathering rows copies only those rows.

    The paged cache hands us exactly this memory layout, transposed: then this is free. (Gathering
    along dim 1 of the transposed view instead made torch copy ALL of K and V first, per bucket.)
    """
    by_token = states[0].transpose(0, 1)
    return by_token if by_token.is_contiguous() else by_token.contiguous()


def _unpack(by_token: torch.Tensor) -> torch.Tensor:
    """[T, kv_heads, D] → [1, kv_heads, T, D] (a view)."""
    return by_token.transpose(0, 1).unsqueeze(0)


def _one_request(query, key, value, scaling) -> torch.Tensor:
    """One request's queries (the last q tokens of its context) over its keys → [q, heads, D]."""
    q_len, k_len = query.shape[2], key.shape[2]
    if q_len == k_len:
        out = F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling, enable_gqa=True)
    else:  # chunked prefill or a shared prefix: queries sit at the end of the context
        allowed = torch.arange(k_len)[None, :] <= torch.arange(q_len)[:, None] + (k_len - q_len)
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=allowed, scale=scaling, enable_gqa=True)
    return out[0].transpose(0, 1)
