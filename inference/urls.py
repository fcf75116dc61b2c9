from django.urls import path

from . import api, openapi, views

urlpatterns = [
    path("chat/", views.chat, name="chat"),
    path("chat/requests/<str:request_id>/", views.request_transcript, name="chat-request"),
    path("v1/chat/completions", api.chat_completions, name="api-chat-completions"),
    path("v1/models", api.list_models, name="api-models"),
    path("v1/openapi.json", openapi.openapi_json, name="api-openapi"),
]
