"""The decisions the integrations' adapters see, stubbed: ``AutosymmServing._decision`` (the
runtime's prepared call of a key, which every ``serves*`` asks) answered as on a tuned GPU node,
then restored. The calls an adapter then makes run what the runtime decides for them."""

from __future__ import annotations

from contextlib import contextmanager

#: The database file a stubbed decision names: ``Decision.tuned`` (a row decided) holds.
TUNED_SOURCE = "stub-tuned.sqlite"


def tuned(backend: str, mode: str = "eager"):
    """A Decision as a tuned database row gives it: ``backend``, from :data:`TUNED_SOURCE`."""
    from autosymm.runtime.dispatch import Decision

    return Decision(backend, None, "stub", source=TUNED_SOURCE, mode=mode)


@contextmanager
def adapter_decisions(decide=None, backend: str = "triton_one_shot"):
    """Within: an adapter's decision for a call is ``decide(op, key, mode)`` (the op's name, the
    runtime's call key, or None for the MoE adapters' question before a call is built; 'eager' |
    'graph'), or a stub where a tuned row decides ``backend`` (not NCCL) for every call; asked at
    every call (nothing cached)."""
    from autosymm.integrations import serving
    from autosymm.spec import key_mode

    real = serving.AutosymmServing._decision, serving.explained

    def stub(self, door, key, make_args):
        mode = key_mode(key)
        return decide(door.name, key, mode) if decide is not None else tuned(backend, mode)

    def explained(group, record, problem, mode):  # the MoE adapters' question, before a call is built
        return decide(record.name, None, mode) if decide is not None else tuned(backend, mode)

    serving.AutosymmServing._decision, serving.explained = stub, explained
    try:
        yield
    finally:
        serving.AutosymmServing._decision, serving.explained = real
