"""Folding: a chat's snapshot and effective policy read from the database, a fold executed and
committed with one conditional UPDATE, its ledger row, a failure's class and retry, ranges a
provider keeps refusing split up, and a person's summary edit fenced like a fold."""
