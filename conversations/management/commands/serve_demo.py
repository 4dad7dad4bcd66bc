"""The embedded quickstart: migrate, make a demo user with a token, print the URL and the token,
then serve on 127.0.0.1:8000 (SQLite, in-process consolidation, offline model unless configured)."""

from argparse import ArgumentParser
from typing import Any

from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.management import call_command
from django.core.management.base import BaseCommand, CommandError
from django.db import connection
from rest_framework.authtoken.models import Token

from conversations.services.chat_backend import chat_backend_name

DEMO_PASSWORD = "demo-password"
ANY_ADDRESS = ("0.0.0.0", "::", "[::]")


class Command(BaseCommand):
    help = "Run chatmem locally with a ready demo user and API token (embedded SQLite only)."

    def add_arguments(self, parser: ArgumentParser) -> None:
        parser.add_argument("--addrport", default="127.0.0.1:8000")
        parser.add_argument("--username", default="demo")

    def handle(self, *args: Any, **options: Any) -> None:
        if connection.vendor != "sqlite":
            # It makes a superuser with a password printed here: never on a real database.
            raise CommandError(
                "serve_demo runs on the embedded SQLite database only (it creates a superuser "
                f"with a known password); DATABASE_URL points at {connection.vendor}. Serve "
                "with gunicorn as docs/operations.md shows."
            )
        call_command("migrate", interactive=False, verbosity=0)
        user, created = get_user_model().objects.get_or_create(username=options["username"])
        if created:
            user.set_password(DEMO_PASSWORD)
            user.is_staff = user.is_superuser = True
            user.save()
        token, _ = Token.objects.get_or_create(user=user)
        url = f"http://{self.reachable(options['addrport'])}"
        self.stdout.write(
            f"\nchatmem is serving at {url}/api/v1/  (model backend: {chat_backend_name()})\n"
            f"API token for user '{user.get_username()}': {token.key}\n"
            f"Admin: {url}/admin/  ({admin_login(user, created)})\n\n"
            f"Try:\n"
            f"  curl -s -X POST {url}/api/v1/chats/ -H 'Authorization: Token {token.key}' "
            f"-H 'Content-Type: application/json' -d '{{\"title\": \"first chat\"}}'\n"
        )
        call_command("runserver", options["addrport"], use_reloader=False)

    def reachable(self, addrport: str) -> str:
        """The address to print: a server bound to every interface is reached at 127.0.0.1
        (a client sending "Host: 0.0.0.0" is refused by ALLOWED_HOSTS)."""
        host, _, port = addrport.rpartition(":")
        if host in ANY_ADDRESS:
            hosts = settings.ALLOWED_HOSTS
            self.stdout.write(
                f"Serving on every interface: other machines reach it only by a name in "
                f"ALLOWED_HOSTS (now {', '.join(hosts) or 'none'})."
            )
            return f"127.0.0.1:{port}"
        return addrport if host else f"127.0.0.1:{port}"


def admin_login(user: Any, created: bool) -> str:
    name = user.get_username()
    if created:
        return f"user {name}, password {DEMO_PASSWORD}"
    if not user.is_staff:
        return f"user {name} existed before and is not staff: use createsuperuser"
    # The demo password is a constant, so whether it still opens the account is knowable: a
    # second run said "its own password" of a user still on the one printed the first time.
    if user.check_password(DEMO_PASSWORD):
        return f"user {name}, password {DEMO_PASSWORD} (unchanged since the first run)"
    return f"user {name} existed before, with a password of its own (not {DEMO_PASSWORD})"
