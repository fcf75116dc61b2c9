from django.urls import path

from .views import batches, config, costmodel, logs, overview

urlpatterns = [
    path("staff/", overview.overview, name="staff-overview"),
    path("staff/charts/", overview.charts_page, name="staff-charts"),
    path("staff/costs/", logs.cost_per_user, name="staff-costs"),
    path("staff/costmodel/", costmodel.cost_model, name="staff-costmodel"),
    path("staff/logs/", logs.token_logs, name="staff-logs"),
    path("staff/users/", config.users, name="staff-users"),
    path("staff/users/<int:user_id>/", config.user_detail, name="staff-user"),
    path("staff/defaults/", config.defaults, name="staff-defaults"),
    path("staff/features/", config.features, name="staff-features"),
    path("staff/features/<int:feature_id>/", config.feature_detail, name="staff-feature"),
    path("staff/providers/", config.providers, name="staff-providers"),
    path("staff/providers/<int:provider_id>/", config.provider_detail, name="staff-provider"),
    path("staff/audit/", config.audit, name="staff-audit"),
    path("staff/batches/", batches.batches, name="staff-batches"),
    path("staff/batches/<int:job_id>/", batches.batch_detail, name="staff-batch"),
    path("staff/batches/<int:job_id>/progress", batches.batch_progress, name="staff-batch-progress"),
    path("usage/", logs.my_usage, name="my-usage"),
]
