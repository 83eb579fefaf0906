"""optiq: make LLM decode fast by measurement."""

__version__ = "0.1.0"
