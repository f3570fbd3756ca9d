"""Admission (issue 27, item 2): the client address of each submission, so that the per-address
limit is a count of accepted rows, kept across restarts.

Revision ID: 0005
Revises: 0004
"""

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    """Add ``submissions.client_address`` (nullable: rows made before it have none) and its index."""
    with op.batch_alter_table("submissions") as batch:
        batch.add_column(sa.Column("client_address", sa.String(64), nullable=True))
    op.create_index("ix_submissions_client_address", "submissions", ["client_address"])


def downgrade() -> None:
    """Drop the column and its index."""
    op.drop_index("ix_submissions_client_address", table_name="submissions")
    with op.batch_alter_table("submissions") as batch:
        batch.drop_column("client_address")
