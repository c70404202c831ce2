"""The alerting rules under Prometheus' own tools (Debian's prometheus 2.42, scripts/setup.sh installs it):
`promtool check rules` and `promtool test rules` over series shaped like the pods' scrapes (rules_test.yaml:
each alert fires on its fault with its labels and annotations, and stays quiet on a healthy fleet)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

HERE = Path(__file__).resolve().parent
RULES = HERE.parents[2] / "charts" / "pdfleet" / "files" / "prometheus-rules.yaml"


def _promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.skip("promtool is not installed (Debian's prometheus package: scripts/setup.sh installs it)")
    return path


def test_the_rules_file_is_valid() -> None:
    out = subprocess.run([_promtool(), "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


def test_every_alert_fires_on_its_fault_and_none_on_a_healthy_fleet() -> None:
    out = subprocess.run([_promtool(), "test", "rules", "rules_test.yaml"], capture_output=True, text=True,
                         timeout=120, cwd=HERE)
    assert out.returncode == 0 and "SUCCESS" in out.stdout, out.stdout + out.stderr


def test_every_alert_has_a_firing_case() -> None:
    alerts = {r["alert"] for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"] if "alert" in r}
    cases = yaml.safe_load((HERE / "rules_test.yaml").read_text())["tests"]
    fired = {t["alertname"] for c in cases for t in c.get("alert_rule_test", ()) if t.get("exp_alerts")}
    assert alerts == fired, (alerts - fired, fired - alerts)
