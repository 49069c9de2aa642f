"""autosymm in one file: the collectives, each checked against torch.distributed, and what decided each.

    torchrun --standalone --nproc-per-node 2 examples/quickstart.py          # CPU: 2 gloo ranks, any machine
    torchrun --standalone --nproc-per-node 2 examples/quickstart.py --cuda   # GPUs: one rank per GPU, NCCL

On the CPU every call takes its fallback (NCCL's role played by gloo: nothing is tuned for a
CPU); on a tuned GPU node the same calls run the tuned Triton kernels. Each result is compared
with what torch.distributed (or torch) computes, and rank 0 prints the decision behind it.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist

import autosymm
from autosymm.routing import random_expt_indx


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cuda", action="store_true", help="one GPU per rank and NCCL (default: CPU and gloo)")
    args = parser.parse_args()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if args.cuda:
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    say = print if rank == 0 else (lambda *a, **k: None)
    torch.manual_seed(rank)
    autosymm.init()  # collective: agree on settings and databases (before any CUDA-graph capture)

    # 1. all-reduce: dist.all_reduce's signature, in place
    x = torch.randn(1 << 16, device=device, dtype=torch.bfloat16)
    expected = x.clone()
    dist.all_reduce(expected)
    autosymm.all_reduce(x)
    torch.testing.assert_close(x, expected)
    say(f"all_reduce:         {autosymm.explain(x).describe()}")

    # 2. fused all-reduce + residual add + RMSNorm: residual += sum(x); out = rms_norm(residual) * weight
    tokens, hidden, eps = 8, 1024, 1e-6
    x = torch.randn(tokens, hidden, device=device, dtype=torch.bfloat16)
    residual = torch.randn(tokens, hidden, device=device, dtype=torch.bfloat16)
    weight = torch.rand(hidden, device=device, dtype=torch.bfloat16) + 0.5
    problem = autosymm.Problem.all_reduce_rmsnorm(tokens, hidden, "bf16", world)
    decision = autosymm.explain(op="all_reduce_rmsnorm", problem=problem)
    if decision.formula == autosymm.epilogue.NATIVE_CHAIN:  # the untuned fallback: what vLLM's unfused ops do
        summed = x.clone()
        dist.all_reduce(summed)  # the sum in x's dtype, then the add in it too: two roundings
        want_residual = residual + summed
        want_out = torch.nn.functional.rms_norm(want_residual, (hidden,), weight, eps)
    else:  # single rounding: the fp32 sum plus the residual, rounded once; the norm of the unrounded sum
        summed = x.float()
        dist.all_reduce(summed)
        want_out, want_residual, _ = autosymm.epilogue.reference(summed, residual, weight, eps)
    out = autosymm.all_reduce_rmsnorm(x, residual, weight, eps=eps)
    torch.testing.assert_close(residual, want_residual)
    torch.testing.assert_close(out, want_out)
    say(f"all_reduce_rmsnorm: {decision.describe()}")

    # 3. reduce-scatter and all-gather: torch.distributed's signatures (dim-0 shards in rank order)
    n = 4096
    full = torch.randn(world * n, device=device, dtype=torch.float32)
    shard = torch.empty(n, device=device, dtype=torch.float32)
    autosymm.reduce_scatter_tensor(shard, full)
    total = full.clone()
    dist.all_reduce(total)
    torch.testing.assert_close(shard, total[rank * n:(rank + 1) * n])
    gathered = torch.empty_like(full)
    autosymm.all_gather_into_tensor(gathered, shard)
    shards = [torch.empty_like(shard) for _ in range(world)]
    dist.all_gather(shards, shard)
    assert torch.equal(gathered, torch.cat(shards))
    say("reduce_scatter_tensor, all_gather_into_tensor: equal to torch.distributed's")

    # 4. MoE: tokens to the ranks owning their experts (dp -> ep) and back (ep -> dp)
    n_experts, k, n_tokens_local, d_model = 8, 2, 16, 64
    assignment = autosymm.make_expt_assignment(world, n_experts, autosymm.make_expt_dict_uniform(world, n_experts),
                                               device)
    # every rank holds every token's top-k expert ids (the same seed: the same ids on every rank)
    expt_indx = random_expt_indx(world * n_tokens_local, n_experts, k, seed=0, device=device)
    gate_indx, topk_indx = autosymm.route(expt_indx)
    x_local = torch.randn(n_tokens_local, d_model, device=device, dtype=torch.bfloat16)
    on_experts = autosymm.convert_dp_to_ep(x_local, assignment, expt_indx, gate_indx)  # rows of this rank's experts
    back = autosymm.convert_ep_to_dp(on_experts, assignment, expt_indx, topk_indx)  # [n_tokens_local * k, d_model]
    assert torch.equal(back.view(n_tokens_local, k, d_model), x_local[:, None].expand(-1, k, -1))
    say("convert_dp_to_ep, convert_ep_to_dp: every token's k rows back")

    say(f"calls per backend (rank 0): {autosymm.stats()}")
    dist.barrier()  # every rank's last collective done before any rank tears its connections down
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
