from django.contrib import admin
from django.urls import include, path
from django.views.generic import RedirectView

from inference.metrics import metrics_view

urlpatterns = [
    path("", RedirectView.as_view(url="/chat/", permanent=False)),
    path("accounts/", include("accounts.urls")),
    path("", include("inference.urls")),
    path("", include("budgets.urls")),
    path("manage/v1/", include("control.urls")),
    path("staff/tokens/", include("control.page_urls")),
    path("admin/", admin.site.urls),
    path("metrics", metrics_view, name="metrics"),
]
