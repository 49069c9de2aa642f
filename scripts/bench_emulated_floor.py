"""The small-message kernel floor on ONE GPU: W ranks emulated in one process (one stream per
rank, the peers' buffers in local HBM, as tests/gpu/_emulated.py), timed as a CUDA graph.

Method (issue #42). Per case (a backend, a config, a size): every rank's launcher is made and
compiled, every kernel module loaded with the barriers pre-satisfied, then one concurrent round on
fresh random data is checked bit-exactly against the reference (scripts/_floor_cases.py) before
anything is timed. Then ROUNDS rounds are captured in one CUDA graph, each round forking from the
capture stream to the W rank streams (an event) and joining back; the graph is replayed REPLAYS
times between two events, SAMPLES times; the per-round time is the median sample / (REPLAYS x
ROUNDS). The *floor* is the same graph with one trivial kernel per rank (``t.add_(1)``), measured
right before every case (its samples interleaved with the case's), so a case's ``over`` (its time
minus the floor) compares across runs that drift by 10 %. After timing, every barrier error slot
must be 0 and every pad balanced (a wait that gave up would make the time meaningless).
Timing inputs are zeros (in-place sums stay finite); correctness was checked on random data.

  python3 scripts/bench_emulated_floor.py [--world-sizes 2,4,8] [--sizes 2K,8K,64K] [--families lamport,fused]
        [--json OUT.jsonl] [--quick]
  python3 scripts/bench_emulated_floor.py --compare .base [--alternations 3] ...   # base tree vs this one
  python3 scripts/bench_emulated_floor.py --cpu        # smoke: interpreter, forked ranks, no times
  ncu ... python3 scripts/bench_emulated_floor.py --profile --families ar:lamport --sizes 8K

``--compare BASE_DIR`` runs this script's cases on BASE_DIR's autosymm (a ``git archive`` of the
base commit unpacked there) and on this tree's, alternately (B, A, B, A, ...: one subprocess per
turn, each timing every case with its own floor), after compiling both trees' kernels in parallel
(``--compile-only``), and prints per case the median over turns of each tree's time and its
distance to the floor. W = 4 and 8 run W ranks' programs on one GPU: they contend for its SMs and
HBM, so their figures are reported, not held to targets.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROUNDS, REPLAYS, SAMPLES = 32, 20, 5
DEADLINE_S = 60.0
PRESET = 1 << 20


def _use_tree(tree: str) -> None:
    """Import autosymm from ``tree`` (a checkout or an unpacked archive)."""
    root = str(Path(tree).resolve())
    sys.path.insert(0, root)
    sys.path.insert(0, str(HERE))
    import autosymm

    if not Path(autosymm.__file__).resolve().is_relative_to(root):
        raise SystemExit(f"autosymm was imported from {autosymm.__file__}, not from {root}")


# -- GPU: ranks on streams ---------------------------------------------------------------------------

def _workspaces(world_size: int, device: str):
    from _floor_cases import ALL_REDUCE_BYTES, DOUBLE_BUFFER_BYTES
    from autosymm.workspace.symm import simulated_workspaces

    return simulated_workspaces(world_size, all_reduce_bytes=ALL_REDUCE_BYTES, moe_bytes=1 << 12,
                                double_buffer_bytes=DOUBLE_BUFFER_BYTES, device=device)


def _presatisfy(wss) -> None:
    """Every peer slot of every signal channel pre-set (no wait spins), every rank's first Lamport
    receive buffer pre-filled with non-sentinel words (the load step runs ranks one by one)."""
    import torch
    from autosymm.geometry import LAMPORT_HEADER_BYTES, MAX_PROGRAMS, MAX_WORLD_SIZE, SIGNAL_CHANNEL, SIGNAL_SLOTS_PER_RANK

    for ws in wss:
        peers = [p for p in range(ws.world_size) if p != ws.rank]
        for channel in SIGNAL_CHANNEL.values():
            start = channel * SIGNAL_SLOTS_PER_RANK
            words = ws.buffer[:4 * (start + SIGNAL_SLOTS_PER_RANK)].view(torch.int32)[start:]
            words.view(MAX_PROGRAMS, MAX_WORLD_SIZE)[:, peers] = PRESET
        region = ws.regions.get("lamport")
        if region is not None:
            start = region.offset + LAMPORT_HEADER_BYTES
            ws.buffer[start:region.offset + region.nbytes].fill_(0x55)


def _check_pads(wss) -> None:
    import torch
    from autosymm.geometry import MAX_PROGRAMS, MAX_WORLD_SIZE, SIGNAL_CHANNEL, SIGNAL_SLOTS_PER_RANK

    for ws in wss:
        errors = ws.barrier_error_counts()
        assert not any(errors.values()), f"rank {ws.rank}: barrier waits gave up: {errors}"
        peers = [p for p in range(ws.world_size) if p != ws.rank]
        for name, channel in SIGNAL_CHANNEL.items():
            start = channel * SIGNAL_SLOTS_PER_RANK
            words = ws.buffer[:4 * (start + SIGNAL_SLOTS_PER_RANK)].view(torch.int32)[start:]
            left = words.view(MAX_PROGRAMS, MAX_WORLD_SIZE)[:, peers]
            assert int(left.count_nonzero()) == 0, f"rank {ws.rank} channel {name}: unconsumed signals"


def _join(streams, deadline_s: float = DEADLINE_S) -> None:
    import torch

    events = []
    for s in streams:
        e = torch.cuda.Event()
        e.record(s)
        events.append(e)
    start = time.monotonic()
    while not all(e.query() for e in events):
        if time.monotonic() - start > deadline_s:
            raise RuntimeError(f"emulated ranks did not finish within {deadline_s:.0f} s (a wait spins)")
        time.sleep(0.0005)
    torch.cuda.synchronize()


def _graph(streams, calls) -> "torch.cuda.CUDAGraph":
    """ROUNDS rounds of ``calls[rank]()`` on the rank streams, forked from and joined to a capture
    stream, in one CUDA graph."""
    import torch

    capture = torch.cuda.Stream()
    graph = torch.cuda.CUDAGraph()
    capture.wait_stream(torch.cuda.current_stream())
    with torch.cuda.graph(graph, stream=capture):
        for _ in range(ROUNDS):
            fork = torch.cuda.Event()
            fork.record(capture)
            for rank, stream in enumerate(streams):
                stream.wait_event(fork)
                with torch.cuda.stream(stream):
                    calls[rank]()
                done = torch.cuda.Event()
                done.record(stream)
                capture.wait_event(done)
    torch.cuda.synchronize()
    return graph


def _sample_us(graph) -> float:
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(REPLAYS):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / (REPLAYS * ROUNDS)


def run_case_gpu(case, world_size: int, seed: int) -> dict:
    """Check then time one case on ``world_size`` ranks emulated on the current GPU."""
    import torch
    from _floor_cases import RankedCase, in_space
    from autosymm.backends.launch import compile_only

    wss = _workspaces(world_size, "cuda")
    ranked = RankedCase(case, world_size, "cuda")
    for rank, ws in enumerate(wss):
        ranked.prepare(rank, ws)
    ranked.load_inputs(seed)
    with compile_only():
        for rank in range(world_size):
            ranked.call(rank)
    # load every module and bind every launch with no wait spinning (a module load waits for the
    # kernels running on the device: a rank spinning on a peer whose module loads would hang)
    _presatisfy(wss)
    for rank in range(world_size):
        ranked.call(rank)
    torch.cuda.synchronize()
    for ws in wss:
        ws.reset_signals()
    streams = [torch.cuda.Stream() for _ in range(world_size)]
    # checked before timed: one concurrent round on fresh data
    ranked.load_inputs(seed)
    torch.cuda.synchronize()
    for rank, stream in enumerate(streams):
        with torch.cuda.stream(stream):
            ranked.call(rank)
    _join(streams)
    _check_pads(wss)
    ranked.check()
    # timed: zeros, the case's graph and the floor's, samples interleaved
    ranked.load_inputs(seed, zeros=True)
    trivial = [torch.zeros(256, device="cuda") for _ in range(world_size)]
    torch.cuda.synchronize()
    case_graph = _graph(streams, [lambda r=r: ranked.call(r) for r in range(world_size)])
    floor_graph = _graph(streams, [lambda r=r: trivial[r].add_(1) for r in range(world_size)])
    floor_graph.replay()
    case_graph.replay()  # warm
    _join([torch.cuda.current_stream()])
    us, floor = [], []
    for _ in range(SAMPLES):
        floor.append(_sample_us(floor_graph))
        us.append(_sample_us(case_graph))
    _check_pads(wss)
    t, f = statistics.median(us), statistics.median(floor)
    return dict(case=case.key, family=case.family, shape=case.shape, config=case.config_text, op=case.op,
                world_size=world_size, us=round(t, 3), floor_us=round(f, 3), over_us=round(t - f, 3),
                samples=[round(u, 3) for u in us], floor_samples=[round(u, 3) for u in floor],
                in_space=in_space(case, world_size))


def profile_case(case, world_size: int, seed: int, calls: int = 3) -> dict:
    """Rank 0's kernel alone, ``calls`` times, every wait satisfied before each call (pads pre-set,
    Lamport buffers pre-filled): its own cost with no peer to wait for, for a profiler (ncu)."""
    import torch
    from _floor_cases import RankedCase

    wss = _workspaces(world_size, "cuda")
    ranked = RankedCase(case, world_size, "cuda")
    ranked.prepare(0, wss[0])
    ranked.load_inputs(seed, zeros=True)
    for _ in range(calls):
        _presatisfy(wss)
        ranked.call(0)
    torch.cuda.synchronize()
    return dict(case=case.key, world_size=world_size, profiled=calls)


# -- CPU smoke: ranks as forked processes under the interpreter -----------------------------------

def run_case_cpu(case, world_size: int, seed: int) -> dict:
    """One round of ``case`` on ``world_size`` forked processes (the interpreter, the workspaces in
    shared memory at the same addresses in every process), checked; no time."""
    import multiprocessing as mp

    import torch
    from _floor_cases import RankedCase, in_space
    from autosymm.workspace.symm import Workspace

    layout_ws = _workspaces(world_size, "cpu")
    buffers = [ws.buffer.share_memory_() for ws in layout_ws]
    layout = layout_ws[0].layout
    ranked = RankedCase(case, world_size, "cpu", shared=True)
    ranked.load_inputs(seed)

    def rank_main(rank: int) -> None:
        torch.set_num_threads(1)
        ranked.prepare(rank, Workspace(rank, buffers, layout))
        ranked.call(rank)
        os._exit(0)

    ctx = mp.get_context("fork")
    procs = [ctx.Process(target=rank_main, args=(r,)) for r in range(world_size)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=600)
        if p.exitcode != 0:
            for q in procs:
                q.kill()
            raise RuntimeError(f"rank process exited with {p.exitcode}")
    views = [Workspace(r, buffers, layout) for r in range(world_size)]
    _check_pads(views)
    ranked.check()
    return dict(case=case.key, family=case.family, shape=case.shape, config=case.config_text, op=case.op,
                world_size=world_size, checked=True, in_space=in_space(case, world_size))


# -- driver ----------------------------------------------------------------------------------------

def _select(args):
    from _floor_cases import SIZES, available, default_cases, smoke_cases

    sizes = SIZES if not args.sizes else [_parse_bytes(s) for s in args.sizes.split(",")]
    families = set(args.families.split(",")) if args.families else None
    cases = smoke_cases() if args.cpu else default_cases(sizes, families, args.quick)
    if args.cpu and families:
        cases = [c for c in cases if any(f in c.family for f in families)]
    if args.match:
        import re

        cases = [c for c in cases if re.search(args.match, c.key)]
    keep, skipped = [], []
    for case in cases:
        why = available(case)
        (skipped.append((case, why)) if why else keep.append(case))
    return keep, skipped


def _parse_bytes(text: str) -> int:
    text = text.strip().upper().removesuffix("B").removesuffix("I")
    scale = {"K": 1 << 10, "M": 1 << 20}.get(text[-1:], 1)
    return int(text[:-1] if scale > 1 else text) * scale


def run_tree(args) -> list[dict]:
    """Every selected case at every world size on this process's tree; JSON lines to ``args.json``."""
    cases, skipped = _select(args)
    world_sizes = [int(w) for w in args.world_sizes.split(",")]
    out = open(args.json, "a") if args.json else None
    rows = []
    tree = str(Path(args.tree).resolve())
    for case, why in skipped:
        print(f"skip {case.key}: {why}", flush=True)
    if args.compile_only:
        _compile_all(cases, world_sizes, args.compile_shard)
        return rows
    for world_size in world_sizes:
        for i, case in enumerate(cases):
            try:
                run = profile_case if args.profile else run_case_cpu if args.cpu else run_case_gpu
                row = run(case, world_size, seed=1000 + i)
            except Exception as exc:  # reported, not raised: one broken case must not hide the rest
                row = dict(case=case.key, family=case.family, shape=case.shape, config=case.config_text, op=case.op,
                           world_size=world_size, error=f"{type(exc).__name__}: {exc}"[:400])
                if "did not finish" in str(exc):  # a kernel still spins: nothing else can run on this GPU
                    print(json.dumps(row), flush=True)
                    raise
            row["tree"] = tree
            rows.append(row)
            line = json.dumps(row)
            print(line if args.cpu or args.profile or "error" in row else
                  f"W{world_size} {case.key:<58} {row['us']:7.2f} us  floor {row['floor_us']:5.2f}  "
                  f"over {row['over_us']:6.2f}  space={row['in_space']}", flush=True)
            if out:
                out.write(line + "\n")
                out.flush()
    return rows


def _compile_all(cases, world_sizes, shard: str = "0/1") -> None:
    """Compile every rank's kernels of every case (JITFunction.warmup, no launch) of this process's
    shard ``k/n`` of them: the on-disk Triton cache then serves the timed runs. ``compare`` runs n
    shards per tree as processes (a compile holds the GIL for much of its time: threads would not
    overlap)."""
    import torch
    from _floor_cases import RankedCase
    from autosymm.backends.launch import compile_only

    k, n = (int(v) for v in shard.split("/"))
    items = [(c, w) for w in world_sizes for c in cases][k::n]
    for case, world_size in items:
        try:
            wss = _workspaces(world_size, "cuda")
            ranked = RankedCase(case, world_size, "cuda")
            with compile_only():
                for rank, ws in enumerate(wss):
                    ranked.prepare(rank, ws)
                    ranked.call(rank)
        except Exception as exc:
            print(f"compile {case.key} W{world_size}: {type(exc).__name__}: {exc}"[:300], flush=True)
    torch.cuda.synchronize()


def compare(args) -> int:
    """Alternate subprocess runs of the base tree and this one; print the medians per case."""
    here = str(HERE.parent)
    base = str(Path(args.compare).resolve())
    if not (Path(base) / "autosymm").is_dir():
        raise SystemExit(f"--compare {base}: no autosymm package there")
    out_dir = Path(args.out or ".")
    out_dir.mkdir(parents=True, exist_ok=True)
    common = [sys.executable, str(Path(__file__).resolve()), "--world-sizes", args.world_sizes]
    for flag in ("sizes", "families", "match"):
        if getattr(args, flag):
            common += [f"--{flag}", getattr(args, flag)]
    if args.quick:
        common.append("--quick")
    if args.cpu:  # the plumbing alone: every turn checks its cases on interpreter ranks, times nothing
        common.append("--cpu")
    env = dict(os.environ)
    started = time.monotonic()
    # both trees' kernels compiled at once, each by a few processes (the turns then load them from
    # triton's cache)
    shards = max(1, (os.cpu_count() or 2) // 2 - 1)
    compiles = [] if args.cpu else [
        subprocess.Popen(common + ["--tree", tree, "--compile-only", "--compile-shard", f"{k}/{shards}"], env=env)
        for tree in (base, here) for k in range(shards)]
    for p in compiles:
        try:
            p.wait(timeout=max(1.0, args.compile_timeout - (time.monotonic() - started)))
        except subprocess.TimeoutExpired:
            p.kill()
            print("compiling took too long: the turns compile what is left", flush=True)
    print(f"compiled both trees in {time.monotonic() - started:.0f} s", flush=True)
    files = _files(out_dir)
    for f in files.values():
        f.unlink(missing_ok=True)
    for turn in range(args.alternations):
        for name, tree in (("base", base), ("new", here)):
            print(f"== turn {turn} {name} ({tree}) {time.monotonic() - started:.0f} s", flush=True)
            try:
                rc = subprocess.run(common + ["--tree", tree, "--json", str(files[name])], env=env,
                                    timeout=args.turn_timeout).returncode
            except subprocess.TimeoutExpired:
                rc = "timeout"
            if rc:
                print(f"turn {turn} {name}: exit status {rc}", flush=True)
    return summarise(files, out_dir / "floor_compare.md")


def _files(out_dir: Path) -> dict:
    return {"base": out_dir / "floor_base.jsonl", "new": out_dir / "floor_new.jsonl"}


def summarise(files: dict, md_path: Path) -> int:
    rows: dict = {}
    for name, path in files.items():
        if not path.exists():
            continue
        for line in path.read_text().splitlines():
            r = json.loads(line)
            rows.setdefault((r["world_size"], r["case"]), {}).setdefault(name, []).append(r)
    lines = ["| W | case | base us | base over | new us | new over | over: new - base | new in space |",
             "|---|---|---|---|---|---|---|---|"]
    for (w, key), by_tree in sorted(rows.items(), key=lambda kv: (kv[0][0], kv[0][1])):
        cells = []
        if "+spin" in key and not by_tree.get("base"):  # a base without the spin: its plain case (marked *)
            plain = rows.get((w, key.replace("+spin", "")), {}).get("base", [])
            by_tree = {**by_tree, "base": [dict(r, us=r["us"], starred=True) for r in plain if "us" in r]}
        for name in ("base", "new"):
            ok = [r for r in by_tree.get(name, []) if "us" in r]
            err = [r for r in by_tree.get(name, []) if "error" in r]
            checked = [r for r in by_tree.get(name, []) if r.get("checked")]
            if ok:
                cells.append((statistics.median(r["us"] for r in ok), statistics.median(r["over_us"] for r in ok)))
            else:
                cells.append(("ERR" if err else "checked" if checked else "-",) * 2)
        delta = (f"{cells[1][1] - cells[0][1]:+.2f}" if all(isinstance(c[1], float) for c in cells) else "")
        space = next((r.get("in_space") for r in by_tree.get("new", []) if "error" not in r), "")

        def fmt(v):
            return f"{v:.2f}" if isinstance(v, float) else v

        star = "*" if any(r.get("starred") for r in by_tree.get("base", [])) else ""
        lines.append(f"| {w} | {key} | {fmt(cells[0][0])}{star} | {fmt(cells[0][1])}{star} | {fmt(cells[1][0])} | "
                     f"{fmt(cells[1][1])} | {delta} | {space} |")
    text = "\n".join(lines + ["", "\\* base: the same case without ``+spin`` (the base tree has no spin)"])
    print(text)
    md_path.write_text(text + "\n")
    for name, path in files.items():
        for line in (path.read_text().splitlines() if path.exists() else []):
            r = json.loads(line)
            if "error" in r:
                print(f"{name} W{r['world_size']} {r['case']}: {r['error']}")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-sizes", default="", help="comma-separated (default 2; --cpu: 2,3,4)")
    parser.add_argument("--sizes", default="", help="comma-separated: 2K,8K,64K,1M (default 2K..1M)")
    parser.add_argument("--families", default="", help="substrings of family names to keep, comma-separated")
    parser.add_argument("--quick", action="store_true", help="fewer configs (scripts/_floor_cases.py: sized_configs)")
    parser.add_argument("--match", default="", help="a regular expression the case names must match")
    parser.add_argument("--json", default="", help="append one JSON line per case here")
    parser.add_argument("--tree", default=str(HERE.parent), help="the autosymm checkout to run (default: this one)")
    parser.add_argument("--compare", default="", metavar="BASE_DIR", help="time BASE_DIR's tree and this one, alternately")
    parser.add_argument("--alternations", type=int, default=3)
    parser.add_argument("--turn-timeout", type=float, default=300.0)
    parser.add_argument("--compile-timeout", type=float, default=180.0)
    parser.add_argument("--summarise", default="", metavar="DIR", help="print the table of a --compare --out DIR")
    parser.add_argument("--out", default="", help="--compare: folder of the JSON and the table")
    parser.add_argument("--compile-only", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--compile-shard", default="0/1", help=argparse.SUPPRESS)
    parser.add_argument("--cpu", action="store_true", help="smoke run under the interpreter: checks, no times")
    parser.add_argument("--profile", action="store_true",
                        help="rank 0's kernels alone, waits pre-satisfied, for ncu (no check, no time)")
    args = parser.parse_args(argv)
    args.world_sizes = args.world_sizes or ("2,3,4" if args.cpu else "2")
    if args.cpu:
        os.environ["TRITON_INTERPRET"] = "1"
        os.environ.setdefault("AUTOSYMM_BARRIER_MAX_POLLS", "2000000")
    if args.summarise:
        return summarise(_files(Path(args.summarise)), Path(args.summarise) / "floor_compare.md")
    if args.compare:
        return compare(args)
    _use_tree(args.tree)
    rows = run_tree(args)
    failed = [r for r in rows if "error" in r]
    if args.cpu:
        print(f"cpu smoke: {len(rows) - len(failed)} cases checked, {len(failed)} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
