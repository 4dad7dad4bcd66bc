"""The exact message list the model receives (DESIGN §3 step 3): the system prompt, the agent
state (seed 004: session theme, active entities, pending clarification) as a system message when
there is one, the summary as a system message when non-empty, every unfolded message verbatim in
order, then the new user message."""

from conversations.models import Chat, Message, Role

SUMMARY_HEADER = "Summary of the earlier conversation (memory):\n\n"


def model_message(message: Message) -> dict[str, object]:
    entry: dict[str, object] = {"role": message.role, "content": message.content}
    # Tool traffic must reach the model in the shape it was produced in.
    for key in ("tool_calls", "tool_call_id", "name"):
        if key in message.metadata:
            entry[key] = message.metadata[key]
    return entry


def build_model_messages(
    chat: Chat,
    summary: str,
    unfolded: tuple[Message, ...],
    new_user_content: str | None = None,
    agent_context: str = "",
) -> list[dict[str, object]]:
    messages: list[dict[str, object]] = []
    if chat.system_prompt:
        messages.append({"role": Role.SYSTEM.value, "content": chat.system_prompt})
    if agent_context:  # counted in the bound by memory_worker.state.agent_context_tokens
        messages.append({"role": Role.SYSTEM.value, "content": agent_context})
    if summary:
        messages.append({"role": Role.SYSTEM.value, "content": SUMMARY_HEADER + summary})
    messages.extend(model_message(message) for message in unfolded)
    if new_user_content is not None:
        messages.append({"role": Role.USER.value, "content": new_user_content})
    return messages
