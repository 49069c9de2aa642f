"""Compiling Triton kernels for sm_90 without a GPU, in subprocesses, and reading their PTX.

Under TRITON_INTERPRET=1 (the CPU suite's setting) a @triton.jit function cannot be compiled, so
``compile_in_subprocesses`` runs ``<module>._compile_cases(indices)`` in two fresh processes
without it (halves of the cases in parallel) and gathers {case index: features}.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def max_polls() -> int:
    from autosymm.kernels.barrier import MAX_POLLS

    return int(MAX_POLLS.value)


def ptx_features(ptx: str) -> dict:
    """Counts of the instructions the compile tests assert on (peer loads, signals, polls...)."""
    return {
        "peer_v4_loads": len(re.findall(r"ld\.global\.cg\.v4\.b32", ptx)),
        "peer_scalar_loads": len(re.findall(r"ld\.global\.cg\.(?:b16|b32) ", ptx)),
        "v4_stores": len(re.findall(r"st\.global\.v4\.b32", ptx)),
        "scalar_stores": len(re.findall(r"st\.global(?:\.\w+)*\.b16 ", ptx)),
        "signals": len(re.findall(r"(?:atom|red)\.global\.sys\.release\.add", ptx)),
        "acquire_polls": len(re.findall(r"ld\.global\.sys\.acquire|atom\.global\.sys\.acquire", ptx)),
        "ld_reduce": re.findall(r"multimem\.ld_reduce\.relaxed\.sys\.global\.add\.([\w:.]+)", ptx),
        "multimem_st": len(re.findall(r"multimem\.st\.relaxed\.sys\.global\.v4\.f32", ptx)),
        "proxy_fences": ptx.count("fence.proxy.alias"),
        "poll_limit": bool(re.search(rf"setp\.\w+\.[us]32\s+%p\d+, %r\d+, (?:{max_polls()}|{max_polls() - 1});", ptx)),
        "error_adds": len(re.findall(r"(?:red|atom)\.global\.gpu\.relaxed\.add", ptx)),
        "arrivals": len(re.findall(r"atom\.global\.gpu\.acq_rel\.add", ptx)),
        "counter_resets": len(re.findall(r"atom\.global\.gpu\.relaxed\.exch", ptx)),
        "e4m3_cvts": len(re.findall(r"cvt\.rn\.satfinite\.e4m3x2\.f32", ptx)),
        "div_rn": len(re.findall(r"div\.rn\.f32", ptx)),
        "nibble_shifts": len(re.findall(r"shl\.b32\s+%r\d+, %r\d+, 4;", ptx)),
        "byte_permutes": len(re.findall(r"prmt\.b32", ptx)),
        "byte_stores": len(re.findall(r"st\.global(?:\.\w+)*\.b8 ", ptx)),
    }


def compile_ptx(fn, signature: dict, constexprs: dict, aligned_args, num_warps: int) -> str:
    """PTX of ``fn`` compiled for sm_90 (call it in a ``_compile_cases`` subprocess): ``signature``
    without its constexprs, which are added; ``aligned_args``: indices of the pointer arguments
    triton would see 16-byte aligned at run time. ptxas must produce a cubin."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature = {**signature, **{name: "constexpr" for name in constexprs}}
    attrs = {(j,): [["tt.divisibility", 16]] for j in aligned_args}
    src = ASTSource(fn, signature, constexprs=constexprs, attrs=attrs)
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps, "num_stages": 1})
    assert compiled.asm.get("cubin"), "ptxas produced no cubin"
    return compiled.asm["ptx"]


def compile_in_subprocesses(module: str, n_cases: int, timeout_s: float = 600) -> dict[int, dict]:
    """{i: features} of ``tests/<module>.py``'s ``_compile_cases`` over cases 0..n_cases-1."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(REPO / "tests"), env.get("PYTHONPATH", "")])
    code = (f"import json, sys; from {module} import _compile_cases; "
            "print('@@' + json.dumps(_compile_cases(json.loads(sys.argv[1]))))")
    halves = [list(range(n_cases))[k::2] for k in range(2)]
    procs = [subprocess.Popen([sys.executable, "-c", code, json.dumps(h)], env=env, cwd=REPO,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for h in halves]
    result: dict[int, dict] = {}
    for proc in procs:
        stdout, stderr = proc.communicate(timeout=timeout_s)
        if proc.returncode != 0:
            pytest.fail(f"compiling for sm_90 failed:\n{stderr[-4000:]}")
        line = next(l for l in stdout.splitlines() if l.startswith("@@"))
        result.update({int(k): v for k, v in json.loads(line[2:]).items()})
    return result
