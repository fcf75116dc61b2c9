from django.apps import AppConfig


class InferenceConfig(AppConfig):
    name = "inference"
