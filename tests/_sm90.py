"""Compiling Triton kernels for sm_90 without a GPU, in subprocesses, and reading their PTX.

Under TRITON_INTERPRET=1 (the CPU suite's setting) a @triton.jit function cannot be compiled, so
``compile_in_subprocesses`` runs ``<module>._compile_cases(indices)`` in compile servers, processes
without it that live as long as the pytest process (the cases dealt out over them in parallel), and
gathers {case index: features}.
"""

from __future__ import annotations

import json
import os
import re
import select
import subprocess
import sys
import tempfile
import time
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


class _CompileServer:
    """A process without TRITON_INTERPRET that compiles cases for every compile module: it pays
    the ~3 s import of torch, triton and autosymm's kernels once per pytest process, not once per
    module. It runs :func:`serve` (``python -m _sm90``)."""

    def __init__(self) -> None:
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(REPO / "tests"), env.get("PYTHONPATH", "")])
        self.stderr = tempfile.TemporaryFile(mode="w+")  # read back only when a request fails
        self.proc = subprocess.Popen([sys.executable, "-m", "_sm90"], env=env, cwd=REPO, text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.stderr)

    def send(self, module: str, indices: list[int]) -> None:
        self.proc.stdin.write(json.dumps({"module": module, "indices": indices}) + "\n")
        self.proc.stdin.flush()

    def answer(self, deadline: float) -> dict:
        """The answer to the request sent, {"ok": {i: features}} or {"error": text}; the server is
        stopped (and an error returned) when it dies or has not answered by ``deadline``
        (time.monotonic()). The pipe carries only answers, one request at a time, so a readable
        pipe holds the whole line or its end."""
        ready, _, _ = select.select([self.proc.stdout], [], [], max(0.0, deadline - time.monotonic()))
        line = self.proc.stdout.readline() if ready else ""
        if line.startswith("@@"):
            return json.loads(line[2:])
        self.stop()
        self.stderr.seek(0)
        why = "died" if ready else "did not answer in time"
        return {"error": f"the compile process {why}:\n{self.stderr.read()[-4000:]}"}

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> None:
        if self.alive():
            self.proc.kill()
        self.proc.wait()


_servers: list[_CompileServer] = []


def _compile_servers() -> list[_CompileServer]:
    """This pytest process's servers, started at first use: one per CPU left to each xdist worker."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    wanted = max(1, len(os.sched_getaffinity(0)) // workers)
    _servers[:] = [server for server in _servers if server.alive()]
    while len(_servers) < wanted:
        _servers.append(_CompileServer())
    return _servers


def compile_in_subprocesses(module: str, n_cases: int, timeout_s: float = 600) -> dict[int, dict]:
    """{i: features} of ``tests/<module>.py``'s ``_compile_cases`` over cases 0..n_cases-1, the
    cases dealt out over this process's compile servers."""
    servers = _compile_servers()
    for k, server in enumerate(servers):
        server.send(module, list(range(n_cases))[k::len(servers)])
    deadline, result, errors = time.monotonic() + timeout_s, {}, []
    for server in servers:
        answer = server.answer(deadline)
        if "error" in answer:
            errors.append(answer["error"])
        else:
            result.update({int(k): v for k, v in answer["ok"].items()})
    if errors:
        pytest.fail("compiling for sm_90 failed:\n" + "\n".join(e[-4000:] for e in errors))
    return result


def serve() -> None:
    """The compile server's loop: a JSON request ``{"module", "indices"}`` per stdin line, answered
    on stdout by one line ``@@`` + JSON, ``{"ok": {i: features}}`` or ``{"error": traceback}``;
    everything else the compiles print goes to stderr."""
    import importlib
    import traceback

    answers, sys.stdout = sys.stdout, sys.stderr
    for line in sys.stdin:
        request = json.loads(line)
        try:
            answer = {"ok": importlib.import_module(request["module"])._compile_cases(request["indices"])}
        except BaseException:
            answer = {"error": traceback.format_exc()}
        answers.write("@@" + json.dumps(answer) + "\n")
        answers.flush()


if __name__ == "__main__":
    serve()
