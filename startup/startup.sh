#!/usr/bin/env bash
# Boot script of every spawn worker, GCE VM or TPU VM (instance metadata key `startup-script`).
#
# Runs on every boot and is safe to run again: it syncs the code from the bucket, makes or reuses
# a virtualenv, installs the package (skipped when nothing it depends on changed) and starts the
# worker as the systemd service spawn-worker (a no-op when it already runs).
# Everything job-specific comes from instance attributes that tools/create_*.py set:
#   spawn-code         gs:// URL of the code (tools/upload_code.py)          required
#   spawn-queue        gs:// URL of the queue (read again by fleet.service)   required
#   spawn-accelerator  cpu | gpu | tpu: which JAX to install                  default cpu
#   spawn-extras       package extras, comma-separated, e.g. extract         default none
#   spawn-python       interpreter for the virtualenv, e.g. python3.11       default python3
# No attribute value is ever evaluated as shell code.
#
# STARTUP_ROOT (tests only) prefixes every path this script writes; GCE_METADATA_HOST
# (host[:port]) points it at another metadata server.
set -euo pipefail

ROOT="${STARTUP_ROOT:-}"
# Ubuntu images ship gcloud as a snap, whose directory a startup script's PATH may lack.
PATH="${PATH}:/snap/bin"
METADATA_HOST="${GCE_METADATA_HOST:-metadata.google.internal}"
CODE_DIR="/opt/fleet/code"
VENV_DIR="/opt/fleet/venv"
STATE_DIR="/var/lib/fleet"
UNIT="spawn-worker.service"

log() {
  printf 'spawn-startup: %s\n' "$*" >&2
}

# metadata PATH [DEFAULT]: the value at PATH; a missing value prints DEFAULT, or fails without one.
metadata() {
  local path="$1" response status
  response="$(curl --silent --show-error --retry 10 --retry-connrefused --retry-delay 2 --max-time 30 \
    --header 'Metadata-Flavor: Google' --write-out '\n%{http_code}' \
    "http://${METADATA_HOST}/computeMetadata/v1/${path}")"
  status="${response##*$'\n'}"
  if [[ "$status" == 200 ]]; then
    printf '%s' "${response%$'\n'*}"
  elif [[ "$status" == 404 && $# -ge 2 ]]; then
    printf '%s' "$2"
  else
    log "event=metadata_failed path=${path} status=${status}"
    return 1
  fi
}

attribute() {
  metadata "instance/attributes/$1" "${@:2}"
}

apt_install() {
  log "event=apt_install packages=$*"
  DEBIAN_FRONTEND=noninteractive apt-get update -q
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "$@"
}

main() {
  local code_url queue_url accelerator extras python
  code_url="$(attribute spawn-code)"
  queue_url="$(attribute spawn-queue)"
  accelerator="$(attribute spawn-accelerator cpu)"
  extras="$(attribute spawn-extras "")"
  python="$(attribute spawn-python python3)"
  # Values that end up in command lines are checked against their expected shapes.
  if [[ "$code_url" != gs://?* || "$queue_url" != gs://?* ]]; then
    log "event=bad_attribute spawn-code=${code_url} spawn-queue=${queue_url} expected=gs://bucket/prefix"
    exit 1
  fi
  if [[ ! "$extras" =~ ^[a-z0-9_,-]*$ || ! "$python" =~ ^python3(\.[0-9]+)?$ ]]; then
    log "event=bad_attribute spawn-extras=${extras} spawn-python=${python}"
    exit 1
  fi
  local jax=()
  case "$accelerator" in
    tpu) jax=("jax[tpu]") ;;
    gpu) jax=("jax[cuda12]") ;;
    cpu) ;;
    *)
      log "event=bad_attribute spawn-accelerator=${accelerator} expected=cpu|gpu|tpu"
      exit 1
      ;;
  esac

  log "event=code_sync source=${code_url} dest=${CODE_DIR}"
  mkdir -p "${ROOT}${CODE_DIR}" "${ROOT}${STATE_DIR}"
  gcloud storage rsync --recursive --delete-unmatched-destination-objects "$code_url" "${ROOT}${CODE_DIR}"

  local deps stamp venv_stamp="python=${python}"
  deps="$(cat "${ROOT}${CODE_DIR}/setup.cfg" "${ROOT}${CODE_DIR}/pyproject.toml" | sha256sum)"
  stamp="python=${python} accelerator=${accelerator} extras=${extras} deps=${deps%% *}"
  if [[ -f "${ROOT}${STATE_DIR}/venv.stamp" && "$(cat "${ROOT}${STATE_DIR}/venv.stamp")" != "$venv_stamp" ]]; then
    log "event=venv_replaced reason=interpreter_changed python=${python}"
    rm -rf "${ROOT}${VENV_DIR}" "${ROOT}${STATE_DIR}/venv.stamp" "${ROOT}${STATE_DIR}/install.stamp"
  fi
  if [[ ! -x "${ROOT}${VENV_DIR}/bin/python" ]]; then
    if ! command -v "$python" >/dev/null; then
      apt_install "$python" "${python}-venv"
    fi
    if ! "$python" -m venv "${ROOT}${VENV_DIR}"; then
      # Debian and Ubuntu ship venv (ensurepip) as a separate package.
      rm -rf "${ROOT}${VENV_DIR}"
      apt_install "${python}-venv"
      "$python" -m venv "${ROOT}${VENV_DIR}"
    fi
    printf '%s\n' "$venv_stamp" >"${ROOT}${STATE_DIR}/venv.stamp"
    log "event=venv_created path=${VENV_DIR} python=${python}"
  fi

  if [[ -f "${ROOT}${STATE_DIR}/install.stamp" && "$(cat "${ROOT}${STATE_DIR}/install.stamp")" == "$stamp" ]]; then
    log "event=install_skipped reason=unchanged ${stamp}"
  else
    local package="${ROOT}${CODE_DIR}"
    if [[ -n "$extras" ]]; then
      package="${package}[${extras}]"
    fi
    "${ROOT}${VENV_DIR}/bin/python" -m pip install --quiet --upgrade pip
    "${ROOT}${VENV_DIR}/bin/python" -m pip install --quiet --editable "$package" "${jax[@]}"
    printf '%s\n' "$stamp" >"${ROOT}${STATE_DIR}/install.stamp"
    log "event=installed ${stamp}"
  fi

  install -D -m 0644 "${ROOT}${CODE_DIR}/startup/${UNIT}" "${ROOT}/etc/systemd/system/${UNIT}"
  systemctl daemon-reload
  systemctl start "$UNIT"
  log "event=worker_started unit=${UNIT} queue=${queue_url}"
}

main "$@"
