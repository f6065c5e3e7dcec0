"""The HTML report of one or more results files: one self-contained page (styles inline, figures embedded as
base64 PNG) that can be attached to a review or a CI run and opened anywhere.

    python -m verify report jfa-results/results.jsonl [h200.jsonl ...] -o report.html

Sections: environment, summary (backend x family), error against sequence length, ulp-error histograms,
bound-ratio heat map, failures and worst cases (with the replay command), invariants, skipped. Files from
different device classes are merged with the device appended to the backend name ("triton@nvidia-h200"),
so a CPU and an H200 run sit side by side.
"""

from __future__ import annotations

import base64
import html
import io
import math
from collections import defaultdict
from pathlib import Path

from verify import results
from verify.limits import BOUND_LIMIT, ULP_BINS

TENSORS = ("out", "lse", "dq", "dk", "dv")
SECTIONS = (("environment", "Environment"), ("summary", "Summary"),
            ("length", "Error against sequence length"), ("ulp", "ULP error histograms"),
            ("heatmap", "Bound-ratio heat map"), ("worst", "Failures and worst cases"),
            ("invariants", "Invariants"), ("skipped", "Skipped"))
STYLE = """
body { font: 14px/1.4 system-ui, sans-serif; margin: 24px; color: #222; max-width: 1400px; }
h1 { margin-bottom: 4px; } h2 { border-bottom: 2px solid #ddd; padding-bottom: 4px; margin-top: 32px; }
table { border-collapse: collapse; margin: 8px 0; font-size: 13px; }
th, td { border: 1px solid #ddd; padding: 3px 8px; text-align: left; vertical-align: top; }
th { background: #f4f4f4; } td.num { text-align: right; font-variant-numeric: tabular-nums; }
.pass { color: #1a7f37; font-weight: 600; } .FAIL, .fail, .crash { color: #c62828; font-weight: 600; }
.skip { color: #777; } nav a { margin-right: 12px; } img { max-width: 100%; border: 1px solid #eee; }
code.replay { background: #f6f8fa; padding: 2px 4px; user-select: all; display: inline-block; max-width: 380px;
              overflow-wrap: anywhere; }
.id { display: inline-block; max-width: 240px; overflow-wrap: anywhere; }
.msg { display: inline-block; max-width: 440px; }
button.copy { font-size: 11px; margin-left: 4px; } .note { color: #666; }
"""
COPY_SCRIPT = """
for (const b of document.querySelectorAll('button.copy'))
  b.onclick = () => navigator.clipboard.writeText(b.previousElementSibling.textContent);
"""


# Loading ---------------------------------------------------------------------------------------------------
def load(paths: list[Path]) -> tuple[list[dict], list[dict]]:
    """(headers, records) of several results files; backends renamed "name@device_class" when the files
    come from more than one device class."""
    files = []
    for path in paths:
        records = results.read(path)
        header = records[0] if records and records[0].get("kind") == "environment" else {"kind": "environment"}
        files.append((dict(header, file=str(path)), [r for r in records if r.get("kind") == "result"]))
    several_devices = len({h.get("device_class") for h, _ in files}) > 1
    merged = []
    for header, records in files:
        for record in records:
            suffix = f"@{header.get('device_class')}" if several_devices else ""
            merged.append(dict(record, backend=record["backend"] + suffix))
    return [h for h, _ in files], merged


# Figures ---------------------------------------------------------------------------------------------------
def _pyplot():
    # Imported on first use: matplotlib is the `report` extra, which the gate and bisect do not need.
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _png(fig) -> str:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=80, bbox_inches="tight")
    _pyplot().close(fig)
    return base64.b64encode(buffer.getvalue()).decode()


def _img(data: str, alt: str) -> str:
    return f'<img alt="{html.escape(alt)}" src="data:image/png;base64,{data}">'


def _backends(records) -> list[str]:
    return sorted({r["backend"] for r in records})


def length_figure(records: list[dict], backend: str) -> str | None:
    """Per tensor: per-sequence max |err| and max bound ratio against sequence length (log-log)."""
    points = defaultdict(lambda: ([], [], []))
    for r in records:
        per = r.get("per_sequence") or {}
        if r["backend"] != backend or r.get("tensor") not in TENSORS or not per.get("length"):
            continue
        lengths, errors, ratios = points[r["tensor"]]
        for length, err, ratio in zip(per["length"], per["max_err"], per["bound_ratio"], strict=False):
            if length > 0:
                lengths.append(length)
                errors.append(results.number(err))
                ratios.append(results.number(ratio))
    tensors = [t for t in TENSORS if points[t][0]]
    if not tensors:
        return None
    plt = _pyplot()
    from matplotlib.ticker import NullFormatter

    fig, axes = plt.subplots(2, len(tensors), figsize=(3.2 * len(tensors), 5.6), squeeze=False)
    for column, tensor in enumerate(tensors):
        lengths, errors, ratios = points[tensor]
        for row, (values, label) in enumerate(((errors, "max |err|"), (ratios, "max bound ratio"))):
            ax = axes[row][column]
            shown = [(n, v) for n, v in zip(lengths, values, strict=True) if v is not None and 0 < v < math.inf]
            if shown:
                ax.scatter(*zip(*shown, strict=True), s=6, alpha=0.5, color="#1f77b4" if row == 0 else "#d62728")
                ax.set_yscale("log")
            ax.set_xscale("log")
            if row == 1:
                ax.axhline(BOUND_LIMIT, color="k", lw=0.8, ls="--")
                ax.set_xlabel("sequence length")
            ax.set_xlim(0.7, 1.5 * max(lengths))  # from length 1, so that a decade tick is always labelled
            ax.xaxis.set_minor_formatter(NullFormatter())  # minor labels of a short log range overlap
            ax.set_title(f"{tensor}: {label}", fontsize=10)
            hidden = len(values) - len(shown)  # exact zeros (and non-finite values) have no place on a log axis
            if hidden:
                ax.text(0.98, 0.02, f"{hidden} zero or non-finite not shown", transform=ax.transAxes, ha="right",
                        va="bottom", fontsize=7, color="#555")
            ax.grid(True, which="major", alpha=0.3)
    fig.suptitle(f"{backend}: per-sequence error against length (dashed: bound limit {BOUND_LIMIT:g})")
    fig.tight_layout()
    return _png(fig)


def ulp_figure(records: list[dict]) -> str | None:
    """Per tensor: the ulp-error histogram summed over records, one bar series per backend."""
    counts = defaultdict(lambda: [0] * (len(ULP_BINS) - 1))
    for r in records:
        histogram = (r.get("stats") or {}).get("ulp_histogram")
        if histogram and r["tensor"] in TENSORS:
            total = counts[(r["tensor"], r["backend"])]
            for i, n in enumerate(histogram):
                total[i] += n
    tensors = [t for t in TENSORS if any(key[0] == t and sum(v) for key, v in counts.items())]
    if not tensors:
        return None
    backends = _backends(records)
    labels = [f"<{ULP_BINS[i + 1]:g}" if i + 2 < len(ULP_BINS) else f">={ULP_BINS[i]:g}"
              for i in range(len(ULP_BINS) - 1)]
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(tensors), figsize=(3.6 * len(tensors), 3.4), squeeze=False)
    width = 0.8 / len(backends)
    for ax, tensor in zip(axes[0], tensors, strict=True):
        for i, backend in enumerate(backends):
            values = counts.get((tensor, backend))
            if values:
                # empty bins are left out (NaN), not drawn at a fake height on the log axis
                ax.bar([x + i * width for x in range(len(labels))], [v if v else math.nan for v in values], width,
                       label=backend)
        ax.set_yscale("log")
        ax.set_xticks([x + 0.4 - width / 2 for x in range(len(labels))], labels, rotation=60, fontsize=8)
        ax.set_title(f"{tensor}: elements per ulp error", fontsize=10)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    return _png(fig)


def heatmap_figure(rows: list[dict]) -> str | None:
    """Worst bound ratio / BOUND_LIMIT per family x backend; diverging around 1, failures marked."""
    if not rows:
        return None
    from matplotlib.colors import TwoSlopeNorm

    families = sorted({r["family"] for r in rows})
    backends = sorted({r["backend"] for r in rows})
    cell = {(r["family"], r["backend"]): r for r in rows}
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(2.2 + 1.6 * len(backends), 1.0 + 0.32 * len(families)))
    grid = [[math.nan] * len(backends) for _ in families]
    for i, family in enumerate(families):
        for j, backend in enumerate(backends):
            row = cell.get((family, backend))
            if row is None:
                continue
            scaled = row["bound"] / BOUND_LIMIT
            # log10, clipped to 3 decades either side, so that 1 (the limit) is the neutral colour
            grid[i][j] = max(-3.0, min(3.0, math.log10(scaled))) if scaled > 0 else -3.0
            mark = " ✗" if row["failed"] or row["crashed"] else ""
            ax.text(j, i, f"{scaled:.2g}{mark}", ha="center", va="center", fontsize=8,
                    fontweight="bold" if mark else "normal")
    image = ax.imshow(grid, cmap="RdBu_r", norm=TwoSlopeNorm(vmin=-3, vcenter=0, vmax=3), aspect="auto")
    ax.set_xticks(range(len(backends)), backends, rotation=20, ha="right")
    ax.set_yticks(range(len(families)), families, fontsize=8)
    bar = fig.colorbar(image, ax=ax, fraction=0.05)
    bar.set_label(f"log10(worst bound ratio / {BOUND_LIMIT:g})")
    ax.set_title("worst bound ratio / limit (✗: a record of the cell fails)")
    fig.tight_layout()
    return _png(fig)


# Tables ----------------------------------------------------------------------------------------------------
def _table(header: list[str], rows: list[list], numeric: set[int] = frozenset()) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f'<td class="num">{c}</td>' if i in numeric else f"<td>{c}</td>"
                                    for i, c in enumerate(row)) + "</tr>" for row in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def _num(value, spec=".3g") -> str:
    value = results.number(value)
    return "-" if value is None else format(value, spec)


def _status(text: str) -> str:
    return f'<span class="{html.escape(text)}">{html.escape(text)}</span>'


def _id(case_id: str) -> str:
    return f'<span class="id">{html.escape(case_id)}</span>'


def _replay(command: str | None) -> str:
    if not command:
        return "-"
    return f'<code class="replay">{html.escape(command)}</code><button class="copy">copy</button>'


def environment_section(headers: list[dict]) -> str:
    keys = []
    for h in headers:
        keys += [k for k in h if k not in ("kind", "file") and k not in keys]
    rows = [[html.escape(k)] + [html.escape(str(h.get(k, "-"))) for h in headers] for k in keys]
    return _table(["", *(h["file"] for h in headers)], rows)


def summary_section(rows: list[dict]) -> str:
    body = [[html.escape(r["backend"]), html.escape(r["family"]), _num(r["bound"]), _num(r["baseline"]),
             _num(r["ulp"]), _num(r["bias"], ".2f"), r["passed"], r["failed"] + r["crashed"], r["skipped"],
             _status(r["verdict"])] for r in rows]
    return _table(["backend", "family", "worst bound ratio", "worst baseline ratio", "max ulp", "|bias|", "pass",
                   "fail", "skip", "verdict"], body, numeric={2, 3, 4, 5, 6, 7, 8})


def _location(record: dict) -> str:
    worst = record.get("worst")
    if not worst or record["test"] == "invariants":
        return html.escape((record.get("message") or "-")[:300])
    column = "" if worst.get("column") is None else f", col {worst['column']}"
    return (f"seq {worst['sequence']}, row {worst['row']}, head {worst['head']}{column}: got "
            f"{_num(worst.get('value'), '.5g')}, ref {_num(worst.get('reference'), '.5g')}, bound "
            f"{_num(worst.get('bound'), '.3g')}")


def record_rows(records: list[dict]) -> list[list]:
    rows = []
    for r in records:
        stats = r.get("stats") or {}
        failed = [name for name, ok in (r.get("checks") or {}).items() if not ok]
        bias = (max(abs(results.number(stats["bias_mean"])), abs(results.number(stats["bias_magnitude_mean"])))
                if "bias_mean" in stats else None)
        rows.append([html.escape(r["backend"]), _id(r["case"]), r["test"], html.escape(r["tensor"]),
                     _status(r["status"]), html.escape(", ".join(failed) or "-"), _num(stats.get("bound_ratio")),
                     _num(stats.get("baseline_ratio")), _num(stats.get("max_ulp")), _num(stats.get("rel_l2")),
                     _num(bias), f'<span class="msg">{_location(r)}</span>', _replay(r.get("replay"))])
    return rows


RECORD_HEADER = ["backend", "case", "test", "tensor", "status", "failed", "bound ratio", "baseline ratio",
                 "max ulp", "rel L2", "|bias|", "worst element / message", "replay"]


def worst_section(records: list[dict], worst: int) -> str:
    failing = [r for r in records if r["status"] in ("fail", "crash")]
    graded = sorted((r for r in records if "bound_ratio" in (r.get("stats") or {})),
                    key=lambda r: -(results.number(r["stats"]["bound_ratio"]) or 0.0))[:worst]
    parts = [f"<h3>Failures ({len(failing)})</h3>"]
    parts.append(_table(RECORD_HEADER, record_rows(failing), {6, 7, 8, 9, 10}) if failing else
                 '<p class="pass">No record fails.</p>')
    parts.append(f"<h3>The {len(graded)} worst records by bound ratio</h3>")
    parts.append(_table(RECORD_HEADER, record_rows(graded), {6, 7, 8, 9, 10}))
    return "".join(parts)


def invariants_section(records: list[dict]) -> str:
    outcome = defaultdict(lambda: [0, 0, []])
    for r in records:
        if r["test"] == "invariants" and r["status"] in ("pass", "fail"):
            cell = outcome[(r["backend"], r["tensor"])]
            cell[0 if r["status"] == "pass" else 1] += 1
            if r["status"] == "fail":
                cell[2].append(f"{r['case']}: {(r.get('message') or '')[:200]}")
    if not outcome:
        return '<p class="note">No invariant results.</p>'
    rows = [[html.escape(backend), html.escape("(raised)" if name == "*" else name), passed, failed,
             _status("pass" if not failed else "fail"), "<br>".join(html.escape(f) for f in failures[:10])]
            for (backend, name), (passed, failed, failures) in sorted(outcome.items())]
    return _table(["backend", "invariant", "pass", "fail", "verdict", "failing cases"], rows, {2, 3})


def skipped_section(headers: list[dict], records: list[dict]) -> str:
    seen = {r["backend"].split("@")[0] for r in records}
    rows = [[html.escape(backend), "(all)", html.escape(f"no records in {h['file']}: unavailable on "
                                                        f"{h.get('device_class', 'this device')}")]
            for h in headers for backend in h.get("backends") or () if backend not in seen]
    rows += [[html.escape(r["backend"]), _id(r["case"]), html.escape(f"[{r['test']}] {r.get('message')}")]
             for r in records if r["status"] == "skip"]
    return _table(["backend", "case", "reason"], rows) if rows else '<p class="note">Nothing was skipped.</p>'


# The page --------------------------------------------------------------------------------------------------
def render(paths: list[Path], worst: int = 20) -> str:
    headers, records = load(paths)
    rows = results.summary_rows(records)
    figures = {"length": [], "ulp": [], "heatmap": []}
    for backend in _backends(records):
        image = length_figure(records, backend)
        if image:
            figures["length"].append(_img(image, f"error against sequence length, {backend}"))
    for name, image in (("ulp", ulp_figure(records)), ("heatmap", heatmap_figure(rows))):
        if image:
            figures[name].append(_img(image, name))
    verdict = "FAIL" if any(r["verdict"] == "FAIL" for r in rows) else "pass"
    body = {
        "environment": environment_section(headers),
        "summary": summary_section(rows),
        "length": "".join(figures["length"]) or '<p class="note">No per-sequence statistics.</p>',
        "ulp": "".join(figures["ulp"]) or '<p class="note">No ulp histograms.</p>',
        "heatmap": "".join(figures["heatmap"]) or '<p class="note">No results.</p>',
        "worst": worst_section(records, worst),
        "invariants": invariants_section(records),
        "skipped": skipped_section(headers, records),
    }
    nav = "".join(f'<a href="#{key}">{title}</a>' for key, title in SECTIONS)
    sections = "".join(f'<h2 id="{key}">{title}</h2>{body[key]}' for key, title in SECTIONS)
    counts = defaultdict(int)
    for r in records:
        counts[r["status"]] += 1
    tally = ", ".join(f"{n} {status}" for status, n in sorted(counts.items()))
    return (f'<!DOCTYPE html><html><head><meta charset="utf-8"><title>jfa verify report</title>'
            f"<style>{STYLE}</style></head><body><h1>jfa verify report: {_status(verdict)}</h1>"
            f'<p class="note">{len(records)} records ({tally}) from {len(paths)} file(s); bound limit '
            f"{BOUND_LIMIT:g}</p><nav>{nav}</nav>{sections}<script>{COPY_SCRIPT}</script></body></html>")


def add_arguments(parser) -> None:
    parser.add_argument("results", nargs="+", type=Path, metavar="RESULTS", help="results files (JSON lines)")
    parser.add_argument("-o", "--output", type=Path, default=Path("report.html"), help="default report.html")
    parser.add_argument("--worst", type=int, default=20, metavar="N", help="list the N worst records (default 20)")


def main(args) -> int:
    missing = [str(p) for p in args.results if not p.exists()]
    if missing:
        print(f"report: error: no such results file: {', '.join(missing)}")
        return 2
    args.output.write_text(render(args.results, args.worst))
    print(f"report: wrote {args.output}")
    return 0
