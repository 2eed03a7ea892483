#!/usr/bin/env bash
# Prepare a machine for building and testing spark_hvd. Idempotent and non-interactive (CI runs it
# as root with no stdin). Steps:
#   1. OpenMPI (mpirun, mpicc, headers), g++, a Java 17 runtime (for PySpark) and Chromium (the
#      documentation's browser test) from apt when missing.
#   2. .venv with the pinned requirements (requirements.txt, requirements-docs.txt) +
#      `pip install -e .`; skipped when .venv/.setup-stamp
#      matches the hash of requirements*.txt, pyproject.toml, setup.py and this script.
#   3. Always: the incremental native build (python build.py: the core, the TensorFlow op
#      library against the venv's TensorFlow and the torch allocator library against its torch),
#      cheap when nothing changed.
# Env: PYTHON (interpreter for the venv, default python3), SPARK_HVD_SKIP_APT=1 to skip step 1.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

VENV="$ROOT/.venv"
PY="$VENV/bin/python"
STAMP="$VENV/.setup-stamp"
PYTHON="${PYTHON:-python3}"
export DEBIAN_FRONTEND=noninteractive
export PIP_DISABLE_PIP_VERSION_CHECK=1

log() { echo "[setup] $*"; }

as_root() {
  if [ "$(id -u)" -eq 0 ]; then
    "$@"
  elif command -v sudo >/dev/null 2>&1; then
    sudo -n "$@"
  else
    echo "[setup] need root for: $* (not root and no sudo)" >&2
    return 1
  fi
}

# 1. OpenMPI -----------------------------------------------------------------------------------
if [ "${SPARK_HVD_SKIP_APT:-0}" != "1" ]; then
  if ! command -v mpirun >/dev/null 2>&1 || ! command -v mpicc >/dev/null 2>&1; then
    log "installing OpenMPI (openmpi-bin libopenmpi-dev)"
    as_root apt-get update -q
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
      openmpi-bin libopenmpi-dev
  fi
  if ! command -v g++ >/dev/null 2>&1; then
    log "installing g++"
    as_root apt-get update -q
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends g++
  fi
  # PySpark runs Spark in a JVM: Java 17 (Spark 4 needs 17 or newer).
  if ! command -v java >/dev/null 2>&1; then
    log "installing a Java 17 runtime (openjdk-17-jre-headless) for PySpark"
    as_root apt-get update -q
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
      openjdk-17-jre-headless procps
  fi
  # MPICH: its process manager (mpiexec.hydra) for the tests that start jobs with it
  # (tests/test_launcher_envs.py; they are skipped without it), and its headers (libmpich-dev)
  # for the MPI plugin's MPICH build (libspark_hvd_mpi_mpich.so; the wheel carries one per MPI
  # ABI). Debian's alternatives would let MPICH's mpirun, mpicc or MPI headers outrank Open
  # MPI's on some distribution: each previous choice is put back, so mpirun, mpicc and the
  # default headers stay Open MPI's. Optional: a failed install only skips those tests and the
  # MPICH plugin.
  if ! command -v mpiexec.hydra >/dev/null 2>&1 || ! command -v mpicxx.mpich >/dev/null 2>&1; then
    log "installing MPICH (mpich libmpich-dev) for the launcher tests and the MPICH plugin"
    alternatives="mpirun mpi mpi-$(gcc -dumpmachine 2>/dev/null || echo x86_64-linux-gnu)"
    declare -A before=()
    for a in $alternatives; do
      before[$a]="$(update-alternatives --query "$a" 2>/dev/null | awk '/^Value:/ {print $2}')"
    done
    if as_root apt-get update -q && as_root env DEBIAN_FRONTEND=noninteractive \
        apt-get install -y -q --no-install-recommends mpich libmpich-dev; then
      for a in $alternatives; do
        now="$(update-alternatives --query "$a" 2>/dev/null | awk '/^Value:/ {print $2}')"
        if [ -n "${before[$a]}" ] && [ "$now" != "${before[$a]}" ]; then
          as_root update-alternatives --set "$a" "${before[$a]}"
        fi
      done
    else
      log "could not install MPICH: the MPICH (Hydra) launcher tests and the MPICH plugin are skipped"
    fi
  fi
  # The multi-host test bed (tests/multihost): network namespaces and tc from iproute2, and
  # sshd in each simulated host for the launcher's ssh path. Optional: without them those tests
  # skip with the reason.
  if ! command -v ip >/dev/null 2>&1 || ! command -v tc >/dev/null 2>&1 \
      || ! [ -x /usr/sbin/sshd ] || ! command -v ssh-keygen >/dev/null 2>&1; then
    log "installing iproute2 and openssh-server for the multi-host test bed"
    if ! { as_root apt-get update -q && as_root env DEBIAN_FRONTEND=noninteractive \
        apt-get install -y -q --no-install-recommends iproute2 openssh-server openssh-client; }; then
      log "could not install iproute2/openssh-server: the multi-host tests will be skipped"
    fi
  fi
  # The documentation's browser test (tests/test_docs_site.py): Debian's Chromium and its
  # WebDriver, driven headless by selenium.
  if ! command -v chromium >/dev/null 2>&1 || ! command -v chromedriver >/dev/null 2>&1; then
    log "installing chromium and chromium-driver for the documentation's browser test"
    as_root apt-get update -q
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
      chromium chromium-driver
  fi
fi

# 2. Python environment ------------------------------------------------------------------------
if [ ! -x "$PY" ]; then
  log "creating $VENV with $("$PYTHON" --version 2>&1)"
  "$PYTHON" -m venv "$VENV"
fi

want_stamp="$(cat requirements*.txt pyproject.toml setup.py scripts/setup.sh 2>/dev/null \
  | sha256sum | cut -d' ' -f1) $("$PY" --version 2>&1)"
have_stamp="$(cat "$STAMP" 2>/dev/null || true)"

if [ "$want_stamp" != "$have_stamp" ] || ! "$PY" -c 'import importlib.metadata as m; m.version("spark-hvd")' >/dev/null 2>&1; then
  log "installing Python requirements"
  rm -f "$STAMP"
  "$PY" -m pip install -q -r requirements.txt
  if [ -f requirements-dev.txt ]; then
    "$PY" -m pip install -q -r requirements-dev.txt
  fi
  "$PY" -m pip install -q -r requirements-docs.txt
  # Editable install (puts the source tree on sys.path, installs spark-hvd-run). The native
  # build runs in step 3 instead, so that a compile error there does not undo the environment.
  SPARK_HVD_SKIP_NATIVE_BUILD=1 "$PY" -m pip install -q --no-build-isolation -e .
  echo "$want_stamp" > "$STAMP"
else
  log "Python requirements up to date"
fi

# 3. Native core and the framework libraries (incremental) -------------------------------------
"$PY" build.py
log "done"
