"""report.html for ``siq audit``: tables and inline SVG charts, one file, no scripts."""

from __future__ import annotations

import html
from collections import defaultdict
from datetime import UTC, datetime
from typing import Any

W, H, PAD = 640, 180, 36

_SUMMARY_COLUMNS = (
    ("starts", "starts"), ("rate_pct", "% of rate"), ("violations", "violations"), ("min_gap_ms", "min gap ms"),
    ("gap_p01_ms", "gap p1 ms"), ("lateness_p50_ms", "late p50 ms"), ("lateness_p99_ms", "late p99 ms"),
    ("inversions", "inversions"), ("duplicate_starts", "duplicate starts"), ("missing_tickets", "never started"),
    ("unfinished", "unfinished"), ("failures", "failures"), ("epochs", "epochs"), ("worker_hosts", "hosts"),
    ("reported_starts", "bodies reported"), ("body_violations", "body violations"),
    ("body_limit_violations", "bodies over quota or cap"),
)  # fmt: skip
#: Shown when some queue has a window quota or a concurrency cap.
_LIMIT_COLUMNS = (
    ("window_violations", "window violations"), ("max_window_units", "most units in a window"),
    ("concurrency_violations", "over the cap"), ("max_in_flight", "most in flight"),
)  # fmt: skip


def _fmt(value: Any) -> str:
    if value is None:  # e.g. the gap of a queue with one start
        return "-"
    if isinstance(value, float):
        return f"{value:,.3f}".rstrip("0").rstrip(".")
    if isinstance(value, int):
        return f"{value:,}"
    return html.escape(str(value))


def _table(rows: list[dict[str, Any]], columns: tuple[tuple[str, str], ...]) -> str:
    head = "".join(f"<th>{html.escape(label)}</th>" for _, label in columns)
    body = "".join("<tr>" + "".join(f"<td>{_fmt(row.get(key))}</td>" for key, _ in columns) + "</tr>" for row in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def _bars(values: list[float], labels: tuple[str, str], title: str, marker: float | None = None) -> str:
    """A bar chart of ``values`` (left to right), an optional dashed line at ``marker``."""
    top = max([*values, marker or 0.0, 1e-9])
    width = (W - 2 * PAD) / max(len(values), 1)
    scale = (H - 2 * PAD) / top
    bars = "".join(
        f'<rect x="{PAD + i * width:.1f}" y="{H - PAD - v * scale:.1f}" width="{max(width - 1, 0.5):.1f}" '
        f'height="{v * scale:.1f}" fill="#4a7ab5"/>'
        for i, v in enumerate(values)
    )
    line = ""
    if marker is not None:
        y = H - PAD - marker / top * (H - 2 * PAD)
        line = f'<line x1="{PAD}" x2="{W - PAD}" y1="{y:.1f}" y2="{y:.1f}" stroke="#c0392b" stroke-dasharray="4 3"/>'
    return (
        f'<figure><figcaption>{html.escape(title)}</figcaption><svg width="{W}" height="{H}" '
        f'xmlns="http://www.w3.org/2000/svg" role="img"><rect width="{W}" height="{H}" fill="#fff"/>{bars}{line}'
        f'<line x1="{PAD}" x2="{W - PAD}" y1="{H - PAD}" y2="{H - PAD}" stroke="#333"/>'
        f'<text x="{PAD}" y="{H - 10}" font-size="11">{html.escape(labels[0])}</text>'
        f'<text x="{W - PAD}" y="{H - 10}" font-size="11" text-anchor="end">{html.escape(labels[1])}</text>'
        f'<text x="4" y="{PAD - 8}" font-size="11">max {_fmt(top)}</text></svg></figure>'
    )


def _when(us: int) -> str:
    return datetime.fromtimestamp(us / 1e6, UTC).strftime("%Y-%m-%d %H:%M:%S")


_FAIR_COLUMNS = (
    ("fair_key", "key"), ("starts", "starts"), ("units", "units"), ("weight", "weight"), ("share", "share"),
    ("weight_share", "its weight's share"),
)  # fmt: skip


def _fair(keys: list[dict[str, Any]], hours: list[dict[str, Any]]) -> str:
    """A fair queue's shares by key, and its starts out of fair order ("" for another queue)."""
    if not keys:
        return ""
    unfair = sum(h["unfair"] for h in hours)
    return (
        f"<h3>fair shares</h3><p>{_fmt(sum(h['fair_starts'] for h in hours))} starts of fair tasks; {_fmt(unfair)} "
        f"handed their tickets out of fair order (a tag below one before it while keys had work). Its weight's "
        f"share: among the keys that started in the same hours.</p>" + _table(keys, _FAIR_COLUMNS)
    )


def render(report: dict[str, Any]) -> str:
    by_queue: dict[str, dict[str, list[dict[str, Any]]]] = defaultdict(lambda: defaultdict(list))
    for name in ("gaps", "rate", "workers", "by_hour", "fair_keys", "fair_order"):
        for row in report.get(name, []):
            by_queue[row["queue"]][name].append(row)
    sections = []
    limited = any(q.get(k) is not None for q in report["summary"] for k in ("max_window_units", "max_in_flight"))
    limits = _LIMIT_COLUMNS if limited else ()
    for q in report["summary"]:
        parts = by_queue[q["queue"]]
        gap_counts = [0.0] * 61
        for row in parts["gaps"]:
            gap_counts[int(row["bin"])] = float(row["count"])
        rate = sorted(parts["rate"], key=lambda r: r["bucket"])
        hosts: dict[str, int] = defaultdict(int)
        for row in parts["workers"]:
            hosts[row["host"]] += row["starts"]
        target = rate[0]["target_rate"] if rate else None
        sections.append(
            f"<h2>{html.escape(q['queue'])}</h2>"
            f"<p>{_fmt(q['starts'])} starts from {_when(q['first_start_us'])} to {_when(q['last_start_us'])} UTC; "
            f"achieved {_fmt(q['achieved_rate'] or 0.0)}/s against {_fmt(q['target_rate'])}/s.</p>"
            + _bars(gap_counts, ("0", "3+ intervals"), "gap to the previous start, in intervals (none below 1)")
            + _bars(
                [r["rate"] for r in rate],
                (_when(rate[0]["bucket_start_us"]) if rate else "", _when(rate[-1]["bucket_start_us"]) if rate else ""),
                "slots used per second over time (a start of cost c uses c; dashed: 1/interval)",
                target,
            )
            + _bars([float(v) for v in hosts.values()], ("", ""), "starts per worker host: " + ", ".join(
                f"{h} {100 * n / max(q['starts'], 1):.1f}%" for h, n in sorted(hosts.items())))
            + "<h3>by hour (UTC)</h3>"
            + _table(parts["by_hour"], (("hour", "hour"), *_SUMMARY_COLUMNS[:8], *limits))
            + _fair(parts["fair_keys"], parts["fair_order"])
        )  # fmt: skip
    return (
        "<!doctype html><html><head><meta charset='utf-8'><title>siq audit</title><style>"
        "body{font:14px system-ui,sans-serif;margin:2em;color:#222}table{border-collapse:collapse;margin:1em 0}"
        "td,th{border:1px solid #ccc;padding:3px 8px;text-align:right}th{background:#f3f3f3}"
        "figure{margin:1em 0}figcaption{font-weight:600}</style></head><body>"
        f"<h1>siq audit</h1><p>{_fmt(report['rows'])} ledger rows from {html.escape(', '.join(report['inputs']))}; "
        f"a violation is a start less than interval - {report['tolerance_us'] / 1000:g} ms after the one before it "
        f"(c x interval after a start of cost c; store clock; under a burst B, a start GCRA did not allow with a "
        f"tolerance of B intervals). A window violation is a start at which the window ending there holds more "
        f"than its quota; over the cap, a start at which more than the cap were in flight, itself included. "
        f"Generated {html.escape(report['generated_at'])}"
        + (f" in {report['seconds']:g} s ({_fmt(report['rows_per_second'])} rows/s)" if "seconds" in report else "")
        + ".</p>"
        + "".join(
            f"<p>{html.escape(name)}: {_fmt(n)} rows not shown here (see the Parquet table)</p>"
            for name, n in report.get("left_out", {}).items()
        )
        + _table(report["summary"], (("queue", "queue"), *_SUMMARY_COLUMNS, *limits))
        + "".join(sections)
        + "</body></html>"
    )
