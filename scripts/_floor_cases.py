"""The cases of scripts/bench_emulated_floor.py: what each rank launches, on what data, and the
bit-exact check of its outputs. Shared by the GPU executor (ranks on streams of one GPU) and the
CPU smoke (ranks as forked processes under the Triton interpreter), and by both trees of a
``--compare`` run: only the backends' public surface is used (``get_backend(name).prepare(problem,
config, RunContext(workspace=ws))`` and the launchers' ``__call__``), which the base tree has too.

A case is one backend with one config at one size. All-reduce sizes are the tensor's bytes;
reduce-scatter the full input's, all-gather the full output's; fused cases are [tokens, hidden].
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

#: The fused cases' eps, and the fp8 epilogue's static scale.
EPS = 1e-6
FP8_SCALE = 0.01
#: Workspace of the emulated ranks (bytes): every stage of every case up to 1 MiB fits, at W = 8.
ALL_REDUCE_BYTES = 16 << 20
DOUBLE_BUFFER_BYTES = 4 << 20


@dataclass(frozen=True)
class Case:
    op: str  # all_reduce | all_reduce_rmsnorm | reduce_scatter | all_gather
    backend: str  # the registry name (autosymm.backends)
    algorithm: str
    block: int
    grid: int
    warps: int
    size: int  # bytes (all_reduce, reduce_scatter, all_gather) or tokens (all_reduce_rmsnorm)
    hidden: int = 0
    epilogue: str = ""  # autosymm.epilogue key ('' the default add + RMSNorm)
    double_buffer: bool = False
    rows: int = 1
    dtype: str = "bf16"
    spin: bool = False  # the Lamport wait's per-thread spin (configs' ``spin``; world size 2)
    split: int = 1  # fused: programs sharing a row (FusedConfig.row_split)

    @property
    def family(self) -> str:
        db = ("+db" if self.double_buffer else "") + ("+spin" if self.spin else "")
        if self.op == "all_reduce_rmsnorm":
            return f"fused_{self.algorithm}{db}" + (f"[{self.epilogue}]" if self.epilogue else "")
        return f"{self.op.replace('all_reduce', 'ar').replace('reduce_scatter', 'rs').replace('all_gather', 'ag')}:" \
               f"{self.algorithm}{db}"

    @property
    def shape(self) -> str:
        if self.op == "all_reduce_rmsnorm":
            return f"{self.size}x{self.hidden}"
        return _fmt_bytes(self.size)

    @property
    def config_text(self) -> str:
        rows = f" r{self.rows}" if self.rows > 1 else ""
        split = f" s{self.split}" if self.split > 1 else ""
        return f"B{self.block} g{self.grid} w{self.warps}{rows}{split}"

    @property
    def key(self) -> str:
        return f"{self.family} {self.shape} {self.config_text}"

    def problem(self, world_size: int):
        from autosymm.problem import Problem

        if self.op == "all_reduce_rmsnorm":
            from autosymm.epilogue import Epilogue

            epilogue = Epilogue.of_key(self.epilogue) if self.epilogue else None
            return Problem.all_reduce_rmsnorm(self.size, self.hidden, self.dtype, world_size, epilogue=epilogue)
        return Problem(self.op, self.dtype, world_size, nbytes=self.size)

    def config(self):
        from autosymm import configs

        spin = {"spin": True} if self.spin else {}  # a base tree without the field refuses only these
        if self.op == "all_reduce":
            return configs.AllReduceConfig(self.algorithm, self.block, self.grid, self.warps,
                                           double_buffer=self.double_buffer, **spin)
        if self.op == "all_reduce_rmsnorm":
            return configs.FusedConfig(self.algorithm, self.block, self.warps, self.grid, self.rows,
                                       double_buffer=self.double_buffer, row_split=self.split, **spin)
        kind = configs.ReduceScatterConfig if self.op == "reduce_scatter" else configs.AllGatherConfig
        return kind(self.algorithm, self.block, self.grid, self.warps)


def _fmt_bytes(n: int) -> str:
    return f"{n >> 20}MiB" if n >= 1 << 20 and n % (1 << 20) == 0 else f"{n >> 10}KiB" if n % 1024 == 0 else f"{n}B"


# -- the case list -------------------------------------------------------------------------------

#: Default all-reduce, reduce-scatter and all-gather sizes (bytes), and the fused shapes.
SIZES = (2 << 10, 8 << 10, 64 << 10, 256 << 10, 1 << 20)
FUSED_TOKENS = (1, 8)
FUSED_HIDDEN = (4096, 8192)
FUSED_EPILOGUES = ("", "add_rms_fp8")
LAMPORT_MAX_BYTES = 256 << 10
#: The CPU smoke's size: 3072 bf16 elements, shards of whole 16-byte vectors at W = 2, 3 and 4.
SMOKE_BYTES = 6144


def sized_configs(nbytes: int, elem_bytes: int = 2, quick: bool = False) -> list[tuple[int, int, int]]:
    """(BLOCK, grid, warps) sized for the message: 16 bytes a thread, one chunk a program, at two
    widths (4 and 16 warps; ``quick``: one above 64 KiB), at most 132 programs; plus the issue's
    B1024 g4 w4 up to 8 KiB (not ``quick``)."""
    numel = max(1, nbytes // elem_bytes)
    out = []
    for block, warps in ((1024, 4), (4096, 16)):
        if block > 2 * numel and block != 1024:
            continue
        out.append((block, min(132, math.ceil(numel / block)), warps))
    if quick:
        return out if nbytes <= (64 << 10) else out[:1]
    if nbytes <= (8 << 10) and (1024, 4, 4) not in out:
        out.append((1024, 4, 4))
    return out


def default_cases(sizes=SIZES, families: Optional[set] = None, quick: bool = False) -> list[Case]:
    """Every family at ``sizes``: all-reduce (pull one-shot single and double buffer, push one-shot
    single and double buffer, two-shot, Lamport with and without its per-thread spin), the fused all-reduce + RMSNorm at 1 and 8 tokens
    of hidden 4096 and 8192 with the default and the static-FP8 epilogue (push and pull one-shots
    double-buffered, two-shot at 8 tokens, Lamport where the tree has it), reduce-scatter (pull,
    push) and all-gather (push, pull). ``quick``: fewer configs (:func:`sized_configs`; reduce-scatter
    and all-gather one per size; the fused cases at 16 warps only)."""
    cases: list[Case] = []

    def add(case: Case) -> None:
        if families is None or any(f in case.family for f in families):
            cases.append(case)

    for nbytes in sizes:
        configs = sized_configs(nbytes, quick=quick)
        for index, (block, grid, warps) in enumerate(configs):
            for name, algorithm, db in (("triton_one_shot", "one_shot", False), ("triton_one_shot", "one_shot", True),
                                        ("triton_one_shot_push", "one_shot_push", False),
                                        ("triton_one_shot_push", "one_shot_push", True),
                                        ("triton_lamport", "lamport", False)):
                if algorithm == "lamport" and nbytes > LAMPORT_MAX_BYTES:
                    continue
                if db and algorithm == "one_shot" and nbytes > (1 << 20):
                    continue
                add(Case("all_reduce", name, algorithm, block, grid, warps, nbytes, double_buffer=db))
                if algorithm == "lamport":
                    add(Case("all_reduce", name, algorithm, block, grid, warps, nbytes, spin=True))
            # two-shot: a program per chunk of a rank's segment
            seg = max(1, nbytes // 2 // 2)
            add(Case("all_reduce", "triton_two_shot", "two_shot", block, max(1, min(grid, math.ceil(seg / block))),
                     warps, nbytes))
            if quick and index:
                continue
            for algorithm in ("pull", "push"):
                add(Case("reduce_scatter", f"triton_reduce_scatter_{algorithm}", algorithm, block,
                         max(1, min(grid, math.ceil(seg / block))), warps, nbytes))
            for algorithm in ("push", "pull"):  # BLOCK in bytes: the same 16 bytes a thread
                add(Case("all_gather", f"triton_all_gather_{algorithm}", algorithm, 2 * block,
                         max(1, min(grid, math.ceil(nbytes // 2 / (2 * block)))), warps, nbytes))
    for tokens in FUSED_TOKENS:
        for hidden in FUSED_HIDDEN:
            block = 1 << (hidden - 1).bit_length()
            for epilogue in FUSED_EPILOGUES:
                for warps in ((16,) if quick else (8, 16)):
                    for name, algorithm, db in (("triton_fused_one_shot_push", "one_shot_push", True),
                                                ("triton_fused_one_shot", "one_shot", True),
                                                ("triton_fused_lamport", "lamport", False)):
                        add(Case("all_reduce_rmsnorm", name, algorithm, block, tokens, warps, tokens, hidden, epilogue,
                                 double_buffer=db))
                        if algorithm == "lamport":
                            add(Case("all_reduce_rmsnorm", name, algorithm, block, tokens, warps, tokens, hidden,
                                     epilogue, spin=True))
                    if tokens > 1:
                        add(Case("all_reduce_rmsnorm", "triton_fused_two_shot", "two_shot", block, tokens, warps,
                                 tokens, hidden, epilogue))
                if tokens == 1:  # split rows (1024 columns a program, 4 warps: 16 bytes a thread), Lamport and push
                    split = block // 1024
                    for name, algorithm, db, spin in (("triton_fused_one_shot_push", "one_shot_push", True, False),
                                                      ("triton_fused_lamport", "lamport", False, False),
                                                      ("triton_fused_lamport", "lamport", False, True)):
                        add(Case("all_reduce_rmsnorm", name, algorithm, block, split, 4, tokens, hidden, epilogue,
                                 double_buffer=db, spin=spin, split=split))
    return cases


def smoke_cases() -> list[Case]:
    """The CPU smoke's cases: every family once, small and ragged-free, at narrow BLOCKs (the
    interpreter is slow)."""
    out = [Case("all_reduce", "triton_one_shot", "one_shot", 256, 2, 2, SMOKE_BYTES),
           Case("all_reduce", "triton_one_shot", "one_shot", 256, 2, 2, SMOKE_BYTES, double_buffer=True),
           Case("all_reduce", "triton_one_shot_push", "one_shot_push", 256, 2, 2, SMOKE_BYTES),
           Case("all_reduce", "triton_one_shot_push", "one_shot_push", 256, 2, 2, SMOKE_BYTES, double_buffer=True),
           Case("all_reduce", "triton_two_shot", "two_shot", 256, 2, 2, SMOKE_BYTES),
           Case("all_reduce", "triton_lamport", "lamport", 256, 2, 2, SMOKE_BYTES),
           Case("all_reduce", "triton_lamport", "lamport", 256, 2, 2, SMOKE_BYTES, spin=True),
           Case("reduce_scatter", "triton_reduce_scatter_pull", "pull", 256, 2, 2, SMOKE_BYTES),
           Case("reduce_scatter", "triton_reduce_scatter_push", "push", 256, 2, 2, SMOKE_BYTES),
           Case("all_gather", "triton_all_gather_push", "push", 512, 2, 2, SMOKE_BYTES),
           Case("all_gather", "triton_all_gather_pull", "pull", 512, 2, 2, SMOKE_BYTES)]
    for name, algorithm, db in (("triton_fused_one_shot_push", "one_shot_push", True),
                                ("triton_fused_one_shot", "one_shot", True), ("triton_fused_lamport", "lamport", False)):
        for epilogue in FUSED_EPILOGUES:
            out.append(Case("all_reduce_rmsnorm", name, algorithm, 256, 2, 2, 2, 256, epilogue, double_buffer=db))
    out.append(Case("all_reduce_rmsnorm", "triton_fused_two_shot", "two_shot", 256, 2, 2, 4, 256))
    return out


def available(case: Case) -> Optional[str]:
    """Why this tree cannot run ``case`` (its backend or algorithm is unknown), or None."""
    from autosymm.backends import backend_names

    if case.backend not in backend_names():
        return f"no backend {case.backend} in this tree"
    try:
        case.config()
    except (TypeError, ValueError) as exc:  # TypeError: a field the tree's config lacks (spin)
        return f"config refused: {exc}"
    return None


def in_space(case: Case, world_size: int) -> Optional[bool]:
    """Whether the backend's search space (what the tuner sweeps) holds ``case``'s config."""
    from autosymm.backends import get_backend

    try:
        return case.config() in get_backend(case.backend).search_space(case.problem(world_size))
    except Exception:
        return None


# -- one case on W ranks -------------------------------------------------------------------------

@dataclass
class RankedCase:
    """``case`` on ``world_size`` ranks: its tensors (every rank's), its launchers (made per rank
    with :meth:`prepare`), a launch of one rank's call on the current stream (:meth:`call`), fresh
    inputs (:meth:`load_inputs`) and the check of every rank's outputs (:meth:`check`)."""

    case: Case
    world_size: int
    device: str
    shared: bool = False  # CPU smoke: tensors in shared memory (ranks are forked processes)
    t: dict = field(default_factory=dict)
    launchers: list = field(default_factory=list)

    def __post_init__(self) -> None:
        from autosymm.problem import DTYPES

        self.dtype = DTYPES[self.case.dtype]
        self.problem = self.case.problem(self.world_size)
        self.launchers = [None] * self.world_size
        c, W, dev = self.case, self.world_size, self.device

        def new(shape, dtype=None):
            t = torch.zeros(shape, dtype=dtype or self.dtype, device=dev)
            return t.share_memory_() if self.shared else t

        if c.op == "all_reduce":
            numel = c.size // self.problem.elem_bytes
            self.t = {"x": [new(numel) for _ in range(W)], "inputs": [new(numel) for _ in range(W)]}
        elif c.op == "reduce_scatter":
            numel = c.size // self.problem.elem_bytes
            self.t = {"inputs": [new(numel) for _ in range(W)], "out": [new(numel // W) for _ in range(W)]}
        elif c.op == "all_gather":
            numel = c.size // self.problem.elem_bytes
            self.t = {"inputs": [new(numel // W) for _ in range(W)], "out": [new(numel) for _ in range(W)]}
        else:
            from autosymm.epilogue import Epilogue

            self.epilogue = Epilogue.of_key(c.epilogue) if c.epilogue else Epilogue()
            shape = (c.size, c.hidden)
            outs = [self.epilogue.empty_outputs(c.size, c.hidden, self.dtype, dev) for _ in range(W)]
            if self.shared:
                outs = [tuple(None if o is None else o.share_memory_() for o in pair) for pair in outs]
            self.t = {"x": [new(shape) for _ in range(W)], "residual": [new(shape) for _ in range(W)],
                      "residual_in": new(shape), "weight": new(c.hidden), "outs": outs,
                      "scale": new(1, torch.float32)}

    def prepare(self, rank: int, workspace) -> None:
        from autosymm.backends import get_backend
        from autosymm.backends.base import RunContext

        self.launchers[rank] = get_backend(self.case.backend).prepare(self.problem, self.case.config(),
                                                                      RunContext(workspace=workspace))

    def call(self, rank: int) -> None:
        """Launch rank ``rank``'s call on the current stream (in place where the op is)."""
        t, launch = self.t, self.launchers[rank]
        op = self.case.op
        if op == "all_reduce":
            launch(t["x"][rank])
        elif op in ("reduce_scatter", "all_gather"):
            launch(t["out"][rank], t["inputs"][rank])
        else:
            out, scales = t["outs"][rank]
            launch(t["x"][rank], t["residual"][rank] if self.epilogue.residual else None, t["weight"], EPS,
                   out=out if scales is None else (out, scales), scale=t["scale"])

    def load_inputs(self, seed: int, zeros: bool = False) -> None:
        """Fresh random inputs (``zeros``: all zero, for timing: in-place sums then never grow)."""
        gen = torch.Generator().manual_seed(seed)

        def fill(dst, scale=1.0):
            if zeros:
                dst.zero_()
            else:
                dst.copy_((scale * torch.randn(dst.shape, generator=gen)).to(dst.dtype))

        t = self.t
        for r in range(self.world_size):
            fill(t["inputs"][r] if "inputs" in t else t["x"][r])
            if "x" in t and "inputs" in t:
                t["x"][r].copy_(t["inputs"][r])
        if self.case.op == "all_reduce_rmsnorm":
            fill(t["residual_in"])
            t["weight"].copy_((1 + 0.5 * torch.randn(self.case.hidden, generator=gen)).to(self.dtype))
            t["scale"].fill_(FP8_SCALE)
            for r in range(self.world_size):
                t["residual"][r].copy_(t["residual_in"])

    def check(self) -> None:
        """Every rank's outputs against the reference (AssertionError naming the first bad one):
        sums bit-exact with the fp32 in-order sum rounded once; all-gather bytes exact; the fused
        residual bit-exact, out and scales bit-identical on every rank and the epilogue formula's
        (autosymm.epilogue.reference) within its last fp32 bit (quantized: 99 % identical)."""
        t, W, op = self.t, self.world_size, self.case.op
        if op == "all_gather":
            want = torch.cat(t["inputs"])
            for r in range(W):
                _same_bits(t["out"][r], want, f"rank {r}")
            return
        if op == "all_reduce_rmsnorm":
            self._check_fused()
            return
        total = _fp32_sum(t["inputs"])
        for r in range(W):
            if op == "all_reduce":
                _same_bits(t["x"][r], total, f"rank {r}")
            else:
                seg = total.numel() // W
                _same_bits(t["out"][r], total[r * seg:(r + 1) * seg], f"rank {r}")

    def _check_fused(self) -> None:
        from autosymm.epilogue import reference

        t, epilogue = self.t, self.epilogue
        total = torch.zeros(t["x"][0].shape, dtype=torch.float32, device=self.device)
        for x in t["x"]:
            total = total + x.float()
        want = reference(total, t["residual_in"], t["weight"], EPS, epilogue, t["scale"])
        want_residual = _round_like_kernels(total + t["residual_in"].float(), self.dtype)
        for r in range(self.world_size):
            if epilogue.residual:
                _same_bits(t["residual"][r], want_residual, f"residual rank {r}")
            for got, first in zip(t["outs"][r], t["outs"][0]):
                if got is not None:
                    _same_bits(got, first, f"out rank {r} against rank 0")
        out = t["outs"][0][0]
        if epilogue.quant is None:
            ulps = _ulps_off(out.float(), want.out.float())
            assert ulps <= 1.0, f"out {ulps} ulp off the formula"
        else:
            same = (_bits(out) == _bits(want.out)).float().mean().item()
            assert same >= 0.99, f"only {same:.4f} of the quantized values are the formula's"


def _fp32_sum(tensors) -> torch.Tensor:
    acc = torch.zeros(tensors[0].shape, dtype=torch.float32, device=tensors[0].device)
    for t in tensors:
        acc = acc + t.float()
    return _round_like_kernels(acc, tensors[0].dtype)


def _round_like_kernels(acc: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The kernels' fp32 -> ``dtype`` cast: round to nearest even on GPUs; the interpreter's bf16
    cast truncates (tests/test_batch_invariance.py says where)."""
    if dtype is torch.bfloat16 and os.environ.get("TRITON_INTERPRET") == "1":
        return (acc.contiguous().view(torch.int32) >> 16).to(torch.int16).view(torch.bfloat16)
    return acc.to(dtype)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def _same_bits(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    same = _bits(got) == _bits(want.to(got.device))
    if not bool(same.all()):
        bad = torch.nonzero(~same.reshape(-1)).flatten()
        i = int(bad[0])
        raise AssertionError(f"{what}: {bad.numel()} of {same.numel()} elements differ, first at {i}: "
                             f"{got.reshape(-1)[i].item()} != {want.reshape(-1)[i].item()}")


def _ulps_off(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest distance of ``got`` from ``want`` in units of got's dtype's last place at ``want``."""
    _, exponent = torch.frexp(want.abs().clamp_min(2.0**-126))
    ulp = torch.ldexp(torch.ones_like(want), exponent - 8)  # bf16: 8 significant bits
    return float(((got - want).abs() / ulp).max())


Call = Callable[[int], None]
