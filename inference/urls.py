from django.urls import path, re_path
from django.views.decorators.csrf import csrf_exempt

from . import api, health, openapi, views
from .console import batches, features

urlpatterns = [
    path("chat/", views.chat, name="chat"),
    path("healthz", health.healthz, name="healthz"),
    path("readyz", health.readyz, name="readyz"),
    path("chat/requests/<str:request_id>/", views.request_transcript, name="chat-request"),
    path("v1/chat/completions", api.chat_completions, name="api-chat-completions"),
    path("v1/completions", api.completions, name="api-completions"),
    path("v1/embeddings", api.embeddings, name="api-embeddings"),
    path("v1/models", api.list_models, name="api-models"),
    path("v1/models/<path:model>", api.retrieve_model, name="api-model"),
    path("v1/openapi.json", csrf_exempt(api.with_request_id(openapi.openapi_json)), name="api-openapi"),
    # Last of /v1: any other path is OpenAI's JSON 404, never Django's HTML page.
    re_path(r"^v1(?:/(?P<rest>.*))?$", api.not_found, name="api-not-found"),
    # The staff console's pages that manage inference things (the rest of /staff/ is budgets/urls.py).
    path("staff/features/<int:feature_id>/", features.feature_detail, name="staff-feature"),
    path("staff/batches/", batches.batches, name="staff-batches"),
    path("staff/batches/<int:job_id>/", batches.batch_detail, name="staff-batch"),
    path("staff/batches/<int:job_id>/progress", batches.batch_progress, name="staff-batch-progress"),
]
