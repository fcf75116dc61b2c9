"""Loop budgets: anything that calls the model more than once carries a cap on calls and spend.

    with loop_budget(user, max_calls=3, max_cost_micro_usd=20_000) as loop:
        while ...:
            decision = loop.admit(feature, model, prompt_tokens, max_tokens)  # raises LoopBudgetExceeded
            ...

Every iteration goes through the guard with the loop as one more ceiling, so the check is the same
atomic Redis decision as every other cap (and the same applies to a websocket chat with a loop_id).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from .guard import AdmissionRequest, Decision, LoopLimits, admit

LOOP_CODES = ("loop_calls", "loop_spend")


class Refused(Exception):
    """The guard said no; `decision` carries the code, the sentence and retry_after_s."""

    def __init__(self, decision: Decision) -> None:
        super().__init__(decision.message)
        self.decision = decision
        self.code = decision.code


class LoopBudgetExceeded(Refused):
    """The loop itself is out of calls or money: stop iterating."""


@dataclass
class LoopBudget:
    user: object
    limits: LoopLimits
    calls: int = 0

    @property
    def loop_id(self) -> str:
        return self.limits.loop_id

    def admit(self, feature, model: str, prompt_tokens: int, max_tokens: int, request_id: str | None = None) -> Decision:
        decision = admit(
            AdmissionRequest(
                request_id=request_id or uuid.uuid4().hex,
                user=self.user,
                feature=feature,
                model=model,
                prompt_tokens=prompt_tokens,
                max_tokens=max_tokens,
                loop=self.limits,
            )
        )
        if not decision.admitted:
            raise (LoopBudgetExceeded if decision.code in LOOP_CODES else Refused)(decision)
        self.calls += 1
        return decision


@contextmanager
def loop_budget(
    user, *, max_calls: int | None, max_cost_micro_usd: int | None = None, loop_id: str | None = None
) -> Iterator[LoopBudget]:
    if max_calls is None and max_cost_micro_usd is None:
        raise ValueError("a loop budget needs max_calls, max_cost_micro_usd or both")
    if max_calls is not None and max_calls < 1:
        raise ValueError("max_calls must be at least 1")
    yield LoopBudget(user, LoopLimits(loop_id or uuid.uuid4().hex, max_calls, max_cost_micro_usd))
