"""The decisions the integrations' adapters see, stubbed: ``autosymm.explain`` (which an adapter
asks once per call key) replaced as on a tuned GPU node, then restored."""

from __future__ import annotations

from contextlib import contextmanager


@contextmanager
def adapter_decisions(explain=None, backend: str = "triton_one_shot"):
    """Within: the adapters' ``autosymm.explain`` is ``explain``, or a stub deciding ``backend``
    (not NCCL) for every call. Adapters cache decisions per key: clear ``slot.autosymm._use`` inside."""
    from autosymm.runtime.dispatch import Decision
    from autosymm.integrations import serving as module

    real = module.explain
    module.explain = explain or (lambda *a, **k: Decision(backend, None, "stub", mode="eager"))
    try:
        yield
    finally:
        module.explain = real
