#!/usr/bin/env bash
# A local Kubernetes control plane on loopback: etcd + kube-apiserver, both built from their
# Go modules by scripts/install-test-deps-kube.sh. The test harness starts its clusters with
# this same script.
#
#   scripts/local-cluster.sh up [DIR] [--node [--agent [--kustomize]]] [--watch-pid PID]
#   scripts/local-cluster.sh down [DIR]
#   scripts/local-cluster.sh env [DIR]      # prints the cluster's settings (shell syntax)
#   scripts/local-cluster.sh restart-plugin DIR [--plugin-config FILE] [--no-wait]  # --node only (starts a stopped one)
#   scripts/local-cluster.sh stop-plugin DIR      # --node only
#   scripts/local-cluster.sh restart-kubelet DIR  # --node only
#   scripts/local-cluster.sh install-agent DIR [--kustomize]   # --node only: what --agent does, later
#
# --node (root only) adds a real node: kube-controller-manager, kube-scheduler, a private
# containerd, a kubelet and NVIDIA's device plugin on the fake NVML (scripts/local-node.sh).
# --agent (with --node) then deploys the agent as users do: the image (scripts/build-image.sh,
# or TAINTGATE_IMAGE_ARCHIVE) pushed to a loopback registry, the chart installed with
# scripts/local-agent-values.yaml (--kustomize: `kubectl apply -k` of the base with
# scripts/local-agent-overlay/); `up` returns once the agent's Pod released the node.
#
# DIR defaults to ${TMPDIR:-/tmp}/taintgate-cluster. `up` generates a CA, serving and admin
# client certificates and the service-account signing key with openssl, starts etcd and
# kube-apiserver on free loopback ports (or ETCD_PORT / APISERVER_PORT), TLS everywhere a
# client talks to the API, --authorization-mode=Node,RBAC, NodeRestriction on, waits for
# /readyz and prints the admin kubeconfig's path. With --watch-pid, the cluster is taken
# down when that process exits (the test harness passes its own pid, so a test run never
# leaves a control plane behind). `down` stops exactly what `up` started and removes DIR.
#
# Deliberate differences from a production control plane (the docs' testing page says so):
#   - no controller-manager or scheduler runs (except with --node); the
#     TaintNodesByCondition admission plugin is off (on with --node), because without the
#     node lifecycle controller nothing would ever remove the not-ready taint it adds to
#     every new Node;
#   - the nodes watch cache is off (--watch-cache-sizes=nodes#0), so a watch resumed from a
#     compacted revision gets etcd's real 410 Gone; periodic compaction is off, tests compact;
#   - etcd runs with --unsafe-no-fsync (test data only).
# Extra kube-apiserver flags: TAINTGATE_APISERVER_ARGS (space-separated).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=tools/go/lib.sh
. "$ROOT/tools/go/lib.sh"
# shellcheck source=scripts/local-node.sh
. "$ROOT/scripts/local-node.sh"

die() { echo "local-cluster: $*" >&2; exit 1; }

usage() {
    sed -n '2,20p' "$0" | sed 's/^# \{0,1\}//' >&2
    exit 2
}

cmd=${1:-}
[ -n "$cmd" ] || usage
shift
DIR=""
WATCH_PID=""
NODE_MODE=0
AGENT_MODE=0
AGENT_VIA=helm
PLUGIN_CONFIG=""
NO_WAIT=0
while [ $# -gt 0 ]; do
    case "$1" in
        --watch-pid) WATCH_PID=${2:?--watch-pid needs a pid}; shift 2 ;;
        --node) NODE_MODE=1; shift ;;
        --agent) AGENT_MODE=1; shift ;;
        --kustomize) AGENT_VIA=kustomize; shift ;;
        --plugin-config) PLUGIN_CONFIG=${2:?--plugin-config needs a file}; shift 2 ;;
        --no-wait) NO_WAIT=1; shift ;;
        -h|--help) usage ;;
        -*) die "unknown option $1" ;;
        *) [ -z "$DIR" ] || die "more than one DIR given"; DIR=$1; shift ;;
    esac
done
DIR=${DIR:-${TMPDIR:-/tmp}/taintgate-cluster}
[ "$AGENT_MODE" = 0 ] || [ "$NODE_MODE" = 1 ] || die "--agent needs --node (the agent's Pod runs on that node)"
STATE="$DIR/cluster.env"

pid_alive() { [ -n "${1:-}" ] && kill -0 "$1" 2>/dev/null; }

# port_in_use PORT [ADDRESS]: true when PORT cannot be bound on ADDRESS (default loopback).
port_in_use() {
    python3 - "$1" "${2:-127.0.0.1}" <<'PY'
import socket, sys
s = socket.socket()
try:
    s.bind((sys.argv[2], int(sys.argv[1])))
except OSError:
    sys.exit(0)
sys.exit(1)
PY
}

# reserve_port VAR: a free loopback port into $VAR, reserved the way the test harness
# reserves its ports (tests/src/services/mod.rs, free_port): an exclusive flock on
# ${TMPDIR:-/tmp}/taintgate-ports/<port>.lock. The lock's file stays open in this script,
# and the servers it starts inherit it, so the port stays reserved until they are gone;
# another reserver (a test thread, a test process, a second cluster) meets the lock and
# picks another port. Not in a $(...) subshell: the lock would close with it.
reserve_port() {
    local dir=${TMPDIR:-/tmp}/taintgate-ports p fd i
    mkdir -p "$dir"
    for i in $(seq 1 64); do
        p=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
        exec {fd}>>"$dir/$p.lock"
        if flock -n "$fd"; then
            printf -v "$1" '%s' "$p"
            return 0
        fi
        exec {fd}>&-
    done
    die "no unreserved loopback port after 64 tries ($dir)"
}

# Stop the processes named in $STATE: TERM, up to 10 s, then KILL.
stop_recorded() {
    # shellcheck disable=SC1090
    . "$STATE"
    local p
    # The node first: its kubelet and controllers talk to the API server.
    if [ "${NODE_MODE:-0}" = 1 ]; then
        node_stop
    fi
    # The watchdog runs `down` itself (it execs this script): it must not stop itself
    # before DIR is removed.
    [ "${WATCHDOG_PID:-}" = "$$" ] && WATCHDOG_PID=""
    for p in ${APISERVER_PID:-} ${ETCD_PID:-} ${WATCHDOG_PID:-}; do
        pid_alive "$p" && kill -TERM "$p" 2>/dev/null || true
    done
    for _ in $(seq 1 100); do
        local alive=0
        for p in ${APISERVER_PID:-} ${ETCD_PID:-}; do pid_alive "$p" && alive=1; done
        [ "$alive" = 0 ] && break
        sleep 0.1
    done
    for p in ${APISERVER_PID:-} ${ETCD_PID:-} ${WATCHDOG_PID:-}; do
        pid_alive "$p" && kill -KILL "$p" 2>/dev/null || true
    done
}

gen_certs() {
    local d="$DIR/pki"
    mkdir -p "$d"
    (
        cd "$d"
        openssl req -x509 -newkey rsa:2048 -nodes -keyout ca.key -out ca.crt -days 30 \
            -subj "/CN=taintgate-test-ca" >/dev/null 2>&1
        cat > server.ext <<EXT
subjectAltName = IP:127.0.0.1, IP:10.96.0.1, DNS:localhost, DNS:kubernetes, DNS:kubernetes.default, DNS:kubernetes.default.svc, DNS:kubernetes.default.svc.cluster.local
extendedKeyUsage = serverAuth
EXT
        openssl req -newkey rsa:2048 -nodes -keyout server.key -out server.csr \
            -subj "/CN=kube-apiserver" >/dev/null 2>&1
        openssl x509 -req -in server.csr -CA ca.crt -CAkey ca.key -CAcreateserial \
            -out server.crt -days 30 -extfile server.ext >/dev/null 2>&1
        echo "extendedKeyUsage = clientAuth" > client.ext
        openssl req -newkey rsa:2048 -nodes -keyout admin.key -out admin.csr \
            -subj "/O=system:masters/CN=taintgate-admin" >/dev/null 2>&1
        openssl x509 -req -in admin.csr -CA ca.crt -CAkey ca.key -CAcreateserial \
            -out admin.crt -days 30 -extfile client.ext >/dev/null 2>&1
        openssl genrsa -out sa.key 2048 >/dev/null 2>&1
        openssl rsa -in sa.key -pubout -out sa.pub >/dev/null 2>&1
        rm -f ./*.csr ./*.ext ca.srl
        # A static bearer token in system:masters, for clients that can only pass a token
        # through (the test harness's fault proxy forwards the Authorization header).
        echo "$(openssl rand -hex 24),taintgate-admin-token,taintgate-admin-token,system:masters" > tokens.csv
    ) || die "generating certificates with openssl failed"
}

write_kubeconfig() {
    local d="$DIR/pki"
    cat > "$DIR/kubeconfig" <<KC
apiVersion: v1
kind: Config
clusters:
- name: local
  cluster:
    server: https://127.0.0.1:$APISERVER_PORT
    certificate-authority: $d/ca.crt
users:
- name: admin
  user:
    client-certificate: $d/admin.crt
    client-key: $d/admin.key
contexts:
- name: local
  context: {cluster: local, user: admin}
current-context: local
KC
}

wait_ready() {
    local d="$DIR/pki" i
    for i in $(seq 1 600); do
        if curl -fsS --max-time 2 --cacert "$d/ca.crt" --cert "$d/admin.crt" --key "$d/admin.key" \
            "https://127.0.0.1:$APISERVER_PORT/readyz" >/dev/null 2>&1; then
            return 0
        fi
        pid_alive "$ETCD_PID" || { tail -20 "$DIR/etcd.log" >&2; return 1; }
        pid_alive "$APISERVER_PID" || { tail -20 "$DIR/kube-apiserver.log" >&2; return 1; }
        sleep 0.2
    done
    tail -20 "$DIR/kube-apiserver.log" >&2
    return 1
}

up() {
    if [ -f "$STATE" ]; then
        # shellcheck disable=SC1090
        . "$STATE"
        if pid_alive "${APISERVER_PID:-}" || pid_alive "${ETCD_PID:-}"; then
            die "a cluster is already running in $DIR (kube-apiserver pid ${APISERVER_PID:-?}); run '$0 down $DIR' first"
        fi
        die "$DIR holds a stopped cluster's state; run '$0 down $DIR' to clear it"
    fi
    if [ "$NODE_MODE" = 1 ]; then
        node_preflight
    fi
    for v in ETCD_PORT APISERVER_PORT; do
        if [ -n "${!v:-}" ] && port_in_use "${!v}"; then
            die "port ${!v} ($v) is already in use on 127.0.0.1"
        fi
    done
    tg_go_check || exit 2
    local etcd apiserver
    if ! etcd=$(tg_tool_path etcd) || [ ! -x "$etcd" ] \
        || ! apiserver=$(tg_tool_path kube-apiserver) || [ ! -x "$apiserver" ]; then
        echo "local-cluster: etcd/kube-apiserver not built yet; running scripts/install-test-deps-kube.sh (a cold build takes several minutes)" >&2
        bash "$ROOT/scripts/install-test-deps-kube.sh" >&2 || die "building the control plane failed"
        etcd=$(tg_tool_path etcd)
        apiserver=$(tg_tool_path kube-apiserver)
    fi
    mkdir -p "$DIR"
    DIR=$(cd "$DIR" && pwd)
    STATE="$DIR/cluster.env"
    # Ports the caller fixed stay fixed; free ones are chosen per attempt.
    local fixed_etcd=${ETCD_PORT:-} fixed_apiserver=${APISERVER_PORT:-}
    gen_certs
    ETCD_PID="" APISERVER_PID="" WATCHDOG_PID=""
    # Record what runs as soon as it runs, so a failure below can stop exactly that.
    save_state() {
        cat > "$STATE" <<ST
DIR=$DIR
ETCD_PORT=$ETCD_PORT
APISERVER_PORT=$APISERVER_PORT
ETCD_PID=$ETCD_PID
APISERVER_PID=$APISERVER_PID
WATCHDOG_PID=$WATCHDOG_PID
NODE_MODE=$NODE_MODE
NODE_SLOT=${NODE_SLOT:-}
NODE_NAME=${NODE_NAME:-}
NODE_IP=${NODE_IP:-}
NODE_CGROUP_ROOT=${NODE_CGROUP_ROOT:-}
NODE_VAR_LIB=${NODE_VAR_LIB:-}
NODE_DRIVER_ROOT=${NODE_DRIVER_ROOT:-}
NODE_NS_PID=${NODE_NS_PID:-}
NODE_INIT_PID=${NODE_INIT_PID:-}
NODE_PIDNS=${NODE_PIDNS:-}
KCM_PID=${KCM_PID:-}
SCHEDULER_PID=${SCHEDULER_PID:-}
CONTAINERD_PID=${CONTAINERD_PID:-}
CONTAINERD_SOCK=${CONTAINERD_SOCK:-}
KUBELET_PID=${KUBELET_PID:-}
KUBELET_PORT=${KUBELET_PORT:-}
PLUGIN_PID=${PLUGIN_PID:-}
REGISTRY_PID=${REGISTRY_PID:-}
REGISTRY_HOST=${REGISTRY_HOST:-}
AGENT_METRICS_PORT=${AGENT_METRICS_PORT:-}
NODE_KUBECONFIG=${NODE_SLOT:+$DIR/node.kubeconfig}
KUBECONFIG=$DIR/kubeconfig
CA=$DIR/pki/ca.crt
SERVER_CERT=$DIR/pki/server.crt
SERVER_KEY=$DIR/pki/server.key
SA_KEY=$DIR/pki/sa.key
ADMIN_TOKEN=$(cut -d, -f1 "$DIR/pki/tokens.csv")
ETCD_URL=http://127.0.0.1:$ETCD_PORT
APISERVER_URL=https://127.0.0.1:$APISERVER_PORT
ST
    }
    fail_up() {
        echo "local-cluster: $*" >&2
        stop_recorded
        rm -rf "$DIR"
        exit 1
    }
    # Ports are reserved (reserve_port), so no other reserver takes them before etcd or
    # kube-apiserver binds them; a program outside the scheme still can, and that bind
    # failure is retried with fresh ports, a bounded number of times; ports the caller
    # fixed are never retried.
    # Without a node lifecycle controller nothing would remove the not-ready taint the
    # TaintNodesByCondition admission plugin puts on every new Node; --node runs one.
    local node_admission="--disable-admission-plugins TaintNodesByCondition"
    [ "$NODE_MODE" = 1 ] && node_admission=""
    local attempt
    for attempt in 1 2 3 4; do
        if [ -n "$fixed_etcd" ]; then ETCD_PORT=$fixed_etcd; else reserve_port ETCD_PORT; fi
        reserve_port ETCD_PEER_PORT
        if [ -n "$fixed_apiserver" ]; then APISERVER_PORT=$fixed_apiserver; else reserve_port APISERVER_PORT; fi
        setsid "$etcd" --name local --data-dir "$DIR/etcd" \
            --listen-client-urls "http://127.0.0.1:$ETCD_PORT" \
            --advertise-client-urls "http://127.0.0.1:$ETCD_PORT" \
            --listen-peer-urls "http://127.0.0.1:$ETCD_PEER_PORT" \
            --initial-advertise-peer-urls "http://127.0.0.1:$ETCD_PEER_PORT" \
            --initial-cluster "local=http://127.0.0.1:$ETCD_PEER_PORT" \
            --unsafe-no-fsync --log-level warn </dev/null >"$DIR/etcd.log" 2>&1 &
        ETCD_PID=$!
        save_state
        local p="$DIR/pki"
        # shellcheck disable=SC2086
        setsid "$apiserver" \
            --etcd-servers "http://127.0.0.1:$ETCD_PORT" \
            --bind-address 127.0.0.1 --advertise-address 127.0.0.1 --secure-port "$APISERVER_PORT" \
            --endpoint-reconciler-type none \
            --tls-cert-file "$p/server.crt" --tls-private-key-file "$p/server.key" \
            --client-ca-file "$p/ca.crt" \
            --token-auth-file "$p/tokens.csv" \
            --service-account-issuer https://kubernetes.default.svc.cluster.local \
            --service-account-key-file "$p/sa.pub" \
            --service-account-signing-key-file "$p/sa.key" \
            --service-cluster-ip-range 10.96.0.0/12 \
            --authorization-mode Node,RBAC \
            --enable-admission-plugins NodeRestriction \
            $node_admission \
            --watch-cache-sizes nodes#0 \
            --etcd-compaction-interval 0 \
            --profiling=false \
            ${TAINTGATE_APISERVER_ARGS:-} \
            </dev/null >"$DIR/kube-apiserver.log" 2>&1 &
        APISERVER_PID=$!
        save_state
        write_kubeconfig
        wait_ready && break
        if [ "$attempt" -lt 4 ] && [ -z "$fixed_etcd$fixed_apiserver" ] \
            && grep -qs "address already in use" "$DIR/etcd.log" "$DIR/kube-apiserver.log"; then
            echo "local-cluster: a chosen port was taken before it was bound (attempt $attempt); retrying on fresh ports" >&2
            stop_recorded
            rm -rf "$DIR/etcd" "$DIR/etcd.log" "$DIR/kube-apiserver.log"
            ETCD_PID="" APISERVER_PID=""
            continue
        fi
        fail_up "kube-apiserver did not become ready (logs above; $DIR/kube-apiserver.log)"
    done
    if [ -n "$WATCH_PID" ]; then
        pid_alive "$WATCH_PID" || fail_up "--watch-pid $WATCH_PID is not a running process"
        setsid bash -c 'while kill -0 "$1" 2>/dev/null; do sleep 1; done; exec "$2" down "$3"' \
            watchdog "$WATCH_PID" "$ROOT/scripts/local-cluster.sh" "$DIR" </dev/null >/dev/null 2>&1 &
        WATCHDOG_PID=$!
        save_state
    fi
    if [ "$NODE_MODE" = 1 ]; then
        node_up
        echo "local-cluster: up: node $NODE_NAME Ready at $NODE_IP ($("$(tg_tool_path kubelet)" --version)), nvidia.com/gpu: $NODE_GPUS" >&2
        if [ "$AGENT_MODE" = 1 ]; then
            node_agent_up
        fi
    fi
    echo "local-cluster: up: kube-apiserver https://127.0.0.1:$APISERVER_PORT ($("$apiserver" --version)), etcd 127.0.0.1:$ETCD_PORT" >&2
    echo "$DIR/kubeconfig"
}

down() {
    [ -f "$STATE" ] || die "no cluster state in $DIR (nothing that 'up' started is there)"
    stop_recorded
    rm -rf "$DIR"
    echo "local-cluster: down: $DIR" >&2
}

case "$cmd" in
    up) up ;;
    down) down ;;
    env) [ -f "$STATE" ] || die "no cluster state in $DIR"; cat "$STATE" ;;
    restart-plugin) [ -f "$STATE" ] || die "no cluster state in $DIR"; node_restart_plugin "$PLUGIN_CONFIG" "$NO_WAIT" ;;
    stop-plugin) [ -f "$STATE" ] || die "no cluster state in $DIR"; node_stop_plugin ;;
    restart-kubelet) [ -f "$STATE" ] || die "no cluster state in $DIR"; node_restart_kubelet ;;
    install-agent)
        [ -f "$STATE" ] || die "no cluster state in $DIR"
        # shellcheck disable=SC1090
        . "$STATE"
        [ "${NODE_MODE:-0}" = 1 ] || die "$DIR runs no node (it was not started with --node)"
        pid_alive "${NODE_INIT_PID:-}" || die "the node in $DIR is not running"
        [ -z "${REGISTRY_PID:-}" ] || die "the agent is installed in $DIR already"
        # The node keeps running when the install fails: only what it started is recorded.
        fail_up() { die "$*"; }
        save_state() {
            local v
            for v in REGISTRY_PID REGISTRY_HOST AGENT_METRICS_PORT; do
                sed -i "s|^$v=.*|$v=${!v:-}|" "$STATE"
            done
        }
        node_agent_up
        ;;
    *) usage ;;
esac
