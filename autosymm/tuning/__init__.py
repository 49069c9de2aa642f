"""The tuning side of autosymm: `autosymm tune` and `autosymm bench`.

A :class:`~autosymm.tuning.session.TuneSession` owns what a tune needs on one rank (settings,
backends, workspace, control group, database) and runs the sweep: sweep.py says what is tried
(problems, modes, timing plans, candidates), reference.py and precompile.py prepare a problem,
evaluator.py validates and times one candidate (timing.py), tuner.py runs the search (order from
search.py) over the rank protocol of rank_comm.py and returns outcome.py's records, and
workers.py starts one process per GPU. This package imports the runtime (backends, workspace,
database); the runtime never imports it.
"""
