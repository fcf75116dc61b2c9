from django.contrib.auth import views as auth_views
from django.urls import path

from . import views

urlpatterns = [
    path("login/", auth_views.LoginView.as_view(template_name="accounts/login.html"), name="login"),
    path("logout/", auth_views.LogoutView.as_view(), name="logout"),
    path("keys/", views.api_keys, name="api-keys"),
    path("keys/<int:key_id>/revoke/", views.revoke_api_key, name="api-key-revoke"),
]
