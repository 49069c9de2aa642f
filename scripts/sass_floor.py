"""SASS census of the small-message kernels, on the CPU: each kernel of a tree compiled for sm_90
(``triton.compile(..., target=GPUTarget("cuda", 90, 32))``, no GPU), disassembled with the
nvdisasm that ships with triton, and the instructions that cost on a small message's critical
path counted: CTA barriers, fences, atomics and reductions, strong (polling) loads, L1
invalidations, global loads and stores, and all instructions.

  python3 scripts/sass_floor.py [--tree .base] [--world-sizes 2,8] [--json out.json]

Run it for the base tree and this one to see what a change removed (issue #42). Kernels whose
parameters a tree lacks are compiled with that tree's own signature (read from the function).
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

#: Parameter types by name (every autosymm kernel names its parameters alike).
TYPES = {"x_ptr": "*bf16", "res_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16", "scale_ptr": "*fp32",
         "scales_ptr": "*fp32", "region_ptrs": "*i64", "signal_ptrs": "*i64", "counts_ptr": "*i32",
         "partials_ptr": "*fp32", "stash_ptr": "*fp32", "header_ptr": "*i32", "numel": "i32", "n_rows": "i32",
         "seg_vecs": "i32", "stage_offset": "i64", "slot_bytes": "i64", "half_bytes": "i64", "mc_base": "i64",
         "out_offset": "i64", "eps": "fp32"}
OPS = {"bar_sync": r"\bBAR\.SYNC", "membar_sys": r"\bMEMBAR\.\w*\.?SYS|MEMBAR\.ALL\.SYS", "membar_gpu": r"\bMEMBAR\.\w*\.?GPU",
       "fence": r"\bFENCE\.", "atom": r"\bATOMG?\.", "red": r"\bREDG?\.", "strong_ld": r"\bLDG\.E[\w.]*\.STRONG",
       "cctl": r"\bCCTL", "ldg": r"\bLDG\.", "stg": r"\bSTG\.", "lds_sts": r"\b(?:LDS|STS)\b", "redux": r"\bREDUX"}


def cases(world_size: int) -> list[tuple[str, str, dict, int]]:
    """(label, kernel 'module:function', constexprs, warps) of the small-message configs."""
    w = world_size
    common = dict(RANK=w - 1, WORLD_SIZE=w)
    fused = dict(common, HIDDEN=8192, BLOCK=8192, ROWS=1, SPLIT=1, HAS_RESIDUAL=True, GEMMA=False)
    return [
        (f"lamport W{w} B1024 w4", "lamport_all_reduce:_lamport_all_reduce", dict(common, BLOCK=1024, TAIL=8, PHASE=0), 4),
        (f"one_shot W{w} B1024 w4", "all_reduce:_one_shot_all_reduce",
         dict(common, BLOCK=1024, ZERO_COPY=False, ALIGNED=True, DOUBLE_BUFFER=False, TAIL=8), 4),
        (f"one_shot+db W{w} B1024 w4", "all_reduce:_one_shot_all_reduce",
         dict(common, BLOCK=1024, ZERO_COPY=False, ALIGNED=True, DOUBLE_BUFFER=True, TAIL=8), 4),
        (f"push W{w} B1024 w4", "push_all_reduce:_push_one_shot_all_reduce",
         dict(common, BLOCK=1024, ALIGNED=True, DOUBLE_BUFFER=False, TAIL=8), 4),
        (f"push+db W{w} B1024 w8", "push_all_reduce:_push_one_shot_all_reduce",
         dict(common, BLOCK=1024, ALIGNED=True, DOUBLE_BUFFER=True, TAIL=8), 8),
        (f"two_shot W{w} B1024 w4", "all_reduce:_two_shot_all_reduce",
         dict(common, BLOCK=1024, ZERO_COPY=False, ALIGNED=True, MULTIMEM=False, PHASE=0), 4),
        (f"fused push+db 1x8192 W{w} w16", "fused_rmsnorm:_one_shot_all_reduce_rmsnorm",
         dict(fused, PUSH=True, DOUBLE_BUFFER=True, QUANT=0), 16),
        (f"fused push+db fp8 1x8192 W{w} w16", "fused_rmsnorm:_one_shot_all_reduce_rmsnorm",
         dict(fused, PUSH=True, DOUBLE_BUFFER=True, QUANT=1), 16),
        (f"fused lamport 1x8192 W{w} w16", "fused_rmsnorm:_one_shot_all_reduce_rmsnorm",
         dict(fused, PUSH=True, DOUBLE_BUFFER=False, QUANT=0, LAMPORT=True), 16),
        (f"fused lamport fp8 1x8192 W{w} w16", "fused_rmsnorm:_one_shot_all_reduce_rmsnorm",
         dict(fused, PUSH=True, DOUBLE_BUFFER=False, QUANT=1, LAMPORT=True), 16),
    ] + ([] if w != 2 else [  # the Lamport wait's per-thread spin (world size 2; SPIN = spin_pack's)
        (f"lamport+spin W{w} B1024 w4", "lamport_all_reduce:_lamport_all_reduce",
         dict(common, BLOCK=1024, TAIL=8, PHASE=0, SPIN=8), 4),
        (f"fused lamport+spin 1x8192 W{w} w16", "fused_rmsnorm:_one_shot_all_reduce_rmsnorm",
         dict(fused, PUSH=True, DOUBLE_BUFFER=False, QUANT=0, LAMPORT=True, SPIN=8), 16),
    ])


def census(fn, constexprs: dict, warps: int) -> dict:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = list(fn.arg_names)
    constexprs = dict(constexprs)
    for param in fn.params:  # constexprs the case leaves out take their defaults
        if param.is_constexpr and param.name not in constexprs and param.default is not inspect.Parameter.empty:
            constexprs[param.name] = param.default
    missing = [k for k in constexprs if k not in names]
    if missing:
        return {"skipped": f"no parameter {missing} in this tree"}
    signature = {}
    for name in names:
        if name in constexprs:
            signature[name] = "constexpr"
        else:
            kind = TYPES[name]
            if name == "out_ptr" and constexprs.get("QUANT", 0) in (1, 2):
                kind = "*fp8e4nv"
            signature[name] = kind
    pointers = [i for i, n in enumerate(names) if signature[n].startswith("*")]
    attrs = {(i,): [["tt.divisibility", 16]] for i in pointers}
    compiled = triton.compile(ASTSource(fn, signature, constexprs=constexprs, attrs=attrs),
                              target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": 1})
    nvdisasm = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        sass = subprocess.run([str(nvdisasm), "-c", f.name], capture_output=True, text=True, check=True).stdout
    body = [line for line in sass.splitlines() if re.search(r"/\*[0-9a-f]{4}\*/", line)]
    body = [line for line in body if not re.search(r"\bNOP\b", line)]
    out = {"instructions": len(body)}
    for key, pattern in OPS.items():
        out[key] = sum(1 for line in body if re.search(pattern, line))
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tree", default=str(Path(__file__).resolve().parents[1]))
    parser.add_argument("--world-sizes", default="2,8")
    parser.add_argument("--json", default="")
    args = parser.parse_args(argv)
    os.environ.pop("TRITON_INTERPRET", None)
    sys.path.insert(0, str(Path(args.tree).resolve()))
    import importlib

    rows = []
    for w in (int(v) for v in args.world_sizes.split(",")):
        for label, target, constexprs, warps in cases(w):
            module, name = target.split(":")
            fn = getattr(importlib.import_module(f"autosymm.kernels.{module}"), name)
            try:
                row = census(fn, constexprs, warps)
            except Exception as exc:  # reported: one kernel must not hide the others
                row = {"error": f"{type(exc).__name__}: {exc}"[:200]}
            rows.append({"kernel": label, **row})
            print(json.dumps(rows[-1]), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
