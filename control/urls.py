from django.urls import path

from . import views

# Mounted at /manage/v1/ (project/urls.py), never under /v1/: the OpenAI-compatible API owns that.
urlpatterns = [
    path("openapi.json", views.openapi_json, name="manage-openapi"),
    path("keys", views.keys, name="manage-keys"),
    path("keys/<int:key_id>", views.key_detail, name="manage-key"),
    path("keys/<int:key_id>/revoke", views.key_revoke, name="manage-key-revoke"),
    path("keys/<int:key_id>/rotate", views.key_rotate, name="manage-key-rotate"),
    path("keys/<int:key_id>/caps", views.key_caps, name="manage-key-caps"),
    path("quotas", views.quotas, name="manage-quotas"),
    path("in-flight", views.in_flight, name="manage-in-flight"),
    path("features", views.features, name="manage-features"),
    path("features/<str:name>", views.feature_detail, name="manage-feature"),
    path("providers", views.providers, name="manage-providers"),
    path("usage", views.usage, name="manage-usage"),
    path("<path:rest>", views.unknown),
]
