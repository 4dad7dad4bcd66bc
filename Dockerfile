FROM python:3.11-slim
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
WORKDIR /app
COPY pyproject.toml README.md ./
COPY chatmem_project ./chatmem_project
COPY conversations ./conversations
COPY memory_worker ./memory_worker
COPY manage.py gunicorn.conf.py ./
RUN pip install --no-cache-dir ".[gevent]" && python manage.py collectstatic --noinput
RUN useradd --create-home chatmem
USER chatmem
EXPOSE 8000
CMD ["gunicorn", "chatmem_project.wsgi:application", "--bind", "0.0.0.0:8000", "--workers", "2", "--threads", "8"]
