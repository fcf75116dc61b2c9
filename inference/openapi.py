"""The OpenAPI 3.1 description of /v1, served at GET /v1/openapi.json (no key needed: it holds no secrets).

Kept true to inference/api.py: the limits come from the same settings the API enforces, and
tests/test_api_fuzz.py throws schemathesis at the live API with this document, checking every
response against it. A rule JSON Schema cannot say (the last message must be the user's; text
parts must join into non-blank text) is answered with a documented 400.
"""

from __future__ import annotations

from django.conf import settings
from django.http import HttpRequest, JsonResponse

JSON = "application/json"


def openapi_document() -> dict:
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "Ceiling OpenAI-compatible API",
            "version": "1",
            "description": "Chat completions behind Ceiling's budget guard. Refusals are 429 (or 400/403/503) "
            "with an OpenAI-style error body; every admitted or refused request leaves a ledger row.",
        },
        "servers": [{"url": "/"}],
        "security": [{"apiKey": []}],
        "paths": {
            "/v1/chat/completions": {"post": _chat_completions()},
            "/v1/completions": {"post": _completions()},
            "/v1/embeddings": {"post": _embeddings()},
            "/v1/models": {"get": _models()},
            "/v1/models/{model}": {"get": _model()},
        },
        "components": {
            "securitySchemes": {"apiKey": {"type": "http", "scheme": "bearer", "description": "a key from /accounts/keys/ (ck_…)"}},
            "schemas": _schemas(),
            "responses": _error_responses(),
        },
    }


def _chat_completions() -> dict:
    return {
        "operationId": "createChatCompletion",
        "requestBody": {"required": True, "content": {JSON: {"schema": {"$ref": "#/components/schemas/ChatRequest"}}}},
        "responses": {
            "200": {
                "description": "the answer, whole (stream false) or as server-sent chat.completion.chunk events",
                "headers": {"X-Request-Id": {"schema": {"type": "string"}, "description": "the ledger's request id"},
                            **RATE_LIMIT_HEADERS, **FALLBACK_HEADERS},
                "content": {
                    JSON: {"schema": {"$ref": "#/components/schemas/ChatCompletion"}},
                    "text/event-stream": {"schema": {"type": "string"}},
                },
            },
            "400": {"$ref": "#/components/responses/BadRequest"},
            "401": {"$ref": "#/components/responses/Unauthorized"},
            "403": {"$ref": "#/components/responses/FeatureDisabled"},
            "404": {"$ref": "#/components/responses/ModelNotFound"},
            "405": {"$ref": "#/components/responses/MethodNotAllowed"},
            "413": {"$ref": "#/components/responses/TooLarge"},
            "429": {"$ref": "#/components/responses/Refused"},
            "502": {"$ref": "#/components/responses/BadModelOutput"},
            "503": {"$ref": "#/components/responses/Unavailable"},
        },
    }


def _completions() -> dict:
    return {
        "operationId": "createCompletion",
        "description": "The legacy endpoint: 'prompt' (a string, or a list of one) is answered as the user's message of a "
        "chat, with the same fields, guard and ledger as /v1/chat/completions; 'suffix', 'echo' true, 'logprobs' and "
        "'best_of' above 1 are a 400 that says why.",
        "requestBody": {"required": True, "content": {JSON: {"schema": {"type": "object", "required": ["prompt"]}}}},
        "responses": {
            "200": {"description": "a text_completion, whole or as server-sent events",
                    "content": {JSON: {"schema": {"type": "object"}}, "text/event-stream": {"schema": {"type": "string"}}}},
            **{status: {"$ref": f"#/components/responses/{name}"} for status, name in ERROR_RESPONSES},
        },
    }


def _embeddings() -> dict:
    return {
        "operationId": "createEmbedding",
        "description": "all-MiniLM-L6-v2 (384 dimensions, 256 tokens per input): 'input' a string or up to 256 strings, "
        "'encoding_format' float or base64; counted, capped, logged and priced as a chat on 'feature' (default chat).",
        "requestBody": {"required": True, "content": {JSON: {"schema": {"type": "object", "required": ["model", "input"]}}}},
        "responses": {
            "200": {"description": "OpenAI's list of embeddings with usage", "content": {JSON: {"schema": {"type": "object"}}}},
            **{status: {"$ref": f"#/components/responses/{name}"} for status, name in ERROR_RESPONSES if status != "502"},
        },
    }


def _model() -> dict:
    return {
        "operationId": "retrieveModel",
        "parameters": [{"name": "model", "in": "path", "required": True, "schema": {"type": "string"}}],
        "responses": {
            "200": {"description": "one entry of GET /v1/models", "content": {JSON: {"schema": {"type": "object"}}}},
            "401": {"$ref": "#/components/responses/Unauthorized"},
            "404": {"$ref": "#/components/responses/ModelNotFound"},
        },
    }


ERROR_RESPONSES = (("400", "BadRequest"), ("401", "Unauthorized"), ("403", "FeatureDisabled"), ("404", "ModelNotFound"),
                   ("405", "MethodNotAllowed"), ("413", "TooLarge"), ("429", "Refused"), ("502", "BadModelOutput"),
                   ("503", "Unavailable"))


def _models() -> dict:
    return {
        "operationId": "listModels",
        "responses": {
            "200": {"description": "the served model and each alias of a feature the caller may use", "headers": RATE_LIMIT_HEADERS,
                    "content": {JSON: {"schema": {"$ref": "#/components/schemas/ModelList"}}}},
            "401": {"$ref": "#/components/responses/Unauthorized"},
            "405": {"$ref": "#/components/responses/MethodNotAllowed"},
        },
    }


def _schemas() -> dict:
    token_limit = {"type": "integer", "minimum": 1, "maximum": settings.CEILING_MAX_TOKENS_LIMIT}
    text_part = {
        "type": "object",
        "required": ["type", "text"],
        "properties": {"type": {"const": "text"}, "text": {"type": "string"}},
    }
    return {
        "ChatRequest": {
            "type": "object",
            "required": ["messages"],
            "properties": {
                "model": {
                    "type": "string", "minLength": 1, "default": settings.CEILING_MODEL_NAME,
                    "examples": [settings.CEILING_MODEL_NAME],
                    "description": "a name GET /v1/models lists: the served model (the default feature) or a feature's alias; "
                    "anything else is a 404 model_not_found unless \"feature\" is sent",
                },
                "messages": {
                    "type": "array",
                    "minItems": 1,
                    "maxItems": settings.CEILING_MAX_MESSAGES,
                    "items": {"$ref": "#/components/schemas/Message"},
                    "description": "the last message must have role user (else 400 bad_role)",
                },
                "max_tokens": token_limit,
                "max_completion_tokens": {**token_limit, "description": "the newer name of max_tokens; wins when both are sent"},
                "stream": {"type": "boolean", "default": False},
                "stream_options": {
                    "type": "object", "properties": {"include_usage": {"type": "boolean"}},
                    "description": "with stream true only (else 400): include_usage ends the stream with a usage chunk",
                },
                "feature": {"type": "string", "minLength": 1, "default": "chat", "description": "Ceiling's feature (budget) name"},
                "loop_id": {"type": "string", "minLength": 1, "maxLength": 64, "description": "counts calls and spend against a loop budget"},
                **_generation_params(),
            },
            "description": f"The whole body is at most {settings.CEILING_MAX_FRAME_BYTES} bytes (else 413). Other OpenAI "
            "fields are accepted and ignored.",
        },
        "Message": {
            "type": "object",
            "required": ["role", "content"],
            "properties": {
                "role": {"enum": ["system", "developer", "user", "assistant"]},
                "content": {
                    "oneOf": [
                        {"type": "string", "pattern": r"\S", "description": "not blank"},
                        {"type": "array", "minItems": 1, "items": text_part, "description": "joined, must not be blank"},
                    ]
                },
            },
        },
        "ChatCompletion": {
            "type": "object",
            "required": ["id", "object", "created", "model", "choices", "usage"],
            "properties": {
                "id": {"type": "string", "pattern": "^chatcmpl-"},
                "object": {"const": "chat.completion"},
                "created": {"type": "integer"},
                "model": {"type": "string"},
                "choices": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "required": ["index", "message", "finish_reason"],
                        "properties": {
                            "index": {"type": "integer"},
                            "message": {
                                "type": "object",
                                "required": ["role", "content"],
                                "properties": {
                                    "role": {"const": "assistant"},
                                    "content": {"type": ["string", "null"], "description": "null beside a remote's tool calls"},
                                    "tool_calls": {"type": "array", "items": {"type": "object"}},
                                },
                            },
                            "logprobs": {"type": ["object", "null"]},
                            "finish_reason": {"type": "string", "description": "stop, length, cancelled or tool_calls"},
                        },
                    },
                },
                "usage": {"$ref": "#/components/schemas/Usage"},
            },
        },
        "Usage": {
            "type": "object",
            "required": ["prompt_tokens", "completion_tokens", "total_tokens"],
            "properties": {
                "prompt_tokens": {"type": "integer", "minimum": 0},
                "completion_tokens": {"type": "integer", "minimum": 0},
                "total_tokens": {"type": "integer", "minimum": 0},
                "prompt_tokens_details": {"type": "object", "properties": {"cached_tokens": {"type": "integer", "minimum": 0}}},
            },
        },
        "ModelList": {
            "type": "object",
            "required": ["object", "data"],
            "properties": {
                "object": {"const": "list"},
                "data": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "required": ["id", "object", "owned_by"],
                        "properties": {
                            "id": {"type": "string"}, "object": {"const": "model"}, "owned_by": {"type": "string"},
                            "feature": {"type": "string", "description": "the Ceiling feature this name selects"},
                        },
                    },
                },
            },
        },
        "Error": {
            "type": "object",
            "required": ["error"],
            "properties": {
                "error": {
                    "type": "object",
                    "required": ["message", "type", "param", "code"],
                    "properties": {
                        "message": {"type": "string", "minLength": 1},
                        "type": {"type": "string"},
                        "param": {"type": ["string", "null"]},
                        "code": {"type": ["string", "null"]},
                    },
                }
            },
        },
    }


def _error_responses() -> dict:
    def error(description: str, headers: dict | None = None) -> dict:
        response = {"description": description, "content": {JSON: {"schema": {"$ref": "#/components/schemas/Error"}}}}
        if headers:
            response["headers"] = headers
        return response

    return {
        "BadRequest": error("the body is not a valid request, the feature is unknown, or the prompt is over the input limit"),
        "Unauthorized": error("no API key, or an unknown, revoked or expired one", {"WWW-Authenticate": {"schema": {"type": "string"}}}),
        "FeatureDisabled": error("the feature is switched off, or outside the API key's allowed features (feature_not_allowed)"),
        "ModelNotFound": error("no feature answers to this model name (and no \"feature\" was sent)"),
        "MethodNotAllowed": error("wrong HTTP method"),
        "TooLarge": error(f"the body is over {settings.CEILING_MAX_FRAME_BYTES} bytes; refused before it is read"),
        "Refused": error(
            "refused by the budget guard (a cap or a spend limit)",
            {"Retry-After": {"schema": {"type": "string"}, "description": "seconds, when waiting helps"}, **RATE_LIMIT_HEADERS},
        ),
        "BadModelOutput": error("the model's answer was not the JSON object an extract feature or response_format asked for, "
                                "or broke the response_format's schema"),
        "Unavailable": error("the guard or the engine is unavailable; try again"),
    }


def _string_header(description: str) -> dict:
    return {"schema": {"type": "string"}, "description": description}


# Sent when a cap on requests (or tokens) applies to the caller: the tightest one (inference/web/ratelimits.py).
RATE_LIMIT_HEADERS = {
    f"x-ratelimit-{what}-{metric}": _string_header(text.format(metric=metric))
    for metric in ("requests", "tokens")
    for what, text in (("limit", "the tightest cap's {metric}"), ("remaining", "{metric} left under it"),
                       ("reset", "when it resets, e.g. 6m0s"))
}


# Sent only when a cost cap or a provider's spend limit refused the feature and its fallback served it.
FALLBACK_HEADERS = {
    "x-ceiling-fallback": _string_header("the fallback feature that served this request"),
    "x-ceiling-fallback-model": _string_header("the fallback's model, as logged and priced"),
}


def _generation_params() -> dict:
    """OpenAI's sampling and shaping fields with OpenAI's ranges (inference/web/params.py enforces them)."""
    from .web.params import MAX_END_USER_CHARS, MAX_STOPS, MAX_TOOLS, MAX_TOP_LOGPROBS, RANGES

    def number(name: str) -> dict:
        low, high = RANGES[name]
        return {"type": "number", "minimum": low, "maximum": high}

    stop = {"type": "string", "minLength": 1}
    return {
        "temperature": {**number("temperature"), "description": "absent: 0 (greedy), unlike OpenAI's 1"},
        "top_p": number("top_p"),
        "seed": {"type": "integer", "description": "makes a sampled answer reproducible"},
        "stop": {"oneOf": [stop, {"type": "array", "minItems": 1, "maxItems": MAX_STOPS, "items": stop}]},
        "presence_penalty": number("presence_penalty"),
        "frequency_penalty": number("frequency_penalty"),
        "n": {"type": "integer", "minimum": 1, "maximum": 1, "description": "one choice per request"},
        "logprobs": {"type": "boolean"},
        "top_logprobs": {"type": "integer", "minimum": 0, "maximum": MAX_TOP_LOGPROBS, "description": "needs logprobs true"},
        "response_format": {
            "type": "object", "required": ["type"],
            "properties": {"type": {"enum": ["text", "json_object", "json_schema"]}, "json_schema": {"type": "object"}},
        },
        "tools": {"type": "array", "maxItems": MAX_TOOLS, "items": {"type": "object"},
                  "description": "remote providers only; the local engine answers 400 tools_unsupported"},
        "tool_choice": {"description": "none, auto, required or a named function; with tools only"},
        "user": {"type": "string", "maxLength": MAX_END_USER_CHARS, "description": "your id for the end user, kept beside the ledger row"},
    }


async def openapi_json(request: HttpRequest) -> JsonResponse:
    if request.method not in ("GET", "HEAD"):
        error = {"message": f"Use GET for {request.path}.", "type": "invalid_request_error", "param": None, "code": "method_not_allowed"}
        return JsonResponse({"error": error}, status=405, headers={"Allow": "GET"})
    return JsonResponse(openapi_document())
