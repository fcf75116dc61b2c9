"""`make run`: everything Ceiling needs on one machine, stopped together with Ctrl-C."""

from __future__ import annotations

import signal
import subprocess
import time

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError
from django.db import DatabaseError

from inference.variants import VARIANTS, default_variant, variants_in_use, worker_queues
from project import stack


class Command(BaseCommand):
    help = "Start Redis (if needed), daphne and one Celery inference worker per weight variant in use; Ctrl-C stops them all."

    def add_arguments(self, parser) -> None:
        parser.add_argument("--host", default="127.0.0.1")
        parser.add_argument("--port", type=int, default=8000)
        parser.add_argument("--concurrency", type=int, default=32, help="chats one worker streams at once")
        parser.add_argument(
            "--variants", default="",
            help="the weight variants to start a worker for, comma-separated (none, int8, q4, bf16); default: "
                 "CEILING_QUANTIZATION and every variant an enabled feature is switched to, one worker each",
        )

    def handle(self, *args, host: str, port: int, concurrency: int, variants: str, **options) -> None:
        only = [v.strip() for v in variants.split(",") if v.strip()]
        if set(only) - set(VARIANTS):
            raise CommandError(f"--variants: each must be one of {', '.join(VARIANTS)}")
        if concurrency < 1:
            raise CommandError("--concurrency must be at least 1")
        if stack.port_answers(host, port):
            raise CommandError(f"Something already listens on {host}:{port}; stop it or pass --port.")
        processes: list[subprocess.Popen] = []
        try:
            redis_url = self.ensure_redis(processes)
            self.prepare_model()
            self.adopt_shipped_weights()
            env = stack.child_env(REDIS_URL=redis_url)
            for variant in self.variants(only):
                # One worker per weight variant: two engines in one process slow each other ~1.6×.
                self.stdout.write(f"Starting the Celery inference worker for {variant} weights (loads the model)…")
                processes.append(subprocess.Popen(
                    stack.worker_argv(concurrency, f"inference-{variant}@%h", queues=worker_queues([variant])),
                    env=env | {"CEILING_WORKER_VARIANTS": variant},
                ))
            self.stdout.write(f"Starting daphne on {host}:{port}…")
            processes.append(subprocess.Popen(stack.daphne_argv(host, port), env=env))
            stack.wait_until(lambda: stack.port_answers(host, port), timeout=60, what="daphne")
            self.stdout.write(self.style.SUCCESS(f"\nCeiling is running: http://{host}:{port}/  (Ctrl-C stops it)\n"))
            self.wait_for_exit(processes)
        finally:
            self.stdout.write("Stopping…")
            stack.stop_all(processes)

    def variants(self, only: list[str]) -> list[str]:
        if only:
            return list(dict.fromkeys(only))
        try:
            return variants_in_use()
        except DatabaseError:  # not migrated yet: the default variant alone
            return [default_variant()]

    def ensure_redis(self, processes: list[subprocess.Popen]) -> str:
        if stack.redis_answers(settings.REDIS_URL):
            self.stdout.write(f"Using the Redis at {settings.REDIS_URL}")
            return settings.REDIS_URL
        self.stdout.write(f"No Redis answers at {settings.REDIS_URL}; starting a private one under var/")
        process, url = stack.start_private_redis(settings.VAR_DIR)
        processes.append(process)
        return url

    def prepare_model(self) -> None:
        from inference.engines import model_dir

        folder = model_dir(progress=self.stdout.write)
        self.stdout.write(f"Model files: {folder}")

    def adopt_shipped_weights(self) -> None:
        """The demo features on the q4 weights the gate's shipped verdict approves, before any worker
        starts (so the q4 worker is among them), or back in full precision where q4 cannot run here."""
        from inference.engine.config import default_device
        from inference.shipped import adopt_shipped_verdict, q4_problem

        problem = q4_problem(settings.CEILING_DEVICE or default_device())
        try:
            adopt_shipped_verdict(problem, say=self.stdout.write)
        except DatabaseError as exc:  # not migrated: the features do not exist yet
            self.stdout.write(f"Weights not chosen (the database is not ready: {exc})")

    def wait_for_exit(self, processes: list[subprocess.Popen]) -> None:
        stopping = []
        signal.signal(signal.SIGTERM, lambda *_: stopping.append(True))
        signal.signal(signal.SIGINT, signal.default_int_handler)  # even if our parent ignored it
        try:
            while not stopping:
                for process in processes:
                    if process.poll() is not None:
                        raise CommandError(f"{' '.join(process.args[:4])}… exited with code {process.returncode}")
                time.sleep(0.5)
        except KeyboardInterrupt:
            pass
