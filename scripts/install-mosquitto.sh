#!/usr/bin/env bash
# Installs the mosquitto broker (Debian package) when it is missing; the MQTT integration tests start their own
# instance on a free loopback port, so no daemon is enabled.
set -euo pipefail
if command -v mosquitto >/dev/null 2>&1 || [ -x /usr/sbin/mosquitto ]; then
  exit 0
fi
SUDO=""
if [ "$(id -u)" -ne 0 ]; then
  if command -v sudo >/dev/null 2>&1; then SUDO="sudo"; else
    echo "mosquitto is missing and this user cannot install it: run 'apt-get install -y mosquitto' as root" >&2
    exit 1
  fi
fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get install -y -q mosquitto >/dev/null 2>&1 || { $SUDO apt-get update -q >/dev/null && $SUDO apt-get install -y -q mosquitto >/dev/null; }
command -v mosquitto >/dev/null 2>&1 || [ -x /usr/sbin/mosquitto ]
