#!/bin/sh
# Spark GPU discovery script: prints this machine's NVIDIA GPUs in the form Spark reads,
#   {"name": "gpu", "addresses": ["0", "1"]}
# Set it as spark.worker.resource.gpu.discoveryScript (standalone workers) and
# spark.executor.resource.gpu.discoveryScript (YARN, Kubernetes, local-cluster), with
# spark.{worker,executor}.resource.gpu.amount and spark.task.resource.gpu.amount; see
# docs/gpus.md, "GPUs with Spark". The addresses are CUDA device indices, which spark_hvd turns
# into each rank's CUDA_VISIBLE_DEVICES.
set -e
indices=$(nvidia-smi --query-gpu=index --format=csv,noheader | tr -d ' ' | paste -sd, -)
printf '{"name": "gpu", "addresses": [%s]}\n' \
    "$(printf '%s' "$indices" | sed 's/[^,][^,]*/"&"/g')"
