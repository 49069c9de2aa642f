"""The custom-all-reduce slot of vLLM and SGLang, with autosymm first in it.

Built the way the stacks build theirs (vLLM 0.33.0 ``CustomAllreduce(group=cpu_group, ...)``,
SGLang 0.5.23 ``CAClass(group=cpu_group, device=device)``); autosymm serves on the device group
over the same ranks (:func:`autosymm.integrations.groups.device_group_for`). autosymm's half is an
:class:`~autosymm.integrations.serving.AutosymmServing`, held as ``slot.autosymm``. :func:`wrap`
puts it on a stack's object **in place** (the object's class becomes a generated subclass of its
own class, :func:`slot_class`, overriding only the slot calls: autosymm's where its decision is not
NCCL, else the class's own method) or **standalone** (an :class:`AutosymmCustomAllReduce` with the
object as ``fallback``). Constructing is collective over the group's ranks (``autosymm.init`` on
the device group).

Design notes: docs/INTEGRATIONS.md#integrations-custom-all-reduce
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from typing import Callable, Iterator, Optional

import torch

from .serving import AutosymmServing, check_max_size

#: Keyword arguments of vLLM's CustomAllreduce that size or configure its own buffers: accepted,
#: with no effect here (autosymm's workspace is sized by AUTOSYMM_WORKSPACE_BYTES).
STACK_OPTIONS = frozenset({"max_all_gather_size", "max_mnnvl_all_gather_size", "max_reduce_scatter_size",
                           "max_mnnvl_reduce_scatter_size", "max_mnnvl_multimem_reduce_scatter_size",
                           "symm_mem_enabled", "register_graph_buffers"})
#: What the stacks read on the slot where no stack object is wrapped: autosymm's value.
#: (vLLM's DeepSeek mHC path asks for the MNNVL multicast mailbox: autosymm creates none.)
_OWN_VALUES = {"mnnvl_lamport_ag_multicast_ptr": 0}


class AutosymmCustomAllReduce:
    """The standalone slot object: autosymm (``.autosymm``) first, then ``fallback``, the stack's
    own custom all-reduce where there is one (see the module docstring).

    ``group``, ``device``, ``max_size``, ``device_group``, ``deterministic``: as
    :class:`~autosymm.integrations.serving.AutosymmServing`; ``stack_options``: the other
    keywords of vLLM's constructor (:data:`STACK_OPTIONS`). Any other attribute is the fallback's.
    """

    def __init__(self, group=None, device=None, max_size: Optional[int] = None, *, device_group=None,
                 fallback=None, deterministic: Optional[bool] = None, **stack_options) -> None:
        unknown = sorted(set(stack_options) - STACK_OPTIONS)
        if unknown:
            raise TypeError(f"AutosymmCustomAllReduce got unexpected keyword arguments {unknown}; it takes group, "
                            f"device, max_size, device_group, fallback, deterministic and {sorted(STACK_OPTIONS)}")
        check_max_size(max_size)
        self.fallback = fallback
        self.autosymm = AutosymmServing(group, device, max_size, device_group=device_group,
                                        deterministic=deterministic)
        self.disabled = False

    @classmethod
    def beside(cls, serving: AutosymmServing, fallback) -> "AutosymmCustomAllReduce":
        """A standalone slot over ``fallback`` with an already constructed ``serving``."""
        slot = cls.__new__(cls)
        slot.fallback, slot.autosymm, slot.disabled = fallback, serving, False
        return slot

    def __getattr__(self, name: str):
        fallback = self.__dict__.get("fallback")
        if fallback is None and name in _OWN_VALUES:
            return _OWN_VALUES[name]
        if fallback is None or name.startswith("__"):
            raise AttributeError(f"{type(self).__name__} has no attribute {name!r} (and wraps no stack object)")
        return getattr(fallback, name)

    @property
    def fully_connected(self) -> bool:
        """The wrapped object's (the stacks read it to pick their custom all-gather); else False."""
        return bool(getattr(self.fallback, "fully_connected", False))

    @contextlib.contextmanager
    def capture(self) -> Iterator[None]:
        """Wrap a CUDA-graph capture (and its warm-up runs): the graph-mode rows decide inside."""
        with self.autosymm.capture(), contextlib.ExitStack() as stack:
            if self.fallback is not None:
                stack.enter_context(self.fallback.capture())
            yield

    def _autosymm(self, serves: Callable[[torch.Tensor], bool], x: torch.Tensor) -> bool:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"AutosymmCustomAllReduce: x must be a torch.Tensor, got {type(x).__name__}")
        return not self.disabled and serves(x)

    def should_custom_ar(self, x: torch.Tensor) -> bool:
        """True when autosymm, or the wrapped object, serves ``x``."""
        return self._autosymm(self.autosymm.serves, x) or bool(self._wrapped("should_custom_ar", x))

    def custom_all_reduce(self, x: torch.Tensor) -> Optional[torch.Tensor]:
        """A new tensor with the sum of ``x`` over the group, or None when the caller should use
        its own all-reduce (disabled, or neither autosymm nor the wrapped object serves it)."""
        if self._autosymm(self.autosymm.serves, x):
            return self.autosymm.all_reduce(x)
        if self._wrapped("should_custom_ar", x):
            return self.fallback.custom_all_reduce(x)
        return None

    def fused_allreduce_rmsnorm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                                eps: float) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        """SGLang's fused call: ``(rmsnorm(residual + sum(x)) * weight, residual + sum(x))`` as new
        tensors, or None for the caller's own path (see the module docstring)."""
        if self._autosymm(self.autosymm.serves_fused, x):
            return self.autosymm.all_reduce_rmsnorm(x, residual, weight, eps)
        return self._wrapped("fused_allreduce_rmsnorm", x, residual, weight, eps)

    def should_custom_all_gather(self, x: torch.Tensor) -> bool:
        return self._autosymm(self.autosymm.serves_all_gather, x) or bool(self._wrapped("should_custom_all_gather", x))

    def custom_all_gather(self, x: torch.Tensor) -> Optional[torch.Tensor]:
        """autosymm's all-gather where it serves ``x``, else the wrapped object's, else None for
        the caller's own path (disabled, or neither serves it)."""
        if self._autosymm(self.autosymm.serves_all_gather, x):
            return self.autosymm.all_gather(x)
        return self._wrapped("custom_all_gather", x)

    def should_custom_reduce_scatter(self, x: torch.Tensor) -> bool:
        return (self._autosymm(self.autosymm.serves_reduce_scatter, x)
                or bool(self._wrapped("should_custom_reduce_scatter", x)))

    def custom_reduce_scatter(self, x: torch.Tensor) -> Optional[torch.Tensor]:
        """autosymm's reduce-scatter where it serves ``x``, else as :meth:`custom_all_gather`."""
        if self._autosymm(self.autosymm.serves_reduce_scatter, x):
            return self.autosymm.reduce_scatter(x)
        return self._wrapped("custom_reduce_scatter", x)

    def _wrapped(self, name: str, *args):
        """The wrapped object's method ``name`` of ``args``; None while disabled or where it has none."""
        method = getattr(self.fallback, name, None)
        return method(*args) if method is not None and not self.disabled else None

    def close(self) -> None:
        """Stop serving: ``custom_all_reduce`` returns None from now on; closes the wrapped object."""
        self.disabled = True
        self.autosymm.stop()
        if self.fallback is not None and hasattr(self.fallback, "close"):
            self.fallback.close()

    def __repr__(self) -> str:
        fallback = type(self.fallback).__name__ if self.fallback is not None else None
        return f"AutosymmCustomAllReduce({self.autosymm!r}, disabled={self.disabled}, fallback={fallback})"


def wrap(stack_object, group=None, device=None, *, device_group=None, deterministic: Optional[bool] = None):
    """The slot object for a stack's own custom all-reduce ``stack_object`` (None: none was built):
    ``stack_object`` itself, its class swapped for :func:`slot_class`'s, where it is enabled and
    its class takes a subclass; else a standalone :class:`AutosymmCustomAllReduce` over it.
    Arguments as :class:`AutosymmCustomAllReduce`. Collective over the group's ranks."""
    if isinstance(getattr(stack_object, "autosymm", None), AutosymmServing):
        return stack_object  # a slot already
    if stack_object is None or getattr(stack_object, "disabled", True):
        return AutosymmCustomAllReduce(group, device, device_group=device_group, fallback=stack_object,
                                       deterministic=deterministic)
    serving = AutosymmServing(group, device, device_group=device_group, deterministic=deterministic)
    try:
        stack_object.__class__ = slot_class(type(stack_object))
    except TypeError:  # a class with __slots__, or one that cannot be subclassed: serve beside it
        return AutosymmCustomAllReduce.beside(serving, stack_object)
    stack_object.autosymm = serving
    return stack_object


def _first_argument(base) -> str:
    """The name of ``base``'s tensor parameter (the one after ``self``), for keyword callers."""
    return list(inspect.signature(base).parameters)[1]


def _first(serves: str, run: str, base):
    """An override of ``base`` (same name and signature): autosymm's ``run`` where its ``serves``
    says so, else ``base``."""
    name = _first_argument(base)

    @functools.wraps(base)
    def method(self, *args, **kwargs):
        serving = self.autosymm
        inp = args[0] if args else kwargs[name]
        return getattr(serving, run)(inp) if getattr(serving, serves)(inp) else base(self, *args, **kwargs)
    return method


def _asks_first(serves: str, base):
    """An override of a ``should_*`` method ``base``: autosymm's ``serves``, else ``base``."""
    name = _first_argument(base)

    @functools.wraps(base)
    def method(self, *args, **kwargs):
        return getattr(self.autosymm, serves)(args[0] if args else kwargs[name]) or base(self, *args, **kwargs)
    return method


def _capture(base):
    @functools.wraps(base)
    @contextlib.contextmanager
    def capture(self, *args, **kwargs):
        with self.autosymm.capture(), base(self, *args, **kwargs):
            yield
    return capture


def _close(base):
    @functools.wraps(base)
    def close(self, *args, **kwargs):
        serving = self.__dict__.get("autosymm")
        if serving is not None:
            serving.stop()
        return base(self, *args, **kwargs)
    return close


def fused_allreduce_rmsnorm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                            eps: float) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    """SGLang's fused call on an in-place slot: autosymm's where it serves ``x``, else None."""
    if self.autosymm.serves_fused(x):
        return self.autosymm.all_reduce_rmsnorm(x, residual, weight, eps)
    return None


#: The slot calls an in-place slot overrides, where the stack's class has them.
_OVERRIDES = {
    "should_custom_ar": functools.partial(_asks_first, "serves"),
    "custom_all_reduce": functools.partial(_first, "serves", "all_reduce"),
    "should_custom_all_gather": functools.partial(_asks_first, "serves_all_gather"),
    "custom_all_gather": functools.partial(_first, "serves_all_gather", "all_gather"),
    "should_custom_reduce_scatter": functools.partial(_asks_first, "serves_reduce_scatter"),
    "custom_reduce_scatter": functools.partial(_first, "serves_reduce_scatter", "reduce_scatter"),
    "capture": _capture,
    "close": _close,
}
_SLOT_CLASSES: dict[type, type] = {}


def slot_class(base: type) -> type:
    """``base`` with autosymm first in its slot calls (the module docstring), one class per
    ``base``, named ``Autosymm<base name>`` at this module's top level (pickled by reference)."""
    cls = _SLOT_CLASSES.get(base)
    if cls is not None:
        return cls
    name = f"Autosymm{base.__name__}"
    while name in globals():
        name += "_"
    namespace = {"__module__": __name__, "__qualname__": name,
                 "__doc__": f"{base.__module__}.{base.__qualname__} with autosymm first in its slot calls."}
    namespace.update({method: make(getattr(base, method)) for method, make in _OVERRIDES.items()
                      if callable(getattr(base, method, None))})
    if not hasattr(base, "fused_allreduce_rmsnorm") and not hasattr(base, "custom_fused_ar_rms"):
        namespace["fused_allreduce_rmsnorm"] = fused_allreduce_rmsnorm
    cls = _SLOT_CLASSES[base] = globals()[name] = type(name, (base,), namespace)
    return cls
