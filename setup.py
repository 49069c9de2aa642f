"""Package discovery: every package under autosymm/ is found automatically, plus the shipped
databases (tuning_db/ at the repository root), which install as ``autosymm.tuning_db``
(pyproject.toml maps the folder and names the files). Everything else is in pyproject.toml."""

from setuptools import find_packages, setup

setup(packages=find_packages(include=["autosymm", "autosymm.*"]) + ["autosymm.tuning_db"])
