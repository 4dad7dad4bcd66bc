import os

from django.core.wsgi import get_wsgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "chatmem_project.settings")
django_application = get_wsgi_application()

from conversations.middleware import WsgiChunkedBody  # noqa: E402  (needs the apps loaded)

application = WsgiChunkedBody(django_application)
