#!/usr/bin/env bash
# Check what an Ascend run of hyper_parallel_ms needs: the NPU driver (npu-smi), the CANN toolkit,
# visible devices, and a MindSpore that runs on the Ascend device target. Exits 1 if anything is missing.
set -u
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${HPMS_VENV:-$ROOT/.venv}/bin/python"
[ -x "$PY" ] || PY=python3
fail=0
say() { printf '%-28s %s\n' "$1" "$2"; }

if command -v npu-smi >/dev/null 2>&1; then
  say "npu-smi" "$(npu-smi info 2>/dev/null | head -n 1)"
  say "NPUs listed" "$(npu-smi info -l 2>/dev/null | grep -c 'NPU ID' || true)"
else
  say "npu-smi" "MISSING: install the Ascend NPU driver"; fail=1
fi
CANN="${ASCEND_HOME_PATH:-${ASCEND_TOOLKIT_HOME:-/usr/local/Ascend/ascend-toolkit/latest}}"
if [ -d "$CANN" ]; then
  say "CANN toolkit" "$CANN $(cat "$CANN"/*/ascend_toolkit_install.info 2>/dev/null | grep -m1 version || true)"
else
  say "CANN toolkit" "MISSING: not found at $CANN (source <toolkit>/set_env.sh to set ASCEND_HOME_PATH)"; fail=1
fi
say "ASCEND_RT_VISIBLE_DEVICES" "${ASCEND_RT_VISIBLE_DEVICES:-(unset: all devices visible)}"
if "$PY" - <<'PY'
import mindspore as ms
print(f"{'mindspore':<28} {ms.__version__}")
ms.set_device("Ascend")
ms.run_check()
PY
then say "MindSpore on Ascend" "ok"; else say "MindSpore on Ascend" "FAILED (see above)"; fail=1; fi
exit "$fail"
