#!/usr/bin/env bash
# Builds the image `prefect-elastic:local` of the compose stack (docker-compose.yml), with no image registry:
#
#   1. a Debian bookworm rootfs (debootstrap minbase with python3, python3-venv and postgresql), imported
#      as the base image `prefect-elastic/bookworm-base:<version>`;
#   2. a wheelhouse of the project's dependencies made on the host by pip (torch==2.13.0 resolves to the
#      CPU wheel here), plus asyncpg for the Prefect server on PostgreSQL;
#   3. the project itself as a wheel, and `docker build` of ./Dockerfile on top of the base image.
#
# Steps 1 and 2 are cached under $PREFECT_ELASTIC_CACHE (default ~/.cache/prefect-elastic): the rootfs
# tarball and the wheelhouse are made once (the wheelhouse again only when pyproject.toml's dependencies
# change), and Docker's layer cache makes a rebuild after a code change take seconds.
#
# Needs a running Docker engine (DOCKER_HOST), debootstrap and docker (scripts/install-docker.sh), root for
# debootstrap, and the project's virtualenv (scripts/setup.sh) for pip. Usage: scripts/build-image.sh [TAG]
set -euo pipefail
cd "$(dirname "$0")/.."

TAG=${1:-prefect-elastic:local}
CACHE=${PREFECT_ELASTIC_CACHE:-$HOME/.cache/prefect-elastic}
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
PIP=${PIP:-.venv/bin/pip}
# Bump BASE_VERSION when BASE_PACKAGES change, so a cached rootfs of other packages is not reused.
BASE_VERSION=1
BASE_PACKAGES=python3,python3-venv,postgresql
BASE_IMAGE=prefect-elastic/bookworm-base:$BASE_VERSION
TORCH=torch==2.13.0
mkdir -p "$CACHE"

say() { printf '[build-image] %s\n' "$*" >&2; }

# 1. The base image. debootstrap is the slow part (about 90 s), so its result is kept as a tarball
#    and imported again only when the engine does not have the image (a fresh data-root, for instance).
if ! docker image inspect "$BASE_IMAGE" >/dev/null 2>&1; then
  rootfs_tar=$CACHE/rootfs-bookworm-$BASE_VERSION.tar
  if [ ! -s "$rootfs_tar" ]; then
    say "debootstrap bookworm ($BASE_PACKAGES) from $MIRROR"
    work=$(mktemp -d "$CACHE/rootfs.XXXXXX")
    # --one-file-system: a failed debootstrap can leave /proc and /sys of the rootfs mounted.
    trap 'rm -rf --one-file-system "$work"' EXIT
    debootstrap --variant=minbase --include="$BASE_PACKAGES" bookworm "$work/rootfs" "$MIRROR" >"$work/log" 2>&1 ||
      {
        tail -n 30 "$work/log" >&2
        exit 1
      }
    # The package lists and the .deb archives are of no use in the image.
    rm -rf "$work/rootfs/var/cache/apt/archives/"*.deb "$work/rootfs/var/lib/apt/lists/"*
    tar -C "$work/rootfs" --numeric-owner -cf "$rootfs_tar.part" .
    mv "$rootfs_tar.part" "$rootfs_tar"
    rm -rf "$work"
    trap - EXIT
  fi
  say "docker import $BASE_IMAGE"
  docker import "$rootfs_tar" "$BASE_IMAGE" >/dev/null
fi

# 2. The wheelhouse of the dependencies. The versions are those of the project's virtualenv (its `pip
#    freeze` as constraints), so the image runs what the test suite ran. Keyed by the requirements and the
#    constraints, so a dependency change makes a new wheelhouse and an old one is never mixed into it.
# async-timeout: redis (of prefect) needs it on Python < 3.11.3, which bookworm's 3.11.2 is and the host's
# Python may not be, so pip here would not fetch it by itself.
requirements=$(
  printf '%s\n' "$TORCH" asyncpg async-timeout
  # The project's dependencies and its extras `server` (the Prefect server's pins, asyncpg) and `demo`
  # (scikit-learn, for the digits dataset).
  python3 - <<'PY'
import tomllib

project = tomllib.load(open("pyproject.toml", "rb"))["project"]
extras = project.get("optional-dependencies", {})
print("\n".join(project["dependencies"] + extras.get("server", []) + extras.get("demo", [])))
PY
)
constraints=$("$PIP" freeze --exclude-editable | grep -v -i '^prefect-elastic' || true)
key=$(printf '%s\n' "$requirements" "$constraints" | sha256sum | cut -c1-16)
wheels=$CACHE/wheels-$key
if [ ! -f "$wheels/requirements.txt" ]; then
  say "pip wheel: dependencies into $wheels"
  rm -rf "$wheels.part"
  mkdir -p "$wheels.part"
  printf '%s\n' "$requirements" >"$wheels.part/requirements.in"
  printf '%s\n' "$constraints" >"$wheels.part/constraints.txt"
  # Local find-links and index folders make pip warn once per package; only a failure's output matters.
  "$PIP" wheel --quiet --wheel-dir "$wheels.part" -r "$wheels.part/requirements.in" \
    -c "$wheels.part/constraints.txt" >"$wheels.part/pip.log" 2>&1 ||
    {
      tail -n 40 "$wheels.part/pip.log" >&2
      exit 1
    }
  # The image installs exactly these files, so pip there needs no index and resolves nothing new.
  (cd "$wheels.part" && ls -1 ./*.whl >requirements.txt)
  rm -rf "$wheels"
  mv "$wheels.part" "$wheels"
  # Wheelhouses of older requirements are of no more use (about 300 MB each).
  find "$CACHE" -maxdepth 1 -name 'wheels-*' ! -name "wheels-$key" -exec rm -rf {} +
fi

# 3. The build context is the repository (see .dockerignore); the wheels are staged in build/docker (ignored
#    by git) as hard links when the cache is on the same filesystem, so staging costs no copy. Only the
#    wheels and their list: the same wheels staged again then hit Docker's cache, whatever else changed.
stage=build/docker
rm -rf "$stage"
mkdir -p "$stage/dist" "$stage/wheels"
for f in "$wheels"/*.whl "$wheels/requirements.txt"; do
  ln "$f" "$stage/wheels/" 2>/dev/null || cp -p "$f" "$stage/wheels/"
done
# setuptools' deprecation warnings would bury everything else; its output is shown only on a failure.
# SOURCE_DATE_EPOCH: the same code gives the same wheel, byte for byte, so Docker's cache keeps its layers.
SOURCE_DATE_EPOCH=315532800 "$PIP" wheel --quiet --no-deps --no-build-isolation --wheel-dir "$stage/dist" . >"$stage/wheel.log" 2>&1 ||
  {
    cat "$stage/wheel.log" >&2
    exit 1
  }
say "docker build $TAG"
# The classic builder: BuildKit needs the buildx plugin, which Debian's docker.io lacks. Host networking,
# because the private engine of the tests has no bridge (and the build needs no network anyway).
# --force-rm: a failed step leaves no stopped container behind. The stage with the virtualenv is tagged
# too (TAG-deps): untagged, `docker image prune` would take it and with it the cache that spares
# reinstalling every wheel (minutes) on the next build.
for target in deps final; do
  name=$TAG
  [ "$target" = final ] || name=$TAG-$target
  DOCKER_BUILDKIT=0 docker build --quiet --force-rm --network host --build-arg "BASE_IMAGE=$BASE_IMAGE" \
    --target "$target" -t "$name" . >/dev/null
done
say "built $TAG in ${SECONDS} s"
