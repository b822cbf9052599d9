# Sourced by the launchers: the project's venv first on PATH, its Python as $PY.
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
if [ -z "${PY:-}" ]; then
  if [ -x "$ROOT/.venv/bin/python" ]; then PY="$ROOT/.venv/bin/python"; else PY=$(command -v python3); fi
fi
export PATH="$(dirname "$PY"):$PATH"

# check_np_and_script NAME NP_MEANING "$@": exit 2 with a usage line unless "$1" is a positive integer and
# a SCRIPT (or -m MODULE) follows. A bad NP is refused here: horovodrun -np 0 exits 0 having run nothing,
# torchrun and mpirun answer with a traceback or a page of text.
check_np_and_script() {
  local name=$1 meaning=$2
  shift 2
  local usage="usage: $name NP SCRIPT_OR_-m_MODULE [ARGS...]  (NP: $meaning, a positive integer)"
  if [ $# -lt 1 ]; then
    echo "$usage" >&2; exit 2
  elif ! [[ $1 =~ ^[1-9][0-9]*$ ]]; then
    echo "$name: error: NP must be a positive integer, got '$1'" >&2; echo "$usage" >&2; exit 2
  elif [ $# -lt 2 ]; then
    echo "$name: error: no SCRIPT (or -m MODULE) to run" >&2; echo "$usage" >&2; exit 2
  fi
}
