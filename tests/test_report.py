"""The HTML report from real records: every section, every figure embedded as a PNG that decodes to a
sensible image, failures with their replay command, and two device classes merged side by side."""

from __future__ import annotations

import base64
import contextlib
import io
import re

import pytest
import torch
from PIL import Image

from tests import planted  # noqa: F401  (registers the emulator and the planted bugs)
from verify import environment, report, results
from verify.__main__ import main
from verify.checks import check_case

CPU = torch.device("cpu")
CASES = ("uniform:0", "gem_like:0", "causal_q_ne_kv:0")


@pytest.fixture(scope="module")
def records() -> list[dict]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # pytest -n already runs a worker per core
    found = [r for backend in ("emulator", "planted-lse_base2") for case in CASES
             for test in ("forward", "backward") for r in check_case(backend, case, test, CPU)]
    found += check_case("emulator", "uniform:0", "invariants", CPU)
    torch.set_num_threads(threads)
    return found


def write(path, records, device_class="cpu-interpreter", backends=("emulator", "planted-lse_base2", "tlx")):
    header = dict(kind="environment", **environment.collect("cpu"), profile="test", backends=list(backends))
    header["device_class"] = device_class
    path.write_text("".join(results.dumps(r) + "\n" for r in [header, *records]))
    return path


def images(page: str) -> list[Image.Image]:
    return [Image.open(io.BytesIO(base64.b64decode(data)))
            for data in re.findall(r'src="data:image/png;base64,([A-Za-z0-9+/=]+)"', page)]


def test_report_has_every_section_and_decodable_figures(records, tmp_path):
    path = write(tmp_path / "results.jsonl", records)
    output = tmp_path / "report.html"
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["report", str(path), "-o", str(output)]) == 0
    page = output.read_text()
    for _, title in report.SECTIONS:
        assert f">{title}</h2>" in page, title
    assert "http://" not in page and "https://" not in page  # self-contained: nothing to fetch
    pictures = images(page)
    # one error-against-length figure per backend, the ulp histograms, the heat map
    assert len(pictures) == 2 + 1 + 1
    for picture in pictures:
        assert picture.format == "PNG" and picture.width >= 300 and picture.height >= 150
        assert len(picture.convert("L").getcolors(256)) > 8  # drawn on, not blank
    assert page.count('alt="error against sequence length') == 2


def test_report_lists_failures_with_location_and_replay(records, tmp_path):
    page = report.render([write(tmp_path / "results.jsonl", records)])
    failures = page.split(">Failures (")[1].split("</table>")[0]
    failing = [r for r in records if r["status"] == "fail"]
    assert failing and all(r["backend"] == "planted-lse_base2" and r["tensor"] == "lse" for r in failing)
    assert failures.startswith(f"{len(failing)})")
    for r in failing:
        assert f"--jfa-case &#x27;{r['case']}&#x27;" in failures
        assert f"seq {r['worst']['sequence']}, row {r['worst']['row']}, head {r['worst']['head']}" in failures
    assert "jfa verify report: " in page and '<span class="FAIL">FAIL</span>' in page
    # the backend asked for but without records is listed as skipped
    assert "tlx</td><td>(all)</td>" in page
    # invariants of the emulator on uniform:0: eleven, all passing
    invariants = page.split('id="invariants"')[1].split("</table>")[0]
    assert invariants.count("<tr>") == 1 + 12 and "fail</span>" not in invariants


def test_two_device_classes_are_merged_side_by_side(records, tmp_path):
    cpu = write(tmp_path / "cpu.jsonl", records)
    h200 = write(tmp_path / "h200.jsonl", records, device_class="nvidia-h200")
    headers, merged = report.load([cpu, h200])
    assert [h["device_class"] for h in headers] == ["cpu-interpreter", "nvidia-h200"]
    assert {r["backend"] for r in merged} == {"emulator@cpu-interpreter", "emulator@nvidia-h200",
                                              "planted-lse_base2@cpu-interpreter", "planted-lse_base2@nvidia-h200"}
    page = report.render([cpu, h200])
    assert len(images(page)) == 4 + 1 + 1
    summary = page.split('id="summary"')[1].split("</table>")[0]
    assert "emulator@nvidia-h200" in summary and "emulator@cpu-interpreter" in summary


def test_the_report_command_imports_no_torch(records, tmp_path):
    """`python -m verify report` reads results files: the checks' thresholds it shows come from
    verify.limits, not through verify.stats, so it pays no torch import."""
    import subprocess
    import sys
    from pathlib import Path

    path = write(tmp_path / "results.jsonl", records)
    output = tmp_path / "report.html"
    code = ("import sys\nfrom verify.__main__ import main\nstatus = main(['report', sys.argv[1], '-o', sys.argv[2]])\n"
            "print(status, sorted(m for m in ('torch', 'triton', 'jfa') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code, str(path), str(output)], capture_output=True, text=True,
                          cwd=Path(__file__).resolve().parents[1])
    assert done.returncode == 0 and done.stdout.strip().splitlines()[-1] == "0 []", done.stdout + done.stderr
    assert "uniform:0" in output.read_text()
