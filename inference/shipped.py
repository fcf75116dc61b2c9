"""The quantization gate's verdict shipped with the bundled model, and its adoption when the stack starts.

The bundled SmolLM2-135M-Instruct is a Q4_1 GGUF: its "full precision" is those 4-bit weights
dequantized to fp32, and the q4 variant computes with the very same weights (each step's activations
quantized to int8 per 32 values, as llama.cpp does). Its evaluation on the chat prompt set answered
as many prompts right as full precision (docs/quantization.md), and a lone chat runs ~8 ms a token
instead of ~65 on a 2-core AMD EPYC. So the verdict "q4" ships with the model, for the demo's
features, instead of an evaluation every new machine must run first (minutes on 2 cores, competing
with the first chats): `make run` (runstack) switches them to q4 before starting the workers.

Why not run the evaluation at first start instead: it needs both engines loaded in turn and the
prompt set answered twice, minutes of both cores during which every chat would be slow, and its
throughput criterion (a mixed batch workload) does not see where q4 helps (a lone chat's time per
token). An evaluation run here still counts: a failed one closes the gate, and the next start
switches the feature back to full precision.

The adoption, per demo feature that exists, is served by the local engine and is not pinned by staff:
- q4 when the verdict applies (the bundled model, on a CPU), Ceiling's kernels build here, and no
  failed q4 evaluation of the feature closes the gate;
- back to full precision when the feature is on q4 and one of those no longer holds;
each switch through do_switch_quantization (audited, no actor) and announced on the console.
Features switched to bf16 or int8 (choose_variant, staff) are left alone.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from django.conf import settings

from budgets.models import Feature, Provider

from .actions import do_switch_quantization, switch_refusal
from .variants import SHIPPED_MODE, shipped_verdict_applies

# Every feature the demo makes: seed_demo's chat and docs, and the two synth_logs adds for its history
# (users pick them on the chat page too). All run the bundled model, and the verdict is about its weights
# (q4 computes with the same 4-bit codes), not about one prompt set's topic. One of them left in full
# precision made `make run` start a full-precision worker that compiled its decode steps for 165 s
# before the page answered (2-core AMD EPYC, Zen 4, 2026-12-07), all four buckets then kept eager.
SHIPPED_FEATURES = ("chat", "docs", "summary", "extract")
EVIDENCE = ("the bundled model is a Q4_1 GGUF, so q4 computes with its own 4-bit weights; on the chat prompt set it "
            "answered 42 of 60 checkable prompts, as full precision did, and a lone chat runs ~8 ms a token "
            "instead of ~65 (docs/quantization.md)")
FULL = Feature.Quantization.NONE


def q4_problem(device: str) -> str | None:
    """Why the q4 variant cannot run fast here (None when it can): it needs the CPU engine and Ceiling's
    own kernels, compiled for this CPU into var/kernels (once, ~10 s; cached for later starts).

    Without them q4 falls back to torch's int4 kernel, which wants bf16 arithmetic and is slower than
    full precision on CPUs without bf16 units: full precision is then the faster choice.
    """
    if device != "cpu":
        return f"q4 runs on the CPU only, and this stack's engine runs on {device}"
    if not settings.CEILING_OWN_KERNELS:
        return "CEILING_OWN_KERNELS is off, and q4 on torch's kernels is no faster than full precision"
    from .engine import kernels

    try:
        kernels.build(Path(settings.VAR_DIR) / "kernels")
    except kernels.KernelBuildError as exc:
        return f"Ceiling's q4 kernels cannot be built here ({exc})"
    return None


def adopt_shipped_verdict(problem: str | None, say: Callable[[str], object] = print) -> list[Feature]:
    """Switch each demo feature to q4, or back to full precision when `problem` (q4_problem) or a failed
    evaluation rules it out; returns the features switched. Prints one line per decision."""
    if not shipped_verdict_applies(SHIPPED_MODE):
        return []  # another model: only its own evaluations (choose_variant) decide
    switched = []
    for feature in _demo_features():
        target = _target(feature, problem, say)
        if target is None or target == feature.quantization:
            continue
        _switch(feature, target)
        switched.append(feature)
        if target == SHIPPED_MODE:
            say(f"Serving {feature.name} with q4 weights (the shipped verdict: {EVIDENCE}); audited. Staff can pin "
                f"other weights on the feature's page.")
        else:
            say(f"Serving {feature.name} in full precision instead of q4: {problem or _refusal(feature)}.")
    return switched


def _demo_features() -> list[Feature]:
    features = Feature.objects.select_related("provider").filter(name__in=SHIPPED_FEATURES, enabled=True).order_by("pk")
    return [f for f in features if f.provider is None or f.provider.kind != Provider.Kind.OPENAI_COMPATIBLE]


def _target(feature: Feature, problem: str | None, say: Callable[[str], object]) -> str | None:
    """The weights the verdict wants for this feature, or None to leave it as it is."""
    if feature.quantization not in (FULL, SHIPPED_MODE):
        return None  # staff or choose_variant chose bf16 or int8
    if feature.quantization_pinned:
        if feature.quantization != SHIPPED_MODE:
            say(f"{feature.name} stays in {feature.get_quantization_display()}: staff pinned its weights.")
        return None
    if problem is not None:
        if feature.quantization == FULL:
            say(f"{feature.name} stays in full precision: {problem}.")
        return FULL
    refusal = _refusal(feature)
    if refusal is not None:
        if feature.quantization == FULL:
            say(f"{feature.name} stays in full precision: {refusal}")
        return FULL
    return SHIPPED_MODE


def _refusal(feature: Feature) -> str | None:
    return switch_refusal(feature, SHIPPED_MODE)


def _switch(feature: Feature, mode: str) -> None:
    do_switch_quantization(None, feature, mode)
