# The real node of `scripts/local-cluster.sh up DIR --node` (sourced by it, not run).
#
# What runs, all of it started and stopped by the script, nothing of the host's touched:
#   - kube-controller-manager and kube-scheduler on loopback, with client certificates of
#     their RBAC bootstrap users (system:kube-controller-manager, system:kube-scheduler);
#   - one "node namespace": `unshare --mount --pid --fork --kill-child` whose init (a bash
#     loop that reaps orphans) holds a private mount namespace and a pid namespace. Inside it
#     DIR/node/var-lib is bind-mounted over /var/lib and DIR/node/var-log over /var/log, and
#     /run is a fresh tmpfs: the kubelet's compiled-in paths (/var/lib/kubelet/device-plugins/
#     kubelet.sock, /var/log/containers), the shim sockets and runc state under
#     /run/containerd, the CNI host-local leases and pod network namespaces (/run/netns) all
#     land in DIR or vanish with the namespace. Every node process runs in it (nsenter), so
#     killing its init ends every one of them, containers included, and drops every mount;
#   - a private containerd (own root, state, socket and CNI config; CRI with
#     `restrict_oom_score_adj = true`, because these machines lack CAP_SYS_RESOURCE and
#     runc fails every sandbox that asks for oom_score_adj -998), the sandbox image
#     registry.k8s.io/pause:3.10 imported from the archive scripts/install-test-deps-node.sh
#     builds; its runtime handler "nvidia" (RuntimeClass nvidia) is runc with a base OCI spec
#     that bind-mounts the driver root's fake NVML and a fake libcuda (tests/fake-cuda) into
#     every container of that handler, as the NVIDIA container runtime injects the driver;
#   - a kubelet (cgroup v1: failCgroupV1 false, cgroupDriver cgroupfs, failSwapOn false,
#     cgroupRoot /taintgate-node-<slot>) registering one Node with the startup taint
#     (registerWithTaints) and the labels a Karpenter NodePool would give it (nodeLabels),
#     under the client certificate system:node:<name> (group system:nodes), so the API
#     server's Node authorizer and NodeRestriction apply to it;
#   - NVIDIA's device plugin against the fake NVML, registered with that kubelet;
#   - with --agent (or `install-agent` later): a docker-registry on loopback, in the node
#     namespace, holding the agent's image, and the agent deployed from the chart (or the
#     kustomize base) as its DaemonSet's Pod (node_agent_up, below).
#
# Network containment: each node owns a slot N (1..32): a Linux bridge tg-node-N holding the
# node address 10.244.N.1/24 (never loopback), the same bridge for the pods' CNI network
# taintgate-node-N (host-local 10.244.N.0/24, no gateway, no masquerade, no default route in
# the pods, so nothing a pod sends can leave the bridge's subnet). The slot is claimed by
# creating the bridge (atomic; its alias names the owning DIR), so two nodes never share a
# bridge, subnet, cgroupRoot or CNI name; a slot whose owner DIR is gone is reclaimed.
#
# Settings (environment): TAINTGATE_NODE_NAME (default tg-node-N), TAINTGATE_NODE_TAINT
# (default taintgate.io/unverified:NoSchedule), TAINTGATE_NODE_LABELS (extra k=v,...),
# TAINTGATE_NODE_DRIVER_ROOT (a driver root holding usr/lib/x86_64-linux-gnu/
# libnvidia-ml.so.1 and its profile.txt; default: the fake NVML is compiled into
# DIR/node/driver-root with an 8-GPU profile), KUBELET_PORT (default: a free port).

NODE_SLOT_MAX=32
NODE_LIB_SUBDIR=usr/lib/x86_64-linux-gnu

node_bridge() { echo "tg-node-$1"; }

# The DIR that owns slot $1's bridge, from its alias ("taintgate:DIR").
node_slot_owner() {
    local alias
    alias=$(ip -o link show "$(node_bridge "$1")" 2>/dev/null | sed -n 's/.* alias taintgate:\([^ ]*\).*/\1/p')
    echo "$alias"
}

# Claim the first free slot: creating the bridge is the lock.
node_claim_slot() {
    local n owner
    for n in $(seq 1 "$NODE_SLOT_MAX"); do
        if ip link add "$(node_bridge "$n")" type bridge 2>/dev/null; then
            ip link set "$(node_bridge "$n")" alias "taintgate:$DIR"
            NODE_SLOT=$n
            return 0
        fi
        owner=$(node_slot_owner "$n")
        # Reclaim a slot whose owner crashed past its `down` (its DIR or init is gone).
        if [ -n "$owner" ] && [ "$owner" != "$DIR" ] && ! node_owner_alive "$owner"; then
            echo "local-cluster: reclaiming node slot $n left by $owner" >&2
            node_cleanup_slot "$n" "/taintgate-node-$n"
            if ip link add "$(node_bridge "$n")" type bridge 2>/dev/null; then
                ip link set "$(node_bridge "$n")" alias "taintgate:$DIR"
                NODE_SLOT=$n
                return 0
            fi
        fi
    done
    return 1
}

# True while the cluster in DIR $1 runs (or is starting: a slot is claimed only after its
# etcd started and cluster.env names it).
node_owner_alive() {
    local st="$1/cluster.env" v p
    [ -f "$st" ] || return 1
    for v in ETCD_PID APISERVER_PID NODE_NS_PID NODE_INIT_PID; do
        p=$(sed -n "s/^$v=//p" "$st")
        pid_alive "$p" && return 0
    done
    return 1
}

# Remove a slot's bridge and cgroups (after its processes are gone).
node_cleanup_slot() {
    local n=$1 cgroot=$2 c i
    ip link del "$(node_bridge "$n")" 2>/dev/null || true
    for i in $(seq 1 50); do
        local left=0
        for c in /sys/fs/cgroup/*/; do
            [ -d "$c${cgroot#/}" ] || continue
            find "$c${cgroot#/}" -depth -type d -exec rmdir {} \; 2>/dev/null || true
            [ -d "$c${cgroot#/}" ] && left=1
        done
        [ "$left" = 0 ] && return 0
        sleep 0.2
    done
    echo "local-cluster: warning: cgroups under $cgroot could not all be removed" >&2
}

# Every process in the node's pid namespace (host pids).
node_ns_pids() {
    [ -n "${NODE_PIDNS:-}" ] || return 0
    local p
    for p in /proc/[0-9]*; do
        [ "$(readlink "$p/ns/pid" 2>/dev/null)" = "$NODE_PIDNS" ] && echo "${p#/proc/}"
    done
    return 0
}

# Stop the node: controllers, then the namespace (SIGKILL to its init ends every process
# in it and, with the last of them, its mounts and pod network namespaces), then the bridge
# and the cgroups. Safe to call on a partly started node.
node_stop() {
    local p i
    for p in ${KCM_PID:-} ${SCHEDULER_PID:-}; do
        pid_alive "$p" && kill -TERM "$p" 2>/dev/null || true
    done
    pid_alive "${NODE_INIT_PID:-}" && kill -KILL "$NODE_INIT_PID" 2>/dev/null || true
    pid_alive "${NODE_NS_PID:-}" && kill -KILL "$NODE_NS_PID" 2>/dev/null || true
    for i in $(seq 1 100); do
        [ -z "$(node_ns_pids)" ] && break
        sleep 0.1
    done
    [ -z "$(node_ns_pids)" ] || echo "local-cluster: warning: processes still in the node namespace: $(node_ns_pids | tr '\n' ' ')" >&2
    for p in ${KCM_PID:-} ${SCHEDULER_PID:-}; do
        pid_alive "$p" && kill -KILL "$p" 2>/dev/null || true
    done
    if [ -n "${NODE_SLOT:-}" ]; then
        node_cleanup_slot "$NODE_SLOT" "$NODE_CGROUP_ROOT"
    fi
}

# A client certificate (CN $2, O $3) signed by the cluster CA, as $DIR/pki/$1.{crt,key}.
node_client_cert() {
    local name=$1 cn=$2 org=$3 d="$DIR/pki"
    (
        cd "$d"
        echo "extendedKeyUsage = clientAuth" > "$name.ext"
        openssl req -newkey rsa:2048 -nodes -keyout "$name.key" -out "$name.csr" \
            -subj "/O=$org/CN=$cn" >/dev/null 2>&1
        openssl x509 -req -in "$name.csr" -CA ca.crt -CAkey ca.key -CAcreateserial \
            -out "$name.crt" -days 30 -extfile "$name.ext" >/dev/null 2>&1
        rm -f "$name.csr" "$name.ext" ca.srl
    ) || die "generating the $name certificate failed"
}

node_kubeconfig() {
    local name=$1 d="$DIR/pki"
    cat > "$DIR/$name.kubeconfig" <<KC
apiVersion: v1
kind: Config
clusters:
- name: local
  cluster:
    server: https://127.0.0.1:$APISERVER_PORT
    certificate-authority: $d/ca.crt
users:
- name: $name
  user:
    client-certificate: $d/$name.crt
    client-key: $d/$name.key
contexts:
- name: local
  context: {cluster: local, user: $name}
current-context: local
KC
}

# Run "$@" inside the node namespace, detached, output to log $1 (host pid of nsenter in
# $NS_RUN_PID; the process itself is its child).
node_ns_run() {
    local log=$1
    shift
    setsid nsenter -t "$NODE_INIT_PID" -m -p --wd=/ -- "$@" </dev/null >"$log" 2>&1 &
    NS_RUN_PID=$!
    disown "$NS_RUN_PID"
}

# Wait (bounded) for a unix socket, naming the log on failure.
node_wait_socket() {
    local sock=$1 what=$2 log=$3 pid=$4 i
    for i in $(seq 1 300); do
        [ -S "$sock" ] && return 0
        pid_alive "$pid" || { tail -20 "$log" >&2; fail_up "$what exited before serving $sock ($log)"; }
        sleep 0.2
    done
    tail -20 "$log" >&2
    fail_up "$what did not create $sock within 60 s ($log)"
}

# The fake NVML in DIR/node/driver-root with an 8-GPU profile (default driver root).
node_build_fake_nvml() {
    local root=$1 inc
    inc=$("$ROOT/tests/fake-nvml/nvml-include.sh") \
        || fail_up "nvml.h not found (run scripts/install-test-deps-nvidia.sh)"
    mkdir -p "$root/$NODE_LIB_SUBDIR"
    python3 "$ROOT/tests/fake-nvml/gen-stubs.py" --include "$inc" --out "$DIR/node/nvml_stubs.c" \
        || fail_up "generating the fake NVML's stubs failed"
    "${CC:-cc}" -shared -fPIC -O1 -Wall -Werror -Wmissing-prototypes -I "$inc" \
        -o "$root/$NODE_LIB_SUBDIR/libnvidia-ml.so.1" \
        "$ROOT/tests/fake-nvml/fake_nvml.c" "$DIR/node/nvml_stubs.c" \
        -Wl,--no-as-needed -l:libpthread.so.0 -lm -l:libdl.so.2 -l:librt.so.1 -Wl,--as-needed \
        || fail_up "compiling the fake NVML failed"
    printf 'gpus=8\np2p_nvlink=0,1,2,3;4,5,6,7\n' > "$root/$NODE_LIB_SUBDIR/profile.txt"
}

# The fake libcuda.so.1 (tests/fake-cuda) in $1, and $1/log, where it appends a line for
# each cuInit: the "nvidia" handler injects both, so a container that called CUDA shows.
node_build_fake_cuda() {
    local d=$1
    mkdir -p "$d/log"
    "${CC:-cc}" -shared -fPIC -O1 -Wall -Werror -o "$d/libcuda.so.1" "$ROOT/tests/fake-cuda/fake_cuda.c" \
        || fail_up "compiling the fake libcuda failed"
}

# Where the "nvidia" handler puts the driver in a container: the library directory of a
# Debian/Ubuntu image, as the NVIDIA container toolkit does (the loader finds it there).
NODE_CONTAINER_LIB=/usr/lib/x86_64-linux-gnu
NODE_CONTAINER_CUDA_LOG=/var/log/fake-cuda

# The base OCI spec of the "nvidia" runtime handler ($1): containerd's default spec plus
# read-only bind mounts of the fake NVML (with the profile.txt it reads beside itself) and
# the fake libcuda, and the libcuda call log directory (writable) with FAKE_CUDA_LOG naming
# it. CRI applies each Pod's own settings on top of this spec.
node_nvidia_base_spec() {
    local out=$1 nd="$DIR/node"
    mkdir -p "$(dirname "$out")"
    ctr oci spec > "$out.default" || fail_up "ctr oci spec failed"
    python3 - "$out.default" "$out" "$NODE_DRIVER_ROOT/$NODE_LIB_SUBDIR" "$nd/fake-cuda" \
        "$NODE_CONTAINER_LIB" "$NODE_CONTAINER_CUDA_LOG" <<'PY' || fail_up "writing the nvidia base spec failed"
import json, sys
src, out, driver_lib, cuda, lib, log = sys.argv[1:]
spec = json.load(open(src))
ro = ["rbind", "ro", "nosuid", "nodev"]
def bind(source, dest, options):
    spec["mounts"].append({"destination": dest, "type": "bind", "source": source, "options": options})
bind(f"{driver_lib}/libnvidia-ml.so.1", f"{lib}/libnvidia-ml.so.1", ro)
bind(f"{driver_lib}/profile.txt", f"{lib}/profile.txt", ro)
bind(f"{cuda}/libcuda.so.1", f"{lib}/libcuda.so.1", ro)
bind(f"{cuda}/log", log, ["rbind", "rw", "nosuid", "nodev", "noexec"])
spec["process"].setdefault("env", []).append(f"FAKE_CUDA_LOG={log}/calls.log")
json.dump(spec, open(out, "w"), indent=2)
PY
    rm -f "$out.default"
}

# Check what --node needs before anything starts; build what is missing.
node_preflight() {
    [ "$(id -u)" = 0 ] || die "--node needs root (mount and pid namespaces, a bridge, cgroups, containerd)"
    case "$(realpath -m "$DIR")/" in
        /var/lib/*|/var/log/*|/run/*|/var/run/*)
            die "--node: DIR must not be under /var/lib, /var/log or /run (the node namespace mounts over them)" ;;
    esac
    local t need=0
    for t in kubelet kube-scheduler kube-controller-manager kubectl; do
        [ -x "$(tg_tool_path "$t")" ] || need=1
    done
    if [ "$need" = 1 ]; then
        echo "local-cluster: kubelet/kube-scheduler/kube-controller-manager not built yet; running scripts/install-test-deps-kube.sh" >&2
        bash "$ROOT/scripts/install-test-deps-kube.sh" >&2 || die "building the node's components failed"
    fi
    if [ ! -x "$(tg_tool_path nvidia-device-plugin)" ]; then
        echo "local-cluster: NVIDIA's device plugin not built yet; running scripts/install-test-deps-nvidia-plugin.sh" >&2
        bash "$ROOT/scripts/install-test-deps-nvidia-plugin.sh" >&2 || die "building NVIDIA's device plugin failed"
    fi
    PAUSE_ARCHIVE=$(bash "$ROOT/scripts/install-test-deps-node.sh" | tail -1) \
        || die "scripts/install-test-deps-node.sh failed (above)"
    # The kubelet listens on its node address: any address holding the port is a conflict.
    if [ -n "${KUBELET_PORT:-}" ] && port_in_use "$KUBELET_PORT" 0.0.0.0; then
        die "port $KUBELET_PORT (KUBELET_PORT) is already in use"
    fi
    if [ -n "${TAINTGATE_NODE_DRIVER_ROOT:-}" ] \
        && [ ! -f "$TAINTGATE_NODE_DRIVER_ROOT/$NODE_LIB_SUBDIR/libnvidia-ml.so.1" ]; then
        die "TAINTGATE_NODE_DRIVER_ROOT=$TAINTGATE_NODE_DRIVER_ROOT holds no $NODE_LIB_SUBDIR/libnvidia-ml.so.1"
    fi
}

# Start the node (after the API server is ready). Records everything in $STATE as it
# starts, so fail_up/down stop exactly that.
node_up() {
    local kubelet kcm sched plugin kubectl
    kubelet=$(tg_tool_path kubelet)
    kcm=$(tg_tool_path kube-controller-manager)
    sched=$(tg_tool_path kube-scheduler)
    plugin=$(tg_tool_path nvidia-device-plugin)
    kubectl=$(tg_tool_path kubectl)
    local nd="$DIR/node"
    mkdir -p "$nd"/{var-lib/kubelet/device-plugins,var-log,containerd,cni}

    node_claim_slot || fail_up "no free node slot (all $NODE_SLOT_MAX bridges tg-node-N exist and their owners run): take one down with '$0 down DIR'"
    NODE_CGROUP_ROOT=/taintgate-node-$NODE_SLOT
    NODE_IP=10.244.$NODE_SLOT.1
    NODE_NAME=${TAINTGATE_NODE_NAME:-tg-node-$NODE_SLOT}
    NODE_VAR_LIB=$nd/var-lib
    save_state
    ip addr add "$NODE_IP/24" dev "$(node_bridge "$NODE_SLOT")" || fail_up "cannot address the bridge"
    ip link set "$(node_bridge "$NODE_SLOT")" up || fail_up "cannot bring the bridge up"
    # The kubelet wants its cgroupRoot to exist in every v1 hierarchy.
    local c
    for c in /sys/fs/cgroup/*/; do
        [ "$c" = /sys/fs/cgroup/unified/ ] && continue
        [ -f "${c}cgroup.procs" ] && mkdir -p "$c${NODE_CGROUP_ROOT#/}"
    done

    # Controllers, on loopback.
    node_client_cert kcm system:kube-controller-manager system:kube-controller-manager
    node_client_cert scheduler system:kube-scheduler system:kube-scheduler
    node_client_cert node "system:node:$NODE_NAME" system:nodes
    node_kubeconfig kcm
    node_kubeconfig scheduler
    node_kubeconfig node
    reserve_port KCM_PORT
    reserve_port SCHEDULER_PORT
    setsid "$kcm" --kubeconfig "$DIR/kcm.kubeconfig" \
        --authentication-kubeconfig "$DIR/kcm.kubeconfig" --authorization-kubeconfig "$DIR/kcm.kubeconfig" \
        --bind-address 127.0.0.1 --secure-port "$KCM_PORT" \
        --controllers '*,-nodeipam,-cloud-node-lifecycle' \
        --service-account-private-key-file "$DIR/pki/sa.key" --root-ca-file "$DIR/pki/ca.crt" \
        --use-service-account-credentials=true --leader-elect=false \
        --node-monitor-grace-period 20s --profiling=false \
        </dev/null >"$DIR/kube-controller-manager.log" 2>&1 &
    KCM_PID=$!
    save_state
    setsid "$sched" --kubeconfig "$DIR/scheduler.kubeconfig" \
        --authentication-kubeconfig "$DIR/scheduler.kubeconfig" --authorization-kubeconfig "$DIR/scheduler.kubeconfig" \
        --bind-address 127.0.0.1 --secure-port "$SCHEDULER_PORT" --leader-elect=false --profiling=false \
        </dev/null >"$DIR/kube-scheduler.log" 2>&1 &
    SCHEDULER_PID=$!
    save_state

    # The node namespace.
    setsid unshare --mount --pid --fork --kill-child --mount-proc --propagation private \
        bash -c 'set -e
            mount --bind "$1/var-lib" /var/lib
            mount --bind "$1/var-log" /var/log
            mount -t tmpfs -o mode=0755 tmpfs /run
            mkdir -p /run/netns
            touch "$1/ns-ready"
            trap "exit 0" TERM
            while :; do sleep 3600 & wait $! || true; done' node-init "$nd" \
        </dev/null >"$nd/ns.log" 2>&1 &
    NODE_NS_PID=$!
    disown "$NODE_NS_PID"
    local i
    for i in $(seq 1 100); do
        NODE_INIT_PID=$(cat "/proc/$NODE_NS_PID/task/$NODE_NS_PID/children" 2>/dev/null | awk '{print $1}')
        [ -n "$NODE_INIT_PID" ] && [ -f "$nd/ns-ready" ] && break
        pid_alive "$NODE_NS_PID" || { cat "$nd/ns.log" >&2; fail_up "the node namespace (unshare) failed"; }
        sleep 0.1
    done
    [ -f "$nd/ns-ready" ] || fail_up "the node namespace did not come up ($nd/ns.log)"
    NODE_PIDNS=$(readlink "/proc/$NODE_INIT_PID/ns/pid")
    save_state

    # The driver root, before containerd: its `nvidia` runtime handler injects it.
    NODE_DRIVER_ROOT=${TAINTGATE_NODE_DRIVER_ROOT:-}
    if [ -z "$NODE_DRIVER_ROOT" ]; then
        NODE_DRIVER_ROOT=$nd/driver-root
        node_build_fake_nvml "$NODE_DRIVER_ROOT"
    fi
    save_state
    node_build_fake_cuda "$nd/fake-cuda"
    node_nvidia_base_spec "$nd/containerd/nvidia-base-spec.json"

    # containerd.
    local snap=overlayfs
    mkdir -p "$nd/ovl"/{l,u,w,m}
    if mount -t overlay overlay -o "lowerdir=$nd/ovl/l,upperdir=$nd/ovl/u,workdir=$nd/ovl/w" "$nd/ovl/m" 2>/dev/null; then
        umount "$nd/ovl/m"
    else
        snap=native
    fi
    rm -rf "$nd/ovl"
    CONTAINERD_SOCK=$nd/containerd/containerd.sock
    cat > "$nd/containerd/config.toml" <<TOML
version = 2
root = "$nd/containerd/root"
state = "$nd/containerd/state"
disabled_plugins = ["io.containerd.snapshotter.v1.devmapper", "io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.zfs", "io.containerd.snapshotter.v1.aufs"]
[grpc]
  address = "$CONTAINERD_SOCK"
[ttrpc]
  address = "$CONTAINERD_SOCK.ttrpc"
[debug]
  address = ""
[metrics]
  address = ""
[plugins."io.containerd.internal.v1.opt"]
  path = "$nd/containerd/opt"
[plugins."io.containerd.grpc.v1.cri"]
  disable_tcp_service = true
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
  enable_selinux = false
  sandbox_image = "registry.k8s.io/pause:3.10"
  # No CAP_SYS_RESOURCE on these machines: without this, runc fails every pod sandbox.
  restrict_oom_score_adj = true
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "$snap"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
    # The handler of RuntimeClass "nvidia": runc, with a base spec that bind-mounts the
    # driver's libraries into every container of that handler, as the NVIDIA container
    # runtime injects them (the Pod spec names none of them).
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.nvidia]
      runtime_type = "io.containerd.runc.v2"
      base_runtime_spec = "$nd/containerd/nvidia-base-spec.json"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.nvidia.options]
        SystemdCgroup = false
  # Loopback registries (--agent's) are mapped to plain HTTP here (hosts.toml, read on each pull).
  [plugins."io.containerd.grpc.v1.cri".registry]
    config_path = "$nd/containerd/certs.d"
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = "$nd/cni"
    max_conf_num = 1
TOML
    cat > "$nd/cni/10-taintgate.conflist" <<CNI
{
  "cniVersion": "0.4.0",
  "name": "taintgate-node-$NODE_SLOT",
  "plugins": [
    {
      "type": "bridge",
      "bridge": "$(node_bridge "$NODE_SLOT")",
      "isGateway": false,
      "isDefaultGateway": false,
      "ipMasq": false,
      "hairpinMode": true,
      "ipam": {
        "type": "host-local",
        "ranges": [[{"subnet": "10.244.$NODE_SLOT.0/24", "rangeStart": "10.244.$NODE_SLOT.10"}]],
        "dataDir": "/var/lib/cni/networks"
      }
    }
  ]
}
CNI
    node_ns_run "$nd/containerd.log" containerd --config "$nd/containerd/config.toml"
    CONTAINERD_PID=$NS_RUN_PID
    save_state
    node_wait_socket "$CONTAINERD_SOCK" containerd "$nd/containerd.log" "$CONTAINERD_PID"
    # Seen once with three nodes starting side by side, right after containerd's socket
    # appeared: the import's unpack failed with "content digest ...: not found" (cause not
    # established). It is tried up to three times; each attempt's output is kept.
    local attempt imported=""
    for attempt in 1 2 3; do
        if ctr -a "$CONTAINERD_SOCK" -n k8s.io images import --index-name registry.k8s.io/pause:3.10 \
            "$PAUSE_ARCHIVE" >>"$nd/pause-import.log" 2>&1; then
            imported=1
            break
        fi
        echo "local-cluster: importing the pause image failed (attempt $attempt)" >>"$nd/pause-import.log"
        sleep 1
    done
    [ -n "$imported" ] || { cat "$nd/pause-import.log" >&2; fail_up "importing the pause image failed (3 attempts)"; }

    # kubelet.
    local taint=${TAINTGATE_NODE_TAINT:-taintgate.io/unverified:NoSchedule}
    local tkey=${taint%%:*} teffect=${taint##*:} tvalue=""
    case "$tkey" in *=*) tvalue=${tkey#*=}; tkey=${tkey%%=*} ;; esac
    # The labels a Karpenter NodePool (karpenter/nodepool.yaml) gives a GPU node, and
    # karpenter.sh/registered, which Karpenter sets once the kubelet registered (no
    # Karpenter runs here; the agent's register stage waits for it).
    local labels="taintgate.io/enabled=true,karpenter.sh/nodepool=gpu,karpenter.sh/capacity-type=on-demand,karpenter.sh/registered=true,node.kubernetes.io/instance-type=p5.48xlarge"
    [ -n "${TAINTGATE_NODE_LABELS:-}" ] && labels="$labels,$TAINTGATE_NODE_LABELS"
    [ -n "${KUBELET_PORT:-}" ] || reserve_port KUBELET_PORT
    reserve_port KUBELET_HEALTHZ_PORT
    cat > "$nd/kubelet-config.yaml" <<KCFG
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
# cgroup v1 machines: kubelet 1.36 refuses v1 unless told otherwise.
failCgroupV1: false
failSwapOn: false
cgroupDriver: cgroupfs
cgroupRoot: $NODE_CGROUP_ROOT
containerRuntimeEndpoint: unix://$CONTAINERD_SOCK
address: $NODE_IP
port: $KUBELET_PORT
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
healthzPort: $KUBELET_HEALTHZ_PORT
authentication:
  anonymous: {enabled: false}
  webhook: {enabled: false}
  x509: {clientCAFile: $DIR/pki/ca.crt}
authorization:
  mode: AlwaysAllow
registerWithTaints:
- {key: "$tkey", value: "$tvalue", effect: "$teffect"}
# A test machine's disk is not a production node's: no eviction or image GC from it.
evictionHard: {memory.available: "1Mi", nodefs.available: "1%", nodefs.inodesFree: "1%", imagefs.available: "1%"}
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
podCIDR: 10.244.$NODE_SLOT.0/24
maxPods: 110
serializeImagePulls: false
KCFG
    # The kubelet writes host-wide iptables chains (KUBE-FIREWALL in INPUT/OUTPUT,
    # KUBE-KUBELET-CANARY, KUBE-IPTABLES-HINT) that would outlive the node and change the
    # machine's loopback filtering. It finds iptables on PATH: here it finds stand-ins that
    # fail, so it runs without iptables support (nothing on this node needs it: no
    # kube-proxy, no NodePort, no masquerade).
    mkdir -p "$nd/no-iptables"
    local t
    for t in iptables ip6tables iptables-save ip6tables-save iptables-restore ip6tables-restore; do
        printf '#!/bin/sh\necho "%s: not available on the taintgate test node" >&2\nexit 1\n' "$t" > "$nd/no-iptables/$t"
        chmod +x "$nd/no-iptables/$t"
    done
    # The command line is kept (NUL-separated) for `restart-kubelet`.
    printf '%s\0' env "PATH=$nd/no-iptables:$PATH" "$kubelet" --config "$nd/kubelet-config.yaml" \
        --kubeconfig "$DIR/node.kubeconfig" --root-dir /var/lib/kubelet \
        --hostname-override "$NODE_NAME" --node-ip "$NODE_IP" --node-labels "$labels" --v=2 \
        > "$nd/kubelet.args"
    node_kubelet_start
    node_wait_socket "$nd/var-lib/kubelet/device-plugins/kubelet.sock" kubelet "$DIR/kubelet.log" "$KUBELET_PID"

    # NVIDIA's device plugin on the fake NVML; it registers on the kubelet's compiled-in
    # socket path, which is DIR/node/var-lib/kubelet/device-plugins/ in the namespace.
    node_plugin_start "$plugin"
    node_wait_socket "$nd/var-lib/kubelet/device-plugins/nvidia-gpu.sock" "NVIDIA's device plugin" "$DIR/device-plugin.log" "$PLUGIN_PID"

    # Ready, with GPUs published by the kubelet.
    local want='{.status.conditions[?(@.type=="Ready")].status} {.status.allocatable.nvidia\.com/gpu}'
    local got=""
    for i in $(seq 1 600); do
        got=$("$kubectl" --kubeconfig "$DIR/kubeconfig" get node "$NODE_NAME" -o "jsonpath=$want" 2>/dev/null || true)
        case "$got" in "True "[1-9]*) break ;; esac
        pid_alive "$KUBELET_PID" || { tail -30 "$DIR/kubelet.log" >&2; fail_up "the kubelet exited ($DIR/kubelet.log)"; }
        sleep 0.2
    done
    case "$got" in
        "True "[1-9]*) ;;
        *) tail -30 "$DIR/kubelet.log" >&2
           fail_up "node $NODE_NAME not Ready with nvidia.com/gpu allocatable within 120 s (Ready, GPUs: '$got')" ;;
    esac
    NODE_GPUS=${got#True }
}

# Start the kubelet in the node namespace with the command line node_up recorded.
node_kubelet_start() {
    local args=()
    mapfile -d '' args < "$DIR/node/kubelet.args"
    node_ns_run "$DIR/kubelet.log" "${args[@]}"
    KUBELET_PID=$NS_RUN_PID
    save_state
}

# Stop a node process started with node_ns_run ($1: the nsenter pid, $2: what it is): TERM
# to the process (nsenter's child), KILL after 10 s.
node_ns_kill() {
    local pid=$1 child i
    pid_alive "$pid" || return 0
    child=$(cat "/proc/$pid/task/$pid/children" 2>/dev/null | awk '{print $1}')
    [ -n "$child" ] && kill -TERM "$child" 2>/dev/null
    for i in $(seq 1 100); do
        pid_alive "$pid" || return 0
        sleep 0.1
    done
    echo "local-cluster: $2 ignored SIGTERM for 10 s; killing it" >&2
    [ -n "$child" ] && kill -KILL "$child" 2>/dev/null
    sleep 0.2
}

# The checks of every command on a running node: state loaded, a node, alive.
node_running() {
    # shellcheck disable=SC1090
    . "$STATE"
    [ "${NODE_MODE:-0}" = 1 ] || die "$DIR runs no node (it was not started with --node)"
    pid_alive "${NODE_INIT_PID:-}" || die "the node in $DIR is not running"
}

# `local-cluster.sh restart-kubelet DIR`: stop the kubelet and start it again with the same
# command line, as a node's kubelet restarts (an upgrade, a crash, a config change). Its
# log so far moves to kubelet.log.1. The new kubelet empties the device-plugins directory
# and serves a new registration socket; NVIDIA's device plugin sees that and registers
# again (its own behaviour, not the script's). Returns once the new socket is there.
node_restart_kubelet() {
    node_running
    node_ns_kill "$KUBELET_PID" kubelet
    save_state() { sed -i "s/^KUBELET_PID=.*/KUBELET_PID=$KUBELET_PID/" "$STATE"; }
    rm -f "$NODE_VAR_LIB/kubelet/device-plugins/kubelet.sock"
    [ -f "$DIR/kubelet.log" ] && mv "$DIR/kubelet.log" "$DIR/kubelet.log.1"
    node_kubelet_start
    fail_up() { die "$*"; }
    node_wait_socket "$NODE_VAR_LIB/kubelet/device-plugins/kubelet.sock" kubelet "$DIR/kubelet.log" "$KUBELET_PID"
    echo "local-cluster: kubelet restarted (pid $KUBELET_PID)" >&2
}

# `local-cluster.sh stop-plugin DIR`: stop the device plugin (its socket goes with it), as
# when its Pod is deleted or not yet started. `restart-plugin` starts it again.
node_stop_plugin() {
    node_running
    node_ns_kill "$PLUGIN_PID" "the device plugin"
    rm -f "$NODE_VAR_LIB/kubelet/device-plugins/nvidia-gpu.sock"
    sed -i "s/^PLUGIN_PID=.*/PLUGIN_PID=/" "$STATE"
    echo "local-cluster: device plugin stopped" >&2
}

# Start (or restart) the device plugin in the node namespace. Its config file, if any:
# DIR/node/device-plugin-config.yaml (restart with another file to change the profile).
#
# MPS: a plugin config with `sharing.mps` makes the plugin ask NVIDIA's MPS control client
# (`nvidia-cuda-mps-control`, found on its PATH) whether the MPS control daemon answers
# before it serves. No GPU, so no daemon: DIR/node/mps-bin holds a stand-in for the client
# that answers like the real one: `get_default_active_thread_percentage` gets `100.0` when
# the daemon's control pipe exists under the config's `flags.mpsRoot`
# (<mpsRoot>/<resource>/pipe/control, where the daemon makes it), and the real client's
# error and exit status 1 otherwise. A test creates or removes that pipe.
node_plugin_start() {
    local plugin=$1 args=() bin="$DIR/node/mps-bin"
    [ -f "$DIR/node/device-plugin-config.yaml" ] && args+=("--config-file=$DIR/node/device-plugin-config.yaml")
    mkdir -p "$bin"
    # The plugin runs the client with only CUDA_MPS_PIPE_DIRECTORY and
    # CUDA_MPS_LOG_DIRECTORY in its environment (no PATH): the stand-in uses shell builtins
    # and reads the host root from the file beside it.
    cat > "$bin/nvidia-cuda-mps-control" <<'MPS'
#!/bin/sh
# Stand-in for NVIDIA's MPS control client (scripts/local-node.sh, node_plugin_start).
# The plugin passes CUDA_MPS_PIPE_DIRECTORY=/mps/<resource>/pipe (its container path); on
# this node the daemon's pipe would be under the config's flags.mpsRoot (file mps-root).
read -r cmd || true  # the plugin writes the command without a newline
root=""
[ -f "${0%/*}/mps-root" ] && read -r root < "${0%/*}/mps-root"
r=${CUDA_MPS_PIPE_DIRECTORY#/mps/}
resource=${r%/pipe}
if [ -n "$root" ] && [ "$resource" != "$r" ] && [ -p "$root/$resource/pipe/control" ]; then
    case "$cmd" in
        get_default_active_thread_percentage) echo "100.0" ;;
    esac
    exit 0
fi
echo "Cannot find MPS control daemon process" >&2
exit 1
MPS
    chmod +x "$bin/nvidia-cuda-mps-control"
    local mps_root=""
    [ -f "$DIR/node/device-plugin-config.yaml" ] \
        && mps_root=$(sed -n 's/^ *mpsRoot: *"\{0,1\}\([^"]*\)"\{0,1\} *$/\1/p' "$DIR/node/device-plugin-config.yaml" | head -1)
    printf '%s\n' "$mps_root" > "$bin/mps-root"
    node_ns_run "$DIR/device-plugin.log" env "PATH=$bin:$PATH" "$plugin" \
        "--container-driver-root=$NODE_DRIVER_ROOT" --fail-on-init-error=true "${args[@]}"
    PLUGIN_PID=$NS_RUN_PID
    save_state
}

# `local-cluster.sh restart-plugin DIR [--plugin-config FILE]`: stop the device plugin (when
# it runs) and start it, with FILE as its --config-file (time-slicing, MPS, ...) or, without
# it, with none. Returns once the new plugin serves its socket; the kubelet then re-reads
# the plugin's devices and republishes allocatable (callers wait for that on the Node).
# With --no-wait ($2 = 1) it returns once the plugin is started (a plugin that cannot
# serve yet, e.g. MPS without its daemon, retries on its own).
node_restart_plugin() {
    local config=$1 no_wait=${2:-0} nd="$DIR/node" plugin i
    node_running
    plugin=$(tg_tool_path nvidia-device-plugin)
    if [ -n "$config" ]; then
        [ -f "$config" ] || die "--plugin-config $config: no such file"
        cp "$config" "$nd/device-plugin-config.yaml"
    else
        rm -f "$nd/device-plugin-config.yaml"
    fi
    node_ns_kill "${PLUGIN_PID:-}" "the device plugin"
    rm -f "$NODE_VAR_LIB/kubelet/device-plugins/nvidia-gpu.sock"
    save_state() { sed -i "s/^PLUGIN_PID=.*/PLUGIN_PID=$PLUGIN_PID/" "$STATE"; }
    node_plugin_start "$plugin"
    [ "$no_wait" = 1 ] && { echo "local-cluster: device plugin started (pid $PLUGIN_PID)" >&2; return 0; }
    for i in $(seq 1 300); do
        [ -S "$NODE_VAR_LIB/kubelet/device-plugins/nvidia-gpu.sock" ] && { echo "local-cluster: device plugin restarted (pid $PLUGIN_PID)" >&2; return 0; }
        pid_alive "$PLUGIN_PID" || { tail -20 "$DIR/device-plugin.log" >&2; die "the device plugin exited ($DIR/device-plugin.log)"; }
        sleep 0.2
    done
    die "the device plugin did not serve its socket within 60 s ($DIR/device-plugin.log)"
}

# `kubectl apply -k` of scripts/local-agent-overlay (the kustomize base with the local node's
# settings) under a kustomization made here with what is known only now: the image by
# digest, the API server's loopback address and the metrics port (env and containerPort:
# on the host network they are the node's).
node_agent_kustomize() {
    local kubectl=$1 digest=$2 k="$DIR/agent-kustomize" overlay
    mkdir -p "$k"
    # kustomize takes no absolute path to a base.
    overlay=$(realpath --relative-to="$k" "$ROOT/scripts/local-agent-overlay")
    cat > "$k/kustomization.yaml" <<KUST
apiVersion: kustomize.config.k8s.io/v1beta1
kind: Kustomization
resources:
  - $overlay
images:
  - name: registry.example.invalid/taintgate
    newName: $REGISTRY_HOST/taintgate
    digest: $digest
patches:
  - target: {kind: DaemonSet, name: taintgate}
    patch: |-
      - op: replace
        path: /spec/template/spec/containers/0/ports/0/containerPort
        value: $AGENT_METRICS_PORT
  - patch: |-
      apiVersion: apps/v1
      kind: DaemonSet
      metadata: {name: taintgate, namespace: taintgate-system}
      spec:
        template:
          spec:
            containers:
              - name: taintgate
                env:
                  - {name: TAINTGATE_METRICS_ADDR, value: "0.0.0.0:$AGENT_METRICS_PORT"}
                  - {name: KUBERNETES_SERVICE_HOST, value: "127.0.0.1"}
                  - {name: KUBERNETES_SERVICE_PORT, value: "$APISERVER_PORT"}
KUST
    "$kubectl" --kubeconfig "$DIR/kubeconfig" apply -k "$k" >"$DIR/agent-install.log" 2>&1 \
        || { cat "$DIR/agent-install.log" >&2; fail_up "kubectl apply -k $k failed"; }
}

# `up --node --agent` (after node_up): the agent as users deploy it. The image
# (TAINTGATE_IMAGE_ARCHIVE, else scripts/build-image.sh builds it, release binary and all)
# is pushed to a loopback docker-registry that runs in the node namespace, the kubelet pulls
# it by digest through CRI, and the chart (charts/taintgate) is installed with
# scripts/local-agent-values.yaml (plus TAINTGATE_AGENT_VALUES, a values file, when set) and
# the addresses only known now: the registry, the API server (apiServer.host/port: there is
# no kube-proxy here, the Pod runs on the host network) and a free metricsPort. Returns once
# the agent's Pod is Ready, which it is only when it released the node.
node_agent_up() {
    local nd="$DIR/node" kubectl helm registry skopeo archive version digest i
    kubectl=$(tg_tool_path kubectl)
    helm=$(tg_tool_path helm)
    registry=$(command -v docker-registry || command -v registry) \
        || fail_up "docker-registry not installed (scripts/install-test-deps-images.sh)"
    skopeo=$(command -v skopeo) || fail_up "skopeo not installed (scripts/install-test-deps-images.sh)"
    archive=${TAINTGATE_IMAGE_ARCHIVE:-}
    if [ -z "$archive" ]; then
        archive="${CARGO_TARGET_DIR:-$ROOT/target}/image/taintgate-oci.tar"
        echo "local-cluster: building the agent image (scripts/build-image.sh: a release build, minutes when cold)" >&2
        bash "$ROOT/scripts/build-image.sh" "$archive" >&2 || fail_up "scripts/build-image.sh failed"
    fi
    [ -f "$archive" ] || fail_up "image archive $archive not found (TAINTGATE_IMAGE_ARCHIVE)"
    version=$(sed -n '/^\[workspace.package\]/,/^\[/s/^version *= *"\(.*\)"/\1/p' "$ROOT/Cargo.toml")

    # The registry, in the node namespace (it goes with the node), on loopback.
    local registry_port
    reserve_port registry_port
    REGISTRY_HOST=127.0.0.1:$registry_port
    mkdir -p "$nd/registry"
    printf 'version: 0.1\nlog:\n  level: warn\nstorage:\n  filesystem:\n    rootdirectory: %s\nhttp:\n  addr: %s\n' \
        "$nd/registry/data" "$REGISTRY_HOST" > "$nd/registry/config.yml"
    node_ns_run "$DIR/registry.log" "$registry" serve "$nd/registry/config.yml"
    REGISTRY_PID=$NS_RUN_PID
    save_state
    for i in $(seq 1 150); do
        curl -fsS --max-time 1 "http://$REGISTRY_HOST/v2/" >/dev/null 2>&1 && break
        pid_alive "$REGISTRY_PID" || { tail -20 "$DIR/registry.log" >&2; fail_up "docker-registry exited ($DIR/registry.log)"; }
        sleep 0.2
    done
    mkdir -p "$nd/containerd/certs.d/$REGISTRY_HOST"
    printf 'server = "http://%s"\n\n[host."http://%s"]\n  capabilities = ["pull", "resolve"]\n' \
        "$REGISTRY_HOST" "$REGISTRY_HOST" > "$nd/containerd/certs.d/$REGISTRY_HOST/hosts.toml"
    "$skopeo" copy --quiet --dest-tls-verify=false --digestfile "$nd/registry/digest" \
        "oci-archive:$archive" "docker://$REGISTRY_HOST/taintgate:$version" >&2 \
        || fail_up "pushing $archive to $REGISTRY_HOST failed"
    digest=$(cat "$nd/registry/digest")

    # What the GPU Operator (or the NVIDIA container toolkit's install) creates on a real
    # cluster: the RuntimeClass the chart's runtimeClassName names.
    printf 'apiVersion: node.k8s.io/v1\nkind: RuntimeClass\nmetadata:\n  name: nvidia\nhandler: nvidia\n' \
        | "$kubectl" --kubeconfig "$DIR/kubeconfig" apply -f - >&2 || fail_up "creating RuntimeClass nvidia failed"

    reserve_port AGENT_METRICS_PORT
    save_state
    if [ "${AGENT_VIA:-helm}" = kustomize ]; then
        node_agent_kustomize "$kubectl" "$digest"
    else
        local values=(-f "$ROOT/scripts/local-agent-values.yaml")
        [ -n "${TAINTGATE_AGENT_VALUES:-}" ] && values+=(-f "$TAINTGATE_AGENT_VALUES")
        HELM_CACHE_HOME="$DIR/helm/cache" HELM_CONFIG_HOME="$DIR/helm/config" HELM_DATA_HOME="$DIR/helm/data" \
            "$helm" --kubeconfig "$DIR/kubeconfig" install taintgate "$ROOT/charts/taintgate" \
            --namespace default "${values[@]}" \
            --set "image.repository=$REGISTRY_HOST/taintgate" --set "image.digest=$digest" \
            --set apiServer.host=127.0.0.1 --set "apiServer.port=$APISERVER_PORT" \
            --set "metricsPort=$AGENT_METRICS_PORT" >"$DIR/agent-install.log" 2>&1 \
            || { cat "$DIR/agent-install.log" >&2; fail_up "helm install failed"; }
    fi

    # Ready = released (the chart's readiness probe is the agent's /readyz).
    local ready=""
    for i in $(seq 1 900); do
        ready=$("$kubectl" --kubeconfig "$DIR/kubeconfig" -n taintgate-system get pods \
            -l app.kubernetes.io/name=taintgate -o 'jsonpath={.items[*].status.conditions[?(@.type=="Ready")].status}' 2>/dev/null || true)
        [ "$ready" = True ] && break
        pid_alive "$KUBELET_PID" || fail_up "the kubelet exited ($DIR/kubelet.log)"
        sleep 0.2
    done
    if [ "$ready" != True ]; then
        "$kubectl" --kubeconfig "$DIR/kubeconfig" -n taintgate-system get pods -o wide >&2 || true
        "$kubectl" --kubeconfig "$DIR/kubeconfig" -n taintgate-system get events >&2 || true
        tail -20 "$nd"/var-log/pods/taintgate-system_*/taintgate/*.log >&2 2>/dev/null || true
        fail_up "the agent's Pod did not become Ready (release its node) within 180 s"
    fi
    echo "local-cluster: up: agent $REGISTRY_HOST/taintgate@$digest released node $NODE_NAME (Pod Ready)" >&2
}
