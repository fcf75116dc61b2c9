"""Attention for the continuous-batching engine on CPU that costs what each request costs.

transformers' "sdpa" path for continuous batching packs every request of a step into ONE sequence
and runs one attention over it with a block-diagonal mask: N query tokens against the K/V of ALL
requests in the batch. A decode step of B requests with contexts of L tokens therefore does B × (B·L)
work instead of B × L, and first copies the K/V three times over (repeat_kv for grouped-query heads)
to do it. On this model at B=32 that quadratic term is most of the step (measured in
docs/benchmarks.md). There is no flash/paged kernel for CPU in transformers, so we supply one:

- decode-only steps (every request adds one token, the common case): gather each request's K/V into
  a padded [B, kv_heads, L_max, D] batch with one index_select and run ONE batched SDPA with a
  per-row length mask and grouped-query heads handled by SDPA itself (enable_gqa, no copies);
- steps with prefill: one SDPA per request over its own slice (causal, aligned to the end of its
  context), since prefill is compute-bound per request anyway.

The function is registered in place of "sdpa" and falls through to transformers' own SDPA for every
call that does not come from the continuous-batching engine (no cu_seq_lens_q) or from a model that
did not opt in with enable(model), so `generate` is unchanged, and greedy outputs of the engine stay
token-identical to transformers' own (tests/test_engine.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

_installed = False
FLAG = "ceiling_varlen_attention"


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
        return varlen_attention(query, key, value, cu_seq_lens_q, cu_seq_lens_k, scaling), None

    ALL_ATTENTION_FUNCTIONS["sdpa"] = sdpa_or_varlen
    _installed = True


def varlen_attention(
    query: torch.Tensor,  # [1, heads, total_q, D]
    key: torch.Tensor,  # [1, kv_heads, total_k, D]
    value: torch.Tensor,
    cu_seq_lens_q: torch.Tensor,  # [B + 1]
    cu_seq_lens_k: torch.Tensor,  # [B + 1]
    scaling: float | None,
) -> torch.Tensor:
    """Causal attention of each request's queries over its own keys only → [1, total_q, heads, D]."""
    q_lens = (cu_seq_lens_q[1:] - cu_seq_lens_q[:-1]).tolist()
    k_lens = (cu_seq_lens_k[1:] - cu_seq_lens_k[:-1]).tolist()
    # Padding sequences (lengths 0) may follow the real ones; the packed query may also be padded.
    live = [i for i, n in enumerate(q_lens) if n > 0]
    output = query.new_zeros(query.shape[2], query.shape[1], query.shape[3])
    if live and all(q_lens[i] == 1 for i in live):
        rows = cu_seq_lens_q[:-1][live]
        starts = cu_seq_lens_k[:-1][live]
        output[rows] = _decode_batch(query[0, :, rows], key, value, starts, [k_lens[i] for i in live], scaling)
    else:
        for i in live:
            q0, k0 = int(cu_seq_lens_q[i]), int(cu_seq_lens_k[i])
            output[q0 : q0 + q_lens[i]] = _one_request(
                query[:, :, q0 : q0 + q_lens[i]], key[:, :, k0 : k0 + k_lens[i]], value[:, :, k0 : k0 + k_lens[i]], scaling
            )
    return output.unsqueeze(0)


def _decode_batch(queries, key, value, starts, k_lens, scaling) -> torch.Tensor:
    """One query token per request ([heads, B, D]): a padded batch and one SDPA call → [B, heads, D]."""
    batch, longest = len(k_lens), max(k_lens)
    lengths = torch.tensor(k_lens)
    positions = torch.arange(longest)
    valid = positions[None, :] < lengths[:, None]  # [B, L_max]
    # Padding positions read a real row (the request's first) and are masked out.
    index = (starts[:, None] + torch.where(valid, positions[None, :], 0)).reshape(-1)
    keys = key[0].index_select(1, index).view(key.shape[1], batch, longest, -1).transpose(0, 1)
    values = value[0].index_select(1, index).view(value.shape[1], batch, longest, -1).transpose(0, 1)
    out = F.scaled_dot_product_attention(
        queries.transpose(0, 1).unsqueeze(2), keys, values, attn_mask=valid[:, None, None, :], scale=scaling, enable_gqa=True
    )
    return out[:, :, 0, :]


def _one_request(query, key, value, scaling) -> torch.Tensor:
    """One request's queries (the last q tokens of its context) over its keys → [q, heads, D]."""
    q_len, k_len = query.shape[2], key.shape[2]
    if q_len == k_len:
        out = F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling, enable_gqa=True)
    else:  # chunked prefill or a shared prefix: queries sit at the end of the context
        allowed = torch.arange(k_len)[None, :] <= torch.arange(q_len)[:, None] + (k_len - q_len)
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=allowed, scale=scaling, enable_gqa=True)
    return out[0].transpose(0, 1)
