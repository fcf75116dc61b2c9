"""The model's forward pass for one step, over the paged KV cache.

Written against a Llama-family transformers model (SmolLM2, Llama, Mistral without sliding
windows, Qwen2): the runner keeps transformers' modules for the weights and calls each projection's
own `forward` (so every variant of inference/engine/patches — skinny routes, int8, q4, bf16 — runs
unchanged), and does everything between them itself:

- one flat batch of T token rows per step: decode rows first (one per running request), then each
  prompt chunk; every linear layer reads its weights once for all of them;
- q|k|v and gate|up as one fused linear each (inference/engine/patches/fusion.py): 4 linear calls
  per layer instead of 7, a lone q4 step 15.8 → 13.4 ms on a 2-core EPYC; q and k rotate together;
- rotary embeddings from a table computed once with the model's own rotary module;
- K and V written into a per-layer cache of `num_blocks × page_size` slots at the rows' slots, and
  read back through each request's block table (a view, no gather, when its blocks are
  consecutive): decode rows as one padded batch for one
  scaled_dot_product_attention call, each prompt chunk as its own causal call;
- logits only for the rows that yield a token (decode rows and the last row of a finished prompt).

The cache and the tables are made in the loop's own thread (see manager.py): a tensor filled in
another thread would give that thread an OpenMP team of its own (inference/engine/loop.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..patches.fusion import fuse_linears
from .kv import from_cache, row_width, to_cache
from .rows import DecodeRow, cache_slots, decode_arguments, rotate
from .scheduler import StepPlan

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")


def unsupported_reason(model) -> str | None:
    """Why the owned loop cannot run this model, or None when it can."""
    config = model.config
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        return f"model type {config.model_type!r} is not one of {', '.join(SUPPORTED_MODEL_TYPES)}"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"activation {config.hidden_act!r} is not silu"
    if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
        return "sliding-window attention is not implemented"
    return None


@dataclass
class _Layer:
    input_norm: torch.Tensor
    post_norm: torch.Tensor
    qkv: Callable[[torch.Tensor], torch.Tensor]  # x → [rows, q | k | v]
    o: Callable[[torch.Tensor], torch.Tensor]
    gate_up: Callable[[torch.Tensor], torch.Tensor]  # x → [rows, gate | up]
    down: Callable[[torch.Tensor], torch.Tensor]
    # The linear modules behind qkv, o, gate_up and down (None where q|k|v or gate|up could not
    # fuse into one): stack.py reads their 4-bit weights.
    linears: tuple = ()


def _forward_of(module):
    """The module's forward without nn.Module.__call__'s hook machinery (~5 µs × 7 × layers a step)."""
    return module.forward


def _side_by_side(modules: list) -> tuple[Callable[[torch.Tensor], torch.Tensor], torch.nn.Module | None]:
    """One call computing the modules' outputs concatenated, and the fused module behind it (None
    when their weights could not fuse: the call then concatenates their outputs)."""
    fused = fuse_linears(modules)
    if fused is not None:
        return fused.forward, fused
    forwards = [_forward_of(module) for module in modules]
    return (lambda x: torch.cat([forward(x) for forward in forwards], dim=-1)), None


def _layer_of(layer) -> _Layer:
    attn, mlp = layer.self_attn, layer.mlp
    qkv, qkv_linear = _side_by_side([attn.q_proj, attn.k_proj, attn.v_proj])
    gate_up, gate_up_linear = _side_by_side([mlp.gate_proj, mlp.up_proj])
    return _Layer(
        layer.input_layernorm.weight, layer.post_attention_layernorm.weight,
        qkv, _forward_of(attn.o_proj), gate_up, _forward_of(mlp.down_proj),
        linears=(qkv_linear, attn.o_proj, gate_up_linear, mlp.down_proj),
    )


class ModelRunner:
    def __init__(self, model, num_blocks: int, page_size: int, paged_attention: bool = False,
                 kv_dtype: torch.dtype | None = None) -> None:
        config = model.config
        core = model.model
        self.model = model
        self.page_size = page_size
        self.heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        self.hidden = config.hidden_size
        self.eps = config.rms_norm_eps
        self.embed = core.embed_tokens.weight
        self.dtype = self.embed.dtype
        self.device = self.embed.device
        # The cache's dtype: fp32 activations on a CPU may keep K and V in fp16 (half the bytes a
        # decode step reads per cached position; cache_dtype); other models keep their own dtype.
        self.kv_dtype = cache_dtype(self.dtype, self.device, kv_dtype)
        # Decode rows attend with torch.ops.ceiling.decode_attention, reading K and V in place (the
        # engine loaded Ceiling's kernels; fp32 activations on the CPU); else gathered, then SDPA.
        self.paged_attention = paged_attention and self.dtype == torch.float32 and self.device.type == "cpu"
        self.final_norm = core.norm.weight
        self.lm_head = _forward_of(model.lm_head)
        self.intermediate = config.intermediate_size
        self.layers = [_layer_of(layer) for layer in core.layers]
        slots = num_blocks * page_size
        # One block more than the block manager hands out: the scratch block that a compiled decode
        # step's padding rows write to (compiled.decode_arguments).
        shape = (slots + page_size, self.kv_heads, row_width(self.head_dim, self.kv_dtype))
        self.k_cache = [torch.zeros(shape, dtype=self.kv_dtype, device=self.device) for _ in self.layers]
        self.v_cache = [torch.zeros(shape, dtype=self.kv_dtype, device=self.device) for _ in self.layers]
        self.cos, self.sin = self._rotary_table(core, min(slots, config.max_position_embeddings))
        self.offsets = torch.arange(page_size, device=self.device)
        # Decode-only steps as compiled graphs by bucket (rows → step), installed by
        # compiled.DecodeCompiler for the buckets that measure faster; empty: every step runs eagerly.
        self.decode_steps: dict[int, Callable] = {}
        # Decode-only steps of up to stacked.max_rows rows in one C++ call (stack.py), installed by
        # stack.install where it measures faster; None: they take the graphs or the eager path.
        self.stacked = None

    def _rotary_table(self, core, positions: int) -> tuple[torch.Tensor, torch.Tensor]:
        probe = torch.zeros(1, 1, self.head_dim, dtype=self.dtype, device=self.device)
        with torch.no_grad():
            cos, sin = core.rotary_emb(probe, torch.arange(positions, device=self.device).unsqueeze(0))
        return cos[0].to(self.dtype), sin[0].to(self.dtype)  # [positions, head_dim]

    # --- one step -------------------------------------------------------------------------------

    @torch.inference_mode()
    def step(self, plan: StepPlan) -> torch.Tensor | None:
        """Compute the plan's rows; the logits of each row that yields a token, in plan order (None: no row does)."""
        if self.stacked is not None and not plan.prefill and len(plan.decode) <= self.stacked.max_rows:
            return self.stacked.decode(plan.decode)
        if self.decode_steps and not plan.prefill:
            logits = self._compiled_decode(plan.decode)
            if logits is not None:
                return logits
        batch = _StepBatch(self, plan)
        hidden = F.embedding(batch.input_ids, self.embed)
        for index, layer in enumerate(self.layers):
            hidden = self._layer(index, layer, hidden, batch)
        if not batch.logit_rows.numel():
            return None  # only prompt chunks that end mid-prompt: no token this step
        rows = hidden.index_select(0, batch.logit_rows) if batch.logit_rows.numel() != hidden.shape[0] else hidden
        rows = F.rms_norm(rows, (self.hidden,), self.final_norm, self.eps)
        return self.lm_head(rows)

    def _compiled_decode(self, seqs) -> torch.Tensor | None:
        """The decode rows through the graph of the smallest compiled bucket that holds them (None: no
        bucket does, or its guards refused this call; the step then runs eagerly)."""
        steps = self.decode_steps
        bucket = min((rows for rows in steps if rows >= len(seqs)), default=None)
        if bucket is None:
            return None
        rows = [DecodeRow(seq.token_at(len(seq) - 1), seq.block_table, len(seq)) for seq in seqs]
        logits = steps[bucket](*decode_arguments(self, rows, bucket, self.k_cache, self.v_cache))
        return None if logits is None else logits[: len(seqs)]

    def _layer(self, index: int, layer: _Layer, hidden: torch.Tensor, batch: _StepBatch) -> torch.Tensor:
        rows = hidden.shape[0]
        heads, kv_heads, head_dim = self.heads, self.kv_heads, self.head_dim
        x = F.rms_norm(hidden, (self.hidden,), layer.input_norm, self.eps)
        qkv = layer.qkv(x).view(rows, heads + 2 * kv_heads, head_dim)
        # q and k rotate in one pass: they are adjacent heads of the fused output.
        qk = rotate(qkv[:, : heads + kv_heads], batch.cos, batch.sin)
        q, k, v = qk[:, :heads], qk[:, heads:], qkv[:, heads + kv_heads :]
        k_cache, v_cache = self.k_cache[index], self.v_cache[index]
        k_cache.index_copy_(0, batch.write_slots, to_cache(k, self.kv_dtype))
        v_cache.index_copy_(0, batch.write_slots, to_cache(v, self.kv_dtype))
        attended = self._attention(q, k_cache, v_cache, batch)
        hidden = hidden + layer.o(attended)
        x = F.rms_norm(hidden, (self.hidden,), layer.post_norm, self.eps)
        gate_up = layer.gate_up(x)
        gate, up = gate_up[:, : self.intermediate], gate_up[:, self.intermediate :]
        return hidden + layer.down(F.silu(gate) * up)

    def _attention(self, q, k_cache, v_cache, batch: _StepBatch) -> torch.Tensor:
        parts = []
        if batch.decode_rows and self.paged_attention:
            count = batch.decode_rows
            queries = q[:count].contiguous()
            parts.append(torch.ops.ceiling.decode_attention(queries, k_cache, v_cache, batch.decode_slots, batch.decode_lengths))
        elif batch.decode_rows:
            count = batch.decode_rows
            keys, values = k_cache[batch.decode_slots], v_cache[batch.decode_slots]  # [B, L, …] or [L, …] alone
            if count == 1:
                keys, values = keys.unsqueeze(0), values.unsqueeze(0)
            keys, values = from_cache(keys, q.dtype).transpose(1, 2), from_cache(values, q.dtype).transpose(1, 2)  # [B, kv_heads, L, head_dim]
            queries = q[:count].unsqueeze(2)  # [B, heads, 1, head_dim]
            out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=batch.decode_mask, enable_gqa=True)
            parts.append(out.reshape(count, -1))
        for start, end, slots, mask in batch.chunks:
            # [1, kv_heads, L, head_dim], in the activations' dtype (an fp16 cache is widened: CPU SDPA in
            # fp16 is slow; an int8 one is decoded)
            keys = from_cache(k_cache[slots], q.dtype).transpose(0, 1).unsqueeze(0)
            values = from_cache(v_cache[slots], q.dtype).transpose(0, 1).unsqueeze(0)
            queries = q[start:end].transpose(0, 1).unsqueeze(0)
            out = F.scaled_dot_product_attention(
                queries, keys, values, attn_mask=mask, is_causal=mask is None, enable_gqa=True
            )
            parts.append(out[0].transpose(0, 1).reshape(end - start, -1))
        attended = parts[0] if len(parts) == 1 else torch.cat(parts)
        return attended.to(q.dtype)


KV_DTYPES = {"float32": torch.float32, "float16": torch.float16, "int8": torch.int8}


def cache_dtype(activations: torch.dtype, device: torch.device, asked: torch.dtype | None) -> torch.dtype:
    """The KV cache's dtype: the one asked for where the activations are fp32 on a CPU (the kernels
    read fp32, fp16 or int8 there: kv.py), else the activations' own (a GPU's bf16 model keeps a bf16 cache)."""
    if asked is None or activations != torch.float32 or device.type != "cpu":
        return activations
    return asked


class _StepBatch:
    """The index tensors of one step, built once and read by every layer."""

    def __init__(self, runner: ModelRunner, plan: StepPlan) -> None:
        page = runner.page_size
        device = runner.device
        ids: list[int] = []
        positions: list[int] = []
        logit_rows: list[int] = []
        write_slots: list[int] = []  # where each row's K and V go in the cache
        for seq in plan.decode:
            position = len(seq) - 1
            logit_rows.append(len(ids))
            ids.append(seq.token_at(position))
            positions.append(position)
            write_slots.append(seq.block_table[position // page] * page + position % page)
        self.decode_rows = len(plan.decode)
        self.chunks = []
        for chunk in plan.prefill:
            first_row = len(ids)
            ids.extend(chunk.seq.prompt[chunk.start : chunk.end])
            positions.extend(range(chunk.start, chunk.end))
            table = chunk.seq.block_table
            write_slots.extend(table[p // page] * page + p % page for p in range(chunk.start, chunk.end))
            if chunk.completes_prompt:
                logit_rows.append(len(ids) - 1)
            slots = _cache_rows(runner, chunk.seq.block_table, chunk.end)
            mask = None
            if chunk.start:  # earlier positions are cached: queries see all of them plus a causal part
                query_positions = torch.arange(chunk.start, chunk.end, device=device).unsqueeze(1)
                mask = torch.arange(chunk.end, device=device).unsqueeze(0) <= query_positions
            self.chunks.append((first_row, len(ids), slots, mask))
        self.input_ids = torch.tensor(ids, dtype=torch.long, device=device)
        position_tensor = torch.tensor(positions, device=device)
        self.cos = runner.cos[position_tensor].unsqueeze(1)  # [T, 1, head_dim]
        self.sin = runner.sin[position_tensor].unsqueeze(1)
        self.logit_rows = torch.tensor(logit_rows, dtype=torch.long, device=device)
        self.write_slots = torch.tensor(write_slots, device=device)
        self.decode_slots = self.decode_mask = self.decode_lengths = None
        if self.decode_rows and runner.paged_attention:  # slots and lengths, read in place by the kernel
            lengths = [len(seq) for seq in plan.decode]
            self.decode_slots = torch.stack([cache_slots(runner, seq.block_table, max(lengths)) for seq in plan.decode])
            self.decode_lengths = torch.tensor(lengths, device=device)
        elif self.decode_rows:
            lengths = [len(seq) for seq in plan.decode]
            longest = max(lengths)
            if self.decode_rows == 1:
                self.decode_slots = _cache_rows(runner, plan.decode[0].block_table, longest)
            else:
                self.decode_slots = torch.stack([cache_slots(runner, seq.block_table, longest) for seq in plan.decode])
            if min(lengths) != longest:
                self.decode_mask = (torch.arange(longest, device=device).unsqueeze(0) < torch.tensor(lengths, device=device).unsqueeze(1)).view(
                    self.decode_rows, 1, 1, longest
                )


def _cache_rows(runner: ModelRunner, block_table: list[int], length: int) -> slice | torch.Tensor:
    """Where positions 0…length-1 of a request sit in the cache: a slice (a view, nothing copied)
    when its blocks are consecutive, as a lone request's fresh blocks usually are; else slot indices.
    The gather it saves costs ~35 µs per layer and tensor at a few hundred positions."""
    needed = -(-length // runner.page_size)
    first = block_table[0]
    if block_table[:needed] == list(range(first, first + needed)):
        start = first * runner.page_size
        return slice(start, start + length)
    return cache_slots(runner, block_table, length)
