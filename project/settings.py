"""Ceiling settings, read from the environment.

Every value comes from an environment variable through a small typed helper that raises
ImproperlyConfigured on nonsense, so a typo fails at start-up instead of at 3 a.m.
"""

from __future__ import annotations

import ipaddress
import os
from pathlib import Path
from urllib.parse import unquote, urlparse

from django.core.exceptions import ImproperlyConfigured

BASE_DIR = Path(__file__).resolve().parent.parent


def envstr(name: str, default: str) -> str:
    return os.environ.get(name, default)


def envbool(name: str, default: bool) -> bool:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    value = raw.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ImproperlyConfigured(f"{name}={raw!r} is not a boolean (use true/false, 1/0, yes/no, on/off)")


def envint(name: str, default: int | None, *, minimum: int | None = None) -> int | None:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ImproperlyConfigured(f"{name}={raw!r} is not an integer") from None
    if minimum is not None and value < minimum:
        raise ImproperlyConfigured(f"{name}={value} is below the minimum of {minimum}")
    return value


def envfloat(name: str, default: float, *, minimum: float | None = None) -> float:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ImproperlyConfigured(f"{name}={raw!r} is not a number") from None
    if minimum is not None and value < minimum:
        raise ImproperlyConfigured(f"{name}={value} is below the minimum of {minimum}")
    return value


def envlist(name: str, default: list[str]) -> list[str]:
    raw = os.environ.get(name)
    if raw is None:
        return default
    return [item.strip() for item in raw.split(",") if item.strip()]


def envint_item(name: str, item: str) -> int:
    """One integer of a comma-separated setting, or ImproperlyConfigured naming the setting."""
    try:
        return int(item)
    except ValueError:
        raise ImproperlyConfigured(f"{name}: {item!r} is not an integer") from None


def database_pool_options() -> dict:
    return {
        "min_size": 1,
        "max_size": envint("CEILING_DB_POOL_SIZE", 20, minimum=1),
        "timeout": envfloat("CEILING_DB_POOL_TIMEOUT_S", 10.0, minimum=0.1),
    }


SQLITE_BUSY_TIMEOUT_S = 20


def sqlite_options() -> dict:
    """`make run` shares one SQLite file between daphne and a 32-thread worker: without these the
    worker logged `database is locked` under 60 chats at once.

    - WAL: readers no longer block the writer nor it them (the journal mode is kept in the file);
      synchronous=NORMAL is WAL's usual pairing (durable across a crash of the process).
    - a busy timeout: a writer waits up to 20 s for the lock instead of failing at once.
    - BEGIN IMMEDIATE for every transaction (Django 5.1+): a transaction that reads and then writes
      takes the write lock at its start; begun DEFERRED, its upgrade fails at once with
      "database is locked" whatever the timeout, when another writer went first.
    """
    return {
        "timeout": SQLITE_BUSY_TIMEOUT_S,
        "transaction_mode": "IMMEDIATE",
        "init_command": f"PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL; PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_S * 1000};",
    }


def database_from_url(url: str) -> dict:
    """DATABASE_URL → Django DATABASES entry. sqlite:///relative/or//absolute, postgres://..."""
    parsed = urlparse(url)
    if parsed.scheme == "sqlite":
        path = unquote(parsed.path[1:] if parsed.path.startswith("/") else parsed.path)
        if not path:
            raise ImproperlyConfigured(f"DATABASE_URL={url!r} names no SQLite file")
        return {
            "ENGINE": "django.db.backends.sqlite3",
            "NAME": path if os.path.isabs(path) else str(BASE_DIR / path),
            "OPTIONS": sqlite_options(),
        }
    if parsed.scheme in ("postgres", "postgresql", "pgsql"):
        name = unquote(parsed.path.lstrip("/"))
        if not name:
            raise ImproperlyConfigured(f"DATABASE_URL={url!r} names no database")
        return {
            "ENGINE": "django.db.backends.postgresql",
            "NAME": name,
            "USER": unquote(parsed.username or "postgres"),
            "PASSWORD": unquote(parsed.password or ""),
            "HOST": parsed.hostname or "",
            "PORT": str(parsed.port or ""),
            # Connections come from a pool (psycopg_pool, Django's "pool" option) instead of one new
            # PostgreSQL backend per request: a connect costs ~6 ms here, a checkout ~0.1 ms. The check
            # on checkout (CONN_HEALTH_CHECKS) drops connections a database restart broke. The pool needs
            # CONN_MAX_AGE 0.
            "CONN_MAX_AGE": 0,
            "CONN_HEALTH_CHECKS": True,
            "OPTIONS": {"pool": database_pool_options()} if envbool("CEILING_DB_POOL", True) else {},
            "TEST": {"NAME": f"test_{name}"},
        }
    raise ImproperlyConfigured(f"DATABASE_URL={url!r}: unsupported scheme {parsed.scheme!r} (use sqlite or postgres)")


def celery_url_from_redis_url(url: str) -> str:
    """Kombu spells a unix-socket Redis as redis+socket:///path; redis-py spells it unix:///path."""
    if url.startswith("unix://"):
        return "redis+socket://" + url[len("unix://") :]
    return url


# Spelled as in budgets/redis_clients.py, which builds the clients (settings import no app).
CLUSTER_SCHEMES = ("redis+cluster", "rediss+cluster")


def check_redis_url(url: str) -> str:
    scheme = urlparse(url).scheme
    if scheme in CLUSTER_SCHEMES:
        raise ImproperlyConfigured(
            f"REDIS_URL={url!r}: Celery's broker and the channel layer need one Redis server; "
            "name the cluster in CEILING_COUNTERS_URL instead"
        )
    if scheme not in ("redis", "rediss", "unix"):
        raise ImproperlyConfigured(f"REDIS_URL={url!r} must start with redis://, rediss:// or unix://")
    return url


def check_counters_url(url: str, name: str = "CEILING_COUNTERS_URL") -> str:
    """One Redis (as REDIS_URL) or a Redis / Valkey Cluster: redis+cluster://host:port (database 0 only)."""
    if not url:
        return url
    parsed = urlparse(url)
    if parsed.scheme not in ("redis", "rediss", "unix", *CLUSTER_SCHEMES):
        raise ImproperlyConfigured(
            f"{name}={url!r} must start with redis://, rediss://, unix://, "
            "redis+cluster:// or rediss+cluster://"
        )
    if parsed.scheme in CLUSTER_SCHEMES and parsed.path.strip("/") not in ("", "0"):
        raise ImproperlyConfigured(f"{name}={url!r}: a Redis Cluster has only database 0")
    return url


DEBUG = envbool("DEBUG", False)
ALLOWED_HOSTS = envlist("ALLOWED_HOSTS", ["127.0.0.1", "localhost"])
CSRF_TRUSTED_ORIGINS = envlist("CSRF_TRUSTED_ORIGINS", [])
# Served over HTTPS (directly or behind a TLS proxy): secure cookies, redirects and HSTS below.
CEILING_HTTPS = envbool("CEILING_HTTPS", False)
LOOPBACK_HOSTS = {"127.0.0.1", "localhost", "::1", "[::1]"}

SECRET_KEY = os.environ.get("SECRET_KEY", "")
if not SECRET_KEY:
    # A fixed key is fine for `make run` and the tests on 127.0.0.1, never where anyone else can
    # reach the site: sessions and password-reset tokens signed with a public key can be forged.
    if CEILING_HTTPS or not set(ALLOWED_HOSTS) <= LOOPBACK_HOSTS or not envbool("CEILING_INSECURE_DEV_KEY", True):
        raise ImproperlyConfigured("SECRET_KEY must be set (a long random string) when the site is served beyond 127.0.0.1")
    SECRET_KEY = "ceiling-dev-key-not-for-production"

if CEILING_HTTPS:
    SECURE_SSL_REDIRECT = envbool("CEILING_SSL_REDIRECT", True)
    SESSION_COOKIE_SECURE = True
    CSRF_COOKIE_SECURE = True
    SECURE_HSTS_SECONDS = envint("CEILING_HSTS_SECONDS", 365 * 24 * 3600, minimum=0)
    SECURE_HSTS_INCLUDE_SUBDOMAINS = envbool("CEILING_HSTS_INCLUDE_SUBDOMAINS", True)
    SECURE_HSTS_PRELOAD = envbool("CEILING_HSTS_PRELOAD", True)
if envbool("CEILING_TRUST_X_FORWARDED_PROTO", False):
    # Only behind a proxy that sets this header itself (and strips a client's): else anyone can claim HTTPS.
    SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")

VAR_DIR = Path(envstr("CEILING_VAR_DIR", str(BASE_DIR / "var")))

INSTALLED_APPS = [
    "daphne",
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "channels",
    "axes",
    "accounts",
    "budgets",
    "inference",
    "control",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "whitenoise.middleware.WhiteNoiseMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    "project.csp.ContentSecurityPolicyMiddleware",
    # Last, as django-axes asks: it turns a locked-out login into a 429 page.
    "axes.middleware.AxesMiddleware",
]

# --- CORS for /v1 (django-cors-headers), off unless origins are named ----------------------------
# A browser app on another origin may call the API with its key (Bearer, never cookies). Off by
# default: nothing is installed, a preflight gets the API's 401 as before.
CEILING_CORS_ORIGINS = envlist("CEILING_CORS_ORIGINS", [])
for _origin in CEILING_CORS_ORIGINS:
    if urlparse(_origin).scheme not in ("http", "https") or not urlparse(_origin).netloc or urlparse(_origin).path not in ("", "/"):
        raise ImproperlyConfigured(f"CEILING_CORS_ORIGINS: {_origin!r} is not an origin such as https://app.example")
if CEILING_CORS_ORIGINS:
    from corsheaders.defaults import default_headers

    INSTALLED_APPS.append("corsheaders")
    MIDDLEWARE.insert(1, "corsheaders.middleware.CorsMiddleware")  # before CommonMiddleware, as it asks
    CORS_ALLOWED_ORIGINS = CEILING_CORS_ORIGINS
    CORS_URLS_REGEX = r"^/v1/"
    CORS_ALLOW_CREDENTIALS = False
    # What OpenAI's JavaScript client sends beside the usual ones, so its preflight passes.
    CORS_ALLOW_HEADERS = (*default_headers, "openai-organization", "openai-project", "openai-beta", "x-stainless-arch",
                          "x-stainless-lang", "x-stainless-os", "x-stainless-package-version", "x-stainless-retry-count",
                          "x-stainless-runtime", "x-stainless-runtime-version", "x-stainless-timeout", "x-stainless-async",
                          "x-stainless-helper-method", "x-ceiling-team")
    CORS_EXPOSE_HEADERS = ["x-request-id", "x-should-retry", "retry-after", "x-ceiling-fallback", "x-ceiling-fallback-model",
                           *(f"x-ratelimit-{what}-{metric}" for what in ("limit", "remaining", "reset") for metric in ("requests", "tokens"))]

ROOT_URLCONF = "project.urls"
ASGI_APPLICATION = "project.asgi.application"
WSGI_APPLICATION = None

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]

DATABASES = {"default": database_from_url(envstr("DATABASE_URL", f"sqlite:///{VAR_DIR / 'ceiling.sqlite3'}"))}
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

# Login throttling (django-axes): after CEILING_LOGIN_FAILURE_LIMIT wrong passwords for one username
# from one IP address, that pair is locked out for CEILING_LOGIN_COOLOFF_MINUTES. Keyed on the pair,
# not the username alone, so a stranger cannot lock a user out from elsewhere.
AUTHENTICATION_BACKENDS = ["axes.backends.AxesStandaloneBackend", "django.contrib.auth.backends.ModelBackend"]
AXES_FAILURE_LIMIT = envint("CEILING_LOGIN_FAILURE_LIMIT", 5, minimum=1)
AXES_COOLOFF_TIME = envfloat("CEILING_LOGIN_COOLOFF_MINUTES", 15.0, minimum=0.1) / 60  # axes counts in hours
AXES_LOCKOUT_PARAMETERS = [["username", "ip_address"]]
AXES_RESET_ON_SUCCESS = True
# Behind a reverse proxy: its addresses (or networks), whose X-Forwarded-For is believed, so the
# throttle keys on the real client and not on the proxy that every request comes through.
CEILING_TRUSTED_PROXIES = envlist("CEILING_TRUSTED_PROXIES", [])
for _proxy in CEILING_TRUSTED_PROXIES:
    try:
        ipaddress.ip_network(_proxy, strict=False)
    except ValueError:
        raise ImproperlyConfigured(f"CEILING_TRUSTED_PROXIES: {_proxy!r} is not an IP address or network (such as 10.0.0.0/8)") from None
AXES_CLIENT_IP_CALLABLE = "project.proxies.client_address"
AXES_VERBOSE = False

AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
]
LOGIN_URL = "/accounts/login/"
LOGIN_REDIRECT_URL = "/chat/"
LOGOUT_REDIRECT_URL = "/accounts/login/"

LANGUAGE_CODE = "en-us"
TIME_ZONE = envstr("TIME_ZONE", "UTC")
USE_I18N = False
USE_TZ = True

STATIC_URL = "/static/"
STATICFILES_DIRS = [BASE_DIR / "static"]
STATIC_ROOT = VAR_DIR / "static"
# WhiteNoise serves static/ straight from the source folders (no collectstatic step for `make run`);
# at scale a proxy or CDN can serve `collectstatic` output instead.
WHITENOISE_USE_FINDERS = True
STATIC_ROOT.mkdir(parents=True, exist_ok=True)  # WhiteNoise warns on every request when it is missing
WHITENOISE_AUTOREFRESH = DEBUG

# --- Redis: Celery broker, channel layer, engine stats, cancellation ------------------------
REDIS_URL = check_redis_url(envstr("REDIS_URL", "redis://127.0.0.1:6379/0"))

# Messages one web process's Redis list may hold while it is not reading: its stream inbox (bundles
# of frames, inference/bus/) and its channel-layer channels (dashboard points). A send beyond it is
# dropped (streaming is at-most-once; each request then ends from the ledger).
CEILING_CHANNEL_CAPACITY = envint("CEILING_CHANNEL_CAPACITY", 20000, minimum=1)
CHANNEL_LAYERS = {
    "default": {
        "BACKEND": "channels_redis.core.RedisChannelLayer",
        "CONFIG": {
            # redis-py 8 reads with a 5 s socket timeout by default, which aborts channels_redis's
            # blocking BZPOPMIN (itself 5 s) and tears consumers down; allow the read to outlast it.
            "hosts": [{"address": REDIS_URL, "socket_timeout": 30, "socket_connect_timeout": 5}],
            "prefix": envstr("CEILING_CHANNEL_PREFIX", "ceiling"),
            "capacity": CEILING_CHANNEL_CAPACITY,
            "expiry": 60,
        },
    }
}

CELERY_BROKER_URL = celery_url_from_redis_url(REDIS_URL)

# --- Redis for the guard's counters, the answer and retrieval caches and the stream inboxes ----
# May name a Redis (or Valkey) Cluster; empty: the REDIS_URL server (budgets/redis_clients.py). See docs/scaling.md.
CEILING_COUNTERS_URL = check_counters_url(envstr("CEILING_COUNTERS_URL", ""))
# The answer and retrieval caches (keys that always expire) on a Redis of their own, with any
# eviction policy; empty: the counters' Redis. The counters' Redis must never evict (budgets/guard.py).
CEILING_CACHE_URL = check_counters_url(envstr("CEILING_CACHE_URL", ""), "CEILING_CACHE_URL")
# After each admission the guard waits (WAIT) until this many replicas hold it (fewer when the
# master lists fewer): a replica promoted when its master dies then holds every reservation that
# was answered. Fewer within the timeout → released and refused (fail closed). 1 on a cluster, 0 on one Redis.
CEILING_COUNTERS_WAIT_REPLICAS = envint(
    "CEILING_COUNTERS_WAIT_REPLICAS", 1 if urlparse(CEILING_COUNTERS_URL).scheme in CLUSTER_SCHEMES else 0, minimum=0
)
CEILING_COUNTERS_WAIT_MS = envint("CEILING_COUNTERS_WAIT_MS", 50, minimum=1)
CELERY_RESULT_BACKEND = None
CELERY_TASK_IGNORE_RESULT = True
CELERY_TASK_ROUTES = {"inference.tasks.*": {"queue": "inference"}}
CELERY_TASK_DEFAULT_QUEUE = "default"
# One task at a time per worker thread: a worker killed mid-stream loses only what it was running,
# never a backlog it had prefetched. (Which tasks are acked late, and why, is said on each task.)
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
CELERY_TASK_ACKS_LATE = False
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
CELERY_WORKER_HIJACK_ROOT_LOGGER = False

# --- The engine ------------------------------------------------------------------------------
CEILING_MODEL = envstr("CEILING_MODEL", "")  # a local transformers folder; empty → the bundled SmolLM2
CEILING_MODEL_NAME = envstr("CEILING_MODEL_NAME", "SmolLM2-135M-Instruct")
CEILING_DEVICE = envstr("CEILING_DEVICE", "")  # "cpu", "cuda"; empty → cuda when available
CEILING_TORCH_THREADS = envint("CEILING_TORCH_THREADS", 2, minimum=1)
CEILING_KV_PAGE_SIZE = envint("CEILING_KV_PAGE_SIZE", 32, minimum=1)
CEILING_KV_BLOCKS = envint("CEILING_KV_BLOCKS", 512, minimum=8)
CEILING_MAX_BATCH_TOKENS = envint("CEILING_MAX_BATCH_TOKENS", 512, minimum=16)
# Prompt tokens one step may prefill while answers are streaming (0: up to CEILING_MAX_BATCH_TOKENS), and
# requests in an engine's running batch at once (vLLM's max_num_seqs, llama.cpp's slots; 0: as many as
# CEILING_MAX_BATCH_TOKENS; the rest wait for a place, holding no KV blocks). Unset: the engine's device
# decides (inference/engine/config.py: on a CPU 12 running, and a prefill budget measured when the engine
# loads, 32 to 512 tokens by how its steps' time grows with their rows; docs/engine.md "Prefill budget" and
# "Requests in the running batch"; no limits on a GPU).
CEILING_PREFILL_BUDGET = envint("CEILING_PREFILL_BUDGET", None, minimum=0)
CEILING_MAX_RUNNING = envint("CEILING_MAX_RUNNING", None, minimum=0)
# The KV cache's dtype on a CPU (fp32 activations): float16 halves what a decode step reads per cached
# position and the cache's memory (a lone token at 2,000 positions 15.0 → 10.7 ms), int8 takes 27% of
# fp32's bytes (docs/engine.md, "KV cache in int8"); neither has been shown no slower for the short
# chats a demo starts with (docs/engine.md, "KV cache in fp16").
CEILING_KV_DTYPE = envstr("CEILING_KV_DTYPE", "float32")
if CEILING_KV_DTYPE not in ("float32", "float16", "int8"):
    raise ImproperlyConfigured(f"CEILING_KV_DTYPE={CEILING_KV_DTYPE!r} is not one of float32, float16, int8")
CEILING_PREFIX_SHARING = envbool("CEILING_PREFIX_SHARING", True)
# "varlen" (per-request attention, inference/engine/patches/attention.py) or "sdpa" (transformers' own); CPU only.
# Which loop runs decode steps: "owned", Ceiling's own (inference/engine/owned/: scheduler, paged KV
# blocks, model runner), or "transformers", its ContinuousBatchingManager. A model the owned loop
# cannot run (not Llama-family) falls back to transformers' with a log line saying why.
CEILING_ENGINE_LOOP = envstr("CEILING_ENGINE_LOOP", "owned")
if CEILING_ENGINE_LOOP not in ("owned", "transformers"):
    raise ImproperlyConfigured(f"CEILING_ENGINE_LOOP must be owned or transformers, not {CEILING_ENGINE_LOOP!r}")
CEILING_ATTENTION = envstr("CEILING_ATTENTION", "varlen")
if CEILING_ATTENTION not in ("varlen", "sdpa"):
    raise ImproperlyConfigured(f"CEILING_ATTENTION must be varlen or sdpa, not {CEILING_ATTENTION!r}")
# Decode-sized matmuls as W·xᵀ (inference/engine/patches/linears.py) for the row counts where that measures faster when
# the engine loads (2× the weight streaming for 2-8 rows on AMD EPYC; slower on AVX-512 Xeons, so unused
# there); off skips the measurement and keeps F.linear everywhere.
CEILING_SKINNY_LINEAR = envbool("CEILING_SKINNY_LINEAR", True)
# The q4 variant's 4-bit linears and int8 lm_head on Ceiling's own kernels (inference/engine/kernels/lowbit.cpp,
# compiled for this CPU into var/kernels/ the first time a q4 engine loads, ~10 s; needs a C++ compiler, and
# falls back to torch's kernels with a logged reason without one). Off keeps torch's kernels.
CEILING_OWN_KERNELS = envbool("CEILING_OWN_KERNELS", True)
# The q4 variant's wide steps (prompt chunks, decode steps past the 4-bit kernel's reach) on a bf16 copy
# of the block weights, from the row count where it measures faster when the engine loads, and only
# there (inference/engine/patches/quantization.py: measure_wide_rows): prefill ~2x faster on CPUs with
# AVX512-BF16 or AMX, ~256 MiB more memory for SmolLM2. Off keeps fp32 for them.
CEILING_Q4_WIDE_BF16 = envbool("CEILING_Q4_WIDE_BF16", True)
# Decode-only steps of up to 1, 2, 4 or 8 rows compiled by torch.compile (one graph per bucket,
# padded rows) in a background thread when the worker starts (about a minute per bucket on 2 cores),
# each bucket used only where it measures faster than eager (inference/engine/owned/compiled.py).
# CEILING_COMPILE_DECODE=0 turns it off (`make test` does: each test engine would compile).
CEILING_COMPILE_DECODE = envbool("CEILING_COMPILE_DECODE", True)
# How long a starting worker waits for its decode steps to compile before it takes requests (the compile
# then never shares the cores with a chat; a restart reads var/inductor and waits seconds). 0 takes
# requests at once and compiles in the background, serving eagerly meanwhile.
CEILING_COMPILE_WAIT_S = envfloat("CEILING_COMPILE_WAIT_S", 900.0, minimum=0.0)
# What an engine times when it loads (its routes, the decode stack, each compiled bucket against eager)
# is kept per machine in var/engine-measurements.json, under a key of the CPU, torch, the threads, the model,
# the variant and the timed code, so a restarted worker takes it without timing (inference/engine/measured.py):
# serving in seconds instead of ~20 s (q4) or minutes (a compile). On: every start times again and
# replaces what was kept (or delete the file).
CEILING_REMEASURE = envbool("CEILING_REMEASURE", False)
CEILING_COMPILE_BUCKETS = tuple(envint_item("CEILING_COMPILE_BUCKETS", item) for item in envlist("CEILING_COMPILE_BUCKETS", ["1", "2", "4", "8"]))
if not CEILING_COMPILE_BUCKETS or min(CEILING_COMPILE_BUCKETS) < 1 or max(CEILING_COMPILE_BUCKETS) > 64:
    raise ImproperlyConfigured(f"CEILING_COMPILE_BUCKETS must be row counts from 1 to 64, not {CEILING_COMPILE_BUCKETS!r}")
# The Celery queue chats are sent to and workers serve (a private one isolates a benchmark's worker).
CEILING_INFERENCE_QUEUE = envstr("CEILING_INFERENCE_QUEUE", "inference")
# Tokens per streamed frame after the first (SGLang's --stream-interval): 1 sends every token as it
# comes; more sends fewer, longer frames, which leaves the engine more CPU where the web tier shares
# its cores (each delivered frame costs it ~1.3 ms of forward-pass time on 2 cores, docs/benchmarks.md).
CEILING_STREAM_INTERVAL = envint("CEILING_STREAM_INTERVAL", 1, minimum=1)
# And at least this many milliseconds between frames after the first (0: none): a reader sees text
# arrive ~40 times a second either way, and a lone chat on 2 cores ran ~8.5 → ~6.4 ms a token with it
# (inference/worker/generation.py, FrameBuffer). A held piece waits at most for the next step.
CEILING_STREAM_FRAME_MS = envint("CEILING_STREAM_FRAME_MS", 25, minimum=0)
# Benchmarks only: generate exactly max_tokens, ignoring end-of-sequence (manage.py bench's stack mode).
CEILING_IGNORE_EOS = envbool("CEILING_IGNORE_EOS", False)
# Benchmarks only: record when each request reaches each stage of its time to first token
# (inference/bus/trace.py), for the TTFT split of manage.py bench's remote mode.
CEILING_TTFT_TRACE = envbool("CEILING_TTFT_TRACE", False)
# The default weight variant ("none" = full precision, "int8" = int8 linear layers on CPU, "q4" = the
# GGUF's 4-bit weights for decode steps on CPU, "bf16" = bfloat16 weights and arithmetic, fast on CPUs
# with AMX or AVX512-BF16): a worker's variant unless CEILING_WORKER_VARIANTS says otherwise, and the one
# served on CEILING_INFERENCE_QUEUE itself; a feature switched to another variant is served by that
# variant's workers, on its own queue (inference/variants.py). The same in every process.
CEILING_QUANTIZATION = envstr("CEILING_QUANTIZATION", "none")
if CEILING_QUANTIZATION not in ("none", "int8", "q4", "bf16"):
    raise ImproperlyConfigured(f"CEILING_QUANTIZATION={CEILING_QUANTIZATION!r} is not one of none, int8, q4, bf16")
# The variants a worker process serves (inference/variants.py): empty = CEILING_QUANTIZATION alone. One
# per process: two engines in one process slow each other (~1.6×); run a worker per variant instead.
CEILING_WORKER_VARIANTS = envlist("CEILING_WORKER_VARIANTS", [])
if set(CEILING_WORKER_VARIANTS) - {"none", "int8", "q4", "bf16"}:
    raise ImproperlyConfigured(f"CEILING_WORKER_VARIANTS={CEILING_WORKER_VARIANTS!r}: each must be one of none, int8, q4, bf16")
# Start the engine in every Celery worker process that consumes the "inference" queue.
CEILING_ENGINE_AUTOSTART = envbool("CEILING_ENGINE_AUTOSTART", True)

# --- Requests --------------------------------------------------------------------------------
CEILING_MAX_FRAME_BYTES = envint("CEILING_MAX_FRAME_BYTES", 64 * 1024, minimum=1024)
# Any HTTP request body over this is refused at the ASGI edge (project/bodylimit.py) before Django
# reads it: 413, by the declared Content-Length at once, or counted as a chunked body arrives. /v1
# bodies are held to CEILING_MAX_FRAME_BYTES there. Above DATA_UPLOAD_MAX_MEMORY_SIZE (2.5 MB), so
# Django's own 400 for big forms still speaks below it.
CEILING_MAX_BODY_BYTES = envint("CEILING_MAX_BODY_BYTES", 3 * 1024 * 1024, minimum=1024)
CEILING_DEFAULT_MAX_TOKENS = envint("CEILING_DEFAULT_MAX_TOKENS", 256, minimum=1)
CEILING_MAX_TOKENS_LIMIT = envint("CEILING_MAX_TOKENS_LIMIT", 1024, minimum=1)
CEILING_MAX_INPUT_TOKENS = envint("CEILING_MAX_INPUT_TOKENS", 2048, minimum=1)
CEILING_MAX_MESSAGES = envint("CEILING_MAX_MESSAGES", 64, minimum=1)
# Layered timeouts, each shorter than the layer above it, so the layer closest to the work gives up
# first and the user hears why: engine deadline < Celery soft limit < Celery hard limit < what the
# consumer / HTTP API waits < the browser (which never gives up: it shows the elapsed time).
CEILING_ENGINE_FIRST_TOKEN_S = envfloat("CEILING_ENGINE_FIRST_TOKEN_S", 50.0, minimum=0.1)
CEILING_ENGINE_DEADLINE_S = envfloat("CEILING_ENGINE_DEADLINE_S", 240.0, minimum=0.1)
CEILING_FIRST_TOKEN_TIMEOUT_S = envfloat("CEILING_FIRST_TOKEN_TIMEOUT_S", 60.0, minimum=0.1)
CEILING_TOTAL_TIMEOUT_S = envfloat("CEILING_TOTAL_TIMEOUT_S", 300.0, minimum=0.1)
CEILING_TASK_SOFT_TIME_LIMIT_S = envint("CEILING_TASK_SOFT_TIME_LIMIT_S", 270, minimum=1)
CEILING_TASK_TIME_LIMIT_S = envint("CEILING_TASK_TIME_LIMIT_S", 290, minimum=1)
if not (
    CEILING_ENGINE_FIRST_TOKEN_S < CEILING_FIRST_TOKEN_TIMEOUT_S
    and CEILING_ENGINE_DEADLINE_S < CEILING_TASK_SOFT_TIME_LIMIT_S < CEILING_TASK_TIME_LIMIT_S < CEILING_TOTAL_TIMEOUT_S
):
    raise ImproperlyConfigured(
        "Timeouts must nest: CEILING_ENGINE_FIRST_TOKEN_S < CEILING_FIRST_TOKEN_TIMEOUT_S and CEILING_ENGINE_DEADLINE_S < "
        "CEILING_TASK_SOFT_TIME_LIMIT_S < CEILING_TASK_TIME_LIMIT_S < CEILING_TOTAL_TIMEOUT_S"
    )

# An acks_late task not acknowledged within this long is handed to another worker (Redis broker):
# it must outlast the longest task, or a slow task would run twice while the first is still going.
CEILING_BROKER_VISIBILITY_TIMEOUT_S = envint("CEILING_BROKER_VISIBILITY_TIMEOUT_S", 3600, minimum=1)
if CEILING_BROKER_VISIBILITY_TIMEOUT_S <= CEILING_TASK_TIME_LIMIT_S:
    raise ImproperlyConfigured("CEILING_BROKER_VISIBILITY_TIMEOUT_S must be above CEILING_TASK_TIME_LIMIT_S")
CELERY_BROKER_TRANSPORT_OPTIONS = {"visibility_timeout": CEILING_BROKER_VISIBILITY_TIMEOUT_S}

# --- The budget guard ---------------------------------------------------------------------------
# Redis round trips of the guard give up after this long: refusing fast beats hanging (fail closed).
CEILING_GUARD_TIMEOUT_S = envfloat("CEILING_GUARD_TIMEOUT_S", 0.1, minimum=0.01)
if CEILING_COUNTERS_WAIT_REPLICAS and CEILING_COUNTERS_WAIT_MS >= CEILING_GUARD_TIMEOUT_S * 1000:
    # The admission's reply comes after the WAIT: a socket that gives up first would refuse every
    # request whose replica is slow, without releasing its reservation at once.
    raise ImproperlyConfigured(
        f"CEILING_COUNTERS_WAIT_MS={CEILING_COUNTERS_WAIT_MS} must be below CEILING_GUARD_TIMEOUT_S "
        f"({CEILING_GUARD_TIMEOUT_S * 1000:g} ms)"
    )
# A request still "running" this long after admission was lost (worker crash): reconciliation
# marks it failed and releases its reservation.
CEILING_RESERVATION_TTL_S = envint("CEILING_RESERVATION_TTL_S", 600, minimum=60)
if CEILING_RESERVATION_TTL_S <= CEILING_TOTAL_TIMEOUT_S:
    # Reconciliation fails a request still running past the TTL: one shorter than the longest a
    # request may run would fail (and release) requests that are still generating.
    raise ImproperlyConfigured(
        f"CEILING_RESERVATION_TTL_S={CEILING_RESERVATION_TTL_S} must be above CEILING_TOTAL_TIMEOUT_S "
        f"({CEILING_TOTAL_TIMEOUT_S:g} s), the longest a request may run; else reconciliation fails requests still running"
    )
# On PostgreSQL, admissions outside a transaction write their ledger rows through one writer thread
# per process that commits many at once (budgets/ledger_writer.py); each still waits for its commit.
# Off by default: on a 2-core machine with a local PostgreSQL, where CPU and not commits limits
# admissions, it measured 10-20% fewer cycles/s (docs/benchmarks.md); try it where commits are dear.
CEILING_LEDGER_GROUP_COMMIT = envbool("CEILING_LEDGER_GROUP_COMMIT", False)
# Each worker sweeps lost requests, unsettled counters and unsent alerts this often; 0 turns the
# sweep off (tests that drive those paths by hand turn it off in their workers, so a sweep cannot race them).
CEILING_RECONCILE_EVERY_S = envfloat("CEILING_RECONCILE_EVERY_S", 60.0, minimum=0.0)
# Each worker settles the requests of dead workers (their heartbeat expired) this often: failed, with the
# tokens they had streamed, reservations released (inference/worker/lost.py); 0 turns it off.
CEILING_LOST_SWEEP_EVERY_S = envfloat("CEILING_LOST_SWEEP_EVERY_S", 5.0, minimum=0.0)
# How often each worker reports its engine's peak throughput, which prices local tokens (0: never).
CEILING_THROUGHPUT_EVERY_S = envfloat("CEILING_THROUGHPUT_EVERY_S", 30.0, minimum=0.0)
CEILING_LOOP_MAX_CALLS = envint("CEILING_LOOP_MAX_CALLS", 10, minimum=1)
CEILING_LOOP_MAX_COST_MICRO_USD = envint("CEILING_LOOP_MAX_COST_MICRO_USD", 1_000_000, minimum=0)

# --- Secrets Ceiling keeps (budgets/vault.py) ---------------------------------------------------
# Fernet keys, comma-separated: the first encrypts the provider API keys staff enter, every one
# decrypts (put a new key first to rotate, run `manage.py rotate_secrets`, then drop the old one).
# Empty: staff cannot store a key (the page says so); CEILING_PROVIDER_KEY_* variables still work.
CEILING_SECRETS_KEY = envstr("CEILING_SECRETS_KEY", "")


def _check_fernet_keys(raw: str) -> None:
    from cryptography.fernet import Fernet

    for key in (part.strip() for part in raw.split(",") if part.strip()):
        try:
            Fernet(key.encode())
        except ValueError:
            raise ImproperlyConfigured(
                "CEILING_SECRETS_KEY holds something that is not a Fernet key (32 url-safe base64-encoded bytes); "
                'make one with python -c "from cryptography.fernet import Fernet; print(Fernet.generate_key().decode())"'
            ) from None


_check_fernet_keys(CEILING_SECRETS_KEY)

# --- Outbound calls (budgets/outbound.py) -------------------------------------------------------
# Webhook URLs may not reach loopback or private addresses (Redis, PostgreSQL, the admin of a router)
# unless this is true; providers may (a vLLM beside the workers is normal). Link-local and cloud
# metadata addresses are refused for both, whatever this says.
CEILING_WEBHOOK_ALLOW_PRIVATE = envbool("CEILING_WEBHOOK_ALLOW_PRIVATE", False)

# --- Metrics ----------------------------------------------------------------------------------
# GET /metrics wants `Authorization: Bearer <this>`; empty (the default) switches the endpoint off (404).
CEILING_METRICS_TOKEN = envstr("CEILING_METRICS_TOKEN", "")
# ceiling_spend_usd names this many users, teams, API keys and tags by spend (per period); the rest add up
# to one "other" series, so a scrape's size does not grow with the user base.
CEILING_METRICS_TOP_N = envint("CEILING_METRICS_TOP_N", 10, minimum=1)

# --- Tracing (project/tracing.py, docs/observability.md) ----------------------------------------
# OpenTelemetry traces, one per chat, read from OpenTelemetry's own variables. Off unless configured:
# an OTLP endpoint (OTEL_EXPORTER_OTLP_ENDPOINT or OTEL_EXPORTER_OTLP_TRACES_ENDPOINT) switches them on,
# OTEL_TRACES_EXPORTER=otlp|console|none says so outright, OTEL_SDK_DISABLED=true switches them off.
# (OpenTelemetry's default exporter is otlp; here it is none until an endpoint is given, so a fresh
# install never sends spans to a localhost:4318 nobody runs.) The exporter and its endpoint, headers
# and timeout, OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES, OTEL_BSP_* are read by OpenTelemetry.
CEILING_TRACES_EXPORTERS = ("otlp", "console", "none")


def traces_exporter() -> str:
    if envbool("OTEL_SDK_DISABLED", False):
        return "none"
    named = envstr("OTEL_TRACES_EXPORTER", "").strip().lower()
    if named:
        if named not in CEILING_TRACES_EXPORTERS:
            raise ImproperlyConfigured(f"OTEL_TRACES_EXPORTER={named!r} must be one of {', '.join(CEILING_TRACES_EXPORTERS)}")
        return named
    endpoint = envstr("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "") or envstr("OTEL_EXPORTER_OTLP_ENDPOINT", "")
    return "otlp" if endpoint.strip() else "none"


CEILING_TRACES_EXPORTER = traces_exporter()
if CEILING_TRACES_EXPORTER == "otlp":
    for _name in ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL"):
        _protocol = envstr(_name, "").strip()
        if _protocol and _protocol != "http/protobuf":
            raise ImproperlyConfigured(f"{_name}={_protocol!r}: Ceiling exports traces over OTLP http/protobuf only "
                                       "(send them to an OpenTelemetry Collector's port 4318)")
# Which new traces are kept: every one (parentbased_always_on, the default) or a share of them
# (parentbased_traceidratio with OTEL_TRACES_SAMPLER_ARG, 0 to 1). A trace started upstream (an API
# call with a traceparent header) keeps its caller's decision either way.
CEILING_TRACES_SAMPLER = envstr("OTEL_TRACES_SAMPLER", "parentbased_always_on").strip().lower() or "parentbased_always_on"
if CEILING_TRACES_SAMPLER not in ("parentbased_always_on", "parentbased_traceidratio"):
    raise ImproperlyConfigured(f"OTEL_TRACES_SAMPLER={CEILING_TRACES_SAMPLER!r} must be parentbased_always_on or parentbased_traceidratio")
CEILING_TRACES_RATIO = envfloat("OTEL_TRACES_SAMPLER_ARG", 1.0, minimum=0.0) if CEILING_TRACES_SAMPLER.endswith("ratio") else 1.0
if CEILING_TRACES_RATIO > 1:
    raise ImproperlyConfigured(f"OTEL_TRACES_SAMPLER_ARG={CEILING_TRACES_RATIO} must be between 0 and 1")

# --- Email (spend alerts) ------------------------------------------------------------------------
EMAIL_BACKEND = envstr("EMAIL_BACKEND", "django.core.mail.backends.console.EmailBackend")
EMAIL_HOST = envstr("EMAIL_HOST", "localhost")
EMAIL_PORT = envint("EMAIL_PORT", 25, minimum=1)
EMAIL_HOST_USER = envstr("EMAIL_HOST_USER", "")
EMAIL_HOST_PASSWORD = envstr("EMAIL_HOST_PASSWORD", "")
EMAIL_USE_TLS = envbool("EMAIL_USE_TLS", False)
# A dead mail server must not hold an alert task for minutes; the task retries instead.
EMAIL_TIMEOUT = envint("EMAIL_TIMEOUT", 10, minimum=1)
DEFAULT_FROM_EMAIL = envstr("DEFAULT_FROM_EMAIL", "ceiling@localhost")
# Who hears about a provider's spend when the provider names no alert recipients.
CEILING_ALERT_FALLBACK_EMAILS = envlist("CEILING_ALERT_FALLBACK_EMAILS", [])

# plain: the readable line; json: one JSON object per line for a log pipeline (project/logs.py). Both
# carry the ledger's request id of the chat being served, so one chat can be followed from the web
# process to the worker and its settle.
CEILING_LOG_FORMAT = envstr("CEILING_LOG_FORMAT", "plain").strip().lower()
if CEILING_LOG_FORMAT not in ("plain", "json"):
    raise ImproperlyConfigured(f"CEILING_LOG_FORMAT={CEILING_LOG_FORMAT!r} must be plain or json")

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "filters": {"request_id": {"()": "project.logs.RequestIdFilter"}},
    "formatters": {
        "plain": {"()": "project.logs.PlainFormatter"},
        "json": {"()": "project.logs.JsonFormatter"},
    },
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": CEILING_LOG_FORMAT, "filters": ["request_id"]}},
    "root": {"handlers": ["console"], "level": envstr("LOG_LEVEL", "INFO")},
    "loggers": {"daphne": {"level": "WARNING"}, "django.channels.server": {"level": "WARNING"}},
}
