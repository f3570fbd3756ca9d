"""Intake: the normalized-source and family hashes, training variants and the profile of a submission.

Revision ID: 0002
Revises: 0001
"""

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

COLUMNS = ("source_sha256", "family_sha256", "variant_of", "profile")


def upgrade() -> None:
    """Add ``source_sha256``, ``family_sha256``, ``variant_of`` and ``profile`` to ``submissions``
    (all nullable: rows made before this migration have none), each indexed."""
    with op.batch_alter_table("submissions") as batch:
        batch.add_column(sa.Column("source_sha256", sa.String(64), nullable=True))
        batch.add_column(sa.Column("family_sha256", sa.String(64), nullable=True))
        batch.add_column(sa.Column("variant_of", sa.Integer(), nullable=True))
        batch.add_column(sa.Column("profile", sa.String(64), nullable=True))
        batch.create_foreign_key("fk_submissions_variant_of", "submissions", ["variant_of"], ["id"])
        for column in COLUMNS:
            batch.create_index(f"ix_submissions_{column}", [column])


def downgrade() -> None:
    """Drop the four columns (and their indexes and foreign key)."""
    with op.batch_alter_table("submissions") as batch:
        for column in COLUMNS:
            batch.drop_index(f"ix_submissions_{column}")
        batch.drop_constraint("fk_submissions_variant_of", type_="foreignkey")
        for column in reversed(COLUMNS):
            batch.drop_column(column)
