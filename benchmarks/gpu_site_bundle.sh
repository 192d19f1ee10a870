#!/usr/bin/env bash
# Builds .devbundle/site.tar.xz: the Python packages pdserve needs that the lent GPU machine's
# image lacks (or has too old), for benchmarks/gpu_check.sh to unpack there. That machine
# cannot reach a package index; its image has torch, transformers, msgpack, pytest and an older
# grpcio, and no pydantic or Ray (/work/.library/device/KINDS.md). Runs here, where pip reaches
# the registry; the recipe and its reasons are in benchmarks/gpu_site_bundle.md.
#   bash benchmarks/gpu_site_bundle.sh [--serve: also Ray Serve, 32 MiB | --nixl: NIXL, 43 MiB]
# (default: the engine stages, 7 MiB; --serve and --nixl together pass a call's 64-MiB carry).
# Versions are the project venv's (.venv, `make setup`); the target is CPython $PYVER (default
# 3.12, the image's python3), x86-64 manylinux. Then carry .devbundle (ignored by git) in the
# device call; gpu_check.sh finds .devbundle/site.tar.xz by itself. DEST=.devbundle-nixl (say)
# keeps a second bundle beside it: carry that folder and name its file in PDSERVE_SITE_BUNDLE.
set -euo pipefail
cd "$(dirname "$0")/.."
PYVER=${PYVER:-3.12}
VENV_PY=${VENV_PY:-.venv/bin/python}
DEST=${DEST:-.devbundle}
serve=0 nixl=0
for arg in "$@"; do
    case $arg in
    --serve) serve=1 ;;
    --nixl) nixl=1 ;;
    *) echo "usage: $0 [--serve] [--nixl]" >&2 && exit 2 ;;
    esac
done

# pydantic for the config dataclasses; grpcio and protobuf of the versions the committed
# generated code needs go to _fallback/, which gpu_check.sh puts ahead of the image's own.
engine="pydantic pydantic-core annotated-types typing-inspection typing-extensions"
fallback="grpcio protobuf"
serve_pkgs="ray fastapi starlette uvicorn jsonschema jsonschema-specifications referencing
rpds-py watchfiles colorful aiohttp-cors mmh3 grpcio-reflection googleapis-common-protos
opencensus opencensus-context opentelemetry-api opentelemetry-sdk opentelemetry-proto
opentelemetry-semantic-conventions opentelemetry-exporter-prometheus"

pinned() {  # NAME...: NAME==VERSION as installed in the project venv
    "$VENV_PY" - "$@" <<'EOF'
import importlib.metadata as m, sys
print(" ".join(f"{n}=={m.version(n)}" for n in sys.argv[1:]))
EOF
}

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
platforms=""
for p in manylinux_2_28 manylinux_2_27 manylinux_2_24 manylinux_2_17 manylinux2014 manylinux1; do
    platforms="$platforms --platform ${p}_x86_64"
done
fetch() {  # DIR SPEC...: download the target's wheels, then install them under DIR
    local dir=$1 wheels
    shift
    wheels=$(mktemp -d "$work/wheels.XXXX")
    # shellcheck disable=SC2086
    "$VENV_PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$PYVER" \
        --implementation cp $platforms -d "$wheels" "$@"
    # shellcheck disable=SC2086
    "$VENV_PY" -m pip install -q --no-deps --no-index --no-compile --only-binary=:all: \
        --python-version "$PYVER" --implementation cp $platforms --target "$dir" "$wheels"/*.whl
}

site=$work/site
# shellcheck disable=SC2046
fetch "$site" $(pinned $engine)
# shellcheck disable=SC2046
fetch "$site/_fallback" $(pinned $fallback)
if [ "$serve" = 1 ]; then
    # shellcheck disable=SC2046,SC2086
    fetch "$site" $(pinned $serve_pkgs)
    # Ray without what Serve never imports: its Java jars, the libraries for training, tuning,
    # data and LLMs, the dashboard's web client; its binaries stripped.
    for d in jars rllib tune train data air llm workflow serve/llm dashboard/client/build; do
        rm -rf "$site/ray/$d"
    done
    find "$site/ray" -name '*.so' -o -name raylet -o -name gcs_server |
        xargs -r strip --strip-unneeded 2>/dev/null || true
fi
if [ "$nixl" = 1 ]; then  # the kv stage's third transport (UCX: CUDA IPC between processes)
    # shellcheck disable=SC2046
    fetch "$site" $(pinned nixl-cu12)
fi
rm -rf "$site/bin"
find "$site" -name __pycache__ -prune -exec rm -rf {} +
mkdir -p "$DEST"
tar -cJf "$DEST/site.tar.xz" -C "$site" .
if [ "${DEST#/}" = "$DEST" ] && exclude=$(git rev-parse --git-path info/exclude 2>/dev/null); then
    mkdir -p "$(dirname "$exclude")"  # a folder of the checkout: ignored, so only carry sends it
    grep -qsx "/${DEST#./}/" "$exclude" || echo "/${DEST#./}/" >>"$exclude"
fi
echo "$DEST/site.tar.xz: $(du -h "$DEST/site.tar.xz" | cut -f1), CPython $PYVER; engine" \
    "$([ "$serve" = 1 ] && echo '+ Ray Serve')" "$([ "$nixl" = 1 ] && echo '+ NIXL')"
