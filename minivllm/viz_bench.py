from __future__ import annotations

import matplotlib.pyplot as plt


def plot_report(report: dict, path: str | None = None):
    "Throughput bars (minivllm, its bound, transformers) and the standard run's requests and KV usage over time."
    runs = {(r["engine"], r["workload"]): r for r in report["runs"]}
    fig, (bars, timeline) = plt.subplots(1, 2, figsize=(13, 4.2), gridspec_kw=dict(width_ratios=[1, 1.6]))
    rows = []
    if ("minivllm", "standard") in runs:
        std = runs[("minivllm", "standard")]
        rows += [("roofline bound\n(standard)", std["roofline"]["max_output_tok_s"], "lightgray"),
                 ("minivllm\n(standard)", std["output_tok_s"], "tab:blue")]
    for engine, colour in (("minivllm", "tab:blue"), ("transformers", "tab:orange")):
        if (engine, "side-by-side") in runs:
            rows.append((f"{engine}\n(side by side)", runs[(engine, "side-by-side")]["output_tok_s"], colour))
    bars.barh([r[0] for r in rows][::-1], [r[1] for r in rows][::-1], color=[r[2] for r in rows][::-1])
    for i, (_, value, _) in enumerate(rows[::-1]):
        bars.text(value, i, f" {value:,.0f}", va="center", fontsize=9)
    bars.set_xlabel("output tokens / s")
    bars.set_title("throughput on " + report["environment"].get("gpu", "?"))
    if ("minivllm", "standard") in runs:
        trace = runs[("minivllm", "standard")]["trace"]
        t = [r["t"] for r in trace]
        timeline.plot(t, [r["running"] for r in trace], label="running requests")
        timeline.plot(t, [r["waiting"] for r in trace], label="waiting requests")
        timeline.set_xlabel("seconds")
        timeline.set_ylabel("requests")
        kv = timeline.twinx()
        kv.plot(t, [100 * r["kv_usage"] for r in trace], color="tab:green", label="KV cache used (%)")
        kv.set_ylabel("KV cache used (%)")
        kv.set_ylim(0, 100)
        lines = timeline.get_lines() + kv.get_lines()
        timeline.legend(lines, [l.get_label() for l in lines], loc="upper right", fontsize=8)
        timeline.set_title("the standard run: 256 requests over time")
    fig.tight_layout()
    if path:
        fig.savefig(path, dpi=120, bbox_inches="tight")
    return fig
