#!/usr/bin/env bash
# Build pdfleet's OCI images without a container engine: a Debian root filesystem from debootstrap,
# a virtualenv installed with pip inside it (chroot), packed as OCI layers by umoci, exported by skopeo.
#
#   images/build.sh VARIANT [--torch-index URL|none] [--update-lock] [--no-verify]
#
# VARIANT      operator | runtime-cpu | runtime-cuda
# --torch-index  runtime-cpu only: where the CPU build of torch comes from (default: PyTorch's CPU
#              index; PyPI's x86_64 torch is the CUDA build, ~4.5 GB with its nvidia-* wheels).
#              `none` leaves torch and NIXL (which requires torch) out: tag suffix -notorch.
# --update-lock  write images/locks/VARIANT.txt from what pip resolved (later builds use it as -c).
#
# Needs root (debootstrap, chroot) and the Debian packages debootstrap, umoci, skopeo (installed here
# when missing). Outputs live in the cache, never in git:
#   $PDFLEET_CACHE/images/oci                     one OCI layout, a tag per build
#   $PDFLEET_CACHE/images/out/pdfleet-VARIANT-VERSION.oci.tar   the image (oci-archive)
# A build is keyed by its inputs (Debian packages, Python requirements and lock, source tree); a
# second run with the same inputs only re-runs the entrypoint check. Layers: the Debian base (shared
# by every build with the same package set), then /opt/pdfleet.
set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cache=${PDFLEET_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/pdfleet}
root="$cache/images"
suite=bookworm                       # Debian 12: python3 3.11 (pdfleet needs >= 3.11)
mirror=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
version=$(sed -n 's/^version = "\(.*\)"/\1/p' "$repo/pyproject.toml")
torch_version=2.11.0
say() { printf '[images] %s\n' "$*" >&2; }
die() { printf 'images/build.sh: %s\n' "$*" >&2; exit 2; }

variant=${1:-}; shift || true
torch_index=https://download.pytorch.org/whl/cpu
update_lock=0 verify=1 extra_check=()
while (($#)); do
  case $1 in
    --torch-index) torch_index=$2; shift 2 ;;
    --update-lock) update_lock=1; shift ;;
    --no-verify) verify=0; shift ;;
    *) die "unknown argument $1" ;;
  esac
done

# What each variant holds. uid: the image's user (the chart's operator pod runs as 65532; the
# operator gives runtime pods runAsUser 1000, resources/pods.py RUNTIME_UID).
case $variant in
  operator)
    debs=(python3 python3-venv ca-certificates)
    pip_args=("/src")
    uid=65532 entrypoint=pdfleet-operator check=(pdfleet-operator --version) tag_suffix="" ;;
  runtime-cpu)
    # Mooncake's CPU wheel links libibverbs (even when it only uses TCP), libnuma and libcurl (etcd client).
    debs=(python3 python3-venv ca-certificates libibverbs1 libnuma1 libcurl4)
    uid=1000 entrypoint=pdfleet-runtime check=(pdfleet-runtime --version)
    # The engine's native library must load in the image (it links libibverbs).
    extra_check=(python -c "import mooncake.engine; print('mooncake engine loads')")
    if [ "$torch_index" = none ]; then
      pip_args=("/src" "mooncake-transfer-engine-non-cuda==0.3.13.post1"); tag_suffix=-notorch
    else
      pip_args=(--extra-index-url "$torch_index" "torch==$torch_version+cpu" "/src[engines]"); tag_suffix=""
    fi ;;
  runtime-cuda)
    # torch from PyPI is the CUDA 13 build (its nvidia-* wheels carry the CUDA user-space libraries;
    # the driver comes from the node). The CUDA 13 engine wheels match it. RDMA user-space for real NICs.
    debs=(python3 python3-venv ca-certificates libibverbs1 ibverbs-providers librdmacm1 libnuma1 libcurl4)
    pip_args=("/src[torch]" "nixl-cu13==1.5.1" "mooncake-transfer-engine-cuda13==0.3.14")
    uid=1000 entrypoint=pdfleet-runtime check=(pdfleet-runtime --version) tag_suffix="" ;;
  *) die "VARIANT must be operator, runtime-cpu or runtime-cuda (got '${variant}')" ;;
esac

[ "$(id -u)" = 0 ] || die "needs root (debootstrap and chroot)"
missing=()
for tool in debootstrap umoci skopeo; do command -v $tool >/dev/null || missing+=("$tool"); done
if ((${#missing[@]})); then
  say "installing Debian packages: ${missing[*]}"
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
fi
mkdir -p "$root"/{base,work,out}
layout="$root/oci"
[ -f "$layout/index.json" ] || umoci init --layout "$layout"

lock="$repo/images/locks/$variant$tag_suffix.txt"
sources=$(cd "$repo" && git ls-files -co --exclude-standard pyproject.toml README.md operator runtime \
  | grep -v -e '/__pycache__/' -e '\.egg-info/' | sort)
base_key=$(printf '%s\n' "$suite" "${debs[@]}" | sha256sum | cut -c1-12)
build_key=$( { echo "$base_key" "$uid" "$entrypoint" "${pip_args[@]}"; cat "$lock" 2>/dev/null || true;
  cat "$repo/images/build.sh"; (cd "$repo" && sha256sum $sources); } | sha256sum | cut -c1-12)
tag="$variant$tag_suffix-$version-$build_key"
archive="$root/out/pdfleet-$variant$tag_suffix-$version.oci.tar"
t0=$SECONDS

# Tags in the layout (read once: `umoci ls | grep -q` would fail under pipefail when grep exits early).
has_tag() { local tags; tags=$(umoci ls --layout "$layout"); grep -qx "$1" <<<"$tags"; }
in_root() { chroot "$1" /usr/bin/env -i PATH=/opt/pdfleet/bin:/usr/sbin:/usr/bin:/sbin:/bin HOME=/root "${@:2}"; }

if has_tag "$tag"; then
  say "$tag is cached"
else
  # 1. The Debian base, one per package set: debootstrap, then trim what no container needs.
  base_tag="base-$base_key"
  if ! has_tag "$base_tag"; then
    say "debootstrap $suite (${debs[*]})"
    rm -rf "$root/base/$base_key" && mkdir -p "$root/base/$base_key"
    debootstrap --variant=minbase --include="$(IFS=,; echo "${debs[*]}")" "$suite" \
      "$root/base/$base_key/rootfs" "$mirror" > "$root/base/$base_key/debootstrap.log" 2>&1 \
      || die "debootstrap failed: $root/base/$base_key/debootstrap.log"
    r="$root/base/$base_key/rootfs"
    rm -rf "$r"/usr/share/{doc,man,info,locale}/* "$r"/var/cache/apt/* "$r"/var/lib/apt/lists/* \
      "$r"/var/cache/debconf/*-old "$r"/var/log/*.log "$r"/var/log/apt/*
    umoci new --image "$layout:$base_tag"
    rm -rf "$root/work/$base_tag"
    umoci unpack --image "$layout:$base_tag" "$root/work/$base_tag" >/dev/null
    cp -a "$r"/. "$root/work/$base_tag/rootfs/"
    umoci repack --image "$layout:$base_tag" "$root/work/$base_tag"
    rm -rf "$root/work/$base_tag" "$r"
    say "base layer $base_tag packed ($((SECONDS - t0))s)"
  fi

  # 2. /opt/pdfleet: a virtualenv with pdfleet and its pinned dependencies, built inside the base.
  b="$root/work/$tag"
  rm -rf "$b"
  umoci unpack --image "$layout:$base_tag" "$b" >/dev/null
  r="$b/rootfs"
  mkdir -p "$r/src"
  (cd "$repo" && tar -cf - $sources) | tar -xf - -C "$r/src"
  cp /etc/resolv.conf "$r/etc/resolv.conf"
  # A TLS-intercepting proxy's CA (the host's PIP_CERT / SSL_CERT_FILE) is used for the build only,
  # never left in the image.
  pip_env=(PIP_DEFAULT_TIMEOUT="${PIP_DEFAULT_TIMEOUT:-120}")
  for v in PIP_INDEX_URL PIP_EXTRA_INDEX_URL; do [ -n "${!v:-}" ] && pip_env+=("$v=${!v}"); done
  build_ca=${PIP_CERT:-${SSL_CERT_FILE:-}}
  if [ -n "$build_ca" ] && [ -f "$build_ca" ]; then cp "$build_ca" "$r/src/build-ca.crt"; pip_env+=(PIP_CERT=/src/build-ca.crt); fi
  constraints=()
  if [ -f "$lock" ] && [ "$update_lock" = 0 ]; then cp "$lock" "$r/src/lock.txt"; constraints=(-c /src/lock.txt); fi
  say "pip install ${pip_args[*]}"
  in_root "$r" python3 -m venv /opt/pdfleet
  in_root "$r" "${pip_env[@]}" /opt/pdfleet/bin/pip install -q --no-cache-dir --disable-pip-version-check --progress-bar off \
    "${constraints[@]}" "${pip_args[@]}"
  in_root "$r" /opt/pdfleet/bin/pip freeze --exclude-editable | grep -v -e '^pdfleet' > "$b/freeze.txt"
  if [ "$update_lock" = 1 ]; then mkdir -p "$(dirname "$lock")"; cp "$b/freeze.txt" "$lock"; say "wrote $lock"; fi
  in_root "$r" /opt/pdfleet/bin/pip uninstall -q -y pip
  find "$r/opt/pdfleet" -name __pycache__ -type d -prune -exec rm -rf {} +
  rm -rf "$r/src" "$r/root/.cache"
  : > "$r/etc/resolv.conf"
  echo "pdfleet:x:$uid:$uid:pdfleet:/home/pdfleet:/usr/sbin/nologin" >> "$r/etc/passwd"
  echo "pdfleet:x:$uid:" >> "$r/etc/group"
  install -d -o "$uid" -g "$uid" -m 0750 "$r/home/pdfleet"
  umoci repack --image "$layout:$tag" "$b"
  umoci config --image "$layout:$tag" --config.user "$uid:$uid" --config.workingdir /home/pdfleet \
    --config.env PATH=/opt/pdfleet/bin:/usr/local/bin:/usr/bin:/bin --config.env PYTHONDONTWRITEBYTECODE=1 \
    --config.env PYTHONUNBUFFERED=1 --config.entrypoint "$entrypoint" \
    --clear=config.cmd --config.label "org.opencontainers.image.title=pdfleet-$variant" \
    --config.label "org.opencontainers.image.version=$version" \
    --config.label "io.pdfleet.build-key=$build_key" --config.label "io.pdfleet.torch=$tag_suffix" \
    --history.comment "pdfleet $variant $version"
  # What went in, next to the archive: pip's resolution and the Debian package versions.
  cp "$b/freeze.txt" "$root/out/pdfleet-$variant$tag_suffix-$version.freeze.txt"
  in_root "$r" dpkg-query -W > "$root/out/pdfleet-$variant$tag_suffix-$version.dpkg.txt"
  rm -rf "$b"
  # Older builds of this variant and version are superseded: untag them so gc frees their layers.
  for old in $(umoci ls --layout "$layout"); do
    case $old in "$variant$tag_suffix-$version-"*) [ "$old" = "$tag" ] || umoci rm --image "$layout:$old" ;; esac
  done
  umoci gc --layout "$layout"
  rm -f "$archive"
  skopeo copy -q "oci:$layout:$tag" "oci-archive:$archive:pdfleet-$variant$tag_suffix:$version"
  say "built $tag in $((SECONDS - t0))s: $archive ($(du -h "$archive" | cut -f1))"
fi

# 3. Prove the entrypoint starts: unpack the image and run it in a chroot as the image's user.
if [ "$verify" = 1 ]; then
  v="$root/work/verify-$tag"
  rm -rf "$v"
  umoci unpack --image "$layout:$tag" "$v" >/dev/null
  out=$(chroot --userspec="$uid:$uid" "$v/rootfs" /usr/bin/env -i PATH=/opt/pdfleet/bin:/usr/bin:/bin \
    HOME=/home/pdfleet "${check[@]}")
  if ((${#extra_check[@]})); then
    chroot --userspec="$uid:$uid" "$v/rootfs" /usr/bin/env -i PATH=/opt/pdfleet/bin:/usr/bin:/bin \
      HOME=/home/pdfleet "${extra_check[@]}" >&2
  fi
  size=$(du -sh "$v/rootfs" | cut -f1)
  rm -rf "$v"
  say "verified: '${check[*]}' as uid $uid -> $out (unpacked $size)"
  echo "$out"
fi
