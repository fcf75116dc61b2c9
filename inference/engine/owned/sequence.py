"""One request as the loop sees it."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..config import GREEDY, Sampling

WAITING = "waiting"
RUNNING = "running"
FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """A request's tokens and KV blocks; `computed` tokens already have their KV in the cache."""

    request_id: str
    prompt: list[int]
    max_new_tokens: int
    eos_ids: frozenset[int]  # empty when the request ignores end-of-sequence tokens
    generated: list[int] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)
    computed: int = 0
    status: str = WAITING
    hashed_blocks: int = 0  # leading full blocks registered for prefix sharing
    prompt_chains: list[int] | None = None  # the hash chain after each full prompt block (blocks.py)
    error: str | None = None
    sampling: Sampling = GREEDY
    generator: object = None  # a torch.Generator of its own when it samples (see sampler.py)
    logprobs: list = field(default_factory=list)  # one (logprob, top alternatives) per generated token, if asked
    arrived: float = 0.0  # the scheduler's clock when the request was added (its prefill order ages with it)

    def __len__(self) -> int:
        return len(self.prompt) + len(self.generated)

    def token_at(self, position: int) -> int:
        prompt_length = len(self.prompt)
        return self.prompt[position] if position < prompt_length else self.generated[position - prompt_length]

    @property
    def in_prefill(self) -> bool:
        return self.computed < len(self.prompt)

    @property
    def reserved_tokens(self) -> int:
        """The most KV slots this request can ever need: its blocks are reserved for that at admission."""
        return len(self.prompt) + self.max_new_tokens

    def append(self, token: int) -> None:
        self.generated.append(token)

    @property
    def done(self) -> bool:
        if len(self.generated) >= self.max_new_tokens:
            return True
        return bool(self.generated) and self.generated[-1] in self.eos_ids

    def is_finished(self) -> bool:
        return self.status == FINISHED
