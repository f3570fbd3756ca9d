"""The initial schema: submitters, submissions, attempts, runs, nonces.

Revision ID: 0001
Revises:
"""

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

TS = sa.DateTime(timezone=True)


def upgrade() -> None:
    """Create the five tables."""
    op.create_table(
        "submitters",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("hotkey", sa.String(64), nullable=False, unique=True),
        sa.Column("created_at", TS, nullable=False),
    )
    op.create_table(
        "submissions",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("submitter_id", sa.Integer(), sa.ForeignKey("submitters.id"), nullable=False),
        sa.Column("bundle_sha256", sa.String(64), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("max_attempts", sa.Integer(), nullable=False),
        sa.Column("created_at", TS, nullable=False),
        sa.Column("updated_at", TS, nullable=False),
        sa.Column("finished_at", TS, nullable=True),
        sa.Column("error_stage", sa.String(32), nullable=True),
        sa.Column("error_kind", sa.String(16), nullable=True),
        sa.Column("error_message", sa.Text(), nullable=True),
        sa.CheckConstraint("status IN ('pending', 'running', 'completed', 'failed', 'rejected')",
                           name="ck_submissions_status"),
        sa.CheckConstraint("attempts >= 0 AND attempts <= max_attempts", name="ck_submissions_attempts"),
    )
    op.create_index("ix_submissions_submitter_id", "submissions", ["submitter_id"])
    op.create_index("ix_submissions_bundle_sha256", "submissions", ["bundle_sha256"])
    op.create_index("ix_submissions_status", "submissions", ["status"])
    op.create_table(
        "attempts",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("submission_id", sa.Integer(), sa.ForeignKey("submissions.id"), nullable=False),
        sa.Column("number", sa.Integer(), nullable=False),
        sa.Column("worker", sa.String(128), nullable=True),
        sa.Column("started_at", TS, nullable=False),
        sa.Column("finished_at", TS, nullable=True),
        sa.Column("outcome", sa.String(16), nullable=True),
        sa.Column("failure_stage", sa.String(32), nullable=True),
        sa.Column("failure_kind", sa.String(16), nullable=True),
        sa.Column("failure_message", sa.Text(), nullable=True),
        sa.UniqueConstraint("submission_id", "number", name="uq_attempts_submission_number"),
        sa.CheckConstraint("outcome IS NULL OR outcome IN ('completed', 'failed', 'rejected', 'retry')",
                           name="ck_attempts_outcome"),
    )
    op.create_index("ix_attempts_submission_id", "attempts", ["submission_id"])
    op.create_table(
        "runs",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("attempt_id", sa.Integer(), sa.ForeignKey("attempts.id"), nullable=False, unique=True),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("run_dir", sa.Text(), nullable=True),
        sa.Column("prequential_bpb", sa.Float(), nullable=True),
        sa.Column("final_score", sa.Float(), nullable=True),
        sa.Column("manifest", sa.JSON(), nullable=False),
        sa.Column("created_at", TS, nullable=False),
    )
    op.create_table(
        "nonces",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("hotkey", sa.String(64), nullable=False),
        sa.Column("nonce", sa.String(128), nullable=False),
        sa.Column("timestamp", sa.Integer(), nullable=False),
        sa.Column("created_at", TS, nullable=False),
        sa.UniqueConstraint("hotkey", "nonce", name="uq_nonces_hotkey_nonce"),
    )
    op.create_index("ix_nonces_created_at", "nonces", ["created_at"])


def downgrade() -> None:
    """Drop the five tables."""
    for table in ("nonces", "runs", "attempts", "submissions", "submitters"):
        op.drop_table(table)
