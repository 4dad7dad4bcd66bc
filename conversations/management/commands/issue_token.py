"""Print an API token for a user (only the key, so scripts can capture it)."""

from argparse import ArgumentParser
from typing import Any

from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError
from rest_framework.authtoken.models import Token

from conversations.management.usernames import checked_username, find_user


class Command(BaseCommand):
    help = "Print the API token of USERNAME (creating the token, and the user with --create-user)."

    def add_arguments(self, parser: ArgumentParser) -> None:
        parser.add_argument("username")
        parser.add_argument("--create-user", action="store_true", help="create the user if missing")
        parser.add_argument(
            "--rotate", action="store_true", help="revoke the old key, issue a new one"
        )
        parser.add_argument("--revoke", action="store_true", help="delete the user's token")

    def handle(self, *args: Any, **options: Any) -> None:
        user_model = get_user_model()
        username = options["username"]
        user = find_user(username)
        if user is None:
            if not options["create_user"]:
                raise CommandError(f'No user "{username}"; pass --create-user to create it.')
            name = checked_username(username)  # CommandError for a name the model would refuse
            user = user_model.objects.create_user(**{user_model.USERNAME_FIELD: name})
        if options["revoke"]:
            Token.objects.filter(user=user).delete()
            return
        if options["rotate"]:
            Token.objects.filter(user=user).delete()
        token, _ = Token.objects.get_or_create(user=user)
        self.stdout.write(token.key)
