"""What the eager step (runner.py) and the compiled decode graphs (compiled.py) both build their
rows from: rotary embeddings, a request's cache slots, and one decode row's arguments. Below both,
so neither imports the other for them."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding, transformers' layout (the two halves of each head rotate together)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def cache_slots(runner, block_table: list[int], length: int) -> torch.Tensor:
    """Cache slots of positions 0…length-1 of a request (padding past its end reads its last block);
    `runner` is the ModelRunner (its page size, device and offsets)."""
    page = runner.page_size
    needed = -(-length // page)
    table = block_table[:needed]
    table += [table[-1]] * (needed - len(table))  # a shorter request in a padded decode batch
    blocks = torch.tensor(table, device=runner.device)
    return (blocks.unsqueeze(1) * page + runner.offsets).view(-1)[:length]


@dataclass(frozen=True)
class DecodeRow:
    """One request's decode row: its last token, its block table and its length with that token."""

    token: int
    block_table: list[int]
    length: int


def decode_arguments(runner, rows: Sequence[DecodeRow], bucket: int, k_caches, v_caches) -> tuple:
    """decode_step_function's arguments for `rows`, padded to `bucket` rows.

    A padding row writes its K/V to the cache's last block (a scratch block no request is given:
    runner.py allocates one block more than the block manager hands out) and sees one position.
    """
    device, page = runner.device, runner.page_size
    scratch = k_caches[0].shape[0] - page
    longest = max(row.length for row in rows)
    tokens = [row.token for row in rows] + [0] * (bucket - len(rows))
    positions = [row.length - 1 for row in rows] + [0] * (bucket - len(rows))
    write = [cache_slot(row.block_table, row.length - 1, page) for row in rows] + [scratch] * (bucket - len(rows))
    reads = [cache_slots(runner, row.block_table, longest) for row in rows]
    reads += [torch.full((longest,), scratch, device=device)] * (bucket - len(rows))
    hidden = F.embedding(torch.tensor(tokens, device=device), runner.embed)
    position_tensor = torch.tensor(positions, device=device)
    cos = runner.cos[position_tensor].unsqueeze(1)
    sin = runner.sin[position_tensor].unsqueeze(1)
    lengths = torch.tensor([row.length for row in rows] + [1] * (bucket - len(rows)), device=device)
    mask = None
    if bucket > 1 and not runner.paged_attention:
        mask = (torch.arange(longest, device=device).unsqueeze(0) < lengths.unsqueeze(1)).view(bucket, 1, 1, longest)
    return hidden, cos, sin, k_caches, v_caches, torch.tensor(write, device=device), torch.stack(reads), lengths, mask


def cache_slot(block_table: list[int], position: int, page: int) -> int:
    return block_table[position // page] * page + position % page
