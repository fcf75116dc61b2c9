"""manage.py bench: its workload, its arithmetic, the varlen attention it measures, and one real run of every mode.

Numbers are printed and written, never asserted against a speed: this checks that the bench measures
what it says it measures.
"""

from __future__ import annotations

import io
import itertools
import json
import statistics

import pytest
import torch
from django.core.management import CommandError, call_command

from budgets.models import Feature
from inference.engine.bench.measure import MODE_KEYS, BenchError, RequestTiming, percentile, summarise
from inference.engine.bench.peer import run_peer
from inference.engine.bench.stub_peer import StubPeer
from inference.engine.bench.workload import WorkloadSpec, labelled, mixed_workload
from inference.engine.patches.attention import length_buckets, step_plan, varlen_attention
from inference.management.commands.bench import peer_root


def test_the_workload_is_fixed_by_its_seed_and_long_tailed():
    spec = WorkloadSpec(requests=400, seed=7, shared_fraction=0.25)
    first, again = mixed_workload(spec), mixed_workload(spec)
    assert first == again
    assert mixed_workload(WorkloadSpec(requests=400, seed=8)) != first
    lengths = [r.output_tokens for r in first]
    assert min(lengths) >= 8 and max(lengths) <= 256
    assert statistics.mean(lengths) > statistics.median(lengths)  # a long right tail
    assert sum(length >= 128 for length in lengths) >= 10 and lengths.count(256) >= 1
    shared = [r for r in first if r.shared_prefix]
    assert 0.15 < len(shared) / len(first) < 0.35
    assert len({r.messages[0]["content"] for r in shared}) == 1
    assert all(r.arrival_s == 0 for r in first)


def test_a_label_changes_every_system_prompt_and_nothing_else():
    """Each round's prompts are new to every cache (a peer's prompt cache kept the last round's), and
    the shared-prefix requests of one round still share their system prompt."""
    requests = mixed_workload(WorkloadSpec(requests=40, seed=5, shared_fraction=0.5))
    first, second = labelled(requests, "bench ab12 round 1"), labelled(requests, "bench ab12 round 2")
    for before, one, two in zip(requests, first, second, strict=True):
        assert one.messages[0]["content"] == "[bench ab12 round 1] " + before.messages[0]["content"]
        assert one.messages[0]["content"] != two.messages[0]["content"]
        assert one.messages[1:] == before.messages[1:]  # the user's question as it was
        assert (one.index, one.output_tokens, one.arrival_s, one.shared_prefix) == (
            before.index, before.output_tokens, before.arrival_s, before.shared_prefix)
    assert len({r.messages[0]["content"] for r in first if r.shared_prefix}) == 1
    assert requests == mixed_workload(WorkloadSpec(requests=40, seed=5, shared_fraction=0.5))  # the originals untouched


def test_poisson_arrivals_come_at_the_asked_rate():
    requests = mixed_workload(WorkloadSpec(requests=500, seed=1, rate=4.0))
    arrivals = [r.arrival_s for r in requests]
    assert arrivals == sorted(arrivals) and arrivals[0] > 0
    assert 3.4 < len(arrivals) / arrivals[-1] < 4.6


def test_the_summary_follows_vllms_definitions():
    timings = [
        RequestTiming(0, arrival=10.0, first_token=10.1, finished=11.1, output_tokens=11),  # TPOT 100 ms
        RequestTiming(1, arrival=10.0, first_token=10.3, finished=12.0, output_tokens=1),  # no TPOT
    ]
    summary = summarise(timings, peak_rss_mb=512.0)
    assert tuple(summary) == MODE_KEYS
    assert summary["requests"] == 2 and summary["output_tokens"] == 12
    assert summary["output_tokens_per_s"] == pytest.approx(12 / 2.0)
    assert summary["ttft_p50_ms"] == pytest.approx(200.0)
    assert summary["tpot_p50_ms"] == pytest.approx(100.0) and summary["tpot_p99_ms"] == pytest.approx(100.0)
    assert summary["e2e_p50_ms"] == pytest.approx(1550.0) and summary["e2e_p99_ms"] == pytest.approx(1991.0)
    assert percentile([1, 2, 3, 4], 50) == 2.5


def test_a_failed_request_fails_the_mode_with_its_reason():
    timings = [RequestTiming(0, 0.0, 0.1, 0.2, 2), RequestTiming(1, 0.0, error="engine_failed: boom")]
    with pytest.raises(BenchError, match="1 of 2 requests failed: engine_failed: boom"):
        summarise(timings, 1.0)


def _packed_sdpa(query, key, value, q_lens, k_lens):
    """transformers' own continuous-batching attention: one SDPA over the packed batch, block-diagonal causal mask."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    mask = torch.full((1, 1, sum(q_lens), sum(k_lens)), torch.finfo(torch.float32).min)
    q0 = k0 = 0
    for q_len, k_len in zip(q_lens, k_lens, strict=True):
        for row in range(q_len):
            mask[0, 0, q0 + row, k0 : k0 + k_len - q_len + row + 1] = 0
        q0, k0 = q0 + q_len, k0 + k_len

    class Layer:
        num_key_value_groups = 3
        is_causal = True

    return sdpa_attention_forward(Layer(), query, key, value, mask, scaling=0.125)[0]


@pytest.mark.parametrize(
    "q_lens, k_lens",
    [
        ([1, 1, 1, 1], [5, 40, 17, 1]),  # decode only: one padded batch
        ([6, 1, 3], [6, 30, 20]),  # a fresh prefill, a decode, a prefill after a shared prefix
        ([1] * 7, [5, 900, 40, 17, 880, 1, 300]),  # decode only, lengths far apart: several buckets
        ([1, 5, 1, 1, 0], [700, 5, 3, 650, 0]),  # decodes in two buckets beside a prefill, then padding
    ],
)
def test_varlen_attention_equals_transformers_packed_attention(q_lens, k_lens):
    torch.manual_seed(0)
    heads, kv_heads, dim = 9, 3, 64
    query = torch.randn(1, heads, sum(q_lens), dim)
    key, value = torch.randn(1, kv_heads, sum(k_lens), dim), torch.randn(1, kv_heads, sum(k_lens), dim)
    cu_q = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()])
    cu_k = torch.tensor([0, *torch.tensor(k_lens).cumsum(0).tolist()])
    ours = varlen_attention(query, key, value, cu_q, cu_k, 0.125)
    theirs = _packed_sdpa(query, key, value, q_lens, k_lens)
    assert ours.shape == theirs.shape == (1, sum(q_lens), heads, dim)
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize(
    "q_lens, k_lens",
    [([1, 1, 1, 1], [5, 40, 17, 1]), ([6, 1, 3], [6, 30, 20]), ([1, 5, 1, 1, 0], [700, 5, 3, 650, 0])],
)
def test_varlen_attention_reads_the_paged_cache_through_read_index(q_lens, k_lens):
    """The keys handed over are the whole cache, in the cache's own row order; read_index says which rows."""
    torch.manual_seed(1)
    heads, kv_heads, dim, cache_rows = 9, 3, 64, 2048
    query = torch.randn(1, heads, sum(q_lens), dim)
    key, value = torch.randn(1, kv_heads, sum(k_lens), dim), torch.randn(1, kv_heads, sum(k_lens), dim)
    read_index = torch.randperm(cache_rows)[: sum(k_lens)]  # scattered, as pages are
    k_cache, v_cache = torch.randn(cache_rows, kv_heads, dim), torch.randn(cache_rows, kv_heads, dim)
    k_cache[read_index], v_cache[read_index] = key[0].transpose(0, 1), value[0].transpose(0, 1)
    cu_q = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()])
    cu_k = torch.tensor([0, *torch.tensor(k_lens).cumsum(0).tolist()])
    ours = varlen_attention(
        query, k_cache.transpose(0, 1).unsqueeze(0), v_cache.transpose(0, 1).unsqueeze(0), cu_q, cu_k, 0.125, read_index
    )
    torch.testing.assert_close(ours, _packed_sdpa(query, key, value, q_lens, k_lens), atol=1e-5, rtol=1e-4)


def test_length_buckets_split_where_padding_costs_more_than_another_bucket():
    assert length_buckets([10, 12, 14], bucket_cost=64) == [(0, 3)]
    assert length_buckets([10, 12, 800, 810], bucket_cost=64) == [(0, 2), (2, 4)]
    assert length_buckets([10, 12, 800, 810], bucket_cost=10**6) == [(0, 4)]
    assert length_buckets([5, 6, 7], bucket_cost=0) == [(0, 1), (1, 2), (2, 3)]
    assert length_buckets([]) == []


def test_a_step_plan_is_built_once_and_reused_by_every_layer():
    cu_q, cu_k = torch.tensor([0, 1, 2]), torch.tensor([0, 10, 900])
    first = step_plan(cu_q, cu_k)
    assert step_plan(cu_q.clone(), cu_k.clone()) is first
    assert [bucket.batch for bucket in first.decode_buckets] == [1, 1]
    assert step_plan(cu_q, torch.tensor([0, 10, 21])) is not first


def test_bench_runs_every_mode_on_one_workload_and_writes_the_agreed_json(transactional_db, redis_db, tmp_path):
    out, page = tmp_path / "bench.json", tmp_path / "report.html"
    printed = io.StringIO()
    call_command(
        "bench", "--requests", "3", "--shared-fraction", "1", "--max-output-tokens", "6", "--stream-interval", "2",
        "--json", str(out), "--html", str(page), stdout=printed,
    )
    result = json.loads(out.read_text())
    assert set(result) == {"workload", "machine", "modes", "prefix", "roofline_tokens_per_s", "tpot_ms_at_1",
                           "bandwidth_roofline_tpot_ms_at_1"}
    # A lone request after the workload, beside the time to read its step's weights once.
    assert list(result["tpot_ms_at_1"]) == ["engine"] and result["tpot_ms_at_1"]["engine"] > 0
    assert 0 < result["bandwidth_roofline_tpot_ms_at_1"]
    assert list(result["modes"]) == ["sequential", "static", "engine", "stack"]
    expected_tokens = result["workload"]["output_tokens_total"]
    for name, figures in result["modes"].items():
        assert tuple(figures) == MODE_KEYS, name
        assert figures["requests"] == 3 and figures["output_tokens"] == expected_tokens, name
        assert 0 < figures["ttft_p50_ms"] <= figures["e2e_p50_ms"] and figures["ttft_p50_ms"] <= figures["ttft_p99_ms"]
        assert figures["output_tokens_per_s"] > 0 and figures["peak_rss_mb"] > 100
    assert set(result["prefix"]) == {"ttft_p50_ms_on", "ttft_p50_ms_off"}
    assert result["roofline_tokens_per_s"] > 0 and result["machine"]["parameters"] > 100_000_000
    # Measured before and after the modes; the roofline uses the better one.
    machine = result["machine"]
    assert machine["stream_interval"] == 2  # the stack's worker streamed two tokens a frame, same totals
    assert len(machine["matmul_gflops_measured"]) == 2 and machine["matmul_gflops"] == max(machine["matmul_gflops_measured"])
    roofline = machine["matmul_gflops"] * 1e9 / (2 * machine["parameters"])
    assert abs(result["roofline_tokens_per_s"] - roofline) <= 0.01 * roofline
    details = json.loads(page.with_suffix(".details.json").read_text())
    assert details["extras"]["engine"]["peak_running_batch"] >= 1
    engine = details["extras"]["engine"]
    assert engine["loop"] == "owned" and engine["decode_bytes_per_step_at_1"] > 400_000_000  # fp32: every weight once
    assert engine["bandwidth_roofline_tpot_ms_at_1"] == pytest.approx(
        engine["decode_bytes_per_step_at_1"] / (engine["copy_bandwidth_gb_s"] * 1e9) * 1000, rel=0.02)
    assert "a lone request" in printed.getvalue() and "memory-bandwidth roofline" in printed.getvalue()
    assert 0 < details["extras"]["stack"]["connect_ms_p50"] <= details["extras"]["stack"]["connect_ms_p99"]
    assert "handshake p50" in printed.getvalue()
    # The stack's TTFT in three parts, from each request's ledger row; they add up to the client's TTFT.
    stack = details["extras"]["stack"]
    assert 0 <= stack["ttft_to_guard_p50_ms"] <= stack["ttft_to_guard_max_ms"] < result["modes"]["stack"]["ttft_p99_ms"]
    assert 0 < stack["ttft_guard_to_first_token_p50_ms"] <= stack["ttft_guard_to_first_token_max_ms"]
    assert stack["ttft_to_client_p50_ms"] > -2  # the first frame's way back (the ledger keeps whole ms)
    assert "frame → guard" in printed.getvalue()
    assert len(details["timings"]["stack"]) == 3 and len(details["prefix"]["ttft_ms_on"]) == 3
    # e2e ends at the last token frame, as the peer's at its last chunk; `done` (the ledger settled) after it.
    assert all(row["done_after_last_token_ms"] >= 0 for row in details["timings"]["stack"])
    assert 0 <= stack["done_after_last_token_p50_ms"] <= stack["done_after_last_token_max_ms"]
    assert "`done` after the last token" in printed.getvalue()
    # The engine's own decode steps by row count, in the engine mode's process and in the stack's worker.
    for mode in ("engine", "stack"):
        steps = details["extras"][mode]["decode_step_ms_p50"]
        assert steps and all(int(rows) >= 1 and ms > 0 for rows, ms in steps.items()), (mode, steps)
    assert "decode step p50, engine mode / the stack's worker" in printed.getvalue()
    report = page.read_text()
    assert report.count('class="plotly-graph-div"') == 3 and report.count("Plotly.newPlot(") == 3
    assert "Output tokens" in report and "End-to-end latency" in report and "stack" in report
    assert "engine ≥ 3× static tokens/s" in printed.getvalue()


@pytest.mark.parametrize(
    "arguments, message",
    [
        (["--modes", "engine,turbo"], "unknown mode"),
        (["--requests", "0"], "at least 1"),
        (["--rate", "0"], "above 0"),
        (["--shared-fraction", "2"], "between 0 and 1"),
        (["--max-output-tokens", "999"], "between 2 and 256"),
        (["--stream-interval", "0"], "at least 1 token"),
        (["--repeat", "0"], "--repeat must be at least 1"),
        (["--modes", "engine,peer"], "the peer mode needs --peer URL"),
        (["--modes", "remote"], "the remote mode needs --peer URL"),
        (["--prefill-budget", "-1"], "--prefill-budget must be 0"),
        (["--max-running", "-1"], "--max-running must be 0"),
        (["--kv-dtype", "int4"], "invalid choice"),
    ],
)
def test_bad_arguments_are_refused_before_anything_runs(arguments, message, tmp_path):
    with pytest.raises(CommandError, match=message):
        call_command("bench", *arguments, "--html", str(tmp_path / "r.html"), stdout=io.StringIO())


def test_repeated_rounds_report_each_modes_median_run(transactional_db, tmp_path):
    out, page = tmp_path / "bench.json", tmp_path / "report.html"
    printed = io.StringIO()
    call_command("bench", "--requests", "2", "--max-output-tokens", "4", "--modes", "engine", "--repeat", "3",
                 "--json", str(out), "--html", str(page), stdout=printed)
    result = json.loads(out.read_text())
    speeds = json.loads(page.with_suffix(".details.json").read_text())["runs_tokens_per_s"]["engine"]
    assert len(speeds) == 3 and result["machine"]["repeat"] == 3
    assert result["modes"]["engine"]["output_tokens_per_s"] == sorted(speeds)[1]
    assert printed.getvalue().count("running engine (round") == 3 and "engine runs: " in printed.getvalue()


@pytest.mark.parametrize(
    "arguments, message",
    [
        (["--venv", "{tmp}"], "is not a virtual environment"),
        (["--first-run-timeout", "0"], "--first-run-timeout must be above 0"),
        (["--json", "{tmp}/no/first.json"], "does not exist"),
    ],
)
def test_a_first_run_refuses_bad_arguments_before_it_clones_anything(arguments, message, tmp_path):
    """Only the argument checks: a first run itself clones and starts a whole stack (minutes), so it
    is a bench to run by hand, never part of the suite."""
    arguments = [argument.replace("{tmp}", str(tmp_path)) for argument in arguments]
    with pytest.raises(CommandError, match=message):
        call_command("bench", "--first-run", *arguments, stdout=io.StringIO())


def test_bench_positions_times_each_position_on_each_kv_dtype(tmp_path):
    out = tmp_path / "positions.json"
    printed = io.StringIO()
    call_command("bench_positions", "--positions", "0,40", "--tokens", "3", "--rounds", "2", "--quantization", "none",
                 "--json", str(out), stdout=printed)
    result = json.loads(out.read_text())
    assert [run["kv_dtype"] for run in result["runs"]] == ["float32", "float16", "int8"]
    for run in result["runs"]:
        assert all(len(times) == 2 and min(times) > 0 for times in run["ms_per_token_runs"].values())
        assert set(run["ms_per_token_median"]) == {"0", "40"} and run["ratio_to_first"]["0"] == 1.0
    assert "float16 cache, median of 2: 0: " in printed.getvalue()
    assert "int8 cache, median of 2: 0: " in printed.getvalue()


def test_bench_positions_refuses_bad_arguments():
    with pytest.raises(CommandError, match="--positions must name positions from 0 to 8000"):
        call_command("bench_positions", "--positions", "0,9000", stdout=io.StringIO())
    with pytest.raises(CommandError, match="comma-separated whole numbers"):
        call_command("bench_positions", "--positions", "0,half", stdout=io.StringIO())
    with pytest.raises(CommandError, match="unknown KV dtype"):
        call_command("bench_positions", "--kv-dtypes", "float32,int4", stdout=io.StringIO())


def test_a_json_path_in_a_missing_folder_is_refused(tmp_path):
    with pytest.raises(CommandError, match="does not exist"):
        call_command("bench", "--json", str(tmp_path / "no" / "b.json"), stdout=io.StringIO())


def test_the_stack_modes_feature_is_served_by_the_variant_under_test(transactional_db):
    # A worker answers a feature with the feature's own variant: left at "none", a bf16 stack run
    # would load and measure the fp32 engine beside the bf16 one the worker started with.
    from budgets.models import Feature
    from inference.tools.stack_bench import BENCH_FEATURE, prepare_bench_user

    assert prepare_bench_user("bf16")
    assert Feature.objects.get(name=BENCH_FEATURE).quantization == "bf16"
    prepare_bench_user("none")
    assert Feature.objects.get(name=BENCH_FEATURE).quantization == "none"


@pytest.fixture
def stub_peer():
    """A real OpenAI-compatible server streaming one chunk per token, max_tokens of them (it honours
    ignore_eos by never stopping early), and a final usage chunk; it records every request."""
    server = StubPeer(first_byte_s=0.0, token_s=0.002).start()
    yield server
    server.shutdown()
    server.server_close()


def test_the_peer_mode_replays_the_workload_against_an_openai_server(stub_peer):
    requests = mixed_workload(WorkloadSpec(requests=6, seed=3, max_output_tokens=12))
    result = run_peer(stub_peer.url, requests)
    assert result.summary["requests"] == 6
    assert result.summary["output_tokens"] == sum(r.output_tokens for r in requests)
    assert result.extra["peer_model"] == "stub-peer" and result.extra["tpot_ms_at_1"] > 0
    bodies = [received.body for received in stub_peer.received]
    replayed = bodies[1:7]  # after the warm-up, before the lone request
    assert sorted(b["max_tokens"] for b in replayed) == sorted(r.output_tokens for r in requests)
    assert all(b["temperature"] == 0 and b["ignore_eos"] is True and b["stream"] is True for b in replayed)
    assert bodies[-1]["max_tokens"] == 64
    # The warm-up and the lone request leave none of the workload's prompts in the peer's cache.
    workload_prompts = {json.dumps(r.messages) for r in requests}
    assert {json.dumps(b["messages"]) for b in replayed} == workload_prompts
    assert json.dumps(bodies[0]["messages"]) not in workload_prompts and json.dumps(bodies[-1]["messages"]) not in workload_prompts


def test_each_round_sends_the_peer_prompts_it_has_not_seen(db, stub_peer, tmp_path):
    """A peer with a prompt cache answered rounds 2 and 3 of the same burst from it; each round's
    prompts now carry their own label, and an invocation's labels are its own."""
    for _ in range(2):
        call_command("bench", "--modes", "peer", "--peer", stub_peer.url, "--requests", "3", "--max-output-tokens", "4",
                     "--repeat", "2", "--json", str(tmp_path / "bench.json"), "--html", str(tmp_path / "report.html"),
                     stdout=io.StringIO())
    systems = [b["messages"][0]["content"] for b in (received.body for received in stub_peer.received)]
    assert len(systems) == 2 * 2 * (1 + 3 + 1)  # invocations × rounds × (warm-up, the burst, the lone request)
    bursts = [set(systems[start + 1: start + 4]) for start in range(0, len(systems), 5)]
    assert all(not (one & two) for one, two in itertools.combinations(bursts, 2))  # no prompt seen twice
    assert all(label.startswith("[bench ") for burst in bursts for label in burst)


def test_the_remote_mode_sends_one_burst_directly_and_through_the_stack(transactional_db, redis_db, tmp_path):
    """The same requests straight to a stub peer and through Ceiling's /v1 to it, in one run, with the
    stack's TTFT split by stage; the stub's fixed first-byte delay shows up where it belongs."""
    out, page = tmp_path / "bench.json", tmp_path / "report.html"
    printed = io.StringIO()
    peer = StubPeer(first_byte_s=0.3, token_s=0.005).start()
    try:
        # The /v1 base URL every OpenAI client takes, as a person would paste it.
        call_command("bench", "--modes", "remote", "--peer", f"{peer.url}/v1/", "--requests", "3", "--max-output-tokens", "6",
                     "--json", str(out), "--html", str(page), stdout=printed)
    finally:
        peer.shutdown()
        peer.server_close()
    result = json.loads(out.read_text())
    assert list(result["modes"]) == ["remote_direct", "remote"]
    expected_tokens = result["workload"]["output_tokens_total"]
    for name, figures in result["modes"].items():
        assert figures["requests"] == 3 and figures["output_tokens"] == expected_tokens, name
        assert 300 <= figures["ttft_p50_ms"] <= figures["ttft_p99_ms"] <= figures["e2e_p99_ms"], name
    through, direct = result["modes"]["remote"], result["modes"]["remote_direct"]
    ratios = result["remote_vs_direct"]
    assert ratios["ttft_p50_ms"] == pytest.approx(through["ttft_p50_ms"] / direct["ttft_p50_ms"], abs=0.001)
    assert ratios["ttft_p99_ms"] == pytest.approx(through["ttft_p99_ms"] / direct["ttft_p99_ms"], abs=0.001)
    assert ratios["output_tokens_per_s"] == pytest.approx(through["output_tokens_per_s"] / direct["output_tokens_per_s"], abs=0.001)

    split = json.loads(page.with_suffix(".details.json").read_text())["extras"]["remote"]
    assert split["traced_requests"] == 3
    for part in ("to_guard", "guard", "dispatch", "queue", "pickup", "connect", "first_byte", "to_frame", "relay"):
        assert 0 <= split[f"ttft_{part}_p50_ms"] <= split[f"ttft_{part}_max_ms"], part
    assert 290 <= split["ttft_first_byte_p50_ms"] < through["ttft_p50_ms"]  # the stub's own 300 ms
    assert split["daphne_cpu_ms_per_request"] > 0 and split["worker_cpu_ms_per_request"] > 0
    text = printed.getvalue()
    assert "remote through the stack ÷ directly: TTFT p50" in text and "remote first byte" in text
    assert "remote through the stack, CPU per request: daphne" in text
    assert "remote TTFT p50 through the stack within 20% of direct" in text
    # The bench's own features are switched off again: no chat page offers them, no worker is started for them.
    assert "Switched off the bench's own feature(s) bench, bench-remote again" in text
    assert not Feature.objects.filter(name__in=("bench", "bench-remote"), enabled=True).exists()

    # One warm-up and the burst each way; Ceiling forwarded each request as the workload asked for it.
    bodies = [received.body for received in peer.received]
    assert len(bodies) == 8
    forwarded = [body for body in bodies if "ignore_eos" not in body]
    assert len(forwarded) == 4 and all(body["model"] == "stub-peer" and body["stream"] is True for body in forwarded)
    assert sorted(body["max_tokens"] for body in forwarded[1:]) == sorted(body["max_tokens"] for body in bodies[1:4])
    # Each send's prompts are its own: the send through Ceiling finds none of the direct one's in a cache.
    direct_systems = {body["messages"][0]["content"] for body in bodies[1:4]}
    through_systems = {body["messages"][0]["content"] for body in forwarded[1:]}
    assert not direct_systems & through_systems
    assert all(system.startswith("[direct] ") for system in direct_systems)
    assert all(system.startswith("[through Ceiling] ") for system in through_systems)


@pytest.mark.parametrize("given", ["http://127.0.0.1:8080", "http://127.0.0.1:8080/", "http://127.0.0.1:8080/v1",
                                   "http://127.0.0.1:8080/v1/"])
def test_the_peer_is_given_as_its_root_or_as_the_v1_base_url_openai_clients_take(given):
    assert peer_root(given) == "http://127.0.0.1:8080"


def test_a_peer_that_does_not_answer_is_a_sentence():
    with pytest.raises(BenchError, match="does not answer GET /v1/models like an OpenAI-compatible server"):
        run_peer("http://127.0.0.1:9", mixed_workload(WorkloadSpec(requests=1)))


def test_bench_positions_says_which_engine_failed_to_load(tmp_path):
    """Each dtype's engine loads in a process of its own: one that fails is named, with the reason."""
    from inference.engine.bench.positions import PositionsError, measure_positions

    with pytest.raises(PositionsError, match="the float16 engine failed: .*"):
        measure_positions(tmp_path / "no-model-here", ["float16"], (0,), tokens=2, rounds=1, progress=lambda _: None)


def test_a_first_run_chat_is_timed_to_its_last_token_and_the_settlement_shown_beside():
    from inference.engine.bench.first_run import chat_figures

    timing = RequestTiming(0, arrival=10.0, first_token=10.1, finished=10.73, done=10.745, output_tokens=64)
    figures = chat_figures(timing)
    assert figures["ttft_ms"] == pytest.approx(100.0)
    assert figures["ms_per_token"] == pytest.approx(10.0)  # (10.73 - 10.1) s over 63 tokens, not to `done`
    assert figures["done_after_last_token_ms"] == pytest.approx(15.0)


def test_the_decode_steps_line_compares_the_row_counts_both_modes_ran():
    from inference.engine.bench.report import decode_steps_line

    assert decode_steps_line({"1": 3.4, "8": 12.0}, {"1": 5.9, "12": 30.0}) == (
        "decode step p50, engine mode / the stack's worker: 1 row 3.4 / 5.9 ms")
    many = {str(rows): float(rows) for rows in range(1, 21)}
    assert decode_steps_line(many, many).count(" ms") == 6
    assert decode_steps_line({}, {"1": 2.0}) == "" and decode_steps_line(None, None) == ""
