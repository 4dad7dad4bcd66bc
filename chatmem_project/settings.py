"""chatmem settings. Every value comes from the environment (or a ``.env`` file); the defaults
are the embedded mode: SQLite, consolidation in-process, the offline model, no API key.
``.env.example`` lists every setting."""

from pathlib import Path

import environ

BASE_DIR = Path(__file__).resolve().parent.parent

env = environ.Env()
environ.Env.read_env(BASE_DIR / ".env", overwrite=False)

DEBUG = env.bool("DEBUG", default=False)
SECRET_KEY = env("SECRET_KEY", default="django-insecure-chatmem-local-only-set-SECRET_KEY")
ALLOWED_HOSTS = env.list("ALLOWED_HOSTS", default=["127.0.0.1", "localhost"])
CSRF_TRUSTED_ORIGINS = env.list("CSRF_TRUSTED_ORIGINS", default=[])

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "rest_framework",
    "rest_framework.authtoken",
    "conversations",
    "memory_worker",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
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
DATABASES = {"default": env.db("DATABASE_URL", default=f"sqlite:///{BASE_DIR / 'db.sqlite3'}")}
# Persistent connections: a turn should not pay for a new PostgreSQL connection.
DATABASES["default"]["CONN_MAX_AGE"] = env.int("DB_CONN_MAX_AGE", default=60)
DATABASES["default"]["CONN_HEALTH_CHECKS"] = True
if DATABASES["default"]["ENGINE"] == "django.db.backends.sqlite3":
    # The embedded default has two writers (requests and the in-process fold runner). BEGIN
    # IMMEDIATE takes the write lock up front, so a writer waits (timeout) instead of failing
    # with "database is locked" on a read-to-write upgrade; WAL lets readers run meanwhile.
    DATABASES["default"].setdefault("OPTIONS", {}).update(
        {"timeout": 20, "transaction_mode": "IMMEDIATE", "init_command": "PRAGMA journal_mode=WAL;"}
    )
    # Tests on SQLite use a file like the embedded default does: an in-memory shared-cache
    # database fails at once with "table is locked" when the in-process runner writes.
    DATABASES["default"]["TEST"] = {"NAME": str(BASE_DIR / "test_db.sqlite3")}
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.UserAttributeSimilarityValidator"},
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
    {"NAME": "django.contrib.auth.password_validation.CommonPasswordValidator"},
    {"NAME": "django.contrib.auth.password_validation.NumericPasswordValidator"},
]

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True
STATIC_URL = "static/"
STATIC_ROOT = env("STATIC_ROOT", default=str(BASE_DIR / "staticfiles"))

# --- REST API -------------------------------------------------------------------------------
REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": [
        # Token first: its WWW-Authenticate header makes unauthenticated requests a 401.
        "rest_framework.authentication.TokenAuthentication",
        "rest_framework.authentication.SessionAuthentication",
    ],
    "DEFAULT_PERMISSION_CLASSES": ["rest_framework.permissions.IsAuthenticated"],
    "DEFAULT_PAGINATION_CLASS": "conversations.api.pagination.StandardPagination",
    "PAGE_SIZE": 50,
    "DEFAULT_RENDERER_CLASSES": ["rest_framework.renderers.JSONRenderer"],
    "DEFAULT_PARSER_CLASSES": ["rest_framework.parsers.JSONParser"],
    "EXCEPTION_HANDLER": "conversations.api.errors.exception_handler",
}

# --- Redis, Celery --------------------------------------------------------------------------
# Unset = embedded mode: consolidation runs on an in-process background thread.
REDIS_URL = env("REDIS_URL", default="")

LLM_TIMEOUT_SECONDS = env.float("LLM_TIMEOUT_SECONDS", default=60.0)
MEMORY_LLM_TIMEOUT_SECONDS = env.float("MEMORY_LLM_TIMEOUT_SECONDS", default=60.0)
# Ordered deadlines (DESIGN §6): LLM < soft < hard < lock TTL < broker visibility timeout.
MEMORY_TASK_SOFT_TIME_LIMIT = env.int("MEMORY_TASK_SOFT_TIME_LIMIT", default=240)
MEMORY_TASK_TIME_LIMIT = env.int("MEMORY_TASK_TIME_LIMIT", default=300)
MEMORY_LOCK_TTL_SECONDS = env.int("MEMORY_LOCK_TTL_SECONDS", default=360)
BROKER_VISIBILITY_TIMEOUT = env.int("BROKER_VISIBILITY_TIMEOUT", default=3600)
MEMORY_SWEEP_INTERVAL_SECONDS = env.float("MEMORY_SWEEP_INTERVAL_SECONDS", default=60.0)
# How many policy re-evaluations one task runs while holding the lock before handing on.
MEMORY_MAX_RERUNS_PER_TASK = env.int("MEMORY_MAX_RERUNS_PER_TASK", default=5)

CELERY_BROKER_URL = REDIS_URL or "memory://"
CELERY_RESULT_BACKEND = None
CELERY_TASK_IGNORE_RESULT = True
CELERY_TASK_DEFAULT_QUEUE = "memory"
CELERY_TASK_ROUTES = {"chatmem.*": {"queue": "memory"}}
CELERY_TASK_ACKS_LATE = True
CELERY_TASK_REJECT_ON_WORKER_LOST = True
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
CELERY_TASK_SOFT_TIME_LIMIT = MEMORY_TASK_SOFT_TIME_LIMIT
CELERY_TASK_TIME_LIMIT = MEMORY_TASK_TIME_LIMIT
CELERY_BROKER_TRANSPORT_OPTIONS = {
    "visibility_timeout": BROKER_VISIBILITY_TIMEOUT,
    # A turn must not hang on a dead broker: fail fast, log, let the sweep find the chat.
    "socket_connect_timeout": 2,
    "socket_timeout": 5,
    "max_retries": 0,
}
CELERY_BROKER_CONNECTION_TIMEOUT = 2
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
CELERY_TASK_PUBLISH_RETRY = False
CELERY_WORKER_HIJACK_ROOT_LOGGER = False
CELERY_BEAT_SCHEDULE = {
    "chatmem-sweep": {
        "task": "chatmem.sweep",
        "schedule": MEMORY_SWEEP_INTERVAL_SECONDS,
        # A sweep that could not run in time is useless: the next one covers it.
        "options": {"expires": MEMORY_SWEEP_INTERVAL_SECONDS, "queue": "memory"},
    },
}

# --- Models ---------------------------------------------------------------------------------
OPENAI_BASE_URL = env("OPENAI_BASE_URL", default="") or None
OPENAI_API_KEY = env("OPENAI_API_KEY", default="")
CHAT_MODEL = env("CHAT_MODEL", default="gpt-4o-mini")
CHAT_MODEL_CONTEXT_TOKENS = env.int("CHAT_MODEL_CONTEXT_TOKENS", default=128000)
# Extra variants a turn may pick: "name=model:context_tokens,..." (seed 003 §6).
MODEL_VARIANTS = env("MODEL_VARIANTS", default="")
# "openai" or "offline"; empty = openai when OPENAI_API_KEY is set, else offline.
CHAT_BACKEND = env("CHAT_BACKEND", default="")

# --- Memory ---------------------------------------------------------------------------------
MEMORY_POLICY = env("MEMORY_POLICY", default="sliding-window")
MEMORY_SUMMARIZER_MODEL = env("MEMORY_SUMMARIZER_MODEL", default="gpt-4o-mini")
# "chat" (Chat Completions), "responses" (hosted prompt, seed 003), "offline";
# empty = chat when OPENAI_API_KEY is set, else offline.
MEMORY_SUMMARIZER_BACKEND = env("MEMORY_SUMMARIZER_BACKEND", default="")
MEMORY_SUMMARY_TOKEN_CAP = env.int("MEMORY_SUMMARY_TOKEN_CAP", default=500)
MEMORY_SUMMARIZER_INPUT_BUDGET = env.int("MEMORY_SUMMARIZER_INPUT_BUDGET", default=12000)
PROMPT_ID_SUMMARY_GLOBAL = env(
    "PROMPT_ID_SUMMARY_GLOBAL", default="pmpt_6917ebe9367c819396fe4840cf0f0e050c18a965a3366120"
)
PROMPT_VERSION_SUMMARY_GLOBAL = env("PROMPT_VERSION_SUMMARY_GLOBAL", default="") or None

# --- Turns ----------------------------------------------------------------------------------
CHATMEM_MAX_MESSAGE_CHARS = env.int("CHATMEM_MAX_MESSAGE_CHARS", default=32000)
CHATMEM_DEFAULT_SYSTEM_PROMPT = env(
    "CHATMEM_DEFAULT_SYSTEM_PROMPT", default="You are a helpful assistant."
)
# A turn slot older than this is taken to belong to a dead process; it must outlast the model
# deadline so a live turn is never pre-empted.
TURN_SLOT_STALE_SECONDS = env.float("TURN_SLOT_STALE_SECONDS", default=LLM_TIMEOUT_SECONDS + 30)

# --- Logging --------------------------------------------------------------------------------
LOG_LEVEL = env("LOG_LEVEL", default="INFO")
LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"json": {"()": "chatmem_project.logs.JsonFormatter"}},
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "json"}},
    "root": {"handlers": ["console"], "level": LOG_LEVEL},
    "loggers": {
        "django.db.backends": {"level": "WARNING"},
        "httpx": {"level": "WARNING"},
        "httpx2": {"level": "WARNING"},
        "httpcore": {"level": "WARNING"},
        "openai": {"level": "WARNING"},
    },
}

# --- Consolidation ---------------------------------------------------------------------------
# "celery" (REDIS_URL set), "inline" (embedded: an in-process background thread) or "off".
MEMORY_DISPATCH = env("MEMORY_DISPATCH", default="celery" if REDIS_URL else "inline")
MEMORY_FAILURE_BACKOFF_SECONDS = env.float("MEMORY_FAILURE_BACKOFF_SECONDS", default=30.0)
MEMORY_FAILURE_BACKOFF_MAX_SECONDS = env.float("MEMORY_FAILURE_BACKOFF_MAX_SECONDS", default=3600.0)
MEMORY_DEGRADED_AFTER_FAILURES = env.int("MEMORY_DEGRADED_AFTER_FAILURES", default=3)
# The sweep only looks at chats whose last fold is at least this old (the shortest cooldown).
MEMORY_SWEEP_MIN_COOLDOWN_SECONDS = env.float("MEMORY_SWEEP_MIN_COOLDOWN_SECONDS", default=60.0)
MEMORY_SWEEP_BATCH = env.int("MEMORY_SWEEP_BATCH", default=500)
# Seed 002's flush hooks: dotted paths of callables hook(chat_id, messages, version), each run
# as its own task after a fold commits.
MEMORY_FLUSH_HOOKS = env.list("MEMORY_FLUSH_HOOKS", default=[])

# Operator defaults per preset, from the environment (seed 003 §10 and seed 001 knobs); a chat's
# own policy_overrides win over these. Filled in by memory_worker.env_knobs.
from memory_worker.env_knobs import preset_env_overrides  # noqa: E402

MEMORY_PRESET_ENV_OVERRIDES = preset_env_overrides(env)
