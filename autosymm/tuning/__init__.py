"""The tuning side of autosymm: `autosymm tune` and `autosymm bench`.

A :class:`~autosymm.tuning.session.TuneSession` owns what a tune needs on one rank (settings,
workspace, control group, database); the sweep turns problems into validated, timed candidates
(reference.py, precompile.py, timing.py), the tuner runs the rank protocol over rank_comm.py
with a search order from search.py, and workers.py starts one process per GPU. This package
imports the runtime (backends, workspace, database); the runtime never imports it.
"""
