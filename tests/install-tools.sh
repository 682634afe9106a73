#!/usr/bin/env bash
# The Debian tools some test tiers drive, installed where this machine can (root, or
# passwordless sudo, and apt-get): Chromium for tests/browser, kubectl, systemd-analyze and
# strace for tests/deploy, etcd for tests/scaleout. Only what is missing is installed; where
# nothing can be installed those tiers skip and say why. `make test` and .ci/run both run it.
set -uo pipefail

missing=""
need() { command -v "$1" >/dev/null 2>&1 || missing="$missing $2"; }
need chromium chromium
need kubectl kubernetes-client
need systemd-analyze systemd
need strace strace
need etcd etcd-server
[ -z "$missing" ] && exit 0

if ! command -v apt-get >/dev/null 2>&1; then
    echo "==> no apt-get: the tests that need$missing will skip" >&2
    exit 0
fi
as_root=""
if [ "$(id -u)" != 0 ]; then
    if sudo -n true 2>/dev/null; then
        as_root="sudo -n"
    else
        echo "==> not root and no passwordless sudo: the tests that need$missing will skip" >&2
        exit 0
    fi
fi
log=/tmp/pdproxy-test-tools.log
echo "==> installing$missing for the browser, deploy and etcd test tiers (log: $log)"
# shellcheck disable=SC2086  # one word per package
{ $as_root apt-get update -q \
    && $as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -q $missing; } \
    >"$log" 2>&1 \
    || echo "could not install$missing (see $log): the tests that need them will skip" >&2
exit 0
