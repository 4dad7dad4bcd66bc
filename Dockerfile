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
RUN useradd --create-home chatmem
USER chatmem
EXPOSE 8000
CMD ["gunicorn", "chatmem_project.wsgi:application", "--bind", "0.0.0.0:8000", "--workers", "2", "--threads", "8"]
