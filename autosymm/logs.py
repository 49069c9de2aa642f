"""autosymm's logging set-up from the environment: ``AUTOSYMM_LOG=debug`` (or info, warning,
error, critical, or a number such as 10; autosymm.settings parses it) sets the level of the
``autosymm`` logger.

A bad value never breaks ``import autosymm`` or the command line: it is ignored with one
warning naming the variable and the accepted values.
"""

from __future__ import annotations

import logging
import warnings
from typing import Mapping, Optional

from . import settings

ENV_VAR = "AUTOSYMM_LOG"
logger = logging.getLogger("autosymm")

_warned_values: set[str] = set()


def configure_from_env(environ: Optional[Mapping[str, str]] = None) -> Optional[int]:
    """Set the ``autosymm`` logger's level from ``$AUTOSYMM_LOG`` (``environ``: default
    ``os.environ``) and give the root logger a handler if it has none. Returns the level set,
    or None when the variable is unset, empty or bad (warned about once per value); never raises."""
    level, error = settings.get_or_default(ENV_VAR, environ)
    if error:
        text = settings.raw(ENV_VAR, environ)
        if text not in _warned_values:
            _warned_values.add(text)
            warnings.warn(f"autosymm: ignoring {error}", RuntimeWarning, stacklevel=2)
        return None
    if level is None:
        return None
    logging.basicConfig()
    logger.setLevel(level)
    return level


def debug_enabled() -> bool:
    """True when the ``autosymm`` logger shows debug messages (e.g. ``AUTOSYMM_LOG=debug``)."""
    return logger.isEnabledFor(logging.DEBUG)
