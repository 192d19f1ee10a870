#!/usr/bin/env bash
# The project's GPU checks in one run, for a machine with one CUDA GPU. Default stages (issue 20's
# acceptance; their limits, with 10 s to kill each, fit one 600-s call): tests (the `gpu`-marked
# tests); engine (engine benchmark, `small` bf16, batches 1 and 128, CUDA-graph decode);
# engine-eager (the same with --no-cuda-graphs); engine-1b (`1b` preset, bf16, batch 1, against
# its weight-read floor). Then benchmarks/gpu_summary.py prints one acceptance table (each figure
# beside its target: PASS, FAIL or "not measured"), which heads $OUT/README.md. By name only, in
# GPU_CHECK_STAGES: engine-fp32 (fp32, batches 1 and 32); kv (the KV transports between two
# processes sharing the GPU: grpc, gloo, nixl over CUDA IPC with a bundle built with --nixl);
# serving-gpu (the serving benchmark, every engine replica on the GPU; needs Ray); serving-cpu
# (the serving benchmark on the CPUs, fp32, 4 torch threads an engine, N = 1 through the proxy,
# 41 pairs: enough for the interval to decide the 1-ms target; a device call of its own).
# Each stage has its own time limit and the script goes on after a failure; the exit status is
# the number of failed stages. A stage's files are $OUT/NAME.* (log, report, figures), removed
# as it starts, so a stale file never stands in for a failed stage. $OUT (default
# ./gpu-results)/README.md puts them together: copy it to benchmarks/results/gpu/README.md.
# Without a .git (a `git archive` copy), set PDSERVE_COMMIT to the commit.
#   bash benchmarks/gpu_check.sh                 # issue 20's acceptance
#   GPU_CHECK_STAGES="kv serving-gpu" bash benchmarks/gpu_check.sh
# Runs from a checkout without installing pdserve (PYTHONPATH), against the machine's torch,
# transformers, msgpack and pytest plus the site bundle (pydantic, grpcio, protobuf; Ray Serve
# for the serving stages): `bash benchmarks/gpu_site_bundle.sh [--serve]`, .devbundle carried.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-results}
STAGES=${GPU_CHECK_STAGES:-"tests engine engine-eager engine-1b"}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
export PDSERVE_CACHE=${PDSERVE_CACHE:-/tmp/pdserve-cache}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
failed=0

stage() {  # stage NAME LIMIT_S CMD...: run CMD under a time limit, log to $OUT/NAME.log
    local name=$1 limit=$2
    shift 2
    case " $STAGES " in *" $name "*) ;; *) return 0 ;; esac
    rm -f "$OUT/$name".*
    echo "== $name (limit ${limit}s): $*"
    local t0=$SECONDS
    timeout --kill-after=10 "$limit" "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    echo "== $name: exit $rc after $((SECONDS - t0))s"
    tail -n 25 "$OUT/$name.log"
    [ "$rc" -eq 0 ] || failed=$((failed + 1))
}

{
    date -u +%FT%TZ
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv
    nproc
    "$PY" -c 'import sys, torch, transformers, grpc; print(sys.version.split()[0], "torch",
torch.__version__, "cuda", torch.version.cuda, "transformers", transformers.__version__,
"grpcio", grpc.__version__, "gpus", torch.cuda.device_count())'
} 2>&1 | tee "$OUT/machine.txt"

# The lent machine's image lacks pydantic and Ray and has an older grpcio: $PDSERVE_SITE_BUNDLE
# (default .devbundle/site.tar.xz, made by benchmarks/gpu_site_bundle.sh) is a tar.xz of
# site-packages (pydantic, Ray Serve with --serve; grpcio and protobuf in _fallback/).
PDSERVE_SITE_BUNDLE=${PDSERVE_SITE_BUNDLE:-$PWD/.devbundle/site.tar.xz}
if [ -f "$PDSERVE_SITE_BUNDLE" ]; then
    site=/tmp/pdserve-site
    mkdir -p $site && tar -xJf "$PDSERVE_SITE_BUNDLE" -C $site &&
        export PYTHONPATH=$PWD:$site/_fallback:$site:${PYTHONPATH#"$PWD:"}
    "$PY" -c 'import ray, grpc, google.protobuf as p; print("ray", ray.__version__, "grpcio",
grpc.__version__, "protobuf", p.__version__)' 2>&1 | tee -a "$OUT/machine.txt"
fi

# Every stage imports the engine and the generated gRPC code: if they do not import (no bundle,
# or one made for another Python), no stage is run, and the log says why in seconds.
if ! "$PY" -c 'import cluster.config, cluster.pb.pdserve.v1.generation_pb2, benchmarks.engine_bench' \
    >"$OUT/preflight.log" 2>&1; then
    tail -n 3 "$OUT/preflight.log"
    echo "== preflight failed: the engine does not import here; build the bundle with" \
        "benchmarks/gpu_site_bundle.sh (PYVER = this python's version), carry .devbundle" |
        tee -a "$OUT/preflight.log"
    STAGES=""
    failed=1
fi

# The ini's warning filters name pydantic, which a machine without Ray may lack.
# Only the files with `gpu`-marked tests: collecting every test would import Ray.
gpu_tests=$(grep -rl --include='test_*.py' 'mark\.gpu' tests | sort)
# shellcheck disable=SC2086
stage tests 140 "$PY" -m pytest -q -p no:cacheprovider \
    -o filterwarnings=ignore::DeprecationWarning -m gpu -rs --junitxml="$OUT/tests.xml" $gpu_tests

# Issue 20's figures: `small` bf16 at batches 1 and 128 (128-token prompts), with the GPU's
# default token budget (8,192), so a 128 x 128 prefill takes two steps; graphs on, then off.
stage engine 120 "$PY" -m benchmarks.engine_bench --device cuda --dtype bfloat16 \
    --batches 1,128 --repeats 2 --out "$OUT/engine.md" --json "$OUT/engine.json"

# Graphs off (ModelConfig.cuda_graphs=false, `pdserve serve --enforce-eager`), for the gain.
stage engine-eager 80 "$PY" -m benchmarks.engine_bench --device cuda --dtype bfloat16 \
    --batches 1,128 --no-cuda-graphs --out "$OUT/engine-eager.md" \
    --json "$OUT/engine-eager.json"

# The 1b preset (Llama-3.2-1B-shaped; weights drawn on the GPU) against its weight-read floor.
stage engine-1b 120 "$PY" -m benchmarks.engine_bench --preset 1b --device cuda \
    --dtype bfloat16 --batches 1 --repeats 2 --out "$OUT/engine-1b.md" \
    --json "$OUT/engine-1b.json"

stage engine-fp32 90 "$PY" -m benchmarks.engine_bench --device cuda --dtype float32 \
    --batches 1,32 --repeats 2 --out "$OUT/engine-fp32.md" --json "$OUT/engine-fp32.json"

stage kv 120 "$PY" -m benchmarks.kv_transports_bench --device cuda --repeats 5 \
    --out "$OUT/kv.md"

case " $STAGES " in
*" serving-"*)
    if "$PY" -c 'import ray.serve' 2>/dev/null; then
        stage serving-gpu 120 "$PY" -m benchmarks.serving_bench --device cuda \
            --dtype bfloat16 --streams 1,64 --repeats 3 --out "$OUT/serving-gpu.md"
        stage serving-cpu 330 "$PY" -m benchmarks.serving_bench --preset small --threads 4 \
            --streams 1 --tokens 64 --paths proxy --repeats 41 --out "$OUT/serving-cpu.md"
    else
        echo "== serving stages skipped: Ray Serve is not importable" | tee "$OUT/serving.log"
    fi
    ;;
esac

echo "== failed stages: $failed"
acceptance=$("$PY" -m benchmarks.gpu_summary "$OUT" 2>&1)

{  # the one report of this run
    commit=${PDSERVE_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
    printf '# GPU check\n\n- date: %s\n- commit: %s\n- stages: %s; failed: %s\n\n' \
        "$(date -u +%FT%TZ)" "$commit" "$STAGES" "$failed"
    printf '## Acceptance (issue 20)\n\n%s\n\n## Machine\n\n' "$acceptance"
    sed 's/^/    /' "$OUT/machine.txt"
    for log in "$OUT"/*.log; do
        [ -f "$log" ] || continue
        printf '\n## %s: last lines of the log\n\n' "$(basename "$log" .log)"
        tail -n 15 "$log" | sed 's/^/    /'
    done
    for report in "$OUT"/*.md; do
        case $report in */README.md) continue ;; esac
        [ -f "$report" ] || continue
        printf '\n## %s\n\n' "$(basename "$report" .md)"
        sed 's/^#/###/' "$report"
    done
} >"$OUT/README.md"
echo "== acceptance (issue 20)"
echo "$acceptance"
echo "== report: $OUT/README.md"
exit "$failed"
