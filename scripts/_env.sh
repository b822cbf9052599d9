# Sourced by the launchers: the project's venv first on PATH, its Python as $PY.
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
if [ -z "${PY:-}" ]; then
  if [ -x "$ROOT/.venv/bin/python" ]; then PY="$ROOT/.venv/bin/python"; else PY=$(command -v python3); fi
fi
export PATH="$(dirname "$PY"):$PATH"
