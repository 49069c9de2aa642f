"""A process group's autosymm state: what the first call found out, agreed by every rank (see
autosymm.runtime.agreement), and the prepared calls (keys: autosymm.spec.CallKey). The front doors
(autosymm.collectives) and autosymm.api's session-level calls build on it.
"""

from __future__ import annotations

import hashlib
import logging
import socket
import threading
import warnings
from dataclasses import dataclass, replace
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import _get_current_dispatch_mode as _current_dispatch_mode

from . import dispatch
from .. import hardware, settings
from .agreement import AgreementError, Exchange, problems
from .call_check import CheckedCache
from ..backends import Capabilities, RunContext, get_backend
from ..db.read import DBSource, open_sources
from ..db import store
from ..db.store import TuningDB
from .dispatch import Decision
from ..dist_compat import check_group, group_device
from ..problem import Problem
from .replay import wrap_eager
from .warmup import WarmupLog, key_of as warmup_key
from ..geometry import DOUBLE_BUFFER_HALF_BYTES, MAX_WORLD_SIZE, workspace_layout
from ..workspace.symm import get_workspace

log = logging.getLogger("autosymm")

HAS_CUDA = torch.cuda.is_available()  # checked once: is_available() is a driver query per call


def _not_capturing() -> bool:
    return False


#: Whether the current CUDA stream is capturing a graph: torch's C function itself (what
#: torch.cuda.is_current_stream_capturing calls, one Python frame less on the hot path).
stream_capturing = torch._C._cuda_isCurrentStreamCapturing if HAS_CUDA else _not_capturing


def _no_stream(device_index: int) -> int:
    return 0


#: The raw handle of a device's current stream (0: torch's default stream, on which no capture
#: can run: torch refuses to capture there, CUDA refuses the legacy stream). A C call that
#: does not ask the driver, as :data:`stream_capturing` does (0.55 us a call on the 2x H200 node).
current_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", _no_stream) if HAS_CUDA else _no_stream


def check_traced(x, what: str) -> None:
    """ValueError for a fake or meta tensor outside tracing: it holds no data, so no collective
    can run on it (tracers, torch.compile's included, run with a dispatch mode active; Dynamo
    itself only while compiling)."""
    if torch.compiler.is_dynamo_compiling() or _current_dispatch_mode() is not None:
        return

    if isinstance(x, FakeTensor) or getattr(x, "is_meta", False):
        kind = "is a fake tensor" if isinstance(x, FakeTensor) else "is on meta"
        raise ValueError(f"autosymm.{what}: tensor {tuple(x.shape)} {x.dtype} {kind} outside tracing: it holds no "
                         f"data to reduce; pass a real tensor on the group's device (fake and meta tensors serve only "
                         f"inside torch.compile, torch.export or make_fx)")


def dense_error(x, what: str, name: str = "tensor"):
    """The error (TypeError, ValueError) naming argument ``name`` of ``autosymm.<what>`` unless
    ``x`` is a dense (strided) torch.Tensor, else None: the collectives move a tensor's storage,
    which a list has not and a sparse tensor does not hold as one dense block."""
    if not isinstance(x, torch.Tensor):
        return TypeError(f"autosymm.{what}: {name} must be a torch.Tensor, got {type(x).__name__}")
    if x.layout is not torch.strided:
        return ValueError(f"autosymm.{what}: {name} is a {str(x.layout).replace('torch.', '')} tensor "
                          f"{tuple(x.shape)}: only dense tensors are served (call .to_dense() first)")
    return None


def check_tensor(x: torch.Tensor, state: GroupState, what: str, name: str = "tensor") -> None:
    """ValueError (TypeError for a non-tensor) naming argument ``name`` of ``autosymm.<what>``
    unless ``x`` is a dense, contiguous tensor with data on the group's device."""
    error = dense_error(x, what, name)
    if error is not None:
        raise error
    check_traced(x, what)
    if x.device.type != state.device.type or (x.device.type == "cuda" and x.device != state.device):
        raise ValueError(f"autosymm.{what}: {name} is on {x.device}, the group's device is {state.device}")
    if not x.is_contiguous():
        raise ValueError(f"autosymm.{what}: {name} of shape {tuple(x.shape)} with strides {x.stride()} "
                         f"is not contiguous")


@dataclass
class Entry:
    """A prepared call: its decision, launcher and counters."""

    decision: Decision
    launcher: Any
    calls: int = 0
    bytes_per_call: int = 0  # the key fixes the size: bytes = calls * bytes_per_call


class GroupState:
    """What the first call on a group found out, agreed by every rank (see autosymm.runtime.agreement)."""

    #: only batch-invariant backends serve (AUTOSYMM_DETERMINISTIC as every rank has it, or
    #: autosymm.init(deterministic=...)); see autosymm.runtime.dispatch
    deterministic: bool = False

    #: AUTOSYMM_CHECK_CALLS on any rank of the group: every call is checked with every rank
    check_calls = False

    def __init__(self, group) -> None:
        self.group = group
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.device = group_device(group)
        self.channel = Exchange(group, self.rank, self.world_size)
        self.prepared_calls = 0
        local = LocalSetup(self.device, self.world_size)
        reports = self.channel.exchange("init", local.report)
        if any(report["capturing"] for report in reports):
            raise AgreementError("autosymm: the first call on a group ran inside a CUDA-graph capture; call "
                                 "autosymm.init(group) (or make one eager call) before capturing")
        self.intra_node = len({report["host"] for report in reports}) == 1
        self.fingerprint, self.hardware = local.fingerprint, local.fingerprint.hardware_slug
        #: why every call takes the fallback (NCCL), when the ranks failed or disagree at set-up
        self.safe_reason = problems(reports)
        # a rank that failed counts as off: every rank computes the same value
        self.deterministic = all(report["settings"].get("deterministic", False) for report in reports)
        #: AUTOSYMM_CHECK_CALLS on any rank: every call agrees on its fingerprint (autosymm.runtime.call_check)
        self.check_calls = any(report["settings"].get("check_calls") for report in reports)
        if self.safe_reason and self.rank == 0:
            warnings.warn(f"autosymm: every rank uses NCCL on this group: {self.safe_reason}", stacklevel=4)
        self.workspace = None
        if self.safe_reason is None and local.wants_workspace and self.intra_node:
            self.workspace = get_workspace(group, self.device)
        self.caps = Capabilities.of(self.world_size, workspace=self.workspace, intra_node=self.intra_node,
                                    compute_capability=self.fingerprint.compute_capability)
        self.sources = local.sources if self.safe_reason is None else []
        self.ctx = RunContext(group=group, workspace=self.workspace)
        self.cache: dict[tuple, Entry] = CheckedCache() if self.check_calls else {}
        self.agreed_calls: set[str] = set()  # agree_once's
        self.agreed_reports: list[dict] = []  # every rank's report of the last agreed check
        self.control_group = None  # the warm-up tuner's protocol group (autosymm.tuning.warmup), made at need
        self.warmup = WarmupLog()
        #: calls and bytes per backend of the calls decided again since (decide_again)
        self.past_counts: dict[str, dict[str, int]] = {}

    def decide(self, problem: Problem, mode: str) -> Decision:
        if self.safe_reason is not None:
            return dispatch.unagreed_decision(problem, mode, self.safe_reason, self.deterministic, self.hardware)
        decision = dispatch.decide(problem, mode, self.caps, self.sources, self.hardware, self.deterministic)
        note = self.warmup.notes.get(warmup_key(problem))
        return dispatch.with_note(decision, f"warm-up tuning: {note}") if note else decision

    def attach_stack(self, path, control_group=None) -> None:
        """A serving adapter's word (collective: every rank of the group alike): the stack's own
        path on this group (autosymm.backends.stack.StackPath) becomes a candidate and the default
        to beat (autosymm.runtime.dispatch), and ``control_group`` (a gloo group over the ranks,
        the stack's CPU group, when it is not the group the calls run on) carries the warm-up
        tuner's protocol. Calls are decided again."""
        self.ctx.stack = path
        self.caps = replace(self.caps, stack=path.name, stack_path=path)
        if control_group is not None and control_group is not self.group:
            self.control_group = control_group
        self.decide_again()

    def add_rows(self, rows, label: str) -> None:
        """Rows measured on this node since set-up (warm-up tuning: the same on every rank), served
        before every database's (the user database holds them too, for the next start)."""
        db = TuningDB(":memory:")
        db.record_many(list(rows))
        self.sources = [DBSource(db, label or "warm-up tuning", self.hardware)] + list(self.sources)

    def set_deterministic(self, value: bool) -> None:
        """``autosymm.init(deterministic=...)``: agreed with every rank (AgreementError naming the
        difference otherwise), then the calls prepared so far are decided again on their next use."""
        self.prepared_calls += 1
        report = {"ok": True, "error": "", "settings": {"deterministic": value}}
        trouble = problems(self.channel.exchange(f"call{self.prepared_calls}", report))
        if trouble is not None:
            raise AgreementError(f"autosymm: ranks disagree on init(deterministic=...): {trouble}")
        self.deterministic = value
        self.decide_again()

    def decide_again(self) -> None:
        """Drop the prepared calls (each is decided again on its next use); their counts stay."""
        for backend, agg in self.counts().items():
            self.past_counts[backend] = dict(agg)
        self.cache.clear()

    def counts(self) -> dict[str, dict[str, int]]:
        """Calls and bytes per backend since set-up."""
        out = {backend: dict(agg) for backend, agg in self.past_counts.items()}
        for entry in self.cache.values():
            agg = out.setdefault(entry.decision.backend, {"calls": 0, "bytes": 0})
            agg["calls"] += entry.calls
            agg["bytes"] += entry.calls * entry.bytes_per_call
        return out

    def prepare(self, problem: Problem, mode: str) -> Entry:
        decision = self.decide(problem, mode)
        log.info("autosymm: %s %s -> %s", problem.describe(), mode, decision.describe())
        backend = get_backend(decision.backend)
        if mode == "graph" and not backend.needs.graph_capturable:
            skipped = "; ".join(decision.skipped) or "none"
            raise RuntimeError(
                f"autosymm: {problem.describe()} cannot be captured in a CUDA graph: only {decision.backend} "
                f"can serve it ({decision.reason}; passed over: {skipped}). A larger workspace "
                f"(AUTOSYMM_WORKSPACE_BYTES) lets the Triton kernels serve it; or run this call eagerly")
        return Entry(decision, wrap_eager(backend.prepare(problem, decision.config, self.ctx), decision))

    def agree_once(self, call: str) -> None:
        """Agree on ``call`` (text that must match on every rank) on its first use on this group,
        on every use in checked mode: an AgreementError on every rank where the ranks differ."""
        if call in self.agreed_calls and not self.check_calls:
            return
        self.agreed_check(call, _nothing)
        self.agreed_calls.add(call)

    def agreed_check(self, call: str, check: Callable[[], Any], word: Optional[Callable[[Any], dict]] = None) -> Any:
        """``check()`` this rank's part of a new call (local work only: no collective), then make
        sure with every rank that each checked the same ``call`` (op, dtype, size, mode) without
        error; returns what ``check`` returned. A failure or mismatch raises on every rank: the
        failing rank its own error, the others an AgreementError naming it. ``word(result)``:
        what else this rank tells its peers (compared by nobody: :attr:`agreed_reports` holds
        every rank's report afterwards)."""
        result, error = None, None
        try:
            result = check()
        except Exception as exc:  # reported to the peers before it propagates
            error = exc
        self.prepared_calls += 1
        report = {"ok": error is None, "error": f"{type(error).__name__}: {error}" if error else "",
                  "settings": {"call": call}}
        if word is not None and error is None:
            report.update(word(result))
        self.agreed_reports = self.channel.exchange(f"call{self.prepared_calls}", report)
        trouble = problems(self.agreed_reports)
        if error is not None:
            raise error
        if trouble is not None:
            raise AgreementError(f"autosymm: ranks disagree on or failed at {call}: {trouble}")
        return result


class LocalSetup:
    """What this rank finds out on its own before the first agreement; never raises: a failure
    goes into ``report`` (ok False) so that every rank learns it and takes the same path."""

    def __init__(self, device: torch.device, world_size: int) -> None:
        self.fingerprint, self.sources, self.wants_workspace = hardware.cpu_fingerprint(), [], False
        self.report: dict[str, Any] = {"ok": True, "error": "", "host": socket.gethostname(),
                                       "capturing": stream_capturing(),
                                       "settings": {}}
        try:
            self._find_out(device, world_size)
        except Exception as exc:  # bad env value, unreadable DB, driver trouble: every rank hears it
            self.report.update(ok=False, error=f"{type(exc).__name__}: {exc}")

    def _find_out(self, device: torch.device, world_size: int) -> None:
        settings.check()  # a bad value of any runtime variable: every rank hears it and uses NCCL
        self.fingerprint = hardware.fingerprint()
        disabled = settings.disabled()
        agreed = self.report["settings"]
        agreed.update(hardware=self.fingerprint.hardware_slug, nccl_version=hardware.nccl_version(), disabled=disabled,
                      deterministic=settings.deterministic(), check_calls=settings.check_calls())
        self.sources = open_sources(store.user_db_path(), store.shipped_db_paths(), self.fingerprint.hardware_slug)
        agreed["databases"] = hashlib.sha256("".join(s.digest() for s in self.sources).encode()).hexdigest()
        self.wants_workspace = (device.type == "cuda" and 1 < world_size <= MAX_WORLD_SIZE and not disabled)
        if world_size > 1:  # what the kernels would be built with, compared even where none run
            region_bytes = settings.default_region_bytes()
            polls = settings.get_or_default("AUTOSYMM_BARRIER_MAX_POLLS")[0]
            if self.wants_workspace:
                # Triton kernels load only with a workspace; the limit is the one they compile with
                from ..kernels.barrier import MAX_POLLS

                polls = int(MAX_POLLS.value)
                check_free_memory(device, region_bytes)
            agreed.update(region_bytes=region_bytes, barrier_max_polls=polls,
                          multicast_off=settings.multicast_disabled_by_env())


def check_free_memory(device: torch.device, region_bytes: tuple[int, int]) -> None:
    """MemoryError naming the bytes when ``device`` cannot hold the workspace: checked before the
    rendezvous, because a rank whose allocation fails inside it would leave its peers waiting."""
    needed = workspace_layout(*region_bytes, DOUBLE_BUFFER_HALF_BYTES).total_bytes
    free, _ = torch.cuda.mem_get_info(device)
    if free < needed:
        raise MemoryError(f"{device} has {free} bytes free; the symmetric workspace needs {needed} "
                          f"(AUTOSYMM_WORKSPACE_BYTES sizes it)")


def _nothing() -> None:
    return None


STATES: dict[Any, GroupState] = {}
STATES_LOCK = threading.Lock()


def state_key(group):
    """The key of ``group``'s state: None for the default (world) group however it is named, so
    ``group=None`` and ``group=dist.group.WORLD`` share one state, its workspace and its cache."""
    return None if group is None or group is dist.group.WORLD else group


def state_of(group) -> GroupState:
    """``group``'s state, made on first use (collective: every rank of the group together)."""
    state = STATES.get(group)
    if state is None:
        check_group(group)
        if not dist.is_initialized():
            raise RuntimeError("autosymm needs torch.distributed initialised (dist.init_process_group)")
        key = state_key(group)
        with STATES_LOCK:
            state = STATES.get(key)
            if state is None:
                state = STATES[key] = GroupState(key if key is not None else dist.group.WORLD)
            STATES[group] = state  # the hot path's STATES.get(group) finds it under either name
    return state
