"""The chat page opens on the feature staff mark as default, else `chat`: never simply the alphabetically
first (a `bench` feature the benchmark left sorted first, and alice's next chat was refused)."""

from __future__ import annotations

import pytest
from django.db import IntegrityError
from django.test import Client

from budgets.models import Feature

pytestmark = pytest.mark.django_db(transaction=True)


def _opens_on(user) -> str | None:
    client = Client()
    client.force_login(user)
    return client.get("/chat/").context["chat_config"]["default_feature"]


def _mark_default(staff, feature: Feature, marked: bool = True):
    client = Client()
    client.force_login(staff)
    form = {"name": feature.name, "description": feature.description, "enabled": "on", "mode": feature.mode,
            "max_input_tokens": feature.max_input_tokens, "max_output_tokens": feature.max_output_tokens,
            "cache_ttl_s": 0, "temperature": 0, "top_p": 1, "frequency_penalty": 0, "presence_penalty": 0}
    return client.post(f"/staff/features/{feature.pk}/", form | ({"is_default": "on"} if marked else {}))


def test_with_no_default_marked_it_opens_on_chat_not_on_the_first_name(alice, chat_feature):
    Feature.objects.create(name="bench", description="manage.py bench")
    Feature.objects.create(name="answers")

    assert _opens_on(alice) == "chat"


def test_without_a_chat_feature_it_opens_on_the_first_one(alice):
    Feature.objects.create(name="summary")
    Feature.objects.create(name="answers")

    assert _opens_on(alice) == "answers"


def test_it_opens_on_the_feature_staff_mark_as_default(alice, staff, chat_feature):
    docs = Feature.objects.create(name="docs", mode=Feature.Mode.DOCS)

    _mark_default(staff, docs)

    docs.refresh_from_db()
    assert docs.is_default
    assert _opens_on(alice) == "docs"
    Feature.objects.filter(pk=docs.pk).update(enabled=False)  # a switched-off default is not offered
    assert _opens_on(alice) == "chat"


def test_only_one_feature_is_the_default(staff, chat_feature):
    docs = Feature.objects.create(name="docs", mode=Feature.Mode.DOCS)
    _mark_default(staff, chat_feature)

    refused = _mark_default(staff, docs)

    assert "chat is the chat page&#x27;s default feature; untick it there first." in refused.content.decode()
    docs.refresh_from_db()
    assert not docs.is_default
    with pytest.raises(IntegrityError):
        Feature.objects.filter(pk=docs.pk).update(is_default=True)
