"""The epilogue of the fused all-reduce + RMSNorm (``all_reduce_rmsnorm``): what follows the sum
(residual add or not, RMSNorm or Gemma RMSNorm, output quantization), as one record
(:class:`Epilogue`), the reference formula (:func:`reference`, by name :data:`SINGLE_ROUNDING`), and
the name of the op's other formula, the stacks' unfused chain the default call's fallback computes
(:data:`NATIVE_CHAIN`); which path computes which: docs/EPILOGUE.md#each-paths-formula.

In short, per row, from ``sum_fp32`` (the ranks' x summed in fp32, ranks 0..W-1 in order) and the
dtype ``T`` of x: ``s = sum_fp32 (+ residual.float())`` in fp32, the residual written back as
``T(s)``, ``y = s * rsqrt(sum(s * s) / hidden + eps) * (weight.float() (+ 1 if gemma))`` of the
unrounded ``s``, then ``T(y)``, or static FP8, per-token FP8 or NVFP4 (block scales in the
swizzled 128x4 layout, :func:`nvfp4_scale_offsets`) after vLLM's unfused kernels.

Design notes: docs/EPILOGUE.md#epilogue
"""

from __future__ import annotations

import functools

import re
from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch

QUANTS = ("fp8", "fp8_per_token", "nvfp4")
#: The kernels' QUANT constexpr of each quant mode (autosymm.kernels.fused_rmsnorm).
QUANT_CODES = {None: 0, "fp8": 1, "fp8_per_token": 2, "nvfp4": 3}
FP8_E4M3_MAX = 448.0
E2M1_MAX = 6.0
NVFP4_BLOCK = 16
#: vLLM's floor of a dynamic fp8 scale: ``1.0f / (448 * 512.0f)`` (fp32), w8a8/utils.cuh.
FP8_MIN_SCALING_FACTOR = float(torch.tensor(1.0, dtype=torch.float32) / (FP8_E4M3_MAX * 512.0))
#: fp32(1/6): nvfp4's ``amax * (1 / 6)`` multiplies by it.
E2M1_MAX_RECIPROCAL = float(torch.tensor(1.0, dtype=torch.float32) / E2M1_MAX)
#: e2m1 magnitudes by code 0..7, and the code thresholds of round-to-nearest-even: a magnitude
#: a gets code sum(a > t for t in GT) + sum(a >= t for t in GE) (the ties go to the even code).
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_GT = (0.25, 1.25, 2.5, 5.0)
E2M1_GE = (0.75, 1.75, 3.5)

_KEY = re.compile(r"(add_)?(rms|gemma)(?:_(fp8_per_token|fp8|nvfp4))?")


@dataclass(frozen=True)
class Epilogue:
    """What the fused op does after the sum: add the residual (and write it back) or not, a
    Gemma norm (weight applied as ``1 + w``) or not, and the output quantization (None or one of
    :data:`QUANTS`)."""

    residual: bool = True
    gemma: bool = False
    quant: Optional[str] = None

    def __post_init__(self) -> None:
        if self.quant is not None and self.quant not in QUANTS:
            raise ValueError(f"quant={self.quant!r} is not a quantization: choose None or one of {QUANTS}")
        if not isinstance(self.residual, bool) or not isinstance(self.gemma, bool):
            raise ValueError(f"residual={self.residual!r} and gemma={self.gemma!r} must be bools")

    @property
    def key(self) -> str:
        """The DB shape key's epilogue part: '' for the default (add + RMSNorm, unquantized: the
        'h{hidden}' rows tuned before epilogues existed), else e.g. 'rms', 'add_gemma',
        'add_rms_fp8', 'rms_nvfp4', 'add_rms_fp8_per_token'."""
        if self == DEFAULT:
            return ""
        key = ("add_" if self.residual else "") + ("gemma" if self.gemma else "rms")
        return key + (f"_{self.quant}" if self.quant else "")

    @classmethod
    def of_key(cls, key: str) -> "Epilogue":
        """Inverse of :attr:`key`; a ValueError naming ``key`` for any other text."""
        if key == "":
            return DEFAULT
        match = _KEY.fullmatch(str(key))
        if match is None or key == "add_rms":
            raise ValueError(f"{key!r} is not an epilogue key like 'rms', 'add_gemma' or 'add_rms_fp8' "
                             "('' is the default add + RMSNorm)")
        return cls(residual=bool(match.group(1)), gemma=match.group(2) == "gemma", quant=match.group(3))

    @property
    def quant_code(self) -> int:
        """The kernels' QUANT constexpr (:data:`QUANT_CODES`)."""
        return QUANT_CODES[self.quant]

    @property
    def needs_scale(self) -> bool:
        """Whether a float32 ``scale`` input is taken (fp8's static scale, nvfp4's global scale)."""
        return self.quant in ("fp8", "nvfp4")

    @property
    def has_scales(self) -> bool:
        """Whether scales are a second output (fp8 per token: [tokens, 1]; nvfp4: the block scales)."""
        return self.quant in ("fp8_per_token", "nvfp4")

    def out_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The output's dtype for x of ``dtype``."""
        return {None: dtype, "nvfp4": torch.uint8}.get(self.quant, torch.float8_e4m3fn)

    def out_shape(self, tokens: int, hidden: int) -> tuple[int, int]:
        return (tokens, hidden // 2) if self.quant == "nvfp4" else (tokens, hidden)

    def scales_shape(self, tokens: int, hidden: int) -> Optional[tuple[int, int]]:
        """The scales output's shape (float32 [tokens, 1]; nvfp4: e4m3 [round_up(tokens, 128),
        round_up(hidden / 16, 4)]), None without one."""
        if self.quant == "fp8_per_token":
            return (tokens, 1)
        if self.quant == "nvfp4":
            return (_round_up(tokens, 128), _round_up(hidden // NVFP4_BLOCK, 4))
        return None

    def empty_outputs(self, tokens: int, hidden: int, dtype: torch.dtype, device) -> tuple:
        """(out, scales or None) to write, on ``device``; nvfp4's scales zero-filled (the swizzled
        layout's padding is 0, as vLLM's)."""
        out = torch.empty(self.out_shape(tokens, hidden), dtype=self.out_dtype(dtype), device=device)
        shape = self.scales_shape(tokens, hidden)
        if shape is None:
            return out, None
        if self.quant == "nvfp4":
            return out, torch.zeros(shape, dtype=torch.float8_e4m3fn, device=device)
        return out, torch.empty(shape, dtype=torch.float32, device=device)


DEFAULT = Epilogue()


class EpilogueResult(NamedTuple):
    """The reference's results: ``out``, the new ``residual`` (None without one), ``scales``."""

    out: torch.Tensor
    residual: Optional[torch.Tensor]
    scales: Optional[torch.Tensor]


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def residual_sum(sum_fp32: torch.Tensor, residual: Optional[torch.Tensor], epilogue: Epilogue) -> torch.Tensor:
    """s: the fp32 sum plus the residual (fp32) where the epilogue adds it."""
    s = sum_fp32.float()
    if epilogue.residual:
        if residual is None:
            raise ValueError(f"epilogue {epilogue} adds a residual, but residual is None")
        s = s + residual.float()
    return s


def inverse_rms(s: torch.Tensor, eps: float) -> torch.Tensor:
    """fp32 [tokens, 1]: rsqrt(sum(s * s) / hidden + eps) per row (the sum's order is the
    kernels' own; torch's here)."""
    return torch.rsqrt((s * s).sum(-1, keepdim=True) / s.shape[-1] + eps)


def normalized(s: torch.Tensor, inv_rms: torch.Tensor, weight: torch.Tensor, epilogue: Epilogue) -> torch.Tensor:
    """y = s * inv_rms * w (fp32), w = weight (+ 1 for Gemma)."""
    w = weight.float() + 1.0 if epilogue.gemma else weight.float()
    return s * inv_rms * w


def quantize(y: torch.Tensor, epilogue: Epilogue, dtype: torch.dtype,
             scale: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(out, scales) of the fp32 norm output ``y`` [tokens, hidden] (module docstring)."""
    if epilogue.quant is None:
        return y.to(dtype), None
    if epilogue.needs_scale and scale is None:
        raise ValueError(f"quant={epilogue.quant!r} needs a float32 scale tensor, got None")
    if epilogue.quant == "fp8":
        inverse = 1.0 / scale.float().reshape(())
        return _e4m3(y * inverse), None
    if epilogue.quant == "fp8_per_token":
        row_scale = (y.abs().amax(-1, keepdim=True) / FP8_E4M3_MAX).clamp_min(FP8_MIN_SCALING_FACTOR)
        return _e4m3(y / row_scale), row_scale
    return nvfp4_quantize(y, scale)


def _e4m3(values: torch.Tensor) -> torch.Tensor:
    return values.clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)


def e2m1_codes(values: torch.Tensor) -> torch.Tensor:
    """uint8 e2m1 codes (sign in bit 3) of fp32 ``values``: round to nearest even, saturating
    at +-6; -0.0 and negatives rounding to 0 keep the sign (0x8)."""
    magnitude = values.abs()
    code = torch.zeros(values.shape, dtype=torch.uint8, device=values.device)
    for threshold in E2M1_GT:
        code += (magnitude > threshold).to(torch.uint8)
    for threshold in E2M1_GE:
        code += (magnitude >= threshold).to(torch.uint8)
    return code | (torch.signbit(values).to(torch.uint8) << 3)


def nvfp4_scale_offsets(rows: torch.Tensor, blocks: torch.Tensor, n_blocks: int) -> torch.Tensor:
    """Element offsets, in vLLM's swizzled scale tensor, of the scale of block ``blocks`` (16
    columns each) of row ``rows`` for rows of ``n_blocks`` blocks: tiles of 128 rows x 4 blocks
    (512 bytes), row-tile major, in a tile (row % 32) * 16 + (row // 32 % 4) * 4 + block % 4
    (nvfp4_utils.cuh ``cvt_quant_to_fp4_get_sf_out_offset``)."""
    k_tiles = -(-n_blocks // 4)
    return (((rows // 128) * k_tiles + blocks // 4) * 512 + (rows % 32) * 16 + (rows // 32 % 4) * 4
            + blocks % 4)


def nvfp4_quantize(y: torch.Tensor, global_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed uint8 [tokens, hidden / 2], swizzled e4m3 block scales) of fp32 ``y``."""
    tokens, hidden = y.shape
    if hidden % NVFP4_BLOCK:
        raise ValueError(f"nvfp4 packs blocks of {NVFP4_BLOCK}: hidden={hidden} is not a multiple")
    gs = global_scale.float().reshape(())
    blocks = y.reshape(tokens, hidden // NVFP4_BLOCK, NVFP4_BLOCK)
    amax = blocks.abs().amax(-1)
    sf = (gs * (amax * E2M1_MAX_RECIPROCAL)).clamp_max(FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    sf_value = sf.float()
    output_scale = torch.where(sf_value != 0, 1.0 / (sf_value * (1.0 / gs)), torch.zeros_like(sf_value))
    codes = e2m1_codes(blocks * output_scale[..., None]).reshape(tokens, hidden)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    n_blocks = hidden // NVFP4_BLOCK
    scales = torch.zeros(Epilogue(quant="nvfp4").scales_shape(tokens, hidden), dtype=torch.float8_e4m3fn,
                         device=y.device)
    rows = torch.arange(tokens, device=y.device)[:, None].expand(tokens, n_blocks)
    cols = torch.arange(n_blocks, device=y.device)[None, :].expand(tokens, n_blocks)
    flat = scales.view(torch.uint8).view(-1)
    flat[nvfp4_scale_offsets(rows, cols, n_blocks).reshape(-1)] = sf.view(torch.uint8).reshape(-1)
    return packed, scales


def reference(sum_fp32: torch.Tensor, residual: Optional[torch.Tensor], weight: torch.Tensor, eps: float,
              epilogue: Epilogue = DEFAULT, scale: Optional[torch.Tensor] = None) -> EpilogueResult:
    """THE formula of ``all_reduce_rmsnorm`` (module docstring) from the fp32 all-reduced sum
    [tokens, hidden]: (out, new residual or None, scales or None). The dtype of the outputs is
    the weight's (x's)."""
    s = residual_sum(sum_fp32, residual, epilogue)
    new_residual = s.to(residual.dtype) if epilogue.residual else None
    y = normalized(s, inverse_rms(s, eps), weight, epilogue)
    out, scales = quantize(y, epilogue, weight.dtype, scale)
    return EpilogueResult(out, new_residual, scales)


def epilogue_launcher(epilogue: Epilogue, total, inv_rms=None):
    """``launcher(x, residual, weight, eps, *, scale=None)`` of a non-default ``epilogue``:
    ``total(x)`` gives the fp32 sum of every rank's x (unrounded where the path keeps it so),
    then :func:`reference` (with ``inv_rms(s, eps)``: its steps with that
    inverse RMS, the ordered fallback's fixed tree), the new residual (where there is one)
    written in place. Returns out, or (out, scales)."""

    def launcher(x: torch.Tensor, residual: Optional[torch.Tensor], weight: torch.Tensor, eps: float = 1e-6, *,
                 scale: Optional[torch.Tensor] = None):
        if inv_rms is None:
            out, new_residual, scales = reference(total(x), residual, weight, float(eps), epilogue, scale)
        else:
            new_residual = s = residual_sum(total(x), residual, epilogue)
            out, scales = quantize(normalized(s, inv_rms(s, float(eps)), weight, epilogue), epilogue, weight.dtype,
                                   scale)
        if residual is not None:
            residual.copy_(new_residual)  # rounded once to residual's dtype
        return out if scales is None else (out, scales)

    return launcher


#: The fused op's formulas by name (docs/EPILOGUE.md): the reference formula of this module (the
#: rank sum, residual add and norm in fp32, each output rounded once) ...
SINGLE_ROUNDING = "single-rounding"
#: ... and the serving stacks' unfused chain, as NCCL's fused fallback runs it for the default
#: epilogue: the sum rounded to x's dtype, the residual add rounded again, torch's rms_norm.
NATIVE_CHAIN = "native-chain"


def single_rank_launcher(epilogue: Epilogue):
    """World size 1 (non-default epilogue): the sum is ``x`` itself (left as it is), no collective."""
    return epilogue_launcher(epilogue, lambda x: x.float())


def local_launcher(problem):
    """The launcher of a fused call with nothing to exchange (autosymm.backends.local, the
    backend 'noop'): no rows, the epilogue's empty outputs; one rank, the sum is ``x`` itself
    (left as it is): the default epilogue runs ``residual += x`` and torch's ``rms_norm`` in x's
    dtype (the native chain of the NCCL fallback), the others :func:`reference`'s steps."""
    epilogue = problem.epilogue or DEFAULT
    if problem.n_tokens_local == 0 or problem.hidden == 0:
        if epilogue == DEFAULT:
            return _empty_default
        return functools.partial(_empty_epilogue, epilogue)
    if epilogue == DEFAULT:
        return _single_rank_default
    return single_rank_launcher(epilogue)


def _empty_default(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return torch.empty_like(x)


def _empty_epilogue(epilogue: Epilogue, x: torch.Tensor, residual: Optional[torch.Tensor], weight: torch.Tensor,
                    eps: float = 1e-6, *, scale: Optional[torch.Tensor] = None):
    return outputs_like(x, epilogue)


def _single_rank_default(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6):
    residual.add_(x)
    return torch.nn.functional.rms_norm(residual, (x.shape[1],), weight, eps)


def outputs_like(x: torch.Tensor, epilogue: Epilogue):
    """Empty outputs of ``epilogue`` for ``x`` [tokens, hidden] (the fakes' and an empty call's):
    out, or (out, scales) (:meth:`Epilogue.empty_outputs`)."""
    out, scales = epilogue.empty_outputs(x.shape[0], x.shape[1], x.dtype, x.device)
    return out if scales is None else (out, scales)
