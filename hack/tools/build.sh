#!/usr/bin/env bash
# Builds the local control plane's binaries from the pinned Go modules under hack/tools/,
# caching each part by version so that only the first run pays for the build.
#
#   hack/tools/build.sh        build what is missing; prints the directory holding the binaries
#   hack/tools/build.sh kueue  build only Kueue's manager (for `make bench`); prints the same
#
# Kueue (the comparison in the benchmarks) is never built by default, so `make test` and CI
# do not pay for it: only `build.sh kueue`, or RESERVOIR_TOOLS_KUEUE=1 with the rest.
# Cache: ${RESERVOIR_CACHE:-$HOME/.cache/reservoir}/bin/<part>-<version>/
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
# shellcheck source=versions.env
source "$here/versions.env"
cache="${RESERVOIR_CACHE:-$HOME/.cache/reservoir}"
bin="$cache/bin/current"
mkdir -p "$bin"
export GOFLAGS="-mod=mod -trimpath"
export CGO_ENABLED=0

log() { echo "[build] $*" >&2; }

# build_part NAME VERSION LDFLAGS PACKAGES... : go build into the versioned cache dir, once.
build_part() {
  local name="$1" version="$2" ldflags="$3"; shift 3
  local out="$cache/bin/$name-$version"
  if [ -f "$out/.complete" ]; then
    log "$name $version: cached in $out"
  else
    log "$name $version: building (first run only; Kubernetes takes a while on 2 cores)"
    local started=$SECONDS
    rm -rf "$out.tmp" && mkdir -p "$out.tmp"
    (cd "$here/$name" && go build -ldflags "$ldflags" -o "$out.tmp/" "$@")
    # A main package at a module root ending in /vN is named after its parent folder.
    if [ -f "$out.tmp/server" ]; then mv "$out.tmp/server" "$out.tmp/$name"; fi
    rm -rf "$out" && mv "$out.tmp" "$out" && touch "$out/.complete"
    log "$name $version: built in $((SECONDS - started))s"
  fi
  local f
  for f in "$out"/*; do ln -sfn "$f" "$bin/$(basename "$f")"; done
}

# Kueue's manager, sigs.k8s.io/kueue/cmd/kueue. Kueue's own go.mod has no replace
# directives, so the plain module requirement in hack/tools/kueue/go.mod builds it as is.
build_kueue() {
  build_part kueue "$KUEUE_VERSION" \
    "-s -w -X sigs.k8s.io/kueue/pkg/version.GitVersion=${KUEUE_VERSION} -X sigs.k8s.io/kueue/pkg/version.GitCommit=unknown -X sigs.k8s.io/kueue/pkg/version.BuildDate=1970-01-01T00:00:00Z" \
    sigs.k8s.io/kueue/cmd/kueue
}

case "${1:-}" in
  "") ;;
  kueue) build_kueue; echo "$bin"; exit 0 ;;
  *) echo "usage: $0 [kueue]" >&2; exit 2 ;;
esac

k8s_minor="${KUBERNETES_VERSION#v1.}"; k8s_minor="${k8s_minor%%.*}"
k8s_ldflags="-s -w"
for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
  k8s_ldflags+=" -X $pkg.gitVersion=${KUBERNETES_VERSION} -X $pkg.gitMajor=1"
  k8s_ldflags+=" -X $pkg.gitMinor=${k8s_minor} -X $pkg.gitTreeState=clean"
  k8s_ldflags+=" -X $pkg.buildDate=1970-01-01T00:00:00Z"
done

build_part etcd "$ETCD_VERSION" "-s -w" go.etcd.io/etcd/server/v3
build_part kwok "$KWOK_VERSION" "-s -w -X sigs.k8s.io/kwok/pkg/consts.Version=${KWOK_VERSION}" \
  sigs.k8s.io/kwok/cmd/kwok
# Helm's own Makefile sets, besides its version, the Kubernetes version that `helm template`
# and `helm lint` assume without --kube-version (else v1.20.0, below any chart's kubeVersion):
# the k8s.io/client-go it is built with, v0.X.Y being Kubernetes 1.X. That version is part
# of the cache key, so that a binary built without it is never reused.
helm_kube="$(awk '$1 == "k8s.io/client-go" {print $2}' "$here/helm/go.mod")"
helm_kube_minor="${helm_kube#v0.}"; helm_kube_minor="${helm_kube_minor%%.*}"
if ! [[ "$helm_kube_minor" =~ ^[0-9]+$ ]]; then
  echo "hack/tools/helm/go.mod: no k8s.io/client-go v0.X.Y requirement (found '$helm_kube')" >&2
  exit 1
fi
helm_ldflags="-s -w -X helm.sh/helm/v3/internal/version.version=${HELM_VERSION}"
for pkg in helm.sh/helm/v3/pkg/lint/rules helm.sh/helm/v3/pkg/chartutil; do
  helm_ldflags+=" -X $pkg.k8sVersionMajor=1 -X $pkg.k8sVersionMinor=${helm_kube_minor}"
done
build_part helm "${HELM_VERSION}-kube1.${helm_kube_minor}" "$helm_ldflags" helm.sh/helm/v3/cmd/helm
build_part kubernetes "$KUBERNETES_VERSION" "$k8s_ldflags" \
  k8s.io/kubernetes/cmd/kube-apiserver k8s.io/kubernetes/cmd/kube-scheduler \
  k8s.io/kubernetes/cmd/kube-controller-manager k8s.io/kubernetes/cmd/kubectl

# github.com/prometheus/prometheus v0.3XX.Y is Prometheus 3.XX.Y. The remove_all_sd tag
# leaves out the service-discovery plugins (cloud SDKs) that promtool links by default
# and that checking rules and metrics does not use: a much smaller, faster build.
prom_release="${PROMETHEUS_VERSION#v0.}"
prom_release="${prom_release:0:1}.${prom_release:1}"
prom_ldflags="-s -w"
for kv in "Version=${prom_release}" Revision=unknown Branch=HEAD BuildUser=reservoir \
  BuildDate=19700101-00:00:00; do
  prom_ldflags+=" -X github.com/prometheus/common/version.$kv"
done
build_part prometheus "$PROMETHEUS_VERSION" "$prom_ldflags" -tags=remove_all_sd \
  github.com/prometheus/prometheus/cmd/promtool
if [ "${RESERVOIR_TOOLS_KUEUE:-0}" = 1 ]; then build_kueue; fi
echo "$bin"
