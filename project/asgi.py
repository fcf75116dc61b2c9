"""ASGI entry point: HTTP through Django, websockets through Channels (as in the Channels tutorial)."""

import os

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "project.settings")
django_asgi_app = get_asgi_application()

from channels.auth import AuthMiddlewareStack  # noqa: E402 - needs Django set up first
from channels.routing import ProtocolTypeRouter, URLRouter  # noqa: E402
from channels.security.websocket import AllowedHostsOriginValidator  # noqa: E402

from inference.routing import websocket_urlpatterns  # noqa: E402
from inference.web.tokenizer import load_tokenizer_now  # noqa: E402
from project.bodylimit import BodyLimitMiddleware, limit_daphne_bodies  # noqa: E402
from project.origins import SameOriginValidator  # noqa: E402

# daphne stores a whole request body before the application runs: refuse an over-limit one as it arrives.
limit_daphne_bodies()

application = ProtocolTypeRouter(
    {
        # The body-size limit first, before Django reads any body (project/bodylimit.py).
        "http": BodyLimitMiddleware(django_asgi_app),
        # The Origin's host must be allowed (Channels) and be exactly the address connected to, port
        # included (project/origins.py): cookies reach every port of a host, origins do not.
        "websocket": AllowedHostsOriginValidator(
            SameOriginValidator(AuthMiddlewareStack(URLRouter(websocket_urlpatterns)))
        ),
    }
)

# Before daphne listens: a page that answers can serve a chat at once (inference/web/tokenizer.py).
load_tokenizer_now()
