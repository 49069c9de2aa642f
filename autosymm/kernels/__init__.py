"""The Triton kernels, device side only (``@triton.jit`` functions and their constexpr helpers), one
module per family: the signal-pad barriers, the all-reduces (one-shot pull and push, two-shot,
Lamport, multimem), reduce-scatter and all-gather, the fused all-reduce + RMSNorm and its
epilogues, the MoE conversions and their split planning. The backends (autosymm.backends) launch
them.

Design notes: docs/KERNELS.md
"""
