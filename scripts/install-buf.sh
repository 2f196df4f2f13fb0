#!/usr/bin/env bash
# Install buf (the protobuf linter used by tests/integration/test_protos.py) from the npm
# package @bufbuild/buf into .cache/tools. Idempotent: does nothing when the pinned version is
# already there. Needs node/npm and access to the npm registry.
#
#   scripts/install-buf.sh            # then: .cache/tools/node_modules/.bin/buf lint
set -euo pipefail

BUF_VERSION="${BUF_VERSION:-1.75.0}"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PREFIX="$ROOT/.cache/tools"
BUF="$PREFIX/node_modules/.bin/buf"

if [[ -x "$BUF" ]] && [[ "$("$BUF" --version 2>/dev/null)" == "$BUF_VERSION" ]]; then
  echo "buf $BUF_VERSION already installed at $BUF"
  exit 0
fi

command -v npm >/dev/null || { echo "install-buf.sh: npm not found (install Node.js)" >&2; exit 1; }
mkdir -p "$PREFIX"
# --save-exact pins buf in .cache/tools/package.json, so other tools installed into the same
# prefix later do not prune it. The binary comes from the platform package
# (@bufbuild/buf-linux-x64 etc.), so no install script has to run.
npm install --prefix "$PREFIX" --save-exact --no-audit --no-fund "@bufbuild/buf@$BUF_VERSION" >&2

installed="$("$BUF" --version)"
if [[ "$installed" != "$BUF_VERSION" ]]; then
  echo "install-buf.sh: expected buf $BUF_VERSION, got $installed" >&2
  exit 1
fi
echo "buf $installed installed at $BUF"
