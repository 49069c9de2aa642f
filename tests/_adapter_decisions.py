"""The decisions the integrations' adapters see, stubbed: ``autosymm.explain`` (which an adapter
asks once per call key) replaced as on a tuned GPU node, then restored."""

from __future__ import annotations

from contextlib import contextmanager

#: The database file a stubbed decision names: ``Decision.tuned`` (a row decided) holds.
TUNED_SOURCE = "stub-tuned.sqlite"


def tuned(backend: str, mode: str = "eager"):
    """A Decision as a tuned database row gives it: ``backend``, from :data:`TUNED_SOURCE`."""
    from autosymm.runtime.dispatch import Decision

    return Decision(backend, None, "stub", source=TUNED_SOURCE, mode=mode)


@contextmanager
def adapter_decisions(explain=None, backend: str = "triton_one_shot"):
    """Within: the adapters' ``autosymm.explain`` is ``explain``, or a stub where a tuned row decides
    ``backend`` (not NCCL) for every call. Adapters cache decisions per key: clear
    ``slot.autosymm._use`` inside."""
    from autosymm.integrations import serving as module

    real = module.explain
    module.explain = explain or (lambda *a, **k: tuned(backend, k.get("mode") or "eager"))
    try:
        yield
    finally:
        module.explain = real
