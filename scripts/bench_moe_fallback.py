"""MoE conversions beside plain NCCL: autosymm's NCCL path (nccl_all_to_all), the plain path a
user writes without autosymm (index_select of the rows grouped by destination + one
``all_to_all_single`` with device-computed split sizes, one host copy of the counts; its rows
stay in arrival order, no scatter into the routing layout), and what ``autosymm.convert_*``
runs once ``autosymm.init(moe=[MoEPlan(...)])`` declared the calls (the Triton conversion).

Every path's output is checked first against an expectation built from NCCL all_gathers of
every rank's inputs (rows each path writes, bit for bit); then each is timed eagerly (CUDA
events, median of per-call samples, MAX over ranks). ``remote MB``: bytes of rows this rank
sends to other ranks (MAX over ranks); GB/s = remote MB / median time.

    source scripts/_node_env.sh && python3 scripts/bench_moe_fallback.py            # all local GPUs
    python3 scripts/bench_moe_fallback.py --shapes d5120_e160_k6 --tokens 3000 --csv out.csv
    python3 scripts/bench_moe_fallback.py --cpu --nproc 2 --shapes d64_e8_k2 --tokens 16   # gloo smoke run
"""

from __future__ import annotations

import argparse
import csv
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

SHAPES = "d5120_e160_k6,d4096_e128_k8,d7168_e256_k8"
TOKENS = "512,1024,3000"
PATHS = ("autosymm_nccl", "plain_nccl", "autosymm")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default=SHAPES)
    parser.add_argument("--tokens", default=TOKENS, help="tokens per rank, comma-separated")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--nproc", type=int, default=None)
    parser.add_argument("--csv", default=None)
    parser.add_argument("--cpu", action="store_true", help="gloo on the CPU (a smoke run of this script)")
    args = parser.parse_args()
    shapes = args.shapes.split(",")
    tokens = [int(t) for t in args.tokens.split(",")]
    if args.cpu:
        rows = _spawn_gloo(args.nproc or 2, shapes, tokens, args.repeats)
    else:
        from autosymm.tuning.workers import run_workers

        rows = run_workers(_bench, args.nproc, shapes, tokens, args.repeats)
    _print(rows)
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)


def _bench(rank, world_size, shapes, tokens, repeats):
    import autosymm

    autosymm.init(moe=[autosymm.MoEPlan(s, max(tokens)) for s in shapes])
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() and \
        dist.get_backend() == "nccl" else torch.device("cpu")
    rows = []
    for shape_key in shapes:
        for n_tokens in tokens:
            case = _Case(autosymm.MoEPlan(shape_key, n_tokens).shape, n_tokens, rank, world_size, device)
            for op in ("dp_to_ep", "ep_to_dp"):
                rows.append(case.measure(op, repeats))
    return rows


class _Case:
    """Inputs of one (shape, tokens per rank) on this rank, and every rank's copies for checking."""

    def __init__(self, shape, n_tokens, rank, world_size, device) -> None:
        from autosymm.routing import make_expt_assignment, make_expt_dict_random, random_expt_indx, route

        self.shape, self.n_tokens, self.rank, self.world_size, self.device = shape, n_tokens, rank, world_size, device
        k, n_experts = shape.n_expts_act, shape.n_expts_tot
        self.assignment = make_expt_assignment(world_size, n_experts,
                                               make_expt_dict_random(world_size, n_experts, seed=n_tokens), device)
        self.expt_indx = random_expt_indx(world_size * n_tokens, n_experts, k, seed=n_tokens + 1, device=device)
        self.gate, self.topk = route(self.expt_indx)
        gen = torch.Generator(device=device).manual_seed(1000 * rank + n_tokens)
        self.src = torch.randn(n_tokens, shape.d_model, generator=gen, device=device).bfloat16()
        self.ep_src = torch.randn(world_size * n_tokens * k, shape.d_model, generator=gen, device=device).bfloat16()
        self.owner = self.assignment.expt_owner.long()[self.expt_indx.reshape(-1).long()]  # per pair (no drops)

    def _gathered(self, t):
        out = [torch.empty_like(t) for _ in range(self.world_size)]
        dist.all_gather(out, t)
        return out

    def measure(self, op: str, repeats: int) -> dict:
        from autosymm.tuning.timing import max_over_ranks, time_eager

        args = (self.src if op == "dp_to_ep" else self.ep_src, self.assignment, self.expt_indx,
                self.gate if op == "dp_to_ep" else self.topk)
        fns = {"autosymm_nccl": self._nccl_launcher(op), "plain_nccl": self._plain(op),
               "autosymm": _public(op)}
        rows, expected, plain_expected = self._expectations(op)
        for name, fn in fns.items():
            got = fn(*args)
            ok = torch.equal(got, plain_expected) if name == "plain_nccl" else torch.equal(got[rows], expected)
            if not ok:
                raise AssertionError(f"rank {self.rank}: {name} {op} {self.shape.key} {self.n_tokens} tok: wrong rows")
        del expected, plain_expected
        dist.barrier()
        row = {"shape": self.shape.key, "tokens": self.n_tokens, "op": op, "world_size": self.world_size,
               "remote_MB": self._remote_mb(op), "autosymm_backend": self._backend(op)}
        for name, fn in fns.items():
            timing = max_over_ranks(time_eager(fn, [args], warmup=3, repeats=repeats, group=dist.group.WORLD))
            row[f"{name}_us"] = round(timing.median_us, 1)
        return row

    def _expectations(self, op: str):
        """(destination rows this rank checks, their expected values, the plain path's expected
        rows in arrival order), from all_gathers of every rank's inputs."""
        k, n_pairs_local = self.shape.n_expts_act, self.n_tokens * self.shape.n_expts_act
        if op == "dp_to_ep":
            x = torch.cat(self._gathered(self.src))
            mine = torch.nonzero(self.owner == self.rank).flatten()  # pair order = the plain path's arrival order
            expected = x[mine // k]
            return self.gate.reshape(-1).long()[mine], expected, expected
        eps = torch.stack(self._gathered(self.ep_src))
        pairs = torch.arange(n_pairs_local, device=self.device) + self.rank * n_pairs_local
        sorted_row = self.gate.reshape(-1).long()[pairs]
        expected = eps[self.owner[pairs], sorted_row]
        arrival = torch.argsort(self.owner[pairs] * len(self.owner) + sorted_row)  # by sender, then row
        return pairs - self.rank * n_pairs_local, expected, expected[arrival]

    def _remote_mb(self, op: str) -> float:
        n_pairs_local = self.n_tokens * self.shape.n_expts_act
        if op == "dp_to_ep":
            mine = self.owner[self.rank * n_pairs_local:(self.rank + 1) * n_pairs_local]
            remote = int((mine != self.rank).sum())
        else:
            home = self.topk.long() // n_pairs_local
            remote = int(((self.owner[self.topk.long()] == self.rank) & (home != self.rank)).sum())
        t = torch.tensor([remote * self.shape.d_model * 2 / 1e6], dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return round(float(t), 2)

    def _backend(self, op: str) -> str:
        import autosymm
        from autosymm.problem import Problem

        return autosymm.explain(problem=Problem.moe(op, self.shape, self.n_tokens, "bf16", self.world_size),
                                mode="eager").backend

    def _nccl_launcher(self, op: str):
        from autosymm.backends.base import RunContext
        from autosymm.backends.nccl_all_to_all import NCCL_ALL_TO_ALL
        from autosymm.problem import Problem

        problem = Problem.moe(op, self.shape, self.n_tokens, "bf16", self.world_size)
        return NCCL_ALL_TO_ALL.prepare(problem, None, RunContext(group=dist.group.WORLD))

    def _plain(self, op: str):
        return _plain_dp_to_ep(self.rank, self.world_size) if op == "dp_to_ep" else \
            _plain_ep_to_dp(self.rank, self.world_size)


def _public(op: str):
    import autosymm

    return autosymm.convert_dp_to_ep if op == "dp_to_ep" else autosymm.convert_ep_to_dp


def _plain_dp_to_ep(rank: int, world_size: int):
    """What a user writes: owners of the local pairs, sorted by destination, counts by one-hot
    sums (no bincount: it syncs), one host copy, index_select, all_to_all_single."""

    def call(src, assignment, expt_indx, gate_indx):
        k = expt_indx.shape[1]
        ranks = torch.arange(world_size, device=src.device)
        owner = assignment.expt_owner.long()[expt_indx.reshape(-1).long()]
        local = owner.view(world_size, -1)[rank]
        order = torch.argsort(local, stable=True)
        counts = torch.cat([(local[:, None] == ranks).sum(0), (owner.view(world_size, -1) == rank).sum(1)]).tolist()
        send = src.index_select(0, order // k)
        recv = src.new_empty((sum(counts[world_size:]), src.shape[1]))
        dist.all_to_all_single(recv, send, counts[world_size:], counts[:world_size])
        return recv

    return call


def _plain_ep_to_dp(rank: int, world_size: int):
    """The user's ep->dp: this rank's experts' rows grouped by their token's home rank."""

    def call(src, assignment, expt_indx, topk_indx):
        n_pairs_local = src.shape[0] // world_size
        ranks = torch.arange(world_size, device=src.device)
        pair = topk_indx.long()
        owner = assignment.expt_owner.long()[expt_indx.reshape(-1).long()[pair]]
        home = pair // n_pairs_local
        key = torch.where(owner == rank, home, world_size)
        order = torch.argsort(key, stable=True)
        arriving = (home == rank)[:, None] & (owner[:, None] == ranks)
        counts = torch.cat([(key[:, None] == ranks).sum(0), arriving.sum(0)]).tolist()
        send = src.index_select(0, order[:sum(counts[:world_size])])
        recv = src.new_empty((sum(counts[world_size:]), src.shape[1]))
        dist.all_to_all_single(recv, send, counts[world_size:], counts[:world_size])
        return recv

    return call


def _print(rows) -> None:
    head = (f"{'shape':>14} {'tok':>5} {'op':>8} {'remote MB':>9} | {'autosymm NCCL':>17} | {'plain NCCL':>17} | "
            f"{'autosymm':>17} ({'backend'}) | plain/NCCL-path  plain/autosymm")
    print(head)
    for r in rows:
        cells = []
        for name in PATHS:
            us = r[f"{name}_us"]
            cells.append(f"{us:8.1f} us {r['remote_MB'] / us * 1e3:5.0f} GB/s")  # MB/us = TB/s
        print(f"{r['shape']:>14} {r['tokens']:>5} {r['op']:>8} {r['remote_MB']:>9.1f} | " + " | ".join(cells)
              + f" ({r['autosymm_backend']}) | {r['plain_nccl_us'] / r['autosymm_nccl_us']:14.2f}x "
              f"{r['plain_nccl_us'] / r['autosymm_us']:14.2f}x")


def _gloo_worker(rank, world_size, port, shapes, tokens, repeats, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        rows = _bench(rank, world_size, shapes, tokens, repeats)
        if rank == 0:
            results.put(rows)
    finally:
        import autosymm

        autosymm.reset()
        dist.destroy_process_group()


def _spawn_gloo(nproc, shapes, tokens, repeats):
    import torch.multiprocessing as mp

    from autosymm.tuning.workers import free_port

    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    mp.start_processes(_gloo_worker, args=(nproc, free_port(), shapes, tokens, repeats, results), nprocs=nproc,
                       join=True, start_method="spawn")
    return results.get()


if __name__ == "__main__":
    main()
