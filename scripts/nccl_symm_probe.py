"""Which route to NCCL's symmetric (window-registered) buffers works with this torch and NCCL?

    source scripts/_node_env.sh; python3 scripts/nccl_symm_probe.py [--json FILE] [--routes a,b,...]

Each route runs in a subprocess of its own (one rank: RANK=0 WORLD_SIZE=1, or torchrun's
variables when they are set), so a segfault ends its route, not the probe. A route passes when
its buffer is registered and ``dist.all_reduce`` on a tensor in it returns the right sum
(checked on random data, every element). NVLink multicast stays off (NCCL_NVLS_ENABLE=0).

Routes:
  torch_symm_nccl   torch symm_mem with its NCCL backend: set_backend, empty, rendezvous, on a
                    process group made with device_id (its communicator created eagerly)
  torch_symm_nccl_lazy_comm  the same without device_id (the communicator made at first use)
  torch_mem_alloc   ProcessGroupNCCL.mem_allocator -> MemPool -> register_mem_pool(symm=True)
  shim_pool         ncclMemAlloc behind a CUDAPluggableAllocator (a C shim built with gcc here)
                    -> MemPool -> register_mem_pool(pool, symm=True)
  ctypes_window     ncclMemAlloc + ncclCommWindowRegister(NCCL_WIN_COLL_SYMMETRIC) through ctypes
                    on torch's own communicator (ProcessGroupNCCL._comm_ptr())
  ctypes_window_symm_mem  the same window registration on a torch symm_mem buffer (CUDA backend,
                    cuMem), as autosymm's workspace is allocated
  expandable_pool   register_mem_pool(symm=True) on a pool of torch's own cuMem allocator
                    (expandable segments)

At world size 1 NCCL copies instead of communicating, so a pass proves that the route registers
and that NCCL accepts the buffer; whether the symmetric kernels run needs >= 2 GPUs (the NCCL
INFO lines with 'ymmetric' or 'window' are kept as evidence).

Seen on one H200 (2026-12-01, torch 2.11.0+cu130, NCCL 2.28.9, world size 1; each route a fresh
process, NCCL_DEBUG=INFO: "Symmetric VA size=140GB", "register comm ... buffer ... size ..."):
  torch_symm_nccl            works (rendezvous ok, sum right)
  torch_symm_nccl_lazy_comm  segfault (rc -11) in symm_mem.rendezvous: the crash seen before is
                             rendezvous on a group whose NCCL communicator does not exist yet
  torch_mem_alloc            RuntimeError "NCCL mem allocator is not supported in this NCCL version"
  shim_pool, expandable_pool register_mem_pool(symm=True) registers and the sum is right, then the
                             process aborts at exit: "Deregister: Could not find handle" (torch
                             deregisters the window as a plain registration)
  ctypes_window, ctypes_window_symm_mem  work, clean exit (autosymm.backends.nccl_symm's route)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

SAFE_ENV = {"TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NCCL_NVLS_ENABLE": "0", "NVSHMEM_DISABLE_NVLS": "1"}
os.environ.update(SAFE_ENV)
NUMEL = 1 << 20
NCCL_WIN_COLL_SYMMETRIC = 1

SHIM_C = r"""
#include <dlfcn.h>
#include <stddef.h>
typedef int (*alloc_t)(void**, size_t);
typedef int (*free_t)(void*);
typedef int (*setdev_t)(int);
static void* sym(const char* lib, const char* name) {
  void* h = dlopen(lib, RTLD_NOW | RTLD_NOLOAD);
  if (!h) h = dlopen(lib, RTLD_NOW);
  return h ? dlsym(h, name) : NULL;
}
void* probe_alloc(size_t size, int device, void* stream) {
  void* p = NULL;
  setdev_t setdev = (setdev_t)sym("libcudart.so.13", "cudaSetDevice");
  if (!setdev) setdev = (setdev_t)sym("libcudart.so.12", "cudaSetDevice");
  if (setdev) setdev(device);
  alloc_t a = (alloc_t)sym(getenv_lib(), "ncclMemAlloc");
  if (!a || a(&p, size) != 0) return NULL;
  return p;
}
void probe_free(void* ptr, size_t size, int device, void* stream) {
  free_t f = (free_t)sym(getenv_lib(), "ncclMemFree");
  if (f) f(ptr);
}
"""
SHIM_HEAD = "#include <stdlib.h>\nstatic const char* getenv_lib(void) { return getenv(\"PROBE_NCCL_LIB\"); }\n"


# -- helpers run inside a route's subprocess ---------------------------------------------------
def _init(eager_comm: bool = True):
    import torch
    import torch.distributed as dist

    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    rank = int(os.environ["RANK"])
    local = int(os.environ.get("LOCAL_RANK", rank))
    torch.cuda.set_device(local)
    device = torch.device("cuda", local)
    # device_id: the NCCL communicator is created now (eagerly), not at the first collective
    dist.init_process_group("nccl", device_id=device if eager_comm else None)
    return torch, dist, device


def nccl_library() -> str:
    """Path of the libnccl this process has loaded (torch's), from /proc/self/maps."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            path = line.split()[-1]
            if "libnccl" in os.path.basename(path) and path.startswith("/"):
                return path
    return "libnccl.so.2"


def _load_nccl():
    import ctypes

    lib = ctypes.CDLL(nccl_library())
    lib.ncclGetErrorString.restype = ctypes.c_char_p
    lib.ncclGetLastError.restype = ctypes.c_char_p
    return lib


def _check(lib, rc: int, what: str) -> None:
    if rc != 0:
        raise RuntimeError(f"{what} returned {rc}: {lib.ncclGetErrorString(rc).decode()} "
                           f"({(lib.ncclGetLastError(None) or b'').decode()})")


def _tensor_at(torch, ptr: int, numel: int, device):
    """A float32 tensor over ``numel`` elements at device address ``ptr`` (no copy)."""

    class _Raw:
        __cuda_array_interface__ = {"shape": (numel,), "typestr": "<f4", "data": (ptr, False), "version": 3}

    return torch.as_tensor(_Raw(), device=device)


def _check_sum(torch, dist, t) -> str:
    world = dist.get_world_size()
    gen = torch.Generator(device=t.device).manual_seed(1234 + dist.get_rank())
    t.copy_(torch.randn(t.shape, generator=gen, device=t.device))
    parts = [torch.empty_like(t) for _ in range(world)]
    dist.all_gather(parts, t.clone())
    want = torch.zeros_like(t)
    for part in parts:
        want += part
    dist.all_reduce(t)
    torch.cuda.synchronize()
    err = (t - want).abs().max().item()
    if not err <= 1e-5 * world:
        raise AssertionError(f"all_reduce on the registered buffer is wrong: max error {err}")
    start = time.perf_counter()
    for _ in range(20):
        dist.all_reduce(t)
    torch.cuda.synchronize()
    return f"sum right on {t.numel()} fp32 (world {world}); {(time.perf_counter() - start) / 20 * 1e6:.1f} us/call host-timed"


def route_torch_symm_nccl(eager_comm: bool = True):
    torch, dist, device = _init(eager_comm)
    import torch.distributed._symmetric_memory as symm_mem

    symm_mem.set_backend("NCCL")
    print("backend", symm_mem.get_backend(device), flush=True)
    t = symm_mem.empty(NUMEL, dtype=torch.float32, device=device)
    print("empty ok", flush=True)
    handle = symm_mem.rendezvous(t, dist.group.WORLD.group_name)
    print("rendezvous ok", type(handle).__name__, flush=True)
    return _check_sum(torch, dist, t)


def route_torch_mem_alloc():
    torch, dist, device = _init()
    backend = dist.group.WORLD._get_backend(device)
    pool = torch.cuda.MemPool(backend.mem_allocator)
    with torch.cuda.use_mem_pool(pool):
        t = torch.empty(NUMEL, dtype=torch.float32, device=device)
    backend.register_mem_pool(pool, symm=True)
    print("registered symm=True", flush=True)
    return _check_sum(torch, dist, t)


def route_shim_pool():
    torch, dist, device = _init()
    so = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"nccl_shim_{os.getpid()}.so")
    src = so[:-3] + ".c"
    with open(src, "w") as f:
        f.write(SHIM_HEAD + SHIM_C)
    subprocess.run(["gcc", "-shared", "-fPIC", "-O1", "-o", so, src, "-ldl"], check=True, capture_output=True)
    os.environ["PROBE_NCCL_LIB"] = nccl_library()
    allocator = torch.cuda.memory.CUDAPluggableAllocator(so, "probe_alloc", "probe_free")
    pool = torch.cuda.MemPool(allocator.allocator())
    with torch.cuda.use_mem_pool(pool):
        t = torch.empty(NUMEL, dtype=torch.float32, device=device)
    backend = dist.group.WORLD._get_backend(device)
    backend.register_mem_pool(pool, symm=True)
    print("registered symm=True", flush=True)
    return _check_sum(torch, dist, t)


def _window(lib, comm: int, ptr: int, nbytes: int):
    import ctypes

    win = ctypes.c_void_p()
    _check(lib, lib.ncclCommWindowRegister(ctypes.c_void_p(comm), ctypes.c_void_p(ptr), ctypes.c_size_t(nbytes),
                                           ctypes.byref(win), ctypes.c_int(NCCL_WIN_COLL_SYMMETRIC)),
           "ncclCommWindowRegister")
    print("window", hex(win.value or 0), flush=True)
    return win


def route_ctypes_window():
    import ctypes

    torch, dist, device = _init()
    lib = _load_nccl()
    backend = dist.group.WORLD._get_backend(device)
    dist.barrier()  # the communicator exists once a collective ran
    comm = int(backend._comm_ptr())
    print("comm", hex(comm), "lib", nccl_library(), flush=True)
    ptr = ctypes.c_void_p()
    _check(lib, lib.ncclMemAlloc(ctypes.byref(ptr), ctypes.c_size_t(NUMEL * 4)), "ncclMemAlloc")
    win = _window(lib, comm, ptr.value, NUMEL * 4)
    result = _check_sum(torch, dist, _tensor_at(torch, ptr.value, NUMEL, device))
    _check(lib, lib.ncclCommWindowDeregister(ctypes.c_void_p(comm), win), "ncclCommWindowDeregister")
    _check(lib, lib.ncclMemFree(ptr), "ncclMemFree")
    return result


def route_ctypes_window_symm_mem():
    torch, dist, device = _init()
    import torch.distributed._symmetric_memory as symm_mem

    lib = _load_nccl()
    t = symm_mem.empty(NUMEL, dtype=torch.float32, device=device)
    symm_mem.rendezvous(t, dist.group.WORLD.group_name)
    dist.barrier()
    comm = int(dist.group.WORLD._get_backend(device)._comm_ptr())
    _window(lib, comm, t.data_ptr(), NUMEL * 4)
    return _check_sum(torch, dist, t)


def route_expandable_pool():
    torch, dist, device = _init()
    pool = torch.cuda.MemPool()
    with torch.cuda.use_mem_pool(pool):
        t = torch.empty(NUMEL, dtype=torch.float32, device=device)
    dist.group.WORLD._get_backend(device).register_mem_pool(pool, symm=True)
    print("registered symm=True", flush=True)
    return _check_sum(torch, dist, t)


ROUTES = {
    "torch_symm_nccl": (route_torch_symm_nccl, {}),
    "torch_symm_nccl_lazy_comm": (lambda: route_torch_symm_nccl(eager_comm=False), {}),
    "torch_mem_alloc": (route_torch_mem_alloc, {}),
    "shim_pool": (route_shim_pool, {}),
    "ctypes_window": (route_ctypes_window, {}),
    "ctypes_window_symm_mem": (route_ctypes_window_symm_mem, {}),
    "expandable_pool": (route_expandable_pool, {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}),
}


def _evidence(text: str) -> list[str]:
    keys = ("ymmetric", "indow", "WARN", "Error", "error", "NCCL version", "Segmentation", "register")
    return [line[-300:] for line in text.splitlines() if any(k in line for k in keys)][-25:]


def run_route(name: str, timeout_s: float = 120.0) -> dict:
    """Run one route in a subprocess; {'route', 'ok', 'rc', 'result', 'evidence', 'seconds'}."""
    env = dict(os.environ, **SAFE_ENV, **ROUTES[name][1], NCCL_DEBUG="INFO", NCCL_DEBUG_SUBSYS="INIT,REG,TUNING")
    start = time.monotonic()
    try:
        proc = subprocess.run([sys.executable, "-X", "faulthandler", __file__, "--route", name], env=env,
                              capture_output=True, text=True, timeout=timeout_s)
        rc, out = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as exc:
        rc, out = "timeout", f"{exc.stdout or ''}{exc.stderr or ''}"
        out = out.decode(errors="replace") if isinstance(out, bytes) else out
    result = [line[len("RESULT "):] for line in out.splitlines() if line.startswith("RESULT ")]
    return {"route": name, "ok": rc == 0 and bool(result), "sum_right": bool(result), "rc": rc,
            "result": result[0] if result else out.strip().splitlines()[-1][-400:] if out.strip() else "",
            "evidence": _evidence(out), "seconds": round(time.monotonic() - start, 1)}


def versions() -> dict:
    import torch

    return {"torch": torch.__version__, "cuda": torch.version.cuda,
            "nccl": ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else None}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--route", help=argparse.SUPPRESS)
    parser.add_argument("--routes", default=",".join(ROUTES), help="comma-separated routes to try")
    parser.add_argument("--json", help="write the findings to this file")
    args = parser.parse_args()
    if args.route:
        print("RESULT", ROUTES[args.route][0](), flush=True)
        return 0
    findings = {"versions": versions(), "routes": []}
    print(json.dumps(findings["versions"]), flush=True)
    for name in args.routes.split(","):
        found = run_route(name)
        findings["routes"].append(found)
        verdict = "WORKS" if found["ok"] else "sum right, then the process died" if found["sum_right"] else "fails"
        print(f"== {name}: {verdict} (rc {found['rc']}, {found['seconds']} s): {found['result']}", flush=True)
        for line in found["evidence"]:
            print("   |", line, flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(findings, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
