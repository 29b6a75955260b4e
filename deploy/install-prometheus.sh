#!/usr/bin/env bash
# Install the Prometheus server that tests/integration/test_prometheus.py runs against.
# Idempotent: does nothing when `prometheus` is already on PATH. Uses Debian's package (apt), so it
# needs root or sudo; the package's service is not started (the test runs its own server on
# loopback with a temporary data directory).
set -euo pipefail

if command -v prometheus >/dev/null 2>&1; then
    exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
    echo "install-prometheus: no apt-get; install Prometheus >= 2.x and put it on PATH" >&2
    exit 1
fi
SUDO=""
if [ "$(id -u)" -ne 0 ]; then
    SUDO="sudo"
fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
# policy-rc.d exit code 101 tells invoke-rc.d not to start the packaged service: a daemon on
# 0.0.0.0:9090 is not wanted on a CI or developer machine.
POLICY=/usr/sbin/policy-rc.d
CREATED_POLICY=0
if [ ! -e "$POLICY" ]; then
    printf '#!/bin/sh\nexit 101\n' | $SUDO tee "$POLICY" >/dev/null
    $SUDO chmod +x "$POLICY"
    CREATED_POLICY=1
fi
status=0
$SUDO apt-get install -y -qq --no-install-recommends prometheus >/dev/null || status=$?
if [ "$CREATED_POLICY" -eq 1 ]; then
    $SUDO rm -f "$POLICY"
fi
exit "$status"
