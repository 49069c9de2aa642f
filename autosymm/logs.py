"""autosymm's logging set-up from the environment: ``AUTOSYMM_LOG=debug`` (or info, warning,
error, critical, or a number such as 10) sets the level of the ``autosymm`` logger.

A bad value never breaks ``import autosymm`` or the command line: it is ignored with one
warning naming the variable and the accepted values.
"""

from __future__ import annotations

import logging
import os
import warnings
from typing import Mapping, Optional

ENV_VAR = "AUTOSYMM_LOG"
LEVEL_NAMES = ("debug", "info", "warning", "error", "critical")
logger = logging.getLogger("autosymm")

_warned_values: set[str] = set()


def parse_level(text: str) -> Optional[int]:
    """'debug' -> 10, 'WARNING' -> 30, 'warn' -> 30, '15' -> 15; None for anything else
    (numbers must be >= 0)."""
    text = text.strip()
    if text.isdigit():
        return int(text)
    name = text.upper()
    aliases = {"WARN": "WARNING", "FATAL": "CRITICAL"}
    name = aliases.get(name, name)
    return getattr(logging, name) if name.lower() in LEVEL_NAMES else None


def configure_from_env(environ: Optional[Mapping[str, str]] = None) -> Optional[int]:
    """Set the ``autosymm`` logger's level from ``$AUTOSYMM_LOG`` (``environ``: default
    ``os.environ``) and give the root logger a handler if it has none. Returns the level set,
    or None when the variable is unset, empty or bad (warned about once per value); never raises."""
    text = (os.environ if environ is None else environ).get(ENV_VAR, "")
    if not text.strip():
        return None
    level = parse_level(text)
    if level is None:
        if text not in _warned_values:
            _warned_values.add(text)
            warnings.warn(f"autosymm: ignoring {ENV_VAR}={text!r}: give a level name ({', '.join(LEVEL_NAMES)}) "
                          f"or a number >= 0, e.g. {ENV_VAR}=debug", RuntimeWarning, stacklevel=2)
        return None
    logging.basicConfig()
    logger.setLevel(level)
    return level


def debug_enabled() -> bool:
    """True when the ``autosymm`` logger shows debug messages (e.g. ``AUTOSYMM_LOG=debug``)."""
    return logger.isEnabledFor(logging.DEBUG)
