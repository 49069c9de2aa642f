"""Imported last by the rank processes' fork server (``_gloo._PRELOAD``), after everything it
preloads: ``gc.freeze()`` moves those objects out of the collector's reach, so a forked rank's
collections neither walk nor copy (on write) the fork server's millions of objects. The fork
server unfreezes them when it exits, so its own finalisation frees them as usual (nanobind
reports objects left alive at exit)."""

import atexit
import gc

gc.freeze()
atexit.register(gc.unfreeze)
