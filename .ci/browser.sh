#!/bin/sh
# Install Debian's Chromium and its chromedriver for the web view's browser tests (tests/ui).
# Idempotent: does nothing when both are present. Needs root (CI runs as root); otherwise it
# only says what is missing and exits 0, and the browser tests skip with that reason.
set -eu
if [ -x /usr/bin/chromium ] && [ -x /usr/bin/chromedriver ]; then
    exit 0
fi
if [ "$(id -u)" != "0" ]; then
    echo "browser.sh: chromium/chromedriver missing and not root; run: sudo sh .ci/browser.sh" >&2
    exit 0
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq chromium chromium-driver
/usr/bin/chromium --version
