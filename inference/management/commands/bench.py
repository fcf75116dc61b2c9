"""`manage.py bench`: one workload through sequential, static, engine, stack and prefix modes, side by side.

With --peer, an OpenAI-compatible server joins: `peer` replays the workload against it beside the
engine, and `remote` replays it against it twice, directly and through the stack (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import json as jsonlib
import secrets
from dataclasses import asdict
from pathlib import Path

from django.conf import settings
from django.core.management.base import CommandError

from accounts.management.database import DatabaseCommand
from inference.engine.bench import report
from inference.engine.bench.measure import BenchError, machine_facts, measured_flops, roofline_tokens_per_s
from inference.engine.bench.modes import run_in_child
from inference.engine.bench.peer import run_peer
from inference.engine.bench.workload import WorkloadSpec, describe, labelled, mixed_workload
from inference.engine.config import KV_DTYPE_NAMES, step_limits
from inference.engine.patches.quantization import MODES
from inference.engines import model_dir

ALL_MODES = ("sequential", "static", "engine", "stack", "prefix", "peer", "remote")
DEFAULT_MODES = ALL_MODES[:-2]  # peer runs when --peer names a server; remote when asked for
NEEDS_PEER = ("peer", "remote")
QUICK_REQUESTS = 24


class Command(DatabaseCommand):
    help = "Replay one fixed workload through several serving modes and report them side by side (vLLM's metrics)."

    def add_arguments(self, parser) -> None:
        parser.add_argument("--requests", type=int, default=64)
        parser.add_argument("--quick", action="store_true", help=f"a short run: {QUICK_REQUESTS} requests")
        parser.add_argument("--rate", type=float, help="Poisson arrivals at this many requests/s (default: all at once)")
        parser.add_argument("--seed", type=int, default=0)
        parser.add_argument("--shared-fraction", type=float, default=0.25, help="share of requests with the long system prompt")
        parser.add_argument("--max-output-tokens", type=int, default=256, help="cap on output lengths (smoke runs only)")
        parser.add_argument("--modes", default=None,
                            help=f"comma-separated, of {', '.join(ALL_MODES)} (default: all but peer, plus peer with --peer)")
        parser.add_argument("--peer", metavar="URL",
                            help="an OpenAI-compatible server (its root or its /v1 base URL, e.g. llama.cpp's llama-server "
                                 "at http://127.0.0.1:8080/v1) to replay the same workload "
                                 "against as the peer mode, in the same run (docs/benchmarks.md says how to build one); "
                                 "the remote mode sends it the workload directly and through the stack")
        parser.add_argument("--threads", type=int, default=settings.CEILING_TORCH_THREADS)
        parser.add_argument("--loop", choices=("owned", "transformers"), default=settings.CEILING_ENGINE_LOOP,
                            help="the decode loop of the engine and stack modes (CEILING_ENGINE_LOOP)")
        parser.add_argument("--attention", choices=("varlen", "sdpa"), default=settings.CEILING_ATTENTION)
        parser.add_argument("--skinny-linear", action=argparse.BooleanOptionalAction, default=settings.CEILING_SKINNY_LINEAR,
                            help="decode-sized matmuls as W·xᵀ where the engine measures that faster when it loads (inference/engine/patches/linears.py)")
        parser.add_argument("--compile-decode", action=argparse.BooleanOptionalAction, default=settings.CEILING_COMPILE_DECODE,
                            help="compile the decode steps of CEILING_COMPILE_BUCKETS rows (torch.compile) and wait for "
                                 "them before the engine and stack modes run (inference/engine/owned/compiled.py)")
        parser.add_argument("--max-batch-tokens", type=int, default=settings.CEILING_MAX_BATCH_TOKENS)
        parser.add_argument("--prefill-budget", type=int, default=settings.CEILING_PREFILL_BUDGET,
                            help="prompt tokens a step may prefill while requests decode, 0 for no limit (default: CEILING_PREFILL_BUDGET, "
                                 "else on a CPU measured when the engine loads: inference/engine/owned/scheduler.py)")
        parser.add_argument("--max-running", type=int, default=settings.CEILING_MAX_RUNNING,
                            help="requests in the engine's running batch at once, 0 for no limit (default: CEILING_MAX_RUNNING, else 12 "
                                 "on a CPU)")
        parser.add_argument("--kv-dtype", choices=KV_DTYPE_NAMES, default=settings.CEILING_KV_DTYPE,
                            help="the KV cache's dtype on a CPU (CEILING_KV_DTYPE)")
        parser.add_argument("--q4-wide-bf16", action=argparse.BooleanOptionalAction, default=settings.CEILING_Q4_WIDE_BF16,
                            help="the q4 variant's wide steps on a bf16 copy where it measures faster (CEILING_Q4_WIDE_BF16)")
        parser.add_argument("--quantization", choices=MODES, default=settings.CEILING_QUANTIZATION,
                            help="the weight variant of the engine and stack modes (inference/engine/patches/quantization.py); "
                                 "sequential and static always run transformers' generate in full precision")
        parser.add_argument("--stream-interval", type=int, default=settings.CEILING_STREAM_INTERVAL,
                            help="the stack's tokens per frame after the first (CEILING_STREAM_INTERVAL)")
        parser.add_argument("--json", type=Path, help="write the result (the agreed JSON shape) here")
        parser.add_argument("--html", type=Path, default=None, help="HTML report (default var/bench/report.html)")
        parser.add_argument("--mode-timeout", type=float, default=1800, help="seconds one mode may take")
        parser.add_argument("--first-run", action="store_true",
                            help="clone HEAD into a temporary folder, start it with `make run` as a new user would "
                                 "(its own var/, SQLite and Redis) and time the page, the first chat's first token "
                                 "and ten chats' ms per token; with --peer, the same chats against the peer")
        parser.add_argument("--first-run-timeout", type=float, default=1200,
                            help="seconds `make run` may take until the page answers (--first-run)")
        parser.add_argument("--venv", type=Path, default=Path(settings.BASE_DIR) / ".venv",
                            help="the installed virtual environment the clone uses (--first-run; default this "
                                 "checkout's); --fresh-install lets `make run` install its own instead")
        parser.add_argument("--fresh-install", action="store_true",
                            help="--first-run: `make run` creates and installs the clone's own virtual environment")
        parser.add_argument("--keep-clone", action="store_true", help="--first-run: leave the clone and its log")
        parser.add_argument("--repeat", type=int, default=1,
                            help="run the modes this many times in alternating rounds and report each mode's "
                                 "median run by tokens/s (prefix runs once)")

    def handle(self, *args, **options) -> None:
        options["peer"] = peer_root(options["peer"])
        if options["first_run"]:
            return self._first_run(options)
        modes = self._modes(options["modes"], options["peer"])
        spec = self._spec(options)
        html_path = self._html_path(options)
        html_path.parent.mkdir(parents=True, exist_ok=True)  # var/bench/ on a first run
        try:
            result, details = self._run(spec, modes, options)
        except BenchError as exc:
            raise CommandError(str(exc)) from exc
        finally:
            if "stack" in modes or "remote" in modes:
                self._retire_bench_features()
        self.stdout.write(report.table(result, details["extras"]))
        if options["repeat"] > 1:
            for mode, speeds in details["runs_tokens_per_s"].items():
                self.stdout.write(f"{mode} runs: {', '.join(f'{speed:g}' for speed in speeds)} output tokens/s (median run reported)")
        if options["json"] is not None:
            options["json"].write_text(jsonlib.dumps(result, indent=2))
            self.stdout.write(f"JSON: {options['json']}")
        report.write_html(html_path, result, details)
        html_path.with_suffix(".details.json").write_text(jsonlib.dumps(details, indent=1))
        self.stdout.write(f"HTML report: {html_path} (per-request timings beside it, .details.json)")

    def _first_run(self, options: dict) -> None:
        from inference.engine.bench.first_run import run_first_run

        venv = None if options["fresh_install"] else options["venv"].resolve()
        if venv is not None and not (venv / "bin" / "python").exists():
            raise CommandError(f"{options['venv']} is not a virtual environment (no bin/python); give --venv or --fresh-install")
        if options["first_run_timeout"] <= 0:
            raise CommandError("--first-run-timeout must be above 0 seconds")
        if options["json"] is not None and not options["json"].parent.exists():
            raise CommandError(f"{options['json'].parent} does not exist")
        try:
            result = run_first_run(Path(settings.BASE_DIR), venv=venv, peer=options["peer"],
                                   timeout_s=options["first_run_timeout"], keep=options["keep_clone"],
                                   progress=self.stdout.write).as_dict()
        except BenchError as exc:
            raise CommandError(str(exc)) from exc
        self.stdout.write(report.first_run_table(result))
        if options["json"] is not None:
            options["json"].write_text(jsonlib.dumps(result, indent=2))
            self.stdout.write(f"JSON: {options['json']}")

    def needs_database(self, options: dict) -> bool:
        # Only the stack mode runs requests through the guard and the ledger. Bad arguments are
        # left for handle() to explain first: they are wrong whatever the database holds.
        if options["first_run"]:
            return False  # the clone makes its own
        try:
            modes = self._modes(options["modes"], options["peer"])
            self._spec(options)
            self._html_path(options)
        except CommandError:
            return False
        return "stack" in modes or "remote" in modes

    @staticmethod
    def _html_path(options: dict) -> Path:
        """The report's path, once the folders given for it and for --json are known to exist."""
        html_path = options["html"] or Path(settings.VAR_DIR) / "bench" / "report.html"
        for path in (options["json"], options["html"]):
            if path is not None and not path.parent.exists():
                raise CommandError(f"{path.parent} does not exist")
        return html_path

    def _modes(self, raw: str | None, peer: str | None) -> list[str]:
        if raw is None:
            raw = ",".join(DEFAULT_MODES + (("peer",) if peer else ()))
        modes = [m.strip() for m in raw.split(",") if m.strip()]
        unknown = sorted(set(modes) - set(ALL_MODES))
        if unknown or not modes:
            raise CommandError(f"unknown mode(s) {', '.join(unknown) or '(none given)'}; choose from {', '.join(ALL_MODES)}")
        for mode in NEEDS_PEER:
            if mode in modes and not peer:
                raise CommandError(f"the {mode} mode needs --peer URL: the OpenAI-compatible server to compare with")
        return [m for m in ALL_MODES if m in modes]

    def _spec(self, options) -> WorkloadSpec:
        requests = QUICK_REQUESTS if options["quick"] else options["requests"]
        if requests < 1:
            raise CommandError("--requests must be at least 1")
        if options["rate"] is not None and options["rate"] <= 0:
            raise CommandError("--rate must be above 0 requests/s")
        if not 0 <= options["shared_fraction"] <= 1:
            raise CommandError("--shared-fraction must be between 0 and 1")
        if not 2 <= options["max_output_tokens"] <= 256:
            raise CommandError("--max-output-tokens must be between 2 and 256")
        if options["stream_interval"] < 1:
            raise CommandError("--stream-interval must be at least 1 token")
        if options["repeat"] < 1:
            raise CommandError("--repeat must be at least 1")
        if options["prefill_budget"] is not None and options["prefill_budget"] < 0:
            raise CommandError("--prefill-budget must be 0 (no limit) or a number of tokens")
        if options["max_running"] is not None and options["max_running"] < 0:
            raise CommandError("--max-running must be 0 (no limit) or a number of requests")
        # Unset: what a worker on this machine gets (inference/engine/config.py, step_limits).
        options["prefill_budget"], options["max_running"] = step_limits(
            settings.CEILING_DEVICE or "cpu", options["prefill_budget"], options["max_running"])
        return WorkloadSpec(requests=requests, seed=options["seed"], shared_fraction=options["shared_fraction"],
                            rate=options["rate"], max_output_tokens=options["max_output_tokens"])

    def _run(self, spec: WorkloadSpec, modes: list[str], options) -> tuple[dict, dict]:
        from transformers import AutoTokenizer

        from inference.engine import encode_chat

        folder = model_dir(progress=self.stdout.write)
        requests = mixed_workload(spec)
        # Every round's prompts carry a label of their own (workload.labelled): no mode finds an earlier
        # round's prompts, or an earlier invocation's, in a cache (a long-running peer keeps them).
        run_label = f"bench {secrets.token_hex(3)}"
        rounds = [labelled(requests, f"{run_label} round {number}") for number in range(1, options["repeat"] + 1)]
        tokenizer = AutoTokenizer.from_pretrained(str(folder))
        workload = describe(spec, rounds[0], [len(encode_chat(tokenizer, r.messages)) for r in rounds[0]])
        workload["round_labels"] = f"[{run_label} round N] before each system prompt"
        threads = options["threads"]
        machine = machine_facts(threads)
        flops_before = measured_flops(threads)
        machine["parameters"] = parameter_count(folder)
        machine["loop"] = options["loop"]
        machine["attention"] = options["attention"]
        machine["max_batch_tokens"] = options["max_batch_tokens"]
        machine["prefill_budget"] = "measured" if options["prefill_budget"] is None else options["prefill_budget"]
        machine["max_running"] = options["max_running"]
        machine["kv_dtype"] = options["kv_dtype"]
        machine["skinny_linear"] = options["skinny_linear"]
        machine["compile_buckets"] = list(settings.CEILING_COMPILE_BUCKETS) if options["compile_decode"] else []
        machine["quantization"] = options["quantization"]
        machine["q4_wide_bf16"] = options["q4_wide_bf16"]
        machine["stream_interval"] = options["stream_interval"]
        machine["repeat"] = options["repeat"]
        self.stdout.write(
            f"workload: {spec.requests} requests, {workload['output_tokens_total']} output tokens "
            f"({workload['arrivals']}); machine: {flops_before / 1e9:.1f} GFLOP/s on {threads} threads"
        )
        engine_options = {
            "loop": options["loop"],
            "attention": options["attention"],
            "max_batch_tokens": options["max_batch_tokens"],
            "prefill_budget": options["prefill_budget"],
            "max_running": options["max_running"],
            "kv_dtype": options["kv_dtype"],
            "skinny_linear": options["skinny_linear"],
            "quantization": options["quantization"],
            "compile_buckets": settings.CEILING_COMPILE_BUCKETS if options["compile_decode"] else (),
            "compile_cache_dir": Path(settings.VAR_DIR) / "inductor",  # the worker's: one compile serves both
            "own_kernels": settings.CEILING_OWN_KERNELS,
            "kernel_cache_dir": Path(settings.VAR_DIR) / "kernels",
            "q4_wide_bf16": options["q4_wide_bf16"],
        }
        # Rounds, not one mode N times in a row: a VM's slow minutes then fall on every mode alike.
        runs: dict[str, list[dict]] = {}
        prefix = None
        for round_number, round_requests in enumerate(rounds, start=1):
            for mode in modes:
                if mode == "prefix" and round_number > 1:
                    continue
                self.stdout.write(f"running {mode}…" if options["repeat"] == 1 else f"running {mode} (round {round_number})…")
                if mode == "prefix":
                    prefix = run_in_child(mode, folder, round_requests, {"threads": threads}, options["mode_timeout"])
                    continue
                if mode == "remote":
                    direct, run = self._remote(options["peer"], round_requests, threads, engine_options, options["stream_interval"])
                    runs.setdefault("remote_direct", []).append(direct)
                    figures = direct["summary"]
                    self.stdout.write(f"  directly: {figures['output_tokens_per_s']:g} output tokens/s, "
                                      f"TTFT p50 {figures['ttft_p50_ms']:g} ms; through the stack:")
                elif mode == "stack":
                    run = self._stack(round_requests, threads, engine_options, options["stream_interval"])
                elif mode == "peer":
                    run = asdict(run_peer(options["peer"], round_requests))
                else:
                    run = run_in_child(
                        mode, folder, round_requests, {"threads": threads, "engine_options": engine_options}, options["mode_timeout"]
                    )
                runs.setdefault(mode, []).append(run)
                figures = run["summary"]
                self.stdout.write(f"  {figures['output_tokens_per_s']:g} output tokens/s, TTFT p50 {figures['ttft_p50_ms']:g} ms")
        results = {mode: median_run(mode_runs) for mode, mode_runs in runs.items()}
        if "remote" in results:  # the direct run of the same round: a ratio compares one round's pair
            results["remote_direct"] = runs["remote_direct"][runs["remote"].index(results["remote"])]
        flops = best_flops(machine, flops_before, measured_flops(threads))
        result = report.result_json(workload, machine, results, prefix, roofline_tokens_per_s(flops, machine["parameters"]))
        details = {
            "extras": {name: r["extra"] for name, r in results.items() if r["extra"]},
            "timings": {name: r["timings"] for name, r in results.items()},
            "prefix": prefix,
            "runs_tokens_per_s": {mode: [r["summary"]["output_tokens_per_s"] for r in mode_runs] for mode, mode_runs in runs.items()},
        }
        return result, details

    def _retire_bench_features(self) -> None:
        from inference.tools.stack_bench import retire_bench_features

        retired = retire_bench_features()
        if retired:
            self.stdout.write(f"Switched off the bench's own feature(s) {', '.join(retired)} again: no chat page "
                              f"offers them and no worker is started for their weights (their ledger rows stay).")

    def _stack(self, requests, threads: int, engine_options: dict, stream_interval: int) -> dict:
        from inference.tools.stack_bench import run_stack

        result = run_stack(requests, threads=threads, engine_env=stack_env(engine_options, stream_interval),
                           log_dir=Path(settings.VAR_DIR) / "bench", progress=self.stdout.write)
        return asdict(result)

    def _remote(self, peer: str, requests, threads: int, engine_options: dict, stream_interval: int) -> tuple[dict, dict]:
        from inference.tools.stack_bench import run_remote

        direct, through = run_remote(peer, requests, threads=threads, engine_env=stack_env(engine_options, stream_interval),
                                     log_dir=Path(settings.VAR_DIR) / "bench", progress=self.stdout.write)
        return asdict(direct), asdict(through)


def peer_root(url: str | None) -> str | None:
    """The peer server's root, which the bench's clients append /v1/… to. Every OpenAI client takes
    the `…/v1` base URL instead, so that is accepted too (with or without a trailing slash)."""
    if not url:
        return url
    root = url.rstrip("/")
    return root[: -len("/v1")] if root.endswith("/v1") else root


def stack_env(engine_options: dict, stream_interval: int) -> dict[str, str]:
    """The environment of the daphne and worker a stack or remote run starts: the engine under test."""
    return {
        "CEILING_ENGINE_LOOP": engine_options["loop"],
        "CEILING_ATTENTION": engine_options["attention"],
        "CEILING_MAX_BATCH_TOKENS": str(engine_options["max_batch_tokens"]),
        # None: unset, so the worker measures its own (as a worker started by `make run` does)
        "CEILING_PREFILL_BUDGET": "" if engine_options["prefill_budget"] is None else str(engine_options["prefill_budget"]),
        "CEILING_MAX_RUNNING": str(engine_options["max_running"]),
        "CEILING_KV_DTYPE": engine_options["kv_dtype"],
        "CEILING_SKINNY_LINEAR": "1" if engine_options["skinny_linear"] else "0",
        "CEILING_QUANTIZATION": engine_options["quantization"],
        "CEILING_COMPILE_DECODE": "1" if engine_options["compile_buckets"] else "0",
        "CEILING_COMPILE_BUCKETS": ",".join(map(str, engine_options["compile_buckets"] or settings.CEILING_COMPILE_BUCKETS)),
        "CEILING_STREAM_INTERVAL": str(stream_interval),
        "CEILING_Q4_WIDE_BF16": "1" if engine_options["q4_wide_bf16"] else "0",
    }


def median_run(runs: list[dict]) -> dict:
    """The run with the median output tokens/s (the upper one of an even count): a real run, so
    its latencies and throughput belong together."""
    ordered = sorted(runs, key=lambda run: run["summary"]["output_tokens_per_s"])
    return ordered[len(ordered) // 2]


def best_flops(machine: dict, before: float, after: float) -> float:
    """The roofline is a ceiling, so the better of the two measurements (before and after the modes).

    One second of matmuls can land on a slow moment of a shared VM: one run here measured 115
    GFLOP/s at its start where every measurement around it gave ~200, which would have halved the
    roofline and passed the 25% target on a wrong number.
    """
    machine["matmul_gflops_measured"] = [round(before / 1e9, 1), round(after / 1e9, 1)]
    machine["matmul_gflops"] = round(max(before, after) / 1e9, 1)
    return max(before, after)


def parameter_count(folder: Path) -> int:
    """Parameters stored in the model's safetensors files (tied embeddings count once)."""
    from safetensors import safe_open

    total = 0
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as weights:
            for name in weights.keys():
                shape = weights.get_slice(name).get_shape()
                count = 1
                for dim in shape:
                    count *= dim
                total += count
    return total
