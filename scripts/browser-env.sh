#!/usr/bin/env bash
# Makes sure the headless browser of the status-page test is present: Debian's Chromium at
# /usr/bin/chromium (Playwright drives it; its own browser downloads are never used).
# Idempotent and quiet: nothing happens when the browser is there; otherwise one apt-get
# install (as root, or through sudo), waiting for a dpkg lock another install may hold.
# Prints the wall time of an install it made.
set -euo pipefail
browser=${AGENTIC_LORA_CHROMIUM:-/usr/bin/chromium}
[[ -x $browser ]] && exit 0
sudo=()
((EUID == 0)) || sudo=(sudo -n)
SECONDS=0
export DEBIAN_FRONTEND=noninteractive
apt=("${sudo[@]}" apt-get -qq -o DPkg::Lock::Timeout=300)
# A fresh machine's package lists may be empty or stale: refresh them once when the package
# cannot be installed from what is there.
if ! "${apt[@]}" install -y --no-install-recommends chromium >/dev/null 2>&1; then
  "${apt[@]}" update >/dev/null
  "${apt[@]}" install -y --no-install-recommends chromium >/dev/null
fi
[[ -x $browser ]] || { echo "browser-env: $browser missing after installing chromium" >&2; exit 1; }
echo "browser-env: chromium installed in ${SECONDS} s"
