"""`make run`: everything Ceiling needs on one machine, stopped together with Ctrl-C.

The order is what makes the first chat fast: the demo features' weights are chosen (the shipped
verdict, inference/shipped.py), then each worker is started and waited for until it serves at full
speed (model loaded, kernels built, decode steps compiled; it publishes its stats only then), one at
a time so that no load's measurements nor compile share the cores with another, and only then does
daphne answer the page.
"""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

import redis
from django.conf import settings
from django.core.management.base import BaseCommand, CommandError
from django.db import DatabaseError

from inference.bus.stats import STATS_KEY_PREFIX
from inference.variants import VARIANTS, default_variant, feature_variants, variants_in_use, worker_queues
from project import stack

# A worker's start: the model (≈5-20 s), q4's kernels (≈10 s, once) and its compile (CEILING_COMPILE_WAIT_S at most).
WORKER_LOAD_S = 300.0


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
        # SIGTERM while the workers start (minutes) must stop what was started, as Ctrl-C does: by
        # default it ended this process at once and left a compiling worker behind, orphaned.
        signal.signal(signal.SIGTERM, _interrupt)
        signal.signal(signal.SIGINT, signal.default_int_handler)  # even if our parent ignored it
        try:
            redis_url = self.ensure_redis(processes)
            self.prepare_model()
            self.adopt_shipped_weights(only)
            env = stack.child_env(REDIS_URL=redis_url)
            # Inductor's compile cache where the configuration says, set before the worker imports torch.
            env.setdefault("TORCHINDUCTOR_CACHE_DIR", str(Path(settings.VAR_DIR) / "inductor"))
            served = self.served_by_features()
            for variant in self.variants(only):
                # One worker per weight variant: two engines in one process slow each other ~1.6×.
                self.start_worker(processes, variant, concurrency, env, redis_url, compiles=variant in served)
            self.stdout.write(f"Starting daphne on {host}:{port}…")
            processes.append(subprocess.Popen(stack.daphne_argv(host, port), env=env))
            stack.wait_until(lambda: stack.port_answers(host, port), timeout=60, what="daphne")
            self.stdout.write(self.style.SUCCESS(f"\nCeiling is running: http://{host}:{port}/  (Ctrl-C stops it)\n"))
            self.wait_for_exit(processes)
        except KeyboardInterrupt:
            pass
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

    def served_by_features(self) -> set[str]:
        try:
            return feature_variants()
        except DatabaseError:
            return {default_variant()}

    def start_worker(self, processes: list[subprocess.Popen], variant: str, concurrency: int, env: dict[str, str],
                     redis_url: str, *, compiles: bool) -> None:
        """Start one variant's worker and wait until it serves (it publishes its stats only then); it joins
        `processes` before the wait, so a Ctrl-C during the wait stops it too."""
        extra = {"CEILING_WORKER_VARIANTS": variant}
        if not compiles:
            # The default variant's worker also serves remote features and small jobs; while no feature
            # runs on its engine, minutes of compiling its decode steps on every first start buy nothing.
            extra["CEILING_COMPILE_DECODE"] = "0"
        what = "loads the model" + ("" if compiles else "; no feature uses it, so its decode steps are not compiled")
        self.stdout.write(f"Starting the Celery inference worker for {variant} weights ({what})…")
        started = time.monotonic()
        process = subprocess.Popen(
            stack.worker_argv(concurrency, f"inference-{variant}@%h", queues=worker_queues([variant])), env=env | extra,
        )
        processes.append(process)
        timeout = WORKER_LOAD_S + (settings.CEILING_COMPILE_WAIT_S if compiles else 0)
        if worker_ready(redis_url, process, timeout):
            self.stdout.write(f"The {variant} worker serves at full speed ({time.monotonic() - started:.0f} s after its start).")
        else:
            self.stdout.write(self.style.WARNING(f"The {variant} worker did not report ready within {timeout:.0f} s; "
                                                 f"going on (its chats queue until it does)."))

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

    def adopt_shipped_weights(self, only: list[str]) -> None:
        """The demo features on the q4 weights the gate's shipped verdict approves, before any worker
        starts (so the q4 worker is among them), or back in full precision where q4 cannot run here
        (or --variants starts no q4 worker: its chats would be refused)."""
        from inference.engine.config import default_device
        from inference.shipped import SHIPPED_MODE, adopt_shipped_verdict, q4_problem

        if only and SHIPPED_MODE not in only:
            problem = f"--variants {','.join(only)} starts no {SHIPPED_MODE} worker"
        else:
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


def _interrupt(*_: object) -> None:
    raise KeyboardInterrupt


def worker_ready(redis_url: str, process: subprocess.Popen, timeout: float) -> bool:
    """Whether the worker process published its stats (inference/bus/stats.py: host:pid:token) within
    `timeout`; a worker that exits first is an error, with its exit code."""
    client = redis.Redis.from_url(redis_url)
    pattern = f"{STATS_KEY_PREFIX}*:{process.pid}:*"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise CommandError(f"The worker {' '.join(process.args[-8:-6])} exited with code {process.returncode} "
                               f"before it served; its log is above.")
        try:
            if next(client.scan_iter(match=pattern, count=1000), None) is not None:
                return True
        except redis.RedisError:
            pass  # a private Redis still starting: ask again
        time.sleep(0.5)
    return False
