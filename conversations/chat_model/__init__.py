"""The model client, plain Python loaded before Django's apps: the chat model's contract and its
backends (an OpenAI-compatible endpoint, offline), the transport every model call uses (the
turn's and the summarizers'), token counting with bundled encodings, storable text."""
