"""report.html in a real browser (headless Chromium, no network): it loads without errors and draws every plot.

The static checks of test_report.py cannot see a plotly.js that fails to run or a plot that throws while drawing.
Chromium comes from Debian: ``apt-get update && apt-get install -y chromium``; without it these tests are skipped.
"""

import json
import re
import struct
import subprocess
from pathlib import Path

import pytest

from optiq.report import write_report
from optiq.rundir import write_json
from test_report import h200_report

CHROMIUM = Path("/usr/bin/chromium")
pytestmark = pytest.mark.skipif(not CHROMIUM.exists(), reason="chromium is not installed")

FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--enable-logging=stderr", "--v=0", "--host-resolver-rules=MAP * ~NOTFOUND",  # any fetch would fail
         "--virtual-time-budget=10000", "--window-size=1280,2400"]  # 10 s of page time: plots drawn before the dump
# Lists, after the plots are drawn, every resource the page asked for (failed fetches included).
PROBE = """<script>window.addEventListener("load", () => setTimeout(() => { document.body.dataset.resources =
JSON.stringify(performance.getEntriesByType("resource").map(e => e.name)); }, 1000));</script>"""


@pytest.fixture(scope="module")
def page(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("apply-fusion-run")
    write_json(run / "report.json", h200_report())
    write_report(run)
    probed = run / "probed.html"
    probed.write_text((run / "report.html").read_text().replace("</body>", PROBE + "</body>"))
    return probed


def chromium(tmp_path, *args) -> subprocess.CompletedProcess:
    profile = tmp_path / f"profile-{len(list(tmp_path.iterdir()))}"  # a fresh profile per launch
    proc = subprocess.run([str(CHROMIUM), *FLAGS, f"--user-data-dir={profile}", *args], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc


def test_page_loads_without_errors_and_draws_every_plot(page, tmp_path):
    proc = chromium(tmp_path, "--dump-dom", page.as_uri())
    dom = proc.stdout
    console = [line for line in proc.stderr.splitlines() if ":CONSOLE" in line]
    assert not [line for line in console if "Uncaught" in line or "Error" in line], console
    graphs = dom.split('class="plotly-graph-div')[1:]
    assert len(graphs) == 3 and all(g.startswith(' js-plotly-plot"') and 'class="main-svg"' in g for g in graphs)
    assert dom.count('class="gtitle"') == 3
    assert len(re.findall(r'class="trace scatter', dom)) == 9  # 4 lines, twice; the timed step
    assert dom.count('class="trace bars"') == 7  # the op classes of the stacked bars
    resources = re.search(r'data-resources="([^"]*)"', dom)
    assert resources and json.loads(resources.group(1).replace("&quot;", '"')) == []


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def test_screenshot_shows_the_plots(page, tmp_path):
    # The same page without its scripts has the tables but empty plot areas: the plots must add far more than that.
    without_scripts = tmp_path / "without-scripts.html"
    without_scripts.write_text(re.sub(r"<script.*?</script>", "", page.read_text(), flags=re.S))
    drawn, bare = tmp_path / "drawn.png", tmp_path / "bare.png"
    top = "--window-size=1280,2400"  # the notice, the verdict, the throughput table and the first plot
    chromium(tmp_path, top, f"--screenshot={drawn}", page.as_uri())
    chromium(tmp_path, top, f"--screenshot={bare}", without_scripts.as_uri())
    assert png_size(drawn) == png_size(bare) == (1280, 2400)
    assert drawn.stat().st_size > 1.5 * bare.stat().st_size  # measured: 118 KB against 49 KB
