"""Provider API keys kept by Ceiling, encrypted (budgets/vault.py); env variables only as CEILING_PROVIDER_KEY_*.

The data step keeps existing providers working where it can. A provider whose api_key_env names a
variable outside the prefix:
- whose value this process can see, and CEILING_SECRETS_KEY is set: the value is stored encrypted
  on the provider and the variable's name cleared (the provider works as before, from any worker);
- a server setting (SECRET_KEY, DATABASE_URL, ...): its value is never copied; the name stays, so
  the worker refuses the provider with a sentence until staff enter the key on its page;
- otherwise: the name stays and the worker refuses it with the same sentence (rename the variable
  to CEILING_PROVIDER_KEY_<NAME> on every worker, or enter the key on the page).
Each provider touched is printed with what was done.
"""

import os

from django.db import migrations, models

PREFIX = "CEILING_PROVIDER_KEY_"
# The environment of Ceiling's own settings: such a value is the server's, never a provider's key.
SERVER_SETTINGS = {"SECRET_KEY", "DATABASE_URL", "REDIS_URL", "EMAIL_HOST_PASSWORD", "EMAIL_HOST_USER", "EMAIL_URL"}


def is_server_setting(name: str) -> bool:
    return name in SERVER_SETTINGS or name.startswith(("CEILING_", "DJANGO_", "CELERY_", "AWS_", "PG"))


def move_keys(apps, schema_editor) -> None:
    from budgets import vault

    Provider = apps.get_model("budgets", "Provider")
    for provider in Provider.objects.exclude(api_key_env="").exclude(api_key_env__startswith=PREFIX):
        name = provider.api_key_env
        value = os.environ.get(name, "")
        if is_server_setting(name):
            done = f"names the server setting {name}: not copied; enter the provider's key on its page"
        elif value and vault.configured():
            provider.api_key_encrypted = vault.seal(value)
            provider.api_key_env = ""
            provider.save(update_fields=["api_key_encrypted", "api_key_env"])
            done = f"the value of {name} is now stored encrypted on the provider"
        elif value:
            done = f"{name} is set but CEILING_SECRETS_KEY is not: set it and enter the key on the page, or rename {name} to {PREFIX}{name}"
        else:
            done = f"{name} is not set here: rename it to {PREFIX}{name} on every worker, or enter the key on the page"
        print(f"  provider {provider.name!r}: {done}")


class Migration(migrations.Migration):

    dependencies = [
        ('budgets', '0020_tokenlog_tags_index_on_tagged_rows'),
    ]

    operations = [
        migrations.AddField(
            model_name='provider',
            name='api_key_encrypted',
            field=models.TextField(blank=True, editable=False),
        ),
        migrations.AlterField(
            model_name='provider',
            name='api_key_env',
            field=models.CharField(blank=True, help_text="name of the environment variable holding the server's API key (starting CEILING_PROVIDER_KEY_)", max_length=100),
        ),
        migrations.RunPython(move_keys, migrations.RunPython.noop),
    ]
