from django.apps import AppConfig


class ConversationsConfig(AppConfig):
    name = "conversations"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from conversations import checks  # noqa: F401  (registers the checks)
        from conversations.services.agent_state import ChatAgentModel
        from memory_worker.memory import use_agent_model

        # The worker's agent-state summaries ask the chat model, which lives on the web side.
        use_agent_model(ChatAgentModel())
