"""``autosymm bench``: autosymm's tuned calls against NCCL and torch's symm_mem ops, per op, with
its baselines, report tables and plots. It builds on the runtime and the tuning side; neither
imports it."""
