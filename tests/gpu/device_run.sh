#!/usr/bin/env bash
# The GPU checks of issue 22 in one go, on a machine with a CUDA GPU (torch with CUDA, pytest;
# no PySpark, Java or TensorFlow needed): the build, the GPU suite, both benchmarks' --quick
# CUDA runs. From the repository root:
#
#   bash tests/gpu/device_run.sh build test     # ~1 min build (16 cores) + ~4-6 min suite
#   bash tests/gpu/device_run.sh build hosts    # the CUDA tests of the network-namespace bed
#   bash tests/gpu/device_run.sh build latency  # benchmarks/gpu_latency.py --quick (~1 min)
#   bash tests/gpu/device_run.sh build bench    # + ~1 min allreduce, ~1 min scaling
#   bash tests/gpu/device_run.sh wheel          # issue 32: the manylinux wheel carried in
#                                               # .wheel-gpu/ passes tests/gpu (~4 min)
#   bash tests/gpu/device_run.sh                # build test hosts latency (about 8 minutes)
#
# Python packages the GPU machine lacks travel as wheels in .whl/ (tests/gpu/README.md says
# which: Keras for the Keras-on-torch test); they are installed into /tmp/site first.
#
# Every stage runs under a timeout; logs, Markdown tables and JSON records go to $OUT (or
# /tmp/spark_hvd_gpu_out); the end prints a summary. Exit status: 1 if a stage failed.
set -u
cd "$(dirname "$0")/../.." || exit 2
OUT=${OUT:-/tmp/spark_hvd_gpu_out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1
stages=${*:-build test hosts latency}
if compgen -G ".whl/*.whl" > /dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl && export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
failed=()

stage() {  # stage NAME SECONDS COMMAND...: runs COMMAND under a timeout, logs to $OUT/NAME.log
    local name=$1 limit=$2
    shift 2
    local t0=$SECONDS
    echo "== $name (limit ${limit}s): $*"
    timeout --kill-after=10 "$limit" "$@" > "$OUT/$name.log" 2>&1
    local rc=$?
    echo "== $name: exit $rc after $((SECONDS - t0)) s (log: $OUT/$name.log)"
    [ "$rc" -eq 0 ] || failed+=("$name (exit $rc)")
    return "$rc"
}

{
    date -u
    nvidia-smi -L 2>&1
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1
    "$PY" -c "import sys, torch; print('python', sys.version.split()[0], '| torch', \
torch.__version__, '| CUDA', torch.version.cuda, '| available', torch.cuda.is_available(), \
'| devices', torch.cuda.device_count(), '| NCCL', torch.cuda.nccl.version() \
if torch.cuda.is_available() else '-')" 2>&1
    git log -1 --format='commit %h %s' 2>/dev/null
} | tee "$OUT/machine.txt"

for s in $stages; do
    case $s in
    build)
        stage build 300 "$PY" build.py --no-tensorflow -j "$(nproc)" || tail -40 "$OUT/build.log"
        stage check_build 60 "$PY" -m spark_hvd.runner --check-build
        cat "$OUT/check_build.log"
        ;;
    test)
        GPU_SUITE_REQUIRE_GPU=1 GPU_SUITE_JOB_TIMEOUT=${GPU_SUITE_JOB_TIMEOUT:-90} \
            stage pytest 420 "$PY" -m pytest tests/gpu -v -rP -p no:cacheprovider --durations=20
        grep -E "PASSED|FAILED|ERROR|SKIPPED|passed|failed|^E  " "$OUT/pytest.log" | head -80
        ;;
    hosts)
        # Needs root, iproute2 and sshd (tests/multihost/bed.py); skipped with the reason if not.
        stage hosts 240 "$PY" -m pytest -v -rs -p no:cacheprovider \
            tests/multihost/test_hierarchical_hosts.py tests/multihost/test_lost_hosts.py -k nccl
        grep -E "PASSED|FAILED|ERROR|SKIPPED|passed|failed|^E  " "$OUT/hosts.log" | head -40
        ;;
    wheel)
        # The wheel built here with `make wheel TORCH_WHEELS=<a torch wheel of this machine's
        # minor>` (docs/installing.md), carried in .wheel-gpu/: installed alone into a venv that
        # sees this machine's CUDA torch, the GPU suite run from outside the repository.
        stage wheel 420 "$PY" scripts/wheel_gpu_check.py .wheel-gpu/spark_hvd-*.whl \
            --durations=10
        grep -E "installed in|imported from|PASSED|FAILED|ERROR|SKIPPED|passed|failed|^E  " \
            "$OUT/wheel.log" | head -60
        ;;
    latency)
        stage latency 200 "$PY" benchmarks/gpu_latency.py --quick
        sed -n '/^Small CUDA allreduces/,$p' "$OUT/latency.log"
        ;;
    bench)
        stage allreduce 170 "$PY" benchmarks/allreduce.py --device cuda --quick \
            --json "$OUT/allreduce.json"
        sed -n '/^Allreduce benchmark/,$p' "$OUT/allreduce.log"
        stage scaling 150 "$PY" benchmarks/scaling.py --device cuda --quick \
            --json "$OUT/scaling.json"
        sed -n '/^## Training step/,$p' "$OUT/scaling.log"
        ;;
    *)
        echo "unknown stage $s (build, test, hosts, latency, bench, wheel)"
        exit 2
        ;;
    esac
done

if [ ${#failed[@]} -gt 0 ]; then
    echo "FAILED: ${failed[*]}"
    exit 1
fi
echo "all stages passed"
