"""Each feature's default generation settings: staff set them, a request's own values win, and the demo's
chat (greedy with a frequency penalty) answers without looping, through the real stack."""

from __future__ import annotations

import asyncio
import collections
import io
import re

import pytest
from django.contrib.auth.models import User
from django.core.management import call_command
from django.test import Client

from budgets.models import AuditEntry, Feature
from inference.chat.admit import worker_params
from inference.models import Transcript
from inference.web.frames import ChatFrame
from inference.web.params import parse_params
from tests.conftest import session_cookie
from tests.wsclient import chat, chat_frame

pytestmark = pytest.mark.django_db(transaction=True)

# The looping answers among them (the KV cache one repeated its one sentence greedily).
QUESTIONS = (
    "What is a KV cache?",
    "Explain what a GPU does.",
    "What is continuous batching?",
    "How does a budget ceiling protect spending?",
    "Why is the sky blue?",
)


def sentences(text: str) -> list[str]:
    """The answer's sentences (and list lines) of three words or more, compared without case."""
    return [s.strip().lower() for s in re.split(r"(?<=[.!?])\s+|\n+", text) if len(s.split()) >= 3]


def test_the_demo_chat_answers_five_questions_without_repeating_a_sentence(live_stack):
    call_command("seed_demo", "--no-history", stdout=io.StringIO())
    chat_feature = Feature.objects.get(name="chat")
    assert chat_feature.generation_defaults() == {"frequency_penalty": 0.5}
    cookie = session_cookie(User.objects.get(username="alice"))

    async def ask_all() -> list[list[dict]]:
        return await asyncio.gather(*(chat(live_stack, cookie, chat_frame(q, 200)) for q in QUESTIONS))

    for frames in asyncio.run(ask_all()):
        assert frames[-1]["type"] == "done", frames[-1]
        answer = "".join(f["text"] for f in frames if f["type"] == "token")
        repeated = [s for s, n in collections.Counter(sentences(answer)).items() if n > 1]
        assert not repeated, answer
        stored = Transcript.objects.get(log__request_id=frames[0]["request_id"]).params
        assert stored == {"frequency_penalty": 0.5}  # what the worker generated with


def test_a_requests_own_values_win_over_the_features_defaults(chat_feature):
    chat_feature.frequency_penalty = 0.5
    chat_feature.temperature = 0.2
    chat_feature.top_p = 0.9

    plain = ChatFrame("chat", [], 16)
    own = ChatFrame("chat", [], 16, params=parse_params({"temperature": 0, "seed": 7}))

    assert worker_params(chat_feature, plain) == {"frequency_penalty": 0.5, "temperature": 0.2, "top_p": 0.9}
    assert worker_params(chat_feature, own) == {"frequency_penalty": 0.5, "temperature": 0.0, "top_p": 0.9, "seed": 7}


def test_a_json_answer_keeps_plain_decoding_whatever_the_defaults(chat_feature):
    # A penalty on repeated tokens would punish the quotes and braces every JSON object repeats.
    chat_feature.frequency_penalty = 0.5
    shaped = ChatFrame("chat", [], 16, params=parse_params({"response_format": {"type": "json_object"}}))
    assert worker_params(chat_feature, shaped) == {"response_format": {"type": "json_object"}}
    chat_feature.mode = Feature.Mode.EXTRACT
    assert worker_params(chat_feature, ChatFrame("chat", [], 16)) == {}


def test_staff_set_a_features_defaults_on_its_page_audited(chat_feature, staff):
    client = Client()
    client.force_login(staff)
    page = f"/staff/features/{chat_feature.pk}/"
    form = {"name": "chat", "description": "Chat", "enabled": "on", "mode": "chat", "max_input_tokens": 2048,
            "max_output_tokens": 512, "cache_ttl_s": 0, "temperature": 0.2, "top_p": 0.9, "frequency_penalty": 0,
            "presence_penalty": 0}

    client.post(page, form)

    chat_feature.refresh_from_db()
    assert (chat_feature.temperature, chat_feature.top_p) == (0.2, 0.9)
    entry = AuditEntry.objects.get(target="feature chat", field="temperature")
    assert (entry.actor, entry.before, entry.after) == (staff, "0.0", "0.2")

    refused = client.post(page, form | {"temperature": 3})
    assert refused.status_code == 200 and "Ensure this value is less than or equal to 2.0." in refused.content.decode()
    chat_feature.refresh_from_db()
    assert chat_feature.temperature == 0.2
