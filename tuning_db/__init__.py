"""Shipped tuning databases, one SQLite file per hardware slug (see autosymm.db.store)."""
