#!/usr/bin/env bash
# The hub from a terminal, start to finish, in a scratch folder:
#   build the example package -> make a key -> sign it -> publish it as acme/example@v1.0.0 (a tag
#   names the version its manifest says) and as branch main -> `kcpp serve` on loopback -> list
#   versions -> download by constraint (refused until the publisher is trusted) -> lock -> verify
#   through the lock -> offline -> a tampered copy refused.
# Usage: scripts/hub-demo.sh [build-dir]   (default build/release; run scripts/build.sh first)
# CTest runs it as hub.demo.  Every step prints the command it runs.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
build="$(cd "${1:-$root/build/release}" && pwd)"
kcpp="$build/bin/kcpp"
pkg="$build/kernels/example"
[ -x "$kcpp" ] && [ -f "$pkg/manifest.json" ] || { echo "hub-demo: build first (scripts/build.sh)"; exit 2; }

work="$(mktemp -d "${TMPDIR:-/tmp}/kcpp-hub-demo.XXXXXX")"
server_pid=""
cleanup() { [ -n "$server_pid" ] && kill "$server_pid" 2>/dev/null; rm -rf "$work"; }
trap cleanup EXIT
cd "$work"
# Nothing from the user's own configuration leaks in: cache, trust store and lock file are ours.
export KCPP_CACHE="$work/cache" KCPP_TRUST_STORE="$work/trusted_publishers.json" KCPP_LOCK_FILE=""
unset HF_HUB_OFFLINE KCPP_TRUSTED_PUBLISHERS KCPP_ALLOW_ALL_KERNELS USE_HUB_KERNELS HF_TOKEN
step() { printf '\n$ %s\n' "$*"; "$@"; }
fails() {  # the command must fail, and say $1
  local want="$1"; shift
  printf '\n$ %s   # must be refused\n' "$*"
  if out="$("$@" 2>&1)"; then echo "$out"; echo "hub-demo: expected a refusal"; exit 1; fi
  echo "$out"
  grep -q -- "$want" <<<"$out" || { echo "hub-demo: the refusal does not say '$want'"; exit 1; }
}

step "$kcpp" keygen --publisher acme --out keys
mkdir -p hub/acme/example
for v in v1.0.0 main; do cp -r "$pkg" "hub/acme/example/$v"; step "$kcpp" package sign "hub/acme/example/$v" --key keys/acme.key; done

"$kcpp" serve hub --port 0 --quiet > serve.log 2>&1 &
server_pid=$!
for _ in $(seq 100); do grep -q "HF_ENDPOINT=" serve.log && break; sleep 0.1; done
export HF_ENDPOINT="$(grep -o 'http://127.0.0.1:[0-9]*' serve.log | head -1)"
echo; cat serve.log

step "$kcpp" versions acme/example --quiet
fails "a publisher not in the trust store" "$kcpp" download 'acme/example@>=1.0,<2.0' --quiet
step "$kcpp" trust add keys/acme.pub
step "$kcpp" download 'acme/example@>=1.0,<2.0' --quiet
step "$kcpp" show 'acme/example@^1.0:SiLU' --quiet

echo '{"kernel_mapping": {"SiLU": "acme/example@>=1.0,<2.0:SiLU"}}' > kcpp.json
step "$kcpp" lock --quiet
step "$kcpp" verify 'acme/example@>=1.0,<2.0:SiLU' --lock kcpp.lock --quiet
step "$kcpp" verify 'acme/example@>=1.0,<2.0:SiLU' --offline --quiet

# The publisher's v1.0.0 is replaced behind everyone's back (8 bytes overwritten, the size kept: a
# longer file would be cut off at the manifest's size): the lock notices the new commit, and without
# the lock the file's hash no longer matches the signed manifest.
printf 'tampered' | dd of="$(echo hub/acme/example/v1.0.0/build/kcpp1-cpu-*/libexample.so)" bs=1 seek=4096 conv=notrunc status=none
fails "but the hub now has commit" "$kcpp" verify 'acme/example@>=1.0,<2.0:SiLU' --lock kcpp.lock --quiet
fails "but the manifest says" "$kcpp" download 'acme/example@v1.0.0' --quiet --cache "$work/fresh-cache"
echo; echo "hub-demo: every step behaved"
