"""When folds run: one run per chat at a time under its lock with reruns chained, the fold a turn
needs before its model call, a manual fold, the beat sweep, and catching up once a provider
recovers."""
