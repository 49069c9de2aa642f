"""The tuning databases: the store (paths, writing, the shipped files), the row schema and its
validator, opening with migration, reading for the dispatcher, and merging (ARCHITECTURE.md)."""
