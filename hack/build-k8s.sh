#!/usr/bin/env bash
# Builds the pinned Kubernetes test control plane (etcd, kube-apiserver, kube-scheduler,
# kube-controller-manager, kwok) and the pinned clients the tests drive (kubectl, helm,
# promtool, kubeconform) from Go modules into a per-machine cache outside git.
#
# Run by `make k8s` (and so by `make test`). A second run finds the binaries and builds nothing.
# Binaries already present in $BULKHEAD_K8S_BIN or $KUBEBUILDER_ASSETS (envtest) are used as they
# are and not built. A kubectl on PATH is never used: tests check what the pinned one prints.
#
# Environment:
#   BULKHEAD_K8S_CACHE   cache root (default ~/.cache/bulkhead); binaries go to
#                        $BULKHEAD_K8S_CACHE/k8s-$K8S_VERSION/bin
#   BULKHEAD_K8S_BIN     a directory of prebuilt binaries to use instead of building
#   KUBEBUILDER_ASSETS   envtest binaries (etcd, kube-apiserver, kubectl) to use instead
#   GO                   the go command (default: go on PATH, else /usr/local/go/bin/go)
#   BUILD_PARALLELISM    go build -p (default 2)
set -euo pipefail

# Pinned versions; hack/k8s_cluster.py reads K8S_VERSION from this line to find the cache.
K8S_VERSION=v1.33.13
ETCD_VERSION=v3.6.16
KWOK_VERSION=v0.8.0
HELM_VERSION=v3.22.0
# promtool ships in the prometheus module, whose Go versions are v0.<3xx> for Prometheus 3.x.
PROMETHEUS_VERSION=v0.316.0
KUBECONFORM_VERSION=v0.8.0

CACHE_ROOT="${BULKHEAD_K8S_CACHE:-$HOME/.cache/bulkhead}"
BIN_DIR="$CACHE_ROOT/k8s-$K8S_VERSION/bin"
SRC_DIR="$CACHE_ROOT/k8s-$K8S_VERSION/src"
PARALLELISM="${BUILD_PARALLELISM:-2}"

log() { printf '[build-k8s] %s\n' "$*" >&2; }

find_go() {
  if [[ -n "${GO:-}" ]]; then echo "$GO"; return; fi
  if command -v go >/dev/null 2>&1; then command -v go; return; fi
  if [[ -x /usr/local/go/bin/go ]]; then echo /usr/local/go/bin/go; return; fi
  log "Go is not installed (looked for \$GO, go on PATH, /usr/local/go/bin/go); install Go >= 1.24"
  exit 1
}

# Prints the directory holding a usable prebuilt $1, or nothing.
prebuilt_dir() {
  local name="$1" dir
  for dir in "${BULKHEAD_K8S_BIN:-}" "${KUBEBUILDER_ASSETS:-}"; do
    if [[ -n "$dir" && -x "$dir/$name" ]]; then echo "$dir"; return; fi
  done
}

# True when $1 must be built: not prebuilt elsewhere, and not already built at version $2.
needs_build() {
  local name="$1" version="$2" dir
  dir="$(prebuilt_dir "$name")"
  if [[ -n "$dir" ]]; then
    log "$name: using $dir/$name"
    return 1
  fi
  if [[ -x "$BIN_DIR/$name" && "$(cat "$BIN_DIR/.$name.version" 2>/dev/null)" == "$version" ]]; then
    log "$name $version: cached in $BIN_DIR"
    return 1
  fi
  return 0
}

mark_built() { echo "$2" >"$BIN_DIR/.$1.version"; }

build_etcd() {
  needs_build etcd "$ETCD_VERSION" || return 0
  # The server module's go.mod replaces its sibling modules with relative paths, so
  # `go install ...@version` refuses it; a wrapper module requires it instead, and the
  # server's own requirements pin the siblings (api, client, pkg) to the same release.
  local dir="$SRC_DIR/etcd"
  mkdir -p "$dir"
  cat >"$dir/go.mod" <<EOF
module bulkhead.dev/hack/etcd

go 1.24.0

require go.etcd.io/etcd/server/v3 $ETCD_VERSION
EOF
  log "etcd $ETCD_VERSION: building"
  (cd "$dir" && "$GO_BIN" build -mod=mod -p "$PARALLELISM" -trimpath -ldflags='-s -w' \
    -o "$BIN_DIR/etcd" go.etcd.io/etcd/server/v3)
  mark_built etcd "$ETCD_VERSION"
}

k8s_ldflags() {
  local minor major
  major="$(echo "$K8S_VERSION" | sed -E 's/^v([0-9]+)\..*/\1/')"
  minor="$(echo "$K8S_VERSION" | sed -E 's/^v[0-9]+\.([0-9]+)\..*/\1/')"
  local flags="-s -w" pkg
  # Servers report component-base's version, clients client-go's; set both so
  # `kubectl version` shows the real release instead of v0.0.0-master.
  for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
    flags+=" -X $pkg.gitVersion=$K8S_VERSION -X $pkg.gitMajor=$major -X $pkg.gitMinor=$minor"
    flags+=" -X $pkg.gitTreeState=clean -X $pkg.buildDate=$(date -u +%Y-%m-%dT%H:%M:%SZ)"
  done
  echo "$flags"
}

build_kubernetes() {
  local cmds=() name
  for name in kube-apiserver kube-scheduler kube-controller-manager; do
    needs_build "$name" "$K8S_VERSION" && cmds+=("$name")
  done
  needs_build kubectl "$K8S_VERSION" && cmds+=(kubectl)
  [[ ${#cmds[@]} -eq 0 ]] && return 0
  # k8s.io/kubernetes requires its staging modules at v0.0.0 and replaces them with
  # ./staging paths; the wrapper replaces each with its published v0.<minor>.<patch> tag.
  local dir="$SRC_DIR/kubernetes" staging_version modules module
  staging_version="v0.${K8S_VERSION#v1.}"
  mkdir -p "$dir"
  # The module's own go.mod lists the staging modules; `go mod download` honours GOPROXY.
  local gomod
  gomod="$("$GO_BIN" mod download -json "k8s.io/kubernetes@$K8S_VERSION" \
    | sed -nE 's/^\s*"GoMod": "(.*)",?$/\1/p')"
  modules="$(sed -nE 's#^\s*(k8s\.io/[a-z0-9-]+) => \./staging/.*#\1#p' "$gomod")"
  if [[ -z "$modules" ]]; then
    log "could not read the staging module list from k8s.io/kubernetes@$K8S_VERSION's go.mod"
    exit 1
  fi
  {
    printf 'module bulkhead.dev/hack/kubernetes\n\ngo 1.24.0\n\ngodebug default=go1.24\n\n'
    printf 'require k8s.io/kubernetes %s\n\nreplace (\n' "$K8S_VERSION"
    for module in $modules; do printf '\t%s => %s %s\n' "$module" "$module" "$staging_version"; done
    printf ')\n'
  } >"$dir/go.mod"
  local pkgs=()
  for name in "${cmds[@]}"; do pkgs+=("k8s.io/kubernetes/cmd/$name"); done
  log "kubernetes $K8S_VERSION: building ${cmds[*]}"
  (cd "$dir" && "$GO_BIN" build -mod=mod -p "$PARALLELISM" -trimpath -ldflags="$(k8s_ldflags)" \
    -o "$BIN_DIR/" "${pkgs[@]}")
  for name in "${cmds[@]}"; do mark_built "$name" "$K8S_VERSION"; done
}

# Modules without replace lines install directly at a version.
go_install() {
  local name="$1" version="$2" pkg="$3" ldflags="$4"
  needs_build "$name" "$version" || return 0
  log "$name $version: building"
  GOBIN="$BIN_DIR" "$GO_BIN" install -p "$PARALLELISM" -trimpath -ldflags="$ldflags" "$pkg@$version"
  mark_built "$name" "$version"
}

main() {
  GO_BIN="$(find_go)"
  export GOTOOLCHAIN="${GOTOOLCHAIN:-local}"
  export GOFLAGS="${GOFLAGS:--buildvcs=false}"
  # Static binaries, as the upstream releases are: no C toolchain needed, no libc coupling.
  export CGO_ENABLED=0
  mkdir -p "$BIN_DIR"
  local start=$SECONDS
  build_etcd
  build_kubernetes
  go_install kwok "$KWOK_VERSION" sigs.k8s.io/kwok/cmd/kwok \
    "-s -w -X sigs.k8s.io/kwok/pkg/consts.Version=$KWOK_VERSION"
  go_install helm "$HELM_VERSION" helm.sh/helm/v3/cmd/helm \
    "-s -w -X helm.sh/helm/v3/internal/version.version=$HELM_VERSION"
  go_install promtool "$PROMETHEUS_VERSION" github.com/prometheus/prometheus/cmd/promtool \
    "-s -w -X github.com/prometheus/common/version.Version=$PROMETHEUS_VERSION"
  go_install kubeconform "$KUBECONFORM_VERSION" github.com/yannh/kubeconform/cmd/kubeconform \
    "-s -w -X main.version=$KUBECONFORM_VERSION"
  log "control-plane binaries ready ($((SECONDS - start)) s; cache $BIN_DIR)"
}

main "$@"
