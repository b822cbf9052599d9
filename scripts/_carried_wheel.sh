# Sourced by setup_horovod.sh and setup_byteps.sh, whose wheels for the GPU machine are built here
# (scripts/fill_gpu_carry.sh) and carried there.
#
# take_carried_wheel ENGINE PACKAGE: where no wheel was found yet ($wheel empty), the carry folder holds one
# under $KEY and ENGINE_NO_CARRIED_WHEEL is not 1, set wheel to it and CARRIED=1; status 1 otherwise.
take_carried_wheel() {
  local package=$2 opt_out=${1}_NO_CARRIED_WHEEL
  [ -z "$wheel" ] && [ "${!opt_out:-0}" = 0 ] && ls "$CARRY/$KEY/$package"-*.whl >/dev/null 2>&1 || return 1
  wheel=$(ls "$CARRY/$KEY/$package"-*.whl | head -n1)
  CARRIED=1
}

# import_or_rebuild ENGINE CODE: after $wheel was installed into $PY, run CODE with it. Where that fails and
# the wheel was a carried one (CARRIED=1: built elsewhere, and not loadable here), run the calling script
# again with ENGINE_NO_CARRIED_WHEEL=1 (ENGINE: HOROVOD or BYTEPS), which builds from the sdist; otherwise
# exit 1.
import_or_rebuild() {
  local engine=$1 code=$2
  "$PY" -c "$code" && return 0
  if [ "$CARRIED" = 1 ]; then
    echo "setup_${engine,,}: the carried wheel $wheel does not import; building from the sdist" >&2
    exec env "${engine}_NO_CARRIED_WHEEL=1" bash "$0" "$PY"
  fi
  echo "setup_${engine,,}: the installed ${engine,,} does not import" >&2
  exit 1
}
