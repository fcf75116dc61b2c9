"""Serving the model with other weights on CPU: int8 linear layers, the GGUF's own 4-bit weights, or bf16.

What works with the pinned stack (torch 2.13.0 CPU, transformers 5.24), checked by hand and by
tests/test_quantization.py:

- `torch.ao.quantization.quantize_dynamic` still works on torch 2.13 (it warns that it is
  deprecated in favour of torchao) and the quantized model runs inside transformers'
  ContinuousBatchingManager unchanged: every nn.Linear (attention and MLP projections and the
  lm_head) becomes a dynamically quantized Linear whose weights are int8, one scale per output
  channel; activations are quantized on the fly per batch. The token embedding stays fp32 (it is
  a lookup, not a matmul). We use it rather than torchao so that no extra dependency is pinned;
  torchao 0.18 installs from PyPI for torch 2.13 without CUDA if a later change needs int4.
- On a GPU the installed stack has no int8 path: quantize_dynamic's kernels (fbgemm/qnnpack) are
  CPU only, and neither torchao nor bitsandbytes is installed. A GPU worker serves bf16 and
  refuses "int8" at load with a sentence saying so.

"q4" serves decode steps from the model's own 4-bit weights. The shipped model is a Q4_1 GGUF:
every weight of the decoder layers' linears is d·q + m for a 4-bit q and one (d, m) pair per 32
weights, so the fp32 weights we load lie on that grid, and `q4_grid` recovers q, d and m from them
(it refuses weights off such a grid rather than round them). Where Ceiling's own kernels build
(inference/engine/kernels: the default on CPU) the codes and float16 (d, m) are kept as the GGUF
has them and multiplied with the activations quantized to int8 per 32 values (llama.cpp's Q4_1 ×
Q8_1 arithmetic, AVX-512 VNNI); the lm_head's int8 copy below runs on the same kernels. That is a
change of numerics like bf16 activations, under the same evaluation gate; a lone request's compiled
step cost 12.4-13.0 ms of one core against 16.1-17.3 ms on torch's kernels (docs/engine.md).
Otherwise torch's CPU int4 kernel
(`_weight_int4pack_mm_for_cpu`, groups of 32, w = (q − 8)·scale + zero) is fast only with bf16
activations and bf16 scales and zeros (fp16 or fp32 ran 6-35× slower than bf16 here), so a q4
step rounds each group's scale and zero and its input rows to bf16 — the numerics of serving in
bf16, as GPUs do; the 4-bit codes themselves are the GGUF's. That is a change of numerics, which is
why q4 is a variant that must pass the evaluation gate like int8, not a silent speed-up.
A decode step of a few rows reads every weight once for a handful of tokens, so it is bound by
memory, and the 4-bit copy is 8× smaller: on an AMD EPYC, one pass over all the block linears took
15-26 ms for 1-4 rows against 41-63 ms in fp32 (docs/benchmarks.md). Steps with more rows (prefill
chunks, big batches) keep the fp32 weights, which stay loaded beside the 4-bit copy (+66 MB); the
row count up to which q4 pays is measured when the engine loads (`measure_q4_rows`); then, on a
CPU whose bf16 matrix units make it pay, wide steps read a bf16 copy instead (`measure_wide_rows`). The lm_head
(the tied embedding, Q8_0 in the GGUF, one scale per 32 weights) has no kernel for 32-weight groups
in torch; read in fp32 it was 113 MB — 9.4 ms of a lone request's ~24 ms step. So q4 also gives
the lm_head an int8 copy with one scale per output row (`_weight_int8pack_mm`, bf16 activations:
28 MB, 1.6 ms), routed by the same load-time measurement. Against the fp32 lm_head on the 616
positions of 12 evaluation answers its argmax agreed at every position (max logit error 0.65, bf16
weights 0.16); the token embedding lookup keeps the fp32 table.

"bf16" stores every weight, and computes every step, in bfloat16 — what GPUs serve, and what CPUs
with AMX or AVX512-BF16 run fast: on a 2-core Intel Xeon VM with AMX a 512-row product ran at 1,487
GFLOP/s in bf16 against 281 in fp32, so prefill chunks and large decode batches speed up most. It
rounds each weight to 8 bits of mantissa (the GGUF's Q4_1 values are not all bf16 numbers), so it
is a change of numerics like the others and passes the same evaluation gate. On a CPU without bf16
instructions torch emulates it (not measured here); the gate's throughput criterion is what
would keep it off there. On CUDA the
full-precision model is bf16 already, so the variant changes nothing.
"""

from __future__ import annotations

import types
import warnings
from dataclasses import dataclass

import torch
from torch import nn

from inference.engine import kernels
from inference.engine.patches.linears import routed_linear_forward, time_routes

NONE = "none"
INT8 = "int8"
Q4 = "q4"
BF16 = "bf16"
MODES = (NONE, INT8, Q4, BF16)
CPU_ONLY = {INT8: "torch.ao dynamic quantization", Q4: "torch's CPU int4 kernel"}

Q4_GROUP = 32  # weights per (scale, zero) pair: Q4_1's block
Q4_ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
Q4_MIN_GAIN = 0.05  # the 4-bit route must beat fp32 by this much for a bucket to take it
# Wide steps (big decode batches, prefill chunks) may read a bf16 copy instead of the fp32 weights:
# measured at these row counts too, the last standing for every longer step.
WIDE_ROW_BUCKETS = (*Q4_ROW_BUCKETS, 256)
WIDE_SECOND_OPINION = 0.15  # a bucket whose bf16 ÷ current time lies this close to the line is timed again
NEVER = 1 << 30  # a wide_min_rows no step reaches: the layer has no bf16 route
# Which kernel a packed layer's 4-bit (or the lm_head's int8) copy is laid out for: Ceiling's own
# (inference/engine/kernels, the default where it builds) or torch's.
OWN_KERNELS = "ceiling"
TORCH_KERNELS = "torch"


class QuantizationError(RuntimeError):
    """The requested quantization cannot run here; the message says why."""


def check_mode(mode: str, device: str) -> None:
    if mode not in MODES:
        raise QuantizationError(f"unknown quantization {mode!r}; use one of {', '.join(MODES)}")
    if mode in CPU_ONLY and not device.startswith("cpu"):
        raise QuantizationError(
            f"{mode} weights run on CPU only with the installed stack ({CPU_ONLY[mode]}); this engine runs on {device}"
        )


def quantize_model(model: torch.nn.Module, mode: str, own_kernels: bool = False) -> torch.nn.Module:
    """The model with its weights stored as `mode` asks; "none" returns it unchanged.

    own_kernels: q4 lays its copies out for Ceiling's kernels (loaded by the caller: kernels.load).
    """
    device = str(next(model.parameters()).device)
    check_mode(mode, device)
    if mode == NONE:
        return model
    if mode == Q4:
        return pack_q4(model, own_kernels)
    if mode == BF16:
        return model.to(torch.bfloat16)  # the paged KV cache follows the model's dtype: half the bytes too
    qconfig = torch.ao.quantization.per_channel_dynamic_qconfig
    with warnings.catch_warnings():
        # torch 2.13 says torch.ao.quantization is deprecated (for torchao); it still works, and the
        # warning would be printed at every worker start.
        warnings.simplefilter("ignore", DeprecationWarning)
        warnings.filterwarnings("ignore", message=".*torch.ao.quantization is deprecated.*")
        warnings.filterwarnings("ignore", message=".*are deprecated and will be removed.*")
        quantized = torch.ao.quantization.quantize_dynamic(
            model, {torch.nn.Linear: qconfig}, dtype=torch.qint8, inplace=False
        )
    return quantized.eval()


def weights_memory_bytes(model: torch.nn.Module) -> int:
    """Bytes held by the model's weights and buffers, each storage counted once (tied weights share one).

    A dynamically quantized Linear keeps its int8 weight in packed params, which are not
    parameters, so it is read through the module's weight() accessor.
    """
    seen: set[int] = set()
    kept: list[torch.Tensor] = []  # weight() unpacks a fresh tensor: keep it alive so no address is reused
    total = 0

    def count(tensor: torch.Tensor | None) -> None:
        nonlocal total
        if tensor is None:
            return
        pointer = tensor.data_ptr()
        if pointer in seen:
            return
        seen.add(pointer)
        kept.append(tensor)
        total += tensor.nelement() * tensor.element_size()
        if tensor.is_quantized and tensor.qscheme() in (torch.per_channel_affine, torch.per_channel_symmetric):
            count(tensor.q_per_channel_scales())
            count(tensor.q_per_channel_zero_points())

    for module in model.modules():
        if isinstance(module, torch.ao.nn.quantized.dynamic.Linear):
            count(module.weight())
            count(module.bias())
        for tensor in (*module.parameters(recurse=False), *module.buffers(recurse=False)):
            count(tensor)
    return total


def bytes_read_per_decode_step(model: nn.Module, rows: int = 1) -> int:
    """Weight bytes one decode step of `rows` rows reads: every linear once, by the route it takes.

    A q4 layer at or under its q4_max_rows reads its 4-bit codes and bf16 scales, not its fp32
    copy; an int8 layer its packed int8 weight; the token embedding only `rows` rows (a lookup).
    This is the numerator of the memory-bandwidth roofline of a lone request.
    """
    total = 0
    for module in model.modules():
        if isinstance(module, torch.ao.nn.quantized.dynamic.Linear):
            total += module.weight().nelement()  # one byte each
        elif isinstance(module, nn.Linear):
            if getattr(module, "bf16_weight", None) is not None and rows >= module.wide_min_rows:
                total += module.bf16_weight.nbytes
            elif getattr(module, "q4_weight", None) is not None and rows <= getattr(module, "q4_max_rows", 0):
                total += module.q4_weight.nbytes + module.q4_scales_and_zeros.nbytes
            elif getattr(module, "q8_weight", None) is not None and rows <= getattr(module, "q4_max_rows", 0):
                total += module.q8_weight.nbytes + module.q8_scales.nbytes
            else:
                total += module.weight.nbytes
        elif isinstance(module, nn.Embedding):
            total += rows * module.weight[0].nbytes
    return total


def mode_of(model: torch.nn.Module) -> str:
    """Which quantization a loaded model carries (read back from its layers, not from a setting)."""
    if any(isinstance(m, torch.ao.nn.quantized.dynamic.Linear) for m in model.modules()):
        return INT8
    if any(hasattr(m, "q4_weight") for m in model.modules()):
        return Q4
    weight = next(model.parameters())
    if weight.dtype == torch.bfloat16 and weight.device.type == "cpu":
        return BF16  # on CUDA, bf16 is the full-precision default ("none")
    return NONE


def kernels_of(model: torch.nn.Module) -> str:
    """Whose kernels a q4 model's packed layers run on (read back from its layers, as mode_of reads the mode)."""
    return next((m.q4_kernel for m in model.modules() if hasattr(m, "q4_kernel")), TORCH_KERNELS)


# --- q4: the GGUF's 4-bit weights for decode steps ---------------------------------------------------


def q4_layers(model: nn.Module) -> list[tuple[str, nn.Linear]]:
    """(name, layer) of the linears q4 packs: every plain Linear inside the decoder layers (not the lm_head)."""
    return [(name, m) for name, m in model.named_modules() if type(m) is nn.Linear and ".layers." in f".{name}"]


def pack_q4(model: nn.Module, own_kernels: bool = False) -> nn.Module:
    """Give each decoder-layer linear a 4-bit copy of its weights and route few-row steps to it.

    Refused unless every weight lies on a 4-bit grid of 32-weight groups (the Q4_1 GGUF's): packing
    anything else would quantize the weights anew, and q4 promises the model's own 4-bit codes.
    Until `measure_q4_rows` runs, no step takes the 4-bit route. With own_kernels the copies are
    laid out for Ceiling's kernels (every layer's, or none's where a scale is not a float16).
    """
    layers = q4_layers(model)
    if not layers:
        raise QuantizationError("q4 found no decoder-layer linears to pack in this model")
    # Every layer is packed before any is changed: a refusal leaves the model as it was.
    grids = [q4_grid(layer.weight.detach(), name) for name, layer in layers]
    kernel = OWN_KERNELS if own_kernels and all(grid.fits_float16() for grid in grids) else TORCH_KERNELS
    packs = [grid.pack(kernel) for grid in grids]
    head = q8_head(model)
    if head is not None:
        weight, scales = q8_pack(head.weight.detach(), kernel)
        head.register_buffer("q8_weight", weight, persistent=False)
        head.register_buffer("q8_scales", scales, persistent=False)
        head.q4_kernel = kernel
        head.q4_max_rows, head.wide_min_rows = 0, NEVER
        head.consults_skinny_routes = True
        head.forward = types.MethodType(q8_routed_forward, head)
    for (_, layer), (packed, scales_and_zeros) in zip(layers, packs, strict=True):
        layer.register_buffer("q4_weight", packed, persistent=False)
        layer.register_buffer("q4_scales_and_zeros", scales_and_zeros, persistent=False)
        layer.q4_kernel = kernel
        layer.q4_max_rows, layer.wide_min_rows = 0, NEVER
        # skinny.use_skinny_linears leaves forward alone on a layer that consults skinny_routes itself.
        layer.consults_skinny_routes = True
        layer.forward = types.MethodType(q4_routed_forward, layer)
    return model


@dataclass(frozen=True)
class Q4Grid:
    """A weight's 4-bit codes [out, groups, 32] (uint8) and each group's scale and minimum [out, groups]: w = scale·q + minimum."""

    codes: torch.Tensor
    scale: torch.Tensor
    minimum: torch.Tensor
    weight: torch.Tensor

    def fits_float16(self) -> bool:
        """Whether float16 scales and minima rebuild the weights as well as fp32 ones (a GGUF's are float16)."""
        rebuilt = self.codes.float() * self.scale.half().float()[..., None] + self.minimum.half().float()[..., None]
        span = (15 * self.scale).clamp(min=1e-12)[..., None]
        return bool(((rebuilt - self.weight).abs() <= 1e-6 * span).all())

    def pack(self, kernel: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(codes, scales) in the layout `kernel` reads."""
        out_features, groups, _ = self.codes.shape
        if kernel == OWN_KERNELS:
            return kernels.pack_q4(self.codes, self.scale.half(), self.minimum.half())
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
            self.codes.to(torch.int32).reshape(out_features, groups * Q4_GROUP), 1
        )
        # torch's kernel computes (q − 8)·scale + zero: zero is the group's value at q = 8.
        scales_and_zeros = torch.stack([self.scale.t(), (self.minimum + 8 * self.scale).t()], dim=-1)
        return packed, scales_and_zeros.contiguous().to(torch.bfloat16)


def q4_grid(weight: torch.Tensor, name: str = "a layer") -> Q4Grid:
    """The 4-bit grid a weight lies on, refused with a sentence where it lies on none."""
    out_features, in_features = weight.shape
    if in_features % Q4_GROUP:
        raise QuantizationError(f"q4 needs {name}'s input size ({in_features}) to be a multiple of {Q4_GROUP}")
    groups = weight.float().reshape(out_features, in_features // Q4_GROUP, Q4_GROUP)
    low, high = groups.amin(-1), groups.amax(-1)
    scale = (high - low) / 15
    safe_scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round((groups - low[..., None]) / safe_scale[..., None]).clamp(0, 15)
    rebuilt = q * scale[..., None] + low[..., None]
    off_grid = ((rebuilt - groups).abs() > 1e-6 * (high - low).clamp(min=1e-12)[..., None]).sum().item()
    if off_grid:
        raise QuantizationError(
            f"q4 serves the model's own 4-bit weights, but {off_grid} of {name}'s weights are not on a 4-bit grid "
            f"of {Q4_GROUP}-weight groups (a Q4_1 GGUF's); quantizing them would change the model"
        )
    return Q4Grid(q.to(torch.uint8), scale, low, groups)  # uint8: every layer's grid is held until all are packed


def q4_pack(weight: torch.Tensor, name: str = "a layer", kernel: str = TORCH_KERNELS) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed 4-bit codes, scales) of a weight on a 4-bit group grid, laid out for `kernel`."""
    return q4_grid(weight, name).pack(kernel)


def q8_head(model: nn.Module) -> nn.Linear | None:
    head = getattr(model, "lm_head", None)
    return head if type(head) is nn.Linear and head.in_features % 8 == 0 else None


def q8_pack(weight: torch.Tensor, kernel: str = TORCH_KERNELS) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 weight, scale per output row) of a weight: symmetric, the row's largest value at ±127.

    For Ceiling's kernel the codes are stored + 128 as uint8 (its VNNI product wants them unsigned)
    with fp32 scales; for torch's as int8 with bf16 scales (it wants bf16 activations too).
    """
    scales = weight.float().abs().amax(dim=1).clamp(min=1e-12) / 127
    codes = torch.round(weight.float() / scales[:, None]).clamp(-127, 127)
    if kernel == OWN_KERNELS:
        return (codes + 128).to(torch.uint8).contiguous(), scales
    return codes.to(torch.int8).contiguous(), scales.to(torch.bfloat16)


def q8_forward(layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    rows = x.numel() // x.shape[-1]
    if layer.q4_kernel == OWN_KERNELS:
        flat = x.reshape(rows, x.shape[-1]).float().contiguous()
        out = torch.ops.ceiling.q8_linear(flat, layer.q8_weight, layer.q8_scales).to(x.dtype)
    else:
        flat = x.reshape(rows, x.shape[-1]).to(torch.bfloat16)
        out = torch.ops.aten._weight_int8pack_mm(flat, layer.q8_weight, layer.q8_scales).to(x.dtype)
    if layer.bias is not None:
        out = out + layer.bias
    return out.view(*x.shape[:-1], layer.out_features)


def q8_routed_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    rows = x.numel() // x.shape[-1]
    if rows <= self.q4_max_rows:
        return q8_forward(self, x)
    if rows >= self.wide_min_rows:
        return bf16_forward(self, x)
    return routed_linear_forward(self, x)


def bf16_forward(layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """x · Wᵀ from the layer's bf16 copy, the activations rounded to bf16 as the 4-bit route rounds them."""
    rows = x.numel() // x.shape[-1]
    flat = x.reshape(rows, x.shape[-1]).to(torch.bfloat16)
    out = nn.functional.linear(flat, layer.bf16_weight).to(x.dtype)
    if layer.bias is not None:
        out = out + layer.bias
    return out.view(*x.shape[:-1], layer.out_features)


def q4_forward(layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """x · Wᵀ from the 4-bit copy: Ceiling's kernel (activations as int8 per 32 values) or torch's
    (activations in bf16, that kernel's fast path)."""
    rows = x.numel() // x.shape[-1]
    if layer.q4_kernel == OWN_KERNELS:
        flat = x.reshape(rows, x.shape[-1]).float().contiguous()
        out = torch.ops.ceiling.q4_linear(flat, layer.q4_weight, layer.q4_scales_and_zeros)
    else:
        flat = x.reshape(rows, x.shape[-1]).to(torch.bfloat16)
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(flat, layer.q4_weight, Q4_GROUP, layer.q4_scales_and_zeros)
    out = out.to(x.dtype)
    if layer.bias is not None:
        out = out + layer.bias
    return out.view(*x.shape[:-1], layer.out_features)


def q4_routed_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """Few rows: the 4-bit copy; many rows: the bf16 copy where it measured faster; between: fp32."""
    rows = x.numel() // x.shape[-1]
    if rows <= self.q4_max_rows:
        return q4_forward(self, x)
    if rows >= self.wide_min_rows:
        return bf16_forward(self, x)
    return routed_linear_forward(self, x)


def measure_q4_rows(model: nn.Module, repeats: int = 3) -> tuple[int, list[tuple[int, float, float]]]:
    """Time the 4-bit route against the layers' fp32 route per row bucket and route the winners.

    Returns (the row count up to which steps now take q4, [(rows, fp32 ms, q4 ms)] per bucket). The
    4-bit route is used from one row up to the last bucket of an unbroken run of wins: beyond it
    the fp32 weights serve, as they do for every prefill. Run after skinny routes are set, so q4
    competes with the route fp32 steps would really take.
    """
    layers = [m for m in model.modules() if hasattr(m, "q4_weight")]
    return _route_by_rows(layers, q4_forward, repeats)


def measure_head_rows(model: nn.Module, repeats: int = 3) -> tuple[int, list[tuple[int, float, float]]]:
    """The lm_head's int8 copy against its fp32 route, per row bucket, routed as measure_q4_rows routes
    the block linears: (the row count up to which steps take int8, [(rows, fp32 ms, int8 ms)]);
    (0, []) where the model has no int8 head. A lone token's lm_head reads ~28 MB of int8 weights for
    SmolLM2 against 113 MB in fp32, a quarter of a lone q4 step's bytes: which route it took is worth
    a line in the log when two starts of the same machine run at different speeds."""
    heads = [m for m in model.modules() if hasattr(m, "q8_weight")]
    return _route_by_rows(heads, q8_forward, repeats) if heads else (0, [])


def q4_routes(model: nn.Module) -> dict[str, int]:
    """Where the packed layers' routes stand (measure_q4_rows, measure_wide_rows): kept so that a
    restart routes the same without timing (inference/engine/measured.py), set with route_packed_layers."""
    routes = {}
    for buffer in ("q4_weight", "q8_weight"):
        group = _packed_layers(model, buffer)
        if group:
            routes[f"{buffer}.q4_max_rows"] = group[0].q4_max_rows
            routes[f"{buffer}.wide_min_rows"] = getattr(group[0], "wide_min_rows", NEVER)
    return routes


def route_packed_layers(model: nn.Module, routes: dict[str, int]) -> None:
    """Route the packed layers as `routes` (from q4_routes) says, bf16 copies made where wide steps read them."""
    for buffer in ("q4_weight", "q8_weight"):
        group = _packed_layers(model, buffer)
        if not group:
            continue
        for layer in group:
            layer.q4_max_rows = routes.get(f"{buffer}.q4_max_rows", 0)
        keep_wide_copy(group, routes.get(f"{buffer}.wide_min_rows", NEVER))


def _route_by_rows(layers: list[nn.Linear], packed_forward, repeats: int) -> tuple[int, list[tuple[int, float, float]]]:
    """Route the layers' steps of few rows to their packed copy up to the last bucket of an unbroken run of wins."""
    routes = {"fp32": routed_linear_forward, "q4": packed_forward}
    timings = []
    with torch.inference_mode():
        for rows in Q4_ROW_BUCKETS:
            timed = time_routes(layers, rows, routes, repeats)
            if timed["q4"] >= (1 - Q4_MIN_GAIN) * timed["fp32"]:
                # A second opinion before a bucket is lost: on a loaded machine (load average 9 on 2
                # cores, 2026-12-06) one 1-row pass of the 4-bit route took 164 ms against 29 in fp32,
                # ~10 ms normally, and that one noisy bucket turned q4 off for every decode step.
                again = time_routes(layers, rows, routes, repeats * 2)
                timed = {route: min(timed[route], again[route]) for route in timed}
            timings.append((rows, timed["fp32"], timed["q4"]))
    max_rows = 0
    for rows, fp32_ms, q4_ms in timings:
        if q4_ms >= (1 - Q4_MIN_GAIN) * fp32_ms:
            break
        max_rows = rows
    for layer in layers:
        layer.q4_max_rows = max_rows
    return max_rows, timings


def measure_wide_rows(model: nn.Module, repeats: int = 3) -> tuple[int, list[tuple[int, float, float]]]:
    """Give the packed layers a bf16 copy for wide steps where it beats the route those steps take now.

    Run after `measure_q4_rows`. On a CPU with bf16 matrix units (AMX, AVX512-BF16) a product of
    16-256 rows reads half the bytes of fp32 and runs on those units, while the 4-bit kernel's cost
    grows with the rows (it unpacks every weight for each few rows). Per bucket of WIDE_ROW_BUCKETS
    from 2 rows up, the layers' current route (4-bit or fp32) is timed against the bf16 copy; the
    copy serves an unbroken run of wins up to the last bucket (256 rows, standing for every longer
    prefill chunk), from where the two routes' times cross between the last losing bucket and the
    first winning one (wide_crossing). Where it never wins the copies are dropped (no memory kept).
    Returns (the row count from which steps read the bf16 copy, NEVER if none; [(rows, current ms,
    bf16 ms)] per bucket).
    """
    result: tuple[int, list[tuple[int, float, float]]] = (NEVER, [])
    for buffer in ("q8_weight", "q4_weight"):  # the block linears last: theirs is the figure returned
        group = _packed_layers(model, buffer)
        if not group:
            continue
        for layer in group:  # timed before any step is routed to them
            _give_bf16_copy(layer)
        result = _wide_start(group, repeats)
        keep_wide_copy(group, result[0])
    return result


def keep_wide_copy(layers: list[nn.Linear], start: int) -> None:
    """Route the layers' steps of `start` rows and more to their bf16 copy (made if missing); NEVER drops the copies."""
    for layer in layers:
        if start == NEVER:
            if hasattr(layer, "bf16_weight"):
                del layer.bf16_weight
        else:
            _give_bf16_copy(layer)
            layer.q4_max_rows = min(layer.q4_max_rows, start - 1)  # the 4-bit route is checked first
        layer.wide_min_rows = start


def _give_bf16_copy(layer: nn.Linear) -> None:
    if not hasattr(layer, "bf16_weight"):
        layer.register_buffer("bf16_weight", layer.weight.detach().to(torch.bfloat16), persistent=False)


def _packed_layers(model: nn.Module, buffer: str) -> list[nn.Linear]:
    return [m for m in model.modules() if hasattr(m, buffer)]


def _wide_start(layers: list[nn.Linear], repeats: int) -> tuple[int, list[tuple[int, float, float]]]:
    routes = {"current": q4_routed_forward if hasattr(layers[0], "q4_weight") else q8_routed_forward,
              "bf16": bf16_forward}
    buckets = [rows for rows in WIDE_ROW_BUCKETS if rows >= 2]
    timings = []
    with torch.inference_mode():
        for rows in buckets:
            timed = time_routes(layers, rows, routes, repeats)
            if abs(timed["bf16"] / timed["current"] - (1 - Q4_MIN_GAIN)) < WIDE_SECOND_OPINION:
                # Near the line a busy moment decides the bucket, and with it the start of the copy for
                # every later step (kept for later starts): a second opinion, as _route_by_rows takes.
                again = time_routes(layers, rows, routes, repeats * 2)
                timed = {route: min(timed[route], again[route]) for route in timed}
            timings.append((rows, timed["current"], timed["bf16"]))
    start = NEVER
    for index in reversed(range(len(buckets))):  # the unbroken run of wins that ends at the widest bucket
        rows, current_ms, bf16_ms = timings[index]
        if not _bf16_wins(current_ms, bf16_ms):
            if start != NEVER:  # the run begins between this bucket and the next
                start = wide_crossing(timings[index], timings[index + 1])
            break
        start = 2 if index == 0 else rows
    return start, timings


def _bf16_wins(current_ms: float, bf16_ms: float) -> bool:
    return bf16_ms < (1 - Q4_MIN_GAIN) * current_ms


def wide_crossing(losing: tuple[int, float, float], winning: tuple[int, float, float]) -> int:
    """The first row count after a bucket where the bf16 copy loses at which it wins, each route's time
    taken as a straight line between the two buckets' timings (rows, current ms, bf16 ms).

    The 4-bit route's time grows with its rows several times faster than the bf16 copy's, so between
    16 rows (4-bit 21 ms, bf16 33) and 32 (46 and 41; 2-core AMD EPYC, Zen 4) the lines cross near 28:
    starting the copy right after the losing bucket put steps of 17-27 rows (a burst's decode rows
    beside a prompt's last chunk) on the slower route.
    """
    low_rows, low_current, low_bf16 = losing
    high_rows, high_current, high_bf16 = winning
    for rows in range(low_rows + 1, high_rows):
        share = (rows - low_rows) / (high_rows - low_rows)
        if _bf16_wins(low_current + share * (high_current - low_current), low_bf16 + share * (high_bf16 - low_bf16)):
            return rows
    return high_rows


def describe_wide(start: int, timings: list[tuple[int, float, float]]) -> str:
    passes = "; ".join(f"{rows} rows {current:.1f} vs {bf16:.1f} ms" for rows, current, bf16 in timings)
    verdict = "no bf16 copy kept" if start == NEVER else f"the bf16 copy for steps of {start} rows and more"
    return f"{passes} → {verdict}"


def describe_q4(max_rows: int, timings: list[tuple[int, float, float]], weights: str = "4-bit weights") -> str:
    passes = "; ".join(f"{rows} rows {fp32:.1f} vs {q4:.1f} ms" for rows, fp32, q4 in timings)
    return f"{passes} → {weights} for steps of up to {max_rows} rows"
