"""Validate custom resources in rendered manifests against deploy/k8s/crd-schemas/.

kubernetes-validate knows only built-in kinds; this checks the Prometheus Operator objects the chart
renders (ServiceMonitor, PrometheusRule) against strict schemas of the fields the chart uses.
Run with the deploy tools venv (needs jsonschema and PyYAML):

    .tools/deploy-venv/bin/python deploy/tools/validate_crds.py rendered.yaml [...]

Exit status 1 when a custom resource is invalid or has no schema; prints one line per object.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import jsonschema
import yaml

SCHEMAS = Path(__file__).resolve().parents[1] / "k8s" / "crd-schemas"
BUILTIN_GROUPS = {
    "",
    "apps",
    "batch",
    "policy",
    "autoscaling",
    "networking.k8s.io",
    "rbac.authorization.k8s.io",
    "discovery.k8s.io",
}


def main(paths: list[str]) -> int:
    schemas = {
        p.name.split(".")[0]: json.loads(p.read_text()) for p in SCHEMAS.glob("*.schema.json")
    }
    failed = 0
    for path in paths:
        for doc in yaml.safe_load_all(Path(path).read_text()):
            if not doc:
                continue
            group = doc.get("apiVersion", "").rpartition("/")[0]
            if group in BUILTIN_GROUPS:
                continue
            kind = doc.get("kind", "")
            name = f"{path}: {kind}/{doc.get('metadata', {}).get('name')}"
            schema = schemas.get(kind.lower())
            if schema is None:
                print(f"FAIL {name}: no schema in {SCHEMAS}")
                failed += 1
                continue
            errors = sorted(jsonschema.Draft7Validator(schema).iter_errors(doc), key=str)
            for error in errors:
                where = "/".join(str(p) for p in error.absolute_path)
                print(f"FAIL {name}: {where}: {error.message}")
            failed += bool(errors)
            if not errors:
                print(f"OK   {name}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
