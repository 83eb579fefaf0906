"""One module per CLI command; ``optiq.cli`` gathers them into the ``optiq`` group."""
