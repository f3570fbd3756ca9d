"""The service's routers (FastAPI "Bigger Applications" layout): :mod:`.submit` (intake),
:mod:`.read` (submissions, leaderboard, weights), :mod:`.ops` (health, version, metrics),
:mod:`.pages` (the web pages); :mod:`.auth` holds the signature and token checks."""
