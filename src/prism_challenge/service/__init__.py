"""The challenge service (issue 17). So far: the storage layer (:mod:`.store`, :mod:`.models`,
Alembic migrations under ``migrations/``), which keeps submitters, submissions, attempts, runs
and nonces, and the state machine of a submission."""
