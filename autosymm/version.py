"""autosymm's version (the one place it is written; recorded with every tuned row)."""

__version__ = "0.1.0"
