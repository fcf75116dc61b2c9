"""The OpenAI-compatible HTTP API: POST /v1/chat/completions and GET /v1/models.

Authenticated by per-user API keys (`Authorization: Bearer ck_…`, accounts/models.py). A completion
goes through the same chat request code as the websocket (inference/chat/, the pipeline): the same validation, guard,
ledger rows and cancellation. The chat request's first event decides the status code, so a refusal is a
429 (or 400/403/503, see `refusal_status`) even when a stream was asked for; after `accepted` the
answer is either collected into one chat.completion or streamed as server-sent events. An extract
feature (inference/web/modes.py) always answers collected: its content is the JSON object, or a 502.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from dataclasses import dataclass, replace
from datetime import UTC
from functools import partial, wraps
from typing import Any

from asgiref.sync import sync_to_async
from channels.db import database_sync_to_async
from django.conf import settings
from django.core.exceptions import RequestDataTooBig
from django.http import HttpRequest, HttpResponse, JsonResponse, StreamingHttpResponse
from django.views.decorators.csrf import csrf_exempt

from accounts.actions import do_touch_api_key
from accounts.models import ApiKey
from budgets.models import Feature, team_names_of
from project.logs import request_context
from project.proxies import client_address

from .chat.admit import refused_event
from .chat.events import INTERNAL_ERROR, refused
from .chat.pipeline import run_chat
from .chat.route import get_feature
from .models import ModelAlias
from .web import embeddings as embeddings_lib
from .web.frames import DEFAULT_FEATURE, ChatFrame, FrameError, loads_limited, parse_chat
from .web.params import ParamError, parse_params
from .web.ratelimits import rate_limit_headers

View = Callable[..., Awaitable[HttpResponse]]
log = logging.getLogger(__name__)

# Which request field a validation error is about, for the error body's "param".
PARAMS = {
    "bad_messages": "messages",
    "bad_role": "messages",
    "empty_content": "messages",
    "bad_text": "messages",
    "bad_max_tokens": "max_tokens",
    "bad_feature": "feature",
    "unknown_feature": "feature",
    "bad_loop_id": "loop_id",
    "bad_model": "model",
    "bad_stream": "stream",
}
SPEND_CODES = ("provider_spend", "loop_spend")


# --- errors ------------------------------------------------------------------------------------


def error_body(message: str, *, type: str, code: str | None, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def api_error(
    status: int, message: str, *, type: str, code: str | None, param: str | None = None, headers: dict | None = None
) -> JsonResponse:
    return JsonResponse(error_body(message, type=type, code=code, param=param), status=status, headers=headers)


def invalid_request(exc: FrameError | ParamError) -> JsonResponse:
    status = 413 if exc.code == "request_too_large" else 400
    param = exc.param if isinstance(exc, ParamError) else PARAMS.get(exc.code)
    return api_error(status, exc.message, type="invalid_request_error", code=exc.code, param=param)


def model_not_found(model: str) -> JsonResponse:
    # OpenAI's own words and shape for a model that is not there, so clients handle it as theirs.
    message = f"The model `{model}` does not exist or you do not have access to it. GET /v1/models lists the models you can use."
    return api_error(404, message, type="invalid_request_error", code="model_not_found")


def feature_not_allowed(key: ApiKey, feature: str) -> JsonResponse:
    """A key outside its scope: refused before the guard (no ledger row, as for other 4xx), logged."""
    log.info("api key %s refused: feature %r is outside its scope", key.pk, feature)
    message = (f"The API key {key.name!r} ({key.prefix}…) may not use the feature {feature!r}; it may use "
               f"{key.scope_text}. GET /v1/models lists the models it can use.")
    return api_error(403, message, type="permission_error", code="feature_not_allowed", param="feature")


TEAM_HEADER = "X-Ceiling-Team"


async def paying_team_or_refusal(request: HttpRequest) -> tuple[str, JsonResponse | None]:
    """The team named to pay for this request (X-Ceiling-Team, else the key's team) and, when the
    user is not in it, the 403 that says so (before the guard, no ledger row, as for other 4xx).
    No name: "" (the team the user joined first pays, budgets/guard.py request_scopes)."""
    name = request.headers.get(TEAM_HEADER, "").strip() or request.api_key.team_name
    if not name:
        return "", None
    teams = await database_sync_to_async(team_names_of)(request.api_key.user_id)
    if name in teams:
        return name, None
    where = f"the {TEAM_HEADER} header" if request.headers.get(TEAM_HEADER, "").strip() else f"the API key {request.api_key.name!r}"
    yours = ", ".join(repr(team) for team in teams) if teams else "none"
    message = f"You are not in a team called {name!r}, which {where} names to pay for this request; your teams: {yours}."
    return name, api_error(403, message, type="permission_error", code="team_not_member", param=TEAM_HEADER)


def refusal_status(code: str) -> tuple[int, str]:
    """(HTTP status, OpenAI error type) of a refusal: caps and spend are 429, as OpenAI's are."""
    if code in ("max_input_tokens", CONTEXT_LENGTH_EXCEEDED):
        return 400, "invalid_request_error"  # the request itself is too long: waiting never helps
    if code == "feature_disabled":
        return 403, "permission_error"
    if code in ("guard_unavailable", "variant_unavailable"):  # ours to fix, not the caller's
        return 503, "server_error"
    if code in SPEND_CODES or "_cost_per_" in code:
        return 429, "insufficient_quota"
    return 429, "rate_limit_exceeded"


# OpenAI's code for a prompt over the model's window: LangChain's overflow error and LiteLLM's
# context-window fallbacks look for it (and for "maximum context length" in the message). The
# ledger and the websocket keep the guard's own code, max_input_tokens.
CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
# Beyond this a Retry-After is not worth a client's automatic retry (OpenAI's waits up to 120 s and
# then gives up; one that waits a minute for a cap that resets at midnight only holds a connection).
MAX_RETRY_AFTER_S = 60


def openai_refusal(event: dict) -> tuple[str, str]:
    """(code, message) of a refusal as OpenAI's clients read it: a too-long prompt in OpenAI's words."""
    if event["code"] != "max_input_tokens":
        return event["code"], event["message"]
    if event.get("limit") is None:  # already in OpenAI's words (the embeddings' refusal)
        return CONTEXT_LENGTH_EXCEEDED, event["message"]
    head = f"This model's maximum context length is {event['limit']} tokens."
    if event.get("prompt_tokens"):
        tail = f"However, your messages resulted in {event['prompt_tokens']} tokens. Please reduce the length of the messages."
    else:  # refused by its size before it was tokenized: the guard's sentence has the bytes
        tail = f"However, your messages are longer than that. {event['message']}"
    # The code in the text too: openai>=2 clients put only the message in str(error), which is
    # where LangChain looks for "context_length_exceeded".
    return CONTEXT_LENGTH_EXCEEDED, f"{head} {tail} ({CONTEXT_LENGTH_EXCEEDED})"


def refusal_response(event: dict) -> JsonResponse:
    status, kind = refusal_status(event["code"])
    code, message = openai_refusal(event)
    retry_after = event.get("retry_after_s")
    headers = {"Retry-After": str(retry_after)} if retry_after else {}
    if not retry_after or retry_after > MAX_RETRY_AFTER_S:
        headers["x-should-retry"] = "false"  # tells OpenAI's clients that retrying soon will not help
    return api_error(status, message, type=kind, code=code, headers=headers)


def error_event(event: dict) -> tuple[int, dict]:
    """(status, body) of a chat request's `error` event: a bad request, or the engine or we failed."""
    if event["code"] in ("unknown_feature", "batch_only"):
        return 400, error_body(event["message"], type="invalid_request_error", code=event["code"], param="feature")
    if event["code"] == "tools_unsupported":
        return 400, error_body(event["message"], type="invalid_request_error", code=event["code"], param="tools")
    if event["code"] == "invalid_json":
        return 502, error_body(event["message"], type="server_error", code=event["code"])  # the model's answer was bad
    status = 500 if event["code"] == "internal" else 503
    return status, error_body(event["message"], type="server_error", code=event["code"])


# Errors that come back the same however often they are retried (and a retry of invalid_json pays
# for the same answer again): OpenAI's clients would retry a 5xx twice by default.
DETERMINISTIC_ERRORS = frozenset({"invalid_json"})


def error_event_response(event: dict) -> JsonResponse:
    status, body = error_event(event)
    response = JsonResponse(body, status=status)
    if event["code"] in DETERMINISTIC_ERRORS:
        response["x-should-retry"] = "false"
    return response


# --- every /v1 answer -------------------------------------------------------------------------


def with_request_id(view: View) -> View:
    """Every /v1 answer carries x-request-id, refusals and errors included; a chat's is its ledger row's.

    A 4xx other than 408/409/429 is the request's own fault, so retrying it cannot help: it says so
    with x-should-retry: false, which OpenAI's clients obey (they retry 408, 409, 429 and 5xx).
    """

    @wraps(view)
    async def wrapper(request: HttpRequest, *args, **kwargs) -> HttpResponse:
        request.request_id = uuid.uuid4().hex
        with request_context(request.request_id):
            response = await view(request, *args, **kwargs)
        if "x-request-id" not in response:
            response["x-request-id"] = request.request_id
        if 400 <= response.status_code < 500 and response.status_code not in (408, 409, 429):
            response.setdefault("x-should-retry", "false")
        return response

    return wrapper


# --- authentication ----------------------------------------------------------------------------


def api_key_required(view: View) -> View:
    """Bearer API key → request.api_key (with its user), else a 401 in OpenAI's shape."""

    @wraps(view)
    async def wrapper(request: HttpRequest, *args, **kwargs) -> HttpResponse:
        scheme, _, token = request.headers.get("Authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            return _unauthorized("missing_api_key", "Send your API key as 'Authorization: Bearer <key>'. Create one at /accounts/keys/.")
        key, expired = await authenticate(token.strip(), client_address(request))
        if key is None:
            return _unauthorized("invalid_api_key", "This API key is not valid: it is unknown, revoked, or its user is deactivated.")
        if expired:
            return _unauthorized("invalid_api_key", expired)
        request.api_key = key
        return await view(request, *args, **kwargs)

    return wrapper


# The /v1 lookups run off the one thread-sensitive thread (from the connection pool): a burst's
# requests would otherwise take their turns there, one query at a time, before reaching the guard.
@partial(database_sync_to_async, thread_sensitive=False)
def authenticate(token: str, address: str) -> tuple[ApiKey | None, str | None]:
    """(the unrevoked key with this text, why it no longer works: None while it does).

    Only a working key's use is recorded: last_used_at says when it last let a request in.
    """
    key = ApiKey.objects.for_plaintext(token)
    if key is None:
        return None, None
    if key.is_expired():
        return key, expired_message(key)
    do_touch_api_key(key, address)
    return key, None


def expired_message(key: ApiKey) -> str:
    when = key.expires_at.astimezone(UTC).strftime("%Y-%m-%d %H:%M UTC")
    rotated = " (it was rotated: use its successor)" if key.successors.exists() else ""
    return (f"This API key {key.name!r} ({key.prefix}…) expired at {when}{rotated}. "
            "Create or rotate a key at /accounts/keys/.")


def _unauthorized(code: str, message: str) -> JsonResponse:
    return api_error(401, message, type="authentication_error", code=code, headers={"WWW-Authenticate": "Bearer"})


# --- request parsing ---------------------------------------------------------------------------


@dataclass(frozen=True)
class ChatRequest:
    """A validated completion request: the chat request's frame plus what only the HTTP API has."""

    frame: ChatFrame
    model: str
    stream: bool
    feature_given: bool  # the body named its feature: that wins over the model's routing
    include_usage: bool = False  # stream_options.include_usage: end the stream with a usage chunk


def read_body(request: HttpRequest) -> bytes:
    """The body, refused by its declared size before anything reads or parses it."""
    limit = settings.CEILING_MAX_FRAME_BYTES
    declared = request.headers.get("Content-Length", "")
    if declared.isdigit() and int(declared) > limit:
        raise _too_large(f"{int(declared):,} bytes", limit)
    try:
        body = request.body
    except RequestDataTooBig:  # no Content-Length and above Django's own limit
        raise _too_large("too large", limit) from None
    if len(body) > limit:
        raise _too_large(f"{len(body):,} bytes", limit)
    return body


def _too_large(size: str, limit: int) -> FrameError:
    return FrameError("request_too_large", f"The request body is {size}; the limit is {limit:,} bytes.")


def parse_chat_request(body: bytes) -> ChatRequest:
    return parse_chat_data(loads_limited(body, "request body"))


def parse_chat_data(data: object) -> ChatRequest:
    """A completion request from its parsed body (a chat's, or a legacy completion's turned into one)."""
    if not isinstance(data, dict):
        raise FrameError("bad_json", "The request body must be a JSON object.")
    model = _first_given(data.get("model"), settings.CEILING_MODEL_NAME)
    if not isinstance(model, str) or not model:
        raise FrameError("bad_model", f'"model" must be a model name, such as "{settings.CEILING_MODEL_NAME}".')
    stream = _first_given(data.get("stream"), False)
    if not isinstance(stream, bool):
        raise FrameError("bad_stream", "\"stream\" must be true or false.")
    fields = {
        "messages": _openai_messages(data.get("messages")),
        "feature": data.get("feature"),
        "loop_id": data.get("loop_id"),
        # max_completion_tokens is the newer name of the same limit; either may be sent.
        "max_tokens": _first_given(data.get("max_completion_tokens"), data.get("max_tokens")),
        "tags": _tags_field(data),
    }
    frame = parse_chat({name: value for name, value in fields.items() if value is not None})
    frame = replace(frame, params=parse_params(data))
    return ChatRequest(frame, model, stream, feature_given=data.get("feature") is not None,
                       include_usage=_include_usage(data.get("stream_options"), stream))


def _include_usage(options: Any, stream: bool) -> bool:
    """stream_options.include_usage, checked as OpenAI checks it."""
    if options is None:
        return False
    if not stream:
        raise ParamError("invalid_value", "The 'stream_options' parameter is only allowed when 'stream' is enabled.", "stream_options")
    if not isinstance(options, dict):
        raise ParamError("invalid_type", "Invalid type for 'stream_options': expected an object.", "stream_options")
    include = options.get("include_usage", False)
    if not isinstance(include, bool):
        raise ParamError("invalid_type", "Invalid type for 'stream_options.include_usage': expected a boolean.", "stream_options.include_usage")
    return include


def _tags_field(data: dict):
    """`metadata.tags`, or `tags` at the top level (OpenAI's clients merge `extra_body` into the body),
    or an `extra_body` object sent as is; one place only, so no request counts twice."""
    metadata, extra = data.get("metadata"), data.get("extra_body")
    given = [
        value for value in (
            metadata.get("tags") if isinstance(metadata, dict) else None,
            data.get("tags"),
            extra.get("tags") if isinstance(extra, dict) else None,
        ) if value is not None
    ]
    if len(given) > 1:
        raise FrameError("bad_tags", "Send \"tags\" once: in metadata.tags or in extra_body.tags, not both.")
    return given[0] if given else None


@partial(database_sync_to_async, thread_sensitive=False)
def routed_feature(model: str) -> str | None:
    """The feature a model name selects: its alias's, the default one for the served model, else None."""
    feature = ModelAlias.objects.filter(name=model).values_list("feature__name", flat=True).first()
    if feature is not None:
        return feature
    return DEFAULT_FEATURE if model == settings.CEILING_MODEL_NAME else None


def _first_given(*values: Any) -> Any:
    return next((value for value in values if value is not None), None)


def _openai_messages(messages: Any) -> Any:
    """OpenAI's newer "developer" role is a system prompt here; every other field is parse_chat's to check."""
    if not isinstance(messages, list):
        return messages
    return [{**m, "role": "system"} if isinstance(m, dict) and m.get("role") == "developer" else m for m in messages]


@partial(database_sync_to_async, thread_sensitive=False)
def is_extract(feature_name: str) -> bool:
    """An extract feature answers once, with a whole JSON object, even when a stream was asked for."""
    return Feature.objects.filter(name=feature_name, mode=Feature.Mode.EXTRACT).exists()


# --- views -------------------------------------------------------------------------------------


def with_rate_limits(view: View) -> View:
    """Every answer of an authenticated /v1 view carries OpenAI's x-ratelimit-* headers.

    The view sets request.rate_limit_feature once it knows which feature's caps apply (None: the
    caller's caps for all features). They are read after the view's work, so a finished answer's
    own request and tokens are counted, and a streamed one's reservation.
    """

    @wraps(view)
    async def wrapper(request: HttpRequest, *args, **kwargs) -> HttpResponse:
        request.rate_limit_feature = None
        response = await view(request, *args, **kwargs)
        headers = await read_rate_limits(request.api_key.user, request.rate_limit_feature, request.api_key)
        for name, value in headers.items():
            response[name] = value
        return response

    return wrapper


# Off the one thread-sensitive thread: a quota query and a Redis read, beside the request's own work.
@partial(database_sync_to_async, thread_sensitive=False)
def read_rate_limits(user, feature_name: str | None, api_key=None) -> dict[str, str]:
    return rate_limit_headers(user, feature_name, api_key)


def method_not_allowed(request: HttpRequest, allowed: str) -> JsonResponse:
    message = f"Use {allowed} for {request.path}; {request.method} is not allowed there."
    return api_error(405, message, type="invalid_request_error", code="method_not_allowed", headers={"Allow": allowed})


@csrf_exempt
@with_request_id
@api_key_required
@with_rate_limits
async def chat_completions(request: HttpRequest) -> HttpResponse:
    if request.method != "POST":
        return method_not_allowed(request, "POST")
    try:
        chat = parse_chat_request(read_body(request))
    except (FrameError, ParamError) as exc:
        return invalid_request(exc)
    return await answer(request, chat, Completion)


@csrf_exempt
@with_request_id
@api_key_required
@with_rate_limits
async def completions(request: HttpRequest) -> HttpResponse:
    """The legacy POST /v1/completions: one prompt string, answered as the user's message of a chat."""
    if request.method != "POST":
        return method_not_allowed(request, "POST")
    try:
        chat = parse_chat_data(legacy_body(read_body(request)))  # parsed once, not dumped and read again
    except (FrameError, ParamError) as exc:
        return invalid_request(exc)
    return await answer(request, chat, TextCompletion)


async def answer(request: HttpRequest, chat: ChatRequest, shape: type[Completion]) -> HttpResponse:
    """Route, admit and answer one parsed request: the chat request's first event decides the status."""
    if not chat.feature_given:
        feature = await routed_feature(chat.model)
        if feature is None:
            return model_not_found(chat.model)
        chat = replace(chat, frame=replace(chat.frame, feature=feature))
    request.rate_limit_feature = chat.frame.feature
    if not request.api_key.allows(chat.frame.feature):
        return feature_not_allowed(request.api_key, chat.frame.feature)
    team, refusal = await paying_team_or_refusal(request)
    if refusal is not None:
        return refusal
    stream = chat.stream and not await is_extract(chat.frame.feature)
    # The key's own caps apply to this request as well as its user's (budgets/guard.py).
    frame = replace(chat.frame, api_key=request.api_key, team=team)
    events = run_chat(request.api_key.user, frame, request_id=request.request_id)
    first = await anext(events, INTERNAL_ERROR)
    if first["type"] != "accepted":
        await events.aclose()
        return refusal_response(first) if first["type"] == "refused" else error_event_response(first)
    completion = shape(first["request_id"], chat.model, logprobs=chat.frame.params.logprobs, include_usage=chat.include_usage)
    if stream:
        response = StreamingHttpResponse(stream_chunks(events, completion), content_type="text/event-stream")
        response["Cache-Control"] = "no-cache"
        response["X-Accel-Buffering"] = "no"  # proxies must pass each chunk on at once
    else:
        response = await collect_completion(events, completion)
    if "fallback" in first:
        # The guard served it with the feature's fallback: say who answered (docs/api.md).
        response["x-ceiling-fallback"] = first["fallback"]["feature"]
        response["x-ceiling-fallback-model"] = first["fallback"]["model"]
    return response


def legacy_body(body: bytes) -> dict:
    """A /v1/completions body as the chat body it stands for: `prompt` becomes the user's message.

    What a chat model cannot do with a bare prompt is refused with a sentence, not ignored.
    """
    data = loads_limited(body, "request body")  # deep nesting is a 400, never a RecursionError's 500
    if not isinstance(data, dict):
        raise FrameError("bad_json", "The request body must be a JSON object.")
    if "messages" in data:
        raise ParamError("invalid_value", "/v1/completions takes a 'prompt'; send 'messages' to /v1/chat/completions.", "messages")
    if data.get("suffix") is not None:
        raise ParamError("unsupported_value", "Ceiling's models answer after a prompt and cannot fill in before a "
                         "'suffix'; leave 'suffix' out.", "suffix")
    if data.get("echo"):
        raise ParamError("unsupported_value", "Ceiling does not echo the prompt back; send 'echo': false or leave it out.", "echo")
    if data.get("logprobs") is not None:
        raise ParamError("unsupported_value", "The legacy 'logprobs' is not supported here; use /v1/chat/completions with "
                         "'logprobs': true and 'top_logprobs'.", "logprobs")
    if data.get("best_of") not in (None, 1):
        raise ParamError("unsupported_value", "Ceiling answers with one completion per request, so 'best_of' must be 1.", "best_of")
    fields = {name: value for name, value in data.items() if name not in ("prompt", "suffix", "echo", "best_of", "logprobs")}
    return fields | {"messages": [{"role": "user", "content": legacy_prompt(data.get("prompt"))}]}


def legacy_prompt(prompt: Any) -> str:
    """One prompt string: a string, or a list of one string (the client's batch of one)."""
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    if isinstance(prompt, list):
        raise ParamError("unsupported_value", "Ceiling answers one prompt per request; send 'prompt' as one string.", "prompt")
    if not isinstance(prompt, str) or not prompt.strip():
        raise ParamError("invalid_value", "'prompt' must be a string with some text in it.", "prompt")
    return prompt


@csrf_exempt
@with_request_id
@api_key_required
@with_rate_limits
async def embeddings(request: HttpRequest) -> HttpResponse:
    """POST /v1/embeddings: counted, capped, logged and priced as a chat is (inference/web/embeddings.py)."""
    if request.method != "POST":
        return method_not_allowed(request, "POST")
    try:
        asked = embeddings_lib.parse_embedding_request(read_body(request))
    except (FrameError, ParamError) as exc:
        return invalid_request(exc)
    if asked.model not in embeddings_lib.MODEL_NAMES:
        return model_not_found(asked.model)
    feature = await get_feature(asked.feature)
    if feature is None:
        return api_error(400, f"There is no feature named {asked.feature!r}.", type="invalid_request_error",
                         code="unknown_feature", param="feature")
    request.rate_limit_feature = feature.name
    if not request.api_key.allows(feature.name):
        return feature_not_allowed(request.api_key, feature.name)
    user, request_id = request.api_key.user, request.request_id
    ids = await off_thread(embeddings_lib.token_ids)(asked.inputs)
    tokens = sum(len(one) for one in ids)
    refusal = _embedding_refusal(feature, ids)
    if refusal is not None:
        code, message = refusal
        await database_sync_to_async(embeddings_lib.log_refusal)(request_id, user, feature, code, message, tokens)
        return refusal_response(refused(code, message))
    decision = await database_sync_to_async(embeddings_lib.admit, thread_sensitive=False)(
        request_id, user, request.api_key, feature, asked, ids)
    if not decision.admitted:
        return refusal_response(refused_event(decision))
    try:
        vectors = await off_thread(embeddings_lib.embed_and_settle)(request_id, asked.inputs, tokens)
    except Exception:  # noqa: BLE001 - settled failed already; the caller hears it in OpenAI's shape
        log.exception("embeddings %s failed", request_id)
        return error_event_response({"type": "error", "code": "engine_failed",
                                     "message": "The embedding model failed on this request; it is logged, please try again."})
    return JsonResponse(embeddings_lib.response_body(asked, vectors, tokens))


def _embedding_refusal(feature: Feature, ids: list[list[int]]) -> tuple[str, str] | None:
    """(code, message) decided before the guard: a switched-off feature, an input over the model's length."""
    if not feature.enabled:
        return "feature_disabled", f"The feature {feature.name!r} is switched off by the operators."
    message = embeddings_lib.too_long(ids)
    return ("max_input_tokens", message) if message else None  # the ledger's code, as for a chat


def off_thread(function):
    # The tokenizer and the model release the GIL in their native code: other requests keep moving.
    return sync_to_async(function, thread_sensitive=False)


@csrf_exempt
@with_request_id
@api_key_required
@with_rate_limits
async def list_models(request: HttpRequest) -> HttpResponse:
    if request.method != "GET":
        return method_not_allowed(request, "GET")
    return JsonResponse({"object": "list", "data": await listed_models(request.api_key)})


@csrf_exempt
@with_request_id
@api_key_required
@with_rate_limits
async def retrieve_model(request: HttpRequest, model: str) -> HttpResponse:
    """GET /v1/models/{id}: one entry of the list (the client's models.retrieve), else a 404 model_not_found."""
    if request.method != "GET":
        return method_not_allowed(request, "GET")
    found = next((entry for entry in await listed_models(request.api_key) if entry["id"] == model), None)
    return JsonResponse(found) if found is not None else model_not_found(model)


@csrf_exempt
@with_request_id
async def not_found(request: HttpRequest, rest: str = "") -> HttpResponse:
    """Any other /v1 path: OpenAI's JSON 404, never Django's HTML page (clients parse the body)."""
    message = f"Invalid URL ({request.method} {request.path}): Ceiling's API has no such endpoint; GET /v1/openapi.json lists them."
    return api_error(404, message, type="invalid_request_error", code="unknown_url")


@database_sync_to_async
def listed_models(key: ApiKey) -> list[dict]:
    """The served model (the default feature), one entry per alias of a feature an API caller can use,
    then the embedding model (POST /v1/embeddings; on the default feature unless the body names one);
    of those, the ones whose feature `key` may use."""
    def entry(name: str, feature: str) -> dict:
        return {"id": name, "object": "model", "created": 0, "owned_by": "ceiling", "feature": feature}

    aliases = (
        ModelAlias.objects.filter(feature__enabled=True).exclude(feature__mode=Feature.Mode.BATCH)
        .order_by("name").values_list("name", "feature__name")
    )
    served = [entry(settings.CEILING_MODEL_NAME, DEFAULT_FEATURE), *(entry(name, feature) for name, feature in aliases)]
    listed = [*served, entry(embeddings_lib.EMBEDDING_MODEL, DEFAULT_FEATURE)]  # POST /v1/embeddings only
    return [one for one in listed if key.allows(one["feature"])]


# --- responses ---------------------------------------------------------------------------------


class Completion:
    """The OpenAI objects of one answer; the id carries our request id, as in the TokenLog."""

    def __init__(self, request_id: str, model: str, *, logprobs: bool = False, include_usage: bool = False) -> None:
        self.request_id = request_id
        self.id = f"chatcmpl-{request_id}"
        self.model = model
        self.created = int(time.time())
        self.logprobs = logprobs  # the client asked for them: each choice carries {"content": [...]}
        self.include_usage = include_usage  # as OpenAI: every chunk has "usage": null, the last one after

    def chunk(self, delta: dict, finish_reason: str | None = None, logprobs: list | None = None) -> dict:
        choice = {"index": 0, "delta": delta, "logprobs": self._logprobs(logprobs), "finish_reason": finish_reason}
        extra = {"usage": None} if self.include_usage else {}
        return self._object("chat.completion.chunk", choices=[choice], **extra)

    def usage_chunk(self, done: dict) -> dict:
        return self._object("chat.completion.chunk", choices=[], usage=usage(done))

    def whole(self, text: str, done: dict, logprobs: list | None = None) -> dict:
        message = {"role": "assistant", "content": text, "refusal": None}
        if done.get("tool_calls"):
            message["tool_calls"] = done["tool_calls"]
            message["content"] = text or None  # OpenAI's content is null beside tool calls
        choice = {"index": 0, "message": message, "logprobs": self._logprobs(logprobs), "finish_reason": done["finish_reason"]}
        return self._object("chat.completion", choices=[choice], usage=usage(done))

    def _logprobs(self, entries: list | None) -> dict | None:
        if not self.logprobs or entries is None:
            return None
        return {"content": entries, "refusal": None}

    def _object(self, kind: str, **fields) -> dict:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model, **fields}


class TextCompletion(Completion):
    """The legacy text_completion objects of /v1/completions: `text` where a chat has a message."""

    def __init__(self, request_id: str, model: str, **options) -> None:
        super().__init__(request_id, model, **options)
        self.id = f"cmpl-{request_id}"

    def chunk(self, delta: dict, finish_reason: str | None = None, logprobs: list | None = None) -> dict:
        choice = {"text": delta.get("content") or "", "index": 0, "logprobs": None, "finish_reason": finish_reason}
        extra = {"usage": None} if self.include_usage else {}
        return self._object("text_completion", choices=[choice], **extra)

    def usage_chunk(self, done: dict) -> dict:
        return self._object("text_completion", choices=[], usage=usage(done))

    def whole(self, text: str, done: dict, logprobs: list | None = None) -> dict:
        choice = {"text": text, "index": 0, "logprobs": None, "finish_reason": done["finish_reason"]}
        return self._object("text_completion", choices=[choice], usage=usage(done))


def usage(done: dict) -> dict:
    numbers = done["usage"]
    return {
        "prompt_tokens": numbers["prompt_tokens"],
        "completion_tokens": numbers["completion_tokens"],
        "total_tokens": numbers["prompt_tokens"] + numbers["completion_tokens"],
        "prompt_tokens_details": {"cached_tokens": numbers["cached_tokens"]},
    }


async def collect_completion(events: AsyncIterator[dict], completion: Completion) -> JsonResponse:
    parts: list[str] = []
    logprobs: list = []
    async with aclosing(events):
        async for event in events:
            if event["type"] == "token":
                parts.append(event["text"])
                logprobs.extend(event.get("logprobs") or ())
            elif event["type"] == "done":
                text = json.dumps(event["result"]) if "result" in event else "".join(parts)
                return JsonResponse(completion.whole(text, event, logprobs))
            elif event["type"] == "error":
                return error_event_response(event)
    return error_event_response(INTERNAL_ERROR)


async def stream_chunks(events: AsyncIterator[dict], completion: Completion) -> AsyncIterator[bytes]:
    """Server-sent events as OpenAI streams them; a last chunk with usage only when the client asked
    (stream_options.include_usage): its empty `choices` breaks the common `chunk.choices[0]` loop.

    Daphne hands a client's disconnect to Django, which cancels or closes this generator; closing
    `events` then cancels the generation.
    """
    async with aclosing(events):
        yield sse(completion.chunk({"role": "assistant", "content": ""}))
        async for event in events:
            if event["type"] == "token":
                yield sse(completion.chunk({"content": event["text"]}, logprobs=event.get("logprobs") or []))
            elif event["type"] == "done":
                if "result" in event:  # response_format JSON: the checked object, whole, in one piece
                    yield sse(completion.chunk({"content": json.dumps(event["result"])}))
                if event.get("tool_calls"):
                    calls = [{"index": index, **call} for index, call in enumerate(event["tool_calls"])]
                    yield sse(completion.chunk({"tool_calls": calls}))
                yield sse(completion.chunk({}, finish_reason=event["finish_reason"]))
                if completion.include_usage:
                    yield sse(completion.usage_chunk(event))
                yield b"data: [DONE]\n\n"
                return
            elif event["type"] == "error":
                # Headers are gone already: the error travels as a chunk, which OpenAI's clients raise.
                yield sse(error_event(event)[1])
                return


def sse(data: dict) -> bytes:
    return b"data: " + json.dumps(data, separators=(",", ":")).encode() + b"\n\n"
