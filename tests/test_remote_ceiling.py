"""The ceiling holds where money leaves for a remote provider: tool lists, tool results, remotes that
count more than any estimate, remotes that report nothing and ignore max_tokens.

The remote is a real OpenAI-compatible HTTP server on loopback that bills what a real server would:
it counts the prompt it received (messages of every role and the tool list, as JSON, with the served
model's own tokenizer) and streams `max_tokens` pieces. Its `mode` makes it honest, heavy (a chat
template that renders twice the tokens, beyond what three bytes a token can know) or silent (no
usage chunk, and it ignores max_tokens).

The stack under test has a queue of its own with input and body limits large enough for a 200-tool
list (the defaults would refuse it by size, which proves nothing about the reservation).
"""

from __future__ import annotations

import json
import subprocess
import threading
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import redis
from django.utils import timezone

from accounts.actions import do_create_api_key
from accounts.models import ApiKey
from budgets.estimates import RATIO_KEY
from budgets.models import (
    Alert,
    Feature,
    ModelPrice,
    Provider,
    Quota,
    TagQuota,
    Team,
    TeamMembership,
    TeamQuota,
    TokenLog,
)
from project import stack as processes
from tests.conftest import wait_for

pytestmark = pytest.mark.django_db(transaction=True)

MODEL = "remote-model"
PRICE_PER_MILLION = 10_000_000  # $10 per million tokens, in and out


@pytest.fixture(scope="module")
def ceiling_stack(live_stack, shared_stack):
    """A stack whose limits let 200-tool lists in (CEILING_MAX_INPUT_TOKENS, CEILING_MAX_FRAME_BYTES):
    the shared one has them (tests/conftest.py)."""
    return shared_stack


@pytest.fixture(autouse=True)
def clean_counters(redis_db):
    for key in [*redis_db.scan_iter(match="ceiling:c:*"), RATIO_KEY]:
        redis_db.delete(key)


# --- the remote -------------------------------------------------------------------------------------


def prompt_tokens_of(body: dict) -> int:
    """What a real server bills for this prompt: its JSON in a real tokenizer, plus role markers."""
    from inference.web.tokenizer import get_tokenizer

    billed = {"messages": body["messages"], **({"tools": body["tools"]} if body.get("tools") else {})}
    return len(get_tokenizer().encode(json.dumps(billed))) + 4 * len(body["messages"])


class BillingRemote(BaseHTTPRequestHandler):
    mode = "honest"  # honest | heavy | silent | agent
    received: list[dict] = []

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        BillingRemote.received.append(body)
        if self.mode == "agent":
            return self._agent_step(body)
        prompt = prompt_tokens_of(body) * (2 if self.mode == "heavy" else 1)
        pieces = body["max_tokens"] * (5 if self.mode == "silent" else 1)
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        try:
            for n in range(pieces):
                self._send({"choices": [{"index": 0, "delta": {"content": f" w{n}"}}]})
            self._send({"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]})
            if self.mode != "silent":
                self._send({"choices": [], "usage": {"prompt_tokens": prompt, "completion_tokens": body["max_tokens"]}})
            self.wfile.write(b"data: [DONE]\n\n")
            self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError):
            pass  # the worker hung up: what a cut-off remote sees

    def _send(self, chunk: dict) -> None:
        self.wfile.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")

    def _agent_step(self, body: dict) -> None:
        """A model in a tool loop: it calls lookup_record_<n> until two results are in, then answers."""
        results = sum(1 for m in body["messages"] if m["role"] == "tool")
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        if results < 2:
            call = {"index": 0, "id": f"call_{results}", "type": "function",
                    "function": {"name": f"lookup_record_{results}", "arguments": json.dumps({"record_id": f"CUST-{results}"})}}
            self._send({"choices": [{"index": 0, "delta": {"tool_calls": [call]}}]})
            self._send({"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]})
            completion = 12
        else:
            self._send({"choices": [{"index": 0, "delta": {"content": "Both records are paid."}}]})
            self._send({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
            completion = 5
        self._send({"choices": [], "usage": {"prompt_tokens": prompt_tokens_of(body), "completion_tokens": completion}})
        self.wfile.write(b"data: [DONE]\n\n")
        self.wfile.flush()

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def remote():
    server = ThreadingHTTPServer(("127.0.0.1", 0), BillingRemote)
    BillingRemote.mode, BillingRemote.received = "honest", []
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    server.shutdown()
    server.server_close()


@pytest.fixture
def tools_feature(remote) -> Feature:
    provider = Provider.objects.create(name="billing-remote", kind=Provider.Kind.OPENAI_COMPATIBLE, base_url=remote,
                                       remote_model=MODEL)
    ModelPrice.objects.create(provider=provider, model=MODEL, input_per_million_micro_usd=PRICE_PER_MILLION,
                              output_per_million_micro_usd=PRICE_PER_MILLION, effective_from=timezone.now() - timedelta(days=1))
    return Feature.objects.create(name="agent", provider=provider, max_input_tokens=200_000, max_output_tokens=256)


def tool(i: int) -> dict:
    return {"type": "function", "function": {
        "name": f"lookup_record_{i}",
        "description": f"Look up record number {i} in the customer database and return its fields, including the "
                       "account owner, the billing address and the last five invoices.",
        "parameters": {"type": "object", "required": ["record_id"], "properties": {
            "record_id": {"type": "string", "description": "The record's identifier, such as CUST-000123."},
            "include_invoices": {"type": "boolean", "description": "Whether to include the invoices."},
            "limit": {"type": "integer", "description": "How many invoices at most."},
        }},
    }}


def tools(n: int) -> list[dict]:
    return [tool(i) for i in range(n)]


QUESTION = [{"role": "user", "content": "Find the invoices of customer CUST-000123."}]
# A tool loop's second step: the assistant's call (content null) and the tool's long result.
TOOL_TURN = [
    *QUESTION,
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "lookup_record_3", "arguments": '{"record_id": "CUST-000123"}'}},
    ]},
    {"role": "tool", "tool_call_id": "call_1", "content": json.dumps(
        {"owner": "Ada Lovelace", "invoices": [{"n": n, "amount_usd": 120 + n, "status": "paid"} for n in range(60)]})},
]


def post(stack, key: str, body: dict):
    import httpx

    return httpx.post(f"{stack.http_url}/v1/chat/completions", json={"model": MODEL, "feature": "agent", **body},
                      headers={"Authorization": f"Bearer {key}"}, timeout=120)


def settled_rows(feature: Feature) -> list[TokenLog]:
    return list(TokenLog.objects.filter(feature=feature).exclude(status=TokenLog.Status.REFUSED).order_by("created_at"))


# --- the case: ten concurrent calls with a 64-tool list against a cost cap ------------------------


def cap(scope: str, dollars: float, alice, key: ApiKey, feature: Feature) -> list[str]:
    """A cost cap of `dollars` on one scope of alice's requests; the tags her requests must carry."""
    limit = int(dollars * 1_000_000)
    if scope == "user":
        Quota.objects.create(user=alice, period="day", max_cost_micro_usd=limit)
    elif scope == "feature":
        Quota.objects.create(feature=feature, period="day", max_cost_micro_usd=limit)
    elif scope == "team":
        team = Team.objects.create(name="agents")
        TeamMembership.objects.create(user=alice, team=team)
        TeamQuota.objects.create(team=team, period="month", max_cost_micro_usd=limit)
    elif scope == "api_key":
        key.max_cost_per_day_micro_usd = limit
        key.save()
    elif scope == "tag":
        TagQuota.objects.create(tag="agents", max_cost_micro_usd=limit)
        return ["agents"]
    elif scope == "provider":
        feature.provider.monthly_limit_micro_usd = limit
        feature.provider.save()
    return []


@pytest.mark.parametrize(("scope", "cap_usd"), [
    ("user", 0.05),  # the case as reported: $1.31 billed against this cap before
    ("user", 0.50), ("team", 0.50), ("api_key", 0.50), ("tag", 0.50), ("feature", 0.50), ("provider", 0.50),
])
def test_ten_concurrent_calls_with_a_64_tool_list_never_bill_past_a_cap(ceiling_stack, alice, tools_feature, scope, cap_usd):
    key, plaintext = do_create_api_key(alice, "agent")
    tags = cap(scope, cap_usd, alice, key, tools_feature)
    body = {"messages": QUESTION, "tools": tools(64), "max_tokens": 1, **({"tags": tags} if tags else {})}

    with ThreadPoolExecutor(10) as pool:
        answers = list(pool.map(lambda _: post(ceiling_stack, plaintext, body), range(10)))

    statuses = [answer.status_code for answer in answers]
    assert set(statuses) <= {200, 429}, [answer.text for answer in answers]
    for refused in (a for a in answers if a.status_code == 429):
        assert "$" in refused.json()["error"]["message"]  # a sentence with the numbers
    rows = settled_rows(tools_feature)  # an answer is sent after its row is settled
    assert len(rows) == statuses.count(200) and all(row.status == TokenLog.Status.OK for row in rows)
    billed = sum(row.cost_micro_usd for row in rows)
    print(f"{scope} cap ${cap_usd}: {len(rows)} of 10 admitted, billed ${billed / 1e6:.4f}")  # for the report (-s)
    assert billed <= cap_usd * 1_000_000, f"billed ${billed / 1e6:.4f} against a ${cap_usd} {scope} cap"
    assert all(row.overshoot_tokens == 0 and row.overshoot_micro_usd == 0 for row in rows)
    if cap_usd >= 0.5:
        assert rows, "a cap that fits a few requests admits them"
        # Every admitted request reached the remote with its whole tool list.
        assert all(len(received["tools"]) == 64 for received in BillingRemote.received)


# --- tool lists of 0, 10 and 200 entries, and tool results ----------------------------------------------


@pytest.mark.parametrize("n_tools", [0, 10, 200])
@pytest.mark.parametrize("messages", [QUESTION, TOOL_TURN], ids=["question", "tool-results"])
def test_whatever_is_sent_is_reserved_before_it_is_billed(ceiling_stack, alice, tools_feature, n_tools, messages):
    key = do_create_api_key(alice, "agent")[1]
    body = {"messages": messages, "max_tokens": 8, **({"tools": tools(n_tools)} if n_tools else {})}

    answer = post(ceiling_stack, key, body)

    assert answer.status_code == 200, answer.text
    row = TokenLog.objects.get(request_id=answer.json()["id"].removeprefix("chatcmpl-"))
    [received] = BillingRemote.received
    assert received["messages"] == [{k: v for k, v in m.items()} for m in messages]  # tool turns passed unchanged
    assert row.prompt_tokens == prompt_tokens_of(received)  # billed what the remote counted
    assert row.prompt_tokens + row.completion_tokens <= row.reserved_tokens
    assert row.cost_micro_usd <= row.reserved_cost_micro_usd
    assert (row.overshoot_tokens, row.overshoot_micro_usd) == (0, 0)


# --- an agent's tool loop, step by step, billed and capped -------------------------------------------------


def run_tool(call) -> str:
    return json.dumps({"record_id": json.loads(call["function"]["arguments"])["record_id"], "status": "paid"})


def test_a_three_step_tool_loop_with_the_official_client_is_billed_step_by_step(ceiling_stack, alice, tools_feature):
    from openai import OpenAI

    BillingRemote.mode = "agent"
    client = OpenAI(base_url=f"{ceiling_stack.http_url}/v1", api_key=do_create_api_key(alice, "agent")[1], max_retries=0)
    messages: list = [{"role": "user", "content": "Are CUST-0 and CUST-1 paid?"}]

    for _ in range(3):
        completion = client.chat.completions.create(model=MODEL, messages=messages, tools=tools(4), max_tokens=32,
                                                    parallel_tool_calls=False, extra_body={"feature": "agent"})
        message = completion.choices[0].message
        if not message.tool_calls:
            break
        messages.append(message.model_dump(exclude_none=True))  # content null beside the calls, as agents send it
        messages += [{"role": "tool", "tool_call_id": call.id, "content": run_tool(call.model_dump())} for call in message.tool_calls]

    assert message.content == "Both records are paid." and [m["role"] for m in messages].count("tool") == 2
    rows = list(TokenLog.objects.filter(feature=tools_feature).order_by("created_at"))
    assert [row.finish_reason for row in rows] == ["tool_calls", "tool_calls", "stop"]
    for row, received in zip(rows, BillingRemote.received, strict=True):
        assert row.prompt_tokens == prompt_tokens_of(received) and row.overshoot_tokens == 0  # tool results counted
        assert row.prompt_tokens + row.completion_tokens <= row.reserved_tokens
    assert rows[0].prompt_tokens < rows[1].prompt_tokens < rows[2].prompt_tokens  # each step carries more
    assert BillingRemote.received[1]["messages"][1]["tool_calls"][0]["id"] == "call_0"
    assert BillingRemote.received[2]["parallel_tool_calls"] is False


def test_a_tool_loop_stops_at_the_cap_with_a_sentence(ceiling_stack, alice, tools_feature):
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_openai import ChatOpenAI

    BillingRemote.mode = "agent"
    key, plaintext = do_create_api_key(alice, "langchain")
    Quota.objects.create(user=alice, period="day", max_requests=2)
    llm = ChatOpenAI(model=MODEL, base_url=f"{ceiling_stack.http_url}/v1", api_key=plaintext, max_tokens=32,
                     max_retries=0, extra_body={"feature": "agent"}).bind_tools([tool(0)["function"], tool(1)["function"]])
    history = [HumanMessage("Are CUST-0 and CUST-1 paid?")]

    for _ in range(2):
        reply = llm.invoke(history)
        history += [reply, *(ToolMessage(run_tool({"function": {"arguments": json.dumps(c["args"])}}), tool_call_id=c["id"])
                             for c in reply.tool_calls)]
    from openai import RateLimitError

    with pytest.raises(RateLimitError) as refused:  # the third step, as LangChain raises it
        llm.invoke(history)

    assert "You have made 2 of your 2 requests for today" in str(refused.value)
    assert TokenLog.objects.filter(feature=tools_feature, status=TokenLog.Status.OK).count() == 2
    assert TokenLog.objects.get(feature=tools_feature, status=TokenLog.Status.REFUSED).refusal_code == "user_requests_per_day"


# --- a remote that counts more than any estimate: the overshoot is recorded once, then covered ----------


def test_a_remote_that_bills_beyond_its_estimate_overshoots_once_and_is_then_reserved_in_full(
    ceiling_stack, alice, tools_feature, remote
):
    BillingRemote.mode = "heavy"
    key = do_create_api_key(alice, "agent")[1]
    body = {"messages": QUESTION, "tools": tools(10), "max_tokens": 4}

    first, second, third = (post(ceiling_stack, key, body) for _ in range(3))

    assert [a.status_code for a in (first, second, third)] == [200, 200, 200]
    rows = [TokenLog.objects.get(request_id=a.json()["id"].removeprefix("chatcmpl-")) for a in (first, second, third)]
    assert rows[0].overshoot_tokens > 0 and rows[0].overshoot_micro_usd > 0
    assert rows[0].cost_micro_usd == rows[0].reserved_cost_micro_usd + rows[0].overshoot_micro_usd  # billed all the same
    assert [(r.overshoot_tokens, r.overshoot_micro_usd) for r in rows[1:]] == [(0, 0), (0, 0)]
    assert rows[1].reserved_tokens >= rows[1].prompt_tokens + rows[1].completion_tokens
    # Alerted once for the provider and day, however often it happens.
    wait_for(lambda: Alert.objects.filter(kind=Alert.Kind.OVERSHOOT).exists(), timeout=10)
    [alert] = Alert.objects.filter(kind=Alert.Kind.OVERSHOOT)
    assert alert.scope == "provider:billing-remote" and alert.spent_micro_usd == rows[0].cost_micro_usd
    # …and counted in /metrics.
    import httpx

    def overshoot_metric() -> str | None:
        text = httpx.get(f"{ceiling_stack.http_url}/metrics", headers={"Authorization": "Bearer test-metrics-token"}).text
        return next((line for line in text.splitlines() if line.startswith('ceiling:overshoot_requests_total{feature="agent"}')), None)

    line = wait_for(overshoot_metric, timeout=10)
    assert line.endswith(" 1.0")


# --- a remote that reports no usage and ignores max_tokens ------------------------------------------------


def test_a_silent_remote_that_ignores_max_tokens_is_cut_off_and_billed_within_its_reservation(
    ceiling_stack, alice, tools_feature
):
    BillingRemote.mode = "silent"
    key = do_create_api_key(alice, "agent")[1]

    answer = post(ceiling_stack, key, {"messages": QUESTION, "tools": tools(10), "max_tokens": 6})

    assert answer.status_code == 200, answer.text
    choice = answer.json()["choices"][0]
    assert choice["finish_reason"] == "length" and choice["message"]["content"] == " w0 w1 w2 w3 w4 w5"
    row = TokenLog.objects.get(request_id=answer.json()["id"].removeprefix("chatcmpl-"))
    assert row.completion_tokens == 6  # at most max_tokens, though the remote said nothing
    assert row.cost_micro_usd <= row.reserved_cost_micro_usd and row.overshoot_tokens == 0


# --- the local engine: exactly 0 ------------------------------------------------------------------------


def test_the_local_engine_never_bills_past_a_reservation(ceiling_stack, alice, chat_feature):
    key = do_create_api_key(alice, "local")[1]

    def ask(n: int):
        import httpx

        return httpx.post(f"{ceiling_stack.http_url}/v1/chat/completions", headers={"Authorization": f"Bearer {key}"},
                          json={"messages": [{"role": "user", "content": f"Count to {n}."}], "max_tokens": 12}, timeout=120)

    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(ask, range(4)))

    assert [a.status_code for a in answers] == [200] * 4
    rows = TokenLog.objects.filter(feature=chat_feature)
    assert rows.count() == 4
    assert all(r.overshoot_tokens == 0 and r.prompt_tokens + r.completion_tokens <= r.reserved_tokens for r in rows)


# --- a Redis that could evict the counters ----------------------------------------------------------------


def test_the_guard_refuses_a_redis_that_may_evict_its_counters(tmp_path):
    from budgets.guard import EvictingRedis, refuse_evicting_redis

    port = processes.free_port()
    server = subprocess.Popen(
        ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--maxmemory", "64mb",
         "--maxmemory-policy", "volatile-lru", "--dir", str(tmp_path)],
        stdout=subprocess.DEVNULL,
    )
    try:
        client = redis.Redis(port=port)
        wait_for(lambda: client.ping(), timeout=10)
        with pytest.raises(EvictingRedis, match="maxmemory-policy volatile-lru.*noeviction"):
            refuse_evicting_redis(client)
        client.config_set("maxmemory-policy", "noeviction")
        refuse_evicting_redis(client)  # now safe: nothing raised
    finally:
        server.terminate()
        server.wait(timeout=10)
