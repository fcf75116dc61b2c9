from django.contrib import admin
from django.contrib.staticfiles.urls import staticfiles_urlpatterns
from django.urls import include, path
from django.views.generic import RedirectView

urlpatterns = [
    path("", RedirectView.as_view(url="/chat/", permanent=False)),
    path("accounts/", include("accounts.urls")),
    path("", include("inference.urls")),
    path("admin/", admin.site.urls),
]
# Daphne serves the few static files itself; at scale, put them behind the proxy (collectstatic).
urlpatterns += staticfiles_urlpatterns()
