"""The report's PNG plots (matplotlib, an optional extra: without it the report has none)."""

from __future__ import annotations

from pathlib import Path

from measure import Measurement
from peers import log
from sections import Served


def plot_add_sub(served: dict[str, Served], plots: Path) -> list[tuple[str, Path]]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import matplotlib.ticker
    except ImportError:
        log("matplotlib missing: no plots (pip install matplotlib)")
        return []
    plots.mkdir(parents=True, exist_ok=True)
    colors = {"dlserve": "tab:blue", "Triton": "tab:green", "MLServer": "tab:orange"}
    styles = {
        "pa": ("-", "o", "perf_analyzer"),
        "dp": ("--", "s", "dlserve perf"),
        "lg": (":", "^", "loadgen"),
    }
    files = []
    for protocol, shown in (("http", "HTTP"), ("grpc", "gRPC")):
        fig, ax = plt.subplots(figsize=(8, 5))
        drawn = False
        for name, record in served.items():
            for tool, (style, marker, tool_name) in styles.items():
                if tool == "lg":
                    ms = [record.results.get(f"lg {protocol} c{c}") for c in (1, 16)]
                    levels = [m.levels[0] for m in ms if isinstance(m, Measurement) and m.ok]
                else:
                    m = record.results.get(f"{tool} {protocol}")
                    levels = m.levels if isinstance(m, Measurement) and m.ok else []
                if not levels:
                    continue
                drawn = True
                x, y = [lv.throughput for lv in levels], [lv.p50_us / 1000 for lv in levels]
                label = f"{name} · {tool_name}" + (
                    " (JSON)" if tool == "lg" and protocol == "http" else ""
                )
                ax.plot(x, y, linestyle=style, marker=marker, color=colors.get(name), label=label)
                for lv, xi, yi in zip(levels, x, y):
                    ax.annotate(
                        f"c{lv.concurrency}",
                        (xi, yi),
                        textcoords="offset points",
                        xytext=(4, 3),
                        fontsize=7,
                        color=colors.get(name),
                    )
        if not drawn:
            plt.close(fig)
            continue
        ax.set_xlabel("throughput (inferences/s)")
        ax.set_yscale("log")  # MLServer's latencies are an order of magnitude above the others
        ax.yaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
        ax.set_ylabel("p50 latency (ms, log scale)")
        ax.set_title(f"add_sub over {shown}: latency vs throughput, concurrency sweep")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = plots / f"add_sub_{protocol}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        files.append((shown, path))
    return files
