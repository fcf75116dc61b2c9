from django.apps import AppConfig


class InferenceConfig(AppConfig):
    name = "inference"

    def ready(self) -> None:
        from . import live, revocation  # import models: only once the app registry is ready

        live.connect()
        revocation.connect()
