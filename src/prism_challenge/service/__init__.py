"""The challenge service (issue 17): ``prism serve``.

Storage: :mod:`.store`, :mod:`.models` and the Alembic migrations under ``migrations/`` (the
state machine of a submission), :mod:`.blobs` (bundle bytes by sha256). Intake:
:mod:`.archive` (safe zip extraction), :mod:`.intake` (gates, normalized-source and family
hashes), :mod:`.signing` (sr25519, SS58), :mod:`.admission` (the limits), :mod:`.registry`
(listed hotkeys), :mod:`.slowclients` (the header deadline). The app: :mod:`.settings`,
:mod:`.app` (``create_app``), :mod:`.routes` (submit, read, ops, pages), :mod:`.errors`,
:mod:`.queries`, :mod:`.weights`, :mod:`.metrics`. The submitter's side: :mod:`.client`,
:mod:`.keys` (``prism submit``, ``prism keygen``). The Ray dispatcher: ``dispatch`` (branch
``fleet``), started by :func:`.app.start_dispatcher`; :mod:`.capacity` (what it can run).
"""
