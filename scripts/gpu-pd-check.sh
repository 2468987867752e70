#!/usr/bin/env bash
# Real-engine check of PD-disaggregated publication, for a machine with >= 2 CUDA GPUs (not part
# of `make test`: SGLang's prefill server refuses the `fake` transfer backend and its decode
# server needs CUDA, so PD cannot run on a CPU-only machine).
#
# Starts an SGLang prefill server (GPU 0) and decode server (GPU 1) with the nixl or mooncake
# transfer backend, plus the SGLang router in PD mode with retries off, then runs
# scripts/gpu_pd_check.py: publication and reclaim of LoRA versions through the product on that
# PD group. Prints one PASS/FAIL line per check; exit status 0 only if every check passed.
#
# Environment:
#   SGLANG_PYTHON   python with sglang (CUDA build), sglang-router and the transfer backend
#                   installed (default: python3)
#   PD_BACKEND      nixl (default) or mooncake
#   PD_MODEL        model path (default: the tiny test fixture, built on first use)
#   PD_ADAPTER_A, PD_ADAPTER_B   two PEFT adapter directories for PD_MODEL (default: fixture A, B)
#   PD_PORT_BASE    first of the ports used (default 31000: prefill, +1 decode, +2 router,
#                   +3 bootstrap)
#   PD_TIMEOUT      seconds to wait for each server to become healthy (default 600)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
sglang_python=${SGLANG_PYTHON:-python3}
backend=${PD_BACKEND:-nixl}
base=${PD_PORT_BASE:-31000}
timeout=${PD_TIMEOUT:-600}
prefill_port=$base decode_port=$((base + 1)) router_port=$((base + 2)) bootstrap_port=$((base + 3))
logs=$(mktemp -d)
pids=()

fail() { echo "FAIL $*"; exit 1; }

cleanup() {
  # Only the processes this script started, by their process id.
  for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
  for pid in "${pids[@]}"; do wait "$pid" 2>/dev/null || true; done
  echo "logs: $logs"
}
trap cleanup EXIT

case $backend in nixl|mooncake) ;; *) fail "PD_BACKEND must be nixl or mooncake, got $backend" ;; esac
gpus=$(nvidia-smi --query-gpu=index --format=csv,noheader 2>/dev/null | wc -l || echo 0)
[[ $gpus -ge 2 ]] || fail "needs >= 2 CUDA GPUs, found $gpus"
"$sglang_python" -c "import sglang, sglang_router" 2>/dev/null \
  || fail "$sglang_python cannot import sglang and sglang_router (set SGLANG_PYTHON)"
echo "PASS environment: $gpus GPUs, transfer backend $backend"

py=$root/.venv/bin/python
[[ -x $py ]] || py=python3
if [[ -z ${PD_MODEL:-} ]]; then
  fixture=$("$py" -m agentic_lora_harness.fixture)
  model=$(jq -r .model_dir <<<"$fixture")
  served=$(jq -r .served_model_name <<<"$fixture")
  adapter_a=${PD_ADAPTER_A:-$(jq -r .adapters.A <<<"$fixture")}
  adapter_b=${PD_ADAPTER_B:-$(jq -r .adapters.B <<<"$fixture")}
else
  model=$PD_MODEL served=$(basename "$PD_MODEL")
  adapter_a=${PD_ADAPTER_A:?set PD_ADAPTER_A with PD_MODEL}
  adapter_b=${PD_ADAPTER_B:?set PD_ADAPTER_B with PD_MODEL}
fi

# Both role servers need capacity + 1 LoRA slots (capacity 2 below), LoRA pinned loading on.
lora=(--enable-lora --max-loras-per-batch 3 --max-loaded-loras 3 --max-lora-rank 64
      --lora-target-modules all)
common=(--model-path "$model" --served-model-name "$served" --host 127.0.0.1
        --disaggregation-transfer-backend "$backend"
        --disaggregation-bootstrap-port "$bootstrap_port" --enable-cache-report "${lora[@]}")

CUDA_VISIBLE_DEVICES=0 "$sglang_python" -m sglang.launch_server "${common[@]}" \
  --port "$prefill_port" --disaggregation-mode prefill >"$logs/prefill.log" 2>&1 &
pids+=($!)
CUDA_VISIBLE_DEVICES=1 "$sglang_python" -m sglang.launch_server "${common[@]}" \
  --port "$decode_port" --disaggregation-mode decode >"$logs/decode.log" 2>&1 &
pids+=($!)

wait_healthy() {  # name url
  local deadline=$((SECONDS + timeout))
  until curl -fsS -o /dev/null "$2/health"; do
    [[ $SECONDS -lt $deadline ]] || { tail -n 40 "$logs/$1.log"; fail "$1 not healthy at $2"; }
    sleep 2
  done
  echo "PASS $1 healthy at $2"
}
wait_healthy prefill "http://127.0.0.1:$prefill_port"
wait_healthy decode "http://127.0.0.1:$decode_port"

# The PD router: one attempt per request (a retried generation could run twice).
"$sglang_python" -m sglang_router.launch_router --pd-disaggregation \
  --prefill "http://127.0.0.1:$prefill_port" "$bootstrap_port" \
  --decode "http://127.0.0.1:$decode_port" \
  --host 127.0.0.1 --port "$router_port" --disable-retries >"$logs/router.log" 2>&1 &
pids+=($!)
wait_healthy router "http://127.0.0.1:$router_port"

"$py" scripts/gpu_pd_check.py \
  --prefill "http://127.0.0.1:$prefill_port" \
  --decode "http://127.0.0.1:$decode_port" \
  --router "http://127.0.0.1:$router_port" \
  --served-model-name "$served" \
  --adapter-a "$adapter_a" --adapter-b "$adapter_b" \
  --store-root "$logs/adapters"
