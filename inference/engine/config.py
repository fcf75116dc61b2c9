"""What an engine is built from, how a request can end, and the one error it raises.

Plain values only: the Django side (inference/engines.py) builds an EngineConfig from settings,
the bench and the evaluation build their own.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

FINISH_STOP = "stop"
FINISH_LENGTH = "length"
FINISH_CANCELLED = "cancelled"
FINISH_ERROR = "error"


KV_DTYPE_NAMES = ("float32", "float16", "int8")


class EngineError(RuntimeError):
    """The engine cannot take or finish a request; the message is safe to show to a user."""


@dataclass(frozen=True)
class EngineConfig:
    model_dir: Path
    device: str = "cpu"
    torch_threads: int = 2
    page_size: int = 32
    num_blocks: int = 512
    max_batch_tokens: int = 512
    # Owned loop: prompt tokens a step may prefill while any request is decoding (0: up to
    # max_batch_tokens), so streaming answers are not held up by big prompt chunks (owned/scheduler.py).
    # None: from the step times the q4 variant measures at load (measured_prefill_budget), else
    # CPU_PREFILL_BUDGET.
    prefill_budget: int | None = 0
    # Owned loop: requests in the running batch at once, the rest wait their turn (0: up to
    # max_batch_tokens); each step's rows all wait for the whole step (owned/scheduler.py).
    max_running: int = 0
    # Owned loop, fp32 activations on a CPU: the KV cache's dtype, "float32" or "float16" (half the
    # bytes a decode step reads per cached position; owned/runner.py cache_dtype).
    kv_dtype: str = "float32"
    prefix_sharing: bool = True
    # "owned": Ceiling's decode loop (inference/engine/owned/); "transformers": transformers'
    # ContinuousBatchingManager, also used when the owned loop cannot run the model.
    loop: str = "owned"
    # "varlen": our per-request attention for CPU steps (inference/engine/patches/attention.py); "sdpa": transformers'
    # packed attention, which costs B × (all tokens of the batch) per step.
    attention: str = "varlen"
    # CPU decode steps' linear layers as W·xᵀ where that measures faster at load (inference/engine/patches/linears.py).
    skinny_linear: bool = True
    # "none", "int8", "q4" or "bf16" (inference/engine/patches/quantization.py): how the weights are stored once loaded.
    quantization: str = "none"
    # q4 only: wide steps (big decode batches, prefill chunks) read a bf16 copy of the weights where
    # that measures faster at load than their 4-bit or fp32 route (patches/quantization.py, measure_wide_rows).
    # Off by default: it cut the burst's TTFT but not its output tokens/s (docs/benchmarks.md).
    q4_wide_bf16: bool = False
    # Decode-only steps of up to these many rows compiled (torch.compile, inductor) in the
    # background, each bucket used where it measures faster (inference/engine/owned/compiled.py);
    # owned loop on a CPU only. () compiles nothing.
    compile_buckets: tuple[int, ...] = ()
    compile_cache_dir: Path | None = None  # inductor's cache: a restarted worker compiles from it in seconds
    # q4 only: Ceiling's own kernels (inference/engine/kernels) for the 4-bit block linears and the
    # int8 lm_head, compiled for this machine on first use into kernel_cache_dir (None: a folder
    # under the system's temporary directory); torch's kernels where they cannot be built, or with False.
    own_kernels: bool = True
    kernel_cache_dir: Path | None = None
    # Where the load-time timings (routes, decode stack, compiled buckets) are kept per machine, so a
    # restart takes them without timing (inference/engine/measured.py); None times at every load.
    measurements_file: Path | None = None
    remeasure: bool = False  # time again at this load and replace what was kept

    def __post_init__(self) -> None:
        if self.kv_dtype not in KV_DTYPE_NAMES:
            raise EngineError(f"kv_dtype must be one of {', '.join(KV_DTYPE_NAMES)}, not {self.kv_dtype!r}")
        if self.max_running < 0:
            raise EngineError(f"max_running must be 0 (no limit) or a number of requests, not {self.max_running}")
        if self.prefill_budget is not None and self.prefill_budget < 0:
            raise EngineError(f"prefill_budget must be 0 (no limit), a number of tokens or None (measured), "
                              f"not {self.prefill_budget}")


# The per-step limits a CPU engine gets unless configured (CEILING_PREFILL_BUDGET, CEILING_MAX_RUNNING).
# Every decode row waits for its whole step, and past ~12 rows a CPU step's time grows with its rows
# about as fast as the tokens it makes: on the bench's --quick burst (24 requests at once, q4, 2-core
# AMD EPYC Zen 4, 2026-12-07) no cap gave 60-62 ms per streamed token (TPOT p50) against llama.cpp's
# 39.6 (its 8 slots), 12 running and a 32-token prefill budget 35.8 ms, with the first token still
# sooner than llama.cpp's (TTFT p50 985 against 1,458 ms) and the burst 1.9× its tokens/s
# (docs/engine.md, "Requests in the running batch"). A GPU's step costs about the same for 1 row or 64:
# no limits there. Unset on a CPU, the budget is measured at load where the q4 variant times its steps
# by rows (owned/scheduler.py, measured_prefill_budget); 32 where nothing was timed.
CPU_PREFILL_BUDGET = 32
CPU_MAX_RUNNING = 12


def step_limits(device: str, prefill_budget: int | None, max_running: int | None) -> tuple[int | None, int]:
    """(prefill_budget, max_running) as configured, else the device's defaults (0 = no limit; a CPU's
    prefill budget None: measured when the engine loads)."""
    on_cpu = not device.startswith("cuda")
    if prefill_budget is None and not on_cpu:
        prefill_budget = 0
    if max_running is None:
        max_running = CPU_MAX_RUNNING if on_cpu else 0
    return prefill_budget, max_running


MAX_TOP_LOGPROBS = 20  # OpenAI's limit for top_logprobs


@dataclass(frozen=True)
class Sampling:
    """How the next token is chosen; the default is greedy (what the chat page and the bench use).

    The ranges are OpenAI's, so the API can pass a client's values straight through. `seed` makes a
    sampled answer reproducible: each request draws from its own generator, so the rows a batch
    happens to hold beside it change nothing.
    """

    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: bool = False  # report each chosen token's log-probability
    top_logprobs: int = 0  # and this many most likely alternatives

    def __post_init__(self) -> None:
        problem = self.problem()
        if problem:
            raise EngineError(problem)

    def problem(self) -> str | None:
        """Why these values are out of range, or None."""
        if not 0 <= self.temperature <= 2:
            return f"temperature must be between 0 and 2, not {self.temperature}"
        if not 0 < self.top_p <= 1:
            return f"top_p must be greater than 0 and at most 1, not {self.top_p}"
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                return f"{name} must be between -2 and 2, not {getattr(self, name)}"
        if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            return f"top_logprobs must be between 0 and {MAX_TOP_LOGPROBS}, not {self.top_logprobs}"
        if self.top_logprobs and not self.logprobs:
            return "top_logprobs needs logprobs to be true"
        return None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 and not self.presence_penalty and not self.frequency_penalty

    @property
    def plain(self) -> bool:
        """Greedy and reporting nothing extra: what transformers' loop can also serve."""
        return self.greedy and not self.logprobs


GREEDY = Sampling()


def default_device() -> str:
    """CUDA when this machine has a GPU, else the CPU."""
    import torch  # here, not at the top: the web tier reads this module's names without torch

    return "cuda" if torch.cuda.is_available() else "cpu"

