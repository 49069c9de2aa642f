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
    every call (nothing cached). The calls then made are decided as on that node: by autosymm's
    own rows and fallbacks, the stack's path not standing in for them (dispatch's stack rule off),
    nothing left to tune at a first use (no warm-up tuner on); the calls prepared before are
    prepared again, within and after (every rank enters and leaves at the same point)."""
    from autosymm.integrations import serving
    from autosymm.runtime import dispatch, group, warmup
    from autosymm.spec import key_mode

    real = serving.AutosymmServing._decision, serving.explained, dispatch._stack_rule

    def stub(self, door, key, make_args):
        mode = key_mode(key)
        return decide(door.name, key, mode) if decide is not None else tuned(backend, mode)

    def explained(group, record, problem, mode):  # the MoE adapters' question, before a call is built
        return decide(record.name, None, mode) if decide is not None else tuned(backend, mode)

    def own(problem, mode, caps, decision, ranked):  # the call the adapter hands autosymm: autosymm's own decision
        return decision

    serving.AutosymmServing._decision, serving.explained, dispatch._stack_rule = stub, explained, own
    tuners, warmup.TUNERS[:] = list(warmup.TUNERS), []
    _prepare_again(group)
    try:
        yield
    finally:
        serving.AutosymmServing._decision, serving.explained, dispatch._stack_rule = real
        warmup.TUNERS[:] = tuners
        _prepare_again(group)


def _prepare_again(group) -> None:
    for state in set(group.STATES.values()):
        state.decide_again()
