"""The toy op's record: its shape kind (the row width, with its own command-line options), its
config type and its spec, naming its door, backends and tuning module by entry."""

from __future__ import annotations

import re
from dataclasses import dataclass

from autosymm.configs import AnyConfig, as_int
from autosymm.problem import Problem, torch_dtype
from autosymm.spec import Option, ShapeKind, TokensKeyed, TuningPoints
from autosymm.spec.kinds import parse_count


@dataclass(frozen=True)
class Width:
    """The toy op's shape: ``elements`` per row; its database key 'w{elements}'."""

    elements: int

    @property
    def key(self) -> str:
        return f"w{self.elements}"

    @classmethod
    def from_key(cls, key: str) -> "Width":
        match = re.fullmatch(r"w([1-9][0-9]*)", str(key))
        if match is None:
            raise ValueError(f"{key!r} is not a row width key like 'w64'")
        return cls(int(match.group(1)))


def parse_widths(text: str) -> tuple[Width, ...]:
    """'8,64' -> those widths; ValueError naming a bad item."""
    widths = tuple(Width(parse_count(item)) for item in text.split(",") if item.strip())
    if not widths:
        raise ValueError(f"no row width in {text!r}")
    return widths


WIDTH = ShapeKind("width", Option("--width", "the row width (elements per row)", lambda text: Width(parse_count(text))),
                  of_key=Width.from_key, row_elements=lambda width: width.elements,
                  sort_key=lambda width: width.elements,
                  sweep=(Option("--widths", "row widths, comma-separated", parse_widths, default="8,64"),))


@dataclass(frozen=True)
class ToyConfig(AnyConfig):
    """``chunks``: how many all_reduces the tensor is summed in (1..64)."""

    chunks: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "chunks", as_int("chunks", self.chunks))
        if not 1 <= self.chunks <= 64:
            raise ValueError(f"chunks={self.chunks} must be in 1..64")


@dataclass(frozen=True, eq=False)
class ToySpec(TokensKeyed):
    def check_problem(self, problem: Problem) -> None:
        if not isinstance(problem.shape, Width) or problem.n_tokens_local < 0:
            raise ValueError(f"toy needs a Width and n_tokens_local >= 0, got {problem.shape!r}, "
                             f"{problem.n_tokens_local}")

    def shape_key(self, problem: Problem) -> str:
        return problem.shape.key

    def problem_at(self, dtype: str, world_size: int, size: int, shape=None) -> Problem:
        nbytes = size * shape.elements * torch_dtype(dtype).itemsize
        return Problem(self.name, dtype, world_size, nbytes=nbytes, shape=shape, n_tokens_local=size)

    def empty_reason(self, problem: Problem) -> str:
        return "no rows: nothing to exchange" if problem.n_tokens_local == 0 else ""

    def one_rank_reason(self, deterministic: bool) -> str:
        return "world size 1: nothing to exchange"


TOY = ToySpec("toy", fallback="toy_gloo", fallback_order=("toy_gloo",), config_type=ToyConfig,
              points=TuningPoints(sizes=(1, 4, 16), shapes=(Width(8), Width(64))), shape=WIDTH,
              door="toy_op.door:DOOR",
              backends={"toy_gloo": "toy_op.backend:TOY_GLOO", "toy_chunked": "toy_op.backend:TOY_CHUNKED"},
              tuning="toy_op.tuning:TOY", tuned_by_default=False, local="toy_op.backend:identity")
