#!/usr/bin/env bash
# Builds the ropeattn container image with buildah (no Docker engine needed),
# then smoke-tests it: starts the server from the image exactly as the
# Kubernetes Deployment does (the image's ENTRYPOINT with the args read from
# deploy/k8s/ropeattn-deployment.yaml, its TLS, client-CA and tokens files
# at the manifest's paths, made with the host's openssl for this run), probes
# it with the image's own `ropeattn` CLI (health, a short decode, info over
# mutual TLS; refused without a token or without TLS; /metrics), prints the
# image size and cleans up.
#
#   bash deploy/build-image.sh            # build + test, then remove the image
#   bash deploy/build-image.sh --keep     # build + test, keep ropeattn:latest
#
# Steps:
#  1. installs buildah and debootstrap with apt when missing (quiet, idempotent);
#  2. when debian:bookworm-slim is not in buildah's local storage, creates it:
#     `debootstrap --variant=minbase bookworm` from the Debian mirror this
#     machine's apt sources use, then `buildah from scratch` + copy + commit;
#  3. `buildah bud` of ./Dockerfile as ropeattn:latest (layer cache on, so a
#     re-run only rebuilds what changed);
#  4. runs the image's ENTRYPOINT with the Deployment's args (its ports,
#     50051 and 9464 on this host's network, must be free) and probes it;
#  5. prints the image size; 6. removes its containers (and the image unless
#     --keep). Any failure exits non-zero with a message saying which step.
#
# Environment: IMAGE (default ropeattn:latest), MIRROR (default: read from the
# apt sources), BUILDAH_STORAGE_DRIVER is not read: every buildah command uses
# --storage-driver vfs (no overlay/fuse needed) and bud/run use --isolation
# chroot. Needs root (or sudo) for apt, debootstrap and buildah's root storage.
set -euo pipefail

cd "$(dirname "$0")/.."
IMAGE="${IMAGE:-ropeattn:latest}"
BASE_IMAGE="debian:bookworm-slim"
KEEP=0
for arg in "$@"; do
  case "$arg" in
    --keep) KEEP=1 ;;
    -h|--help) sed -n '2,27p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "build-image: unknown argument '$arg' (try --help)" >&2; exit 64 ;;
  esac
done

SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
bah() { $SUDO buildah --storage-driver vfs "$@"; }

STEP="start"
die() { echo "build-image: FAILED at step '$STEP': $*" >&2; exit 1; }
trap 'rc=$?; [ $rc -ne 0 ] && echo "build-image: FAILED at step \"$STEP\" (exit $rc)" >&2' ERR
now() { date +%s; }
T_START=$(now)
declare -A TIMES=()
timed() { TIMES["$1"]=$(( $(now) - $2 )); }

CONTAINERS=()
SERVER_PID=""
# The ropeattn-server process started by `buildah run` PID $1 (a descendant).
server_process() {
  local queue=("$1") p c
  while [ ${#queue[@]} -gt 0 ]; do
    p="${queue[0]}"; queue=("${queue[@]:1}")
    for c in $(ps -o pid= --ppid "$p" 2>/dev/null); do
      if [ "$(ps -o comm= -p "$c" 2>/dev/null)" = "ropeattn-server" ]; then echo "$c"; return 0; fi
      queue+=("$c")
    done
  done
}
WORKDIR_TMP=""
cleanup() {
  local rc=$?
  set +e
  if [ -n "$SERVER_PID" ] && kill -0 "$SERVER_PID" 2>/dev/null; then
    spid="$(server_process "$SERVER_PID")"
    if [ -n "$spid" ]; then kill -TERM "$spid" 2>/dev/null; else kill -TERM "$SERVER_PID" 2>/dev/null; fi
    for _ in $(seq 1 30); do kill -0 "$SERVER_PID" 2>/dev/null || break; sleep 0.5; done
    kill -KILL "$SERVER_PID" 2>/dev/null
    wait "$SERVER_PID" 2>/dev/null
  fi
  for c in "${CONTAINERS[@]}"; do bah rm "$c" >/dev/null 2>&1; done
  if [ "$KEEP" -eq 0 ] && [ "${BUILT:-0}" -eq 1 ]; then
    bah rmi "$IMAGE" >/dev/null 2>&1 && echo "build-image: removed $IMAGE (pass --keep to keep it)"
  fi
  [ -n "${log:-}" ] && rm -f "$log"
  [ -n "${PKI:-}" ] && rm -rf "$PKI"
  [ -n "$WORKDIR_TMP" ] && $SUDO rm -rf "$WORKDIR_TMP"
  exit $rc
}
trap cleanup EXIT

# ---------------------------------------------------------------- 1. tools
STEP="install buildah and debootstrap"
t=$(now)
missing=()
for p in buildah debootstrap; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "build-image: installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -qq || die "apt-get update failed"
  $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null \
    || die "apt-get install ${missing[*]} failed"
fi
timed tools "$t"

# Debian mirror and security mirror from this machine's apt sources (deb822
# *.sources and one-line *.list), for the suites bookworm / bookworm-security.
apt_uri_for_suite() {
  local suite="$1" f
  for f in /etc/apt/sources.list /etc/apt/sources.list.d/*.list /etc/apt/sources.list.d/*.sources; do
    [ -f "$f" ] || continue
    case "$f" in
      *.sources)
        awk -v suite="$suite" '
          function flush() { if (types ~ /(^| )deb( |$)/ && (" " suites " ") ~ (" " suite " ") && uris != "") { split(uris, u, " "); print u[1]; found=1; exit } types=""; suites=""; uris="" }
          /^[ \t]*#/ { next }
          /^[ \t]*$/ { flush(); next }
          /^Types:/  { sub(/^Types:[ \t]*/, ""); types=$0 }
          /^URIs:/   { sub(/^URIs:[ \t]*/, ""); uris=$0 }
          /^Suites:/ { sub(/^Suites:[ \t]*/, ""); suites=$0 }
          END { if (!found) flush() }' "$f" ;;
      *)
        awk -v suite="$suite" '
          $1 == "deb" { i = 2; if ($2 ~ /^\[/) { while (i <= NF && $i !~ /\]$/) i++; i++ }
                        if ($(i+1) == suite) { print $i; exit } }' "$f" ;;
    esac
  done | head -n 1
}

# ------------------------------------------------------- 2. base image
STEP="create $BASE_IMAGE"
t=$(now)
if bah inspect --type image "$BASE_IMAGE" >/dev/null 2>&1; then
  echo "build-image: $BASE_IMAGE already in local storage"
else
  MIRROR="${MIRROR:-$(apt_uri_for_suite bookworm)}"
  [ -n "$MIRROR" ] || die "no Debian mirror for suite bookworm in /etc/apt/sources.list{,.d/*} (set MIRROR=...)"
  SECURITY_MIRROR="$(apt_uri_for_suite bookworm-security)"
  echo "build-image: creating $BASE_IMAGE with debootstrap from $MIRROR"
  WORKDIR_TMP="$(mktemp -d /var/tmp/ropeattn-image.XXXXXX)"
  rootfs="$WORKDIR_TMP/rootfs"
  $SUDO debootstrap --variant=minbase bookworm "$rootfs" "$MIRROR" > "$WORKDIR_TMP/debootstrap.log" 2>&1 \
    || { tail -n 20 "$WORKDIR_TMP/debootstrap.log" >&2; die "debootstrap failed (log above)"; }
  # Like the official slim image: full apt sources, no docs/man pages/locales
  # installed by later apt-get installs, no caches.
  {
    echo "deb $MIRROR bookworm main"
    echo "deb $MIRROR bookworm-updates main"
    [ -n "$SECURITY_MIRROR" ] && echo "deb $SECURITY_MIRROR bookworm-security main"
  } | $SUDO tee "$rootfs/etc/apt/sources.list" >/dev/null
  $SUDO tee "$rootfs/etc/dpkg/dpkg.cfg.d/docker-slim" >/dev/null <<'EOF'
path-exclude /usr/share/doc/*
path-include /usr/share/doc/*/copyright
path-exclude /usr/share/man/*
path-exclude /usr/share/info/*
path-exclude /usr/share/locale/*
path-exclude /usr/share/lintian/*
EOF
  $SUDO tee "$rootfs/etc/apt/apt.conf.d/docker-clean" >/dev/null <<'EOF'
DPkg::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin || true"; };
APT::Update::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin || true"; };
Dir::Cache::pkgcache "";
Dir::Cache::srcpkgcache "";
EOF
  $SUDO find "$rootfs/usr/share/doc" -mindepth 1 -not -name copyright -not -type d -delete
  $SUDO find "$rootfs/usr/share/doc" -mindepth 1 -type d -empty -delete
  $SUDO rm -rf "$rootfs"/usr/share/man/* "$rootfs"/usr/share/info/* "$rootfs"/usr/share/locale/* \
    "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/cache/apt/*.bin "$rootfs"/var/lib/apt/lists/* \
    "$rootfs"/var/log/*.log "$rootfs"/var/log/apt/* "$rootfs"/tmp/*
  : | $SUDO tee "$rootfs/etc/hostname" "$rootfs/etc/resolv.conf" >/dev/null
  ctr="$(bah from scratch)"; CONTAINERS+=("$ctr")
  mnt="$(bah mount "$ctr")"
  $SUDO tar -C "$rootfs" --numeric-owner -cf - . | $SUDO tar -C "$mnt" --numeric-owner -xpf - \
    || die "copying the rootfs into the scratch container failed"
  bah umount "$ctr" >/dev/null
  bah config --cmd '["bash"]' --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    --os linux --arch amd64 "$ctr"
  bah commit --quiet "$ctr" "$BASE_IMAGE" >/dev/null || die "buildah commit $BASE_IMAGE failed"
  bah rm "$ctr" >/dev/null; CONTAINERS=()
  $SUDO rm -rf "$WORKDIR_TMP"; WORKDIR_TMP=""
fi
timed base "$t"

# ------------------------------------------------------------ 3. build
STEP="buildah bud $IMAGE"
t=$(now)
echo "build-image: building $IMAGE (compiles the project; several minutes on 2 cores)"
# --format docker keeps HEALTHCHECK (the OCI format has no field for it);
# --layers caches each step, so re-runs only redo what changed.
bah bud --isolation chroot --format docker --layers --pull=never -t "$IMAGE" -f Dockerfile . \
  || die "buildah bud failed (output above)"
BUILT=1
timed build "$t"

# ------------------------------------------------------------- 4. smoke test
# The server runs from the image WITH TLS AND A TOKEN, as in Kubernetes: a
# throwaway CA, server certificate and tokens file are made with the host's
# openssl (not in the image) and copied into the containers.
STEP="make a test CA, server certificate and tokens file (openssl)"
t=$(now)
command -v openssl >/dev/null || die "openssl not found on the host (apt-get install openssl)"
PKI="$(mktemp -d /var/tmp/ropeattn-smoke-pki.XXXXXX)"
(
  set -e
  cd "$PKI"
  cat > ext.cnf <<'EXT'
[server]
basicConstraints = critical, CA:FALSE
keyUsage = critical, digitalSignature
extendedKeyUsage = serverAuth
subjectAltName = DNS:localhost, IP:127.0.0.1
authorityKeyIdentifier = keyid
EXT
  # EC P-256 keys, one day of validity: the certificates live as long as
  # this run.
  openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 1 \
    -subj "/CN=ropeattn smoke-test CA" -keyout ca.key -out ca.crt \
    -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign"
  openssl req -new -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes \
    -subj "/CN=localhost" -keyout server.key -out server.csr
  openssl x509 -req -in server.csr -CA ca.crt -CAkey ca.key -set_serial "0x$(openssl rand -hex 8)" \
    -days 1 -extfile ext.cnf -extensions server -out server.crt
  openssl verify -CAfile ca.crt server.crt
  # The Deployment asks callers for a client certificate (Envoy's, in the
  # cluster): the CLI presents this one.
  printf '[client]\nbasicConstraints = critical, CA:FALSE\nkeyUsage = critical, digitalSignature\nextendedKeyUsage = clientAuth\n' > client.cnf
  openssl req -new -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes \
    -subj "/CN=smoke-client" -keyout client.key -out client.csr
  openssl x509 -req -in client.csr -CA ca.crt -CAkey ca.key -set_serial "0x$(openssl rand -hex 8)" \
    -days 1 -extfile client.cnf -extensions client -out client.crt
  # Two principals; the tokens are random per run and never leave $PKI and
  # the throwaway containers.
  printf '# smoke test: TOKEN PRINCIPAL [admin]\n%s smoke-user\n%s smoke-admin admin\n' \
    "$(openssl rand -hex 32)" "$(openssl rand -hex 32)" > tokens
  chmod 0644 ca.crt server.crt client.crt tokens
  chmod 0600 ca.key server.key client.key
) >"$PKI/openssl.log" 2>&1 || { cat "$PKI/openssl.log" >&2; die "openssl failed (log above)"; }
TOKEN="$(awk '$2 == "smoke-user" {print $1}' "$PKI/tokens")"
[ -n "$TOKEN" ] || die "no token in the generated tokens file"
openssl x509 -in "$PKI/server.crt" -noout -ext subjectAltName 2>/dev/null | grep -q 'IP Address:127.0.0.1' \
  || die "server certificate lacks the IP SAN 127.0.0.1"

STEP="start $IMAGE as the Deployment does"
[ "$(bah inspect --type image --format '{{.Docker.Config.User}}' "$IMAGE")" = "10001:10001" ] \
  || die "image user is not 10001:10001"
bah inspect --type image --format '{{.Docker.Config.Healthcheck}}' "$IMAGE" | grep -q "ropeattn health" \
  || die "image has no HEALTHCHECK running ropeattn health"
# Kubernetes runs the image's ENTRYPOINT with the container's args (the
# Deployment sets no command).
entrypoint="$(bah inspect --type image --format '{{range .Docker.Config.Entrypoint}}{{.}} {{end}}' "$IMAGE")"
read -r -a ENTRYPOINT <<<"$entrypoint"
[ "${ENTRYPOINT[*]:-}" = "ropeattn-server" ] || die "image ENTRYPOINT is '${entrypoint}', want ropeattn-server"
MANIFEST=deploy/k8s/ropeattn-deployment.yaml
grep -qE '^[[:space:]]+command:' <(awk '/^      containers:/,/^          ports:/' "$MANIFEST") \
  && die "the ropeattn container in $MANIFEST sets command (it would replace the ENTRYPOINT)"
# The ropeattn container's args: the list items between `args:` and the
# next key at the container's indentation, comments skipped.
mapfile -t ARGS < <(awk '
  /^          args:/ { on = 1; next }
  on && /^          [a-zA-Z]/ { on = 0 }
  on && /^ *- / { sub(/^ *- /, ""); print }' "$MANIFEST")
[ "${#ARGS[@]}" -gt 0 ] || die "no args found for the ropeattn container in $MANIFEST"
arg_value() { local a; for a in "${ARGS[@]}"; do case "$a" in --"$1"=*) echo "${a#*=}"; return 0;; esac; done; return 1; }
port="$(arg_value address | sed 's/.*://')"
mport="$(arg_value metrics_address | sed 's/.*://')"
for p in "$port" "$mport"; do
  if ss -Hltn "sport = :$p" 2>/dev/null | grep -q .; then
    die "port $p (from the Deployment's args) is in use on this host; the smoke test shares its network"
  fi
done
srv="$(bah from --pull=never "$IMAGE")"; CONTAINERS+=("$srv")
cli="$(bah from --pull=never "$IMAGE")"; CONTAINERS+=("$cli")
# Files where the manifest's volumes mount them (readable by uid 10001).
for pair in tls_cert_file:server.crt tls_key_file:server.key tls_client_ca_file:ca.crt \
            auth_tokens_file:tokens; do
  path="$(arg_value "${pair%%:*}")" || die "the Deployment's args lack --${pair%%:*}"
  bah run --isolation chroot --user 0:0 "$srv" -- mkdir -p "$(dirname "$path")" >/dev/null \
    || die "cannot create $(dirname "$path") in the server's container"
  bah copy --chown 10001:10001 --chmod 0400 "$srv" "$PKI/${pair#*:}" "$path" >/dev/null \
    || die "copying ${pair#*:} to $path in the server's container failed"
done
# The CLI's container: the CA and the client certificate.
bah copy --chmod 0444 "$cli" "$PKI/ca.crt" "$PKI/client.crt" /tmp/tls/ >/dev/null \
  || die "copying the CA and client certificate into the CLI's container failed"
bah copy --chown 10001:10001 --chmod 0400 "$cli" "$PKI/client.key" /tmp/tls/ >/dev/null \
  || die "copying the client key into the CLI's container failed"
log="$(mktemp /var/tmp/ropeattn-server.XXXXXX.log)"
echo "build-image: running ${ENTRYPOINT[*]} ${ARGS[*]}"
bah run --isolation chroot "$srv" -- "${ENTRYPOINT[@]}" "${ARGS[@]}" >"$log" 2>&1 &
SERVER_PID=$!
line=""
for _ in $(seq 1 120); do
  line="$(grep -m1 '"event":"listening"' "$log" || true)"
  [ -n "$line" ] && break
  kill -0 "$SERVER_PID" 2>/dev/null || { cat "$log" >&2; die "ropeattn-server exited at start"; }
  sleep 0.5
done
[ -n "$line" ] || { cat "$log" >&2; die "ropeattn-server did not report listening within 60 s"; }
echo "build-image: $line"
target="127.0.0.1:$port"
# The image's CLI over mutual TLS, verifying the server against the test CA.
ropeattn_tls() {
  bah run --isolation chroot "$cli" -- ropeattn "$1" --target "$target" --tls_ca_file /tmp/tls/ca.crt \
    --tls_cert_file /tmp/tls/client.crt --tls_key_file /tmp/tls/client.key "${@:2}"
}

STEP="probe the server with the image's ropeattn CLI (TLS + token)"
ok=0
for _ in $(seq 1 30); do
  # Health needs no token (probes and load balancers carry none).
  if ropeattn_tls health --deadline_seconds 3 >/dev/null 2>&1; then ok=1; break; fi
  sleep 1
done
[ "$ok" -eq 1 ] || { cat "$log" >&2; ropeattn_tls health --deadline_seconds 3 >&2 || true; die "ropeattn health over TLS never reported SERVING"; }
echo "build-image: ropeattn health (TLS, no token) -> $(ropeattn_tls health)"
uid="$(bah run --isolation chroot "$cli" -- id -u)"
[ "$uid" = "10001" ] || die "container runs as uid $uid, expected 10001"
echo "build-image: ropeattn decode (TLS + token, short session):"
ropeattn_tls decode --token "$TOKEN" \
  --heads 8 --kv_heads 2 --head_dim 64 --context 64 --steps 8 | sed 's/^/    /' \
  || die "ropeattn decode with TLS and a token failed"
# The token from the environment, as the CLI's help recommends.
info="$(bah run --isolation chroot --env "ROPEATTN_TOKEN=$TOKEN" "$cli" -- \
          ropeattn info --target "$target" --tls_ca_file /tmp/tls/ca.crt \
            --tls_cert_file /tmp/tls/client.crt --tls_key_file /tmp/tls/client.key)" \
  || die "ropeattn info with TLS and \$ROPEATTN_TOKEN failed"
echo "build-image: ropeattn info (TLS + \$ROPEATTN_TOKEN) -> $(head -n 1 <<<"$info")"

STEP="check that calls without a valid token, or without TLS, are refused"
# The CLI exits with the gRPC status code: 16 = UNAUTHENTICATED.
rc=0; out="$(ropeattn_tls info 2>&1)" || rc=$?
[ "$rc" -eq 16 ] || die "ropeattn info without a token exited $rc, want 16 (UNAUTHENTICATED): $out"
echo "build-image: ropeattn info without a token -> exit $rc: $(grep -m1 '^ropeattn info:' <<<"$out")"
rc=0; out="$(ropeattn_tls info --token "not-$TOKEN" 2>&1)" || rc=$?
[ "$rc" -eq 16 ] || die "ropeattn info with an unknown token exited $rc, want 16 (UNAUTHENTICATED): $out"
echo "build-image: ropeattn info with an unknown token -> exit $rc"
rc=0; out="$(ropeattn_tls decode --heads 8 --kv_heads 2 --head_dim 64 --context 64 --steps 2 2>&1)" || rc=$?
[ "$rc" -eq 16 ] || die "ropeattn decode without a token exited $rc, want 16 (UNAUTHENTICATED): $out"
echo "build-image: ropeattn decode without a token -> exit $rc"
# Plaintext to the TLS port: the handshake fails, nothing is served.
rc=0; out="$(bah run --isolation chroot "$cli" -- ropeattn health --target "$target" --deadline_seconds 3 2>&1)" || rc=$?
[ "$rc" -ne 0 ] || die "a plaintext health check of the TLS port succeeded"
echo "build-image: ropeattn health in plaintext -> exit $rc (refused)"
if [ -n "$mport" ]; then
  exec 3<>"/dev/tcp/127.0.0.1/$mport" || die "cannot connect to /metrics on port $mport"
  printf 'GET /metrics HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n' >&3
  metrics="$(cat <&3)"; exec 3<&-
  grep -q '^ropeattn_' <<<"$metrics" || die "GET /metrics returned no ropeattn_ series"
  grep -qF "$TOKEN" <<<"$metrics" && die "GET /metrics shows a token"
  echo "build-image: GET /metrics -> $(grep -c '^ropeattn_' <<<"$metrics") ropeattn_ samples (no token)"
fi
grep -qF "$TOKEN" "$log" && die "the server log shows a token"
STEP="stop the server"
# `buildah run` does not forward signals (it SIGKILLs its child), so send
# SIGTERM to the server process itself (chroot isolation shares the host PID
# namespace) to exercise the graceful drain the image relies on.
spid="$(server_process "$SERVER_PID")"
[ -n "$spid" ] || die "cannot find the ropeattn-server process under buildah run (pid $SERVER_PID)"
kill -TERM "$spid"
for _ in $(seq 1 40); do kill -0 "$SERVER_PID" 2>/dev/null || break; sleep 0.5; done
if kill -0 "$SERVER_PID" 2>/dev/null; then die "server did not stop within 20 s of SIGTERM"; fi
wait "$SERVER_PID" || die "server exited non-zero after SIGTERM: $(tail -n 3 "$log")"
SERVER_PID=""
grep -q '"event":"stopped"' "$log" || die "server log has no clean 'stopped' line: $(tail -n 3 "$log")"
echo "build-image: SIGTERM -> $(tail -n 1 "$log")"
rm -f "$log"
timed smoke "$t"

# ------------------------------------------------------------- 5. report
STEP="report"
echo "build-image: image $(bah images --format '{{.Name}}:{{.Tag}} {{.ID}} {{.Size}}' "$IMAGE")"
echo "build-image: timings (s): tools ${TIMES[tools]}, base image ${TIMES[base]}, build ${TIMES[build]}, smoke test ${TIMES[smoke]}, total $(( $(now) - T_START ))"
echo "build-image: OK"
