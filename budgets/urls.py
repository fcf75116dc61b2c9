from django.urls import path

from .views import alerts, config, costmodel, keys, logs, overview, teams

urlpatterns = [
    path("staff/", overview.overview, name="staff-overview"),
    path("staff/charts/", overview.charts_page, name="staff-charts"),
    path("staff/costs/", logs.cost_per_user, name="staff-costs"),
    path("staff/costmodel/", costmodel.cost_model, name="staff-costmodel"),
    path("staff/logs/", logs.token_logs, name="staff-logs"),
    path("staff/logs/<str:request_id>/", logs.request_detail, name="staff-request"),
    path("staff/users/", config.users, name="staff-users"),
    path("staff/users/<int:user_id>/", config.user_detail, name="staff-user"),
    path("staff/teams/", teams.teams, name="staff-teams"),
    path("staff/teams/<int:team_id>/", teams.team_detail, name="staff-team"),
    path("staff/teams/<int:team_id>/delete/", teams.team_delete, name="staff-team-delete"),
    path("staff/tags/", teams.tags, name="staff-tags"),
    path("staff/defaults/", config.defaults, name="staff-defaults"),
    path("staff/features/", config.features, name="staff-features"),
    path("staff/providers/", config.providers, name="staff-providers"),
    path("staff/providers/<int:provider_id>/", config.provider_detail, name="staff-provider"),
    path("staff/audit/", config.audit, name="staff-audit"),
    path("staff/alerts/", alerts.alerts, name="staff-alerts"),
    path("staff/alerts/webhooks/<int:webhook_id>/", alerts.webhook_detail, name="staff-webhook"),
    path("usage/", logs.my_usage, name="my-usage"),
    path("usage/keys/<int:key_id>/caps/", keys.key_caps, name="api-key-caps"),
    path("usage/keys/<int:key_id>/rotate/", keys.rotate_key, name="api-key-rotate"),
]
