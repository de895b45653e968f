"""Alert rules fire and stay quiet as intended (promtool unit tests), and the dashboard file is
what deploy/tools/dashboard.py generates."""

from __future__ import annotations

import subprocess
import sys

from tests.deploy.conftest import ROOT


def test_every_alert_has_a_firing_and_a_quiet_promtool_case() -> None:
    import yaml

    rules = yaml.safe_load((ROOT / "deploy" / "prometheus" / "rules.yaml").read_text())
    alerts = {r["alert"] for g in rules["groups"] for r in g["rules"] if "alert" in r}
    cases = yaml.safe_load((ROOT / "deploy" / "prometheus" / "rules_test.yaml").read_text())
    fired: set[str] = set()
    quiet: set[str] = set()
    for test in cases["tests"]:
        for check in test["alert_rule_test"]:
            (fired if check["exp_alerts"] else quiet).add(check["alertname"])
    assert alerts == fired
    # WorkerDown's quiet cases are the workers that recover, in the same test.
    assert alerts - {"DFlashGatewayWorkerDown"} <= quiet


def test_promtool_rule_tests_pass(promtool: str) -> None:
    done = subprocess.run(
        [promtool, "test", "rules", str(ROOT / "deploy" / "prometheus" / "rules_test.yaml")],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_dashboard_files_are_generated_from_the_builder() -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "deploy" / "tools" / "dashboard.py"), "--check"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
