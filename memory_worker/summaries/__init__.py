"""The summarizers: their contract, the backends (Chat Completions, the Responses API, offline),
what may be written (validation), and the fold guard that checks a draft against what it
replaces and repairs it."""
