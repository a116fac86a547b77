# shellcheck shell=bash
# The node of `scripts/kube-cluster start DIR --node` and its teardown in `stop DIR` (sourced by
# kube-cluster-start.sh; uses its KUBE_BIN, TOOLS_BIN, die, log, spawn, alive, wait_for,
# make_cert, write_kubeconfig, free_ports). One node per machine: containerd + runc with the CNI
# bridge, kube-scheduler, a kubelet, kube-proxy (iptables) and cluster DNS (dnsmasq in a pod).
# Everything lives under DIR/node; what the components change on the host is recorded at start
# and undone by stop (docs/kubernetes-testing.md lists it). Needs root.

NODE_NAME=cleave-node
NODE_BRIDGE=cleave0
POD_CIDR=10.88.0.0/16
NODE_IP=10.88.0.1
# The API server's --service-cluster-ip-range, and the kubelet's clusterDNS inside it.
SERVICE_CIDR=10.0.0.0/24
CLUSTER_DNS=10.0.0.10
DROP_CHAIN=CLEAVE-NODE-DROP
# Set by the kubelet at every start (1.20 has no flag to skip it), kube-proxy and the bridge.
NODE_SYSCTLS="vm.overcommit_memory kernel.panic kernel.panic_on_oops net.ipv4.ip_forward
  net.ipv4.conf.all.route_localnet net.bridge.bridge-nf-call-iptables"
# Host paths the kubelet, containerd and CNI use whatever their configuration says.
NODE_HOST_DIRS="/var/lib/kubelet /usr/libexec/kubernetes /var/log/pods /var/log/containers
  /var/lib/cni /run/netns /run/containerd"
NODE_CMDS="containerd containerd-shim-runc-v2 runc ctr iptables ip gcc busybox dnsmasq umoci skopeo"

node_preflight() {
  [ "$(id -u)" = 0 ] || die "--node needs root (containerd, iptables, cgroups)"
  local c
  for c in $NODE_CMDS; do
    command -v "$c" >/dev/null || die "$c not found (apt-get install --no-install-recommends containerd runc containernetworking-plugins iptables conntrack busybox-static umoci skopeo libc6-dev dnsmasq-base)"
  done
  [ -x /usr/lib/cni/bridge ] || die "/usr/lib/cni/bridge missing (apt-get install containernetworking-plugins)"
  local b
  for b in kube-scheduler kubelet kube-proxy; do
    [ -x "$KUBE_BIN/$b" ] || die "$KUBE_BIN/$b missing: run '$0 build' first"
  done
  if ip link show "$NODE_BRIDGE" >/dev/null 2>&1; then
    local running
    running=$(pgrep -a -x kubelet | head -n 1) || true
    [ -z "$running" ] || die "bridge $NODE_BRIDGE exists and a kubelet runs (pid ${running%% *}): a node already runs here (scripts/kube-cluster stop ITS_DIR)"
    # No kubelet: a node that was killed without its stop left the bridge (and its rules).
    log "bridge $NODE_BRIDGE exists but no kubelet runs: removing what a crashed node left (bridge, veths, iptables chains)"
    node_remove_network
  fi
}

# Saves what the node changes on the host, to DIR/node/host.saved (read by node_stop).
node_save_host() {
  local node=$1 s d
  : >"$node/host.saved"
  for s in $NODE_SYSCTLS; do
    [ -e "/proc/sys/${s//.//}" ] && echo "sysctl $s $(sysctl -n "$s")" >>"$node/host.saved"
  done
  for d in $NODE_HOST_DIRS; do
    [ -e "$d" ] || echo "created $d" >>"$node/host.saved"
  done
}

# The pause image (the pod sandbox: a process that sleeps and reaps) and the DNS image.
node_images() {
  local node=$1 sock=$2 rootfs
  rootfs=$(mktemp -d "$node/rootfs.XXXXXX")
  cat >"$node/pause.c" <<'EOF'
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>
static void on_term(int sig) { (void)sig; _exit(0); }
static void on_child(int sig) { (void)sig; while (waitpid(-1, 0, WNOHANG) > 0) continue; }
int main(void) {
  signal(SIGTERM, on_term);
  signal(SIGINT, on_term);
  signal(SIGCHLD, on_child);
  for (;;) pause();
}
EOF
  gcc -static -Os -s -o "$rootfs/pause" "$node/pause.c" || die "building the pause binary failed (apt-get install libc6-dev)"
  oci_pack "$rootfs" cleave-pause 1.0 "$node/pause.tar" --config.entrypoint /pause
  rm -rf "$rootfs" && mkdir -p "$rootfs"
  rootfs_busybox "$rootfs"
  rootfs_add_bin "$rootfs" "$(command -v dnsmasq)" usr/sbin/dnsmasq
  oci_pack "$rootfs" cleave-dnsmasq 1.0 "$node/dnsmasq.tar" --config.entrypoint /usr/sbin/dnsmasq
  rm -rf "$rootfs"
  oci_import "$sock" "$node/pause.tar"
  oci_import "$sock" "$node/dnsmasq.tar"
}

node_containerd() {
  local node=$1
  mkdir -p "$node/containerd" "$node/cni/net.d" "$node/cni/ipam"
  cat >"$node/containerd/config.toml" <<EOF
version = 2
root = "$node/containerd/root"
state = "$node/containerd/state"
oom_score = 0
[grpc]
  address = "$node/containerd.sock"
[ttrpc]
  address = "$node/containerd.sock.ttrpc"
[debug]
  address = "$node/containerd-debug.sock"
  level = "info"
[plugins]
  [plugins."io.containerd.internal.v1.opt"]
    path = "$node/containerd/opt"
  [plugins."io.containerd.grpc.v1.cri"]
    sandbox_image = "localhost/cleave-pause:1.0"
    stream_server_address = "127.0.0.1"
    stream_server_port = "0"
    enable_selinux = false
    disable_apparmor = true
    netns_mounts_under_state_dir = true
    # Root here lacks CAP_SYS_RESOURCE: runc cannot raise oom_score_adj (../shared/kube-node).
    restrict_oom_score_adj = true
    [plugins."io.containerd.grpc.v1.cri".containerd]
      snapshotter = "overlayfs"
      default_runtime_name = "runc"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
        runtime_type = "io.containerd.runc.v2"
        [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
          SystemdCgroup = false
          Root = "$node/runc"
    [plugins."io.containerd.grpc.v1.cri".cni]
      bin_dir = "/usr/lib/cni"
      conf_dir = "$node/cni/net.d"
      max_conf_num = 1
EOF
  cat >"$node/cni/net.d/10-cleave.conflist" <<EOF
{
  "cniVersion": "0.4.0",
  "name": "cleave",
  "plugins": [
    {
      "type": "bridge", "bridge": "$NODE_BRIDGE", "isGateway": true, "ipMasq": false, "hairpinMode": true,
      "ipam": {"type": "host-local", "dataDir": "$node/cni/ipam",
               "ranges": [[{"subnet": "$POD_CIDR", "gateway": "$NODE_IP"}]], "routes": [{"dst": "0.0.0.0/0"}]}
    },
    {"type": "portmap", "capabilities": {"portMappings": true}}
  ]
}
EOF
  spawn "$node" containerd containerd --config "$node/containerd/config.toml"
  wait_for "$node" containerd 30 ctr --address "$node/containerd.sock" version
}

# The bridge the pods live on (its address is the node IP: the kubelet refuses a loopback one)
# and the DROP rules that keep pod and service traffic on this machine.
node_network() {
  ip link add "$NODE_BRIDGE" type bridge
  ip addr add "$NODE_IP/${POD_CIDR#*/}" dev "$NODE_BRIDGE"
  ip link set "$NODE_BRIDGE" up
  iptables -N "$DROP_CHAIN"
  # The node IP is the host's own address (the API server and the kubelet listen on it).
  iptables -A "$DROP_CHAIN" -d "$NODE_IP" -j RETURN
  iptables -A "$DROP_CHAIN" -i "$NODE_BRIDGE" ! -o "$NODE_BRIDGE" -j DROP
  # A Service address kube-proxy did not translate to a pod would leave by the default route.
  # (Translated traffic keeps the interface of its first route in this match, so the pod range
  # is not filtered here: it is on-link on the bridge, and FORWARD covers pods' own traffic.)
  iptables -A "$DROP_CHAIN" -d "$SERVICE_CIDR" ! -o "$NODE_BRIDGE" -m conntrack ! --ctstate DNAT -j DROP
  iptables -I FORWARD 1 -j "$DROP_CHAIN"
  iptables -I OUTPUT 1 -j "$DROP_CHAIN"
  # Pod-to-Service traffic on one bridge must pass kube-proxy's iptables rules.
  modprobe br_netfilter 2>/dev/null || true
  [ -e /proc/sys/net/bridge/bridge-nf-call-iptables ] && sysctl -qw net.bridge.bridge-nf-call-iptables=1
  sysctl -qw net.ipv4.ip_forward=1
}

node_components() {
  local dir=$1 node=$1/node server=$2 pki=$1/pki
  make_cert "$pki" kubelet "/O=system:nodes/CN=system:node:$NODE_NAME" "extendedKeyUsage=clientAuth
keyUsage=digitalSignature,keyEncipherment"
  make_cert "$pki" scheduler "/CN=system:kube-scheduler" "extendedKeyUsage=clientAuth
keyUsage=digitalSignature,keyEncipherment"
  make_cert "$pki" kube-proxy "/CN=system:kube-proxy" "extendedKeyUsage=clientAuth
keyUsage=digitalSignature,keyEncipherment"
  local c
  for c in kubelet scheduler kube-proxy; do
    write_kubeconfig "$node/$c.kubeconfig" "$server" "$pki" "$c"
  done
  # RBAC only (no Node authorizer here): the system:nodes group gets the system:node role.
  KUBECONFIG=$dir/kubeconfig "$TOOLS_BIN/kubectl" create clusterrolebinding cleave-test-nodes \
    --clusterrole=system:node --group=system:nodes >/dev/null
  local sched_port kubelet_port kubelet_hz proxy_metrics proxy_hz
  read -r sched_port kubelet_port kubelet_hz proxy_metrics proxy_hz <<<"$(free_ports 5)"
  spawn "$node" kube-scheduler "$KUBE_BIN/kube-scheduler" \
    --kubeconfig "$node/scheduler.kubeconfig" \
    --authentication-kubeconfig "$node/scheduler.kubeconfig" \
    --authorization-kubeconfig "$node/scheduler.kubeconfig" \
    --bind-address 127.0.0.1 --secure-port "$sched_port" --port 0 --leader-elect=false
  cat >"$node/kubelet-config.yaml" <<EOF
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
address: $NODE_IP
port: $kubelet_port
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
healthzPort: $kubelet_hz
cgroupDriver: cgroupfs
failSwapOn: false
authentication:
  anonymous: {enabled: false}
  webhook: {enabled: true}
  x509: {clientCAFile: $pki/ca.crt}
authorization: {mode: Webhook}
volumePluginDir: $node/kubelet-plugins
clusterDomain: cluster.local
clusterDNS: [$CLUSTER_DNS]
resolvConf: /etc/resolv.conf
serializeImagePulls: false
# The test images are imported, not pulled: never garbage-collect them (a full disk would
# otherwise remove the pause image itself).
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
evictionHard: {memory.available: "100Mi", nodefs.available: "2%", imagefs.available: "2%"}
EOF
  spawn "$node" kubelet "$KUBE_BIN/kubelet" \
    --config "$node/kubelet-config.yaml" --kubeconfig "$node/kubelet.kubeconfig" \
    --container-runtime remote --container-runtime-endpoint "unix://$node/containerd.sock" \
    --root-dir "$node/kubelet" --cert-dir "$node/kubelet-pki" \
    --hostname-override "$NODE_NAME" --node-ip "$NODE_IP" --v 1
  spawn "$node" kube-proxy "$KUBE_BIN/kube-proxy" \
    --kubeconfig "$node/kube-proxy.kubeconfig" --hostname-override "$NODE_NAME" \
    --proxy-mode iptables --cluster-cidr "$POD_CIDR" --nodeport-addresses "$POD_CIDR" \
    --bind-address 127.0.0.1 --metrics-bind-address "127.0.0.1:$proxy_metrics" \
    --healthz-bind-address "127.0.0.1:$proxy_hz" --oom-score-adj 0 \
    --conntrack-max-per-core 0 --conntrack-tcp-timeout-established 0 \
    --conntrack-tcp-timeout-close-wait 0
  local ready='{.status.conditions[?(@.type=="Ready")].status}'
  wait_for "$node" kubelet 90 sh -c "KUBECONFIG='$dir/kubeconfig' '$TOOLS_BIN/kubectl' get node $NODE_NAME -o jsonpath='$ready' | grep -qx True"
}

node_dns() {
  local dir=$1 node=$1/node server=$2
  mkdir -p "$node/dns/hosts"
  : >"$node/dns/hosts/cluster"
  spawn "$node" kube-dns-sync python3 "$(dirname "${BASH_SOURCE[0]}")/kube-dns-sync.py" \
    "$server" "$dir/pki" "$node/dns/hosts/cluster"
  KUBECONFIG=$dir/kubeconfig "$TOOLS_BIN/kubectl" apply -f - >/dev/null <<EOF
apiVersion: apps/v1
kind: Deployment
metadata: {name: kube-dns, namespace: kube-system}
spec:
  replicas: 1
  selector: {matchLabels: {k8s-app: kube-dns}}
  template:
    metadata: {labels: {k8s-app: kube-dns}}
    spec:
      dnsPolicy: Default
      terminationGracePeriodSeconds: 1
      containers:
      - name: dnsmasq
        image: localhost/cleave-dnsmasq:1.0
        imagePullPolicy: Never
        args: ["--keep-in-foreground", "--pid-file=", "--log-facility=-", "--user=root", "--no-resolv",
               "--no-hosts", "--hostsdir=/dns", "--local=/cluster.local/", "--domain-needed"]
        volumeMounts: [{name: hosts, mountPath: /dns, readOnly: true}]
        readinessProbe:
          exec: {command: ["nslookup", "kubernetes.default.svc.cluster.local", "127.0.0.1"]}
          periodSeconds: 1
      volumes:
      - name: hosts
        hostPath: {path: $node/dns/hosts, type: Directory}
---
apiVersion: v1
kind: Service
metadata: {name: kube-dns, namespace: kube-system}
spec:
  clusterIP: $CLUSTER_DNS
  selector: {k8s-app: kube-dns}
  ports:
  - {name: dns, port: 53, protocol: UDP}
  - {name: dns-tcp, port: 53, protocol: TCP}
EOF
  wait_for "$node" kubelet 120 env KUBECONFIG="$dir/kubeconfig" "$TOOLS_BIN/kubectl" -n kube-system \
    rollout status deployment/kube-dns --timeout 2s
}

# node_prepare DIR: before the control plane starts, the bridge whose address (the node IP) the
# API server listens on too: pods reach it there through the `kubernetes` Service.
node_prepare() {
  local node=$1/node
  rm -rf "$node" && mkdir -p "$node"
  node_save_host "$node"
  node_network
}

# node_start DIR SERVER: the node joins the control plane started from DIR.
node_start() {
  local dir=$1 server=$2 node=$1/node t0=$SECONDS
  # shellcheck source=scripts/oci.sh
  . "$(dirname "${BASH_SOURCE[0]}")/oci.sh"
  node_containerd "$node"
  node_images "$node" "$node/containerd.sock"
  node_components "$dir" "$server"
  node_dns "$dir" "$server"
  cat >>"$dir/env" <<EOF
export CLEAVE_NODE_CONTAINERD=$node/containerd.sock
export CLEAVE_NODE_IP=$NODE_IP
EOF
  log "node $NODE_NAME Ready in $((SECONDS - t0))s (pods on $NODE_BRIDGE $POD_CIDR, services $SERVICE_CIDR, DNS $CLUSTER_DNS)"
}

# stop_pid DIR NAME: SIGTERM, a 10 s grace, SIGKILL.
stop_pid() {
  local dir=$1 name=$2 pid
  [ -f "$dir/$name.pid" ] || return 0
  pid=$(cat "$dir/$name.pid")
  if kill -0 "$pid" 2>/dev/null; then
    kill "$pid" 2>/dev/null || true
    for _ in $(seq 1 50); do
      kill -0 "$pid" 2>/dev/null || break
      sleep 0.2
    done
    kill -9 "$pid" 2>/dev/null || true
  fi
  rm -f "$dir/$name.pid"
}

# iptables chains made by kube-proxy (KUBE-*), the portmap plugin (CNI-*) and node_network.
node_iptables_cleanup() {
  local table chain
  for table in filter nat mangle; do
    # Rules in any chain that jump to one of those chains, then the chains themselves.
    iptables -t "$table" -S 2>/dev/null | grep -E -- "-j (KUBE-|CNI-|$DROP_CHAIN)" |
      while read -r rule; do
        # shellcheck disable=SC2086
        eval "iptables -t $table ${rule/-A /-D }" 2>/dev/null || true
      done
    for chain in $(iptables -t "$table" -S 2>/dev/null | awk -v d="$DROP_CHAIN" '$1 == "-N" && ($2 ~ /^(KUBE-|CNI-)/ || $2 == d) {print $2}'); do
      iptables -t "$table" -F "$chain" 2>/dev/null || true
    done
    for chain in $(iptables -t "$table" -S 2>/dev/null | awk -v d="$DROP_CHAIN" '$1 == "-N" && ($2 ~ /^(KUBE-|CNI-)/ || $2 == d) {print $2}'); do
      iptables -t "$table" -X "$chain" 2>/dev/null || true
    done
  done
}

# The pods' veths, the bridge and every chain node_network and kube-proxy made (best effort).
node_remove_network() {
  local -
  set +e +o pipefail
  local l
  for l in $(ip -o link show master "$NODE_BRIDGE" 2>/dev/null | awk -F': ' '{print $2}' | cut -d@ -f1); do
    ip link delete "$l" 2>/dev/null || true
  done
  ip link delete "$NODE_BRIDGE" 2>/dev/null || true
  node_iptables_cleanup
}

# node_stop DIR: stops the node started from DIR and restores the host.
node_stop() {
  local dir=$1 node=$1/node
  [ -d "$node" ] || return 0
  # Best effort: every step runs even when an earlier one found nothing to undo.
  local -
  set +e +o pipefail
  local n
  for n in kubelet kube-proxy kube-scheduler kube-dns-sync; do stop_pid "$node" "$n"; done
  # Every container process lives under the kubepods cgroups; kill them, then the shims.
  local procs
  procs=$(cat /sys/fs/cgroup/*/kubepods/cgroup.procs /sys/fs/cgroup/*/kubepods/*/cgroup.procs \
    /sys/fs/cgroup/*/kubepods/*/*/cgroup.procs /sys/fs/cgroup/*/kubepods/*/*/*/cgroup.procs 2>/dev/null | sort -u)
  # shellcheck disable=SC2086
  [ -z "$procs" ] || kill -9 $procs 2>/dev/null || true
  pkill -9 -f "containerd-shim-runc-v2 .*-address $node/containerd.sock" 2>/dev/null || true
  stop_pid "$node" containerd
  # Veths on the bridge, the bridge, the mounts under the node's folder (netns, rootfs overlays,
  # volumes, the kubelet's self bind mount), the pod cgroups.
  node_remove_network
  local m
  for m in $(awk -v p="$node/" 'index($2, p) == 1 || index($2, "/run/containerd/") == 1 {print $2}' /proc/self/mounts | sort -r); do
    umount -l "$m" 2>/dev/null || true
  done
  local cg
  for cg in /sys/fs/cgroup/*/kubepods; do
    [ -d "$cg" ] && find "$cg" -depth -type d -exec rmdir {} + 2>/dev/null || true
  done
  if [ -f "$node/host.saved" ]; then
    local kind key value
    while read -r kind key value; do
      case $kind in
        sysctl) sysctl -qw "$key=$value" 2>/dev/null || true ;;
        created) rm -rf "$key" ;;
      esac
    done <"$node/host.saved"
  fi
  log "stopped the node in $node and restored the host"
}
