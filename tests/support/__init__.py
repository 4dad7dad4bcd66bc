"""What tests and benchmarks share: the fake OpenAI-compatible server, real worker processes,
the ledger's invariants, the import graph's reader. Not tests themselves."""
