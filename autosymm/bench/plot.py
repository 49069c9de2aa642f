"""Plots of `autosymm bench` results (needs the `plot` extra: matplotlib)."""

from __future__ import annotations

from ..spec import ALL_REDUCE


def plot_bench(result, path: str) -> None:
    """Latency and bus bandwidth of all-reduce against size, one line per implementation and
    mode, log axes, with the link floor (bytes / measured peer-read bandwidth) marked."""
    import matplotlib  # matplotlib: the optional `plot` extra

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # after use('Agg')

    rows = [r for r in result.rows if r.op == ALL_REDUCE.name and r.us]
    if not rows:
        raise ValueError("no all-reduce measurements to plot")
    n = result.world_size
    fig, (ax_lat, ax_bw) = plt.subplots(1, 2, figsize=(13, 5))
    for impl, mode in sorted({(r.impl, r.mode) for r in rows}):
        points = sorted((r.nbytes, r.us) for r in rows if r.impl == impl and r.mode == mode)
        sizes = [p[0] for p in points]
        style = "-" if mode == "graph" else "--"
        ax_lat.plot(sizes, [p[1] for p in points], style, marker="o", ms=3, label=f"{impl} ({mode})")
        # bus bandwidth: 2(n-1)/n * bytes / time, the ring-equivalent convention of nccl-tests
        ax_bw.plot(sizes, [2 * (n - 1) / n * s / (us * 1e3) for s, us in points], style, marker="o", ms=3,
                   label=f"{impl} ({mode})")
    if result.peer_read_gbps:
        sizes = sorted({r.nbytes for r in rows})
        floor = [2 * (n - 1) / n * s / (result.peer_read_gbps * 1e3) for s in sizes]
        ax_lat.plot(sizes, floor, ":", color="black", label=f"link floor ({result.peer_read_gbps:.0f} GB/s)")
        ax_bw.axhline(result.peer_read_gbps, ls=":", color="black", label="peer-read bandwidth")
    for ax, ylabel in ((ax_lat, "latency (us, MAX over ranks)"), (ax_bw, "bus bandwidth (GB/s)")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("all-reduce size (bytes)")
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
    ax_lat.legend(fontsize=7)
    fig.suptitle(f"autosymm bench: {result.hardware.get('topology')}, bf16")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
