"""Which weight variant serves a request, and the Celery queue of each variant.

A worker process hosts one variant (CEILING_WORKER_VARIANTS, default CEILING_QUANTIZATION): two
engines in one process are two OpenMP teams on the same cores, and an idle bf16 engine beside the
fp32 one slowed every fp32 answer ~1.6× (docs/quantization.md). So each variant has a queue of its
own, and the web tier sends a chat to the queue of the variant that serves it:

    the default variant (CEILING_QUANTIZATION)   CEILING_INFERENCE_QUEUE            e.g. inference
    any other (a feature switched to it)         CEILING_INFERENCE_QUEUE.<variant>  e.g. inference.bf16

Features on a remote server go to the default queue (their worker streams, it runs no engine).
CEILING_QUANTIZATION must be the same in every web process and worker; it names the default queue.

Every worker marks the queues it serves as served (SERVING_KEY, refreshed with its heartbeat), so
the web tier refuses a chat for a variant that no worker serves at once (`variant_unavailable`)
instead of leaving it in a queue nobody reads until the first-token timeout. The mark outlives its
worker by SERVING_TTL_S, so a worker restarting does not cause refusals: chats wait in its queue.
The default variant's queue is never refused (with no worker at all, chats time out as before).
Nothing here imports torch: the web tier uses it.
"""

from __future__ import annotations

import redis
from django.conf import settings

VARIANTS = ("none", "int8", "q4", "bf16")  # inference/engine/patches/quantization.py's MODES, without torch
SERVING_KEY = "ceiling:serving:{}"  # per queue: the last worker that said it serves it
SERVING_TTL_S = 60
QUEUE_FOR_SMALL_JOBS = "default"  # alert emails: every worker takes them
# The quantization gate's verdict shipped with the bundled model (inference/shipped.py adopts it at start).
SHIPPED_MODE = "q4"


def shipped_verdict_applies(mode: str) -> bool:
    """Whether the shipped verdict stands in for an evaluation of `mode`: q4 of the bundled model (a
    Q4_1 GGUF, whose full precision is those 4-bit weights dequantized). CEILING_MODEL names another."""
    return mode == SHIPPED_MODE and not settings.CEILING_MODEL


def default_variant() -> str:
    return settings.CEILING_QUANTIZATION


def variant_of(feature) -> str:
    """The weight variant that serves a feature's requests (the default one for a remote feature or none)."""
    provider = getattr(feature, "provider", None) if feature is not None else None
    if feature is None or (provider is not None and provider.kind == "openai-compatible"):
        return default_variant()
    return feature.quantization


def variant_queue(variant: str) -> str:
    base = settings.CEILING_INFERENCE_QUEUE
    return base if variant == default_variant() else f"{base}.{variant}"


def worker_variants() -> tuple[str, ...]:
    """The variants this worker process serves (one, unless CEILING_WORKER_VARIANTS names several)."""
    return tuple(settings.CEILING_WORKER_VARIANTS) or (default_variant(),)


def worker_queues(variants: tuple[str, ...] | list[str]) -> str:
    """The --queues of a worker serving these variants."""
    return ",".join([*(variant_queue(v) for v in variants), QUEUE_FOR_SMALL_JOBS])


def mark_served(client: redis.Redis, worker: str, variants: tuple[str, ...] | list[str]) -> None:
    """Say that this worker serves these variants' queues (with its heartbeat, every half second)."""
    with client.pipeline(transaction=False) as pipe:
        for variant in variants:
            pipe.set(SERVING_KEY.format(variant_queue(variant)), worker, ex=SERVING_TTL_S)
        pipe.execute()


def is_served(variant: str) -> bool:
    """Whether a worker serves this variant (one Redis round trip; True for the default variant)."""
    if variant == default_variant():
        return True
    from .bus.clients import redis_client

    try:
        return bool(redis_client().exists(SERVING_KEY.format(variant_queue(variant))))
    except redis.RedisError:
        return True  # cannot tell: queue it, the timeouts still end it


def unavailable_message(feature_name: str, variant: str) -> str:
    return (f"No worker serves the {variant} weights the feature {feature_name!r} is switched to, so this request "
            f"was not taken. The operators must start one (runstack starts one per variant in use; or "
            f"CEILING_WORKER_VARIANTS={variant} with --queues {variant_queue(variant)}), or switch the feature back.")


def feature_variants() -> set[str]:
    """The variants enabled local features are switched to."""
    from budgets.models import Feature, Provider

    features = Feature.objects.filter(enabled=True).exclude(provider__kind=Provider.Kind.OPENAI_COMPATIBLE)
    return set(features.values_list("quantization", flat=True))


def variants_in_use() -> list[str]:
    """The default variant and every variant an enabled local feature is switched to (runstack's workers)."""
    return [default_variant(), *sorted(feature_variants() - {default_variant()})]


def variant_model_name(variant: str) -> str:
    """Our model as logged and priced when served with these weights: "<model>@int8", or the bare name
    for full precision; each variant has its own ModelPrice (budgets.guard.price_in_force)."""
    from budgets.guard import VARIANT_SEPARATOR

    return settings.CEILING_MODEL_NAME if variant in ("", "none") else f"{settings.CEILING_MODEL_NAME}{VARIANT_SEPARATOR}{variant}"
