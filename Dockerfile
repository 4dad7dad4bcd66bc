FROM python:3.11-slim
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
# A container is a deployment: with no DEBUG and SECRET_KEY given it refuses to serve with the
# public development key (chatmem_project.boot) instead of running as an unconfigured checkout.
ENV DEBUG=false
WORKDIR /app
COPY pyproject.toml README.md ./
COPY chatmem_project ./chatmem_project
COPY conversations ./conversations
COPY memory_worker ./memory_worker
COPY manage.py gunicorn.conf.py ./
# The admin's and Swagger UI's files, collected into STATIC_ROOT (/app/staticfiles) for WhiteNoise
# to serve from gunicorn (conversations.middleware.StaticFilesMiddleware).
RUN pip install --no-cache-dir ".[gevent]" && python manage.py collectstatic --noinput
# o200k_base's ranks (gpt-4o and later, the default CHAT_MODEL) for exact token counts offline:
# tiktoken's cache files out of litellm's wheel (any platform's: only its data is read), not
# litellm itself (280 MB with its dependencies). Checked against tiktoken's hash when loaded.
ENV TIKTOKEN_RANKS_DIR=/app/tiktoken-ranks
RUN pip download --no-cache-dir --no-deps --only-binary=:all: --platform manylinux_2_28_x86_64 \
      --python-version 3.11 --dest /tmp/litellm "litellm==1.110.2" \
    && python -m memory_worker.bundled_encodings /tmp/litellm/litellm-*.whl "$TIKTOKEN_RANKS_DIR" \
    && rm -rf /tmp/litellm
RUN useradd --create-home chatmem
USER chatmem
EXPOSE 8000
CMD ["gunicorn", "chatmem_project.wsgi:application", "--bind", "0.0.0.0:8000", "--workers", "2", "--threads", "8"]
