from django.apps import AppConfig


class BudgetsConfig(AppConfig):
    name = "budgets"

    def ready(self) -> None:
        # tasks registers the alert senders the actions queue through (budgets/delivery.py).
        from . import refcache, tasks  # noqa: F401
        from .models import Feature, InFlightCap, ModelPrice, Provider, Quota, TagQuota, Team, TeamMembership, TeamQuota

        refcache.connect([Feature, InFlightCap, ModelPrice, Provider, Quota, TagQuota, Team, TeamMembership, TeamQuota])
