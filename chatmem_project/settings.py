"""chatmem settings. Every value comes from the environment (or a ``.env`` file); the defaults
are the embedded mode: SQLite, consolidation in-process, the offline model, no API key.
``.env.example`` lists every setting."""

from pathlib import Path

from django.core.exceptions import ImproperlyConfigured

from chatmem_project.database import databases
from chatmem_project.env import env, env_bool, env_float, env_int, env_text
from chatmem_project.logs import logging_config

BASE_DIR = Path(__file__).resolve().parent.parent

DEBUG = env_bool("DEBUG", False)
# Public (it is in the source): for a checkout with nothing configured (the tests, serve_demo with
# DEBUG). Served with DEBUG off it lets anyone forge sessions: chatmem_project.boot refuses it.
DEV_SECRET_KEY = "django-insecure-chatmem-local-only-set-SECRET_KEY"
SECRET_KEY = env_text("SECRET_KEY", DEV_SECRET_KEY)
ALLOWED_HOSTS = env.list("ALLOWED_HOSTS", default=[]) or ["127.0.0.1", "localhost"]
CSRF_TRUSTED_ORIGINS = env.list("CSRF_TRUSTED_ORIGINS", default=[])

# Neither DEBUG nor SECRET_KEY given (environment or .env): a source checkout run as it is (the
# test suite, CI's checks, a benchmark), not a deployment. The Docker image sets DEBUG, so a
# container is never one (chatmem_project.boot).
UNCONFIGURED_CHECKOUT = not (env_text("DEBUG", "") or env_text("SECRET_KEY", ""))

# HTTPS (docs/operations.md, "HTTPS"): who serves it.
#   on     chatmem does: plain HTTP is redirected to https://, cookies are Secure, HSTS is sent;
#   proxy  a TLS-terminating proxy in front does, and redirects plain HTTP itself: no redirect
#          here, Secure cookies and HSTS as with on, the proxy's X-Forwarded-Proto trusted;
#   off    nobody: plain HTTP (the quickstart, a trial on a private network).
# Empty: on with DEBUG off, off with DEBUG on and in an unconfigured checkout. Each SECURE_*
# setting below may still be set on its own and wins.
HTTPS_MODES = ("on", "proxy", "off")
CHATMEM_HTTPS = env_text("CHATMEM_HTTPS", "off" if DEBUG or UNCONFIGURED_CHECKOUT else "on")
if CHATMEM_HTTPS not in HTTPS_MODES:
    raise ImproperlyConfigured(
        f'CHATMEM_HTTPS "{CHATMEM_HTTPS}" is not one of on, proxy, off (docs/operations.md).'
    )
_HTTPS = CHATMEM_HTTPS != "off"
SECURE_SSL_REDIRECT = env_bool("SECURE_SSL_REDIRECT", CHATMEM_HTTPS == "on")
# Health probes and Prometheus' scrapes come over plain HTTP from inside the container, the
# compose network or the orchestrator (conversations.middleware.ProbeMiddleware answers them
# before the redirect; this covers them should the middleware order change).
SECURE_REDIRECT_EXEMPT = [r"^healthz$", r"^readyz$", r"^metrics$"]
SECURE_HSTS_SECONDS = env_int("SECURE_HSTS_SECONDS", 31536000 if _HTTPS else 0)
SECURE_HSTS_INCLUDE_SUBDOMAINS = env_bool("SECURE_HSTS_INCLUDE_SUBDOMAINS", _HTTPS)
# Asking browsers' built-in HSTS lists to include the domain is hard to undo and the operator's
# decision: off unless set, and Django's deployment check's warning about it (security.W021)
# silenced below.
SECURE_HSTS_PRELOAD = env_bool("SECURE_HSTS_PRELOAD", False)
SESSION_COOKIE_SECURE = env_bool("SESSION_COOKIE_SECURE", _HTTPS)
CSRF_COOKIE_SECURE = env_bool("CSRF_COOKIE_SECURE", _HTTPS)
# Behind a TLS-terminating proxy that sets X-Forwarded-Proto, replacing any a client sent: then
# Django knows which requests came over HTTPS (HSTS, the admin's CSRF origin check).
if env_bool("SECURE_PROXY_SSL_HEADER", CHATMEM_HTTPS == "proxy"):
    SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")
SILENCED_SYSTEM_CHECKS = ["security.W021"]
if CHATMEM_HTTPS == "proxy" and not SECURE_SSL_REDIRECT:
    # The proxy redirects plain HTTP: security.W008 (no SECURE_SSL_REDIRECT) is the design.
    SILENCED_SYSTEM_CHECKS.append("security.W008")

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "rest_framework",
    "rest_framework.authtoken",
    "drf_spectacular",
    "drf_spectacular_sidecar",  # Swagger UI's files, served locally: /api/v1/docs/ works offline
    "conversations",
    "memory_worker",
]

MIDDLEWARE = [
    "conversations.middleware.ProbeMiddleware",
    "chatmem_project.request_id.RequestIdMiddleware",
    "conversations.metrics.RequestMetricsMiddleware",
    "django.middleware.security.SecurityMiddleware",
    # The admin's and Swagger UI's files under any server: gunicorn serves none of its own.
    "conversations.middleware.StaticFilesMiddleware",
    "conversations.middleware.BodySizeLimitMiddleware",
    "conversations.middleware.NulInUrlMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
]

ROOT_URLCONF = "chatmem_project.urls"
WSGI_APPLICATION = "chatmem_project.wsgi.application"
ASGI_APPLICATION = "chatmem_project.asgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [],
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

# --- Database -------------------------------------------------------------------------------
# DATABASE_URL, persistent connections, timeouts, the pool (chatmem_project.database).
DATABASE_URL = env("DATABASE_URL", default="") or f"sqlite:///{BASE_DIR / 'db.sqlite3'}"
DATABASES, DB_POOL_MIN_SIZE, DB_POOL_MAX_SIZE = databases(DATABASE_URL, BASE_DIR)
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.UserAttributeSimilarityValidator"},
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
    {"NAME": "django.contrib.auth.password_validation.CommonPasswordValidator"},
    {"NAME": "django.contrib.auth.password_validation.NumericPasswordValidator"},
]

LANGUAGE_CODE = "en-us"
# The day a daily note is filed under (memory_worker.daily_notes) and the admin's times. Stored
# times are UTC whatever it is (USE_TZ). Set it before the first chat: changing it later files
# later messages by the new zone's days.
TIME_ZONE = env_text("TIME_ZONE", "UTC")
USE_I18N = True
USE_TZ = True
# One timestamp format on every admin page (chatmem_project/formats/en/formats.py).
FORMAT_MODULE_PATH = ["chatmem_project.formats"]
STATIC_URL = "static/"
STATIC_ROOT = env_text("STATIC_ROOT", str(BASE_DIR / "staticfiles"))
# WhiteNoise (conversations.middleware.StaticFilesMiddleware) serves them from STATIC_ROOT once
# collectstatic has filled it (the image does), else, in a checkout where nothing was collected
# (runserver, serve_demo, the tests, gunicorn from the source tree), from the installed apps.
WHITENOISE_USE_FINDERS = not Path(STATIC_ROOT).is_dir()

# --- REST API -------------------------------------------------------------------------------
REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": [
        # Token first: its WWW-Authenticate header makes unauthenticated requests a 401.
        "conversations.authentication.TokenAuthentication",
        "conversations.authentication.BearerTokenAuthentication",
        "rest_framework.authentication.SessionAuthentication",
    ],
    "DEFAULT_PERMISSION_CLASSES": ["rest_framework.permissions.IsAuthenticated"],
    "DEFAULT_PAGINATION_CLASS": "conversations.api.pagination.StandardPagination",
    "PAGE_SIZE": 50,
    # JSON first: a client that does not ask for HTML (any token client) gets JSON. A browser
    # gets the browsable API; its forms post with the session's CSRF token (DRF checks it).
    "DEFAULT_RENDERER_CLASSES": [
        "rest_framework.renderers.JSONRenderer",
        "rest_framework.renderers.BrowsableAPIRenderer",
    ],
    "DEFAULT_PARSER_CLASSES": ["conversations.api.parsers.StrictJSONParser"],
    "EXCEPTION_HANDLER": "conversations.api.errors.exception_handler",
    "DEFAULT_SCHEMA_CLASS": "conversations.api.schema.ChatmemAutoSchema",
}
# OpenAPI 3 schema at /api/v1/schema/, Swagger UI at /api/v1/docs/ (conversations/api/schema.py).
SPECTACULAR_SETTINGS = {
    "TITLE": "chatmem API",
    "DESCRIPTION": "Chats with summarization memory. Token authentication: "
    "`Authorization: Token <key>` (or a session login at /api-auth/login/); the "
    "OpenAI-compatible API under /v1/ takes the same key as `Authorization: Bearer <key>`. "
    "Turns answer JSON or server-sent events (docs/streaming.md).",
    # Tags and operation ids from the path after /api/v1 or /v1 ("chats", chats_create).
    "SCHEMA_PATH_PREFIX": r"/(api/)?v1",
    "VERSION": "1",
    "SERVE_INCLUDE_SCHEMA": False,
    "SWAGGER_UI_DIST": "SIDECAR",
    "SWAGGER_UI_FAVICON_HREF": "SIDECAR",
    "REDOC_DIST": "SIDECAR",
    "COMPONENT_SPLIT_REQUEST": True,
    "PREPROCESSING_HOOKS": ["conversations.api.schema.only_rest_api"],
    "POSTPROCESSING_HOOKS": [
        "drf_spectacular.hooks.postprocess_schema_enums",
        "conversations.api.schema_constraints.request_constraints",
    ],
    # tests/test_openapi.py fails on any schema warning; `check --deploy` stays about deployment.
    "ENABLE_DJANGO_DEPLOY_CHECK": False,
}

# --- Redis, Celery --------------------------------------------------------------------------
# Unset = embedded mode: consolidation runs on an in-process background thread.
REDIS_URL = env("REDIS_URL", default="")
# The request path's Redis calls (the turn throttle, the post-commit enqueue) give up after this
# long, and a timeout opens a breaker that skips them for REDIS_BREAKER_SECONDS: turns go on
# unthrottled, and the chats whose fold came due are left to the beat sweep
# (memory_worker.coordination.request_redis). Workers and beat keep the longer
# BROKER_SOCKET_TIMEOUT_SECONDS.
REDIS_REQUEST_TIMEOUT_SECONDS = env_float("REDIS_REQUEST_TIMEOUT_SECONDS", 0.25)
REDIS_BREAKER_SECONDS = env_float("REDIS_BREAKER_SECONDS", 30.0)
BROKER_SOCKET_TIMEOUT_SECONDS = env_float("BROKER_SOCKET_TIMEOUT_SECONDS", 5.0)
# The shared cache (turn throttling): Redis when configured, with the request path's timeouts
# (the throttle lets requests through when the cache is down or stalled).
CACHE_URL = env("CACHE_URL", default="") or REDIS_URL
CACHES = {
    "default": (
        {
            "BACKEND": "django.core.cache.backends.redis.RedisCache",
            "LOCATION": CACHE_URL,
            "KEY_PREFIX": "chatmem-cache",
            "OPTIONS": {
                "socket_connect_timeout": REDIS_REQUEST_TIMEOUT_SECONDS,
                "socket_timeout": REDIS_REQUEST_TIMEOUT_SECONDS,
            },
        }
        if CACHE_URL
        else {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"}
    )
}

LLM_TIMEOUT_SECONDS = env_float("LLM_TIMEOUT_SECONDS", 60.0)
# A turn's non-streamed model request goes over the worker thread's own keep-alive connection
# (conversations.chat_model.http) rather than the SDK's shared pool; false: the SDK sends it. With
# an HTTP(S) proxy in the environment the SDK always sends it.
CHAT_DIRECT_HTTP = env_bool("CHAT_DIRECT_HTTP", True)
MEMORY_LLM_TIMEOUT_SECONDS = env_float("MEMORY_LLM_TIMEOUT_SECONDS", 60.0)
# Ordered deadlines (docs/design.md, the fold): LLM < soft < hard < the lock's last expiry (hard +
# one lock TTL) < broker visibility timeout.
MEMORY_TASK_SOFT_TIME_LIMIT = env_int("MEMORY_TASK_SOFT_TIME_LIMIT", 240)
MEMORY_TASK_TIME_LIMIT = env_int("MEMORY_TASK_TIME_LIMIT", 300)
# The per-chat lock's TTL, renewed by its holder every third of it
# (memory_worker.coordination.lease) until the run ends or its hard time limit: a dead holder's chat
# is free again within this. Also how stale a running fold's heartbeat may grow before the recovery
# takes the fold for dead.
MEMORY_LOCK_TTL_SECONDS = env_int("MEMORY_LOCK_TTL_SECONDS", 20)
BROKER_VISIBILITY_TIMEOUT = env_int("BROKER_VISIBILITY_TIMEOUT", 3600)
MEMORY_SWEEP_INTERVAL_SECONDS = env_float("MEMORY_SWEEP_INTERVAL_SECONDS", 60.0)
# How often beat looks for runs whose worker died (a ledger row "running" whose heartbeat is
# older than MEMORY_LOCK_TTL_SECONDS) and queues their chats' folds: a dead worker's chat is
# refolded within that bound, this interval and one fold.
MEMORY_RECOVERY_INTERVAL_SECONDS = env_float("MEMORY_RECOVERY_INTERVAL_SECONDS", 10.0)
# A turn queues no consolidation task for a chat that has one queued and not started yet
# (memory_worker.coordination.dispatch); a marker expires after this (0: no deduplication).
MEMORY_ENQUEUE_DEDUP_SECONDS = env_float("MEMORY_ENQUEUE_DEDUP_SECONDS", 60.0)
# A turn over its hard bound waits this long for a consolidation task queued for its chat to
# start (and then for that fold, up to MEMORY_LLM_TIMEOUT_SECONDS) before folding itself: a free
# worker starts it within moments, and a turn does not wait behind a backlog.
MEMORY_QUEUED_FOLD_WAIT_SECONDS = env_float("MEMORY_QUEUED_FOLD_WAIT_SECONDS", 2.0)
# How many policy re-evaluations one task runs while holding the lock before handing on.
MEMORY_MAX_RERUNS_PER_TASK = env_int("MEMORY_MAX_RERUNS_PER_TASK", 5)

CELERY_BROKER_URL = REDIS_URL or "memory://"
CELERY_RESULT_BACKEND = None
CELERY_TASK_IGNORE_RESULT = True
# Celery's Django fixup closes every database connection before and after each task unless this
# is set: a new PostgreSQL connection (a backend process) per fold, and with DB_POOL_MAX_SIZE a
# new pool. Set, the fixup leaves them be, and chatmem_project.celery closes them around each
# task as Django does around a request (CONN_MAX_AGE, an unusable connection closed).
CELERY_DB_REUSE_MAX = 2**31
CELERY_TASK_DEFAULT_QUEUE = "memory"
# The sweep has a queue of its own, which every worker of the memory queue also consumes
# (chatmem_project.celery adds it): Redis hands a worker its queues in turn (kombu's
# round_robin queue_order_strategy), so a sweep waits behind at most one fold task per worker
# instead of behind the whole backlog, where it expired unrun exactly when workers fell behind.
MEMORY_SWEEP_QUEUE = "memory-sweep"
CELERY_TASK_ROUTES = {
    "chatmem.sweep": {"queue": MEMORY_SWEEP_QUEUE},
    "chatmem.recover_runs": {"queue": MEMORY_SWEEP_QUEUE},
    "chatmem.*": {"queue": "memory"},
}
CELERY_TASK_ACKS_LATE = True
CELERY_TASK_REJECT_ON_WORKER_LOST = True
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
CELERY_TASK_SOFT_TIME_LIMIT = MEMORY_TASK_SOFT_TIME_LIMIT
CELERY_TASK_TIME_LIMIT = MEMORY_TASK_TIME_LIMIT
CELERY_BROKER_TRANSPORT_OPTIONS = {
    "visibility_timeout": BROKER_VISIBILITY_TIMEOUT,
    # A turn must not hang on a dead or stalled broker: fail fast, log, let the sweep find the
    # chat. Workers and beat take BROKER_SOCKET_TIMEOUT_SECONDS when they start
    # (chatmem_project.celery): their blocking reads and publishes are not a turn's.
    "socket_connect_timeout": REDIS_REQUEST_TIMEOUT_SECONDS,
    "socket_timeout": REDIS_REQUEST_TIMEOUT_SECONDS,
    "max_retries": 0,
}
CELERY_BROKER_CONNECTION_TIMEOUT = REDIS_REQUEST_TIMEOUT_SECONDS
# A publish waits at most this long for one of the process's broker_pool_limit (10) producers:
# with gevent, hundreds of turns in a process wait on a broker that stopped answering (each call
# until its socket timeout), unbounded by default, while a turn's answer waits on its publish.
CELERY_BROKER_POOL_ACQUIRE_TIMEOUT = 2.0
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
CELERY_TASK_PUBLISH_RETRY = False
CELERY_WORKER_HIJACK_ROOT_LOGGER = False
# Beat touches "<schedule file>.alive" on each tick, and ticks at least once a minute: its
# healthcheck (docker-compose.yml) calls a file older than a few ticks a hung beat.
CELERY_BEAT_SCHEDULER = "chatmem_project.beat:LivenessScheduler"
CELERY_BEAT_MAX_LOOP_INTERVAL = 60
# No Celery expiry: beat would stamp it with its clock and the worker judge it by its own, so a
# worker ahead of beat by more than an interval would discard every pass. A pass that comes
# less than half an interval after another (a backlog while no worker ran) skips itself instead,
# by database time (memory_worker.scheduling.sweep.beat_pass_due).
CELERY_BEAT_SCHEDULE = {
    "chatmem-sweep": {
        "task": "chatmem.sweep",
        "schedule": MEMORY_SWEEP_INTERVAL_SECONDS,
        "kwargs": {"scheduled": True},
        "options": {"queue": MEMORY_SWEEP_QUEUE},
    },
    "chatmem-recover-runs": {
        "task": "chatmem.recover_runs",
        "schedule": MEMORY_RECOVERY_INTERVAL_SECONDS,
        "kwargs": {"scheduled": True},
        "options": {"queue": MEMORY_SWEEP_QUEUE},
    },
}

# --- Models ---------------------------------------------------------------------------------
OPENAI_BASE_URL = env("OPENAI_BASE_URL", default="") or None
OPENAI_API_KEY = env("OPENAI_API_KEY", default="")
CHAT_MODEL = env_text("CHAT_MODEL", "gpt-4o-mini")
CHAT_MODEL_CONTEXT_TOKENS = env_int("CHAT_MODEL_CONTEXT_TOKENS", 128000)
# Extra variants a turn may pick: "name=model:context_tokens,..." (conversations.variants).
MODEL_VARIANTS = env("MODEL_VARIANTS", default="")
# Each model's tokenizer: "model=encoding_or_tokenizer.json,..." (a tiktoken encoding name, or
# the path of a Hugging Face tokenizer.json, read offline); docs/operations.md.
MODEL_TOKENIZERS = env("MODEL_TOKENIZERS", default="")
# Every token count is multiplied by this (a tokenizer close to, not exactly, the server's).
TOKEN_COUNT_MARGIN = env_float("TOKEN_COUNT_MARGIN", 1.0)
# A model with neither a tokenizer here nor a tiktoken mapping is counted with cl100k, its
# non-Latin text this many times over (small models' tokenizers need up to 1.85x).
UNKNOWN_MODEL_NON_LATIN_MARGIN = env_float("UNKNOWN_MODEL_NON_LATIN_MARGIN", 2.2)
# "openai" or "offline"; empty = openai when OPENAI_BASE_URL or OPENAI_API_KEY is set, else
# offline.
CHAT_BACKEND = env("CHAT_BACKEND", default="")
# The field of a Chat Completions request that carries its output limit, for the summarizer
# and chat turns alike: "auto" (max_completion_tokens for OpenAI's own API, max_tokens for any
# other endpoint), "max_completion_tokens", "max_tokens" or "both".
OPENAI_TOKEN_LIMIT_FIELD = env_text("OPENAI_TOKEN_LIMIT_FIELD", "auto")
# A chat reply's output limit in tokens; 0 = a quarter of the variant's context window, at most
# 4096. Never more than the window has left after the prompt.
CHAT_MAX_REPLY_TOKENS = env_int("CHAT_MAX_REPLY_TOKENS", 0)
# The model variants a chat's prompt_cache_key is sent to ("*": every one; "": none): OpenAI
# routes a chat's requests by it to where its prompt prefix is cached. An endpoint that refuses
# the parameter is asked again without it and not sent it again.
PROMPT_CACHE_KEY_VARIANTS = env("PROMPT_CACHE_KEY_VARIANTS", default="*")

# --- Memory ---------------------------------------------------------------------------------
MEMORY_POLICY = env_text("MEMORY_POLICY", "sliding-window")
MEMORY_SUMMARIZER_MODEL = env_text("MEMORY_SUMMARIZER_MODEL", "gpt-4o-mini")
# "chat" (Chat Completions), "responses" (a hosted prompt id and version), "offline";
# empty = chat when OPENAI_BASE_URL or OPENAI_API_KEY is set, else offline.
MEMORY_SUMMARIZER_BACKEND = env("MEMORY_SUMMARIZER_BACKEND", default="")
MEMORY_SUMMARY_TOKEN_CAP = env_int("MEMORY_SUMMARY_TOKEN_CAP", 500)
MEMORY_SUMMARIZER_INPUT_BUDGET = env_int("MEMORY_SUMMARIZER_INPUT_BUDGET", 12000)
PROMPT_ID_SUMMARY_GLOBAL = env_text(
    "PROMPT_ID_SUMMARY_GLOBAL", "pmpt_6917ebe9367c819396fe4840cf0f0e050c18a965a3366120"
)
PROMPT_VERSION_SUMMARY_GLOBAL = env("PROMPT_VERSION_SUMMARY_GLOBAL", default="") or None

# --- Turns ----------------------------------------------------------------------------------
CHATMEM_MAX_MESSAGE_CHARS = env_int("CHATMEM_MAX_MESSAGE_CHARS", 32000)
# Turns cost model calls: limited per user ("120/min"; empty = off), counted in the shared cache
# (Redis when configured, so the limit holds across web processes). conversations/throttling.py
TURN_RATE_LIMIT = env("TURN_RATE_LIMIT", default="120/min")
# Manual folds (POST .../consolidate/) per user, counted the same way ("12/min"; empty = off):
# each may be a summarizer call, and one queued per chat is all a chat gets anyway.
MEMORY_MANUAL_FOLD_RATE_LIMIT = env("MEMORY_MANUAL_FOLD_RATE_LIMIT", default="12/min")
# Requests with a larger body are refused with 413 before anything reads them.
CHATMEM_MAX_BODY_BYTES = env_int("CHATMEM_MAX_BODY_BYTES", 1024 * 1024)
DATA_UPLOAD_MAX_MEMORY_SIZE = CHATMEM_MAX_BODY_BYTES
CHATMEM_DEFAULT_SYSTEM_PROMPT = env(
    "CHATMEM_DEFAULT_SYSTEM_PROMPT", default="You are a helpful assistant."
)
# A turn slot older than this is taken to belong to a dead process; it must outlast the model
# deadline so a live turn is never pre-empted.
TURN_SLOT_STALE_SECONDS = env_float("TURN_SLOT_STALE_SECONDS", LLM_TIMEOUT_SECONDS + 30)
# The longest a turn holds its web worker: a wait for a fold in flight (up to
# MEMORY_LLM_TIMEOUT_SECONDS), its own synchronous fold (its chunks stop by the turn's fold
# deadline, memory_worker.coordination.deadlines.turn_fold_deadline: within as long again), then
# the slot is renewed and the model answers within the slot's lifetime (its deadline and a
# margin). A stopping web server (a deploy) lets the turns in flight
# finish for this long: gunicorn.conf.py's graceful_timeout; docker-compose.yml's web
# stop_grace_period must exceed it. (Not an environment knob: it follows the deadlines.)
WEB_GRACEFUL_TIMEOUT_SECONDS = 2 * MEMORY_LLM_TIMEOUT_SECONDS + TURN_SLOT_STALE_SECONDS
# A streamed turn sends an SSE comment after this many idle seconds (a synchronous fold, a slow
# first token), so proxies do not drop the connection as idle. (Not an environment knob.)
TURN_STREAM_HEARTBEAT_SECONDS = 15.0

# --- Logging --------------------------------------------------------------------------------
LOG_LEVEL = env_text("LOG_LEVEL", "INFO")
# /metrics (Prometheus): open by default, like /healthz; set a token to require
# "Authorization: Bearer <token>". WORKER_METRICS_PORT: Celery workers serve theirs there.
METRICS_TOKEN = env("METRICS_TOKEN", default="")
# The memory gauges cost one aggregate over every chat (seconds with millions): computed at most
# once per this many seconds per process, and given up (the last value reported instead) past a
# statement timeout on PostgreSQL, so that scraping, open by default, cannot load the database.
# (Not environment knobs.)
METRICS_STATE_CACHE_SECONDS = 30.0
METRICS_STATE_QUERY_TIMEOUT_SECONDS = 5.0
WORKER_METRICS_PORT = env_int("WORKER_METRICS_PORT", 0)
LOGGING = logging_config(LOG_LEVEL)

# --- Consolidation ---------------------------------------------------------------------------
# "celery" (REDIS_URL set), "inline" (embedded: an in-process background thread) or "off".
# Empty (as .env.example leaves it) means the default, not "no dispatch".
MEMORY_DISPATCH = env("MEMORY_DISPATCH", default="") or ("celery" if REDIS_URL else "inline")
MEMORY_FAILURE_BACKOFF_SECONDS = env_float("MEMORY_FAILURE_BACKOFF_SECONDS", 30.0)
MEMORY_FAILURE_BACKOFF_MAX_SECONDS = env_float("MEMORY_FAILURE_BACKOFF_MAX_SECONDS", 3600.0)
MEMORY_DEGRADED_AFTER_FAILURES = env_int("MEMORY_DEGRADED_AFTER_FAILURES", 3)
# The first invalid summary (empty, cut off, not a summary) of a streak is retried this soon,
# with the stricter prompt; only a repeat climbs the backoff ladder.
MEMORY_INVALID_OUTPUT_RETRY_SECONDS = env_float("MEMORY_INVALID_OUTPUT_RETRY_SECONDS", 5.0)
# "offline": a background fold the model summarizer failed, with no fast retry left, commits the
# offline summarizer's summary instead (a fallback, until the next model fold). Empty: off.
MEMORY_SUMMARIZER_FALLBACK = env("MEMORY_SUMMARIZER_FALLBACK", default="").strip()
# The sweep only looks at chats whose last fold is at least this old (the shortest cooldown).
MEMORY_SWEEP_MIN_COOLDOWN_SECONDS = env_float("MEMORY_SWEEP_MIN_COOLDOWN_SECONDS", 60.0)
MEMORY_SWEEP_BATCH = env_int("MEMORY_SWEEP_BATCH", 500)
# Failed, superseded, interrupted and nothing-to-fold ledger rows older than this are deleted by
# the sweep (0 = keep them all); succeeded rows stay: they prove coverage of 1..W.
MEMORY_LEDGER_RETENTION_DAYS = env_int("MEMORY_LEDGER_RETENTION_DAYS", 30)
# Flush hooks (docs/policies.md, token-budget): dotted paths of callables hook(chat_id, messages,
# version), each run as its own task after a fold commits.
MEMORY_FLUSH_HOOKS = env.list("MEMORY_FLUSH_HOOKS", default=[])
# The daily tier: a built-in flush hook that extracts durable facts from folded messages
# into one note per chat and day ("offline": deterministic rules; "chat": one model call).
MEMORY_DAILY_NOTES = env_bool("MEMORY_DAILY_NOTES", True)
MEMORY_DAILY_NOTES_BACKEND = env_text("MEMORY_DAILY_NOTES_BACKEND", "offline")
if MEMORY_DAILY_NOTES and "memory_worker.daily_notes.extract_daily_notes" not in MEMORY_FLUSH_HOOKS:
    MEMORY_FLUSH_HOOKS.append("memory_worker.daily_notes.extract_daily_notes")

# --- Agent state (the Summarize step after replies, docs/agent-state.md) --------------------
# The seed's constants, under the seed's names. FULL_DETAIL_TURNS is the turn-digest preset's
# tail_turns: memory_worker.knobs applies it (a chat's effective_policy shows it); this copy
# is the seed's constant under its name, not among the state endpoint's limits.
SUMMARIZE_THRESHOLD = env_int("SUMMARIZE_THRESHOLD", 400)
FULL_DETAIL_TURNS = env_int("FULL_DETAIL_TURNS", 3)
FULL_DETAIL_STEPS = env_int("FULL_DETAIL_STEPS", 3)
PENDING_TTL_TURNS = env_int("PENDING_TTL_TURNS", 3)
# Bounds the seed leaves open: active entities go into every context, step summaries into a row.
AGENT_MAX_ACTIVE_ENTITIES = env_int("AGENT_MAX_ACTIVE_ENTITIES", 20)
AGENT_MAX_STEP_SUMMARIES = env_int("AGENT_MAX_STEP_SUMMARIES", 50)
# The entity registry (every entity a chat's turns named) is rewritten with every turn.
AGENT_MAX_REGISTRY_ENTITIES = env_int("AGENT_MAX_REGISTRY_ENTITIES", 500)
# The agent-state system message is counted with the system prompt, which folding cannot
# shrink: bounded so that no agent object can push every later turn over the model's window.
AGENT_CONTEXT_MAX_TOKENS = env_int("AGENT_CONTEXT_MAX_TOKENS", 1000)
# "llm", "offline", or empty = the chat backend's choice (llm when an API key is configured).
AGENT_SUMMARY_BACKEND = env("AGENT_SUMMARY_BACKEND", default="")
AGENT_SUMMARY_MODEL = env("AGENT_SUMMARY_MODEL", default="")  # empty = CHAT_MODEL

# Operator defaults per preset: None reads them from the environment (the sliding-window and
# chunked knobs, docs/policies.md; memory_worker.knobs, once, when the app is ready, so these
# settings load without the engine); a dict {preset: {knob: value}} sets them here instead. A
# chat's own policy_overrides win over either.
MEMORY_PRESET_ENV_OVERRIDES: dict[str, dict[str, object]] | None = None
