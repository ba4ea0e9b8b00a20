#!/bin/sh
# Install Debian packages that `make test` and `make test-slurm` need and PyPI cannot give
# (bubblewrap; slurm-wlm and munge), as root only, once per host.
#
#   tools/apt_install.sh WHAT "COMMAND..." PACKAGE...
#
# Does nothing when every COMMAND is on PATH. Otherwise, as root with apt-get, installs the
# PACKAGEs; elsewhere says how and exits 1. Two `make test` runs that start at once on a fresh
# host would each run apt-get, and the second would fail at once on dpkg's lock (and
# `apt-get update` on the lists' lock, which no apt option waits for). So every caller takes
# one host-wide lock first (flock, bounded), checks again under it (the other may have
# installed them), and tells apt to wait for dpkg's lock should anything else hold it.
set -u
what=$1; commands=$2; shift 2
have() { for c in $commands; do command -v "$c" >/dev/null 2>&1 || return 1; done; }
have && exit 0
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
  echo "make: $what needs $*: apt-get install $* (as root)" >&2; exit 1
fi
wait_s=${TANDEM_APT_WAIT:-600}
lock=${TANDEM_APT_LOCK:-/var/lock/tandem-apt.lock}
apt="apt-get -o DPkg::Lock::Timeout=$wait_s -y -q"
flock -w "$wait_s" "$lock" sh -c '
  have() { for c in $1; do command -v "$c" >/dev/null 2>&1 || return 1; done; }
  have "$1" && exit 0
  apt=$2; shift 2
  $apt install "$@" >/dev/null 2>&1 || { $apt update >/dev/null && $apt install "$@" >/dev/null; }
' sh "$commands" "$apt" "$@" && have && exit 0
echo "make: $what needs $*, and apt-get could not install them (waited up to ${wait_s}s for the lock $lock)" >&2
exit 1
