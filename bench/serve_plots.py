"""PNG plots of a serving-benchmark report (matplotlib, imported on use)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["write_plots"]


def write_plots(report: dict[str, Any], plot_dir: str | Path) -> list[str]:
    """Write ``latency_distributions.png`` and ``hit_rate_ttft_over_time.png``; returns paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    d = Path(plot_dir)
    d.mkdir(parents=True, exist_ok=True)
    ok = [i for i, e in enumerate(report["errors"]) if not e]
    ttft = [report["ttfts"][i] * 1000 for i in ok]
    itl = [x * 1000 for i in ok for x in report["itls"][i]]
    tpot = []
    for i in ok:
        n = report["output_lens"][i]
        if n > 1:
            tpot.append((report["e2e_latencies"][i] - report["ttfts"][i]) / (n - 1) * 1000)
    name = report.get("config", {}).get("workload", "")
    paths = []

    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for ax, vals, title in zip(axes, (ttft, tpot, itl), ("TTFT", "TPOT", "ITL")):
        if vals:
            ax.hist(vals, bins=min(40, max(5, len(vals) // 2)), color="tab:blue", alpha=0.8)
            ax.axvline(float(np.median(vals)), color="k", linestyle="--", label="median")
            ax.legend()
        ax.set_title(f"{title} ({len(vals)} samples)")
        ax.set_xlabel("ms")
        ax.set_ylabel("count")
        ax.grid(alpha=0.3)
    fig.suptitle(f"latency distributions: {name}")
    fig.tight_layout()
    p = d / "latency_distributions.png"
    fig.savefig(p, dpi=110)
    plt.close(fig)
    paths.append(str(p))

    starts = [report["start_times"][i] for i in ok]
    prompt = [report["prompt_tokens"][i] for i in ok]
    cached = [report["cached_tokens"][i] for i in ok]
    per_req = [c / p if p else 0.0 for c, p in zip(cached, prompt)]
    cum = np.cumsum(cached) / np.maximum(np.cumsum(prompt), 1) if ok else np.array([])
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(9, 7), sharex=True)
    ax1.scatter(starts, per_req, s=12, label="per request")
    ax1.plot(starts, cum, color="tab:orange", label="cumulative")
    ax1.set_ylabel("prompt cache hit rate")
    ax1.set_ylim(-0.02, 1.02)
    ax1.grid(alpha=0.3)
    ax1.legend()
    ax2.scatter(starts, ttft, s=12, color="tab:red")
    ax2.set_ylabel("TTFT (ms)")
    ax2.set_xlabel("request start (s since benchmark start)")
    ax2.grid(alpha=0.3)
    fig.suptitle(f"hit rate and TTFT over time: {name}")
    fig.tight_layout()
    p = d / "hit_rate_ttft_over_time.png"
    fig.savefig(p, dpi=110)
    plt.close(fig)
    paths.append(str(p))
    return paths
