#!/usr/bin/env bash
# Installs prometheus and promtool from Debian's `prometheus` package into .cache/tools/bin:
# the package is downloaded and unpacked (no service is installed or started). The chart tests
# run `promtool test rules` on the chart's alerts; the dashboard check runs a real Prometheus.
# Idempotent: binaries already there are left alone.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
BIN="$PWD/.cache/tools/bin"

if [ -x "$BIN/prometheus" ] && [ -x "$BIN/promtool" ]; then
  echo "prometheus and promtool already in $BIN"
else
  for tool in apt-get dpkg-deb; do
    command -v "$tool" >/dev/null || { echo "install-prometheus: $tool is needed (a Debian system)" >&2; exit 1; }
  done
  work="$(mktemp -d)"
  trap 'rm -rf "$work"' EXIT
  chmod 755 "$work"  # apt's download sandbox user writes here
  # A fresh machine may have no package lists yet.
  (cd "$work" && apt-get download -q prometheus) || { apt-get update -q && (cd "$work" && apt-get download -q prometheus); }
  dpkg-deb -x "$work"/prometheus_*.deb "$work/unpacked"
  mkdir -p "$BIN"
  install -m 755 "$work/unpacked/usr/bin/prometheus" "$work/unpacked/usr/bin/promtool" "$BIN/"
fi
"$BIN/promtool" --version | head -1
