"""The entry half of a collective (:class:`Door`: its checks in the one order of every door, the
text and fingerprint the ranks compare, how a checked call is prepared, its custom ops), and the
one path every public call takes on the first call of a key (:func:`prepare_call`) or with
arguments no key can be built of (:func:`refuse_call`). Each op's door, public function and hot path live in its module of
autosymm.collectives; its key is an autosymm.spec.CallKey, built by ``call_key`` only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

from ..problem import Problem
from ..spec import CallKey, OpSpec, key_mode
from . import warmup
from .call_check import checked_entry, fingerprint
from .group import stream_capturing


@dataclass(frozen=True)
class CustomOp:
    """One ``torch.ops.autosymm.<name>``: its implementation (whose annotations make the schema),
    the arguments it mutates, its fake implementation and, for a differentiable op, its
    ``backward`` and ``setup_context`` (torch.library.register_autograd's; autosymm.ops registers
    them all)."""

    name: str
    impl: Callable
    fake: Callable
    mutates_args: tuple[str, ...] = ()
    setup_context: Optional[Callable] = None
    backward: Optional[Callable] = None


class Door:
    """A collective's entry: ``spec`` (its autosymm.spec.OpSpec) and ``arg_names`` (its call's
    arguments in the entry's order, as errors and the checked mode name them). ``args`` is the
    call's arguments in that order, as the caller gave them (a keyword option unparsed), so that
    every check of them runs inside the step that shares a failure with every rank.

    A door checks and launches; it never decides (autosymm.runtime.dispatch does). Its checks
    run in the one order :meth:`check_call` fixes for every door: :meth:`check_options` (the
    non-tensor arguments: a reduce op, epilogue keywords, per-rank sizes), then
    :meth:`check_tensors` (each tensor's type, layout, dtype, device, contiguity, shape and grad
    requirement, and how the tensors fit together), then :meth:`problem` (what the call is, for
    the dispatcher). Each raises a ValueError (TypeError for a wrong kind of argument) naming the
    argument. ``prepare_in_check``: the decision and launcher are made inside the agreed check
    (False when preparing may run a collective, as growing the MoE region does). Subclasses give
    :meth:`call_text`, the three checks they need and :meth:`custom_ops`."""

    prepare_in_check = True

    def __init__(self, spec: OpSpec, arg_names: tuple[str, ...]) -> None:
        self.spec, self.name, self.arg_names = spec, spec.name, arg_names

    def call_text(self, key: Optional[CallKey], args: tuple, mode: str) -> str:
        """The call as the ranks compare it (and errors name it) on its first use."""
        raise NotImplementedError(self.name)

    def fingerprint(self, key: Optional[CallKey], args: tuple, mode: str) -> dict[str, Any]:
        """What the checked mode (AUTOSYMM_CHECK_CALLS) compares across ranks on every call: each
        argument by :attr:`arg_names` (a tensor's dtype and shape, a value itself) and the mode."""
        return fingerprint(self.name, args, self.arg_names, mode=mode)

    def check_call(self, state, key: Optional[CallKey], args: tuple, mode: str) -> Problem:
        """This rank's checks of a call, in the one order of every door (local: no collective):
        its Problem, or the first error."""
        self.check_options(state, args)
        self.check_tensors(state, args, mode)
        return self.problem(state, key, args, mode)

    def check_options(self, state, args: tuple) -> None:
        """The call's non-tensor arguments (see the class docstring)."""

    def check_tensors(self, state, args: tuple, mode: str) -> None:
        """The call's tensors (see the class docstring)."""

    def problem(self, state, key: Optional[CallKey], args: tuple, mode: str) -> Problem:
        """The checked call as the dispatcher sees it."""
        raise NotImplementedError(self.name)

    def prepare(self, state, problem, mode: str):
        """The Entry (decision and launcher) of a checked call."""
        return state.prepare(problem, mode)

    def bytes_per_call(self, args: tuple) -> int:
        """Bytes a call moves, for ``autosymm.stats`` (the first tensor's)."""
        return args[0].numel() * args[0].element_size()

    def custom_ops(self) -> tuple[CustomOp, ...]:
        """Its ``torch.ops.autosymm.*`` ops."""
        raise NotImplementedError(self.name)

    def __repr__(self) -> str:
        return f"<{self.name} door>"


def prepare_call(state, door: Door, key: CallKey, args: tuple):
    """The first call of ``key`` on a group state: checked on this rank, agreed with every rank
    (a bad tensor on one rank raises on all: GroupState.agreed_check), decided, prepared and
    cached. Every public entry takes this path on a miss of its key in ``state.cache`` (a repeated
    call is that lookup, ``entry.calls += 1`` and the launcher, inline in the entry). In checked
    mode (AUTOSYMM_CHECK_CALLS) every call comes here, its lookups missing by design, and is
    checked with every rank first (autosymm.runtime.call_check.checked_entry)."""
    mode = key_mode(key)
    if state.check_calls:
        entry = checked_entry(state, door, key, args, mode)
        if entry is not None:
            return entry

    def local():
        problem = door.check_call(state, key, args, mode)
        return problem, door.prepare(state, problem, mode) if door.prepare_in_check else None

    def word(found) -> dict:  # this rank tunes the key if every rank will (autosymm.runtime.warmup)
        return {"warmup": warmup.wants(found[0]) and not stream_capturing()}

    problem, entry = state.agreed_check(door.call_text(key, args, mode), local, word)
    if entry is None:
        entry = door.prepare(state, problem, mode)
    if warmup.tune_first_call(state, problem, all(r.get("warmup") for r in state.agreed_reports)):
        entry = door.prepare(state, problem, mode)  # decided again, from the rows just measured
    entry.bytes_per_call = door.bytes_per_call(args)
    state.cache[key] = entry
    return entry


def refuse_call(state, door: Door, args: tuple):
    """A call whose key cannot be built (an argument that is not a dense tensor, per-rank sizes
    that are not ints): its checks (``door.check_call``, which name the argument) raise, after
    they are agreed with every rank as :func:`prepare_call` agrees a call's first use, so a peer
    making its first use of a call at the same point raises too, naming this rank's error."""
    mode = "graph" if stream_capturing() else "eager"

    def check():
        door.check_call(state, None, args, mode)
        raise TypeError(f"autosymm.{door.name}: the arguments are not tensors of one call")  # checks missed it

    if state.check_calls:
        checked_entry(state, door, None, args, mode)  # raises the checks' error (or the peers')
    state.agreed_check(f"{door.name} of arguments this rank refused", check)
