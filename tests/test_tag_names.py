"""A tag has one spelling: trimmed, lower-case, one charset. "support\n" and "Support" are the tag
"support", so no spelling escapes the tag's cap or hides from its filter."""

from __future__ import annotations

import pytest
from django.core.management import call_command
from django.test import Client

from budgets.models import TagQuota
from budgets.tags import is_tag, normalise_tag
from inference.web.frames import FrameError, parse_chat

pytestmark = pytest.mark.django_db(transaction=True)


def chat(tags) -> dict:
    return {"type": "chat", "messages": [{"role": "user", "content": "hi"}], "tags": tags}


def test_every_spelling_of_a_tag_is_the_one_tag():
    # Before: "support\n" passed TAG_RE (its "$" matches before a final newline) as a tag of its own.
    assert parse_chat(chat(["support\n", " Support", "SUPPORT", "support", "Beta"])).tags == ("support", "beta")


@pytest.mark.parametrize("tag", ["sup port", "support\nbeta", "süpport", "-support", "", "x" * 33, "a,b"])
def test_names_outside_the_charset_are_refused(tag):
    with pytest.raises(FrameError) as refused:
        parse_chat(chat([tag]))
    assert refused.value.code == "bad_tags"


def test_the_rule_is_whole_names():
    assert is_tag("support") and not is_tag("support\n") and normalise_tag("\tOps:EU \n") == "ops:eu"


def test_set_quota_and_the_staff_form_store_the_normal_spelling(staff):
    call_command("set_quota", "--tag", " Support\n", "--period", "month", "--cost-usd", "5")
    assert list(TagQuota.objects.values_list("tag", flat=True)) == ["support"]
    client = Client()
    client.force_login(staff)
    client.post("/staff/tags/", {"tag": "BETA", "max_cost_usd": "3"})
    assert sorted(TagQuota.objects.values_list("tag", flat=True)) == ["beta", "support"]
