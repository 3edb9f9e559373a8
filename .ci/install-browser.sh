#!/usr/bin/env bash
# Debian's Chromium for tests/test_rdu_browser.py (Playwright drives it; never `playwright install`).
# Idempotent and quiet: does nothing when /usr/bin/chromium exists.
set -euo pipefail
[ -x /usr/bin/chromium ] && exit 0
SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO="sudo"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq >/dev/null
$SUDO apt-get install -y -qq --no-install-recommends chromium >/dev/null
[ -x /usr/bin/chromium ] || { echo "install-browser.sh: chromium did not install" >&2; exit 1; }
