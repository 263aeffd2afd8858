#!/usr/bin/env bash
# Installs headless Chromium (Debian package chromium-headless-shell) when it is missing: the test of `fedge status
# --web` loads the page in it (and skips without it). Only a test tool: fedge itself never needs a browser.
set -euo pipefail
if command -v chromium-headless-shell >/dev/null 2>&1; then
  exit 0
fi
SUDO=""
if [ "$(id -u)" -ne 0 ]; then
  if command -v sudo >/dev/null 2>&1; then SUDO="sudo"; else
    echo "chromium-headless-shell is missing and this user cannot install it: run 'apt-get install -y chromium-headless-shell' as root" >&2
    exit 1
  fi
fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get install -y -q chromium-headless-shell >/dev/null 2>&1 || { $SUDO apt-get update -q >/dev/null && $SUDO apt-get install -y -q chromium-headless-shell >/dev/null; }
command -v chromium-headless-shell >/dev/null 2>&1
