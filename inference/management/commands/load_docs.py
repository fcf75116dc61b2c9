"""`manage.py load_docs [--feature docs] [--audience everyone|staff | --team NAME] [FILE ...]`: documents into a docs feature.

Without files it loads Ceiling's own documentation (docs/*.md), the demo corpus that `make run`
loads after seed_demo. Idempotent: a file whose text has not changed is left as it is (no embedding
work, no cache invalidation), so it can run at every start.
"""

from __future__ import annotations

import time
from pathlib import Path

from django.conf import settings
from django.core.management.base import CommandError

from accounts.management.database import DatabaseCommand
from budgets.models import Feature
from inference.actions import do_save_document
from inference.models import Document
from inference.retrieval import DocumentRejected, document_text, model_token_counter

COMMAND_LINE_ACTOR = None


class Command(DatabaseCommand):
    help = "Load Markdown/text files (default: Ceiling's docs/*.md) into a docs feature, chunked and embedded."

    def add_arguments(self, parser) -> None:
        parser.add_argument("files", nargs="*", help="Markdown or text files; none: docs/*.md of this checkout")
        parser.add_argument("--feature", default="docs", help="a feature whose mode is docs (default: docs)")
        parser.add_argument("--audience", default=Document.Audience.EVERYONE, choices=Document.Audience.values)
        parser.add_argument("--team", help="readable by this team's members (and staff) only, instead of --audience")

    def handle(self, *args, files: list[str], feature: str, audience: str, team: str | None = None, **options) -> None:
        if team is not None:
            from budgets.models import Team

            found = Team.objects.filter(name=team).first()
            if found is None:
                raise CommandError(f"There is no team named {team!r} (create_team makes one).")
            audience = Document.team_audience(found.pk)
        target = Feature.objects.filter(name=feature).first()
        if target is None:
            raise CommandError(f"There is no feature named {feature!r} (seed_demo creates 'docs').")
        if target.mode != Feature.Mode.DOCS:
            raise CommandError(f"The feature {feature!r} is in {target.mode} mode; documents serve a feature in docs mode.")
        paths = [Path(f) for f in files] or sorted((Path(settings.BASE_DIR) / "docs").glob("*.md"))
        if not paths:
            raise CommandError("No files to load: name some, or run it in a checkout with docs/*.md.")
        count_tokens = model_token_counter()
        changed = 0
        started = time.monotonic()
        for path in paths:
            if not path.is_file():
                raise CommandError(f"{path} is not a file.")
            try:
                text = document_text(path.name, path.read_bytes())
            except DocumentRejected as exc:
                raise CommandError(str(exc)) from exc
            document, was_changed = do_save_document(COMMAND_LINE_ACTOR, target, path.name, text, audience, count_tokens=count_tokens)
            changed += was_changed
            if was_changed:
                self.stdout.write(f"{path.name}: {document.chunks.count()} chunks")
        total = Document.objects.filter(feature=target).count()
        self.stdout.write(f"feature {feature!r}: {total} documents, {changed} loaded or changed now "
                          f"({time.monotonic() - started:.1f} s), the rest unchanged")
