"""A toy collective, ``toy``, added from outside the package the way ARCHITECTURE.md's "A new
collective" says (tests/test_toy_op.py registers it and proves it): ``toy_sum(x)`` sums a
[rows, width] tensor over the group in place. It is keyed by tokens per rank (its rows) and a new
shape kind, the row width (database key 'w{width}', `explain --width`, `tune --widths`); two
backends over torch.distributed (gloo or NCCL): ``toy_gloo`` (one all_reduce, the fallback) and
``toy_chunked`` (the tensor in ``ToyConfig.chunks`` all_reduces, the tuned candidate).

Files: spec.py (its shape kind, config type and spec), door.py (its door and public function),
backend.py (its backends), tuning.py (its tuning side)."""
