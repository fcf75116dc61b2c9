from django.apps import AppConfig


class InferenceConfig(AppConfig):
    name = "inference"

    def ready(self) -> None:
        from project import tracing

        # Before Django loads its middleware and before a worker takes a task (project/tracing.py).
        tracing.configure()
        from . import live, revocation  # import models: only once the app registry is ready

        live.connect()
        revocation.connect()
