"""Secret seeds and confirmation runs (issue 29, items 1-2): each attempt's secret seed and the
run it is an attempt of; a submission's runs (one row each, ``(submission_id, run_index)``
unique) instead of one run per submission; how many runs the submission gets, and the attempts
its earlier runs spent.

Revision ID: 0006
Revises: 0005
"""

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    """Add ``attempts.seed``, ``attempts.run_index`` (0 on older rows), ``submissions.runs_wanted``
    (1) and ``submissions.run_base`` (0), ``runs.run_index`` (0) and ``runs.seed`` (NULL: an
    older run's seed is its manifest's, the profile's); ``runs.submission_id`` unique per
    ``run_index`` instead of alone."""
    with op.batch_alter_table("attempts") as batch:
        batch.add_column(sa.Column("seed", sa.BigInteger(), nullable=True))
        batch.add_column(sa.Column("run_index", sa.Integer(), nullable=False, server_default="0"))
    with op.batch_alter_table("submissions") as batch:
        batch.add_column(sa.Column("runs_wanted", sa.Integer(), nullable=False, server_default="1"))
        batch.add_column(sa.Column("run_base", sa.Integer(), nullable=False, server_default="0"))
    with op.batch_alter_table("runs") as batch:
        batch.add_column(sa.Column("run_index", sa.Integer(), nullable=False, server_default="0"))
        batch.add_column(sa.Column("seed", sa.BigInteger(), nullable=True))
        batch.drop_constraint("uq_runs_submission_id", type_="unique")
        batch.create_unique_constraint("uq_runs_submission_run", ["submission_id", "run_index"])


def downgrade() -> None:
    """Drop what :func:`upgrade` added (a submission's runs past its first are deleted)."""
    op.execute("DELETE FROM findings WHERE run_id IN (SELECT id FROM runs WHERE run_index > 0)")
    op.execute("DELETE FROM runs WHERE run_index > 0")
    with op.batch_alter_table("runs") as batch:
        batch.drop_constraint("uq_runs_submission_run", type_="unique")
        batch.create_unique_constraint("uq_runs_submission_id", ["submission_id"])
        batch.drop_column("seed")
        batch.drop_column("run_index")
    with op.batch_alter_table("submissions") as batch:
        batch.drop_column("run_base")
        batch.drop_column("runs_wanted")
    with op.batch_alter_table("attempts") as batch:
        batch.drop_column("run_index")
        batch.drop_column("seed")
