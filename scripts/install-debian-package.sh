#!/usr/bin/env bash
# Installs a Debian package when its command is missing; used by `make mosquitto` and `make chromium` for the tests
# (the MQTT tests start their own mosquitto on a free loopback port, so no daemon is enabled; the web status test
# loads its page in chromium-headless-shell and skips without it).
# Usage: install-debian-package.sh PACKAGE COMMAND [PATH_IF_NOT_ON_PATH]
set -euo pipefail
package=$1 command=$2 fallback=${3:-}
present() { command -v "$command" >/dev/null 2>&1 || { [ -n "$fallback" ] && [ -x "$fallback" ]; }; }
if present; then
  exit 0
fi
SUDO=""
if [ "$(id -u)" -ne 0 ]; then
  if command -v sudo >/dev/null 2>&1; then SUDO="sudo"; else
    echo "$package is missing and this user cannot install it: run 'apt-get install -y $package' as root" >&2
    exit 1
  fi
fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get install -y -q "$package" >/dev/null 2>&1 || { $SUDO apt-get update -q >/dev/null && $SUDO apt-get install -y -q "$package" >/dev/null; }
present
