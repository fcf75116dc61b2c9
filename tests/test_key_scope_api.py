"""What /v1 answers a governed key, over real HTTP with the official `openai` client: a feature outside
the key's scope is a 403 however it is named (routing or the body), /v1/models lists only what the key
may use, an expired key is a 401 that says when, a rotated key's old and new texts both work for the
grace period, and each use records the client's address."""

from __future__ import annotations

from datetime import UTC, timedelta

import openai
import pytest
from django.utils import timezone
from openai import OpenAI

from accounts.actions import do_create_api_key
from accounts.models import ApiKey
from budgets.actions import do_rotate_api_key
from budgets.models import Feature, TokenLog
from inference.models import ModelAlias

pytestmark = pytest.mark.django_db(transaction=True)

MODEL = "SmolLM2-135M-Instruct"
EMBEDDING_MODEL = "all-MiniLM-L6-v2"
HELLO = [{"role": "user", "content": "Say hello."}]


@pytest.fixture(autouse=True)
def clean_counters(redis_db):
    for key in redis_db.scan_iter(match="ceiling:c:*"):
        redis_db.delete(key)


@pytest.fixture
def summary(chat_feature):
    feature = Feature.objects.create(name="summary")
    ModelAlias.objects.create(name="summary-bot", feature=feature)
    return feature


def scoped_key(user, *features: str) -> tuple[ApiKey, str]:
    key, plaintext = do_create_api_key(user, "scoped")
    key.allowed_features = list(features)
    key.save(update_fields=["allowed_features"])
    return key, plaintext


def client_for(live_stack, key: str) -> OpenAI:
    return OpenAI(base_url=f"{live_stack.http_url}/v1", api_key=key, max_retries=0, timeout=120)


def test_a_feature_outside_the_keys_scope_is_refused_however_it_is_named(live_stack, alice, summary):
    _, plaintext = scoped_key(alice, "summary")
    client = client_for(live_stack, plaintext)

    asked = [
        {"model": MODEL},  # routed to chat
        {"model": "summary-bot", "extra_body": {"feature": "chat"}},  # the body's feature wins over routing
    ]
    for how in asked:
        with pytest.raises(openai.PermissionDeniedError) as refused:
            client.chat.completions.create(messages=HELLO, max_tokens=4, **how)
        error = refused.value
        assert error.status_code == 403 and error.code == "feature_not_allowed" and error.type == "permission_error"
        assert "'scoped'" in error.message and "'chat'" in error.message and "may use summary" in error.message
        assert error.response.headers["x-should-retry"] == "false"
    with pytest.raises(openai.PermissionDeniedError):
        client.embeddings.create(model=EMBEDDING_MODEL, input="hello")  # on the default feature, chat
    assert not TokenLog.objects.exists()  # refused before the guard, as every other pre-guard 4xx


def test_a_key_answers_inside_its_scope_and_the_body_cannot_leave_it(live_stack, alice, summary):
    _, plaintext = scoped_key(alice, "chat")
    client = client_for(live_stack, plaintext)

    completion = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=4)
    assert completion.choices[0].message.content is not None

    with pytest.raises(openai.PermissionDeniedError, match="'summary'"):
        client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=4, extra_body={"feature": "summary"})
    with pytest.raises(openai.PermissionDeniedError, match="'summary'"):
        client.completions.create(model="summary-bot", prompt="Say hello.", max_tokens=4)
    assert TokenLog.objects.count() == 1


def test_the_models_list_shows_only_what_the_key_may_use(live_stack, alice, summary):
    _, everything = do_create_api_key(alice, "all")
    _, summary_only = scoped_key(alice, "summary")

    assert [model.id for model in client_for(live_stack, everything).models.list()] == [MODEL, "summary-bot", EMBEDDING_MODEL]
    scoped = client_for(live_stack, summary_only)
    assert [(model.id, model.feature) for model in scoped.models.list()] == [("summary-bot", "summary")]
    with pytest.raises(openai.NotFoundError):
        scoped.models.retrieve(MODEL)


def test_an_expired_key_is_refused_saying_when(live_stack, alice, chat_feature):
    expired_at = timezone.now() - timedelta(minutes=5)
    key, plaintext = do_create_api_key(alice, "trial", expires_at=expired_at)

    with pytest.raises(openai.AuthenticationError) as refused:
        client_for(live_stack, plaintext).models.list()

    assert refused.value.status_code == 401 and refused.value.code == "invalid_api_key"
    assert f"'trial' ({key.prefix}…) expired at {expired_at.astimezone(UTC):%Y-%m-%d %H:%M} UTC" in refused.value.message
    key.refresh_from_db()
    assert key.last_used_at is None  # a refused key was not used


def test_both_texts_of_a_rotated_key_work_for_the_grace_period_and_then_only_the_new_one(live_stack, alice, chat_feature):
    old, old_text = do_create_api_key(alice, "nightly")
    new, new_text = do_rotate_api_key(alice, old.pk, timedelta(hours=1))

    for text in (old_text, new_text):
        assert [model.id for model in client_for(live_stack, text).models.list()][0] == MODEL
    new.refresh_from_db()
    assert new.last_used_ip == "127.0.0.1" and new.last_used_at is not None

    ApiKey.objects.filter(pk=old.pk).update(expires_at=timezone.now())  # the grace period is over
    with pytest.raises(openai.AuthenticationError, match="it was rotated: use its successor"):
        client_for(live_stack, old_text).models.list()
    assert client_for(live_stack, new_text).models.list().data


def test_x_ceiling_team_chooses_which_of_the_users_teams_pays(live_stack, alice, chat_feature):
    from budgets.actions import do_create_team
    from budgets.models import Period, TeamQuota

    support, _ = do_create_team(None, "Support", [alice])
    research, _ = do_create_team(None, "Research", [alice])
    TeamQuota.objects.create(team=research, period=Period.DAY, max_requests=0)
    key, plaintext = do_create_api_key(alice, "teams")
    client = client_for(live_stack, plaintext)

    with pytest.raises(openai.PermissionDeniedError) as outsider:
        client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=4,
                                       extra_headers={"X-Ceiling-Team": "Sales"})
    assert outsider.value.body["code"] == "team_not_member"
    assert "not in a team called 'Sales'" in outsider.value.body["message"]
    assert "your teams: 'Support', 'Research'" in outsider.value.body["message"]

    with pytest.raises(openai.RateLimitError) as capped:
        client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=4,
                                       extra_headers={"X-Ceiling-Team": "Research"})
    assert capped.value.body["code"] == "team_requests_per_day" and "'Research'" in capped.value.body["message"]

    key.team_name = "Research"  # the key names the team now: the same cap, without the header
    key.save(update_fields=["team_name"])
    with pytest.raises(openai.RateLimitError):
        client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=4)
    # The header overrides the key's team: Support has no cap, so the answer comes.
    answer = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=4,
                                            extra_headers={"X-Ceiling-Team": "Support"})
    assert answer.choices[0].message.content
    assert TokenLog.objects.get(request_id=answer.id.removeprefix("chatcmpl-")).team == support
