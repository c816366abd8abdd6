#!/usr/bin/env bash
# The GPU machine's side of the benchmarks (../shared/GPU.md), one stage per call, from the repo root:
#
#   bash bench/gpu_run.sh piece torch.00     # torch 2.13 / NCCL pieces (torch.00-08, nccl.00-03: 60 MiB each, cut
#                                            # as ../shared/gpu/make-torch-chunks.sh does but with split -b 60M, so a
#                                            # piece and the working tree fit one call), one per call, back to back
#   bash bench/gpu_run.sh titan [configs]    # last call (carries .whl .whl_titan): install torch 2.13 + torchtitan,
#                                            # GPU-only tests of meshrl.optim, trainer_speed.py --backend torchtitan
#   bash bench/gpu_run.sh torch211           # the preinstalled torch 2.11 stack (+ .whl): the TransformersEngine tests on
#                                            # the GPU, then a GRPO step through the Controller (cuda_ipc)
#   bash bench/gpu_run.sh gpu-lane [args]    # the torch 2.11 stack (+ .whl): the GPU lane, every test marked gpu
#                                            # (tests/README.md; [args] go to pytest)
#   bash bench/gpu_run.sh onegpu [args]      # the torch 2.11 stack: bench/one_gpu_memory.py (token budgets, packing,
#                                            # memory hand-off vs fixed micro-batches)
#   bash bench/gpu_run.sh fp8kv [args]       # the torch 2.11 stack: the fp8 KV cache's GPU tests, decode_attention.py,
#                                            # then bench/one_gpu_memory.py [args]
#   bash bench/gpu_run.sh sync [args]        # the torch 2.11 stack: bench/weight_sync_ranks.py --gpu (torchstore,
#                                            # sharded and gathered, beside CUDA IPC; 0.6B shape)
#   bash bench/gpu_run.sh piece vllm.00      # ... vllm.27 (GPU.md step 4, re-cut with split -b 54M so a piece and
#                                            # the working tree fit one call), optionally cudnn.00-09 (torch 2.14's
#                                            # nvidia-cudnn-cu13==9.24.0.43 wheel, split -b 54M), then one of
#   bash bench/gpu_run.sh vllm               # TransformersEngine vs generate vs vLLM 0.33 and vLLM's CUDA-IPC weight load, one
#                                            # run ('vllm-ipc': the load check alone, eager engine)
#   bash bench/gpu_run.sh vllm-loop [args]   # (carries .whl) the VMM KV-cache GPU test, then
#                                            # bench/one_gpu_memory.py [args] with vLLM in the GRPO loop
#   bash bench/gpu_run.sh vision-vllm [args] # (.whl carried here or by an earlier call) vLLM on image prompts: the
#                                            # engine tests on tiny VLMs, then bench/vision_gpu.py [args]
#   bash bench/gpu_run.sh titan-vllm [configs] # (carries .whl_titan; after vllm-loop) torchtitan on torch 2.14:
#                                            # the fused Kahan AdamW kernel's GPU tests and bench/kahan_kernel.py, then
#                                            # trainer_speed.py --backend torchtitan (flex without max-autotune, which
#                                            # stalls on 2.14), the bare loop beside fp32-master, bf16 and Kahan configs
#
# Everything lands under $OUT (JSON from the scripts, logs).
set -uo pipefail
stage=${1:?stage: piece NAME | titan [configs] | torch211 | onegpu [args] | sync [args] | vllm}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
pipi() { python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$@"; }
vllm_stack() {  # vLLM 0.33 + torch 2.14 from the pieces in /tmp/chunks (and any still in .chunks), into /tmp/site
  if [ ! -d /tmp/site/vllm ]; then
    mkdir -p /tmp/chunks /tmp/vw && { ! ls .chunks/vllm.* >/dev/null 2>&1 || cp .chunks/vllm.* /tmp/chunks/; }
    cat /tmp/chunks/vllm.* > /tmp/vllm.tar && tar xf /tmp/vllm.tar -C /tmp/vw && rm /tmp/vllm.tar
    # torch 2.14's own cuDNN (9.24), where its pieces were sent (cudnn.00-09: split -b 54M of the
    # nvidia-cudnn-cu13==9.24.0.43 wheel): without it torch 2.14 runs on the machine's older cuDNN, whose SDPA
    # backward fails (bench/NOTES.md)
    ! ls /tmp/chunks/cudnn.* >/dev/null 2>&1 \
      || cat /tmp/chunks/cudnn.* > /tmp/vw/nvidia_cudnn_cu13-9.24.0.43-py3-none-manylinux_2_27_x86_64.whl
    pipi /tmp/site --upgrade /tmp/vw/*.whl || return 1
  fi
  export PYTHONPATH=/tmp/site/nvidia_cutlass_dsl/dsl_packages:/tmp/site:$PWD/src
  export LD_PRELOAD=/tmp/site/nvidia/nccl/lib/libnccl.so.2 VLLM_USE_FLASHINFER_SAMPLER=0
  [ ! -d /tmp/site/nvidia/cudnn/lib ] || export LD_LIBRARY_PATH=/tmp/site/nvidia/cudnn/lib:${LD_LIBRARY_PATH:-}
}

case "$stage" in
piece)
  mkdir -p /tmp/chunks && cp ".chunks/${2:?piece name}" /tmp/chunks/ && ls /tmp/chunks | tr '\n' ' '
  ;;
titan)
  timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_optim_kahan_kernel.py tests/test_optim_bf16.py \
    2>&1 | tail -15 | tee "$OUT/test_optim_kahan_gpu.log"
  (cd bench && timeout 90 python3 kahan_kernel.py 2>&1 | tail -15 | tee "$OUT/kahan_kernel.log")
  configs=${2:-plain-titan,titan+chunked+compile+bf16+sdpa+keep,actor:titan+chunked+compile+bf16+sdpa+keep,plain-titan-sdpa}
  if [ ! -d /tmp/site/torch ]; then
    mkdir -p /tmp/chunks && { [ ! -f .chunks/nccl.03 ] || cp .chunks/nccl.03 /tmp/chunks/; }
    cat /tmp/chunks/torch.* > /tmp/torch-2.13.0-cp312-cp312-manylinux_2_28_x86_64.whl
    cat /tmp/chunks/nccl.* > /tmp/nvidia_nccl_cu13-2.29.7-py3-none-manylinux_2_18_x86_64.whl
    # .whl_titan repeats a few of .whl's small wheels: install only its own.
    pipi /tmp/site /tmp/torch-2.13.0-*.whl /tmp/nvidia_nccl_cu13-*.whl .whl/*.whl \
      .whl_titan/torchtitan-*.whl .whl_titan/torch_checkpointing-*.whl .whl_titan/spmd_types-*.whl \
      .whl_titan/torchdata-*.whl || exit 1
  fi
  # transformers' models do not import under torch 2.13 there (torchvision is built for 2.11): make the random
  # model with the preinstalled torch.
  (cd bench && PYTHONPATH=$PWD/../src python3 -c "from common import make_model_dir; make_model_dir('/tmp/model06b', tiny=False)")
  export PYTHONPATH=/tmp/site:$PWD/src LD_PRELOAD=/tmp/site/nvidia/nccl/lib/libnccl.so.2
  python3 -c "import torch, torchtitan; print('torch', torch.__version__, torch.cuda.get_device_name())"
  # meshrl.optim's CUDA-graph step against the eager one (GPU-only tests, skipped on the CPU machines)
  timeout 120 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_optim.py 2>&1 | tail -15 \
    | tee "$OUT/test_optim_gpu.log"
  cd bench && timeout 540 python3 trainer_speed.py --backend torchtitan --profile --warmup 3 --steps 5 \
    --model-dir /tmp/model06b --configs "$configs" 2>&1 | grep -v -E "Warning|warnings.warn" | tee "$OUT/trainer_speed_titan.log"
  ;;
torch211)
  [ -d /tmp/site211/monarch ] || pipi /tmp/site211 .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site211:$PWD/src
  timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_transformers_engine.py 2>&1 | tail -15 | tee "$OUT/test_transformers_engine_gpu.log"
  cd bench && timeout 330 python3 grpo_step_gpu.py --steps 3 --transports cuda_ipc 2>&1 \
    | grep -v -E "Warning|warnings.warn" | tail -40 | tee "$OUT/grpo_step_gpu.log"
  ;;
gpu-lane)
  # The tests that need CUDA (tests/conftest.py marks them gpu). meshrl's folders are assembled into one package as
  # bench/common.py does; test modules that do not import on this stack (torchtitan, vLLM) are reported, not run.
  [ -d /tmp/site211/monarch ] || pipi /tmp/site211 .whl/*.whl || exit 1
  rm -rf /tmp/meshrl-tree && mkdir -p /tmp/meshrl-tree && cp -r src/meshrl /tmp/meshrl-tree/ || exit 1
  for d in actors controller configs; do cp -r "$d" /tmp/meshrl-tree/meshrl/ || exit 1; done
  export PYTHONPATH=/tmp/site211:/tmp/meshrl-tree
  timeout "${LANE_TIMEOUT:-540}" python3 -m pytest -q -p no:cacheprovider -m gpu --continue-on-collection-errors \
    -rs tests "${@:2}" 2>&1 | grep -v -E "Warning|warnings.warn" | tail -40 | tee "$OUT/test_gpu_lane.log"
  ;;
onegpu)
  # issue 17: token budgets, packing and the memory hand-off beside fixed micro-batches (bench/one_gpu_memory.py)
  [ -d /tmp/site211/monarch ] || pipi /tmp/site211 .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site211:$PWD/src
  cd bench && timeout "${ONEGPU_TIMEOUT:-560}" python3 one_gpu_memory.py "${@:2}" 2>&1 \
    | grep -v -E "Warning|warnings.warn" | tail -60 | tee "$OUT/one_gpu_memory.log"
  ;;
fp8kv)
  # the transformers engine's fp8 KV cache: its GPU tests (kernels, engine against the rounded reference, VMM sleep),
  # the decode attention bench with the fp8 rows, then bench/one_gpu_memory.py [args]
  [ -d /tmp/site211/monarch ] || pipi /tmp/site211 .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site211:$PWD/src
  timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_transformers_engine.py 2>&1 | tail -15 \
    | tee "$OUT/test_transformers_engine_fp8_gpu.log"
  (cd bench && timeout 150 python3 decode_attention.py 2>&1 | tail -25 | tee "$OUT/decode_attention_fp8.log")
  cd bench && timeout "${ONEGPU_TIMEOUT:-330}" python3 one_gpu_memory.py "${@:2}" 2>&1 \
    | grep -v -E "Warning|warnings.warn" | tail -60 | tee "$OUT/one_gpu_memory.log"
  ;;
sync)
  [ -d /tmp/site211/monarch ] || pipi /tmp/site211 .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site211:$PWD/src
  cd bench && timeout "${SYNC_TIMEOUT:-540}" python3 weight_sync_ranks.py --gpu "${@:2}" 2>&1 \
    | grep -v -E "Warning|warnings.warn|Loading weights" | tail -40 | tee "$OUT/weight_sync_ranks_gpu.log"
  ;;
vllm-loop)
  vllm_stack || exit 1
  # Monarch, torchstore, tyro after the vLLM stack on the path: its own versions of shared packages win
  [ -d /tmp/sitew/monarch ] || pipi /tmp/sitew .whl/*.whl || exit 1
  export PYTHONPATH=$PYTHONPATH:/tmp/sitew
  python3 -c "import torch, vllm, monarch; print('torch', torch.__version__, 'vllm', vllm.__version__, torch.cuda.get_device_name())"
  # the transformers engine's KV cache over CUDA virtual memory: a level-1 sleep keeps the decode graphs
  timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_transformers_engine.py -k "remap or vmm or triton_kernels" 2>&1 \
    | tail -15 | tee "$OUT/test_transformers_engine_vmm_gpu.log"
  cd bench && timeout "${LOOP_TIMEOUT:-400}" python3 one_gpu_memory.py "${@:2}" 2>&1 \
    | grep -v -E "Warning|warnings.warn" | tail -60 | tee "$OUT/one_gpu_memory_vllm.log"
  ;;
vision-vllm)
  # issue 34: the vision-language path on vLLM (its models import torchvision, which the CPU machines cannot load):
  # meshrl's VLLMEngine and raw vLLM against the hf trainer / transformers on tiny image checkpoints (float32), then
  # [args] to bench/vision_gpu.py (e.g. --engine vllm: the GRPO program on the real-sized tower). .whl installed into
  # /tmp/sitew by an earlier call on the same machine, or carried now.
  vllm_stack || exit 1
  [ -d /tmp/sitew/monarch ] || pipi /tmp/sitew .whl/*.whl || exit 1
  rm -rf /tmp/meshrl-tree && mkdir -p /tmp/meshrl-tree && cp -r src/meshrl /tmp/meshrl-tree/ || exit 1
  for d in actors controller configs; do cp -r "$d" /tmp/meshrl-tree/meshrl/ || exit 1; done
  export PYTHONPATH=/tmp/meshrl-tree:$PYTHONPATH:/tmp/sitew
  python3 -c "import torch, torchvision, vllm, transformers, monarch; print('torch', torch.__version__, 'torchvision', \
torchvision.__version__, 'vllm', vllm.__version__, 'transformers', transformers.__version__, 'cudnn', \
torch.backends.cudnn.version(), torch.cuda.get_device_name())"
  if [ -z "${VISION_SKIP_TESTS:-}" ]; then
    # one pytest process per module: vLLM's in-process engines leave process-wide state (its parallel groups) that a
    # raw vllm.LLM after a VLLMEngine's shutdown trips over
    # then the programs on vLLM (SFT, GRPO and eval of both families: test_vision_e2e's vllm cases)
    # (VISION_TEST_MODULES: other modules; VISION_E2E_K: which of test_vision_e2e's vllm cases, e.g. qwen3)
    for m in ${VISION_TEST_MODULES:-test_vllm_engine_vision test_vlm_models test_vision_e2e}; do
      only=(); limit=${VISION_TESTS_TIMEOUT:-150}
      [ $m = test_vision_e2e ] && only=(-v -k "vllm and ${VISION_E2E_K:-vl}") && limit=${VISION_E2E_TIMEOUT:-300}
      timeout "$limit" python3 -m pytest -q -p no:cacheprovider -p no:xdist -rs --durations=5 \
        "tests/$m.py" "${only[@]}" > "$OUT/${m}_gpu.log" 2>&1
      echo "== $m"; grep -E "^(FAILED|ERROR)|Error:|^E  |passed|failed" "$OUT/${m}_gpu.log" | cut -c1-300 | tail -20
    done
  fi
  [ $# -lt 2 ] || { cd bench && python3 vision_gpu.py "${@:2}" 2>&1 | grep -v -E "Warning|warnings.warn" | tail -30; }
  ;;
titan-vllm)
  vllm_stack || exit 1
  [ -d /tmp/sitet/torchtitan ] || pipi /tmp/sitet .whl_titan/*.whl || exit 1
  # torchtitan imports tyro: from .whl, installed by a vllm-loop call before this one on the same machine
  [ -d /tmp/sitew/monarch ] || { [ -d .whl ] && pipi /tmp/sitew .whl/*.whl; } || exit 1
  export PYTHONPATH=$PYTHONPATH:/tmp/sitet:/tmp/sitew
  timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_optim_kahan_kernel.py tests/test_optim_bf16.py \
    2>&1 | tail -15 | tee "$OUT/test_optim_kahan_gpu.log"
  (cd bench && timeout 90 python3 kahan_kernel.py 2>&1 | tail -15 | tee "$OUT/kahan_kernel.log")
  # flex attention: the 2.14 stack's cuDNN fails the SDPA backward (CUDNN_STATUS_BAD_PARAM), bench/NOTES.md
  configs=${2:-plain-titan,titan+chunked+compile,titan+chunked+compile+bf16,titan+chunked+compile+bf16+kahan}
  (cd bench && python3 -c "from common import make_model_dir; make_model_dir('/tmp/model06b', tiny=False)")
  cd bench && timeout "${TITAN_TIMEOUT:-540}" python3 trainer_speed.py --backend torchtitan --flex-no-autotune --warmup 3 \
    --steps 5 --model-dir /tmp/model06b --configs "$configs" 2>&1 | grep -v -E "Warning|warnings.warn" \
    | tail -40 | tee "$OUT/trainer_speed_titan.log"
  ;;
vllm|vllm-ipc)
  vllm_stack || exit 1
  extra=()
  # vllm-ipc: only vLLM's weight-load check, eager engine (starts in seconds, not minutes)
  [ "$stage" = vllm-ipc ] && extra=(--variants "" --skip-generate --batches 8 --new 32 --vllm-eager)
  cd bench && timeout 560 python3 generation.py --vllm --ipc-check "${extra[@]}" 2>&1 | grep -v -E "Warning|warnings.warn" \
    | tail -60 | tee "$OUT/generation_vllm.log"
  ;;
*)
  echo "unknown stage $stage" >&2; exit 2
  ;;
esac
