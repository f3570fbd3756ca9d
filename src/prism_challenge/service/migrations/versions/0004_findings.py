"""Findings (issue 25, item 5): a run the audit caught, recorded against its hotkey, and its lift.

Revision ID: 0004
Revises: 0003
"""

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None

TS = sa.DateTime(timezone=True)


def upgrade() -> None:
    """Create the ``findings`` table (one row per caught run: ``run_id`` and ``attempt_id``
    unique), indexed by hotkey and submission. Runs stored before this migration get no finding
    (a finding suspends its hotkey: none is made retroactively)."""
    op.create_table(
        "findings",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("hotkey", sa.String(64), nullable=False),
        sa.Column("submission_id", sa.Integer(), sa.ForeignKey("submissions.id", name="fk_findings_submission_id"),
                  nullable=False),
        sa.Column("attempt_id", sa.Integer(), sa.ForeignKey("attempts.id", name="fk_findings_attempt_id"),
                  nullable=False),
        sa.Column("run_id", sa.Integer(), sa.ForeignKey("runs.id", name="fk_findings_run_id"), nullable=False),
        sa.Column("kind", sa.String(32), nullable=False),
        sa.Column("step", sa.Integer(), nullable=True),
        sa.Column("rank", sa.Integer(), nullable=True),
        sa.Column("row", sa.Integer(), nullable=True),
        sa.Column("recorded_nats", sa.Float(), nullable=True),
        sa.Column("rescored_nats", sa.Float(), nullable=True),
        sa.Column("message", sa.Text(), nullable=False),
        sa.Column("created_at", TS, nullable=False),
        sa.Column("lifted_at", TS, nullable=True),
        sa.Column("lifted_by", sa.String(128), nullable=True),
        sa.Column("lift_reason", sa.Text(), nullable=True),
        sa.UniqueConstraint("run_id", name="uq_findings_run_id"),
        sa.UniqueConstraint("attempt_id", name="uq_findings_attempt_id"),
    )
    op.create_index("ix_findings_hotkey", "findings", ["hotkey"])
    op.create_index("ix_findings_submission_id", "findings", ["submission_id"])


def downgrade() -> None:
    """Drop the ``findings`` table."""
    op.drop_table("findings")
