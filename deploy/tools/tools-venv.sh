#!/usr/bin/env bash
# Create or update .tools/deploy-venv with deploy/tools/requirements.txt (checkov,
# kubernetes-validate, jsonschema). Idempotent: reinstalls only when requirements.txt changes.
# Prints the venv's bin directory on stdout; pip's output goes to stderr.
set -euo pipefail

root="$(cd "$(dirname "$0")/../.." && pwd)"
tools="${DFLASH_TOOLS_DIR:-$root/.tools}"
venv="$tools/deploy-venv"
req="$root/deploy/tools/requirements.txt"
stamp="$venv/.requirements.sha256"
want="$(sha256sum "$req" | cut -d' ' -f1)"

if [[ -x "$venv/bin/checkov" && -f "$stamp" && "$(cat "$stamp")" == "$want" ]]; then
  echo "$venv/bin"
  exit 0
fi

python="${PYTHON:-python3}"
echo "tools-venv.sh: installing deploy tools into $venv (first run: about a minute) ..." >&2
mkdir -p "$tools"
"$python" -m venv "$venv"
"$venv/bin/pip" install --quiet --disable-pip-version-check -r "$req" >&2
echo "$want" > "$stamp"
echo "$venv/bin"
