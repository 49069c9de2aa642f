"""The toy op's backends, over torch.distributed (gloo or NCCL): ``toy_gloo`` one all_reduce (the
fallback, no config), ``toy_chunked`` the tensor in ``ToyConfig.chunks`` all_reduces (tuned)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from autosymm.backends import Backend, BackendError, Needs

from .spec import ToyConfig


class ToyGloo(Backend):
    name = "toy_gloo"
    needs = Needs(dtypes=None, reduce_ops=None)

    def prepare(self, problem, config, ctx):
        group = ctx.group

        def launch(x: torch.Tensor) -> torch.Tensor:
            dist.all_reduce(x, group=group)
            return x

        return launch


class ToyChunked(Backend):
    name = "toy_chunked"
    needs = Needs(dtypes=None, reduce_ops=None)

    def search_space(self, problem):
        return [ToyConfig(chunks) for chunks in (1, 2, 4)]

    def prepare(self, problem, config, ctx):
        if not isinstance(config, ToyConfig):
            raise BackendError(f"toy_chunked needs a ToyConfig, got {config!r}")
        group, chunks = ctx.group, config.chunks

        def launch(x: torch.Tensor) -> torch.Tensor:
            for part in x.view(-1).chunk(chunks):
                dist.all_reduce(part, group=group)
            return x

        return launch


TOY_GLOO, TOY_CHUNKED = ToyGloo(), ToyChunked()


def identity(problem):
    """A toy call with nothing to exchange: ``x`` itself."""
    return lambda x: x
