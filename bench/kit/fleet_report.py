"""The fleet benchmark's outputs (bench/fleet.py measures): one PNG of four panels and a text
table, both from the results dict that bench/results/fleet.json holds."""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["plot", "table"]


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ((a, b), (c, d)) = plt.subplots(2, 2, figsize=(11, 8))
    for step in sorted({r["step_s"] for r in results["throughput"]}, reverse=True):
        rows = [r for r in results["throughput"] if r["step_s"] == step]
        n, label = [r["replicas"] for r in rows], f"{step * 1000:g} ms/step"
        line = a.plot(n, [r["tokens_per_s"] for r in rows], "o-", label=label)[0]
        a.plot(n, [rows[0]["tokens_per_s"] * k / n[0] for k in n], ":", color=line.get_color())
        for key, style in (("client_cpu", "o-"), ("replicas_cpu", "s--")):
            b.plot(n, [r[key] for r in rows], style, color=line.get_color(), label=f"{key[:-4]}, {label}")
        d.plot(n, [r["router_own_us"] for r in rows], "o-", label=f"after the {label} run")
    a.set(xlabel="replicas", ylabel="generated tokens/s (dotted: linear)", yscale="log")
    a.set_title("throughput through the router")
    b.set(xlabel="replicas", ylabel="CPU cores busy", title="CPU in the throughput window")
    sync = [s["replicas"] for s in results["sync"]]
    for name in results["sync"][0]["push"] if results["sync"] else []:
        c.plot(sync, [s["push"][name]["median_s"] for s in results["sync"]], "o-", label=f"push {name}")
    c.plot(sync, [s["form_s"] for s in results["sync"]], "s--", label="group formation")
    c.set(xlabel="replicas", ylabel="seconds", yscale="log", title="weight sync (gloo, loopback)")
    wall = results["overhead"]["wall_us"]
    d.set(xlabel="replicas", ylabel="µs per turn", ylim=(0, None))
    d.set_title(
        f"Router.generate's own cost (stubbed replies)\nend to end vs bare client, 1 replica: "
        f"{wall['overhead_mean']:+.0f} ± {wall['overhead_stdev']:.0f} µs of {wall['bare_mean']:.0f}",
        fontsize=10,
    )
    for ax in (a, b, c, d):
        ax.legend(fontsize=8)
        ax.set_xticks(sorted({r["replicas"] for r in results["throughput"]} | set(sync)))
    fig.suptitle(results["title"], fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def table(results: dict[str, Any]) -> str:
    columns = "step_s replicas tokens_per_s turns_per_s client_cpu replicas_cpu router_own_us".split()
    lines = [" | ".join(columns) + " | token_share_min_max"]
    for r in results["throughput"]:
        lines.append(" | ".join(f"{r[c]:.4g}" for c in columns) + f" | {r['token_share_min_max']}")
    for what in ("wall", "cpu"):
        v = results["overhead"][f"{what}_us"]
        lines.append(
            f"router vs bare client, {what}: {v['overhead_mean']:+.1f} ± {v['overhead_stdev']:.1f} µs/turn "
            f"(median {v['overhead_median']:+.1f}; router {v['router_mean']:.0f}, bare {v['bare_mean']:.0f})"
        )
    for s in results["sync"]:
        pushes = "; ".join(
            f"{k} ({p['bytes'] / 1e6:.1f} MB) {p['median_s'] * 1000:.1f} ms (paused "
            f"{p['paused_median_s'] * 1000:.1f}, digest ~{p['digest_s'] * 1000:.1f})"
            for k, p in s["push"].items()
        )
        lines.append(f"sync N={s['replicas']}: form {s['form_s'] * 1000:.0f} ms; push {pushes}")
    return "\n".join(lines)
