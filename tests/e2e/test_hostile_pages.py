"""Markup in model output, feature names and user names is shown as text on every page, under a CSP
that allows no inline script, and no page breaks that policy (Plotly still draws).

The hostile feature and user are written straight to the database, past the forms' validation, as
the worst case; the hostile answer is seeded into the exact answer cache, so the chat page receives
it from the real stack exactly as a model's answer.
"""

from __future__ import annotations

import pytest
from django.conf import settings
from django.utils import timezone

from budgets.models import Feature, TokenLog
from inference.models import BatchJob
from inference.web import caches
from inference.web.tokenizer import model_name
from tests.e2e.test_chat_page import log_in
from tests.test_access_control import routes, rule_of

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]

PAYLOAD = '<img src=x onerror="window.__xss=1"><script>window.__xss=1</script><b>bold</b>'
INJECTED = "img[src='x'], script:not([src]):not([type='application/json']), b:has-text('bold')"
WATCH_CSP = "window.__csp = []; document.addEventListener('securitypolicyviolation', e => window.__csp.push(e.violatedDirective + ' ' + e.blockedURI));"


@pytest.fixture
def hostile(alice, staff, chat_feature):
    from django.contrib.auth.models import User

    from budgets.actions import do_create_team
    from budgets.models import AlertWebhook, Provider, TeamQuota

    feature = Feature.objects.create(name=f"f{PAYLOAD}"[:64], description=PAYLOAD)
    user = User.objects.create_user(f"u{PAYLOAD}"[:150], password="hostile-password-1")
    for who, what in [(user, feature), (alice, chat_feature)]:
        TokenLog.objects.create(
            request_id=f"seed-{who.pk}", user=who, feature=what, model="m", status=TokenLog.Status.OK,
            prompt_tokens=12, completion_tokens=3, created_at=timezone.now(),
        )
    provider = Provider.objects.create(name=f"p{PAYLOAD}"[:64])
    job = BatchJob.objects.create(feature=feature, user=user, total=0)
    webhook = AlertWebhook.objects.create(provider=provider, url=f"https://hooks.example/{PAYLOAD}"[:500], secret="s" * 32)
    team, _ = do_create_team(None, f"t{PAYLOAD}"[:64], [user])
    TeamQuota.objects.create(team=team, period="month", max_requests=100)
    return {"user_id": user.pk, "feature_id": feature.pk, "provider_id": provider.pk, "job_id": job.pk,
            "webhook_id": webhook.pk, "team_id": team.pk, "request_id": f"seed-{user.pk}"}


def seed_cached_answer(alice, feature, prompt: str, max_tokens: int) -> None:
    feature.cache_ttl_s = 600
    feature.max_output_tokens = max_tokens
    feature.save(update_fields=["cache_ttl_s", "max_output_tokens"])
    key = caches.cache_key(feature, alice, model_name(feature), max_tokens, [{"role": "user", "content": prompt}])
    caches.store(feature, key, text=f"Here: {PAYLOAD}", completion_tokens=9, cost_micro_usd=1, request_id="seed-answer")


def assert_shown_as_text(page, url: str) -> None:
    assert page.locator(INJECTED).count() == 0, url
    assert page.evaluate("window.__xss") is None, url
    assert page.evaluate("window.__csp") == [], url


def test_a_model_answer_with_markup_is_text_on_the_chat_page(live_stack, strict_page, alice, chat_feature):
    page = strict_page
    seed_cached_answer(alice, chat_feature, "Show me markup.", 16)
    page.add_init_script(WATCH_CSP)
    log_in(page, live_stack, "alice", "alice-password-1")
    page.locator("#status", has_text="Connected").wait_for()
    page.fill("#max-tokens", "16")
    page.fill("#prompt", "Show me markup.")
    page.click("#send")
    page.locator("li.assistant .meta").wait_for(timeout=60_000)
    assert PAYLOAD in page.locator("li.assistant").inner_text()
    assert_shown_as_text(page, "/chat/")


def test_every_staff_page_shows_hostile_names_as_text_and_keeps_the_policy(live_stack, strict_page, staff, hostile):
    page = strict_page
    page.add_init_script(WATCH_CSP)
    log_in(page, live_stack, "staff", "staff-password-1", landing="/staff/")
    pages = [
        "/" + route.replace("<int:", "{").replace("<str:", "{").replace(">", "}").format(**hostile)
        for route in routes()
        if rule_of(route) == "staff"
    ]
    for url in [*pages, "/usage/", "/accounts/keys/", "/chat/"]:
        response = page.goto(f"{live_stack.http_url}{url}")
        assert response.status == 200, url
        assert "script-src 'self'" in response.headers["content-security-policy"], url
        page.wait_for_load_state("networkidle")
        assert_shown_as_text(page, url)
    for url, shown in [("/staff/users/", "u<img"), ("/staff/features/", "f<img"), ("/staff/logs/", "u<img"),
                       ("/staff/teams/", "t<img")]:
        page.goto(f"{live_stack.http_url}{url}")
        assert shown in page.locator("main").inner_text(), url
    # Plotly draws under the policy (no 'unsafe-eval'): the charts page has real SVG plots.
    page.goto(f"{live_stack.http_url}/staff/charts/")
    page.wait_for_selector(".js-plotly-plot .main-svg", timeout=15_000)
    assert_shown_as_text(page, "/staff/charts/")
    assert settings.DEBUG is False
