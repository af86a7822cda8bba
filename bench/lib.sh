# Sourced by the bench scripts: helpers they share.

# wait_ready URL: until URL answers 2xx (a server's readiness probe), for at
# most five minutes; a model load on a busy 2-core machine can take a while.
wait_ready() {
  for _ in $(seq 1 600); do
    curl -sf "$1" >/dev/null 2>&1 && return 0
    sleep 0.5
  done
  echo "error: $1 never became ready" >&2; return 1
}
