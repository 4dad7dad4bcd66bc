"""The agent state's side of memory (docs/agent-state.md): what a turn applies to it, and its
Summarize step off the request path."""
