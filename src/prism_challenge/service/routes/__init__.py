"""The service's routers (FastAPI "Bigger Applications" layout): :mod:`.submit` (intake),
:mod:`.read` (submissions, leaderboard, weights), :mod:`.ops` (health, version, metrics)."""
