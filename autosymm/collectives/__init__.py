"""The collectives' front doors, one module per op: its public function and hot path, its checks,
its custom ops (and its replay, where it has one). Each builds on the runtime (autosymm.runtime)
and its op's spec (autosymm.spec), which names its door (``OpSpec.door``): :func:`doors` is read
off the registered specs, and autosymm.ops registers their custom ops.

How to add a collective: ARCHITECTURE.md ("A new collective").
"""

from __future__ import annotations

from .. import spec
from ..entries import load


def doors() -> tuple:
    """Every registered op's door (an autosymm.runtime.entry.Door), in registry order."""
    return tuple(load(record.door) for record in spec.registered())
