"""Fencing and recovery (issue 18): attempt tokens, heartbeats and nodes, the retry backoff, one
run per submission, and the dispatchers' heartbeats.

Revision ID: 0003
Revises: 0002
"""

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None

TS = sa.DateTime(timezone=True)


def upgrade() -> None:
    """Add ``attempts.token`` (unique), ``attempts.node``, ``attempts.heartbeat_at``,
    ``submissions.not_before``, ``runs.submission_id`` (unique; filled for the run of each
    submission's last attempt), and the ``dispatchers`` table."""
    with op.batch_alter_table("attempts") as batch:
        batch.add_column(sa.Column("token", sa.String(32), nullable=True))
        batch.add_column(sa.Column("node", sa.String(128), nullable=True))
        batch.add_column(sa.Column("heartbeat_at", TS, nullable=True))
        batch.create_unique_constraint("uq_attempts_token", ["token"])
    with op.batch_alter_table("submissions") as batch:
        batch.add_column(sa.Column("not_before", TS, nullable=True))
    with op.batch_alter_table("runs") as batch:
        batch.add_column(sa.Column("submission_id", sa.Integer(), nullable=True))
    # Before 0003 a run was written for every attempt; the submission's result is its last one's.
    op.execute("UPDATE runs SET submission_id = (SELECT a.submission_id FROM attempts a JOIN submissions s "
               "ON s.id = a.submission_id WHERE a.id = runs.attempt_id AND a.number = s.attempts)")
    with op.batch_alter_table("runs") as batch:
        batch.create_unique_constraint("uq_runs_submission_id", ["submission_id"])
        batch.create_foreign_key("fk_runs_submission_id", "submissions", ["submission_id"], ["id"])
    op.create_table(
        "dispatchers",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("name", sa.String(128), nullable=False, unique=True),
        sa.Column("ray_address", sa.String(256), nullable=True),
        sa.Column("started_at", TS, nullable=False),
        sa.Column("heartbeat_at", TS, nullable=False),
        sa.Column("stopped_at", TS, nullable=True),
    )


def downgrade() -> None:
    """Drop what :func:`upgrade` added."""
    op.drop_table("dispatchers")
    with op.batch_alter_table("runs") as batch:
        batch.drop_constraint("fk_runs_submission_id", type_="foreignkey")
        batch.drop_constraint("uq_runs_submission_id", type_="unique")
        batch.drop_column("submission_id")
    with op.batch_alter_table("submissions") as batch:
        batch.drop_column("not_before")
    with op.batch_alter_table("attempts") as batch:
        batch.drop_constraint("uq_attempts_token", type_="unique")
        for column in ("heartbeat_at", "node", "token"):
            batch.drop_column(column)
