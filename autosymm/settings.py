"""Every environment variable autosymm reads, declared once (:data:`VARIABLES`) and parsed here;
no other module reads ``os.environ`` (tests/test_house.py checks it).

One boolean vocabulary for every switch: ``1, true, yes, on`` and ``0, false, no, off``
(case-insensitive, surrounding blanks ignored); unset or empty means the default; anything else
is a ValueError naming the variable and the value. A bad value never raises on one rank alone
during a group's first call: autosymm.runtime.group reports :func:`check`'s error in the rank agreement,
and every rank then uses NCCL. The agreed settings (disable flag, workspace sizes, barrier poll
limit, multicast switch, checked mode) are compared across ranks there.

Variables of other programs (torch, NCCL, NVSHMEM, CUDA, torchrun, XDG) are declared too, with
``owner`` naming whose meaning they carry; autosymm never sets the multicast / NVLS variables
(:func:`export` refuses them), it inherits them from the user.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Optional

from .geometry import ALIGN, DEFAULT_ALL_REDUCE_BYTES, DEFAULT_MOE_BYTES, align
from .problem import format_bytes, parse_bytes

TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("0", "false", "no", "off")
#: Largest AUTOSYMM_WORKSPACE_BYTES accepted (bytes): every rank allocates it as symmetric memory
#: on its GPU, and no supported GPU has room for more next to a model.
MAX_WORKSPACE_BYTES = 64 << 30
#: Default poll limit at run time: 2**30 polls, minutes of spinning (NCCL's watchdog waits
#: 10 minutes by default), so a slow peer (a checkpoint, a recompile) never turns a call into
#: garbage; only a peer that is gone does, and then barrier_errors() says so.
RUNTIME_MAX_POLLS = 1 << 30
#: The tuner's limit (`autosymm tune` exports AUTOSYMM_BARRIER_MAX_POLLS with it for its workers):
#: about 5-17 s, so a candidate whose peer failed ends by itself and is scored as failed.
TUNING_MAX_POLLS = 1 << 24
DEFAULT_AGREE_TIMEOUT_S = 300.0
#: Shortest AUTOSYMM_AGREE_TIMEOUT_S accepted (seconds).
MIN_AGREE_TIMEOUT_S = 1.0
LOG_LEVEL_NAMES = ("debug", "info", "warning", "error", "critical")


def parse_bool(name: str, text: str) -> bool:
    """``text`` of variable ``name`` as a switch (TRUE_WORDS / FALSE_WORDS, any case)."""
    word = text.strip().lower()
    if word in TRUE_WORDS:
        return True
    if word in FALSE_WORDS:
        return False
    raise ValueError(f"{name}={text!r} is not a switch: use one of {', '.join(TRUE_WORDS)} (on) "
                     f"or {', '.join(FALSE_WORDS)} (off)")


def _bytes_in(low: int, high: int) -> Callable[[str, str], int]:
    def parse(name: str, text: str) -> int:
        try:
            nbytes = parse_bytes(text)
        except ValueError:
            nbytes = None
        if nbytes is None or not low <= nbytes <= high:
            raise ValueError(f"{name}={text!r} is not a size from {format_bytes(low)} to {format_bytes(high)} "
                             f"(examples: 1073741824, 512MiB, 2GiB)")
        return nbytes
    return parse


def _polls(name: str, text: str) -> int:
    try:
        polls = int(text, 0)
    except ValueError:
        polls = 0
    if not 1 <= polls < 1 << 31:
        raise ValueError(f"{name}={text!r} must be an integer in 1..2**31-1")
    return polls


def _seconds(name: str, text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not MIN_AGREE_TIMEOUT_S <= value <= 24 * 3600:  # NaN fails too
        raise ValueError(f"{name}={text!r} must be a number of seconds in [{MIN_AGREE_TIMEOUT_S:g}, 86400]: a "
                         f"shorter deadline gives up on healthy peers (a first call opens databases and "
                         f"allocates the workspace)")
    return value


def _threads(name: str, text: str) -> int:
    try:
        return max(1, int(text))
    except ValueError:
        raise ValueError(f"{name}={text!r} must be a whole number of threads") from None


def parse_log_level(text: str) -> Optional[int]:
    """'debug' -> 10, 'WARNING' -> 30, 'warn' -> 30, '15' -> 15; None for anything else
    (numbers must be >= 0)."""
    text = text.strip()
    if text.isdigit():
        return int(text)
    name = {"WARN": "WARNING", "FATAL": "CRITICAL"}.get(text.upper(), text.upper())
    return getattr(logging, name) if name.lower() in LOG_LEVEL_NAMES else None


def _log_level(name: str, text: str) -> int:
    level = parse_log_level(text)
    if level is None:
        raise ValueError(f"{name}={text!r}: give a level name ({', '.join(LOG_LEVEL_NAMES)}) "
                         f"or a number >= 0, e.g. {name}=debug")
    return level


def _path(name: str, text: str) -> Path:
    return Path(text).expanduser()


#: AUTOSYMM_AUTOTUNE's budget when it is switched on without a number (seconds).
DEFAULT_AUTOTUNE_S = 30.0


def _budget(name: str, text: str) -> float:
    word = text.strip().lower()
    if word in TRUE_WORDS[1:]:  # '1' is a number of seconds
        return DEFAULT_AUTOTUNE_S
    if word in FALSE_WORDS[1:]:
        return 0.0
    try:
        value = float(word)
    except ValueError:
        value = -1.0
    if not 0.0 <= value <= 24 * 3600:
        raise ValueError(f"{name}={text!r} must be seconds of tuning budget in [0, 86400] or a switch "
                         f"(on: {DEFAULT_AUTOTUNE_S:g} s)")
    return value


def _fraction(name: str, text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0.0 <= value <= 1.0:  # NaN fails too
        raise ValueError(f"{name}={text!r} must be a fraction in [0, 1] (0.05: 5 %)")
    return value


def _text(name: str, text: str) -> str:
    return text


@dataclass(frozen=True)
class Variable:
    """One environment variable: ``parse(name, text)`` turns a non-empty value into its setting
    (ValueError naming the variable and value when it cannot); ``default`` serves when it is
    unset or empty. ``scope``: 'runtime' (checked at a group's first call, :func:`check`),
    'tuning' (the tuner and bench), 'log', or 'foreign' (another program's variable, read or
    recorded as text). ``agreed``: compared across ranks at a group's first call."""

    name: str
    parse: Callable[[str, str], Any]
    default: Any
    doc: str
    scope: str = "runtime"
    agreed: bool = False
    owner: str = "autosymm"


VARIABLES: tuple[Variable, ...] = (
    Variable("AUTOSYMM_DISABLE", parse_bool, False, "switch: every call uses NCCL", agreed=True),
    Variable("AUTOSYMM_WORKSPACE_BYTES", _bytes_in(2 * ALIGN, MAX_WORKSPACE_BYTES), None,
             "size of the symmetric workspace, split in halves between all-reduce and MoE", agreed=True),
    Variable("AUTOSYMM_BARRIER_MAX_POLLS", _polls, RUNTIME_MAX_POLLS,
             "polls before a signal-pad wait gives up; read when autosymm is imported", agreed=True),
    Variable("AUTOSYMM_CHECK_CALLS", parse_bool, False,
             "switch: every call agrees on its op, dtypes, shapes and reduce op with every rank before it runs "
             "(autosymm.runtime.call_check)", agreed=True),
    Variable("AUTOSYMM_AGREE_TIMEOUT_S", _seconds, DEFAULT_AGREE_TIMEOUT_S,
             "seconds a rank waits for its peers' reports in a rank agreement"),
    Variable("AUTOSYMM_DETERMINISTIC", parse_bool, False,
             "switch: only batch-invariant backends (a row's bits follow its inputs alone)", agreed=True),
    Variable("AUTOSYMM_AUTOTUNE", _budget, None,
             "warm-up tuning for the whole process (autosymm.autotune): seconds of budget, or a switch (on: 30 s)"),
    Variable("AUTOSYMM_STACK_AUTOTUNE", _budget, DEFAULT_AUTOTUNE_S,
             "the vLLM / SGLang plugins' warm-up tuning during the stack's warm-up: seconds of budget (default "
             "30), or a switch (off: none)"),
    Variable("AUTOSYMM_STACK_MARGIN", _fraction, 0.05,
             "inside a serving stack, how much faster (a fraction: 0.05 = 5 %) a row must have measured autosymm "
             "than the stack's own path for autosymm to take the call", agreed=True),
    Variable("AUTOSYMM_EAGER_REPLAY", parse_bool, True,
             "switch: eager Triton all-reduces replay a cached CUDA graph per tensor address"),
    Variable("AUTOSYMM_DB", _path, None, "path of the user's tuning database"),
    Variable("TORCH_SYMM_MEM_DISABLE_MULTICAST", parse_bool, False,
             "switch: no NVLink multicast (torch; autosymm then runs no multimem kernel)", agreed=True,
             owner="torch"),
    Variable("AUTOSYMM_COMPILE_THREADS", _threads, None, "threads the tuner compiles a problem's kernels with",
             scope="tuning"),
    Variable("AUTOSYMM_LOG", _log_level, None, "level of the autosymm logger (a bad value is only warned about)",
             scope="log"),
    Variable("NCCL_NVLS_ENABLE", _text, None, "NCCL's NVLS switch: recorded with results, never set", scope="foreign",
             owner="NCCL"),
    Variable("NVSHMEM_DISABLE_NVLS", _text, None, "NVSHMEM's NVLS switch: recorded with results, never set",
             scope="foreign", owner="NVSHMEM"),
    Variable("CUDA_VISIBLE_DEVICES", _text, None, "maps torch's GPUs to nvidia-smi's indices (NVLink counts)",
             scope="foreign", owner="CUDA"),
    Variable("XDG_CACHE_HOME", _text, None, "where the default user database lives", scope="foreign", owner="XDG"),
    Variable("RANK", _text, None, "with WORLD_SIZE and LOCAL_RANK: `autosymm tune` joins a torchrun launch",
             scope="foreign", owner="torchrun"),
    Variable("WORLD_SIZE", _text, None, "see RANK", scope="foreign", owner="torchrun"),
    Variable("LOCAL_RANK", _text, None, "see RANK", scope="foreign", owner="torchrun"),
)
BY_NAME = {variable.name: variable for variable in VARIABLES}
#: The multicast / NVLS variables: autosymm reads and records them, never sets them.
MULTICAST_VARIABLES = ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "NCCL_NVLS_ENABLE", "NVSHMEM_DISABLE_NVLS")
#: NVLink multicast / NVLS off, as the GPU tests and node scripts set it on shared hosts
#: (scripts/_node_env.sh). autosymm itself never applies it: it inherits the user's environment.
MULTICAST_OFF_ENV = {"TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NCCL_NVLS_ENABLE": "0", "NVSHMEM_DISABLE_NVLS": "1"}


def _declared(name: str) -> Variable:
    variable = BY_NAME.get(name)
    if variable is None:
        raise KeyError(f"autosymm.settings declares no environment variable {name!r}")
    return variable


def raw(name: str, environ: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """The text of declared variable ``name`` (None when unset), from ``environ`` (default: this
    process's environment)."""
    _declared(name)
    return (os.environ if environ is None else environ).get(name)


def get(name: str, environ: Optional[Mapping[str, str]] = None) -> Any:
    """The setting of declared variable ``name``: its parsed value, or its default when unset or
    empty (blanks only); ValueError naming the variable and the value when it does not parse."""
    variable = _declared(name)
    text = raw(name, environ)
    if text is None or not text.strip():
        return variable.default
    return variable.parse(name, text)


def get_or_default(name: str, environ: Optional[Mapping[str, str]] = None) -> tuple[Any, str]:
    """(setting, "") or, for a bad value, (the default, the error message): for readers that must
    not raise (module import, logging set-up) and leave the error to :func:`check` or a warning."""
    try:
        return get(name, environ), ""
    except ValueError as exc:
        return _declared(name).default, str(exc)


def errors(scope: str = "runtime", environ: Optional[Mapping[str, str]] = None) -> list[str]:
    """The error message of every variable of ``scope`` whose value does not parse."""
    return [message for variable in VARIABLES if variable.scope == scope
            for message in [get_or_default(variable.name, environ)[1]] if message]


def check(environ: Optional[Mapping[str, str]] = None) -> None:
    """ValueError naming every bad runtime variable (a group's first call reports it to every
    rank, which then all use NCCL)."""
    found = errors("runtime", environ)
    if found:
        raise ValueError("; ".join(found))


def export(values: Mapping[str, str], *, overwrite: bool = True) -> None:
    """Set variables in this process's environment (inherited by the workers it starts), e.g.
    torch.distributed's rendezvous address. ``overwrite`` False keeps a value already set.
    ValueError for the multicast / NVLS variables: autosymm never sets them."""
    refused = sorted(set(values) & set(MULTICAST_VARIABLES))
    if refused:
        raise ValueError(f"autosymm never sets {', '.join(refused)}: the user's environment decides")
    for name, value in values.items():
        if overwrite or name not in os.environ:
            os.environ[name] = str(value)


def disabled() -> bool:
    """AUTOSYMM_DISABLE: True when every call should use NCCL."""
    return get("AUTOSYMM_DISABLE")


def deterministic() -> bool:
    """AUTOSYMM_DETERMINISTIC: True when dispatch may pick only batch-invariant backends."""
    return get("AUTOSYMM_DETERMINISTIC")


def check_calls() -> bool:
    """AUTOSYMM_CHECK_CALLS: True when every call agrees on its fingerprint across ranks."""
    return get("AUTOSYMM_CHECK_CALLS")


def multicast_disabled_by_env() -> bool:
    """True when TORCH_SYMM_MEM_DISABLE_MULTICAST asks torch not to use multicast."""
    return get("TORCH_SYMM_MEM_DISABLE_MULTICAST")


def default_region_bytes() -> tuple[int, int]:
    """(all-reduce bytes, MoE bytes): AUTOSYMM_WORKSPACE_BYTES split in halves (at most
    MAX_WORKSPACE_BYTES), or the defaults when it is unset."""
    nbytes = get("AUTOSYMM_WORKSPACE_BYTES")
    if nbytes is None:
        return DEFAULT_ALL_REDUCE_BYTES, DEFAULT_MOE_BYTES
    half = align(nbytes // 2)
    return half, max(ALIGN, nbytes - half)


def comm_env() -> str:
    """The multicast / NVLS variables as this process sees them ('unset' where absent), e.g.
    'TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=unset'."""
    return " ".join(f"{name}={raw(name) if raw(name) is not None else 'unset'}" for name in MULTICAST_VARIABLES)
