from django.urls import path

from . import api, openapi, views
from .console import batches, features

urlpatterns = [
    path("chat/", views.chat, name="chat"),
    path("chat/requests/<str:request_id>/", views.request_transcript, name="chat-request"),
    path("v1/chat/completions", api.chat_completions, name="api-chat-completions"),
    path("v1/models", api.list_models, name="api-models"),
    path("v1/openapi.json", openapi.openapi_json, name="api-openapi"),
    # The staff console's pages that manage inference things (the rest of /staff/ is budgets/urls.py).
    path("staff/features/<int:feature_id>/", features.feature_detail, name="staff-feature"),
    path("staff/batches/", batches.batches, name="staff-batches"),
    path("staff/batches/<int:job_id>/", batches.batch_detail, name="staff-batch"),
    path("staff/batches/<int:job_id>/progress", batches.batch_progress, name="staff-batch-progress"),
]
