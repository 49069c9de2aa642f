"""The ``autosymm`` command (a click group over the runtime, the tuner and the bench): main, its
error reporting and the dispatch plans it prints."""
