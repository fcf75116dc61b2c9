from django.apps import AppConfig


class BudgetsConfig(AppConfig):
    name = "budgets"

    def ready(self) -> None:
        from . import refcache
        from .models import Feature, InFlightCap, ModelPrice, Provider, Quota, TagQuota, Team, TeamMembership, TeamQuota

        refcache.connect([Feature, InFlightCap, ModelPrice, Provider, Quota, TagQuota, Team, TeamMembership, TeamQuota])
