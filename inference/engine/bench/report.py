"""The bench's outputs: a table on stdout, the JSON of the agreed shape, and an HTML report with Plotly."""

from __future__ import annotations

import html
import json
from pathlib import Path

from inference.engine.bench.measure import MODE_KEYS

MODE_ORDER = ("sequential", "static", "engine", "stack", "peer", "remote_direct", "remote")
# The remote mode's split of its TTFT (inference/tools/stack_bench.py REMOTE_PARTS), as printed.
REMOTE_PARTS = (("to_guard", "→ guard"), ("guard", "guard"), ("dispatch", "dispatch"), ("queue", "Celery queue"), ("pickup", "worker pickup"),
                ("connect", "remote connect"), ("first_byte", "remote first byte"), ("to_frame", "→ frame"),
                ("relay", "relay to the client"))


def result_json(workload: dict, machine: dict, modes: dict[str, dict], prefix: dict | None, roofline: float) -> dict:
    """Exactly the agreed shape: {"workload", "machine", "modes": {name: M}, "prefix", "roofline_tokens_per_s"}."""
    result = {
        "workload": workload,
        "machine": machine,
        "modes": {name: {key: modes[name]["summary"][key] for key in MODE_KEYS} for name in MODE_ORDER if name in modes},
        "prefix": None if prefix is None else {k: prefix[k] for k in ("ttft_p50_ms_on", "ttft_p50_ms_off")},
        "roofline_tokens_per_s": round(roofline, 1),
        # A lone request's time per output token, measured after each mode's workload (engine, peer).
        "tpot_ms_at_1": {name: run["extra"]["tpot_ms_at_1"] for name, run in modes.items()
                         if run.get("extra", {}).get("tpot_ms_at_1") is not None},
        "bandwidth_roofline_tpot_ms_at_1": modes.get("engine", {}).get("extra", {}).get("bandwidth_roofline_tpot_ms_at_1"),
    }
    if "remote" in modes and "remote_direct" in modes:
        result["remote_vs_direct"] = remote_ratios(result["modes"]["remote"], result["modes"]["remote_direct"])
    return result


def remote_ratios(through: dict, direct: dict) -> dict:
    """The same burst through the stack ÷ straight to the peer (above 1: the stack is slower, or faster for tokens/s)."""
    return {key: round(through[key] / direct[key], 3) if direct[key] else None
            for key in ("ttft_p50_ms", "ttft_p99_ms", "output_tokens_per_s", "e2e_p50_ms")}


def targets(result: dict) -> list[tuple[str, float, bool]]:
    """The issue's targets on this machine: (what, measured value, met?), for the modes that ran."""
    modes = result["modes"]

    def ratio(a: str, b: str, key: str = "output_tokens_per_s") -> float | None:
        if a in modes and b in modes and modes[b][key]:
            return modes[a][key] / modes[b][key]
        return None

    rows = []
    for what, value, bar in (
        ("engine ≥ 3× static tokens/s", ratio("engine", "static"), 3.0),
        ("engine ≥ 6× sequential tokens/s", ratio("engine", "sequential"), 6.0),
        ("stack ≥ 90% of engine tokens/s", ratio("stack", "engine"), 0.9),
    ):
        if value is not None:
            rows.append((what, value, value >= bar))
    if "stack" in modes and "engine" in modes:
        gap = modes["stack"]["ttft_p50_ms"] - modes["engine"]["ttft_p50_ms"]
        rows.append(("stack TTFT p50 within 100 ms of engine (ms)", gap, gap <= 100))
    prefix = result.get("prefix")
    if prefix and prefix["ttft_p50_ms_on"]:
        speedup = prefix["ttft_p50_ms_off"] / prefix["ttft_p50_ms_on"]
        rows.append(("prefix caching cuts TTFT p50 ≥ 3×", speedup, speedup >= 3))
    lone = result.get("tpot_ms_at_1") or {}
    if "engine" in lone and "peer" in lone:
        rows.append(("a lone request's TPOT ≤ the peer's (engine ÷ peer)", lone["engine"] / lone["peer"],
                     lone["engine"] <= lone["peer"]))
    if "engine" in lone and result.get("bandwidth_roofline_tpot_ms_at_1"):
        share = result["bandwidth_roofline_tpot_ms_at_1"] / lone["engine"]
        rows.append(("a lone request at ≥ 50% of the memory-bandwidth roofline", share, share >= 0.5))
    peer_speed = ratio("stack", "peer")
    if peer_speed is not None:
        rows.append(("stack ≥ 1.5× the peer's tokens/s", peer_speed, peer_speed >= 1.5))
        rows.append(("stack TTFT p50 ≤ the peer's (stack ÷ peer)", modes["stack"]["ttft_p50_ms"] / modes["peer"]["ttft_p50_ms"],
                     modes["stack"]["ttft_p50_ms"] <= modes["peer"]["ttft_p50_ms"]))
    remote = result.get("remote_vs_direct")
    if remote and remote["ttft_p50_ms"] is not None:
        rows.append(("remote TTFT p50 through the stack within 20% of direct (stack ÷ direct)", remote["ttft_p50_ms"],
                     remote["ttft_p50_ms"] <= 1.2))
    if "engine" in modes and result["roofline_tokens_per_s"]:
        share = modes["engine"]["output_tokens_per_s"] / result["roofline_tokens_per_s"]
        rows.append(("engine ≥ 25% of the roofline", share, share >= 0.25))
    return rows


def table(result: dict, extras: dict[str, dict]) -> str:
    columns = ("mode",) + MODE_KEYS[1:] + ("mean batch", "KV blocks peak")
    rows = [columns]
    for name, figures in result["modes"].items():
        extra = extras.get(name, {})
        rows.append(
            (name, *(f"{figures[k]:g}" for k in MODE_KEYS[1:]),
             f"{extra['mean_running_batch']:g}" if "mean_running_batch" in extra else "-",
             f"{extra['kv_blocks_used_peak']}/{extra['kv_blocks_total']}" if "kv_blocks_total" in extra else "-")
        )
    widths = [max(len(str(row[i])) for row in rows) for i in range(len(columns))]
    lines = ["  ".join(str(cell).rjust(width) for cell, width in zip(row, widths, strict=True)) for row in rows]
    lines.append(f"roofline (measured matmul FLOP/s ÷ 2 × parameters): {result['roofline_tokens_per_s']:g} tokens/s")
    for name, tpot in (result.get("tpot_ms_at_1") or {}).items():
        lines.append(f"{name}: a lone request, {tpot:g} ms per output token")
    if result.get("bandwidth_roofline_tpot_ms_at_1"):
        engine = extras.get("engine", {})
        lines.append(f"memory-bandwidth roofline of a lone request: {result['bandwidth_roofline_tpot_ms_at_1']:g} ms per token "
                     f"({engine.get('decode_bytes_per_step_at_1', 0) / 1e6:.0f} MB of weights per step at "
                     f"{engine.get('copy_bandwidth_gb_s', 0):g} GB/s copy bandwidth)")
    if "connect_ms_p50" in extras.get("stack", {}):
        stack = extras["stack"]
        lines.append(f"stack: chat sockets opened before the clock started (as the chat page does); "
                     f"handshake p50 {stack['connect_ms_p50']:g} ms, p99 {stack['connect_ms_p99']:g} ms")
    if "ttft_to_guard_p50_ms" in extras.get("stack", {}):
        stack = extras["stack"]
        lines.append("stack TTFT, p50 (max) ms: frame → guard " + f"{stack['ttft_to_guard_p50_ms']:g} ({stack['ttft_to_guard_max_ms']:g}), "
                     f"guard → first token in the worker {stack['ttft_guard_to_first_token_p50_ms']:g} "
                     f"({stack['ttft_guard_to_first_token_max_ms']:g}), → client {stack['ttft_to_client_p50_ms']:g} "
                     f"({stack['ttft_to_client_max_ms']:g})")
    step_line = decode_steps_line(extras.get("engine", {}).get("decode_step_ms_p50"),
                                  extras.get("stack", {}).get("decode_step_ms_p50"))
    if step_line:
        lines.append(step_line)
    if "done_after_last_token_p50_ms" in extras.get("stack", {}):
        stack = extras["stack"]
        lines.append(f"stack: `done` after the last token (the ledger settled), p50 {stack['done_after_last_token_p50_ms']:g} ms, "
                     f"max {stack['done_after_last_token_max_ms']:g} (e2e and TPOT end at the last token, as the peer's)")
    remote = result.get("remote_vs_direct")
    if remote:
        lines.append("remote through the stack ÷ directly: " + ", ".join(
            f"{label} {remote[key]:g}×" for key, label in (("ttft_p50_ms", "TTFT p50"), ("ttft_p99_ms", "TTFT p99"),
                                                          ("output_tokens_per_s", "output tokens/s"), ("e2e_p50_ms", "e2e p50"))
            if remote[key] is not None))
    if "ttft_guard_p50_ms" in extras.get("remote", {}):
        split = extras["remote"]
        lines.append("remote TTFT through the stack, p50 (max) ms: " + ", ".join(
            f"{label} {split[f'ttft_{key}_p50_ms']:g} ({split[f'ttft_{key}_max_ms']:g})"
            for key, label in REMOTE_PARTS if f"ttft_{key}_p50_ms" in split))
        lines.append(f"remote through the stack, CPU per request: daphne {split['daphne_cpu_ms_per_request']:g} ms, "
                     f"worker {split['worker_cpu_ms_per_request']:g} ms")
    if result["prefix"]:
        p = result["prefix"]
        lines.append(f"prefix caching: TTFT p50 {p['ttft_p50_ms_on']:g} ms on, {p['ttft_p50_ms_off']:g} ms off")
    for what, value, met in targets(result):
        lines.append(f"  [{'met ' if met else 'MISS'}] {what}: {value:.2f}")
    return "\n".join(lines)


def write_html(path: Path, result: dict, details: dict) -> None:
    """A self-contained page (plotly.js inlined) with the figures a reader compares modes by."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    modes = list(result["modes"])
    figures = result["modes"]
    throughput = go.Figure(go.Bar(x=modes, y=[figures[m]["output_tokens_per_s"] for m in modes], name="output tokens/s"))
    roofline = result["roofline_tokens_per_s"]
    if roofline:
        throughput.add_hline(y=roofline * 0.25, line_dash="dot", annotation_text=f"25% of roofline ({roofline * 0.25:.0f})")
    throughput.update_layout(title="Output tokens/s (same workload)", yaxis_title="tokens/s", height=380)

    latency = make_subplots(rows=1, cols=3, subplot_titles=("TTFT (ms)", "TPOT (ms)", "End-to-end (ms)"))
    for column, metric in enumerate(("ttft", "tpot", "e2e"), start=1):
        for quantile in ("p50", "p99"):
            latency.add_trace(
                go.Bar(x=modes, y=[figures[m][f"{metric}_{quantile}_ms"] for m in modes], name=quantile,
                       legendgroup=quantile, showlegend=column == 1),
                row=1, col=column,
            )
    latency.update_layout(barmode="group", height=380, title="Latency, p50 and p99")

    cdf = go.Figure()
    for mode in modes:
        e2e = sorted(row["e2e_ms"] for row in details["timings"].get(mode, []))
        if e2e:
            cdf.add_trace(go.Scatter(x=e2e, y=[(i + 1) / len(e2e) for i in range(len(e2e))], mode="lines", name=mode))
    cdf.update_layout(title="End-to-end latency, cumulative share of requests", xaxis_title="ms", height=380)

    parts = [throughput.to_html(full_html=False, include_plotlyjs=True)]
    parts += [fig.to_html(full_html=False, include_plotlyjs=False) for fig in (latency, cdf)]
    target_rows = "".join(
        f"<tr><td>{html.escape(what)}</td><td>{value:.2f}</td><td>{'met' if met else 'missed'}</td></tr>"
        for what, value, met in targets(result)
    )
    path.write_text(
        "<!doctype html><meta charset=utf-8><title>Ceiling bench</title>"
        "<style>body{font-family:system-ui;margin:2em}table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:4px 8px}</style>"
        "<h1>Ceiling bench</h1>"
        f"<pre>{html.escape(table(result, details['extras']))}</pre>"
        f"<h2>Targets</h2><table><tr><th>target</th><th>measured</th><th></th></tr>{target_rows}</table>"
        + "".join(parts)
        + f"<h2>Workload and machine</h2><pre>{html.escape(json.dumps({k: result[k] for k in ('workload', 'machine')}, indent=2))}</pre>"
    )


def decode_steps_line(engine: dict | None, stack: dict | None) -> str:
    """The same decode step alone in the engine mode's process and in the stack's worker, beside the
    web tier: its median ms at the row counts both ran most recently (at most six)."""
    shared = sorted(set(engine or {}) & set(stack or {}), key=int)
    if not shared:
        return ""
    picked = shared if len(shared) <= 6 else [shared[round(i * (len(shared) - 1) / 5)] for i in range(6)]
    return "decode step p50, engine mode / the stack's worker: " + ", ".join(
        f"{rows} row{'s' if rows != '1' else ''} {engine[rows]:g} / {stack[rows]:g} ms" for rows in picked)


def first_run_table(result: dict) -> str:
    """`bench --first-run`'s figures as lines a person reads."""
    lines = [f"page answered: {_seconds(result['page_s'])} after `make run`",
             f"first chat's first token: {_seconds(result['first_token_s'])} after `make run`"]
    peers = result.get("peer_ms_per_token") or []
    for index, chat in enumerate(result["chats"]):
        peer = peers[index] if index < len(peers) else None
        if "error" in chat:
            lines.append(f"chat {index + 1}: {chat['error']}")
            continue
        beside = f" (peer {peer:.2f} ms)" if peer else ""
        settled = f", done {chat['done_after_last_token_ms']:.0f} ms after it" if "done_after_last_token_ms" in chat else ""
        lines.append(f"chat {index + 1}: TTFT {chat['ttft_ms']:.0f} ms, {chat['ms_per_token'] or 0:.2f} ms/token "
                     f"over {chat['tokens']} tokens to the last one{settled}{beside}")
    if result.get("ms_per_token_median"):
        peer = result.get("peer_ms_per_token_median")
        ratio = f", {result['ms_per_token_median'] / peer:.2f}x the peer's {peer:.2f} ms" if peer else ""
        lines.append(f"median: {result['ms_per_token_median']:.2f} ms/token{ratio}")
    return "\n".join(lines)


def _seconds(value: float | None) -> str:
    return "never" if value is None else f"{value:.1f} s"
