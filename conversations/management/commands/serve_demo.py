"""The embedded quickstart: migrate, make a demo user with a token, print the URL and the token,
then serve on 127.0.0.1:8000 (SQLite, in-process consolidation, offline model unless configured)."""

from argparse import ArgumentParser
from typing import Any

from django.core.management import call_command
from django.core.management.base import BaseCommand


class Command(BaseCommand):
    help = "Run chatmem locally with a ready demo user and API token."

    def add_arguments(self, parser: ArgumentParser) -> None:
        parser.add_argument("--addrport", default="127.0.0.1:8000")
        parser.add_argument("--username", default="demo")

    def handle(self, *args: Any, **options: Any) -> None:
        from django.contrib.auth import get_user_model
        from rest_framework.authtoken.models import Token

        from conversations.services.backends import chat_backend_name

        call_command("migrate", interactive=False, verbosity=0)
        user, created = get_user_model().objects.get_or_create(username=options["username"])
        if created:
            user.set_password("demo-password")
            user.is_staff = user.is_superuser = True
            user.save()
        token, _ = Token.objects.get_or_create(user=user)
        url = f"http://{options['addrport']}"
        self.stdout.write(
            f"\nchatmem is serving at {url}/api/v1/  (model backend: {chat_backend_name()})\n"
            f"API token for user '{user.get_username()}': {token.key}\n"
            f"Admin: {url}/admin/  (user {user.get_username()}, password demo-password)\n\n"
            f"Try:\n"
            f"  curl -s -X POST {url}/api/v1/chats/ -H 'Authorization: Token {token.key}' "
            f"-H 'Content-Type: application/json' -d '{{\"title\": \"first chat\"}}'\n"
        )
        call_command("runserver", options["addrport"], use_reloader=False)
