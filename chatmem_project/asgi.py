import os

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "chatmem_project.settings")
django_application = get_asgi_application()

from conversations.middleware import AsgiBodySizeLimit  # noqa: E402  (after Django's setup)

application = AsgiBodySizeLimit(django_application)
