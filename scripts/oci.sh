# shellcheck shell=bash
# OCI images without a container engine (sourced by scripts/image and scripts/kube-node.sh):
# a root filesystem assembled in a folder, packed with umoci, written as a docker-archive with
# skopeo, imported into a containerd with ctr. Callers define die and log.

# rootfs_add_bin ROOTFS FILE DEST: copies the executable FILE to ROOTFS/DEST (debug info stripped)
# with every shared library ldd lists, at the path the dynamic loader looks for it.
rootfs_add_bin() {
  local rootfs=$1 file=$2 dest=$3
  mkdir -p "$rootfs/$(dirname "$dest")"
  cp "$file" "$rootfs/$dest"
  strip --strip-debug "$rootfs/$dest" 2>/dev/null || true
  rootfs_add_libs "$rootfs" "$file"
}

# rootfs_add_libs ROOTFS FILE: the shared libraries FILE needs (per ldd), copied into ROOTFS at
# the same paths (symlinked directories such as /lib -> usr/lib resolved to real files).
rootfs_add_libs() {
  local rootfs=$1 file=$2 lib
  while read -r lib; do
    [ -n "$lib" ] && [ -e "$lib" ] || continue
    [ -e "$rootfs/$lib" ] && continue
    mkdir -p "$rootfs/$(dirname "$lib")"
    cp -L "$lib" "$rootfs/$lib"
  done < <(ldd "$file" 2>/dev/null | awk '/=> \//{print $3} /^[[:space:]]*\/[^ ]+ \(/{print $1}')
}

# rootfs_busybox ROOTFS: a minimal userland (sh, cp, nslookup…) from busybox-static, /tmp, and
# /etc/passwd naming the non-root user the images run as.
rootfs_busybox() {
  local rootfs=$1 bb
  bb=$(command -v busybox) || die "busybox not found (apt-get install busybox-static)"
  mkdir -p "$rootfs/bin" "$rootfs/etc" "$rootfs/tmp"
  chmod 1777 "$rootfs/tmp"
  cp "$bb" "$rootfs/bin/busybox"
  "$rootfs/bin/busybox" --install -s "$rootfs/bin"
  # --install links by absolute path of the host; relink relative to the image's /bin.
  local l
  for l in "$rootfs"/bin/*; do
    [ -L "$l" ] && ln -sf busybox "$l"
  done
  printf 'root:x:0:0:root:/root:/bin/sh\nnonroot:x:65532:65532:nonroot:/home/nonroot:/bin/sh\n' >"$rootfs/etc/passwd"
  printf 'root:x:0:\nnonroot:x:65532:\n' >"$rootfs/etc/group"
}

# oci_pack ROOTFS NAME TAG OUT_TAR [umoci config flags...]: packs ROOTFS as the image
# localhost/NAME:TAG into the docker-archive OUT_TAR (ctr and `docker load` both read it).
oci_pack() {
  local rootfs=$1 name=$2 tag=$3 out=$4
  shift 4
  command -v umoci >/dev/null || die "umoci not found (apt-get install umoci)"
  command -v skopeo >/dev/null || die "skopeo not found (apt-get install skopeo)"
  local work
  work=$(mktemp -d "${TMPDIR:-/tmp}/cleave-oci.XXXXXX")
  umoci init --layout "$work/layout" >/dev/null
  umoci new --image "$work/layout:$tag" >/dev/null
  umoci unpack --image "$work/layout:$tag" "$work/bundle" >/dev/null
  cp -a "$rootfs/." "$work/bundle/rootfs/"
  umoci repack --image "$work/layout:$tag" "$work/bundle" >/dev/null
  umoci config --image "$work/layout:$tag" --author cleave "$@" >/dev/null
  rm -f "$out"
  skopeo --insecure-policy copy --quiet "oci:$work/layout:$tag" \
    "docker-archive:$out:localhost/$name:$tag" >/dev/null ||
    { rm -rf "$work"; die "skopeo could not write $out"; }
  rm -rf "$work"
}

# oci_import SOCK TAR: imports an image archive into the containerd at SOCK (Kubernetes'
# namespace), so that pods with imagePullPolicy IfNotPresent/Never find it.
oci_import() {
  local sock=$1 tar=$2
  ctr --address "$sock" -n k8s.io images import "$tar" >/dev/null ||
    die "ctr could not import $tar into $sock"
}
