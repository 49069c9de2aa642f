"""The symmetric workspace: one symmetric-memory allocation per group, its regions reserved by
name (autosymm.geometry lays them out) and its signal pads."""
