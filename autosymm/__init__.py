"""autosymm: tuned symmetric-memory collectives for NVLink GPUs, with an NCCL fallback.

    import autosymm
    autosymm.all_reduce(x)                 # in place, like dist.all_reduce(x); torch.compile-able
    autosymm.explain(x)                    # which backend/config serves it, and why
    autosymm.reduce_scatter_tensor(out, x)  # and all_gather_into_tensor: like torch.distributed's
    dst = autosymm.convert_dp_to_ep(src, assignment, expt_indx, gate_indx)

README.md is the front page; docs/USAGE.md every call, docs/CLI.md `autosymm tune` and the other
commands, docs/DATABASE.md the shipped databases.
"""

from .version import __version__  # noqa: E402
from . import settings  # noqa: E402
from . import spec  # noqa: E402,F401  (the op specs: a Problem finds its spec by name)
from .api import barrier_errors, empty, explain, init, reset, reset_barriers, stats  # noqa: E402
from .collectives.all_gather import all_gather_into_tensor, all_gatherv  # noqa: E402
from .collectives.all_reduce import all_reduce  # noqa: E402
from .collectives.all_reduce_rmsnorm import all_reduce_rmsnorm  # noqa: E402
from .collectives.moe import convert_dp_to_ep, convert_ep_to_dp  # noqa: E402
from .collectives.reduce_scatter import reduce_scatter_tensor, reduce_scatterv  # noqa: E402
from . import ops  # noqa: E402,F401  (registers torch.ops.autosymm.*)
from .problem import MODEL_SHAPES, MoEShape, Problem  # noqa: E402
from .routing import ExptAssignment, make_expt_assignment, make_expt_dict_random, make_expt_dict_uniform, route  # noqa: E402,E501
from .runtime.dispatch import Decision  # noqa: E402
from .runtime.moe_room import MoEPlan  # noqa: E402


def autotune(budget_s: float = 30.0, **options):
    """Warm-up tuning (a context manager): within it, the first eager call of a key this node has
    no row for is tuned on the spot on every rank together and served from its rows afterwards
    (autosymm.tuning.warmup.autotune: ``key_s``, ``ops``, ``db``, ``numerics``, ...). Every rank
    must enter it alike. ``AUTOSYMM_AUTOTUNE=<seconds>`` does the same for the whole process."""
    from .tuning.warmup import autotune as warmup_autotune  # the tuning side loads only when asked for

    return warmup_autotune(budget_s, **options)


def vllm_fusion_pass(graph) -> None:
    """vLLM's post-grad custom pass hook: ``--compilation-config '{"inductor_passes":
    {"post_grad_custom_post_pass": "autosymm.vllm_fusion_pass"}}'`` fuses vLLM's all-reduce ->
    fused add + RMSNorm (autosymm.integrations.vllm_fusion). vLLM resolves the name as an
    attribute of the top-level package and keys its compile cache by this function's source:
    clear the cache after upgrading autosymm."""
    from .integrations.vllm_fusion import PASS  # the integrations load only when vLLM calls the pass

    PASS(graph)

if settings.get_or_default("AUTOSYMM_AUTOTUNE")[0]:  # asked for: the process tunes its calls' keys
    from .tuning.warmup import enable_from_settings

    enable_from_settings()

__all__ = [
    "Decision", "ExptAssignment", "MODEL_SHAPES", "MoEPlan", "MoEShape", "Problem", "__version__",
    "all_gather_into_tensor", "all_gatherv", "all_reduce", "autotune", "all_reduce_rmsnorm", "reduce_scatter_tensor", "reduce_scatterv", "barrier_errors", "convert_dp_to_ep", "convert_ep_to_dp", "empty", "explain", "init", "make_expt_assignment",
    "make_expt_dict_random", "make_expt_dict_uniform", "reset", "reset_barriers", "route", "stats", "vllm_fusion_pass",
]
