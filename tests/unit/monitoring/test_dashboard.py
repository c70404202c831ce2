"""The committed Grafana dashboard is what scripts/grafana/dashboard.py builds with grafanalib (its own small venv,
scripts/venvs.py grafana: pinned, cached, built under a lock), byte for byte, and each panel's queries are sound
PromQL for the series the pods export (the e2e runs them against a real Prometheus)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
DASHBOARD = REPO / "charts" / "pdfleet" / "files" / "grafana-dashboard.json"


def test_regenerating_the_dashboard_gives_the_committed_bytes() -> None:
    venv = subprocess.run([sys.executable, str(REPO / "scripts" / "venvs.py"), "grafana"], capture_output=True,
                          text=True, timeout=600)
    # scripts/test.sh builds it before the tests: a test worker (inside the run's private network) cannot
    # reach the package index, so on an empty cache this fails with pip's name-resolution errors.
    assert venv.returncode == 0, venv.stderr[-3000:]
    python = Path(venv.stdout.strip().splitlines()[-1]) / "bin" / "python"
    out = subprocess.run([str(python), str(REPO / "scripts" / "grafana" / "dashboard.py"), "--out", "-"],
                         capture_output=True, timeout=120)
    assert out.returncode == 0, out.stderr.decode()[-3000:]
    assert out.stdout == DASHBOARD.read_bytes(), "run scripts/grafana/dashboard.py and commit its output"


def test_every_panel_queries_by_the_dashboards_variables() -> None:
    board = json.loads(DASHBOARD.read_text())
    names = {v["name"] for v in board["templating"]["list"]}
    assert names == {"datasource", "namespace", "deployment"}
    panels = [p for p in board["panels"] if p["type"] != "row"]
    assert len(panels) >= 20 and len({p["id"] for p in board["panels"]}) == len(board["panels"])
    for p in panels:
        assert p["targets"], p["title"]
        for t in p["targets"]:
            # fleet series are filtered to the chosen namespace and deployment; the operator's own are global
            assert "$namespace" in t["expr"] or "pdfleet_operator_" in t["expr"], (p["title"], t["expr"])
