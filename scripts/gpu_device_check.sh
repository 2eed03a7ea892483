#!/bin/bash
# One call on a GPU machine: build, then the CUDA smoke check at 1 and 2 ranks (both modes of
# ranks sharing a GPU), then whatever else is passed as arguments ("tests", "bench").
# Logs go to $OUT (or ./gpu-logs).
OUT=${OUT:-gpu-logs}; mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
{
  nvidia-smi -L; $PY -V
  $PY -c "import torch; print('torch', torch.__version__, 'nccl', torch.cuda.nccl.version(), 'gpus', torch.cuda.device_count())"
  ls /proc/sys/net/ipv4/conf
} 2>&1 | tee "$OUT/env.log"
$PY build.py --no-tensorflow --no-torch -j 16 2>&1 | tail -4 | tee "$OUT/build.log" || exit 1
for what in smoke "$@"; do
  case $what in
    smoke)
      timeout 90 $PY scripts/gpu_smoke.py 2>&1 | tee "$OUT/smoke1.log"
      timeout 120 $PY -m spark_hvd.runner -np 2 $PY scripts/gpu_smoke.py 2>&1 | tee "$OUT/smoke2_host.log"
      SPARK_HVD_SHARED_GPU=nccl timeout 120 $PY -m spark_hvd.runner -np 2 $PY scripts/gpu_smoke.py 2>&1 | tee "$OUT/smoke2_nccl.log" ;;
    tests)
      timeout 300 $PY -m pytest tests/gpu -q -x -p no:cacheprovider 2>&1 | tee "$OUT/tests.log" ;;
    bench)
      timeout 200 $PY benchmarks/allreduce.py --device cuda --quick 2>&1 | tee "$OUT/bench_allreduce.log"
      timeout 150 $PY benchmarks/scaling.py --device cuda --quick 2>&1 | tee "$OUT/bench_scaling.log" ;;
  esac
done
