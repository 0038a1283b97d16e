#!/usr/bin/env bash
# Boot script of every spawn worker, GCE VM or TPU VM (instance metadata key `startup-script`).
#
#   startup.sh                  the boot (run by the guest agent on every boot; safe to run again)
#   startup.sh worker-stopped   the unit's ExecStopPost: counts worker failures; a crash loop ends
#                               the machine the way a failed boot does
#
# The boot: write the machine record `booting`; sync the code from the bucket (with this machine's
# own wheelhouse only, and uv/uv, the static uv binary tools/upload_code.py pinned); provision a real
# CPython (uv, never the images' release-candidate python3.11 packages); make the virtualenv and
# install exactly the pins of locks/<lock>.txt, from the bucket's wheelhouse when there is one
# (firewalled fleets: no index at all); check that this machine may delete itself before it claims
# anything; start the worker as the systemd unit spawn-worker.
# Network steps are retried with backoff, and apt waits for the dpkg lock that first-boot updaters hold.
#
# Any failure writes the record `failed` (reason and log tail) to QUEUE/machines/NAME.json (gcloud,
# else one JSON API upload with curl and the metadata server's token) and deletes the machine (python
# -m fleet.selfdelete, else one REST call the same way: no virtualenv, no gcloud needed), so a broken
# boot never idles on the bill and never vanishes without saying why. A snap gcloud still being seeded
# is waited for (bounded); a queue bucket that does not exist ends the boot before the install.
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
# (host[:port]) points it at another metadata server; FLEET_COMPUTE_ENDPOINT and FLEET_TPU_ENDPOINT
# at other Compute and TPU APIs (as for fleet/), STORAGE_EMULATOR_HOST at another storage JSON API;
# STARTUP_RETRY_DELAY_S shortens backoffs; STARTUP_SNAP_SEED_TIMEOUT_S bounds the snap wait (600).
set -Eeuo pipefail

ROOT="${STARTUP_ROOT:-}"
# Ubuntu images ship gcloud as a snap, whose directory a startup script's PATH may lack.
PATH="${PATH}:/snap/bin"
METADATA_HOST="${GCE_METADATA_HOST:-metadata.google.internal}"
COMPUTE_API="${FLEET_COMPUTE_ENDPOINT:-https://compute.googleapis.com}"
TPU_API="${FLEET_TPU_ENDPOINT:-https://tpu.googleapis.com}"
# The Cloud Storage JSON API for the records' REST fallback; STORAGE_EMULATOR_HOST is the variable the
# Python clients on the machine honour too.
STORAGE_API="${STORAGE_EMULATOR_HOST:-https://storage.googleapis.com}"
CODE_DIR="/opt/fleet/code"
VENV_DIR="/opt/fleet/venv"
UV_VENV="/opt/fleet/uv"          # holds a pip-installed uv when neither the bucket nor the image has one
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
# How long the boot waits for snapd to seed (and so mount a snap gcloud) before it goes on without.
SNAP_SEED_TIMEOUT_S="${STARTUP_SNAP_SEED_TIMEOUT_S:-600}"

PHASE="metadata"
MACHINE=""
QUEUE_URL=""
CODE_URL=""
ACCELERATOR=""
PERMISSIONS=""   # the permission check's verdict once it is unverified (fleet/selfdelete.py)
LAST_STATE=""
RECORD_WRITTEN=false   # whether the last record() reached the bucket (gcloud or REST)
UV=""
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

# tpu_env_value KEY: KEY's value in the `tpu-env` attribute (one `KEY: 'value'` per line), or nothing.
tpu_env_value() {
  local wanted="$1" tpu_env line key value
  tpu_env="$(attribute tpu-env "")"
  while IFS= read -r line; do
    key="${line%%:*}"
    value="${line#*:}"
    value="${value#"${value%%[![:space:]]*}"}"
    if [[ "$key" == "$wanted" ]]; then
      printf '%s' "${value//\'/}"
      return 0
    fi
  done <<<"$tpu_env"
}

# read_tpu_env: TPU_NODE and TPU_WORKER from a TPU VM's tpu-env attribute (both empty on a VM).
read_tpu_env() {
  TPU_NODE="$(tpu_env_value NODE_ID)"
  TPU_WORKER="$(tpu_env_value WORKER_ID)"
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
  LAST_STATE="$state"
  RECORD_WRITTEN=false
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
  if [[ -n "$PERMISSIONS" ]]; then body+=", \"permissions\": $(json_string "$PERMISSIONS")"; fi
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
  if [[ -n "$PERMISSIONS" ]]; then listed+=",permissions=$(meta_value "$PERMISSIONS")"; fi
  listed="${listed:0:1000}"
  local object="${QUEUE_URL%/}/machines/${MACHINE}.json"
  if command -v gcloud >/dev/null && printf '%s\n' "$body" | gcloud storage cp --content-type=application/json \
    "--custom-metadata=${listed}" - "$object"; then
    log "event=machine_record machine=${MACHINE} state=${state}"
    RECORD_WRITTEN=true
  elif rest_upload "$object" "$body" "$listed"; then
    # gcloud missing (a snap not seeded yet, an image without it) or failing: the same object and
    # metadata through the JSON API with the metadata server's token, as the REST delete does.
    log "event=machine_record machine=${MACHINE} state=${state} method=rest"
    RECORD_WRITTEN=true
  else
    log "event=machine_record_failed machine=${MACHINE} state=${state}"
    RECORD_WRITTEN=false
  fi
}

# url_encode TEXT: TEXT percent-encoded for a URL's query (unreserved characters and '/' kept).
url_encode() {
  local text="$1" out="" char i
  for ((i = 0; i < ${#text}; i++)); do
    char="${text:i:1}"
    if [[ "$char" =~ [A-Za-z0-9._~/-] ]]; then out+="$char"; else out+="$(printf '%%%02X' "'$char")"; fi
  done
  printf '%s' "$out"
}

# rest_upload gs://BUCKET/NAME BODY LISTED: one JSON API multipart upload (objects.insert with
# uploadType=multipart: the object's resource, its custom metadata included, and its bytes in one
# request; https://cloud.google.com/storage/docs/json_api/v1/objects/insert,
# https://cloud.google.com/storage/docs/uploading-objects) with the machine's token. LISTED is
# record's k=v,k=v metadata. No gcloud and no virtualenv needed: curl and the metadata server.
rest_upload() {
  local url="$1" body="$2" listed="$3" bucket name pair metadata="" boundary="spawn-record-boundary"
  bucket="${url#gs://}"
  name="${bucket#*/}"
  bucket="${bucket%%/*}"
  local IFS=,
  for pair in $listed; do
    metadata+="${metadata:+, }$(json_string "${pair%%=*}"): $(json_string "${pair#*=}")"
  done
  unset IFS
  local resource multipart
  resource="{\"name\": $(json_string "$name"), \"contentType\": \"application/json\", \"metadata\": {${metadata}}}"
  multipart="--${boundary}"$'\r\n'"Content-Type: application/json; charset=UTF-8"$'\r\n\r\n'"${resource}"$'\r\n'
  multipart+="--${boundary}"$'\r\n'"Content-Type: application/json"$'\r\n\r\n'"${body}"$'\n\r\n'"--${boundary}--"$'\r\n'
  api_call POST "${STORAGE_API}/upload/storage/v1/b/${bucket}/o?uploadType=multipart&name=$(url_encode "$name")" \
    "$multipart" "multipart/related; boundary=${boundary}" >/dev/null
}

# bucket_missing gs://BUCKET/...: true only when the JSON API says the bucket does not exist (a
# listing answers 404 for a missing bucket and never for an existing one; objects.list needs only
# storage.objects.list, which the machine has: https://cloud.google.com/storage/docs/json_api/v1/objects/list).
bucket_missing() {
  local bucket="${1#gs://}" token status
  bucket="${bucket%%/*}"
  token="$(access_token)" || return 1
  status="$(curl --silent --output /dev/null --write-out '%{http_code}' --retry 4 --retry-connrefused --max-time 60 \
    --header "Authorization: Bearer ${token}" "${STORAGE_API}/storage/v1/b/${bucket}/o?maxResults=1")" || return 1
  [[ "$status" == 404 ]]
}

# wait_for_gcloud: on Ubuntu 24.04 and the TPU and ML images gcloud is a snap that snapd seeds in the
# background at first boot, and the guest agent no longer orders startup scripts after that
# (GoogleCloudPlatform/guest-agent#84): wait, bounded, for `snap wait system seed.loaded`, as Google's
# own boot scripts do (GoogleCloudPlatform/opentelemetry-operations-collector#619). True when gcloud is
# then on PATH; without it the records go over REST and the code sync fails with a reason.
# GCLOUD_WAIT says what was waited for, and how long, for the reason a boot without gcloud records.
GCLOUD_WAIT="no snap to seed it"
wait_for_gcloud() {
  if command -v snap >/dev/null && ! command -v gcloud >/dev/null; then
    log "event=snap_seed_wait timeout_s=${SNAP_SEED_TIMEOUT_S}"
    local started="$SECONDS"
    if ! timeout "$SNAP_SEED_TIMEOUT_S" snap wait system seed.loaded; then
      log "event=snap_seed_wait_failed timeout_s=${SNAP_SEED_TIMEOUT_S}"
    fi
    GCLOUD_WAIT="after waiting $((SECONDS - started))s for snap seeding (bound ${SNAP_SEED_TIMEOUT_S}s)"
  fi
  if command -v gcloud >/dev/null; then
    log "event=gcloud path=$(command -v gcloud)"
    return 0
  fi
  log "event=gcloud_missing path=${PATH}"
  return 1
}

# access_token: the machine's service-account token from the metadata server
# (https://cloud.google.com/compute/docs/access/authenticate-workloads#applications). Never logged.
access_token() {
  local answer
  answer="$(metadata instance/service-accounts/default/token)" || return 1
  if [[ "$answer" =~ \"access_token\"[[:space:]]*:[[:space:]]*\"([^\"]+)\" ]]; then
    printf '%s' "${BASH_REMATCH[1]}"
  else
    log "event=token_unreadable path=instance/service-accounts/default/token"
    return 1
  fi
}

# api_call METHOD URL [BODY [CONTENT_TYPE]]: one Google API request with the machine's token, retried
# by curl on 408, 429, 5xx and timeouts (curl --retry); the answer's body on stdout when the status is
# 2xx. BODY is JSON unless CONTENT_TYPE says otherwise.
api_call() {
  local method="$1" url="$2" body="${3:-}" content_type="${4:-application/json}" token response status
  token="$(access_token)" || return 1
  local args=(--silent --show-error --retry 4 --retry-connrefused --max-time 60 --request "$method"
    --header "Authorization: Bearer ${token}" --write-out '\n%{http_code}')
  if [[ -n "$body" ]]; then args+=(--header "Content-Type: ${content_type}" --data-binary "$body"); fi
  response="$(curl "${args[@]}" "$url")" || {
    log "event=api_call_failed method=${method} url=${url} error=curl_exit_$?"
    return 1
  }
  status="${response##*$'\n'}"
  response="${response%$'\n'*}"
  if [[ "$status" != 2?? ]]; then
    log "event=api_call_failed method=${method} url=${url} status=${status} answer=${response:0:300}"
    return 1
  fi
  log "event=api_call method=${method} url=${url} status=${status}"
  printf '%s' "$response"
}

# resource_id NAME VALUE: VALUE if it has the shape of a resource id (what goes into a URL), else fail.
resource_id() {
  if [[ "$2" =~ ^[A-Za-z0-9][A-Za-z0-9._-]*$ ]]; then
    printf '%s' "$2"
  else
    log "event=bad_identity field=$1 value=$2"
    return 1
  fi
}

# rest_delete: the delete fleet/selfdelete.py would make, as one REST call (docs/CLOUD.md, "Self-deletion"):
# - TPU VM: projects.locations.queuedResources.delete with force=true for its queued resource
#   (spawn-queued-resource, else the node's queuedResource field), else projects.locations.nodes.delete
#   (https://cloud.google.com/tpu/docs/reference/rest/v2/projects.locations.queuedResources/delete,
#   https://cloud.google.com/tpu/docs/reference/rest/v2/projects.locations.nodes/delete);
# - group member: instanceGroupManagers.deleteInstances, zonal or regional, which lowers the target size
#   (https://cloud.google.com/compute/docs/reference/rest/v1/instanceGroupManagers/deleteInstances,
#   https://cloud.google.com/compute/docs/reference/rest/v1/regionInstanceGroupManagers/deleteInstances);
# - otherwise instances.delete (https://cloud.google.com/compute/docs/reference/rest/v1/instances/delete).
rest_delete() {
  local project zone name created_by queued node location node_json
  project="$(resource_id project "$(metadata project/project-id)")" || return 1
  zone="$(metadata instance/zone)" || return 1
  name="$(resource_id instance "$(metadata instance/name)")" || return 1
  node="$(tpu_env_value NODE_ID)"
  # A TPU VM's zone is the node's (tpu-env), as fleet/selfdelete.py reads it.
  if [[ -n "$node" && -n "$(tpu_env_value ZONE)" ]]; then
    zone="$(tpu_env_value ZONE)"
  fi
  zone="$(resource_id zone "${zone##*/}")" || return 1
  created_by="$(attribute created-by "")"
  queued="$(attribute spawn-queued-resource "")"
  if [[ -n "$node" ]]; then
    node="$(resource_id node "$node")" || return 1
    location="projects/${project}/locations/${zone}"
    if [[ -z "$queued" ]] && node_json="$(api_call GET "${TPU_API}/v2/${location}/nodes/${node}")" &&
      [[ "$node_json" =~ \"queuedResource\"[[:space:]]*:[[:space:]]*\"projects/[^/\"]+/locations/[^/\"]+/queuedResources/([^/\"]+)\" ]]; then
      queued="${BASH_REMATCH[1]}"
    fi
    if [[ -n "$queued" ]]; then
      queued="$(resource_id queued-resource "$queued")" || return 1
      api_call DELETE "${TPU_API}/v2/${location}/queuedResources/${queued}?force=true" >/dev/null
    else
      api_call DELETE "${TPU_API}/v2/${location}/nodes/${node}" >/dev/null
    fi
  elif [[ "$created_by" =~ ^projects/[^/]+/(zones|regions)/([^/]+)/instanceGroupManagers/([^/]+)$ ]]; then
    local scope="${BASH_REMATCH[1]}" where group
    where="$(resource_id group-location "${BASH_REMATCH[2]}")" || return 1
    group="$(resource_id group "${BASH_REMATCH[3]}")" || return 1
    api_call POST "${COMPUTE_API}/compute/v1/projects/${project}/${scope}/${where}/instanceGroupManagers/${group}/deleteInstances" \
      "{\"instances\": [\"zones/${zone}/instances/${name}\"]}" >/dev/null
  else
    api_call DELETE "${COMPUTE_API}/compute/v1/projects/${project}/zones/${zone}/instances/${name}" >/dev/null
  fi
}

# self_delete: python -m fleet.selfdelete when the virtualenv works, else rest_delete: curl and the
# metadata server are all it needs (no virtualenv, no gcloud, whose queued-resources command and API
# reach nothing here checks).
self_delete() {
  if [[ -x "${ROOT}${VENV_DIR}/bin/python" ]] &&
    (cd "${ROOT}${CODE_DIR}" && "${ROOT}${VENV_DIR}/bin/python" -m fleet.selfdelete delete); then
    return 0
  fi
  log "event=self_delete_fallback method=rest"
  rest_delete
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
    log "event=self_delete_failed machine=${MACHINE} hint=see docs/CLOUD.md IAM; run gcs-spawner down RUN, or keep RUN"
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

# ensure_uv CODE WHEELHOUSE: sets UV. The static uv binary that tools/upload_code.py put next to the
# code (uv/uv, arrived with the code sync: gcloud storage, the image's own tool), which is the uv the
# locks and the interpreter mirror were made for; else the image's uv; else (a code upload without
# uv/) pip-installed into a small virtualenv of the image's python3, which needs python3-venv (apt).
ensure_uv() {
  local code="$1" wheelhouse="$2"
  if [[ -f "${code}/uv/uv" ]]; then
    # Cloud Storage keeps no file modes.
    chmod 0755 "${code}/uv/uv"
    UV="${code}/uv/uv"
    log "event=uv source=bucket version=$(cat "${code}/uv/VERSION" 2>/dev/null || printf unknown)"
    return 0
  fi
  if command -v uv >/dev/null; then
    UV="$(command -v uv)"
    log "event=uv source=image path=${UV}"
    return 0
  fi
  UV="${ROOT}${UV_VENV}/bin/uv"
  if [[ -x "$UV" ]]; then
    return 0
  fi
  log "event=uv source=pip hint=run tools/upload_code.py, which puts a static uv next to the code"
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
  wait_for_gcloud || true
  record booting
  if [[ "$RECORD_WRITTEN" != true ]] && bucket_missing "$QUEUE_URL"; then
    # A typo in spawn-queue's bucket: no record can be written anywhere it would be read, so the
    # reason goes to the console and the journal, and the machine goes before it installs anything.
    PHASE="queue"
    local bucket="${QUEUE_URL#gs://}"
    fail "queue_bucket_missing: bucket gs://${bucket%%/*} of spawn-queue=${QUEUE_URL} does not exist (check the queue URL)"
  fi

  PHASE="code_sync"
  if ! command -v gcloud >/dev/null; then
    fail "gcloud_missing: no gcloud on PATH, ${GCLOUD_WAIT} (the image needs the Google Cloud CLI)"
  fi
  # Only this machine's wheelhouse: --exclude is a Python regular expression on the relative path
  # (https://cloud.google.com/sdk/gcloud/reference/storage/rsync); cuda12's alone is gigabytes.
  log "event=code_sync source=${CODE_URL} dest=${CODE_DIR} wheelhouse=${lock}"
  # Its errors go to a file as well, so that a refusal (403) becomes the recorded reason: the
  # permission, the object and the account, as Cloud Storage words them
  # (https://cloud.google.com/storage/docs/troubleshooting, "403: Forbidden").
  local sync_errors="${ROOT}${STATE_DIR}/code_sync.err" denied="" synced=0 line
  local refusal='[^ []+ does not have [a-z.]+ access to the Google Cloud Storage [a-z]+'
  retry 4 gcloud storage rsync --recursive --delete-unmatched-destination-objects \
    "--exclude=wheelhouse/(?!${lock}/)" "$CODE_URL" "${ROOT}${CODE_DIR}" 2>"$sync_errors" || synced=$?
  cat "$sync_errors" >&2
  if ((synced != 0)); then
    while IFS= read -r line; do
      if [[ "$line" =~ $refusal ]]; then
        denied="${BASH_REMATCH[0]}"
        break
      fi
    done <"$sync_errors"
    if [[ -n "$denied" ]]; then
      fail "code_sync_failed: permission denied: ${denied} ${CODE_URL} (grant the machines' service account roles/storage.objectUser on the bucket)"
    fi
    fail "code_sync_failed: gcloud storage rsync of ${CODE_URL} failed 4 times; its errors are in the log tail"
  fi

  PHASE="interpreter"
  local code="${ROOT}${CODE_DIR}" wheelhouse="${ROOT}${CODE_DIR}/wheelhouse/${lock}" uv
  local lockfile="${code}/locks/${lock}.txt" from=()
  if [[ -d "$wheelhouse" ]]; then from=(--no-index --find-links "$wheelhouse"); fi
  ensure_uv "$code" "$wheelhouse"
  uv="$UV"
  export UV_PYTHON_INSTALL_DIR="${ROOT}${PYTHON_DIR}"
  # Firewalled fleets: the interpreter archive mirrored into the bucket next to the code
  # (docs/CLOUD.md, "Firewalled fleets"; https://docs.astral.sh/uv/reference/environment/).
  if [[ -d "${code}/python-mirror" ]]; then export UV_PYTHON_INSTALL_MIRROR="file://${code}/python-mirror"; fi
  # A downloads list of its own, for builds uv does not list (tools/upload_code.py copies the one it
  # was given by UV_PYTHON_DOWNLOADS_JSON_URL).
  if [[ -f "${code}/python-mirror/downloads.json" ]]; then
    export UV_PYTHON_DOWNLOADS_JSON_URL="file://${code}/python-mirror/downloads.json"
  fi
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
  # Only a definite "not granted" stops here; a check that could not be read is recorded and the
  # worker goes on (its records carry `permissions: unverified` too).
  PHASE="permissions"
  local verdict
  if ! verdict="$(cd "$code" && FLEET_STATE_DIR="${ROOT}${STATE_DIR}" "${ROOT}${VENV_DIR}/bin/python" -m fleet.selfdelete check)"; then
    fail "${verdict:-permission_check_failed}"
  fi
  if [[ "$verdict" == unverified* ]]; then
    PERMISSIONS="unverified"
    log "event=permission_check outcome=unverified detail=${verdict}"
    record "$LAST_STATE"
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
