"""What an op's database key holds besides its dtype and world size, as records: its bucket unit
(:class:`BucketUnit`: what the ``bucket`` column counts) and its shape kind (:class:`ShapeKind`:
what the ``shape`` column holds), each with the command-line options that name it and how those
options pick an op's points. An option is data (:class:`Option`): autosymm.cli makes a click
option of it, nothing here imports click. `autosymm explain` asks for one call (a unit's
``option``, a kind's ``option`` and ``refine``), `autosymm tune` for a sweep (a unit's ``sweep``,
a kind's ``sweep``); their parsed values travel keyed by flag (:meth:`Option.of`), so the CLI and
the tuner hold no option of their own for any op.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional, Sequence

from ..problem import Problem, format_bytes, octave_points, parse_bytes, parse_range, parse_size_range
from ..settings import MAX_WORKSPACE_BYTES, default_region_bytes
from ..units import MAX_SIZE

#: Option values as the CLI hands them over: flag -> parsed value, only for the options given.
Values = Mapping[str, Any]


@dataclass(frozen=True, eq=False)  # an op shares an option by sharing its record
class Option:
    """A command-line option: ``flag`` ('--shape'), ``help``, ``parse`` (its text -> value, a
    ValueError saying what is wrong; None: a switch, True when given), ``default`` (text, parsed as
    a given one is; None: not given) and ``choices`` (the texts it takes; () any)."""

    flag: str
    help: str
    parse: Optional[Callable[[str], Any]] = None
    default: Optional[str] = None
    choices: tuple[str, ...] = ()

    @property
    def dest(self) -> str:
        """Its keyword name ('--no-residual' -> 'no_residual')."""
        return self.flag.lstrip("-").replace("-", "_")

    def of(self, values: Values) -> Any:
        """Its value in ``values`` (None: not given)."""
        return values.get(self.flag)


class OptionError(ValueError):
    """Option values no call can have; ``flag`` names the option to blame."""

    def __init__(self, flag: str, message: str) -> None:
        super().__init__(message)
        self.flag = flag


def parse_count(text: str) -> int:
    """'64' -> 64: a count (tokens per rank, elements per row) >= 1; ValueError otherwise."""
    try:
        count = int(text)
    except ValueError:
        raise ValueError(f"{text!r} is not an integer") from None
    if count < 1:
        raise ValueError(f"{count} is not >= 1")
    return count


def parse_counts(text: str) -> list[int]:
    """'1,3000,8192' -> those counts; '1:8192' -> every power of two from low to high; '1:8192:2' ->
    two per octave (autosymm.problem.octave_points). ValueError naming ``text`` otherwise."""
    try:
        counts = octave_points(*parse_range(text)) if ":" in text else \
            list(dict.fromkeys(int(t) for t in text.split(",") if t.strip()))
    except ValueError as exc:
        raise ValueError(f"{text!r} is not a token list like 1,4,3000 or a range like 1:8192 or 1:8192:2 "
                         f"({exc})") from None
    if not counts or min(counts) < 1:
        raise ValueError(f"token counts must be >= 1, got {text!r}")
    return counts


@dataclass(frozen=True)
class BucketUnit:
    """What an op's database bucket counts: ``name``, ``column`` (a plan's first column),
    ``label_suffix`` (after a plan's point label), ``json_field`` (`db show --json`), ``text`` (a
    bucket in the dispatcher's reasons) and ``cell`` (in `show`'s table); ``option`` (`explain`'s:
    one size) and ``sweep`` (`tune`'s: the sizes); ``refuse(problem, text)`` says why `explain`
    refuses the call of the size ``text`` asks for ('' none)."""

    name: str
    column: str
    label_suffix: str
    json_field: str
    text: Callable[[int], str]
    cell: Callable[[int], str]
    option: Option
    sweep: Option
    refuse: Callable[[Problem, str], str]


def _bytes_text(bucket: int) -> str:
    return format_bytes(bucket) if bucket % 1024 == 0 else f"{bucket} B"


def _refuse_bytes(problem: Problem, text: str) -> str:
    """A size no tensor of the dtype has, or over the workspace's all-reduce region."""
    size, elem = problem.nbytes, problem.elem_bytes
    if size < elem or size % elem:
        return f"{text!r} ({size} B) is not a whole, non-zero number of {problem.dtype} elements ({elem} B each)"
    region = default_region_bytes()[0]
    if size > region:
        return (f"{text!r} ({format_bytes(size)}) is over the workspace's all-reduce region ({format_bytes(region)}: "
                f"the default, or half of AUTOSYMM_WORKSPACE_BYTES, at most {format_bytes(MAX_WORKSPACE_BYTES // 2)});"
                " no tuned kernel can take it (NCCL serves such a call)")
    return ""


def _refuse_tokens(problem: Problem, text: str) -> str:
    if problem.nbytes > MAX_SIZE:
        return f"{problem.n_tokens_local} tokens per rank make {problem.nbytes} bytes, over 2^63 - 1"
    return ""


#: `autosymm tune --sizes` by default: 4 KiB..256 MiB, two points per octave (2^k, 1.5 * 2^k).
SIZES_SPEC = "4KiB:256MiB:2"
SIZES = tuple(parse_size_range(SIZES_SPEC))

#: Tokens per rank of the default sweep: powers of four from 1 to 4096, and 8192. The dispatcher
#: serves a count in between from its tuned neighbours, so the range 1..8192 is covered with 8
#: points instead of 14 (a sweep of minutes, not tens).
TOKEN_COUNTS = (1, 4, 16, 64, 256, 1024, 4096, 8192)

#: Bytes of the full (unsharded) tensor.
BYTES = BucketUnit(
    "bytes", "size", "", "size_bytes", _bytes_text, format_bytes,
    option=Option("--bytes", "the call's size: bytes of the full tensor, e.g. 1MiB or 3MB", parse_bytes),
    sweep=Option("--sizes", "sizes in bytes: a list, low:high (powers of two) or low:high:N (N per octave)",
                 parse_size_range, default=SIZES_SPEC),
    refuse=_refuse_bytes)
#: Tokens per rank (the op also has a shape: :class:`ShapeKind`).
TOKENS = BucketUnit(
    "tokens", "shape/tokens", " tok", "tokens_per_rank", lambda bucket: f"{bucket} tokens/rank", str,
    option=Option("--tokens", "the call's tokens per rank", parse_count),
    sweep=Option("--tokens", "tokens per rank: any list, low:high (powers of two) or low:high:N (N per octave)",
                 parse_counts, default=",".join(map(str, TOKEN_COUNTS))),
    refuse=_refuse_tokens)


@dataclass(frozen=True)
class ShapeKind:
    """What an op's database ``shape`` column holds: ``name``; ``option`` (`explain`'s: names one
    shape, needed for one call), ``refine`` (`explain`'s options refining it: the fused op's
    epilogue) and ``sweep`` (`tune`'s: the shapes); ``of_key`` (a shape from its key, a ValueError
    for text that is none), ``row_elements`` (elements per token of a shape, bounding a row's
    bytes), ``sort_key`` (the order plans list shapes in) and ``pick(values, candidates)`` (the
    shapes option values ask for; None: :meth:`select`'s rule)."""

    name: str
    option: Option
    of_key: Callable[[str], Any]
    row_elements: Callable[[Any], int]
    sort_key: Callable[[Any], Any]
    refine: tuple[Option, ...] = ()
    sweep: tuple[Option, ...] = ()
    pick: Optional[Callable[[Values, Sequence[Any]], list]] = None

    def select(self, values: Values, candidates: Sequence[Any]) -> list:
        """The shapes option ``values`` ask for: the one ``option`` names, else the list a ``sweep``
        option gives, else ``candidates`` (the op's default and tuned shapes). OptionError naming
        an option whose values no call has."""
        if self.pick is not None:
            return self.pick(values, candidates)
        one = self.option.of(values)
        if one is not None:
            return [one]
        return next((list(many) for many in (o.of(values) for o in self.sweep) if many is not None), list(candidates))
