# shellcheck shell=bash
# `start` and `stop` of scripts/kube-cluster (sourced by it; uses its KUBE_BIN, TOOLS_BIN, die, log).

# shellcheck source=scripts/kube-node.sh
. "$(dirname "${BASH_SOURCE[0]}")/kube-node.sh"

# Prints N distinct free loopback ports.
free_ports() {
  python3 - "$1" <<'EOF'
import socket, sys
socks = []
for _ in range(int(sys.argv[1])):
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    socks.append(s)
print(" ".join(str(s.getsockname()[1]) for s in socks))
EOF
}

# make_cert NAME SUBJECT EXTENSIONS: a key and a certificate signed by DIR/pki/ca.
make_cert() {
  local pki=$1 name=$2 subj=$3 ext=$4
  openssl genrsa -out "$pki/$name.key" 2048 2>/dev/null
  openssl req -new -key "$pki/$name.key" -subj "$subj" -out "$pki/$name.csr" 2>/dev/null
  printf '%s\n' "$ext" >"$pki/$name.ext"
  openssl x509 -req -sha256 -in "$pki/$name.csr" -CA "$pki/ca.crt" -CAkey "$pki/ca.key" \
    -CAcreateserial -days 365 -extfile "$pki/$name.ext" -out "$pki/$name.crt" 2>/dev/null
}

make_pki() {
  local pki=$1
  mkdir -p "$pki"
  openssl genrsa -out "$pki/ca.key" 2048 2>/dev/null
  openssl req -x509 -new -nodes -sha256 -key "$pki/ca.key" -subj "/CN=cleave-test-ca" -days 3650 \
    -out "$pki/ca.crt" 2>/dev/null
  make_cert "$pki" apiserver "/CN=kube-apiserver" \
    "subjectAltName=IP:127.0.0.1,IP:10.0.0.1,IP:$NODE_IP,DNS:localhost,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc
extendedKeyUsage=serverAuth
keyUsage=digitalSignature,keyEncipherment"
  make_cert "$pki" admin "/O=system:masters/CN=cleave-admin" \
    "extendedKeyUsage=clientAuth
keyUsage=digitalSignature,keyEncipherment"
  # The controller-manager runs every controller under its own identity; on this throwaway
  # cluster it is a member of system:masters rather than the per-controller service accounts.
  make_cert "$pki" controller-manager "/O=system:masters/CN=system:kube-controller-manager" \
    "extendedKeyUsage=clientAuth
keyUsage=digitalSignature,keyEncipherment"
  # The API server's identity towards kubelets (logs, exec, port-forward).
  make_cert "$pki" apiserver-kubelet-client "/O=system:masters/CN=kube-apiserver-kubelet-client" \
    "extendedKeyUsage=clientAuth
keyUsage=digitalSignature,keyEncipherment"
  openssl genrsa -out "$pki/sa.key" 2048 2>/dev/null
  openssl rsa -in "$pki/sa.key" -pubout -out "$pki/sa.pub" 2>/dev/null
  [ -s "$pki/sa.pub" ] && [ -s "$pki/admin.crt" ] && [ -s "$pki/apiserver.crt" ] ||
    die "making certificates with openssl failed"
}

# write_kubeconfig FILE SERVER USER: a kubeconfig with the certificates embedded.
write_kubeconfig() {
  local file=$1 server=$2 pki=$3 user=$4
  cat >"$file" <<EOF
apiVersion: v1
kind: Config
clusters:
- name: cleave-test
  cluster:
    server: $server
    certificate-authority-data: $(base64 -w0 "$pki/ca.crt")
users:
- name: $user
  user:
    client-certificate-data: $(base64 -w0 "$pki/$user.crt")
    client-key-data: $(base64 -w0 "$pki/$user.key")
contexts:
- name: cleave-test
  context:
    cluster: cleave-test
    user: $user
    namespace: default
current-context: cleave-test
EOF
}

# spawn DIR NAME CMD...: runs CMD in the background, output in DIR/NAME.log, pid in DIR/NAME.pid.
spawn() {
  local dir=$1 name=$2
  shift 2
  setsid "$@" </dev/null >"$dir/$name.log" 2>&1 &
  echo $! >"$dir/$name.pid"
}

alive() { [ -f "$1/$2.pid" ] && kill -0 "$(cat "$1/$2.pid")" 2>/dev/null; }

# fail DIR MESSAGE: prints the logs, stops what was started, exits non-zero. DIR is the cluster's
# folder or its node/ subfolder.
fail() {
  local dir=$1
  shift
  [ "$(basename "$dir")" = node ] && dir=$(dirname "$dir")
  for f in "$dir"/*.log "$dir"/node/*.log; do
    [ -f "$f" ] || continue
    echo "----- last lines of $f" >&2
    tail -n 30 "$f" >&2
  done
  # Why a node is not Ready is in its conditions (disk pressure, runtime, network), not the logs.
  if [ -f "$dir/kubeconfig" ] && [ -x "$TOOLS_BIN/kubectl" ]; then
    echo "----- node conditions" >&2
    KUBECONFIG="$dir/kubeconfig" timeout 10 "$TOOLS_BIN/kubectl" get nodes -o \
      jsonpath='{range .items[*].status.conditions[*]}{.type}={.status} {.reason}: {.message}{"\n"}{end}' >&2 || true
  fi
  echo "----- disk: $(df -h "$dir" | tail -n 1)" >&2
  cmd_stop "$dir" >/dev/null 2>&1 || true
  die "$*"
}

# wait_for DIR NAME SECONDS CMD...: waits until CMD succeeds while process NAME lives.
wait_for() {
  local dir=$1 name=$2 secs=$3
  shift 3
  local deadline=$((SECONDS + secs))
  until "$@" >/dev/null 2>&1; do
    alive "$dir" "$name" || fail "$dir" "$name exited while starting (see $dir/$name.log)"
    [ $SECONDS -lt $deadline ] || fail "$dir" "$name not ready after ${secs}s"
    sleep 0.5
  done
}

# cmd_start DIR [--node]
cmd_start() {
  local dir with_node=0
  [ "${2:-}" = --node ] && with_node=1
  [ $with_node = 0 ] || node_preflight
  mkdir -p "$1" && dir=$(cd "$1" && pwd)
  for b in "$KUBE_BIN/kube-apiserver" "$KUBE_BIN/kube-controller-manager" "$TOOLS_BIN/kubectl"; do
    [ -x "$b" ] || die "$b missing: run '$0 build' first"
  done
  local etcd_bin
  etcd_bin=$(command -v etcd) || die "etcd not found (apt-get install etcd-server)"
  command -v openssl >/dev/null || die "openssl not found"
  for n in etcd kube-apiserver kube-controller-manager; do
    alive "$dir" "$n" && die "$n already runs from $dir (pid $(cat "$dir/$n.pid")); stop it first"
  done
  local t0=$SECONDS
  rm -rf "$dir/pki" "$dir/etcd-data"
  make_pki "$dir/pki"
  local pki=$dir/pki etcd_port peer_port api_port cm_port
  read -r etcd_port peer_port api_port cm_port <<<"$(free_ports 4)"

  spawn "$dir" etcd "$etcd_bin" --name default --data-dir "$dir/etcd-data" \
    --listen-client-urls "http://127.0.0.1:$etcd_port" \
    --advertise-client-urls "http://127.0.0.1:$etcd_port" \
    --listen-peer-urls "http://127.0.0.1:$peer_port" \
    --initial-advertise-peer-urls "http://127.0.0.1:$peer_port" \
    --initial-cluster "default=http://127.0.0.1:$peer_port"
  wait_for "$dir" etcd 30 curl -sf "http://127.0.0.1:$etcd_port/health"

  # With a node, the API server listens on the node IP (the bridge's address, on this machine
  # only): pods reach it there through the `kubernetes` Service, whose endpoint it advertises.
  local bind=127.0.0.1
  if [ $with_node = 1 ]; then
    node_prepare "$dir"
    bind=$NODE_IP
  fi
  local server="https://$bind:$api_port"
  # Without a node, ServiceAccount admission is off: no kubelet runs, and pods created by tests
  # in a fresh namespace must not wait for the default service account and its token secret.
  # With one, pods get their service account's token (the operator and router pods need it).
  local admission=(--disable-admission-plugins ServiceAccount)
  [ $with_node = 0 ] || admission=(--enable-admission-plugins ServiceAccount)
  spawn "$dir" kube-apiserver "$KUBE_BIN/kube-apiserver" \
    --etcd-servers "http://127.0.0.1:$etcd_port" \
    --bind-address "$bind" --advertise-address "$bind" \
    --secure-port "$api_port" --insecure-port 0 \
    --tls-cert-file "$pki/apiserver.crt" --tls-private-key-file "$pki/apiserver.key" \
    --client-ca-file "$pki/ca.crt" \
    --authorization-mode RBAC \
    --service-account-issuer "https://kubernetes.default.svc.cluster.local" \
    --service-account-key-file "$pki/sa.pub" \
    --service-account-signing-key-file "$pki/sa.key" \
    --service-cluster-ip-range 10.0.0.0/24 \
    "${admission[@]}" \
    --kubelet-client-certificate "$pki/apiserver-kubelet-client.crt" \
    --kubelet-client-key "$pki/apiserver-kubelet-client.key" \
    --kubelet-preferred-address-types InternalIP \
    --profiling=false
  local curl_admin=(curl -sf --cacert "$pki/ca.crt" --cert "$pki/admin.crt" --key "$pki/admin.key")
  wait_for "$dir" kube-apiserver 90 "${curl_admin[@]}" "$server/readyz"

  write_kubeconfig "$dir/kubeconfig" "$server" "$pki" admin
  write_kubeconfig "$dir/controller-manager.kubeconfig" "$server" "$pki" controller-manager
  spawn "$dir" kube-controller-manager "$KUBE_BIN/kube-controller-manager" \
    --kubeconfig "$dir/controller-manager.kubeconfig" \
    --authentication-kubeconfig "$dir/controller-manager.kubeconfig" \
    --authorization-kubeconfig "$dir/controller-manager.kubeconfig" \
    --bind-address 127.0.0.1 --secure-port "$cm_port" --port 0 \
    --leader-elect=false --controllers '*' \
    --service-account-private-key-file "$pki/sa.key" --root-ca-file "$pki/ca.crt" \
    --profiling=false
  wait_for "$dir" kube-controller-manager 60 curl -sfk "https://127.0.0.1:$cm_port/healthz"

  # The apiserver creates `default` itself shortly after it is ready.
  wait_for "$dir" kube-apiserver 30 "${curl_admin[@]}" "$server/api/v1/namespaces/default"

  cat >"$dir/env" <<EOF
export KUBECONFIG=$dir/kubeconfig
export PATH=$TOOLS_BIN:$KUBE_BIN:\$PATH
EOF
  [ $with_node = 0 ] || node_start "$dir" "$server"
  log "cluster up in $((SECONDS - t0))s at $server (logs in $dir/*.log)"
  cat "$dir/env"
}

cmd_stop() {
  local dir=$1
  [ -d "$dir" ] || die "$dir: no such directory"
  node_stop "$dir"
  local n
  for n in kube-controller-manager kube-apiserver etcd; do stop_pid "$dir" "$n"; done
  log "stopped the cluster in $dir"
}
