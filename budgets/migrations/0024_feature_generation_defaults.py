"""Each feature's generation defaults; the demo's features (chat, docs) get seed_demo's frequency penalty,
as a fresh database's do, so an upgraded demo stops looping too."""

import django.core.validators
from django.db import migrations, models

DEMO_FEATURES = ("chat", "docs")
DEMO_FREQUENCY_PENALTY = 0.5  # budgets/management/commands/seed_demo.py, as of this migration


def demo_defaults(apps, schema_editor):
    Feature = apps.get_model("budgets", "Feature")
    Feature.objects.filter(name__in=DEMO_FEATURES).update(frequency_penalty=DEMO_FREQUENCY_PENALTY)


class Migration(migrations.Migration):

    dependencies = [
        ('budgets', '0023_feature_quantization_pinned'),
    ]

    operations = [
        migrations.AddField(
            model_name='feature',
            name='frequency_penalty',
            field=models.FloatField(default=0.0, help_text='lowers a token by this much for each time the answer already used it (0.5 stops the demo model looping)', validators=[django.core.validators.MinValueValidator(-2.0), django.core.validators.MaxValueValidator(2.0)]),
        ),
        migrations.AddField(
            model_name='feature',
            name='presence_penalty',
            field=models.FloatField(default=0.0, help_text='lowers a token by this much once the answer has used it', validators=[django.core.validators.MinValueValidator(-2.0), django.core.validators.MaxValueValidator(2.0)]),
        ),
        migrations.AddField(
            model_name='feature',
            name='temperature',
            field=models.FloatField(default=0.0, help_text='0 decodes greedily (deterministic, cacheable); above 0 samples', validators=[django.core.validators.MinValueValidator(0.0), django.core.validators.MaxValueValidator(2.0)]),
        ),
        migrations.AddField(
            model_name='feature',
            name='top_p',
            field=models.FloatField(default=1.0, help_text='nucleus sampling: the smallest set of likely tokens whose probability reaches this (1 = all)', validators=[django.core.validators.MinValueValidator(0.01), django.core.validators.MaxValueValidator(1.0)]),
        ),
        migrations.RunPython(demo_defaults, migrations.RunPython.noop),
    ]
