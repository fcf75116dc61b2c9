from django.urls import path

from . import pages

# Mounted at /staff/tokens/ (project/urls.py), beside the other staff pages.
urlpatterns = [
    path("", pages.tokens, name="staff-tokens"),
]
