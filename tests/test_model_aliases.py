"""Staff give a feature its model aliases on the feature page (#20): unique across features, audited."""

from __future__ import annotations

import pytest
from django.conf import settings
from django.test import Client
from django.urls import reverse

from budgets.models import AuditEntry, Feature
from inference.models import ModelAlias

pytestmark = pytest.mark.django_db


@pytest.fixture
def staff_client(staff) -> Client:
    client = Client()
    client.force_login(staff)
    return client


def save_aliases(client: Client, feature: Feature, text: str):
    return client.post(reverse("staff-feature", args=[feature.pk]), {"form": "aliases", "aliases": text}, follow=True)


def aliases_of(feature: Feature) -> list[str]:
    return list(feature.model_aliases.values_list("name", flat=True))


def test_staff_set_replace_and_clear_a_features_aliases(staff_client, staff, chat_feature):
    page = save_aliases(staff_client, chat_feature, "support-bot, gpt-4o-mini  support-bot")
    assert page.status_code == 200 and aliases_of(chat_feature) == ["gpt-4o-mini", "support-bot"]
    assert 'value="gpt-4o-mini, support-bot"' in page.content.decode()
    entry = AuditEntry.objects.get()
    assert (entry.actor, entry.target, entry.field, entry.before, entry.after) == (
        staff, "feature chat", "model_aliases", "none", "gpt-4o-mini, support-bot")

    save_aliases(staff_client, chat_feature, "support-bot, acme/helper:v2")
    assert aliases_of(chat_feature) == ["acme/helper:v2", "support-bot"]
    save_aliases(staff_client, chat_feature, "acme/helper:v2, support-bot")  # the same set: nothing to record
    save_aliases(staff_client, chat_feature, "")
    assert aliases_of(chat_feature) == [] and AuditEntry.objects.count() == 3


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("support bot!", "'bot!' is not a model name"),
        (settings.CEILING_MODEL_NAME, "the served model's own name"),
        ("taken-bot", "'taken-bot' already routes to the feature 'other'"),
        (", ".join(f"a{i}" for i in range(21)), "21 aliases is too many"),
    ],
)
def test_a_bad_or_taken_alias_is_refused_and_nothing_changes(staff_client, chat_feature, text, words):
    ModelAlias.objects.create(name="taken-bot", feature=Feature.objects.create(name="other"))
    ModelAlias.objects.create(name="mine", feature=chat_feature)

    page = save_aliases(staff_client, chat_feature, text)

    assert words in page.content.decode().replace("&#x27;", "'")
    assert aliases_of(chat_feature) == ["mine"] and not AuditEntry.objects.exists()
