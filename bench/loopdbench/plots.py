"""bench/run's plots: workload 1's IOPS relative to loopd direct, workload 3's
gain of the range lock, workload 2's page cache and context switches."""

import os

from .stats import seed001_pairs
from .systems import MAIN_SYSTEMS
from .units import MIB


def make_plots(cfg, rows):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    made = []
    w3 = [r for r in rows if r["workload"] == 3]
    if w3:
        fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
        for ax, bs in zip(axes, ["4k", "1m"]):
            pts = [(j, (a["iops"] / b["iops"] - 1) * 100) for b_s, j, a, b in seed001_pairs(w3)
                   if b_s == bs and a and b and b.get("iops")]
            if pts:
                xs = [str(p[0]) for p in pts]
                ys = [p[1] for p in pts]
                ax.bar(xs, ys, color=["tab:green" if y >= 0 else "tab:red" for y in ys])
                for x, y in zip(xs, ys):
                    ax.annotate(f"{y:+.0f}%", (x, y), ha="center",
                                va="bottom" if y >= 0 else "top", fontsize=8)
            ax.axhline(0, color="black", lw=0.8)
            ax.set_title(f"randrw 50/50, bs={bs.upper()}, QD1")
            ax.set_xlabel("fio jobs (one connection each)")
        axes[0].set_ylabel("IOPS gain of range lock over whole-device lock (%)")
        fig.suptitle("loopd --cache direct: byte-range lock vs one device lock (seed 001)")
        fig.tight_layout()
        fig.savefig(os.path.join(cfg.outdir, "seed001-gain.png"), dpi=110)
        plt.close(fig)
        made.append("seed001-gain.png")
    w1 = [r for r in rows if r["workload"] == 1 and not r.get("error")
          and r.get("ratio_iops_vs_baseline")]
    if w1:
        systems = [s for s in MAIN_SYSTEMS if any(r["system"] == s for r in w1)]
        cases = list(dict.fromkeys(r["case"] for r in w1))
        idx = {(r["case"], r["system"]): r for r in w1}
        fig, ax = plt.subplots(figsize=(12, 4.5))
        width = 0.8 / max(1, len(systems))
        for si, s in enumerate(systems):
            xs = [i + (si - (len(systems) - 1) / 2) * width for i in range(len(cases))]
            ax.bar(xs, [idx.get((c, s), {}).get("ratio_iops_vs_baseline") or 0 for c in cases],
                   width, label=s)
        ax.axhline(1, color="black", lw=0.8)
        ax.set_xticks(range(len(cases)))
        ax.set_xticklabels(cases)
        ax.set_ylabel("IOPS relative to loopd-direct")
        ax.legend(ncol=4, fontsize=8)
        ax.set_title("Workload 1: IOPS of each system relative to loopd --cache direct (cold cache)")
        fig.tight_layout()
        fig.savefig(os.path.join(cfg.outdir, "w1-iops.png"), dpi=110)
        plt.close(fig)
        made.append("w1-iops.png")
    w2 = [r for r in rows if r["workload"] == 2 and not r.get("error")]
    if w2:
        systems = [s for s in MAIN_SYSTEMS if any(r["system"] == s for r in w2)]
        cases = list(dict.fromkeys(r["case"] for r in w2))
        idx = {(r["case"], r["system"]): r for r in w2}
        fig, axes = plt.subplots(2, 1, figsize=(12, 8))
        width = 0.8 / max(1, len(cases))
        for ci, c in enumerate(cases):
            xs = [i + (ci - (len(cases) - 1) / 2) * width for i in range(len(systems))]
            pc = [(idx.get((c, s), {}).get("pagecache_bytes") or 0) / MIB for s in systems]
            cx = []
            for s in systems:
                r = idx.get((c, s), {})
                ios = (r.get("iops") or 0) * (r.get("wall_s") or 0)
                cx.append((r.get("sys_ctx") or 0) / ios if ios else 0)
            axes[0].bar(xs, pc, width, label=c)
            axes[1].bar(xs, cx, width, label=c)
        for ax in axes:
            ax.set_xticks(range(len(systems)))
            ax.set_xticklabels(systems)
        axes[0].set_ylabel("image in page cache after case (MiB)")
        axes[1].set_ylabel("context switches per I/O (machine-wide)")
        axes[0].legend(ncol=4, fontsize=8)
        fig.suptitle("Seed 000: memory footprint and context switches (4k, QD1 per job)")
        fig.tight_layout()
        fig.savefig(os.path.join(cfg.outdir, "seed000-memory-ctx.png"), dpi=110)
        plt.close(fig)
        made.append("seed000-memory-ctx.png")
    return made

