#!/usr/bin/env bash
# Boot script of every spawn worker, GCE VM or TPU VM (instance metadata key `startup-script`).
#
#   startup.sh                  the boot (run by the guest agent on every boot; safe to run again)
#   startup.sh worker-stopped   the unit's ExecStopPost: counts worker failures; a crash loop ends
#                               the machine the way a failed boot does
#
# The boot: write the machine record `booting`; sync the code from the bucket; provision a real
# CPython (uv, never the images' release-candidate python3.11 packages); make the virtualenv and
# install exactly the pins of locks/<lock>.txt (from tools/upload_code.py), from the bucket's
# wheelhouse when there is one (firewalled fleets: no index at all); check that this machine may
# delete itself before it claims anything; start the worker as the systemd unit spawn-worker.
# Network steps are retried with backoff, and apt waits for the dpkg lock that first-boot updaters hold.
#
# Any failure writes the record `failed` (reason and log tail) to QUEUE/machines/NAME.json and
# deletes the machine (python -m fleet.selfdelete, else gcloud), so a broken boot never idles on the bill.
#
# Everything job-specific comes from instance attributes that tools/create_*.py set:
#   spawn-code         gs:// URL of the code (tools/upload_code.py)          required
#   spawn-queue        gs:// URL of the queue                                required
#   spawn-accelerator  cpu | gpu | tpu: which lock (cpu, cuda12, tpu)        default cpu
#   spawn-extras       package extras, comma-separated (unlocked installs)   default none
#   spawn-python       CPython version for the virtualenv, e.g. 3.11         default 3.11
# No attribute value is ever evaluated as shell code.
#
# STARTUP_ROOT (tests only) prefixes every path this script writes; GCE_METADATA_HOST
# (host[:port]) points it at another metadata server; STARTUP_RETRY_DELAY_S shortens backoffs.
set -Eeuo pipefail

ROOT="${STARTUP_ROOT:-}"
# Ubuntu images ship gcloud as a snap, whose directory a startup script's PATH may lack.
PATH="${PATH}:/snap/bin"
METADATA_HOST="${GCE_METADATA_HOST:-metadata.google.internal}"
CODE_DIR="/opt/fleet/code"
VENV_DIR="/opt/fleet/venv"
UV_VENV="/opt/fleet/uv"          # holds uv when the image has none
PYTHON_DIR="/opt/fleet/python"   # uv-managed interpreters
STATE_DIR="/var/lib/fleet"
UNIT="spawn-worker.service"
RETRY_DELAY_S="${STARTUP_RETRY_DELAY_S:-5}"
# Ubuntu's apt-daily and unattended-upgrades hold the dpkg lock for minutes after a first boot.
APT_LOCK_TIMEOUT_S=900
# ExecStopPost: this many worker failures within WORKER_FAILURE_WINDOW_S is a crash loop.
WORKER_FAILURE_LIMIT=5
WORKER_FAILURE_WINDOW_S=900
LOG_TAIL_LINES=40

PHASE="metadata"
MACHINE=""
QUEUE_URL=""
CODE_URL=""
ACCELERATOR=""
MACHINE_TYPE=""
PROVISIONING=""
TPU_NODE=""
TPU_WORKER=""
TEE_PID=""
# The record's time accounting (fleet/machines.py): the current spell (state and start, epoch
# seconds) and the seconds of the finished ones per state. Booting starts at the kernel's boot.
BOOT_EPOCH=""
while read -r stat_key stat_value _; do
  if [[ "$stat_key" == btime ]]; then BOOT_EPOCH="$stat_value"; fi
done </proc/stat
SPELL_STATE=""
SPELL_SINCE=""
declare -A SPENT=()

# One line per event; at= (seconds since the epoch, no fork) lets bench/boot_bench.py time the phases.
log() {
  printf 'spawn-startup: at=%s %s\n' "${EPOCHREALTIME:-}" "$*" >&2
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

# retry ATTEMPTS COMMAND...: run COMMAND until it succeeds, doubling the pause between attempts.
retry() {
  local attempts="$1" attempt=1 delay="$RETRY_DELAY_S"
  shift
  until "$@"; do
    if ((attempt >= attempts)); then
      log "event=gave_up attempts=${attempts} command=$1"
      return 1
    fi
    log "event=retry attempt=${attempt} delay_s=${delay} command=$1"
    sleep "$delay"
    attempt=$((attempt + 1))
    delay=$((delay * 2))
  done
}

apt_install() {
  log "event=apt_install packages=$*"
  retry 3 env DEBIAN_FRONTEND=noninteractive apt-get -o "DPkg::Lock::Timeout=${APT_LOCK_TIMEOUT_S}" update -q
  retry 3 env DEBIAN_FRONTEND=noninteractive apt-get -o "DPkg::Lock::Timeout=${APT_LOCK_TIMEOUT_S}" \
    install -y -q --no-install-recommends "$@"
}

# json_string TEXT: TEXT as a JSON string literal (quotes, backslashes, control characters escaped).
json_string() {
  local text="$1"
  text="${text//\\/\\\\}"
  text="${text//\"/\\\"}"
  text="${text//$'\n'/\\n}"
  text="${text//$'\r'/\\r}"
  text="${text//$'\t'/\\t}"
  printf '"%s"' "$(printf '%s' "$text" | tr -d '\000-\010\013\014\016-\037')"
}

# read_tpu_env: TPU_NODE and TPU_WORKER from a TPU VM's tpu-env attribute (both empty on a VM).
read_tpu_env() {
  local tpu_env line key value
  tpu_env="$(attribute tpu-env "")"
  while IFS= read -r line; do
    key="${line%%:*}"
    value="${line#*:}"
    value="${value#"${value%%[![:space:]]*}"}"
    value="${value//\'/}"
    case "$key" in
      NODE_ID) TPU_NODE="$value" ;;
      WORKER_ID) TPU_WORKER="$value" ;;
    esac
  done <<<"$tpu_env"
  if [[ -n "$TPU_NODE" ]]; then TPU_WORKER="${TPU_WORKER:-0}"; fi
}

# machine_name: the record name fleet.machines.machine_name computes too: a VM's instance name,
# a TPU VM's node id (with -w<N> for hosts other than worker 0). Needs read_tpu_env first.
machine_name() {
  if [[ -n "$TPU_NODE" ]]; then
    if [[ "$TPU_WORKER" == 0 ]]; then printf '%s' "$TPU_NODE"; else printf '%s-w%s' "$TPU_NODE" "$TPU_WORKER"; fi
  else
    metadata instance/name
  fi
}

# read_pricing: what the machine's bill depends on, as fleet.machines.machine_identity reads it:
# MACHINE_TYPE (a TPU VM's accelerator-type attribute, else the basename of instance/machine-type)
# and PROVISIONING (spot when instance/scheduling/provisioning-model is SPOT, or the older
# instance/scheduling/preemptible is TRUE; https://cloud.google.com/compute/docs/metadata/predefined-metadata-keys).
read_pricing() {
  local model
  MACHINE_TYPE="$(attribute accelerator-type "")"
  if [[ -z "$MACHINE_TYPE" ]]; then MACHINE_TYPE="$(metadata instance/machine-type "")"; fi
  MACHINE_TYPE="${MACHINE_TYPE##*/}"
  model="$(metadata instance/scheduling/provisioning-model "")"
  if [[ "${model^^}" == SPOT || "${model^^}" == PREEMPTIBLE ]]; then
    PROVISIONING=spot
  elif [[ -z "$model" && "$(metadata instance/scheduling/preemptible "")" == TRUE ]]; then
    PROVISIONING=spot
  else
    PROVISIONING=standard
  fi
}

iso_time() {
  date -u -d "@$1" +%Y-%m-%dT%H:%M:%S+00:00
}

meta_value() {
  local value="${1//,/;}"
  printf '%s' "${value//=/:}"
}

# record STATE [REASON [LOG_TAIL]]: overwrite QUEUE/machines/NAME.json (docs/PROTOCOL.md, "Machine
# records"). The fields status reads ride along as custom metadata. Never fatal: a record is for people.
record() {
  local state="$1" reason="${2:-}" tail="${3:-}" body at now_s spent="" spent_listed="" key
  if [[ -z "$MACHINE" || "$QUEUE_URL" != gs://?* ]]; then
    log "event=record_skipped state=${state} reason=no_queue_or_name"
    return 0
  fi
  now_s="$(date +%s)"
  if [[ -z "$SPELL_STATE" ]]; then
    SPELL_SINCE="${BOOT_EPOCH:-$now_s}"
  elif [[ "$SPELL_STATE" != "$state" ]]; then
    SPENT["$SPELL_STATE"]=$((${SPENT["$SPELL_STATE"]:-0} + now_s - SPELL_SINCE))
    SPELL_SINCE="$now_s"
  fi
  SPELL_STATE="$state"
  for key in "${!SPENT[@]}"; do
    spent+="${spent:+, }$(json_string "$key"): ${SPENT[$key]}"
    spent_listed+=",spent_${key}=${SPENT[$key]}"
  done
  at="$(iso_time "$now_s")"
  body="{\"machine\": $(json_string "$MACHINE"), \"state\": $(json_string "$state"), \"at\": $(json_string "$at")"
  body+=", \"code\": $(json_string "$CODE_URL"), \"accelerator\": $(json_string "$ACCELERATOR")"
  body+=", \"phase\": $(json_string "$PHASE")"
  body+=", \"machine_type\": $(json_string "$MACHINE_TYPE"), \"provisioning\": $(json_string "$PROVISIONING")"
  body+=", \"since\": $(json_string "$(iso_time "$SPELL_SINCE")"), \"spent\": {${spent}}"
  if [[ -n "$BOOT_EPOCH" ]]; then body+=", \"boot_at\": $(json_string "$(iso_time "$BOOT_EPOCH")")"; fi
  if [[ -n "$TPU_WORKER" ]]; then body+=", \"host\": $(json_string "$TPU_WORKER")"; fi
  if [[ -n "$reason" ]]; then body+=", \"reason\": $(json_string "$reason")"; fi
  if [[ -n "$tail" ]]; then body+=", \"log_tail\": $(json_string "$tail")"; fi
  body+="}"
  # gcloud splits --custom-metadata at commas and '=': values lose them (the body keeps them).
  local listed
  listed="state=${state},accelerator=$(meta_value "$ACCELERATOR"),code=$(meta_value "$CODE_URL")"
  listed+=",at=${at},since=$(iso_time "$SPELL_SINCE"),machine_type=$(meta_value "$MACHINE_TYPE"),provisioning=${PROVISIONING}"
  listed+="${spent_listed}"
  if [[ -n "$BOOT_EPOCH" ]]; then listed+=",boot_at=$(iso_time "$BOOT_EPOCH")"; fi
  if [[ -n "$TPU_WORKER" ]]; then listed+=",host=$(meta_value "$TPU_WORKER")"; fi
  if [[ -n "$reason" ]]; then listed+=",reason=$(meta_value "$reason")"; fi
  if printf '%s\n' "$body" | gcloud storage cp --content-type=application/json \
    "--custom-metadata=${listed:0:1000}" - "${QUEUE_URL%/}/machines/${MACHINE}.json"; then
    log "event=machine_record machine=${MACHINE} state=${state}"
  else
    log "event=machine_record_failed machine=${MACHINE} state=${state}"
  fi
}

# self_delete: python -m fleet.selfdelete when the virtualenv works, else gcloud, from metadata:
# - group member: gcloud compute instance-groups managed delete-instances
#   (https://cloud.google.com/sdk/gcloud/reference/compute/instance-groups/managed/delete-instances),
# - TPU VM: gcloud compute tpus queued-resources delete --force, else tpus tpu-vm delete
#   (https://cloud.google.com/sdk/gcloud/reference/compute/tpus/queued-resources/delete),
# - otherwise gcloud compute instances delete.
self_delete() {
  if [[ -x "${ROOT}${VENV_DIR}/bin/python" ]] &&
    (cd "${ROOT}${CODE_DIR}" && "${ROOT}${VENV_DIR}/bin/python" -m fleet.selfdelete delete); then
    return 0
  fi
  log "event=self_delete_fallback method=gcloud"
  local zone name created_by queued group_path
  zone="$(metadata instance/zone)"
  zone="${zone##*/}"
  name="$(metadata instance/name)"
  created_by="$(attribute created-by "")"
  queued="$(attribute spawn-queued-resource "")"
  if [[ -n "$(attribute tpu-env "")" ]]; then
    if [[ -n "$queued" ]]; then
      gcloud compute tpus queued-resources delete "$queued" "--zone=${zone}" --force --quiet --async
    else
      gcloud compute tpus tpu-vm delete "$MACHINE" "--zone=${zone}" --quiet --async
    fi
  elif [[ "$created_by" == */instanceGroupManagers/* ]]; then
    group_path="${created_by#projects/*/}"  # zones/Z/instanceGroupManagers/G or regions/R/...
    local scope="${group_path%%/*}" where="${group_path#*/}"
    where="${where%%/*}"
    if [[ "$scope" == regions ]]; then
      gcloud compute instance-groups managed delete-instances "${created_by##*/}" "--region=${where}" "--instances=${name}"
    else
      gcloud compute instance-groups managed delete-instances "${created_by##*/}" "--zone=${where}" "--instances=${name}"
    fi
  else
    gcloud compute instances delete "$name" "--zone=${zone}" --quiet
  fi
}

# fail REASON: record the failure with the log tail, delete this machine, and exit.
fail() {
  local reason="$1" tail=""
  trap - ERR
  log "event=boot_failed phase=${PHASE} reason=${reason}"
  if [[ -n "$TEE_PID" ]]; then
    # Let tee write out everything up to here before the tail is read.
    exec 2>&3
    wait "$TEE_PID" || true
    TEE_PID=""
  fi
  if [[ -f "${ROOT}${STATE_DIR}/startup.log" ]]; then
    tail="$(tail -n "$LOG_TAIL_LINES" "${ROOT}${STATE_DIR}/startup.log")"
  fi
  record failed "$reason" "$tail"
  delete_after_failure
  exit 1
}

# The failed record stays the machine's last word: it says why, for as long as anyone looks.
delete_after_failure() {
  if ! self_delete; then
    log "event=self_delete_failed machine=${MACHINE} hint=see docs/CLOUD.md IAM; run tools/teardown.py"
  fi
}

on_error() {
  local status="$1" line="$2"
  # Inside $(...) the trap is inherited (set -E): leave the failure to the script itself, which
  # sees the substitution fail, so the record is written and the delete asked for once.
  if ((BASH_SUBSHELL > 0)); then
    exit "$status"
  fi
  fail "${PHASE}_failed: exit ${status} at line ${line}"
}

read_common() {
  CODE_URL="$(attribute spawn-code "")"
  QUEUE_URL="$(attribute spawn-queue "")"
  ACCELERATOR="$(attribute spawn-accelerator cpu)"
  read_tpu_env
  read_pricing
  MACHINE="$(machine_name)"
}

uv_bin() {
  if command -v uv >/dev/null; then
    command -v uv
  else
    printf '%s' "${ROOT}${UV_VENV}/bin/uv"
  fi
}

# ensure_uv WHEELHOUSE: uv from the image, else into a small virtualenv of the image's python3
# (its own interpreter is fine for that), from the wheelhouse when there is one.
ensure_uv() {
  local wheelhouse="$1"
  if command -v uv >/dev/null || [[ -x "${ROOT}${UV_VENV}/bin/uv" ]]; then
    return 0
  fi
  if ! python3 -m venv "${ROOT}${UV_VENV}"; then
    # Debian and Ubuntu ship venv (ensurepip) as a separate package.
    rm -rf "${ROOT}${UV_VENV}"
    apt_install python3-venv
    python3 -m venv "${ROOT}${UV_VENV}"
  fi
  local from=()
  if [[ -d "$wheelhouse" ]]; then from=(--no-index --find-links "$wheelhouse"); fi
  retry 4 "${ROOT}${UV_VENV}/bin/pip" install --quiet "${from[@]}" uv
  log "event=uv_installed path=${UV_VENV}/bin/uv"
}

boot() {
  local extras python
  trap 'on_error $? $LINENO' ERR
  mkdir -p "${ROOT}${STATE_DIR}" "${ROOT}${CODE_DIR}"
  # Keep this boot's log for the failure record's tail (the journal has it too).
  : >"${ROOT}${STATE_DIR}/startup.log"
  exec 3>&2
  exec 2> >(tee -a "${ROOT}${STATE_DIR}/startup.log" >&3)
  TEE_PID=$!

  read_common
  extras="$(attribute spawn-extras "")"
  python="$(attribute spawn-python 3.11)"
  python="${python#python}"
  # Values that end up in command lines are checked against their expected shapes.
  if [[ "$CODE_URL" != gs://?* || "$QUEUE_URL" != gs://?* ]]; then
    log "event=bad_attribute spawn-code=${CODE_URL} spawn-queue=${QUEUE_URL} expected=gs://bucket/prefix"
    fail "bad_attribute: spawn-code=${CODE_URL} spawn-queue=${QUEUE_URL} (expected gs://bucket/prefix)"
  fi
  if [[ ! "$extras" =~ ^[a-z0-9_,-]*$ || ! "$python" =~ ^3\.[0-9]+$ ]]; then
    log "event=bad_attribute spawn-extras=${extras} spawn-python=${python}"
    fail "bad_attribute: spawn-extras=${extras} spawn-python=${python} (expected extras like extract and a version like 3.11)"
  fi
  local jax=() lock
  case "$ACCELERATOR" in
    tpu) jax=("jax[tpu]") lock=tpu ;;
    gpu) jax=("jax[cuda12]") lock=cuda12 ;;
    cpu) lock=cpu ;;
    *)
      log "event=bad_attribute spawn-accelerator=${ACCELERATOR} expected=cpu|gpu|tpu"
      fail "bad_attribute: spawn-accelerator=${ACCELERATOR} (expected cpu, gpu or tpu)"
      ;;
  esac
  record booting

  PHASE="code_sync"
  log "event=code_sync source=${CODE_URL} dest=${CODE_DIR}"
  retry 4 gcloud storage rsync --recursive --delete-unmatched-destination-objects "$CODE_URL" "${ROOT}${CODE_DIR}"

  PHASE="interpreter"
  local code="${ROOT}${CODE_DIR}" wheelhouse="${ROOT}${CODE_DIR}/wheelhouse/${lock}" uv
  local lockfile="${code}/locks/${lock}.txt" from=()
  if [[ -d "$wheelhouse" ]]; then from=(--no-index --find-links "$wheelhouse"); fi
  ensure_uv "$wheelhouse"
  uv="$(uv_bin)"
  export UV_PYTHON_INSTALL_DIR="${ROOT}${PYTHON_DIR}"
  # Firewalled fleets: the interpreter archive mirrored into the bucket next to the code
  # (docs/CLOUD.md, "Firewalled fleets"; https://docs.astral.sh/uv/reference/environment/).
  if [[ -d "${code}/python-mirror" ]]; then export UV_PYTHON_INSTALL_MIRROR="file://${code}/python-mirror"; fi
  local venv_stamp="python=${python}"
  if [[ -f "${ROOT}${STATE_DIR}/venv.stamp" && "$(cat "${ROOT}${STATE_DIR}/venv.stamp")" != "$venv_stamp" ]]; then
    log "event=venv_replaced reason=interpreter_changed python=${python}"
    rm -rf "${ROOT}${VENV_DIR}" "${ROOT}${STATE_DIR}/venv.stamp" "${ROOT}${STATE_DIR}/install.stamp"
  fi
  if [[ ! -x "${ROOT}${VENV_DIR}/bin/python" ]]; then
    retry 4 "$uv" python install "$python"
    # --managed-python: never the image's own python3.X, which on Ubuntu 22.04 is a release candidate.
    "$uv" venv --managed-python --python "$python" "${ROOT}${VENV_DIR}"
    printf '%s\n' "$venv_stamp" >"${ROOT}${STATE_DIR}/venv.stamp"
    log "event=venv_created path=${VENV_DIR} python=${python}"
  fi

  PHASE="install"
  local deps stamp
  if [[ -f "$lockfile" ]]; then
    deps="$(sha256sum <"$lockfile")"
  else
    deps="$(cat "${code}/setup.cfg" "${code}/pyproject.toml" | sha256sum)"
  fi
  stamp="python=${python} accelerator=${ACCELERATOR} extras=${extras} deps=${deps%% *}"
  if [[ -f "${ROOT}${STATE_DIR}/install.stamp" && "$(cat "${ROOT}${STATE_DIR}/install.stamp")" == "$stamp" ]]; then
    log "event=install_skipped reason=unchanged ${stamp}"
  else
    record installing
    local target=(--python "${ROOT}${VENV_DIR}/bin/python")
    if [[ -f "$lockfile" ]]; then
      retry 4 "$uv" pip install "${target[@]}" "${from[@]}" --requirement "$lockfile"
      # The build backend for the editable install comes from the wheelhouse too.
      "$uv" pip install "${target[@]}" "${from[@]}" --no-deps --editable "$code"
    else
      log "event=install_unlocked reason=no_lock_file lock=locks/${lock}.txt hint=run tools/upload_code.py"
      local package="$code"
      if [[ -n "$extras" ]]; then package="${package}[${extras}]"; fi
      retry 4 "$uv" pip install "${target[@]}" "${from[@]}" --editable "$package" "${jax[@]}"
    fi
    printf '%s\n' "$stamp" >"${ROOT}${STATE_DIR}/install.stamp"
    log "event=installed ${stamp}"
  fi

  # Claim nothing unless this machine can also delete itself: a group member that cannot would
  # otherwise be recreated forever (fleet/selfdelete.py).
  PHASE="permissions"
  local verdict
  if ! verdict="$(cd "$code" && "${ROOT}${VENV_DIR}/bin/python" -m fleet.selfdelete check)"; then
    fail "${verdict:-permission_check_failed}"
  fi

  PHASE="worker"
  rm -f "${ROOT}${STATE_DIR}/worker-failures"
  install -D -m 0644 "${code}/startup/${UNIT}" "${ROOT}/etc/systemd/system/${UNIT}"
  systemctl daemon-reload
  systemctl start "$UNIT"
  log "event=worker_started unit=${UNIT} queue=${QUEUE_URL}"
}

# The unit's ExecStopPost (systemd sets SERVICE_RESULT, EXIT_CODE, EXIT_STATUS): a clean stop is
# nothing; WORKER_FAILURE_LIMIT failures within WORKER_FAILURE_WINDOW_S end the machine.
worker_stopped() {
  local result="${SERVICE_RESULT:-unknown}" now count=0 stamp
  if [[ "$result" == success ]]; then
    return 0
  fi
  PHASE="worker"
  now="$(date +%s)"
  mkdir -p "${ROOT}${STATE_DIR}"
  printf '%s\n' "$now" >>"${ROOT}${STATE_DIR}/worker-failures"
  while IFS= read -r stamp; do
    if [[ "$stamp" =~ ^[0-9]+$ ]] && ((now - stamp <= WORKER_FAILURE_WINDOW_S)); then count=$((count + 1)); fi
  done <"${ROOT}${STATE_DIR}/worker-failures"
  log "event=worker_failed result=${result} exit_code=${EXIT_CODE:-} exit_status=${EXIT_STATUS:-} recent_failures=${count}"
  if ((count < WORKER_FAILURE_LIMIT)); then
    return 0
  fi
  read_common
  local tail
  tail="$(journalctl --unit "$UNIT" --lines "$LOG_TAIL_LINES" --no-pager 2>&1 || true)"
  record failed "worker_crash_loop: ${count} failures in ${WORKER_FAILURE_WINDOW_S}s, last ${result} ${EXIT_CODE:-}=${EXIT_STATUS:-}" "$tail"
  systemctl disable --now --no-block "$UNIT" || log "event=unit_disable_failed unit=${UNIT}"
  delete_after_failure
}

case "${1:-boot}" in
  boot) boot ;;
  worker-stopped) worker_stopped ;;
  *)
    log "event=bad_usage argv=$*"
    exit 2
    ;;
esac
